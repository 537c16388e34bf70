//! The measuring side shared by the peer programs (`src/bin/peer-*.rs`).
//!
//! Each peer program wraps one Rust RDMA crate behind [`Nic`] (a handful of calls straight
//! into that crate's public API) and hands it to [`main`], which runs the same tests as
//! `rdmakit-perf` with the same method, so that the figures compare row for row:
//!
//! - `write-lat`: ping-pong of RDMA writes; each side writes the round's stamp into the last
//!   byte of the peer's buffer and spins on its own; latency = round trip / 2, `t_typical`
//!   is the median (perftest's `ib_write_lat`, rdmakit-perf's `write-lat`). Inline when the
//!   message fits the QP's inline limit (rdmakit-perf's default `-I 220`).
//! - `send-lat`: the same ping-pong with send/recv (`ib_send_lat`, `send-lat`).
//! - `write-bw`, `send-bw`: `--iters` operations of `--size` bytes, `--tx-depth` (128)
//!   outstanding, every one signalled, completions polled 16 at a time; average bandwidth
//!   (MiB/s) and message rate (Mpps) from the first post to the last completion.
//!
//! Connection set-up goes over a TCP socket (the client sends the test parameters, both send
//! their QP endpoint), as perftest's does; nothing measured touches it.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Longest message a run may ask for (rdmakit-perf's limit too).
pub const MAX_SIZE: u32 = 1 << 23;
/// Largest send queue depth asked for.
pub const MAX_WINDOW: u32 = 1024;
/// Inline limit asked for when the QP is created (rdmakit-perf's write-lat default).
pub const INLINE: u32 = 220;
/// Receives the receiver of a send test keeps posted (rdmakit-perf's `--rx-depth`).
pub const RX_DEPTH: u32 = 512;
/// How long any wait for the peer may take before the run fails.
const STUCK: Duration = Duration::from_secs(60);

/// A test, as rdmakit-perf names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Test {
    /// RDMA write ping-pong.
    WriteLat,
    /// RDMA write stream.
    WriteBw,
    /// Send/recv ping-pong.
    SendLat,
    /// Send stream.
    SendBw,
}

impl Test {
    fn parse(s: &str) -> Option<Test> {
        Some(match s {
            "write-lat" => Test::WriteLat,
            "write-bw" => Test::WriteBw,
            "send-lat" => Test::SendLat,
            "send-bw" => Test::SendBw,
            _ => return None,
        })
    }
    /// rdmakit-perf's name of the test.
    pub fn name(self) -> &'static str {
        match self {
            Test::WriteLat => "write-lat",
            Test::WriteBw => "write-bw",
            Test::SendLat => "send-lat",
            Test::SendBw => "send-bw",
        }
    }
    fn code(self) -> u8 {
        self as u8
    }
    fn from_code(c: u8) -> Option<Test> {
        [Test::WriteLat, Test::WriteBw, Test::SendLat, Test::SendBw].get(usize::from(c)).copied()
    }
    fn uses_write(self) -> bool {
        matches!(self, Test::WriteLat | Test::WriteBw)
    }
}

/// What a QP's peer needs to reach it and its buffer (exchanged over TCP).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Endpoint {
    /// QP number.
    pub qpn: u32,
    /// First packet sequence number.
    pub psn: u32,
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// The GID of the index in use.
    pub gid: [u8; 16],
    /// Address of the registered buffer.
    pub addr: u64,
    /// Its remote key.
    pub rkey: u32,
    /// Its length.
    pub len: u64,
}

const ENDPOINT_LEN: usize = 4 + 4 + 2 + 16 + 8 + 4 + 8;

impl Endpoint {
    fn encode(&self) -> [u8; ENDPOINT_LEN] {
        let mut b = [0u8; ENDPOINT_LEN];
        b[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..10].copy_from_slice(&self.lid.to_le_bytes());
        b[10..26].copy_from_slice(&self.gid);
        b[26..34].copy_from_slice(&self.addr.to_le_bytes());
        b[34..38].copy_from_slice(&self.rkey.to_le_bytes());
        b[38..46].copy_from_slice(&self.len.to_le_bytes());
        b
    }
    fn decode(b: &[u8; ENDPOINT_LEN]) -> Endpoint {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[10..26]);
        Endpoint {
            qpn: u32_at(0),
            psn: u32_at(4),
            lid: u16::from_le_bytes([b[8], b[9]]),
            gid,
            addr: u64_at(26),
            rkey: u32_at(34),
            len: u64_at(38),
        }
    }
}

/// One work completion, as the driver needs it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Wc {
    /// The request's id.
    pub wr_id: u64,
    /// `IBV_WC_SUCCESS`.
    pub ok: bool,
    /// The raw status (for the error message).
    pub status: u32,
}

/// What a QP and its buffer are asked to hold.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Device name (e.g. `rxe0`).
    pub device: &'static str,
    /// GID index on port 1.
    pub gid_index: u32,
    /// Bytes of the registered buffer.
    pub buf_len: usize,
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
}

/// One Rust RDMA crate's QP + CQ + registered buffer, as the tests use it.
pub trait Nic: Sized {
    /// `name version` of the crate measured.
    const CRATE: &'static str;
    /// Whether the crate can post RDMA writes.
    const HAS_WRITE: bool;
    /// Opens the device, creates the CQ, the RC QP and registers a buffer.
    fn open(shape: Shape) -> io::Result<Self>;
    /// This side's endpoint.
    fn endpoint(&self) -> Endpoint;
    /// Moves the QP to RTS towards `remote` (and keeps its buffer's address and key).
    fn connect(&mut self, remote: &Endpoint, gid_index: u32) -> io::Result<()>;
    /// The inline limit the QP got (0 when the crate cannot post inline).
    fn max_inline(&self) -> u32;
    /// Reads byte `off` of the buffer (the NIC may write it at any time).
    fn load(&self, off: usize) -> u8;
    /// Writes byte `off` of the buffer.
    fn store(&mut self, off: usize, v: u8);
    /// Posts a signalled RDMA write of `len` bytes at `off` to the peer's buffer at `remote_off`.
    fn post_write(
        &mut self,
        wr_id: u64,
        off: usize,
        len: u32,
        remote_off: u64,
        inline: bool,
    ) -> io::Result<()>;
    /// Posts a signalled send of `len` bytes at `off`.
    fn post_send(&mut self, wr_id: u64, off: usize, len: u32, inline: bool) -> io::Result<()>;
    /// Posts a receive into `len` bytes at `off`.
    fn post_recv(&mut self, wr_id: u64, off: usize, len: u32) -> io::Result<()>;
    /// Polls up to `out.len()` completions.
    fn poll(&mut self, out: &mut [Wc]) -> io::Result<usize>;
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg.into())
}

/// Command line of a peer program.
#[derive(Clone, Debug)]
pub struct Opts {
    /// The test.
    pub test: Test,
    /// Serve on this address.
    pub server: Option<SocketAddr>,
    /// Connect to this address.
    pub connect: Option<SocketAddr>,
    /// Message size.
    pub size: u32,
    /// Iterations.
    pub iters: u32,
    /// Operations outstanding (bandwidth tests).
    pub window: u32,
    /// Device name.
    pub device: &'static str,
    /// GID index on port 1.
    pub gid_index: u32,
}

/// This program's command line (for a peer program that does not go through [`main`]).
pub fn opts() -> io::Result<Opts> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    parse(&args)
}

/// Prints a client's result line.
pub fn report(krate: &str, o: &Opts, m: &Measured) {
    println!("{}", m.json(krate, o));
}

const USAGE: &str = "usage: peer-CRATE write-lat|write-bw|send-lat|send-bw (--server ADDR | --connect ADDR) \
[-s SIZE] [-n ITERS] [-t TX_DEPTH] [--device DEV] [--gid-index N] [--json]";

fn parse(args: &[String]) -> io::Result<Opts> {
    let test = args.first().and_then(|t| Test::parse(t)).ok_or_else(|| bad(USAGE))?;
    let mut o = Opts {
        test,
        server: None,
        connect: None,
        size: 0,
        iters: 0,
        window: 128,
        device: "rxe0",
        gid_index: 1,
    };
    let (mut size, mut iters) = (None, None);
    let mut it = args[1..].iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| bad(format!("{a} wants a value")));
        let num = |v: &String| v.parse::<u32>().map_err(|e| bad(format!("{a} {v}: {e}")));
        let addr = |v: &String| v.parse::<SocketAddr>().map_err(|e| bad(format!("{a} {v}: {e}")));
        match a.as_str() {
            "--server" => o.server = Some(addr(val()?)?),
            "--connect" => o.connect = Some(addr(val()?)?),
            "-s" | "--size" => size = Some(num(val()?)?),
            "-n" | "--iters" => iters = Some(num(val()?)?),
            "-t" | "--tx-depth" => o.window = num(val()?)?,
            "--device" => o.device = Box::leak(val()?.clone().into_boxed_str()),
            "--gid-index" => o.gid_index = num(val()?)?,
            "--json" => {}
            _ => return Err(bad(format!("unknown argument {a}\n{USAGE}"))),
        }
    }
    if o.server.is_some() == o.connect.is_some() {
        return Err(bad(format!("one of --server and --connect\n{USAGE}")));
    }
    let bw = matches!(o.test, Test::WriteBw | Test::SendBw);
    o.size = size.unwrap_or(if bw { 65536 } else { 8 });
    o.iters = iters.unwrap_or(if bw { 5000 } else { 1000 });
    check(o.size, o.iters, o.window)?;
    Ok(o)
}

/// The limits a run's parameters must keep (also applied to what the client sends the server).
fn check(size: u32, iters: u32, window: u32) -> io::Result<()> {
    if size == 0 || size > MAX_SIZE {
        return Err(bad(format!("size must be 1..={MAX_SIZE}")));
    }
    if iters < 5 {
        return Err(bad("iters must be at least 5"));
    }
    if window == 0 || window > MAX_WINDOW {
        return Err(bad(format!("tx depth must be 1..={MAX_WINDOW}")));
    }
    Ok(())
}

/// Slots a bandwidth test cycles through, and their stride.
fn slots(size: u32, window: u32) -> (u64, u64) {
    (u64::from(window.min(128)), u64::from(size.max(64)))
}

fn shape(o: &Opts) -> Shape {
    let (n, stride) = slots(o.size, o.window);
    let need = (2 * u64::from(o.size)).max(n * stride);
    Shape {
        device: o.device,
        gid_index: o.gid_index,
        buf_len: need.next_multiple_of(4096) as usize,
        max_send_wr: o.window.max(16) + 2,
        max_recv_wr: RX_DEPTH + 2,
    }
}

/// Runs the peer program whose crate is `N`: parses the command line, connects, measures, and
/// prints one JSON line (client) or serves (server).
pub fn main<N: Nic>() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match parse(&args).and_then(|o| run::<N>(&o)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}: {e}", N::CRATE);
            ExitCode::FAILURE
        }
    }
}

fn run<N: Nic>(o: &Opts) -> io::Result<()> {
    if o.test.uses_write() && !N::HAS_WRITE {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("{} has no RDMA write: {} cannot be measured through it", N::CRATE, o.test.name()),
        ));
    }
    let (mut tcp, o) = if let Some(addr) = o.server {
        let listener = TcpListener::bind(addr)?;
        let (mut tcp, _) = listener.accept()?;
        let mut p = [0u8; 13];
        tcp.read_exact(&mut p)?;
        let test = Test::from_code(p[0]).ok_or_else(|| bad("unknown test from the client"))?;
        let word = |i: usize| u32::from_le_bytes([p[i], p[i + 1], p[i + 2], p[i + 3]]);
        let (size, iters, window) = (word(1), word(5), word(9));
        check(size, iters, window)?;
        (tcp, Opts { test, size, iters, window, ..o.clone() })
    } else {
        let addr = o.connect.ok_or_else(|| bad(USAGE))?;
        let mut tcp = connect_retrying(addr)?;
        let mut p = [0u8; 13];
        p[0] = o.test.code();
        p[1..5].copy_from_slice(&o.size.to_le_bytes());
        p[5..9].copy_from_slice(&o.iters.to_le_bytes());
        p[9..13].copy_from_slice(&o.window.to_le_bytes());
        tcp.write_all(&p)?;
        (tcp, o.clone())
    };
    tcp.set_nodelay(true)?;
    tcp.set_read_timeout(Some(STUCK * 2))?;
    let shape = shape(&o);
    let mut nic = N::open(shape)?;
    tcp.write_all(&nic.endpoint().encode())?;
    let mut theirs = [0u8; ENDPOINT_LEN];
    tcp.read_exact(&mut theirs)?;
    let remote = Endpoint::decode(&theirs);
    if remote.len < shape.buf_len as u64 {
        return Err(bad(format!("the peer's buffer is {} bytes, {} needed", remote.len, shape.buf_len)));
    }
    nic.connect(&remote, o.gid_index)?;
    let server = o.server.is_some();
    // The receiver of a send test posts its receives before the barrier.
    if o.test == Test::SendBw && server {
        for _ in 0..RX_DEPTH {
            nic.post_recv(RECV, 0, o.size)?;
        }
    }
    if o.test == Test::SendLat {
        nic.post_recv(RECV, 0, o.size)?;
        nic.post_recv(RECV, 0, o.size)?;
    }
    barrier(&mut tcp)?;
    let result = match (o.test, server) {
        (Test::WriteLat, false) => Some(write_lat(&mut nic, &o)?),
        (Test::WriteLat, true) => {
            write_lat_serve(&mut nic, &o)?;
            None
        }
        (Test::SendLat, false) => Some(send_lat(&mut nic, &o)?),
        (Test::SendLat, true) => {
            send_lat_serve(&mut nic, &o)?;
            None
        }
        (Test::WriteBw | Test::SendBw, false) => Some(bandwidth(&mut nic, &o)?),
        (Test::SendBw, true) => {
            send_bw_serve(&mut nic, &o)?;
            None
        }
        (Test::WriteBw, true) => None,
    };
    // The end: each side tells the other it is done, so neither tears its QP down early.
    barrier(&mut tcp)?;
    if let Some(r) = result {
        println!("{}", r.json(N::CRATE, &o));
    }
    Ok(())
}

fn connect_retrying(addr: SocketAddr) -> io::Result<TcpStream> {
    let start = Instant::now();
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => return Ok(s),
            Err(e) if start.elapsed() > STUCK => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn barrier(tcp: &mut TcpStream) -> io::Result<()> {
    tcp.write_all(&[1])?;
    let mut b = [0u8; 1];
    tcp.read_exact(&mut b)
}

const SEND: u64 = 1;
const RECV: u64 = 2;

/// The result of a client's run.
pub enum Measured {
    /// One-way latencies in microseconds (round trip / 2), one per iteration.
    Latency(Vec<f64>),
    /// A stream's average.
    Bandwidth {
        /// Bytes per second.
        bytes_per_sec: f64,
        /// Messages per second.
        msgs_per_sec: f64,
    },
}

impl Measured {
    fn json(&self, krate: &str, o: &Opts) -> String {
        let head = format!(
            "{{\"crate\":\"{krate}\",\"test\":\"{}\",\"bytes\":{},\"iterations\":{}",
            o.test.name(),
            o.size,
            o.iters
        );
        match self {
            Measured::Latency(v) => {
                let mut s = v.clone();
                s.sort_by(f64::total_cmp);
                let n = s.len().max(1) as f64;
                let pct = |q: f64| s[(((q * n).ceil() as usize).saturating_sub(1)).min(s.len() - 1)];
                let avg = s.iter().sum::<f64>() / n;
                format!(
                    "{head},\"t_min\":{:.3},\"t_typical\":{:.3},\"t_avg\":{avg:.3},\"p99\":{:.3}}}",
                    s[0],
                    pct(0.5),
                    pct(0.99)
                )
            }
            Measured::Bandwidth { bytes_per_sec, msgs_per_sec } => format!(
                "{head},\"bw_average_mb_per_sec\":{:.2},\"msg_rate_mpps\":{:.6}}}",
                bytes_per_sec / (1u64 << 20) as f64,
                msgs_per_sec / 1e6
            ),
        }
    }
}

fn stamp(i: u32) -> u8 {
    (i % 250) as u8 + 1
}

/// Waits for one completion, which must be a success.
fn reap<N: Nic>(nic: &mut N) -> io::Result<Wc> {
    let mut wc = [Wc::default(); 1];
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if nic.poll(&mut wc)? == 1 {
            return ok(wc[0]);
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(256) && start.elapsed() > STUCK {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "no completion"));
        }
        std::hint::spin_loop();
    }
}

fn ok(wc: Wc) -> io::Result<Wc> {
    if wc.ok {
        Ok(wc)
    } else {
        Err(io::Error::other(format!("work request {} failed: status {}", wc.wr_id, wc.status)))
    }
}

/// Spins until byte `at` of the buffer is `v`.
fn spin_byte<N: Nic>(nic: &N, at: usize, v: u8) -> io::Result<()> {
    let start = Instant::now();
    let mut spins = 0u32;
    while nic.load(at) != v {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(256) && start.elapsed() > STUCK {
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("byte {at} never became {v}")));
        }
        std::hint::spin_loop();
    }
    Ok(())
}

/// The client of write-lat: writes from the upper half of its buffer into the lower half of
/// the peer's, then waits for the answer in the lower half of its own.
fn write_lat<N: Nic>(nic: &mut N, o: &Opts) -> io::Result<Measured> {
    let (size, last) = (o.size, o.size as usize - 1);
    let src = shape(o).buf_len / 2;
    let inline = size <= nic.max_inline();
    let mut lat = Vec::with_capacity(o.iters as usize);
    for i in 0..o.iters {
        let v = stamp(i);
        nic.store(src + last, v);
        let t = Instant::now();
        nic.post_write(SEND, src, size, 0, inline)?;
        spin_byte(nic, last, v)?;
        lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        reap(nic)?;
    }
    Ok(Measured::Latency(lat))
}

fn write_lat_serve<N: Nic>(nic: &mut N, o: &Opts) -> io::Result<()> {
    let (size, last) = (o.size, o.size as usize - 1);
    let src = shape(o).buf_len / 2;
    let inline = size <= nic.max_inline();
    for i in 0..o.iters {
        let v = stamp(i);
        spin_byte(nic, last, v)?;
        nic.store(src + last, v);
        nic.post_write(SEND, src, size, 0, inline)?;
        reap(nic)?;
    }
    Ok(())
}

/// Completions of a ping-pong that came before they were waited for.
#[derive(Default)]
struct Banked {
    recvs: u32,
    sends: u32,
}

impl Banked {
    fn wait<N: Nic>(&mut self, nic: &mut N, recvs: u32, sends: u32) -> io::Result<()> {
        while self.recvs < recvs || self.sends < sends {
            let wc = reap(nic)?;
            if wc.wr_id == RECV {
                self.recvs += 1;
            } else {
                self.sends += 1;
            }
        }
        self.recvs -= recvs;
        self.sends -= sends;
        Ok(())
    }
}

fn send_lat<N: Nic>(nic: &mut N, o: &Opts) -> io::Result<Measured> {
    let inline = o.size <= nic.max_inline();
    let src = shape(o).buf_len / 2;
    let mut lat = Vec::with_capacity(o.iters as usize);
    let mut banked = Banked::default();
    for _ in 0..o.iters {
        let t = Instant::now();
        nic.post_send(SEND, src, o.size, inline)?;
        banked.wait(nic, 1, 1)?;
        lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        nic.post_recv(RECV, 0, o.size)?;
    }
    Ok(Measured::Latency(lat))
}

fn send_lat_serve<N: Nic>(nic: &mut N, o: &Opts) -> io::Result<()> {
    let inline = o.size <= nic.max_inline();
    let src = shape(o).buf_len / 2;
    let mut banked = Banked::default();
    for _ in 0..o.iters {
        banked.wait(nic, 1, 0)?;
        nic.post_recv(RECV, 0, o.size)?;
        nic.post_send(SEND, src, o.size, inline)?;
        banked.wait(nic, 0, 1)?;
    }
    Ok(())
}

/// The sender of write-bw and send-bw.
fn bandwidth<N: Nic>(nic: &mut N, o: &Opts) -> io::Result<Measured> {
    let (n, stride) = slots(o.size, o.window);
    let window = u64::from(o.window);
    let iters = u64::from(o.iters);
    let mut wcs = [Wc::default(); 16];
    let (mut posted, mut done) = (0u64, 0u64);
    let mut last_progress = Instant::now();
    let start = Instant::now();
    while done < iters {
        while posted < iters && posted - done < window {
            let off = (posted % n) * stride;
            match o.test {
                Test::WriteBw => nic.post_write(SEND, off as usize, o.size, off, false)?,
                _ => nic.post_send(SEND, off as usize, o.size, false)?,
            }
            posted += 1;
        }
        let got = nic.poll(&mut wcs)?;
        if got == 0 {
            if last_progress.elapsed() > STUCK {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "no completion"));
            }
            continue;
        }
        last_progress = Instant::now();
        for wc in &wcs[..got] {
            ok(*wc)?;
            done += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    Ok(Measured::Bandwidth {
        bytes_per_sec: iters as f64 * f64::from(o.size) / secs,
        msgs_per_sec: iters as f64 / secs,
    })
}

/// The receiver of send-bw: counts `iters` receives, keeping [`RX_DEPTH`] posted.
fn send_bw_serve<N: Nic>(nic: &mut N, o: &Opts) -> io::Result<()> {
    let mut wcs = [Wc::default(); 16];
    let mut got_all = 0u32;
    let mut last_progress = Instant::now();
    while got_all < o.iters {
        let got = nic.poll(&mut wcs)?;
        if got == 0 {
            if last_progress.elapsed() > STUCK {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "no message"));
            }
            continue;
        }
        last_progress = Instant::now();
        for wc in &wcs[..got] {
            ok(*wc)?;
            got_all += 1;
            nic.post_recv(RECV, 0, o.size)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_round_trips() {
        let e = Endpoint { qpn: 17, psn: 0xabcdef, lid: 3, gid: [9; 16], addr: 1 << 40, rkey: 77, len: 4096 };
        assert_eq!(Endpoint::decode(&e.encode()), e);
    }

    #[test]
    fn parse_defaults_and_limits() {
        let args = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        let o = parse(&args("write-bw --connect 10.0.0.1:1 -s 8")).unwrap();
        assert_eq!((o.size, o.iters, o.window), (8, 5000, 128));
        assert!(parse(&args("write-bw --connect 10.0.0.1:1 -s 0")).is_err());
        assert!(parse(&args("write-lat -n 3 --server 0.0.0.0:1")).is_err());
        assert!(parse(&args("write-lat")).is_err());
    }
}
