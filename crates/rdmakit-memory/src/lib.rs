//! rdmakit-memory: NIC memory management on top of `rdmakit-verbs`.
//!
//! **Status: partly built.** The allocator core of asymmetric remote heaps
//! (rmalloc/rfree) is here, in [`heap`]: the allocating side's [`heap::HeapAllocator`]
//! (next-fit, first-fit, best-fit, worst-fit), the owner's [`heap::HeapOwner`], and the
//! deferred and immediate synchronisation messages between them with their wire encoding.
//! It is transport-independent; carrying those messages over RDMA comes with the channel
//! layer. Not built yet: MEMIC regions (NIC on-chip memory mapped through an indirect key)
//! and the cross-GVMI UMR mkey pool with its alias map.

pub mod heap;
pub mod xgvmi;
