//! rdmakit-memory: NIC memory management on top of `rdmakit-verbs`.
//!
//! Three memory ideas from the seeds, none of which another Rust crate has:
//! - [`memic`]: regions of NIC on-chip memory at a unique address through an indirect key,
//!   with host fallback and sub-allocated atomic counters (UCX's MEMIC);
//! - [`xgvmi`]: cross-GVMI keys for DPU offload through a LIFO pool of UMR mkeys on the
//!   host and an alias cache on the DPU (UCX's UMR mkey pool), and a registration cache;
//! - [`heap`]: asymmetric remote heaps (rmalloc/rfree) per endpoint pair, with next-fit,
//!   first-fit, best-fit and worst-fit allocation and the paper's deferred and immediate
//!   synchronisation.

// No unsafe code but where it is the point, each exemption with its reason: the MEMIC
// address reservation (mmap/munmap), the registration cache's `register` (memory the
// application owns), and that cache's tests.
#![deny(unsafe_code)]

pub mod heap;
pub mod memic;
pub mod xgvmi;
