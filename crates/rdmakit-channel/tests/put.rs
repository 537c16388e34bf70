//! Persistent put handles on the soft NIC: the state machine (Busy, ready, re-put,
//! deassociate), the sentinel case CkDirect misses, many iterations with checksums, the
//! async variant, soft TCP, and a dying peer.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdmakit_channel::put::*;
use rdmakit_channel::*;
use rdmakit_verbs::cm::{CmOptions, Listener, connect};
use rdmakit_verbs::*;

mod common;
use common::put_endpoints as endpoints;

fn spin_poll(ep: &PutEndpoint, want: usize) -> usize {
    let start = std::time::Instant::now();
    let mut fired = 0;
    while fired < want {
        fired += ep.ready_poll().unwrap();
        assert!(start.elapsed() < Duration::from_secs(10), "no put detected");
    }
    fired
}

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x1000_0000_01b3))
}

#[test]
fn state_machine_busy_ready_and_reput() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = endpoints(&pd);
    let rbuf = pd.alloc_mr(256, AccessFlags::ALL_REMOTE).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    let h = receiver
        .create_handle(&rbuf, move |buf| s2.lock().unwrap().push(buf.to_vec().unwrap()), 0xdead)
        .unwrap();
    let desc = HandleDesc::decode(&h.desc().unwrap().encode()).unwrap();
    let sbuf = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    let sh = sender.assoc_local_buffer(&desc, sbuf.local().unwrap()).unwrap();

    sbuf.fill(1).unwrap();
    h.ready_poll_q().unwrap();
    sh.put().unwrap();
    // (The send buffer is rewritten only once the put has been seen: the NIC reads it after
    // `put` returns.)
    assert_eq!(spin_poll(&receiver, 1), 1);
    assert_eq!(seen.lock().unwrap()[0], vec![1u8; 256]);
    // A second put before the receiver is ready: Busy, nothing overwritten.
    sbuf.fill(2).unwrap();
    assert!(matches!(sh.put(), Err(ChannelError::Busy)));
    assert!(!sh.is_ready().unwrap());
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(rbuf.to_vec().unwrap(), vec![1u8; 256], "a Busy put wrote nothing");
    // The callback took the handle out of the poll queue: polling finds nothing.
    assert!(!h.is_queued());
    assert_eq!(receiver.ready_poll().unwrap(), 0);
    // Not marked done: queueing it again is refused (the sender would stay Busy).
    assert!(!h.is_marked());
    assert!(matches!(h.ready_poll_q(), Err(ChannelError::Invalid(_))));
    // ready_mark (CkDirect_readyMark): done with the data; the sender may go on, but the
    // handle is not polled yet.
    h.ready_mark().unwrap();
    assert!(h.is_marked() && !h.is_queued());
    let start = std::time::Instant::now();
    while !sh.is_ready().unwrap() {
        assert!(start.elapsed() < Duration::from_secs(5));
    }
    h.ready_poll_q().unwrap();
    assert!(h.is_queued());
    sh.put().unwrap();
    spin_poll(&receiver, 1);
    assert_eq!(seen.lock().unwrap()[1], vec![2u8; 256]);
    assert_eq!((sh.puts(), h.puts_seen()), (2, 2));
    // Mismatched lengths are refused at association.
    let small = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    assert!(sender.assoc_local_buffer(&desc, small.local().unwrap()).is_err());
    sh.deassociate().unwrap();
    h.destroy();
}

/// CkDirect misses a put whose last double equals `initial_value`; the sequence word sees it.
#[test]
fn payload_equal_to_the_sentinel_is_still_detected() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = endpoints(&pd);
    let initial = f64::to_bits(-1.0);
    let rbuf = pd.alloc_mr(64, AccessFlags::ALL_REMOTE).unwrap();
    let fired = Arc::new(Mutex::new(0));
    let f2 = fired.clone();
    let h = receiver.create_handle(&rbuf, move |_| *f2.lock().unwrap() += 1, initial).unwrap();
    let sbuf = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    // The payload's last 8 bytes are exactly the sentinel.
    for i in 0..7 {
        sbuf.write_u64(i * 8, i + 100).unwrap();
    }
    sbuf.write_u64(56, initial).unwrap();
    let sh = sender.assoc_local_buffer(&h.desc().unwrap(), sbuf.local().unwrap()).unwrap();
    h.ready_poll_q().unwrap();
    assert_eq!(
        rbuf.read_u64(56).unwrap(),
        initial,
        "the buffer's last word holds the sentinel before the put"
    );
    sh.put().unwrap();
    spin_poll(&receiver, 1);
    assert_eq!(*fired.lock().unwrap(), 1);
    assert_eq!(rbuf.to_vec().unwrap(), sbuf.to_vec().unwrap());
}

#[test]
fn many_iterations_many_sizes_with_checksums() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = endpoints(&pd);
    for size in [8usize, 1000, 64 << 10] {
        let rbuf = pd.alloc_mr(size, AccessFlags::ALL_REMOTE).unwrap();
        let sums = Arc::new(Mutex::new(Vec::new()));
        let s2 = sums.clone();
        let h = receiver
            .create_handle(&rbuf, move |b| s2.lock().unwrap().push(checksum(&b.to_vec().unwrap())), 0)
            .unwrap();
        let sbuf = pd.alloc_mr(size, AccessFlags::LOCAL_WRITE).unwrap();
        let sh = sender.assoc_local_buffer(&h.desc().unwrap(), sbuf.local().unwrap()).unwrap();
        let mut expect = Vec::new();
        for it in 0..200u32 {
            let data: Vec<u8> = (0..size).map(|j| (it as usize * 13 + j) as u8).collect();
            sbuf.write_at(0, &data).unwrap();
            expect.push(checksum(&data));
            h.ready_poll_q().unwrap();
            while let Err(ChannelError::Busy) = sh.put() {}
            spin_poll(&receiver, 1);
            h.ready().unwrap();
        }
        assert_eq!(*sums.lock().unwrap(), expect, "size {size}");
    }
}

/// Two connected put endpoints on the soft NIC whose QPs have send queues of `depth`, and
/// the first one's QP.
fn shallow_endpoints(depth: u32) -> (ProtectionDomain, QueuePair, PutEndpoint, PutEndpoint) {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let (ca, cb) = (ctx.create_cq(256).unwrap(), ctx.create_cq(256).unwrap());
    let caps = QpCaps::default().with_max_send_wr(depth).with_max_recv_wr(64).with_max_inline_data(64);
    let (qa, qb) = (pd.create_qp(&ca, &ca, caps).unwrap(), pd.create_qp(&cb, &cb, caps).unwrap());
    qa.connect(&qb.address().unwrap(), &ConnectOptions::default()).unwrap();
    qb.connect(&qa.address().unwrap(), &ConnectOptions::default()).unwrap();
    let ea = PutEndpoint::new(qa.clone(), ca, PollMode::Busy).unwrap();
    let eb = PutEndpoint::new(qb, cb, PollMode::Busy).unwrap();
    (pd, qa, ea, eb)
}

/// Puts and ready marks are signalled only now and then (nobody waits for their
/// completions): on a send queue of 16, thousands of round trips never fill it, because a
/// signalled one retires those before it.
#[test]
fn a_shallow_send_queue_never_fills_with_unsignalled_puts() {
    let (pd, _, ea, eb) = shallow_endpoints(16);
    let (ra, rb) = (
        pd.alloc_mr(64, AccessFlags::ALL_REMOTE).unwrap(),
        pd.alloc_mr(64, AccessFlags::ALL_REMOTE).unwrap(),
    );
    let (sa, sb) = (
        pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap(),
        pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap(),
    );
    let (ha, hb) = (ea.create_handle(&ra, |_| {}, 0).unwrap(), eb.create_handle(&rb, |_| {}, 0).unwrap());
    let to_b = ea.assoc_local_buffer(&hb.desc().unwrap(), sa.local().unwrap()).unwrap();
    let to_a = eb.assoc_local_buffer(&ha.desc().unwrap(), sb.local().unwrap()).unwrap();
    ha.ready_poll_q().unwrap();
    hb.ready_poll_q().unwrap();
    for it in 0..2000u64 {
        sa.write_u64(0, it).unwrap();
        to_b.put().unwrap(); // never Busy: b marked the previous one before putting back
        spin_poll(&eb, 1);
        assert_eq!(rb.read_u64(0).unwrap(), it);
        hb.ready().unwrap();
        to_a.put().unwrap();
        spin_poll(&ea, 1);
        ha.ready().unwrap();
    }
}

#[test]
fn polling_cost_follows_marked_handles_only() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = endpoints(&pd);
    let fired = Arc::new(Mutex::new(Vec::new()));
    let mut handles = Vec::new();
    let mut senders = Vec::new();
    for i in 0..50u32 {
        let rbuf = pd.alloc_mr(16, AccessFlags::ALL_REMOTE).unwrap();
        let f = fired.clone();
        let h = receiver.create_handle(&rbuf, move |_| f.lock().unwrap().push(i), 0).unwrap();
        let sbuf = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
        senders.push(sender.assoc_local_buffer(&h.desc().unwrap(), sbuf.local().unwrap()).unwrap());
        handles.push(h);
    }
    // Only handles 3 and 40 are marked; all 50 get a put.
    handles[3].ready_poll_q().unwrap();
    handles[40].ready_poll_q().unwrap();
    for s in &senders {
        s.put().unwrap();
    }
    spin_poll(&receiver, 2);
    let mut f = fired.lock().unwrap().clone();
    f.sort();
    assert_eq!(f, vec![3, 40]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_variant_a_future_per_iteration() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = endpoints(&pd);
    let rbuf = pd.alloc_mr(4096, AccessFlags::ALL_REMOTE).unwrap();
    let h = receiver.create_handle(&rbuf, |_| {}, 0).unwrap();
    let sbuf = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let sh = sender.assoc_local_buffer(&h.desc().unwrap(), sbuf.local().unwrap()).unwrap();
    for it in 0..100u8 {
        sbuf.fill(it).unwrap();
        // A dropped wait takes nothing.
        let _ = tokio::time::timeout(Duration::from_micros(1), h.next_put()).await;
        while let Err(ChannelError::Busy) = sh.put() {
            tokio::task::yield_now().await;
        }
        h.next_put_timeout(Duration::from_secs(5)).await.unwrap();
        assert_eq!(rbuf.to_vec().unwrap(), vec![it; 4096]);
        h.ready().unwrap();
    }
    assert!(matches!(h.next_put_timeout(Duration::from_millis(50)).await, Err(ChannelError::Timeout(_))));
}

#[test]
fn over_soft_tcp_then_the_receiver_dies() {
    let ctx = Context::open_soft();
    let listener = Listener::bind(&ctx, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut opts = CmOptions::default();
    opts.caps.max_inline_data = 64;
    opts.connect.timeout = 10;
    opts.connect.retry_cnt = 3;
    let (tx, rx) = std::sync::mpsc::channel();
    let receiver = std::thread::spawn(move || {
        let pd = listener.context().alloc_pd().unwrap();
        let conn = listener.accept(&pd, &opts, b"").unwrap();
        let ep = PutEndpoint::new(conn.qp().clone(), conn.cq().clone(), PollMode::Busy).unwrap();
        let rbuf = pd.alloc_mr(1024, AccessFlags::ALL_REMOTE).unwrap();
        let count = Arc::new(Mutex::new(0u32));
        let c2 = count.clone();
        let h = ep.create_handle(&rbuf, move |_| *c2.lock().unwrap() += 1, 0).unwrap();
        tx.send(h.desc().unwrap().encode()).unwrap();
        for _ in 0..20 {
            h.ready_poll_q().unwrap();
            spin_poll(&ep, 1);
            // The association message arrives before the first put: ready can signal.
            h.ready().unwrap();
        }
        let n = *count.lock().unwrap();
        drop((h, ep, conn)); // the receiver goes away
        n
    });
    let pd = ctx.alloc_pd().unwrap();
    let conn = connect(&pd, addr, &opts, b"").unwrap();
    let ep = PutEndpoint::new(conn.qp().clone(), conn.cq().clone(), PollMode::Busy).unwrap();
    let desc = HandleDesc::decode(&rx.recv().unwrap()).unwrap();
    let sbuf = pd.alloc_mr(1024, AccessFlags::LOCAL_WRITE).unwrap();
    let sh = ep.assoc_local_buffer(&desc, sbuf.local().unwrap()).unwrap();
    let mut done = 0;
    while done < 20 {
        match sh.put() {
            Ok(()) => done += 1,
            Err(ChannelError::Busy) => std::thread::yield_now(),
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(receiver.join().unwrap(), 20);
    // The receiver is gone: puts end in an error, not a hang.
    let start = std::time::Instant::now();
    let err = loop {
        match sh.put() {
            Ok(()) | Err(ChannelError::Busy) => {
                assert!(start.elapsed() < Duration::from_secs(30), "puts to a dead peer kept succeeding");
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => break e,
        }
    };
    assert!(matches!(err, ChannelError::Broken { .. }), "{err}");
    drop(conn);
}

/// A put may land before the receiver queues the handle: queueing (and the `ready` that
/// follows the previous put) must not clobber it.
#[test]
fn a_put_landing_before_ready_poll_q_is_kept() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = endpoints(&pd);
    let rbuf = pd.alloc_mr(8, AccessFlags::ALL_REMOTE).unwrap();
    let h = receiver.create_handle(&rbuf, |_| {}, u64::MAX).unwrap();
    let sbuf = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let sh = sender.assoc_local_buffer(&h.desc().unwrap(), sbuf.local().unwrap()).unwrap();
    for v in 1..50u64 {
        sbuf.write_u64(0, v).unwrap();
        while let Err(ChannelError::Busy) = sh.put() {}
        // Give the put time to land, then queue late.
        let start = std::time::Instant::now();
        while h.puts_seen() < v && rbuf.read_u64(0).unwrap() != v && start.elapsed() < Duration::from_secs(5)
        {
        }
        h.ready_poll_q().unwrap();
        spin_poll(&receiver, 1);
        assert_eq!(rbuf.read_u64(0).unwrap(), v);
        // Done with the data, but not queued: the next put lands unpolled.
        h.ready_mark().unwrap();
    }
}

/// A sender deassociates and another associates with the same handle: its puts count from
/// zero again (an epoch per association), and are seen.
#[test]
fn reassociation_after_deassociate_is_detected() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = endpoints(&pd);
    let rbuf = pd.alloc_mr(32, AccessFlags::ALL_REMOTE).unwrap();
    let got = Arc::new(Mutex::new(Vec::new()));
    let g2 = got.clone();
    let h =
        receiver.create_handle(&rbuf, move |b| g2.lock().unwrap().push(b.read_u64(0).unwrap()), 0).unwrap();
    for round in 1..=3u64 {
        let sbuf = pd.alloc_mr(32, AccessFlags::LOCAL_WRITE).unwrap();
        let sh = sender.assoc_local_buffer(&h.desc().unwrap(), sbuf.local().unwrap()).unwrap();
        for it in 0..5u64 {
            sbuf.write_u64(0, round * 100 + it).unwrap();
            h.ready_poll_q().unwrap();
            let start = std::time::Instant::now();
            while let Err(ChannelError::Busy) = sh.put() {
                receiver.progress().unwrap();
                assert!(start.elapsed() < Duration::from_secs(5), "stuck Busy in round {round}");
            }
            spin_poll(&receiver, 1);
            h.ready().unwrap();
        }
        assert_eq!(h.puts_seen(), 5, "round {round} counts from zero");
        sh.deassociate().unwrap();
    }
    let want: Vec<u64> = (1..=3u64).flat_map(|r| (0..5).map(move |i| r * 100 + i)).collect();
    assert_eq!(*got.lock().unwrap(), want);
}

/// Ending an association never fails for want of room: with the receiver stalled, the
/// sender's control backlog fills with associations until one is refused, and a
/// deassociation still goes out after them, so the receiver learns of it once it runs.
#[test]
fn deassociate_with_a_full_control_backlog_still_reaches_the_receiver() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = endpoints(&pd);
    let (b1, b2) = (
        pd.alloc_mr(16, AccessFlags::ALL_REMOTE).unwrap(),
        pd.alloc_mr(16, AccessFlags::ALL_REMOTE).unwrap(),
    );
    let h1 = receiver.create_handle(&b1, |_| {}, 0).unwrap();
    let h2 = receiver.create_handle(&b2, |_| {}, 0).unwrap();
    let sbuf = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    let sh1 = sender.assoc_local_buffer(&h1.desc().unwrap(), sbuf.local().unwrap()).unwrap();
    // The receiver does not run: associations of the other handle pile up.
    let mut refused = false;
    for _ in 0..8 * MAX_HANDLES {
        match sender.assoc_local_buffer(&h2.desc().unwrap(), sbuf.local().unwrap()) {
            Ok(sh) => drop(sh),
            Err(ChannelError::TooLarge { what: "control backlog", .. }) => {
                refused = true;
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(refused, "the backlog never filled");
    sh1.deassociate().expect("a deassociation is never refused for want of room");
    let start = std::time::Instant::now();
    while h1.is_associated() || !h2.is_associated() {
        receiver.progress().unwrap();
        sender.progress().unwrap();
        assert!(start.elapsed() < Duration::from_secs(10), "the deassociation never arrived");
    }
}

/// A destroyed handle's slot is reused: a put from the old association, still associated,
/// is not taken for a put on the new handle.
#[test]
fn reused_handle_slot_ignores_the_old_association() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = endpoints(&pd);
    let old_buf = pd.alloc_mr(16, AccessFlags::ALL_REMOTE).unwrap();
    let old = receiver.create_handle(&old_buf, |_| {}, 0).unwrap();
    let sbuf = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    let stale = sender.assoc_local_buffer(&old.desc().unwrap(), sbuf.local().unwrap()).unwrap();
    sbuf.write_u64(0, 1).unwrap();
    old.ready_poll_q().unwrap();
    stale.put().unwrap();
    spin_poll(&receiver, 1);
    old.ready().unwrap();
    let old_id = old.desc().unwrap().id;
    old.destroy();

    let new_buf = pd.alloc_mr(16, AccessFlags::ALL_REMOTE).unwrap();
    let fired = Arc::new(Mutex::new(Vec::new()));
    let f2 = fired.clone();
    let new = receiver
        .create_handle(&new_buf, move |b| f2.lock().unwrap().push(b.read_u64(0).unwrap()), 0)
        .unwrap();
    assert_eq!(new.desc().unwrap().id, old_id, "the slot is reused");
    new.ready_poll_q().unwrap();
    // The stale sender was readied once more: its put lands in the old buffer.
    sbuf.write_u64(0, 2).unwrap();
    let start = std::time::Instant::now();
    while let Err(ChannelError::Busy) = stale.put() {
        assert!(start.elapsed() < Duration::from_secs(5));
    }
    while old_buf.read_u64(0).unwrap() != 2 {
        assert!(start.elapsed() < Duration::from_secs(5));
    }
    let until = std::time::Instant::now() + Duration::from_millis(50);
    while std::time::Instant::now() < until {
        assert_eq!(receiver.ready_poll().unwrap(), 0, "a stale put fired the new handle");
    }
    // Not readied again: the stale sender is Busy from now on.
    assert!(matches!(stale.put(), Err(ChannelError::Busy)));
    // A real association with the new handle is seen.
    let nbuf = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    nbuf.write_u64(0, 7).unwrap();
    let fresh = sender.assoc_local_buffer(&new.desc().unwrap(), nbuf.local().unwrap()).unwrap();
    fresh.put().unwrap();
    spin_poll(&receiver, 1);
    assert_eq!(*fired.lock().unwrap(), vec![7]);
    assert_eq!(new_buf.read_u64(0).unwrap(), 7);
}

/// The CkDirect slides' receiver (Eric Bohm et al., "CkDirect: Charm++ RDMA Put", "How does
/// it work?", "Reducing Polling Overhead" and "The CkDirect API"), ported call by call: the
/// receiver creates the handle, the sender associates its buffer and puts every iteration,
/// the callback triggers the computation, and the receiver calls `CkDirect_readyMark` when
/// done with the data and `CkDirect_readyPollQ` when it expects the next put (even
/// iterations, the split scheme, with the next put completing in between: "can detect puts
/// completed since readyMark"), or `CkDirect_ready` for both (odd iterations). Checks every
/// iteration's data and that the sender is never stuck on `Busy`.
#[test]
fn ckdirect_receive_loop_ported_line_by_line() {
    const ITERS: u64 = 40;
    const SIZE: usize = 1024;
    const STUCK: Duration = Duration::from_secs(10);
    let pattern = |it: u64| -> Vec<u8> { (0..SIZE).map(|j| (it as usize * 31 + j * 7) as u8).collect() };
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender_ep, receiver_ep) = endpoints(&pd);
    let (desc_tx, desc_rx) = std::sync::mpsc::channel::<[u8; HandleDesc::ENCODED_LEN]>();
    let (put_tx, put_rx) = std::sync::mpsc::channel::<u64>();

    let sender = {
        let pd = pd.clone();
        std::thread::spawn(move || {
            let send_buf = pd.alloc_mr(SIZE, AccessFlags::LOCAL_WRITE).unwrap();
            let desc = HandleDesc::decode(&desc_rx.recv().unwrap()).unwrap();
            // CkDirect_assocLocalBuffer(&handle, sendBuf, sendBufSize);
            let handle = sender_ep.assoc_local_buffer(&desc, send_buf.local().unwrap()).unwrap();
            for it in 0..ITERS {
                // The application's iteration boundary: the receiver is done with the last
                // put. Here the ready word says so; a receiver that never said it would
                // leave this loop stuck.
                let start = std::time::Instant::now();
                while !handle.is_ready().unwrap() {
                    assert!(start.elapsed() < STUCK, "sender stuck before put {it}");
                    std::thread::yield_now();
                }
                send_buf.write_at(0, &pattern(it)).unwrap();
                // CkDirect_put(&handle);
                handle.put().unwrap_or_else(|e| panic!("put {it} after is_ready: {e}"));
                put_tx.send(it).unwrap();
            }
            handle
        })
    };

    let recv_buf = pd.alloc_mr(SIZE, AccessFlags::ALL_REMOTE).unwrap();
    let arrived = Arc::new(Mutex::new(Vec::new()));
    let a2 = arrived.clone();
    // void callback(void *callbackData): "trigger message from callback for real computation"
    let callback = move |buf: &MemoryRegion| a2.lock().unwrap().push(buf.to_vec().unwrap());
    let initial_value = f64::to_bits(-1.0);
    // handle = CkDirect_createHandle(senderNode, recvBuf, recvBufSize, callback, callbackData, initialValue);
    let handle = receiver_ep.create_handle(&recv_buf, callback, initial_value).unwrap();
    desc_tx.send(handle.desc().unwrap().encode()).unwrap();
    // CkDirect_readyPollQ(&handle): expect the first put.
    handle.ready_poll_q().unwrap();
    assert_eq!(put_rx.recv_timeout(STUCK).unwrap(), 0, "the sender is stuck");
    for it in 0..ITERS {
        // The scheduler's loop polls the ready handles and runs the callback.
        let start = std::time::Instant::now();
        while receiver_ep.ready_poll().unwrap() == 0 {
            assert!(start.elapsed() < STUCK, "put {it} never detected");
        }
        // The computation the callback triggered: the data is this iteration's.
        let data = arrived.lock().unwrap().last().cloned().unwrap();
        assert_eq!(data, pattern(it), "iteration {it}");
        assert_eq!(handle.puts_seen(), it + 1);
        if it % 2 == 0 {
            // CkDirect_readyMark(&handle): done with the data, don't start polling yet.
            handle.ready_mark().unwrap();
            assert!(!handle.is_queued());
            if it + 1 < ITERS {
                // Meanwhile the sender, no longer Busy, puts the next iteration ...
                assert_eq!(put_rx.recv_timeout(STUCK).unwrap(), it + 1, "the sender is stuck");
                let start = std::time::Instant::now();
                while recv_buf.to_vec().unwrap() != pattern(it + 1) {
                    assert!(start.elapsed() < STUCK, "put {} never landed", it + 1);
                }
                // ... which nobody polls for yet.
                assert_eq!(receiver_ep.ready_poll().unwrap(), 0);
            }
            // CkDirect_readyPollQ(&handle): data was already marked, start checking.
            handle.ready_poll_q().unwrap();
        } else {
            // CkDirect_ready(&handle): done with the data, start checking.
            handle.ready().unwrap();
            assert!(handle.is_marked() && handle.is_queued());
            if it + 1 < ITERS {
                assert_eq!(put_rx.recv_timeout(STUCK).unwrap(), it + 1, "the sender is stuck");
            }
        }
    }
    let send_handle = sender.join().expect("sender");
    assert_eq!(send_handle.puts(), ITERS);
    assert!(send_handle.is_ready().unwrap(), "the last put was marked done");
    assert_eq!(arrived.lock().unwrap().len() as u64, ITERS);
}

/// `ready_mark` with nothing new to mark touches nothing: a second call after the sender
/// put again must not write the sentinel over the new put's data.
#[test]
fn a_second_ready_mark_does_not_clobber_the_next_put() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = endpoints(&pd);
    let rbuf = pd.alloc_mr(16, AccessFlags::ALL_REMOTE).unwrap();
    let h = receiver.create_handle(&rbuf, |_| {}, 0x5e5e).unwrap();
    let sbuf = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    let sh = sender.assoc_local_buffer(&h.desc().unwrap(), sbuf.local().unwrap()).unwrap();
    h.ready_poll_q().unwrap();
    sbuf.write_u64(8, 1).unwrap();
    sh.put().unwrap();
    spin_poll(&receiver, 1);
    h.ready_mark().unwrap();
    assert_eq!(rbuf.read_u64(8).unwrap(), 0x5e5e, "the sentinel is back");
    let start = std::time::Instant::now();
    while !sh.is_ready().unwrap() {
        assert!(start.elapsed() < Duration::from_secs(5));
    }
    sbuf.write_u64(8, 2).unwrap();
    sh.put().unwrap();
    while rbuf.read_u64(8).unwrap() != 2 {
        assert!(start.elapsed() < Duration::from_secs(5));
    }
    h.ready_mark().unwrap();
    h.ready().unwrap();
    assert_eq!(rbuf.read_u64(8).unwrap(), 2, "a mark with nothing to mark wrote the sentinel");
    spin_poll(&receiver, 1);
    assert_eq!(rbuf.read_u64(8).unwrap(), 2);
}

/// Two threads in `ready_poll` at once: thread A runs the callback of put 1 (held there);
/// the handle is marked and queued again, put 2 lands, and thread B polls. Put 2 must not
/// count as seen while its callback cannot run (it is out, on thread A): it is seen, with
/// its callback, by a poll after A's callback returned.
#[test]
fn concurrent_ready_poll_never_counts_a_put_without_its_callback() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = endpoints(&pd);
    let rbuf = pd.alloc_mr(8, AccessFlags::ALL_REMOTE).unwrap();
    let (entered_tx, entered_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let c2 = calls.clone();
    let h = receiver
        .create_handle(
            &rbuf,
            move |b| {
                let v = b.read_u64(0).unwrap();
                c2.lock().unwrap().push(v);
                if v == 1 {
                    entered_tx.send(()).unwrap();
                    release_rx.recv_timeout(Duration::from_secs(10)).unwrap();
                }
            },
            0,
        )
        .unwrap();
    let sbuf = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let sh = sender.assoc_local_buffer(&h.desc().unwrap(), sbuf.local().unwrap()).unwrap();
    h.ready_poll_q().unwrap();
    sbuf.write_u64(0, 1).unwrap();
    sh.put().unwrap();
    let a = {
        let receiver = receiver.clone();
        std::thread::spawn(move || spin_poll(&receiver, 1))
    };
    entered_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    // A is inside put 1's callback. The receiver is done with put 1 and expects put 2.
    h.ready().unwrap();
    let start = std::time::Instant::now();
    while !sh.is_ready().unwrap() {
        assert!(start.elapsed() < Duration::from_secs(5));
    }
    sbuf.write_u64(0, 2).unwrap();
    sh.put().unwrap();
    while rbuf.read_u64(0).unwrap() != 2 {
        assert!(start.elapsed() < Duration::from_secs(5));
    }
    // Thread B (this one) polls while A's callback is out.
    for _ in 0..100 {
        assert_eq!(receiver.ready_poll().unwrap(), 0);
    }
    assert_eq!(h.puts_seen(), 1, "put 2 counted as seen while its callback could not run");
    release_tx.send(()).unwrap();
    assert_eq!(a.join().unwrap(), 1);
    assert_eq!(spin_poll(&receiver, 1), 1, "put 2's callback");
    assert_eq!(*calls.lock().unwrap(), vec![1, 2]);
    assert_eq!(h.puts_seen(), 2);
}

/// CkDirect's own detection: one write per put, seen when the buffer's last word leaves
/// the out-of-band value, which `ready_mark` writes back locally.
#[test]
fn sentinel_handles_work_as_ckdirect_describes() {
    const OOB: u64 = 0x7ff8_dead_0000_0001; // a NaN pattern: never this data's last word
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = endpoints(&pd);
    let rbuf = pd.alloc_mr(256, AccessFlags::ALL_REMOTE).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    let h = receiver
        .create_handle_with(
            &rbuf,
            move |b| s2.lock().unwrap().push(b.to_vec().unwrap()),
            OOB,
            Detection::Sentinel,
        )
        .unwrap();
    let desc = HandleDesc::decode(&h.desc().unwrap().encode()).unwrap();
    assert_eq!((desc.sentinel, desc.detection()), (Some(OOB), Detection::Sentinel));
    assert_eq!(rbuf.read_u64(248).unwrap(), OOB, "the buffer starts with the sentinel");
    let sbuf = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    let sh = sender.assoc_local_buffer(&desc, sbuf.local().unwrap()).unwrap();
    for i in 1..=50u8 {
        sbuf.fill(i).unwrap();
        h.ready_poll_q().unwrap();
        sh.put().unwrap();
        assert_eq!(spin_poll(&receiver, 1), 1);
        assert_eq!(seen.lock().unwrap().last().unwrap(), &vec![i; 256]);
        assert_eq!(h.puts_seen(), u64::from(i));
        // Nothing to wait for on the sender's side: the application orders the next put.
        assert!(sh.is_ready().unwrap());
        h.ready_mark().unwrap();
        assert_eq!(rbuf.read_u64(248).unwrap(), OOB, "ready_mark rewrites the sentinel");
        // Marked and not queued: nothing fires.
        assert_eq!(receiver.ready_poll().unwrap(), 0);
    }
    // A payload ending with the out-of-band value would never be seen: refused, unsent.
    sbuf.write_u64(248, OOB).unwrap();
    assert!(matches!(sh.put(), Err(ChannelError::Invalid(_))));
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(rbuf.read_u64(0).unwrap(), u64::from_ne_bytes([50; 8]), "nothing was written");
    // The async variant sees a sentinel put too.
    sbuf.fill(0x77).unwrap();
    sh.put().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(h.next_put_timeout(Duration::from_secs(10))).unwrap();
    assert_eq!(rbuf.to_vec().unwrap(), vec![0x77; 256]);
    // The sentinel is the buffer's last aligned word: a buffer that is not whole words is
    // refused.
    let odd = pd.alloc_mr(252, AccessFlags::ALL_REMOTE).unwrap();
    assert!(matches!(
        receiver.create_handle_with(&odd, |_| {}, OOB, Detection::Sentinel),
        Err(ChannelError::Invalid(_))
    ));
}

/// `ep` as a QP of another process sees it: a GID no device of this process has, so
/// connecting to it goes over the soft NIC's TCP wire.
fn far(ep: &QpAddress) -> QpAddress {
    let mut e = *ep;
    for b in &mut e.gid[8..12] {
        *b ^= 0xa5;
    }
    e
}

/// Over the TCP wire a large write lands in pieces as it arrives; the piece holding the
/// sentinel must land last and whole, or the receiver sees a put whose data is not all
/// there. Every detected put must hold its whole payload. (The window for a torn last word
/// is a few instructions wide, so this end-to-end run does not catch its loss reliably:
/// the soft NIC's `the_last_word_of_a_write_lands_last_and_whole_however_it_is_cut` checks
/// the placement's arithmetic for every cut.)
#[test]
fn sentinel_puts_over_the_wire_are_seen_only_once_whole() {
    const LEN: usize = 64 << 10;
    const OOB: u64 = u64::MAX;
    let (ca, cb) = (
        Context::open_soft_with(SoftConfig::default()).unwrap(),
        Context::open_soft_with(SoftConfig::default()).unwrap(),
    );
    let (pa, pb) = (ca.alloc_pd().unwrap(), cb.alloc_pd().unwrap());
    let caps = QpCaps::default().with_max_inline_data(64);
    let (qa_cq, qb_cq) = (ca.create_cq(1024).unwrap(), cb.create_cq(1024).unwrap());
    let qa = pa.create_qp(&qa_cq, &qa_cq, caps).unwrap();
    let qb = pb.create_qp(&qb_cq, &qb_cq, caps).unwrap();
    // The sender's requests (the puts) go over TCP; the receiver's (control messages)
    // stay in process.
    // A transport budget of about 8 s (1.07 s per try): this test is about whole puts, not
    // timeouts, and under ThreadSanitizer on 2 CPUs, with this thread spinning, the 1 s
    // budget it had once ran out (RETRY_EXC_ERR on the receiver's keep-alive, 1 run in 40).
    let opts = ConnectOptions::default().with_timeout(18).with_retry_cnt(7);
    qb.connect(&qa.address().unwrap(), &opts).unwrap();
    qa.connect(&far(&qb.address().unwrap()), &opts).unwrap();
    let sender = PutEndpoint::new(qa, qa_cq, PollMode::Busy).unwrap();
    let receiver = PutEndpoint::new(qb, qb_cq, PollMode::Busy).unwrap();
    let rbuf = pb.alloc_mr(LEN, AccessFlags::ALL_REMOTE).unwrap();
    let h = receiver.create_handle_with(&rbuf, |_| {}, OOB, Detection::Sentinel).unwrap();
    let sbuf = pa.alloc_mr(LEN, AccessFlags::LOCAL_WRITE).unwrap();
    let sh = sender.assoc_local_buffer(&h.desc().unwrap(), sbuf.local().unwrap()).unwrap();
    let mut payload = vec![0u8; LEN];
    for i in 0..100u32 {
        // Every byte differs from the previous put's, the last word included.
        for (j, b) in payload.iter_mut().enumerate() {
            *b = (i as usize * 7 + j) as u8;
        }
        sbuf.write_at(0, &payload).unwrap();
        h.ready_poll_q().unwrap();
        sh.put().unwrap();
        spin_poll(&receiver, 1);
        assert_eq!(
            checksum(&rbuf.to_vec().unwrap()),
            checksum(&payload),
            "put {i} seen before all of it landed"
        );
        h.ready_mark().unwrap();
    }
}

/// A sentinel put is posted without a CQ poll first (nobody waits for its completion):
/// thousands of them in a row, with nothing else called between, on a send queue of 8,
/// never find it full: a put that would take it past half polls first.
#[test]
fn sentinel_puts_in_a_row_never_fill_a_shallow_send_queue() {
    let (pd, qa, ea, eb) = shallow_endpoints(8);
    let rb = pd.alloc_mr(64, AccessFlags::ALL_REMOTE).unwrap();
    let sa = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let hb = eb.create_handle_with(&rb, |_| {}, u64::MAX, Detection::Sentinel).unwrap();
    let to_b = ea.assoc_local_buffer(&hb.desc().unwrap(), sa.local().unwrap()).unwrap();
    let mut most = 0;
    for it in 0..2000u64 {
        sa.write_u64(56, it).unwrap();
        to_b.put().unwrap();
        most = most.max(qa.outstanding_sends());
    }
    assert!(most <= 4, "unpolled puts kept at most half the send queue: {most}");
    assert_eq!(rb.read_u64(56).unwrap(), 1999);
    assert_eq!(to_b.puts(), 2000);
}

/// A put whose write fails (the receiver's buffer is gone) is reported by a later put
/// within the few steps the driver takes without polling the CQ: puts do not go on
/// succeeding into a broken connection.
#[test]
fn a_failed_unpolled_put_is_reported_within_a_few_puts() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = endpoints(&pd);
    let rb = pd.alloc_mr(64, AccessFlags::ALL_REMOTE).unwrap();
    let sa = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let hb = receiver.create_handle_with(&rb, |_| {}, u64::MAX, Detection::Sentinel).unwrap();
    let to_b = sender.assoc_local_buffer(&hb.desc().unwrap(), sa.local().unwrap()).unwrap();
    for _ in 0..40 {
        to_b.put().unwrap();
    }
    // The region is deregistered: the next write is refused by the receiver's NIC.
    drop(hb);
    drop(rb);
    let mut ok = 0;
    let err = loop {
        match to_b.put() {
            Ok(()) => ok += 1,
            Err(e) => break e,
        }
        assert!(ok <= 17, "puts kept succeeding after the failed one");
    };
    assert!(matches!(err, ChannelError::Broken { .. }), "{err}");
}

/// Handles of one test below: `faces` receive handles on `eb`, each associated with a
/// sender on `ea` over one shared source buffer, all queued for polling.
#[allow(clippy::type_complexity)]
fn many_faces(
    pd: &ProtectionDomain,
    ea: &PutEndpoint,
    eb: &PutEndpoint,
    faces: usize,
) -> (Vec<MemoryRegion>, MemoryRegion, Vec<RecvHandle>, Vec<SendHandle>) {
    let rbs: Vec<_> = (0..faces).map(|_| pd.alloc_mr(64, AccessFlags::ALL_REMOTE).unwrap()).collect();
    let sa = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let hbs: Vec<_> = rbs.iter().map(|rb| eb.create_handle(rb, |_| {}, 0).unwrap()).collect();
    let tos = hbs
        .iter()
        .map(|hb| ea.assoc_local_buffer(&hb.desc().unwrap(), sa.local().unwrap()).unwrap())
        .collect();
    for hb in &hbs {
        hb.ready_poll_q().unwrap();
    }
    (rbs, sa, hbs, tos)
}

/// Puts until one is posted: `Busy` (the receiver's mark not there yet, or no room in the
/// send queue) is retried, with both endpoints making progress meanwhile (as both sides of
/// an application would); anything else fails the test.
fn put_until_posted(to: &SendHandle, ep: &PutEndpoint, peer: &PutEndpoint, what: &str) -> usize {
    let start = std::time::Instant::now();
    let mut busy = 0;
    while let Err(e) = to.put() {
        assert!(matches!(e, ChannelError::Busy), "{what}: {e}");
        busy += 1;
        ep.progress().unwrap();
        peer.progress().unwrap(); // takes the control messages in, posts deferred marks
        assert!(start.elapsed() < Duration::from_secs(10), "{what}: the sender stayed busy");
    }
    busy
}

/// Associating many handles at once queues their control messages behind a full send
/// queue; a put meanwhile must be `Busy` (retry), not fail with the queue full.
#[test]
fn a_put_behind_a_full_send_queue_is_busy_not_an_error() {
    let (pd, qa, ea, eb) = shallow_endpoints(8);
    let (rbs, sa, _hbs, tos) = many_faces(&pd, &ea, &eb, 40);
    assert_eq!(qa.outstanding_sends(), 8, "the associations fill the send queue");
    sa.write_u64(0, 7).unwrap();
    for to in &tos {
        put_until_posted(to, &ea, &eb, "first put");
    }
    spin_poll(&eb, rbs.len());
    assert!(rbs.iter().all(|rb| rb.read_u64(0).unwrap() == 7));
}

/// A receiver that marks many handles done in a row (a halo exchange with more faces than
/// its send queue is deep) posts one ready signal per handle, nobody polling the CQ in
/// between: the marks must wait for room, never fail with a full send queue, and every
/// sender must get its signal.
#[test]
fn many_ready_marks_in_a_row_never_fill_a_shallow_send_queue() {
    let (pd, _, ea, eb) = shallow_endpoints(8);
    let (rbs, sa, hbs, tos) = many_faces(&pd, &ea, &eb, 40);
    for round in 0..50u64 {
        sa.write_u64(0, round).unwrap();
        for to in &tos {
            put_until_posted(to, &ea, &eb, &format!("round {round}"));
        }
        spin_poll(&eb, rbs.len());
        for (hb, rb) in hbs.iter().zip(&rbs) {
            assert_eq!(rb.read_u64(0).unwrap(), round);
            hb.ready().unwrap();
        }
    }
    for to in &tos {
        assert_eq!(to.puts(), 50);
    }
}

/// A CQ smaller than the QP's send queue plus the endpoint's receive slots could overrun
/// (a burst of associations, each a signalled control message, before the next poll), which
/// would break the endpoint for good: it is refused up front. One just large enough takes a
/// hundred associations at once.
#[test]
fn a_completion_queue_that_could_overrun_is_refused() {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let endpoints = |cqe: u32| {
        let (ca, cb) = (ctx.create_cq(cqe).unwrap(), ctx.create_cq(cqe).unwrap());
        let (qa, qb) = (
            pd.create_qp(&ca, &ca, QpCaps::default()).unwrap(),
            pd.create_qp(&cb, &cb, QpCaps::default()).unwrap(),
        );
        qa.connect(&qb.address().unwrap(), &ConnectOptions::default()).unwrap();
        qb.connect(&qa.address().unwrap(), &ConnectOptions::default()).unwrap();
        (PutEndpoint::new(qa, ca, PollMode::Busy), PutEndpoint::new(qb, cb, PollMode::Busy))
    };
    let (tx, _) = endpoints(64);
    match tx {
        Err(ChannelError::QueueTooSmall { needed, got, .. }) => assert_eq!((needed, got), (160, 64)),
        other => panic!("a 64-entry CQ under a 128-deep send queue: {:?}", other.map(|_| ())),
    }
    let (tx, rx) = endpoints(160);
    let (tx, rx) = (tx.unwrap(), rx.unwrap());
    let rbs: Vec<_> = (0..100).map(|_| pd.alloc_mr(64, AccessFlags::ALL_REMOTE).unwrap()).collect();
    let hs: Vec<_> = rbs.iter().map(|rb| rx.create_handle(rb, |_| {}, 0).unwrap()).collect();
    let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let tos: Vec<_> =
        hs.iter().map(|h| tx.assoc_local_buffer(&h.desc().unwrap(), src.local().unwrap()).unwrap()).collect();
    for _ in 0..1000 {
        rx.progress().unwrap();
        tx.progress().unwrap();
    }
    put_until_posted(&tos[0], &tx, &rx, "after a hundred associations");
}

/// What a put endpoint ignores from its peer (here 1000 one-byte sends, malformed control
/// messages) is logged at most once a second, not once a message: the peer must not decide
/// how much its target logs.
#[test]
fn junk_from_the_peer_does_not_flood_the_log() {
    let (delivered, text) = common::with_captured_log(|| {
        let ctx = Context::open_soft();
        let pd = ctx.alloc_pd().unwrap();
        let caps = QpCaps::default().with_max_send_wr(256).with_max_recv_wr(64).with_max_inline_data(64);
        let (ca, cb) = (ctx.create_cq(1024).unwrap(), ctx.create_cq(1024).unwrap());
        let qa = pd.create_qp(&ca, &ca, caps).unwrap();
        let raw = pd.create_qp(&cb, &cb, caps).unwrap();
        qa.connect(&raw.address().unwrap(), &ConnectOptions::default()).unwrap();
        raw.connect(&qa.address().unwrap(), &ConnectOptions::default()).unwrap();
        let ep = PutEndpoint::new(qa, ca, PollMode::Busy).unwrap();
        let mut delivered = 0;
        for _round in 0..50 {
            // 20 at a time: the endpoint has 32 receive slots.
            for _ in 0..20 {
                raw.post_send(SendWr::send_inline(&[0xEE])).unwrap();
            }
            let start = std::time::Instant::now();
            let mut round = 0;
            while round < 20 {
                ep.progress().unwrap();
                while let Some(wc) = cb.poll_one().unwrap() {
                    assert!(wc.status.is_success());
                    round += 1;
                }
                assert!(start.elapsed() < Duration::from_secs(10), "the endpoint stopped taking messages");
            }
            delivered += round;
        }
        for _ in 0..100 {
            ep.progress().unwrap();
        }
        delivered
    });
    let warnings = text.lines().filter(|l| l.contains("WARN")).count();
    assert!(warnings < 10, "{delivered} junk messages gave {warnings} warnings:\n{text}");
}

/// Runs `f` on a thread; fails if it has not returned in 5 s (a deadlock).
fn returns_in_time(what: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    assert!(rx.recv_timeout(Duration::from_secs(5)).is_ok(), "{what} deadlocked");
}

/// Endpoints on one soft device, a 16-byte buffer for the handle under test, and another
/// handle of the receiver (over a buffer of its own) for that handle's callback to own.
fn with_inner_handle() -> (ProtectionDomain, PutEndpoint, PutEndpoint, MemoryRegion, RecvHandle) {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = endpoints(&pd);
    let (b1, b2) = (
        pd.alloc_mr(16, AccessFlags::ALL_REMOTE).unwrap(),
        pd.alloc_mr(16, AccessFlags::ALL_REMOTE).unwrap(),
    );
    let inner = receiver.create_handle(&b2, |_| {}, 0).unwrap();
    (pd, sender, receiver, b1, inner)
}

#[test]
fn a_handle_whose_callback_owns_another_handle_can_be_dropped() {
    // An application keeps a handle in another's callback (say, to ready it when the first
    // fires). Dropping the first drops the callback, and with it the second handle, whose
    // own drop takes the endpoint's lock: the first must not hold it then.
    returns_in_time("dropping the handle", || {
        let (_pd, _sender, receiver, b1, inner) = with_inner_handle();
        let outer = receiver
            .create_handle(
                &b1,
                move |_| {
                    let _ = inner.is_marked();
                },
                0,
            )
            .unwrap();
        drop(outer);
        // The endpoint still works.
        let again = receiver.create_handle(&b1, |_| {}, 0).unwrap();
        assert!(again.desc().is_ok());
    });
}

#[test]
fn a_callback_that_destroys_its_own_handle_is_dropped_without_the_lock() {
    // The callback destroys its own handle while it runs (through shared state), and owns
    // another handle: `ready_poll` cannot put the callback back, and drops it, and with it
    // the other handle, whose drop takes the endpoint's lock.
    returns_in_time("ready_poll", || {
        let (pd, sender, receiver, b1, inner) = with_inner_handle();
        let own: Arc<Mutex<Option<RecvHandle>>> = Arc::default();
        let own2 = own.clone();
        let h = receiver
            .create_handle(
                &b1,
                move |_| {
                    let _ = inner.is_marked();
                    drop(own2.lock().unwrap().take()); // destroys this very handle
                },
                0,
            )
            .unwrap();
        let desc = h.desc().unwrap();
        h.ready_poll_q().unwrap();
        *own.lock().unwrap() = Some(h);
        let sbuf = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
        let sh = sender.assoc_local_buffer(&desc, sbuf.local().unwrap()).unwrap();
        sh.put().unwrap();
        assert_eq!(spin_poll(&receiver, 1), 1);
        assert!(own.lock().unwrap().is_none(), "the callback destroyed its handle");
        assert_eq!(receiver.ready_poll().unwrap(), 0, "the endpoint still works");
    });
}
