//! Build script of the `rdmakit` facade.
//!
//! It does not compile anything. It detects, through pkg-config, which rdma-core libraries
//! this machine has, and records it so a binary can say what it was built against:
//! - `RDMAKIT_RDMA_CORE_VERSION` (env, read with `option_env!`): libibverbs' version, if found;
//! - cfg `rdmakit_mlx5dv`: libmlx5 (mlx5 direct verbs) is present.
//!
//! With the `verbs` feature on and libibverbs missing it prints a warning naming the Debian
//! packages to install; the `rdmakit-sys` build that follows then fails with the same advice.
//! (The FFI itself, bindgen over mlx5dv.h and the link lines, lives in crates/rdmakit-sys/build.rs.)

fn main() {
    println!("cargo::rustc-check-cfg=cfg(rdmakit_mlx5dv)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=PKG_CONFIG_PATH");
    let verbs = std::env::var_os("CARGO_FEATURE_VERBS").is_some();
    let probe = |lib: &str| pkg_config::Config::new().cargo_metadata(false).env_metadata(false).probe(lib);
    match probe("libibverbs") {
        Ok(lib) => println!("cargo::rustc-env=RDMAKIT_RDMA_CORE_VERSION={}", lib.version),
        Err(e) if verbs => println!(
            "cargo::warning=libibverbs not found ({e}); install: apt-get install libibverbs-dev \
             librdmacm-dev ibverbs-providers pkg-config clang libclang-dev, or build with \
             --no-default-features for the soft NIC only"
        ),
        Err(_) => {}
    }
    if probe("libmlx5").is_ok() {
        println!("cargo::rustc-cfg=rdmakit_mlx5dv");
    }
}
