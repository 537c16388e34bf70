//! `bystander`: what one peer's large RDMA reads cost the other connections of the soft
//! NIC process that serves them.
//!
//! Three processes: this one is the responder, with a region to read and a small one to
//! write. A *writer* child (the hidden `bystander-peer --role write`) makes 8-byte RDMA
//! writes to it one at a time and times each to its completion, once alone and once while a
//! *reader* child (`--role read`) keeps a window of large RDMA reads of the region
//! outstanding. Both children talk to this process only, so what the writer sees beside the
//! reads is the responder's wire loop sharing itself between the two connections (the
//! reader's own process, which takes the large answers in, is not on the writer's path).
//! Endpoints and the region go over the children's stdin and stdout, as in `scaling`.

use std::io::{BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use rdmakit_verbs::*;

use crate::scaling::{bad, hex, io, read_line, unhex};

/// Options of `bystander`.
#[derive(Args, Debug, Clone)]
pub struct BystanderArgs {
    /// Bytes per read of the reader (at most 64 MiB less 64 bytes, the soft wire's largest
    /// message).
    #[arg(long, default_value_t = 48 << 20)]
    read_size: u32,
    /// Reads the reader keeps outstanding.
    #[arg(long, default_value_t = 4)]
    window: u32,
    /// Seconds of writes per phase (alone, then beside the reads); a phase also ends at
    /// 4 million writes (the samples kept).
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Through the same-host rings (where reads and writes may also be placed directly,
    /// past the responder's loop) instead of the TCP wire.
    #[arg(long)]
    same_host: bool,
}

/// The most latency samples a writer keeps.
const MAX_SAMPLES: usize = 4_000_000;

/// Which child this is.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// 8-byte writes, each timed to its completion.
    Write,
    /// Large reads, a window of them outstanding, until told to stop.
    Read,
}

/// Options of the hidden child.
#[derive(Args, Debug, Clone)]
pub struct PeerArgs {
    #[arg(long, value_enum)]
    role: Role,
    #[arg(long, default_value_t = 8)]
    size: u32,
    #[arg(long, default_value_t = 1)]
    window: u32,
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    #[arg(long)]
    same_host: bool,
}

/// The writer's latencies, in microseconds.
struct Latency {
    n: usize,
    median: f64,
    p99: f64,
    max: f64,
}

/// A child process with its pipes, killed if dropped before it finished.
struct Peer {
    child: Child,
    to: ChildStdin,
    from: BufReader<ChildStdout>,
}

impl Peer {
    fn spawn(p: &PeerArgs) -> Result<Peer> {
        let exe = std::env::current_exe().map_err(io("current_exe"))?;
        let role = match p.role {
            Role::Write => "write",
            Role::Read => "read",
        };
        let mut child = Command::new(exe)
            .args(["bystander-peer", "--role", role])
            .args(["--size", &p.size.to_string(), "--window", &p.window.to_string()])
            .args(["--seconds", &p.seconds.to_string()])
            .args(p.same_host.then_some("--same-host"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(io("spawn a peer"))?;
        let to = child.stdin.take().ok_or_else(|| bad("no stdin"))?;
        let from = BufReader::new(child.stdout.take().ok_or_else(|| bad("no stdout"))?);
        Ok(Peer { child, to, from })
    }

    fn say(&mut self, line: &str) -> Result<()> {
        self.to
            .write_all(line.as_bytes())
            .and_then(|_| self.to.write_all(b"\n"))
            .map_err(io("write to a peer"))?;
        self.to.flush().map_err(io("write to a peer"))
    }

    /// Connects `qp` (this side's) with the peer's QP, telling it the region to use.
    fn connect(&mut self, qp: &QueuePair, target: RemoteRegion) -> Result<()> {
        self.say(&hex(&qp.address()?.to_bytes()))?;
        self.say(&format!("{} {} {}", target.addr, target.rkey, target.len))?;
        let theirs =
            QpAddress::from_bytes(&unhex(&read_line(&mut self.from)?)?).map_err(|e| bad(e.to_string()))?;
        qp.connect(&theirs, &ConnectOptions::default())?;
        self.say("GO")
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn parse_latency(line: &str) -> Result<Latency> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let num = |i: usize| {
        f.get(i).and_then(|v| v.parse::<f64>().ok()).ok_or_else(|| bad(format!("peer said {line:?}")))
    };
    if f.first() != Some(&"LAT") {
        return Err(bad(format!("the writer said {line:?}")));
    }
    Ok(Latency { n: num(1)? as usize, median: num(2)?, p99: num(3)?, max: num(4)? })
}

/// One run of a writer child, on a fresh QP of this process: its latencies.
fn writer_run(
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    target: RemoteRegion,
    a: &BystanderArgs,
) -> Result<Latency> {
    let qp = pd.create_qp(cq, cq, QpCaps::default())?;
    let args = PeerArgs { role: Role::Write, size: 8, window: 1, seconds: a.seconds, same_host: a.same_host };
    let mut w = Peer::spawn(&args)?;
    w.connect(&qp, target)?;
    parse_latency(&read_line(&mut w.from)?)
}

/// `rdmakit-perf bystander`.
pub fn main(a: &BystanderArgs) -> Result<()> {
    if a.read_size == 0 || a.read_size > (64 << 20) - 64 {
        return Err(bad("--read-size: 1 byte to 64 MiB less 64 bytes"));
    }
    if !(1..=64).contains(&a.window) {
        return Err(bad("--window: 1 to 64"));
    }
    if !(a.seconds > 0.0 && a.seconds <= 3600.0) {
        return Err(bad("--seconds: more than 0, at most 3600"));
    }
    let ctx = Context::open_soft_with(SoftConfig::default().with_same_host_shm(a.same_host))?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(64)?;
    let big = pd.alloc_mr(a.read_size as usize, AccessFlags::ALL_REMOTE)?;
    big.fill(0x5a)?;
    let small = pd.alloc_mr(4096, AccessFlags::ALL_REMOTE)?;

    let alone = writer_run(&pd, &cq, small.remote(), a)?;

    let rqp = pd.create_qp(&cq, &cq, QpCaps::default())?;
    let args = PeerArgs {
        role: Role::Read,
        size: a.read_size,
        window: a.window,
        seconds: 0.0,
        same_host: a.same_host,
    };
    let mut reader = Peer::spawn(&args)?;
    reader.connect(&rqp, big.remote())?;
    if read_line(&mut reader.from)? != "STARTED" {
        return Err(bad("the reader did not start"));
    }
    let beside = writer_run(&pd, &cq, small.remote(), a);
    reader.say("STOP")?;
    let line = read_line(&mut reader.from)?;
    let beside = beside?;
    let read_rate = match line.split_whitespace().collect::<Vec<_>>()[..] {
        ["READ", bytes, secs] => {
            let (b, s) = (bytes.parse::<f64>().unwrap_or(0.0), secs.parse::<f64>().unwrap_or(0.0));
            if s > 0.0 { b / s / 1e9 } else { 0.0 }
        }
        _ => return Err(bad(format!("the reader said {line:?}"))),
    };

    println!(
        "soft NIC, three processes {}: 8-byte RDMA write latency to a process \
         (one at a time, to completion), alone and while another peer keeps {} reads of {} MiB \
         from the same process outstanding",
        if a.same_host { "through the same-host rings" } else { "over the TCP wire" },
        a.window,
        f64::from(a.read_size) / f64::from(1u32 << 20)
    );
    println!("{:<14} {:>8} {:>12} {:>12} {:>12}", "writer", "writes", "median us", "p99 us", "max us");
    for (name, l) in [("alone", &alone), ("beside reads", &beside)] {
        println!("{name:<14} {:>8} {:>12.1} {:>12.1} {:>12.1}", l.n, l.median, l.p99, l.max);
    }
    println!(
        "beside/alone: median {:.2}, p99 {:.2}; the reads meanwhile: {read_rate:.2} GB/s",
        beside.median / alone.median,
        beside.p99 / alone.p99
    );
    Ok(())
}

/// The hidden child: connects one QP to the parent's, then writes or reads as `a.role`
/// says (see the module's docs).
pub fn peer(a: &PeerArgs) -> Result<()> {
    let mut r = std::io::stdin().lock();
    let theirs = QpAddress::from_bytes(&unhex(&read_line(&mut r)?)?).map_err(|e| bad(e.to_string()))?;
    let region = read_line(&mut r)?;
    let (addr, rkey, len) = match region.split_whitespace().map(str::parse::<u64>).collect::<Vec<_>>()[..] {
        [Ok(a), Ok(k), Ok(l)] => (a, u32::try_from(k).map_err(|_| bad("rkey"))?, l),
        _ => return Err(bad(format!("region {region:?}"))),
    };
    if u64::from(a.size) > len || a.window == 0 || a.window > 64 {
        return Err(bad("size or window out of range"));
    }
    let ctx = Context::open_soft_with(SoftConfig::default().with_same_host_shm(a.same_host))?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(128)?;
    let caps = QpCaps::default().with_max_send_wr(64);
    let qp = pd.create_qp(&cq, &cq, caps)?;
    let mut stdout = std::io::stdout();
    let mut say = |line: &str| {
        stdout
            .write_all(line.as_bytes())
            .and_then(|_| stdout.write_all(b"\n"))
            .and_then(|_| stdout.flush())
            .map_err(io("write to the parent"))
    };
    say(&hex(&qp.address()?.to_bytes()))?;
    if read_line(&mut r)? != "GO" {
        return Err(bad("expected GO"));
    }
    // A transport budget of seconds, not the default half second: the last read of a
    // window of large ones is answered only after those before it are through.
    qp.connect(&theirs, &ConnectOptions::default().with_timeout(18))?;
    let remote = RemoteSlice::new(addr, a.size, rkey);
    let buf = pd.alloc_mr(a.size as usize, AccessFlags::LOCAL_WRITE)?;
    let wait = Some(Duration::from_secs(30));
    match a.role {
        Role::Write => {
            let seconds = Duration::from_secs_f64(a.seconds.clamp(0.001, 3600.0));
            let mut lat = Vec::new();
            let end = Instant::now() + seconds;
            // The samples are bounded however long the phase (32 MiB of them).
            while Instant::now() < end && lat.len() < MAX_SAMPLES {
                let t = Instant::now();
                qp.post_send(SendWr::write(buf.local()?, remote))?;
                let wc = cq.wait(wait)?;
                if !wc.status.is_success() {
                    return Err(bad(format!("a write failed: {:?}", wc.status)));
                }
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            }
            let l = crate::report::lat_stats(&lat);
            say(&format!("LAT {} {} {} {}", lat.len(), l.t_typical, l.p99, l.t_max))
        }
        Role::Read => {
            // Stop when the parent says so (or goes away).
            let stop = Arc::new(AtomicBool::new(false));
            let s = stop.clone();
            let (tx, rx) = std::sync::mpsc::channel::<String>();
            // The lock goes (it stays on this thread); what it buffered stays in stdin's buffer.
            drop(r);
            std::thread::spawn(move || {
                let mut l = String::new();
                let _ = std::io::stdin().read_line(&mut l);
                s.store(true, Ordering::Relaxed);
                let _ = tx.send(l);
            });
            for _ in 0..a.window {
                qp.post_send(SendWr::read(buf.local()?, remote))?;
            }
            let (t0, mut bytes, mut started) = (Instant::now(), 0u64, false);
            while !stop.load(Ordering::Relaxed) {
                let wc = cq.wait(wait)?;
                if !wc.status.is_success() {
                    return Err(bad(format!("a read failed: {:?}", wc.status)));
                }
                bytes += u64::from(a.size);
                if !started {
                    started = true;
                    say("STARTED")?;
                }
                qp.post_send(SendWr::read(buf.local()?, remote))?;
            }
            let secs = t0.elapsed().as_secs_f64();
            let _ = rx.recv_timeout(Duration::from_secs(1));
            say(&format!("READ {bytes} {secs}"))
        }
    }
}
