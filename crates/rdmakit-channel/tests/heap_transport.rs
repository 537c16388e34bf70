//! Remote heaps between two endpoints on the soft NIC, in one process and over soft TCP:
//! rmalloc → write → consume → rfree rounds with checksums, growth and refusal, both
//! synchronisation modes, and a peer that goes away.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rdmakit_channel::ChannelError;
use rdmakit_channel::control::Message;
use rdmakit_channel::heap::{FREE_BATCH_BLOCKS, HeapEndpoint, LandedBlock, OwnerLimits};

const FREE: u64 = FREE_BATCH_BLOCKS as u64;
use rdmakit_memory::heap::{AllocPolicy, HeapConfig, HeapError, HeapId};
use rdmakit_verbs::cm::{CmOptions, Listener, connect};
use rdmakit_verbs::*;

const T: Duration = Duration::from_secs(10);

mod common;

fn in_process(limits: OwnerLimits) -> (HeapEndpoint, HeapEndpoint, ProtectionDomain) {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (a, b) = common::heap_endpoints(&pd, limits, T);
    (a, b, pd)
}

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x1000_0000_01b3))
}

/// Creates `config`'s heap from `alloc` while `owner` answers in another thread.
fn create(alloc: &mut HeapEndpoint, owner: &mut HeapEndpoint, config: HeapConfig, len: u64) {
    while_serving(owner, || alloc.create_heap(config, len).unwrap());
}

/// Runs `f` while another thread takes `owner`'s messages in (answers its requests).
fn while_serving<R>(owner: &mut HeapEndpoint, f: impl FnOnce() -> R) -> R {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                owner.poll_messages().unwrap();
            }
        });
        let r = f();
        stop.store(true, Ordering::Relaxed);
        server.join().unwrap();
        r
    })
}

#[test]
fn next_fit_deferred_round_trips_with_checksums() {
    let (mut a, mut b, pd) =
        in_process(OwnerLimits::default().with_segment_len(256 << 10).with_max_heap_bytes(1 << 20));
    let heap = HeapId(1);
    create(&mut a, &mut b, HeapConfig::new(heap, AllocPolicy::NextFit), 256 << 10);
    let src = pd.alloc_mr(64 << 10, AccessFlags::LOCAL_WRITE).unwrap();
    let mut sent = HashMap::new();
    let mut held: VecDeque<LandedBlock> = VecDeque::new();
    for i in 0..300usize {
        let len = 1 + (i * 7919) % (40 << 10);
        let data: Vec<u8> = (0..len).map(|j| (i * 31 + j * 7) as u8).collect();
        src.write_at(0, &data).unwrap();
        // Deferred mode: the owner side only has to poll; growth requests need an answer,
        // so the owner polls before each allocation as a service loop would.
        b.poll_messages().unwrap();
        let block = match a.rmalloc(heap, len as u64) {
            Ok(bl) => bl,
            Err(e) => panic!("rmalloc {i}: {e}"),
        };
        for l in &held {
            let (x, n) = (l.block().addr, l.block().len);
            assert!(block.addr + block.len <= x || x + n <= block.addr, "overlaps a block the owner holds");
        }
        a.write(heap, &block, 0, src.slice(0, len as u32).unwrap()).unwrap();
        sent.insert(block.addr, (len, checksum(&data)));
        let landed = b.recv_block(heap).unwrap();
        let (len, sum) = sent[&landed.block().addr];
        let mut got = vec![0u8; len];
        b.read(&landed, 0, &mut got).unwrap();
        assert_eq!(checksum(&got), sum, "message {i}");
        held.push_back(landed);
        while held.len() > 3 {
            b.rfree(held.pop_front().unwrap()).unwrap();
        }
    }
    for l in held {
        b.rfree(l).unwrap();
    }
    b.flush_frees(heap).unwrap();
    a.poll_messages().unwrap();
    let s = a.heap_stats(heap).unwrap();
    assert_eq!(s.free, s.total, "freeing everything restores full capacity: {s:?}");
}

#[test]
fn best_and_worst_fit_synchronise_immediately() {
    for (id, policy) in [(2, AllocPolicy::BestFit), (3, AllocPolicy::WorstFit)] {
        let (mut a, mut b, pd) = in_process(OwnerLimits::default());
        let heap = HeapId(id);
        create(&mut a, &mut b, HeapConfig::new(heap, policy), 128 << 10);
        // The owner must answer each allocation while the allocating side waits.
        let owner = std::thread::spawn(move || {
            for n in 0..100u32 {
                let landed = b.recv_block(heap).unwrap();
                let mut first = [0u8; 1];
                b.read(&landed, 0, &mut first).unwrap();
                assert_eq!(first[0], n as u8);
                b.rfree(landed).unwrap();
            }
            b
        });
        let src = pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE).unwrap();
        for i in 0..100u32 {
            let len = 64 + (i * 131) % 8000;
            src.write_at(0, &[i as u8]).unwrap();
            let block = a.rmalloc(heap, u64::from(len)).unwrap();
            a.write(heap, &block, 0, src.slice(0, len).unwrap()).unwrap();
        }
        let b = owner.join().unwrap();
        assert_eq!(b.owner_stats(heap).unwrap().held_blocks, 0, "{policy:?}");
    }
}

#[test]
fn growth_is_granted_then_refused_at_the_limit() {
    let (mut a, mut b, pd) =
        in_process(OwnerLimits::default().with_segment_len(64 << 10).with_max_heap_bytes(192 << 10));
    let heap = HeapId(4);
    create(&mut a, &mut b, HeapConfig::new(heap, AllocPolicy::NextFit), 64 << 10);
    let src = pd.alloc_mr(32 << 10, AccessFlags::LOCAL_WRITE).unwrap();
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let done2 = done.clone();
    let owner = std::thread::spawn(move || {
        // Holds everything it receives: nothing is ever freed; answers growth requests.
        let mut held = Vec::new();
        while !done2.load(Ordering::Relaxed) {
            b.poll_messages().unwrap();
            while let Some(l) = b.try_recv_block(heap).unwrap() {
                held.push(l);
            }
        }
        held.len()
    });
    for _ in 0..6 {
        let block = a.rmalloc(heap, 32 << 10).unwrap();
        a.write(heap, &block, 0, src.slice(0, 32 << 10).unwrap()).unwrap();
    }
    assert_eq!(a.heap_stats(heap).unwrap().segments, 3);
    let err = a.rmalloc(heap, 32 << 10).unwrap_err();
    assert!(matches!(err, ChannelError::Heap(HeapError::GrowthRefused { .. })), "{err}");
    done.store(true, Ordering::Relaxed);
    assert_eq!(owner.join().unwrap(), 6);
}

#[test]
fn over_soft_tcp_and_a_peer_that_goes_away() {
    let ctx = Context::open_soft();
    let listener = Listener::bind(&ctx, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let heap = HeapId(9);
    let server = std::thread::spawn(move || {
        let pd = listener.context().alloc_pd().unwrap();
        let conn = listener.accept(&pd, &CmOptions::default(), b"").unwrap();
        let mut b = HeapEndpoint::from_connection(conn, OwnerLimits::default(), T).unwrap();
        let mut sums = Vec::new();
        let deadline = Instant::now() + T;
        while sums.len() < 50 && Instant::now() < deadline {
            b.poll_messages().unwrap();
            while let Some(l) = b.try_recv_block(heap).ok().flatten() {
                let mut buf = vec![0u8; 1000];
                b.read(&l, 0, &mut buf).unwrap();
                sums.push(checksum(&buf));
                b.rfree(l).unwrap();
            }
        }
        sums // dropping `b` closes the connection
    });
    let pd = ctx.alloc_pd().unwrap();
    let conn = connect(&pd, addr, &CmOptions::default(), b"").unwrap();
    let mut a = HeapEndpoint::from_connection(conn, OwnerLimits::default(), Duration::from_secs(2)).unwrap();
    a.create_heap(HeapConfig::new(heap, AllocPolicy::NextFit), 1 << 20).unwrap();
    let src = pd.alloc_mr(1000, AccessFlags::LOCAL_WRITE).unwrap();
    let mut expect = Vec::new();
    for i in 0..50u32 {
        let data: Vec<u8> = (0..1000u32).map(|j| (i ^ j) as u8).collect();
        src.write_at(0, &data).unwrap();
        expect.push(checksum(&data));
        let block = a.rmalloc(heap, 1000).unwrap();
        a.write(heap, &block, 0, src.local().unwrap()).unwrap();
    }
    assert_eq!(server.join().unwrap(), expect);
    // The owner is gone: writing fails with an error (an error completion or a time-out),
    // never a hang.
    let started = Instant::now();
    let err = loop {
        match a.rmalloc(heap, 1000).and_then(|b| a.write(heap, &b, 0, src.local().unwrap())) {
            Ok(()) => assert!(started.elapsed() < Duration::from_secs(60), "still succeeding"),
            Err(e) => break e,
        }
    };
    assert!(err.is_peer_gone(), "{err}");
}

/// Attack 5: a malformed message followed, in the same poll, by a valid `Create`: the
/// error is reported, but the `Create` is processed (a grant comes back) and its slot
/// reposted.
#[test]
fn a_malformed_message_does_not_lose_the_valid_one_behind_it() {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let (ca, cb) = (ctx.create_cq(64).unwrap(), ctx.create_cq(1024).unwrap());
    let raw = pd.create_qp(&ca, &ca, QpCaps::default()).unwrap();
    let b = pd.create_qp(&cb, &cb, QpCaps::default()).unwrap();
    raw.connect(&b.address().unwrap(), &ConnectOptions::default()).unwrap();
    b.connect(&raw.address().unwrap(), &ConnectOptions::default()).unwrap();
    let mut owner = HeapEndpoint::new(b, cb, OwnerLimits::default(), T).unwrap();
    let answer = pd.alloc_mr(16 << 10, AccessFlags::LOCAL_WRITE).unwrap();
    raw.post_recv(RecvWr::new(answer.local().unwrap())).unwrap();
    let out = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    let create =
        Message::HeapCreate { config: HeapConfig::new(HeapId(7), AllocPolicy::NextFit), len: 64 << 10 }
            .encode();
    let malformed = &create[..2]; // a Create cut short
    out.write_at(0, malformed).unwrap();
    out.write_at(64, &create).unwrap();
    raw.post_send(SendWr::send(out.slice(0, malformed.len() as u32).unwrap())).unwrap();
    raw.post_send(SendWr::send(out.slice(64, create.len() as u32).unwrap())).unwrap();
    for _ in 0..2 {
        assert!(ca.wait(Some(T)).unwrap().status.is_success());
    }
    // Both messages are in the owner's CQ now: one poll reaps both.
    let first = owner.poll_messages();
    assert!(first.is_err(), "the malformed message must be reported");
    let _ = owner.poll_messages();
    let wc = ca.wait(Some(Duration::from_secs(3))).expect("the Create behind the malformed message was lost");
    assert!(wc.status.is_success() && wc.opcode == WcOpcode::RECV, "{wc:?}");
    assert_eq!(owner.owner_stats(HeapId(7)).unwrap().total, 1 << 20);
}

/// A peer may not make this side register more than `max_total_bytes` across all the
/// heaps it creates (the per-heap limit alone let it create heaps without end).
#[test]
fn heaps_a_peer_creates_are_bounded_in_total() {
    let limits = OwnerLimits::default()
        .with_segment_len(64 << 10)
        .with_max_heap_bytes(1 << 20)
        .with_max_total_bytes(256 << 10);
    let (mut a, mut b, _pd) = in_process(limits);
    for h in 0..4 {
        create(&mut a, &mut b, HeapConfig::new(HeapId(h), AllocPolicy::NextFit), 64 << 10);
    }
    let stop = AtomicBool::new(false);
    let err = std::thread::scope(|s| {
        let server = s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                b.poll_messages().unwrap();
            }
        });
        let err = a.create_heap(HeapConfig::new(HeapId(4), AllocPolicy::NextFit), 64 << 10).unwrap_err();
        stop.store(true, Ordering::Relaxed);
        server.join().unwrap();
        err
    });
    assert!(matches!(err, ChannelError::Heap(HeapError::GrowthRefused { .. })), "{err}");
    assert!(b.owner_stats(HeapId(4)).is_err(), "a refused heap leaves nothing behind");
}

/// Answers nobody asked for pile up only to a bound: beyond it, a protocol error.
#[test]
fn unsolicited_answers_are_bounded() {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let (ca, cb) = (ctx.create_cq(4096).unwrap(), ctx.create_cq(4096).unwrap());
    let raw = pd.create_qp(&ca, &ca, QpCaps::default().with_max_inline_data(64)).unwrap();
    let b = pd.create_qp(&cb, &cb, QpCaps::default()).unwrap();
    raw.connect(&b.address().unwrap(), &ConnectOptions::default()).unwrap();
    b.connect(&raw.address().unwrap(), &ConnectOptions::default()).unwrap();
    let mut ep = HeapEndpoint::new(b, cb, OwnerLimits::default(), T).unwrap();
    let freed = Message::HeapFreed { heap: HeapId(3) }.encode();
    let mut err = None;
    for i in 0..1100 {
        raw.post_send(SendWr::send_inline(&freed)).unwrap();
        assert!(ca.wait(Some(T)).unwrap().status.is_success());
        if i % 16 == 15
            && let Err(e) = ep.poll_messages()
        {
            err = Some(e);
            break;
        }
    }
    let err = err.or_else(|| ep.poll_messages().err()).expect("1100 unasked answers must be refused");
    assert!(matches!(err, ChannelError::Protocol(_)), "{err}");
}

/// The rpipe seed's writer, line by line: `addr = rmalloc(rp, size); ptr = rmem(rp, addr);
/// *ptr = SEND_VAL; rwrite(rp, addr)`, then the reader's `rread`/`rmem`/`rfree`. The view is
/// staged by copy and in place (`as_mut_slice` after the previous `rwrite` returned), and
/// reused; what lands is checked byte for byte.
#[test]
fn rmem_views_stage_blocks_before_rwrite() {
    const SEND_VAL: u32 = 0x5eed_0042;
    let (mut a, mut b, _pd) = in_process(OwnerLimits::default().with_segment_len(64 << 10));
    let heap = HeapId(7);
    create(&mut a, &mut b, HeapConfig::new(heap, AllocPolicy::NextFit), 64 << 10);

    // addr = rmalloc(rp, sizeof(int)); ptr = rmem(rp, addr); *ptr = SEND_VAL; rwrite(rp, addr);
    let addr = a.rmalloc(heap, 4).unwrap();
    let mut ptr = a.rmem(heap, &addr).unwrap();
    assert_eq!(ptr.block(), addr);
    assert_eq!(ptr.to_vec().unwrap(), vec![0u8; addr.len as usize], "a fresh view is zeroed");
    // SAFETY: no rwrite of this view has been posted yet.
    unsafe { ptr.as_mut_slice()[..4].copy_from_slice(&SEND_VAL.to_le_bytes()) };
    a.rwrite(&ptr).unwrap();
    // Reader: rread(rp, addr, sizeof(int)); ptr = rmem(rp, addr); ...; rfree(addr);
    let landed = b.recv_block(heap).unwrap();
    assert_eq!(landed.block(), addr);
    let mut got = [0u8; 4];
    b.read(&landed, 0, &mut got).unwrap();
    assert_eq!(u32::from_le_bytes(got), SEND_VAL);
    b.rfree(landed).unwrap();

    // Larger blocks, staged by copy, in place, and a view reused after its rwrite returned.
    for i in 0..20u64 {
        let len = 100 + i * 997;
        let block = a.rmalloc(heap, len).unwrap();
        let mut view = a.rmem(heap, &block).unwrap();
        let data: Vec<u8> = (0..len).map(|j| (i * 13 + j * 7) as u8).collect();
        if i % 2 == 0 {
            view.write_at(0, &data).unwrap();
        } else {
            // SAFETY: this view has not been written yet.
            unsafe { view.as_mut_slice()[..len as usize].copy_from_slice(&data) };
        }
        a.rwrite(&view).unwrap();
        let landed = b.recv_block(heap).unwrap();
        let mut out = vec![0u8; len as usize];
        b.read(&landed, 0, &mut out).unwrap();
        assert_eq!(checksum(&out), checksum(&data), "block {i}");
        b.rfree(landed).unwrap();
        // Rewritten in place after rwrite returned (the NIC is done with it), and sent to
        // a second block.
        // SAFETY: the only rwrite of `view` returned Ok.
        unsafe { view.as_mut_slice().fill(0xa5) };
        let again = a.rmalloc(heap, view.len()).unwrap();
        let view2 = a.rmem(heap, &again).unwrap();
        view2.write_at(0, &view.to_vec().unwrap()).unwrap();
        a.rwrite(&view2).unwrap();
        let landed = b.recv_block(heap).unwrap();
        let mut out = vec![0u8; landed.len() as usize];
        b.read(&landed, 0, &mut out).unwrap();
        assert!(out.iter().all(|&x| x == 0xa5), "block {i}'s second write");
        b.rfree(landed).unwrap();
        b.flush_frees(heap).unwrap();
    }

    // Bad input is a typed error: an out-of-range copy, another heap, a forged block.
    let block = a.rmalloc(heap, 64).unwrap();
    let view = a.rmem(heap, &block).unwrap();
    assert!(view.write_at(60, &[0u8; 8]).is_err());
    assert!(view.read_at(u64::MAX, &mut [0u8; 1]).is_err());
    assert!(matches!(a.rmem(HeapId(99), &block), Err(ChannelError::UnknownHeap(_))));
    let mut forged = block;
    forged.len = 1 << 40;
    assert!(matches!(a.rmem(heap, &forged), Err(ChannelError::Heap(HeapError::UnknownBlock { .. }))));
    forged = block;
    forged.rkey ^= 1;
    assert!(a.rmem(heap, &forged).is_err());
    forged = block;
    forged.segment = 5;
    assert!(a.rmem(heap, &forged).is_err());
}

/// A raw peer's receive slots, for fake endpoints that speak the control protocol by hand.
struct RawInbox<'a> {
    qp: &'a QueuePair,
    slots: MemoryRegion,
}

impl<'a> RawInbox<'a> {
    const SLOT: u64 = 16384;

    /// `n` receives posted on `qp`.
    fn new(pd: &ProtectionDomain, qp: &'a QueuePair, n: u64) -> Self {
        let slots = pd.alloc_mr((n * Self::SLOT) as usize, AccessFlags::LOCAL_WRITE).unwrap();
        let inbox = RawInbox { qp, slots };
        (0..n).for_each(|i| inbox.repost(i));
        inbox
    }

    fn repost(&self, slot: u64) {
        let buf = self.slots.slice(slot * Self::SLOT, Self::SLOT as u32).unwrap();
        self.qp.post_recv(RecvWr::new(buf).wr_id(slot)).unwrap();
    }

    /// The next control message from `cq` (its slot reposted), or `None` for nothing or a
    /// completion of the peer's own sends.
    fn next(&self, cq: &CompletionQueue) -> Option<Message> {
        let wc = cq.poll_one().unwrap()?.ok().unwrap();
        if wc.opcode != WcOpcode::RECV {
            return None;
        }
        let mut bytes = vec![0u8; wc.byte_len as usize];
        self.slots.read_at(wc.wr_id * Self::SLOT, &mut bytes).unwrap();
        self.repost(wc.wr_id);
        Some(Message::decode(&bytes).unwrap())
    }
}

/// An allocating endpoint facing a fake owner on a raw QP, which grants a first segment of
/// 64 KiB when the heap is created and answers the `n`-th growth request (from 1) with
/// `grow(n)`. Runs `f` on the endpoint and heap 5; returns its result and the number of
/// growth requests the owner saw.
fn against_a_fake_owner<R>(
    grow: impl Fn(u64) -> Message + Sync,
    f: impl FnOnce(&mut HeapEndpoint, HeapId) -> R,
) -> (R, u64) {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let (ca, cb) = (ctx.create_cq(1024).unwrap(), ctx.create_cq(1024).unwrap());
    let a = pd.create_qp(&ca, &ca, QpCaps::default()).unwrap();
    let raw = pd.create_qp(&cb, &cb, QpCaps::default().with_max_inline_data(64)).unwrap();
    a.connect(&raw.address().unwrap(), &ConnectOptions::default()).unwrap();
    raw.connect(&a.address().unwrap(), &ConnectOptions::default()).unwrap();
    let mut alloc = HeapEndpoint::new(a, ca, OwnerLimits::default(), T).unwrap();
    let heap = HeapId(5);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let owner = s.spawn(|| {
            let segment = pd.alloc_mr(64 << 10, AccessFlags::ALL_REMOTE).unwrap();
            let inbox = RawInbox::new(&pd, &raw, 8);
            let mut grows = 0;
            while !stop.load(Ordering::Relaxed) {
                let Some(m) = inbox.next(&cb) else { continue };
                let reply = match m {
                    Message::HeapCreate { .. } => Message::HeapGrant { heap, segment: segment.remote() },
                    Message::HeapGrow { .. } => {
                        grows += 1;
                        grow(grows)
                    }
                    _ => continue, // keep-alives and notices
                };
                raw.post_send(SendWr::send_inline(&reply.encode())).unwrap();
            }
            grows
        });
        let r = f(&mut alloc, heap);
        stop.store(true, Ordering::Relaxed);
        (r, owner.join().unwrap())
    })
}

/// A hostile (or broken) owner that answers every growth request with `HeapFreed` ("the
/// frees I just sent may suffice, try again") but never frees anything: `rmalloc` gives up
/// after a bounded number of rounds with a protocol error, instead of asking forever.
#[test]
fn an_owner_answering_freed_forever_is_left_after_a_bounded_number_of_rounds() {
    let (err, grows) = against_a_fake_owner(
        |_| Message::HeapFreed { heap: HeapId(5) },
        |alloc, heap| {
            alloc.create_heap(HeapConfig::new(heap, AllocPolicy::NextFit), 64 << 10).unwrap();
            alloc.rmalloc(heap, 64 << 10).unwrap(); // the heap is full
            alloc.rmalloc(heap, 8).unwrap_err()
        },
    );
    assert!(matches!(&err, ChannelError::Protocol(m) if m.contains("frees")), "{err}");
    // rdmakit-channel's GROW_ROUNDS: enough for a consumer still freeing, and a bound.
    assert_eq!(grows, 16, "growth requests sent before giving up");
}

/// A hostile owner that answers every growth request with a segment far smaller than asked
/// (8 bytes) once left a useless segment in the allocator per `rmalloc`, without bound: the
/// short grant is a protocol error.
#[test]
fn a_heap_segment_smaller_than_asked_is_a_protocol_error() {
    let tiny = |n: u64| Message::HeapGrant {
        heap: HeapId(5),
        segment: RemoteRegion::new(0x4000_0000 + n * 4096, 8, 9),
    };
    let (err, grows) = against_a_fake_owner(tiny, |alloc, heap| {
        alloc.create_heap(HeapConfig::new(heap, AllocPolicy::NextFit), 64 << 10).unwrap();
        alloc.rmalloc(heap, 64 << 10).unwrap(); // the heap is full
        alloc.rmalloc(heap, 64).unwrap_err()
    });
    assert!(matches!(&err, ChannelError::Protocol(m) if m.contains("asked for")), "{err}");
    assert_eq!(grows, 1);
}

/// A peer that stops taking messages in (no receives posted: every answer waits behind
/// receiver-not-ready) while it sends requests fills the owner's control backlog. Frees the
/// owner's consumer makes then must stay pending until there is room (`rfree` reports the
/// peer's silence as a timeout), not be taken into a batch whose send fails: such a batch
/// was lost (its blocks neither held nor returned, its sequence number spent, so every
/// later batch out of order at the allocator: the peer's heap leaked).
#[test]
fn frees_made_while_the_control_backlog_is_full_are_kept_not_lost() {
    use rdmakit_memory::heap::{AllocNotice, RemoteBlock};
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let (ca, cb) = (ctx.create_cq(1024).unwrap(), ctx.create_cq(1024).unwrap());
    let raw = pd.create_qp(&ca, &ca, QpCaps::default().with_max_inline_data(64)).unwrap();
    let b = pd.create_qp(&cb, &cb, QpCaps::default()).unwrap();
    raw.connect(&b.address().unwrap(), &ConnectOptions::default()).unwrap();
    b.connect(&raw.address().unwrap(), &ConnectOptions::default()).unwrap();
    let mut owner = HeapEndpoint::new(b, cb, OwnerLimits::default(), Duration::from_millis(50)).unwrap();
    let heap = HeapId(7);
    // One receive, for the grant: the owner's answers after it find none.
    let inbox = pd.alloc_mr(16 << 10, AccessFlags::LOCAL_WRITE).unwrap();
    raw.post_recv(RecvWr::new(inbox.local().unwrap())).unwrap();
    let send = |m: Message, owner: &mut HeapEndpoint| {
        raw.post_send(SendWr::send_inline(&m.encode())).unwrap();
        loop {
            let _ = owner.poll_messages(); // refusals beyond the backlog are errors
            if let Some(wc) = ca.poll_one().unwrap() {
                if wc.opcode == WcOpcode::RECV {
                    return Some(wc);
                }
                assert!(wc.status.is_success(), "{wc:?}");
                return None;
            }
        }
    };
    send(
        Message::HeapCreate { config: HeapConfig::new(heap, AllocPolicy::NextFit), len: 64 << 10 },
        &mut owner,
    );
    let granted = loop {
        let _ = owner.poll_messages();
        if let Some(wc) = ca.poll_one().unwrap()
            && wc.opcode == WcOpcode::RECV
        {
            let mut m = vec![0u8; wc.byte_len as usize];
            inbox.read_at(0, &mut m).unwrap();
            match Message::decode(&m).unwrap() {
                Message::HeapGrant { segment, .. } => break segment,
                other => panic!("expected the grant, got {other:?}"),
            }
        }
    };
    // Requests the owner must answer, more than its send queue and backlog (4096) hold.
    for _ in 0..4400 {
        send(Message::HeapGrow { heap, len: 1 << 40 }, &mut owner);
    }
    // Blocks the peer wrote, and the owner's consumer frees: a batch's worth and more.
    for i in 0..(2 * FREE) {
        let block = RemoteBlock { addr: granted.addr + i * 64, len: 64, rkey: granted.rkey, segment: 0 };
        send(Message::HeapSync(AllocNotice::new(heap, block).into()), &mut owner);
    }
    for _ in 0..(2 * FREE) {
        let landed = owner.try_recv_block(heap).ok().flatten().expect("a landed block");
        // A due batch cannot go out: the free stays pending, the wait for room times out.
        if let Err(e) = owner.rfree(landed) {
            assert!(matches!(e, ChannelError::Timeout(_)), "{e}");
        }
    }
    let stats = owner.owner_stats(heap).unwrap();
    assert_eq!((stats.held_blocks, stats.freed_blocks), (0, 2 * FREE as usize), "the frees were lost");
}

/// A peer that sends a burst of requests fills this endpoint's send queue with answers (its
/// QP is the application's, shallower than the burst): a `write` right after must wait for
/// room, not fail with a full send queue.
#[test]
fn a_write_behind_a_send_queue_full_of_answers_waits_for_room() {
    const BURST: u64 = 40;
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let (ca, cb) = (ctx.create_cq(1024).unwrap(), ctx.create_cq(1024).unwrap());
    let caps = QpCaps::default().with_max_inline_data(64).with_max_send_wr(8).with_max_recv_wr(128);
    let a = pd.create_qp(&ca, &ca, caps).unwrap();
    let raw = pd.create_qp(&cb, &cb, QpCaps::default().with_max_inline_data(64)).unwrap();
    a.connect(&raw.address().unwrap(), &ConnectOptions::default()).unwrap();
    raw.connect(&a.address().unwrap(), &ConnectOptions::default()).unwrap();
    let mut ep = HeapEndpoint::new(a, ca, OwnerLimits::default(), T).unwrap();
    let heap = HeapId(5);
    let segment = pd.alloc_mr(64 << 10, AccessFlags::ALL_REMOTE).unwrap();
    let (stop, answers) = (AtomicBool::new(false), AtomicU64::new(0));
    /// Stops the peer however the test's thread leaves the scope.
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    std::thread::scope(|s| {
        // The peer: grants this endpoint's heap, then asks it to host BURST heaps at once.
        s.spawn(|| {
            let inbox = RawInbox::new(&pd, &raw, 64);
            while !stop.load(Ordering::Relaxed) {
                let Some(m) = inbox.next(&cb) else { continue };
                match m {
                    Message::HeapCreate { .. } => {
                        let grant = Message::HeapGrant { heap, segment: segment.remote() };
                        let mut burst = vec![grant];
                        burst.extend((0..BURST).map(|h| Message::HeapCreate {
                            config: HeapConfig::new(HeapId(100 + h as u32), AllocPolicy::NextFit),
                            len: 4096,
                        }));
                        for m in burst {
                            raw.post_send(SendWr::send_inline(&m.encode())).unwrap();
                        }
                    }
                    Message::HeapGrant { .. } | Message::HeapRefuse { .. } => {
                        answers.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {} // keep-alives and notices
                }
            }
        });
        let _stop = Stop(&stop);
        ep.create_heap(HeapConfig::new(heap, AllocPolicy::NextFit), 64 << 10).unwrap();
        // Takes the burst in and answers it: more answers than the send queue holds, most
        // of them waiting in the backlog.
        let start = Instant::now();
        while ep.owner_stats(HeapId(100 + BURST as u32 - 1)).is_err()
            && answers.load(Ordering::Relaxed) < BURST
        {
            ep.poll_messages().unwrap();
            assert!(start.elapsed() < T, "the burst was not answered");
        }
        let block = ep.rmalloc(heap, 64).unwrap();
        let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        src.write_u64(0, 0x5eed).unwrap();
        ep.write(heap, &block, 0, src.local().unwrap()).unwrap();
        let start = Instant::now();
        while answers.load(Ordering::Relaxed) < BURST {
            ep.poll_messages().unwrap();
            assert!(start.elapsed() < T, "answers lost: {} of {BURST}", answers.load(Ordering::Relaxed));
        }
    });
    assert_eq!(segment.read_u64(0).unwrap(), 0x5eed);
}

/// An owner busy elsewhere for longer than the writer's time-out: the write that times
/// out was posted all the same and lands when the owner gets to it, so it is reported as
/// unconfirmed (not to be repeated), not as a plain time-out.
#[test]
fn a_write_the_owner_does_not_confirm_in_time_is_unconfirmed_and_lands() {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let (cw, cr) = (ctx.create_cq(1024).unwrap(), ctx.create_cq(1024).unwrap());
    let (w, r) = (
        pd.create_qp(&cw, &cw, QpCaps::default()).unwrap(),
        pd.create_qp(&cr, &cr, QpCaps::default()).unwrap(),
    );
    w.connect(&r.address().unwrap(), &ConnectOptions::default()).unwrap();
    r.connect(&w.address().unwrap(), &ConnectOptions::default()).unwrap();
    let t = Duration::from_millis(300);
    let mut writer = HeapEndpoint::new(w, cw, OwnerLimits::default(), t).unwrap();
    let mut owner = HeapEndpoint::new(r, cr, OwnerLimits::default(), t).unwrap();
    let heap = HeapId(1);
    create(&mut writer, &mut owner, HeapConfig::new(heap, AllocPolicy::NextFit), 1 << 20);
    // The owner is busy now: the writer writes until a write is not confirmed (its
    // notices fill the owner's receive slots).
    let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut ok = 0;
    let err = loop {
        let b = writer.rmalloc(heap, 64).unwrap();
        match writer.write(heap, &b, 0, src.local().unwrap()) {
            Ok(()) => ok += 1,
            Err(e) => break e,
        }
        assert!(ok < 10_000, "the owner's receive slots never ran out");
    };
    assert!(matches!(err, ChannelError::Unconfirmed { .. }), "{err}");
    // The owner comes back: every block, the unconfirmed write's too, lands once.
    let mut landed = 0;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(1) {
        if let Ok(Some(_)) = owner.try_recv_block(heap) {
            landed += 1;
        }
    }
    assert_eq!(landed, ok + 1, "the unconfirmed write landed, once");
}

/// An allocating side that announces again a block the owner's consumer already holds (a
/// second `HeapReady`, sent behind the endpoint's back as a hostile peer would) must not
/// get it delivered twice: the second copy could be freed after its address was allocated
/// again, freeing a newer, unread block. Deferred heaps take no announcements at all.
/// (Found by review: any block the owner held was queued again.)
#[test]
fn a_block_announced_again_while_in_use_is_not_delivered_twice() {
    for policy in [AllocPolicy::BestFit, AllocPolicy::NextFit] {
        let pd = Context::open_soft().alloc_pd().unwrap();
        let (mut w, mut r) = common::heap_endpoints(&pd, OwnerLimits::default(), T);
        let heap = HeapId(1);
        create(&mut w, &mut r, HeapConfig::new(heap, policy), 64 << 10);
        let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let block = while_serving(&mut r, || {
            let block = w.rmalloc(heap, 64).unwrap();
            w.write(heap, &block, 0, src.local().unwrap()).unwrap();
            block
        });
        let start = Instant::now();
        let first = loop {
            if let Some(b) = r.try_recv_block(heap).unwrap() {
                break b;
            }
            assert!(start.elapsed() < T, "{policy:?}: the block never landed");
        };
        assert_eq!(first.block().addr, block.addr);
        // The same announcement again, posted on the allocating side's QP directly.
        let again = Message::HeapReady { heap, addr: block.addr }.encode();
        w.qp().post_send(SendWr::send_inline(&again).unsignaled()).unwrap();
        let start = Instant::now();
        let second = loop {
            match r.try_recv_block(heap) {
                Ok(Some(b)) => break Some(b),
                Ok(None) if start.elapsed() < Duration::from_millis(500) => {}
                Ok(None) => break None,
                Err(e) => {
                    assert!(matches!(e, ChannelError::Protocol(_)), "{policy:?}: {e}");
                    break None;
                }
            }
        };
        assert!(
            second.is_none(),
            "{policy:?}: block {:#x} delivered twice: {first:?}, {second:?}",
            block.addr
        );
        r.rfree(first).unwrap();
    }
}

/// An immediate `rmalloc` that times out (the owner busy for longer than the endpoint's
/// time-out) leaves its answer to come later: it must be taken for that request, not for
/// the next one. (Found by review: the next `rmalloc(4096)` took the late acknowledgement of
/// the first and returned its 64-byte block.)
#[test]
fn an_rmalloc_after_a_timed_out_one_gets_its_own_answer() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (mut w, mut r) = common::heap_endpoints(&pd, OwnerLimits::default(), Duration::from_millis(300));
    let heap = HeapId(1);
    create(&mut w, &mut r, HeapConfig::new(heap, AllocPolicy::BestFit), 64 << 10);
    // The owner takes no messages in for a while: the first rmalloc times out.
    let first = w.rmalloc(heap, 64);
    assert!(matches!(first, Err(ChannelError::Timeout(_))), "{first:?}");
    // The owner answers it now, then serves the next one.
    let owner = std::thread::spawn(move || {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(2) {
            r.poll_messages().unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        r
    });
    std::thread::sleep(Duration::from_millis(100));
    let second = w.rmalloc(heap, 4096).expect("rmalloc");
    assert!(second.len >= 4096, "rmalloc(4096) returned a block of {} bytes: {second:?}", second.len);
    let third = w.rmalloc(heap, 128).expect("rmalloc");
    assert!(third.len >= 128 && third.addr != second.addr, "{third:?}");
    drop(owner.join().unwrap());
}

/// The blocks an allocating peer makes the owner track are bounded in number, not only in
/// bytes: 8-byte blocks of a 64 MiB heap would be eight million map entries (hundreds of
/// MiB of bookkeeping) for one heap. Past `max_blocks` held, a notice is a protocol error.
#[test]
fn blocks_a_peer_makes_the_owner_hold_are_bounded() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (mut w, mut r) = common::heap_endpoints(&pd, OwnerLimits::default().with_max_blocks(64), T);
    let heap = HeapId(5);
    create(&mut w, &mut r, HeapConfig::new(heap, AllocPolicy::NextFit), 64 << 10);
    let src = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let mut refused = None;
    for i in 0..200 {
        let block = w.rmalloc(heap, 8).unwrap();
        w.write(heap, &block, 0, src.local().unwrap()).unwrap();
        // Nobody consumes: every block stays held on the owner's side.
        if let Err(e) = r.poll_messages() {
            refused = Some((i, e));
            break;
        }
    }
    let (i, e) = refused.expect("200 blocks held by an owner limited to 64");
    assert!(matches!(e, ChannelError::Protocol(_)), "{e}");
    assert!((64..80).contains(&i), "refused at block {i}");
}

/// A peer's message that is an error (here: a block over this owner's limit) arrives while
/// an immediate `rmalloc` waits for its acknowledgement. The `rmalloc` still gets its own
/// answer; the next call reports the error; and the answers after it still pair with
/// their requests (they used to shift by one: `rmalloc(4096)` got the 64-byte block).
#[test]
fn an_error_from_another_message_during_a_wait_leaves_answers_paired() {
    use rdmakit_memory::heap::SyncMode;
    let (mut w, mut r, pd) = in_process(OwnerLimits::default().with_max_blocks(2));
    let y = HeapId(1); // r owns it, w allocates in it, immediate
    let x = HeapId(2); // w owns it (at most 2 blocks held), r allocates in it
    create(&mut w, &mut r, HeapConfig::new(y, AllocPolicy::BestFit).with_sync(SyncMode::Immediate), 64 << 10);
    create(&mut r, &mut w, HeapConfig::new(x, AllocPolicy::NextFit), 64 << 10);
    let src = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let blocks: Vec<_> = (0..3).map(|_| r.rmalloc(x, 8).unwrap()).collect();
    for b in &blocks[..2] {
        r.write(x, b, 0, src.local().unwrap()).unwrap();
    }
    w.poll_messages().unwrap(); // w holds 2 blocks of x: its limit
    let first = std::thread::scope(|s| {
        let t = s.spawn(|| w.rmalloc(y, 64));
        std::thread::sleep(Duration::from_millis(300));
        // A third block of x (over w's limit), then, while its notice goes out, r answers
        // w's allocation.
        r.write(x, &blocks[2], 0, src.local().unwrap()).unwrap();
        t.join().unwrap()
    });
    let first = first.expect("the allocation got its own answer");
    assert!(first.len >= 64, "{first:?}");
    let e = w.poll_messages().expect_err("the next call reports the peer's error");
    assert!(matches!(&e, ChannelError::Protocol(m) if m.contains("more than 2 blocks")), "{e}");
    let second = while_serving(&mut r, || w.rmalloc(y, 4096)).unwrap();
    assert!(second.len >= 4096, "rmalloc(4096) got a block of {} bytes", second.len);
}
