//! The soft NIC between processes and hosts: QPs talk over TCP.
//!
//! Each soft device opens a TCP "port" the first time one of its QPs hands out an
//! endpoint (address from `RDMAKIT_SOFT_ADDR`, default `127.0.0.1:0`). A requester QP
//! connecting to a QP of another process opens one stream to that device and introduces
//! itself with a `Hello`; once the Hello is authenticated, the device serves that stream as
//! the target-side progress engine: it applies each request to the target QP's memory
//! through the same responder code as in-process, and answers in order, without the target
//! application.
//!
//! All of it runs on one thread per process, the wire's event loop (`rdmakit-soft-wire`,
//! `mio` over non-blocking sockets), whatever the number of devices and connections: every
//! device's listener, the Hellos being read, the authenticated streams being served and
//! every requester link (writing its frames, reading its responses). Each connection keeps
//! its own input state and a bounded output queue; an idle one holds no buffer.
//!
//! Every peer is treated as hostile until its `Hello` proves it is the QP the target was
//! connected to (both initial PSNs and the connection token, see [`wire::Frame::Hello`]):
//! - before that, a connection costs the device one descriptor and a few bytes: the loop
//!   takes only a header whose length is exactly a Hello's, and drops a connection whose
//!   Hello is not complete within [`HELLO_TIMEOUT`]; at most [`MAX_PENDING_PER_ADDR`]
//!   connections with an incomplete Hello per peer address and [`MAX_PENDING`] per device are
//!   kept, the rest are closed at once; at most [`MAX_AWAITING_PER_QP`] complete Hellos wait
//!   for the same not-yet-connected QP (for [`AUTH_WAIT`]);
//! - after it, a frame's length is checked against its kind before anything is allocated,
//!   each frame must be complete within [`FRAME_TIMEOUT`] of its first byte, request PSNs
//!   must follow on from the requester's initial PSN (replays and gaps are dropped), a
//!   device serves at most [`MAX_SERVED`] connections, and a peer that stops reading is cut
//!   off after [`SEND_TIMEOUT`]: a connection's queued output is bounded (`OUT_HIGH` plus one
//!   frame; beyond it the loop stops reading that peer's requests, or taking that link's
//!   frames, until the peer takes some), never buffered without limit;
//! - accept errors (`EMFILE`) pause that listener with a growing backoff instead of
//!   spinning (the loop goes on serving everything else), and warnings a peer can trigger
//!   are rate-limited.
//!
//! Requesters never hold a lock across I/O, nor wait on it: a QP queues a frame on its
//! link (a bounded queue; full means "retry later") and wakes the loop, which writes it; the
//! loop hands responses back to the QP. A link holds its frames until the peer accepts its
//! Hello, and when a device closes it before that (over the bounds above, its QPs not
//! connected yet), dials again with backoff until [`HELLO_TIMEOUT`] after its first dial
//! (`Dial`; same-host rings first, then TCP). A process opens at most [`DIALS_PER_ADDR`]
//! TCP connections to one address at a time, each until its Hello is written, and a device
//! at its bound per address reads the Hellos that came since before it refuses: many QPs of
//! one process connecting at once are not taken for a flood. Served streams and links whose
//! QP is gone end within [`IDLE_CHECK`]. Dropping the link has the loop close its socket at
//! once, which ends it even if the peer is alive but silent.
//!
//! Between processes of one host the same frames go through rings in shared memory
//! instead (see [`super::shm`]): the device also listens on a Unix socket, a connection
//! there carries a memfd and then only doorbells, and the loop serves it like a TCP one,
//! with the same authentication, checks, bounds and timeouts (a [`Conn`] is either).

use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::SoftDevice;
use super::direct::{self, GrantTable, Miss};
use super::flags::FlagPage;
use super::mr::MrEntry;
use super::qp::{Auth, Deferred, Placement, Requester, ResponseData, SharedTail, SoftQp, TailCopies};
use super::shm::{self, ShmConn};
use super::wire::{self, Frame, WireError};
use crate::shared_mem::Src;
use mio::net::{TcpListener as MioListener, TcpStream as MioStream, UnixListener};
use mio::{Events, Interest, Poll, Token, Waker};

/// Environment variable, for tests only: a device waits this many milliseconds before
/// writing the answers of each batch of requests it served for another process (at most
/// 1000), which makes the window between a request's effect and its answer wide enough for
/// a test to see what an application does inside it.
pub const ANSWER_DELAY_ENV: &str = "RDMAKIT_SOFT_TEST_ANSWER_DELAY_MS";

/// The delay [`ANSWER_DELAY_ENV`] asks for, read once.
fn answer_delay() -> Option<Duration> {
    static DELAY: OnceLock<Option<Duration>> = OnceLock::new();
    *DELAY.get_or_init(|| {
        let ms = std::env::var(ANSWER_DELAY_ENV).ok()?.parse::<u64>().ok()?;
        (ms > 0).then(|| Duration::from_millis(ms.min(1000)))
    })
}

/// Environment variable: the address soft devices listen on (`IP` or `IP:port`).
pub const SOFT_ADDR_ENV: &str = "RDMAKIT_SOFT_ADDR";

/// Environment variable: microseconds the wire's loop keeps polling after a turn that had
/// work before it sleeps (default [`DEFAULT_SPIN`]: it sleeps at once; at most 10,000).
///
/// Spinning saves the loop's sleep and wake-up, and its peers' doorbells, when traffic
/// comes in bursts and a core is free for it: applications that wait for completions in
/// event mode across processes gain the most (`rdmakit-perf scaling`). It is off by
/// default because it costs CPU time, and because on a machine with fewer free cores than
/// spinning threads (applications busy-polling their CQs, both wire loops) every thread
/// waits whole time slices for the others: on 2 cores the test of `rdmakit-perf limits`
/// (busy-polling latency between two processes, among others) took 12 times as long with
/// a 100 us spin.
pub const SPIN_ENV: &str = "RDMAKIT_SOFT_SPIN_US";

/// How long the wire's loop polls after work unless [`SPIN_ENV`] says otherwise: not at
/// all.
pub const DEFAULT_SPIN: Duration = Duration::ZERO;

/// The spin [`SPIN_ENV`] asks for, read when the wire starts.
fn spin_window() -> Duration {
    spin_of(std::env::var(SPIN_ENV).ok().as_deref())
}

/// The spin a value of [`SPIN_ENV`] asks for (unset: the default).
fn spin_of(value: Option<&str>) -> Duration {
    let Some(v) = value else { return DEFAULT_SPIN };
    match v.trim().parse::<u64>() {
        Ok(us) => Duration::from_micros(us.min(10_000)),
        Err(_) => {
            tracing::warn!(value = %v, "soft NIC: {SPIN_ENV} is not a number of microseconds; using the default");
            DEFAULT_SPIN
        }
    }
}

/// A connection's whole `Hello` must arrive within this time of the connection.
pub(crate) const HELLO_TIMEOUT: Duration = Duration::from_secs(3);
/// A complete `Hello` naming a QP that exists but is not connected yet waits this long for
/// it (the two sides of a bootstrap connect their QPs one after the other).
pub(crate) const AUTH_WAIT: Duration = Duration::from_secs(30);
/// After authentication, each frame must be complete within this time of its first byte.
pub(crate) const FRAME_TIMEOUT: Duration = Duration::from_secs(30);
/// A peer that does not take our bytes for this long is cut off.
pub(crate) const SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections per peer address whose `Hello` is still incomplete (slow or silent ones).
/// Connections with a complete `Hello` waiting for their QP do not count here: a host of
/// legitimate peers connecting at once (one per QP) has as many of those as QPs being set up.
pub(crate) const MAX_PENDING_PER_ADDR: usize = 16;
/// TCP connections a process's wire has opening to one address, their Hello not written
/// yet; the others wait their turn. Half a device's [`MAX_PENDING_PER_ADDR`]: a process
/// connecting many QPs at once (a service with many clients, `rdmakit-perf scaling`) opened
/// them all in one go, and the device, accepting them before their Hellos came, closed all
/// but 16 and had the rest dial again.
const DIALS_PER_ADDR: usize = MAX_PENDING_PER_ADDR / 2;
/// Complete `Hello`s waiting for the same not-yet-connected QP (a legitimate peer sends one).
pub(crate) const MAX_AWAITING_PER_QP: usize = 4;
/// Unauthenticated connections kept per device.
pub(crate) const MAX_PENDING: usize = 256;
/// Authenticated connections served per device (each is bound to one target QP).
pub(crate) const MAX_SERVED: usize = 1024;
/// How often the wire checks that the target QP of each served connection (and the QP of
/// each link) still exists.
const IDLE_CHECK: Duration = Duration::from_secs(1);

const HELLO_FRAME: usize = wire::HEADER + wire::HELLO_LEN;

/// Lets one warning through per second per call site; counts the ones it held back. For
/// warnings a peer can trigger, through [`warn_limited!`](crate::warn_limited): a hostile
/// peer must not decide how much its target logs.
#[doc(hidden)]
pub struct RateLimit {
    next_ms: AtomicU64,
    held: AtomicU64,
}

impl RateLimit {
    /// A limiter that lets the next warning through.
    pub const fn new() -> RateLimit {
        RateLimit { next_ms: AtomicU64::new(0), held: AtomicU64::new(0) }
    }

    /// `Some(held back since the last one)` if a warning may be logged now.
    pub fn allow(&self) -> Option<u64> {
        static START: OnceLock<Instant> = OnceLock::new();
        let now = START.get_or_init(Instant::now).elapsed().as_millis() as u64;
        let next = self.next_ms.load(Ordering::Relaxed);
        if now >= next
            && self.next_ms.compare_exchange(next, now + 1000, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            return Some(self.held.swap(0, Ordering::Relaxed));
        }
        self.held.fetch_add(1, Ordering::Relaxed);
        None
    }
}

impl Default for RateLimit {
    fn default() -> Self {
        RateLimit::new()
    }
}

/// `tracing::warn!` at most once a second from this call site (hostile peers must not be
/// able to flood the log); reports how many were held back. The calling crate needs
/// `tracing`.
#[doc(hidden)]
#[macro_export]
macro_rules! warn_limited {
    ($($arg:tt)*) => {{
        static LIMIT: $crate::RateLimit = $crate::RateLimit::new();
        if let Some(held_back) = LIMIT.allow() {
            tracing::warn!(held_back, $($arg)*);
        }
    }};
}

/// The listen address configured for new devices.
pub(crate) fn configured_addr() -> SocketAddrV4 {
    let v = std::env::var(SOFT_ADDR_ENV).unwrap_or_default();
    if let Ok(a) = v.parse::<SocketAddrV4>() {
        return a;
    }
    if let Ok(ip) = v.parse::<Ipv4Addr>() {
        return SocketAddrV4::new(ip, 0);
    }
    if !v.is_empty() {
        tracing::warn!(value = %v, "{SOFT_ADDR_ENV} is not an IPv4 address; using 127.0.0.1");
    }
    SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)
}

/// Starts the device's listeners on the wire's event loop (TCP, and the same-host socket
/// unless that path is off or cannot bind); returns its TCP port.
pub(crate) fn listen(device: &Arc<SoftDevice>, addr: SocketAddrV4) -> std::io::Result<u16> {
    let listener = TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let port = listener.local_addr()?.port();
    let local = if shm::enabled() && device.config().same_host_shm {
        shm::bind(&device.gid())
            .inspect_err(
                |e| tracing::warn!(error = %e, "soft NIC: no same-host listener; peers of this host use TCP"),
            )
            .ok()
    } else {
        None
    };
    let wire = wire()?;
    wire.submit(|inbox| {
        inbox.listeners.push((Listening::Tcp(MioListener::from_std(listener)), Arc::downgrade(device)));
        if let Some(l) = local {
            // Any ring size a requester may configure (its choice, not ours: two devices with
            // different `same_host_ring` must still connect), up to the global bound.
            inbox.listeners.push((Listening::Local(l, shm::MAX_RING), Arc::downgrade(device)));
        }
    });
    Ok(port)
}

/// A device's listening socket: TCP, or the same-host Unix socket.
enum Listening {
    Tcp(MioListener),
    /// With the largest rings it maps for a peer.
    Local(UnixListener, usize),
}

impl Listening {
    fn accept(&self) -> std::io::Result<(Conn, PeerKey)> {
        match self {
            Listening::Tcp(l) => {
                let (s, addr) = l.accept()?;
                let _ = s.set_nodelay(true);
                Ok((Conn::Tcp(s), PeerKey::Ip(addr.ip())))
            }
            Listening::Local(l, max_ring) => {
                let s = shm::PeerSock::from(l.accept()?.0);
                // Only processes of this user attach (see `peer_pid_of_this_user`); any
                // other is closed here, before it can pass a descriptor or a Hello.
                match shm::peer_pid_of_this_user(s.as_raw_fd()) {
                    Ok(pid) => Ok((Conn::Unattached(s, *max_ring), PeerKey::Pid(pid))),
                    Err(e) => {
                        warn_limited!(error = %e, "soft NIC: same-host connection refused");
                        Err(std::io::ErrorKind::ConnectionAborted.into())
                    }
                }
            }
        }
    }

    fn source(&mut self) -> &mut dyn mio::event::Source {
        match self {
            Listening::Tcp(l) => l,
            Listening::Local(l, _) => l,
        }
    }
}

/// Who a connection comes from, for the per-peer bounds and the logs: an IP address, or a
/// process of this host.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum PeerKey {
    Ip(IpAddr),
    Pid(u32),
}

impl std::fmt::Display for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerKey::Ip(ip) => write!(f, "{ip}"),
            PeerKey::Pid(pid) => write!(f, "local pid {pid}"),
        }
    }
}

/// A connection's byte stream: a TCP socket, or rings shared with a process of this host.
enum Conn {
    Tcp(MioStream),
    /// A same-host connection whose memfd has not arrived yet, and the largest rings the
    /// device maps.
    Unattached(shm::PeerSock, usize),
    Shm(Box<ShmConn>),
    /// Left behind for an instant while a connection changes form.
    Moving,
}

impl Conn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.read(buf),
            Conn::Shm(c) => c.read(buf),
            Conn::Unattached(s, max_ring) => {
                let map = shm::accept_rings(s, *max_ring)?;
                let Conn::Unattached(s, _) = std::mem::replace(self, Conn::Moving) else { unreachable!() };
                *self = Conn::Shm(Box::new(ShmConn::served(s, map)));
                self.read(buf)
            }
            Conn::Moving => Err(std::io::ErrorKind::NotConnected.into()),
        }
    }

    /// Writes the pieces `parts` (`len` bytes at `src` each), in order, as far as the
    /// stream takes them now, and returns the bytes written (`WouldBlock`: none). A socket
    /// takes up to [`GATHER`] of them in one `sendmsg`, so that a payload left in its region
    /// costs an entry of a call, not a call; rings copy them in one after the other.
    ///
    /// # Safety
    /// Each `src` must be valid for reads of its `len` bytes for the whole call (they are
    /// read as opaque bytes).
    unsafe fn write_gathered(&mut self, parts: &[(Src, usize)]) -> std::io::Result<usize> {
        match self {
            Conn::Tcp(s) => {
                let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; GATHER];
                let n_iov = parts.len().min(GATHER);
                for (v, &(src, len)) in iov.iter_mut().zip(parts) {
                    *v = libc::iovec { iov_base: src.ptr().cast_mut().cast(), iov_len: len };
                }
                // SAFETY: a zeroed `msghdr` is valid (no name, no control data).
                let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
                msg.msg_iov = iov.as_mut_ptr();
                msg.msg_iovlen = n_iov as _;
                // MSG_NOSIGNAL: a closed peer is an error, not SIGPIPE; MSG_DONTWAIT: a full
                // socket is WouldBlock (the loop never blocks).
                // SAFETY: `iov[..n_iov]` covers what the caller vouches for; the kernel only
                // reads it.
                let n =
                    unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
                if n < 0 { Err(std::io::Error::last_os_error()) } else { Ok(n as usize) }
            }
            Conn::Shm(c) => {
                let mut written = 0;
                for &(src, len) in parts {
                    // SAFETY: the caller vouches for `src`.
                    match unsafe { c.write_raw(src, len) } {
                        Ok(n) => {
                            written += n;
                            if n < len {
                                break;
                            }
                        }
                        // What was written counts; the error comes again on the next call.
                        Err(_) if written > 0 => break,
                        Err(e) => return Err(e),
                    }
                }
                Ok(written)
            }
            Conn::Unattached(..) | Conn::Moving => Err(std::io::ErrorKind::NotConnected.into()),
        }
    }

    /// A readiness event came: for shared rings, take the doorbells (and note the end).
    fn on_readable(&mut self, hup: bool) {
        if let Conn::Shm(c) = self {
            c.take_doorbells(hup);
        }
    }

    /// Shared rings (not a socket). Their reads differ in one way: a short read does not
    /// mean a new edge will come (only a doorbell does, asked for when a read finds the ring
    /// empty), so they read on until `WouldBlock`.
    fn is_shm(&self) -> bool {
        matches!(self, Conn::Shm(_))
    }

    fn peer_addr(&self) -> Option<SocketAddr> {
        match self {
            Conn::Tcp(s) => s.peer_addr().ok(),
            _ => None,
        }
    }

    /// What to watch: a TCP socket for both directions; the Unix socket of shared rings
    /// for doorbells and its end only.
    fn source(&mut self, interest: Interest) -> Option<(&mut dyn mio::event::Source, Interest)> {
        match self {
            Conn::Tcp(s) => Some((s, interest)),
            Conn::Unattached(s, _) => Some((&mut **s, Interest::READABLE)),
            Conn::Shm(c) => Some((c.sock(), Interest::READABLE)),
            Conn::Moving => None,
        }
    }

    fn register(&mut self, reg: &mio::Registry, token: Token, interest: Interest) -> std::io::Result<()> {
        match self.source(interest) {
            Some((s, i)) => reg.register(s, token, i),
            None => Err(std::io::ErrorKind::NotConnected.into()),
        }
    }

    fn reregister(&mut self, reg: &mio::Registry, token: Token, interest: Interest) -> std::io::Result<()> {
        match self.source(interest) {
            Some((s, i)) => reg.reregister(s, token, i),
            None => Err(std::io::ErrorKind::NotConnected.into()),
        }
    }

    /// Ends a same-host connection for the peer at once, even while a requester's direct
    /// poster still holds a copy of the socket (dropping the loop's copy alone would not).
    fn end(&mut self) {
        if let Conn::Shm(c) = self {
            c.shutdown();
        }
    }

    fn deregister(&mut self, reg: &mio::Registry) {
        if let Some((s, _)) = self.source(Interest::READABLE) {
            let _ = reg.deregister(s);
        }
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        Conn::read(self, buf)
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // SAFETY: `buf` is valid for reads of its length.
        unsafe { self.write_gathered(&[(Src::Private(buf.as_ptr()), buf.len())]) }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

const BACKOFF_MIN: Duration = Duration::from_millis(10);
/// A link whose peer closed it before answering its Hello dials again after this, doubling
/// up to [`REDIAL_MAX`], until [`HELLO_TIMEOUT`] from its first dial.
const REDIAL_MIN: Duration = Duration::from_millis(5);
const REDIAL_MAX: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Bytes queued for one socket beyond which the loop stops producing more for it (a
/// responder stops reading requests, a requester stops taking frames from its queue) until
/// the peer has taken some: with one frame on top, the bound on a connection's queued output.
const OUT_HIGH: usize = 256 * 1024;
/// Small frames are appended to the last queued buffer while it is below this size.
const COALESCE: usize = 64 * 1024;
/// Queued chunks one write of a connection's output takes at most (one `sendmsg`).
const GATHER: usize = 64;
/// Data of at least this size is queued as its own buffer (moved, not copied).
const OWN_CHUNK: usize = 16 * 1024;
/// The loop's one read buffer, shared by all connections.
const READ_BUF: usize = 256 * 1024;
/// Writes with at least this much data are placed as they arrive; smaller ones are kept
/// whole and applied at once (checks and copy together), as cheap as placing them.
const PLACE_MIN: usize = 4096;
/// The most a served connection reads from same-host rings into the loop's buffer at once.
const SHM_READ: usize = 4096;
/// Reads per connection per turn of the loop before the others get theirs.
const READS_PER_TURN: usize = 8;
/// Bytes a connection writes per turn of the loop before the others get theirs.
const WRITE_PER_TURN: usize = 64 * 1024;
/// Sleeps of the loop after which a same-host ring with no input in any of them is no
/// longer polled on waking: it waits for its doorbell again. Only for rings the loop polls
/// on their own: those with a bit in a flag page (`super::flags`) are never polled.
///
/// The trade: a ring kept polled costs a look per turn of the loop and two stores per sleep
/// (armed, then disarmed); one dropped costs its producer a doorbell (a system call, and a
/// wake-up of this loop) for its next frame. With many connections each ring's traffic is
/// sparse against the loop's sleeps: at 4, `rdmakit-perf scaling` at 1024 pairs paid 0.76
/// to 0.81 doorbells per message; at 128, 0.33 to 0.48, and 16 against 20 us of CPU per
/// message, at 1.2 times the rate. Idle, a ring leaves after 128 sleeps (at least one per
/// `SWEEP`: under 13 s).
const KEEP_POLLING: u8 = 128;
// A ring's count of quiet sleeps stops at `u8::MAX`: below it, quiet rings still leave.
const _: () = assert!(KEEP_POLLING < u8::MAX);
/// How often the loop checks deadlines (Hello, frame and send timeouts, gone QPs/devices).
const SWEEP: Duration = Duration::from_millis(100);
/// How often a complete Hello waiting for its QP asks again.
const AUTH_RETRY: Duration = Duration::from_millis(20);

const WAKER: Token = Token(usize::MAX);
/// How long a process going away waits for its wire to write the answers it owes
/// ([`flush_at_exit`]).
const EXIT_FLUSH: Duration = Duration::from_millis(500);

/// The process's wire: one event-loop thread serving every soft device's listener, the
/// connections they accepted and every requester link, over non-blocking sockets.
/// Other threads hand it work through the inbox and wake it; they never do socket I/O.
struct Wire {
    waker: Waker,
    inbox: Mutex<Inbox>,
    /// The loop is (about to be) waiting in `poll`: only then does new work need a wake-up
    /// (a system call); a busy loop takes the inbox on its next turn anyway.
    asleep: AtomicBool,
    exit: ExitFlush,
}

/// The exit hook's handshake with the loop ([`flush_at_exit`]).
#[derive(Default)]
struct ExitFlush {
    /// The process is exiting: the loop writes what it owes at the end of its turn.
    wanted: AtomicBool,
    done: Mutex<bool>,
    cv: Condvar,
    /// The loop's thread (it must not wait for itself).
    loop_tid: std::sync::atomic::AtomicI32,
}

/// The process's wire, once started.
static WIRE: OnceLock<std::result::Result<&'static Wire, String>> = OnceLock::new();

/// Run by `exit` (an `atexit` hook): lets the wire finish its turn, so that the answers it
/// owes for requests already applied are written before the process goes.
///
/// A NIC acknowledges a write as it places the data; the soft NIC's loop writes the ACK a
/// moment after placing it. A process that sees the data in memory (a put handle, a pipe's
/// flag) may exit in between, and without this its peer's write would fail with
/// `RETRY_EXC_ERR` though delivered. Receive completions need no hook: a device serving
/// another process publishes them only after their answers are written. Bounded by
/// [`EXIT_FLUSH`]; a process killed by a signal gets no such grace (its peer sees it die).
extern "C" fn flush_at_exit() {
    let Some(Ok(w)) = WIRE.get() else { return };
    // SAFETY: gettid(2) has no preconditions.
    if w.exit.loop_tid.load(Ordering::Relaxed) == unsafe { libc::gettid() } {
        return;
    }
    w.exit.wanted.store(true, Ordering::SeqCst);
    if w.waker.wake().is_err() {
        return;
    }
    // No panic may leave an `extern "C"` function: a poisoned lock is taken as it is.
    let done = w.exit.done.lock().unwrap_or_else(|e| e.into_inner());
    let _ = w.exit.cv.wait_timeout_while(done, EXIT_FLUSH, |d| !*d);
}

#[derive(Default)]
struct Inbox {
    listeners: Vec<(Listening, Weak<SoftDevice>)>,
    links: Vec<NewLink>,
    /// Links for the loop to dial (non-blocking) before their first Hello.
    dials: Vec<Redial>,
    /// Links with new frames queued, or dropped.
    ready: Vec<Arc<LinkShared>>,
    /// A QP of this process was connected: Hellos waiting for their QP may be answered.
    auth: bool,
    /// Entries of regions deregistered: payloads queued from them are copied out
    /// ([`copy_out_tails`]).
    revoked: Vec<Weak<MrEntry>>,
}

struct NewLink {
    /// Connected, its Hello sent.
    s: Conn,
    shared: Arc<LinkShared>,
    qp: Weak<SoftQp>,
    /// How to dial again until the peer accepts the Hello.
    dial: Option<Dial>,
}

/// How a link whose Hello is unanswered is set up again.
///
/// A device over its bound of connections waiting for their QPs ([`MAX_PENDING`]) closes
/// new ones; for an honest requester that means "busy", as a full listen backlog does, not
/// "gone": its peer may just not have connected its QPs yet (out-of-band set-up lets either
/// side go first). So until the peer accepts the Hello, a link holds its requests (none
/// can be lost with a closed socket or abandoned rings) and, when the peer closes, dials
/// again with backoff until `until`; then it fails, and its requests time out as before.
struct Dial {
    addr: SocketAddr,
    /// Same-host rings to try first: the device's GID and the ring size.
    shm: Option<([u8; 16], usize)>,
    /// The encoded Hello.
    hello: Vec<u8>,
    /// [`HELLO_TIMEOUT`] after the first dial (before it: after the link was made, the
    /// most a first dial waits for a turn to its address, [`DIALS_PER_ADDR`]).
    until: Instant,
    /// Dialed once: the first dial restarts `until`, so a wait for a turn does not shorten
    /// the time the link has to be accepted.
    dialed: bool,
    /// The wait before the next dial.
    backoff: Duration,
}

/// A TCP link's turn among the dials to its address ([`DIALS_PER_ADDR`]), held until its
/// Hello is written; given back when dropped (with its link, on any path).
struct Opening(Arc<AtomicUsize>);

impl Opening {
    /// A turn, if the address has one free (`count`: its links opening now).
    fn take(count: &Arc<AtomicUsize>) -> Option<Opening> {
        // Only the loop's thread takes and gives back turns: no race between look and add.
        if count.load(Ordering::Relaxed) >= DIALS_PER_ADDR {
            return None;
        }
        count.fetch_add(1, Ordering::Relaxed);
        Some(Opening(count.clone()))
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A link waiting to dial again, off the loop's slab.
struct Redial {
    at: Instant,
    shared: Arc<LinkShared>,
    qp: Weak<SoftQp>,
    dial: Dial,
}

impl Wire {
    /// Runs `f` on the inbox and wakes the loop.
    fn submit(&self, f: impl FnOnce(&mut Inbox)) {
        f(&mut self.inbox.lock().expect("wire inbox"));
        // After the inbox lock: either the loop saw this work when it looked before
        // sleeping, or it had said it was asleep before looking, and this wakes it.
        if self.asleep.swap(false, Ordering::SeqCst)
            && let Err(e) = self.waker.wake()
        {
            warn_limited!(error = %e, "soft NIC: cannot wake the wire's event loop");
        }
    }
}

/// The process's wire, started on first use.
fn wire() -> std::io::Result<&'static Wire> {
    WIRE.get_or_init(|| start_wire().map_err(|e| e.to_string()))
        .as_ref()
        .map(|w| *w)
        .map_err(|e| std::io::Error::other(format!("soft NIC wire: {e}")))
}

/// A poll and the wire whose waker it watches.
fn new_wire() -> std::io::Result<(Poll, &'static Wire)> {
    let poll = Poll::new()?;
    let waker = Waker::new(poll.registry(), WAKER)?;
    // Lives as long as the process: links and listeners of any device may reach it.
    let wire: &'static Wire = Box::leak(Box::new(Wire {
        waker,
        inbox: Mutex::new(Inbox::default()),
        asleep: AtomicBool::new(false),
        exit: ExitFlush::default(),
    }));
    Ok((poll, wire))
}

fn start_wire() -> std::io::Result<&'static Wire> {
    let (poll, wire) = new_wire()?;
    #[cfg(not(miri))]
    // SAFETY: registers a function taking and returning nothing, which only reads statics
    // and never unwinds; atexit(3) has no other precondition.
    unsafe {
        if libc::atexit(flush_at_exit) != 0 {
            tracing::debug!("soft NIC: atexit failed; answers owed at exit may be lost");
        }
    }
    let lp = EventLoop::new(poll, wire, spin_window());
    std::thread::Builder::new().name("rdmakit-soft-wire".into()).spawn(move || lp.run())?;
    Ok(wire)
}

/// A QP of this process was connected (moved to RTR): Hellos waiting for it are answered
/// on the loop's next turn rather than at its next periodic retry ([`AUTH_RETRY`]), which a
/// burst of connections outran (a device keeps at most [`MAX_PENDING`] waiting). Nothing to
/// do when the wire has not started: no Hello can be waiting.
pub(crate) fn qp_connected() {
    if let Some(Ok(wire)) = WIRE.get() {
        wire.submit(|inbox| inbox.auth = true);
    }
}

/// The region whose entry is `entry` was deregistered: the loop copies the payloads still
/// queued from it out of the region on its next turn, so that a peer reading them slowly
/// does not keep the region (and its deregistration) waiting. (A `Weak`, which keeps the
/// entry's allocation, so its address names no other region meanwhile.) Nothing to do when
/// the wire has not started: nothing is queued.
pub(crate) fn copy_out_tails(entry: Weak<MrEntry>) {
    if let Some(Ok(wire)) = WIRE.get() {
        wire.submit(|inbox| inbox.revoked.push(entry));
    }
}

/// A device's listener on the loop.
struct Lst {
    l: Listening,
    device: Weak<SoftDevice>,
    /// Tokens of its connections that are not authenticated yet.
    pending: Vec<usize>,
    /// Its authenticated connections being served.
    served: Arc<AtomicUsize>,
    backoff: Duration,
    /// After an accept error (EMFILE...): no accepting before this.
    paused_until: Option<Instant>,
    /// Connections may be waiting in the backlog (the last accept did not say WouldBlock).
    ready: bool,
}

/// A connection that has not proven who it is yet.
struct Pending {
    s: Conn,
    ip: PeerKey,
    listener: usize,
    buf: [u8; HELLO_FRAME],
    got: usize,
    deadline: Instant,
    hello: Option<Frame>,
}

enum Next {
    Keep,
    Drop,
    Serve(Arc<SoftQp>),
}

/// A piece of a connection's queued output.
enum Chunk {
    Bytes(Vec<u8>, usize),
    /// A request's payload sent straight from its registered region (`send(2)` reads it).
    Tail(SharedTail, usize),
}

/// A connection's socket with its input state and bounded output queue.
struct Io {
    s: Conn,
    rd: FrameReader,
    /// Input read but not consumed yet (the connection was held back by its output).
    left: Vec<u8>,
    out: VecDeque<Chunk>,
    out_bytes: usize,
    /// Readiness as last reported by the edge-triggered poll (until WouldBlock).
    readable: bool,
    writable: bool,
    /// When output last moved (or became pending): the send timeout counts from here.
    last_progress: Instant,
}

impl Io {
    fn new(s: Conn, accept: Accept) -> Io {
        Io {
            s,
            rd: FrameReader::new(accept),
            left: Vec::new(),
            out: VecDeque::new(),
            out_bytes: 0,
            readable: true,
            writable: true,
            last_progress: Instant::now(),
        }
    }

    fn start_output(&mut self) {
        if self.out.is_empty() {
            self.last_progress = Instant::now();
        }
    }

    /// Queues `f` (its data, when large, moved into the queue as is).
    fn push_frame(&mut self, mut f: Frame, scratch: &mut Vec<u8>) {
        self.start_output();
        let data = match &mut f {
            Frame::Write { data, .. } | Frame::Send { data, .. } | Frame::Ack { data, .. }
                if data.len() >= OWN_CHUNK =>
            {
                std::mem::take(data)
            }
            _ => Vec::new(),
        };
        scratch.clear();
        let inline = wire::encode_split(&f, scratch);
        debug_assert!(data.is_empty() || inline.is_empty());
        let inline = inline.to_vec();
        if !data.is_empty() {
            patch_len(scratch, data.len());
        }
        self.push_bytes(scratch);
        self.push_bytes(&inline);
        if !data.is_empty() {
            self.out_bytes += data.len();
            self.out.push_back(Chunk::Bytes(data, 0));
        }
    }

    /// Queues a frame whose data, as `tail`, is still in a registered region: a request's
    /// payload in the requester's, or a read's response in the responder's.
    fn push_with_tail(&mut self, f: Frame, tail: Option<SharedTail>, scratch: &mut Vec<u8>) {
        let Some(tail) = tail else { return self.push_frame(f, scratch) };
        self.start_output();
        scratch.clear();
        let inline = wire::encode_split(&f, scratch);
        debug_assert!(inline.is_empty(), "a shared payload's frame carries no data");
        // The header's length counts the payload that follows from the region.
        patch_len(scratch, tail.len);
        self.push_bytes(scratch);
        self.out_bytes += tail.len;
        self.out.push_back(Chunk::Tail(tail, 0));
    }

    fn push_bytes(&mut self, b: &[u8]) {
        if b.is_empty() {
            return;
        }
        self.out_bytes += b.len();
        if let Some(Chunk::Bytes(last, _)) = self.out.back_mut()
            && last.len() < COALESCE
        {
            last.extend_from_slice(b);
            return;
        }
        self.out.push_back(Chunk::Bytes(b.to_vec(), 0));
    }

    /// A readiness event: shared rings take their doorbells, and any doorbell may mean
    /// either direction moved.
    fn on_event(&mut self, readable: bool, writable: bool, hup: bool) {
        if self.s.is_shm() {
            if readable {
                self.s.on_readable(hup);
                self.readable = true;
                self.writable = true;
            }
        } else {
            self.readable |= readable;
            self.writable |= writable;
        }
    }

    /// Writes queued output until done or the socket is full. Err: the connection failed.
    fn flush(&mut self) -> std::io::Result<()> {
        self.flush_up_to(usize::MAX).map(drop)
    }

    /// [`flush`](Self::flush), stopping once `budget` bytes are written (a turn's share of
    /// the loop: a large answer to a peer that takes it fast must not keep the loop from
    /// every other connection); returns the bytes written.
    fn flush_up_to(&mut self, budget: usize) -> std::io::Result<usize> {
        let mut written = 0;
        while !self.out.is_empty() && written < budget {
            // The queued chunks from the front, within the budget.
            let mut parts = [(Src::Private(std::ptr::null()), 0); GATHER];
            let (mut n_parts, mut want) = (0, 0);
            for c in self.out.iter().take(GATHER) {
                let left = budget - written - want;
                if left == 0 {
                    break;
                }
                let (src, len) = match c {
                    Chunk::Bytes(b, off) => (Src::Private(b[*off..].as_ptr()), b.len() - *off),
                    // SAFETY: `*off < t.len` (a chunk written whole is popped), so the
                    // pointer stays within the `t.len` bytes `t` keeps valid.
                    Chunk::Tail(t, off) => (Src::Shared(unsafe { t.ptr.add(*off) }), t.len - *off),
                };
                let len = len.min(left);
                parts[n_parts] = (src, len);
                n_parts += 1;
                want += len;
            }
            // SAFETY: each part covers live bytes: a chunk's own buffer, or a tail's region
            // kept valid by its chunk, which stays queued until the call returns.
            match unsafe { self.s.write_gathered(&parts[..n_parts]) } {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    written += n;
                    self.last_progress = Instant::now();
                    self.consume(n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.writable = false;
                    return Ok(written);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(written)
    }

    /// Drops the first `n` queued bytes, written: whole chunks popped, the next one's
    /// offset moved.
    fn consume(&mut self, mut n: usize) {
        self.out_bytes -= n;
        while n > 0 {
            let Some(c) = self.out.front_mut() else { break };
            let (off, len) = match c {
                Chunk::Bytes(b, off) => (off, b.len()),
                Chunk::Tail(t, off) => (off, t.len),
            };
            let take = n.min(len - *off);
            *off += take;
            n -= take;
            if *off == len {
                self.out.pop_front();
            }
        }
    }

    /// Output is left that the socket could take now: the connection wants another turn.
    fn more_to_write(&self) -> bool {
        !self.out.is_empty() && self.writable
    }

    /// The peer has not taken our bytes for [`SEND_TIMEOUT`].
    fn send_stalled(&self, now: Instant) -> bool {
        !self.out.is_empty() && now.saturating_duration_since(self.last_progress) > SEND_TIMEOUT
    }

    /// Gives memory back when idle (an idle connection keeps no buffers).
    fn trim(&mut self) {
        if self.out.is_empty() && self.out.capacity() > 8 {
            self.out = VecDeque::new();
        }
        if self.left.is_empty() && self.left.capacity() > 0 {
            self.left = Vec::new();
        }
    }
}

/// A requester's stream ended inside a frame: said, and the answers already queued go out
/// if the stream takes them now. Always false (the connection ends).
fn closed_inside_a_frame(s: &mut ServedConn) -> bool {
    warn_limited!(peer = ?s.peer, "soft NIC: connection closed inside a frame");
    let _ = s.io.flush();
    false
}

/// Sets the length in an encoded header to its fixed part plus `extra` data bytes.
fn patch_len(encoded: &mut [u8], extra: usize) {
    let len = u32::from_le_bytes([encoded[4], encoded[5], encoded[6], encoded[7]]) as usize + extra;
    encoded[4..8].copy_from_slice(&(len as u32).to_le_bytes());
}

/// An authenticated connection: the target side of one requester QP.
struct ServedConn {
    io: Io,
    qp: Weak<SoftQp>,
    requester: Requester<'static>,
    /// The PSN the next request must carry. Go-back-N: after an RNR NAK, requests are
    /// dropped until the NAKed one comes again; replays and gaps are dropped the same way.
    expected: u32,
    peer: Option<SocketAddr>,
    /// The receive completions of requests answered but whose answers are not written
    /// yet, and QPs to kick: released after each flush (see [`Deferred::holding`]).
    held: Deferred,
    /// Keys granted to this requester for direct placement (at most
    /// [`direct::MAX_GRANTS`]).
    grants: usize,
    _count: Served,
}

/// A requester QP's connection to a remote device.
struct LinkConn {
    io: Io,
    shared: Arc<LinkShared>,
    qp: Weak<SoftQp>,
    /// Until the peer accepts the Hello: how to dial again if it closes first.
    dial: Option<Dial>,
    /// Until its Hello is written: its turn among the dials to its address.
    opening: Option<Opening>,
}

/// A slab slot's standing in the loop's polling of same-host rings.
#[derive(Clone, Copy, Default)]
struct SlotPolling {
    /// In `polled` (a slot is listed once, whoever holds it now).
    listed: bool,
    /// The loop's sleeps since its ring last had input (saturating).
    quiet: u8,
    /// The connection's bit in a flag page the loop reads ([`FlagScan`]): its ring is
    /// never polled nor armed on its own.
    flag: Option<FlagOwner>,
}

/// Where a connection's bit is: the page (by its address), the ring, the bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FlagOwner {
    page: usize,
    ring: usize,
    bit: u32,
}

/// The loop's reading of one ready-flag page, for the ring it consumes there
/// (`super::flags`): the connections whose bits it owns.
struct FlagScan {
    page: Arc<FlagPage>,
    ring: usize,
    /// By bit: the slab index of the connection it names, plus one (0: none).
    owners: Vec<u32>,
    /// The words of bits to read: those holding an owned bit, in order. Only those: a peer
    /// naming a high bit must not make every turn read the whole page.
    words: Vec<usize>,
    live: usize,
}

enum Entry {
    Listener(Lst),
    Pending(Pending),
    Served(ServedConn),
    Link(LinkConn),
}

struct EventLoop {
    poll: Poll,
    wire: &'static Wire,
    /// Everything on the loop, by token.
    slab: Vec<Option<Entry>>,
    free: Vec<usize>,
    listeners: Vec<usize>,
    /// Connections with input or output left over from their last turn.
    again: Vec<usize>,
    /// Links waiting to dial again.
    redials: Vec<Redial>,
    /// Links due to dial whose address has [`DIALS_PER_ADDR`] opening: dialed, in order, as
    /// those write their Hellos.
    held_dials: VecDeque<Redial>,
    /// By address: the links opening to it ([`Opening`]).
    opening: HashMap<SocketAddr, Arc<AtomicUsize>>,
    /// Same-host connections whose rings the loop looks at on every turn until it sleeps
    /// (their peers post without doorbells meanwhile; see [`ShmConn::set_polled`]).
    polled: Vec<(usize, shm::Probe)>,
    /// By slab index: the slot's standing in the polling ([`SlotPolling`]).
    slots: Vec<SlotPolling>,
    /// The last look at the polled rings found input: no sleeping yet.
    polled_input: bool,
    /// Polled rings armed for the loop's sleep, polled again when it wakes
    /// ([`resume_polling`](Self::resume_polling)).
    slept: Vec<usize>,
    /// The flag pages whose bits name connections on this loop.
    scans: Vec<FlagScan>,
    /// The connections the last read of the flag pages named (kept for its allocation).
    flag_turns: Vec<usize>,
    /// How long the loop polls after a turn with work before it sleeps ([`SPIN_ENV`]).
    spin: Duration,
    rbuf: Vec<u8>,
    scratch: Vec<u8>,
}

impl EventLoop {
    fn new(poll: Poll, wire: &'static Wire, spin: Duration) -> EventLoop {
        EventLoop {
            poll,
            wire,
            slab: Vec::new(),
            free: Vec::new(),
            listeners: Vec::new(),
            again: Vec::new(),
            redials: Vec::new(),
            held_dials: VecDeque::new(),
            opening: HashMap::new(),
            polled: Vec::new(),
            slots: Vec::new(),
            polled_input: false,
            slept: Vec::new(),
            scans: Vec::new(),
            flag_turns: Vec::new(),
            spin,
            rbuf: vec![0; READ_BUF],
            scratch: Vec::new(),
        }
    }

    fn run(mut self) {
        // SAFETY: gettid(2) has no preconditions.
        self.wire.exit.loop_tid.store(unsafe { libc::gettid() }, Ordering::Relaxed);
        ON_WIRE.set(true);
        // Peers granted direct access learn from the kernel when this thread (and so the
        // process) ends.
        direct::watch_loop_thread();
        let mut events = Events::with_capacity(1024);
        let mut next_sweep = Instant::now() + SWEEP;
        let mut next_auth = Instant::now() + AUTH_RETRY;
        let mut next_idle = Instant::now() + IDLE_CHECK;
        // Until then the loop polls instead of sleeping (its last turn with work, plus the
        // spin window).
        let mut spin_until = Instant::now();
        loop {
            let now = Instant::now();
            let mut until = next_sweep.min(next_auth);
            if let Some(r) = self.redials.iter().map(|r| r.at).min() {
                until = until.min(r);
            }
            for &li in &self.listeners {
                if let Some(Some(Entry::Listener(l))) = self.slab.get(li)
                    && let Some(p) = l.paused_until
                {
                    until = until.min(p);
                }
            }
            // With a spin window ([`SPIN_ENV`]), work is taken to come soon after work (a
            // peer answering, the application posting its next request): polling a while
            // longer (yielding the core between looks) saves the sleep and wake-up, and the
            // doorbells the armed rings would cost their producers.
            let spinning = now < spin_until;
            if !spinning {
                self.wire.asleep.store(true, Ordering::SeqCst);
            }
            let polled_input = std::mem::take(&mut self.polled_input);
            let work = !self.again.is_empty() || polled_input || {
                let inbox = self.wire.inbox.lock().expect("wire inbox");
                !(inbox.listeners.is_empty()
                    && inbox.links.is_empty()
                    && inbox.dials.is_empty()
                    && inbox.ready.is_empty()
                    && inbox.revoked.is_empty())
                    || inbox.auth
            };
            let work = work
                || (spinning && {
                    std::thread::yield_now();
                    true
                });
            let work = work || self.arm_polled();
            let timeout = if work { Duration::ZERO } else { until.saturating_duration_since(now) };
            let polled = self.poll.poll(&mut events, Some(timeout));
            self.wire.asleep.store(false, Ordering::SeqCst);
            self.resume_polling();
            if let Err(e) = polled {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    warn_limited!(error = %e, "soft NIC: the wire's poll failed");
                    std::thread::sleep(BACKOFF_MIN);
                }
                continue;
            }
            for ev in events.iter() {
                if ev.token() == WAKER {
                    continue;
                }
                let hup = ev.is_read_closed() || ev.is_error();
                self.on_event(ev.token().0, ev.is_readable() || hup, ev.is_writable(), hup);
            }
            self.take_inbox();
            let again = std::mem::take(&mut self.again);
            // Inbox work (a post queued for the loop) counts, as events and ring input do.
            let mut worked = !events.is_empty() || !again.is_empty();
            for i in again {
                self.on_event(i, false, false, false);
            }
            self.poll_rings();
            self.poll_flags();
            worked |= self.polled_input || !self.again.is_empty();
            if self.wire.exit.wanted.swap(false, Ordering::SeqCst) {
                self.flush_for_exit();
            }
            let now = Instant::now();
            if worked {
                spin_until = now + self.spin;
            }
            self.resume_listeners(now);
            self.redial_due(now);
            if now >= next_auth {
                self.retry_auth();
                next_auth = now + AUTH_RETRY;
            }
            if now >= next_sweep {
                let idle_check = now >= next_idle;
                if idle_check {
                    next_idle = now + IDLE_CHECK;
                }
                self.sweep(now, idle_check);
                next_sweep = now + SWEEP;
            }
        }
    }

    fn insert(&mut self, e: Entry) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.slab[i] = Some(e);
                i
            }
            None => {
                self.slab.push(Some(e));
                self.slab.len() - 1
            }
        }
    }

    /// Ends entry `i` (taken out of the slab): its socket closes as it drops.
    fn remove(&mut self, i: usize, e: Entry) {
        match e {
            Entry::Listener(mut l) => {
                let _ = self.poll.registry().deregister(l.l.source());
                self.listeners.retain(|&x| x != i);
                for p in std::mem::take(&mut l.pending) {
                    if !matches!(self.slab[p], Some(Entry::Pending(_))) {
                        continue;
                    }
                    if let Some(Entry::Pending(mut pc)) = self.slab[p].take() {
                        pc.s.deregister(self.poll.registry());
                        self.free.push(p);
                    }
                }
            }
            Entry::Pending(mut p) => {
                p.s.deregister(self.poll.registry());
                if let Some(Some(Entry::Listener(l))) = self.slab.get_mut(p.listener) {
                    l.pending.retain(|&x| x != i);
                }
            }
            Entry::Served(mut s) => {
                s.io.s.deregister(self.poll.registry());
                s.io.s.end();
            }
            Entry::Link(mut c) => {
                c.io.s.deregister(self.poll.registry());
                c.io.s.end();
                c.shared.fail();
            }
        }
        self.unlist(i);
        self.free.push(i);
    }

    fn take_inbox(&mut self) {
        let inbox = std::mem::take(&mut *self.wire.inbox.lock().expect("wire inbox"));
        for (l, device) in inbox.listeners {
            let i = self.insert(Entry::Listener(Lst {
                l,
                device,
                pending: Vec::new(),
                served: Arc::new(AtomicUsize::new(0)),
                backoff: BACKOFF_MIN,
                paused_until: None,
                ready: true,
            }));
            let Some(Some(Entry::Listener(l))) = self.slab.get_mut(i) else { unreachable!() };
            if let Err(e) = self.poll.registry().register(l.l.source(), Token(i), Interest::READABLE) {
                tracing::error!(error = %e, "soft NIC: cannot watch a listener");
                let e = self.slab[i].take().expect("just inserted");
                self.remove(i, e);
                continue;
            }
            self.listeners.push(i);
            self.again.push(i);
        }
        for nl in inbox.links {
            let io = Io::new(nl.s, Accept::HelloAck);
            self.add_link(LinkConn { io, shared: nl.shared, qp: nl.qp, dial: nl.dial, opening: None });
        }
        // First dials: due now (`redial_due` runs later in this turn).
        self.redials.extend(inbox.dials);
        for link in inbox.ready {
            link.flagged.store(false, Ordering::Release);
            let i = link.token.load(Ordering::Acquire);
            // A link the loop has already ended has nothing to send.
            if let Some(Some(Entry::Link(c))) = self.slab.get(i)
                && Arc::ptr_eq(&c.shared, &link)
            {
                self.again.push(i);
            }
        }
        self.again.sort_unstable();
        self.again.dedup();
        if inbox.auth {
            self.retry_auth();
        }
        for entry in inbox.revoked {
            self.copy_out(entry);
        }
    }

    /// Copies every payload queued from the region whose entry is `entry` out of it (once
    /// per run of overlapping payloads: [`TailCopies`]), in connections' output and in
    /// links' queues (on the loop, waiting to dial again or for a turn to dial).
    fn copy_out(&mut self, entry: Weak<MrEntry>) {
        // The entry is held through both passes: the tails noted may go meanwhile (a QP
        // dropped clears its link's queue), and the copy reads the region. Gone already:
        // nothing reads the region any more.
        let Some(held) = entry.upgrade() else { return };
        let mut copies = TailCopies::new(entry);
        self.each_tail(|t| copies.note(t));
        // SAFETY: `held` keeps the region's bytes valid through the copy.
        unsafe { copies.copy() };
        self.each_tail(|t| copies.rehome(t));
        drop(held);
    }

    /// Runs `f` on every queued payload still in its region.
    fn each_tail(&mut self, mut f: impl FnMut(&mut SharedTail)) {
        let queues = self.slab.iter().filter_map(|e| match e {
            Some(Entry::Link(c)) => Some(&c.shared),
            _ => None,
        });
        let waiting = self.redials.iter().chain(&self.held_dials).map(|r| &r.shared);
        for shared in queues.chain(waiting) {
            for (_, tail) in shared.queue.lock().expect("link queue").iter_mut() {
                if let Some(t) = tail {
                    f(t);
                }
            }
        }
        for e in self.slab.iter_mut().flatten() {
            let io = match e {
                Entry::Link(c) => &mut c.io,
                Entry::Served(s) => &mut s.io,
                _ => continue,
            };
            for c in &mut io.out {
                if let Chunk::Tail(t, _) = c {
                    f(t);
                }
            }
        }
    }

    /// Puts link `c` on the loop.
    fn add_link(&mut self, c: LinkConn) {
        let shared = c.shared.clone();
        let i = self.insert(Entry::Link(c));
        shared.token.store(i, Ordering::Release);
        let Some(Some(Entry::Link(c))) = self.slab.get_mut(i) else { unreachable!() };
        if let Err(e) =
            c.io.s.register(self.poll.registry(), Token(i), Interest::READABLE | Interest::WRITABLE)
        {
            tracing::error!(error = %e, "soft NIC: cannot watch a link");
            let e = self.slab[i].take().expect("just inserted");
            self.remove(i, e);
            return;
        }
        self.watch_flag(i);
        self.again.push(i);
    }

    /// Link `c` (taken out of the slab at `i`) ended. One whose Hello is unanswered dials
    /// again later if its time allows ([`Dial`]); any other fails.
    fn end_link(&mut self, i: usize, mut c: LinkConn) {
        let now = Instant::now();
        match c.dial.take() {
            Some(mut dial) if now + dial.backoff < dial.until && !c.shared.closed.load(Ordering::Acquire) => {
                c.io.s.deregister(self.poll.registry());
                c.io.s.end();
                self.unlist(i);
                self.free.push(i);
                let at = now + dial.backoff;
                dial.backoff = (dial.backoff * 2).min(REDIAL_MAX);
                self.redials.push(Redial { at, shared: c.shared, qp: c.qp, dial });
            }
            _ => self.remove(i, Entry::Link(c)),
        }
    }

    /// Dials the links whose wait is over: those held for a turn to their address first, in
    /// order, then those whose backoff ended.
    fn redial_due(&mut self, now: Instant) {
        if self.held_dials.is_empty() && !self.redials.iter().any(|r| r.at <= now) {
            return;
        }
        let (due, later): (Vec<Redial>, Vec<Redial>) =
            std::mem::take(&mut self.redials).into_iter().partition(|r| r.at <= now);
        self.redials = later;
        let held = std::mem::take(&mut self.held_dials);
        for r in held.into_iter().chain(due) {
            if r.shared.closed.load(Ordering::Acquire) || r.qp.strong_count() == 0 {
                r.shared.fail();
                continue;
            }
            // Same-host rings first (the Hello is in the ring when it returns), else TCP.
            if let Some((gid, ring)) = r.dial.shm
                && let Some(conn) = shm::connect(&gid, &r.dial.hello, ring)
            {
                let io = Io::new(Conn::Shm(Box::new(conn)), Accept::HelloAck);
                self.add_link(LinkConn { io, shared: r.shared, qp: r.qp, dial: Some(r.dial), opening: None });
                continue;
            }
            let count = self.opening.entry(r.dial.addr).or_default();
            let Some(opening) = Opening::take(count) else {
                let mut r = r;
                if now >= r.dial.until {
                    r.shared.fail();
                } else {
                    // Its rings were just tried: it waits for a TCP turn.
                    r.dial.shm = None;
                    self.held_dials.push_back(r);
                }
                continue;
            };
            let mut r = r;
            if !r.dial.dialed {
                r.dial.dialed = true;
                r.dial.until = now + HELLO_TIMEOUT;
            }
            // Non-blocking: the Hello goes out when the socket first says it is writable.
            match MioStream::connect(r.dial.addr) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    let mut io = Io::new(Conn::Tcp(s), Accept::HelloAck);
                    io.writable = false;
                    io.push_bytes(&r.dial.hello);
                    let c = LinkConn {
                        io,
                        shared: r.shared,
                        qp: r.qp,
                        dial: Some(r.dial),
                        opening: Some(opening),
                    };
                    self.add_link(c);
                }
                Err(e) => {
                    warn_limited!(addr = %r.dial.addr, error = %e, "soft NIC: dialing a peer again failed");
                    let mut dial = r.dial;
                    if now + dial.backoff < dial.until {
                        let at = now + dial.backoff;
                        dial.backoff = (dial.backoff * 2).min(REDIAL_MAX);
                        self.redials.push(Redial { at, shared: r.shared, qp: r.qp, dial });
                    } else {
                        r.shared.fail();
                    }
                }
            }
        }
        // Addresses with no link opening are forgotten.
        self.opening.retain(|_, c| Arc::strong_count(c) > 1);
    }

    fn on_event(&mut self, i: usize, readable: bool, writable: bool, hup: bool) {
        let Some(mut e) = self.slab.get_mut(i).and_then(Option::take) else { return };
        let keep = match &mut e {
            Entry::Listener(l) => {
                l.ready |= readable;
                self.accept_all(i, l);
                true
            }
            Entry::Pending(p) => {
                let next = if p.hello.is_none() {
                    if readable {
                        p.s.on_readable(hup);
                        self.read_hello(p)
                    } else {
                        Next::Keep
                    }
                } else if hup {
                    Next::Drop
                } else {
                    // A complete Hello waits for its QP: the requests pipelined behind it
                    // stay in the socket for the served connection to read.
                    Next::Keep
                };
                self.settle(i, e, next);
                return;
            }
            Entry::Served(s) => {
                s.io.on_event(readable, writable, hup);
                let keep = self.drive_served(i, s);
                self.start_polling(i, &mut s.io.s);
                keep
            }
            Entry::Link(c) => {
                c.io.on_event(readable, writable, hup);
                let keep = self.drive_link(i, c);
                self.start_polling(i, &mut c.io.s);
                keep
            }
        };
        self.put_back(i, e, keep);
    }

    /// After a turn: entry `i` goes back to its slot, or ends.
    fn put_back(&mut self, i: usize, e: Entry, keep: bool) {
        if keep {
            self.slab[i] = Some(e);
        } else if let Entry::Link(c) = e {
            self.end_link(i, c);
        } else {
            self.remove(i, e);
        }
    }

    /// The process exits: what every served connection owes is written now (as far as its
    /// peer has room), then the exit hook is let go.
    fn flush_for_exit(&mut self) {
        for e in self.slab.iter_mut().flatten() {
            if let Entry::Served(s) = e {
                if !s.io.out.is_empty() {
                    let _ = s.io.flush();
                }
                s.held.release();
            }
        }
        *self.wire.exit.done.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.wire.exit.cv.notify_all();
    }

    // ---- same-host rings looked at without doorbells ----

    /// A same-host connection that just had a turn is polled from now until the loop
    /// sleeps: more is likely to come soon, and looking costs less than a doorbell.
    fn start_polling(&mut self, i: usize, conn: &mut Conn) {
        let Conn::Shm(c) = conn else { return };
        if self.slots.get(i).is_some_and(|s| s.flag.is_some()) {
            return; // its flag bit stands for polling
        }
        if c.is_polled() {
            // Polled already (since the loop woke, say), and its turn came from a doorbell
            // sent just before: that is input, and the ring is not quiet.
            if let Some(slot) = self.slots.get_mut(i)
                && slot.listed
            {
                slot.quiet = 0;
            }
            return;
        }
        c.set_polled(true);
        if self.slots.len() <= i {
            self.slots.resize(i + 1, SlotPolling::default());
        }
        if self.slots[i].listed {
            // Listed for a connection that held the slot before (see `unlist`).
            self.polled.retain(|(x, _)| *x != i);
        }
        self.slots[i] = SlotPolling { listed: true, quiet: 0, flag: None };
        self.polled.push((i, c.probe()));
    }

    /// Slot `i` ends: its ring is polled no more, and its flag bit names nothing.
    fn unlist(&mut self, i: usize) {
        let Some(slot) = self.slots.get_mut(i) else { return };
        if slot.listed {
            slot.listed = false;
            self.polled.retain(|(x, _)| *x != i);
        }
        if let Some(o) = slot.flag.take()
            && let Some(k) =
                self.scans.iter().position(|s| Arc::as_ptr(&s.page) as usize == o.page && s.ring == o.ring)
        {
            let scan = &mut self.scans[k];
            if let Some(owner) = scan.owners.get_mut(o.bit as usize)
                && *owner as usize == i + 1
            {
                *owner = 0;
                scan.live -= 1;
                let w = o.bit as usize / 64;
                let word = &scan.owners[w * 64..scan.owners.len().min(w * 64 + 64)];
                if word.iter().all(|&x| x == 0) {
                    scan.words.retain(|&x| x != w);
                }
            }
            if scan.live == 0 {
                self.scans.swap_remove(k);
            }
        }
    }

    /// Connection `i` (just placed in the slab) has a bit in a flag page: the loop reads
    /// that page and gives it a turn when its bit is set, instead of polling its ring. A bit
    /// another connection of the page holds (one ending while its bit was given again, or
    /// a peer naming one bit twice) is not taken: that ring is polled as without a page.
    fn watch_flag(&mut self, i: usize) {
        let Some((c, _)) = self.rings(i) else { return };
        let Some(f) = c.flag() else { return };
        let (page, bit, ring) = (f.page().clone(), f.bit(), c.rx_ring());
        let k = match self.scans.iter().position(|s| Arc::ptr_eq(&s.page, &page) && s.ring == ring) {
            Some(k) => k,
            None => {
                self.scans.push(FlagScan {
                    page: page.clone(),
                    ring,
                    owners: Vec::new(),
                    words: Vec::new(),
                    live: 0,
                });
                self.scans.len() - 1
            }
        };
        let scan = &mut self.scans[k];
        let b = bit as usize;
        if scan.owners.len() <= b {
            scan.owners.resize(b + 1, 0);
        }
        if scan.owners[b] != 0 {
            return; // (an owner: the scan is live, it stays)
        }
        scan.owners[b] = u32::try_from(i + 1).expect("slab index fits a u32");
        scan.live += 1;
        if let Err(at) = scan.words.binary_search(&(b / 64)) {
            scan.words.insert(at, b / 64);
        }
        if self.slots.len() <= i {
            self.slots.resize(i + 1, SlotPolling::default());
        }
        self.unlist(i);
        self.slots[i].flag = Some(FlagOwner { page: Arc::as_ptr(&page) as usize, ring, bit });
        if let Some((c, _)) = self.rings(i) {
            // Its reads never ask for the ring's own doorbell: the page's stands for it.
            c.set_polled(true);
        }
    }

    /// Reads the flag pages and gives a turn to each connection named there with input.
    fn poll_flags(&mut self) {
        let mut turns = std::mem::take(&mut self.flag_turns);
        for s in &self.scans {
            for &k in &s.words {
                let mut bits = s.page.take(s.ring, k);
                while bits != 0 {
                    let b = k * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    if let Some(&o) = s.owners.get(b)
                        && o != 0
                    {
                        turns.push(o as usize - 1);
                    }
                }
            }
        }
        if !turns.is_empty() {
            FlagPage::took();
        }
        for &i in &turns {
            let input = match Self::rings_in(&mut self.slab, i) {
                Some((c, takes)) => takes && c.has_input(),
                None => false,
            };
            if input {
                self.polled_input = true;
                self.ring_turn(i);
            }
        }
        turns.clear();
        self.flag_turns = turns;
    }

    /// The rings of entry `i`, if it is a same-host connection, and whether it takes input
    /// now: a served connection held back by answers its peer has not taken does not (it
    /// waits for the doorbell of the peer making room), or the loop would spin on it.
    fn rings(&mut self, i: usize) -> Option<(&mut ShmConn, bool)> {
        Self::rings_in(&mut self.slab, i)
    }

    fn rings_in(slab: &mut [Option<Entry>], i: usize) -> Option<(&mut ShmConn, bool)> {
        match slab.get_mut(i)? {
            Some(Entry::Served(ServedConn { io: Io { s: Conn::Shm(c), out_bytes, .. }, .. })) => {
                Some((c, *out_bytes <= OUT_HIGH))
            }
            Some(Entry::Link(LinkConn { io: Io { s: Conn::Shm(c), .. }, .. })) => Some((c, true)),
            _ => None,
        }
    }

    /// Looks at every polled ring and gives a turn to those with input. A ring whose head
    /// has not moved costs one word of its control page ([`shm::Probe`]): with many
    /// connections polled, the scan is most of what the loop does between turns.
    fn poll_rings(&mut self) {
        let mut j = 0;
        while j < self.polled.len() {
            if !self.polled[j].1.moved() {
                j += 1;
                continue;
            }
            let i = self.polled[j].0;
            let input = match Self::rings_in(&mut self.slab, i) {
                Some((c, takes)) if c.is_polled() && c.sync_probe(&mut self.polled[j].1) => {
                    takes && c.has_input()
                }
                // Ended (or its slot taken by a connection not polled): forgotten.
                _ => {
                    self.slots[i].listed = false;
                    self.polled.swap_remove(j);
                    continue;
                }
            };
            if input {
                self.polled_input = true;
                self.slots[i].quiet = 0;
                self.ring_turn(i);
                // The turn may have ended the connection (`unlist` took its entry out,
                // and the entries after it moved down: the one at `j` is not scanned yet).
                if self.polled.get(j).is_none_or(|e| e.0 != i) {
                    continue;
                }
                // Its reads moved the tail.
                if let Some((c, _)) = Self::rings_in(&mut self.slab, i) {
                    c.sync_probe(&mut self.polled[j].1);
                }
            }
            j += 1;
        }
    }

    /// A turn for a polled connection with input: as a doorbell's, without its byte to read.
    fn ring_turn(&mut self, i: usize) {
        let Some(mut e) = self.slab.get_mut(i).and_then(Option::take) else { return };
        let keep = match &mut e {
            Entry::Served(s) => {
                s.io.readable = true;
                self.drive_served(i, s)
            }
            Entry::Link(c) => {
                c.io.readable = true;
                self.drive_link(i, c)
            }
            _ => true,
        };
        self.put_back(i, e, keep);
    }

    /// Before sleeping: every polled ring asks for a doorbell again. True if input came
    /// meanwhile (the loop then stays awake and goes on polling).
    fn arm_polled(&mut self) -> bool {
        // The flag pages first: one word each says the loop sleeps.
        let mut flagged = false;
        for s in &self.scans {
            flagged |= s.page.sleep(s.ring, &s.words);
        }
        // A set bit is a hint, and a peer may set its own again after every take, with
        // nothing behind it: only a turn given keeps the loop awake. Sleeping after a
        // look that gave none misses nothing: the sleep words were set before the bits
        // were taken, so a publish the look did not see finds them set and rings.
        let mut input = flagged && {
            self.poll_flags();
            self.polled_input
        };
        for j in 0..self.polled.len() {
            let i = self.polled[j].0;
            if let Some((c, takes)) = self.rings(i)
                && c.is_polled()
            {
                input |= c.arm() && takes;
            }
        }
        for j in 0..self.polled.len() {
            let i = self.polled[j].0;
            // Only rings of this list: a slot taken since by a connection not polled has
            // its own doorbell request, which must stand.
            if let Some((c, _)) = self.rings(i)
                && c.is_polled()
            {
                if input {
                    c.disarm();
                } else {
                    c.set_polled(false);
                }
            }
        }
        if !input {
            for (i, _) in self.polled.drain(..) {
                self.slots[i].listed = false;
                let q = &mut self.slots[i].quiet;
                *q = q.saturating_add(1);
                if *q <= KEEP_POLLING {
                    self.slept.push(i);
                }
            }
        }
        input
    }

    /// After the loop's sleep, however it ended: the rings it armed go back to being
    /// polled (disarmed), unless they stayed quiet for [`KEEP_POLLING`] sleeps. Under load
    /// a wake-up is the first of a wave (the peer posts to many connections at once); left
    /// armed, every ring would cost its producer a doorbell (a system call) and this loop
    /// a poll event and a read, per connection. Disarmed, they post without one and the
    /// loop looks at each ring once per turn, as it does until it sleeps again (and arms
    /// them first: a producer that saw the disarm posted where the loop looks).
    fn resume_polling(&mut self) {
        for s in &self.scans {
            s.page.wake(s.ring);
        }
        let mut slept = std::mem::take(&mut self.slept);
        for &i in &slept {
            // Nothing changed the slab during the sleep: `i` is the ring armed for it.
            if let Some((c, _)) = self.rings(i)
                && !c.is_polled()
            {
                c.disarm();
                c.set_polled(true);
                let probe = c.probe();
                if !self.slots[i].listed {
                    self.slots[i].listed = true;
                    self.polled.push((i, probe));
                }
            }
        }
        slept.clear();
        self.slept = slept;
    }

    // ---- the listener and unauthenticated connections ----

    fn resume_listeners(&mut self, now: Instant) {
        for li in self.listeners.clone() {
            let due = matches!(self.slab.get(li), Some(Some(Entry::Listener(l)))
                if l.ready && l.paused_until.is_some_and(|p| p <= now));
            if due {
                self.on_event(li, false, false, false);
            }
        }
    }

    fn accept_all(&mut self, li: usize, l: &mut Lst) {
        if let Some(p) = l.paused_until {
            if Instant::now() < p {
                return;
            }
            l.paused_until = None;
        }
        // Whether this call read the Hellos of an address at its bound again (once: a peer
        // holding silent connections must not make each of its connects cost that many reads).
        let mut reread = false;
        while l.ready {
            match l.l.accept() {
                Ok((s, ip)) => {
                    l.backoff = BACKOFF_MIN;
                    let mut from_ip = self.unread_hellos_from(l, ip);
                    if from_ip >= MAX_PENDING_PER_ADDR && !reread {
                        // Counted before their Hellos came (a burst of connections is
                        // accepted in one go): read those that came since.
                        reread = true;
                        self.read_hellos_from(l, ip);
                        from_ip = self.unread_hellos_from(l, ip);
                    }
                    if l.pending.len() >= MAX_PENDING || from_ip >= MAX_PENDING_PER_ADDR {
                        #[cfg(test)]
                        tests::REFUSED.fetch_add(1, Ordering::Relaxed);
                        warn_limited!(peer = %ip, "soft NIC: too many unauthenticated connections; refused");
                        continue; // dropping `s` closes it
                    }
                    let mut p = Pending {
                        s,
                        ip,
                        listener: li,
                        buf: [0; HELLO_FRAME],
                        got: 0,
                        deadline: Instant::now() + HELLO_TIMEOUT,
                        hello: None,
                    };
                    // A peer's Hello usually follows its connect at once: take it now, so a
                    // burst of legitimate connections from one host is not counted as slow.
                    let next = self.read_hello_of(&mut p, &l.pending, &l.device, &l.served);
                    match next {
                        Next::Drop => {}
                        Next::Keep => {
                            let i = self.insert(Entry::Pending(p));
                            let Some(Some(Entry::Pending(p))) = self.slab.get_mut(i) else { unreachable!() };
                            if p.s.register(self.poll.registry(), Token(i), Interest::READABLE).is_err() {
                                self.slab[i] = None;
                                self.free.push(i);
                                continue;
                            }
                            l.pending.push(i);
                        }
                        Next::Serve(qp) => self.start_serving(p, qp, &l.served, None),
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => l.ready = false,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => {}
                Err(e) => {
                    // EMFILE, ENFILE, ENOBUFS...: the connection stays in the backlog, so
                    // pause this listener (the loop goes on with everything else) rather than
                    // spin; pending connections still time out meanwhile.
                    warn_limited!(error = %e, backoff_ms = l.backoff.as_millis() as u64, "soft NIC: accept failed; backing off");
                    l.paused_until = Some(Instant::now() + l.backoff);
                    l.backoff = (l.backoff * 2).min(BACKOFF_MAX);
                    return;
                }
            }
        }
    }

    /// Connections of listener `l` from `ip` whose Hello has not been read whole.
    fn unread_hellos_from(&self, l: &Lst, ip: PeerKey) -> usize {
        l.pending
            .iter()
            .filter(|&&p| matches!(&self.slab[p], Some(Entry::Pending(o)) if o.ip == ip && o.hello.is_none()))
            .count()
    }

    /// Reads what arrived of the Hellos of `l`'s connections from `ip` (`l` is off the slab,
    /// being served).
    fn read_hellos_from(&mut self, l: &mut Lst, ip: PeerKey) {
        for i in l.pending.clone() {
            let unread = matches!(&self.slab[i], Some(Entry::Pending(p)) if p.ip == ip && p.hello.is_none());
            let Some(Entry::Pending(mut p)) = self.slab[i].take_if(|_| unread) else { continue };
            p.s.on_readable(false);
            match self.read_hello_of(&mut p, &l.pending, &l.device, &l.served) {
                Next::Keep => self.slab[i] = Some(Entry::Pending(p)),
                Next::Drop => {
                    l.pending.retain(|&x| x != i);
                    self.remove(i, Entry::Pending(p));
                }
                Next::Serve(qp) => {
                    l.pending.retain(|&x| x != i);
                    let served = l.served.clone();
                    self.start_serving(p, qp, &served, Some(i));
                }
            }
        }
    }

    /// Pending connection `p` (taken out of the slab at `i`) is kept, dropped or served.
    fn settle(&mut self, i: usize, e: Entry, next: Next) {
        let Entry::Pending(p) = e else { unreachable!() };
        match next {
            Next::Keep => self.slab[i] = Some(Entry::Pending(p)),
            Next::Drop => self.remove(i, Entry::Pending(p)),
            Next::Serve(qp) => {
                let li = p.listener;
                let served = match self.slab.get_mut(li) {
                    Some(Some(Entry::Listener(l))) => {
                        l.pending.retain(|&x| x != i);
                        l.served.clone()
                    }
                    _ => return self.remove(i, Entry::Pending(p)),
                };
                self.start_serving(p, qp, &served, Some(i));
            }
        }
    }

    fn read_hello(&mut self, p: &mut Pending) -> Next {
        let (pending, device, served) = match self.slab.get(p.listener) {
            Some(Some(Entry::Listener(l))) => (l.pending.clone(), l.device.clone(), l.served.clone()),
            _ => return Next::Drop,
        };
        self.read_hello_of(p, &pending, &device, &served)
    }

    /// Reads what arrived of `p`'s Hello (never past it); `pending` are the other
    /// unauthenticated connections of its listener.
    fn read_hello_of(
        &self,
        p: &mut Pending,
        pending: &[usize],
        device: &Weak<SoftDevice>,
        served: &AtomicUsize,
    ) -> Next {
        loop {
            if p.got == HELLO_FRAME {
                break;
            }
            // Only the header first, then exactly the Hello's payload: nothing beyond it.
            let want = if p.got < wire::HEADER { wire::HEADER } else { HELLO_FRAME };
            match p.s.read(&mut p.buf[p.got..want]) {
                Ok(0) => return Next::Drop,
                Ok(n) => p.got += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Next::Keep,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Next::Drop,
            }
            if p.got == wire::HEADER {
                let ok = wire::decode_header(&p.buf[..wire::HEADER]).and_then(|(k, len)| {
                    if k != wire::KIND_HELLO {
                        return Err(WireError::UnknownKind(k));
                    }
                    wire::check_length(k, len)
                });
                if let Err(e) = ok {
                    warn_limited!(peer = %p.ip, error = %e, "soft NIC: connection did not start with a Hello; dropped");
                    return Next::Drop;
                }
            }
        }
        match wire::decode_payload(wire::KIND_HELLO, &p.buf[wire::HEADER..]) {
            Ok(h @ Frame::Hello { dst_qpn, .. }) => {
                let awaiting = pending
                    .iter()
                    .filter(|&&o| {
                        matches!(&self.slab[o], Some(Entry::Pending(o))
                            if matches!(o.hello, Some(Frame::Hello { dst_qpn: q, .. }) if q == dst_qpn))
                    })
                    .count();
                if awaiting >= MAX_AWAITING_PER_QP {
                    warn_limited!(peer = %p.ip, qpn = dst_qpn, "soft NIC: too many Hellos waiting for one QP; dropped");
                    return Next::Drop;
                }
                p.hello = Some(h);
                p.deadline = Instant::now() + AUTH_WAIT;
                try_auth(p, device, served)
            }
            _ => {
                warn_limited!(peer = %p.ip, "soft NIC: malformed Hello; connection dropped");
                Next::Drop
            }
        }
    }

    /// Complete Hellos waiting for their QP ask again.
    fn retry_auth(&mut self) {
        for li in self.listeners.clone() {
            let (pending, device, served) = match self.slab.get(li) {
                Some(Some(Entry::Listener(l))) => (l.pending.clone(), l.device.clone(), l.served.clone()),
                _ => continue,
            };
            for i in pending {
                let waiting = matches!(&self.slab[i], Some(Entry::Pending(p)) if p.hello.is_some());
                if !waiting {
                    continue;
                }
                let Some(mut e) = self.slab[i].take() else { continue };
                let Entry::Pending(p) = &mut e else { unreachable!() };
                let next = try_auth(p, &device, &served);
                self.settle(i, e, next);
            }
        }
    }

    /// Serves `p`, authenticated for `qp`; `token`: its slot on the loop, if it has one.
    fn start_serving(
        &mut self,
        p: Pending,
        qp: Arc<SoftQp>,
        served: &Arc<AtomicUsize>,
        token: Option<usize>,
    ) {
        let Some(Frame::Hello { src_gid, src_qpn, src_psn, .. }) = p.hello else {
            if let Some(i) = token {
                self.free.push(i);
            }
            return;
        };
        let peer = p.s.peer_addr();
        let conn = ServedConn {
            io: Io::new(p.s, Accept::Requests),
            qp: Arc::downgrade(&qp),
            requester: Requester::remote(src_gid, src_qpn),
            expected: src_psn & 0x00ff_ffff,
            peer,
            held: Deferred::holding(),
            grants: 0,
            _count: Served::new(served),
        };
        // Same-host rings: the requester may place accesses directly while the QP serves
        // it (the gate closes when the QP leaves RTR/RTS or is destroyed).
        if let Conn::Shm(sc) = &conn.io.s {
            qp.set_gate(sc.gate());
        }
        drop(qp);
        let i = match token {
            Some(i) => {
                self.slab[i] = Some(Entry::Served(conn));
                i
            }
            None => self.insert(Entry::Served(conn)),
        };
        let Some(Some(Entry::Served(c))) = self.slab.get_mut(i) else { unreachable!() };
        let reg = self.poll.registry();
        let r = if token.is_some() {
            c.io.s.reregister(reg, Token(i), Interest::READABLE | Interest::WRITABLE)
        } else {
            c.io.s.register(reg, Token(i), Interest::READABLE | Interest::WRITABLE)
        };
        if let Err(e) = r {
            warn_limited!(error = %e, "soft NIC: cannot watch a served connection");
            let e = self.slab[i].take().expect("just set");
            return self.remove(i, e);
        }
        self.watch_flag(i);
        // Requests pipelined behind the Hello may already be in the socket.
        self.again.push(i);
    }

    // ---- authenticated connections: the responder ----

    /// Writes what is queued, then reads and applies requests while the output is below its
    /// bound. False: the connection ends.
    fn drive_served(&mut self, i: usize, s: &mut ServedConn) -> bool {
        let mut rbuf = std::mem::take(&mut self.rbuf);
        let keep = self.drive_served_with(i, s, &mut rbuf);
        self.rbuf = rbuf;
        // Whatever was answered is published now, even if its answer still waits for room
        // (a peer not taking its answers must not hold back the receiver's completions).
        s.held.release();
        if keep {
            s.io.trim();
        }
        keep
    }

    fn drive_served_with(&mut self, i: usize, s: &mut ServedConn, rbuf: &mut [u8]) -> bool {
        let mut reads = 0;
        loop {
            if !s.io.out.is_empty()
                && !self.wire.exit.wanted.load(Ordering::Relaxed)
                && let Some(d) = answer_delay()
            {
                std::thread::sleep(d);
            }
            if !s.io.out.is_empty() && s.io.writable {
                match s.io.flush_up_to(WRITE_PER_TURN) {
                    Err(_) => return false,
                    // Its share of the turn is used: the rest on the next.
                    Ok(_) if s.io.more_to_write() => {
                        self.again.push(i);
                        return true;
                    }
                    Ok(_) => {}
                }
            }
            // The answers are written (or wait for room): their requests' completions go.
            s.held.release();
            if s.io.out_bytes > OUT_HIGH {
                return true; // held back until the peer takes its answers
            }
            if !s.io.left.is_empty() {
                let left = std::mem::take(&mut s.io.left);
                let Some(used) = self.feed_served(s, &left) else { return false };
                s.io.left = left;
                s.io.left.drain(..used);
                continue;
            }
            if !s.io.readable {
                return true;
            }
            if reads == READS_PER_TURN {
                self.again.push(i);
                return true;
            }
            reads += 1;
            // Same-host rings: a write's data being placed goes from the ring straight to
            // its target region.
            if let (Conn::Shm(c), Some((p, done))) = (&mut s.io.s, s.io.rd.placing()) {
                let Some(held) = p.hold() else {
                    // Revoked mid-frame: the reader discards the rest (read through the
                    // buffer below) and the write is answered as refused.
                    s.io.rd.revoke();
                    continue;
                };
                // SAFETY: at most what is left of the placement, from where it stands, under
                // its own leave.
                match unsafe { c.read_placed(p, &held, done, p.len() - done) } {
                    Ok(0) => return closed_inside_a_frame(s),
                    Ok(n) => {
                        if !self.placed(s, n) {
                            return false;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => s.io.readable = false,
                    Err(_) => return false,
                }
                continue;
            }
            // TCP: a write's data being placed goes from the socket straight to its target,
            // all but its last word (which lands last, read through the buffer below).
            if let (Conn::Tcp(sock), Some((p, done))) = (&s.io.s, s.io.rd.placing()) {
                let want = p.direct_span(done, rbuf.len());
                if want > 0 {
                    let Some(held) = p.hold() else {
                        // Revoked mid-frame: as for rings, above.
                        s.io.rd.revoke();
                        continue;
                    };
                    // SAFETY: `want` is within the placement's direct span from `done`,
                    // under its own leave.
                    let r = unsafe { p.recv_direct(&held, sock.as_raw_fd(), done, want) };
                    drop(held);
                    match r {
                        Ok(0) => return closed_inside_a_frame(s),
                        Ok(n) => {
                            // A short read drained the socket: what arrives later is a new edge.
                            if n < want {
                                s.io.readable = false;
                            }
                            // (Never the frame's end here: its last word is still to come.)
                            if !self.placed(s, n) {
                                return false;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => s.io.readable = false,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(_) => return false,
                    }
                    continue;
                }
            }
            // Through rings, small reads: a large write's data is then mostly placed from
            // the ring (above) rather than through this buffer.
            let cap = if s.io.s.is_shm() { SHM_READ } else { rbuf.len() };
            match s.io.s.read(&mut rbuf[..cap]) {
                Ok(0) => {
                    if s.io.rd.in_frame() {
                        warn_limited!(peer = ?s.peer, "soft NIC: connection closed inside a frame");
                    }
                    // Answers already queued still go out if the socket takes them now.
                    let _ = s.io.flush();
                    return false;
                }
                Ok(n) => {
                    // A short read drained the socket: what arrives later is a new edge.
                    if n < cap && !s.io.s.is_shm() {
                        s.io.readable = false;
                    }
                    let Some(used) = self.feed_served(s, &rbuf[..n]) else { return false };
                    if used < n {
                        s.io.left.extend_from_slice(&rbuf[used..n]);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => s.io.readable = false,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
    }

    /// `n` more bytes of the write being placed landed: once it is whole, it is answered.
    /// False: the connection ends.
    fn placed(&mut self, s: &mut ServedConn, n: usize) -> bool {
        let Some(got) = s.io.rd.placed(n) else { return true };
        match answer(s, got) {
            None => false,
            Some(Some((reply, tail))) => {
                s.io.push_with_tail(reply, tail, &mut self.scratch);
                true
            }
            Some(None) => true,
        }
    }

    /// Applies the requests in `input` until it is used up or the output is over its
    /// bound; returns the bytes used. None: the connection ends.
    fn feed_served(&mut self, s: &mut ServedConn, input: &[u8]) -> Option<usize> {
        let mut rest = input;
        while !rest.is_empty() && s.io.out_bytes <= OUT_HIGH {
            let qp = &s.qp;
            // A write's data may not exceed what its target region can take from its
            // address (nothing if the key is not valid for it), nor a send's what the
            // receive at the head of the queue can take (nothing if none is posted): more
            // would be refused anyway, so it is not stored.
            let limit = |kind: u8, fixed: &[u8]| match (wire::decode_payload(kind, fixed), qp.upgrade()) {
                (Ok(Frame::Write { addr, rkey, .. }), Some(t)) => t.write_data_limit(addr, rkey),
                (Ok(Frame::Send { .. }), Some(t)) => t.send_data_limit(),
                _ => wire::MAX_MESSAGE as usize,
            };
            // A write in sequence, from the connected requester, to a target its key allows:
            // its data lands in the region as it arrives (no copy kept here).
            let (requester, expected) = (&s.requester, s.expected);
            let place = |kind: u8, fixed: &[u8], data_len: usize| match wire::decode_payload(kind, fixed) {
                Ok(Frame::Write { psn, addr, rkey, imm: None, .. })
                    if psn == expected && data_len >= PLACE_MIN =>
                {
                    qp.upgrade()?.place_write(requester, addr, rkey, data_len)
                }
                _ => None,
            };
            let got = match s.io.rd.feed_placing(&mut rest, limit, true, place) {
                Ok(None) => continue,
                Ok(Some(g)) => g,
                Err(e) => {
                    warn_limited!(peer = ?s.peer, error = %e, "soft NIC: bad frame from a requester; connection dropped");
                    return None;
                }
            };
            if let Got::Frame(Frame::KeyRequest { rkey }) = got {
                let reply = grant(s, rkey);
                s.io.push_frame(reply, &mut self.scratch);
                continue;
            }
            match answer(s, got)? {
                Some((reply, tail)) => s.io.push_with_tail(reply, tail, &mut self.scratch),
                None => continue,
            }
        }
        Some(input.len() - rest.len())
    }

    // ---- requester links ----

    /// Moves queued frames to the socket (within the output bound) and hands responses to
    /// the QP. False: the link ends.
    fn drive_link(&mut self, i: usize, c: &mut LinkConn) -> bool {
        if c.shared.closed.load(Ordering::Acquire) {
            return false;
        }
        let mut rbuf = std::mem::take(&mut self.rbuf);
        let keep = self.drive_link_with(i, c, &mut rbuf);
        self.rbuf = rbuf;
        if keep {
            c.io.trim();
        }
        keep
    }

    fn drive_link_with(&mut self, i: usize, c: &mut LinkConn, rbuf: &mut [u8]) -> bool {
        // Output: what the QP queued, within the bound and the turn's share.
        let mut budget = WRITE_PER_TURN;
        // Another turn is asked for (once) when this one's share of output is used.
        let mut another_turn = false;
        loop {
            {
                let mut q = c.shared.queue.lock().expect("link queue");
                // A TCP link holds its requests until the peer accepts its Hello (`Dial`).
                while c.dial.is_none() && c.io.out_bytes <= OUT_HIGH {
                    let Some((f, tail)) = q.pop_front() else { break };
                    c.io.push_with_tail(f, tail, &mut self.scratch);
                }
                // Under the queue's lock, where the QP looks before posting directly: what
                // the loop took goes first.
                if let Conn::Shm(sc) = &c.io.s
                    && !c.io.out.is_empty()
                {
                    sc.producer().set_loop_pending(true);
                }
            }
            if c.io.out.is_empty() || !c.io.writable {
                break;
            }
            match c.io.flush_up_to(budget) {
                Err(_) => return false,
                Ok(n) => budget -= n.min(budget),
            }
            if budget == 0 && c.io.more_to_write() {
                self.again.push(i);
                another_turn = true;
                break;
            }
            if !c.io.writable {
                break;
            }
        }
        if let Conn::Shm(sc) = &c.io.s
            && c.io.out.is_empty()
        {
            sc.producer().set_loop_pending(false);
        }
        // Until the peer accepts it, the Hello is all a TCP link writes: out, the next dial
        // to the address may go (later in this turn, `redial_due`).
        if c.opening.is_some() && c.io.out.is_empty() {
            c.opening = None;
        }
        // Input: responses, handed to the QP (which takes no lock of the loop's).
        for _ in 0..READS_PER_TURN {
            if !c.io.readable {
                return true;
            }
            match c.io.s.read(rbuf) {
                Ok(0) => return false,
                Ok(n) => {
                    // A short read drained the socket: what arrives later is a new edge.
                    if n < rbuf.len() && !c.io.s.is_shm() {
                        c.io.readable = false;
                    }
                    let mut rest = &rbuf[..n];
                    while !rest.is_empty() {
                        let qp = &c.qp;
                        // An answer carries at most what the oldest outstanding request
                        // asked for.
                        let limit = |_: u8, _: &[u8]| qp.upgrade().map_or(0, |q| q.response_data_limit());
                        // A large read's answer lands in the read's buffer as it arrives:
                        // never stored whole, nor copied in one go on this loop.
                        let place =
                            |kind: u8, fixed: &[u8], data_len: usize| match wire::decode_payload(kind, fixed)
                            {
                                Ok(Frame::Ack { psn, status: 0, .. }) if data_len >= PLACE_MIN => {
                                    qp.upgrade()?.place_response(psn, data_len)
                                }
                                _ => None,
                            };
                        match c.io.rd.feed_placing(&mut rest, limit, false, place) {
                            Ok(None) => {}
                            Ok(Some(Got::Frame(Frame::HelloAck { status: 0 }))) => {
                                c.io.rd.accept = Accept::Responses;
                                let _ = c.shared.accepted_at.set(Instant::now());
                                if let Conn::Shm(sc) = &c.io.s
                                    && let Ok(d) = sc.direct()
                                {
                                    let _ = c.shared.direct.set(d);
                                }
                                // Accepted: no more dialing, and the held requests go out.
                                c.dial = None;
                                self.again.push(i);
                            }
                            Ok(Some(Got::Frame(Frame::HelloAck { .. }))) => {
                                warn_limited!("soft NIC: the peer refused our Hello; requests will time out");
                                c.dial = None;
                                return false;
                            }
                            Ok(Some(Got::Frame(Frame::KeyGrant {
                                rkey,
                                access,
                                addr,
                                len,
                                map_len,
                                slot,
                                tag,
                                ino,
                            }))) => {
                                // The files came before the frame. A link dialed again may
                                // have fallen back to TCP, where a grant has none: it is
                                // then refused here, as is any grant that does not check out
                                // (the key stays on the ring; the link goes on).
                                let (fd, status) = match &mut c.io.s {
                                    Conn::Shm(sc) if access != 0 => (sc.take_fd(), sc.take_fd()),
                                    _ => (None, None),
                                };
                                let msg =
                                    direct::GrantMsg { rkey, access, addr, len, map_len, slot, tag, ino };
                                let (asked, taken) = {
                                    let mut grants = c.shared.grants.lock().expect("grants");
                                    (grants.is_asked(rkey), grants.insert(msg, fd, status))
                                };
                                if let Err(e) = taken {
                                    warn_limited!(error = %e, "soft NIC: a key grant not taken; that key stays on the ring");
                                }
                                // Accesses waiting for the answer go now (directly or not),
                                // run by the timer thread: the QP's lock may be held by a
                                // thread making a bulk copy, which the loop must not wait for.
                                // Only for an answer to an ask (at most two at a time): a
                                // grant nobody asked for changes nothing, and a flood of them
                                // would keep the timer thread busy with this QP.
                                match c.qp.upgrade() {
                                    Some(qp) if asked => qp.kick_soon(),
                                    Some(_) => {}
                                    None => return false,
                                }
                            }
                            Ok(Some(got @ (Got::Frame(_) | Got::Placed { .. } | Got::Refused { .. }))) => {
                                let (f, data) = match got {
                                    Got::Frame(f) => (f, ResponseData::InFrame),
                                    Got::Placed { frame, .. } => (frame, ResponseData::Placed),
                                    Got::Refused { frame, .. } => (frame, ResponseData::Cut),
                                };
                                match c.qp.upgrade() {
                                    Some(qp) => qp.on_remote_response(f, data),
                                    None => return false,
                                }
                            }
                            Err(e) => {
                                warn_limited!(error = %e, "soft NIC: bad response; link dropped");
                                c.dial = None;
                                return false;
                            }
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => c.io.readable = false,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
        if c.io.readable && !another_turn {
            self.again.push(i);
        }
        true
    }

    // ---- timers ----

    /// Ends what is late; with `idle_check`, also connections whose QP (or link) is gone.
    fn sweep(&mut self, now: Instant, idle_check: bool) {
        for i in 0..self.slab.len() {
            let end = match &self.slab[i] {
                None => false,
                Some(Entry::Listener(l)) => l.device.strong_count() == 0,
                Some(Entry::Pending(p)) => {
                    let late = p.deadline <= now;
                    if late {
                        warn_limited!(peer = %p.ip, "soft NIC: no authenticated Hello in time; connection dropped");
                    }
                    late
                }
                Some(Entry::Served(s)) => {
                    let slow =
                        s.io.rd.started.is_some_and(|t| now.saturating_duration_since(t) > FRAME_TIMEOUT);
                    if slow {
                        warn_limited!(peer = ?s.peer, "soft NIC: frame not completed in time; connection dropped");
                    }
                    let stalled = s.io.send_stalled(now);
                    if stalled {
                        warn_limited!(peer = ?s.peer, "soft NIC: requester does not take its answers; connection dropped");
                    }
                    slow || stalled || (idle_check && s.qp.strong_count() == 0)
                }
                Some(Entry::Link(c)) => {
                    let stalled = c.io.send_stalled(now);
                    if stalled {
                        warn_limited!("soft NIC: responder does not take our requests; link dropped");
                    }
                    stalled
                        || c.shared.closed.load(Ordering::Acquire)
                        || (idle_check && c.qp.strong_count() == 0)
                }
            };
            if end && let Some(e) = self.slab[i].take() {
                self.remove(i, e);
            }
        }
    }
}

/// The answer to a request that came in whole. `None`: the connection ends; `Some(None)`:
/// nothing is answered (the request is dropped, as a NIC drops such packets).
fn answer(s: &mut ServedConn, got: Got) -> Option<Option<(Frame, Option<SharedTail>)>> {
    Some(match got {
        Got::Placed { frame, .. } => {
            let psn = request_psn(&frame)?;
            let target = s.qp.upgrade()?;
            let Some(reply) = target.placed_write_done(&s.requester, psn) else { return Some(None) };
            s.expected = next_psn(psn);
            Some((reply, None))
        }
        Got::Refused { frame, data_len } => {
            let psn = request_psn(&frame)?;
            if psn != s.expected {
                return Some(None);
            }
            let target = s.qp.upgrade()?;
            let Some(reply) = target.refuse(&s.requester, frame, data_len, &mut s.held) else {
                return Some(None);
            };
            if !matches!(reply, Frame::RnrNak { .. }) {
                s.expected = next_psn(psn);
            }
            Some((reply, None))
        }
        Got::Frame(frame) => {
            let psn = request_psn(&frame)?;
            if psn != s.expected {
                warn_limited!(peer = ?s.peer, psn, expected = s.expected, "soft NIC: request out of sequence (replay or gap); dropped");
                return Some(None);
            }
            // A destroyed target QP answers nothing: the requester times out, as on a real
            // NIC.
            let target = s.qp.upgrade()?;
            // `None`: the target QP is not connected to this requester (any more): drop, as
            // a NIC drops such packets; the requester times out.
            let same_host = s.io.s.is_shm();
            let Some(reply) = target.serve_remote(&s.requester, frame, &mut s.held, same_host) else {
                return Some(None);
            };
            if !matches!(reply.0, Frame::RnrNak { .. }) {
                s.expected = next_psn(psn);
            }
            Some(reply)
        }
    })
}

/// The answer to a same-host requester's `KeyRequest`: a grant, its memfd passed on the
/// doorbell socket first, or a refusal (over TCP, past the grant bound, a key the QP does
/// not admit, or a socket that cannot take the descriptor now).
fn grant(s: &mut ServedConn, rkey: u32) -> Frame {
    let refused = Frame::KeyGrant { rkey, access: 0, addr: 0, len: 0, map_len: 0, slot: 0, tag: 0, ino: 0 };
    let Conn::Shm(sc) = &s.io.s else { return refused };
    if s.grants >= direct::MAX_GRANTS {
        return refused;
    }
    let Some(qp) = s.qp.upgrade() else { return refused };
    let Some(status) = direct::status_fd() else { return refused };
    let Some((grant, fd)) = qp.grant(&s.requester, rkey) else { return refused };
    if let Err(e) = sc.pass_grant(&fd, status) {
        tracing::debug!(error = %e, "soft NIC: cannot pass a region's memfd; refused");
        return refused;
    }
    s.grants += 1;
    grant
}

thread_local! {
    /// True on the wire's loop thread.
    static ON_WIRE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this is the wire's loop thread (which must not make bulk copies for a QP).
pub(crate) fn on_wire_thread() -> bool {
    ON_WIRE.get()
}

/// Checks `p`'s complete Hello against the QP it names.
fn try_auth(p: &mut Pending, device: &Weak<SoftDevice>, served: &AtomicUsize) -> Next {
    let Some(Frame::Hello { src_gid, src_qpn, dst_qpn, src_psn, dst_psn, token }) = &p.hello else {
        return Next::Drop;
    };
    let Some(device) = device.upgrade() else { return Next::Drop };
    let auth = match device.find_qp(*dst_qpn) {
        Some(qp) => match qp.authenticate(src_gid, *src_qpn, *src_psn, *dst_psn, token) {
            Auth::Accepted if served.load(Ordering::Acquire) >= MAX_SERVED => {
                warn_limited!(peer = %p.ip, "soft NIC: too many served connections; refused");
                qp.release_claim(); // not served: the QP may be served later
                None
            }
            Auth::Accepted => Some(qp),
            Auth::NotYet => return Next::Keep,
            Auth::Refused => {
                warn_limited!(peer = %p.ip, qpn = *dst_qpn, "soft NIC: Hello failed authentication; refused");
                None
            }
        },
        None => None,
    };
    let mut scratch = Vec::new();
    let status = u8::from(auth.is_none());
    // A fresh socket's send buffer takes these few bytes at once; if it does not, the peer
    // is not worth waiting for.
    let sent = write_frame(&mut p.s, &Frame::HelloAck { status }, &mut scratch).is_ok();
    match auth {
        Some(qp) if sent => Next::Serve(qp),
        Some(qp) => {
            // Not answered, not served: the requester dials again with the same Hello.
            qp.release_claim();
            Next::Drop
        }
        None => Next::Drop,
    }
}

/// Counts a served connection for as long as it lives.
struct Served(Arc<AtomicUsize>);

impl Served {
    fn new(n: &Arc<AtomicUsize>) -> Served {
        n.fetch_add(1, Ordering::AcqRel);
        Served(n.clone())
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

type Queued = (Frame, Option<SharedTail>);

/// What a link shares between its QP and the loop.
struct LinkShared {
    /// Frames waiting for the loop, at most `cap`.
    queue: Mutex<VecDeque<Queued>>,
    cap: usize,
    dead: AtomicBool,
    /// When the peer accepted our Hello. Until then requests wait on the link's set-up,
    /// which is not transport time ([`TcpLink::transport_start`]).
    accepted_at: OnceLock<Instant>,
    /// The link was dropped: the loop closes it.
    closed: AtomicBool,
    /// On the loop's ready list already.
    flagged: AtomicBool,
    /// Its slot on the loop.
    token: AtomicUsize,
    /// Same-host rings: the QP's way to post into the ring itself, set by the loop when the
    /// peer accepts the Hello (the rings of a link dialed again are new ones).
    direct: OnceLock<shm::Direct>,
    /// Same-host rings: the peer's regions this link maps (`super::direct`).
    grants: Mutex<GrantTable>,
}

impl LinkShared {
    /// A link's shared state, holding at most `cap` queued frames.
    fn new(cap: usize) -> LinkShared {
        LinkShared {
            queue: Mutex::new(VecDeque::new()),
            cap,
            dead: AtomicBool::new(false),
            accepted_at: OnceLock::new(),
            closed: AtomicBool::new(false),
            flagged: AtomicBool::new(false),
            token: AtomicUsize::new(usize::MAX),
            direct: OnceLock::new(),
            grants: Mutex::new(GrantTable::default()),
        }
    }

    fn fail(&self) {
        self.dead.store(true, Ordering::Release);
        // Outstanding requests now time out (RETRY_EXC_ERR) on the QP's transport budget.
        self.queue.lock().expect("link queue").clear();
    }
}

/// A requester's connection to a remote QP.
pub(crate) struct TcpLink {
    shared: Arc<LinkShared>,
    wire: Option<&'static Wire>,
    same_host: bool,
}

impl TcpLink {
    /// Connects QP `qp` to the device listening at `addr`, introducing itself with `hello`.
    /// At most `queue` frames wait for the wire's loop.
    ///
    /// Errors are not returned: as on a real RC QP, an unreachable peer shows up as
    /// requests that complete with `RETRY_EXC_ERR`. The link is then dead from the start.
    /// The Hello is answered asynchronously (the peer may be connecting its QP to ours
    /// meanwhile); requests queued before the answer follow the Hello on the stream.
    /// A device of this host (`gid` names the process) is reached through shared memory
    /// when it can be (see [`super::shm`]), over TCP otherwise.
    pub fn connect(
        qp: &Arc<SoftQp>,
        gid: &[u8; 16],
        addr: SocketAddr,
        hello: Frame,
        queue: usize,
    ) -> TcpLink {
        let (same_host, ring) = (qp.device.config().same_host_shm, qp.device.config().same_host_ring);
        let shared = Arc::new(LinkShared::new(queue));
        let wire = match wire() {
            Ok(w) => w,
            Err(e) => {
                tracing::error!(%e, "soft NIC: no wire; requests will time out");
                shared.dead.store(true, Ordering::Release);
                return TcpLink { shared, wire: None, same_host: false };
            }
        };
        let mut encoded = Vec::new();
        wire::encode(&hello, &mut encoded);
        // With rings (`shm`), the first dial is made here; over TCP, by the loop.
        let dial = |shm: Option<_>| Dial {
            addr,
            shm,
            hello: encoded.clone(),
            until: Instant::now() + HELLO_TIMEOUT,
            dialed: shm.is_some(),
            backoff: REDIAL_MIN,
        };
        if let Some(conn) = same_host.then(|| shm::connect(gid, &encoded, ring)).flatten() {
            // Requests go into the ring from the QP's thread (no wake-up of the loop) once
            // the peer accepted the Hello: `LinkShared::direct`.
            let nl = NewLink {
                s: Conn::Shm(Box::new(conn)),
                shared: shared.clone(),
                qp: Arc::downgrade(qp),
                dial: Some(dial(Some((*gid, ring)))),
            };
            wire.submit(|inbox| inbox.links.push(nl));
            return TcpLink { shared, wire: Some(wire), same_host: true };
        }
        // Dialled by the loop, as a redial is (non-blocking; the Hello goes out when the
        // socket first says it is writable), never from this thread: the address may be a
        // peer's declaration that nothing answers (a connection manager's request), and
        // `QueuePair::connect` may run on an async runtime's worker. A peer that refuses or
        // never answers is dialled again with backoff until `HELLO_TIMEOUT`; the requests
        // meanwhile wait in the link's queue and time out as they would on a dead link.
        let first =
            Redial { at: Instant::now(), shared: shared.clone(), qp: Arc::downgrade(qp), dial: dial(None) };
        wire.submit(|inbox| inbox.dials.push(first));
        TcpLink { shared, wire: Some(wire), same_host: false }
    }

    /// Queues a request frame, with its payload still in the region when `tail` is given.
    /// False if the link is down or its queue is full (the request is retried later).
    /// Never waits on I/O: the wire's loop does the writing.
    pub fn send(&self, f: Frame, tail: Option<SharedTail>) -> bool {
        let Some(wire) = self.wire else { return false };
        if self.is_dead() {
            return false;
        }
        {
            let mut q = self.shared.queue.lock().expect("link queue");
            if q.len() >= self.shared.cap {
                return false;
            }
            if q.is_empty()
                && let Some(d) = self.shared.direct.get()
                && post_direct(d, &f, tail.as_ref())
            {
                return true;
            }
            q.push_back((f, tail));
        }
        if !self.shared.flagged.swap(true, Ordering::AcqRel) {
            wire.submit(|inbox| inbox.ready.push(self.shared.clone()));
        }
        true
    }

    pub fn is_dead(&self) -> bool {
        self.shared.dead.load(Ordering::Acquire)
    }

    /// When the transport timer of a request sent at `sent` starts, or `None` while the
    /// link is still being set up.
    ///
    /// On a NIC the connection exists before the first request: its timer measures the
    /// transport alone. Here the link (TCP connect or rings, Hello, the peer's checks) is
    /// set up when the QP connects, and a request posted right away waits for it; on a
    /// loaded host that can take longer than a whole transport budget, and the request
    /// would fail with `RETRY_EXC_ERR` although nothing was lost. So a request's timer
    /// starts when it was sent or when the peer accepted the Hello, whichever is later.
    /// A dead link (refused, unreachable, closed) starts it at once; a peer that neither
    /// accepts nor closes is given [`HELLO_TIMEOUT`] (a device drops a Hello that late),
    /// after which the timer runs from the end of that grace.
    pub fn transport_start(&self, sent: Instant) -> Option<Instant> {
        if let Some(&at) = self.shared.accepted_at.get() {
            return Some(sent.max(at));
        }
        if self.is_dead() {
            return Some(sent);
        }
        let grace = sent + HELLO_TIMEOUT;
        (Instant::now() >= grace).then_some(grace)
    }

    /// Goes through same-host rings (not TCP).
    pub fn is_same_host(&self) -> bool {
        self.same_host
    }

    /// Whether an access could be placed directly once what is before it is answered
    /// (`Ok`); asks for a grant of the key if none was asked for (`Wait` then).
    pub fn can_place(&self, rkey: u32, addr: u64, len: u64, need: crate::AccessFlags) -> Result<(), Miss> {
        self.direct_access(rkey, addr, len, need, None::<fn(*mut u8) -> bool>)
    }

    /// Places a write or read of `len` bytes at `addr` of key `rkey` directly (see
    /// [`super::direct`]): runs `copy` with the local address of that range if the link
    /// holds a live grant allowing `need` there and the responder QP's gate is open
    /// (`Ok`). Otherwise says why: no grant yet (one is asked for now if it was not:
    /// `Wait` until the answer, which kicks the QP, or the deadline), or `Ring`.
    ///
    /// The caller holds the QP's send-queue lock and saw nothing of the QP unanswered
    /// (RC order).
    pub fn place_direct(
        &self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: crate::AccessFlags,
        copy: impl FnOnce(*mut u8) -> bool,
    ) -> Result<(), Miss> {
        self.direct_access(rkey, addr, len, need, Some(copy))
    }

    fn direct_access(
        &self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: crate::AccessFlags,
        copy: Option<impl FnOnce(*mut u8) -> bool>,
    ) -> Result<(), Miss> {
        // The gate: set up once the peer accepted our Hello, open while its QP serves this
        // link. A responder that does not know direct placement never opens it, so it is
        // never asked for a grant.
        if self.is_dead() || !self.shared.direct.get().is_some_and(shm::Direct::responder_open) {
            return Err(Miss::Ring);
        }
        let mut grants = self.shared.grants.lock().expect("grants");
        match grants.target(rkey, addr, len, need) {
            Ok(t) => {
                // Outside the table's lock (the wire's loop takes it to add grants); `t`
                // keeps the mapping while the copy runs.
                drop(grants);
                if let Some(copy) = copy {
                    if !copy(t.ptr) {
                        return Err(Miss::Ring);
                    }
                    direct::count_placement();
                }
                Ok(())
            }
            Err(Miss::Ask) => {
                // Marked before it is sent: the grant may come back at once.
                let until = grants.asked(rkey);
                drop(grants);
                if self.send(Frame::KeyRequest { rkey }, None) {
                    Err(Miss::Wait(until))
                } else {
                    self.shared.grants.lock().expect("grants").unask(rkey);
                    Err(Miss::Ring)
                }
            }
            Err(miss) => Err(miss),
        }
    }
}

/// Writes request `f` (its payload in `tail` when given) into the link's ring from this
/// thread, whole, if it can now. The caller holds the link's queue lock and saw it empty.
fn post_direct(d: &shm::Direct, f: &Frame, tail: Option<&SharedTail>) -> bool {
    // The header and fixed fields are encoded into a buffer of this thread, kept between
    // posts: no allocation per request.
    thread_local! {
        static HEAD: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    HEAD.with_borrow_mut(|head| {
        head.clear();
        let inline = wire::encode_split(f, head);
        let body = match tail {
            Some(t) => {
                debug_assert!(inline.is_empty(), "a shared payload's frame carries no data");
                // The header's length counts the payload that follows from the region.
                patch_len(head, t.len);
                (Src::Shared(t.ptr.cast_const()), t.len)
            }
            None => (Src::Private(inline.as_ptr()), inline.len()),
        };
        // SAFETY: `head` and `inline` are live private bytes; a tail's `ptr` is valid for
        // `len` bytes while `t` (holding the region's entry) lives, which outlasts the call.
        unsafe { d.post(&[(Src::Private(head.as_ptr()), head.len()), body]) }
    })
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        // The loop closes the socket at once, even if the peer is alive but silent.
        self.shared.closed.store(true, Ordering::Release);
        self.shared.fail();
        if let Some(wire) = self.wire {
            self.shared.flagged.store(true, Ordering::Release);
            wire.submit(|inbox| inbox.ready.push(self.shared.clone()));
        }
    }
}

/// The incremental form of [`read_frame_with`], for non-blocking sockets: bytes are fed
/// as they arrive and a frame comes out when complete. The same checks, in the same
/// order: the header's length against its kind and against what the stream accepts, then
/// (data-carrying frames) the data length against `data_limit(kind, fixed)` *before* any
/// data is stored; the data vector grows only as bytes arrive, never past that length.
pub(crate) struct FrameReader {
    accept: Accept,
    h: [u8; wire::HEADER],
    got: usize,
    body: Option<Body>,
    /// When the frame being read had its first byte.
    started: Option<Instant>,
}

struct Body {
    kind: u8,
    /// Bytes of fixed fields (the whole payload for frames without data).
    fixed_len: usize,
    fixed: Vec<u8>,
    /// Data bytes of a data-carrying frame.
    data_len: usize,
    /// Whether the data limit was applied (once the fixed fields are in).
    checked: bool,
    /// Data bytes still to throw away (a refused frame).
    discard: Option<usize>,
    data: Vec<u8>,
    /// Where the data lands as it arrives, and how much has.
    place: Option<(Placement, usize)>,
}

impl FrameReader {
    pub(crate) fn new(accept: Accept) -> FrameReader {
        FrameReader { accept, h: [0; wire::HEADER], got: 0, body: None, started: None }
    }

    /// Inside a frame past its header (an end of stream inside a header counts as a clean
    /// end, as for [`read_frame_with`]).
    pub(crate) fn in_frame(&self) -> bool {
        self.body.is_some()
    }

    /// The data frame being placed, if the reader is inside its data: where it lands and
    /// how much has.
    pub(crate) fn placing(&self) -> Option<(&Placement, usize)> {
        let (p, done) = self.body.as_ref()?.place.as_ref()?;
        Some((p, *done))
    }

    /// Stops placing the frame being placed: the rest of its data is discarded, and it
    /// comes out as [`Got::Refused`].
    pub(crate) fn revoke(&mut self) {
        if let Some(b) = self.body.as_mut()
            && let Some((p, done)) = b.place.take()
        {
            b.discard = Some(p.len() - done);
        }
    }

    /// `n` more bytes of the frame being placed landed (put there by the caller); the
    /// frame once all have.
    pub(crate) fn placed(&mut self, n: usize) -> Option<Got> {
        let (p, done) = self.body.as_mut()?.place.as_mut()?;
        *done += n;
        debug_assert!(*done <= p.len());
        if *done < p.len() {
            return None;
        }
        let b = self.finish();
        // The fixed fields decoded when the placement was chosen.
        let frame = wire::decode_payload(b.kind, &b.fixed).ok()?;
        Some(Got::Placed { frame, data_len: b.data_len })
    }

    /// Takes bytes from the front of `input` up to the end of the next frame. `Ok(None)`:
    /// `input` is used up, the frame is not complete yet.
    pub(crate) fn feed(
        &mut self,
        input: &mut &[u8],
        data_limit: impl FnMut(u8, &[u8]) -> usize,
        discard: bool,
    ) -> Result<Option<Got>, String> {
        self.feed_placing(input, data_limit, discard, |_, _, _| None)
    }

    /// [`feed`](Self::feed), where `place(kind, fixed, data_len)`, asked once a data
    /// frame's fixed fields are in, may return where its data lands: then the data is
    /// copied there as it arrives (never stored here) and the frame comes out as
    /// [`Got::Placed`]. `None`: the frame is read as by `feed`.
    pub(crate) fn feed_placing(
        &mut self,
        input: &mut &[u8],
        mut data_limit: impl FnMut(u8, &[u8]) -> usize,
        discard: bool,
        mut place: impl FnMut(u8, &[u8], usize) -> Option<Placement>,
    ) -> Result<Option<Got>, String> {
        if input.is_empty() {
            return Ok(None);
        }
        if self.got < wire::HEADER {
            if self.got == 0 {
                self.started = Some(Instant::now());
            }
            let take = (wire::HEADER - self.got).min(input.len());
            self.h[self.got..self.got + take].copy_from_slice(&input[..take]);
            self.got += take;
            *input = &input[take..];
            if self.got < wire::HEADER {
                return Ok(None);
            }
            let (kind, len) = wire::decode_header(&self.h).map_err(|e: WireError| e.to_string())?;
            wire::check_length(kind, len).map_err(|e| e.to_string())?;
            if !self.accept.allows(kind) {
                return Err(format!("frame kind {kind} is not expected here ({:?})", self.accept));
            }
            let len = len as usize;
            // `check_length` bounded a frame without data to its kind's size, and a
            // data-carrying one's fixed part is at most its kind's.
            let (fixed_len, data_len) = match wire::data_offset(kind) {
                Some(fixed) if len >= fixed => (fixed, len - fixed),
                _ => (len, 0),
            };
            self.body = Some(Body {
                kind,
                fixed_len,
                fixed: Vec::with_capacity(fixed_len),
                data_len,
                checked: false,
                discard: None,
                data: Vec::new(),
                place: None,
            });
        }
        let b = self.body.as_mut().expect("a header was read");
        if b.fixed.len() < b.fixed_len {
            let take = (b.fixed_len - b.fixed.len()).min(input.len());
            b.fixed.extend_from_slice(&input[..take]);
            *input = &input[take..];
            if b.fixed.len() < b.fixed_len {
                return Ok(None);
            }
        }
        let is_data = matches!(wire::data_offset(b.kind), Some(f) if b.fixed_len == f);
        // A frame with no data has nothing to place and fits any limit: neither is asked for
        // (a limit may take a lock the QP holds while it posts, and most answers carry none).
        if is_data && !b.checked {
            b.checked = true;
            if b.data_len > 0 {
                match place(b.kind, &b.fixed, b.data_len) {
                    Some(p) if p.len() == b.data_len => b.place = Some((p, 0)),
                    _ => {
                        let limit = data_limit(b.kind, &b.fixed);
                        if b.data_len > limit {
                            if !discard {
                                return Err(format!(
                                    "frame kind {} with {} data bytes where at most {limit} fit",
                                    b.kind, b.data_len
                                ));
                            }
                            b.discard = Some(b.data_len);
                        }
                    }
                }
            }
        }
        // The leave to land this piece, kept while it lands.
        let held = match b.place.as_ref() {
            Some((p, done)) => {
                let held = p.hold();
                if held.is_none() {
                    // Revoked mid-frame: the rest is discarded and the frame comes out as
                    // refused (a write is answered with the status the target check now
                    // gives; a read completes with a protection error).
                    b.discard = Some(p.len() - done);
                    b.place = None;
                }
                held
            }
            None => None,
        };
        if let (Some((p, done)), Some(held)) = (b.place.as_mut(), held.as_ref()) {
            let take = (p.len() - *done).min(input.len());
            // SAFETY: `*done + take <= p.len()`, the placement's checked length; `held` is
            // its own leave.
            unsafe { p.land(held, *done, &input[..take]) };
            *done += take;
            *input = &input[take..];
            if *done < p.len() {
                return Ok(None);
            }
            let b = self.finish();
            let frame = wire::decode_payload(b.kind, &b.fixed).map_err(|e| e.to_string())?;
            return Ok(Some(Got::Placed { frame, data_len: b.data_len }));
        }
        if let Some(left) = b.discard.as_mut() {
            let take = (*left).min(input.len());
            *left -= take;
            *input = &input[take..];
            if *left > 0 {
                return Ok(None);
            }
            let b = self.finish();
            let frame = wire::decode_payload(b.kind, &b.fixed).map_err(|e| e.to_string())?;
            return Ok(Some(Got::Refused { frame, data_len: b.data_len }));
        }
        if b.data.len() < b.data_len {
            let take = (b.data_len - b.data.len()).min(input.len());
            let need = b.data.len() + take;
            if b.data.capacity() < need {
                // Doubling, but never past the frame's data length.
                let want = (b.data.capacity() * 2).max(need).min(b.data_len);
                b.data.reserve_exact(want - b.data.len());
            }
            b.data.extend_from_slice(&input[..take]);
            *input = &input[take..];
            if b.data.len() < b.data_len {
                return Ok(None);
            }
        }
        let b = self.finish();
        let frame = if is_data {
            wire::decode_payload_split(b.kind, &b.fixed, b.data)
        } else {
            wire::decode_payload(b.kind, &b.fixed)
        };
        frame.map(|f| Some(Got::Frame(f))).map_err(|e| e.to_string())
    }

    fn finish(&mut self) -> Body {
        self.got = 0;
        self.started = None;
        self.body.take().expect("a frame was being read")
    }
}

/// What a reader accepts on its stream; other kinds are refused from their header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accept {
    /// A responder's stream after the Hello: requests only.
    Requests,
    /// A requester's stream before its HelloAck.
    HelloAck,
    /// A requester's stream after its HelloAck: responses only.
    Responses,
}

impl Accept {
    fn allows(self, k: u8) -> bool {
        match self {
            Accept::Requests => wire::is_request_kind(k),
            Accept::HelloAck => k == wire::KIND_HELLO_ACK,
            Accept::Responses => wire::is_response_kind(k),
        }
    }
}

#[cfg(test)]
/// Reads one frame: the header, its length checked against its kind, against what
/// `accept` allows and against `data_limit(kind)` (the most data bytes the reader can use
/// for that kind now) *before* anything is allocated for the payload, then the payload (a
/// data-carrying frame's data read straight into the vector the frame keeps).
/// `Ok(None)` at a clean end of stream.
pub fn read_frame(
    r: &mut impl Read,
    buf: &mut Vec<u8>,
    accept: Accept,
    data_limit: impl Fn(u8) -> usize,
) -> Result<Option<Frame>, String> {
    match read_frame_with(r, buf, accept, |k, _| data_limit(k), false)? {
        Some(Got::Frame(f)) => Ok(Some(f)),
        Some(Got::Refused { .. }) => Err("a refused frame from a reader that does not discard".into()),
        Some(Got::Placed { .. }) => Err("a placed frame from a reader that does not place".into()),
        None => Ok(None),
    }
}

/// What [`read_frame_with`] read.
#[derive(Debug, PartialEq, Eq)]
pub enum Got {
    /// A whole frame.
    Frame(Frame),
    /// A data-carrying frame whose data exceeded the limit: its fixed fields (with empty
    /// data) and its data length. The data was read and thrown away, never stored.
    Refused { frame: Frame, data_len: usize },
    /// A data-carrying frame whose data went where [`FrameReader::feed_placing`] was told:
    /// its fixed fields (with empty data) and its data length.
    Placed { frame: Frame, data_len: usize },
}

/// [`read_frame`] with the data limit computed from the frame's kind and fixed fields
/// (`data_limit(kind, fixed)`, called after the fixed fields are read, before any data is):
/// with `discard`, data over the limit is consumed and dropped (`Got::Refused`) so that the
/// stream stays in sync and the frame can still be answered; without, it is an error.
pub fn read_frame_with(
    r: &mut impl Read,
    buf: &mut Vec<u8>,
    accept: Accept,
    data_limit: impl Fn(u8, &[u8]) -> usize,
    discard: bool,
) -> Result<Option<Got>, String> {
    let mut h = [0u8; wire::HEADER];
    match r.read_exact(&mut h) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.to_string()),
    }
    let (kind, len) = wire::decode_header(&h).map_err(|e: WireError| e.to_string())?;
    wire::check_length(kind, len).map_err(|e| e.to_string())?;
    if !accept.allows(kind) {
        return Err(format!("frame kind {kind} is not expected here ({accept:?})"));
    }
    let len = len as usize;
    buf.clear();
    match wire::data_offset(kind) {
        // Data-carrying frames: the fixed fields, then the data read straight into the
        // vector the frame keeps (no zero-fill, no second copy). `check_length` made sure
        // `len >= fixed` and the data is at most `MAX_MESSAGE`; the vector grows only as
        // bytes arrive, and only up to what `data_limit` allows.
        Some(fixed) if len >= fixed => {
            buf.resize(fixed, 0);
            r.read_exact(buf).map_err(|e| e.to_string())?;
            let n = len - fixed;
            let limit = data_limit(kind, buf);
            if n > limit {
                if !discard {
                    return Err(format!("frame kind {kind} with {n} data bytes where at most {limit} fit"));
                }
                let got =
                    std::io::copy(&mut r.take(n as u64), &mut std::io::sink()).map_err(|e| e.to_string())?;
                if got != n as u64 {
                    return Err(format!("connection closed inside a frame ({got} of {n} data bytes)"));
                }
                let frame = wire::decode_payload(kind, buf).map_err(|e| e.to_string())?;
                return Ok(Some(Got::Refused { frame, data_len: n }));
            }
            let mut data = Vec::new();
            let got = r.take(n as u64).read_to_end(&mut data).map_err(|e| e.to_string())?;
            if got != n {
                return Err(format!("connection closed inside a frame ({got} of {n} data bytes)"));
            }
            wire::decode_payload_split(kind, buf, data)
                .map(|f| Some(Got::Frame(f)))
                .map_err(|e| e.to_string())
        }
        _ => {
            buf.resize(len, 0);
            r.read_exact(buf).map_err(|e| e.to_string())?;
            wire::decode_payload(kind, buf).map(|f| Some(Got::Frame(f))).map_err(|e| e.to_string())
        }
    }
}

/// Writes `f`; a large payload goes to the writer without passing through `scratch`.
fn write_frame(w: &mut impl Write, f: &Frame, scratch: &mut Vec<u8>) -> std::io::Result<()> {
    scratch.clear();
    let data = wire::encode_split(f, scratch);
    w.write_all(scratch)?;
    w.write_all(data)
}

/// 24-bit PSN arithmetic, as on the wire of a real RC QP.
pub(crate) fn next_psn(psn: u32) -> u32 {
    psn.wrapping_add(1) & 0x00ff_ffff
}

fn request_psn(f: &Frame) -> Option<u32> {
    match f {
        Frame::Write { psn, .. }
        | Frame::Read { psn, .. }
        | Frame::Send { psn, .. }
        | Frame::FetchAdd { psn, .. }
        | Frame::CmpSwap { psn, .. } => Some(*psn),
        _ => None,
    }
}

/// Fuzzing entry: runs the wire's frame reader ([`FrameReader`], fed 7 bytes at a time
/// so that frames straddle reads as they do on a socket) over `bytes` as a stream, in each
/// of its modes, until the end or an error, and checks that it reads exactly what the
/// blocking reference reader ([`read_frame_with`]) reads (panics otherwise); returns the
/// frames read per mode.
#[doc(hidden)]
pub fn fuzz_read_frames(bytes: &[u8]) -> Vec<Result<Frame, String>> {
    let mut out = Vec::new();
    for accept in [Accept::Requests, Accept::HelloAck, Accept::Responses] {
        let all = |_: u8, _: &[u8]| wire::MAX_MESSAGE as usize;
        out.extend(both_readers(bytes, accept, all, false));
    }
    // The responder's discarding reader, with a limit derived from the fixed fields.
    let limit = |_: u8, fixed: &[u8]| usize::from(fixed.first().copied().unwrap_or(0));
    out.extend(both_readers(bytes, Accept::Requests, limit, true));
    out
}

/// The frames `bytes` hold for both readers, which must agree (frame for frame, and on
/// whether the stream ends in an error).
fn both_readers(
    bytes: &[u8],
    accept: Accept,
    limit: impl Fn(u8, &[u8]) -> usize,
    discard: bool,
) -> Vec<Result<Frame, String>> {
    // The reference: a blocking reader through a small buffer.
    let mut r = BufReader::with_capacity(7, bytes);
    let mut buf = Vec::new();
    let mut reference = Vec::new();
    loop {
        match read_frame_with(&mut r, &mut buf, accept, &limit, discard) {
            Ok(Some(Got::Frame(f))) => reference.push(Ok(f)),
            Ok(Some(Got::Refused { frame, data_len })) => {
                assert!(data_len > 0, "refused without data");
                reference.push(Ok(frame));
            }
            Ok(Some(Got::Placed { .. })) => unreachable!("nothing is placed here"),
            Ok(None) => break,
            Err(e) => {
                reference.push(Err(e));
                break;
            }
        }
    }
    // The wire's incremental reader.
    let mut rd = FrameReader::new(accept);
    let mut got = Vec::new();
    'feed: for piece in bytes.chunks(7) {
        let mut rest = piece;
        while !rest.is_empty() {
            match rd.feed(&mut rest, &limit, discard) {
                Ok(None) => {}
                Ok(Some(Got::Frame(f))) => got.push(Ok(f)),
                Ok(Some(Got::Refused { frame, data_len })) => {
                    assert!(data_len > 0, "refused without data");
                    got.push(Ok(frame));
                }
                Ok(Some(Got::Placed { .. })) => unreachable!("nothing is placed here"),
                Err(e) => {
                    got.push(Err(e));
                    break 'feed;
                }
            }
        }
    }
    if rd.in_frame() && !matches!(got.last(), Some(Err(_))) {
        got.push(Err("connection closed inside a frame".into()));
    }
    let frames =
        |v: &[Result<Frame, String>]| v.iter().filter_map(|r| r.as_ref().ok().cloned()).collect::<Vec<_>>();
    assert_eq!(frames(&got), frames(&reference), "the readers disagree on the frames ({accept:?})");
    assert_eq!(
        matches!(got.last(), Some(Err(_))),
        matches!(reference.last(), Some(Err(_))),
        "the readers disagree on the stream's end ({accept:?}): {got:?} vs {reference:?}"
    );
    got
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Connections refused for the per-device or per-address bound of unauthenticated ones.
    pub(super) static REFUSED: AtomicUsize = AtomicUsize::new(0);

    /// An event loop of the test's own (not the process's wire) with one same-host link on
    /// it, and the device's end of its rings, which produces into the ring the link reads.
    #[cfg(not(miri))]
    fn add_link(lp: &mut EventLoop) -> (usize, ShmConn) {
        let (mine, peer) = shm::test_pair();
        (lp.insert(Entry::Link(accepted_link(mine))), peer)
    }

    /// A same-host link over `rings` whose Hello was accepted, of no QP.
    #[cfg(not(miri))]
    fn accepted_link(rings: ShmConn) -> LinkConn {
        let io = Io::new(Conn::Shm(Box::new(rings)), Accept::Responses);
        LinkConn { io, shared: Arc::new(LinkShared::new(16)), qp: Weak::new(), dial: None, opening: None }
    }

    #[cfg(not(miri))]
    fn test_loop() -> EventLoop {
        let (poll, wire) = new_wire().unwrap();
        EventLoop::new(poll, wire, Duration::ZERO)
    }

    /// The rings of link `i`.
    #[cfg(not(miri))]
    fn ring(lp: &mut EventLoop, i: usize) -> &mut ShmConn {
        lp.rings(i).expect("a same-host link").0
    }

    /// What the loop does after a turn of link `i` (a doorbell's, say).
    #[cfg(not(miri))]
    fn had_a_turn(lp: &mut EventLoop, i: usize) {
        let mut e = lp.slab[i].take().expect("on the loop");
        if let Entry::Link(c) = &mut e {
            lp.start_polling(i, &mut c.io.s);
        }
        lp.slab[i] = Some(e);
    }

    /// Gathered output (`flush_up_to`, `Conn::write_gathered`): many chunks of every size through a socket whose
    /// send buffer is small, so that most calls take part of a chunk, arrive whole and in
    /// order; no call writes more than its budget; the queue's byte count ends at 0.
    #[test]
    #[cfg(not(miri))]
    fn gathered_output_survives_partial_writes_and_keeps_its_budget() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let tx = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut rx, _) = l.accept().unwrap();
        let small: libc::c_int = 4096;
        // SAFETY: setsockopt on a live socket with a c_int option of its size.
        let rc = unsafe {
            libc::setsockopt(
                tx.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&small as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0);
        tx.set_nonblocking(true).unwrap();
        let mut io = Io::new(Conn::Tcp(MioStream::from_std(tx)), Accept::Responses);
        // 300 chunks of 1 B to 40 KiB, more than one call gathers, each with its own bytes.
        let mut sent = Vec::new();
        for i in 0..300usize {
            let len = 1 + (i * 7919) % (40 << 10);
            let chunk: Vec<u8> = (0..len).map(|k| (i * 31 + k) as u8).collect();
            sent.extend_from_slice(&chunk);
            io.out_bytes += len;
            io.out.push_back(Chunk::Bytes(chunk, 0));
        }
        rx.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut got = Vec::with_capacity(sent.len());
        let mut buf = vec![0u8; 64 << 10];
        let (mut calls, mut partial) = (0, 0);
        while got.len() < sent.len() {
            let before = io.out_bytes;
            let budget = 10_000;
            let n = io.flush_up_to(budget).unwrap();
            calls += 1;
            assert!(n <= budget, "a turn wrote {n} bytes, over its budget");
            assert_eq!(before - io.out_bytes, n);
            if io.out.front().is_some_and(|c| matches!(c, Chunk::Bytes(_, off) if *off > 0)) {
                partial += 1;
            }
            if n < budget || io.out.is_empty() {
                let m = rx.read(&mut buf).unwrap();
                assert!(m > 0, "the peer closed");
                got.extend_from_slice(&buf[..m]);
            }
        }
        assert_eq!(io.out_bytes, 0);
        assert!(io.out.is_empty());
        assert!(got == sent, "the stream arrived changed ({} bytes)", got.len());
        assert!(partial > 10, "only {partial} of {calls} turns ended inside a chunk");
    }

    #[test]
    #[cfg(not(miri))]
    fn rings_armed_for_a_sleep_are_polled_again_on_waking_until_they_stay_quiet() {
        let mut lp = test_loop();
        let (i, mut peer) = add_link(&mut lp);
        let frame = [0u8; 8];
        let mut buf = [0u8; 256];
        had_a_turn(&mut lp, i);
        // The loop is about to sleep: the ring asks for a doorbell, and the first frame rings.
        assert!(!lp.arm_polled(), "no input yet");
        peer.write(&frame).unwrap();
        assert_eq!(ring(&mut lp, i).bells_waiting(), 1);
        ring(&mut lp, i).take_doorbells(false);
        // Woken: the ring is polled again, disarmed. What follows comes without doorbells,
        // and the loop's scan sees it.
        lp.resume_polling();
        assert!(ring(&mut lp, i).is_polled());
        assert_eq!(lp.polled.len(), 1);
        for _ in 0..10 {
            peer.write(&frame).unwrap();
        }
        assert_eq!(ring(&mut lp, i).bells_waiting(), -1, "no doorbell while the ring is polled");
        assert!(lp.polled[0].1.moved(), "the scan's probe sees the frames");
        assert_eq!(ring(&mut lp, i).read(&mut buf).unwrap(), 88);
        // The doorbell's turn counted as input, though the ring was polled already.
        had_a_turn(&mut lp, i);
        // Sleeps with no input: after KEEP_POLLING of them the ring is left armed on waking,
        // and its next frame rings.
        let keep = usize::from(KEEP_POLLING);
        for sleep in 1..=keep + 1 {
            assert!(!lp.arm_polled());
            lp.resume_polling();
            assert_eq!(ring(&mut lp, i).is_polled(), sleep <= keep, "after quiet sleep {sleep}");
        }
        assert!(lp.polled.is_empty());
        peer.write(&frame).unwrap();
        assert_eq!(ring(&mut lp, i).bells_waiting(), 1, "quiet: the doorbell is back");
    }

    /// A link flagged in a page (see `super::flags`), watched as the loop watches a new link.
    #[cfg(not(miri))]
    fn add_flagged_link(lp: &mut EventLoop, pair: (ShmConn, ShmConn)) -> (usize, ShmConn) {
        let (mine, peer) = pair;
        let i = lp.insert(Entry::Link(accepted_link(mine)));
        lp.watch_flag(i);
        (i, peer)
    }

    /// A pair of rings flagged at `bit` of `first`'s page (not given out by the page).
    #[cfg(not(miri))]
    fn pair_at(first: &ShmConn, bit: u32) -> (ShmConn, ShmConn) {
        let (mut b, mut pb) = shm::test_pair();
        b.set_flag_for_test(first.flag().unwrap().at(bit));
        pb.set_flag_for_test(first.flag().unwrap().at(bit));
        (b, pb)
    }

    #[test]
    #[cfg(not(miri))]
    fn flagged_rings_take_turns_from_their_bits_and_a_sleep_costs_one_doorbell() {
        // A pid no device of this test has: the page is the test's own.
        const PID: u32 = u32::MAX - 7;
        let mut lp = test_loop();
        let (i, mut pi) = add_flagged_link(&mut lp, shm::test_pair_flagged(PID));
        let (j, mut pj) = add_flagged_link(&mut lp, shm::test_pair_flagged(PID));
        assert_eq!(lp.scans.len(), 1, "one page for both");
        assert_eq!(lp.scans[0].live, 2);
        // A doorbell's turn does not list a flagged ring for polling.
        had_a_turn(&mut lp, i);
        assert!(lp.polled.is_empty());
        assert!(ring(&mut lp, i).is_polled(), "its reads never ask for the ring's own doorbell");
        // Awake: frames come without doorbells, and no bit means no turn.
        let garbage = [0xffu8; 16];
        lp.poll_flags();
        assert!(!lp.polled_input, "nothing set, no turn");
        pi.write(&garbage).unwrap();
        assert_eq!(ring(&mut lp, i).bells_waiting(), -1);
        // The bit gives the link its turn: it reads the garbage and ends; the other stays.
        lp.poll_flags();
        assert!(std::mem::take(&mut lp.polled_input));
        assert!(lp.slab[i].is_none(), "link i had its turn");
        assert!(lp.slab[j].is_some());
        assert_eq!(lp.scans[0].live, 1, "an ended link's bit names nothing");
        // Asleep: the first frame rings, once for the page; the loop stays awake for it.
        assert!(!lp.arm_polled(), "no input: the loop may sleep");
        pj.write(&garbage).unwrap();
        assert_eq!(ring(&mut lp, j).bells_waiting(), 1);
        pj.write(&garbage).unwrap();
        assert_eq!(ring(&mut lp, j).bells_waiting(), 1, "one doorbell per sleep");
        lp.resume_polling();
        assert!(lp.arm_polled(), "input with its bit keeps the loop awake");
        lp.resume_polling();
        lp.poll_flags();
        assert!(lp.slab[j].is_none(), "link j had its turn");
        assert!(lp.scans.is_empty(), "no page left to read");
        drop((pi, pj));
    }

    /// A peer that sets its bit with nothing behind it, again after every take (one store
    /// each time), does not keep the loop from sleeping: only a bit that gives a
    /// connection a turn does. Before, every set bit the loop saw as it went to sleep kept
    /// it awake, and the peer made it spin a core for the price of a store.
    #[test]
    #[cfg(not(miri))]
    fn a_bit_set_with_nothing_behind_it_does_not_keep_the_loop_awake() {
        const PID: u32 = u32::MAX - 10;
        let mut lp = test_loop();
        let (i, pi) = add_flagged_link(&mut lp, shm::test_pair_flagged(PID));
        let (j, mut pj) = add_flagged_link(&mut lp, shm::test_pair_flagged(PID));
        for round in 0..3 {
            pi.raise_flag_without_input();
            assert!(!lp.arm_polled(), "round {round}: a bare bit kept the loop awake");
            // The bit was read for it: the loop's next look does not find it again.
            lp.resume_polling();
            lp.poll_flags();
            assert!(!std::mem::take(&mut lp.polled_input));
        }
        // A bare bit raised while the loop sleeps rings it, as a publish would: a spurious
        // wake-up, which costs the peer a system call per doorbell.
        assert!(!lp.arm_polled());
        pi.raise_flag_without_input();
        assert_eq!(ring(&mut lp, i).bells_waiting(), 1);
        lp.resume_polling();
        // Input with its bit still keeps the loop awake, and its link has its turn there.
        pj.write(&[0xffu8; 16]).unwrap();
        assert!(lp.arm_polled(), "input came: the loop stays awake");
        assert!(lp.slab[j].is_none(), "link j had its turn (its garbage ended it)");
        assert!(lp.slab[i].is_some());
        drop(pi);
    }

    /// A peer naming the page's last bit: the loop reads that word only, not the 127 below
    /// it, on every turn and before every sleep; and forgets it when the connection ends.
    #[test]
    #[cfg(not(miri))]
    fn the_loop_reads_only_the_words_of_bits_it_owns() {
        const PID: u32 = u32::MAX - 9;
        let mut lp = test_loop();
        let (a, pa) = shm::test_pair_flagged(PID);
        let high = super::super::flags::BITS - 1;
        let (b, pb) = pair_at(&a, high);
        let low = a.flag().unwrap().bit() as usize / 64;
        let (i, _pa) = add_flagged_link(&mut lp, (a, pa));
        let (j, _pb) = add_flagged_link(&mut lp, (b, pb));
        assert_eq!(lp.scans.len(), 1);
        assert_eq!(lp.scans[0].words, vec![low, high as usize / 64]);
        let e = lp.slab[j].take().unwrap();
        lp.remove(j, e);
        assert_eq!(lp.scans[0].words, vec![low], "the high word is read no more");
        let e = lp.slab[i].take().unwrap();
        lp.remove(i, e);
        assert!(lp.scans.is_empty());
    }

    #[test]
    #[cfg(not(miri))]
    fn a_bit_taken_twice_leaves_the_second_ring_polled_on_its_own() {
        const PID: u32 = u32::MAX - 8;
        let mut lp = test_loop();
        let (a, pa) = shm::test_pair_flagged(PID);
        // A second connection naming the same bit of the same page (a peer doing so, or a
        // bit given again while the device still serves its old connection).
        let (b, pb) = pair_at(&a, a.flag().unwrap().bit());
        let (i, _pi) = add_flagged_link(&mut lp, (a, pa));
        let (j, _pb) = add_flagged_link(&mut lp, (b, pb));
        assert!(lp.slots[i].flag.is_some());
        assert!(lp.slots.get(j).is_none_or(|s| s.flag.is_none()), "not taken twice");
        assert!(!ring(&mut lp, j).is_polled(), "its reads ask for the ring's own doorbell");
        had_a_turn(&mut lp, j);
        assert_eq!(lp.polled.len(), 1, "polled as a ring without a page");
    }

    /// Links whose rings bring garbage end in the scan's own turns: the entries after an
    /// ended one (the list closes up over it) are scanned all the same, and nothing ended
    /// stays listed.
    #[test]
    #[cfg(not(miri))]
    fn links_ending_in_the_scan_leave_no_entry_and_skip_none() {
        let mut lp = test_loop();
        let mut peers = Vec::new();
        for _ in 0..4 {
            let (i, peer) = add_link(&mut lp);
            had_a_turn(&mut lp, i);
            peers.push((i, peer));
        }
        assert_eq!(lp.polled.len(), 4);
        // Not a frame: a response of an unknown kind ends the link.
        for (_, peer) in &mut peers {
            peer.write(&[0xff; 64]).unwrap();
        }
        lp.poll_rings();
        assert!(lp.polled.is_empty(), "left listed: {:?}", lp.polled.iter().map(|e| e.0).collect::<Vec<_>>());
        for (i, _) in &peers {
            assert!(lp.slab[*i].is_none(), "link {i} ended");
            assert!(!lp.slots[*i].listed);
        }
        // A new link in an ended one's slot is listed afresh, with its own probe.
        let (j, mut peer) = add_link(&mut lp);
        assert!(peers.iter().any(|(i, _)| *i == j), "the slot is reused");
        had_a_turn(&mut lp, j);
        assert_eq!(lp.polled.len(), 1);
        peer.write(&[0u8; 8]).unwrap();
        assert!(lp.polled[0].1.moved());
    }

    #[test]
    fn the_spin_window_is_read_in_microseconds_and_bounded() {
        assert_eq!(spin_of(None), Duration::ZERO, "off unless asked for");
        assert_eq!(spin_of(Some("0")), Duration::ZERO);
        assert_eq!(spin_of(Some(" 250 ")), Duration::from_micros(250));
        assert_eq!(spin_of(Some("99999999")), Duration::from_millis(10));
        assert_eq!(spin_of(Some("fast")), DEFAULT_SPIN);
        assert_eq!(spin_of(Some("-5")), DEFAULT_SPIN);
    }

    fn bytes(frames: &[Frame]) -> Vec<u8> {
        let mut b = Vec::new();
        for f in frames {
            wire::encode(f, &mut b);
        }
        b
    }

    fn read_all(b: &[u8], accept: Accept, limit: usize) -> Vec<Result<Frame, String>> {
        let mut r = BufReader::with_capacity(7, b);
        let (mut buf, mut out) = (Vec::new(), Vec::new());
        loop {
            match read_frame(&mut r, &mut buf, accept, |_| limit) {
                Ok(Some(f)) => out.push(Ok(f)),
                Ok(None) => return out,
                Err(e) => {
                    out.push(Err(e));
                    return out;
                }
            }
        }
    }

    #[test]
    fn reads_frames_across_small_buffers() {
        let frames = [
            Frame::Write { psn: 1, addr: 8, rkey: 3, imm: Some(4), data: vec![5; 300] },
            Frame::Read { psn: 2, addr: 8, rkey: 3, len: 16 },
            Frame::Send { psn: 3, imm: None, data: vec![6; 9] },
        ];
        let got = read_all(&bytes(&frames), Accept::Requests, 1 << 20);
        assert_eq!(got, frames.iter().cloned().map(Ok).collect::<Vec<_>>());
    }

    #[test]
    fn refuses_from_the_header_before_reading_the_payload() {
        // A "Hello" declaring 64 MiB: refused from its 8 header bytes (the payload is not
        // there; a reader that tried to read it would report a short read instead).
        let mut h = bytes(&[Frame::HelloAck { status: 0 }]);
        h.truncate(wire::HEADER);
        h[3] = wire::KIND_HELLO;
        h[4..8].copy_from_slice(&(64u32 << 20).to_le_bytes());
        let got = read_all(&h, Accept::Requests, usize::MAX);
        assert!(matches!(&got[..], [Err(e)] if e.contains("with a")), "{got:?}");
        // A kind the stream does not take (a response on a responder's stream).
        let ack = bytes(&[Frame::Ack { psn: 1, status: 0, data: vec![1; 8] }]);
        let got = read_all(&ack[..wire::HEADER], Accept::Requests, usize::MAX);
        assert!(matches!(&got[..], [Err(e)] if e.contains("not expected")), "{got:?}");
        // More data than the reader can use now (an answer longer than its request).
        let got = read_all(&ack[..wire::HEADER + 8], Accept::Responses, 4);
        assert!(matches!(&got[..], [Err(e)] if e.contains("at most 4")), "{got:?}");
        assert_eq!(
            read_all(&ack, Accept::Responses, 8),
            vec![Ok(Frame::Ack { psn: 1, status: 0, data: vec![1; 8] })]
        );
    }

    #[test]
    fn refused_data_is_discarded_and_the_stream_stays_in_sync() {
        let big = Frame::Write { psn: 1, addr: 8, rkey: 3, imm: None, data: vec![7; 100] };
        let next = Frame::Read { psn: 2, addr: 8, rkey: 3, len: 4 };
        let b = bytes(&[big, next.clone()]);
        let mut r = BufReader::with_capacity(7, &b[..]);
        let mut buf = Vec::new();
        let limit = |_: u8, _: &[u8]| 10;
        let got = read_frame_with(&mut r, &mut buf, Accept::Requests, limit, true).unwrap();
        let fixed = Frame::Write { psn: 1, addr: 8, rkey: 3, imm: None, data: Vec::new() };
        assert_eq!(got, Some(Got::Refused { frame: fixed, data_len: 100 }));
        let got = read_frame_with(&mut r, &mut buf, Accept::Requests, limit, true).unwrap();
        assert_eq!(got, Some(Got::Frame(next)));
    }

    proptest::proptest! {
        #[test]
        // Under Miri, proptest's failure file needs getcwd, which isolation refuses; the
        // unit tests above run the same reader under Miri.
        #[cfg_attr(miri, ignore = "proptest's failure persistence needs getcwd")]
        fn the_wire_reader_agrees_with_the_reference(
            n in 0usize..6,
            data_len in 0usize..300,
            cut in 0usize..2000,
            junk in proptest::collection::vec(proptest::num::u8::ANY, 0..40),
        ) {
            let mut frames = Vec::new();
            for i in 0..n {
                frames.push(match i % 4 {
                    0 => Frame::Write { psn: i as u32, addr: 8, rkey: 3, imm: None, data: vec![i as u8; data_len] },
                    1 => Frame::Read { psn: i as u32, addr: 8, rkey: 3, len: 16 },
                    2 => Frame::Ack { psn: i as u32, status: 0, data: vec![1; data_len % 17] },
                    _ => Frame::Send { psn: i as u32, imm: Some(5), data: vec![2; data_len / 3] },
                });
            }
            let mut b = bytes(&frames);
            b.truncate(cut.max(b.len() / 2));
            b.extend_from_slice(&junk);
            // Panics if the two readers disagree.
            fuzz_read_frames(&b);
        }
    }

    /// A connection with a large answer queued, to a peer that takes it as fast as it comes,
    /// writes at most its turn's share and then says it wants another turn: the loop goes
    /// round its other connections between shares.
    #[test]
    #[cfg_attr(miri, ignore = "a TCP socket pair: Miri has no sockets; the native test run covers it")]
    fn a_large_output_goes_out_a_turns_share_at_a_time() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut theirs, _) = l.accept().unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut io = Io::new(Conn::Tcp(MioStream::from_std(ours)), Accept::Requests);
        let data = vec![7u8; 4 * WRITE_PER_TURN];
        io.push_frame(Frame::Ack { psn: 1, status: 0, data }, &mut Vec::new());
        let queued = io.out_bytes;
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; queued];
            theirs.read_exact(&mut got).unwrap();
            got
        });
        let mut turns = 0;
        while io.out_bytes > 0 {
            let n = io.flush_up_to(WRITE_PER_TURN).unwrap();
            assert!(n <= WRITE_PER_TURN, "a turn wrote {n} bytes");
            if io.out_bytes > 0 {
                assert!(!io.writable || io.more_to_write(), "output left and no turn asked for");
            }
            if !io.writable {
                std::thread::sleep(std::time::Duration::from_millis(1));
                io.writable = true;
            }
            turns += 1;
        }
        let got = reader.join().unwrap();
        assert!(turns >= 4, "{queued} bytes went out in {turns} turns");
        assert!(got[got.len() - 4 * WRITE_PER_TURN..].iter().all(|&b| b == 7));
    }

    #[test]
    #[cfg_attr(miri, ignore = "devices on the process's wire: sockets and threads")]
    fn a_process_connecting_many_qps_at_once_is_never_refused() {
        // 300 QPs of one process connect over TCP to 300 QPs of another device at once.
        // Before, the wire opened the 300 sockets in one go; the device accepted them before
        // their Hellos came, closed all but `MAX_PENDING_PER_ADDR` (16) as unauthenticated,
        // and the rest dialed again: 284 refusals, a WARN storm and backoffs of up to 0.5 s.
        use crate::{AccessFlags, ConnectOptions, Context, QpCaps, SendWr};
        const N: usize = 300;
        let cfg = crate::SoftConfig { same_host_shm: false, ..Default::default() };
        let side = || {
            let ctx = Context::open_soft_with(cfg.clone()).unwrap();
            let pd = ctx.alloc_pd().unwrap();
            let cq = ctx.create_cq(2 * N as u32).unwrap();
            let qps: Vec<_> = (0..N).map(|_| pd.create_qp(&cq, &cq, QpCaps::default()).unwrap()).collect();
            (ctx, pd, cq, qps)
        };
        let (_vctx, vpd, _vcq, vqps) = side();
        let (_ctx, pd, cq, qps) = side();
        let target = vpd.alloc_mr(8 * N, AccessFlags::ALL_REMOTE).unwrap();
        let src = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
        let refused_before = REFUSED.load(Ordering::Relaxed);
        let opts = ConnectOptions::default().with_timeout(18).with_retry_cnt(7);
        for (vqp, qp) in vqps.iter().zip(&qps) {
            vqp.connect(&qp.address().unwrap(), &opts).unwrap();
        }
        for (i, (vqp, qp)) in vqps.iter().zip(&qps).enumerate() {
            // As a QP of another process sees it: a GID no device here has, so over TCP.
            let mut far = vqp.address().unwrap();
            far.gid[8..12].iter_mut().for_each(|b| *b ^= 0xa5);
            qp.connect(&far, &opts).unwrap();
            let dst = target.remote().slice(8 * i as u64, 8).unwrap();
            qp.post_send(SendWr::write(src.local().unwrap(), dst).wr_id(i as u64)).unwrap();
        }
        for _ in 0..N {
            let wc = cq.wait(Some(Duration::from_secs(20))).expect("every write completes");
            assert!(wc.status.is_success(), "{wc:?}");
        }
        let refused = REFUSED.load(Ordering::Relaxed) - refused_before;
        assert_eq!(refused, 0, "{refused} refusals for {N} connections from one process");
    }

    #[test]
    #[cfg(not(miri))]
    fn hellos_that_came_after_their_connections_were_accepted_are_read_before_refusing() {
        // A burst from one host is accepted before its Hellos arrive: 16 connections without
        // a Hello, the bound per address. Their Hellos come; before the loop's turn for them,
        // a 17th connection is accepted. Before, it was refused for the 16 counted as silent.
        let mut lp = test_loop();
        let std_l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        std_l.set_nonblocking(true).unwrap();
        let addr = std_l.local_addr().unwrap();
        let li = lp.insert(Entry::Listener(Lst {
            l: Listening::Tcp(MioListener::from_std(std_l)),
            device: Weak::new(), // the Hellos are read, then dropped: no such device
            pending: Vec::new(),
            served: Arc::new(AtomicUsize::new(0)),
            backoff: BACKOFF_MIN,
            paused_until: None,
            ready: true,
        }));
        let pending = |lp: &EventLoop| match &lp.slab[li] {
            Some(Entry::Listener(l)) => l.pending.len(),
            _ => unreachable!(),
        };
        let accept = |lp: &mut EventLoop| {
            // The kernel's accept queue has them once `connect` returns; poll for it anyway.
            std::thread::sleep(Duration::from_millis(20));
            lp.on_event(li, true, false, false);
        };
        let mut socks: Vec<std::net::TcpStream> =
            (0..MAX_PENDING_PER_ADDR).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
        accept(&mut lp);
        assert_eq!(pending(&lp), MAX_PENDING_PER_ADDR, "accepted, their Hellos not come yet");
        let hello =
            Frame::Hello { src_gid: [1; 16], src_qpn: 1, dst_qpn: 2, src_psn: 3, dst_psn: 4, token: [5; 16] };
        let mut bytes = Vec::new();
        wire::encode(&hello, &mut bytes);
        for s in &mut socks {
            s.write_all(&bytes).unwrap();
        }
        let late = std::net::TcpStream::connect(addr).unwrap();
        accept(&mut lp);
        assert_eq!(pending(&lp), 1, "the 16 Hellos were read (and dropped: no device), the 17th kept");
        drop(late);
    }

    #[test]
    fn rate_limit_lets_one_through_per_second() {
        let l = RateLimit::new();
        assert_eq!(l.allow(), Some(0));
        assert_eq!(l.allow(), None);
        assert_eq!(l.allow(), None);
    }
}
