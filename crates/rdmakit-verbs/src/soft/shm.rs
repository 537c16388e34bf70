//! The soft NIC between processes of one host: the same frames as over TCP, through two
//! rings in shared memory instead of a socket.
//!
//! Each device that listens on TCP also listens on an abstract Unix socket named after its
//! GID (`socket_name`). A requester QP whose peer is on its host connects there first:
//! - it checks, with `SO_PEERCRED`, that the listener is the process whose pid the GID
//!   names (the GID came with the endpoint it was handed), so a process squatting the name
//!   gets nothing, and falls back to TCP otherwise;
//! - it creates a `memfd` holding two byte rings (requests, responses), sealed against
//!   shrinking and growing, writes its `Hello` into the request ring and passes the memfd
//!   over the socket (`SCM_RIGHTS`);
//! - the device checks the memfd (shared memory, sealed, large enough) before mapping it,
//!   then reads the Hello from the ring and authenticates it exactly as a TCP Hello (both
//!   initial PSNs and the connection token): the socket proves nothing by itself.
//!
//! After that the wire's event loop treats the pair of rings like a socket: frames are
//! copied into a ring from the requester's region (one copy, where TCP makes the kernel
//! copy twice) and parsed on the other side with the same checks, bounds and timeouts as the
//! TCP stream. The Unix socket stays open: one byte on it is a doorbell, and its end is the
//! peer's end, so a dead peer is noticed at once. A doorbell is sent only when the other
//! side asked for one: its loop found the ring empty and does not poll it, or is about to
//! sleep. A loop polls the rings of every connection that had a turn since it last slept
//! (NAPI's way), and on waking those it armed for its sleep: under load their peers post
//! without doorbells, and the loop looks at each ring once per turn (one word of its
//! control page, through a `Probe`) instead of taking a byte from a socket per frame. Everything
//! read from the shared pages is copied into private memory before it is looked at, and
//! the peer's ring counters are checked against the ring size on every use: a hostile peer
//! can garble only its own frames, which are then refused.
//! With the rings the requester passes a ready-flag page, one per pair of processes
//! (`super::flags`): a producer also sets its connection's bit there, and a loop reads the
//! page's set words instead of looking at each ring, and says it sleeps once per page, so
//! that one doorbell wakes it for all of the pair's connections. A ring without a page
//! (or whose bit another connection holds) is polled and armed on its own, as above.
//! Plain writes and reads to regions the responder granted skip the rings altogether: the
//! requester maps the region and places them itself (`super::direct`); the rings carry the
//! grants and everything else.
//! `RDMAKIT_SOFT_SHM=0` turns the path off (TCP only).

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::SocketAddr as UnixAddr;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex, MutexGuard};

use mio::net::UnixStream;

use super::flags::{self, Flag};
use super::qp::{Held, Placement};
use crate::shared_mem::{self, Dst, Src};

/// Environment variable: `0` keeps processes of one host on TCP.
pub const SHM_ENV: &str = "RDMAKIT_SOFT_SHM";

/// Bytes of each ring (one per direction) unless configured otherwise
/// ([`SoftConfig::same_host_ring`](crate::SoftConfig::same_host_ring)).
pub const DEFAULT_RING: usize = 2 * 1024 * 1024;
/// The smallest ring a device accepts.
pub const MIN_RING: usize = 64 * 1024;
/// The largest ring a device accepts (it maps two of them per connection).
pub const MAX_RING: usize = 8 * 1024 * 1024;
/// The control page: each ring's counters and flags, each on its own cache line. The
/// request ring's bytes follow it, then the response ring's; the request ring's head (a
/// little-endian `u64`, bytes written ever) is the control page's first word.
pub const CTRL: usize = 4096;

/// Bytes of the shared mapping (the memfd's size) for rings of `ring` bytes.
pub const fn map_len(ring: usize) -> usize {
    CTRL + 2 * ring
}

/// The ring size a memfd of `len` bytes holds, if it is one a device accepts: a power of
/// two from [`MIN_RING`] to [`MAX_RING`].
fn ring_of(len: u64) -> Option<usize> {
    let ring = usize::try_from(len.checked_sub(CTRL as u64)? / 2).ok()?;
    (map_len(ring) as u64 == len && ring.is_power_of_two() && (MIN_RING..=MAX_RING).contains(&ring))
        .then_some(ring)
}

/// Rings: requests flow requester → device in ring 0, responses device → requester in 1.
const REQUESTS: usize = 0;
const RESPONSES: usize = 1;
// Offsets of a ring's words within the control page.
/// Bytes the producer has written, ever (a wrapping count).
const HEAD: usize = 0;
/// Bytes the consumer has taken, ever.
const TAIL: usize = 64;
/// The consumer found the ring empty and waits for a doorbell.
const CONSUMER_WAITS: usize = 128;
/// The producer found the ring full and waits for a doorbell.
const PRODUCER_WAITS: usize = 192;
const RING_CTRL: usize = 256;
/// The responder QP's gate (after both rings' words): 1 while the device's QP serves this
/// connection, so that the requester may place accesses directly (`super::direct`).
const GATE: usize = 2 * RING_CTRL;
/// The connection's bit in the ready-flag page passed with the rings, plus one (0: none),
/// written by the requester before it passes them (`super::flags`).
const FLAG_BIT: usize = GATE + 64;
/// Descriptors a requester keeps waiting for their grant frames (two per grant, at most
/// two grants asked at once).
const MAX_STASHED: usize = 4;

/// Whether same-host peers use shared memory (unless `RDMAKIT_SOFT_SHM=0`).
pub(crate) fn enabled() -> bool {
    !cfg!(miri) && std::env::var(SHM_ENV).map_or(true, |v| v != "0")
}

/// The abstract socket name of the device with `gid`.
pub fn socket_name(gid: &[u8; 16]) -> String {
    let mut s = String::from("rdmakit-soft-");
    for b in gid {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

fn abstract_addr(gid: &[u8; 16]) -> io::Result<UnixAddr> {
    use std::os::linux::net::SocketAddrExt;
    UnixAddr::from_abstract_name(socket_name(gid).as_bytes())
}

/// Binds the device's same-host listener.
pub(crate) fn bind(gid: &[u8; 16]) -> io::Result<mio::net::UnixListener> {
    let l = std::os::unix::net::UnixListener::bind_addr(&abstract_addr(gid)?)?;
    l.set_nonblocking(true)?;
    Ok(mio::net::UnixListener::from_std(l))
}

/// The shared pages of one connection, unmapped on drop.
pub(crate) struct Map {
    base: NonNull<u8>,
    /// Bytes of each ring.
    ring: usize,
    /// The memfd's identity when this process made it for one of its links (see `OURS`).
    own: Option<(u64, u64)>,
    /// The connection's bit in the ready-flag page of its two processes, if it has one.
    flag: Option<Flag>,
}

// SAFETY: the mapping is plain memory owned by this value; it is only reached through raw
// pointers and atomics, never through references to its bytes. Its ring bytes are written
// only under the producer's lock ([`Tx`]) and read only by the one consumer.
unsafe impl Send for Map {}
// SAFETY: as above; shared references reach the words only as atomics.
unsafe impl Sync for Map {}

impl Map {
    /// Maps `fd`'s first [`map_len`]`(ring)` bytes, shared, read-write.
    fn new(fd: &OwnedFd, ring: usize) -> io::Result<Map> {
        // SAFETY: a fresh mapping chosen by the kernel; nothing else is at that address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len(ring),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Map {
            base: NonNull::new(p.cast()).expect("mmap does not return null on success"),
            ring,
            own: None,
            flag: None,
        })
    }

    /// A counter or flag word of the control page.
    fn word(&self, ring: usize, at: usize) -> &AtomicU64 {
        debug_assert!(ring < 2 && at < RING_CTRL && at.is_multiple_of(64));
        // SAFETY: within the control page, 8-aligned (the mapping is page-aligned); an
        // `AtomicU64` may be changed by others at any time, which is what the peer does.
        unsafe { &*self.base.as_ptr().add(ring * RING_CTRL + at).cast::<AtomicU64>() }
    }

    /// The word of the flag page's bit (see [`FLAG_BIT`]).
    fn flag_bit(&self) -> &AtomicU64 {
        // SAFETY: within the control page, 8-aligned; peers change it only as an atomic.
        unsafe { &*self.base.as_ptr().add(FLAG_BIT).cast::<AtomicU64>() }
    }

    /// The gate word (see [`GATE`]).
    fn gate(&self) -> &AtomicU64 {
        // SAFETY: within the control page, 8-aligned; peers change it only as an atomic.
        unsafe { &*self.base.as_ptr().add(GATE).cast::<AtomicU64>() }
    }

    fn data(&self, ring: usize) -> *mut u8 {
        // SAFETY: ring data lies within the mapping, after the control page.
        unsafe { self.base.as_ptr().add(CTRL + ring * self.ring) }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: mapped by `Map::new` with this length; no reference into it outlives `self`.
        unsafe { libc::munmap(self.base.as_ptr().cast(), map_len(self.ring)) };
        if let Some(id) = self.own {
            forget(id);
        }
    }
}

/// The producing side of a ring: its count of bytes written, and whether the wire's loop
/// holds output that must go before anything posted directly ([`Direct`]).
pub(crate) struct Tx {
    head: u64,
    loop_pending: bool,
}

/// A same-host peer's socket as this process holds it. Dropping it shuts it down both
/// ways and takes, defused ([`defuse`]), every descriptor the peer left queued on it:
/// the kernel releases the descriptors still queued on a socket when its last descriptor
/// closes, in the closing thread (the wire's loop), and one of them may take long to close
/// (a TCP socket with unsent data and a long linger held the loop for the linger time).
/// This covers peers refused before they attach (another user's, one passing no memfd) as
/// well as attached ones.
pub(crate) struct PeerSock(UnixStream);

/// Reads a dropped [`PeerSock`] makes at most, with those of the Unix sockets found in it
/// ([`defuse`]). A peer queues at most its send buffer (`wmem_max`, 208 KiB by default,
/// for a process that is not privileged) on a socket, and each read takes at least one of
/// its messages, of several hundred bytes of buffer each; past this many, the kernel
/// releases what is left as before.
const DRAIN_READS: usize = 1024;

impl From<UnixStream> for PeerSock {
    fn from(s: UnixStream) -> PeerSock {
        PeerSock(s)
    }
}

impl std::ops::Deref for PeerSock {
    type Target = UnixStream;
    fn deref(&self) -> &UnixStream {
        &self.0
    }
}

impl std::ops::DerefMut for PeerSock {
    fn deref_mut(&mut self) -> &mut UnixStream {
        &mut self.0
    }
}

impl Drop for PeerSock {
    fn drop(&mut self) {
        let mut budget = DRAIN_READS;
        empty(self.0.as_raw_fd(), 0, &mut budget);
    }
}

/// Shuts the Unix socket `sock` down both ways and takes what is queued on it, its
/// descriptors defused, in at most `budget` reads (shared with the sockets nested in it,
/// `depth` levels down from the peer's own).
fn empty(sock: RawFd, depth: u32, budget: &mut usize) {
    // SAFETY: shutdown(2) on a descriptor we hold; on one that is not a socket it fails and
    // changes nothing. The peer's sends fail from now on (the kernel checks the shutdown
    // under the lock it queues with), so what is queued is all there will be.
    unsafe { libc::shutdown(sock, libc::SHUT_RDWR) };
    let mut b = [0u8; 4096];
    while *budget > 0 {
        *budget -= 1;
        match recv_nested(sock, &mut b, depth, budget) {
            Ok(got) if got.bytes > 0 => {} // its descriptors were defused, and go here
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // A listening socket (`EINVAL`): the connections in its backlog go with it, and
            // with them what their clients queued on them.
            Err(_) if socket_option(sock, libc::SO_ACCEPTCONN) == Some(1) => {
                // SAFETY: accept4(2) without an address; a descriptor it returns is ours.
                let fd = unsafe {
                    libc::accept4(
                        sock,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                    )
                };
                if fd < 0 {
                    break;
                }
                // SAFETY: a fresh descriptor, owned from here.
                defuse(&unsafe { OwnedFd::from_raw_fd(fd) }, depth, budget);
            }
            _ => break, // the end (shut down and empty), or an error
        }
    }
}

/// One side of a same-host connection: the rings and the doorbell socket.
pub(crate) struct ShmConn {
    sock: PeerSock,
    map: Arc<Map>,
    /// The ring this side writes and the one it reads.
    tx_ring: usize,
    rx: usize,
    /// This side's own counters; the shared copies are for the peer, never read back.
    tx: Arc<Mutex<Tx>>,
    rx_tail: u64,
    /// The socket ended: the peer closed it or died.
    peer_gone: bool,
    /// This side is the requester's (it may receive grants' memfds).
    requester: bool,
    /// Descriptors the peer passed with doorbells, not taken yet (grants' memfds).
    fds: std::collections::VecDeque<OwnedFd>,
    /// The peer passed descriptors it must not have.
    bad_fds: bool,
    /// Descriptors were dropped (see `lose_fds`).
    fds_lost: bool,
    /// The wire's loop looks at this ring on each of its turns until it sleeps, so a read
    /// that finds it empty does not ask the peer for a doorbell (see [`ShmConn::set_polled`]).
    polled: bool,
}

impl Tx {
    /// Marks (or clears) output the loop holds that must go before any direct post.
    pub(crate) fn set_loop_pending(&mut self, pending: bool) {
        self.loop_pending = pending;
    }
}

/// A look at the head of the ring a connection reads, kept apart from the connection: the
/// wire's loop scans the rings it polls through these, one word each, without reaching
/// each connection's state.
pub(crate) struct Probe {
    map: Arc<Map>,
    rx: usize,
    /// The connection's tail when the probe was last brought up to date: never ahead of it.
    seen: u64,
}

impl Probe {
    /// Whether the head moved from the tail last seen: the connection may have input (or a
    /// head out of bounds, which its read reports). The connection's own reads since the
    /// probe was last brought up to date make this true at worst once too often, never
    /// false when there is input.
    pub(crate) fn moved(&self) -> bool {
        self.map.word(self.rx, HEAD).load(Ordering::Acquire) != self.seen
    }
}

/// The device's handle on a connection's gate word: its QP opens it when it starts
/// serving the connection and closes it when it stops (error, destruction).
pub(crate) struct Gate {
    map: Arc<Map>,
}

impl Gate {
    pub(crate) fn open(&self) {
        self.map.gate().store(1, Ordering::Release);
    }

    pub(crate) fn close(&self) {
        self.map.gate().store(0, Ordering::Release);
    }
}

/// A requester QP's way to put a request into its ring itself, without waking the wire's
/// loop, when nothing of the loop's is waiting to go first.
pub(crate) struct Direct {
    map: Arc<Map>,
    tx: Arc<Mutex<Tx>>,
    ring: usize,
    bell: std::os::fd::OwnedFd,
}

impl Direct {
    /// Whether the responder QP still serves this connection (its gate is open).
    pub(crate) fn responder_open(&self) -> bool {
        self.map.gate().load(Ordering::Acquire) == 1
    }

    /// Writes the concatenation of `parts` into the ring as one, if the loop has nothing
    /// waiting and all of it fits now; false otherwise (the caller queues it for the loop).
    ///
    /// # Safety
    /// Each part must be valid for reads of its length, of the kind it says (a region:
    /// `Shared`; the caller's own bytes: `Private`).
    pub(crate) unsafe fn post(&self, parts: &[(Src, usize)]) -> bool {
        let mut tx = self.tx.lock().expect("ring producer");
        if tx.loop_pending {
            return false;
        }
        let total: usize = parts.iter().map(|p| p.1).sum();
        let Ok(free) = free_in(&self.map, self.ring, tx.head) else { return false };
        if total > free {
            return false;
        }
        for &(src, len) in parts {
            // SAFETY: the caller vouches for each part; `len <= free` of what is left.
            unsafe { copy_in(&self.map, self.ring, tx.head, src, len) };
            tx.head = tx.head.wrapping_add(len as u64);
        }
        publish(&self.map, self.ring, tx.head, self.bell.as_raw_fd());
        true
    }
}

/// Free bytes in `ring` for a producer at `head`, the peer's tail checked against the ring.
fn free_in(map: &Map, ring: usize, head: u64) -> io::Result<usize> {
    let tail = map.word(ring, TAIL).load(Ordering::Acquire);
    let used = head.wrapping_sub(tail);
    if used > map.ring as u64 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "peer's ring tail is out of bounds"));
    }
    Ok(map.ring - used as usize)
}

/// Copies `n` bytes from `src` into `ring` at the producer position `head`.
///
/// # Safety
/// `src` must be valid for reads of `n` bytes, of its kind, and `n` at most the ring's free
/// bytes.
unsafe fn copy_in(map: &Map, ring: usize, head: u64, src: Src, n: usize) {
    let size = map.ring;
    let at = (head % size as u64) as usize;
    let first = n.min(size - at);
    let data = map.data(ring);
    // Written as `Shared`, byte-wise atomically: an honest peer does not read free bytes
    // until the head says so, but a hostile one may, or may hand our memfd back to us.
    // SAFETY: the caller vouches for `src`; both ranges stay within the ring (8-aligned,
    // a multiple of 8 long: the padding invariant).
    unsafe {
        shared_mem::copy_across_cores(src, Dst::Shared(data.add(at)), first);
        shared_mem::copy_across_cores(src.add(first), Dst::Shared(data), n - first);
    }
}

/// Publishes `head` to the consumer, ringing `bell` if it said it waits: in the flag page
/// (its loop sleeps), or in the ring's own word (it does not poll this ring).
fn publish(map: &Map, ring: usize, head: u64, bell: RawFd) {
    map.word(ring, HEAD).store(head, Ordering::Release);
    fence(Ordering::SeqCst);
    let rang = map.flag.as_ref().is_some_and(|f| f.raise(ring, bell));
    let waits = map.word(ring, CONSUMER_WAITS);
    if waits.load(Ordering::Relaxed) != 0 && waits.swap(0, Ordering::SeqCst) != 0 && !rang {
        ring_bell(bell);
    }
}

/// Rings a doorbell. A full socket already holds doorbells the peer has not taken, so it
/// will look anyway; a closed one is noticed by the loop as its end.
pub(crate) fn ring_bell(sock: RawFd) {
    let b = 1u8;
    // SAFETY: one byte from a local; MSG_DONTWAIT: never blocks; MSG_NOSIGNAL: a closed
    // peer is an error, not SIGPIPE.
    unsafe {
        libc::send(sock, (&raw const b).cast(), 1, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL);
    }
}

impl ShmConn {
    /// The device's side of an accepted connection whose rings are `map`.
    pub(crate) fn served(sock: PeerSock, map: Map) -> ShmConn {
        ShmConn::new(sock, map, false)
    }

    fn new(sock: PeerSock, map: Map, requester: bool) -> ShmConn {
        let (tx_ring, rx) = if requester { (REQUESTS, RESPONSES) } else { (RESPONSES, REQUESTS) };
        let tx = Arc::new(Mutex::new(Tx { head: 0, loop_pending: false }));
        ShmConn {
            sock,
            map: Arc::new(map),
            tx_ring,
            rx,
            tx,
            rx_tail: 0,
            peer_gone: false,
            requester,
            fds: Default::default(),
            bad_fds: false,
            fds_lost: false,
            polled: false,
        }
    }

    /// Shuts the doorbell socket down both ways: the peer sees the end now, whoever else
    /// holds a descriptor of it.
    pub(crate) fn shutdown(&mut self) {
        // SAFETY: shutdown(2) on a descriptor we own.
        unsafe { libc::shutdown(self.sock.as_raw_fd(), libc::SHUT_RDWR) };
        self.peer_gone = true;
    }

    /// A handle for posting into this side's ring from another thread.
    pub(crate) fn direct(&self) -> io::Result<Direct> {
        // SAFETY: dup of a descriptor we own; the copy is owned right after.
        let fd = unsafe { libc::fcntl(self.sock.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor, now owned.
        let bell = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Direct { map: self.map.clone(), tx: self.tx.clone(), ring: self.tx_ring, bell })
    }

    /// The producer's lock, for the loop to mark (or clear) output of its own that must go
    /// before anything posted directly.
    pub(crate) fn producer(&self) -> MutexGuard<'_, Tx> {
        self.tx.lock().expect("ring producer")
    }

    pub(crate) fn sock(&mut self) -> &mut UnixStream {
        &mut self.sock
    }

    /// Copies what the peer produced into `buf`. `WouldBlock` when the ring is empty (the
    /// peer is then asked to ring); `Ok(0)` once it is empty and the peer gone.
    pub(crate) fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.bad_fds {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "same-host peer passed descriptors unasked",
            ));
        }
        if buf.is_empty() {
            return Ok(0);
        }
        let avail = self.ready()?;
        if avail == 0 {
            return Ok(0);
        }
        let n = avail.min(buf.len());
        let ring = self.map.ring;
        let at = (self.rx_tail % ring as u64) as usize;
        let first = n.min(ring - at);
        let data = self.map.data(self.rx);
        // The ring bytes are the peer's, copied byte-wise atomically into private memory
        // before anything looks at them: a peer writing them meanwhile garbles its own frames.
        // SAFETY: `at + first` and `n - first` are at most the ring's size: in the ring;
        // `buf` is private memory of at least `n` bytes.
        unsafe {
            let out = buf.as_mut_ptr();
            shared_mem::copy_across_cores(Src::Shared(data.add(at)), Dst::Private(out), first);
            shared_mem::copy_across_cores(Src::Shared(data), Dst::Private(out.add(first)), n - first);
        }
        self.consumed(n);
        Ok(n)
    }

    /// Moves up to `max` bytes the peer produced straight into `p` at offset `at` (a
    /// write's data landing in its target region): the same as [`read`](Self::read), with
    /// no private buffer between the ring and the region.
    ///
    /// # Safety
    /// `at + max` must not exceed `p.len()`, and `held` must come from `p`'s `hold`.
    pub(crate) unsafe fn read_placed(
        &mut self,
        p: &Placement,
        held: &Held,
        at: usize,
        max: usize,
    ) -> io::Result<usize> {
        if max == 0 {
            return Ok(0);
        }
        let avail = self.ready()?;
        if avail == 0 {
            return Ok(0);
        }
        let n = avail.min(max);
        let ring = self.map.ring;
        let from = (self.rx_tail % ring as u64) as usize;
        let first = n.min(ring - from);
        let data = self.map.data(self.rx);
        // SAFETY: both ring ranges stay in the ring (as in `read`); the caller keeps
        // `at + n <= p.len()` and gives `p`'s own leave. The peer's bytes land as opaque
        // bytes, torn at worst.
        unsafe {
            p.land_from(held, at, Src::Shared(data.add(from)), first);
            p.land_from(held, at + first, Src::Shared(data), n - first);
        }
        self.consumed(n);
        Ok(n)
    }

    /// Hands `n` taken bytes back to the producer (and wakes it if it waits for room).
    fn consumed(&mut self, n: usize) {
        self.rx_tail = self.rx_tail.wrapping_add(n as u64);
        self.map.word(self.rx, TAIL).store(self.rx_tail, Ordering::Release);
        fence(Ordering::SeqCst);
        if self.map.word(self.rx, PRODUCER_WAITS).swap(0, Ordering::SeqCst) != 0 {
            ring_bell(self.sock.as_raw_fd());
        }
    }

    /// Bytes ready to take. When there are none, asks the peer to ring (unless the loop
    /// polls this ring) and looks once more: `WouldBlock` if still none, `Ok(0)` if none
    /// will come (the peer is gone).
    fn ready(&self) -> io::Result<usize> {
        let avail = self.available()?;
        if avail > 0 {
            return Ok(avail);
        }
        if self.polled {
            return if self.peer_gone { Ok(0) } else { Err(io::ErrorKind::WouldBlock.into()) };
        }
        self.ask_for_doorbell();
        match self.available()? {
            0 if self.peer_gone => Ok(0),
            0 => Err(io::ErrorKind::WouldBlock.into()),
            n => Ok(n),
        }
    }

    /// Bytes the peer produced that this side has not taken, checked against the ring.
    fn available(&self) -> io::Result<usize> {
        let head = self.map.word(self.rx, HEAD).load(Ordering::Acquire);
        let avail = head.wrapping_sub(self.rx_tail);
        if avail > self.map.ring as u64 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "peer's ring head is out of bounds"));
        }
        Ok(avail as usize)
    }

    /// Whether the loop polls this ring (NAPI's way): while it does, the peer posts into
    /// it without a doorbell, as the loop will look anyway. Under load that saves a
    /// doorbell's two system calls and a poll event per frame; the loop asks for doorbells
    /// again ([`arm`](Self::arm)) before it sleeps.
    pub(crate) fn set_polled(&mut self, polled: bool) {
        self.polled = polled;
    }

    pub(crate) fn is_polled(&self) -> bool {
        self.polled
    }

    /// This connection's bit in the ready-flag page of its two processes, if it has one.
    pub(crate) fn flag(&self) -> Option<&Flag> {
        self.map.flag.as_ref()
    }

    /// The ring this side reads (`0`: requests, `1`: responses), as the flag page names it.
    pub(crate) fn rx_ring(&self) -> usize {
        self.rx
    }

    /// A probe of the ring this side reads ([`Probe`]).
    pub(crate) fn probe(&self) -> Probe {
        Probe { map: self.map.clone(), rx: self.rx, seen: self.rx_tail }
    }

    /// Whether `p` probes this connection's ring; if so, brings it up to date.
    pub(crate) fn sync_probe(&self, p: &mut Probe) -> bool {
        // Each connection maps its rings once: the mapping tells them apart.
        let ours = Arc::ptr_eq(&self.map, &p.map);
        if ours {
            p.seen = self.rx_tail;
        }
        ours
    }

    /// Whether there is input to take (or a ring error to report, which a read then does).
    pub(crate) fn has_input(&self) -> bool {
        self.available().map_or(true, |n| n > 0)
    }

    /// Asks the peer to ring for its next frame, then looks once more: whether input came
    /// meanwhile (the peer may have published without ringing just before).
    pub(crate) fn arm(&self) -> bool {
        self.ask_for_doorbell();
        self.has_input()
    }

    /// Tells the peer this side waits (it rings after its next publish); the fence pairs
    /// with the peer's between publishing and looking, so one of the two sees the other.
    fn ask_for_doorbell(&self) {
        self.map.word(self.rx, CONSUMER_WAITS).store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Takes back an [`arm`](Self::arm): the loop stays awake after all. A peer that
    /// already saw the request rings anyway, which only costs a spurious wake-up.
    pub(crate) fn disarm(&self) {
        self.map.word(self.rx, CONSUMER_WAITS).store(0, Ordering::SeqCst);
    }

    /// Copies `buf` (or what fits) into the ring.
    pub(crate) fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for reads of its length.
        unsafe { self.write_raw(Src::Private(buf.as_ptr()), buf.len()) }
    }

    /// Copies `len` bytes at `src` (or what fits) into the ring. `WouldBlock` when it is
    /// full (the peer is then asked to ring once it takes some).
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes; they are read as opaque bytes.
    pub(crate) unsafe fn write_raw(&mut self, src: Src, len: usize) -> io::Result<usize> {
        if self.peer_gone {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        if len == 0 {
            return Ok(0);
        }
        let mut tx = self.tx.lock().expect("ring producer");
        let mut free = free_in(&self.map, self.tx_ring, tx.head)?;
        if free == 0 {
            self.map.word(self.tx_ring, PRODUCER_WAITS).store(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            free = free_in(&self.map, self.tx_ring, tx.head)?;
            if free == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
        }
        let n = free.min(len);
        // SAFETY: the caller vouches for `src`; `n` is at most the free bytes.
        unsafe { copy_in(&self.map, self.tx_ring, tx.head, src, n) };
        tx.head = tx.head.wrapping_add(n as u64);
        publish(&self.map, self.tx_ring, tx.head, self.sock.as_raw_fd());
        Ok(n)
    }

    /// Takes doorbells after a readiness event (`hup`: the event said the peer's end).
    /// One bounded read per event, never a loop until empty: a peer writing to its socket as
    /// fast as it can must not hold the wire's loop here. Doorbells are only hints (each new
    /// byte is a new edge), so bytes left behind lose nothing.
    pub(crate) fn take_doorbells(&mut self, hup: bool) {
        let mut b = [0u8; 4096];
        let failed = match recv_with_fds(self.sock.as_raw_fd(), &mut b) {
            Ok(got) => {
                self.stash(got.fds, got.truncated);
                got.bytes == 0
            }
            Err(e) => !matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted),
        };
        if hup || failed {
            self.peer_gone = true;
        }
    }

    /// Keeps descriptors that came with doorbells for [`take_fd`](Self::take_fd), on a
    /// requester's side only: a device's requester never sends one after its rings, and
    /// doing so ends its connection. On a requester's side a batch that does not fit
    /// ([`MAX_STASHED`]: an honest responder sends at most two grants' at once) or came
    /// truncated (this process is out of descriptors) is closed whole: the grants it was
    /// for find no files and are not taken (the keys stay on the ring).
    fn stash(&mut self, fds: Vec<OwnedFd>, truncated: bool) {
        if fds.is_empty() && !truncated {
            return;
        }
        if !self.requester {
            self.bad_fds = true;
            return;
        }
        if self.fds_lost || truncated || self.fds.len() + fds.len() > MAX_STASHED {
            tracing::debug!(fds = fds.len(), truncated, "soft NIC: descriptors from a responder dropped");
            self.lose_fds();
            return;
        }
        self.fds.extend(fds);
    }

    /// Descriptors were dropped: the pairing of those to come with their frames (by order
    /// alone) is lost, so none is taken any more (the link's later grants are not taken).
    fn lose_fds(&mut self) {
        self.fds_lost = true;
        self.fds.clear();
    }

    /// The next descriptor the peer passed (a grant's memfd, sent just before its frame):
    /// from the stash, or read from the socket now (its bytes are doorbells, taken as
    /// such). `None` if it has not come, or the peer passed what it must not.
    pub(crate) fn take_fd(&mut self) -> Option<OwnedFd> {
        for _ in 0..16 {
            if self.bad_fds || self.fds_lost {
                return None;
            }
            if let Some(fd) = self.fds.pop_front() {
                return Some(fd);
            }
            let mut b = [0u8; 256];
            match recv_with_fds(self.sock.as_raw_fd(), &mut b) {
                Ok(got) if got.bytes > 0 => self.stash(got.fds, got.truncated),
                Ok(_) => {
                    self.peer_gone = true;
                    return None;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        // Not there when it must be (it was sent before its frame): out of step for good.
        self.lose_fds();
        None
    }

    /// Sends a grant's memfd and this process's status file to the peer with one doorbell
    /// byte, before the grant's frame.
    pub(crate) fn pass_grant(&self, region: &OwnedFd, status: &OwnedFd) -> io::Result<()> {
        send_fds(self.sock.as_raw_fd(), &[region.as_raw_fd(), status.as_raw_fd()])
    }

    /// The responder QP's gate in this connection's control page (device side).
    pub(crate) fn gate(&self) -> Gate {
        Gate { map: self.map.clone() }
    }
}

/// Takes the memfd a same-host requester passes with its first byte on `sock` (accepted by
/// a device), checks it and maps it, with the ready-flag page that may come with it (see
/// [`flags`]). `WouldBlock`: not here yet. Any other error: the connection is to be dropped.
pub(crate) fn accept_rings(sock: &UnixStream, max_ring: usize) -> io::Result<Map> {
    let mut fds = recv_fds(sock)?.into_iter();
    let fd = fds.next().expect("at least one descriptor");
    let ring = check_memfd(&fd, max_ring)?;
    // The descriptor itself is not needed once mapped.
    let mut map = Map::new(&fd, ring)?;
    if let Some(page) = fds.next() {
        // The requester wrote its bit before passing the rings; copied once, checked.
        let bit = map.flag_bit().load(Ordering::Acquire);
        let bit = bit.checked_sub(1).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidData, "same-host peer passed a flag page but no bit")
        })?;
        map.flag = Some(flags::accept(page, bit)?);
    }
    Ok(map)
}

/// Receives one byte carrying the rings' memfd and, optionally, a flag page's.
fn recv_fds(sock: &UnixStream) -> io::Result<Vec<OwnedFd>> {
    let mut byte = [0u8; 1];
    let got = recv_with_fds(sock.as_raw_fd(), &mut byte)?;
    if got.bytes == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "same-host peer closed before its memfd"));
    }
    if got.truncated || !matches!(got.fds.len(), 1 | 2) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("same-host peer passed {} descriptors, not one memfd (and a flag page)", got.fds.len()),
        ));
    }
    Ok(got.fds)
}

/// What one `recvmsg` gave: bytes, the descriptors that came with them (now ours), and
/// whether some of them are not among those: dropped for want of room (`MSG_CTRUNC`), or
/// files of a FUSE mount, which go to be closed elsewhere ([`close_elsewhere`]). Either way
/// the message's descriptors are not what the peer should have sent.
struct Received {
    bytes: usize,
    fds: Vec<OwnedFd>,
    truncated: bool,
}

/// One non-blocking `recvmsg` into `buf`, with room for every descriptor one message can
/// carry (`SCM_MAX_FD`, 253: the kernel never closes extras on this thread; `truncated` is
/// kept for a kernel with a larger limit). A Unix stream socket never returns the
/// descriptors of two sends in one call.
///
/// Every descriptor received is defused ([`defuse`]) before anything else: whoever drops
/// one the peer should not have passed (this is the wire's loop, mostly) must not wait in
/// its `close`.
fn recv_with_fds(sock: RawFd, buf: &mut [u8]) -> io::Result<Received> {
    let mut budget = DRAIN_READS;
    recv_nested(sock, buf, 0, &mut budget)
}

/// [`recv_with_fds`] on a socket `depth` levels down from a peer's own; Unix sockets among
/// the descriptors are emptied within `budget` reads.
fn recv_nested(sock: RawFd, buf: &mut [u8], depth: u32, budget: &mut usize) -> io::Result<Received> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // A header (16 bytes) and 253 descriptors (1012 bytes), rounded up to words.
    const CBUF_WORDS: usize = 130;
    let mut cbuf = [0u64; CBUF_WORDS];
    // SAFETY: zeroed `msghdr` is a valid empty header; its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = size_of::<[u64; CBUF_WORDS]>() as _;
    // SAFETY: `msg` points at live locals and `buf` of the lengths it states;
    // MSG_CMSG_CLOEXEC: no descriptor leaks into children; MSG_DONTWAIT: never blocks.
    let n = unsafe { libc::recvmsg(sock, &raw mut msg, libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut withheld = false;
    // SAFETY: walks the control messages the kernel wrote into `cbuf`, within
    // `msg_controllen`; each SCM_RIGHTS payload is an array of descriptors now ours.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&raw const msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / size_of::<RawFd>();
                for k in 0..count {
                    let fd = OwnedFd::from_raw_fd(data.add(k).read_unaligned());
                    if is_fuse(&fd) {
                        close_elsewhere(fd);
                        withheld = true;
                        continue;
                    }
                    defuse(&fd, depth, budget);
                    fds.push(fd);
                }
            }
            c = libc::CMSG_NXTHDR(&raw const msg, c);
        }
    }
    Ok(Received { bytes: n as usize, fds, truncated: withheld || msg.msg_flags & libc::MSG_CTRUNC != 0 })
}

/// `statfs.f_type` of a FUSE mount.
const FUSE_SUPER_MAGIC: u64 = 0x6573_5546;

/// Whether `fd` is a file of a FUSE mount (whose daemon answers for its `close`).
fn is_fuse(fd: &OwnedFd) -> bool {
    // SAFETY: fstatfs into a zeroed local of the right type.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is ours; `st` is a live local.
    let ok = unsafe { libc::fstatfs(fd.as_raw_fd(), &raw mut st) } == 0;
    ok && st.f_type as u64 == FUSE_SUPER_MAGIC
}

/// Files of a FUSE mount a peer passed queue for this thread to close, at most this many.
const CLOSE_QUEUE: usize = 1024;

/// Closes `fd` on a thread of its own (one for the process), not this one. `close(2)` of
/// a FUSE file asks the mount's daemon to flush it and waits for the answer: a peer that
/// serves the mount itself (any user may mount one) never answers, and whoever closes
/// waits with it, the wire's loop otherwise. (The kernel releasing a file it holds in
/// flight does not flush; a descriptor received does.) With [`CLOSE_QUEUE`] files waiting
/// already, or no thread to be had, it is closed here after all.
fn close_elsewhere(fd: OwnedFd) {
    static CLOSER: std::sync::OnceLock<Option<std::sync::mpsc::SyncSender<OwnedFd>>> =
        std::sync::OnceLock::new();
    let tx = CLOSER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<OwnedFd>(CLOSE_QUEUE);
        let spawned = std::thread::Builder::new().name("rdmakit-fd-close".into()).spawn(move || {
            for fd in rx {
                drop(fd);
            }
        });
        spawned.ok().map(|_| tx)
    });
    match tx {
        Some(tx) => {
            if let Err(e) = tx.try_send(fd) {
                crate::warn_limited!(
                    "soft NIC: FUSE files from same-host peers wait to be closed; closing one here"
                );
                drop(e); // it holds the descriptor: closed here
            }
        }
        None => drop(fd),
    }
}

/// Makes closing `fd` quick if it is a socket: a peer can pass a TCP socket with unsent
/// data and a long `SO_LINGER` (up to `INT_MAX` seconds), whose last `close` waits that long
/// (measured: 21.7 s for a linger of 20 s, on the thread that refused it). Lingering 0 s
/// makes that close abortive. Anything else (`ENOTSOCK`, the memfds expected) is left
/// alone. (A file of a FUSE mount never gets here: [`recv_nested`] hands it to
/// [`close_elsewhere`].)
///
/// A Unix socket is emptied the same way ([`empty`]): descriptors queued on it would be
/// released by whoever closes it last, and may linger in turn. Nesting is followed
/// [`NEST_MAX`] levels down, within the reads a dropped peer socket makes
/// ([`DRAIN_READS`]).
fn defuse(fd: &OwnedFd, depth: u32, budget: &mut usize) {
    if set_linger(fd.as_raw_fd(), 0).is_err() {
        return; // ENOTSOCK: nothing to defuse
    }
    if depth < NEST_MAX && socket_option(fd.as_raw_fd(), libc::SO_DOMAIN) == Some(libc::AF_UNIX) {
        empty(fd.as_raw_fd(), depth + 1, budget);
    }
}

/// Levels of Unix sockets passed inside Unix sockets that [`defuse`] empties.
const NEST_MAX: u32 = 4;

/// An integer option of socket `fd` at `SOL_SOCKET` (`SO_DOMAIN`: its address family;
/// `SO_ACCEPTCONN`: 1 if it listens).
fn socket_option(fd: RawFd, option: libc::c_int) -> Option<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt into a live `c_int` of the size given.
    let rc = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, option, (&raw mut value).cast(), &raw mut len) };
    (rc == 0).then_some(value)
}

/// `SO_LINGER` on, for `secs` seconds, on socket `fd`.
fn set_linger(fd: RawFd, secs: i32) -> io::Result<()> {
    let linger = libc::linger { l_onoff: 1, l_linger: secs };
    // SAFETY: setsockopt with a `linger` of the size given; on a descriptor that is not a
    // socket (or not open) it fails and changes nothing.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Accepts only shared memory sealed against shrinking (so the mapping can never fault
/// with SIGBUS) whose size holds two rings of a size a device accepts; returns that size.
fn check_memfd(fd: &OwnedFd, max_ring: usize) -> io::Result<usize> {
    // SAFETY: fcntl on a descriptor we own; F_GET_SEALS fails on anything but shared memory.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "same-host peer's descriptor is not a memfd"));
    }
    if seals & libc::F_SEAL_SHRINK == 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "same-host peer's memfd may shrink"));
    }
    // Shared memory of tmpfs only: a sealed hugetlbfs file faults (SIGBUS) when its pool
    // runs dry.
    // SAFETY: zeroed `statfs` is valid; fstatfs writes into it.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `fs` is a live local of the right type; `fd` is ours.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &raw mut fs) } != 0 || fs.f_type != libc::TMPFS_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "same-host peer's memfd is not in shared memory",
        ));
    }
    // SAFETY: fstat into a zeroed local.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a live local of the right type.
    if unsafe { libc::fstat(fd.as_raw_fd(), &raw mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if super::direct::is_any_of_ours(file_id(&st)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "same-host peer passed back one of our own memfds",
        ));
    }
    let ring = ((st.st_mode & libc::S_IFMT) == libc::S_IFREG)
        .then(|| ring_of(st.st_size as u64))
        .flatten()
        .filter(|&r| r <= max_ring);
    ring.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "same-host peer's memfd has a bad size ({} bytes) for two rings of at most {max_ring}",
                st.st_size
            ),
        )
    })
}

/// The memfds this process made for its own links, by (device, inode): a peer handing one
/// back must not get this process to map its own rings a second time.
static OURS: std::sync::Mutex<Vec<(u64, u64)>> = std::sync::Mutex::new(Vec::new());

fn file_id(st: &libc::stat) -> (u64, u64) {
    (st.st_dev, st.st_ino)
}

/// Whether the file with identity `id` (device, inode) is one of this process's rings.
pub(crate) fn is_ours(id: (u64, u64)) -> bool {
    OURS.lock().expect("memfd registry").contains(&id)
}

/// Forgets a memfd of ours once its mapping is gone.
fn forget(id: (u64, u64)) {
    OURS.lock().expect("memfd registry").retain(|&o| o != id);
}

/// Creates a sealed memfd for one connection's rings of `ring` bytes each.
pub fn ring_memfd(ring: usize) -> io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated name; the flags are valid.
    let fd = unsafe {
        libc::memfd_create(c"rdmakit-soft-rings".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor, now owned.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain calls on a descriptor we own.
    unsafe {
        if libc::ftruncate(fd.as_raw_fd(), map_len(ring) as libc::off_t) != 0 {
            return Err(io::Error::last_os_error());
        }
        if libc::fcntl(
            fd.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        ) != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(fd)
}

/// Sends one byte carrying `fd`.
pub fn send_fd(sock: RawFd, fd: &OwnedFd) -> io::Result<()> {
    send_fds(sock, &[fd.as_raw_fd()])
}

/// Sends one byte carrying `fds` (one or two descriptors).
fn send_fds(sock: RawFd, fds: &[RawFd]) -> io::Result<()> {
    assert!(matches!(fds.len(), 1 | 2), "one or two descriptors per doorbell");
    let byte = 0u8;
    let mut iov = libc::iovec { iov_base: (&raw const byte).cast_mut().cast(), iov_len: 1 };
    let mut cbuf = [0u64; 4];
    let bytes = std::mem::size_of_val(fds) as u32;
    // SAFETY: zeroed `msghdr` is a valid empty header; its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is a pure size computation.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(bytes) } as _;
    // SAFETY: `cbuf` (32 bytes) holds one header (16) and two descriptors (8); `msg` points
    // at live locals; the descriptors are only copied into the message.
    let n = unsafe {
        let c = libc::CMSG_FIRSTHDR(&raw const msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(bytes) as _;
        let data = libc::CMSG_DATA(c).cast::<RawFd>();
        for (k, fd) in fds.iter().enumerate() {
            data.add(k).write_unaligned(*fd);
        }
        libc::sendmsg(sock, &raw const msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
    };
    if n != 1 {
        return Err(if n < 0 { io::Error::last_os_error() } else { io::ErrorKind::WriteZero.into() });
    }
    Ok(())
}

/// The pid of the process at the other end of `sock`, an accepted same-host connection,
/// if it runs as this process's user; `PermissionDenied` if it runs as another.
///
/// A device gives same-host requesters its regions' files ([`super::direct`]), which a
/// process of another user could reopen beyond what was granted (a memfd's inode is mode
/// 0777), and its abstract socket has no permission check of its own. An honest requester
/// of another user never attaches (it checks the listener the same way, in [`connect`],
/// and uses TCP), so refusing one costs nothing.
pub(crate) fn peer_pid_of_this_user(sock: RawFd) -> io::Result<u32> {
    let (pid, uid) = peer_cred(sock)?;
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    if uid != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("same-host requester pid {pid} runs as user {uid}, not {me}"),
        ));
    }
    Ok(pid)
}

/// The pid and user of the process at the other end of `sock`.
fn peer_cred(sock: RawFd) -> io::Result<(u32, u32)> {
    // SAFETY: zeroed `ucred` is valid; getsockopt writes at most `len` bytes into it.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: as above.
    let r = unsafe {
        libc::getsockopt(sock, libc::SOL_SOCKET, libc::SO_PEERCRED, (&raw mut cred).cast(), &raw mut len)
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.pid as u32, cred.uid))
}

/// Connects a requester to the device with `gid` on this host, introducing itself with
/// the encoded `hello`. `None` (TCP is used) when the path is off, the device has no
/// same-host listener here, or the listener is not the process the GID names.
pub(crate) fn connect(gid: &[u8; 16], hello: &[u8], ring: usize) -> Option<ShmConn> {
    if !enabled() {
        return None;
    }
    // The rings are ready before connecting, so the memfd follows the connection at once
    // (a device counts connections whose Hello is late).
    let rings = ring_memfd(ring).and_then(|fd| {
        let mut map = Map::new(&fd, ring)?;
        // SAFETY: fstat into a zeroed local.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a live local of the right type; `fd` is ours.
        if unsafe { libc::fstat(fd.as_raw_fd(), &raw mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let id = file_id(&st);
        OURS.lock().expect("memfd registry").push(id);
        map.own = Some(id);
        Ok((fd, map))
    });
    let (fd, map) = match rings {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(error = %e, "soft NIC: no memfd for same-host rings; using TCP");
            return None;
        }
    };
    let addr = abstract_addr(gid).ok()?;
    // Non-blocking: a full backlog is an error here (then TCP), not a wait.
    let sock = PeerSock::from(UnixStream::connect_addr(&addr).ok()?);
    let owner = u32::from_be_bytes([gid[8], gid[9], gid[10], gid[11]]);
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    match peer_cred(sock.as_raw_fd()) {
        // Our user only: a listener of another user could be a squatter whose pid matches
        // a device of another pid namespace (a container); one of ours could already read
        // our memory.
        Ok((pid, uid)) if pid == owner && uid == me => {}
        Ok((pid, uid)) if pid == owner => {
            tracing::debug!(uid, "soft NIC: the same-host listener is another user's; using TCP");
            return None;
        }
        Ok((pid, _)) => {
            tracing::warn!(
                pid,
                expected = owner,
                "soft NIC: a same-host listener is not the device's process; using TCP"
            );
            return None;
        }
        Err(e) => {
            tracing::debug!(error = %e, "soft NIC: no peer credentials; using TCP");
            return None;
        }
    }
    let mut conn = ShmConn::new(sock, map, true);
    let attach = |conn: &mut ShmConn| -> io::Result<()> {
        // The ring is empty: the Hello fits whole.
        if conn.write(hello)? != hello.len() {
            return Err(io::ErrorKind::WriteZero.into());
        }
        // A bit in the flag page of this pair of processes, written where the device reads
        // it. Only now: raised for the Hello, it could ring (the device's loop sleeping on
        // the page), and a doorbell before the descriptors would be taken for them.
        let map = Arc::get_mut(&mut conn.map).expect("a new connection's rings are not shared yet");
        let page = flags::for_peer(owner).map(|(flag, page_fd)| {
            map.flag_bit().store(u64::from(flag.bit()) + 1, Ordering::Release);
            map.flag = Some(flag);
            page_fd
        });
        match page {
            Some(p) => send_fds(conn.sock.as_raw_fd(), &[fd.as_raw_fd(), p]),
            None => send_fd(conn.sock.as_raw_fd(), &fd),
        }
    };
    match attach(&mut conn) {
        Ok(()) => Some(conn),
        Err(e) => {
            tracing::debug!(error = %e, "soft NIC: same-host attach failed; using TCP");
            None
        }
    }
}

/// A connected pair of same-host ends over rings of [`MIN_RING`] bytes: the requester's
/// (it writes requests, reads responses) and the device's.
#[cfg(all(test, not(miri)))]
pub(crate) fn test_pair() -> (ShmConn, ShmConn) {
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    b.set_nonblocking(true).unwrap();
    let fd = ring_memfd(MIN_RING).unwrap();
    let req = ShmConn::new(UnixStream::from_std(a).into(), Map::new(&fd, MIN_RING).unwrap(), true);
    let b = PeerSock::from(UnixStream::from_std(b));
    send_fd(req.sock.as_raw_fd(), &fd).unwrap();
    let map = accept_rings(&b, MAX_RING).unwrap();
    let resp = ShmConn::served(b, map);
    (req, resp)
}

/// As [`test_pair`], with both ends' rings flagged in one page made for the device process
/// `pid` (a pid no device of the test has: the page is the test's own), at the bit given
/// out next.
#[cfg(all(test, not(miri)))]
pub(crate) fn test_pair_flagged(pid: u32) -> (ShmConn, ShmConn) {
    let (mut req, mut resp) = test_pair();
    let (flag, _) = flags::for_peer(pid).expect("a flag page");
    Arc::get_mut(&mut resp.map).expect("unshared").flag = Some(flag.twin());
    Arc::get_mut(&mut req.map).expect("unshared").flag = Some(flag);
    (req, resp)
}

#[cfg(all(test, not(miri)))]
impl ShmConn {
    /// Flags this end's rings (before the connection is shared).
    pub(crate) fn set_flag_for_test(&mut self, flag: Flag) {
        Arc::get_mut(&mut self.map).expect("unshared").flag = Some(flag);
    }

    /// Sets this end's bit in its flag page with nothing published behind it, as a hostile
    /// peer may (ringing the consumer if it said it sleeps, as a publish would).
    pub(crate) fn raise_flag_without_input(&self) {
        self.flag().expect("a flagged connection").raise(1 - self.rx, self.sock.as_raw_fd());
    }

    /// Doorbell bytes waiting on this side's socket (not taken); -1 for none.
    pub(crate) fn bells_waiting(&self) -> isize {
        let mut peek = [0u8; 16];
        // SAFETY: reads into a local buffer, leaving the bytes in the socket.
        unsafe {
            libc::recv(
                self.sock.as_raw_fd(),
                peek.as_mut_ptr().cast(),
                16,
                libc::MSG_DONTWAIT | libc::MSG_PEEK,
            )
        }
    }
}

#[cfg(test)]
// Miri has no memfd, mmap or Unix sockets: these run natively only.
#[cfg(not(miri))]
mod tests {
    use super::*;

    /// A region file of this process that a peer holds through a write grant, handed back
    /// as its rings or its flag page, is refused: the device would use its own registered
    /// memory as the peer's.
    #[test]
    fn a_region_file_of_ours_is_refused_as_rings_or_flag_page() {
        use crate::AccessFlags;
        use crate::soft::direct::RegionFile;
        let Some(rings) = RegionFile::create(map_len(MIN_RING), true) else {
            panic!("no region file: the status file could not be made");
        };
        let fd = rings.fd_for(AccessFlags::REMOTE_WRITE).unwrap();
        let e = check_memfd(&fd, MAX_RING).expect_err("our region as rings");
        assert!(e.to_string().contains("our own"), "{e}");
        let page = RegionFile::create(super::super::flags::PAGE, true).unwrap();
        let fd = page.fd_for(AccessFlags::REMOTE_WRITE).unwrap();
        let e = super::super::flags::accept(fd, 0).err().expect("our region as a flag page");
        assert!(e.to_string().contains("own"), "{e}");
    }

    /// A descriptor the peer passes that is not a memfd is closed by the thread that took it
    /// in: the wire's loop, which serves every connection. A TCP socket with unsent data and
    /// a long `SO_LINGER` made that close wait for the linger time (up to `INT_MAX`
    /// seconds): one hostile same-host peer froze the loop. The refused descriptor is now
    /// closed at once.
    /// A TCP socket whose `close` waits `secs` seconds: `SO_LINGER` on, with unsent data
    /// (its send buffer and the peer's receive buffer full), and the peer's end, which must
    /// stay open (it never reads) for the close to wait.
    fn lingering_socket(secs: i32) -> (std::net::TcpStream, std::net::TcpStream) {
        use std::io::Write;
        use std::net::{TcpListener, TcpStream};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        set_linger(client.as_raw_fd(), secs).unwrap();
        client.set_nonblocking(true).unwrap();
        let chunk = vec![0u8; 64 << 10];
        while client.write(&chunk).is_ok() {}
        (client, server)
    }

    /// Drops a peer's socket, and checks that took far less than `linger` seconds.
    fn dropped_quickly(sock: PeerSock, linger: i32) {
        let started = std::time::Instant::now();
        drop(sock);
        let took = started.elapsed();
        assert!(
            took < std::time::Duration::from_secs(linger as u64 / 4),
            "dropping the connection took {took:?} (the linger time is {linger} s)"
        );
    }

    #[test]
    fn a_lingering_socket_passed_as_rings_does_not_hold_the_loop() {
        const LINGER_S: i32 = 20;
        let (client, _server) = lingering_socket(LINGER_S);
        let (ours, theirs) = UnixStream::pair().unwrap();
        send_fds(theirs.as_raw_fd(), &[client.as_raw_fd()]).unwrap();
        drop(client); // the passed copy is now the socket's last descriptor
        let started = std::time::Instant::now();
        let e = accept_rings(&ours, MAX_RING).err().expect("a socket is not rings");
        let took = started.elapsed();
        assert!(e.to_string().contains("not a memfd"), "{e}");
        assert!(
            took < std::time::Duration::from_secs(LINGER_S as u64 / 4),
            "refusing the descriptor took {took:?} (the linger time is {LINGER_S} s)"
        );
    }

    /// Descriptors still queued on a peer's socket when its connection is dropped were
    /// closed by the thread that dropped it (the kernel releases them with the socket):
    /// the wire's loop. A peer that queued a lingering socket behind the message the device
    /// refused (or behind any doorbell) froze the loop for the linger time.
    #[test]
    fn descriptors_queued_behind_a_dropped_connection_do_not_hold_the_loop() {
        const LINGER_S: i32 = 10;
        let (first, _s1) = lingering_socket(LINGER_S);
        let (queued, _s2) = lingering_socket(LINGER_S);
        let (ours, theirs) = UnixStream::pair().unwrap();
        let ours = PeerSock::from(ours);
        // Two messages: the one read as rings, and one behind it.
        send_fds(theirs.as_raw_fd(), &[first.as_raw_fd()]).unwrap();
        send_fds(theirs.as_raw_fd(), &[queued.as_raw_fd()]).unwrap();
        drop((first, queued));
        assert!(accept_rings(&ours, MAX_RING).is_err(), "a socket is not rings");
        dropped_quickly(ours, LINGER_S);
        drop(theirs);
    }

    /// The same one level down: the peer passes a Unix socket with a lingering socket
    /// queued on it. Defusing that Unix socket empties it, as dropping a peer's does.
    #[test]
    fn descriptors_queued_on_a_passed_unix_socket_do_not_hold_the_loop() {
        const LINGER_S: i32 = 10;
        let (lingering, _s) = lingering_socket(LINGER_S);
        let (inner, inner_peer) = UnixStream::pair().unwrap();
        send_fds(inner_peer.as_raw_fd(), &[lingering.as_raw_fd()]).unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        let ours = PeerSock::from(ours);
        send_fds(theirs.as_raw_fd(), &[inner.as_raw_fd()]).unwrap();
        drop((lingering, inner));
        dropped_quickly(ours, LINGER_S);
        drop((theirs, inner_peer));
    }

    /// And through a passed listening Unix socket: the connections waiting in its backlog
    /// are released with it, and with them what their clients queued.
    #[test]
    fn descriptors_queued_behind_a_passed_listeners_backlog_do_not_hold_the_loop() {
        use std::os::linux::net::SocketAddrExt;
        const LINGER_S: i32 = 10;
        let (lingering, _s) = lingering_socket(LINGER_S);
        let name = format!("rdmakit-test-backlog-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
        let client = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
        send_fds(client.as_raw_fd(), &[lingering.as_raw_fd()]).unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        let ours = PeerSock::from(ours);
        send_fds(theirs.as_raw_fd(), &[listener.as_raw_fd()]).unwrap();
        drop((lingering, listener));
        dropped_quickly(ours, LINGER_S);
        drop((theirs, client));
    }

    /// Only files of a FUSE mount go to the closing thread (memfds, sockets and devices
    /// close where they are dropped), and what goes there is closed: the far end of a pipe
    /// handed to it reads end-of-file. (A FUSE mount whose daemon withholds its answer to
    /// the flush is not made here: that needs a FUSE server in the test.)
    #[test]
    fn only_fuse_files_are_closed_elsewhere_and_they_are_closed() {
        let memfd = ring_memfd(MIN_RING).unwrap();
        let (a, _b) = UnixStream::pair().unwrap();
        let null = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        assert!(!is_fuse(&memfd) && !is_fuse(&OwnedFd::from(a)) && !is_fuse(&null));
        let (r, w) = std::io::pipe().unwrap();
        close_elsewhere(OwnedFd::from(w));
        let mut r = r;
        let mut b = [0u8; 1];
        assert_eq!(std::io::Read::read(&mut r, &mut b).unwrap(), 0, "the write end was closed");
    }

    #[test]
    fn bytes_cross_the_rings_in_order_through_wraps() {
        let (mut req, mut resp) = test_pair();
        let mut sent = 0u64;
        let mut got = 0u64;
        let mut buf = vec![0u8; 70_000];
        for round in 0..40u64 {
            let chunk: Vec<u8> = (0..50_000u64).map(|i| ((sent + i) % 251) as u8).collect();
            let mut off = 0;
            while off < chunk.len() {
                match req.write(&chunk[off..]) {
                    Ok(n) => off += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        let n = resp.read(&mut buf).unwrap();
                        for (k, b) in buf[..n].iter().enumerate() {
                            assert_eq!(*b, ((got + k as u64) % 251) as u8, "round {round}");
                        }
                        got += n as u64;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            sent += chunk.len() as u64;
        }
        while got < sent {
            let n = resp.read(&mut buf).unwrap();
            for (k, b) in buf[..n].iter().enumerate() {
                assert_eq!(*b, ((got + k as u64) % 251) as u8);
            }
            got += n as u64;
        }
        assert_eq!(resp.read(&mut buf).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        // Responses go the other way.
        assert_eq!(resp.write(b"ack").unwrap(), 3);
        let mut b3 = [0u8; 8];
        assert_eq!(req.read(&mut b3).unwrap(), 3);
        assert_eq!(&b3[..3], b"ack");
    }

    #[test]
    fn a_forged_head_is_an_error_not_a_read_past_the_ring() {
        let (req, mut resp) = test_pair();
        // The requester (hostile) claims more bytes than the ring holds.
        req.map.word(REQUESTS, HEAD).store(MIN_RING as u64 + 1, Ordering::SeqCst);
        let mut buf = [0u8; 16];
        assert_eq!(resp.read(&mut buf).unwrap_err().kind(), io::ErrorKind::InvalidData);
        // And a tail running ahead of what the device wrote.
        req.map.word(RESPONSES, TAIL).store(5, Ordering::SeqCst);
        assert_eq!(resp.write(b"x").unwrap_err().kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn a_doorbell_is_rung_only_for_a_waiting_peer_and_the_end_is_seen() {
        let (mut req, mut resp) = test_pair();
        let mut buf = [0u8; 8];
        // Nobody waits: no doorbell.
        req.write(b"a").unwrap();
        resp.take_doorbells(false);
        assert_eq!(resp.read(&mut buf).unwrap(), 1);
        // The device found the ring empty: the next write rings.
        assert!(resp.read(&mut buf).is_err());
        req.write(b"b").unwrap();
        assert_eq!(resp.bells_waiting(), 1, "one doorbell");
        resp.take_doorbells(false);
        assert!(!resp.peer_gone);
        drop(req);
        resp.take_doorbells(false);
        assert!(resp.peer_gone);
        assert_eq!(resp.read(&mut buf).unwrap(), 1, "what was sent before the end is still read");
        assert_eq!(resp.read(&mut buf).unwrap(), 0, "then the end");
        assert_eq!(resp.write(b"z").unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn a_probe_sees_every_publish_and_stays_quiet_otherwise() {
        let (mut req, mut resp) = test_pair();
        let mut other = test_pair().1;
        let mut buf = [0u8; 64];
        let mut p = resp.probe();
        assert!(!p.moved(), "nothing published");
        req.write(b"abc").unwrap();
        assert!(p.moved(), "a publish moves the head");
        // The connection reads on its own (a doorbell's turn): the probe is behind, which
        // costs a look, never a miss.
        assert_eq!(resp.read(&mut buf).unwrap(), 3);
        assert!(p.moved());
        assert!(resp.sync_probe(&mut p));
        assert!(!p.moved(), "up to date, nothing new");
        req.write(b"d").unwrap();
        assert!(p.moved());
        // A probe is of one connection's ring: another connection neither takes it nor
        // changes it.
        assert!(!other.sync_probe(&mut p));
        assert!(p.moved());
        assert_eq!(other.read(&mut buf).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        assert_eq!(resp.read(&mut buf).unwrap(), 1);
        assert!(resp.sync_probe(&mut p));
        assert!(!p.moved());
    }

    /// A requester connecting while the device's loop sleeps on their flag page: the Hello
    /// it writes must not ring before the rings' descriptors are passed, or the device
    /// takes the doorbell's byte for the one carrying them and drops the connection (the
    /// cross-process test with 300 QPs lost one this way).
    #[test]
    fn a_new_connection_passes_its_descriptors_first_even_to_a_sleeping_loop() {
        if !enabled() {
            return;
        }
        // A device "of" this process: a GID naming its pid, a listener on its name.
        let mut gid = [0u8; 16];
        gid[8..12].copy_from_slice(&std::process::id().to_be_bytes());
        gid[15] = 0x5a;
        let listener = bind(&gid).unwrap();
        // The page this process would pass to that device, its requests' consumer asleep.
        let (held, _) = flags::for_peer(std::process::id()).unwrap();
        assert!(!held.page().sleep(REQUESTS, &(0..128).collect::<Vec<_>>()));
        let conn = connect(&gid, b"hello frame", MIN_RING).expect("same-host connection");
        let flag = conn.flag().expect("flagged");
        assert!(Arc::ptr_eq(flag.page(), held.page()));
        let (sock, _) = listener.accept().unwrap();
        let fds = recv_fds(&sock).expect("the first byte carries the descriptors");
        assert_eq!(fds.len(), 2, "rings and flag page");
        // Published after: the page's bit now rings the sleeping loop.
        let mut conn = conn;
        conn.write(b"more").unwrap();
        let mut b = [0u8; 8];
        // SAFETY: reads into a local buffer.
        let n = unsafe { libc::recv(sock.as_raw_fd(), b.as_mut_ptr().cast(), 8, libc::MSG_DONTWAIT) };
        assert_eq!(n, 1, "one doorbell");
    }

    #[test]
    fn unsealed_or_small_or_foreign_descriptors_are_refused() {
        let try_attach = |fd: OwnedFd| {
            let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
            b.set_nonblocking(true).unwrap();
            send_fd(a.as_raw_fd(), &fd).unwrap();
            accept_rings(&UnixStream::from_std(b), MAX_RING).map(|_| ()).unwrap_err()
        };
        // A memfd that may shrink (the peer could truncate it under our mapping: SIGBUS).
        // SAFETY: plain calls; the descriptor is owned right after.
        let unsealed = unsafe {
            let fd = libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, map_len(MIN_RING) as libc::off_t), 0);
            OwnedFd::from_raw_fd(fd)
        };
        assert!(try_attach(unsealed).to_string().contains("shrink"));
        // Sealed but too small.
        // SAFETY: as above.
        let small = unsafe {
            let fd = libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
            assert_eq!(libc::ftruncate(fd, 4096), 0);
            assert_eq!(libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
            OwnedFd::from_raw_fd(fd)
        };
        assert!(try_attach(small).to_string().contains("bad size"));
        // Sealed, large, but not two rings of an accepted size.
        // SAFETY: as above.
        let odd = unsafe {
            let fd = libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
            assert_eq!(libc::ftruncate(fd, (map_len(MIN_RING) + 4096) as libc::off_t), 0);
            assert_eq!(libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
            OwnedFd::from_raw_fd(fd)
        };
        assert!(try_attach(odd).to_string().contains("bad size"));
        // Rings larger than this device maps.
        let big = ring_memfd(2 * MIN_RING).unwrap();
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        send_fd(a.as_raw_fd(), &big).unwrap();
        let e = accept_rings(&UnixStream::from_std(b), MIN_RING).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("bad size"), "{e}");
        // One of this process's own link memfds, handed back.
        let mine = ring_memfd(MIN_RING).unwrap();
        // SAFETY: fstat into a zeroed local of the right type.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above; `mine` is ours.
        assert_eq!(unsafe { libc::fstat(mine.as_raw_fd(), &raw mut st) }, 0);
        OURS.lock().unwrap().push(file_id(&st));
        let dup = mine.try_clone().unwrap();
        assert!(try_attach(dup).to_string().contains("own"));
        forget(file_id(&st));
        // Not shared memory at all.
        let (x, _y) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(try_attach(OwnedFd::from(x)).to_string().contains("not a memfd"));
        // No descriptor.
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        std::io::Write::write_all(&mut &a, b"\0").unwrap();
        assert!(accept_rings(&UnixStream::from_std(b), MAX_RING).is_err());
    }
}
