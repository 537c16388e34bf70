//! The allocating side of a remote heap.

use std::collections::VecDeque;

use super::free_space::FreeSpace;
use super::segments::SegmentTable;
use super::wire::{AllocAck, FreeBatch};
use super::{AllocPolicy, HeapConfig, HeapError, HeapId, HeapStats, RemoteBlock, RemoteRegion, SyncMode};

/// Grants new segments when a heap is full: the owner's side of growth, as the allocating
/// side reaches it (a closure `FnMut(HeapId, u64) -> Option<RemoteRegion>` will do).
pub trait SegmentProvider {
    /// Heap `heap` cannot fit `min_len` bytes: grant a segment (which the owner has already
    /// added on its side, [`HeapOwner::add_segment`](super::HeapOwner::add_segment)), or
    /// `None` to refuse.
    fn grow(&mut self, heap: HeapId, min_len: u64) -> Option<RemoteRegion>;
}

impl<F: FnMut(HeapId, u64) -> Option<RemoteRegion>> SegmentProvider for F {
    fn grow(&mut self, heap: HeapId, min_len: u64) -> Option<RemoteRegion> {
        self(heap, min_len)
    }
}

/// The allocator of one remote heap, run by the allocating side over the owner's segments.
///
/// Free space is a map of coalesced ranges by address (next-fit, merging freed ranges) plus,
/// for best-fit and worst-fit, an index by size, so those policies choose in O(log n), and
/// for first-fit an index by size class and address (see the [module docs](super)' costs). Space comes back only through [`apply_free_batch`](Self::apply_free_batch) (or
/// the batch inside an [`AllocAck`]), never from the allocating side alone (save a pending
/// block the owner refused, [`cancel`](Self::cancel)): a block is never handed out again
/// while the owner holds it. See the [module docs](super) for the protocol.
#[derive(Clone, Debug)]
pub struct HeapAllocator {
    config: HeapConfig,
    segments: SegmentTable,
    free: FreeSpace,
    /// Next-fit's roving cursor: the end of the previous allocation.
    cursor: u64,
    /// Immediate mode: blocks handed out and not yet acknowledged, in the order they were
    /// (acknowledgements come back in that order over an RC connection, so the one
    /// confirmed is the first, and an allocation or a confirmation moves nothing). Each is
    /// an allocation awaiting its round trip, so there are few.
    pending: VecDeque<RemoteBlock>,
    /// Sequence number of the next free batch to apply.
    next_batch: u64,
}

impl HeapAllocator {
    /// An allocator with no segments yet.
    pub fn new(config: HeapConfig) -> Self {
        HeapAllocator {
            config,
            segments: SegmentTable::default(),
            free: FreeSpace::new(config.policy().index_kind()),
            cursor: 0,
            pending: VecDeque::new(),
            next_batch: 0,
        }
    }

    /// The heap's configuration.
    pub fn config(&self) -> &HeapConfig {
        &self.config
    }

    /// Adds a segment the owner granted (the owner adds it on its side in the same order, so
    /// both agree on its index); its space is free at once. Its base and length must be
    /// multiples of the alignment, and it must not overlap another segment.
    pub fn add_segment(&mut self, seg: RemoteRegion) -> Result<u32, HeapError> {
        let index = self.segments.add(seg, self.config.align())?;
        self.free.insert(seg.addr, seg.addr + seg.len, index).expect("a new segment is disjoint");
        Ok(index)
    }

    /// The segments, by index.
    pub fn segments(&self) -> &[RemoteRegion] {
        self.segments.as_slice()
    }

    /// `size` rounded up to the alignment, or `None` for 0 or on overflow.
    pub fn rounded_size(&self, size: u64) -> Option<u64> {
        let mask = self.config.align() - 1;
        if size == 0 { None } else { Some(size.checked_add(mask)? & !mask) }
    }

    /// Allocates `size` bytes (rounded up to the alignment) by the heap's policy.
    ///
    /// In [`SyncMode::Deferred`] the block is usable at once; send the owner its
    /// [`AllocNotice`](super::AllocNotice) with the data. In [`SyncMode::Immediate`] it is
    /// pending until [`confirm`](Self::confirm) receives the owner's acknowledgement.
    ///
    /// [`HeapError::Exhausted`] when no free range fits: apply pending free batches or grow
    /// the heap ([`alloc_or_grow`](Self::alloc_or_grow)).
    pub fn alloc(&mut self, size: u64) -> Result<RemoteBlock, HeapError> {
        let n = self.rounded_size(size).ok_or(HeapError::InvalidSize { size })?;
        let taken = match self.config.policy() {
            AllocPolicy::NextFit => self.free.take_next_fit(n, self.cursor),
            AllocPolicy::FirstFit => self.free.take_first_fit(n),
            AllocPolicy::BestFit => self.free.take_best_fit(n),
            AllocPolicy::WorstFit => self.free.take_worst_fit(n),
        };
        let Some(taken) = taken else {
            return Err(HeapError::Exhausted {
                requested: n,
                largest_free: self.free.largest(),
                total_free: self.free.bytes(),
            });
        };
        let rkey = self.segments.get(taken.seg).expect("free space lies in segments").rkey;
        let block = RemoteBlock { addr: taken.addr, len: n, rkey, segment: taken.seg };
        self.cursor = block.end();
        if self.config.sync() == SyncMode::Immediate {
            self.pending.push_back(block);
        }
        Ok(block)
    }

    /// [`alloc`](Self::alloc), and when the heap is exhausted, asks `provider` once for a
    /// segment of at least the rounded size, adds it and retries. A refusal is
    /// [`HeapError::GrowthRefused`]; a granted segment too small to help is still added, and
    /// the retry's [`HeapError::Exhausted`] returned.
    pub fn alloc_or_grow(
        &mut self,
        size: u64,
        provider: &mut impl SegmentProvider,
    ) -> Result<RemoteBlock, HeapError> {
        match self.alloc(size) {
            Err(HeapError::Exhausted { requested, .. }) => {
                let seg = provider
                    .grow(self.config.heap(), requested)
                    .ok_or(HeapError::GrowthRefused { requested })?;
                self.add_segment(seg)?;
                self.alloc(size)
            }
            other => other,
        }
    }

    /// Immediate mode: applies the owner's acknowledgement of a pending block, including the
    /// ranges it freed since the last synchronisation, and returns the block, now usable.
    pub fn confirm(&mut self, ack: &AllocAck) -> Result<RemoteBlock, HeapError> {
        self.check_heap(ack.heap)?;
        let i = self
            .pending_index(ack.addr)
            .filter(|&i| self.pending[i].len == ack.len)
            .ok_or(HeapError::NotPending { addr: ack.addr })?;
        self.apply_free_batch(&ack.freed)?;
        Ok(self.pending.remove(i).expect("found above"))
    }

    /// Immediate mode: gives back a pending block the owner **refused** (its
    /// [`HeapOwner::acknowledge`](super::HeapOwner::acknowledge) failed, so it never held it).
    /// Never cancel a block whose notice may have been accepted.
    pub fn cancel(&mut self, addr: u64) -> Result<(), HeapError> {
        let i = self.pending_index(addr).ok_or(HeapError::NotPending { addr })?;
        let block = self.pending.remove(i).expect("found above");
        self.free.insert(block.addr, block.end(), block.segment).expect("a pending block is not free");
        Ok(())
    }

    /// Whether the block at `addr` is waiting for the owner's acknowledgement.
    pub fn is_pending(&self, addr: u64) -> bool {
        self.pending_index(addr).is_some()
    }

    /// The index in `pending` of the block at `addr`: the first, usually (see `pending`);
    /// else a scan of the few others.
    fn pending_index(&self, addr: u64) -> Option<usize> {
        self.pending.iter().position(|b| b.addr == addr)
    }

    /// Number of blocks waiting for the owner's acknowledgement.
    pub fn pending_count(&self) -> usize {
        self.pending.len()
    }

    /// The sequence number of the next free batch this allocator will accept.
    pub fn expected_batch(&self) -> u64 {
        self.next_batch
    }

    /// Returns the ranges of a free batch to the free space, merging them with their
    /// neighbours. Every range must lie inside one segment, be aligned, not be free already
    /// ([`HeapError::DoubleFree`]) nor be a pending block; batches must arrive in sequence.
    /// Atomic: a batch that fails changes nothing. An empty batch changes nothing either.
    pub fn apply_free_batch(&mut self, batch: &FreeBatch) -> Result<(), HeapError> {
        self.check_heap(batch.heap())?;
        if batch.seq() != self.next_batch {
            return Err(HeapError::OutOfOrder { expected: self.next_batch, got: batch.seq() });
        }
        if batch.is_empty() {
            return Ok(());
        }
        let mask = self.config.align() - 1;
        let ranges = batch.ranges();
        for r in ranges {
            let end = r.addr + r.len; // FreeBatch guarantees no overflow
            if (r.addr | r.len) & mask != 0 || self.segments.find(r.addr, end).is_none() {
                return Err(HeapError::InvalidBlock { addr: r.addr, len: r.len });
            }
        }
        // No range may free a pending block (the lowest overlapped is named). The ranges are
        // sorted and disjoint (FreeBatch guarantees it): the first ending after a block's
        // start overlaps it if it begins before the block's end.
        let overlapped = self.pending.iter().filter(|b| {
            let first_after = ranges.partition_point(|r| r.addr + r.len <= b.addr);
            ranges.get(first_after).is_some_and(|r| r.addr < b.end())
        });
        if let Some(addr) = overlapped.map(|b| b.addr).min() {
            return Err(HeapError::NotPending { addr });
        }
        for (i, r) in batch.ranges().iter().enumerate() {
            let (addr, end) = (r.addr, r.addr + r.len);
            let seg = self.segments.find(addr, end).expect("checked above");
            if let Err(first_free) = self.free.insert(addr, end, seg) {
                for r in &batch.ranges()[..i] {
                    self.free.remove(r.addr, r.addr + r.len);
                }
                return Err(HeapError::DoubleFree { addr: first_free });
            }
        }
        self.next_batch += 1;
        Ok(())
    }

    /// Current occupancy. O(1), except `largest_free`: a scan of the free ranges for
    /// next-fit heaps (which keep no index), of the largest ranges' size class for
    /// first-fit heaps.
    pub fn stats(&self) -> HeapStats {
        let total = self.segments.total();
        let free = self.free.bytes();
        let largest_free = self.free.largest();
        HeapStats {
            segments: self.segments.len(),
            total,
            free,
            used: total - free,
            largest_free,
            free_blocks: self.free.ranges(),
            fragmentation: HeapStats::fragmentation_of(largest_free, free),
        }
    }

    /// The free ranges in address order, as `(start, end, segment)`.
    pub fn free_ranges(&self) -> impl Iterator<Item = (u64, u64, u32)> + '_ {
        self.free.iter()
    }

    fn check_heap(&self, got: HeapId) -> Result<(), HeapError> {
        if got == self.config.heap() {
            Ok(())
        } else {
            Err(HeapError::WrongHeap { expected: self.config.heap(), got })
        }
    }
}
