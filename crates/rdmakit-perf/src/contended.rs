//! `fadd-contended`: N client processes hammer one shared 64-bit counter with
//! fetch-and-add, as the OpenSHMEM atomic benchmark of the MEMIC talk does.
//!
//! The coordinating process owns the counter (in host memory or device memory), listens,
//! and starts N copies of this binary as workers. Each worker connects (`rdmakit::cm`), gets
//! the counter's descriptor in the reply's private data, says `READY`, waits for `GO` on
//! stdin so that all start together, runs its fetch-adds one at a time, and prints its rate.
//! The coordinator prints the total and per-process rates, and checks that the counter
//! ended at exactly N × iterations.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdmakit_verbs::cm::{self, CmOptions};
use rdmakit_verbs::*;

use crate::rig::Placement;

/// What a worker reports.
#[derive(serde::Serialize, serde::Deserialize)]
struct WorkerResult {
    ops: u64,
    secs: f64,
}

/// The total and per-process rates of one run.
#[derive(serde::Serialize)]
pub struct Contended {
    pub procs: u32,
    pub iterations: u64,
    pub placement: Placement,
    pub provider: String,
    pub total_mops: f64,
    pub per_proc_min_mops: f64,
    pub per_proc_avg_mops: f64,
    pub per_proc_max_mops: f64,
    pub counter: u64,
}

fn options(connect: ConnectOptions) -> CmOptions {
    CmOptions::default().with_connect(connect).with_timeout(Duration::from_secs(30))
}

/// Coordinator: owns the counter and runs `procs` workers against it.
pub fn coordinate(
    ctx: &Context,
    listen: SocketAddr,
    procs: u32,
    iters: u64,
    placement: Placement,
    connect: ConnectOptions,
    worker_args: &[String],
) -> Result<Contended> {
    let pd = ctx.alloc_pd()?;
    let counter = match placement {
        Placement::Host => pd.alloc_mr(8, AccessFlags::ALL_REMOTE)?,
        Placement::Memic => pd.register_dm(&ctx.alloc_dm(64)?, 0, 8, AccessFlags::ALL_REMOTE)?,
    };
    counter.write_u64(0, 0)?;
    let listener = cm::Listener::bind(ctx, listen)?;
    let addr = listener.local_addr()?;
    let exe = std::env::current_exe().map_err(|source| Error::Os { call: "current_exe", source })?;
    let mut children: Vec<Child> = Vec::new();
    let kill_all = |children: &mut Vec<Child>| {
        for c in children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    };
    // Busy-polling workers are fastest until they outnumber the cores; then they would
    // starve each other (and the NIC's threads on the soft provider): sleep instead.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    let spin = procs < cores;
    let mut conns = Vec::new();
    for _ in 0..procs {
        let child = Command::new(&exe)
            .args(["fadd-contended", "--worker", &addr.to_string(), "--iters", &iters.to_string()])
            .args(if spin { &[][..] } else { &["--sleep"][..] })
            .args(worker_args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|source| Error::Os { call: "spawn worker", source })?;
        children.push(child);
        match listener.accept_timeout(
            &pd,
            &options(connect),
            &counter.remote().encode(),
            Some(Duration::from_secs(30)),
        ) {
            Ok(c) => conns.push(c),
            Err(e) => {
                kill_all(&mut children);
                return Err(e);
            }
        }
    }
    // Wait until every worker is connected and ready, then start them together.
    let mut outs = Vec::new();
    for c in children.iter_mut() {
        let mut out = BufReader::new(c.stdout.take().expect("piped"));
        let mut line = String::new();
        out.read_line(&mut line).map_err(|source| Error::Os { call: "read worker", source })?;
        if line.trim() != "READY" {
            kill_all(&mut children);
            return Err(Error::InvalidArgument(format!("worker said {line:?} instead of READY")));
        }
        outs.push(out);
    }
    for c in children.iter_mut() {
        let stdin = c.stdin.as_mut().expect("piped");
        writeln!(stdin, "GO").map_err(|source| Error::Os { call: "start worker", source })?;
    }
    let mut results = Vec::new();
    for (c, out) in children.iter_mut().zip(outs.iter_mut()) {
        let mut line = String::new();
        out.read_line(&mut line).map_err(|source| Error::Os { call: "read worker", source })?;
        let status = c.wait().map_err(|source| Error::Os { call: "wait worker", source })?;
        let r: WorkerResult = serde_json::from_str(line.trim()).map_err(|e| Error::Malformed {
            what: "worker result",
            reason: format!("{e} (worker exit {status}, said {line:?})"),
        })?;
        results.push(r);
    }
    drop(conns);
    let rates: Vec<f64> = results.iter().map(|r| r.ops as f64 / r.secs.max(1e-9) / 1e6).collect();
    let slowest = results.iter().map(|r| r.secs).fold(0.0, f64::max);
    let total_ops: u64 = results.iter().map(|r| r.ops).sum();
    Ok(Contended {
        procs,
        iterations: iters,
        placement,
        provider: ctx.provider().to_string(),
        total_mops: total_ops as f64 / slowest.max(1e-9) / 1e6,
        per_proc_min_mops: rates.iter().copied().fold(f64::INFINITY, f64::min),
        per_proc_avg_mops: rates.iter().sum::<f64>() / rates.len().max(1) as f64,
        per_proc_max_mops: rates.iter().copied().fold(0.0, f64::max),
        counter: counter.read_u64(0)?,
    })
}

/// Worker: connects, waits for `GO`, runs `iters` fetch-adds of 1, prints its result.
/// With `sleep`, it waits for each completion on the completion channel instead of
/// busy-polling.
pub fn work(ctx: &Context, addr: SocketAddr, iters: u64, connect: ConnectOptions, sleep: bool) -> Result<()> {
    let pd = ctx.alloc_pd()?;
    let conn = cm::connect(&pd, addr, &options(connect), &[])?;
    let d = conn.peer_private_data();
    let desc = d.get(..RemoteRegion::ENCODED_LEN).ok_or_else(|| Error::Malformed {
        what: "the coordinator's counter descriptor",
        reason: format!("{} bytes", d.len()),
    })?;
    let target = RemoteRegion::decode(desc)?.slice(0, 8)?;
    let result = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    let local = result.local()?;
    let mut out = std::io::stdout();
    writeln!(out, "READY")
        .and_then(|()| out.flush())
        .map_err(|source| Error::Os { call: "write", source })?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).map_err(|source| Error::Os { call: "read", source })?;
    let start = Instant::now();
    for _ in 0..iters {
        conn.qp().post_send(SendWr::fetch_add(local.clone(), target, 1))?;
        let wc = if sleep {
            conn.cq().wait(Some(Duration::from_secs(30)))?
        } else {
            conn.cq().spin(Duration::from_secs(30))?
        };
        wc.ok()?;
    }
    let secs = start.elapsed().as_secs_f64();
    let r = serde_json::to_string(&WorkerResult { ops: iters, secs }).expect("serialisable");
    writeln!(out, "{r}").map_err(|source| Error::Os { call: "write", source })?;
    Ok(())
}
