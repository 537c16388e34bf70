//! `rdmakit-perf`: perftest-style benchmarks for rdmakit.
//!
//! With no arguments it runs a short suite on the soft NIC in loopback and prints one
//! table (`--provider`, `--device`, `--gid-index` pick another device). The perftest-style
//! subcommands (`write-bw`, `write-lat`, `read-bw`, `read-lat`, `send-bw`, `send-lat`,
//! `atomic-bw`, `atomic-lat`, and the channel crate's `pipe-lat`, `pipe-bw`, `put-lat`) run
//! one test in loopback (both sides in this process), as a server (`--server ADDR`) or as a client
//! (`--connect ADDR`), on the soft NIC or on a verbs device, and take perftest's flags
//! (`-s -a -n -D -f -t -r -I -q -b -e -F --report_gbits --output`; README "perftest flags").
//! `fadd-contended` and `limits` run on one machine only. Output uses perftest's
//! column layouts so the figures can be pasted beside `ib_write_bw`/`ib_write_lat`'s, or
//! JSON lines with `--json`.

mod bystander;
mod channel;
mod contended;
mod limits;
mod measure;
mod plot;
mod put_lat;
mod report;
mod rig;
mod scaling;
mod seeds;
mod seeds_ckdirect;
mod seeds_rpipe;
mod transfer;

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use rdmakit_verbs::*;

use crate::measure::{Bw, Measured};
use crate::report::Level;
use crate::rig::{Params, Placement, Test};

#[derive(Parser, Debug)]
#[command(
    name = "rdmakit-perf",
    version,
    about = "perftest-style RDMA benchmarks on rdmakit (soft NIC or rdma-core)",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    /// The suite's options, when no subcommand is given.
    #[command(flatten)]
    suite: SuiteArgs,
}

/// The default suite's options.
#[derive(Args, Debug, Clone)]
struct SuiteArgs {
    /// Print JSON lines instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    dev: DeviceOpts,
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
    /// Send/receive ping-pong (as `ib_send_lat`); half the round trip.
    SendLat(Opts),
    /// Fetch-and-add latency (full round trip).
    AtomicLat(Opts),
    /// Fetch-and-add message rate (window of outstanding atomics).
    AtomicBw(Opts),
    /// Pipe rwrite ping-pong (rdmakit-channel); half the round trip.
    PipeLat(Opts),
    /// Pipe rwrite bandwidth (window of writes in flight, the reader releasing).
    PipeBw(Opts),
    /// Persistent put-handle ping-pong; half the round trip (`send-lat` at the same `-s`
    /// is its baseline).
    PutLat(Opts),
    /// N processes hammer one shared counter with fetch-and-add (total and per-process
    /// rates, and a check of the final count).
    FaddContended(Contention),
    /// The soft NIC against this machine's limits: memcpy in-process, a raw TCP stream
    /// across processes (ratios, goals 0.5x and 0.8x), 8-byte write latency across
    /// processes, and a pipe's rwrite against a raw write side by side (goal 1.2x).
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
    /// Draw a size sweep (CSV `series,kind,size,value`, as `scripts/perftest-compare.sh`
    /// writes it) as an SVG: bandwidth and latency against message size, series side by side.
    Plot(plot::PlotArgs),
    /// The UCX MEMIC talk's table: fetch-and-add and posted atomic add, windows 1 and 16,
    /// the target in host memory and in device memory, beside the talk's figures.
    MemicAtomics {
        #[command(flatten)]
        dev: DeviceOpts,
        /// Operations per cell.
        #[arg(short = 'n', long, default_value_t = 100_000)]
        iters: u64,
    },
    /// The cross-GVMI UMR mkey pool talk's table: each step of exporting a host buffer to a
    /// DPU with a key per export, beside the pool's export, over 16 KiB to 1 GiB.
    XgvmiExport {
        #[command(flatten)]
        dev: DeviceOpts,
        /// The largest buffer (16 KiB, 1 MiB, 64 MiB and 1 GiB are measured up to it).
        #[arg(long, default_value_t = 64 << 20)]
        max_size: u64,
        /// Runs per figure; the median is reported.
        #[arg(long, default_value_t = 5)]
        runs: usize,
    },
    /// The rmalloc()/rpipe() paper's tables through pipes: rwrite latency with write with
    /// immediate (PUT_W_SYNC) beside data + flag (2PUT), rread latency, and rwrite latency per
    /// allocation policy of the pipe's heap, over a size sweep, beside the paper's figures.
    RpipeSeed(seeds_rpipe::RpipeArgs),
    /// The CkDirect slides' tables: put-handle vs send/recv ping-pong improvement in % over a
    /// size sweep, and a Jacobi halo exchange timed with put handles vs send/recv.
    CkdirectSeed(seeds_ckdirect::CkArgs),
    /// The default suite in loopback (what no arguments runs): the soft NIC unless
    /// `--provider`/`--device` say otherwise.
    Suite(SuiteArgs),
    /// The soft NIC across two processes against the number of connections: message rate,
    /// threads and memory per process for N pipe pairs.
    Scaling(scaling::ScalingArgs),
    /// The peer process of `scaling` (spawned by it).
    #[command(hide = true)]
    ScalingPeer(scaling::PeerArgs),
    /// The soft NIC across three processes: one peer's 8-byte write latency to a process,
    /// alone and while another peer keeps large reads from that process outstanding.
    Bystander(bystander::BystanderArgs),
    /// A child process of `bystander` (spawned by it).
    #[command(hide = true)]
    BystanderPeer(bystander::PeerArgs),
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
            // Never a silent fall-back to the soft NIC: software figures must not pass for
            // the hardware's.
            "verbs" => Context::open_verbs(self.device.as_deref()).map_err(|e| {
                Error::InvalidArgument(format!(
                    "--provider verbs: cannot open {}: {e}; rdmakit-perf does not fall back to \
                     the soft NIC (use --provider soft for it); on an RDMA host, check that \
                     `ibv_devices` lists the NIC and that rdma-core's provider for it is installed",
                    self.device.as_deref().unwrap_or("an RDMA device")
                ))
            }),
            "auto" => Context::open_default(),
            other => Err(Error::InvalidArgument(format!("--provider {other}: expected soft, verbs or auto"))),
        }
    }

    fn connect_options(&self) -> ConnectOptions {
        ConnectOptions::default().with_gid_index(self.gid_index)
    }
}

/// The perftest-style tests' options: perftest's flags, meanings and defaults.
#[derive(Args, Debug, Clone)]
struct Opts {
    /// Message size in bytes (perftest's default: 2 for latency tests, 65536 for bandwidth
    /// tests; atomics are always 8).
    #[arg(short, long)]
    size: Option<u32>,
    /// Run every size from 2 to 2^23 bytes (powers of two), one row each.
    #[arg(short = 'a', long = "all", conflicts_with = "size")]
    all: bool,
    /// Iterations, per QP and size (default 1000 for latency tests, 5000 for bandwidth
    /// tests; at least 5).
    #[arg(short = 'n', long)]
    iters: Option<u32>,
    /// Run for this many seconds instead of a number of iterations; the first and last
    /// `--margin` seconds are not measured.
    #[arg(short = 'D', long, conflicts_with_all = ["iters", "all"])]
    duration: Option<u16>,
    /// Seconds left out at each end of a `--duration` run.
    #[arg(short = 'f', long, default_value_t = 2, requires = "duration")]
    margin: u16,
    /// Send queue depth: operations a bandwidth test keeps outstanding (default 128, at
    /// most the iterations). `--window` is the old name.
    #[arg(short = 't', long = "tx-depth", visible_alias = "window")]
    tx_depth: Option<u32>,
    /// Receive queue depth: receives the receiver of a send test keeps posted.
    #[arg(short = 'r', long = "rx-depth", default_value_t = 512)]
    rx_depth: u32,
    /// Largest message sent inline (default 220 for write-lat, 236 for send-lat, 0 for the
    /// others; reads and atomics never go inline).
    #[arg(short = 'I', long = "inline_size", visible_alias = "inline-size")]
    inline: Option<u32>,
    /// Bandwidth tests ask for a completion every this many operations (perftest's `-Q`).
    /// Default as perftest's: 100, or every operation for messages over 8 KiB in a polling
    /// run of one size; at most `--tx-depth`.
    #[arg(short = 'Q', long = "cq-mod", value_parser = clap::value_parser!(u32).range(1..=65535))]
    cq_mod: Option<u32>,
    /// put-lat: the handles detect a put by CkDirect's sentinel (the buffer's last 8 bytes
    /// change from an out-of-band value): one RDMA write per put, against three with the
    /// default sequence word. Sizes that are multiples of 8.
    #[arg(long)]
    sentinel: bool,
    /// Queue pairs run at once (bandwidth tests); each does `--iters`.
    #[arg(short = 'q', long = "qp", default_value_t = 1)]
    qps: u32,
    /// Both sides run the test at once; the figures are the two directions' sum.
    #[arg(short = 'b', long)]
    bidirectional: bool,
    /// Report bandwidth in Gb/sec (10^9 bits) instead of MiB/sec (2^20 bytes).
    #[arg(long = "report_gbits", visible_alias = "report-gbits")]
    report_gbits: bool,
    /// Print only this figure, one line per result: bandwidth or message_rate (bandwidth
    /// tests), latency (the average; latency tests).
    #[arg(long, value_enum)]
    output: Option<Level>,
    /// Accepted for perftest compatibility: rdmakit-perf never fails on CPU frequency.
    #[arg(short = 'F', long = "CPU-freq")]
    cpu_freq: bool,
    /// Bandwidth tests sleep on the completion channel instead of busy-polling, as
    /// perftest's `-e` (leaves the CPU to a software NIC on small machines).
    #[arg(short = 'e', long = "events", visible_alias = "use-event")]
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

fn progress(iters: u64, timed: bool) -> ProgressBar {
    if timed || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(iters);
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} {per_sec}").expect("template"));
    bar
}

fn bad(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

/// perftest's rules and defaults, turned into the run's parameters.
fn validate(test: Test, o: &Opts) -> Result<Params> {
    let bw = !test.is_latency();
    let raw_bw = matches!(test, Test::WriteBw | Test::ReadBw | Test::SendBw | Test::AtomicBw);
    if test.is_atomic() && (o.all || o.size.is_some_and(|s| s != 8)) {
        return Err(bad("atomic tests move 8 bytes: no --size or --all (as perftest)"));
    }
    let size = match (o.size, test.is_atomic()) {
        (_, true) => 8,
        (Some(s), _) => s,
        (None, _) if o.all => rig::MAX_SIZE,
        (None, _) if bw => 65536,
        // A put handle's buffer ends with an 8-byte word (CkDirect's sentinel).
        (None, _) if test == Test::PutLat => 8,
        (None, _) => 2,
    };
    if size == 0 || size > rig::MAX_SIZE {
        return Err(bad(format!("--size must be 1..={}", rig::MAX_SIZE)));
    }
    if o.sentinel && (test != Test::PutLat || o.all || !size.is_multiple_of(8)) {
        return Err(bad(
            "--sentinel is for put-lat at one size that is a multiple of 8 (the sentinel is the last word)",
        ));
    }
    if test == Test::PutLat && size < 8 {
        return Err(bad("put-lat moves at least 8 bytes: a put handle's buffer ends with an 8-byte word"));
    }
    let iters = o.iters.unwrap_or(if bw { 5000 } else { 1000 });
    if iters < 5 {
        return Err(bad("--iters must be at least 5 (as perftest)"));
    }
    if test.is_latency() && iters > rig::MAX_LAT_ITERS {
        return Err(bad(format!(
            "-n {iters}: a latency test keeps a time stamp per iteration; at most {}",
            rig::MAX_LAT_ITERS
        )));
    }
    let duration = o.duration.unwrap_or(0);
    if o.duration.is_some() {
        if duration <= 2 * o.margin {
            return Err(bad(format!(
                "--duration {duration} must be more than 2 x --margin ({}): the margins are not measured",
                o.margin
            )));
        }
        if o.use_event {
            return Err(bad("--duration does not work with --events (as perftest)"));
        }
    }
    if test.is_channel() && (o.all || o.duration.is_some() || o.bidirectional || o.qps != 1) {
        return Err(bad(format!(
            "{}: -a, -D, -b and -q are for the verbs tests (write/read/send/atomic); the channel tests take -s, -n, -t",
            test.name()
        )));
    }
    if !raw_bw && (o.bidirectional || o.qps != 1) {
        return Err(bad(format!("{}: -b and -q are for bandwidth tests (as perftest)", test.name())));
    }
    if o.qps == 0 || o.qps > rig::MAX_QPS {
        return Err(bad(format!("--qp must be 1..={}", rig::MAX_QPS)));
    }
    match (o.output, bw) {
        (Some(Level::Latency), true) => {
            return Err(bad("--output for a bandwidth test is bandwidth or message_rate"));
        }
        (Some(Level::Bandwidth | Level::MessageRate), false) => {
            return Err(bad("--output for a latency test is latency"));
        }
        _ => {}
    }
    // perftest: tx depth 128 for bandwidth tests, never more than the iterations.
    let window = match o.tx_depth {
        Some(0) => return Err(bad("--tx-depth must be at least 1")),
        Some(t) => t,
        None if bw && duration == 0 => 128.min(iters),
        None if bw => 128,
        None => 1,
    };
    if window > rig::MAX_DEPTH || o.rx_depth == 0 || o.rx_depth > rig::MAX_DEPTH {
        return Err(bad(format!("--tx-depth and --rx-depth must be 1..={}", rig::MAX_DEPTH)));
    }
    let inline = o.inline.unwrap_or(match test {
        Test::WriteLat => 220,
        Test::SendLat => 236,
        _ => 0,
    });
    let p = Params {
        test,
        size,
        iters,
        window,
        rx_depth: o.rx_depth,
        inline,
        qps: o.qps,
        bidir: o.bidirectional,
        all: o.all,
        in_sweep: false,
        duration,
        margin: if duration > 0 { o.margin } else { 0 },
        cq_mod: o.cq_mod.unwrap_or(0),
        sentinel: o.sentinel,
        placement: o.placement,
    };
    // The rules a server applies to what it receives (the checks above say them in the
    // CLI's terms first).
    match p.combination_error() {
        Some(e) => Err(bad(e)),
        None => Ok(p),
    }
}

fn join<T>(h: std::thread::ScopedJoinHandle<'_, Result<T>>) -> Result<T> {
    h.join().map_err(|_| bad("a measuring thread panicked"))?
}

/// Longest wait for a client's next QP once its first is connected.
const NEXT_QP_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The server of one test: accepts the client's QPs (as many as it asks for) and serves
/// every size of its run.
fn serve_one(ctx: &Context, o: &Opts, addr: SocketAddr, copts: &ConnectOptions) -> Result<()> {
    if o.placement == Placement::Memic && ctx.attr().max_dm_size == 0 {
        return Err(bad(format!("--placement memic: {} has no device memory", ctx.name())));
    }
    let listener = cm::Listener::bind(ctx, addr)?;
    eprintln!("rdmakit-perf: serving on {} ({} {})", listener.local_addr()?, ctx.provider(), ctx.name());
    let (p, first) = rig::first_client("server", || rig::server(ctx, &listener, copts, o.placement, None))?;
    eprintln!(
        "rdmakit-perf: client asked for {} of {} bytes x {}{} on {} QP(s){}",
        p.test.name(),
        p.size,
        p.iters,
        if p.all { " (all sizes)" } else { "" },
        p.qps,
        if p.bidir { ", bidirectional" } else { "" }
    );
    let mut sides = vec![first];
    while sides.len() < p.qps as usize {
        // A client connects its QPs one after another: one that stops short leaves.
        let (q, side) = rig::server(ctx, &listener, copts, o.placement, Some(NEXT_QP_WAIT)).map_err(|e| {
            bad(format!("the client asked for {} QPs and connected {}: {e}", p.qps, sides.len()))
        })?;
        // Every QP runs the first one's parameters: the others must ask for the same (each
        // was checked against its own, such as a bidirectional run's buffer size).
        if q.encode() != p.encode() {
            return Err(Error::Malformed {
                what: "test parameters",
                reason: format!(
                    "QP {} asked for other parameters than QP 1 ({} on {} QPs)",
                    sides.len() + 1,
                    q.test.name(),
                    q.qps
                ),
            });
        }
        sides.push(side);
    }
    std::thread::scope(|s| {
        let hs: Vec<_> = sides
            .iter()
            .map(|side| {
                s.spawn(move || {
                    if p.test == Test::PutLat {
                        put_lat::serve(side, &p)
                    } else if p.test.is_channel() {
                        channel::serve(side, &p)
                    } else {
                        measure::serve(side, &p)
                    }
                })
            })
            .collect();
        hs.into_iter().try_for_each(join)
    })?;
    // One-sided tests need nothing from us: wait for the client to finish, an hour at most
    // for all its QPs together (not an hour each: 64 QPs of an idle client held the server
    // for 64 hours).
    let until = std::time::Instant::now() + std::time::Duration::from_secs(3600);
    for side in &sides {
        if let Some(c) = &side.conn {
            let left = until.saturating_duration_since(std::time::Instant::now());
            c.wait_disconnected(left.max(std::time::Duration::from_millis(1)))?;
        }
    }
    Ok(())
}

fn one(test: Test, o: &Opts) -> Result<()> {
    let ctx = o.dev.open()?;
    let copts = o.dev.connect_options();
    let out = report::Out::with(o.json, o.report_gbits, o.output);
    if let Some(addr) = o.peer.server {
        return serve_one(&ctx, o, addr, &copts);
    }
    let p = validate(test, o)?;
    let wait = if o.use_event { measure::CqWait::Event } else { measure::CqWait::Poll };
    if !o.json
        && o.output.is_none()
        && !p.test.is_latency()
        && p.duration == 0
        && p.iters > measure::PEAK_MAX_ITERS
    {
        eprintln!(
            " WARNING: BW peak won't be measured in this run (more than 20000 iterations, as perftest)."
        );
    }
    // The client sides (and, in loopback, their peers, served by threads of this process).
    let mut clients = Vec::new();
    let mut peers = Vec::new();
    for _ in 0..p.qps {
        if let Some(addr) = o.peer.connect {
            clients.push(rig::client(&ctx, addr, &p, &copts)?);
        } else {
            let (a, b) = rig::loopback(&ctx, &p, &copts)?;
            clients.push(a);
            peers.push(b);
        }
    }
    out.header(p.test, p.duration > 0);
    std::thread::scope(|s| -> Result<()> {
        let servers: Vec<_> =
            if p.test == Test::PutLat {
                Vec::new()
            } else {
                peers
                    .iter()
                    .map(|b| {
                        s.spawn(move || {
                            if p.test.is_channel() { channel::serve(b, &p) } else { measure::serve(b, &p) }
                        })
                    })
                    .collect()
            };
        let measured = (|| -> Result<()> {
            for size in p.sizes() {
                let p = p.at(size);
                let bar = progress(u64::from(p.iters) * u64::from(p.qps), p.duration > 0);
                let m = if p.test == Test::PutLat {
                    put_lat::run(&clients[0], peers.first(), &p, &bar)?
                } else if p.test.is_channel() {
                    channel::run(&clients[0], &p, &bar)?
                } else if p.qps == 1 {
                    measure::run_with(&clients[0], &p, &bar, wait)?
                } else {
                    let bws = std::thread::scope(|s| {
                        let hs: Vec<_> = clients
                            .iter()
                            .map(|c| s.spawn(|| measure::run_with(c, &p, &bar, wait)))
                            .collect();
                        hs.into_iter().map(join).collect::<Result<Vec<_>>>()
                    })?;
                    let mut total: Option<Bw> = None;
                    for m in bws {
                        let Measured::Bandwidth(b) = m else { return Err(bad("a QP measured no bandwidth")) };
                        total = Some(total.map_or(b, |t| t.add(b, p.duration > 0)));
                    }
                    Measured::Bandwidth(total.unwrap_or_default())
                };
                bar.finish_and_clear();
                out.row(&ctx, &p, &m);
            }
            Ok(())
        })();
        let served: Result<()> = servers.into_iter().try_for_each(join);
        measured.and(served)
    })?;
    out.footer();
    Ok(())
}

fn limits(json: bool, runs: u32) -> Result<()> {
    let rows = limits::run(runs)?;
    if !json {
        println!(
            "the soft NIC against this machine's limits (MB/s = 2^20 bytes/s; latency rows in us; median of {runs} runs)"
        );
        println!(
            " {:<44} {:>9} {:>12} {:>12} {:>7}  goal",
            "comparison", "#bytes", "rdmakit", "limit", "ratio"
        );
    }
    for r in &rows {
        if json {
            println!("{}", serde_json::to_string(r).expect("serialisable"));
        } else {
            let met = if r.met() { "met" } else { "missed" };
            let goal = match r.unit {
                "us" if r.goal.is_infinite() => "no goal".to_owned(),
                "us" => format!("{met} (<= {})", r.goal),
                _ => format!("{met} (>= {})", r.goal),
            };
            println!(
                " {:<44} {:>9} {:>12.2} {:>12.2} {:>7.3}  {goal}",
                r.what, r.bytes, r.rdmakit_mb_per_sec, r.limit_mb_per_sec, r.ratio
            );
        }
    }
    Ok(())
}

/// The suite's first line: which provider and device every result below comes from, and
/// whether that is the software NIC because no RDMA device is here.
fn suite_banner(ctx: &Context) -> String {
    let what = format!("provider {}, device {}, loopback in one process", ctx.provider(), ctx.name());
    if ctx.provider() != ProviderKind::Soft {
        return format!("rdmakit-perf suite on {} ({what})", ctx.name());
    }
    match verbs_unavailable_reason() {
        Some(why) => format!(
            "rdmakit-perf suite on the soft NIC (software RDMA, not hardware: no RDMA device here: {why}); every result is from {what}"
        ),
        None => format!(
            "rdmakit-perf suite on the soft NIC (software RDMA; an RDMA device is present: --provider verbs measures it); every result is from {what}"
        ),
    }
}

/// The default suite: small and short, in loopback.
fn suite(a: &SuiteArgs) -> Result<()> {
    let ctx = a.dev.open()?;
    let out = report::Out::new(a.json);
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
    let banner = suite_banner(&ctx);
    if a.json {
        eprintln!("{banner}");
    } else {
        println!("{banner}");
    }
    out.suite_header();
    let copts = a.dev.connect_options();
    for (test, size, iters, placement) in plan {
        if placement == Placement::Memic && ctx.attr().max_dm_size == 0 {
            eprintln!("rdmakit-perf: {} in device memory skipped: {} has none", test.name(), ctx.name());
            continue;
        }
        let p = Params {
            inline: if test == Test::WriteLat { 64 } else { 0 },
            ..Params::simple(test, size, iters, 16, placement)
        };
        let (a, b) = rig::loopback(&ctx, &p, &copts)?;
        let bar = ProgressBar::hidden();
        let m = if test == Test::PutLat {
            put_lat::run(&a, Some(&b), &p, &bar)?
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

/// Warnings of the library (a refused connection, a dropped frame, a peer that stopped
/// answering) go to stderr; `RUST_LOG` chooses more or less (default: warnings).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .try_init();
}

fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    let r = match &cli.cmd {
        None => suite(&cli.suite),
        Some(Cmd::Suite(a)) => suite(a),
        Some(Cmd::WriteBw(o)) => one(Test::WriteBw, o),
        Some(Cmd::WriteLat(o)) => one(Test::WriteLat, o),
        Some(Cmd::ReadBw(o)) => one(Test::ReadBw, o),
        Some(Cmd::ReadLat(o)) => one(Test::ReadLat, o),
        Some(Cmd::SendBw(o)) => one(Test::SendBw, o),
        Some(Cmd::SendLat(o)) => one(Test::SendLat, o),
        Some(Cmd::AtomicLat(o)) => one(Test::AtomicLat, o),
        Some(Cmd::AtomicBw(o)) => one(Test::AtomicBw, o),
        Some(Cmd::PipeLat(o)) => one(Test::PipeLat, o),
        Some(Cmd::PipeBw(o)) => one(Test::PipeBw, o),
        Some(Cmd::PutLat(o)) => one(Test::PutLat, o),
        Some(Cmd::FaddContended(c)) => fadd_contended(c),
        Some(Cmd::Scaling(a)) => scaling::main(a),
        Some(Cmd::ScalingPeer(a)) => scaling::peer(a),
        Some(Cmd::Bystander(a)) => bystander::main(a),
        Some(Cmd::BystanderPeer(a)) => bystander::peer(a),
        Some(Cmd::Limits { json, runs }) => limits(*json, *runs),
        Some(Cmd::Transfer(t)) => return transfer::main(t),
        Some(Cmd::Datagen(d)) => return transfer::datagen_main(d),
        Some(Cmd::MemicAtomics { dev, iters }) => {
            dev.open().and_then(|ctx| seeds::memic_atomics(&ctx, (*iters).max(1)))
        }
        Some(Cmd::XgvmiExport { dev, max_size, runs }) => {
            dev.open().and_then(|ctx| seeds::xgvmi_export(&ctx, *max_size, (*runs).max(1)))
        }
        Some(Cmd::RpipeSeed(a)) => {
            a.dev.open().and_then(|ctx| seeds_rpipe::run(&ctx, &a.dev.connect_options(), a))
        }
        Some(Cmd::CkdirectSeed(a)) => {
            a.dev.open().and_then(|ctx| seeds_ckdirect::run(&ctx, &a.dev.connect_options(), a))
        }
        Some(Cmd::Plot(p)) => match plot::run(p) {
            Ok(n) => {
                println!("{}: {n} measurements drawn", p.output.display());
                return ExitCode::SUCCESS;
            }
            Err(e) => {
                eprintln!("rdmakit-perf plot: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rdmakit-perf: {e}");
            ExitCode::FAILURE
        }
    }
}
