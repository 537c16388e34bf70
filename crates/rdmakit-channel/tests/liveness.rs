//! Peer liveness (issue 11, attack 4): an operation blocked with nothing in flight learns
//! that its peer is gone within a bound, instead of waiting forever. In process: the
//! peer's end is dropped (its QP destroyed), so the keep-alive the blocked end sends goes
//! unanswered and the transport's retry budget runs out.

use std::time::{Duration, Instant};

use rdmakit_channel::*;
use rdmakit_verbs::*;

mod common;
use common::put_endpoints;

/// Generous: the keep-alive interval plus the default transport budget (4.096 µs × 2^14 ×
/// 7 tries, about 0.47 s) is under a second on an idle machine.
const BOUND: Duration = Duration::from_secs(10);

fn config(notify: NotifyMode, poll: PollMode) -> PipeConfig {
    PipeConfig::default().with_notify(notify).with_poll(poll).with_ring_len(64 << 10).with_slots(4)
}

/// Runs `op` (blocked on a dead peer) and returns how long it took to fail, panicking if
/// it succeeds or hangs past [`BOUND`].
async fn fails_within<T: std::fmt::Debug>(
    what: &str,
    op: impl std::future::Future<Output = rdmakit_channel::Result<T>>,
) -> Duration {
    let start = Instant::now();
    let r = tokio::time::timeout(BOUND, op).await;
    let took = start.elapsed();
    match r {
        Err(_) => panic!("{what}: still blocked {BOUND:?} after the peer went away"),
        Ok(Ok(v)) => panic!("{what}: succeeded against a dead peer: {v:?}"),
        Ok(Err(e)) => {
            assert!(e.is_peer_gone(), "{what}: expected a peer-gone error, got {e:?}");
            eprintln!("liveness: {what} failed after {took:?}: {e}");
        }
    }
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_rwrite_fails_after_the_reader_is_dropped() {
    for (notify, poll) in [(NotifyMode::WriteImm, PollMode::Event), (NotifyMode::Flag, PollMode::Busy)] {
        let pd = Context::open_soft().alloc_pd().unwrap();
        let (a, b) = Pipe::pair(&pd, config(notify, poll), config(notify, poll)).await.unwrap();
        let src = pd.alloc_mr(1024, AccessFlags::LOCAL_WRITE).unwrap();
        // The reader takes nothing: after `slots` messages the writer waits for credits.
        for _ in 0..4 {
            a.rwrite(src.local().unwrap()).await.0.unwrap();
        }
        let blocked = tokio::time::timeout(Duration::from_millis(100), a.rwrite(src.local().unwrap())).await;
        assert!(blocked.is_err(), "the fifth write should wait for credits");
        drop(b);
        let a2 = a.clone();
        let slice = src.local().unwrap();
        fails_within(&format!("rwrite ({notify:?})"), async move { a2.rwrite(slice).await.0 }).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_recv_fails_after_the_writer_is_dropped() {
    for (notify, poll) in [(NotifyMode::WriteImm, PollMode::Event), (NotifyMode::Flag, PollMode::Busy)] {
        let pd = Context::open_soft().alloc_pd().unwrap();
        let (a, b) = Pipe::pair(&pd, config(notify, poll), config(notify, poll)).await.unwrap();
        drop(a);
        fails_within(&format!("recv ({notify:?})"), b.recv()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_rread_and_publish_fail_after_the_peer_is_dropped() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let cfg = PipeConfig::default().with_ring_len(0);
    // rread waiting for a publication that never comes.
    let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
    drop(a);
    let dst = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let slice = dst.local().unwrap();
    fails_within("rread", async move { b.rread(slice).await.0 }).await;
    // publish waiting for a reader that never reads.
    let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
    let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ).unwrap();
    let slice = src.local().unwrap();
    let publisher = tokio::spawn(async move { a.publish(slice).await.0 });
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(b);
    fails_within("publish", async move { publisher.await.unwrap() }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_stream_read_fails_after_the_writer_is_dropped() {
    use tokio::io::AsyncReadExt;
    let pd = Context::open_soft().alloc_pd().unwrap();
    let cfg = PipeConfig::default();
    let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
    let mut s = stream::PipeStream::new(b, 4096).unwrap();
    drop(a);
    let start = Instant::now();
    let mut buf = [0u8; 16];
    let r = tokio::time::timeout(BOUND, s.read(&mut buf)).await;
    let r = r.unwrap_or_else(|_| panic!("poll_read still blocked {BOUND:?} after the writer went away"));
    let e = r.expect_err("a read from a dead writer must fail");
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
    eprintln!("liveness: poll_read failed after {:?}: {e}", start.elapsed());
}

/// Polls `f` until it errors; panics after [`BOUND`].
fn sync_fails_within(what: &str, mut f: impl FnMut() -> rdmakit_channel::Result<()>) -> Duration {
    let start = Instant::now();
    loop {
        match f() {
            Ok(()) => {
                assert!(start.elapsed() < BOUND, "{what}: still waiting {BOUND:?} after the peer went away");
                std::thread::sleep(Duration::from_micros(200));
            }
            Err(e) => {
                assert!(e.is_peer_gone(), "{what}: expected a peer-gone error, got {e:?}");
                eprintln!("liveness: {what} failed after {:?}: {e}", start.elapsed());
                return start.elapsed();
            }
        }
    }
}

#[test]
fn ready_poll_fails_after_the_sender_is_dropped() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = put_endpoints(&pd);
    let rbuf = pd.alloc_mr(256, AccessFlags::ALL_REMOTE).unwrap();
    let h = receiver.create_handle(&rbuf, |_| {}, 0).unwrap();
    h.ready_poll_q().unwrap();
    drop(sender);
    sync_fails_within("ready_poll", || receiver.ready_poll().map(|_| ()));
}

#[test]
fn busy_put_fails_after_the_receiver_is_dropped() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (sender, receiver) = put_endpoints(&pd);
    let rbuf = pd.alloc_mr(256, AccessFlags::ALL_REMOTE).unwrap();
    let sbuf = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    let h = receiver.create_handle(&rbuf, |_| {}, 0).unwrap();
    let sh = sender.assoc_local_buffer(&h.desc().unwrap(), sbuf.local().unwrap()).unwrap();
    sh.put().unwrap();
    // Let the put and its sequence word complete, then the receiver goes away unready.
    let start = Instant::now();
    while sh.put().is_ok() {
        assert!(start.elapsed() < Duration::from_secs(5));
    }
    drop((h, receiver));
    sync_fails_within("put", || match sh.put() {
        Err(ChannelError::Busy) => Ok(()),
        other => other,
    });
}

#[test]
fn blocked_rmalloc_fails_after_the_owner_is_dropped() {
    use rdmakit_memory::heap::{AllocPolicy, HeapConfig, HeapId, SyncMode};
    // A time-out far beyond the bound: the error must come from liveness, not from it.
    let timeout = Duration::from_secs(60);
    for sync in [SyncMode::Deferred, SyncMode::Immediate] {
        let limits = rdmakit_channel::heap::OwnerLimits::default().with_segment_len(64 << 10);
        let pd = Context::open_soft().alloc_pd().unwrap();
        let (mut a, mut b) = common::heap_endpoints(&pd, limits, timeout);
        let heap = HeapId(1);
        let config = HeapConfig::new(heap, AllocPolicy::NextFit).with_sync(sync);
        std::thread::scope(|s| {
            let owner = s.spawn(|| {
                let start = Instant::now();
                while start.elapsed() < Duration::from_secs(2) {
                    b.poll_messages().unwrap();
                }
            });
            a.create_heap(config, 64 << 10).unwrap();
            owner.join().unwrap();
        });
        drop(b);
        // Deferred: a block larger than the segment needs a growth the dead owner never
        // answers; immediate: every allocation waits for the owner's acknowledgement.
        let size = if sync == SyncMode::Deferred { 128 << 10 } else { 64 };
        sync_fails_within(&format!("rmalloc ({sync:?})"), || a.rmalloc(heap, size).map(|_| ()));
    }
}
