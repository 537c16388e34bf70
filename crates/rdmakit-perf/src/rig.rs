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
        [WriteLat, WriteBw, ReadLat, ReadBw, SendBw, AtomicLat, AtomicBw, PipeLat, PipeBw, PutLat]
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
            Test::AtomicLat => "atomic-lat",
            Test::AtomicBw => "atomic-bw",
            Test::PipeLat => "pipe-lat",
            Test::PipeBw => "pipe-bw",
            Test::PutLat => "put-lat",
        }
    }

    pub fn is_latency(self) -> bool {
        matches!(self, Test::WriteLat | Test::ReadLat | Test::AtomicLat | Test::PipeLat | Test::PutLat)
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
    pub size: u32,
    pub iters: u32,
    pub window: u32,
    pub placement: Placement,
}

impl Params {
    /// 14 bytes of private data: test, placement, size, iterations, window.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![self.test.code(), self.placement as u8];
        b.extend_from_slice(&self.size.to_le_bytes());
        b.extend_from_slice(&self.iters.to_le_bytes());
        b.extend_from_slice(&self.window.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Params, String> {
        if b.len() < 14 {
            return Err(format!("test parameters: {} bytes, need 14", b.len()));
        }
        let u = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4"));
        let test = Test::from_code(b[0]).ok_or_else(|| format!("unknown test code {}", b[0]))?;
        let placement = match b[1] {
            0 => Placement::Host,
            1 => Placement::Memic,
            p => return Err(format!("unknown placement {p}")),
        };
        Ok(Params { test, placement, size: u(2), iters: u(6), window: u(10) })
    }
}

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
}

pub fn buffer_len(p: &Params) -> usize {
    // Two slots at least: latency tests write from one half and poll the other.
    (p.size as usize).max(64) * (p.window as usize).clamp(2, 64)
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
    let depth = (p.window + 8).max(16);
    // Room for a pipe's or put endpoint's posted receives and inline control messages.
    QpCaps {
        max_send_wr: depth.max(256),
        max_recv_wr: depth.max(160),
        max_inline_data: 64,
        ..QpCaps::default()
    }
}

fn cqe(p: &Params) -> u32 {
    (p.window * 2 + 16).max(1024)
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
    qa.connect(&qb.endpoint_with(opts)?, opts)?;
    qb.connect(&qa.endpoint_with(opts)?, opts)?;
    let a = Side {
        _pd: pd.clone(),
        qp: qa,
        cq: ca,
        peer_buf: bb.remote(),
        peer_atomic: ab.remote(),
        buf: ba,
        conn: None,
        _atomic: aa,
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
    CmOptions { caps: qp_caps(p), cqe: cqe(p), connect: *opts, timeout: Duration::from_secs(30) }
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
    })
}

/// Server side: accepts one client and returns its parameters and the connected side.
/// The server's `placement` decides where the atomic target lives.
pub fn server(
    ctx: &Context,
    listener: &cm::Listener,
    opts: &ConnectOptions,
    placement: Placement,
) -> Result<(Params, Side)> {
    // The client's parameters come with its request, but the server's buffer must exist
    // before it answers: size it for the largest test the CLI allows.
    let max =
        Params { test: Test::WriteBw, size: MAX_SIZE, iters: 1, window: 64, placement: Placement::Host };
    let pd = ctx.alloc_pd()?;
    let buf = pd.alloc_mr(buffer_len(&max), AccessFlags::ALL_REMOTE)?;
    let atomic = atomic_target(ctx, &pd, placement)?;
    let conn = listener.accept(&pd, &cm_options(&max, opts), &regions(&buf, &atomic))?;
    let d = conn.peer_private_data();
    let p = Params::decode(d).map_err(|reason| Error::Malformed { what: "test parameters", reason })?;
    let peer_buf = RemoteRegion::decode(&d[14..14 + RemoteRegion::ENCODED_LEN])?;
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
    };
    Ok((p, side))
}

/// Largest message size the CLI accepts.
pub const MAX_SIZE: u32 = 8 << 20;
