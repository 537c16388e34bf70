//! Property tests: random operation sequences against a model, per policy; the
//! owner/allocator protocol with late delivery over the wire encoding; wire decoding of
//! arbitrary bytes.

use std::collections::{BTreeMap, VecDeque};

use proptest::prelude::*;
use proptest::sample::Index;

use super::tests::{H, Pair};
use super::*;

/// What the model knows of a block the allocator handed out and has not got back.
#[derive(Clone, Copy, Debug)]
struct Out {
    block: RemoteBlock,
    /// The owner has registered or acknowledged it.
    known: bool,
    /// The owner's consumer freed it.
    freed: bool,
}

/// The model: every block handed out and not yet returned by an applied batch.
struct Model {
    segs: Vec<RemoteRegion>,
    align: u64,
    out: BTreeMap<u64, Out>,
}

impl Model {
    fn new(segs: &[RemoteRegion], align: u64) -> Self {
        Model { segs: segs.to_vec(), align, out: BTreeMap::new() }
    }

    fn total(&self) -> u64 {
        self.segs.iter().map(|s| s.len).sum()
    }

    fn out_bytes(&self) -> u64 {
        self.out.values().map(|o| o.block.len).sum()
    }

    /// Overlaps any block not yet returned?
    fn overlaps_out(&self, addr: u64, end: u64) -> bool {
        self.out.range(..end).next_back().is_some_and(|(_, o)| o.block.end() > addr)
    }

    /// A freshly allocated block: aligned, rounded, inside its segment, and disjoint from
    /// everything not yet returned (the owner's held, freed and in-flight blocks).
    fn handed_out(&mut self, b: RemoteBlock, size: u64, known: bool) {
        let rounded = size.div_ceil(self.align) * self.align;
        assert_eq!(b.len, rounded, "{b:?} for {size}");
        assert_eq!(b.addr % self.align, 0, "{b:?}");
        let seg = self.segs[b.segment as usize];
        assert!(
            b.addr >= seg.addr && b.end() <= seg.addr + seg.len && b.rkey == seg.rkey,
            "{b:?} outside {seg:?}"
        );
        assert!(!self.overlaps_out(b.addr, b.end()), "{b:?} handed out while still held");
        self.out.insert(b.addr, Out { block: b, known, freed: false });
    }

    /// A batch was applied: each range must be exactly a run of blocks the owner freed.
    fn returned(&mut self, batch: &FreeBatch) {
        for r in batch.ranges() {
            let mut at = r.addr;
            while at < r.addr + r.len {
                let o = self.out.remove(&at).unwrap_or_else(|| panic!("{r:?} returns {at:#x}, not a block"));
                assert!(o.freed, "{r:?} returns {:?}, which the owner still holds", o.block);
                at = o.block.end();
            }
            assert_eq!(at, r.addr + r.len, "{r:?} ends inside a block");
        }
    }

    /// The `i`th block matching `f`.
    fn pick(&self, i: &Index, f: impl Fn(&Out) -> bool) -> Option<u64> {
        let v: Vec<u64> = self.out.values().filter(|o| f(o)).map(|o| o.block.addr).collect();
        (!v.is_empty()).then(|| v[i.index(v.len())])
    }

    /// The allocator's free space and statistics agree with the model.
    fn check(&self, alloc: &HeapAllocator) {
        let s = alloc.stats();
        let free: Vec<(u64, u64, u32)> = alloc.free_ranges().collect();
        assert_eq!(s.segments, self.segs.len());
        assert_eq!(s.total, self.total());
        assert_eq!(s.free + s.used, s.total);
        assert_eq!(s.used, self.out_bytes());
        assert_eq!(s.free_blocks, free.len());
        assert_eq!(s.free, free.iter().map(|r| r.1 - r.0).sum::<u64>());
        assert_eq!(s.largest_free, free.iter().map(|r| r.1 - r.0).max().unwrap_or(0));
        assert_eq!(s.fragmentation, HeapStats::fragmentation_of(s.largest_free, s.free));
        assert!((0.0..1.0).contains(&s.fragmentation));
        for w in free.windows(2) {
            assert!(w[0].1 <= w[1].0, "free ranges overlap: {w:?}");
            assert!(w[0].1 < w[1].0 || w[0].2 != w[1].2, "adjacent free ranges not merged: {w:?}");
        }
        for &(start, end, seg) in &free {
            let sg = self.segs[seg as usize];
            assert!(start < end && start >= sg.addr && end <= sg.addr + sg.len);
            assert!(!self.overlaps_out(start, end), "free range {start:#x}..{end:#x} is held");
        }
    }

    /// Everything has been returned: one free range per segment, each the whole segment.
    fn check_all_free(&self, alloc: &HeapAllocator) {
        assert!(self.out.is_empty());
        self.check(alloc);
        let free: Vec<(u64, u64, u32)> = alloc.free_ranges().collect();
        let mut segs: Vec<(u64, u64, u32)> =
            self.segs.iter().enumerate().map(|(i, s)| (s.addr, s.addr + s.len, i as u32)).collect();
        segs.sort();
        assert_eq!(free, segs);
        assert_eq!(alloc.stats().free, self.total());
    }
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![8 => 1u64..=64, 3 => 65u64..=512, 1 => 513u64..=2048]
}

/// An alignment and 1–3 segments, some adjacent (gap 0), with distinct rkeys.
fn layout() -> impl Strategy<Value = (u64, Vec<RemoteRegion>)> {
    let segs = prop::collection::vec((0u64..=2, 1u64..=48), 1..=3);
    (prop::sample::select(vec![1u64, 8, 64]), segs).prop_map(|(align, segs)| {
        let mut base = 0x1_0000;
        let mut out = Vec::new();
        for (i, (gap, units)) in segs.into_iter().enumerate() {
            base += gap * 4096;
            out.push(RemoteRegion::new(base, units * 128, 100 + i as u32));
            base += units * 128;
        }
        (align, out)
    })
}

#[derive(Clone, Debug)]
enum Op {
    Alloc(u64),
    Free(Index),
    Consume(Index),
    Sync,
    /// `rfree` of an arbitrary address near the segments.
    BogusFree(u64),
    /// A batch returning part of a range that is already free.
    ForgedBatch(Index),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        6 => size().prop_map(Op::Alloc),
        4 => any::<Index>().prop_map(Op::Free),
        1 => any::<Index>().prop_map(Op::Consume),
        1 => Just(Op::Sync),
        1 => (0x1_0000u64 - 64..0x1_0000 + 5 * 8192).prop_map(Op::BogusFree),
        1 => any::<Index>().prop_map(Op::ForgedBatch),
    ];
    prop::collection::vec(op, 1..200)
}

fn check_exhausted(p: &Pair, size: u64, e: HeapError) {
    let s = p.alloc.stats();
    match e {
        HeapError::Exhausted { requested, largest_free, total_free } => {
            assert_eq!(Some(requested), p.alloc.rounded_size(size));
            assert!(largest_free < requested);
            assert_eq!((largest_free, total_free), (s.largest_free, s.free));
        }
        e => panic!("alloc({size}): {e}"),
    }
}

proptest! {
    /// Random allocations and frees, per policy, synchronised by the policy's mode, against
    /// the model; bogus frees and forged batches are refused without effect; freeing
    /// everything gives every segment back whole.
    #[test]
    fn policies_against_the_model((align, segs) in layout(), ops in ops()) {
        for policy in AllocPolicy::ALL {
            let config = HeapConfig::new(H, policy).with_align(align).expect("align");
            let mut p = Pair::new(config, &segs);
            let mut m = Model::new(&segs, align);
            for op in &ops {
                match *op {
                    Op::Alloc(size) => match p.alloc(size) {
                        Ok((b, freed)) => {
                            m.handed_out(b, size, true);
                            m.returned(&freed);
                        }
                        Err(e) => check_exhausted(&p, size, e),
                    },
                    Op::Free(ref i) => {
                        if let Some(addr) = m.pick(i, |o| !o.freed) {
                            assert_eq!(p.owner.rfree(addr).map(|b| b.addr), Ok(addr));
                            m.out.get_mut(&addr).expect("out").freed = true;
                        }
                    }
                    Op::Consume(ref i) => {
                        if let Some(addr) = m.pick(i, |o| !o.freed) {
                            p.owner.consume(addr).expect("consume");
                            assert_eq!(p.owner.state(addr), Some(OwnerBlockState::InUse));
                        }
                    }
                    Op::Sync => {
                        let batch = p.sync();
                        m.returned(&batch);
                    }
                    Op::BogusFree(addr) => {
                        let live = m.out.get(&addr).is_some_and(|o| !o.freed);
                        let before = p.owner.stats();
                        match p.owner.rfree(addr) {
                            Ok(b) => {
                                assert!(live);
                                assert_eq!(b.addr, addr);
                                m.out.get_mut(&addr).expect("out").freed = true;
                            }
                            Err(HeapError::UnknownBlock { .. } | HeapError::DoubleFree { .. }) => {
                                assert!(!live);
                                assert_eq!(p.owner.stats(), before);
                            }
                            Err(e) => panic!("rfree({addr:#x}): {e}"),
                        }
                    }
                    Op::ForgedBatch(ref i) => {
                        // Part of a free range, alone or beside a block the allocator
                        // handed out (so that its insertion is rolled back).
                        let free: Vec<(u64, u64, u32)> = p.alloc.free_ranges().collect();
                        if !free.is_empty() {
                            let (start, end, _) = free[i.index(free.len())];
                            let mut ranges = vec![FreeRange { addr: start, len: (end - start).min(align) }];
                            if let Some(addr) = m.pick(i, |_| true) {
                                ranges.push(FreeRange { addr, len: m.out[&addr].block.len });
                                ranges.sort_by_key(|r| r.addr);
                            }
                            let (stats, before) = (p.alloc.stats(), p.alloc.free_ranges().collect::<Vec<_>>());
                            let forged = FreeBatch::new(H, p.alloc.expected_batch(), ranges).expect("batch");
                            assert_eq!(p.alloc.apply_free_batch(&forged), Err(HeapError::DoubleFree { addr: start }));
                            assert_eq!(p.alloc.stats(), stats);
                            assert_eq!(p.alloc.free_ranges().collect::<Vec<_>>(), before);
                        }
                    }
                }
                m.check(&p.alloc);
            }
            for addr in m.out.keys().copied().collect::<Vec<_>>() {
                if !m.out[&addr].freed {
                    p.owner.rfree(addr).expect("free");
                    m.out.get_mut(&addr).expect("out").freed = true;
                }
            }
            let batch = p.sync();
            m.returned(&batch);
            m.check_all_free(&p.alloc);
            let o = p.owner.stats();
            prop_assert_eq!((o.held_blocks, o.freed_blocks), (0, 0));
        }
    }
}

#[derive(Clone, Debug)]
enum Step {
    Alloc(u64),
    /// The owner receives the oldest notice in flight.
    DeliverNotice,
    /// The owner's consumer frees one of the blocks it knows.
    OwnerFree(Index),
    /// The owner cuts a batch of at most this many ranges; it goes in flight.
    CutBatch(usize),
    /// The allocating side receives the oldest batch or acknowledgement in flight.
    Deliver,
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        5 => size().prop_map(Step::Alloc),
        3 => Just(Step::DeliverNotice),
        4 => any::<Index>().prop_map(Step::OwnerFree),
        2 => (1usize..=4).prop_map(Step::CutBatch),
        2 => Just(Step::Deliver),
    ];
    prop::collection::vec(step, 1..300)
}

/// The two sides with messages in flight between them, each message encoded and decoded.
struct Wire {
    p: Pair,
    m: Model,
    to_owner: VecDeque<Vec<u8>>,
    to_alloc: VecDeque<Vec<u8>>,
}

impl Wire {
    fn deliver_notice(&mut self) {
        let Some(bytes) = self.to_owner.pop_front() else { return };
        let notice = AllocNotice::decode(&bytes).expect("notice decodes");
        match self.p.alloc.config().sync() {
            SyncMode::Deferred => self.p.owner.register(&notice).expect("owner never sees a conflict"),
            SyncMode::Immediate => {
                let ack = self.p.owner.acknowledge(&notice).expect("owner never sees a conflict");
                self.to_alloc.push_back(ack.encode());
            }
        }
        self.m.out.get_mut(&notice.block.addr).expect("in flight").known = true;
    }

    fn deliver(&mut self) {
        let Some(bytes) = self.to_alloc.pop_front() else { return };
        match HeapMessage::decode(&bytes).expect("message decodes") {
            HeapMessage::FreeBatch(batch) => {
                self.p.alloc.apply_free_batch(&batch).expect("batch applies");
                self.m.returned(&batch);
            }
            HeapMessage::AllocAck(ack) => {
                let block = self.p.alloc.confirm(&ack).expect("ack confirms");
                assert_eq!(block.addr, ack.addr);
                self.m.returned(&ack.freed);
            }
            HeapMessage::AllocNotice(n) => panic!("notice sent to the allocator: {n:?}"),
        }
    }

    fn cut(&mut self, max: usize) {
        let batch = self.p.owner.take_free_batch(max);
        if !batch.is_empty() {
            self.to_alloc.push_back(HeapMessage::from(batch).encode());
        }
    }
}

proptest! {
    /// The owner/allocator protocol with notices, acknowledgements and batches delivered
    /// late (but in order, as on one RC connection) and through the wire encoding: the
    /// allocator never hands out a range the owner holds or that is still in flight, the
    /// owner never sees a conflicting notice, every batch returns only freed blocks, and
    /// draining everything gives the heap back whole.
    #[test]
    fn protocol_with_late_delivery((align, segs) in layout(), steps in steps()) {
        for policy in AllocPolicy::ALL {
            let config = HeapConfig::new(H, policy).with_align(align).expect("align");
            let mut w = Wire {
                p: Pair::new(config, &segs),
                m: Model::new(&segs, align),
                to_owner: VecDeque::new(),
                to_alloc: VecDeque::new(),
            };
            for step in &steps {
                match *step {
                    Step::Alloc(size) => match w.p.alloc.alloc(size) {
                        Ok(b) => {
                            w.m.handed_out(b, size, false);
                            w.to_owner.push_back(AllocNotice::new(H, b).encode().to_vec());
                        }
                        Err(e) => check_exhausted(&w.p, size, e),
                    },
                    Step::DeliverNotice => w.deliver_notice(),
                    Step::OwnerFree(ref i) => {
                        if let Some(addr) = w.m.pick(i, |o| o.known && !o.freed) {
                            w.p.owner.rfree(addr).expect("free");
                            w.m.out.get_mut(&addr).expect("out").freed = true;
                        }
                    }
                    Step::CutBatch(max) => w.cut(max),
                    Step::Deliver => w.deliver(),
                }
                w.m.check(&w.p.alloc);
                if config.sync() == SyncMode::Immediate {
                    let unconfirmed = w.to_owner.len()
                        + w.to_alloc.iter().filter(|b| b[0] == 3).count();
                    prop_assert_eq!(w.p.alloc.pending_count(), unconfirmed);
                }
            }
            while !w.to_owner.is_empty() {
                w.deliver_notice();
            }
            for addr in w.m.out.keys().copied().collect::<Vec<_>>() {
                if !w.m.out[&addr].freed {
                    w.p.owner.rfree(addr).expect("free");
                    w.m.out.get_mut(&addr).expect("out").freed = true;
                }
            }
            w.cut(usize::MAX);
            while !w.to_alloc.is_empty() {
                w.deliver();
            }
            w.m.check_all_free(&w.p.alloc);
            prop_assert_eq!(w.p.alloc.pending_count(), 0);
        }
    }
}

fn batch_strategy() -> impl Strategy<Value = FreeBatch> {
    (any::<u32>(), any::<u64>(), prop::collection::vec((0u64..1 << 20, 1u64..1 << 20), 0..20)).prop_map(
        |(heap, seq, parts)| {
            let mut at = 0;
            let ranges = parts
                .into_iter()
                .map(|(gap, len)| {
                    at += gap;
                    let r = FreeRange { addr: at, len };
                    at += len;
                    r
                })
                .collect();
            FreeBatch::new(HeapId(heap), seq, ranges).expect("sorted ranges")
        },
    )
}

fn message_strategy() -> impl Strategy<Value = HeapMessage> {
    let notice = (any::<u32>(), any::<u64>(), 1u64..1 << 40, any::<u32>(), any::<u32>()).prop_map(
        |(heap, addr, len, rkey, segment)| {
            let addr = addr.min(u64::MAX - len);
            HeapMessage::AllocNotice(AllocNotice::new(HeapId(heap), RemoteBlock { addr, len, rkey, segment }))
        },
    );
    let ack = (batch_strategy(), any::<u64>(), 1u64..1 << 40).prop_map(|(freed, addr, len)| {
        HeapMessage::AllocAck(AllocAck { heap: freed.heap(), addr: addr.min(u64::MAX - len), len, freed })
    });
    prop_oneof![batch_strategy().prop_map(HeapMessage::FreeBatch), notice, ack]
}

/// Decodes `bytes` every way; whatever is accepted re-encodes to exactly `bytes`.
fn decode_all(bytes: &[u8]) {
    if let Ok(m) = HeapMessage::decode(bytes) {
        assert_eq!(m.encode(), bytes);
    }
    if let Ok(b) = FreeBatch::decode(bytes) {
        assert_eq!(b.encode(), bytes);
    }
    if let Ok(n) = AllocNotice::decode(bytes) {
        assert_eq!(n.encode(), bytes);
    }
    if let Ok(a) = AllocAck::decode(bytes) {
        assert_eq!(a.encode(), bytes);
    }
}

proptest! {
    #[test]
    fn wire_round_trip(m in message_strategy()) {
        let bytes = m.encode();
        prop_assert_eq!(HeapMessage::decode(&bytes), Ok(m.clone()));
        for cut in 0..bytes.len() {
            prop_assert!(HeapMessage::decode(&bytes[..cut]).is_err());
        }
    }

    #[test]
    fn wire_garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..160)) {
        decode_all(&bytes);
    }

    #[test]
    fn wire_mutations_never_panic(
        m in message_strategy(),
        edits in prop::collection::vec((any::<Index>(), any::<u8>()), 1..4),
        cut in any::<Index>(),
    ) {
        let mut bytes = m.encode();
        for (i, v) in edits {
            let i = i.index(bytes.len());
            bytes[i] = v;
        }
        decode_all(&bytes);
        decode_all(&bytes[..cut.index(bytes.len() + 1)]);
    }
}
