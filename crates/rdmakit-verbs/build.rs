//! Build script of `rdmakit-verbs`: decides whether the rdma-core provider is compiled in.
//!
//! It is, as `cfg(rdmakit_verbs)`, when the `verbs` feature is on (the default) *and*
//! `rdmakit-sys` found rdma-core's development files and libclang. When the feature is on but
//! rdma-core is missing, `rdmakit-sys` has already printed a warning naming the packages; the
//! reason is kept in `RDMAKIT_VERBS_MISSING` so that asking for the verbs provider at run time
//! fails with it (`Error::ProviderUnavailable`).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(rdmakit_verbs)");
    println!("cargo::rerun-if-changed=build.rs");
    let feature = std::env::var_os("CARGO_FEATURE_VERBS").is_some();
    // Set by rdmakit-sys's build script (`links = "rdmakit_rdma_core"`).
    let bound = std::env::var("DEP_RDMAKIT_RDMA_CORE_VERBS").as_deref() == Ok("1");
    let missing = if !feature {
        "rdmakit-verbs was built without its `verbs` feature".to_string()
    } else if !bound {
        std::env::var("DEP_RDMAKIT_RDMA_CORE_MISSING")
            .unwrap_or_else(|_| "rdmakit-sys built without rdma-core".to_string())
    } else {
        String::new()
    };
    if feature && bound {
        println!("cargo::rustc-cfg=rdmakit_verbs");
    }
    println!("cargo::rustc-env=RDMAKIT_VERBS_MISSING={missing}");
}
