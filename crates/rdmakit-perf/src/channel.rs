//! `pipe-lat` and `pipe-bw`: rdmakit-channel's pipes measured the perftest way (`put-lat`
//! is in `put_lat`).
//!
//! - pipe-lat: a ping-pong of `rwrite`s (each side receives, then writes back); half the
//!   round trip, as `ib_write_lat` reports;
//! - pipe-bw: `window` `rwrite`s in flight at a time, the reader receiving and releasing.
//!
//! All wait by busy polling (as perftest does).

use std::time::Instant;

use indicatif::ProgressBar;
use rdmakit_channel::{ChannelError, NotifyMode, Pipe, PipeConfig, PollMode};
use rdmakit_verbs::{Error, Result};

use crate::measure::{Bw, Measured, PEAK_MAX_ITERS};
use crate::rig::{Params, Side, Test};

/// A channel error as the tool's error: verbs errors as they are, the rest by message.
pub(crate) fn chan(e: ChannelError) -> Error {
    match e {
        ChannelError::Verbs(v) => v,
        other => Error::InvalidArgument(other.to_string()),
    }
}

/// The single-threaded tokio runtime the channel benchmarks run their pipes on.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| Error::Os { call: "tokio runtime", source })
}

fn config(p: &Params) -> PipeConfig {
    // Room for `window` messages of `size` bytes in the ring, twice over, within 1..=256 MiB
    // (what pipe-bw's defaults ask: 1 MiB messages, a window of 128): a server sizes its
    // ring from what a client asks for, and 8 MiB messages with a window of 2000 would be
    // 32 GiB. A writer beyond the ring waits for credit.
    let ring =
        (u64::from(p.size.next_multiple_of(8)) * u64::from(p.window.max(1)) * 2).clamp(1 << 20, 256 << 20);
    let default = PipeConfig::default();
    // Notification slots for the window, and never fewer than a pipe has by default: the
    // reader returns credit when a quarter of its slots wait, so the 2 slots a window of 1
    // would give made every rwrite of pipe-lat cost a credit message as well (1.2 us a
    // half round trip on the soft NIC instead of 0.8; on rxe 51 us instead of 20).
    let slots = p.window.max(default.slots).min(64);
    default.with_ring_len(ring).with_notify(NotifyMode::WriteImm).with_poll(PollMode::Busy).with_slots(slots)
}

async fn pipe(side: &Side, p: &Params) -> Result<Pipe> {
    let conn_qp = side.qp.clone();
    Pipe::connect(conn_qp, side.cq.clone(), config(p)).await.map_err(chan)
}

/// The client's side of a channel test, against a peer running [`serve`] (in this
/// process for loopback, or over a connection).
pub fn run(side: &Side, p: &Params, bar: &ProgressBar) -> Result<Measured> {
    runtime()?.block_on(async {
        let pipe = pipe(side, p).await?;
        let src = side.buf.slice(0, p.size)?;
        match p.test {
            Test::PipeLat => {
                let mut lat = crate::measure::samples_vec(p.iters as usize)?;
                for i in 0..p.iters {
                    let t = Instant::now();
                    pipe.rwrite(src.clone()).await.0.map_err(chan)?;
                    drop(pipe.recv().await.map_err(chan)?);
                    lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
                    tick(bar, i);
                }
                Ok(Measured::Latency(lat))
            }
            Test::PipeBw => {
                let window = p.window.max(1) as usize;
                let slots = (side.buf.len() / p.size.max(64) as usize).clamp(1, window);
                let slices: Vec<_> = (0..slots)
                    .map(|i| side.buf.slice((i * p.size.max(64) as usize) as u64, p.size))
                    .collect::<Result<_>>()?;
                let start = Instant::now();
                let mut done = 0u32;
                let mut peak: f64 = 0.0;
                while done < p.iters {
                    let n = (p.iters - done).min(slots as u32) as usize;
                    let t = Instant::now();
                    let writes: Vec<_> = slices[..n].iter().map(|s| pipe.rwrite(s.clone())).collect();
                    for (r, _) in join_all(writes).await {
                        r.map_err(chan)?;
                    }
                    let secs = t.elapsed().as_secs_f64().max(1e-9);
                    peak = peak.max(n as f64 * f64::from(p.size) / secs);
                    done += n as u32;
                    tick(bar, done);
                }
                // The reader acknowledges the last message: everything has landed.
                drop(pipe.recv().await.map_err(chan)?);
                let secs = start.elapsed().as_secs_f64();
                let bytes = u64::from(p.iters) * u64::from(p.size);
                let avg = bytes as f64 / secs.max(1e-9);
                Ok(Measured::Bandwidth(Bw {
                    bytes_per_sec: avg,
                    peak_bytes_per_sec: (p.iters <= PEAK_MAX_ITERS).then(|| peak.max(avg)),
                    msgs_per_sec: f64::from(p.iters) / secs.max(1e-9),
                    iters: u64::from(p.iters),
                    cq_mod: 0,
                }))
            }
            _ => Err(Error::InvalidArgument(format!("{} is not a pipe test", p.test.name()))),
        }
    })
}

/// The server's rwrite, which waits `STUCK` at most (for credit from a client that takes
/// nothing, or for its completion): a client may be alive and never release. Most rwrites
/// resolve on their first poll (an inline one is done once posted), so the timer, a clock
/// read and a timer-wheel entry, is made only for one that waits: the server's echo is
/// part of what the client measures.
async fn rwrite(pipe: &Pipe, src: rdmakit_verbs::LocalSlice) -> Result<()> {
    use std::task::Poll;
    let mut w = std::pin::pin!(pipe.rwrite(src));
    let first = std::future::poll_fn(|cx| Poll::Ready(w.as_mut().poll(cx))).await;
    let (r, _) = match first {
        Poll::Ready(done) => done,
        Poll::Pending => tokio::time::timeout(crate::measure::STUCK, w)
            .await
            .map_err(|_| Error::Timeout(crate::measure::STUCK))?,
    };
    r.map_err(chan)
}

/// The server's side of a pipe test.
pub fn serve(side: &Side, p: &Params) -> Result<()> {
    runtime()?.block_on(async {
        let pipe = pipe(side, p).await?;
        match p.test {
            // A live client that stops sending, or stops taking what it is sent (its pipe
            // still answers keep-alives), would hold the server for ever: each message is
            // waited for `STUCK` at most, as the verbs tests' servers wait.
            Test::PipeLat => {
                let src = side.buf.slice(0, p.size)?;
                for _ in 0..p.iters {
                    drop(pipe.recv_timeout(crate::measure::STUCK).await.map_err(chan)?);
                    rwrite(&pipe, src.clone()).await?;
                }
            }
            Test::PipeBw => {
                for _ in 0..p.iters {
                    drop(pipe.recv_timeout(crate::measure::STUCK).await.map_err(chan)?);
                }
                let ack = side.buf.slice(0, 1)?;
                rwrite(&pipe, ack).await?;
            }
            _ => return Err(Error::InvalidArgument(format!("{} is not a pipe test", p.test.name()))),
        }
        Ok(())
    })
}

fn tick(bar: &ProgressBar, i: u32) {
    if i.is_multiple_of(1024) {
        bar.set_position(u64::from(i));
    }
}

/// Polls the futures to completion together (a small `join_all`).
async fn join_all<F: std::future::Future>(fs: Vec<F>) -> Vec<F::Output> {
    let mut fs: Vec<_> = fs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = fs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in fs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *o = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    out.into_iter().map(|o| o.expect("every future completed")).collect()
}

/// Pipe `rwrite` of 8 bytes against its floor in raw verbs, a raw 8-byte RDMA write and its
/// completion, in one process on the soft NIC: the criterion group `channel/latency_8b`'s
/// rows, measured side by side. Criterion times each row in its own few seconds, and on a
/// shared host the two windows differ by up to 30%, more than the 1.2× the pipe is
/// allowed; here blocks of `block` operations of each alternate `rounds` times, so a slow
/// moment slows all of them.
///
/// Timed as the criterion rows are: a clock pair around each operation; the pipe's reader
/// takes and releases each message between two writes, untimed (the rpipe paper's rwrite
/// is the writer's put and its completion). Returns the mean µs per operation of: a pipe
/// notifying by write with immediate (PUT_W_SYNC), a pipe notifying by a flag write after
/// the data (2PUT, the paper's "one put plus a flag"), a raw write, and a raw write with
/// immediate (the floor of the first pipe's notification: it also consumes a receive of
/// the reader, re-posted untimed, as the pipe's reader re-posts).
pub(crate) fn rwrite_vs_raw(rounds: u32, block: u32) -> Result<[f64; 4]> {
    use rdmakit_verbs::{AccessFlags, ConnectOptions, Context, QpCaps, RecvWr, SendWr};
    let rt = runtime()?;
    let pd = Context::open_soft().alloc_pd()?;
    let pair = |notify| {
        let cfg = PipeConfig::default().with_notify(notify).with_poll(PollMode::Busy).with_ring_len(1 << 20);
        rt.block_on(Pipe::pair(&pd, cfg, cfg)).map_err(chan)
    };
    let pipes = [pair(NotifyMode::WriteImm)?, pair(NotifyMode::Flag)?];
    let src = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    // The raw floors: a QP pair of their own, a write of 8 bytes and a busy poll of its CQ.
    let ctx = pd.context().clone();
    let (ca, cb) = (ctx.create_cq(4096)?, ctx.create_cq(4096)?);
    let caps = QpCaps::default().with_max_send_wr(256).with_max_recv_wr(256).with_max_inline_data(64);
    let (a, b) = (pd.create_qp(&ca, &ca, caps)?, pd.create_qp(&cb, &cb, caps)?);
    a.connect(&b.address()?, &ConnectOptions::default())?;
    b.connect(&a.address()?, &ConnectOptions::default())?;
    let (rsrc, rdst) = (pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?, pd.alloc_mr(8, AccessFlags::ALL_REMOTE)?);
    let inbox = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    let mut t = [std::time::Duration::ZERO; 4];
    for _ in 0..rounds {
        for (k, (w, r)) in pipes.iter().enumerate() {
            rt.block_on(async {
                for _ in 0..block {
                    let at = Instant::now();
                    let (res, _) = w.rwrite(src.local()?).await;
                    t[k] += at.elapsed();
                    res.map_err(chan)?;
                    drop(r.recv().await.map_err(chan)?);
                }
                Ok::<_, Error>(())
            })?;
        }
        for _ in 0..block {
            let at = Instant::now();
            a.post_send(SendWr::write(rsrc.local()?, rdst.remote().slice(0, 8)?))?;
            ca.spin(crate::measure::STUCK)?.ok()?;
            t[2] += at.elapsed();
        }
        for i in 0..block {
            b.post_recv(RecvWr::new(inbox.local()?))?;
            let at = Instant::now();
            a.post_send(SendWr::write(rsrc.local()?, rdst.remote().slice(0, 8)?).with_imm(i))?;
            ca.spin(crate::measure::STUCK)?.ok()?;
            t[3] += at.elapsed();
            cb.spin(crate::measure::STUCK)?.ok()?;
        }
    }
    let ops = f64::from(rounds) * f64::from(block.max(1));
    Ok(t.map(|d| d.as_secs_f64() * 1e6 / ops))
}
