//! The synchronisation messages between the owner and the allocating side, and their wire
//! encoding (see [`HeapMessage`]).

use super::{HeapId, RemoteBlock};

const KIND_FREE_BATCH: u8 = 1;
const KIND_ALLOC_NOTICE: u8 = 2;
const KIND_ALLOC_ACK: u8 = 3;

/// A malformed synchronisation message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Shorter than its header or its declared contents.
    #[error("message truncated: {needed} bytes needed, {got} given")]
    Truncated {
        /// Bytes the message needs.
        needed: usize,
        /// Bytes given.
        got: usize,
    },
    /// Longer than its declared contents.
    #[error("trailing bytes: message is {expected} bytes, {got} given")]
    TrailingBytes {
        /// The message's length.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// A kind byte no message has.
    #[error("unknown message kind {kind}")]
    UnknownKind {
        /// The kind byte.
        kind: u8,
    },
    /// Another message than the one being decoded.
    #[error("message kind {got}, expected {expected}")]
    WrongKind {
        /// The kind expected.
        expected: u8,
        /// The kind found.
        got: u8,
    },
    /// A reserved byte that is not zero.
    #[error("reserved bytes are not zero")]
    Reserved,
    /// A range (or block) of zero length, overflowing the address space, or, in a batch,
    /// not above the previous one.
    #[error("invalid range at index {index}")]
    InvalidRange {
        /// Its position in the message.
        index: usize,
    },
    /// An acknowledgement whose free batch names another heap.
    #[error("acknowledgement and its free batch name different heaps")]
    HeapMismatch,
}

/// A freed range in a [`FreeBatch`]: `addr..addr + len`, possibly several coalesced blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FreeRange {
    /// First address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Deferred synchronisation: ranges the owner freed, coalesced, returned to the allocating
/// side ([`HeapOwner::take_free_batch`](super::HeapOwner::take_free_batch) →
/// [`HeapAllocator::apply_free_batch`](super::HeapAllocator::apply_free_batch)).
///
/// Its ranges are non-empty, do not overflow, and are sorted and disjoint; every
/// constructor checks it. Non-empty batches are numbered from 0 per heap, and must be
/// applied in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FreeBatch {
    heap: HeapId,
    seq: u64,
    ranges: Vec<FreeRange>,
}

impl FreeBatch {
    /// Encoded length of the header.
    pub const HEADER_LEN: usize = 24;
    /// Encoded length of one range.
    pub const RANGE_LEN: usize = 16;

    /// A batch of heap `heap` with sequence number `seq`, checking the ranges (non-empty,
    /// not overflowing, sorted, disjoint).
    pub fn new(heap: HeapId, seq: u64, ranges: Vec<FreeRange>) -> Result<Self, WireError> {
        check_ranges(&ranges)?;
        Ok(FreeBatch { heap, seq, ranges })
    }

    /// From ranges the owner's free list produced, valid by construction.
    pub(crate) fn from_sorted(heap: HeapId, seq: u64, ranges: Vec<FreeRange>) -> Self {
        debug_assert_eq!(check_ranges(&ranges), Ok(()));
        FreeBatch { heap, seq, ranges }
    }

    /// The heap.
    pub fn heap(&self) -> HeapId {
        self.heap
    }

    /// The sequence number.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The freed ranges, in address order.
    pub fn ranges(&self) -> &[FreeRange] {
        &self.ranges
    }

    /// Number of ranges.
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Whether the batch returns nothing.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Bytes returned.
    pub fn bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.len).sum()
    }

    /// Length of the encoding.
    pub fn encoded_len(&self) -> usize {
        Self::HEADER_LEN + self.ranges.len() * Self::RANGE_LEN
    }

    /// Encodes the batch.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut out);
        out
    }

    /// Appends the encoding to `out`.
    ///
    /// # Panics
    ///
    /// If the batch holds more than `u32::MAX` ranges (the owner never produces such a
    /// batch unless asked for one with [`take_free_batch`](super::HeapOwner::take_free_batch)).
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&[KIND_FREE_BATCH, 0, 0, 0]);
        out.extend_from_slice(&self.heap.0.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        let count = u32::try_from(self.ranges.len()).expect("a free batch holds at most u32::MAX ranges");
        out.extend_from_slice(&count.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        for r in &self.ranges {
            out.extend_from_slice(&r.addr.to_le_bytes());
            out.extend_from_slice(&r.len.to_le_bytes());
        }
    }

    /// Decodes exactly one encoded batch.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(bytes, Self::HEADER_LEN)?;
        let heap = r.header(KIND_FREE_BATCH)?;
        let seq = r.u64();
        let count = r.u32() as usize;
        if r.u32() != 0 {
            return Err(WireError::Reserved);
        }
        let needed = count.checked_mul(Self::RANGE_LEN).and_then(|n| n.checked_add(Self::HEADER_LEN));
        match needed {
            Some(n) if n == bytes.len() => {}
            Some(n) if n < bytes.len() => {
                return Err(WireError::TrailingBytes { expected: n, got: bytes.len() });
            }
            _ => return Err(WireError::Truncated { needed: needed.unwrap_or(usize::MAX), got: bytes.len() }),
        }
        let mut ranges = Vec::with_capacity(count);
        for _ in 0..count {
            ranges.push(FreeRange { addr: r.u64(), len: r.u64() });
        }
        check_ranges(&ranges)?;
        Ok(FreeBatch { heap, seq, ranges })
    }
}

fn check_ranges(ranges: &[FreeRange]) -> Result<(), WireError> {
    let mut floor = 0;
    for (index, r) in ranges.iter().enumerate() {
        match r.addr.checked_add(r.len) {
            Some(end) if r.len > 0 && r.addr >= floor => floor = end,
            _ => return Err(WireError::InvalidRange { index }),
        }
    }
    Ok(())
}

/// Notice of an allocation, from the allocating side to the owner: with the data in
/// deferred mode ([`HeapOwner::register`](super::HeapOwner::register)), as a request
/// awaiting an [`AllocAck`] in immediate mode
/// ([`HeapOwner::acknowledge`](super::HeapOwner::acknowledge)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AllocNotice {
    /// The heap.
    pub heap: HeapId,
    /// The block allocated.
    pub block: RemoteBlock,
}

impl AllocNotice {
    /// Encoded length.
    pub const ENCODED_LEN: usize = 32;

    /// The notice of `block` in heap `heap`.
    pub const fn new(heap: HeapId, block: RemoteBlock) -> Self {
        AllocNotice { heap, block }
    }

    /// Encodes the notice.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0; Self::ENCODED_LEN];
        out[0] = KIND_ALLOC_NOTICE;
        out[4..8].copy_from_slice(&self.heap.0.to_le_bytes());
        out[8..16].copy_from_slice(&self.block.addr.to_le_bytes());
        out[16..24].copy_from_slice(&self.block.len.to_le_bytes());
        out[24..28].copy_from_slice(&self.block.rkey.to_le_bytes());
        out[28..32].copy_from_slice(&self.block.segment.to_le_bytes());
        out
    }

    /// Decodes exactly one encoded notice.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        exact(bytes, Self::ENCODED_LEN)?;
        let mut r = Reader::new(bytes, Self::ENCODED_LEN)?;
        let heap = r.header(KIND_ALLOC_NOTICE)?;
        let (addr, len) = (r.u64(), r.u64());
        check_ranges(&[FreeRange { addr, len }])?;
        Ok(AllocNotice { heap, block: RemoteBlock { addr, len, rkey: r.u32(), segment: r.u32() } })
    }
}

/// Immediate synchronisation: the owner's acknowledgement of an [`AllocNotice`], carrying
/// the ranges freed since the previous synchronisation ([`HeapAllocator::confirm`](super::HeapAllocator::confirm)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocAck {
    /// The heap.
    pub heap: HeapId,
    /// Address of the acknowledged block.
    pub addr: u64,
    /// Its length.
    pub len: u64,
    /// Ranges freed by the owner since its previous batch (possibly none).
    pub freed: FreeBatch,
}

impl AllocAck {
    /// Encoded length without the free batch.
    pub const HEADER_LEN: usize = 24;

    /// Length of the encoding.
    pub fn encoded_len(&self) -> usize {
        Self::HEADER_LEN + self.freed.encoded_len()
    }

    /// Encodes the acknowledgement.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        out.extend_from_slice(&[KIND_ALLOC_ACK, 0, 0, 0]);
        out.extend_from_slice(&self.heap.0.to_le_bytes());
        out.extend_from_slice(&self.addr.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        self.freed.encode_into(&mut out);
        out
    }

    /// Decodes exactly one encoded acknowledgement.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(bytes, Self::HEADER_LEN + FreeBatch::HEADER_LEN)?;
        let heap = r.header(KIND_ALLOC_ACK)?;
        let (addr, len) = (r.u64(), r.u64());
        check_ranges(&[FreeRange { addr, len }])?;
        let freed = FreeBatch::decode(r.rest())?;
        if freed.heap != heap {
            return Err(WireError::HeapMismatch);
        }
        Ok(AllocAck { heap, addr, len, freed })
    }
}

/// Any heap synchronisation message, for a transport carrying them on one channel.
///
/// Encodings are compact and little-endian, and decoding is defensive: the messages cross
/// hosts, so every malformed input is a [`WireError`], never a panic, and whatever decodes
/// re-encodes to the same bytes.
///
/// | message | bytes |
/// | --- | --- |
/// | [`FreeBatch`] | kind `1` (u8), 3 zero bytes, heap (u32), seq (u64), count (u32), 4 zero bytes, then `count` × (addr u64, len u64) |
/// | [`AllocNotice`] | kind `2` (u8), 3 zero bytes, heap (u32), addr (u64), len (u64), rkey (u32), segment (u32): 32 bytes |
/// | [`AllocAck`] | kind `3` (u8), 3 zero bytes, heap (u32), addr (u64), len (u64), then the [`FreeBatch`] of freed ranges |
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeapMessage {
    /// Freed ranges returned to the allocating side.
    FreeBatch(FreeBatch),
    /// An allocation, told to the owner.
    AllocNotice(AllocNotice),
    /// The owner's acknowledgement of an allocation.
    AllocAck(AllocAck),
}

impl HeapMessage {
    /// The heap the message is for.
    pub fn heap(&self) -> HeapId {
        match self {
            HeapMessage::FreeBatch(b) => b.heap,
            HeapMessage::AllocNotice(n) => n.heap,
            HeapMessage::AllocAck(a) => a.heap,
        }
    }

    /// Encodes the message.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            HeapMessage::FreeBatch(b) => b.encode(),
            HeapMessage::AllocNotice(n) => n.encode().to_vec(),
            HeapMessage::AllocAck(a) => a.encode(),
        }
    }

    /// Decodes exactly one encoded message of any kind.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        match bytes.first() {
            None => Err(WireError::Truncated { needed: 1, got: 0 }),
            Some(&KIND_FREE_BATCH) => FreeBatch::decode(bytes).map(HeapMessage::FreeBatch),
            Some(&KIND_ALLOC_NOTICE) => AllocNotice::decode(bytes).map(HeapMessage::AllocNotice),
            Some(&KIND_ALLOC_ACK) => AllocAck::decode(bytes).map(HeapMessage::AllocAck),
            Some(&kind) => Err(WireError::UnknownKind { kind }),
        }
    }
}

impl From<FreeBatch> for HeapMessage {
    fn from(b: FreeBatch) -> Self {
        HeapMessage::FreeBatch(b)
    }
}

impl From<AllocNotice> for HeapMessage {
    fn from(n: AllocNotice) -> Self {
        HeapMessage::AllocNotice(n)
    }
}

impl From<AllocAck> for HeapMessage {
    fn from(a: AllocAck) -> Self {
        HeapMessage::AllocAck(a)
    }
}

fn exact(bytes: &[u8], len: usize) -> Result<(), WireError> {
    if bytes.len() > len {
        return Err(WireError::TrailingBytes { expected: len, got: bytes.len() });
    }
    Ok(())
}

/// Reads little-endian fields from a buffer whose length was checked up front, so reads
/// cannot fail; a short buffer yields zeros rather than a panic, as a second line of defence.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader over `bytes`, which must hold at least `min_len` bytes.
    fn new(bytes: &'a [u8], min_len: usize) -> Result<Self, WireError> {
        if bytes.len() < min_len {
            return Err(WireError::Truncated { needed: min_len, got: bytes.len() });
        }
        Ok(Reader { rest: bytes })
    }

    fn take<const N: usize>(&mut self) -> [u8; N] {
        match self.rest.split_first_chunk::<N>() {
            Some((head, tail)) => {
                self.rest = tail;
                *head
            }
            None => {
                self.rest = &[];
                [0; N]
            }
        }
    }

    /// The kind byte (checked against `kind`), three reserved zero bytes and the heap id.
    fn header(&mut self, kind: u8) -> Result<HeapId, WireError> {
        let [got, r0, r1, r2] = self.take::<4>();
        if got != kind {
            return Err(WireError::WrongKind { expected: kind, got });
        }
        if [r0, r1, r2] != [0; 3] {
            return Err(WireError::Reserved);
        }
        Ok(HeapId(self.u32()))
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }

    fn rest(&self) -> &'a [u8] {
        self.rest
    }
}
