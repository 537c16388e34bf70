//! Asymmetric remote heaps: the allocator core of `rmalloc`/`rfree`, without transport.
//!
//! A remote heap lives between two endpoints. The **owner** registers heap segments (its
//! NIC-addressable memory, each with an rkey) and consumes what lands there; the
//! **allocating side** runs the allocator over the owner's address space and gets remote
//! addresses to RDMA-write into. Per endpoint pair there may be zero or more heaps, each
//! named by a [`HeapId`] that every message carries.
//!
//! This module is the pure, transport-independent core: [`HeapAllocator`] on the allocating
//! side, [`HeapOwner`] on the owner's side, and the messages between them ([`AllocNotice`],
//! [`AllocAck`], [`FreeBatch`]) as plain data with a compact little-endian encoding whose
//! decoder rejects malformed input with a [`WireError`] and never panics. Carrying the
//! messages over RDMA is the transport's job: `rdmakit_channel::heap` (the `HeapEndpoint`).
//!
//! # Protocol
//!
//! A block's life, as the owner sees it: **handed out** (the allocator chose it and the owner
//! has learned of it), **in use** (the owner's consumer took it, [`HeapOwner::consume`]),
//! **freed** (the consumer called [`HeapOwner::rfree`]; the block waits in the owner's free
//! list, still held), and finally **returned** when a [`FreeBatch`] carrying it is taken
//! ([`HeapOwner::take_free_batch`], which sorts the freed blocks and coalesces adjacent ones
//! into ranges) and applied by the allocator ([`HeapAllocator::apply_free_batch`]). Only
//! then can the allocator hand the range out again. Synchronisation follows the rmalloc
//! paper, chosen per heap by [`SyncMode`]:
//!
//! - **Deferred** (default for next-fit and first-fit): [`HeapAllocator::alloc`] returns a
//!   block that is usable at once; its [`AllocNotice`] travels with the data, and the owner
//!   records it with [`HeapOwner::register`]. Frees flow back in coalesced batches whenever
//!   the transport chooses (a size threshold, or when the allocator runs short).
//! - **Immediate** (default for best-fit and worst-fit): each allocation is synchronised
//!   at once. The block stays *pending* until the owner answers its [`AllocNotice`] with
//!   [`HeapOwner::acknowledge`]; the [`AllocAck`] also carries every range the owner freed
//!   since the last synchronisation, so the allocator's size index is current at each
//!   allocation. [`HeapAllocator::confirm`] applies it and releases the block for use.
//!
//! Invariants, enforced in code and checked by the tests:
//!
//! - The allocator never hands out a range the owner still holds (handed out, in use, or
//!   freed but not yet returned): ranges enter the allocator's free space only from a new
//!   segment or from a batch the owner produced after the consumer freed them, and the owner
//!   refuses a notice overlapping anything it holds ([`HeapError::Conflict`]).
//! - Batches are numbered; one applied out of order or twice is refused
//!   ([`HeapError::OutOfOrder`]), and a range already free on the allocating side is a
//!   [`HeapError::DoubleFree`]. Every error leaves the state unchanged.
//! - Blocks are aligned to the heap's alignment and lie within one segment; free ranges of
//!   different segments never coalesce, even when the segments are adjacent.
//!
//! # Costs
//!
//! With n free ranges on the allocating side and m blocks held by the owner: next-fit
//! walks from the cursor's range to the first that fits (usually the cursor's own, which
//! it carves in place; O(n) at worst). First-fit asks the address index (the size index's
//! classes, each in address order, with each class's and each group of 32 classes' lowest
//! address, and masks of the non-empty ones): the non-empty classes of one group and the
//! non-empty groups compared (at most a few dozen words), then a scan of the requested
//! size's own class up to what the classes above offer. That scan passes the class's shorter ranges below the
//! answer, so it is O(n) at worst too (the owner's frees decide what the ranges are: a peer
//! can leave many ranges of one class just short of a size below a range that holds it).
//! Best-fit and worst-fit find their range through the size index (a two-level segregated
//! fit: bins by size class, exact below 16 bytes and 16 per power of two above, with a
//! bitmap of the non-empty ones; a lookup is a few bit operations and a search in one bin,
//! O(log n) at worst) and carve it without searching the address map. Applying a free batch
//! costs O(log n) per range, `register`, `rfree` and batching O(log m) per block. With p
//! blocks pending (immediate mode), an acknowledgement in allocation order is found at
//! once (out of order, in O(p)), and a batch of b ranges is checked against them in
//! O(p log b).
//! `benches/heap_alloc.rs` measures them under a realistic size mix.
//!
//! # Example
//!
//! ```
//! use rdmakit_memory::heap::*;
//! use rdmakit_verbs::RemoteRegion;
//!
//! let seg = RemoteRegion::new(0x10_0000, 1 << 20, 0x1234);
//! let config = HeapConfig::new(HeapId(7), AllocPolicy::NextFit);
//! let mut alloc = HeapAllocator::new(config);
//! let mut owner = HeapOwner::new(HeapId(7));
//! alloc.add_segment(seg)?;
//! owner.add_segment(seg)?;
//!
//! // Allocating side: pick a remote address, RDMA-write there, tell the owner.
//! let block = alloc.alloc(100)?; // rounded up to the alignment (8)
//! assert_eq!((block.addr, block.len, block.rkey), (0x10_0000, 104, 0x1234));
//! owner.register(&AllocNotice::new(HeapId(7), block))?;
//!
//! // Owner: consume, free; the free reaches the allocator in a batch.
//! owner.consume(block.addr)?;
//! owner.rfree(block.addr)?;
//! let batch = owner.take_free_batch(usize::MAX);
//! let bytes = batch.encode(); // what the transport carries
//! alloc.apply_free_batch(&FreeBatch::decode(&bytes)?)?;
//! assert_eq!(alloc.stats().free, 1 << 20);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]

mod addr_index;
mod allocator;
mod free_space;
mod owner;
mod segments;
mod wire;

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;

pub use allocator::{HeapAllocator, SegmentProvider};
pub use owner::{HeapOwner, OwnerBlockState, OwnerStats};
pub use wire::{AllocAck, AllocNotice, FreeBatch, FreeRange, HeapMessage, WireError};

use rdmakit_verbs::RemoteRegion;

/// Names one heap among those of an endpoint pair; every message carries it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HeapId(pub u32);

/// How the allocator chooses among free ranges that fit. The block is always taken from the
/// start (lowest address) of the chosen free range.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AllocPolicy {
    /// The first free range that fits, searching in address order from the roving cursor
    /// (the end of the previous allocation: the free range containing it, or the next one)
    /// and wrapping around to the lowest address. The paper's default and fastest policy.
    #[default]
    NextFit,
    /// The free range that fits with the lowest address, through the address index
    /// (see the module's costs).
    FirstFit,
    /// The smallest free range that fits; ties go to the lowest address. O(log n) through
    /// the size index.
    BestFit,
    /// The largest free range, if it fits; ties go to the lowest address. O(log n) through
    /// the size index.
    WorstFit,
}

impl AllocPolicy {
    /// Every policy, in declaration order.
    pub const ALL: [AllocPolicy; 4] =
        [AllocPolicy::NextFit, AllocPolicy::FirstFit, AllocPolicy::BestFit, AllocPolicy::WorstFit];

    /// The synchronisation the paper pairs with this policy: deferred for next-fit (and
    /// first-fit), immediate for best-fit and worst-fit.
    pub const fn default_sync(self) -> SyncMode {
        match self {
            AllocPolicy::NextFit | AllocPolicy::FirstFit => SyncMode::Deferred,
            AllocPolicy::BestFit | AllocPolicy::WorstFit => SyncMode::Immediate,
        }
    }

    /// The index the allocator keeps for this policy: by size for best-fit and worst-fit,
    /// by size class and address for first-fit, none for next-fit, which walks addresses
    /// from its cursor.
    pub(crate) const fn index_kind(self) -> free_space::IndexKind {
        match self {
            AllocPolicy::NextFit => free_space::IndexKind::None,
            AllocPolicy::FirstFit => free_space::IndexKind::Address,
            AllocPolicy::BestFit | AllocPolicy::WorstFit => free_space::IndexKind::Size,
        }
    }
}

/// When allocations are synchronised with the owner (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SyncMode {
    /// A block is usable as soon as it is allocated; the owner learns of it with the data
    /// ([`HeapOwner::register`]) and frees come back in batches.
    Deferred,
    /// A block is pending until the owner acknowledges its notice
    /// ([`HeapOwner::acknowledge`], [`HeapAllocator::confirm`]).
    Immediate,
}

/// The alignment of a heap unless configured otherwise.
pub const DEFAULT_ALIGN: u64 = 8;

/// The parameters of one heap, fixed at creation and agreed by both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HeapConfig {
    heap: HeapId,
    policy: AllocPolicy,
    sync: SyncMode,
    align: u64,
}

impl HeapConfig {
    /// Heap `heap` with `policy`, its default synchronisation and an alignment of
    /// [`DEFAULT_ALIGN`].
    pub const fn new(heap: HeapId, policy: AllocPolicy) -> Self {
        HeapConfig { heap, policy, sync: policy.default_sync(), align: DEFAULT_ALIGN }
    }

    /// Overrides the synchronisation mode.
    pub const fn with_sync(mut self, sync: SyncMode) -> Self {
        self.sync = sync;
        self
    }

    /// Sets the alignment of block addresses and lengths: a power of two.
    pub fn with_align(mut self, align: u64) -> Result<Self, HeapError> {
        if !align.is_power_of_two() {
            return Err(HeapError::InvalidAlignment { align });
        }
        self.align = align;
        Ok(self)
    }

    /// The heap's name.
    pub const fn heap(&self) -> HeapId {
        self.heap
    }

    /// The allocation policy.
    pub const fn policy(&self) -> AllocPolicy {
        self.policy
    }

    /// The synchronisation mode.
    pub const fn sync(&self) -> SyncMode {
        self.sync
    }

    /// The alignment (a power of two).
    pub const fn align(&self) -> u64 {
        self.align
    }
}

/// A block of the owner's memory handed out by the allocator: where to RDMA-write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteBlock {
    /// First address (aligned to the heap's alignment).
    pub addr: u64,
    /// Length in bytes: the requested size rounded up to the alignment.
    pub len: u64,
    /// The rkey of the block's segment.
    pub rkey: u32,
    /// Index of the block's segment, in the order segments were added.
    pub segment: u32,
}

impl RemoteBlock {
    /// One past the last address.
    pub const fn end(&self) -> u64 {
        self.addr + self.len
    }

    /// The block as a remote region descriptor for posting RDMA operations.
    pub const fn region(&self) -> RemoteRegion {
        RemoteRegion { addr: self.addr, len: self.len, rkey: self.rkey }
    }
}

/// Occupancy of a heap as the allocating side sees it ([`HeapAllocator::stats`]).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct HeapStats {
    /// Number of segments.
    pub segments: usize,
    /// Bytes in all segments.
    pub total: u64,
    /// Bytes the allocator may hand out now.
    pub free: u64,
    /// `total - free`: blocks handed out, including those the owner freed whose batch has
    /// not been applied yet.
    pub used: u64,
    /// The largest free range: the biggest allocation that can succeed now.
    pub largest_free: u64,
    /// Number of disjoint free ranges (adjacent ranges of one segment are always merged).
    pub free_blocks: usize,
    /// External fragmentation, `1 - largest_free / free`, or 0 when nothing is free: 0 when
    /// all free space is one range, approaching 1 as it splinters into many small ranges.
    /// A heap with one free range per segment reports the share outside the largest.
    pub fragmentation: f64,
}

impl HeapStats {
    pub(crate) fn fragmentation_of(largest_free: u64, free: u64) -> f64 {
        if free == 0 { 0.0 } else { 1.0 - largest_free as f64 / free as f64 }
    }
}

/// What can go wrong in a heap operation. An error never changes the heap's state.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HeapError {
    /// No free range fits the request. Apply pending free batches, or ask the owner for a
    /// segment of at least `requested` bytes ([`HeapAllocator::alloc_or_grow`]).
    #[error(
        "heap exhausted: {requested} bytes requested, largest free range {largest_free} of {total_free} free"
    )]
    Exhausted {
        /// The request, rounded up to the alignment.
        requested: u64,
        /// The largest free range.
        largest_free: u64,
        /// All free bytes.
        total_free: u64,
    },
    /// A request of zero bytes, or one that overflows when rounded up to the alignment.
    #[error("invalid allocation size {size}")]
    InvalidSize {
        /// The requested size.
        size: u64,
    },
    /// The heap was full and the owner refused to grant a new segment.
    #[error("the owner refused to grow the heap for {requested} bytes")]
    GrowthRefused {
        /// The request, rounded up to the alignment.
        requested: u64,
    },
    /// The alignment is not a power of two.
    #[error("alignment {align} is not a power of two")]
    InvalidAlignment {
        /// The alignment given.
        align: u64,
    },
    /// A segment of zero length, overflowing the address space, or not aligned.
    #[error("invalid segment {base:#x}+{len:#x}")]
    InvalidSegment {
        /// Its base address.
        base: u64,
        /// Its length.
        len: u64,
    },
    /// A segment overlapping one already in the heap.
    #[error("segment {base:#x}+{len:#x} overlaps an existing segment")]
    SegmentOverlap {
        /// Its base address.
        base: u64,
        /// Its length.
        len: u64,
    },
    /// More than `u32::MAX` segments.
    #[error("too many segments")]
    TooManySegments,
    /// The owner does not hold a block at this address.
    #[error("no block at {addr:#x}")]
    UnknownBlock {
        /// The address given.
        addr: u64,
    },
    /// A range that is already free: freed twice by the owner's consumer, or a free batch
    /// returning space the allocator already has.
    #[error("double free at {addr:#x}")]
    DoubleFree {
        /// The first address already free.
        addr: u64,
    },
    /// A block or range that is not inside one segment of the heap, carries the wrong rkey
    /// or segment index, or is not aligned.
    #[error("range {addr:#x}+{len:#x} is not a valid block of this heap")]
    InvalidBlock {
        /// Its first address.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// An allocation notice for a range the owner still holds (handed out, in use, or freed
    /// and not yet returned): the allocating side would hand out memory twice.
    #[error("block {addr:#x}+{len:#x} overlaps memory the owner still holds")]
    Conflict {
        /// Its first address.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// An acknowledgement, cancellation or free for a block that is not pending
    /// confirmation, or a free batch touching a block that still is.
    #[error("block at {addr:#x} is not in the expected pending state")]
    NotPending {
        /// The block's address.
        addr: u64,
    },
    /// A message for another heap.
    #[error("message for heap {got:?} delivered to heap {expected:?}")]
    WrongHeap {
        /// This heap.
        expected: HeapId,
        /// The message's heap.
        got: HeapId,
    },
    /// A free batch out of sequence: lost, duplicated or reordered.
    #[error("free batch {got} out of order, expected {expected}")]
    OutOfOrder {
        /// The next sequence number this side expects.
        expected: u64,
        /// The batch's sequence number.
        got: u64,
    },
}
