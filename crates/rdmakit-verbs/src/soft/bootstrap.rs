//! The soft provider's connection bootstrap: a TCP exchange of endpoints, tokens and private
//! data, returning raw pieces (streams, the peer's hello) as `rdma/cm/` does for rdma_cm.
//! The front (`cm.rs`) creates and connects the QP between the steps and checks private
//! data; nothing here knows a QP.
//!
//! ```text
//! request:  "RKCM" 2 | endpoint (32) | token (16) | len u8 | private data
//! reply:    "RKCM" 2 | status u8 (0 accepted) | endpoint (32) | token (16) | len u8 | private data
//! ready:    "RKCM" 2 | 0xff            (the requester's QP is connected: start sending)
//! ```
//! Then the stream stays open; closing it is the disconnect.
//!
//! Each side draws a random connection token and sends it: a requester of the other process
//! must present it in its soft NIC Hello (with both initial PSNs) before any of its requests
//! is served, so a client that did not take part in this exchange cannot forge one.
//!
//! Every read of a handshake shares one deadline (a peer trickling bytes cannot stretch it);
//! a length byte from the peer is checked against the caller's limit before anything is
//! allocated for it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::types::QpAddress;

const MAGIC: [u8; 5] = *b"RKCM\x02";
/// Bytes of a connection token.
pub(crate) const TOKEN_LEN: usize = 16;
/// A connection token.
pub(crate) type Token = [u8; TOKEN_LEN];
/// The requester's last message.
const READY: [u8; 6] = *b"RKCM\x02\xff";
/// A request's fixed part; a reply has one more byte (the status).
const REQUEST_HEAD: usize = MAGIC.len() + QpAddress::ENCODED_LEN + TOKEN_LEN + 1;

/// What one side sends: status (0 in a request), endpoint, token and private data.
#[derive(Debug)]
pub(crate) struct Hello {
    /// 0: accepted (always 0 in a request).
    pub status: u8,
    /// The peer QP's endpoint.
    pub endpoint: QpAddress,
    /// The peer's connection token.
    pub token: Token,
    /// The peer's private data, at most the limit the front gave.
    pub private_data: Vec<u8>,
}

/// Where a bootstrap connection's two ends are: what a peer's declared endpoint is checked
/// against before this side's NIC dials it (`cm`'s `check_declared`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Origin {
    /// The other end's IP address.
    pub peer: std::net::IpAddr,
    /// This end's.
    pub local: std::net::IpAddr,
}

impl Origin {
    fn of(peer: std::io::Result<SocketAddr>, local: std::io::Result<SocketAddr>) -> Result<Origin> {
        let (peer, local) = (peer.map_err(io_err("getpeername"))?, local.map_err(io_err("getsockname"))?);
        Ok(Origin { peer: peer.ip().to_canonical(), local: local.ip().to_canonical() })
    }
}

fn malformed(reason: &str) -> Error {
    Error::Malformed { what: "connection handshake", reason: reason.into() }
}

fn io_err(call: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |source| Error::Os { call, source }
}

fn encode(status: Option<u8>, ep: &QpAddress, token: &Token, data: &[u8]) -> Result<Vec<u8>> {
    let len = u8::try_from(data.len())
        .map_err(|_| Error::InvalidArgument(format!("private data of {} bytes", data.len())))?;
    let mut m = MAGIC.to_vec();
    m.extend(status);
    m.extend_from_slice(&ep.encode());
    m.extend_from_slice(token);
    m.push(len);
    m.extend_from_slice(data);
    Ok(m)
}

/// The fixed part of a request (`with_status` false) or reply: the hello without its data,
/// and how many data bytes follow (checked against `max_data`).
fn decode_head(head: &[u8], with_status: bool, max_data: usize) -> Result<(Hello, usize)> {
    if head[..MAGIC.len()] != MAGIC {
        return Err(malformed("bad magic"));
    }
    let (status, rest) =
        if with_status { (head[MAGIC.len()], &head[MAGIC.len() + 1..]) } else { (0, &head[MAGIC.len()..]) };
    let endpoint = QpAddress::decode(&rest[..QpAddress::ENCODED_LEN])?;
    let mut token = [0u8; TOKEN_LEN];
    token.copy_from_slice(&rest[QpAddress::ENCODED_LEN..QpAddress::ENCODED_LEN + TOKEN_LEN]);
    let len = usize::from(rest[QpAddress::ENCODED_LEN + TOKEN_LEN]);
    if len > max_data {
        return Err(malformed("private data too long"));
    }
    Ok((Hello { status, endpoint, token, private_data: Vec::new() }, len))
}

fn check_ready(m: &[u8; READY.len()]) -> Result<()> {
    if *m != READY {
        return Err(malformed("bad ready message"));
    }
    Ok(())
}

fn refused(addr: SocketAddr, e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::ConnectionRefused {
        Error::ConnectionRejected { reason: format!("nothing listens at {addr}"), private_data: Vec::new() }
    } else {
        Error::Os { call: "connect", source: e }
    }
}

// ---- blocking ----

/// Reads exactly `buf.len()` bytes before `deadline` (a per-read timeout would restart with
/// every byte).
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

/// A reply (the requester's side; the listener reads requests without blocking, in
/// [`Pending::advance`]).
fn read_reply(s: &mut TcpStream, max_data: usize, deadline: Instant, budget: Duration) -> Result<Hello> {
    let mut head = [0u8; REQUEST_HEAD + 1];
    read_by(s, &mut head, deadline, budget)?;
    let (mut hello, len) = decode_head(&head, true, max_data)?;
    hello.private_data = vec![0u8; len];
    read_by(s, &mut hello.private_data, deadline, budget)?;
    Ok(hello)
}

/// Most connections a blocking listener call reads requests from at once. Past it, one is
/// dropped ([`Pending::keep_rank`]): the one whose request has come least far, and of
/// those the one accepted first (a request arrives one round trip after its connection, so
/// the oldest one still silent is the likeliest to stay so). A flood of connections that
/// say nothing thus drops each other, not a client that has begun its request. What a
/// connection sent is read as it is accepted: a request already whole is served at once,
/// where holders that each sent a byte outranked it unread and dropped it.
pub(crate) const MAX_PENDING: usize = 64;

/// A bootstrap listener (blocking).
///
/// It reads the requests of every connection it has accepted at once (non-blocking sockets
/// and `poll`), so a client that connects and says nothing, or trickles its request, delays
/// no other: each connection has its own deadline, a call keeps at most [`MAX_PENDING`],
/// and those still incomplete when a call returns wait for the next call.
pub(crate) struct SoftListener {
    l: TcpListener,
    /// Connections whose request is incomplete, between calls. A call takes them all and
    /// gives back what it leaves, so concurrent calls never read the same socket.
    pending: Mutex<Vec<Pending>>,
}

/// A connection whose request is still arriving.
struct Pending {
    s: TcpStream,
    /// The request's bytes so far.
    got: Vec<u8>,
    /// The request's length in all: its fixed part until that has been read, then with the
    /// private data the fixed part announced (checked against the limit first).
    need: usize,
    /// The end of its budget, counted from its accept; the rest of its handshake shares it.
    deadline: Instant,
    budget: Duration,
}

impl Pending {
    /// Where it stands when connections must be dropped: the lowest goes first (see
    /// [`MAX_PENDING`]).
    fn keep_rank(&self) -> (usize, Instant) {
        (self.got.len(), self.deadline)
    }

    /// Reads what has arrived: true once the request is complete.
    fn advance(&mut self, max_data: usize) -> Result<bool> {
        loop {
            let have = self.got.len();
            self.got.resize(self.need, 0);
            let r = (&self.s).read(&mut self.got[have..]);
            let n = match r {
                Ok(0) => {
                    let eof = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
                    return Err(Error::Os { call: "read handshake", source: eof });
                }
                Ok(n) => n,
                Err(e) => {
                    self.got.truncate(have);
                    match e.kind() {
                        std::io::ErrorKind::Interrupted => continue,
                        std::io::ErrorKind::WouldBlock => return Ok(false),
                        _ => return Err(Error::Os { call: "read handshake", source: e }),
                    }
                }
            };
            self.got.truncate(have + n);
            if self.got.len() < self.need {
                continue;
            }
            if self.need == REQUEST_HEAD {
                let (_, len) = decode_head(&self.got, false, max_data)?;
                self.need += len;
            }
            if self.got.len() == self.need {
                return Ok(true);
            }
        }
    }

    /// The complete request, its stream blocking again for the rest of the handshake.
    fn into_request(self, max_data: usize) -> Result<SoftRequest> {
        let (mut hello, _) = decode_head(&self.got[..REQUEST_HEAD], false, max_data)?;
        hello.private_data = self.got[REQUEST_HEAD..].to_vec();
        self.s.set_nonblocking(false).map_err(io_err("fcntl"))?;
        let left = self.deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let _ = self.s.set_write_timeout(Some(left));
        Ok(SoftRequest { s: self.s, deadline: self.deadline, budget: self.budget, hello })
    }
}

/// A call's own connections: given back to the listener when the call returns.
struct Taken<'a> {
    from: &'a Mutex<Vec<Pending>>,
    v: Vec<Pending>,
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        let mut shared = self.from.lock().unwrap_or_else(|e| e.into_inner());
        shared.append(&mut self.v);
        // Calls that ran at once may have left more than one call keeps: the lowest ranked
        // go.
        if shared.len() > MAX_PENDING {
            shared.sort_by_key(Pending::keep_rank);
            let extra = shared.len() - MAX_PENDING;
            shared.drain(..extra);
        }
    }
}

impl SoftListener {
    pub fn bind(addr: SocketAddr) -> Result<SoftListener> {
        let l = TcpListener::bind(addr).map_err(io_err("bind"))?;
        l.set_nonblocking(true).map_err(io_err("fcntl"))?;
        Ok(SoftListener { l, pending: Mutex::new(Vec::new()) })
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.l.local_addr().map_err(io_err("getsockname"))
    }

    /// The next complete request (`Error::Timeout` if none within `wait`; `None`: no end).
    /// Each connection has `budget` from its accept for its request (at most `max_data`
    /// bytes of private data), and the rest of its handshake shares that deadline.
    /// A connection that fails before its request is complete (closed, malformed, out of
    /// time, or dropped for a newer one) is not the caller's error: it is closed and logged
    /// here, and the call goes on. Errors are the listener's own (its socket failing).
    pub fn next_request(
        &self,
        wait: Option<Duration>,
        max_data: usize,
        budget: Duration,
    ) -> Result<SoftRequest> {
        let until = wait.map(deadline_after);
        let shared = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        let mut mine = Taken { from: &self.pending, v: shared };
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(MAX_PENDING + 1);
        loop {
            let now = Instant::now();
            mine.v.retain(|p| {
                let live = p.deadline > now;
                if !live {
                    tracing::debug!(budget = ?p.budget, "soft CM: a connection sent no complete request in time");
                }
                live
            });
            if let Some(u) = until
                && now >= u
            {
                return Err(Error::Timeout(wait.unwrap_or_default()));
            }
            fds.clear();
            fds.push(libc::pollfd { fd: self.l.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            fds.extend(mine.v.iter().map(|p| libc::pollfd {
                fd: p.s.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }));
            let wake = mine.v.iter().map(|p| p.deadline).chain(until).min();
            poll_fds(&mut fds, wake)?;
            // The connections first (from the last, for `swap_remove`): a complete request
            // is answered before new connections are taken.
            for i in (0..mine.v.len()).rev() {
                if fds[i + 1].revents == 0 {
                    continue;
                }
                match mine.v[i].advance(max_data) {
                    Ok(false) => {}
                    Ok(true) => return mine.v.swap_remove(i).into_request(max_data),
                    Err(e) => {
                        tracing::debug!(error = %e, "soft CM: a connection's request failed");
                        mine.v.swap_remove(i);
                    }
                }
            }
            if fds[0].revents != 0
                && let Some(done) = self.take_connections(&mut mine.v, budget, max_data)?
            {
                return done.into_request(max_data);
            }
        }
    }

    /// Accepts what the listening socket holds, up to [`MAX_PENDING`] a round, and reads
    /// what each has sent before it is ranked: a request already complete is returned, not
    /// ranked (holders of a byte each would outrank it while unread).
    fn take_connections(
        &self,
        v: &mut Vec<Pending>,
        budget: Duration,
        max_data: usize,
    ) -> Result<Option<Pending>> {
        for _ in 0..MAX_PENDING {
            let s = match self.l.accept() {
                Ok((s, _)) => s,
                Err(e) => match e.kind() {
                    std::io::ErrorKind::WouldBlock => return Ok(None),
                    // Gone before it was taken: not this listener's error.
                    std::io::ErrorKind::Interrupted | std::io::ErrorKind::ConnectionAborted => continue,
                    _ => return Err(Error::Os { call: "accept", source: e }),
                },
            };
            if s.set_nonblocking(true).is_err() {
                continue;
            }
            let mut p =
                Pending { s, got: Vec::new(), need: REQUEST_HEAD, deadline: deadline_after(budget), budget };
            match p.advance(max_data) {
                Ok(true) => return Ok(Some(p)),
                Ok(false) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "soft CM: a connection's request failed");
                    continue;
                }
            }
            if v.len() >= MAX_PENDING {
                // Among those taken before: a newcomer whose request is on its way has until
                // the next connection comes, ranked then by what it has sent.
                let last = v.iter().enumerate().min_by_key(|(_, p)| p.keep_rank()).map(|(i, _)| i);
                if let Some(i) = last {
                    tracing::debug!(
                        "soft CM: {MAX_PENDING} requests incomplete; the one least far along is dropped"
                    );
                    v.swap_remove(i);
                }
            }
            v.push(p);
        }
        Ok(None)
    }
}

/// A request read: the peer's hello, and the stream to answer on.
pub(crate) struct SoftRequest {
    s: TcpStream,
    deadline: Instant,
    budget: Duration,
    /// What the requester sent.
    pub hello: Hello,
}

impl SoftRequest {
    /// The connection's ends.
    pub fn origin(&self) -> Result<Origin> {
        Origin::of(self.s.peer_addr(), self.s.local_addr())
    }

    /// Answers with our endpoint, token and private data, then waits for the requester's
    /// ready: the connection's stream.
    pub fn accept(mut self, ep: &QpAddress, token: &Token, data: &[u8]) -> Result<SoftConn> {
        self.s.write_all(&encode(Some(0), ep, token, data)?).map_err(io_err("write handshake"))?;
        let mut ready = [0u8; READY.len()];
        read_by(&mut self.s, &mut ready, self.deadline, self.budget)?;
        check_ready(&ready)?;
        self.s.set_read_timeout(None).map_err(io_err("setsockopt"))?;
        Ok(SoftConn(self.s))
    }
}

/// The requester's side: a TCP connection to the listener, within `budget` (which also
/// bounds the rest of the handshake).
pub(crate) fn connect(addr: SocketAddr, budget: Duration) -> Result<SoftConnecting> {
    let s = TcpStream::connect_timeout(&addr, budget).map_err(|e| refused(addr, e))?;
    let _ = s.set_write_timeout(Some(budget));
    Ok(SoftConnecting { s, deadline: deadline_after(budget), budget })
}

/// A requester's TCP connection, the request not sent yet.
pub(crate) struct SoftConnecting {
    s: TcpStream,
    deadline: Instant,
    budget: Duration,
}

impl SoftConnecting {
    /// The connection's ends.
    pub fn origin(&self) -> Result<Origin> {
        Origin::of(self.s.peer_addr(), self.s.local_addr())
    }

    /// Sends the request and reads the reply (of any status: the caller decides).
    pub fn request(
        mut self,
        ep: &QpAddress,
        token: &Token,
        data: &[u8],
        max_data: usize,
    ) -> Result<(SoftReplied, Hello)> {
        self.s.write_all(&encode(None, ep, token, data)?).map_err(io_err("write handshake"))?;
        let hello = read_reply(&mut self.s, max_data, self.deadline, self.budget)?;
        Ok((SoftReplied(self.s), hello))
    }
}

/// A requester that has its reply: it sends ready once its QP is connected.
pub(crate) struct SoftReplied(TcpStream);

impl SoftReplied {
    pub fn ready(mut self) -> Result<SoftConn> {
        self.0.write_all(&READY).map_err(io_err("write handshake"))?;
        self.0.set_read_timeout(None).map_err(io_err("setsockopt"))?;
        Ok(SoftConn(self.0))
    }
}

/// An established soft connection's bootstrap stream: closing it is the disconnect.
pub(crate) struct SoftConn(TcpStream);

impl SoftConn {
    pub fn disconnect(&self) {
        let _ = self.0.shutdown(std::net::Shutdown::Both);
    }

    /// True once the stream reports end-of-file (the peer closed or this side shut it down).
    pub fn wait_disconnected(&self, wait: Duration) -> Result<bool> {
        if !wait_readable(self.0.as_raw_fd(), wait)? {
            return Ok(false);
        }
        // Readable means end-of-file: the peer sends nothing after the handshake, so stray
        // bytes or a read error are a broken bootstrap stream, which is a disconnect too.
        let _ = (&self.0).read(&mut [0u8; 1]);
        Ok(true)
    }
}

/// `Instant::now() + d`, for a `d` that may be too long to add to the clock (a caller's
/// `Duration::MAX` for "no end"): at most a century away.
fn deadline_after(d: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    let now = Instant::now();
    now.checked_add(d.min(CENTURY)).unwrap_or(now)
}

fn wait_readable(fd: i32, wait: Duration) -> Result<bool> {
    let deadline = deadline_after(wait);
    let mut pfd = [libc::pollfd { fd, events: libc::POLLIN, revents: 0 }];
    loop {
        poll_fds(&mut pfd, Some(deadline))?;
        if pfd[0].revents != 0 {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
    }
}

/// Waits until one of `fds` is readable (or fails), or until `wake` (`None`: no end).
fn poll_fds(fds: &mut [libc::pollfd], wake: Option<Instant>) -> Result<()> {
    let n = libc::nfds_t::try_from(fds.len())
        .map_err(|_| Error::InvalidArgument("too many sockets to poll".into()))?;
    let ms = match wake {
        // Rounded up, so that a deadline is past when poll returns.
        Some(w) => {
            let left = w.saturating_duration_since(Instant::now());
            left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
        }
        None => -1,
    };
    // SAFETY: `fds` is a valid, initialised slice of `n` pollfds that lives across the
    // call, so poll reads and writes only it.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), n, ms) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::Os { call: "poll", source: e });
        }
        // Interrupted: the caller's loop looks again.
        fds.iter_mut().for_each(|f| f.revents = 0);
    }
    Ok(())
}

// ---- on tokio ----
//
// The same exchange on tokio sockets. No deadline here: the front runs the whole handshake
// under one `tokio::time::timeout`, which drops (closes) the stream when it fires.

#[cfg(feature = "async")]
pub(crate) use self::nonblocking::*;

#[cfg(feature = "async")]
mod nonblocking {
    use super::*;
    use tokio::net::{TcpListener, TcpStream};

    async fn read_exact(s: &TcpStream, mut buf: &mut [u8]) -> Result<()> {
        while !buf.is_empty() {
            s.readable().await.map_err(io_err("read handshake"))?;
            match s.try_read(buf) {
                Ok(0) => {
                    let eof = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
                    return Err(Error::Os { call: "read handshake", source: eof });
                }
                Ok(n) => buf = &mut buf[n..],
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(Error::Os { call: "read handshake", source: e }),
            }
        }
        Ok(())
    }

    async fn write_all(s: &TcpStream, mut buf: &[u8]) -> Result<()> {
        while !buf.is_empty() {
            s.writable().await.map_err(io_err("write handshake"))?;
            match s.try_write(buf) {
                Ok(n) => buf = &buf[n..],
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(Error::Os { call: "write handshake", source: e }),
            }
        }
        Ok(())
    }

    async fn read_hello(s: &TcpStream, with_status: bool, max_data: usize) -> Result<Hello> {
        let mut head = [0u8; REQUEST_HEAD + 1];
        let head = if with_status { &mut head[..] } else { &mut head[..REQUEST_HEAD] };
        read_exact(s, head).await?;
        let (mut hello, len) = decode_head(head, with_status, max_data)?;
        hello.private_data = vec![0u8; len];
        read_exact(s, &mut hello.private_data).await?;
        Ok(hello)
    }

    /// Back to a blocking std stream: what the established connection keeps.
    fn into_conn(s: TcpStream) -> Result<SoftConn> {
        let s = s.into_std().map_err(io_err("deregister"))?;
        s.set_nonblocking(false).map_err(io_err("fcntl"))?;
        Ok(SoftConn(s))
    }

    /// A bootstrap listener on tokio (needs a runtime).
    pub(crate) struct AsyncSoftListener(TcpListener);

    impl AsyncSoftListener {
        pub fn bind(addr: SocketAddr) -> Result<AsyncSoftListener> {
            let l = std::net::TcpListener::bind(addr).map_err(io_err("bind"))?;
            l.set_nonblocking(true).map_err(io_err("fcntl"))?;
            TcpListener::from_std(l).map(AsyncSoftListener).map_err(io_err("register"))
        }

        pub fn local_addr(&self) -> Result<SocketAddr> {
            self.0.local_addr().map_err(io_err("getsockname"))
        }

        /// The next TCP connection, its request not read yet.
        pub async fn accept(&self) -> Result<AsyncSoftIncoming> {
            let (s, _) = self.0.accept().await.map_err(io_err("accept"))?;
            Ok(AsyncSoftIncoming(s))
        }
    }

    /// A bootstrap connection whose request is not read yet.
    pub(crate) struct AsyncSoftIncoming(TcpStream);

    impl AsyncSoftIncoming {
        pub async fn read_request(self, max_data: usize) -> Result<AsyncSoftRequest> {
            let hello = read_hello(&self.0, false, max_data).await?;
            Ok(AsyncSoftRequest { s: self.0, hello })
        }
    }

    /// A request read: the peer's hello, and the stream to answer on.
    pub(crate) struct AsyncSoftRequest {
        s: TcpStream,
        /// What the requester sent.
        pub hello: Hello,
    }

    impl AsyncSoftRequest {
        /// The connection's ends.
        pub fn origin(&self) -> Result<Origin> {
            Origin::of(self.s.peer_addr(), self.s.local_addr())
        }

        /// Answers, then waits for the requester's ready.
        pub async fn accept(self, ep: &QpAddress, token: &Token, data: &[u8]) -> Result<SoftConn> {
            write_all(&self.s, &encode(Some(0), ep, token, data)?).await?;
            let mut ready = [0u8; READY.len()];
            read_exact(&self.s, &mut ready).await?;
            check_ready(&ready)?;
            into_conn(self.s)
        }
    }

    /// The requester's side on tokio: the TCP connection, the request not sent yet.
    pub(crate) async fn connect_async(addr: SocketAddr) -> Result<AsyncSoftConnecting> {
        let s = TcpStream::connect(addr).await.map_err(|e| refused(addr, e))?;
        Ok(AsyncSoftConnecting(s))
    }

    /// A requester's TCP connection, the request not sent yet.
    pub(crate) struct AsyncSoftConnecting(TcpStream);

    impl AsyncSoftConnecting {
        /// The connection's ends.
        pub fn origin(&self) -> Result<Origin> {
            Origin::of(self.0.peer_addr(), self.0.local_addr())
        }

        /// Sends the request and reads the reply (of any status).
        pub async fn request(
            self,
            ep: &QpAddress,
            token: &Token,
            data: &[u8],
            max_data: usize,
        ) -> Result<(AsyncSoftReplied, Hello)> {
            write_all(&self.0, &encode(None, ep, token, data)?).await?;
            let hello = read_hello(&self.0, true, max_data).await?;
            Ok((AsyncSoftReplied(self.0), hello))
        }
    }

    /// A requester that has its reply.
    pub(crate) struct AsyncSoftReplied(TcpStream);

    impl AsyncSoftReplied {
        pub async fn ready(self) -> Result<SoftConn> {
            write_all(&self.0, &READY).await?;
            into_conn(self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::ProviderKind;

    /// A flood of silent connections past [`MAX_PENDING`] drops silent ones, not a client
    /// that has begun its request (it has shown it talks; the flood's connections have
    /// not), even when that client is older than all of them.
    #[test]
    #[cfg_attr(miri, ignore = "sockets and threads: Miri has no sockets; the native test run covers it")]
    fn a_flood_of_silent_connections_does_not_evict_a_client_that_has_begun_its_request() {
        let l = SoftListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = l.local_addr().unwrap();
        let ep = QpAddress::new(ProviderKind::Soft, 0, [1; 16], 7, 9);
        let req = encode(None, &ep, &[3; TOKEN_LEN], b"cli").unwrap();
        std::thread::scope(|s| {
            let got = s.spawn(|| l.next_request(Some(Duration::from_secs(20)), 64, Duration::from_secs(30)));
            let mut real = TcpStream::connect(addr).unwrap();
            real.write_all(&req[..4]).unwrap();
            // Accepted and its first bytes read (generous: a loaded or sanitized run).
            std::thread::sleep(Duration::from_secs(1));
            let flood: Vec<TcpStream> =
                (0..MAX_PENDING * 2).map(|_| TcpStream::connect(addr).unwrap()).collect();
            // Accepted too: more than a call keeps, so some were dropped.
            std::thread::sleep(Duration::from_millis(500));
            real.write_all(&req[4..]).unwrap();
            let r = got.join().unwrap().expect("the client that had begun is served");
            assert_eq!(r.hello.private_data, b"cli");
            assert_eq!(r.hello.endpoint, ep);
            drop(flood);
        });
    }

    /// Holders that each sent one byte outrank a newcomer not read yet: a client whose whole
    /// request sat in its socket when a later connection made room was the one dropped, and
    /// a stream of holders and newcomers kept every client out. A newcomer's bytes are read
    /// as it is accepted, so a complete request is served, not ranked.
    #[test]
    #[cfg_attr(miri, ignore = "sockets and threads: Miri has no sockets; the native test run covers it")]
    fn holders_of_one_byte_do_not_evict_a_client_whose_request_has_come() {
        let l = SoftListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = l.local_addr().unwrap();
        let ep = QpAddress::new(ProviderKind::Soft, 0, [1; 16], 7, 9);
        let req = encode(None, &ep, &[3; TOKEN_LEN], b"cli").unwrap();
        // Every slot a call keeps, held by a connection with one byte read.
        let mut holders: Vec<TcpStream> =
            (0..MAX_PENDING).map(|_| TcpStream::connect(addr).unwrap()).collect();
        for h in &mut holders {
            h.write_all(&req[..1]).unwrap();
        }
        let r = l.next_request(Some(Duration::from_millis(500)), 64, Duration::from_secs(30));
        assert!(matches!(r, Err(Error::Timeout(_))), "the holders are taken in, their byte read");
        // The client's whole request, then one more connection, both in the backlog.
        let mut real = TcpStream::connect(addr).unwrap();
        real.write_all(&req).unwrap();
        let _late = TcpStream::connect(addr).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let r = l.next_request(Some(Duration::from_secs(5)), 64, Duration::from_secs(30));
        let r = r.expect("the client whose request came is served");
        assert_eq!(r.hello.private_data, b"cli");
        drop(holders);
    }
}
