//! Pipes on the soft NIC: integrity over many sizes in both notification modes, flow
//! control under a slow reader, cancel safety, publish/rread, soft TCP, and a dying peer.

use std::time::Duration;

use rdmakit_channel::*;
use rdmakit_verbs::cm::{CmOptions, Listener, connect};
use rdmakit_verbs::*;

mod common;

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x1000_0000_01b3))
}

fn payload(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i.wrapping_mul(131) ^ j.wrapping_mul(7)) as u8).collect()
}

fn config(notify: NotifyMode, poll: PollMode, ring_len: u64) -> PipeConfig {
    PipeConfig::default().with_notify(notify).with_poll(poll).with_ring_len(ring_len)
}

/// `n` messages of varying sizes from `a` to `b`, checked by checksum; the reader runs in
/// its own task and sleeps now and then when `slow`.
async fn transfer(a: Pipe, b: Pipe, pd: &ProtectionDomain, n: usize, max: usize, slow: bool) {
    let reader = tokio::spawn(async move {
        let mut sums = Vec::new();
        for i in 0..n {
            let g = b.recv_timeout(Duration::from_secs(20)).await.expect("recv");
            sums.push((g.len(), checksum(&g.to_vec().unwrap())));
            if slow && i % 7 == 0 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            drop(g); // rfree: the writer's credit
        }
        sums
    });
    let src = pd.alloc_mr(max, AccessFlags::LOCAL_WRITE).unwrap();
    let mut expect = Vec::new();
    for i in 0..n {
        let len = 1 + (i * 7919) % max;
        let data = payload(i, len);
        src.write_at(0, &data).unwrap();
        let (r, _src) = a.rwrite(src.slice(0, len as u32).unwrap()).await;
        r.expect("rwrite");
        expect.push((len, checksum(&data)));
    }
    assert_eq!(reader.await.unwrap(), expect);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_imm_mode_integrity_event_driven() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let cfg = config(NotifyMode::WriteImm, PollMode::Event, 256 << 10);
    let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
    transfer(a, b, &pd, 500, 64 << 10, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flag_mode_integrity_busy_polling() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let cfg = config(NotifyMode::Flag, PollMode::Busy, 256 << 10);
    let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
    transfer(a, b, &pd, 500, 64 << 10, false).await;
}

/// A message of at most the QP's inline size is copied into its request: `rwrite` resolves
/// once it is posted (its completion is not waited for, so its request is still outstanding),
/// the source is free at once, and the reader gets the bytes as they were at the call. A
/// longer message (or any, with `inline_max` 0) waits for its completion, which retires
/// everything before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_rwrites_go_inline_and_resolve_once_posted() {
    for notify in [NotifyMode::WriteImm, NotifyMode::Flag] {
        let pd = Context::open_soft().alloc_pd().unwrap();
        let cfg = config(notify, PollMode::Busy, 64 << 10);
        let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
        let src = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        let inline = a.qp().caps().max_inline_data.min(256);
        let before = a.qp().outstanding().0;
        src.write_at(0, &[0xa5; 64]).unwrap();
        let (r, _) = a.rwrite(src.slice(0, inline.min(64)).unwrap()).await;
        r.expect("inline rwrite");
        assert!(a.qp().outstanding().0 > before, "{notify:?}: the inline rwrite waited for its completion");
        src.write_at(0, &[0x5a; 64]).unwrap(); // reused at once
        let g = b.recv_timeout(Duration::from_secs(10)).await.unwrap();
        assert!(
            g.to_vec().unwrap().iter().all(|&x| x == 0xa5),
            "{notify:?}: the reader saw the reused source"
        );
        drop(g);
        let (r, _) = a.rwrite(src.slice(0, 4096).unwrap()).await;
        r.expect("rwrite");
        assert_eq!(a.qp().outstanding().0, 0, "{notify:?}: a waited-for rwrite retires what came before it");
        drop(b.recv_timeout(Duration::from_secs(10)).await.unwrap());

        // A writer posting only inline rwrites (some without polling its CQ first) still
        // reaps their completions: its send queue never fills.
        let reader = tokio::spawn({
            let b = b.clone();
            async move {
                for _ in 0..2000 {
                    drop(b.recv_timeout(Duration::from_secs(10)).await.unwrap());
                }
            }
        });
        let depth = a.qp().caps().max_send_wr as usize;
        for _ in 0..2000 {
            let (r, _) = a.rwrite(src.slice(0, 8).unwrap()).await;
            r.expect("inline rwrite");
            assert!(a.qp().outstanding().0 <= depth / 2, "{notify:?}: inline rwrites filled the send queue");
        }
        reader.await.unwrap();

        // `flush` waits for delivery: nothing is left outstanding after it.
        let (r, _) = a.rwrite(src.slice(0, 8).unwrap()).await;
        r.expect("inline rwrite");
        assert!(a.qp().outstanding().0 > 0, "{notify:?}: the inline rwrite was waited for");
        a.flush().await.expect("flush");
        assert_eq!(a.qp().outstanding().0, 0, "{notify:?}: flush left requests outstanding");
        drop(b.recv_timeout(Duration::from_secs(10)).await.unwrap());

        // The last handle dropped right after an inline rwrite lingers until it completed
        // (the QP, kept here, then has nothing outstanding): destroying the QP at once
        // would discard a request a NIC had not executed yet.
        let qp = a.qp().clone();
        let (r, _) = a.rwrite(src.slice(0, 8).unwrap()).await;
        r.expect("inline rwrite");
        assert!(qp.outstanding().0 > 0, "{notify:?}: the inline rwrite was waited for");
        drop(a);
        // The linger runs in the runtime's blocking pool: give it a moment.
        for _ in 0..500 {
            if qp.outstanding().0 == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(qp.outstanding().0, 0, "{notify:?}: the dropped end did not wait for its inline rwrite");
        drop(b.recv_timeout(Duration::from_secs(10)).await.unwrap());
        drop(qp);

        // `inline_max` 0: every rwrite waits for its completion.
        let cfg = cfg.with_inline_max(0);
        let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
        let (r, _) = a.rwrite(src.slice(0, 8).unwrap()).await;
        r.expect("rwrite");
        assert_eq!(a.qp().outstanding().0, 0, "{notify:?}: with inline_max 0 an rwrite waits for its write");
        drop(b.recv_timeout(Duration::from_secs(10)).await.unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_reader_holds_back_the_writer() {
    // A 64 KiB ring and up to 32 KiB messages: the writer must wait for releases often.
    for notify in [NotifyMode::WriteImm, NotifyMode::Flag] {
        let pd = Context::open_soft().alloc_pd().unwrap();
        let cfg = config(notify, PollMode::Event, 64 << 10);
        let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
        transfer(a, b, &pd, 200, 32 << 10, true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_guards_block_the_writer_until_released() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let cfg = config(NotifyMode::WriteImm, PollMode::Event, 16 << 10);
    let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
    let src = pd.alloc_mr(8 << 10, AccessFlags::LOCAL_WRITE).unwrap();
    src.fill(1).unwrap();
    a.rwrite(src.slice(0, 8 << 10).unwrap()).await.0.unwrap();
    a.rwrite(src.slice(0, 8 << 10).unwrap()).await.0.unwrap();
    let g1 = b.recv().await.unwrap();
    let g2 = b.recv().await.unwrap();
    // The ring is full of held blocks: the third write cannot proceed.
    src.fill(2).unwrap();
    let third =
        tokio::time::timeout(Duration::from_millis(200), a.rwrite(src.slice(0, 8 << 10).unwrap())).await;
    assert!(third.is_err(), "a write went ahead while the reader held the whole ring");
    assert_eq!(g1.to_vec().unwrap(), vec![1u8; 8 << 10], "held data intact");
    drop(g1);
    a.rwrite(src.slice(0, 8 << 10).unwrap()).await.0.unwrap();
    assert_eq!(g2.to_vec().unwrap(), vec![1u8; 8 << 10]);
    let g3 = b.recv().await.unwrap();
    assert_eq!(g3.to_vec().unwrap(), vec![2u8; 8 << 10]);
    // Too large for the ring at all: an error, not a wait.
    let big = pd.alloc_mr(32 << 10, AccessFlags::LOCAL_WRITE).unwrap();
    let (r, _) = a.rwrite(big.local().unwrap()).await;
    assert!(matches!(r, Err(ChannelError::TooLarge { .. })), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_futures_lose_nothing() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let cfg = config(NotifyMode::WriteImm, PollMode::Event, 64 << 10);
    let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
    let mut got = Vec::new();
    for i in 0..50u8 {
        // A fresh region per write, dropped by us at once: only the pipe keeps it alive.
        let src = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        src.fill(i).unwrap();
        let fut = a.rwrite(src.slice(0, 4096).unwrap());
        drop(src);
        // Poll once or twice, then drop the future mid-flight.
        let _ = tokio::time::timeout(Duration::from_micros(1), fut).await;
        // Receive futures dropped before anything arrives take nothing; one that finishes
        // returns its message.
        if let Ok(r) = tokio::time::timeout(Duration::from_micros(1), b.recv()).await {
            let v = r.unwrap().to_vec().unwrap();
            assert!(v.iter().all(|&x| x == v[0]), "a message was torn");
            got.push(v[0]);
        }
    }
    // Every write that was posted arrives, intact and once; the ones dropped before
    // posting do not. The pipe counts what it posted: exactly that many arrive, in order.
    let posted = a.messages_sent();
    while let Ok(g) = b.recv_timeout(Duration::from_millis(300)).await {
        let v = g.to_vec().unwrap();
        assert!(v.iter().all(|&x| x == v[0]), "a message was torn");
        got.push(v[0]);
    }
    assert_eq!(got.len() as u64, posted, "messages posted {posted}, received {}", got.len());
    assert!(got.windows(2).all(|w| w[0] < w[1]), "each message once, in order: {got:?}");
    // The pipe still works.
    let src = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, b"after the storm!").unwrap();
    a.rwrite(src.local().unwrap()).await.0.unwrap();
    let g = b.recv_timeout(Duration::from_secs(5)).await.unwrap();
    assert_eq!(g.to_vec().unwrap(), b"after the storm!");
    assert_eq!(a.messages_sent(), posted + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_chunks_are_capped_to_half_the_peer_ring() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let cfg = config(NotifyMode::WriteImm, PollMode::Event, 64 << 10);
    let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
    // Asked for far more than the ring (and more than a u32): capped, not truncated.
    let s = stream::PipeStream::new(a, usize::MAX).unwrap();
    assert_eq!(s.chunk_len(), (32 << 10) - 1);
    let s = stream::PipeStream::new(b, 100).unwrap();
    assert_eq!(s.chunk_len(), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_rread_loses_no_publication() {
    use std::future::Future;
    // Over the soft NIC's TCP path. (On the soft NIC in one process the read usually
    // completes within its post, so the window this guards is seldom open here; the rread
    // closes it by construction: it takes a publication in the step that posts the read,
    // and the read-done is sent by whichever operation reaps the read's completion.)
    let ctx = Context::open_soft();
    let listener = Listener::bind(&ctx, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut opts = CmOptions::default();
    opts.caps.max_inline_data = 64;
    opts.caps.max_recv_wr = 160;
    opts.caps.max_send_wr = 256;
    opts.cqe = 1024;
    let server = tokio::task::spawn_blocking(move || {
        let pd = listener.context().alloc_pd().unwrap();
        listener.accept(&pd, &opts, b"").unwrap()
    });
    let pd = ctx.alloc_pd().unwrap();
    let client = tokio::task::spawn_blocking({
        let pd = pd.clone();
        move || connect(&pd, addr, &opts, b"").unwrap()
    });
    let (server, client) = (server.await.unwrap(), client.await.unwrap());
    let cfg = PipeConfig::default().with_ring_len(0);
    let (a, b) =
        tokio::try_join!(Pipe::from_connection(client, cfg), Pipe::from_connection(server, cfg)).unwrap();
    let src = pd.alloc_mr(1 << 20, AccessFlags::REMOTE_READ | AccessFlags::LOCAL_WRITE).unwrap();
    let dst = b.qp().pd().alloc_mr(1 << 20, AccessFlags::LOCAL_WRITE).unwrap();
    for round in 0..5u8 {
        src.fill(round).unwrap();
        let (a, slice) = (a.clone(), src.local().unwrap());
        let publisher = tokio::spawn(async move { a.publish(slice).await.0 });
        tokio::time::sleep(Duration::from_millis(50)).await; // the publication has arrived
        // One poll: the rread takes the publication and posts its read, then waits for
        // the completion; it is dropped there.
        let mut fut = Box::pin(b.rread(dst.local().unwrap()));
        std::future::poll_fn(|cx| {
            let _ = fut.as_mut().poll(cx);
            std::task::Poll::Ready(())
        })
        .await;
        drop(fut);
        // The read-done still reaches the publisher once this end makes progress again
        // (here: the next rread, which waits for a publication that will not come).
        let done = tokio::time::timeout(Duration::from_secs(5), async {
            while !publisher.is_finished() {
                let _ = tokio::time::timeout(Duration::from_millis(50), b.rread(dst.local().unwrap())).await;
            }
        })
        .await;
        assert!(
            done.is_ok(),
            "round {round}: a cancelled rread lost its publication; the publisher still waits"
        );
        publisher.await.unwrap().unwrap();
        assert_eq!(dst.to_vec().unwrap(), vec![round; 1 << 20]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_publish_keeps_its_slice_alive_until_read() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let cfg = PipeConfig::default().with_ring_len(0);
    let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
    let src = pd.alloc_mr(4096, AccessFlags::REMOTE_READ | AccessFlags::LOCAL_WRITE).unwrap();
    src.fill(9).unwrap();
    let fut = a.publish(src.local().unwrap());
    drop(src); // only the publish (and then the pipe) holds the region
    let _ = tokio::time::timeout(Duration::from_millis(20), fut).await; // published, then cancelled
    // The reader still reads the publication: the region is alive and registered.
    let dst = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let (n, _) = b.rread(dst.local().unwrap()).await;
    assert_eq!(n.unwrap(), 4096);
    assert_eq!(dst.to_vec().unwrap(), vec![9u8; 4096]);
    // The answer to the abandoned publication is absorbed; the pipe still works.
    let src = pd.alloc_mr(64, AccessFlags::REMOTE_READ | AccessFlags::LOCAL_WRITE).unwrap();
    src.fill(1).unwrap();
    let slice = src.local().unwrap();
    let publisher = tokio::spawn(async move { a.publish(slice).await.0 });
    let (n, _) = b.rread(dst.local().unwrap()).await;
    assert_eq!(n.unwrap(), 64);
    publisher.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_rread() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let cfg = PipeConfig::default().with_ring_len(0); // pull only
    let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
    let src = pd.alloc_mr(10_000, AccessFlags::REMOTE_READ | AccessFlags::LOCAL_WRITE).unwrap();
    let data = payload(3, 10_000);
    src.write_at(0, &data).unwrap();
    let publisher = tokio::spawn(async move {
        let (r, s) = a.publish(src.slice(0, 10_000).unwrap()).await;
        r.unwrap();
        // A publication too large for the reader's buffer is refused.
        let (r, _) = a.publish(s.region().slice(0, 10_000).unwrap()).await;
        assert!(r.is_err());
    });
    let dst = pd.alloc_mr(10_000, AccessFlags::LOCAL_WRITE).unwrap();
    let (n, dst_slice) = b.rread(dst.local().unwrap()).await;
    assert_eq!(n.unwrap(), 10_000);
    assert_eq!(dst_slice.region().to_vec().unwrap(), data);
    let small = pd.alloc_mr(100, AccessFlags::LOCAL_WRITE).unwrap();
    let (r, _) = b.rread(small.local().unwrap()).await;
    assert!(matches!(r, Err(ChannelError::TooLarge { .. })));
    publisher.await.unwrap();
    // No ring on this end: recv is an error, not a hang.
    assert!(b.recv().await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_soft_tcp_then_the_peer_dies() {
    let ctx = Context::open_soft();
    let listener = Listener::bind(&ctx, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut opts = CmOptions::default();
    opts.caps.max_inline_data = 64;
    opts.caps.max_recv_wr = 160;
    opts.caps.max_send_wr = 256;
    opts.cqe = 1024;
    opts.connect.timeout = 10; // ~4 ms per retry: a dead peer shows quickly
    opts.connect.retry_cnt = 3;
    let server_opts = opts;
    let server = tokio::task::spawn_blocking(move || {
        let pd = listener.context().alloc_pd().unwrap();
        listener.accept(&pd, &server_opts, b"").unwrap()
    });
    let pd = ctx.alloc_pd().unwrap();
    let client_conn = tokio::task::spawn_blocking({
        let pd = pd.clone();
        move || connect(&pd, addr, &opts, b"").unwrap()
    });
    let (server_conn, client_conn) = (server.await.unwrap(), client_conn.await.unwrap());
    let cfg = PipeConfig::default();
    let (a, b) =
        tokio::try_join!(Pipe::from_connection(client_conn, cfg), Pipe::from_connection(server_conn, cfg))
            .unwrap();
    transfer(a.clone(), b.clone(), &pd, 100, 32 << 10, false).await;

    // The reader's end goes away (its QP is destroyed with the pipe and the connection).
    drop(b);
    let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let r = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if let (Err(e), _) = a.rwrite(src.local().unwrap()).await {
                return e;
            }
        }
    })
    .await
    .expect("a write to a dead peer must fail, not hang");
    assert!(matches!(r, ChannelError::Broken { .. }), "{r:?}");
    // A reader with nobody writing gets its time-out.
    assert!(a.recv_timeout(Duration::from_millis(100)).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_round_trip_with_tokio_io() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let pd = Context::open_soft().alloc_pd().unwrap();
    let cfg = config(NotifyMode::WriteImm, PollMode::Event, 256 << 10);
    let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
    let mut w = rdmakit_channel::stream::PipeStream::new(a, 60_000).unwrap();
    let mut r = rdmakit_channel::stream::PipeStream::new(b, 60_000).unwrap();
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    let expect = checksum(&data);
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        r.read_to_end(&mut got).await.unwrap();
        got
    });
    // Odd-sized writes through a reader of the std io kind: tokio::io::copy.
    let mut src = std::io::Cursor::new(data);
    tokio::io::copy(&mut src, &mut w).await.unwrap();
    w.shutdown().await.unwrap();
    let got = reader.await.unwrap();
    assert_eq!((got.len(), checksum(&got)), (3_000_000, expect));
}

/// Both ends write and read at once, each end's reader and writer in their own tasks, so
/// two futures drive one CQ concurrently (one asleep on completion events). Messages must
/// still arrive in order: a completion is applied in the step that takes it off the CQ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_concurrent_tasks_keep_order() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let cfg = config(NotifyMode::WriteImm, PollMode::Event, 128 << 10);
    let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
    let n = 1000;
    let mut tasks = Vec::new();
    for (from, to) in [(a.clone(), b.clone()), (b, a)] {
        let pd = pd.clone();
        tasks.push(tokio::spawn(async move { transfer(from, to, &pd, n, 20_000, false).await }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_slice_covers_exactly_its_block() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let cfg = config(NotifyMode::WriteImm, PollMode::Event, 64 << 10);
    let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
    let src = pd.alloc_mr(1000, AccessFlags::LOCAL_WRITE).unwrap();
    for (i, len) in [10u32, 1000, 333].into_iter().enumerate() {
        src.write_at(0, &payload(i, len as usize)).unwrap();
        a.rwrite(src.slice(0, len).unwrap()).await.0.unwrap();
        let g = b.recv().await.unwrap();
        // SAFETY: the writer never writes a block the reader holds, and nothing else has the
        // ring's rkey in this test.
        let view = unsafe { g.as_slice() };
        assert_eq!(view, payload(i, len as usize).as_slice());
        assert_eq!(view, g.to_vec().unwrap().as_slice());
    }
}

/// Released blocks go back to the writer in batches, so a writer that needs the room of a
/// block the reader released but has not yet returned waits until the reader's end runs.
/// With both ends in one task nothing runs it: the writer waits (here, until a timeout)
/// however long, and `return_credits` is the way out.
#[tokio::test(flavor = "current_thread")]
async fn a_writer_needing_held_back_credit_waits_for_the_reader_to_return_it() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let cfg = config(NotifyMode::WriteImm, PollMode::Busy, 4096);
    let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
    let src = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let (r, _) = a.rwrite(src.slice(0, 8).unwrap()).await;
    r.expect("small rwrite");
    drop(b.recv_timeout(Duration::from_secs(5)).await.expect("recv")); // released, not returned
    src.write_at(0, &payload(1, 4096)).unwrap();
    // The whole ring: it needs the released block back.
    let blocked =
        tokio::time::timeout(Duration::from_millis(300), a.rwrite(src.slice(0, 4096).unwrap())).await;
    assert!(blocked.is_err(), "the writer got room the reader had not returned");
    b.return_credits().expect("return credits");
    let done = tokio::time::timeout(Duration::from_secs(5), a.rwrite(src.slice(0, 4096).unwrap())).await;
    done.expect("the returned credit lets the writer on").0.expect("rwrite");
    let g = b.recv_timeout(Duration::from_secs(5)).await.expect("recv");
    assert_eq!(g.to_vec().unwrap(), payload(1, 4096));
}

/// The same wait, long enough: the writer says once, in the log, that it waits for room the
/// reader has not returned, and names the way out.
#[test]
fn a_writer_waiting_long_for_credit_says_so_once() {
    let ((), text) = common::with_captured_log(|| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let pd = Context::open_soft().alloc_pd().unwrap();
            let cfg = config(NotifyMode::WriteImm, PollMode::Busy, 4096);
            let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
            let src = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
            a.rwrite(src.slice(0, 8).unwrap()).await.0.expect("small rwrite");
            drop(b.recv_timeout(Duration::from_secs(5)).await.expect("recv"));
            let blocked =
                tokio::time::timeout(Duration::from_millis(2500), a.rwrite(src.slice(0, 4096).unwrap()));
            assert!(blocked.await.is_err(), "the writer got room the reader had not returned");
        });
    });
    assert_eq!(text.matches("Pipe::return_credits").count(), 1, "log: {text}");
}

/// A send queue too shallow for a pipe to make progress (a flag-mode rwrite posts two
/// requests, within half the queue) is refused up front, not left to hang.
#[tokio::test]
async fn a_send_queue_too_shallow_for_a_pipe_is_refused() {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let caps = QpCaps::default().with_max_send_wr(3).with_max_recv_wr(136).with_max_inline_data(64);
    let cq = ctx.create_cq(1024).unwrap();
    let qp = pd.create_qp(&cq, &cq, caps).unwrap();
    match Pipe::connect(qp, cq, PipeConfig::default()).await {
        Err(ChannelError::QueueTooSmall { needed: 4, got: 3, .. }) => {}
        other => panic!("a send queue of 3: {:?}", other.map(|_| ())),
    }
}

/// Polls a future once (its synchronous part runs) and drops it.
fn poll_once<F: std::future::Future>(f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(r) => Some(r),
        std::task::Poll::Pending => None,
    }
}

/// A burst of publications (within the 1024 a pipe allows) fills the control channel while
/// the peer is busy and takes no messages in. The credits this end returns meanwhile must
/// not be lost (its ring would leak for good, and the peer's next rwrite wait forever), and
/// every publication must be taken, none refused for want of room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credits_returned_while_the_control_channel_is_full_are_not_lost() {
    const BURST: usize = 1000;
    let pd = Context::open_soft().alloc_pd().unwrap();
    let (a, b) =
        Pipe::pair(&pd, PipeConfig::default().with_ring_len(4096), PipeConfig::default()).await.unwrap();
    // b fills a's ring: 16 × 256 bytes, all held by a's application.
    let src = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    for _ in 0..16 {
        b.rwrite(src.local().unwrap()).await.0.unwrap();
    }
    let mut guards = Vec::new();
    for _ in 0..16 {
        guards.push(a.recv_timeout(Duration::from_secs(5)).await.unwrap());
    }
    // a publishes while b runs nothing: each publication's message is handed to the control
    // channel in the first poll of its future, which is then dropped (the publication
    // stays, abandoned).
    let data = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ).unwrap();
    for i in 0..BURST {
        if let Some((r, _)) = poll_once(a.publish(data.slice(0, 8).unwrap())) {
            panic!("publication {i} ended at once: {r:?}");
        }
    }
    // a's application releases b's messages: the credits meet a full control channel.
    drop(guards);
    // b runs again: it takes the publications in, and writes into a's ring once more.
    let reader = tokio::spawn({
        let a = a.clone();
        async move { a.recv_timeout(Duration::from_secs(10)).await.map(|g| g.len()) }
    });
    let r = tokio::time::timeout(Duration::from_secs(10), b.rwrite(src.local().unwrap())).await;
    assert!(matches!(r, Ok((Ok(()), _))), "b's rwrite into a's released ring: {:?}", r.map(|x| x.0));
    assert_eq!(reader.await.unwrap().unwrap(), 256);
    // Every publication reaches b, and each read is answered. a's application drives its
    // end meanwhile (a pipe makes progress in the calls on it; b's answers need a to take
    // them in, or they hold b's send queue, and b's reads behind them).
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let publisher = tokio::spawn({
        let (a, done) = (a.clone(), done.clone());
        async move {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                a.flush().await?;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Ok::<(), ChannelError>(())
        }
    });
    let dst = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    for i in 0..BURST {
        let (r, _) = tokio::time::timeout(Duration::from_secs(10), b.rread(dst.local().unwrap()))
            .await
            .unwrap_or_else(|_| panic!("publication {i} never arrived"));
        assert_eq!(r.unwrap(), 8);
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    publisher.await.unwrap().expect("a's end");
}

/// A read behind a send queue that the pipe's own control messages fill (its peer takes
/// none in for a while; the application's QP holds 8 requests): `rread` waits for room,
/// not failing with a full send queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rread_behind_a_full_send_queue_waits_for_room() {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let caps = QpCaps::default().with_max_send_wr(8).with_max_recv_wr(136).with_max_inline_data(64);
    let (ca, cb) = (ctx.create_cq(256).unwrap(), ctx.create_cq(256).unwrap());
    let (qa, qb) = (pd.create_qp(&ca, &ca, caps).unwrap(), pd.create_qp(&cb, &cb, caps).unwrap());
    qa.connect(&qb.address().unwrap(), &ConnectOptions::default()).unwrap();
    qb.connect(&qa.address().unwrap(), &ConnectOptions::default()).unwrap();
    let cfg = PipeConfig::default();
    let (a, b) = tokio::try_join!(Pipe::connect(qa.clone(), ca, cfg), Pipe::connect(qb, cb, cfg)).unwrap();
    let data = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ).unwrap();
    data.write_at(0, b"readable").unwrap();
    // b publishes once; then a publishes more than b's receive slots hold while b runs
    // nothing, so a's send queue fills with messages b has no receive for.
    assert!(poll_once(b.publish(data.slice(0, 8).unwrap())).is_none());
    for i in 0..160 {
        assert!(poll_once(a.publish(data.slice(0, 8).unwrap())).is_none(), "publication {i}");
    }
    assert_eq!(qa.outstanding_sends(), 8, "a's send queue is full");
    // a reads b's publication while its queue is full; b's application runs meanwhile.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let peer = tokio::spawn({
        let (b, done) = (b.clone(), done.clone());
        async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                b.flush().await?;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Ok::<(), ChannelError>(())
        }
    });
    let dst = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let (r, dst) =
        tokio::time::timeout(Duration::from_secs(10), a.rread(dst.local().unwrap())).await.unwrap();
    assert_eq!(r.expect("rread behind a full send queue"), 8);
    assert_eq!(dst.region().to_vec().unwrap(), b"readable");
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    peer.await.unwrap().unwrap();
}
