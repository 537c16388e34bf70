//! The owner's side of a remote heap.

use std::collections::BTreeMap;

use super::segments::SegmentTable;
use super::wire::{AllocAck, AllocNotice, FreeBatch, FreeRange};
use super::{HeapError, HeapId, RemoteBlock, RemoteRegion};

/// Where a block stands on the owner's side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OwnerBlockState {
    /// The allocator handed it out and the owner knows (registered or acknowledged); the
    /// allocating side may be writing it.
    HandedOut,
    /// The owner's consumer took it ([`HeapOwner::consume`]).
    InUse,
    /// Freed by the consumer; still held until a batch returns it.
    Freed,
}

/// The owner's side of a heap at a glance ([`HeapOwner::stats`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct OwnerStats {
    /// Number of segments.
    pub segments: usize,
    /// Bytes in all segments.
    pub total: u64,
    /// Blocks handed out or in use.
    pub held_blocks: usize,
    /// Their bytes.
    pub held_bytes: u64,
    /// Blocks freed and not yet taken into a batch.
    pub freed_blocks: usize,
    /// Their bytes.
    pub freed_bytes: u64,
}

/// A held block, without its address (the map key) or rkey (its segment's): 16 bytes, to
/// keep the map small.
#[derive(Clone, Copy, Debug)]
struct Block {
    len: u64,
    seg: u32,
    state: OwnerBlockState,
}

/// The owner's side of one remote heap: its segments, the blocks it holds, and the free
/// list that `rfree` feeds and [`take_free_batch`](Self::take_free_batch) drains, sorted and
/// coalesced. See the [module docs](super) for the protocol.
///
/// A block is held from the notice that tells the owner of it until the batch returning it
/// is taken; a notice overlapping anything held is refused ([`HeapError::Conflict`]), and a
/// free of anything not held is a typed error, never a corruption.
#[derive(Clone, Debug)]
pub struct HeapOwner {
    heap: HeapId,
    segments: SegmentTable,
    /// Every block the owner holds (handed out, in use, or freed and not yet batched), by
    /// address. Disjoint.
    blocks: BTreeMap<u64, Block>,
    /// Addresses of the freed blocks, in the order they were freed; sorted and coalesced
    /// into ranges when a batch is taken.
    freed: Vec<u64>,
    held_bytes: u64,
    freed_bytes: u64,
    /// Sequence number of the next non-empty batch.
    next_batch: u64,
}

impl HeapOwner {
    /// The owner's side of heap `heap`, with no segments yet.
    pub fn new(heap: HeapId) -> Self {
        HeapOwner {
            heap,
            segments: SegmentTable::default(),
            blocks: BTreeMap::new(),
            freed: Vec::new(),
            held_bytes: 0,
            freed_bytes: 0,
            next_batch: 0,
        }
    }

    /// The heap's name.
    pub fn heap(&self) -> HeapId {
        self.heap
    }

    /// Adds a segment of the owner's registered memory; grant it to the allocating side
    /// ([`HeapAllocator::add_segment`](super::HeapAllocator::add_segment)) in the same order,
    /// so that both agree on its index. The allocating side also requires the base and
    /// length to be multiples of the heap's alignment.
    pub fn add_segment(&mut self, seg: RemoteRegion) -> Result<u32, HeapError> {
        self.segments.add(seg, 1)
    }

    /// The segments, by index.
    pub fn segments(&self) -> &[RemoteRegion] {
        self.segments.as_slice()
    }

    /// Deferred mode: records the block of a notice that arrived with its data. Refused if
    /// the block is not inside the segment it names, carries another rkey, or overlaps
    /// anything the owner holds (handed out, in use, or freed and not yet batched).
    pub fn register(&mut self, notice: &AllocNotice) -> Result<(), HeapError> {
        if notice.heap != self.heap {
            return Err(HeapError::WrongHeap { expected: self.heap, got: notice.heap });
        }
        let b = notice.block;
        let invalid = HeapError::InvalidBlock { addr: b.addr, len: b.len };
        let end = match b.addr.checked_add(b.len) {
            Some(end) if b.len > 0 => end,
            _ => return Err(invalid),
        };
        match self.segments.get(b.segment) {
            Some(s) if s.rkey == b.rkey && s.addr <= b.addr && end <= s.addr + s.len => {}
            _ => return Err(invalid),
        }
        if let Some((&addr, held)) = self.blocks.range(..end).next_back()
            && addr + held.len > b.addr
        {
            return Err(HeapError::Conflict { addr: b.addr, len: b.len });
        }
        let block = Block { len: b.len, seg: b.segment, state: OwnerBlockState::HandedOut };
        self.blocks.insert(b.addr, block);
        self.held_bytes += b.len;
        Ok(())
    }

    /// Immediate mode: records the block as [`register`](Self::register) does and answers
    /// with the acknowledgement, which carries every range freed since the last batch.
    pub fn acknowledge(&mut self, notice: &AllocNotice) -> Result<AllocAck, HeapError> {
        self.register(notice)?;
        let freed = self.take_free_batch(usize::MAX);
        Ok(AllocAck { heap: self.heap, addr: notice.block.addr, len: notice.block.len, freed })
    }

    /// The consumer takes the block at `addr` (handed out → in use; taking it again is a
    /// no-op). Returns the block.
    pub fn consume(&mut self, addr: u64) -> Result<RemoteBlock, HeapError> {
        match self.blocks.get_mut(&addr) {
            Some(b) if b.state != OwnerBlockState::Freed => b.state = OwnerBlockState::InUse,
            _ => return Err(HeapError::UnknownBlock { addr }),
        }
        Ok(self.remote(addr, self.blocks[&addr]))
    }

    /// `rfree`: the consumer frees the block starting at `addr` (handed out or in use). It
    /// joins the free list, still held, until a batch returns it. Returns the block.
    ///
    /// [`HeapError::DoubleFree`] if the block is already freed and not yet batched,
    /// [`HeapError::UnknownBlock`] if the owner holds no block starting at `addr`.
    pub fn rfree(&mut self, addr: u64) -> Result<RemoteBlock, HeapError> {
        let b = self.blocks.get_mut(&addr).ok_or(HeapError::UnknownBlock { addr })?;
        if b.state == OwnerBlockState::Freed {
            return Err(HeapError::DoubleFree { addr });
        }
        b.state = OwnerBlockState::Freed;
        self.held_bytes -= b.len;
        self.freed_bytes += b.len;
        let b = *b;
        self.freed.push(addr);
        Ok(self.remote(addr, b))
    }

    /// Takes freed blocks, lowest addresses first, sorted and coalesced (adjacent blocks of
    /// one segment become one range) into at most `max_ranges` ranges: the next free batch,
    /// the deferred-synchronisation message for the allocating side. The blocks are no
    /// longer held once taken. An empty batch (nothing freed, or `max_ranges == 0`) uses no
    /// sequence number and need not be sent.
    pub fn take_free_batch(&mut self, max_ranges: usize) -> FreeBatch {
        if max_ranges == 0 || self.freed.is_empty() {
            return FreeBatch::from_sorted(self.heap, self.next_batch, Vec::new());
        }
        self.freed.sort_unstable();
        let mut ranges: Vec<FreeRange> = Vec::new();
        let (mut last_seg, mut taken) = (u32::MAX, 0);
        for &addr in &self.freed {
            let b = self.blocks.remove(&addr).expect("freed blocks are held");
            let n = ranges.len();
            match ranges.last_mut() {
                Some(r) if r.addr + r.len == addr && last_seg == b.seg => r.len += b.len,
                _ if n < max_ranges => ranges.push(FreeRange { addr, len: b.len }),
                _ => {
                    self.blocks.insert(addr, b); // it would start one range too many
                    break;
                }
            }
            last_seg = b.seg;
            self.freed_bytes -= b.len;
            taken += 1;
        }
        self.freed.drain(..taken);
        self.next_batch += 1;
        FreeBatch::from_sorted(self.heap, self.next_batch - 1, ranges)
    }

    /// Blocks the owner tracks: handed out, in use, or freed and not yet batched (a map
    /// entry each).
    pub fn tracked_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Where the block starting at `addr` stands, or `None` if the owner holds no block
    /// starting there.
    pub fn state(&self, addr: u64) -> Option<OwnerBlockState> {
        self.blocks.get(&addr).map(|b| b.state)
    }

    /// The block starting at `addr` and where it stands, or `None` if the owner holds no
    /// block starting there (an ordered-map lookup).
    pub fn block(&self, addr: u64) -> Option<(RemoteBlock, OwnerBlockState)> {
        self.blocks.get(&addr).map(|&b| (self.remote(addr, b), b.state))
    }

    /// Number of freed blocks waiting for a batch.
    pub fn pending_free_blocks(&self) -> usize {
        self.freed.len()
    }

    /// Bytes freed and waiting for a batch.
    pub fn pending_free_bytes(&self) -> u64 {
        self.freed_bytes
    }

    /// Counts of what the owner holds.
    pub fn stats(&self) -> OwnerStats {
        OwnerStats {
            segments: self.segments.len(),
            total: self.segments.total(),
            held_blocks: self.blocks.len() - self.freed.len(),
            held_bytes: self.held_bytes,
            freed_blocks: self.freed.len(),
            freed_bytes: self.freed_bytes,
        }
    }

    /// Every block the owner holds, freed ones included, in address order.
    pub fn blocks(&self) -> impl Iterator<Item = (RemoteBlock, OwnerBlockState)> + '_ {
        self.blocks.iter().map(|(&addr, &b)| (self.remote(addr, b), b.state))
    }

    fn remote(&self, addr: u64, b: Block) -> RemoteBlock {
        let rkey = self.segments.get(b.seg).expect("blocks lie in segments").rkey;
        RemoteBlock { addr, len: b.len, rkey, segment: b.seg }
    }
}
