//! Unit tests: each policy's choice on a known free list, the protocol's states and every
//! typed error.

use super::*;

pub(super) const H: HeapId = HeapId(1);
const BASE: u64 = 0x1_0000;
const RKEY: u32 = 0xabc;

/// An allocator and an owner wired back to back, synchronising at once.
pub(super) struct Pair {
    pub(super) alloc: HeapAllocator,
    pub(super) owner: HeapOwner,
}

impl Pair {
    pub(super) fn new(config: HeapConfig, segs: &[RemoteRegion]) -> Self {
        let mut pair = Pair { alloc: HeapAllocator::new(config), owner: HeapOwner::new(config.heap()) };
        for &s in segs {
            pair.grant(s).expect("segment");
        }
        pair
    }

    pub(super) fn grant(&mut self, seg: RemoteRegion) -> Result<u32, HeapError> {
        let i = self.owner.add_segment(seg)?;
        assert_eq!(self.alloc.add_segment(seg)?, i);
        Ok(i)
    }

    /// Allocates and synchronises the allocation by the heap's mode; returns the block and
    /// any free batch that came back with it.
    pub(super) fn alloc(&mut self, size: u64) -> Result<(RemoteBlock, FreeBatch), HeapError> {
        let block = self.alloc.alloc(size)?;
        let notice = AllocNotice::new(self.alloc.config().heap(), block);
        match self.alloc.config().sync() {
            SyncMode::Deferred => {
                self.owner.register(&notice).expect("owner accepts the notice");
                Ok((block, FreeBatch::default()))
            }
            SyncMode::Immediate => {
                assert!(self.alloc.is_pending(block.addr));
                let ack = self.owner.acknowledge(&notice).expect("owner acknowledges");
                assert_eq!(self.alloc.confirm(&ack).expect("confirm"), block);
                assert!(!self.alloc.is_pending(block.addr));
                Ok((block, ack.freed))
            }
        }
    }

    /// Delivers everything the owner freed; returns the batch.
    pub(super) fn sync(&mut self) -> FreeBatch {
        let batch = self.owner.take_free_batch(usize::MAX);
        self.alloc.apply_free_batch(&batch).expect("apply");
        batch
    }
}

fn seg(base: u64, len: u64) -> RemoteRegion {
    RemoteRegion::new(base, len, RKEY)
}

/// A heap over one segment cut into `pieces` (length, free?), allocated in order, whose free
/// pieces were freed and synchronised: the cursor sits at the segment's end.
fn with_holes(policy: AllocPolicy, pieces: &[(u64, bool)]) -> (Pair, Vec<u64>) {
    let total = pieces.iter().map(|p| p.0).sum();
    let mut pair = Pair::new(HeapConfig::new(H, policy), &[seg(BASE, total)]);
    let addrs: Vec<u64> = pieces.iter().map(|&(len, _)| pair.alloc(len).expect("fill").0.addr).collect();
    assert_eq!(pair.alloc.stats().free, 0);
    for (&(_, free), &addr) in pieces.iter().zip(&addrs) {
        if free {
            pair.owner.rfree(addr).expect("free");
        }
    }
    pair.sync();
    (pair, addrs)
}

fn addrs_of(pair: &mut Pair, sizes: &[u64]) -> Vec<u64> {
    sizes.iter().map(|&s| pair.alloc(s).expect("alloc").0.addr).collect()
}

// Holes H1 (32), H2 (64), H3 (16) between used pieces; the cursor is at the end.
const THREE_HOLES: [(u64, bool); 7] =
    [(32, false), (32, true), (32, false), (64, true), (32, false), (16, true), (64, false)];

#[test]
fn next_fit_resumes_after_the_last_allocation_and_wraps() {
    let (mut p, a) = with_holes(AllocPolicy::NextFit, &THREE_HOLES);
    let (h1, h2, h3) = (a[1], a[3], a[5]);
    let got = addrs_of(&mut p, &[16, 24, 8, 24, 16, 16]);
    // wrap to H1; H1's rest (16) too small → H2; resume in H2 (first-fit would go back to
    // H1); H2 again; H2's rest (8) too small → H3; nothing after → wrap to H1's rest.
    assert_eq!(got, [h1, h2, h2 + 24, h2 + 32, h3, h1 + 16]);
    assert_eq!(p.alloc.stats().free, 8); // H2's last 8 bytes
}

#[test]
fn first_fit_takes_the_lowest_range_that_fits() {
    let (mut p, a) = with_holes(AllocPolicy::FirstFit, &THREE_HOLES);
    let (h1, h2, h3) = (a[1], a[3], a[5]);
    let got = addrs_of(&mut p, &[40, 8, 16, 16, 16]);
    // H1 too small → H2; then H1 (lowest); H1 again; H1's rest (8) too small → H2's rest;
    // H2's rest (8) too small → H3.
    assert_eq!(got, [h2, h1, h1 + 8, h2 + 40, h3]);
}

#[test]
fn best_fit_takes_the_smallest_range_that_fits_lowest_first() {
    let pieces =
        [(8, false), (48, true), (8, false), (32, true), (8, false), (64, true), (8, false), (32, true)];
    let (mut p, a) = with_holes(AllocPolicy::BestFit, &pieces);
    let (h48, h32a, h64, h32b) = (a[1], a[3], a[5], a[7]);
    let got = addrs_of(&mut p, &[24, 32, 40, 8, 64]);
    // 32s tie → the lower; the other 32; 48; the 8s left in the 48 and the first 32 tie →
    // the lower; only the 64 holds 64.
    assert_eq!(got, [h32a, h32b, h48, h48 + 40, h64]);
    assert_eq!(p.alloc.stats().free, 8);
}

#[test]
fn worst_fit_takes_the_largest_range_lowest_first() {
    let pieces =
        [(8, false), (48, true), (8, false), (64, true), (8, false), (64, true), (8, false), (32, true)];
    let (mut p, a) = with_holes(AllocPolicy::WorstFit, &pieces);
    let (h48, h64a, h64b) = (a[1], a[3], a[5]);
    let got = addrs_of(&mut p, &[8, 8, 16, 48]);
    // 64s tie → the lower; the other 64 is now the largest; 56 vs 56 → the lower;
    // the 56 left in the second.
    assert_eq!(got, [h64a, h64b, h64a + 8, h64b + 8]);
    assert_eq!(
        p.alloc.alloc(49).map(|b| b.addr),
        Err(HeapError::Exhausted { requested: 56, largest_free: 48, total_free: 48 + 40 + 8 + 32 })
    );
    assert_eq!(p.alloc.alloc(48).map(|b| b.addr), Ok(h48));
}

#[test]
fn sizes_round_up_to_the_alignment() {
    let config = HeapConfig::new(H, AllocPolicy::NextFit).with_align(64).expect("align");
    let mut p = Pair::new(config, &[seg(BASE, 4096)]);
    let (b, _) = p.alloc(1).expect("alloc");
    assert_eq!((b.addr, b.len, b.rkey, b.segment), (BASE, 64, RKEY, 0));
    let (b, _) = p.alloc(65).expect("alloc");
    assert_eq!((b.addr, b.len), (BASE + 64, 128));
    assert_eq!(p.alloc.alloc(0), Err(HeapError::InvalidSize { size: 0 }));
    assert_eq!(p.alloc.alloc(u64::MAX), Err(HeapError::InvalidSize { size: u64::MAX }));
    assert_eq!(
        HeapConfig::new(H, AllocPolicy::NextFit).with_align(24),
        Err(HeapError::InvalidAlignment { align: 24 })
    );
    assert_eq!(
        p.alloc.add_segment(seg(0x100_0000 + 8, 4096)),
        Err(HeapError::InvalidSegment { base: 0x100_0000 + 8, len: 4096 })
    );
}

#[test]
fn segments_must_be_valid_and_disjoint() {
    let mut a = HeapAllocator::new(HeapConfig::new(H, AllocPolicy::BestFit));
    assert_eq!(a.add_segment(seg(BASE, 4096)), Ok(0));
    assert_eq!(
        a.add_segment(seg(BASE + 4088, 16)),
        Err(HeapError::SegmentOverlap { base: BASE + 4088, len: 16 })
    );
    assert_eq!(a.add_segment(seg(BASE - 8, 16)), Err(HeapError::SegmentOverlap { base: BASE - 8, len: 16 }));
    assert_eq!(a.add_segment(seg(0, 0)), Err(HeapError::InvalidSegment { base: 0, len: 0 }));
    assert_eq!(
        a.add_segment(seg(u64::MAX - 7, 16)),
        Err(HeapError::InvalidSegment { base: u64::MAX - 7, len: 16 })
    );
    assert_eq!(a.add_segment(seg(BASE + 4096, 8)), Ok(1)); // adjacent is fine
    assert_eq!(a.add_segment(seg(BASE - 8, 8)), Ok(2));
    assert_eq!(a.stats().segments, 3);
}

#[test]
fn adjacent_segments_never_coalesce() {
    let mut p = Pair::new(HeapConfig::new(H, AllocPolicy::FirstFit), &[seg(BASE, 64), seg(BASE + 64, 64)]);
    assert_eq!(p.alloc.stats().free_blocks, 2);
    assert!(matches!(
        p.alloc.alloc(72),
        Err(HeapError::Exhausted { requested: 72, largest_free: 64, total_free: 128 })
    ));
    let (x, _) = p.alloc(64).expect("alloc");
    let (y, _) = p.alloc(64).expect("alloc");
    assert_eq!((x.segment, y.segment, y.addr), (0, 1, BASE + 64));
    p.owner.rfree(x.addr).expect("free");
    p.owner.rfree(y.addr).expect("free");
    assert_eq!(p.owner.pending_free_blocks(), 2);
    let batch = p.sync();
    assert_eq!(batch.ranges(), [FreeRange { addr: BASE, len: 64 }, FreeRange { addr: BASE + 64, len: 64 }]);
    assert_eq!(p.alloc.free_ranges().collect::<Vec<_>>(), [(BASE, BASE + 64, 0), (BASE + 64, BASE + 128, 1)]);
}

#[test]
fn owner_states_and_coalescing_free_list() {
    let mut p = Pair::new(HeapConfig::new(H, AllocPolicy::NextFit), &[seg(BASE, 1024)]);
    let blocks: Vec<RemoteBlock> = (0..4).map(|_| p.alloc(64).expect("alloc").0).collect();
    assert_eq!(p.owner.state(blocks[0].addr), Some(OwnerBlockState::HandedOut));
    assert_eq!(p.owner.consume(blocks[0].addr), Ok(blocks[0]));
    assert_eq!(p.owner.state(blocks[0].addr), Some(OwnerBlockState::InUse));
    for i in [2, 0, 1] {
        p.owner.rfree(blocks[i].addr).expect("free");
    }
    assert_eq!(p.owner.state(blocks[1].addr), Some(OwnerBlockState::Freed));
    assert_eq!(p.owner.state(blocks[3].addr), Some(OwnerBlockState::HandedOut));
    let s = p.owner.stats();
    assert_eq!((s.held_blocks, s.held_bytes, s.freed_blocks, s.freed_bytes), (1, 64, 3, 192));
    // Freed but not returned: the allocator cannot have it, and a second free is refused.
    assert_eq!(p.owner.rfree(blocks[1].addr), Err(HeapError::DoubleFree { addr: blocks[1].addr }));
    assert_eq!(p.owner.rfree(blocks[1].addr + 8), Err(HeapError::UnknownBlock { addr: blocks[1].addr + 8 }));
    assert_eq!(p.owner.rfree(BASE + 512), Err(HeapError::UnknownBlock { addr: BASE + 512 }));
    assert_eq!(p.owner.rfree(blocks[3].addr + 8), Err(HeapError::UnknownBlock { addr: blocks[3].addr + 8 }));
    assert_eq!(p.owner.stats(), s);
    let batch = p.owner.take_free_batch(usize::MAX);
    assert_eq!((batch.seq(), batch.ranges()), (0, &[FreeRange { addr: BASE, len: 192 }][..]));
    assert_eq!(p.owner.state(blocks[1].addr), None);
    assert_eq!(p.owner.rfree(blocks[1].addr), Err(HeapError::UnknownBlock { addr: blocks[1].addr }));
    assert!(p.owner.take_free_batch(usize::MAX).is_empty());
    p.alloc.apply_free_batch(&batch).expect("apply");
    assert_eq!(p.alloc.stats().free, 1024 - 64);
}

#[test]
fn batches_are_limited_and_numbered() {
    let mut p = Pair::new(HeapConfig::new(H, AllocPolicy::NextFit), &[seg(BASE, 1024)]);
    let blocks: Vec<RemoteBlock> = (0..6).map(|_| p.alloc(64).expect("alloc").0).collect();
    for i in [0, 2, 4] {
        p.owner.rfree(blocks[i].addr).expect("free");
    }
    let b0 = p.owner.take_free_batch(2);
    let b1 = p.owner.take_free_batch(2);
    assert_eq!((b0.seq(), b0.len(), b1.seq(), b1.len()), (0, 2, 1, 1));
    assert_eq!(p.owner.take_free_batch(0), FreeBatch::new(H, 2, vec![]).expect("empty"));
    assert_eq!(p.alloc.apply_free_batch(&b1), Err(HeapError::OutOfOrder { expected: 0, got: 1 }));
    p.alloc.apply_free_batch(&b0).expect("apply");
    assert_eq!(p.alloc.apply_free_batch(&b0), Err(HeapError::OutOfOrder { expected: 1, got: 0 }));
    p.alloc.apply_free_batch(&b1).expect("apply");
    assert_eq!(p.alloc.expected_batch(), 2);
    assert_eq!(p.alloc.stats().free_blocks, 3 + 1); // three holes and the tail
}

#[test]
fn a_limited_batch_keeps_coalesced_runs_whole() {
    let mut p = Pair::new(HeapConfig::new(H, AllocPolicy::NextFit), &[seg(BASE, 1024)]);
    let blocks: Vec<RemoteBlock> = (0..6).map(|_| p.alloc(64).expect("alloc").0).collect();
    for i in [4, 1, 0, 5, 2] {
        p.owner.rfree(blocks[i].addr).expect("free");
    }
    let b0 = p.owner.take_free_batch(1);
    assert_eq!(b0.ranges(), [FreeRange { addr: BASE, len: 192 }]);
    assert_eq!(
        (p.owner.pending_free_blocks(), p.owner.state(blocks[4].addr)),
        (2, Some(OwnerBlockState::Freed))
    );
    let b1 = p.owner.take_free_batch(1);
    assert_eq!(b1.ranges(), [FreeRange { addr: BASE + 256, len: 128 }]);
    assert_eq!((b0.seq(), b1.seq(), p.owner.pending_free_blocks()), (0, 1, 0));
    p.alloc.apply_free_batch(&b0).expect("apply");
    p.alloc.apply_free_batch(&b1).expect("apply");
    assert_eq!(
        p.alloc.free_ranges().collect::<Vec<_>>(),
        [(BASE, BASE + 192, 0), (BASE + 256, BASE + 1024, 0)]
    );
}

#[test]
fn forged_batches_are_refused_without_effect() {
    let mut p = Pair::new(HeapConfig::new(H, AllocPolicy::BestFit), &[seg(BASE, 1024)]);
    let (b, _) = p.alloc(64).expect("alloc");
    let before = p.alloc.stats();
    let forge = |seq, ranges: &[(u64, u64)]| {
        FreeBatch::new(H, seq, ranges.iter().map(|&(addr, len)| FreeRange { addr, len }).collect())
            .expect("batch")
    };
    let cases = [
        (forge(0, &[(BASE, 64), (BASE + 64, 8)]), HeapError::DoubleFree { addr: BASE + 64 }),
        (forge(0, &[(BASE + 32, 64)]), HeapError::DoubleFree { addr: BASE + 64 }),
        (forge(0, &[(BASE + 2048, 8)]), HeapError::InvalidBlock { addr: BASE + 2048, len: 8 }),
        (forge(0, &[(BASE - 8, 16)]), HeapError::InvalidBlock { addr: BASE - 8, len: 16 }),
        (forge(0, &[(BASE + 4, 8)]), HeapError::InvalidBlock { addr: BASE + 4, len: 8 }),
        (forge(0, &[(BASE + 1016, 16)]), HeapError::InvalidBlock { addr: BASE + 1016, len: 16 }),
        (forge(3, &[(BASE, 64)]), HeapError::OutOfOrder { expected: 0, got: 3 }),
        (
            FreeBatch::new(HeapId(9), 0, vec![FreeRange { addr: BASE, len: 64 }]).expect("batch"),
            HeapError::WrongHeap { expected: H, got: HeapId(9) },
        ),
    ];
    for (batch, err) in cases {
        assert_eq!(p.alloc.apply_free_batch(&batch), Err(err));
        assert_eq!(p.alloc.stats(), before);
    }
    assert_eq!(p.alloc.expected_batch(), 0);
    // The genuine free still works afterwards.
    p.owner.rfree(b.addr).expect("free");
    p.sync();
    assert_eq!(p.alloc.stats().free, 1024);
}

#[test]
fn owner_refuses_notices_it_cannot_honour() {
    let mut p = Pair::new(HeapConfig::new(H, AllocPolicy::NextFit), &[seg(BASE, 1024)]);
    let (b, _) = p.alloc(64).expect("alloc");
    let (c, _) = p.alloc(64).expect("alloc");
    p.owner.rfree(c.addr).expect("free");
    let before = p.owner.stats();
    let notice = |addr, len, rkey, segment| AllocNotice::new(H, RemoteBlock { addr, len, rkey, segment });
    let cases = [
        (notice(b.addr, 64, RKEY, 0), HeapError::Conflict { addr: b.addr, len: 64 }),
        (notice(b.addr + 32, 64, RKEY, 0), HeapError::Conflict { addr: b.addr + 32, len: 64 }),
        (notice(c.addr + 8, 8, RKEY, 0), HeapError::Conflict { addr: c.addr + 8, len: 8 }), // freed, not returned
        (notice(BASE + 512, 64, RKEY + 1, 0), HeapError::InvalidBlock { addr: BASE + 512, len: 64 }),
        (notice(BASE + 512, 64, RKEY, 1), HeapError::InvalidBlock { addr: BASE + 512, len: 64 }),
        (notice(BASE + 1000, 64, RKEY, 0), HeapError::InvalidBlock { addr: BASE + 1000, len: 64 }),
        (notice(BASE + 512, 0, RKEY, 0), HeapError::InvalidBlock { addr: BASE + 512, len: 0 }),
        (notice(u64::MAX, 2, RKEY, 0), HeapError::InvalidBlock { addr: u64::MAX, len: 2 }),
    ];
    for (n, err) in cases {
        assert_eq!(p.owner.register(&n), Err(err.clone()));
        assert_eq!(p.owner.acknowledge(&n), Err(err));
        assert_eq!(p.owner.stats(), before);
    }
    let other = AllocNotice::new(HeapId(2), b);
    assert_eq!(p.owner.register(&other), Err(HeapError::WrongHeap { expected: H, got: HeapId(2) }));
    assert_eq!(p.owner.consume(BASE + 8), Err(HeapError::UnknownBlock { addr: BASE + 8 }));
}

#[test]
fn immediate_mode_blocks_wait_for_the_owner() {
    let mut p = Pair::new(HeapConfig::new(H, AllocPolicy::WorstFit), &[seg(BASE, 1024)]);
    let (x, _) = p.alloc(128).expect("alloc");
    p.owner.rfree(x.addr).expect("free");
    // A second allocation: pending until its acknowledgement, which brings x back.
    let y = p.alloc.alloc(64).expect("alloc");
    assert!(p.alloc.is_pending(y.addr) && p.alloc.pending_count() == 1);
    assert_eq!(p.alloc.stats().free, 1024 - 128 - 64);
    let ack = p.owner.acknowledge(&AllocNotice::new(H, y)).expect("ack");
    assert_eq!(ack.freed.ranges(), [FreeRange { addr: x.addr, len: 128 }]);
    let wrong = AllocAck { addr: y.addr + 8, ..ack.clone() };
    assert_eq!(p.alloc.confirm(&wrong), Err(HeapError::NotPending { addr: y.addr + 8 }));
    let wrong = AllocAck { len: 8, ..ack.clone() };
    assert_eq!(p.alloc.confirm(&wrong), Err(HeapError::NotPending { addr: y.addr }));
    assert_eq!(p.alloc.confirm(&ack), Ok(y));
    assert_eq!(p.alloc.confirm(&ack), Err(HeapError::NotPending { addr: y.addr }));
    assert_eq!(p.alloc.stats().free, 1024 - 64);
    // A batch may not return a block still pending.
    let z = p.alloc.alloc(64).expect("alloc");
    let forged = FreeBatch::new(H, 1, vec![FreeRange { addr: z.addr, len: 64 }]).expect("batch");
    assert_eq!(p.alloc.apply_free_batch(&forged), Err(HeapError::NotPending { addr: z.addr }));
    // The owner refuses z (say it is shutting the heap): the allocator takes it back.
    p.alloc.cancel(z.addr).expect("cancel");
    assert_eq!(p.alloc.cancel(z.addr), Err(HeapError::NotPending { addr: z.addr }));
    assert_eq!(p.alloc.stats().free, 1024 - 64);
}

/// Several blocks pending at once, handed out in no address order: each is found by its
/// address, a batch touching any of them is refused (naming the lowest one it overlaps),
/// and their acknowledgements confirm them in any order.
#[test]
fn many_pending_blocks_are_found_by_address() {
    let pieces = [(8, false), (48, true), (8, false), (32, true), (8, false), (64, true), (8, false)];
    let (mut p, a) = with_holes(AllocPolicy::BestFit, &pieces);
    let (h48, h32, h64) = (a[1], a[3], a[5]);
    let blocks: Vec<RemoteBlock> = [64, 32, 48].iter().map(|&n| p.alloc.alloc(n).expect("alloc")).collect();
    assert_eq!(blocks.iter().map(|b| b.addr).collect::<Vec<_>>(), [h64, h32, h48]);
    assert!(p.alloc.pending_count() == 3 && blocks.iter().all(|b| p.alloc.is_pending(b.addr)));
    let seq = p.alloc.expected_batch();
    for b in &blocks {
        for (addr, len) in [(b.addr, 8), (b.end() - 8, 8), (b.addr - 8, 16), (b.end() - 8, 16)] {
            let forged = FreeBatch::new(H, seq, vec![FreeRange { addr, len }]).expect("batch");
            assert_eq!(p.alloc.apply_free_batch(&forged), Err(HeapError::NotPending { addr: b.addr }));
        }
    }
    // Spanning the used piece between the 48 and the 32: the lower block is named.
    let forged = FreeBatch::new(H, seq, vec![FreeRange { addr: h48 + 40, len: 24 }]).expect("batch");
    assert_eq!(p.alloc.apply_free_batch(&forged), Err(HeapError::NotPending { addr: h48 }));
    for &i in &[1, 2, 0] {
        let ack = p.owner.acknowledge(&AllocNotice::new(H, blocks[i])).expect("ack");
        assert_eq!(p.alloc.confirm(&ack), Ok(blocks[i]));
        assert!(!p.alloc.is_pending(blocks[i].addr));
    }
    assert_eq!((p.alloc.pending_count(), p.alloc.stats().free), (0, 0));
}

#[test]
fn growth_asks_the_owner_and_a_refusal_is_typed() {
    let mut p = Pair::new(HeapConfig::new(H, AllocPolicy::NextFit), &[seg(BASE, 256)]);
    p.alloc(200).expect("alloc");
    let mut refuse = |_: HeapId, _: u64| None;
    assert_eq!(p.alloc.alloc_or_grow(100, &mut refuse), Err(HeapError::GrowthRefused { requested: 104 }));
    let mut asked = None;
    let mut grant = |heap: HeapId, min_len: u64| {
        asked = Some((heap, min_len));
        Some(RemoteRegion::new(0x20_0000, 4096, RKEY + 1))
    };
    let b = p.alloc.alloc_or_grow(100, &mut grant).expect("grown");
    assert_eq!(asked, Some((H, 104)));
    assert_eq!((b.addr, b.len, b.rkey, b.segment), (0x20_0000, 104, RKEY + 1, 1));
    let mut tiny = |_: HeapId, _: u64| Some(RemoteRegion::new(0x30_0000, 64, RKEY + 2));
    assert!(matches!(
        p.alloc.alloc_or_grow(8192, &mut tiny),
        Err(HeapError::Exhausted { requested: 8192, .. })
    ));
    let s = p.alloc.stats();
    assert_eq!((s.segments, s.total), (3, 256 + 4096 + 64));
}

#[test]
fn stats_and_fragmentation() {
    let mut p = Pair::new(HeapConfig::new(H, AllocPolicy::NextFit), &[seg(BASE, 1024)]);
    let empty = p.alloc.stats();
    assert_eq!(
        empty,
        HeapStats {
            segments: 1,
            total: 1024,
            free: 1024,
            used: 0,
            largest_free: 1024,
            free_blocks: 1,
            fragmentation: 0.0
        }
    );
    let blocks: Vec<RemoteBlock> = (0..8).map(|_| p.alloc(128).expect("alloc").0).collect();
    let full = p.alloc.stats();
    assert_eq!(
        (full.free, full.used, full.largest_free, full.free_blocks, full.fragmentation),
        (0, 1024, 0, 0, 0.0)
    );
    for i in [1, 3, 4, 6] {
        p.owner.rfree(blocks[i].addr).expect("free");
    }
    assert_eq!(p.alloc.stats(), full); // nothing comes back before the batch
    p.sync();
    let s = p.alloc.stats();
    // free: 128 + 256 + 128; largest 256 → 1 - 256/512
    assert_eq!((s.free, s.used, s.largest_free, s.free_blocks), (512, 512, 256, 3));
    assert_eq!(s.fragmentation, 0.5);
}

#[test]
fn remote_block_and_segment_conversions() {
    let r = rdmakit_verbs::RemoteRegion { addr: 0x1000, len: 4096, rkey: 7 };
    assert_eq!(rdmakit_verbs::RemoteRegion::new(0x1000, 4096, 7), r);
    assert_eq!(r.end(), Some(0x2000));
    let b = RemoteBlock { addr: 0x1008, len: 16, rkey: 7, segment: 0 };
    assert_eq!(b.region(), rdmakit_verbs::RemoteRegion { addr: 0x1008, len: 16, rkey: 7 });
    assert_eq!(b.end(), 0x1018);
    assert_eq!(AllocPolicy::default(), AllocPolicy::NextFit);
    assert_eq!(HeapConfig::new(H, AllocPolicy::BestFit).sync(), SyncMode::Immediate);
    assert_eq!(HeapConfig::new(H, AllocPolicy::FirstFit).sync(), SyncMode::Deferred);
}

mod wire {
    use super::*;

    fn batch() -> FreeBatch {
        FreeBatch::new(
            HeapId(5),
            42,
            vec![FreeRange { addr: 0x1000, len: 64 }, FreeRange { addr: 0x2000, len: 8 }],
        )
        .expect("batch")
    }

    #[test]
    fn layouts_are_as_documented() {
        let b = batch().encode();
        assert_eq!(b.len(), 24 + 2 * 16);
        assert_eq!(&b[..8], &[1, 0, 0, 0, 5, 0, 0, 0]);
        assert_eq!(&b[8..16], &42u64.to_le_bytes());
        assert_eq!(&b[16..24], &[2, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&b[24..40], &[0, 0x10, 0, 0, 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, 0, 0]);
        let n =
            AllocNotice::new(HeapId(5), RemoteBlock { addr: 0x1000, len: 64, rkey: 9, segment: 3 }).encode();
        assert_eq!(n[..8], [2, 0, 0, 0, 5, 0, 0, 0]);
        assert_eq!(n[24..], [9, 0, 0, 0, 3, 0, 0, 0]);
        let ack = AllocAck { heap: HeapId(5), addr: 0x3000, len: 8, freed: batch() };
        let a = ack.encode();
        assert_eq!((a.len(), a[0], &a[24..]), (ack.encoded_len(), 3, &b[..]));
    }

    #[test]
    fn round_trips() {
        let b = batch();
        assert_eq!(FreeBatch::decode(&b.encode()), Ok(b.clone()));
        let n = AllocNotice::new(HeapId(5), RemoteBlock { addr: 0x1000, len: 64, rkey: 9, segment: 3 });
        assert_eq!(AllocNotice::decode(&n.encode()), Ok(n));
        let ack = AllocAck { heap: HeapId(5), addr: 0x3000, len: 8, freed: b.clone() };
        assert_eq!(AllocAck::decode(&ack.encode()), Ok(ack.clone()));
        for m in [HeapMessage::from(b), n.into(), ack.into()] {
            assert_eq!(HeapMessage::decode(&m.encode()), Ok(m.clone()));
            assert_eq!(m.heap(), HeapId(5));
        }
    }

    #[test]
    fn malformed_input_is_a_typed_error() {
        let good = batch().encode();
        let with = |i: usize, v: u8| {
            let mut b = good.clone();
            b[i] = v;
            b
        };
        assert_eq!(FreeBatch::decode(&good[..23]), Err(WireError::Truncated { needed: 24, got: 23 }));
        assert_eq!(FreeBatch::decode(&good[..50]), Err(WireError::Truncated { needed: 56, got: 50 }));
        let mut long = good.clone();
        long.push(0);
        assert_eq!(FreeBatch::decode(&long), Err(WireError::TrailingBytes { expected: 56, got: 57 }));
        assert_eq!(FreeBatch::decode(&with(0, 2)), Err(WireError::WrongKind { expected: 1, got: 2 }));
        assert_eq!(FreeBatch::decode(&with(2, 1)), Err(WireError::Reserved));
        assert_eq!(FreeBatch::decode(&with(21, 1)), Err(WireError::Reserved));
        // count = 0xffff_ffff with two ranges' worth of bytes
        let mut huge = good.clone();
        huge[16..20].copy_from_slice(&[0xff; 4]);
        assert!(matches!(FreeBatch::decode(&huge), Err(WireError::Truncated { .. })));
        // second range below the first; zero length; overflow
        let mut unsorted = good.clone();
        unsorted[40..48].copy_from_slice(&0x1020u64.to_le_bytes());
        assert_eq!(FreeBatch::decode(&unsorted), Err(WireError::InvalidRange { index: 1 }));
        let mut zero = good.clone();
        zero[32..40].copy_from_slice(&0u64.to_le_bytes());
        assert_eq!(FreeBatch::decode(&zero), Err(WireError::InvalidRange { index: 0 }));
        let mut over = good.clone();
        over[40..48].copy_from_slice(&(u64::MAX - 4).to_le_bytes());
        assert_eq!(FreeBatch::decode(&over), Err(WireError::InvalidRange { index: 1 }));
        assert_eq!(
            FreeBatch::new(HeapId(0), 0, vec![FreeRange { addr: 8, len: 8 }, FreeRange { addr: 8, len: 8 }]),
            Err(WireError::InvalidRange { index: 1 })
        );

        let n =
            AllocNotice::new(HeapId(5), RemoteBlock { addr: 0x1000, len: 64, rkey: 9, segment: 3 }).encode();
        assert_eq!(AllocNotice::decode(&n[..31]), Err(WireError::Truncated { needed: 32, got: 31 }));
        assert_eq!(
            AllocNotice::decode(&[&n[..], &[0]].concat()),
            Err(WireError::TrailingBytes { expected: 32, got: 33 })
        );
        let mut nz = n;
        nz[16..24].copy_from_slice(&0u64.to_le_bytes());
        assert_eq!(AllocNotice::decode(&nz), Err(WireError::InvalidRange { index: 0 }));

        let ack = AllocAck { heap: HeapId(5), addr: 0x3000, len: 8, freed: batch() }.encode();
        assert_eq!(AllocAck::decode(&ack[..47]), Err(WireError::Truncated { needed: 48, got: 47 }));
        let mut other_heap = ack.clone();
        other_heap[28] = 6;
        assert_eq!(AllocAck::decode(&other_heap), Err(WireError::HeapMismatch));
        assert_eq!(HeapMessage::decode(&[]), Err(WireError::Truncated { needed: 1, got: 0 }));
        assert_eq!(HeapMessage::decode(&[7; 40]), Err(WireError::UnknownKind { kind: 7 }));
    }
}
