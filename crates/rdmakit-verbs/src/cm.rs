//! Connections by address: listen, accept and connect by IP and port, with private data.
//!
//! One API over both providers:
//! - **verbs**: librdmacm (`rdma_cm`). The address picks the device; the PD given to
//!   [`Listener::accept`] or [`connect`] must be on that device.
//! - **soft**: a TCP bootstrap connection to the listener's address carries the same
//!   handshake (endpoints and private data), then the QPs talk over the soft NIC's own
//!   wire (in-process, or TCP between processes).
//!
//! The private data (at most [`MAX_PRIVATE_DATA`] bytes) typically carries a
//! [`RemoteRegion`](crate::RemoteRegion) descriptor. On verbs, InfiniBand and RoCE carry
//! it in fixed-size fields, so the peer receives it **zero-padded** (56 bytes with a
//! request, up to 196 with a reply): encode lengths yourself if you need them. The soft
//! provider delivers exactly what was sent.
//!
//! Users with their own bootstrap keep using [`QueuePair::endpoint`] and
//! [`QueuePair::connect`] directly.
//!
//! # Examples
//! ```
//! use rdmakit_verbs::{cm, AccessFlags, Context, SendWr, RemoteRegion};
//! let ctx = Context::open_soft();
//! let pd = ctx.alloc_pd()?;
//! let listener = cm::Listener::bind(&ctx, "127.0.0.1:0".parse().unwrap())?;
//! let addr = listener.local_addr()?;
//! let server = std::thread::spawn({
//!     let pd = pd.clone();
//!     move || -> rdmakit_verbs::Result<_> {
//!         let mr = pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
//!         let conn = listener.accept(&pd, &cm::CmOptions::default(), &mr.remote().encode())?;
//!         conn.wait_disconnected(std::time::Duration::from_secs(10))?;
//!         mr.to_vec()
//!     }
//! });
//! let conn = cm::connect(&pd, addr, &cm::CmOptions::default(), b"hello")?;
//! let region = RemoteRegion::decode(&conn.peer_private_data()[..RemoteRegion::ENCODED_LEN])?;
//! let src = pd.alloc_mr(5, AccessFlags::LOCAL_WRITE)?;
//! src.write_at(0, b"hello")?;
//! conn.qp().post_send(SendWr::write(src.local()?, region.slice(0, 5)?))?;
//! conn.cq().wait(None)?.ok()?;
//! conn.disconnect()?;
//! assert_eq!(&server.join().unwrap()?[..5], b"hello");
//! # Ok::<(), rdmakit_verbs::Error>(())
//! ```

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::cq::CompletionQueue;
use crate::device::{Context, CtxBackend};
use crate::error::{Error, Result};
use crate::pd::ProtectionDomain;
use crate::qp::QueuePair;
use crate::types::{ConnectOptions, Endpoint, ProviderKind, QpCaps};

/// The most private data a connect, accept or reject carries (the rdma_cm limit for a
/// connect request on InfiniBand and RoCE).
pub const MAX_PRIVATE_DATA: usize = 56;

/// How connections are set up.
///
/// Start from [`Default`] and change what you need with the `with_*` setters (the struct is
/// `#[non_exhaustive]`, so fields can be added without breaking you).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CmOptions {
    /// Queue sizes of the connection's QP.
    pub caps: QpCaps,
    /// Entries of the connection's CQ (shared by its send and receive queues).
    pub cqe: u32,
    /// QP attributes (timeouts, retries, access). On verbs, path and GID come from the CM.
    pub connect: ConnectOptions,
    /// How long resolving, connecting or accepting (once a request came) may take.
    pub timeout: Duration,
}

impl Default for CmOptions {
    fn default() -> Self {
        CmOptions {
            caps: QpCaps::default(),
            cqe: 256,
            connect: ConnectOptions::default(),
            timeout: Duration::from_secs(10),
        }
    }
}

impl CmOptions {
    /// Sets [`caps`](Self::caps).
    pub const fn with_caps(mut self, caps: QpCaps) -> Self {
        self.caps = caps;
        self
    }

    /// Sets [`cqe`](Self::cqe).
    pub const fn with_cqe(mut self, cqe: u32) -> Self {
        self.cqe = cqe;
        self
    }

    /// Sets [`connect`](Self::connect).
    pub const fn with_connect(mut self, connect: ConnectOptions) -> Self {
        self.connect = connect;
        self
    }

    /// Sets [`timeout`](Self::timeout).
    pub const fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

pub(crate) fn check_private_data(data: &[u8]) -> Result<()> {
    if data.len() > MAX_PRIVATE_DATA {
        return Err(Error::InvalidArgument(format!(
            "private data is {} bytes; at most {MAX_PRIVATE_DATA} are allowed",
            data.len()
        )));
    }
    Ok(())
}

/// An established connection: a connected QP and its CQ.
///
/// Dropping it disconnects and moves the QP to the error state; the QP handle (a clone)
/// may be kept, but will only flush.
pub struct Connection {
    qp: QueuePair,
    cq: CompletionQueue,
    peer_data: Vec<u8>,
    backend: ConnBackend,
}

enum ConnBackend {
    Soft(TcpStream),
    #[cfg(rdmakit_verbs)]
    Verbs(crate::rdma::cm::CmConn),
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection").field("qp", &self.qp).finish()
    }
}

impl Connection {
    /// The connected QP.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The CQ of the QP's send and receive queues.
    pub fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// What the peer sent with its request or reply (zero-padded on verbs).
    pub fn peer_private_data(&self) -> &[u8] {
        &self.peer_data
    }

    /// Disconnects (`rdma_disconnect` on verbs; closes the bootstrap stream on soft) and
    /// moves the QP to the error state, so outstanding requests flush. Idempotent.
    pub fn disconnect(&self) -> Result<()> {
        match &self.backend {
            ConnBackend::Soft(s) => {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            #[cfg(rdmakit_verbs)]
            ConnBackend::Verbs(c) => c.disconnect()?,
        }
        self.qp.modify_to_error()
    }

    /// Waits until the peer disconnects (or this side did). `Ok(false)` on timeout.
    pub fn wait_disconnected(&self, timeout: Duration) -> Result<bool> {
        let seen = match &self.backend {
            ConnBackend::Soft(s) => wait_eof(s, timeout)?,
            #[cfg(rdmakit_verbs)]
            ConnBackend::Verbs(c) => c.wait_disconnected(timeout)?,
        };
        if seen {
            self.qp.modify_to_error()?;
        }
        Ok(seen)
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if let Err(e) = self.disconnect() {
            tracing::debug!(error = %e, "disconnect on drop");
        }
    }
}

/// Listens for connections at an address.
pub struct Listener {
    ctx: Context,
    backend: ListenerBackend,
}

enum ListenerBackend {
    Soft(TcpListener),
    #[cfg(rdmakit_verbs)]
    Verbs(crate::rdma::cm::CmListener),
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener").field("addr", &self.local_addr().ok()).finish()
    }
}

impl Listener {
    /// Listens at `addr` (port 0 picks one) for connections to `ctx`'s provider.
    ///
    /// On verbs, bind to an address of the device (`rdma_bind_addr` then `rdma_listen`);
    /// a wildcard address accepts on any device.
    pub fn bind(ctx: &Context, addr: SocketAddr) -> Result<Listener> {
        let backend = match &ctx.inner.backend {
            CtxBackend::Soft(_) => ListenerBackend::Soft(
                TcpListener::bind(addr).map_err(|source| Error::Os { call: "bind", source })?,
            ),
            #[cfg(rdmakit_verbs)]
            CtxBackend::Verbs(_) => {
                let l = crate::rdma::cm::CmListener::bind(addr, 64)?;
                if let Some(dev) = l.device_name()
                    && dev != ctx.name()
                {
                    return Err(Error::InvalidArgument(format!(
                        "{addr} belongs to device {dev}, not {}",
                        ctx.name()
                    )));
                }
                ListenerBackend::Verbs(l)
            }
        };
        Ok(Listener { ctx: ctx.clone(), backend })
    }

    /// The bound address (with the chosen port).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        match &self.backend {
            ListenerBackend::Soft(l) => {
                l.local_addr().map_err(|source| Error::Os { call: "getsockname", source })
            }
            #[cfg(rdmakit_verbs)]
            ListenerBackend::Verbs(l) => l.local_addr(),
        }
    }

    /// The device this listener belongs to.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Waits for the next connection request, creates a QP and CQ on `pd` for it,
    /// connects, and answers with `private_data`. Blocks until a request arrives.
    pub fn accept(&self, pd: &ProtectionDomain, opts: &CmOptions, private_data: &[u8]) -> Result<Connection> {
        self.accept_timeout(pd, opts, private_data, None)
    }

    /// [`accept`](Self::accept), giving up with [`Error::Timeout`] if no request arrives
    /// within `wait`.
    pub fn accept_timeout(
        &self,
        pd: &ProtectionDomain,
        opts: &CmOptions,
        private_data: &[u8],
        wait: Option<Duration>,
    ) -> Result<Connection> {
        check_private_data(private_data)?;
        match &self.backend {
            ListenerBackend::Soft(l) => {
                if pd.context().provider() != ProviderKind::Soft {
                    return Err(Error::InvalidArgument("a soft listener needs a soft PD".into()));
                }
                soft_accept(l, pd, opts, private_data, wait)
            }
            #[cfg(rdmakit_verbs)]
            ListenerBackend::Verbs(l) => {
                let req = l.get_request(wait)?;
                if req.device_name() != pd.context().name() {
                    let dev = req.device_name();
                    let _ = req.reject(&[]);
                    return Err(Error::InvalidArgument(format!(
                        "a request arrived on device {dev}, but the PD is on {}",
                        pd.context().name()
                    )));
                }
                let peer_data = req.private_data().to_vec();
                let (qp, cq) = new_qp(pd, opts)?;
                let Some(vqp) = qp.verbs_qp() else { unreachable!("a verbs PD makes verbs QPs") };
                let conn = req.accept(vqp, &opts.connect, private_data, Some(opts.timeout))?;
                Ok(Connection { qp, cq, peer_data, backend: ConnBackend::Verbs(conn) })
            }
        }
    }
}

/// Connects to a listener at `addr` with a new QP and CQ on `pd`, sending `private_data`.
///
/// # Errors
/// [`Error::ConnectionRejected`] if the peer refuses (or nothing listens, on verbs);
/// [`Error::Timeout`]; on verbs [`Error::InvalidArgument`] if `addr` routes through
/// another device than `pd`'s.
pub fn connect(
    pd: &ProtectionDomain,
    addr: SocketAddr,
    opts: &CmOptions,
    private_data: &[u8],
) -> Result<Connection> {
    check_private_data(private_data)?;
    match &pd.context().inner.backend {
        CtxBackend::Soft(_) => soft_connect(pd, addr, opts, private_data),
        #[cfg(rdmakit_verbs)]
        CtxBackend::Verbs(_) => {
            let conn = crate::rdma::cm::CmConnector::resolve(addr, opts.timeout, opts.connect.traffic_class)?;
            if conn.device_name() != pd.context().name() {
                return Err(Error::InvalidArgument(format!(
                    "{addr} is reached through device {}, but the PD is on {}",
                    conn.device_name(),
                    pd.context().name()
                )));
            }
            let (qp, cq) = new_qp(pd, opts)?;
            let Some(vqp) = qp.verbs_qp() else { unreachable!("a verbs PD makes verbs QPs") };
            let (c, peer_data) = conn.connect(vqp, &opts.connect, private_data, opts.timeout)?;
            Ok(Connection { qp, cq, peer_data, backend: ConnBackend::Verbs(c) })
        }
    }
}

fn new_qp(pd: &ProtectionDomain, opts: &CmOptions) -> Result<(QueuePair, CompletionQueue)> {
    let cq = pd.context().create_cq(opts.cqe)?;
    let qp = pd.create_qp(&cq, &cq, opts.caps)?;
    Ok((qp, cq))
}

// ---- the soft provider's bootstrap protocol over TCP ----
//
// request:  "RKCM" 2 | endpoint (32) | token (16) | len u8 | private data
// reply:    "RKCM" 2 | status u8 (0 accepted) | endpoint (32) | token (16) | len u8 | private data
// ready:    "RKCM" 2 | 0xff            (the requester's QP is connected: start sending)
// Then the stream stays open; closing it is the disconnect.
//
// Each side draws a random connection token and sends it: a requester of the other process
// must present it in its soft NIC Hello (with both initial PSNs) before any of its requests
// is served, so a client that did not take part in this exchange cannot forge one. The
// token is soft-only: the verbs provider's exchange goes through rdma_cm and ignores it.

const MAGIC: [u8; 5] = *b"RKCM\x02";
const TOKEN_LEN: usize = 16;

fn io_err(call: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |source| Error::Os { call, source }
}

type Msg = (u8, Endpoint, [u8; TOKEN_LEN], Vec<u8>);

/// Reads exactly `buf.len()` bytes before `deadline`: the whole handshake has one time
/// budget, so a peer trickling bytes cannot hold an `accept` or `connect` (a per-read
/// timeout would restart with every byte).
fn read_by(s: &mut TcpStream, mut buf: &mut [u8], deadline: Instant, budget: Duration) -> Result<()> {
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout(budget));
        }
        s.set_read_timeout(Some(left)).map_err(io_err("setsockopt"))?;
        match s.read(buf) {
            Ok(0) => {
                let eof = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
                return Err(Error::Os { call: "read handshake", source: eof });
            }
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(Error::Timeout(budget));
            }
            Err(e) => return Err(Error::Os { call: "read handshake", source: e }),
        }
    }
    Ok(())
}

fn read_msg(s: &mut TcpStream, with_status: bool, deadline: Instant, budget: Duration) -> Result<Msg> {
    let bad = |reason: &str| Error::Malformed { what: "connection handshake", reason: reason.into() };
    let mut head = [0u8; 5 + 1 + Endpoint::ENCODED_LEN + TOKEN_LEN + 1];
    let head = if with_status { &mut head[..] } else { &mut head[1..] };
    read_by(s, head, deadline, budget)?;
    if head[..5] != MAGIC {
        return Err(bad("bad magic"));
    }
    let (status, rest) = if with_status { (head[5], &head[6..]) } else { (0, &head[5..]) };
    let ep = Endpoint::decode(&rest[..Endpoint::ENCODED_LEN])?;
    let mut token = [0u8; TOKEN_LEN];
    token.copy_from_slice(&rest[Endpoint::ENCODED_LEN..Endpoint::ENCODED_LEN + TOKEN_LEN]);
    let len = rest[Endpoint::ENCODED_LEN + TOKEN_LEN] as usize;
    if len > MAX_PRIVATE_DATA {
        return Err(bad("private data too long"));
    }
    let mut data = vec![0u8; len];
    read_by(s, &mut data, deadline, budget)?;
    Ok((status, ep, token, data))
}

fn write_msg(
    s: &mut TcpStream,
    status: Option<u8>,
    ep: &Endpoint,
    token: &[u8; TOKEN_LEN],
    data: &[u8],
) -> Result<()> {
    let mut m = MAGIC.to_vec();
    m.extend(status);
    m.extend_from_slice(&ep.encode());
    m.extend_from_slice(token);
    m.push(data.len() as u8);
    m.extend_from_slice(data);
    s.write_all(&m).map_err(io_err("write handshake"))
}

fn soft_accept(
    l: &TcpListener,
    pd: &ProtectionDomain,
    opts: &CmOptions,
    private_data: &[u8],
    wait: Option<Duration>,
) -> Result<Connection> {
    if let Some(w) = wait
        && !wait_readable(l.as_raw_fd(), w)?
    {
        return Err(Error::Timeout(w));
    }
    let (mut s, _) = l.accept().map_err(io_err("accept"))?;
    let deadline = Instant::now() + opts.timeout;
    let _ = s.set_write_timeout(Some(opts.timeout));
    let (_, peer_ep, peer_token, peer_data) = read_msg(&mut s, false, deadline, opts.timeout)?;
    let (qp, cq) = new_qp(pd, opts)?;
    let token: [u8; TOKEN_LEN] = crate::soft::random();
    qp.set_soft_tokens(token, peer_token);
    qp.connect(&peer_ep, &opts.connect)?;
    write_msg(&mut s, Some(0), &qp.endpoint_with(&opts.connect)?, &token, private_data)?;
    // Wait for the requester's "ready": its QP is connected, ours may send.
    let mut ready = [0u8; 6];
    read_by(&mut s, &mut ready, deadline, opts.timeout)?;
    if ready[..5] != MAGIC || ready[5] != 0xff {
        return Err(Error::Malformed { what: "connection handshake", reason: "bad ready message".into() });
    }
    s.set_read_timeout(None).map_err(io_err("setsockopt"))?;
    Ok(Connection { qp, cq, peer_data, backend: ConnBackend::Soft(s) })
}

fn soft_connect(
    pd: &ProtectionDomain,
    addr: SocketAddr,
    opts: &CmOptions,
    private_data: &[u8],
) -> Result<Connection> {
    let mut s = TcpStream::connect_timeout(&addr, opts.timeout).map_err(|e| {
        if e.kind() == std::io::ErrorKind::ConnectionRefused {
            Error::ConnectionRejected {
                reason: format!("nothing listens at {addr}"),
                private_data: Vec::new(),
            }
        } else {
            Error::Os { call: "connect", source: e }
        }
    })?;
    let deadline = Instant::now() + opts.timeout;
    let _ = s.set_write_timeout(Some(opts.timeout));
    let (qp, cq) = new_qp(pd, opts)?;
    qp.modify_to_init(&opts.connect)?;
    let token: [u8; TOKEN_LEN] = crate::soft::random();
    write_msg(&mut s, None, &qp.endpoint_with(&opts.connect)?, &token, private_data)?;
    let (status, peer_ep, peer_token, peer_data) = read_msg(&mut s, true, deadline, opts.timeout)?;
    if status != 0 {
        return Err(Error::ConnectionRejected {
            reason: format!("status {status}"),
            private_data: peer_data,
        });
    }
    qp.set_soft_tokens(token, peer_token);
    qp.connect(&peer_ep, &opts.connect)?;
    let mut ready = MAGIC.to_vec();
    ready.push(0xff);
    s.write_all(&ready).map_err(io_err("write handshake"))?;
    s.set_read_timeout(None).map_err(io_err("setsockopt"))?;
    Ok(Connection { qp, cq, peer_data, backend: ConnBackend::Soft(s) })
}

fn wait_readable(fd: i32, wait: Duration) -> Result<bool> {
    let deadline = Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let ms = left.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd on the stack, count 1.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r >= 0 {
            return Ok(r > 0);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::Os { call: "poll", source: e });
        }
    }
}

/// True once the stream reports end-of-file (the peer closed or this side shut it down).
fn wait_eof(s: &TcpStream, wait: Duration) -> Result<bool> {
    if !wait_readable(s.as_raw_fd(), wait)? {
        return Ok(false);
    }
    // Readable means end-of-file: the peer sends nothing after the handshake, so stray
    // bytes or a read error are a broken bootstrap stream, which is a disconnect too.
    let _ = (&*s).read(&mut [0u8; 1]);
    Ok(true)
}
