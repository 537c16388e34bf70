//! `rdmakit-perf`: perftest-style benchmarks for rdmakit.
//!
//! With no arguments it runs a short suite on the soft NIC in loopback and prints one
//! table. Each subcommand runs one test, in loopback (both sides in this process), as a
//! server (`--server ADDR`) or as a client (`--connect ADDR`), on the soft NIC or on a
//! verbs device (`--provider`, `--device`, `--gid-index`). Output uses perftest's column
//! layouts so the figures can be pasted beside `ib_write_bw`/`ib_write_lat`'s, or JSON
//! lines with `--json`.

mod channel;
mod contended;
mod limits;
mod measure;
mod report;
mod rig;
mod transfer;

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use rdmakit_verbs::*;

use crate::rig::{Params, Placement, Test};

#[derive(Parser, Debug)]
#[command(
    name = "rdmakit-perf",
    version,
    about = "perftest-style RDMA benchmarks on rdmakit (soft NIC or rdma-core)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// RDMA write bandwidth (window of outstanding writes).
    WriteBw(Opts),
    /// RDMA write latency (ping-pong; half the round trip).
    WriteLat(Opts),
    /// RDMA read bandwidth.
    ReadBw(Opts),
    /// RDMA read latency (full round trip).
    ReadLat(Opts),
    /// Send bandwidth into posted receives.
    SendBw(Opts),
    /// Fetch-and-add latency (full round trip).
    AtomicLat(Opts),
    /// Fetch-and-add message rate (window of outstanding atomics).
    AtomicBw(Opts),
    /// Pipe rwrite ping-pong (rdmakit-channel); half the round trip.
    PipeLat(Opts),
    /// Pipe rwrite bandwidth (window of writes in flight, the reader releasing).
    PipeBw(Opts),
    /// Persistent put-handle ping-pong; half the round trip (loopback only).
    PutLat(Opts),
    /// N processes hammer one shared counter with fetch-and-add (total and per-process
    /// rates, and a check of the final count).
    FaddContended(Contention),
    /// The soft NIC against this machine's limits: memcpy in-process, a raw TCP stream
    /// across processes (ratios, goals 0.5x and 0.8x).
    Limits {
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
        /// Runs per figure; the median is reported.
        #[arg(long, default_value_t = 3)]
        runs: u32,
    },
    /// Bulk transfer through a ring of chunk slots (RDMA write, consumed flags checked by
    /// RDMA read, CRC-32 end to end), with live gauges.
    Transfer(transfer::TransferArgs),
    /// A TCP data generator to feed `transfer --input tcp://HOST:PORT`.
    Datagen(transfer::DatagenArgs),
    /// The default suite on the soft NIC in loopback (what no arguments runs).
    Suite {
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// The mode: loopback (neither), or one side of a two-process run.
#[derive(Args, Debug, Clone)]
struct PeerOpts {
    /// Serve one peer at this address (IP:port): the server, or the transfer's receiver.
    #[arg(long, conflicts_with = "connect")]
    server: Option<SocketAddr>,
    /// Connect to a peer serving at this address (IP:port): the client, or the sender.
    #[arg(long)]
    connect: Option<SocketAddr>,
}

/// Which device to measure.
#[derive(Args, Debug, Clone)]
struct DeviceOpts {
    /// `soft`, `verbs` or `auto`.
    #[arg(long, default_value = "soft")]
    provider: String,
    /// Device name (e.g. `mlx5_0`, `rxe0`).
    #[arg(long)]
    device: Option<String>,
    /// RoCE GID index.
    #[arg(long)]
    gid_index: Option<u8>,
}

impl DeviceOpts {
    fn open(&self) -> Result<Context> {
        match self.provider.as_str() {
            "soft" => match &self.device {
                Some(d) => Context::open(d),
                None => Ok(Context::open_soft()),
            },
            "verbs" => Context::open_verbs(self.device.as_deref()),
            "auto" => Context::open_default(),
            other => Err(Error::InvalidArgument(format!("--provider {other}: expected soft, verbs or auto"))),
        }
    }

    fn connect_options(&self) -> ConnectOptions {
        ConnectOptions { gid_index: self.gid_index, ..ConnectOptions::default() }
    }
}

#[derive(Args, Debug, Clone)]
struct Opts {
    /// Message size in bytes.
    #[arg(short, long, default_value_t = 65536)]
    size: u32,
    /// Iterations.
    #[arg(short = 'n', long, default_value_t = 5000)]
    iters: u32,
    /// Outstanding operations (bandwidth tests).
    #[arg(short, long, default_value_t = 16)]
    window: u32,
    /// Bandwidth tests sleep on the completion channel instead of busy-polling, as
    /// perftest's `--use_event` (leaves the CPU to a software NIC on small machines).
    #[arg(short = 'e', long)]
    use_event: bool,
    /// Where the atomic target lives (on the server in client/server mode).
    #[arg(long, value_enum, default_value_t = Placement::Host)]
    placement: Placement,
    #[command(flatten)]
    dev: DeviceOpts,
    #[command(flatten)]
    peer: PeerOpts,
    /// Print one JSON object per result.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug, Clone)]
struct Contention {
    /// Numbers of worker processes, one run each (e.g. `1,2,4,8`).
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 2, 4, 8])]
    procs: Vec<u32>,
    /// Fetch-and-adds per process.
    #[arg(short = 'n', long, default_value_t = 20_000)]
    iters: u64,
    /// Where the counter lives.
    #[arg(long, value_enum, default_value_t = Placement::Host)]
    placement: Placement,
    #[command(flatten)]
    dev: DeviceOpts,
    /// Address the coordinator listens on (an address of the device on verbs).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Internal: run as one worker connecting to this address.
    #[arg(long, hide = true)]
    worker: Option<SocketAddr>,
    /// Internal: the worker sleeps on the completion channel instead of spinning.
    #[arg(long, hide = true)]
    sleep: bool,
    /// Print one JSON object per run.
    #[arg(long)]
    json: bool,
}

fn fadd_contended(c: &Contention) -> Result<()> {
    let ctx = c.dev.open()?;
    let copts = c.dev.connect_options();
    if let Some(addr) = c.worker {
        return contended::work(&ctx, addr, c.iters, copts, c.sleep);
    }
    let mut forward = vec!["--provider".to_owned(), c.dev.provider.clone()];
    if let Some(d) = &c.dev.device {
        forward.extend(["--device".to_owned(), d.clone()]);
    }
    if let Some(g) = c.dev.gid_index {
        forward.extend(["--gid-index".to_owned(), g.to_string()]);
    }
    if !c.json {
        println!(
            "fadd-contended on {} ({}), counter in {:?} memory, {} fetch-adds per process",
            ctx.name(),
            ctx.provider(),
            c.placement,
            c.iters
        );
        println!(
            " {:>6} {:>14} {:>16} {:>16} {:>16} {:>12}",
            "#procs", "total[Mops/s]", "per-proc min", "per-proc avg", "per-proc max", "counter"
        );
    }
    for &n in &c.procs {
        if n == 0 {
            return Err(Error::InvalidArgument("--procs must be at least 1".into()));
        }
        let r = contended::coordinate(&ctx, c.listen, n, c.iters, c.placement, copts, &forward)?;
        if r.counter != u64::from(n) * c.iters {
            return Err(Error::InvalidArgument(format!(
                "the counter ended at {}, expected {} x {} = {}: fetch-adds were lost",
                r.counter,
                n,
                c.iters,
                u64::from(n) * c.iters
            )));
        }
        if c.json {
            println!("{}", serde_json::to_string(&r).expect("serialisable"));
        } else {
            println!(
                " {:>6} {:>14.4} {:>16.4} {:>16.4} {:>16.4} {:>12}",
                r.procs,
                r.total_mops,
                r.per_proc_min_mops,
                r.per_proc_avg_mops,
                r.per_proc_max_mops,
                r.counter
            );
        }
    }
    Ok(())
}

fn progress(iters: u32) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(u64::from(iters));
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} {per_sec}").expect("template"));
    bar
}

fn validate(test: Test, o: &Opts) -> Result<Params> {
    if o.size == 0 || o.size > rig::MAX_SIZE {
        return Err(Error::InvalidArgument(format!("--size must be 1..={}", rig::MAX_SIZE)));
    }
    if o.iters == 0 {
        return Err(Error::InvalidArgument("--iters must be at least 1".into()));
    }
    let size = if matches!(test, Test::AtomicLat | Test::AtomicBw) { 8 } else { o.size };
    Ok(Params { test, size, iters: o.iters, window: o.window.clamp(1, 64), placement: o.placement })
}

fn one(test: Test, o: &Opts) -> Result<()> {
    let ctx = o.dev.open()?;
    let copts = o.dev.connect_options();
    let out = report::Out::new(o.json);
    if let Some(addr) = o.peer.server {
        let listener = cm::Listener::bind(&ctx, addr)?;
        eprintln!("rdmakit-perf: serving on {} ({} {})", listener.local_addr()?, ctx.provider(), ctx.name());
        let (p, side) = rig::server(&ctx, &listener, &copts, o.placement)?;
        eprintln!("rdmakit-perf: client asked for {} of {} bytes x {}", p.test.name(), p.size, p.iters);
        if p.test.is_channel() {
            channel::serve(&side, &p)?;
        } else {
            measure::serve(&side, &p)?;
        }
        // One-sided tests need nothing from us: wait for the client to finish.
        if let Some(c) = &side.conn {
            c.wait_disconnected(std::time::Duration::from_secs(3600))?;
        }
        return Ok(());
    }
    let p = validate(test, o)?;
    let bar = progress(p.iters);
    let wait = if o.use_event { measure::CqWait::Event } else { measure::CqWait::Poll };
    if p.test == Test::PutLat && o.peer.connect.is_some() {
        return Err(Error::InvalidArgument("put-lat runs in loopback only".into()));
    }
    let client = |side: &rig::Side| {
        if p.test.is_channel() {
            channel::run(side, &p, &bar)
        } else {
            measure::run_with(side, &p, &bar, wait)
        }
    };
    let m = if let Some(addr) = o.peer.connect {
        let side = rig::client(&ctx, addr, &p, &copts)?;
        client(&side)?
    } else if p.test == Test::PutLat {
        let (a, b) = rig::loopback(&ctx, &p, &copts)?;
        channel::put_lat(&a, &b, &p, &bar)?
    } else {
        let (a, b) = rig::loopback(&ctx, &p, &copts)?;
        std::thread::scope(|s| {
            let server =
                s.spawn(|| if p.test.is_channel() { channel::serve(&b, &p) } else { measure::serve(&b, &p) });
            let m = client(&a);
            let served = server.join().map_err(|_| Error::InvalidArgument("server side panicked".into()))?;
            served.and(m)
        })?
    };
    bar.finish_and_clear();
    out.header(p.test);
    out.row(&ctx, &p, &m);
    Ok(())
}

fn limits(json: bool, runs: u32) -> Result<()> {
    let rows = limits::run(runs)?;
    if !json {
        println!("the soft NIC against this machine's limits (MB/s = 2^20 bytes/s, median of {runs} runs)");
        println!(
            " {:<44} {:>9} {:>12} {:>12} {:>7}  goal",
            "comparison", "#bytes", "rdmakit", "limit", "ratio"
        );
    }
    for r in &rows {
        if json {
            println!("{}", serde_json::to_string(r).expect("serialisable"));
        } else {
            let met = if r.ratio >= r.goal { "met" } else { "missed" };
            println!(
                " {:<44} {:>9} {:>12.1} {:>12.1} {:>7.3}  {met} (>= {})",
                r.what, r.bytes, r.rdmakit_mb_per_sec, r.limit_mb_per_sec, r.ratio, r.goal
            );
        }
    }
    Ok(())
}

/// The default suite: small and short, on the soft NIC in loopback.
fn suite(json: bool) -> Result<()> {
    let ctx = Context::open_soft();
    let out = report::Out::new(json);
    let plan: [(Test, u32, u32, Placement); 12] = [
        (Test::WriteLat, 8, 20_000, Placement::Host),
        (Test::PipeLat, 8, 20_000, Placement::Host),
        (Test::PutLat, 8, 20_000, Placement::Host),
        (Test::ReadLat, 8, 20_000, Placement::Host),
        (Test::AtomicLat, 8, 20_000, Placement::Host),
        (Test::AtomicLat, 8, 20_000, Placement::Memic),
        (Test::WriteBw, 65536, 20_000, Placement::Host),
        (Test::WriteBw, 1 << 20, 2_000, Placement::Host),
        (Test::ReadBw, 65536, 20_000, Placement::Host),
        (Test::SendBw, 4096, 50_000, Placement::Host),
        (Test::AtomicBw, 8, 200_000, Placement::Host),
        (Test::PipeBw, 1 << 20, 2_000, Placement::Host),
    ];
    if !json {
        println!(
            "rdmakit-perf suite on {} ({} provider, loopback in one process)",
            ctx.name(),
            ctx.provider()
        );
    }
    out.suite_header();
    for (test, size, iters, placement) in plan {
        let p = Params { test, size, iters, window: 16, placement };
        let (a, b) = rig::loopback(&ctx, &p, &ConnectOptions::default())?;
        let bar = ProgressBar::hidden();
        let m = if test == Test::PutLat {
            channel::put_lat(&a, &b, &p, &bar)?
        } else {
            std::thread::scope(|s| {
                let server =
                    s.spawn(
                        || if test.is_channel() { channel::serve(&b, &p) } else { measure::serve(&b, &p) },
                    );
                let m =
                    if test.is_channel() { channel::run(&a, &p, &bar) } else { measure::run(&a, &p, &bar) };
                server.join().map_err(|_| Error::InvalidArgument("server side panicked".into()))?.and(m)
            })?
        };
        out.suite_row(&ctx, &p, &m);
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match &cli.cmd {
        None => suite(false),
        Some(Cmd::Suite { json }) => suite(*json),
        Some(Cmd::WriteBw(o)) => one(Test::WriteBw, o),
        Some(Cmd::WriteLat(o)) => one(Test::WriteLat, o),
        Some(Cmd::ReadBw(o)) => one(Test::ReadBw, o),
        Some(Cmd::ReadLat(o)) => one(Test::ReadLat, o),
        Some(Cmd::SendBw(o)) => one(Test::SendBw, o),
        Some(Cmd::AtomicLat(o)) => one(Test::AtomicLat, o),
        Some(Cmd::AtomicBw(o)) => one(Test::AtomicBw, o),
        Some(Cmd::PipeLat(o)) => one(Test::PipeLat, o),
        Some(Cmd::PipeBw(o)) => one(Test::PipeBw, o),
        Some(Cmd::PutLat(o)) => one(Test::PutLat, o),
        Some(Cmd::FaddContended(c)) => fadd_contended(c),
        Some(Cmd::Limits { json, runs }) => limits(*json, *runs),
        Some(Cmd::Transfer(t)) => return transfer::main(t),
        Some(Cmd::Datagen(d)) => return transfer::datagen_main(d),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rdmakit-perf: {e}");
            ExitCode::FAILURE
        }
    }
}
