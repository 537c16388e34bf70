//! Setting up the two sides of a measurement: a loopback pair in one process, or a
//! client and a server connected by address (`rdmakit::cm`: rdma_cm on verbs, the soft
//! NIC's TCP bootstrap on soft).

use std::net::SocketAddr;
use std::time::Duration;

use rdmakit_verbs::cm::{self, CmOptions};
use rdmakit_verbs::*;

/// Which test the client asks the server to serve (sent in the connect's private data).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Test {
    /// RDMA write ping-pong; half the round trip, as `ib_write_lat`.
    WriteLat,
    /// RDMA write bandwidth with a window of outstanding writes, as `ib_write_bw`.
    WriteBw,
    /// One RDMA read's round trip, as `ib_read_lat`.
    ReadLat,
    /// RDMA read bandwidth.
    ReadBw,
    /// Send bandwidth into posted receives, as `ib_send_bw`.
    SendBw,
    /// Send/receive ping-pong; half the round trip, as `ib_send_lat`.
    SendLat,
    /// One atomic's round trip, as `ib_atomic_lat`.
    AtomicLat,
    /// Atomic message rate with a window.
    AtomicBw,
    /// Pipe `rwrite` ping-pong (rdmakit-channel); half the round trip.
    PipeLat,
    /// Pipe `rwrite` bandwidth with a window of writes in flight, the reader releasing.
    PipeBw,
    /// Persistent put-handle ping-pong; half the round trip.
    PutLat,
}

impl Test {
    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn from_code(c: u8) -> Option<Test> {
        use Test::*;
        [WriteLat, WriteBw, ReadLat, ReadBw, SendBw, SendLat, AtomicLat, AtomicBw, PipeLat, PipeBw, PutLat]
            .get(usize::from(c))
            .copied()
    }

    pub fn name(self) -> &'static str {
        match self {
            Test::WriteLat => "write-lat",
            Test::WriteBw => "write-bw",
            Test::ReadLat => "read-lat",
            Test::ReadBw => "read-bw",
            Test::SendBw => "send-bw",
            Test::SendLat => "send-lat",
            Test::AtomicLat => "atomic-lat",
            Test::AtomicBw => "atomic-bw",
            Test::PipeLat => "pipe-lat",
            Test::PipeBw => "pipe-bw",
            Test::PutLat => "put-lat",
        }
    }

    pub fn is_latency(self) -> bool {
        matches!(
            self,
            Test::WriteLat | Test::ReadLat | Test::SendLat | Test::AtomicLat | Test::PipeLat | Test::PutLat
        )
    }

    /// Atomics move 8 bytes, always (perftest refuses another size).
    pub fn is_atomic(self) -> bool {
        matches!(self, Test::AtomicLat | Test::AtomicBw)
    }

    /// Runs on rdmakit-channel (pipes, put handles) rather than raw verbs.
    pub fn is_channel(self) -> bool {
        matches!(self, Test::PipeLat | Test::PipeBw | Test::PutLat)
    }
}

/// Where the atomic target lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// Host memory.
    Host,
    /// NIC device memory (MEMIC on mlx5, emulated on the soft NIC).
    Memic,
}

/// What a test needs from the two sides.
#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub test: Test,
    /// Message size; with `all`, the largest of the sweep (what buffers are sized for).
    pub size: u32,
    /// Iterations per QP (per size with `all`); ignored when `duration` is set.
    pub iters: u32,
    /// Send queue depth: operations kept outstanding by bandwidth tests (perftest's `-t`).
    pub window: u32,
    /// Receives kept posted by the receiver of send tests (perftest's `-r`).
    pub rx_depth: u32,
    /// Messages up to this size go inline (perftest's `-I`).
    pub inline: u32,
    /// Queue pairs (connections) run at once (perftest's `-q`).
    pub qps: u32,
    /// Both sides send at once (perftest's `-b`).
    pub bidir: bool,
    /// Sweep the sizes 2, 4, ..., 2^23 (perftest's `-a`).
    pub all: bool,
    /// This is one size of such a sweep ([`Params::at`]; never sent to the peer, which
    /// makes its own from `all`).
    pub in_sweep: bool,
    /// Run for this many seconds instead of `iters` (perftest's `-D`); 0 = by iterations.
    pub duration: u16,
    /// Seconds left out of the measurement at each end of a timed run (perftest's `-f`).
    pub margin: u16,
    /// Bandwidth tests ask for a completion every `cq_mod` operations (perftest's `-Q`);
    /// 0 = perftest's default rule ([`Params::cq_mod_at`]).
    pub cq_mod: u32,
    /// `put-lat`: the handles detect puts by CkDirect's sentinel (one write per put)
    /// instead of a sequence word.
    pub sentinel: bool,
    pub placement: Placement,
}

/// The sizes perftest's `-a` sweeps: 2^1 to 2^23.
pub fn sweep_sizes() -> impl Iterator<Item = u32> {
    (1..24).map(|i| 1u32 << i)
}

impl Params {
    /// The default for tests and the suite: perftest's defaults for everything but size,
    /// iterations and window.
    pub fn simple(test: Test, size: u32, iters: u32, window: u32, placement: Placement) -> Params {
        Params {
            test,
            size,
            iters,
            window,
            rx_depth: 512,
            inline: 0,
            qps: 1,
            bidir: false,
            all: false,
            in_sweep: false,
            duration: 0,
            margin: 0,
            cq_mod: 0,
            sentinel: false,
            placement,
        }
    }

    /// The message sizes this run measures, one result row each.
    pub fn sizes(&self) -> Vec<u32> {
        if self.all { sweep_sizes().collect() } else { vec![self.size] }
    }

    /// This run at one size of its sweep.
    pub fn at(&self, size: u32) -> Params {
        Params { size, all: false, in_sweep: self.all || self.in_sweep, ..*self }
    }

    /// Operations per requested completion in a bandwidth test of `size`-byte messages
    /// (`events`: the test sleeps on the completion channel). As perftest: what `-Q` asked
    /// for, else 100, except for messages over 8 KiB in a polling run of one size, which
    /// ask for every completion; never more than the send queue depth.
    pub fn cq_mod_at(&self, size: u32, events: bool) -> u32 {
        let asked = match self.cq_mod {
            0 if size > CQ_MOD_SIZE_LIMIT && !self.all && !self.in_sweep && !events => 1,
            0 => DEFAULT_CQ_MOD,
            n => n,
        };
        asked.clamp(1, self.window.max(1))
    }

    /// 25 bytes of private data: test, placement, size, iterations, window, rx depth,
    /// inline size, QPs, flags (bidirectional, all sizes, sentinel puts), duration, margin, CQ
    /// moderation.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![self.test.code(), self.placement as u8];
        b.extend_from_slice(&self.size.to_le_bytes());
        b.extend_from_slice(&self.iters.to_le_bytes());
        b.extend_from_slice(&self.window.to_le_bytes());
        b.extend_from_slice(&(self.rx_depth.min(u32::from(u16::MAX)) as u16).to_le_bytes());
        b.extend_from_slice(&(self.inline.min(u32::from(u16::MAX)) as u16).to_le_bytes());
        b.push(self.qps.min(255) as u8);
        b.push(u8::from(self.bidir) | (u8::from(self.all) << 1) | (u8::from(self.sentinel) << 2));
        b.extend_from_slice(&self.duration.to_le_bytes());
        b.push(self.margin.min(255) as u8);
        b.extend_from_slice(&(self.cq_mod.min(u32::from(u16::MAX)) as u16).to_le_bytes());
        debug_assert_eq!(b.len(), Params::ENCODED_LEN);
        b
    }

    /// Length of [`Params::encode`]'s output.
    pub const ENCODED_LEN: usize = 25;

    /// Decodes and checks what a client asked for (a peer may send anything).
    pub fn decode(b: &[u8]) -> Result<Params, String> {
        if b.len() < Params::ENCODED_LEN {
            return Err(format!("test parameters: {} bytes, need {}", b.len(), Params::ENCODED_LEN));
        }
        let u = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4"));
        let h = |i: usize| u16::from_le_bytes(b[i..i + 2].try_into().expect("2"));
        let test = Test::from_code(b[0]).ok_or_else(|| format!("unknown test code {}", b[0]))?;
        let placement = match b[1] {
            0 => Placement::Host,
            1 => Placement::Memic,
            p => return Err(format!("unknown placement {p}")),
        };
        if b[19] > 0b111 {
            return Err(format!("unknown flags {:#04x}", b[19]));
        }
        let p = Params {
            test,
            placement,
            size: u(2),
            iters: u(6),
            window: u(10),
            rx_depth: u32::from(h(14)),
            inline: u32::from(h(16)),
            qps: u32::from(b[18]),
            bidir: b[19] & 1 != 0,
            all: b[19] & 2 != 0,
            in_sweep: false,
            sentinel: b[19] & 4 != 0,
            duration: h(20),
            margin: u16::from(b[22]),
            cq_mod: u32::from(h(23)),
        };
        if p.size == 0 || p.size > MAX_SIZE {
            return Err(format!("message size {} out of 1..={MAX_SIZE}", p.size));
        }
        if p.qps == 0 || p.qps > MAX_QPS {
            return Err(format!("{} QPs out of 1..={MAX_QPS}", p.qps));
        }
        if p.window == 0 || p.window > MAX_DEPTH || p.rx_depth == 0 || p.rx_depth > MAX_DEPTH {
            return Err(format!("queue depths {}/{} out of 1..={MAX_DEPTH}", p.window, p.rx_depth));
        }
        if p.test.is_latency() && p.iters > MAX_LAT_ITERS {
            return Err(format!("{} iterations of a latency test, over {MAX_LAT_ITERS}", p.iters));
        }
        // As the CLI's own check: the sample window lies between the two margins.
        if p.duration > 0 && p.duration <= 2 * p.margin {
            return Err(format!(
                "duration {} s is not more than twice the margin ({} s)",
                p.duration, p.margin
            ));
        }
        p.combination_error().map_or(Ok(p), Err)
    }

    /// What the CLI refuses about this combination of test and flags, if anything: a
    /// server applies the same rules to what a client sends, which never went through the
    /// CLI's checks if the client is not `rdmakit-perf` (a pipe test on 64 QPs, say).
    pub fn combination_error(&self) -> Option<String> {
        let t = self.test;
        let raw_bw = matches!(t, Test::WriteBw | Test::ReadBw | Test::SendBw | Test::AtomicBw);
        if t.is_atomic() && (self.size != 8 || self.all) {
            return Some(format!("{}: atomics move 8 bytes, at one size", t.name()));
        }
        if self.sentinel && (t != Test::PutLat || self.all || !self.size.is_multiple_of(8)) {
            return Some("sentinel puts are for put-lat at one size that is a multiple of 8".into());
        }
        if t == Test::PutLat && self.size < 8 {
            return Some("put-lat moves at least 8 bytes".into());
        }
        if t.is_channel() && (self.all || self.duration > 0) {
            return Some(format!("{}: no sweep or timed run for a channel test", t.name()));
        }
        if !raw_bw && (self.bidir || self.qps != 1) {
            return Some(format!("{}: bidirectional runs and several QPs are for bandwidth tests", t.name()));
        }
        None
    }
}

/// perftest's default CQ moderation (`DEF_CQ_MOD`).
pub const DEFAULT_CQ_MOD: u32 = 100;
/// Above this message size perftest turns its default moderation off in a polling run of
/// one size (`MSG_SIZE_CQ_MOD_LIMIT`).
const CQ_MOD_SIZE_LIMIT: u32 = 8192;

/// The send and receive queue depths a server offers.
const SERVER_DEPTH: u32 = 2048;

/// Most QPs `-q` may ask for.
pub const MAX_QPS: u32 = 64;

/// Most iterations of a latency test: it keeps a time stamp per iteration (16 bytes each,
/// 1.6 GB at this bound), which a larger `-n` would ask memory for before the test starts.
pub const MAX_LAT_ITERS: u32 = 100_000_000;
/// Deepest send or receive queue `-t`/`-r` may ask for.
pub const MAX_DEPTH: u32 = 8192;

/// One side's view: its QP, CQ, local buffer, and the peer's buffer.
pub struct Side {
    /// Keeps the PD (and the device) alive for the regions above.
    pub _pd: ProtectionDomain,
    pub qp: QueuePair,
    pub cq: CompletionQueue,
    /// Local buffer: source of writes and sends, destination of reads and receives.
    pub buf: MemoryRegion,
    /// The peer's buffer (and atomic target, at offset 0 of `peer_atomic`).
    pub peer_buf: RemoteRegion,
    pub peer_atomic: RemoteRegion,
    /// Keeps the connection (and with it the peer's resources) up; `None` in loopback.
    pub conn: Option<cm::Connection>,
    /// Local atomic target (what the peer's atomics hit), kept alive.
    pub _atomic: MemoryRegion,
    /// Receives posted on this QP and not yet consumed (they outlive one size of a sweep).
    pub posted_recvs: std::sync::atomic::AtomicU32,
    /// The receive `measure` keeps posting (the whole buffer), prepared on first use.
    pub recv: std::sync::OnceLock<PreparedRecv>,
}

/// Bytes at the end of every buffer for the peer's report in bidirectional runs.
pub const REPORT_LEN: usize = 64;

/// A buffer's message slots cycle through at most this many bytes (as perftest's cyclic
/// buffer), so large windows of large messages need no gigabytes.
const CYCLE: usize = 4 << 20;

/// Slots of `size` bytes (each at least 64) that a buffer of `len` bytes holds.
pub fn slots(len: usize, size: u32) -> usize {
    (len.saturating_sub(REPORT_LEN) / (size as usize).max(64)).max(1)
}

pub fn buffer_len(p: &Params) -> usize {
    // Two slots at least: latency tests write from one half and poll the other.
    let stride = (p.size as usize).max(64);
    let slots = (p.window as usize).min(CYCLE / stride).clamp(2, 64);
    stride * slots + REPORT_LEN
}

/// The largest buffer any client's parameters need (what a server offers).
pub fn max_buffer_len() -> usize {
    (MAX_SIZE as usize) * 2 + REPORT_LEN
}

fn atomic_target(ctx: &Context, pd: &ProtectionDomain, placement: Placement) -> Result<MemoryRegion> {
    match placement {
        Placement::Host => pd.alloc_mr(64, AccessFlags::ALL_REMOTE),
        Placement::Memic => {
            let dm = ctx.alloc_dm(64)?;
            pd.register_dm(&dm, 0, 64, AccessFlags::ALL_REMOTE)
        }
    }
}

fn qp_caps(p: &Params) -> QpCaps {
    // Room for a pipe's or put endpoint's posted receives and inline control messages, and
    // for the bidirectional report (an inline write of up to REPORT_LEN bytes).
    QpCaps::default()
        .with_max_send_wr((p.window + 8).max(256))
        .with_max_recv_wr((p.rx_depth + 8).max(160))
        .with_max_inline_data(p.inline.max(REPORT_LEN as u32))
}

fn cqe(p: &Params) -> u32 {
    (p.window + p.rx_depth + 16).max(1024)
}

/// Two connected sides in this process.
pub fn loopback(ctx: &Context, p: &Params, opts: &ConnectOptions) -> Result<(Side, Side)> {
    let pd = ctx.alloc_pd()?;
    let mk = || -> Result<(QueuePair, CompletionQueue, MemoryRegion, MemoryRegion)> {
        let cq = ctx.create_cq(cqe(p))?;
        let qp = pd.create_qp(&cq, &cq, qp_caps(p))?;
        let buf = pd.alloc_mr(buffer_len(p), AccessFlags::ALL_REMOTE)?;
        let atomic = atomic_target(ctx, &pd, p.placement)?;
        Ok((qp, cq, buf, atomic))
    };
    let (qa, ca, ba, aa) = mk()?;
    let (qb, cb, bb, ab) = mk()?;
    qa.connect(&qb.address_with(opts)?, opts)?;
    qb.connect(&qa.address_with(opts)?, opts)?;
    let a = Side {
        _pd: pd.clone(),
        qp: qa,
        cq: ca,
        peer_buf: bb.remote(),
        peer_atomic: ab.remote(),
        buf: ba,
        conn: None,
        _atomic: aa,
        posted_recvs: 0.into(),
        recv: std::sync::OnceLock::new(),
    };
    let b = Side {
        _pd: pd,
        qp: qb,
        cq: cb,
        peer_buf: a.buf.remote(),
        peer_atomic: a._atomic.remote(),
        buf: bb,
        conn: None,
        _atomic: ab,
        posted_recvs: 0.into(),
        recv: std::sync::OnceLock::new(),
    };
    Ok((a, b))
}

/// 40 bytes: the buffer and atomic-target descriptors.
fn regions(buf: &MemoryRegion, atomic: &MemoryRegion) -> Vec<u8> {
    let mut d = buf.remote().encode().to_vec();
    d.extend_from_slice(&atomic.remote().encode());
    d
}

fn peer_regions(d: &[u8]) -> Result<(RemoteRegion, RemoteRegion)> {
    let n = RemoteRegion::ENCODED_LEN;
    if d.len() < 2 * n {
        return Err(Error::Malformed { what: "peer regions", reason: format!("{} bytes", d.len()) });
    }
    Ok((RemoteRegion::decode(&d[..n])?, RemoteRegion::decode(&d[n..2 * n])?))
}

fn cm_options(p: &Params, opts: &ConnectOptions) -> CmOptions {
    CmOptions::default()
        .with_caps(qp_caps(p))
        .with_cqe(cqe(p))
        .with_connect(*opts)
        .with_timeout(Duration::from_secs(30))
}

/// Client side: connects to `addr`, telling the server which test to serve.
pub fn client(ctx: &Context, addr: SocketAddr, p: &Params, opts: &ConnectOptions) -> Result<Side> {
    let pd = ctx.alloc_pd()?;
    let buf = pd.alloc_mr(buffer_len(p), AccessFlags::ALL_REMOTE)?;
    let atomic = atomic_target(ctx, &pd, Placement::Host)?;
    let mut data = p.encode();
    data.extend_from_slice(&buf.remote().encode());
    let conn = cm::connect(&pd, addr, &cm_options(p, opts), &data)?;
    let (peer_buf, peer_atomic) = peer_regions(conn.peer_private_data())?;
    Ok(Side {
        _pd: pd,
        qp: conn.qp().clone(),
        cq: conn.cq().clone(),
        buf,
        peer_buf,
        peer_atomic,
        conn: Some(conn),
        _atomic: atomic,
        posted_recvs: 0.into(),
        recv: std::sync::OnceLock::new(),
    })
}

/// Server side: accepts one client and returns its parameters and the connected side.
/// The server's `placement` decides where the atomic target lives.
/// Whether an error accepting a connection is the client's (a handshake that failed, a
/// malformed or refused request, a client that went silent), after which a server takes the
/// next connection, rather than this side's (its device, its memory).
pub fn a_client_failed(e: &Error) -> bool {
    matches!(
        e,
        Error::Os { .. }
            | Error::Malformed { .. }
            | Error::Timeout(_)
            | Error::ConnectionRejected { .. }
            | Error::InvalidArgument(_)
            | Error::PermissionDenied(_)
    )
}

/// Runs `accept` until it gives a client: a connection that fails on the client's side
/// ([`a_client_failed`]: a port scan, a malformed request) is said on stderr (`what` names
/// the server) and dropped, and the server waits for the next; anything else is returned.
pub fn first_client<T>(what: &str, mut accept: impl FnMut() -> Result<T>) -> Result<T> {
    loop {
        match accept() {
            Ok(x) => return Ok(x),
            Err(e) if a_client_failed(&e) => {
                eprintln!(
                    "rdmakit-perf: {what}: a connection failed before its test began: {e}; waiting for the next"
                );
                // A listener failing at once (out of descriptors) must not spin a core.
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Accepts one QP of a client's test on `listener` (waiting at most `wait` for it, or for
/// ever), reads the client's request and answers with this side's regions.
pub fn server(
    ctx: &Context,
    listener: &cm::Listener,
    opts: &ConnectOptions,
    placement: Placement,
    wait: Option<std::time::Duration>,
) -> Result<(Params, Side)> {
    // The client's parameters come with its request, but the server's buffer must exist
    // before it answers: size it for the largest test the CLI allows.
    // Deep enough queues for perftest's defaults and more; the loops clamp a client's
    // depths to what this QP has. Inline up to 256 bytes covers perftest's latency defaults.
    let max = Params {
        rx_depth: SERVER_DEPTH,
        inline: 256,
        ..Params::simple(Test::WriteBw, MAX_SIZE, 1, SERVER_DEPTH, Placement::Host)
    };
    let pd = ctx.alloc_pd()?;
    let buf = pd.alloc_mr(max_buffer_len(), AccessFlags::ALL_REMOTE)?;
    let atomic = atomic_target(ctx, &pd, placement)?;
    // The request is read before it is answered: a malformed one is refused (the client's
    // connect fails), and a test that sends to the server finds its receives posted.
    let mut asked = None;
    let conn =
        listener.accept_with(&pd, &cm_options(&max, opts), &regions(&buf, &atomic), wait, |qp, d| {
            let (p, peer_buf) = parse_request(d)?;
            let preposted = crate::measure::prepost_recvs(qp, &buf, &p)?;
            asked = Some((p, peer_buf, preposted));
            Ok(())
        })?;
    let (p, peer_buf, preposted) =
        asked.ok_or_else(|| Error::InvalidArgument("accepted without reading the request".into()))?;
    let (recv, posted) = match preposted {
        Some((r, n)) => (std::sync::OnceLock::from(r), n),
        None => (std::sync::OnceLock::new(), 0),
    };
    let side = Side {
        _pd: pd,
        qp: conn.qp().clone(),
        cq: conn.cq().clone(),
        buf,
        peer_buf,
        // The client's atomic target is never used by the server.
        peer_atomic: peer_buf,
        conn: Some(conn),
        _atomic: atomic,
        posted_recvs: posted.into(),
        recv,
    };
    Ok((p, side))
}

/// A client's request (its private data): the test parameters, then its buffer.
fn parse_request(d: &[u8]) -> Result<(Params, RemoteRegion)> {
    let p = Params::decode(d).map_err(|reason| Error::Malformed { what: "test parameters", reason })?;
    let at = Params::ENCODED_LEN;
    let buf = d.get(at..at + RemoteRegion::ENCODED_LEN).ok_or_else(|| Error::Malformed {
        what: "test parameters",
        reason: format!("{} bytes, no buffer descriptor", d.len()),
    })?;
    let buf = RemoteRegion::decode(buf)?;
    // A bidirectional run's report lands in the last bytes of the client's buffer.
    if p.bidir && buf.len < REPORT_LEN as u64 {
        return Err(Error::Malformed {
            what: "test parameters",
            reason: format!("a buffer of {} bytes, under the report's {REPORT_LEN}", buf.len),
        });
    }
    Ok((p, buf))
}

/// Largest message size the CLI accepts.
pub const MAX_SIZE: u32 = 8 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_request_is_refused_before_it_is_answered() {
        let ctx = Context::open_soft();
        let listener = cm::Listener::bind(&ctx, "127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            server(&ctx, &listener, &ConnectOptions::default(), Placement::Host, None).map(drop)
        });
        let pd = Context::open_soft().alloc_pd().unwrap();
        let opts = CmOptions::default().with_timeout(Duration::from_secs(10));
        let client = cm::connect(&pd, addr, &opts, b"not a test request");
        assert!(client.is_err(), "a malformed request was answered");
        match server.join().unwrap() {
            Err(Error::Malformed { what: "test parameters", .. }) => {}
            other => panic!("the server gave {other:?}"),
        }
    }
}
