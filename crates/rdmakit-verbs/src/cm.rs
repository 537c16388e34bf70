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
//! Users with their own bootstrap keep using [`QueuePair::address`] and
//! [`QueuePair::connect`] directly.
//!
//! **On tokio** (feature `async`, on by default): [`AsyncListener`] and [`connect_async`].
//! The listener runs every handshake as a task of its own, each within
//! [`CmOptions::timeout`] and at most [`AsyncListener::DEFAULT_MAX_HANDSHAKES`] (or the
//! number given) at once, so a slow or silent client delays no other; established
//! connections queue for [`AsyncListener::accept`]. On verbs the rdma_cm event channels'
//! (non-blocking) fds are awaited through tokio's `AsyncFd`; on soft the bootstrap runs on
//! tokio's `TcpListener`/`TcpStream`.
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

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use crate::cq::CompletionQueue;
use crate::device::{Context, CtxBackend};
use crate::error::{Error, Result};
use crate::pd::ProtectionDomain;
use crate::qp::QueuePair;
#[cfg(rdmakit_verbs)]
use crate::rdma::cm::CmConn;
#[cfg(rdmakit_verbs)]
use crate::rdma::cm::connector::CmConnector;
#[cfg(rdmakit_verbs)]
use crate::rdma::cm::listener::{CmListener, CmRequest};
use crate::soft::bootstrap::{self, Hello, Origin, SoftConn, SoftListener, SoftRequest, Token};
use crate::types::{ConnectOptions, ProviderKind, QpAddress, QpCaps};

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

/// Our private data must fit the CM limit; checked here, in the front, before any
/// provider sees it.
fn check_private_data(data: &[u8]) -> Result<()> {
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
        self.backend.disconnect()?;
        self.qp.modify_to_error()
    }

    /// Waits until the peer disconnects (or this side did). `Ok(false)` on timeout.
    pub fn wait_disconnected(&self, timeout: Duration) -> Result<bool> {
        let seen = self.backend.wait_disconnected(timeout)?;
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
        Ok(Listener { ctx: ctx.clone(), backend: ListenerBackend::bind(ctx, addr)? })
    }

    /// The bound address (with the chosen port).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.backend.local_addr()
    }

    /// The device this listener belongs to.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Waits for the next connection request, creates a QP and CQ on `pd` for it,
    /// connects, and answers with `private_data`. Blocks until a request arrives.
    ///
    /// On soft, the requests of every connection are read at once, each within
    /// [`CmOptions::timeout`] from its TCP accept (the `opts` of the call that took it), and
    /// at most 64 at a time (past that the one whose request has come least far is dropped,
    /// the oldest of those): a client that connects and says nothing, or trickles its
    /// request, delays no other, and a flood of silent connections drops its own rather
    /// than a client that has begun its request. Such a connection is closed
    /// and logged at debug level, not returned as an error, and one whose request is still
    /// incomplete when a call returns is read on by the next call. From a complete request
    /// on, the handshake is this call's: a requester that stalls after its request holds the
    /// call until its deadline, and that is returned as an error. A server that must not be
    /// held even so runs its handshakes concurrently with [`AsyncListener`].
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
        self.accept_with(pd, opts, private_data, wait, |_, _| Ok(()))
    }

    /// [`accept_timeout`](Self::accept_timeout) that runs `before_answer` on the new QP,
    /// with the requester's private data, once the QP takes receives and before the
    /// requester learns that it was accepted. Receives posted there are in place before the
    /// peer's first send can arrive, as perftest posts its receives before its handshake: a
    /// send that finds none is answered with a receiver-not-ready NAK, and the sender waits
    /// out the RNR timer (at least a kernel tick on rxe) before it tries again.
    ///
    /// An error from `before_answer` rejects the request and is returned.
    ///
    /// # Example
    /// ```
    /// # use rdmakit_verbs::{cm, AccessFlags, Context, RecvWr};
    /// # fn main() -> rdmakit_verbs::Result<()> {
    /// let ctx = Context::open_soft();
    /// let pd = ctx.alloc_pd()?;
    /// let inbox = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    /// let listener = cm::Listener::bind(&ctx, "127.0.0.1:0".parse().unwrap())?;
    /// let addr = listener.local_addr()?;
    /// let client = std::thread::spawn(move || {
    ///     let pd = Context::open_soft().alloc_pd()?;
    ///     cm::connect(&pd, addr, &cm::CmOptions::default(), b"hi")
    /// });
    /// let conn = listener.accept_with(&pd, &cm::CmOptions::default(), &[], None, |qp, _peer| {
    ///     qp.post_recv(RecvWr::new(inbox.local()?))
    /// })?;
    /// client.join().unwrap()?;
    /// # drop(conn);
    /// # Ok(())
    /// # }
    /// ```
    pub fn accept_with(
        &self,
        pd: &ProtectionDomain,
        opts: &CmOptions,
        private_data: &[u8],
        wait: Option<Duration>,
        before_answer: impl FnOnce(&QueuePair, &[u8]) -> Result<()>,
    ) -> Result<Connection> {
        check_private_data(private_data)?;
        self.backend.check_pd(pd)?;
        self.backend.incoming(wait, opts.timeout)?.accept(pd, opts, private_data, before_answer)
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
    connect_backend(pd, addr, opts, private_data)
}

fn new_qp(pd: &ProtectionDomain, opts: &CmOptions) -> Result<(QueuePair, CompletionQueue)> {
    let cq = pd.context().create_cq(opts.cqe)?;
    let qp = pd.create_qp(&cq, &cq, opts.caps)?;
    Ok((qp, cq))
}

fn check_soft_pd(pd: &ProtectionDomain) -> Result<()> {
    if pd.context().provider() != ProviderKind::Soft {
        return Err(Error::InvalidArgument("a soft listener needs a soft PD".into()));
    }
    Ok(())
}

/// A soft peer's declared endpoint is connected to only if it lies where the handshake
/// came from: a device at the IP address the bootstrap connection's other end has, or any
/// address when that connection is within this host (a peer on this host can reach what
/// this side's NIC would dial by itself; its device may be at one of the host's addresses
/// while it connects through loopback, or be a device of this process, whose QPs the soft
/// NIC serves only once they took the exchanged token). Otherwise a peer of another host
/// could make this side's NIC dial, and send Hellos to, any address it names; and, naming
/// a device of this process, link a connection of its own to another of this process's
/// QPs, whose token it learnt from that QP's handshake.
fn check_declared(ep: &QpAddress, origin: Origin, who: &str) -> Result<()> {
    let same_host = origin.peer == origin.local || origin.peer.is_loopback();
    if crate::soft::SoftDevice::by_gid(&ep.gid).is_some() {
        if same_host {
            return Ok(());
        }
        return Err(Error::PermissionDenied(format!(
            "the {who}'s soft endpoint names a device of this process, but its connection came \
             from another host ({})",
            origin.peer
        )));
    }
    let declared = IpAddr::V4(Ipv4Addr::new(ep.gid[4], ep.gid[5], ep.gid[6], ep.gid[7]));
    if declared == origin.peer || same_host {
        return Ok(());
    }
    Err(Error::PermissionDenied(format!(
        "the {who}'s soft endpoint is at {declared}, but its connection came from {}: a soft NIC \
         connects only to the address its peer connects from (set RDMAKIT_SOFT_ADDR to the \
         address this host reaches its peers from)",
        origin.peer
    )))
}

/// The soft acceptor's QP for a request that came from `origin`: connected to the
/// requester's endpoint with both tokens set; returns it with what the reply carries (our
/// endpoint and token).
fn soft_accepting_qp(
    pd: &ProtectionDomain,
    opts: &CmOptions,
    peer: &Hello,
    origin: Origin,
) -> Result<(QueuePair, CompletionQueue, QpAddress, Token)> {
    check_declared(&peer.endpoint, origin, "requester")?;
    let (qp, cq) = new_qp(pd, opts)?;
    let token: Token = crate::soft::random();
    qp.set_soft_tokens(token, Some(peer.token));
    qp.connect(&peer.endpoint, &opts.connect)?;
    let ep = qp.address_with(&opts.connect)?;
    Ok((qp, cq, ep, token))
}

/// The soft requester's QP, in INIT, with what the request carries.
fn soft_requesting_qp(
    pd: &ProtectionDomain,
    opts: &CmOptions,
) -> Result<(QueuePair, CompletionQueue, QpAddress, Token)> {
    let (qp, cq) = new_qp(pd, opts)?;
    qp.modify_to_init(&opts.connect)?;
    let ep = qp.address_with(&opts.connect)?;
    // The token the request carries is the one the acceptor's QP will present: installed
    // now, as its Hello may arrive before the reply (a QP not yet connected takes only
    // Hellos with its token).
    let token: Token = crate::soft::random();
    qp.set_soft_tokens(token, None);
    Ok((qp, cq, ep, token))
}

/// The soft requester's QP once the reply came (over a connection from `origin`):
/// connected if the peer accepted.
fn soft_replied(
    qp: &QueuePair,
    opts: &CmOptions,
    token: Token,
    reply: Hello,
    origin: Origin,
) -> Result<Vec<u8>> {
    if reply.status != 0 {
        return Err(Error::ConnectionRejected {
            reason: format!("status {}", reply.status),
            private_data: reply.private_data,
        });
    }
    check_declared(&reply.endpoint, origin, "listener")?;
    qp.set_soft_tokens(token, Some(reply.token));
    qp.connect(&reply.endpoint, &opts.connect)?;
    Ok(reply.private_data)
}

#[cfg(rdmakit_verbs)]
fn check_request_device(req: CmRequest, pd: &ProtectionDomain) -> Result<CmRequest> {
    if req.device_name() != pd.context().name() {
        let dev = req.device_name();
        let _ = req.reject(&[]);
        return Err(Error::InvalidArgument(format!(
            "a request arrived on device {dev}, but the PD is on {}",
            pd.context().name()
        )));
    }
    Ok(req)
}

#[cfg(rdmakit_verbs)]
fn check_route_device(conn: &CmConnector, addr: SocketAddr, pd: &ProtectionDomain) -> Result<()> {
    if conn.device_name() != pd.context().name() {
        return Err(Error::InvalidArgument(format!(
            "{addr} is reached through device {}, but the PD is on {}",
            conn.device_name(),
            pd.context().name()
        )));
    }
    Ok(())
}

#[cfg(rdmakit_verbs)]
fn verbs_qp(qp: &QueuePair) -> &crate::rdma::Qp {
    qp.verbs_qp().expect("a verbs PD makes verbs QPs")
}

// ---- the provider dispatch: every `#[cfg]` arm of this file is below ----

enum ListenerBackend {
    Soft(SoftListener),
    #[cfg(rdmakit_verbs)]
    Verbs(CmListener),
}

/// A request that arrived and is not answered yet.
enum Incoming {
    /// A TCP connection whose request has been read.
    Soft(SoftRequest),
    #[cfg(rdmakit_verbs)]
    Verbs(CmRequest),
}

enum ConnBackend {
    Soft(SoftConn),
    #[cfg(rdmakit_verbs)]
    Verbs(CmConn),
}

impl ListenerBackend {
    fn bind(ctx: &Context, addr: SocketAddr) -> Result<ListenerBackend> {
        Ok(match &ctx.inner.backend {
            CtxBackend::Soft(_) => ListenerBackend::Soft(SoftListener::bind(addr)?),
            #[cfg(rdmakit_verbs)]
            CtxBackend::Verbs(_) => ListenerBackend::Verbs(bind_verbs(ctx, addr)?),
        })
    }

    fn local_addr(&self) -> Result<SocketAddr> {
        match self {
            ListenerBackend::Soft(l) => l.local_addr(),
            #[cfg(rdmakit_verbs)]
            ListenerBackend::Verbs(l) => l.local_addr(),
        }
    }

    /// Refuses a PD of another provider before a request is taken (verbs checks the
    /// device once a request names it).
    fn check_pd(&self, pd: &ProtectionDomain) -> Result<()> {
        match self {
            ListenerBackend::Soft(_) => check_soft_pd(pd),
            #[cfg(rdmakit_verbs)]
            ListenerBackend::Verbs(_) => Ok(()),
        }
    }

    /// The next request, within `wait`; on soft, `budget` is each connection's for its
    /// whole handshake.
    fn incoming(&self, wait: Option<Duration>, budget: Duration) -> Result<Incoming> {
        Ok(match self {
            ListenerBackend::Soft(l) => Incoming::Soft(l.next_request(wait, MAX_PRIVATE_DATA, budget)?),
            #[cfg(rdmakit_verbs)]
            ListenerBackend::Verbs(l) => Incoming::Verbs(l.get_request(wait)?),
        })
    }
}

#[cfg(rdmakit_verbs)]
fn bind_verbs(ctx: &Context, addr: SocketAddr) -> Result<CmListener> {
    let l = CmListener::bind(addr, 64)?;
    if let Some(dev) = l.device_name()
        && dev != ctx.name()
    {
        return Err(Error::InvalidArgument(format!("{addr} belongs to device {dev}, not {}", ctx.name())));
    }
    Ok(l)
}

impl Incoming {
    /// The handshake: a QP and CQ on `pd`, connected, answered with `data` (checked).
    /// `before_answer` runs on the connected QP before the answer goes out.
    fn accept(
        self,
        pd: &ProtectionDomain,
        opts: &CmOptions,
        data: &[u8],
        before_answer: impl FnOnce(&QueuePair, &[u8]) -> Result<()>,
    ) -> Result<Connection> {
        match self {
            Incoming::Soft(mut req) => {
                let (qp, cq, ep, token) = soft_accepting_qp(pd, opts, &req.hello, req.origin()?)?;
                let peer_data = std::mem::take(&mut req.hello.private_data);
                // On an error the request is dropped unanswered: its stream closes, and the
                // requester's connect fails.
                before_answer(&qp, &peer_data)?;
                let conn = req.accept(&ep, &token, data)?;
                Ok(Connection { qp, cq, peer_data, backend: ConnBackend::Soft(conn) })
            }
            #[cfg(rdmakit_verbs)]
            Incoming::Verbs(req) => {
                let req = check_request_device(req, pd)?;
                let peer_data = req.private_data().to_vec();
                let (qp, cq) = new_qp(pd, opts)?;
                let mut once = Some(before_answer);
                let mut hook = || once.take().map_or(Ok(()), |f| f(&qp, &peer_data));
                let conn = req.accept(verbs_qp(&qp), &opts.connect, data, Some(opts.timeout), &mut hook)?;
                Ok(Connection { qp, cq, peer_data, backend: ConnBackend::Verbs(conn) })
            }
        }
    }
}

fn connect_backend(
    pd: &ProtectionDomain,
    addr: SocketAddr,
    opts: &CmOptions,
    data: &[u8],
) -> Result<Connection> {
    match &pd.context().inner.backend {
        CtxBackend::Soft(_) => {
            let connecting = bootstrap::connect(addr, opts.timeout)?;
            let origin = connecting.origin()?;
            let (qp, cq, ep, token) = soft_requesting_qp(pd, opts)?;
            let (replied, reply) = connecting.request(&ep, &token, data, MAX_PRIVATE_DATA)?;
            let peer_data = soft_replied(&qp, opts, token, reply, origin)?;
            let conn = replied.ready()?;
            Ok(Connection { qp, cq, peer_data, backend: ConnBackend::Soft(conn) })
        }
        #[cfg(rdmakit_verbs)]
        CtxBackend::Verbs(_) => {
            let connector = CmConnector::resolve(addr, opts.timeout, opts.connect.traffic_class)?;
            check_route_device(&connector, addr, pd)?;
            let (qp, cq) = new_qp(pd, opts)?;
            let (conn, peer_data) = connector.connect(verbs_qp(&qp), &opts.connect, data, opts.timeout)?;
            Ok(Connection { qp, cq, peer_data, backend: ConnBackend::Verbs(conn) })
        }
    }
}

impl ConnBackend {
    fn disconnect(&self) -> Result<()> {
        match self {
            ConnBackend::Soft(c) => c.disconnect(),
            #[cfg(rdmakit_verbs)]
            ConnBackend::Verbs(c) => c.disconnect()?,
        }
        Ok(())
    }

    fn wait_disconnected(&self, timeout: Duration) -> Result<bool> {
        match self {
            ConnBackend::Soft(c) => c.wait_disconnected(timeout),
            #[cfg(rdmakit_verbs)]
            ConnBackend::Verbs(c) => c.wait_disconnected(timeout),
        }
    }
}

// ---- on tokio ----

#[cfg(feature = "async")]
pub use self::on_tokio::{AsyncListener, connect_async};

#[cfg(feature = "async")]
mod on_tokio {
    use std::collections::VecDeque;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

    use tokio::sync::{Semaphore, TryAcquireError, mpsc};
    use tokio::task::{AbortHandle, JoinSet};

    use super::*;
    use crate::soft::bootstrap::{AsyncSoftIncoming, AsyncSoftListener};

    /// Listens for connections on tokio and runs their handshakes concurrently.
    ///
    /// [`bind`](Self::bind) starts a task (on the current tokio runtime) that takes
    /// requests and runs each handshake as a task of its own, within
    /// [`CmOptions::timeout`]: a client that sends nothing, or trickles, is dropped when its
    /// time is up and holds no other. At most `max_handshakes` run at once; with all of
    /// them running, a new connection takes the place of the oldest handshake whose
    /// request has not come whole (dropped and counted as failed), else of the oldest
    /// whose request came and that has not finished an eighth of the budget (250 ms to 4 s)
    /// after its connection (a client answers within a round trip: one withholding its READY or RTU
    /// would hold its slot for the whole budget), and waits until one has stalled so or a
    /// slot is free. Established connections
    /// queue (as many again) until [`accept`](Self::accept) takes them. A handshake that fails or times out
    /// is logged and counted ([`failed_handshakes`](Self::failed_handshakes)), not returned:
    /// one bad client is no error of the listener.
    ///
    /// Dropping the listener stops the task, the handshakes in progress and the queued
    /// connections (which disconnect).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> rdmakit_verbs::Result<()> {
    /// use rdmakit_verbs::{cm, Context};
    /// let pd = Context::open_soft().alloc_pd()?;
    /// let opts = cm::CmOptions::default();
    /// let listener = cm::AsyncListener::bind(&pd, "127.0.0.1:0".parse().unwrap(), &opts, b"srv")?;
    /// let addr = listener.local_addr();
    /// let client = tokio::spawn({
    ///     let pd = pd.clone();
    ///     async move { cm::connect_async(&pd, addr, &opts, b"cli").await }
    /// });
    /// let conn = listener.accept().await?;
    /// assert_eq!(conn.peer_private_data(), b"cli");
    /// assert_eq!(client.await.unwrap()?.peer_private_data(), b"srv");
    /// # Ok(())
    /// # }
    /// ```
    pub struct AsyncListener {
        ctx: Context,
        local: SocketAddr,
        rx: tokio::sync::Mutex<mpsc::Receiver<Result<Connection>>>,
        failed: Arc<AtomicU64>,
        task: tokio::task::JoinHandle<()>,
    }

    impl std::fmt::Debug for AsyncListener {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("AsyncListener").field("addr", &self.local).finish()
        }
    }

    impl AsyncListener {
        /// Handshakes in progress at once unless [`bind_with`](Self::bind_with) says.
        pub const DEFAULT_MAX_HANDSHAKES: usize = 64;
        /// The most [`bind_with`](Self::bind_with) accepts: each handshake holds a socket or
        /// a CM id and a task, and tokio's semaphore panics beyond its own limit.
        pub const MAX_HANDSHAKES: usize = 4096;

        /// Listens at `addr` (port 0 picks one); every connection gets a QP and CQ on
        /// `pd` made with `opts`, and is answered with `private_data`. Needs a tokio
        /// runtime.
        pub fn bind(
            pd: &ProtectionDomain,
            addr: SocketAddr,
            opts: &CmOptions,
            private_data: &[u8],
        ) -> Result<AsyncListener> {
            Self::bind_with(pd, addr, opts, private_data, Self::DEFAULT_MAX_HANDSHAKES)
        }

        /// [`bind`](Self::bind) with at most `max_handshakes` (at least 1) in progress.
        pub fn bind_with(
            pd: &ProtectionDomain,
            addr: SocketAddr,
            opts: &CmOptions,
            private_data: &[u8],
            max_handshakes: usize,
        ) -> Result<AsyncListener> {
            check_private_data(private_data)?;
            if !(1..=Self::MAX_HANDSHAKES).contains(&max_handshakes) {
                return Err(Error::InvalidArgument(format!(
                    "max_handshakes is {max_handshakes}; it must be 1 to {}",
                    Self::MAX_HANDSHAKES
                )));
            }
            if tokio::runtime::Handle::try_current().is_err() {
                return Err(Error::InvalidArgument("AsyncListener::bind needs a tokio runtime".into()));
            }
            let ctx = pd.context().clone();
            let backend = AsyncListenerBackend::bind(&ctx, addr)?;
            let local = backend.local_addr()?;
            let (tx, rx) = mpsc::channel(max_handshakes);
            let failed = Arc::new(AtomicU64::new(0));
            let handshakes = Handshakes {
                pd: pd.clone(),
                opts: *opts,
                data: Arc::from(private_data),
                permits: Arc::new(Semaphore::new(max_handshakes)),
                tx,
                failed: failed.clone(),
            };
            let task = tokio::spawn(handshakes.run(backend));
            Ok(AsyncListener { ctx, local, rx: tokio::sync::Mutex::new(rx), failed, task })
        }

        /// The bound address (with the chosen port).
        pub fn local_addr(&self) -> SocketAddr {
            self.local
        }

        /// The device this listener belongs to.
        pub fn context(&self) -> &Context {
            &self.ctx
        }

        /// The next established connection. Errors are the listener's own (its socket or
        /// event channel failing), not a client's. Cancel-safe: a dropped call takes
        /// nothing.
        pub async fn accept(&self) -> Result<Connection> {
            match self.rx.lock().await.recv().await {
                Some(r) => r,
                None => Err(Error::InvalidArgument("the listener's task ended".into())),
            }
        }

        /// Handshakes that failed or ran out of time so far.
        pub fn failed_handshakes(&self) -> u64 {
            self.failed.load(Ordering::Relaxed)
        }
    }

    impl Drop for AsyncListener {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    /// What the listener's task needs for each handshake.
    struct Handshakes {
        pd: ProtectionDomain,
        opts: CmOptions,
        data: Arc<[u8]>,
        permits: Arc<Semaphore>,
        tx: mpsc::Sender<Result<Connection>>,
        failed: Arc<AtomicU64>,
    }

    /// Where a handshake stands (see [`Handshakes::run`]).
    const SILENT: u8 = 0;
    const SPOKE: u8 = 1;
    /// Established, waiting for [`AsyncListener::accept`] (the application's backpressure:
    /// never dropped for a newer connection).
    const DONE: u8 = 2;

    /// A handshake in progress, as the listener's task tracks it.
    struct InFlight {
        h: AbortHandle,
        state: Arc<AtomicU8>,
        /// When its connection was taken.
        at: tokio::time::Instant,
    }

    /// Forgets the handshakes that ended or are established (waiting for `accept`).
    fn prune(inflight: &mut VecDeque<InFlight>) {
        inflight.retain(|x| !x.h.is_finished() && x.state.load(Ordering::Acquire) != DONE);
    }

    /// Sleeps until `t`, or for ever without one (a `select!` arm that may not fire).
    async fn sleep_until_some(t: Option<tokio::time::Instant>) {
        match t {
            Some(t) => tokio::time::sleep_until(t).await,
            None => std::future::pending().await,
        }
    }

    impl Handshakes {
        /// How long after its connection a handshake whose request came may take before a
        /// newer connection may take its place when every slot is held: an eighth of the budget, from 250 ms to
        /// 4 s. A client answers its reply within a round trip; one that has not by then
        /// is stalling (a request sent and the READY or RTU withheld holds its slot for
        /// the whole budget, so a peer renewing such handshakes held every slot).
        fn stall_age(&self) -> Duration {
            (self.opts.timeout / 8).clamp(Duration::from_millis(250), Duration::from_secs(4))
        }

        /// The handshake to drop for a newer connection, if one may go (its index): the
        /// oldest still silent; else the oldest that spoke and has stalled past
        /// [`stall_age`](Self::stall_age).
        fn victim(&self, inflight: &VecDeque<InFlight>, now: tokio::time::Instant) -> Option<usize> {
            let state = |x: &InFlight| x.state.load(Ordering::Acquire);
            inflight.iter().position(|x| state(x) == SILENT && !x.h.is_finished()).or_else(|| {
                inflight
                    .iter()
                    .position(|x| state(x) == SPOKE && !x.h.is_finished() && now >= x.at + self.stall_age())
            })
        }

        /// When the oldest handshake that spoke will have stalled, if one is in progress.
        fn next_stall(&self, inflight: &VecDeque<InFlight>) -> Option<tokio::time::Instant> {
            let spoke = inflight.iter().find(|x| x.state.load(Ordering::Acquire) == SPOKE)?;
            Some(spoke.at + self.stall_age())
        }

        async fn run(self, backend: AsyncListenerBackend) {
            // Dropped with this task: aborts every handshake in progress.
            let mut running = JoinSet::new();
            // Handshakes in progress, oldest first. With every slot taken, a new connection
            // takes the slot of the oldest one whose request has not come whole (as the
            // blocking listener drops its least advanced connection), so a flood of
            // connections that say nothing drops its own instead of holding every slot for
            // its whole budget; failing that, of the oldest that spoke and then stalled.
            let mut inflight: VecDeque<InFlight> = VecDeque::new();
            loop {
                while running.try_join_next().is_some() {}
                prune(&mut inflight);
                let free = match self.permits.clone().try_acquire_owned() {
                    Ok(p) => Some(p),
                    Err(TryAcquireError::Closed) => return,
                    Err(TryAcquireError::NoPermits) => None,
                };
                // No slot free and none to take: wait for one (or for a handshake to stall).
                let free = match free {
                    None if self.victim(&inflight, tokio::time::Instant::now()).is_none() => {
                        let stalls = self.next_stall(&inflight);
                        tokio::select! {
                            p = self.permits.clone().acquire_owned() => match p {
                                Ok(p) => Some(p),
                                Err(_) => return,
                            },
                            // A handshake ended (its slot is free now, or it spoke: look again).
                            Some(_) = running.join_next() => continue,
                            () = sleep_until_some(stalls) => continue,
                            () = self.tx.closed() => return,
                        }
                    }
                    free => free,
                };
                let incoming = tokio::select! {
                    r = backend.incoming() => r,
                    () = self.tx.closed() => return,
                };
                let incoming = match incoming {
                    Ok(i) => i,
                    Err(e) => {
                        tracing::warn!(error = %e, "async listener");
                        if self.tx.send(Err(e)).await.is_err() {
                            return;
                        }
                        // Out of fds, say: do not spin.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let permit = match free.map_or_else(|| self.permits.clone().try_acquire_owned(), Ok) {
                    Ok(p) => p,
                    Err(TryAcquireError::Closed) => return,
                    // Every slot still taken: the oldest silent (or stalled) handshake gives
                    // way, now or once one has stalled, unless a slot frees first.
                    Err(TryAcquireError::NoPermits) => loop {
                        prune(&mut inflight);
                        if let Some(i) = self.victim(&inflight, tokio::time::Instant::now()) {
                            let x = inflight.remove(i).expect("a victim's index");
                            x.h.abort();
                            self.failed.fetch_add(1, Ordering::Relaxed);
                            let why = if x.state.load(Ordering::Acquire) == SILENT {
                                "it sent no request"
                            } else {
                                "it stalled after its request"
                            };
                            tracing::debug!("handshake dropped for a newer connection: {why}");
                        }
                        let stalls = self.next_stall(&inflight);
                        // Freed when an aborted task is dropped (or by any other ending).
                        tokio::select! {
                            p = self.permits.clone().acquire_owned() => match p {
                                Ok(p) => break p,
                                Err(_) => return,
                            },
                            () = sleep_until_some(stalls) => {}
                            () = self.tx.closed() => return,
                        }
                    },
                };
                let (pd, opts, data) = (self.pd.clone(), self.opts, self.data.clone());
                let (tx, failed) = (self.tx.clone(), self.failed.clone());
                let state = Arc::new(AtomicU8::new(SILENT));
                let said = state.clone();
                let h = running.spawn(async move {
                    let r =
                        tokio::time::timeout(opts.timeout, incoming.accept(&pd, &opts, &data, &said)).await;
                    match r {
                        // The permit is held until the connection is queued: that bounds
                        // the queue too.
                        Ok(Ok(conn)) => {
                            said.store(DONE, Ordering::Release);
                            drop(tx.send(Ok(conn)).await);
                        }
                        Ok(Err(e)) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!(error = %e, "handshake failed");
                        }
                        Err(_) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!(budget = ?opts.timeout, "handshake timed out");
                        }
                    }
                    drop(permit);
                });
                inflight.push_back(InFlight { h, state, at: tokio::time::Instant::now() });
            }
        }
    }

    /// [`connect`](super::connect) on tokio: the whole of it within
    /// [`CmOptions::timeout`] (else [`Error::Timeout`]).
    pub async fn connect_async(
        pd: &ProtectionDomain,
        addr: SocketAddr,
        opts: &CmOptions,
        private_data: &[u8],
    ) -> Result<Connection> {
        check_private_data(private_data)?;
        match tokio::time::timeout(opts.timeout, connect_backend_async(pd, addr, opts, private_data)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout(opts.timeout)),
        }
    }

    // ---- the provider dispatch on tokio ----

    enum AsyncListenerBackend {
        Soft(AsyncSoftListener),
        #[cfg(rdmakit_verbs)]
        Verbs(CmListener),
    }

    enum AsyncIncoming {
        Soft(AsyncSoftIncoming),
        #[cfg(rdmakit_verbs)]
        Verbs(CmRequest),
    }

    impl AsyncListenerBackend {
        fn bind(ctx: &Context, addr: SocketAddr) -> Result<AsyncListenerBackend> {
            Ok(match &ctx.inner.backend {
                CtxBackend::Soft(_) => AsyncListenerBackend::Soft(AsyncSoftListener::bind(addr)?),
                #[cfg(rdmakit_verbs)]
                CtxBackend::Verbs(_) => AsyncListenerBackend::Verbs(bind_verbs(ctx, addr)?),
            })
        }

        fn local_addr(&self) -> Result<SocketAddr> {
            match self {
                AsyncListenerBackend::Soft(l) => l.local_addr(),
                #[cfg(rdmakit_verbs)]
                AsyncListenerBackend::Verbs(l) => l.local_addr(),
            }
        }

        /// The next request; its handshake is [`AsyncIncoming::accept`]. Cancel-safe.
        async fn incoming(&self) -> Result<AsyncIncoming> {
            Ok(match self {
                AsyncListenerBackend::Soft(l) => AsyncIncoming::Soft(l.accept().await?),
                #[cfg(rdmakit_verbs)]
                AsyncListenerBackend::Verbs(l) => AsyncIncoming::Verbs(l.get_request_async().await?),
            })
        }
    }

    impl AsyncIncoming {
        /// The handshake; `state` becomes [`SPOKE`] once the request has come whole (from
        /// then on the handshake gives way to newer connections only once it stalls).
        async fn accept(
            self,
            pd: &ProtectionDomain,
            opts: &CmOptions,
            data: &[u8],
            state: &AtomicU8,
        ) -> Result<Connection> {
            match self {
                AsyncIncoming::Soft(inc) => {
                    check_soft_pd(pd)?;
                    let mut req = inc.read_request(MAX_PRIVATE_DATA).await?;
                    state.store(SPOKE, Ordering::Release);
                    let (qp, cq, ep, token) = soft_accepting_qp(pd, opts, &req.hello, req.origin()?)?;
                    let peer_data = std::mem::take(&mut req.hello.private_data);
                    let conn = req.accept(&ep, &token, data).await?;
                    Ok(Connection { qp, cq, peer_data, backend: ConnBackend::Soft(conn) })
                }
                #[cfg(rdmakit_verbs)]
                AsyncIncoming::Verbs(req) => {
                    // rdma_cm hands over requests whole.
                    state.store(SPOKE, Ordering::Release);
                    let req = check_request_device(req, pd)?;
                    let peer_data = req.private_data().to_vec();
                    let (qp, cq) = new_qp(pd, opts)?;
                    let conn = req.accept_async(verbs_qp(&qp), &opts.connect, data).await?;
                    Ok(Connection { qp, cq, peer_data, backend: ConnBackend::Verbs(conn) })
                }
            }
        }
    }

    async fn connect_backend_async(
        pd: &ProtectionDomain,
        addr: SocketAddr,
        opts: &CmOptions,
        data: &[u8],
    ) -> Result<Connection> {
        match &pd.context().inner.backend {
            CtxBackend::Soft(_) => {
                let connecting = bootstrap::connect_async(addr).await?;
                let origin = connecting.origin()?;
                let (qp, cq, ep, token) = soft_requesting_qp(pd, opts)?;
                let (replied, reply) = connecting.request(&ep, &token, data, MAX_PRIVATE_DATA).await?;
                let peer_data = soft_replied(&qp, opts, token, reply, origin)?;
                let conn = replied.ready().await?;
                Ok(Connection { qp, cq, peer_data, backend: ConnBackend::Soft(conn) })
            }
            #[cfg(rdmakit_verbs)]
            CtxBackend::Verbs(_) => {
                let connector =
                    CmConnector::resolve_async(addr, opts.timeout, opts.connect.traffic_class).await?;
                check_route_device(&connector, addr, pd)?;
                let (qp, cq) = new_qp(pd, opts)?;
                let (conn, peer_data) = connector.connect_async(verbs_qp(&qp), &opts.connect, data).await?;
                Ok(Connection { qp, cq, peer_data, backend: ConnBackend::Verbs(conn) })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A soft endpoint at `ip` (no device of this process).
    fn at(ip: [u8; 4]) -> QpAddress {
        let mut gid = [0u8; 16];
        gid[..2].copy_from_slice(&[0xfe, 0x80]);
        gid[4..8].copy_from_slice(&ip);
        gid[8..12].copy_from_slice(&0x7fff_fff0u32.to_be_bytes());
        QpAddress::new(ProviderKind::Soft, 4791, gid, 7, 1)
    }

    fn origin(peer: [u8; 4], local: [u8; 4]) -> Origin {
        Origin { peer: IpAddr::from(peer), local: IpAddr::from(local) }
    }

    /// Across hosts the declared endpoint must be at the handshake's origin; within one
    /// host (a loopback origin, or both ends at one address) any address is taken, as a
    /// client connecting through 127.0.0.1 to a server whose device is at the host's own
    /// address needs.
    #[test]
    fn declared_endpoints_are_taken_from_where_the_handshake_came() {
        let (client, server) = ([10, 0, 0, 2], [10, 0, 0, 1]);
        assert!(check_declared(&at(client), origin(client, server), "requester").is_ok());
        assert!(matches!(
            check_declared(&at([192, 0, 2, 1]), origin(client, server), "requester"),
            Err(Error::PermissionDenied(_))
        ));
        assert!(check_declared(&at([127, 0, 0, 1]), origin(client, server), "requester").is_err());
        // Within this host.
        assert!(check_declared(&at(server), origin([127, 0, 0, 1], [127, 0, 0, 1]), "listener").is_ok());
        assert!(check_declared(&at([127, 0, 0, 1]), origin(server, server), "requester").is_ok());
    }

    /// An endpoint of a device of this process, declared by a peer of another host: forged
    /// (a remote peer's QP is on its own device), and the way to link a connection of its
    /// own to another QP of this process whose token the peer learnt from its replies (QP
    /// numbers are sequential). Taken from within this host only.
    #[test]
    fn an_endpoint_of_this_process_declared_from_another_host_is_refused() {
        let ctx = crate::Context::open_soft();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4).unwrap();
        let qp = pd.create_qp(&cq, &cq, crate::QpCaps::default()).unwrap();
        let ours = qp.address().unwrap();
        let (client, server) = ([10, 0, 0, 2], [10, 0, 0, 1]);
        assert!(matches!(
            check_declared(&ours, origin(client, server), "requester"),
            Err(Error::PermissionDenied(m)) if m.contains("came from another host")
        ));
        assert!(check_declared(&ours, origin([127, 0, 0, 1], [127, 0, 0, 1]), "requester").is_ok());
        assert!(check_declared(&ours, origin(server, server), "listener").is_ok());
    }
}
