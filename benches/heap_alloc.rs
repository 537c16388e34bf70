//! Remote-heap allocator throughput per policy: the transport-independent core of
//! rmalloc/rfree under a realistic size mix.
//!
//! Sizes come from a fixed seeded distribution (70% 8–256 B, 25% 256 B–4 KiB, 5% 4–64 KiB)
//! over a working set of 1024 live blocks in a 16 MiB segment; the owner frees live blocks
//! chosen at random and the allocating side allocates replacements, with the
//! synchronisation each mode needs:
//!
//! - deferred (next-fit, first-fit; best/worst-fit `_deferred`): each allocation is
//!   registered with the owner; the owner's `rfree` feeds its free list, and every 32 frees
//!   a batch is taken (sorted, coalesced) and applied by the allocator;
//! - immediate (best-fit, worst-fit): each allocation is acknowledged by the owner, and the
//!   acknowledgement (carrying the frees since the previous one) confirmed by the allocator.
//!
//! Two measurements, in operations per second where a free and an allocation are one
//! operation each:
//!
//! - `two_sided`: both sides in one thread, everything timed: the owner's register, rfree
//!   and batch building as well as the allocator's alloc and batch application.
//! - `allocator_side`: the same work in rounds of 32 frees and 32 allocations, timing only
//!   what the allocating host runs (applying the batch or acknowledgements, allocating);
//!   the owner's part runs on its own host in a deployment and is left out of the clock.
//!
//! Goals: next-fit ≥ 20 M ops/s; best/worst-fit within 2× of next-fit.
//!
//! `cargo bench --bench heap_alloc`; steady-state fragmentation is printed per policy.

#![allow(missing_docs)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rdmakit::RemoteRegion;
use rdmakit::memory::heap::*;

const HEAP: HeapId = HeapId(1);
const LIVE: usize = 1024;
const SEGMENT: RemoteRegion = RemoteRegion::new(0x7f00_0000_0000, 16 << 20, 0x4242);
/// Frees per batch (deferred) and cycles per round (`allocator_side`).
const BATCH_EVERY: u32 = 32;
const SCRIPT_LEN: usize = 1 << 16;

/// splitmix64: a fixed, seeded, dependency-free generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    fn size(&mut self) -> u64 {
        match self.next() % 100 {
            0..70 => self.between(8, 256),
            70..95 => self.between(257, 4096),
            _ => self.between(4097, 64 << 10),
        }
    }
}

struct Rig {
    alloc: HeapAllocator,
    owner: HeapOwner,
    live: Vec<u64>,
    /// Pre-drawn (size, victim) pairs, replayed in a loop.
    script: Vec<(u64, u32)>,
    step: usize,
    frees_since_batch: u32,
}

impl Rig {
    fn new(config: HeapConfig) -> Self {
        let mut alloc = HeapAllocator::new(config);
        let mut owner = HeapOwner::new(HEAP);
        owner.add_segment(SEGMENT).expect("segment");
        alloc.add_segment(SEGMENT).expect("segment");
        let mut rng = Rng(0x5eed);
        let script = (0..SCRIPT_LEN).map(|_| (rng.size(), rng.next() as u32)).collect();
        let mut rig =
            Rig { alloc, owner, live: Vec::with_capacity(LIVE), script, step: 0, frees_since_batch: 0 };
        for _ in 0..LIVE {
            let size = rig.next().0;
            let addr = rig.allocate(size);
            rig.live.push(addr);
        }
        for _ in 0..4 * SCRIPT_LEN {
            rig.cycle(); // reach the steady state's fragmentation
        }
        rig
    }

    fn next(&mut self) -> (u64, u32) {
        let s = self.script[self.step];
        self.step = (self.step + 1) % SCRIPT_LEN;
        s
    }

    fn sync_frees(&mut self) {
        let batch = self.owner.take_free_batch(usize::MAX);
        self.alloc.apply_free_batch(&batch).expect("apply");
        self.frees_since_batch = 0;
    }

    /// Allocates `size` bytes with the synchronisation of the heap's mode.
    fn allocate(&mut self, size: u64) -> u64 {
        let block = match self.alloc.alloc(size) {
            Ok(b) => b,
            Err(HeapError::Exhausted { .. }) => {
                self.sync_frees();
                self.alloc.alloc(size).expect("16 MiB holds the working set")
            }
            Err(e) => panic!("{e}"),
        };
        let notice = AllocNotice::new(HEAP, block);
        match self.alloc.config().sync() {
            SyncMode::Deferred => self.owner.register(&notice).expect("register"),
            SyncMode::Immediate => {
                let ack = self.owner.acknowledge(&notice).expect("acknowledge");
                self.alloc.confirm(&ack).expect("confirm");
                self.frees_since_batch = 0;
            }
        }
        block.addr
    }

    /// One free (a random live block, on the owner's side) and one allocation.
    fn cycle(&mut self) {
        let (size, victim) = self.next();
        let k = victim as usize % LIVE;
        self.owner.rfree(self.live[k]).expect("rfree");
        self.frees_since_batch += 1;
        if self.frees_since_batch >= BATCH_EVERY {
            self.sync_frees();
        }
        self.live[k] = self.allocate(size);
    }

    /// 32 frees and 32 allocations; returns the time the allocating side spent.
    fn round(&mut self) -> Duration {
        // 32 distinct victims drawn at random. (They were once 32 steps of stride 37 through
        // `live`: one cycle through every index, in the order next-fit had handed out
        // consecutive addresses, so next-fit's frees came back as runs, about 2.9 ranges per
        // 32 frees, and its batches cost a tenth of what random frees cost.)
        let mut victims = [0usize; BATCH_EVERY as usize];
        let mut drawn = 0;
        while drawn < victims.len() {
            let k = self.next().1 as usize % LIVE;
            if !victims[..drawn].contains(&k) {
                victims[drawn] = k;
                drawn += 1;
            }
        }
        for &k in &victims {
            self.owner.rfree(self.live[k]).expect("rfree");
        }
        let mut blocks = [None; BATCH_EVERY as usize];
        let mut spent;
        match self.alloc.config().sync() {
            SyncMode::Deferred => {
                let batch = self.owner.take_free_batch(usize::MAX);
                let t = Instant::now();
                self.alloc.apply_free_batch(&batch).expect("apply");
                for b in &mut blocks {
                    let size = self.next().0;
                    *b = Some(self.alloc.alloc(size).expect("alloc"));
                }
                spent = t.elapsed();
                for b in blocks.iter().flatten() {
                    self.owner.register(&AllocNotice::new(HEAP, *b)).expect("register");
                }
            }
            SyncMode::Immediate => {
                let t = Instant::now();
                for b in &mut blocks {
                    let size = self.next().0;
                    *b = Some(self.alloc.alloc(size).expect("alloc"));
                }
                spent = t.elapsed();
                let acks: Vec<AllocAck> = blocks
                    .iter()
                    .flatten()
                    .map(|b| self.owner.acknowledge(&AllocNotice::new(HEAP, *b)).expect("acknowledge"))
                    .collect();
                let t = Instant::now();
                for ack in &acks {
                    self.alloc.confirm(ack).expect("confirm");
                }
                spent += t.elapsed();
            }
        }
        for (&k, b) in victims.iter().zip(blocks.iter().flatten()) {
            self.live[k] = b.addr;
        }
        spent
    }
}

fn cases() -> [(&'static str, HeapConfig); 6] {
    [
        ("next_fit", HeapConfig::new(HEAP, AllocPolicy::NextFit)),
        ("first_fit", HeapConfig::new(HEAP, AllocPolicy::FirstFit)),
        ("best_fit", HeapConfig::new(HEAP, AllocPolicy::BestFit)),
        ("worst_fit", HeapConfig::new(HEAP, AllocPolicy::WorstFit)),
        ("best_fit_deferred", HeapConfig::new(HEAP, AllocPolicy::BestFit).with_sync(SyncMode::Deferred)),
        ("worst_fit_deferred", HeapConfig::new(HEAP, AllocPolicy::WorstFit).with_sync(SyncMode::Deferred)),
    ]
}

fn two_sided(c: &mut Criterion) {
    let mut group = c.benchmark_group("heap_alloc/two_sided");
    group.throughput(Throughput::Elements(2));
    for (name, config) in cases() {
        // Built on first use, so that benches filtered out cost nothing.
        let mut rig = None;
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            let rig = rig.get_or_insert_with(|| Rig::new(config));
            b.iter(|| black_box(&mut *rig).cycle())
        });
        let Some(rig) = rig else { continue };
        let s = rig.alloc.stats();
        println!(
            "{name}: {LIVE} live, {} KiB free in {} ranges, largest {} KiB, fragmentation {:.3}",
            s.free >> 10,
            s.free_blocks,
            s.largest_free >> 10,
            s.fragmentation
        );
    }
    group.finish();
}

fn allocator_side(c: &mut Criterion) {
    let mut group = c.benchmark_group("heap_alloc/allocator_side");
    group.throughput(Throughput::Elements(2 * u64::from(BATCH_EVERY)));
    for (name, config) in cases() {
        let mut rig = None;
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            let rig = rig.get_or_insert_with(|| Rig::new(config));
            b.iter_custom(|rounds| (0..rounds).map(|_| black_box(&mut *rig).round()).sum())
        });
    }
    group.finish();
}

criterion_group!(benches, two_sided, allocator_side);
criterion_main!(benches);
