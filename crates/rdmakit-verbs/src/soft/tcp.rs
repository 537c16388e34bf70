//! The soft NIC between processes and hosts: QPs talk over TCP.
//!
//! Each soft device opens a TCP "port" the first time one of its QPs hands out an
//! endpoint (address from `RDMAKIT_SOFT_ADDR`, default `127.0.0.1:0`). A requester QP
//! connecting to a QP of another process opens one stream to that device and introduces
//! itself with a `Hello`; once the Hello is authenticated, a thread of the device serves
//! that stream as the target-side progress engine: it applies each request to the target
//! QP's memory through the same responder code as in-process, and answers in order,
//! without the target application.
//!
//! Every peer is treated as hostile until its `Hello` proves it is the QP the target was
//! connected to (both initial PSNs and the connection token, see [`wire::Frame::Hello`]):
//! - before that, a connection costs the device one descriptor and a few bytes, no thread:
//!   one acceptor thread per device reads Hellos from all of them with `poll(2)`, takes only
//!   a header whose length is exactly a Hello's, and drops a connection whose Hello is not
//!   complete within [`HELLO_TIMEOUT`]; at most [`MAX_PENDING_PER_ADDR`] connections with an incomplete Hello
//!   per peer address and [`MAX_PENDING`] per device are kept, the rest are closed at once;
//! - after it, a frame's length is checked against its kind before anything is allocated,
//!   each frame must be complete within [`FRAME_TIMEOUT`] of its first byte, request PSNs
//!   must follow on from the requester's initial PSN (replays and gaps are dropped), and a
//!   peer that stops reading is cut off after [`SEND_TIMEOUT`];
//! - accept errors (`EMFILE`) back off instead of spinning, and warnings a peer can
//!   trigger are rate-limited.
//!
//! Requesters never hold a lock across blocking I/O: frames go to a writer thread through a
//! bounded channel, and a reader thread hands responses back to the QP. Dropping the link
//! shuts its socket down, which ends both threads even if the peer is alive but silent.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::SoftDevice;
use super::qp::{Auth, Requester, SharedTail, SoftQp};
use super::wire::{self, Frame, WireError};

/// Environment variable: the address soft devices listen on (`IP` or `IP:port`).
pub const SOFT_ADDR_ENV: &str = "RDMAKIT_SOFT_ADDR";

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
/// Complete `Hello`s waiting for the same not-yet-connected QP (a legitimate peer sends one).
pub(crate) const MAX_AWAITING_PER_QP: usize = 4;
/// Unauthenticated connections kept per device.
pub(crate) const MAX_PENDING: usize = 256;
/// Authenticated connections served per device (each is bound to one target QP).
pub(crate) const MAX_SERVED: usize = 1024;
/// How often an idle served connection checks that its target QP still exists.
const IDLE_CHECK: Duration = Duration::from_secs(1);

const HELLO_FRAME: usize = wire::HEADER + wire::HELLO_LEN;

/// Lets one warning through per second per call site; counts the ones it held back.
pub(crate) struct RateLimit {
    next_ms: AtomicU64,
    held: AtomicU64,
}

impl RateLimit {
    pub(crate) const fn new() -> RateLimit {
        RateLimit { next_ms: AtomicU64::new(0), held: AtomicU64::new(0) }
    }

    /// `Some(held back since the last one)` if a warning may be logged now.
    pub(crate) fn allow(&self) -> Option<u64> {
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

/// `tracing::warn!` at most once a second from this call site (hostile peers must not be
/// able to flood the log); reports how many were held back.
macro_rules! warn_limited {
    ($($arg:tt)*) => {{
        static LIMIT: RateLimit = RateLimit::new();
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

/// Starts the device's listener; returns its port.
pub(crate) fn listen(device: &Arc<SoftDevice>, addr: SocketAddrV4) -> std::io::Result<u16> {
    let listener = TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let port = listener.local_addr()?.port();
    let acceptor = Acceptor {
        listener,
        device: Arc::downgrade(device),
        pending: Vec::new(),
        served: Arc::new(AtomicUsize::new(0)),
        backoff: BACKOFF_MIN,
    };
    std::thread::Builder::new()
        .name(format!("rdmakit-{}-port", device.name()))
        .spawn(move || acceptor.run())?;
    Ok(port)
}

const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// A connection that has not proven who it is yet.
struct Pending {
    s: TcpStream,
    ip: IpAddr,
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

struct Acceptor {
    listener: TcpListener,
    device: Weak<SoftDevice>,
    pending: Vec<Pending>,
    served: Arc<AtomicUsize>,
    backoff: Duration,
}

impl Acceptor {
    fn run(mut self) {
        loop {
            if self.device.strong_count() == 0 {
                return;
            }
            let now = Instant::now();
            self.pending.retain(|p| {
                let alive = p.deadline > now;
                if !alive {
                    warn_limited!(peer = %p.ip, "soft NIC: no authenticated Hello in time; connection dropped");
                }
                alive
            });
            let mut fds = Vec::with_capacity(self.pending.len() + 1);
            fds.push(libc::pollfd { fd: self.listener.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            for p in &self.pending {
                // A complete Hello waits for its QP: watch only for errors and hang-ups (the
                // requests pipelined behind it are the served thread's to read).
                let events = if p.hello.is_some() { 0 } else { libc::POLLIN };
                fds.push(libc::pollfd { fd: p.s.as_raw_fd(), events, revents: 0 });
            }
            let waiting = self.pending.iter().any(|p| p.hello.is_some());
            let next_deadline = self.pending.iter().map(|p| p.deadline).min();
            let mut wait = if waiting { Duration::from_millis(20) } else { IDLE_CHECK };
            if let Some(d) = next_deadline {
                wait = wait.min(d.saturating_duration_since(now) + Duration::from_millis(1));
            }
            let ms = wait.as_millis().min(i32::MAX as u128) as i32;
            // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs for the call.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    warn_limited!(error = %e, "soft NIC: poll failed on the listener");
                    std::thread::sleep(BACKOFF_MIN);
                }
                continue;
            }
            for i in (0..self.pending.len()).rev() {
                let re = fds[i + 1].revents;
                let next = if self.pending[i].hello.is_none() {
                    if re != 0 { self.read_hello(i) } else { Next::Keep }
                } else if re & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
                    Next::Drop
                } else {
                    self.try_auth(i)
                };
                match next {
                    Next::Keep => {}
                    Next::Drop => drop(self.pending.swap_remove(i)),
                    Next::Serve(qp) => {
                        let p = self.pending.swap_remove(i);
                        self.start_serving(p, qp);
                    }
                }
            }
            if fds[0].revents & libc::POLLIN != 0 {
                self.accept_all();
            }
        }
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((s, addr)) => {
                    self.backoff = BACKOFF_MIN;
                    let ip = addr.ip();
                    let from_ip = self.pending.iter().filter(|p| p.ip == ip && p.hello.is_none()).count();
                    if self.pending.len() >= MAX_PENDING || from_ip >= MAX_PENDING_PER_ADDR {
                        warn_limited!(peer = %addr, "soft NIC: too many unauthenticated connections; refused");
                        continue; // dropping `s` closes it
                    }
                    if s.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = s.set_nodelay(true);
                    self.pending.push(Pending {
                        s,
                        ip,
                        buf: [0; HELLO_FRAME],
                        got: 0,
                        deadline: Instant::now() + HELLO_TIMEOUT,
                        hello: None,
                    });
                    // A peer's Hello usually follows its connect at once: take it now, so a
                    // burst of legitimate connections from one host is not counted as slow.
                    let i = self.pending.len() - 1;
                    match self.read_hello(i) {
                        Next::Keep => {}
                        Next::Drop => drop(self.pending.swap_remove(i)),
                        Next::Serve(qp) => {
                            let p = self.pending.swap_remove(i);
                            self.start_serving(p, qp);
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => {}
                Err(e) => {
                    // EMFILE, ENFILE, ENOBUFS...: the listener stays readable, so back off
                    // rather than spin; pending connections still time out meanwhile.
                    warn_limited!(error = %e, backoff_ms = self.backoff.as_millis() as u64, "soft NIC: accept failed; backing off");
                    std::thread::sleep(self.backoff);
                    self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
                    return;
                }
            }
        }
    }

    /// Reads what arrived of pending connection `i`'s Hello (never past it).
    fn read_hello(&mut self, i: usize) -> Next {
        let p = &mut self.pending[i];
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
                let awaiting = self
                    .pending
                    .iter()
                    .filter(|o| matches!(o.hello, Some(Frame::Hello { dst_qpn: q, .. }) if q == dst_qpn))
                    .count();
                let p = &mut self.pending[i];
                if awaiting >= MAX_AWAITING_PER_QP {
                    warn_limited!(peer = %p.ip, qpn = dst_qpn, "soft NIC: too many Hellos waiting for one QP; dropped");
                    return Next::Drop;
                }
                p.hello = Some(h);
                p.deadline = Instant::now() + AUTH_WAIT;
                self.try_auth(i)
            }
            _ => {
                warn_limited!(peer = %p.ip, "soft NIC: malformed Hello; connection dropped");
                Next::Drop
            }
        }
    }

    /// Checks pending connection `i`'s complete Hello against the QP it names.
    fn try_auth(&mut self, i: usize) -> Next {
        let p = &mut self.pending[i];
        let Some(Frame::Hello { src_gid, src_qpn, dst_qpn, src_psn, dst_psn, token }) = &p.hello else {
            return Next::Drop;
        };
        let Some(device) = self.device.upgrade() else { return Next::Drop };
        let auth = match device.find_qp(*dst_qpn) {
            Some(qp) => match qp.authenticate(src_gid, *src_qpn, *src_psn, *dst_psn, token) {
                Auth::Accepted if self.served.load(Ordering::Acquire) >= MAX_SERVED => {
                    warn_limited!(peer = %p.ip, "soft NIC: too many served connections; refused");
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
        // A fresh socket's send buffer takes these few bytes without blocking; if it does
        // not, the peer is not worth waiting for.
        let sent = write_frame(&mut p.s, &Frame::HelloAck { status }, &mut scratch).is_ok();
        match auth {
            Some(qp) if sent => Next::Serve(qp),
            _ => Next::Drop,
        }
    }

    fn start_serving(&mut self, p: Pending, qp: Arc<SoftQp>) {
        let Some(Frame::Hello { src_gid, src_qpn, src_psn, .. }) = p.hello else { return };
        if p.s.set_nonblocking(false).is_err() {
            return;
        }
        let guard = Served::new(&self.served);
        let weak = Arc::downgrade(&qp);
        drop(qp);
        let spawned = std::thread::Builder::new()
            .name("rdmakit-soft-responder".into())
            .spawn(move || serve(p.s, weak, Requester::remote(src_gid, src_qpn), src_psn, guard));
        if let Err(e) = spawned {
            warn_limited!(error = %e, "soft NIC: cannot start a responder thread");
        }
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

/// A socket whose reads fail once a deadline passes (the partial-frame timeout): each read
/// waits at most until the deadline, so a peer trickling bytes cannot hold a frame open.
struct DeadlineStream {
    s: TcpStream,
    deadline: Option<Instant>,
}

impl Read for DeadlineStream {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        if let Some(d) = self.deadline {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "frame not completed in time"));
            }
            self.s.set_read_timeout(Some(left))?;
        }
        self.s.read(b)
    }
}

/// Writes a request frame whose payload is either in the frame or, as `tail`, still in the
/// requester's registered region: then the header goes through the buffer and the payload
/// straight from the region to the socket (`send(2)` reads it; no Rust reference is formed
/// over memory the NIC's peers may write).
fn write_request(
    w: &mut BufWriter<TcpStream>,
    f: &Frame,
    tail: Option<SharedTail>,
    scratch: &mut Vec<u8>,
) -> std::io::Result<()> {
    let Some(tail) = tail else { return write_frame(w, f, scratch) };
    scratch.clear();
    let inline = wire::encode_split(f, scratch);
    debug_assert!(inline.is_empty(), "a shared payload's frame carries no data");
    // The header's length counts the payload that follows from the region.
    let len = u32::from_le_bytes([scratch[4], scratch[5], scratch[6], scratch[7]]) as usize + tail.len;
    scratch[4..8].copy_from_slice(&(len as u32).to_le_bytes());
    w.write_all(scratch)?;
    w.flush()?;
    let fd = w.get_ref().as_raw_fd();
    let mut sent = 0;
    while sent < tail.len {
        // SAFETY: `tail.ptr` is valid for `tail.len` bytes while `tail` (holding the region's
        // entry) lives; the kernel only reads it. MSG_NOSIGNAL: a closed peer is an error,
        // not SIGPIPE. The socket's send timeout bounds the wait on a peer that stops reading.
        let n = unsafe { libc::send(fd, tail.ptr.add(sent).cast(), tail.len - sent, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        sent += n as usize;
    }
    Ok(())
}

/// Writes `f`; a large payload goes to the writer without passing through `scratch`.
fn write_frame(w: &mut impl Write, f: &Frame, scratch: &mut Vec<u8>) -> std::io::Result<()> {
    scratch.clear();
    let data = wire::encode_split(f, scratch);
    w.write_all(scratch)?;
    w.write_all(data)
}

/// Waits until `fd` is readable; false after `wait`.
fn readable(fd: i32, wait: Duration) -> std::io::Result<bool> {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let ms = wait.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd on the stack, count 1.
    let r = unsafe { libc::poll(&mut pfd, 1, ms) };
    match r {
        0 => Ok(false),
        r if r > 0 => Ok(true),
        _ => {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted { Ok(false) } else { Err(e) }
        }
    }
}

/// 24-bit PSN arithmetic, as on the wire of a real RC QP.
pub(crate) fn next_psn(psn: u32) -> u32 {
    psn.wrapping_add(1) & 0x00ff_ffff
}

/// Serves one authenticated stream: the target side of one requester QP. `first_psn` is
/// the requester's initial PSN, checked in its Hello.
fn serve(
    stream: TcpStream,
    qp: Weak<SoftQp>,
    requester: Requester<'static>,
    first_psn: u32,
    _served: Served,
) {
    let peer = stream.peer_addr().ok();
    let _ = stream.set_write_timeout(Some(SEND_TIMEOUT));
    let Ok(read_half) = stream.try_clone() else { return };
    let fd = read_half.as_raw_fd();
    let mut r = BufReader::with_capacity(256 * 1024, DeadlineStream { s: read_half, deadline: None });
    let mut w = BufWriter::with_capacity(64 * 1024, stream);
    let (mut buf, mut scratch) = (Vec::new(), Vec::new());
    // The PSN the next request must carry. Go-back-N: after an RNR NAK, requests are
    // dropped until the NAKed one comes again; replays and gaps are dropped the same way.
    let mut expected = first_psn & 0x00ff_ffff;
    loop {
        if r.buffer().is_empty() {
            // Flush replies before a read that may block (nothing more buffered): batches
            // replies under load, and no reply waits behind a request that gets dropped.
            if w.flush().is_err() {
                return;
            }
            // Idle: wait for the next frame, leaving when the target QP is gone.
            loop {
                match readable(fd, IDLE_CHECK) {
                    Ok(true) => break,
                    Ok(false) if qp.strong_count() == 0 => return,
                    Ok(false) => {}
                    Err(_) => return,
                }
            }
        }
        r.get_mut().deadline = Some(Instant::now() + FRAME_TIMEOUT);
        // A write's data may not exceed what its target region can take from its address
        // (nothing if the key is not valid for it): more would be refused anyway, so it is
        // not stored.
        let limit = |_: u8, fixed: &[u8]| match (wire::decode_payload(wire::KIND_WRITE, fixed), qp.upgrade())
        {
            (Ok(Frame::Write { addr, rkey, .. }), Some(t)) => t.write_data_limit(addr, rkey),
            _ => wire::MAX_MESSAGE as usize,
        };
        let frame = read_frame_with(&mut r, &mut buf, Accept::Requests, limit, true);
        r.get_mut().deadline = None;
        let frame = match frame {
            Ok(Some(Got::Frame(f))) => f,
            Ok(Some(Got::Refused { frame, data_len })) => {
                let Some(psn) = request_psn(&frame) else { return };
                if psn != expected {
                    continue;
                }
                let Some(target) = qp.upgrade() else { return };
                let Some(reply) = target.refuse_write(&requester, frame, data_len) else { continue };
                drop(target);
                expected = next_psn(psn);
                if write_frame(&mut w, &reply, &mut scratch).is_err() {
                    return;
                }
                continue;
            }
            Ok(None) => return,
            Err(e) => {
                warn_limited!(?peer, error = %e, "soft NIC: bad frame from a requester; connection dropped");
                return;
            }
        };
        let Some(psn) = request_psn(&frame) else { return };
        if psn != expected {
            warn_limited!(?peer, psn, expected, "soft NIC: request out of sequence (replay or gap); dropped");
            continue;
        }
        // A destroyed target QP answers nothing: the requester times out, as on a real NIC.
        let Some(target) = qp.upgrade() else { return };
        // `None`: the target QP is not connected to this requester (any more): drop, as a
        // NIC drops such packets; the requester times out.
        let Some(reply) = target.serve_remote(&requester, frame) else { continue };
        drop(target);
        if !matches!(reply, Frame::RnrNak { .. }) {
            expected = next_psn(psn);
        }
        if write_frame(&mut w, &reply, &mut scratch).is_err() {
            return;
        }
    }
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

type Queued = (Frame, Option<SharedTail>);

/// A requester's connection to a remote QP.
pub(crate) struct TcpLink {
    tx: mpsc::SyncSender<Queued>,
    dead: Arc<AtomicBool>,
    /// A handle on the socket, to shut it down when the link is dropped.
    stream: Option<TcpStream>,
}

impl TcpLink {
    /// Connects QP `qp` to the device listening at `addr`, introducing itself with `hello`.
    /// At most `queue` frames wait for the writer thread.
    ///
    /// Errors are not returned: as on a real RC QP, an unreachable peer shows up as
    /// requests that complete with `RETRY_EXC_ERR`. The link is then dead from the start.
    /// The Hello is answered asynchronously (the peer may be connecting its QP to ours
    /// meanwhile); requests queued before the answer follow the Hello on the stream.
    pub fn connect(qp: &Arc<SoftQp>, addr: SocketAddr, hello: Frame, queue: usize) -> TcpLink {
        let dead = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::sync_channel::<Queued>(queue);
        let mut handle = None;
        match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            Ok(stream) => {
                let _ = stream.set_nodelay(true);
                let _ = stream.set_write_timeout(Some(SEND_TIMEOUT));
                handle = stream.try_clone().ok();
                let weak = Arc::downgrade(qp);
                if let Err(e) = spawn_io(stream, hello, rx, weak, dead.clone()) {
                    tracing::error!(%e, "soft NIC: cannot start link threads");
                    dead.store(true, Ordering::Release);
                }
            }
            Err(e) => {
                warn_limited!(%addr, error = %e, "soft NIC: peer unreachable; requests will time out");
                dead.store(true, Ordering::Release);
            }
        }
        TcpLink { tx, dead, stream: handle }
    }

    /// Queues a request frame, with its payload still in the region when `tail` is given.
    /// False if the link is down or its queue is full (the request is retried later).
    pub fn send(&self, f: Frame, tail: Option<SharedTail>) -> bool {
        !self.is_dead() && self.tx.try_send((f, tail)).is_ok()
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        // Ends both threads even if the peer is alive but silent (a writer blocked on a
        // full socket, a reader waiting for an answer): their calls fail at once.
        if let Some(s) = &self.stream {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn spawn_io(
    stream: TcpStream,
    hello: Frame,
    rx: mpsc::Receiver<Queued>,
    qp: Weak<SoftQp>,
    dead: Arc<AtomicBool>,
) -> std::io::Result<()> {
    let read_half = stream.try_clone()?;
    let dead_w = dead.clone();
    std::thread::Builder::new().name("rdmakit-soft-tx".into()).spawn(move || {
        let mut w = BufWriter::with_capacity(256 * 1024, stream);
        let mut scratch = Vec::new();
        let fail = |w: &BufWriter<TcpStream>| {
            dead_w.store(true, Ordering::Release);
            let _ = w.get_ref().shutdown(std::net::Shutdown::Both);
        };
        if write_frame(&mut w, &hello, &mut scratch).and_then(|_| w.flush()).is_err() {
            return fail(&w);
        }
        // Write each frame; flush when the queue is momentarily empty.
        while let Ok((f, tail)) = rx.recv() {
            let mut ok = write_request(&mut w, &f, tail, &mut scratch).is_ok();
            while ok {
                match rx.try_recv() {
                    Ok((f, tail)) => ok = write_request(&mut w, &f, tail, &mut scratch).is_ok(),
                    Err(_) => break,
                }
            }
            if !ok || w.flush().is_err() {
                return fail(&w);
            }
        }
        // The QP is gone (sender dropped): close the stream.
        let _ = w.get_ref().shutdown(std::net::Shutdown::Both);
    })?;
    std::thread::Builder::new().name("rdmakit-soft-rx".into()).spawn(move || {
        let mut r = BufReader::with_capacity(256 * 1024, read_half);
        let mut buf = Vec::new();
        let acked = match read_frame(&mut r, &mut buf, Accept::HelloAck, |_| 0) {
            Ok(Some(Frame::HelloAck { status: 0 })) => true,
            Ok(Some(_)) => {
                warn_limited!("soft NIC: the peer refused our Hello; requests will time out");
                false
            }
            Ok(None) => false,
            Err(e) => {
                warn_limited!(error = %e, "soft NIC: bad handshake reply; link dropped");
                false
            }
        };
        if acked {
            loop {
                // An answer carries at most what the oldest outstanding request asked for.
                let limit = |_| qp.upgrade().map_or(0, |q| q.response_data_limit());
                match read_frame(&mut r, &mut buf, Accept::Responses, limit) {
                    Ok(Some(f)) => match qp.upgrade() {
                        Some(qp) => qp.on_remote_response(f),
                        None => break,
                    },
                    Ok(None) => break,
                    Err(e) => {
                        warn_limited!(error = %e, "soft NIC: bad response; link dropped");
                        break;
                    }
                }
            }
        }
        // Outstanding requests now time out (RETRY_EXC_ERR) on the QP's transport budget.
        dead.store(true, Ordering::Release);
        let _ = r.get_ref().shutdown(std::net::Shutdown::Both);
    })?;
    Ok(())
}

/// Fuzzing entry: runs the production frame reader over `bytes` as a stream, in each of
/// its modes, until the end or an error; returns the frames read per mode.
#[doc(hidden)]
pub fn fuzz_read_frames(bytes: &[u8]) -> Vec<Result<Frame, String>> {
    let mut out = Vec::new();
    for accept in [Accept::Requests, Accept::HelloAck, Accept::Responses] {
        // A small buffer so frames straddle refills, as they do on a socket.
        let mut r = BufReader::with_capacity(7, bytes);
        let mut buf = Vec::new();
        loop {
            match read_frame(&mut r, &mut buf, accept, |_| wire::MAX_MESSAGE as usize) {
                Ok(Some(f)) => out.push(Ok(f)),
                Ok(None) => break,
                Err(e) => {
                    out.push(Err(e));
                    break;
                }
            }
        }
    }
    // The responder's discarding reader, with a limit derived from the fixed fields.
    let mut r = BufReader::with_capacity(7, bytes);
    let mut buf = Vec::new();
    let limit = |_: u8, fixed: &[u8]| usize::from(fixed.first().copied().unwrap_or(0));
    loop {
        match read_frame_with(&mut r, &mut buf, Accept::Requests, limit, true) {
            Ok(Some(Got::Frame(f))) => out.push(Ok(f)),
            Ok(Some(Got::Refused { frame, data_len })) => {
                assert!(data_len > 0, "refused without data");
                out.push(Ok(frame));
            }
            Ok(None) => break,
            Err(e) => {
                out.push(Err(e));
                break;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn rate_limit_lets_one_through_per_second() {
        let l = RateLimit::new();
        assert_eq!(l.allow(), Some(0));
        assert_eq!(l.allow(), None);
        assert_eq!(l.allow(), None);
    }
}
