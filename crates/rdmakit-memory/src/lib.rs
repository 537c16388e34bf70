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
//!
//! Each module's page has a runnable example; the `rdmakit` facade's `seeds` pages map them
//! onto the seeds' own terms.
//!
//! # Example: a counter in NIC memory and a remote heap's first block
//!
//! ```
//! use rdmakit_memory::heap::{AllocPolicy, HeapAllocator, HeapConfig, HeapId};
//! use rdmakit_verbs::RemoteRegion;
//! use rdmakit_memory::memic::{CounterPool, Memic, Placement};
//!
//! let pd = rdmakit_verbs::Context::open_soft().alloc_pd()?;
//! let counters = CounterPool::new(&Memic::open(&pd), 4, Placement::NicPreferred)?;
//! let hits = counters.alloc()?.expect("four free counters");
//! assert_eq!(hits.get()?, 0);
//!
//! // The allocating side of a heap whose memory a peer registered (address, length, rkey).
//! let mut heap = HeapAllocator::new(HeapConfig::new(HeapId(1), AllocPolicy::BestFit));
//! heap.add_segment(RemoteRegion::new(0x7000_0000, 1 << 16, 0xbeef))?;
//! assert_eq!(heap.stats().free, 1 << 16);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

// No unsafe code but where it is the point, each exemption with its reason: the MEMIC
// address reservation (mmap/munmap), the registration cache's `register` (memory the
// application owns), that cache's tests, and the UMR pool's read of the monotonic clock.
#![deny(unsafe_code)]

pub mod heap;
pub mod memic;
pub mod xgvmi;
