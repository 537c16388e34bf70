//! `rpipe-seed`: the rmalloc()/rpipe() paper's evaluation (Wickramasinghe and Lumsdaine),
//! rerun through rdmakit's pipes and printed in the paper's shapes beside its figures.
//!
//! - rwrite latency over a size sweep, the two notification modes side by side: one RDMA
//!   write with immediate ([`NotifyMode::WriteImm`], the paper's `PUT_W_SYNC`) against the
//!   data write followed by a flag write ([`NotifyMode::Flag`], the paper's `2PUT`), beside
//!   raw RDMA writes with immediate between two QPs (the pipe's cost over the wire's; the
//!   paper's baseline was MPI RMA, which rdmakit has no counterpart for);
//! - rread latency over the same sweep (the owner publishes, the reader RDMA-reads);
//! - rwrite latency per allocation policy of the pipe's remote heap (next-fit, first-fit,
//!   best-fit, worst-fit) over a fragmented ring, and each policy's slowdown against
//!   next-fit (the paper: 1x-3.5x for best/worst-fit).
//!
//! The paper's figures come from a Cray XC30 (Aries, uGNI; Big Red II+); the text of the
//! talk gives 0.65 us for small/medium `rwrite`, 2.14 us for small/medium `rread`, and the
//! 1x-3.5x slowdown; its other figures are plots. Both ends run in this process (loopback)
//! in one task, as a ping-pong (latency is half the round trip, as `ib_write_lat`), busy
//! polling; each cell is the median over `runs` runs of each run's typical (median) round
//! trip of `iters`.

use std::future::Future;
use std::pin::pin;
use std::task::Poll;
use std::time::Instant;

use rdmakit_channel::{NotifyMode, Pipe, PipeConfig, PollMode, RecvGuard};
use rdmakit_memory::heap::AllocPolicy;
use rdmakit_verbs::*;

use crate::channel::{chan, runtime};
use crate::rig::{self, Params, Placement, Side, Test};

/// The paper's figures (Cray XC30, Aries, uGNI), as its text gives them.
const SEED_RWRITE_US: f64 = 0.65;
const SEED_RREAD_US: f64 = 2.14;

/// Polls two futures together until both are done (a two-way `join`).
pub(crate) async fn join2<A: Future, B: Future>(a: A, b: B) -> (A::Output, B::Output) {
    let (mut a, mut b) = (pin!(a), pin!(b));
    let (mut ra, mut rb) = (None, None);
    std::future::poll_fn(|cx| {
        if ra.is_none()
            && let Poll::Ready(v) = a.as_mut().poll(cx)
        {
            ra = Some(v);
        }
        if rb.is_none()
            && let Poll::Ready(v) = b.as_mut().poll(cx)
        {
            rb = Some(v);
        }
        if ra.is_some() && rb.is_some() { Poll::Ready(()) } else { Poll::Pending }
    })
    .await;
    (ra.expect("polled to completion"), rb.expect("polled to completion"))
}

/// The sizes of the sweep: 8 B to `max` by factors of 8, and `max` itself.
pub fn sizes(max: u32) -> Vec<u32> {
    let mut v: Vec<u32> =
        std::iter::successors(Some(8u32), |&s| s.checked_mul(8)).take_while(|&s| s <= max).collect();
    if v.last().is_some_and(|&l| l < max) {
        v.push(max);
    }
    v
}

/// Median of `v` (sorted in place); NaN for an empty set.
pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

/// A connected pair of pipe ends in this process, on QPs the perf rig made (so a verbs
/// device gets its connect options), with everything they need kept alive.
struct PipePair {
    a: Pipe,
    b: Pipe,
    src_a: MemoryRegion,
    src_b: MemoryRegion,
    _sides: (Side, Side),
}

async fn pipe_pair(ctx: &Context, copts: &ConnectOptions, max: u32, cfg: PipeConfig) -> Result<PipePair> {
    let p = Params::simple(Test::PipeLat, 8, 1, 64, Placement::Host);
    let (sa, sb) = rig::loopback(ctx, &p, copts)?;
    let (a, b) = join2(
        Pipe::connect(sa.qp.clone(), sa.cq.clone(), cfg),
        Pipe::connect(sb.qp.clone(), sb.cq.clone(), cfg),
    )
    .await;
    let (a, b) = (a.map_err(chan)?, b.map_err(chan)?);
    let pd = sa.qp.pd();
    // REMOTE_READ: rread's owner publishes from these.
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
    let (src_a, src_b) = (pd.alloc_mr(max as usize, access)?, pd.alloc_mr(max as usize, access)?);
    Ok(PipePair { a, b, src_a, src_b, _sides: (sa, sb) })
}

fn config(max: u32, notify: NotifyMode, policy: AllocPolicy) -> PipeConfig {
    // Room for the largest message and the fragmentation below, several times over.
    let ring = (u64::from(max) * 4).max(4 << 20);
    PipeConfig::default()
        .with_ring_len(ring)
        .with_notify(notify)
        .with_policy(policy)
        .with_poll(PollMode::Busy)
        .with_slots(64)
}

/// Typical (median) half round trip (us) of `iters` rwrite ping-pongs of `size` bytes.
async fn rwrite_pingpong(pp: &PipePair, size: u32, iters: u32) -> Result<f64> {
    let (sa, sb) = (pp.src_a.slice(0, size)?, pp.src_b.slice(0, size)?);
    let mut lat = crate::measure::samples_vec(iters as usize)?;
    for _ in 0..iters {
        let t = Instant::now();
        pp.a.rwrite(sa.clone()).await.0.map_err(chan)?;
        drop(pp.b.recv().await.map_err(chan)?);
        pp.b.rwrite(sb.clone()).await.0.map_err(chan)?;
        drop(pp.a.recv().await.map_err(chan)?);
        lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
    }
    Ok(median(&mut lat))
}

/// The baseline under a pipe: raw RDMA writes with immediate between two QPs of the rig
/// (what one PUT_W_SYNC `rwrite` is on the wire), as a ping-pong in one thread.
struct RawPair {
    a: Side,
    b: Side,
}

const RAW_RECV: u64 = 1;
const RAW_SEND: u64 = 2;

impl RawPair {
    fn new(ctx: &Context, copts: &ConnectOptions, max: u32) -> Result<RawPair> {
        let (a, b) = rig::loopback(ctx, &Params::simple(Test::WriteLat, max, 1, 2, Placement::Host), copts)?;
        for s in [&a, &b] {
            s.qp.post_recv(RecvWr::new(s.buf.slice(0, 8)?).wr_id(RAW_RECV))?;
        }
        Ok(RawPair { a, b })
    }

    /// Waits for `side`'s receive completion (a write with immediate landed), reaping its
    /// own sends' completions on the way, and posts the next receive.
    fn landed(side: &Side) -> Result<()> {
        loop {
            let wc = side.cq.spin(std::time::Duration::from_secs(30))?.ok()?;
            if wc.wr_id == RAW_RECV {
                return side.qp.post_recv(RecvWr::new(side.buf.slice(0, 8)?).wr_id(RAW_RECV));
            }
        }
    }

    /// Typical (median) half round trip (us) of `iters` ping-pongs of `size` bytes.
    fn pingpong(&self, size: u32, iters: u32) -> Result<f64> {
        let (a, b) = (&self.a, &self.b);
        let mut lat = crate::measure::samples_vec(iters as usize)?;
        for i in 0..iters {
            let t = Instant::now();
            a.qp.post_send(
                SendWr::write(a.buf.slice(0, size)?, a.peer_buf.slice(0, size)?).with_imm(i).wr_id(RAW_SEND),
            )?;
            Self::landed(b)?;
            b.qp.post_send(
                SendWr::write(b.buf.slice(0, size)?, b.peer_buf.slice(0, size)?).with_imm(i).wr_id(RAW_SEND),
            )?;
            Self::landed(a)?;
            lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
        Ok(median(&mut lat))
    }
}

/// Typical (median) time (us) of `iters` rreads of `size` bytes: `a` publishes, `b` reads
/// it (the publication's control message, the RDMA read, the read-done answer).
async fn rread_loop(pp: &PipePair, size: u32, iters: u32) -> Result<f64> {
    let (src, dst) = (pp.src_a.slice(0, size)?, pp.src_b.slice(0, size)?);
    let mut lat = crate::measure::samples_vec(iters as usize)?;
    for _ in 0..iters {
        let t = Instant::now();
        let ((published, _), (read, _)) = join2(pp.a.publish(src.clone()), pp.b.rread(dst.clone())).await;
        published.map_err(chan)?;
        let n = read.map_err(chan)?;
        if n != size as usize {
            return Err(Error::InvalidArgument(format!("rread returned {n} bytes of {size}")));
        }
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(median(&mut lat))
}

/// Fragments `b`'s ring as the writer `a` sees it: 96 messages of 1-8 KiB that `b` holds,
/// every other one released (48 holes of varied sizes), the rest returned by the caller's
/// drop. The writer's allocator then chooses among the holes on every rwrite.
async fn fragment(pp: &PipePair) -> Result<Vec<RecvGuard>> {
    let mut held = Vec::new();
    for i in 0..96u32 {
        let len = 1024 * (1 + (i * 5) % 8);
        let s = pp.src_a.slice(0, len.min(pp.src_a.len() as u32))?;
        pp.a.rwrite(s).await.0.map_err(chan)?;
        let g = pp.b.recv().await.map_err(chan)?;
        if i % 2 == 0 {
            held.push(g);
        }
    }
    Ok(held)
}

/// Runs `f` `runs` times and returns the median.
async fn med<F, Fut>(runs: usize, mut f: F) -> Result<f64>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<f64>>,
{
    let mut v = Vec::with_capacity(runs);
    for _ in 0..runs {
        v.push(f().await?);
    }
    Ok(median(&mut v))
}

/// One row of the output: what, the size, and the figures.
fn label(size: u32) -> String {
    match size {
        s if s >= 1 << 20 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

/// The three tables of the rpipe seed on `ctx`.
pub fn rpipe_seed(ctx: &Context, copts: &ConnectOptions, max: u32, iters: u32, runs: usize) -> Result<()> {
    let sizes = sizes(max);
    if sizes.is_empty() {
        return Err(Error::InvalidArgument(format!("--max-size {max} is below the smallest size (8 B)")));
    }
    let max = *sizes.last().expect("not empty");
    let kind = if ctx.provider() == ProviderKind::Soft { "soft" } else { "rxe/verbs" };
    let rt = runtime()?;
    println!(
        "rpipe-seed on {} ({:?} provider: {kind}), loopback, busy polling, typical (median) of {iters} round trips per run, median of {runs} runs; seed: rmalloc()/rpipe() on a Cray XC30 (Aries, uGNI, Big Red II+)",
        ctx.name(),
        ctx.provider()
    );
    // 1. rwrite: PUT_W_SYNC (write with immediate) against 2PUT (data + flag).
    println!();
    println!(
        "rwrite latency [us], half round trip: PUT_W_SYNC (write with immediate) vs 2PUT (data write + flag write)"
    );
    println!(
        "{:<10} {:>12} {:>12} {:>9}   {:>12} {:>9}   {:<8}",
        "size", "PUT_W_SYNC", "2PUT", "2PUT/PWS", "raw w/imm", "PWS/raw", ""
    );
    rt.block_on(async {
        let imm = pipe_pair(ctx, copts, max, config(max, NotifyMode::WriteImm, AllocPolicy::NextFit)).await?;
        let flag = pipe_pair(ctx, copts, max, config(max, NotifyMode::Flag, AllocPolicy::NextFit)).await?;
        let raw = RawPair::new(ctx, copts, max)?;
        for &s in &sizes {
            // Warm up (first touches, ring cursor), then interleave the three's runs.
            rwrite_pingpong(&imm, s, iters.min(64)).await?;
            rwrite_pingpong(&flag, s, iters.min(64)).await?;
            raw.pingpong(s, iters.min(64))?;
            let (mut vi, mut vf, mut vr) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..runs {
                vi.push(rwrite_pingpong(&imm, s, iters).await?);
                vf.push(rwrite_pingpong(&flag, s, iters).await?);
                vr.push(raw.pingpong(s, iters)?);
            }
            let (li, lf, lr) = (median(&mut vi), median(&mut vf), median(&mut vr));
            println!(
                "{:<10} {:>12.3} {:>12.3} {:>9.2}   {:>12.3} {:>9.2}   {kind}",
                label(s),
                li,
                lf,
                lf / li,
                lr,
                li / lr
            );
        }
        Ok::<(), Error>(())
    })?;
    println!(
        "{:<10} {:>12} {:>12} {:>9}   {:>12} {:>9}   seed (small/medium rwrite {SEED_RWRITE_US} us; PUT_W_SYNC(s) < 2PUT(s) at every size; up to 6x faster than MPI RMA)",
        "", "", "", "", "", ""
    );
    // 2. rread.
    println!();
    println!("rread latency [us] (publish, RDMA read, read-done)");
    println!("{:<10} {:>12}   {:<8}", "size", "rread", "");
    rt.block_on(async {
        let pp = pipe_pair(ctx, copts, max, config(max, NotifyMode::WriteImm, AllocPolicy::NextFit)).await?;
        for &s in &sizes {
            rread_loop(&pp, s, iters.min(64)).await?;
            let l = med(runs, || rread_loop(&pp, s, iters)).await?;
            println!("{:<10} {:>12.3}   {kind}", label(s), l);
        }
        Ok::<(), Error>(())
    })?;
    println!("{:<10} {:>12}   seed (small/medium rread {SEED_RREAD_US} us)", "", "");
    // 3. Allocation policies, through pipes over a fragmented ring.
    println!();
    println!(
        "rwrite latency [us] by allocation policy of the pipe's remote heap (ring fragmented into 48 holes of 1-8 KiB), slowdown against next-fit"
    );
    let names = ["next-fit", "first-fit", "best-fit", "worst-fit"];
    print!("{:<10}", "size");
    for n in names {
        print!(" {n:>10}");
    }
    println!(" {:>8} {:>8} {:>8}", "FF/NF", "BF/NF", "WF/NF");
    rt.block_on(async {
        let mut pairs = Vec::new();
        for policy in AllocPolicy::ALL {
            let pp = pipe_pair(ctx, copts, max, config(max, NotifyMode::WriteImm, policy)).await?;
            let held = fragment(&pp).await?;
            pairs.push((pp, held));
        }
        for &s in &sizes {
            let mut lat = [0.0f64; 4];
            let mut v: [Vec<f64>; 4] = Default::default();
            for (pp, _) in &pairs {
                rwrite_pingpong(pp, s, iters.min(64)).await?;
            }
            for _ in 0..runs {
                for (i, (pp, _)) in pairs.iter().enumerate() {
                    v[i].push(rwrite_pingpong(pp, s, iters).await?);
                }
            }
            for i in 0..4 {
                lat[i] = median(&mut v[i]);
            }
            print!("{:<10}", label(s));
            for l in lat {
                print!(" {l:>10.3}");
            }
            println!(" {:>8.2} {:>8.2} {:>8.2}   {kind}", lat[1] / lat[0], lat[2] / lat[0], lat[3] / lat[0]);
        }
        Ok::<(), Error>(())
    })?;
    println!(
        "{:<10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>8}   seed (next-fit fastest; best/worst-fit 1x-3.5x slower; L[next-fit] < L[MPI] < L[worst-fit])",
        "", "", "", "", "", "", "1-3.5", "1-3.5"
    );
    if ctx.provider() == ProviderKind::Soft {
        println!(
            "soft NIC: a software NIC in this process (memcpy and threads), not Aries' FMA/BTE engines: the ratios (PUT_W_SYNC vs 2PUT, policy slowdowns) are comparable, the absolute microseconds are not"
        );
    }
    Ok(())
}

/// `rpipe-seed`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct RpipeArgs {
    #[command(flatten)]
    pub(crate) dev: crate::DeviceOpts,
    /// The largest message (the sweep is 8 B to it by factors of 8, and it).
    #[arg(long, default_value_t = 1 << 20)]
    max_size: u32,
    /// Round trips (or rreads) per run.
    #[arg(short = 'n', long, default_value_t = 2000)]
    iters: u32,
    /// Runs per cell; the median is reported.
    #[arg(long, default_value_t = 5)]
    runs: usize,
}

/// Runs `rpipe-seed` with `a`'s options.
pub(crate) fn run(ctx: &Context, copts: &ConnectOptions, a: &RpipeArgs) -> Result<()> {
    rpipe_seed(ctx, copts, a.max_size.min(rig::MAX_SIZE), a.iters.max(1), a.runs.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_ends_at_the_largest_size() {
        assert_eq!(sizes(8), [8]);
        assert_eq!(sizes(4096), [8, 64, 512, 4096]);
        assert_eq!(sizes(1 << 20), [8, 64, 512, 4096, 32768, 262144, 1 << 20]);
        assert_eq!(sizes(5000), [8, 64, 512, 4096, 5000]);
        assert!(sizes(7).is_empty());
    }

    #[test]
    fn join2_waits_for_both() {
        let rt = runtime().unwrap();
        let (a, b) = rt.block_on(join2(async { 1 }, async {
            tokio::task::yield_now().await;
            2
        }));
        assert_eq!((a, b), (1, 2));
    }
}
