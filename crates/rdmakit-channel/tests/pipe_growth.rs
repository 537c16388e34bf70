//! Pipes on top of the rmalloc paper's heaps: the writer's allocation policy over the
//! peer's ring (next-fit, first-fit, best-fit, worst-fit), and rings that grow when the
//! writer asks, up to the reader's configured maximum.

use std::collections::VecDeque;
use std::time::Duration;

use rdmakit_channel::*;
use rdmakit_memory::heap::AllocPolicy;
use rdmakit_verbs::*;

const T: Duration = Duration::from_secs(20);

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x1000_0000_01b3))
}

fn payload(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i.wrapping_mul(151) ^ j.wrapping_mul(13) ^ (j >> 9)) as u8).collect()
}

/// Every policy, both notification modes: 300 messages of varying sizes through a small
/// ring whose reader holds up to five guards and releases them out of order (so the free
/// space is fragmented and the policies place blocks differently), checked by checksum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_policy_round_trips_with_checksums() {
    for policy in [AllocPolicy::NextFit, AllocPolicy::FirstFit, AllocPolicy::BestFit, AllocPolicy::WorstFit] {
        for notify in [NotifyMode::WriteImm, NotifyMode::Flag] {
            let pd = Context::open_soft().alloc_pd().unwrap();
            let cfg = PipeConfig::default().with_notify(notify).with_ring_len(48 << 10).with_policy(policy);
            let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
            const N: usize = 300;
            let reader = tokio::spawn(async move {
                let mut sums = Vec::new();
                let mut held = VecDeque::new();
                for i in 0..N {
                    let g = b.recv_timeout(T).await.expect("recv");
                    sums.push((g.len(), checksum(&g.to_vec().unwrap())));
                    held.push_back(g);
                    if held.len() > 4 {
                        // Release the second oldest, then the oldest now and then.
                        drop(held.remove(1));
                        if i % 3 == 0 {
                            held.pop_front();
                        }
                    }
                }
                sums
            });
            let max = 6 << 10;
            let src = pd.alloc_mr(max, AccessFlags::LOCAL_WRITE).unwrap();
            let mut expect = Vec::new();
            for i in 0..N {
                let len = 1 + (i * 7919) % max;
                let data = payload(i, len);
                src.write_at(0, &data).unwrap();
                let (r, _) = a.rwrite(src.slice(0, len as u32).unwrap()).await;
                r.unwrap_or_else(|e| panic!("{policy:?} {notify:?} message {i}: {e}"));
                expect.push((len, checksum(&data)));
            }
            assert_eq!(reader.await.unwrap(), expect, "{policy:?} {notify:?}");
            assert_eq!(a.peer_ring_len(), 48 << 10, "no growth configured");
        }
    }
}

/// The reader holds every message: the writer's requests grow the ring segment by segment
/// up to `max_ring_len` (including a segment for a message larger than the first one),
/// then the writer waits for frees; a message beyond what the ring may grow to is refused
/// at once. Everything that landed is intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ring_grows_on_demand_up_to_its_maximum() {
    for notify in [NotifyMode::WriteImm, NotifyMode::Flag] {
        let pd = Context::open_soft().alloc_pd().unwrap();
        let reader_cfg =
            PipeConfig::default().with_notify(notify).with_ring_len(16 << 10).with_max_ring_len(64 << 10);
        let writer_cfg =
            PipeConfig::default().with_notify(notify).with_ring_len(0).with_policy(AllocPolicy::BestFit);
        let (a, b) = Pipe::pair(&pd, writer_cfg, reader_cfg).await.unwrap();
        assert_eq!((a.peer_ring_len(), b.ring_len(), b.ring_segments()), (16 << 10, 16 << 10, 1));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
        let b2 = b.clone();
        let reader = tokio::spawn(async move {
            let mut held = Vec::new();
            // Hold the first six messages (56 KiB of the 64 KiB the ring may reach).
            for _ in 0..6 {
                let g = b2.recv_timeout(T).await.expect("recv");
                tx.send((g.len(), checksum(&g.to_vec().unwrap()))).unwrap();
                held.push(g);
            }
            // Keep the connection driven (growth requests need an answer) until released.
            let next = b2.recv_timeout(T);
            tokio::pin!(next);
            tokio::select! {
                _ = release_rx => {}
                g = &mut next => panic!("a seventh message landed in a full ring: {:?}", g.map(|g| g.len())),
            }
            drop(held);
            let g = next.await.expect("the seventh message after the release");
            tx.send((g.len(), checksum(&g.to_vec().unwrap()))).unwrap();
        });
        let sizes = [8 << 10, 8 << 10, 24 << 10, 8 << 10, 4 << 10, 4 << 10];
        let src = pd.alloc_mr(40 << 10, AccessFlags::LOCAL_WRITE).unwrap();
        for (i, &len) in sizes.iter().enumerate() {
            let data = payload(i, len);
            src.write_at(0, &data).unwrap();
            let (r, _) = a.rwrite(src.slice(0, len as u32).unwrap()).await;
            r.unwrap_or_else(|e| panic!("{notify:?} message {i}: {e}"));
            assert_eq!(rx.recv().await.unwrap(), (len, checksum(&data)), "{notify:?} message {i}");
        }
        // 16 KiB first, a 24 KiB segment for the large message, then 16 KiB twice, at most 64.
        assert!(b.ring_segments() > 1, "the ring grew");
        assert!(b.ring_len() <= 64 << 10 && b.ring_len() >= 56 << 10, "ring {}", b.ring_len());
        assert_eq!(a.peer_ring_len(), b.ring_len());
        // Beyond what the ring may still grow to: refused at once, not a wait.
        let (r, _) = a.rwrite(src.slice(0, 40 << 10).unwrap()).await;
        assert!(matches!(r, Err(ChannelError::TooLarge { .. })), "{r:?}");
        // The ring is full and at its maximum: the writer waits for frees.
        let data = payload(99, 12 << 10);
        src.write_at(0, &data).unwrap();
        let blocked =
            tokio::time::timeout(Duration::from_millis(300), a.rwrite(src.slice(0, 12 << 10).unwrap()));
        assert!(blocked.await.is_err(), "{notify:?}: a write went ahead past the maximum ring");
        assert!(b.ring_len() <= 64 << 10);
        release_tx.send(()).unwrap();
        let (r, _) = a.rwrite(src.slice(0, 12 << 10).unwrap()).await;
        r.unwrap();
        assert_eq!(rx.recv().await.unwrap(), (12 << 10, checksum(&data)));
        reader.await.unwrap();
        assert!(b.ring_len() <= 64 << 10);
    }
}

/// A ring without `max_ring_len` never grows: the writer waits for frees as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_without_a_maximum_never_grows() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let cfg = PipeConfig::default().with_ring_len(16 << 10);
    let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
    let src = pd.alloc_mr(8 << 10, AccessFlags::LOCAL_WRITE).unwrap();
    a.rwrite(src.slice(0, 8 << 10).unwrap()).await.0.unwrap();
    a.rwrite(src.slice(0, 8 << 10).unwrap()).await.0.unwrap();
    let g = (b.recv().await.unwrap(), b.recv().await.unwrap());
    let third = tokio::time::timeout(Duration::from_millis(200), a.rwrite(src.slice(0, 8 << 10).unwrap()));
    assert!(third.await.is_err());
    assert_eq!((b.ring_len(), b.ring_segments(), a.peer_ring_len()), (16 << 10, 1, 16 << 10));
    drop(g);
    a.rwrite(src.slice(0, 8 << 10).unwrap()).await.0.unwrap();
}

/// A `max_ring_len` that is not a multiple of 8 (4096 + 1004) is a cap, not a segment size:
/// the growth it allows is rounded down to whole 8-byte words. (Found by review: the reader
/// granted a segment of the raw remainder, 1004 bytes, which the writer's allocator refuses,
/// and the writer's pipe broke with "invalid segment".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn growth_to_a_maximum_that_is_not_a_multiple_of_8_keeps_the_pipe_usable() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let reader_cfg = PipeConfig::default().with_ring_len(4096).with_max_ring_len(4096 + 1004);
    let writer_cfg = PipeConfig::default().with_ring_len(0);
    let (a, b) = Pipe::pair(&pd, writer_cfg, reader_cfg).await.unwrap();
    // The reader holds every message, so the fifth needs the ring to grow.
    let reader = tokio::spawn(async move {
        let mut held = Vec::new();
        for _ in 0..5 {
            held.push(b.recv_timeout(T).await?);
        }
        Ok::<_, ChannelError>((held.len(), b.ring_len()))
    });
    let src = pd.alloc_mr(1000, AccessFlags::LOCAL_WRITE).unwrap();
    for i in 0..5 {
        let (r, _) =
            tokio::time::timeout(T, a.rwrite(src.slice(0, 1000).unwrap())).await.expect("rwrite hangs");
        r.unwrap_or_else(|e| panic!("message {i}: {e}"));
    }
    let (n, ring) = reader.await.unwrap().unwrap();
    assert_eq!((n, ring), (5, 4096 + 1000), "grown by the budget rounded down to 8");
}

/// A ring whose length is not a multiple of 8 is refused when the pipe is made, with a
/// clear error, instead of being offered to a writer that refuses it.
#[tokio::test]
async fn a_ring_length_that_is_not_a_multiple_of_8_is_refused_up_front() {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let caps = QpCaps::default().with_max_send_wr(64).with_max_recv_wr(136).with_max_inline_data(64);
    let cq = ctx.create_cq(1024).unwrap();
    let qp = pd.create_qp(&cq, &cq, caps).unwrap();
    match Pipe::connect(qp, cq, PipeConfig::default().with_ring_len(1001)).await {
        Err(ChannelError::Invalid(why)) => assert!(why.contains("multiple of 8"), "{why}"),
        other => panic!("a ring of 1001 bytes: {:?}", other.map(|_| ())),
    }
}
