//! `scaling`: the soft NIC's cost against the number of connections across two processes.
//!
//! For each pair count N, this process spawns itself as the peer (the hidden
//! `scaling-peer` subcommand), the two exchange N QP endpoints over the child's
//! stdin/stdout, connect N pipes (one QP and one CQ per pipe end, on one soft device per
//! process), and this side `rwrite`s 8-byte messages on every pipe at once (one in flight
//! per pipe) for the given time while the peer receives and releases them. Printed per N:
//! the aggregate message rate, and the threads and resident memory of each process sampled
//! in the middle of the run (`/proc/<pid>/status`).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::channel::{chan, runtime};
use clap::Args;
use rdmakit_channel::{NotifyMode, Pipe, PipeConfig, PollMode};
use rdmakit_verbs::*;

/// Options of `scaling`.
#[derive(Args, Debug, Clone)]
pub struct ScalingArgs {
    /// Pair counts to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1u32, 4, 16, 64, 256, 1024])]
    pairs: Vec<u32>,
    /// Seconds of sending per pair count.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Runs per pair count (a new pair of processes each): the row is the run with the
    /// median rate, and the spread of the rates is printed beside it.
    #[arg(long, default_value_t = 1)]
    runs: u32,
    /// Connect the QPs (each end's link and served stream up) but send nothing: the memory
    /// of idle connections.
    #[arg(long)]
    idle: bool,
}

/// Options of the hidden peer.
#[derive(Args, Debug, Clone)]
pub struct PeerArgs {
    /// Seconds after which the peer samples its threads and memory.
    #[arg(long)]
    sample_after: f64,
    /// QPs only, no pipes, nothing sent.
    #[arg(long)]
    idle: bool,
}

const MSG: u32 = 8;
/// QPs connected per step (see `measure`).
const CHUNK: usize = 128;

pub(crate) fn io(call: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Os { call, source }
}

pub(crate) fn bad(what: impl Into<String>) -> Error {
    Error::InvalidArgument(what.into())
}

/// The QPs' transport timer: the default unless `RDMAKIT_SCALING_QP_TIMEOUT` (the verbs
/// `timeout` exponent, 4.096 us x 2^t per try) says otherwise.
fn connect_options() -> ConnectOptions {
    let o = ConnectOptions::default();
    match std::env::var("RDMAKIT_SCALING_QP_TIMEOUT").ok().and_then(|v| v.parse::<u8>().ok()) {
        Some(t) if (1..=31).contains(&t) => o.with_timeout(t),
        _ => o,
    }
}

fn config() -> PipeConfig {
    PipeConfig::default()
        .with_ring_len(64 << 10)
        .with_notify(NotifyMode::WriteImm)
        .with_poll(PollMode::Event)
        // One rwrite in flight on each pipe, as the table says: each waits for its write.
        .with_inline_max(0)
}

/// Threads and resident KiB of process `pid` ("self" for this one).
fn status(pid: &str) -> (u64, u64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("Threads:"), field("VmRSS:"))
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub(crate) fn unhex(s: &str) -> Result<Vec<u8>> {
    let s = s.trim();
    if !s.len().is_multiple_of(2) {
        return Err(bad("odd hex length"));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|_| bad("bad hex")))
        .collect()
}

/// N pipe-end QPs on `pd`, each with its own CQ.
fn qps(ctx: &Context, pd: &ProtectionDomain, n: u32) -> Result<Vec<(QueuePair, CompletionQueue)>> {
    let caps = QpCaps::default().with_max_send_wr(64).with_max_recv_wr(136).with_max_inline_data(64);
    (0..n)
        .map(|_| {
            let cq = ctx.create_cq(256)?;
            let qp = pd.create_qp(&cq, &cq, caps)?;
            Ok((qp, cq))
        })
        .collect()
}

pub(crate) fn read_line(r: &mut impl BufRead) -> Result<String> {
    let mut l = String::new();
    if r.read_line(&mut l).map_err(io("read from the peer"))? == 0 {
        return Err(bad("the peer closed its output"));
    }
    Ok(l.trim().to_owned())
}

fn read_addresses(r: &mut impl BufRead, n: u32) -> Result<Vec<QpAddress>> {
    (0..n).map(|_| QpAddress::from_bytes(&unhex(&read_line(r)?)?).map_err(|e| bad(e.to_string()))).collect()
}

async fn connect_pipes(ends: Vec<(QueuePair, CompletionQueue)>) -> Result<Vec<Pipe>> {
    let mut set = tokio::task::JoinSet::new();
    for (i, (qp, cq)) in ends.into_iter().enumerate() {
        set.spawn(async move { (i, Pipe::connect(qp, cq, config()).await) });
    }
    let mut pipes: Vec<Option<Pipe>> = Vec::new();
    while let Some(r) = set.join_next().await {
        let (i, p) = r.map_err(|e| bad(e.to_string()))?;
        if pipes.len() <= i {
            pipes.resize(i + 1, None);
        }
        pipes[i] = Some(p.map_err(chan)?);
    }
    Ok(pipes.into_iter().flatten().collect())
}

/// Threads and resident KiB of a process.
type Usage = (u64, u64);

/// One row: (aggregate msgs/s, usage here, usage in the peer).
fn measure(n: u32, seconds: f64, idle: bool) -> Result<(f64, Usage, Usage)> {
    let exe = std::env::current_exe().map_err(io("current_exe"))?;
    let mut args = vec!["scaling-peer".to_owned(), "--sample-after".into(), format!("{}", seconds / 2.0)];
    if idle {
        args.push("--idle".into());
    }
    let mut child = Command::new(exe)
        .args(&args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(io("spawn the peer"))?;
    let result = (|| {
        let mut to = child.stdin.take().ok_or_else(|| bad("no stdin"))?;
        let mut from = BufReader::new(child.stdout.take().ok_or_else(|| bad("no stdout"))?);
        let ctx = Context::open_soft();
        let pd = ctx.alloc_pd()?;
        let ends = qps(&ctx, &pd, n)?;
        let mut msg = format!("{n}\n");
        for (qp, _) in &ends {
            msg += &hex(&qp.address()?.to_bytes());
            msg.push('\n');
        }
        to.write_all(msg.as_bytes()).map_err(io("write to the peer"))?;
        to.flush().map_err(io("write to the peer"))?;
        let theirs = read_addresses(&mut from, n)?;
        let opts = connect_options();
        // In steps, each side a chunk at a time: a device keeps at most 256 connections
        // whose Hello waits for its QP, and a QP's Hello waits until the other side connects.
        for (chunk, addrs) in ends.chunks(CHUNK).zip(theirs.chunks(CHUNK)) {
            for ((qp, _), a) in chunk.iter().zip(addrs) {
                qp.connect(a, &opts)?;
            }
            to.write_all(b"C\n").and_then(|_| to.flush()).map_err(io("write to the peer"))?;
            if read_line(&mut from)? != "K" {
                return Err(bad("the peer did not connect its QPs"));
            }
        }
        let src = pd.alloc_mr(n as usize * MSG as usize, AccessFlags::LOCAL_WRITE)?;
        let rt = runtime()?;
        let (pipes, _held) =
            if idle { (Vec::new(), Some(ends)) } else { (rt.block_on(connect_pipes(ends))?, None) };
        if read_line(&mut from)? != "READY" {
            return Err(bad("the peer did not get ready"));
        }
        // Go: the peer samples itself half way through.
        to.write_all(b"GO\n").and_then(|_| to.flush()).map_err(io("write to the peer"))?;
        let count = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let mut mine = (0, 0);
        let (sent, el) = rt.block_on(async {
            let mut set = tokio::task::JoinSet::new();
            for (i, p) in pipes.iter().enumerate() {
                let (p, count, stop) = (p.clone(), count.clone(), stop.clone());
                let s = src.slice(i as u64 * u64::from(MSG), MSG)?;
                set.spawn(async move {
                    let mut s = s;
                    while !stop.load(Ordering::Relaxed) {
                        let (r, back) = p.rwrite(s).await;
                        s = back;
                        if r.is_err() {
                            return r.map_err(chan);
                        }
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(())
                });
            }
            let t = Instant::now();
            tokio::time::sleep(Duration::from_secs_f64(seconds / 2.0)).await;
            mine = status("self");
            tokio::time::sleep(Duration::from_secs_f64(seconds / 2.0)).await;
            let n = count.load(Ordering::Relaxed);
            let el = t.elapsed();
            stop.store(true, Ordering::Relaxed);
            while let Some(r) = set.join_next().await {
                r.map_err(|e| bad(e.to_string()))??;
            }
            Ok::<_, Error>((n, el))
        })?;
        let line = read_line(&mut from)?;
        let mut it = line.split_whitespace();
        let theirs = match (it.next(), it.next(), it.next()) {
            (Some("STATS"), Some(t), Some(r)) => (t.parse().unwrap_or(0), r.parse().unwrap_or(0)),
            _ => return Err(bad(format!("unexpected peer line {line:?}"))),
        };
        drop(pipes);
        Ok((sent as f64 / el.as_secs_f64(), mine, theirs))
    })();
    if result.is_err() {
        // Say how the peer ended, if it did (its own error, if any, is on stderr above).
        std::thread::sleep(Duration::from_millis(200));
        if let Ok(Some(status)) = child.try_wait() {
            eprintln!("rdmakit-perf scaling: the peer process ended: {status}");
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// `rdmakit-perf scaling`.
pub fn main(a: &ScalingArgs) -> Result<()> {
    if a.pairs.is_empty() || a.pairs.contains(&0) {
        return Err(bad("--pairs: counts of at least 1"));
    }
    if !(a.seconds > 0.0 && a.seconds <= 3600.0) {
        return Err(bad("--seconds: more than 0, at most 3600"));
    }
    if !(1..=101).contains(&a.runs) {
        return Err(bad("--runs: 1 to 101"));
    }
    if a.idle {
        println!(
            "soft NIC across two processes: N connected QP pairs, idle (nothing sent); per pair: RSS growth from the first row"
        );
    } else {
        println!(
            "soft NIC across two processes: N pipe pairs, 8-byte rwrite on every pipe (one in flight each), {} s per run, {}",
            a.seconds,
            if a.runs == 1 {
                "1 run per row".to_owned()
            } else {
                format!("median of {} runs per row", a.runs)
            }
        );
    }
    println!(
        "{:>6} {:>12} {:>10} {:>12} {:>10} {:>12} {:>14} {:>20}",
        "pairs",
        "msgs/s",
        "threads",
        "RSS MiB",
        "peer thr",
        "peer RSS MiB",
        "KiB/pair",
        "runs' msgs/s min-max"
    );
    let mut first: Option<(u32, u64)> = None;
    for &n in &a.pairs {
        let mut runs = (0..a.runs).map(|_| measure(n, a.seconds, a.idle)).collect::<Result<Vec<_>>>()?;
        runs.sort_by(|x, y| x.0.total_cmp(&y.0));
        let spread = match (runs.first(), runs.last()) {
            (Some(lo), Some(hi)) if a.runs > 1 => format!("{:.0}-{:.0}", lo.0, hi.0),
            _ => "-".into(),
        };
        let (rate, (t, r), (pt, pr)) = runs[runs.len() / 2];
        // Both processes' growth over the first row's, per extra pair (a pair is one
        // connected QP in each process: a link and a served stream each).
        let per_pair = match first {
            Some((n0, r0)) if n > n0 => {
                format!("{:.1}", (r + pr).saturating_sub(r0) as f64 / 2.0 / f64::from(n - n0))
            }
            _ => "-".into(),
        };
        first.get_or_insert((n, r + pr));
        println!(
            "{n:>6} {rate:>12.0} {t:>10} {:>12.1} {pt:>10} {:>12.1} {per_pair:>14} {spread:>20}",
            r as f64 / 1024.0,
            pr as f64 / 1024.0
        );
    }
    Ok(())
}

/// The hidden peer: reads N and N endpoints on stdin, answers with its own, receives on
/// every pipe until the parent goes away.
pub fn peer(a: &PeerArgs) -> Result<()> {
    let stdin = std::io::stdin();
    let mut r = stdin.lock();
    let n: u32 = read_line(&mut r)?.parse().map_err(|_| bad("pair count"))?;
    if n == 0 || n > 1 << 16 {
        return Err(bad("pair count out of range"));
    }
    let theirs = read_addresses(&mut r, n)?;
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd()?;
    let ends = qps(&ctx, &pd, n)?;
    let opts = connect_options();
    let mut out = String::new();
    for (qp, _) in &ends {
        out += &hex(&qp.address()?.to_bytes());
        out.push('\n');
    }
    let mut stdout = std::io::stdout();
    stdout.write_all(out.as_bytes()).and_then(|_| stdout.flush()).map_err(io("write to the parent"))?;
    for (chunk, addrs) in ends.chunks(CHUNK).zip(theirs.chunks(CHUNK)) {
        if read_line(&mut r)? != "C" {
            return Err(bad("expected C"));
        }
        for ((qp, _), a) in chunk.iter().zip(addrs) {
            qp.connect(a, &opts)?;
        }
        stdout.write_all(b"K\n").and_then(|_| stdout.flush()).map_err(io("write to the parent"))?;
    }
    let rt = runtime()?;
    let (pipes, _held) =
        if a.idle { (Vec::new(), Some(ends)) } else { (rt.block_on(connect_pipes(ends))?, None) };
    stdout.write_all(b"READY\n").and_then(|_| stdout.flush()).map_err(io("write to the parent"))?;
    if read_line(&mut r)? != "GO" {
        return Err(bad("expected GO"));
    }
    let sample_after = Duration::from_secs_f64(a.sample_after.clamp(0.0, 3600.0));
    rt.block_on(async {
        for p in &pipes {
            let p = p.clone();
            tokio::spawn(async move {
                while let Ok(g) = p.recv().await {
                    g.release();
                }
            });
        }
        tokio::time::sleep(sample_after).await;
        let (t, rss) = status("self");
        let line = format!("STATS {t} {rss}\n");
        let _ = stdout.write_all(line.as_bytes()).and_then(|_| stdout.flush());
        // Receive until the parent kills this process.
        std::future::pending::<()>().await;
    });
    Ok(())
}
