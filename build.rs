//! Build script of the `rdmakit` facade.
//!
//! It does not compile anything. It records which rdma-core this machine has, through
//! pkg-config, so a binary can say what it was built against:
//! - `RDMAKIT_RDMA_CORE_VERSION` (env, read with `option_env!`): libibverbs' version, if found;
//! - cfg `rdmakit_mlx5dv`: libmlx5 (mlx5 direct verbs) is present.
//!
//! Whether the rdma-core provider is compiled in is decided by `crates/rdmakit-sys/build.rs`
//! (which also prints the packages to install when it is missing), not here.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(rdmakit_mlx5dv)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=PKG_CONFIG_PATH");
    let probe = |lib: &str| pkg_config::Config::new().cargo_metadata(false).env_metadata(false).probe(lib);
    if let Ok(lib) = probe("libibverbs") {
        println!("cargo::rustc-env=RDMAKIT_RDMA_CORE_VERSION={}", lib.version);
    }
    if probe("libmlx5").is_ok() {
        println!("cargo::rustc-cfg=rdmakit_mlx5dv");
    }
}
