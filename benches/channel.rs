//! rdmakit-channel against raw verbs on the soft NIC, side by side in one run:
//! - pipe `rwrite` latency at 8 B (post to completion, busy polling) vs a raw RDMA write
//!   plus completion poll (goal ≤ 1.2×), in both notification modes, beside their floors in
//!   raw verbs (a write with immediate; a data write plus an inline flag write), and the
//!   floor of the pipe's own 8-byte post (an inline write with immediate, signalled one in
//!   16);
//! - pipe bandwidth at 1 MiB, 8 writes in flight, reader releasing, vs 8 raw writes in
//!   flight (goal ≥ 0.95×);
//! - a persistent put-handle round trip vs a send/recv ping-pong of the same size (CkDirect's
//!   claim: put beats messaging), with rdmakit's default detection and with CkDirect's
//!   sentinel (one write per put).
//!
//! `cargo bench --bench channel`; HTML reports land in `target/criterion/report/`.

#![allow(missing_docs)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rdmakit::channel::put::{Detection, PutEndpoint};
use rdmakit::channel::{NotifyMode, Pipe, PipeConfig, PollMode};
use rdmakit::*;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

struct Raw {
    a: QueuePair,
    b: QueuePair,
    ca: CompletionQueue,
    cb: CompletionQueue,
    pd: ProtectionDomain,
}

fn raw_pair() -> Raw {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().expect("pd");
    let (ca, cb) = (ctx.create_cq(4096).expect("cq"), ctx.create_cq(4096).expect("cq"));
    let caps = QpCaps::default().with_max_send_wr(256).with_max_recv_wr(256).with_max_inline_data(64);
    let a = pd.create_qp(&ca, &ca, caps).expect("qp");
    let b = pd.create_qp(&cb, &cb, caps).expect("qp");
    a.connect(&b.address().expect("ep"), &ConnectOptions::default()).expect("connect");
    b.connect(&a.address().expect("ep"), &ConnectOptions::default()).expect("connect");
    Raw { a, b, ca, cb, pd }
}

fn spin(cq: &CompletionQueue) -> WorkCompletion {
    loop {
        if let Some(wc) = cq.poll_one().expect("poll") {
            return wc.ok().expect("completion");
        }
    }
}

/// `op(i)` for `i` in `0..iters`, each timed alone (a clock pair per operation, as the
/// pipe rows are timed).
fn timed_each(iters: u64, mut op: impl FnMut(u64)) -> Duration {
    let mut timed = Duration::ZERO;
    for i in 0..iters {
        let t = Instant::now();
        op(i);
        timed += t.elapsed();
    }
    timed
}

/// `iters` rwrites of `src` from `w` to `r`, each timed from the call to its completion;
/// the reader's release between two is not timed.
fn timed_rwrites(
    rt: &tokio::runtime::Runtime,
    w: &Pipe,
    r: &Pipe,
    src: &MemoryRegion,
    iters: u64,
) -> Duration {
    rt.block_on(async {
        let mut timed = Duration::ZERO;
        for _ in 0..iters {
            let t = Instant::now();
            let (res, _) = w.rwrite(src.local().expect("slice")).await;
            timed += t.elapsed();
            res.expect("rwrite");
            drop(r.recv().await.expect("recv"));
        }
        timed
    })
}

fn pipe_latency(c: &mut Criterion) {
    let rt = rt();
    let pd = Context::open_soft().alloc_pd().expect("pd");
    let cfg = PipeConfig::default()
        .with_notify(NotifyMode::WriteImm)
        .with_poll(PollMode::Busy)
        .with_ring_len(1 << 20);
    let (a, b) = rt.block_on(Pipe::pair(&pd, cfg, cfg)).expect("pipe");
    let src = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).expect("mr");
    let raw = raw_pair();
    let rsrc = raw.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).expect("mr");
    let rdst = raw.pd.alloc_mr(8, AccessFlags::ALL_REMOTE).expect("mr");

    let mut g = c.benchmark_group("latency_8b");
    g.bench_function("pipe_rwrite", |bch| bch.iter_custom(|iters| timed_rwrites(&rt, &a, &b, &src, iters)));
    // The same with the flag notification (the paper's 2PUT: data write, then flag write).
    let fcfg = cfg.with_notify(NotifyMode::Flag);
    let (fa, fb) = rt.block_on(Pipe::pair(&pd, fcfg, fcfg)).expect("pipe");
    g.bench_function("pipe_rwrite_flag", |bch| {
        bch.iter_custom(|iters| timed_rwrites(&rt, &fa, &fb, &src, iters))
    });
    // Timed as the pipe is, one clock pair around each operation (the pipe's reader
    // releases between two of its writes, untimed): the two rows pay the same clock reads.
    g.bench_function("raw_write_and_poll", |bch| {
        bch.iter_custom(|iters| {
            timed_each(iters, |_| {
                raw.a
                    .post_send(SendWr::write(rsrc.local().expect("l"), rdst.remote().slice(0, 8).expect("r")))
                    .expect("post");
                black_box(spin(&raw.ca));
            })
        })
    });
    // The floors of the pipe's two notification modes, in raw verbs: what an rwrite costs
    // before any pipe logic (ring allocation, credits, the driver). A write with immediate
    // also consumes a receive of the reader and queues its completion (the reader's
    // re-post is untimed, as the pipe's release is); data + flag is two writes, the flag
    // inline and signalled.
    let rflag = raw.pd.alloc_mr(8, AccessFlags::ALL_REMOTE).expect("mr");
    let rinbox = raw.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).expect("mr");
    g.bench_function("raw_write_imm_and_poll", |bch| {
        bch.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for i in 0..iters {
                raw.b.post_recv(RecvWr::new(rinbox.local().expect("l"))).expect("recv");
                let t = Instant::now();
                raw.a
                    .post_send(
                        SendWr::write(rsrc.local().expect("l"), rdst.remote().slice(0, 8).expect("r"))
                            .with_imm(i as u32),
                    )
                    .expect("post");
                black_box(spin(&raw.ca));
                timed += t.elapsed();
                black_box(spin(&raw.cb)); // the reader's receive, untimed
            }
            timed
        })
    });
    // The floor of an 8-byte rwrite as the pipe posts it: an inline write with immediate,
    // signalled one in 16 and its completion reaped then, the source bytes on the stack
    // (the pipe copies them from the caller's region first). Between this row and
    // `pipe_rwrite` is the pipe's own cost: ring allocation, credits, its state lock.
    g.bench_function("raw_write_imm_inline_lazy", |bch| {
        bch.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for i in 0..iters {
                raw.b.post_recv(RecvWr::new(rinbox.local().expect("l"))).expect("recv");
                let word = i.to_le_bytes();
                let t = Instant::now();
                let wr =
                    SendWr::write_inline(&word, rdst.remote().slice(0, 8).expect("r")).with_imm(i as u32);
                if i % 16 == 15 {
                    raw.a.post_send(wr).expect("post");
                    black_box(spin(&raw.ca));
                } else {
                    raw.a.post_send(wr.unsignaled()).expect("post");
                }
                timed += t.elapsed();
                black_box(spin(&raw.cb)); // the reader's receive, untimed
            }
            timed
        })
    });
    g.bench_function("raw_write_and_flag_and_poll", |bch| {
        bch.iter_custom(|iters| {
            timed_each(iters, |i| {
                let data = SendWr::write(rsrc.local().expect("l"), rdst.remote().slice(0, 8).expect("r"));
                raw.a.post_send(data.unsignaled()).expect("post");
                let word = i.to_le_bytes();
                raw.a
                    .post_send(SendWr::write_inline(&word, rflag.remote().slice(0, 8).expect("r")))
                    .expect("post");
                black_box(spin(&raw.ca));
            })
        })
    });
    g.finish();
}

fn pipe_bandwidth(c: &mut Criterion) {
    const LEN: u32 = 1 << 20;
    const WINDOW: usize = 8;
    let rt = rt();
    let pd = Context::open_soft().alloc_pd().expect("pd");
    let cfg = PipeConfig::default()
        .with_notify(NotifyMode::WriteImm)
        .with_poll(PollMode::Busy)
        .with_ring_len(16 << 20);
    let (a, b) = rt.block_on(Pipe::pair(&pd, cfg, cfg)).expect("pipe");
    let srcs: Vec<_> =
        (0..WINDOW).map(|_| pd.alloc_mr(LEN as usize, AccessFlags::LOCAL_WRITE).expect("mr")).collect();
    let raw = raw_pair();
    let rsrcs: Vec<_> =
        (0..WINDOW).map(|_| raw.pd.alloc_mr(LEN as usize, AccessFlags::LOCAL_WRITE).expect("mr")).collect();
    let rdst = raw.pd.alloc_mr(LEN as usize * WINDOW, AccessFlags::ALL_REMOTE).expect("mr");

    let mut g = c.benchmark_group("bandwidth_1mib_x8");
    g.throughput(Throughput::Bytes(u64::from(LEN) * WINDOW as u64));
    g.sample_size(20);
    g.bench_function("pipe_rwrite", |bch| {
        bch.iter(|| {
            rt.block_on(async {
                let writes = srcs.iter().map(|s| a.rwrite(s.local().expect("slice")));
                for (r, _) in futures_join_all(writes).await {
                    r.expect("rwrite");
                }
                for _ in 0..WINDOW {
                    drop(b.recv().await.expect("recv"));
                }
            })
        })
    });
    g.bench_function("raw_writes", |bch| {
        bch.iter(|| {
            for (i, s) in rsrcs.iter().enumerate() {
                let dst = rdst.remote().slice(i as u64 * u64::from(LEN), LEN).expect("r");
                raw.a.post_send(SendWr::write(s.local().expect("l"), dst)).expect("post");
            }
            for _ in 0..WINDOW {
                spin(&raw.ca);
            }
        })
    });
    g.finish();
}

/// Polls all futures to completion concurrently (join_all without the `futures` crate).
async fn futures_join_all<F: std::future::Future>(fs: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut set: Vec<_> = fs.map(|f| Box::pin(f)).collect();
    let mut out: Vec<Option<F::Output>> = (0..set.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in set.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    out.into_iter().map(|o| o.expect("completed")).collect()
}

/// Puts, retrying while the receiver has not consumed the previous put; any other error
/// ends the bench.
fn put_when_ready(h: &rdmakit::channel::put::SendHandle) {
    loop {
        match h.put() {
            Ok(()) => return,
            Err(rdmakit::channel::ChannelError::Busy) => std::hint::spin_loop(),
            Err(e) => panic!("put failed: {e}"),
        }
    }
}

fn put_vs_messaging(c: &mut Criterion) {
    let mut g = c.benchmark_group("round_trip");
    for size in [8usize, 4096, 65536] {
        // Put handles both ways: rdmakit's default detection (a sequence word, the
        // receiver's ready signalled back: three writes per put) and CkDirect's own (the
        // buffer's last word changes from an out-of-band value: one write per put).
        for (name, detection) in
            [("put_handles", Detection::SequenceWord), ("put_handles_sentinel", Detection::Sentinel)]
        {
            let raw = raw_pair();
            let pd = raw.pd.clone();
            let ea = PutEndpoint::new(raw.a.clone(), raw.ca.clone(), PollMode::Busy).expect("ep");
            let eb = PutEndpoint::new(raw.b.clone(), raw.cb.clone(), PollMode::Busy).expect("ep");
            let (ra, rb) = (
                pd.alloc_mr(size, AccessFlags::ALL_REMOTE).expect("mr"),
                pd.alloc_mr(size, AccessFlags::ALL_REMOTE).expect("mr"),
            );
            let (sa, sb) = (
                pd.alloc_mr(size, AccessFlags::LOCAL_WRITE).expect("mr"),
                pd.alloc_mr(size, AccessFlags::LOCAL_WRITE).expect("mr"),
            );
            // The payloads are zeros: the sentinel is a value they never end with.
            let ha = ea.create_handle_with(&ra, |_| {}, u64::MAX, detection).expect("handle");
            let hb = eb.create_handle_with(&rb, |_| {}, u64::MAX, detection).expect("handle");
            let to_b = ea.assoc_local_buffer(&hb.desc().expect("d"), sa.local().expect("l")).expect("assoc");
            let to_a = eb.assoc_local_buffer(&ha.desc().expect("d"), sb.local().expect("l")).expect("assoc");
            // CkDirect's loop (see `rdmakit_channel::put`): queued once, then each
            // iteration polls, uses the data and calls `ready` (mark done and queue again).
            hb.ready_poll_q().expect("queue");
            ha.ready_poll_q().expect("queue");
            g.bench_with_input(BenchmarkId::new(name, size), &size, |bch, _| {
                bch.iter(|| {
                    put_when_ready(&to_b);
                    while eb.ready_poll().expect("poll") == 0 {}
                    hb.ready().expect("ready");
                    put_when_ready(&to_a);
                    while ea.ready_poll().expect("poll") == 0 {}
                    ha.ready().expect("ready");
                })
            });
        }

        // Send/recv ping-pong: each side echoes the buffer it received into (two buffers in
        // all, as perftest's send_lat), and with a receive buffer apart from the send
        // buffer on each side (four in all: the put handles' working set, where the bytes a
        // side sends are not the bytes it just received, so not in its nearest cache).
        for (name, apart) in [("send_recv", false), ("send_recv_apart", true)] {
            let raw = raw_pair();
            let mr = || raw.pd.alloc_mr(size, AccessFlags::LOCAL_WRITE).expect("mr");
            let (ra, rb) = (mr(), mr());
            let (sa, sb) = if apart { (mr(), mr()) } else { (ra.clone(), rb.clone()) };
            g.bench_with_input(BenchmarkId::new(name, size), &size, |bch, _| {
                bch.iter(|| {
                    raw.b.post_recv(RecvWr::new(rb.local().expect("l"))).expect("recv");
                    raw.a.post_recv(RecvWr::new(ra.local().expect("l"))).expect("recv");
                    raw.a.post_send(SendWr::send(sa.local().expect("l"))).expect("send");
                    spin(&raw.cb); // b's receive
                    raw.b.post_send(SendWr::send(sb.local().expect("l"))).expect("send");
                    spin(&raw.ca); // a's send or receive
                    spin(&raw.ca);
                    spin(&raw.cb); // b's send
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, pipe_latency, pipe_bandwidth, put_vs_messaging);
criterion_main!(benches);
