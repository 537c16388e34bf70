//! The pipe's allocation policy is the one its writer configured: on the same fragmented
//! ring, next-fit, first-fit, best-fit and worst-fit put the same messages in different
//! places, each where its rule says (`PipeConfig::with_policy`, `RecvGuard::segment_offset`).

use std::time::Duration;

use rdmakit_channel::*;
use rdmakit_memory::heap::AllocPolicy;
use rdmakit_verbs::*;

const T: Duration = Duration::from_secs(20);
const K: u64 = 1024;

/// Writes messages of `sizes` from `w`, receives each on `r`; returns the guards (held).
async fn send_all(w: &Pipe, r: &Pipe, src: &MemoryRegion, sizes: &[u64]) -> Vec<RecvGuard> {
    let mut held = Vec::new();
    for &len in sizes {
        let (sent, _) = w.rwrite(src.slice(0, len as u32).unwrap()).await;
        sent.unwrap();
        let g = r.recv_timeout(T).await.unwrap();
        assert_eq!(g.len() as u64, len);
        held.push(g);
    }
    held
}

/// A 64 KiB ring filled by seven messages; three released make holes of 8, 4 and 16 KiB
/// (at 0, 12 and 20 KiB) between held blocks, the rest of the ring stays held. Then 4 KiB,
/// 10 KiB and 4 KiB messages land by the policy's rule:
/// - next-fit: from the cursor (the ring's end: wraps to 0), then on from each block's end;
/// - first-fit: the lowest hole that fits;
/// - best-fit: the smallest hole that fits;
/// - worst-fit: the largest hole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_policy_places_blocks_where_its_rule_says() {
    let expect = [
        (AllocPolicy::NextFit, [0, 20 * K, 30 * K]),
        (AllocPolicy::FirstFit, [0, 20 * K, 4 * K]),
        (AllocPolicy::BestFit, [12 * K, 20 * K, 30 * K]),
        (AllocPolicy::WorstFit, [20 * K, 24 * K, 0]),
    ];
    for notify in [NotifyMode::WriteImm, NotifyMode::Flag] {
        for (policy, want) in expect {
            let pd = Context::open_soft().alloc_pd().unwrap();
            let writer_cfg = PipeConfig::default().with_notify(notify).with_ring_len(0).with_policy(policy);
            // The reader's own policy is not the one that counts: the writer allocates.
            let reader_cfg = PipeConfig::default().with_notify(notify).with_ring_len(64 * K);
            let (w, r) = Pipe::pair(&pd, writer_cfg, reader_cfg).await.unwrap();
            assert_eq!(w.config().policy, policy);
            let src = pd.alloc_mr(32 << 10, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ).unwrap();
            // One free range: every policy fills it in address order.
            let held = send_all(&w, &r, &src, &[8 * K, 4 * K, 4 * K, 4 * K, 16 * K, 4 * K, 24 * K]).await;
            let at: Vec<u64> = held.iter().map(RecvGuard::segment_offset).collect();
            assert_eq!(at, [0, 8 * K, 12 * K, 16 * K, 20 * K, 36 * K, 40 * K], "{policy:?} {notify:?}");
            // Holes of 8, 4 and 16 KiB: the frees go back together once a quarter of the
            // ring is pending, that is at the third release.
            let mut held: Vec<Option<RecvGuard>> = held.into_iter().map(Some).collect();
            for i in [0, 2, 4] {
                drop(held[i].take());
            }
            // A barrier: the publication goes after the frees on the same connection, so
            // once the writer has read it, its allocator has every hole.
            let barrier = async {
                tokio::join!(
                    r.publish(src.slice(0, 8).unwrap()),
                    w.rread(pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap().slice(0, 8).unwrap())
                )
            };
            let (pubd, read) = tokio::time::timeout(T, barrier).await.expect("the barrier");
            pubd.0.unwrap();
            assert_eq!(read.0.unwrap(), 8);
            // Bounded: a writer that found no room would wait for a reader nobody polls.
            let placed = tokio::time::timeout(T, send_all(&w, &r, &src, &[4 * K, 10 * K, 4 * K]))
                .await
                .unwrap_or_else(|_| panic!("{policy:?} {notify:?}: a message found no room"));
            let at: Vec<u64> = placed.iter().map(RecvGuard::segment_offset).collect();
            assert_eq!(at, want, "{policy:?} {notify:?}");
        }
    }
}
