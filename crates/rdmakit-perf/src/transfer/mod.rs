//! `transfer`: a bulk transfer through a ring of chunk slots by RDMA write, with the
//! receiver's "chunk consumed" flags checked by RDMA read, end-to-end CRC-32 verification,
//! and live gauges (terminal, and a web speedometer fed by server-sent events); and
//! `datagen`, a TCP data generator to feed it, as the seed's `fpga_emulator` feeds
//! `transfer_real` (Isac Bruce and Hannes Ekstam Ljusegren, "COTS RDMA Data-Transfer: two
//! throughput demos using UCX and Verbs", 2022).
//!
//! Modes: loopback (both ends in this process, the default), `--server ADDR` (the
//! receiver, serving one sender; it owns the ring and announces its shape), `--connect
//! ADDR` (the sender, with the data source). The seed's demo has the roles the other way
//! round; here the client drives, as in the other subcommands.
//!
//! The default 40 GiB is logical: the bytes cycle through a ring of `--slots` × `--chunk`
//! (16 MiB). In loopback on the soft NIC a release build moved it in 9 to 13 s on a busy
//! 2-core machine (3 to 5 GiB/s: each byte is generated, checksummed, copied by the NIC,
//! copied out and checksummed again); a debug build is about ten times slower, so use
//! `--release` or `--bytes`.

mod gauge;
mod ring;
mod source;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use rdmakit_verbs::cm::{self, CmOptions};
use rdmakit_verbs::{Context, ProtectionDomain};

use crate::{DeviceOpts, PeerOpts};
pub use gauge::Progress;
use ring::{Input, ReceiverMem, RingInfo, Sender, SenderMem, Tally};

/// What can go wrong in a transfer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An RDMA operation failed.
    #[error(transparent)]
    Rdma(#[from] rdmakit_verbs::Error),
    /// The two ends disagree about what was moved.
    #[error(
        "checksum mismatch: sent {} chunks, {} bytes, crc32 {:#010x}; received {} chunks, {} bytes, crc32 {:#010x}",
        sent.chunks, sent.bytes, sent.crc32, received.chunks, received.bytes, received.crc32
    )]
    Mismatch {
        /// The sender's tally.
        sent: Tally,
        /// The receiver's tally.
        received: Tally,
    },
    /// Reading the input stream (or serving it, for `datagen`) failed.
    #[error("input: {what}: {source}")]
    Input {
        /// What was being done.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Other I/O (the gauge's listener).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The peer broke the protocol.
    #[error("protocol: {0}")]
    Protocol(String),
    /// A bad command-line value.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Parses a byte count: a number with an optional `K`/`M`/`G`/`T` suffix (powers of 1024;
/// `KiB`, `MiB`, ... and `KB`, ... mean the same).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num.parse().map_err(|_| format!("{s:?}: expected a number of bytes, e.g. 4GiB"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        u => return Err(format!("{s:?}: unknown unit {u:?} (use K, M, G or T)")),
    };
    n.checked_mul(1u64 << shift).ok_or_else(|| format!("{s:?}: too large"))
}

/// Options of `transfer`.
#[derive(Args, Debug, Clone)]
pub struct TransferArgs {
    /// Bytes to move (K/M/G/T suffixes, powers of 1024). Default 40GiB with the built-in
    /// pattern; with --input, the most to take (default: until the stream ends).
    #[arg(long, value_parser = parse_size)]
    bytes: Option<u64>,
    /// Chunk size: one RDMA write per chunk. Default 2MiB; a sender uses the receiver's
    /// slot size unless told a smaller chunk.
    #[arg(long, value_parser = parse_size)]
    chunk: Option<u64>,
    /// Slots in the receiver's ring.
    #[arg(long, default_value_t = 8)]
    slots: u32,
    /// Writes the sender keeps outstanding (at most the number of slots).
    #[arg(long, default_value_t = 4)]
    window: u32,
    /// Data source: `tcp://HOST:PORT` (e.g. `rdmakit-perf datagen`) instead of the pattern.
    #[arg(long)]
    input: Option<String>,
    #[command(flatten)]
    dev: DeviceOpts,
    #[command(flatten)]
    peer: PeerOpts,
    /// Serve a live speedometer page (and its event stream at /events) at this address.
    #[arg(long)]
    gauge_http: Option<SocketAddr>,
    /// Milliseconds between gauge events.
    #[arg(long, default_value_t = 250)]
    gauge_interval_ms: u64,
    /// Before starting the transfer, wait up to this many seconds for a page to open the
    /// gauge's event stream, so that whoever opens it sees the transfer from its start
    /// (a demo: start the command, open the page, watch). At most a day; 0 does not wait.
    #[arg(long, default_value_t = 0.0, requires = "gauge_http")]
    gauge_wait: f64,
    /// Keep serving the gauge this many seconds after the transfer ends.
    #[arg(long, default_value_t = 0.0)]
    gauge_linger: f64,
    /// Seconds any one wait may take before the transfer is declared stuck (a ring that
    /// stays full for that long included; at most a day).
    #[arg(long, default_value_t = 30)]
    timeout: u64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Test hook: corrupt this chunk after the sender checksummed it.
    #[arg(long, hide = true)]
    inject_corruption: Option<u64>,
}

/// Options of `datagen`.
#[derive(Args, Debug, Clone)]
pub struct DatagenArgs {
    /// Address to listen on (port 0 picks one; the address is printed first).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Pace the stream at this many MB/s (MB = 2^20 bytes), per client.
    #[arg(long)]
    rate: Option<f64>,
    /// Bytes to send each client, then close (default: until the client goes away).
    #[arg(long, value_parser = parse_size)]
    bytes: Option<u64>,
    /// Serve one client, then exit.
    #[arg(long)]
    once: bool,
    /// Drop a client that accepts no bytes for this many seconds (it frees its place).
    #[arg(long, default_value_t = 60)]
    write_timeout: u64,
}

/// The result line.
#[derive(serde::Serialize)]
struct Report {
    mode: &'static str,
    provider: String,
    device: String,
    chunk: u32,
    slots: u32,
    chunks: u64,
    bytes: u64,
    secs: f64,
    gib_per_sec: f64,
    sent_crc32: String,
    received_crc32: String,
    ok: bool,
}

const DEFAULT_BYTES: u64 = 40 << 30;
const DEFAULT_CHUNK: u64 = 2 << 20;
const MAX_CHUNK: u64 = 1 << 30;
/// Most ring slots (`--slots`), and what a sender takes from a receiver.
const MAX_SLOTS: u32 = 4096;
/// Longest `--timeout`, in seconds (a day).
const MAX_TIMEOUT: u64 = 24 * 3600;

fn check_chunk(c: u64) -> Result<u32, Error> {
    if c == 0 || c > MAX_CHUNK {
        return Err(Error::InvalidArgument(format!("--chunk {c}: must be 1 byte to 1GiB")));
    }
    Ok(c as u32)
}

fn check(sent: Tally, received: Tally) -> Result<(), Error> {
    if sent == received { Ok(()) } else { Err(Error::Mismatch { sent, received }) }
}

/// Runs `transfer`; errors are printed, and give a non-zero exit code.
pub fn main(a: &TransferArgs) -> ExitCode {
    match run(a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rdmakit-perf: transfer: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `datagen`.
pub fn datagen_main(a: &DatagenArgs) -> ExitCode {
    match source::datagen(a.listen, a.rate, a.bytes, a.once, Duration::from_secs(a.write_timeout.max(1))) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rdmakit-perf: datagen: {e}");
            ExitCode::FAILURE
        }
    }
}

fn input(a: &TransferArgs, stuck: Duration) -> Result<Input, Error> {
    Ok(match &a.input {
        Some(url) => Input::Tcp(source::connect_input(url, stuck)?, a.bytes),
        None => Input::Pattern(source::Pattern::new(), a.bytes.unwrap_or(DEFAULT_BYTES)),
    })
}

fn cm_options(a: &TransferArgs, (caps, cqe): (rdmakit_verbs::QpCaps, u32)) -> CmOptions {
    CmOptions::default()
        .with_caps(caps)
        .with_cqe(cqe)
        .with_connect(a.dev.connect_options())
        .with_timeout(Duration::from_secs(30))
}

fn run(a: &TransferArgs) -> Result<(), Error> {
    if a.slots == 0 || a.slots > MAX_SLOTS {
        return Err(Error::InvalidArgument(format!("--slots {}: must be 1..={MAX_SLOTS}", a.slots)));
    }
    if a.timeout > MAX_TIMEOUT {
        return Err(Error::InvalidArgument(format!(
            "--timeout {}: at most {MAX_TIMEOUT} s (a day)",
            a.timeout
        )));
    }
    let window = a.window.clamp(1, a.slots);
    let stuck = Duration::from_secs(a.timeout.max(1));
    let ctx = a.dev.open()?;
    for (flag, secs) in [("--gauge-linger", a.gauge_linger), ("--gauge-wait", a.gauge_wait)] {
        if !(secs >= 0.0 && secs.is_finite()) {
            return Err(Error::InvalidArgument(format!("{flag} {secs}: seconds, at least 0")));
        }
    }
    // The receiver learns the size only at the end.
    let total = match (&a.peer.server, &a.input) {
        (Some(_), _) => None,
        (None, Some(_)) => a.bytes,
        (None, None) => Some(a.bytes.unwrap_or(DEFAULT_BYTES)),
    };
    let progress = Progress::new(total);
    let http = match a.gauge_http {
        Some(addr) => {
            let interval = Duration::from_millis(a.gauge_interval_ms.clamp(10, 10_000));
            let g = gauge::HttpGauge::start(addr, progress.clone(), interval)?;
            eprintln!("rdmakit-perf: gauge at http://{}/", g.addr());
            if a.gauge_wait > 0.0 {
                let wait = Duration::from_secs_f64(a.gauge_wait.min(86_400.0));
                if !g.wait_for_viewer(wait) {
                    eprintln!("rdmakit-perf: gauge: nobody opened the page in {wait:?}; starting anyway");
                }
                progress.begin();
            }
            Some(g)
        }
        None => None,
    };
    let term = gauge::terminal(&progress);
    let r = if let Some(addr) = a.peer.server {
        serve(a, &ctx, addr, &progress, stuck)
    } else if let Some(addr) = a.peer.connect {
        send(a, &ctx, addr, window, &progress, stuck)
    } else {
        loopback(a, &ctx, window, &progress, stuck)
    };
    progress.finish(matches!(&r, Ok(o) if o.sent == o.received));
    if let Some(t) = term {
        let _ = t.join();
    }
    if let Some(g) = &http {
        g.wind_down(Duration::from_secs_f64(a.gauge_linger.min(86_400.0)));
    }
    let Outcome { mode, chunk, slots, sent, received, secs } = r?;
    let report = Report {
        mode,
        provider: ctx.provider().to_string(),
        device: ctx.name().to_string(),
        chunk,
        slots,
        chunks: received.chunks,
        bytes: received.bytes,
        secs,
        gib_per_sec: received.bytes as f64 / secs.max(1e-9) / (1u64 << 30) as f64,
        sent_crc32: format!("{:#010x}", sent.crc32),
        received_crc32: format!("{:#010x}", received.crc32),
        ok: sent == received,
    };
    if a.json {
        println!("{}", serde_json::to_string(&report).expect("serialisable"));
    } else {
        println!(
            "transfer ({}, {} {}): {} bytes in {} chunks of up to {} bytes, {:.3} s, {:.3} GiB/s, crc32 sent {} received {}: {}",
            report.mode,
            report.provider,
            report.device,
            report.bytes,
            report.chunks,
            report.chunk,
            report.secs,
            report.gib_per_sec,
            report.sent_crc32,
            report.received_crc32,
            if report.ok { "OK" } else { "MISMATCH" }
        );
    }
    check(sent, received)
}

/// How a transfer went.
struct Outcome {
    mode: &'static str,
    chunk: u32,
    slots: u32,
    sent: Tally,
    received: Tally,
    /// Seconds from connected to verified.
    secs: f64,
}

fn loopback(
    a: &TransferArgs,
    ctx: &Context,
    window: u32,
    progress: &Progress,
    stuck: Duration,
) -> Result<Outcome, Error> {
    let chunk = check_chunk(a.chunk.unwrap_or(DEFAULT_CHUNK))?;
    let opts = a.dev.connect_options();
    let pd = ctx.alloc_pd()?;
    let ring::Loopback { rcq, rqp, rmem, scq, sqp, smem } =
        ring::Loopback::new(&pd, chunk, a.slots, window, &opts)?;
    let input = input(a, stuck)?;
    let sender =
        Sender { qp: &sqp, cq: &scq, ring: rmem.info(), chunk, window, stuck, corrupt: a.inject_corruption };
    // The gauge follows the receiver: bytes that arrived and were checksummed.
    let quiet = Progress::new(None);
    let start = Instant::now();
    let (sent, received) = std::thread::scope(|s| {
        let rx = s.spawn(|| {
            let r = ring::receive(&rqp, &rcq, &rmem, progress, stuck);
            if r.is_err() {
                // Unblock the sender: its QP flushes.
                let _ = sqp.modify_to_error();
            }
            r
        });
        let tx = sender.run(&smem, input, &quiet);
        if tx.is_err() {
            // Unblock the receiver: its QP flushes.
            let _ = rqp.modify_to_error();
        }
        let rx = rx.join().map_err(|_| Error::Protocol("the receiver thread panicked".into()))?;
        // The sender's error is the cause when both failed.
        let (sent, verdict) = tx?;
        let (received, told) = rx?;
        check(sent, told)?;
        if verdict != received {
            return Err(Error::Protocol("the receiver's verdict differs from its own tally".into()));
        }
        Ok::<_, Error>((sent, received))
    })?;
    let secs = start.elapsed().as_secs_f64();
    Ok(Outcome { mode: "loopback", chunk, slots: a.slots, sent, received, secs })
}

fn serve(
    a: &TransferArgs,
    ctx: &Context,
    addr: SocketAddr,
    progress: &Progress,
    stuck: Duration,
) -> Result<Outcome, Error> {
    let chunk = check_chunk(a.chunk.unwrap_or(DEFAULT_CHUNK))?;
    let pd: ProtectionDomain = ctx.alloc_pd()?;
    let mem = ReceiverMem::new(&pd, chunk, a.slots)?;
    let listener = cm::Listener::bind(ctx, addr)?;
    eprintln!(
        "rdmakit-perf: transfer: receiving on {} ({} {})",
        listener.local_addr()?,
        ctx.provider(),
        ctx.name()
    );
    // The first connection that is a transfer sender (another program's is dropped).
    let conn = crate::rig::first_client("transfer", || {
        let c = listener.accept(&pd, &cm_options(a, ring::receiver_caps(a.slots)), &mem.info().encode())?;
        if c.peer_private_data().get(..ring::HELLO.len()) != Some(&ring::HELLO[..]) {
            return Err(rdmakit_verbs::Error::Malformed {
                what: "transfer hello",
                reason: "the client is not an rdmakit-perf transfer sender".into(),
            });
        }
        Ok(c)
    })?;
    mem.post_receives(conn.qp())?;
    let start = Instant::now();
    let (received, sent) = ring::receive(conn.qp(), conn.cq(), &mem, progress, stuck)?;
    let secs = start.elapsed().as_secs_f64();
    // The verdict's send completed, so the sender has it: the receiver hangs up first
    // (were the sender to go first, the verdict's acknowledgement could be lost with it).
    conn.disconnect()?;
    Ok(Outcome { mode: "server", chunk, slots: a.slots, sent, received, secs })
}

fn send(
    a: &TransferArgs,
    ctx: &Context,
    addr: SocketAddr,
    window: u32,
    progress: &Progress,
    stuck: Duration,
) -> Result<Outcome, Error> {
    let pd = ctx.alloc_pd()?;
    let conn = cm::connect(&pd, addr, &cm_options(a, ring::sender_caps(window)), ring::HELLO)?;
    let info = RingInfo::decode(conn.peer_private_data())?;
    let chunk = match a.chunk {
        None => info.slot,
        Some(c) if c <= u64::from(info.slot) => check_chunk(c)?,
        Some(c) => {
            return Err(Error::InvalidArgument(format!(
                "--chunk {c}: the receiver's slots hold {} bytes",
                info.slot
            )));
        }
    };
    let window = window.min(info.slots);
    let mem = SenderMem::new(&pd, chunk, window, info.slots)?;
    mem.post_receive(conn.qp())?;
    let input = input(a, stuck)?;
    let sender = Sender {
        qp: conn.qp(),
        cq: conn.cq(),
        ring: info,
        chunk,
        window,
        stuck,
        corrupt: a.inject_corruption,
    };
    let start = Instant::now();
    let (sent, received) = sender.run(&mem, input, progress)?;
    let secs = start.elapsed().as_secs_f64();
    // Wait for the receiver to hang up once its verdict's send completed (see `serve`).
    conn.wait_disconnected(stuck)?;
    Ok(Outcome { mode: "client", chunk, slots: info.slots, sent, received, secs })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units_and_reject_nonsense() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2MiB"), Ok(2 << 20));
        assert_eq!(parse_size("40G"), Ok(40 << 30));
        assert_eq!(parse_size("3 kb"), Ok(3 << 10));
        assert!(parse_size("").is_err());
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
