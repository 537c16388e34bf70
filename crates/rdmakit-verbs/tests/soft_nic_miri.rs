//! End-to-end soft NIC flows small enough for Miri
//! (`cargo +nightly miri test -p rdmakit-verbs --no-default-features --test soft_nic_miri`).
//!
//! They check the soundness claims at the API: a CPU thread copying a region while the NIC
//! writes and runs atomics on it is race-free; dropping QPs and regions in any order with
//! work outstanding frees nothing the NIC still uses.

use std::sync::atomic::{AtomicBool, Ordering};

use rdmakit_verbs::*;

fn pair() -> (ProtectionDomain, CompletionQueue, QueuePair, QueuePair) {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let a = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    let b = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    let o = ConnectOptions::default();
    a.connect(&b.address().unwrap(), &o).unwrap();
    b.connect(&a.address().unwrap(), &o).unwrap();
    (pd, cq, a, b)
}

fn reap(cq: &CompletionQueue) -> WorkCompletion {
    loop {
        if let Some(wc) = cq.poll_one().unwrap() {
            return wc;
        }
        std::thread::yield_now();
    }
}

#[test]
fn cpu_reader_races_nic_writes_and_atomics_soundly() {
    let (pd, cq, a, _b) = pair();
    let target = pd.alloc_mr(64, AccessFlags::ALL_REMOTE).unwrap();
    let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let res = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    src.fill(7).unwrap();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut buf = [0u8; 29];
            while !stop.load(Ordering::Relaxed) {
                target.read_at(3, &mut buf).unwrap();
                target.write_at(43, &buf[..5]).unwrap();
            }
        });
        for i in 0..6u64 {
            let w = SendWr::write(src.slice(0, 31).unwrap(), target.remote().slice(1, 31).unwrap());
            a.post_send(w).unwrap();
            let f = SendWr::fetch_add(res.local().unwrap(), target.remote().slice(32, 8).unwrap(), i);
            a.post_send(f).unwrap();
            assert!(reap(&cq).status.is_success());
            assert!(reap(&cq).status.is_success());
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert_eq!(target.read_u64(32).unwrap(), 15);
}

#[test]
fn send_recv_read_and_errors() {
    let (pd, cq, a, b) = pair();
    let m = pd.alloc_mr(32, AccessFlags::ALL_REMOTE).unwrap();
    let r = pd.register(vec![0u8; 16], AccessFlags::LOCAL_WRITE).unwrap();
    m.write_at(0, b"0123456789abcdef").unwrap();
    b.post_recv(RecvWr::new(r.local().unwrap()).wr_id(1)).unwrap();
    a.post_send(SendWr::send(m.slice(0, 16).unwrap()).with_imm(3).wr_id(2)).unwrap();
    let mut seen = [reap(&cq), reap(&cq)];
    seen.sort_by_key(|w| w.wr_id);
    assert_eq!((seen[0].wr_id, seen[0].imm, seen[0].byte_len), (1, Some(3), 16));
    a.post_send(SendWr::read(m.slice(16, 8).unwrap(), m.remote().slice(4, 8).unwrap())).unwrap();
    reap(&cq).ok().unwrap();
    let mut back = [0u8; 8];
    m.read_at(16, &mut back).unwrap();
    assert_eq!(&back, b"456789ab");
    // A bad rkey: error completion, QP to error, nothing written.
    a.post_send(SendWr::write(m.slice(0, 4).unwrap(), RemoteSlice::new(m.addr(), 4, m.rkey() ^ 1))).unwrap();
    assert_eq!(reap(&cq).status, WcStatus::REM_ACCESS_ERR);
    assert_eq!(a.state(), QpState::Error);
    assert_eq!(r.try_into_vec().unwrap(), b"0123456789abcdef");
}

#[test]
fn drop_everything_with_work_outstanding() {
    let (pd, cq, a, b) = pair();
    let buf = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    // No receive is posted: the send waits for one (RNR, infinite retries) and keeps
    // `buf` alive through its in-flight slot.
    a.post_send(SendWr::send(buf.local().unwrap())).unwrap();
    assert_eq!(a.outstanding(), (1, 0));
    drop(buf);
    drop(b);
    drop(a);
    drop(pd);
    // Completions of destroyed QPs are discarded.
    assert!(cq.poll_one().unwrap().is_none());
}

/// An odd-length vector: its padding bytes (spare capacity up to the next multiple of 8)
/// are read as part of whole words by the copy path, so registration must initialise them.
/// Under Miri an uninitialised padding byte read here is an error.
#[test]
fn odd_length_register_reads_only_initialised_bytes() {
    let (pd, cq, a, _b) = pair();
    // Many lengths and allocations: only a vector that happens to be 8-aligned is taken in
    // place (others are copied into an aligned buffer), so try enough of them.
    for len in (1usize..16).filter(|l| l % 8 != 0).cycle().take(42) {
        let mut v = Vec::with_capacity(len);
        v.extend((0..len).map(|i| i as u8 + 1));
        let mr = pd.register(v, AccessFlags::ALL_REMOTE).unwrap();
        let mut back = vec![0u8; len];
        mr.read_at(0, &mut back).unwrap();
        assert_eq!(back, (0..len).map(|i| i as u8 + 1).collect::<Vec<_>>());
        // The NIC reads it too (a loopback RDMA read of the whole region).
        let dst = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
        a.post_send(SendWr::read(
            dst.slice(0, len as u32).unwrap(),
            mr.remote().slice(0, len as u32).unwrap(),
        ))
        .unwrap();
        assert!(reap(&cq).status.is_success());
        assert_eq!(dst.to_vec().unwrap()[..len], back[..]);
        assert_eq!(mr.try_into_vec().unwrap(), back);
    }
}

/// `as_slice_at` over bytes of one aligned word while another thread (`write_at`, whole and
/// partial words) and the NIC (RDMA writes, whole and partial words) write the *adjacent*
/// aligned words on both sides. The contract of `as_slice_at` constrains only the words the
/// slice touches; a write path that read-modify-wrote a neighbouring word (or rounded a
/// partial write out to two words) would race with the slice's plain reads, which Miri's
/// race detector reports.
#[test]
fn as_slice_at_beside_concurrent_neighbour_writes() {
    let (pd, cq, a, _b) = pair();
    let rounds = if cfg!(miri) { 3 } else { 200 };
    let mr = pd.alloc_mr(24, AccessFlags::ALL_REMOTE).unwrap();
    let src = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    src.fill(0xee).unwrap();
    mr.write_at(8, b"abcdefgh").unwrap();
    // SAFETY: nothing writes bytes 8..16 (the one aligned word the slice touches) while the
    // slice lives: the thread and the NIC below write only words 0..8 and 16..24; the write
    // of bytes 8..16 above happened before, on this thread.
    let part = unsafe { mr.as_slice_at(9, 6) }.unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..rounds {
                mr.write_at(0, &[i as u8; 8]).unwrap(); // the whole word before
                mr.write_at(5, &[i as u8; 3]).unwrap(); // its last bytes, touching the slice's word's edge
                mr.write_at(16, &[i as u8; 2]).unwrap(); // the first bytes of the word after
            }
        });
        for _ in 0..rounds {
            // The NIC: a whole word after, and a partial one ending at the slice's word.
            a.post_send(SendWr::write(src.slice(0, 8).unwrap(), mr.remote().slice(16, 8).unwrap())).unwrap();
            a.post_send(SendWr::write(src.slice(0, 3).unwrap(), mr.remote().slice(5, 3).unwrap())).unwrap();
            assert!(reap(&cq).status.is_success());
            assert!(reap(&cq).status.is_success());
            assert_eq!(part, b"bcdefg");
        }
    });
    assert_eq!(part, b"bcdefg");
}

/// A CPU copy into and out of the very word the NIC runs atomics on: the thread writes the
/// word's upper half (`write_at`, a partial-word merge) and reads across it while the NIC
/// fetch-adds small values into its lower half. Sound (every access to the word is an
/// aligned atomic, so Miri reports no mixed-size or non-atomic race), and nothing is lost:
/// the merge keeps the NIC's sums and the atomics keep the CPU's bytes.
#[test]
fn cpu_copy_races_nic_atomic_on_the_same_word() {
    let (pd, cq, a, _b) = pair();
    let rounds: u64 = if cfg!(miri) { 4 } else { 300 };
    let target = pd.alloc_mr(16, AccessFlags::ALL_REMOTE).unwrap();
    let res = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let stop = AtomicBool::new(false);
    let last = std::thread::scope(|s| {
        let cpu = s.spawn(|| {
            let mut last = 0u32;
            let mut seen = [0u8; 10];
            // Bounded as well, so that Miri's interpreter does not spin long.
            for _ in 0..rounds * 50 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                last = last.wrapping_add(1) | 0x100;
                target.write_at(4, &last.to_le_bytes()).unwrap();
                target.read_at(2, &mut seen).unwrap();
                // The upper half read back is this thread's own last store.
                assert_eq!(seen[2..6], last.to_le_bytes());
            }
            last
        });
        for i in 1..=rounds {
            let f = SendWr::fetch_add(res.local().unwrap(), target.remote().slice(0, 8).unwrap(), i);
            a.post_send(f).unwrap();
            assert!(reap(&cq).status.is_success());
            // The value fetched: the lower half is the sum so far, whatever the CPU wrote above it.
            assert_eq!(res.read_u64(0).unwrap() & 0xffff_ffff, (i - 1) * i / 2);
        }
        stop.store(true, Ordering::Relaxed);
        cpu.join().unwrap()
    });
    let word = target.read_u64(0).unwrap();
    assert_eq!(word & 0xffff_ffff, rounds * (rounds + 1) / 2, "a NIC atomic was lost");
    assert_eq!((word >> 32) as u32, last, "the CPU's bytes were lost");
}
