//! rdmakit: safe RDMA abstractions over rdma-core and a software NIC.
//!
//! This facade re-exports the member crates:
//! - [`verbs`] (`rdmakit-verbs`): devices, protection domains, memory regions, completion
//!   queues, RC queue pairs, work requests, device memory, over two providers (rdma-core
//!   and the soft NIC). Its items are also re-exported at the top level.
//! - [`memory`] (`rdmakit-memory`): MEMIC regions in NIC memory, the cross-GVMI UMR mkey
//!   pool and alias cache, and the allocator core of asymmetric remote heaps
//!   ([`memory::heap`]), without transport.
//! - [`channel`] (`rdmakit-channel`): async pipes, persistent put handles and the remote
//!   heaps' transport ([`channel::heap`]), over one control channel with peer liveness.
//!
//! The designs rdmakit implements (MEMIC, the UMR mkey pool and its alias map, rmalloc,
//! rpipe, CkDirect) each have a page in [`seeds`] mapping the source's terms onto the API.
//!
//! ```
//! let ctx = rdmakit::Context::open_soft();
//! assert_eq!(ctx.provider(), rdmakit::ProviderKind::Soft);
//! ```

pub use rdmakit_channel as channel;
pub use rdmakit_memory as memory;
pub use rdmakit_verbs as verbs;
pub use rdmakit_verbs::*;

#[doc = include_str!("seeds/index.md")]
pub mod seeds {
    #[doc = include_str!("seeds/memic.md")]
    pub mod memic {}
    #[doc = include_str!("seeds/umr_pool.md")]
    pub mod umr_pool {}
    #[doc = include_str!("seeds/alias_map.md")]
    pub mod alias_map {}
    #[doc = include_str!("seeds/rmalloc.md")]
    pub mod rmalloc {}
    #[doc = include_str!("seeds/rpipe.md")]
    pub mod rpipe {}
    #[doc = include_str!("seeds/ckdirect.md")]
    pub mod ckdirect {}
}

/// What this build of rdmakit was compiled with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BuildInfo {
    /// The `verbs` provider (rdma-core) is compiled in (see [`VERBS_MISSING`] when not).
    pub verbs: bool,
    /// rdma-core's libibverbs version found at build time, if any.
    pub rdma_core_version: Option<&'static str>,
    /// libmlx5 (mlx5 direct verbs) was present at build time.
    pub mlx5dv: bool,
}

/// How this build was configured (see the top-level `build.rs`).
pub const BUILD: BuildInfo = BuildInfo {
    verbs: rdmakit_verbs::VERBS_BUILT,
    rdma_core_version: option_env!("RDMAKIT_RDMA_CORE_VERSION"),
    mlx5dv: cfg!(rdmakit_mlx5dv),
};
