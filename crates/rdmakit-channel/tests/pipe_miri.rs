//! Flag-mode pipes small enough for Miri
//! (`cargo +nightly miri test -p rdmakit-channel --test pipe_miri`, run by `scripts/dev.sh`'s
//! Miri tier with strict provenance).
//!
//! In flag mode the receiver learns that a block landed by polling the mailbox's sequence
//! word, which the NIC writes last (release) and the receiver loads with acquire; then it
//! reads the block the NIC wrote from another thread. Under Miri's race detector a missing
//! release/acquire pair between the NIC's data writes and the reader's reads is reported as
//! a data race, and a reader seeing the sequence word before the data shows as a wrong
//! checksum. Busy polling and a current-thread runtime with only its timer: no epoll or
//! eventfd, which Miri does not model for the soft NIC's completion channel.

use std::time::Duration;

use rdmakit_channel::*;
use rdmakit_verbs::*;

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x1000_0000_01b3))
}

fn payload(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i.wrapping_mul(131) ^ j.wrapping_mul(7)) as u8).collect()
}

/// A short flag-mode round trip both ways: a few messages of odd and word-multiple sizes
/// from `a` to `b`, each echoed back from `b` to `a`, checked byte for byte.
#[test]
fn flag_mode_round_trip() {
    let (n, max) = if cfg!(miri) { (3usize, 40usize) } else { (64, 4096) };
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    rt.block_on(async {
        let pd = Context::open_soft().alloc_pd().unwrap();
        let cfg = PipeConfig::default()
            .with_notify(NotifyMode::Flag)
            .with_poll(PollMode::Busy)
            .with_ring_len(4096)
            .with_slots(4);
        let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
        let src = pd.alloc_mr(max, AccessFlags::LOCAL_WRITE).unwrap();
        let echo = pd.alloc_mr(max, AccessFlags::LOCAL_WRITE).unwrap();
        for i in 0..n {
            let len = [max - 1, 8, 13, 1][i % 4].min(max);
            let data = payload(i, len);
            src.write_at(0, &data).unwrap();
            let (r, _) = a.rwrite(src.slice(0, len as u32).unwrap()).await;
            r.expect("rwrite a -> b");
            let g = b.recv_timeout(Duration::from_secs(60)).await.expect("recv at b");
            let got = g.to_vec().unwrap();
            assert_eq!((got.len(), checksum(&got)), (len, checksum(&data)), "message {i} at b");
            drop(g);
            echo.write_at(0, &got).unwrap();
            let (r, _) = b.rwrite(echo.slice(0, len as u32).unwrap()).await;
            r.expect("rwrite b -> a");
            let g = a.recv_timeout(Duration::from_secs(60)).await.expect("recv at a");
            assert_eq!(g.to_vec().unwrap(), data, "echo {i} at a");
        }
    });
}
