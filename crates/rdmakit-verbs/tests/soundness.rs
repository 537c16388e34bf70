//! The soft NIC keeps its soundness promises while a large transfer is still landing:
//! deregistering memory the caller owns waits for accesses in progress, and a receive keeps
//! its region until its own completion, whatever completes before it. Each test holds a
//! race window open with a 256 MiB transfer.

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use rdmakit_verbs::*;

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

/// Spins until the first word of `mr` is no longer zero: the transfer has started landing.
fn started(mr: &MemoryRegion) {
    let t0 = Instant::now();
    while mr.read_u64(0).unwrap() == 0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "the transfer never started");
        std::hint::spin_loop();
    }
}

/// `register_raw`'s contract: the caller's memory is theirs again once the region's last
/// handle is dropped. So the drop must wait for a peer's RDMA write that already resolved
/// the key and is still landing; afterwards nothing more lands. (Before, the drop returned
/// at once and the rest of the write landed in memory the caller had reused.)
#[test]
fn dropping_a_raw_region_waits_for_a_write_still_landing() {
    let (pd, a, ca, _b, _cb) = pair();
    // SAFETY: a plain anonymous mapping of our own.
    let mem = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(mem, libc::MAP_FAILED);
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
    let (pd, a, ca, b, cb) = pair();
    let big = pd.alloc_mr(LEN, AccessFlags::LOCAL_WRITE).unwrap();
    let small = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    b.post_recv(RecvWr::new(big.slice(0, LEN as u32).unwrap()).wr_id(1)).unwrap();
    b.post_recv(RecvWr::new(small.local().unwrap()).wr_id(2)).unwrap();
    let src = pd.alloc_mr(LEN, AccessFlags::LOCAL_WRITE).unwrap();
    src.fill(0xAB).unwrap();
    let writer = std::thread::spawn(move || {
        a.post_send(SendWr::send(src.slice(0, LEN as u32).unwrap())).unwrap();
        ca.wait(Some(Duration::from_secs(30))).unwrap()
    });
    started(&big);
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
