//! The soft NIC keeps its soundness promises while a large transfer is still landing:
//! deregistering memory the caller owns waits for accesses in progress, and a receive keeps
//! its region until its own completion, whatever completes before it. Each test holds a
//! race window open with a 256 MiB transfer.

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use rdmakit_verbs::*;

mod common;

const LEN: usize = 256 << 20;

/// A connected loopback pair on the default soft device, each QP on its own CQ.
fn pair() -> (ProtectionDomain, QueuePair, CompletionQueue, QueuePair, CompletionQueue) {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let (ca, cb) = (ctx.create_cq(16).unwrap(), ctx.create_cq(16).unwrap());
    let a = pd.create_qp(&ca, &ca, QpCaps::default()).unwrap();
    let b = pd.create_qp(&cb, &cb, QpCaps::default()).unwrap();
    a.connect(&b.address().unwrap(), &ConnectOptions::default()).unwrap();
    b.connect(&a.address().unwrap(), &ConnectOptions::default()).unwrap();
    (pd, a, ca, b, cb)
}

/// Sends `LEN` bytes of 0xAB from `a` on a thread of its own (the peer's receive is posted
/// by the caller), returning the send's completion.
fn send_big(
    pd: &ProtectionDomain,
    a: QueuePair,
    ca: CompletionQueue,
) -> std::thread::JoinHandle<WorkCompletion> {
    let src = pd.alloc_mr(LEN, AccessFlags::LOCAL_WRITE).unwrap();
    src.fill(0xAB).unwrap();
    std::thread::spawn(move || {
        a.post_send(SendWr::send(src.slice(0, LEN as u32).unwrap())).unwrap();
        ca.wait(Some(Duration::from_secs(60))).unwrap()
    })
}

/// Spins until the first word of `mr` is no longer zero: the transfer has started landing.
fn started(mr: &MemoryRegion) {
    let t0 = Instant::now();
    while mr.read_u64(0).unwrap() == 0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "the transfer never started");
        std::hint::spin_loop();
    }
}

/// `b`'s receive 1 (`big`, `LEN` bytes) being filled by `writer`'s send; receives `more`
/// (into `small`) were posted behind it before the send.
struct Filling {
    b: QueuePair,
    cb: CompletionQueue,
    big: MemoryRegion,
    small: MemoryRegion,
    writer: std::thread::JoinHandle<WorkCompletion>,
}

fn receive_being_filled(more: &[u64]) -> Filling {
    let (pd, a, ca, b, cb) = pair();
    let big = pd.alloc_mr(LEN, AccessFlags::LOCAL_WRITE).unwrap();
    let small = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    b.post_recv(RecvWr::new(big.slice(0, LEN as u32).unwrap()).wr_id(1)).unwrap();
    for &id in more {
        b.post_recv(RecvWr::new(small.local().unwrap()).wr_id(id)).unwrap();
    }
    let writer = send_big(&pd, a, ca);
    started(&big);
    Filling { b, cb, big, small, writer }
}

/// `register_raw`'s contract: the caller's memory is theirs again once the region's last
/// handle is dropped. So the drop must wait for a peer's RDMA write that already resolved
/// the key and is still landing; afterwards nothing more lands. (Before, the drop returned
/// at once and the rest of the write landed in memory the caller had reused.)
#[test]
fn dropping_a_raw_region_waits_for_a_write_still_landing() {
    let (pd, a, ca, _b, _cb) = pair();
    let mem = common::anonymous(LEN);
    // SAFETY: `mem..mem + LEN` is allocated, readable and writable, and stays so until the
    // region (the only handle, never cloned nor used in a local work request) is dropped.
    let target =
        unsafe { pd.register_raw(NonNull::new(mem.cast()).unwrap(), LEN, AccessFlags::ALL_REMOTE) }.unwrap();
    let remote = target.remote().slice(0, LEN as u32).unwrap();
    let src = pd.alloc_mr(LEN, AccessFlags::LOCAL_WRITE).unwrap();
    src.fill(0xAB).unwrap();
    let writer = std::thread::spawn(move || {
        a.post_send(SendWr::write(src.slice(0, LEN as u32).unwrap(), remote)).unwrap();
        ca.wait(Some(Duration::from_secs(30))).unwrap()
    });
    started(&target);
    drop(target); // the last handle: the memory is the caller's again once this returns
    // The caller reuses the range: a fresh, zeroed mapping in its place.
    // SAFETY: `mem..mem + LEN` is our mapping; MAP_FIXED replaces it.
    let again = unsafe {
        libc::mmap(
            mem,
            LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    assert_eq!(again, mem);
    let wc = writer.join().unwrap();
    // SAFETY: the writer has finished; the mapping is ours and initialised.
    let fresh = unsafe { std::slice::from_raw_parts(mem.cast::<u8>(), LEN) };
    let overwritten = fresh.iter().filter(|&&b| b != 0).count();
    // SAFETY: our mapping, no longer borrowed.
    unsafe { libc::munmap(mem, LEN) };
    assert_eq!(overwritten, 0, "bytes landed after the region's last handle was dropped ({:?})", wc.status);
}

/// Receive 1 is being filled by a peer's send when the QP moves to the error state and
/// receive 2 is flushed. Reaping the flush must not release receive 1's region (the NIC is
/// still writing it), and receive 1's own completion must reach the application, before
/// receive 2's flush and before that of receive 3, posted in the error state: a queue's
/// completions come in the order its requests were posted.
#[test]
fn a_flushed_later_receive_does_not_release_one_still_being_filled() {
    let Filling { b, cb, big, small, writer } = receive_being_filled(&[2]);
    b.modify_to_error().unwrap();
    b.post_recv(RecvWr::new(small.local().unwrap()).wr_id(3)).unwrap();
    let writing = !writer.is_finished();
    let first = cb.wait(Some(Duration::from_secs(5))).unwrap();
    let unique = big.is_unique();
    let sent = writer.join().unwrap();
    let mut ids = vec![first.wr_id];
    while let Ok(wc) = cb.wait(Some(Duration::from_millis(500))) {
        assert_eq!(wc.status, WcStatus::WR_FLUSH_ERR, "{wc:?}");
        ids.push(wc.wr_id);
    }
    assert!(writing, "the race window was missed (the copy finished before the QP failed)");
    assert!(!unique || first.wr_id == 1, "receive 1's region was released while still being written");
    assert_eq!(
        ids,
        [1, 2, 3],
        "every receive completes once, in posting order (the sender saw {:?})",
        sent.status
    );
}

/// A receive posted while the QP is failing (its state already Error, its receive queue not
/// flushed yet) completes after the receives posted before it. (Found in review: it was
/// flushed at once, ahead of them, in 4 to 7 rounds of 10.)
#[test]
fn a_receive_posted_as_the_qp_fails_completes_after_earlier_ones() {
    const SENDS: u64 = 8000;
    const EARLY: u64 = 64;
    let mut bad = Vec::new();
    for round in 0..10 {
        let ctx = Context::open_soft();
        let pd = ctx.alloc_pd().unwrap();
        let ca = ctx.create_cq(16).unwrap();
        let cb = ctx.create_cq(16384).unwrap();
        let a = pd.create_qp(&ca, &ca, QpCaps::default()).unwrap();
        let caps = QpCaps::default().with_max_send_wr(8192).with_max_recv_wr(1024);
        let b = pd.create_qp(&cb, &cb, caps).unwrap();
        a.connect(&b.address().unwrap(), &ConnectOptions::default()).unwrap();
        b.connect(&a.address().unwrap(), &ConnectOptions::default()).unwrap();
        let buf = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
        // `a` posts no receive: `b`'s first send waits on RNR and the rest queue up, so that
        // `b`'s move to the error state spends a while flushing sends before its receives.
        for i in 0..SENDS {
            b.post_send(SendWr::send(buf.local().unwrap()).wr_id((1 << 40) | i)).unwrap();
        }
        for i in 0..EARLY {
            b.post_recv(RecvWr::new(buf.local().unwrap()).wr_id(i)).unwrap();
        }
        std::thread::scope(|s| {
            let poster = s.spawn(|| {
                let t0 = Instant::now();
                while b.state() != QpState::Error {
                    assert!(t0.elapsed() < Duration::from_secs(10));
                    std::hint::spin_loop();
                }
                b.post_recv(RecvWr::new(buf.local().unwrap()).wr_id(1000)).unwrap();
            });
            b.modify_to_error().unwrap();
            poster.join().unwrap();
        });
        let mut recvs = Vec::new();
        let mut out = vec![WorkCompletion::default(); 1024];
        let t0 = Instant::now();
        while recvs.len() < (EARLY + 1) as usize && t0.elapsed() < Duration::from_secs(10) {
            let n = cb.poll(&mut out).unwrap();
            recvs.extend(out[..n].iter().filter(|wc| wc.wr_id < (1 << 40)).map(|wc| wc.wr_id));
        }
        let want: Vec<u64> = (0..EARLY).chain([1000]).collect();
        if recvs != want {
            bad.push((round, recvs.iter().position(|&x| x == 1000)));
        }
    }
    assert!(
        bad.is_empty(),
        "receive 1000 (posted after 0..{EARLY}) completed out of order: (round, its position) {bad:?}"
    );
}

/// Dropping a caller-owned region that nothing uses does not wait for an unrelated QP busy
/// with a large in-process transfer (copied under that requester's lock): only a
/// deregistration that may have reads outstanding over the wire visits the QPs. (Found in
/// review: the drop waited for the whole copy.)
#[test]
fn dropping_an_idle_raw_region_does_not_wait_for_an_unrelated_transfer() {
    let (pd, a, ca, b, _cb) = pair();
    let dst = pd.alloc_mr(LEN, AccessFlags::LOCAL_WRITE).unwrap();
    b.post_recv(RecvWr::new(dst.slice(0, LEN as u32).unwrap())).unwrap();
    let mut mem = vec![0u64; 512];
    // SAFETY: `mem` outlives the region, dropped below; nothing else touches it meanwhile.
    let idle = unsafe {
        pd.register_raw(NonNull::new(mem.as_mut_ptr().cast()).unwrap(), 4096, AccessFlags::LOCAL_WRITE)
    }
    .unwrap();
    let writer = send_big(&pd, a, ca);
    started(&dst);
    drop(idle);
    // Had the drop waited for the copy, the last word would have landed.
    let last_landed = dst.read_u64(LEN as u64 - 8).unwrap() != 0;
    let wc = writer.join().unwrap();
    assert!(wc.status.is_success(), "{wc:?}");
    assert!(!last_landed, "dropping an idle region waited for an unrelated transfer to end");
    drop(mem);
}

/// Flushes held back behind a receive being filled are bounded: receives posted to the
/// failed QP beyond what its CQ holds overrun the CQ (as their flushes would on a NIC,
/// none of them polled) instead of piling up in memory.
#[test]
fn flushes_held_back_beyond_the_cq_overrun_it() {
    let Filling { b, cb, big: _big, small, writer } = receive_being_filled(&[]);
    b.modify_to_error().unwrap();
    let cap = cb.capacity() as u64;
    for i in 0..4 * cap {
        b.post_recv(RecvWr::new(small.local().unwrap()).wr_id(100 + i)).unwrap();
    }
    let writing = !writer.is_finished();
    let mut out = vec![WorkCompletion::default(); 4];
    let polled = cb.poll(&mut out);
    writer.join().unwrap();
    assert!(writing, "the race window was missed (the copy finished before the posts)");
    assert!(matches!(polled, Err(Error::CqOverrun { .. })), "{polled:?}");
}

#[test]
fn a_poll_into_no_room_returns_at_once_and_leaves_the_cq_usable() {
    // An empty output slice used to loop for ever, holding the CQ's registry lock. All on
    // a thread of its own: a hang fails this test instead of blocking it (dropping the QPs
    // takes that lock).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (_pd, _a, ca, _b, _cb) = pair();
        let empty = ca.poll(&mut []).map_err(|e| e.to_string());
        let _ = tx.send((empty, ca.poll_one().map(|wc| wc.is_none()).map_err(|e| e.to_string())));
    });
    let got = rx.recv_timeout(Duration::from_secs(5)).expect("poll(&mut []) returned");
    assert_eq!(got, (Ok(0), Ok(true)));
}

#[test]
fn a_wait_without_practical_end_is_one_without_deadline() {
    // `Duration::MAX` overflowed the clock (a panic); it now waits like `None`.
    let (pd, a, ca, _b, _cb) = pair();
    let src = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = pd.alloc_mr(8, AccessFlags::ALL_REMOTE).unwrap();
    a.post_send(SendWr::write(src.local().unwrap(), dst.remote().slice(0, 8).unwrap())).unwrap();
    let wc = ca.wait(Some(Duration::MAX)).unwrap();
    assert!(wc.status.is_success());
}
