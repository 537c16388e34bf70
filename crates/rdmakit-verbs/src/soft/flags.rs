//! The ready-flag page of two processes on one host: which of their same-host connections
//! have input, one bit each, instead of a word in each connection's own control page.
//!
//! Why: the wire's loop used to find input by looking at the head of every ring it polls,
//! one cache line of a separate page per connection, on every turn; with a thousand
//! connections that scan was most of the loop's own time (`rdmakit-perf scaling`: its load
//! of each head was half of the loop's samples at 1024 pairs). With the page, a producer
//! sets its connection's bit after publishing, and the loop reads the set words (128 bytes
//! per 1024 connections) and gives a turn to the connections named there only. Sleeping
//! is one word per page too: the loop says it sleeps in each page it reads, and the first
//! producer to see that rings the doorbell of its own connection, once for all of them;
//! with a word per connection, each sparse connection's producer rang.
//!
//! A requester makes one page per device process it connects to (by the pid its GID names)
//! and passes it with each connection's rings, with the connection's bit written in the
//! rings' control page. The device checks the page as it checks rings (sealed shared
//! memory of the exact size, not one of its own) and the bit against the page's size.
//! Everything on the page is a hint: the loop reads each named ring with all its checks, a
//! bit naming no connection of the page (or a connection the page does not own) costs a
//! look at most, a bit with no input behind it does not keep the loop from sleeping (only
//! a turn given does), and a connection is never left without a way to be woken: its producer
//! still honours the ring's own doorbell request. A hostile peer holding the page can
//! delay or hurry only connections it is the other end of.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex, Weak};

/// Bytes of a flag page (the memfd's size).
pub const PAGE: usize = 4096;
/// Connections one page has bits for; a requester opens another page past that.
pub const BITS: u32 = 8192;
/// Words of bits per direction.
const WORDS: usize = BITS as usize / 64;
/// By ring (0: requests, 1: responses): the word where that ring's consumer says its loop
/// sleeps, and where that ring's bits start. Each on its own cache lines.
const SLEEP_AT: [usize; 2] = [0, 64];
const BITS_AT: [usize; 2] = [1024, 1024 + WORDS * 8];
const _: () = assert!(BITS_AT[1] + WORDS * 8 <= PAGE);

/// One flag page, mapped.
pub(crate) struct FlagPage {
    base: NonNull<u8>,
    /// The memfd's identity.
    id: FileId,
    /// On the side that made the page: its descriptor (passed with each new connection) and
    /// which bits are taken.
    made: Option<Made>,
}

struct Made {
    fd: OwnedFd,
    /// The device process the page is for.
    pid: u32,
    used: Mutex<Vec<u64>>,
}

// SAFETY: the mapping is plain memory owned by this value, reached only as atomics.
unsafe impl Send for FlagPage {}
// SAFETY: as above.
unsafe impl Sync for FlagPage {}

impl Drop for FlagPage {
    fn drop(&mut self) {
        // SAFETY: mapped (`direct::map_shared`) with this length; no reference into it outlives
        // `self` (every user holds the `Arc`).
        unsafe { libc::munmap(self.base.as_ptr().cast(), PAGE) };
    }
}

impl FlagPage {
    /// Word `k` of the bits of `ring`.
    fn bits(&self, ring: usize, k: usize) -> &AtomicU64 {
        assert!(ring < 2 && k < WORDS);
        // SAFETY: within the page, 8-aligned; the peer changes it only as an atomic.
        unsafe { &*self.base.as_ptr().add(BITS_AT[ring] + k * 8).cast::<AtomicU64>() }
    }

    /// The word where `ring`'s consumer says it sleeps.
    fn sleep_word(&self, ring: usize) -> &AtomicU64 {
        // SAFETY: within the page, 8-aligned; the peer changes it only as an atomic.
        unsafe { &*self.base.as_ptr().add(SLEEP_AT[ring]).cast::<AtomicU64>() }
    }

    /// The consumer of `ring` takes word `k` of its bits: what was set, now clear. A
    /// connection set here published before setting it, and a publish after the take sets
    /// it again: after [`took`](Self::took), the rings named are read at their latest.
    pub(crate) fn take(&self, ring: usize, k: usize) -> u64 {
        let w = self.bits(ring, k);
        if w.load(Ordering::Relaxed) == 0 { 0 } else { w.swap(0, Ordering::SeqCst) }
    }

    /// After taking set words, before reading the rings they name: pairs with the fence
    /// of a producer that found its bit already set (and so did not set it again).
    pub(crate) fn took() {
        fence(Ordering::SeqCst);
    }

    /// The consumer of `ring` is about to sleep: producers ring from now on. Then whether a
    /// bit is set in one of `words` (input came meanwhile; the loop stays awake).
    pub(crate) fn sleep(&self, ring: usize, words: &[usize]) -> bool {
        self.sleep_word(ring).store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        words.iter().any(|&k| k < WORDS && self.bits(ring, k).load(Ordering::Relaxed) != 0)
    }

    /// The consumer of `ring` is awake again (producers need not ring).
    pub(crate) fn wake(&self, ring: usize) {
        let w = self.sleep_word(ring);
        if w.load(Ordering::Relaxed) != 0 {
            w.store(0, Ordering::SeqCst);
        }
    }
}

/// A connection's bit in a flag page.
pub(crate) struct Flag {
    page: Arc<FlagPage>,
    bit: u32,
    /// This process gave the bit out of a page it made: it is free again when this goes.
    given: bool,
}

impl Flag {
    /// The page.
    pub(crate) fn page(&self) -> &Arc<FlagPage> {
        &self.page
    }

    /// The bit.
    pub(crate) fn bit(&self) -> u32 {
        self.bit
    }

    /// The same bit of the same page, for the other end of a test's connection.
    #[cfg(test)]
    pub(crate) fn twin(&self) -> Flag {
        self.at(self.bit)
    }

    /// Bit `bit` of the same page, for a test's connection (not given out: never freed).
    #[cfg(test)]
    pub(crate) fn at(&self, bit: u32) -> Flag {
        Flag { page: self.page.clone(), bit, given: false }
    }

    /// After a publish into `ring` (the head stored, then a sequentially consistent fence):
    /// sets this connection's bit, and rings `bell` if the consumer said its loop sleeps.
    /// True if it rang.
    pub(crate) fn raise(&self, ring: usize, bell: RawFd) -> bool {
        let k = (self.bit / 64) as usize;
        let m = 1u64 << (self.bit % 64);
        let w = self.page.bits(ring, k);
        // Already set: the consumer has not taken it yet, and when it does, its fence after
        // the take pairs with the publish's fence: it reads this publish.
        if w.load(Ordering::Relaxed) & m == 0 {
            w.fetch_or(m, Ordering::SeqCst);
        }
        fence(Ordering::SeqCst);
        let sleep = self.page.sleep_word(ring);
        if sleep.load(Ordering::Relaxed) != 0 && sleep.swap(0, Ordering::SeqCst) != 0 {
            super::shm::ring_bell(bell);
            return true;
        }
        false
    }
}

impl Drop for Flag {
    fn drop(&mut self) {
        if let Some(made) = self.page.made.as_ref().filter(|_| self.given) {
            let mut used = made.used.lock().unwrap_or_else(|e| e.into_inner());
            used[(self.bit / 64) as usize] &= !(1u64 << (self.bit % 64));
        }
    }
}

/// The pages this process made, by the device process each is for.
static MADE: Mutex<Vec<Weak<FlagPage>>> = Mutex::new(Vec::new());
/// The pages peers passed this process, mapped once each however many connections use
/// them (by identity).
static TAKEN: Mutex<Vec<(FileId, Weak<FlagPage>)>> = Mutex::new(Vec::new());

/// A file's identity: (device, inode).
type FileId = (u64, u64);

/// A bit for a new connection to the device process `pid`, in a page made for that
/// process (a new page when none has a free bit), and the page's descriptor to pass.
/// `None` when no page can be made (the connection then goes without).
pub(crate) fn for_peer(pid: u32) -> Option<(Flag, RawFd)> {
    let mut made = MADE.lock().unwrap_or_else(|e| e.into_inner());
    made.retain(|w| w.strong_count() > 0);
    let mut pages =
        made.iter().filter_map(Weak::upgrade).filter(|p| p.made.as_ref().is_some_and(|m| m.pid == pid));
    let found = pages.find_map(|p| p.made.as_ref().and_then(Made::take_bit).map(|bit| (p.clone(), bit)));
    let (page, bit) = match found {
        Some(f) => f,
        None => match new_page(pid) {
            Ok(p) => {
                let p = Arc::new(p);
                made.push(Arc::downgrade(&p));
                let bit = p.made.as_ref().and_then(Made::take_bit).expect("a new page has free bits");
                (p, bit)
            }
            Err(e) => {
                tracing::debug!(error = %e, "soft NIC: no ready-flag page; same-host rings go without");
                return None;
            }
        },
    };
    let fd = page.made.as_ref().expect("a page this process made").fd.as_raw_fd();
    Some((Flag { page, bit, given: true }, fd))
}

impl Made {
    /// The lowest free bit, now taken.
    fn take_bit(&self) -> Option<u32> {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        let (k, word) = used.iter_mut().enumerate().find(|(_, w)| **w != u64::MAX)?;
        let b = word.trailing_ones();
        *word |= 1 << b;
        Some(k as u32 * 64 + b)
    }
}

fn new_page(pid: u32) -> io::Result<FlagPage> {
    let fd = super::direct::sealed_memfd(c"rdmakit-soft-flags", PAGE)?;
    // SAFETY: fcntl on a descriptor we own: no more seals (a peer adding one cannot bar
    // this process's writes).
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SEAL) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let base = super::direct::map_shared(&fd, PAGE, true)?;
    let (_, id) = super::direct::file_id(&fd)?;
    Ok(FlagPage { base, id, made: Some(Made { fd, pid, used: Mutex::new(vec![0; WORDS]) }) })
}

/// Whether `id` is a page this process made.
pub(crate) fn is_made(id: FileId) -> bool {
    MADE.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|w| w.upgrade().is_some_and(|p| p.id == id))
}

/// The page a same-host requester passed with its rings, checked (sealed shared memory of
/// [`PAGE`] bytes, not one this process made), and the connection's bit in it, checked
/// against the page. Mapped once per page in this process.
pub(crate) fn accept(fd: OwnedFd, bit: u64) -> io::Result<Flag> {
    let bad =
        |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("same-host peer's flag page {what}"));
    let bit = u32::try_from(bit).ok().filter(|&b| b < BITS).ok_or_else(|| bad("bit is out of range"))?;
    let id = super::direct::check_sealed(&fd, PAGE, "same-host peer's flag page")?;
    if super::direct::is_any_of_ours(id) {
        return Err(bad("is one of this process's own"));
    }
    let mut taken = TAKEN.lock().unwrap_or_else(|e| e.into_inner());
    taken.retain(|(_, w)| w.strong_count() > 0);
    if let Some(page) = taken.iter().find(|(i, _)| *i == id).and_then(|(_, w)| w.upgrade()) {
        return Ok(Flag { page, bit, given: false });
    }
    let page = Arc::new(FlagPage { base: super::direct::map_shared(&fd, PAGE, true)?, id, made: None });
    taken.push((id, Arc::downgrade(&page)));
    Ok(Flag { page, bit, given: false })
}

#[cfg(test)]
#[cfg(not(miri))]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    fn all_words() -> Vec<usize> {
        (0..WORDS).collect()
    }

    fn pair() -> (std::os::unix::net::UnixStream, std::os::unix::net::UnixStream) {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        (a, b)
    }

    fn bells(s: &std::os::unix::net::UnixStream) -> usize {
        let mut b = [0u8; 64];
        // SAFETY: reads into a local buffer.
        let n = unsafe { libc::recv(s.as_raw_fd(), b.as_mut_ptr().cast(), 64, libc::MSG_DONTWAIT) };
        n.max(0) as usize
    }

    #[test]
    fn bits_are_taken_once_and_only_a_sleeping_consumer_is_rung_once() {
        // A pid no device has: this test's pages are its own.
        let (f1, fd) = for_peer(u32::MAX - 1).unwrap();
        let (f2, _) = for_peer(u32::MAX - 1).unwrap();
        assert!(Arc::ptr_eq(f1.page(), f2.page()), "one page per device process");
        assert_ne!(f1.bit(), f2.bit());
        // The device's view of the same page.
        let dev1 = accept(fd_dup(fd), u64::from(f1.bit()));
        assert!(dev1.err().unwrap().to_string().contains("own"), "a page this process made is refused");
        let (tx, rx) = pair();
        let page = f1.page();
        const REQ: usize = 0;
        // Awake consumer: bits set, no doorbell.
        assert!(!f1.raise(REQ, tx.as_raw_fd()));
        assert!(!f2.raise(REQ, tx.as_raw_fd()));
        assert_eq!(bells(&rx), 0);
        let k = (f1.bit() / 64) as usize;
        let got = page.take(REQ, k);
        assert_eq!(got, (1 << (f1.bit() % 64)) | (1 << (f2.bit() % 64)));
        assert_eq!(page.take(REQ, k), 0, "taken once");
        // Sleeping: the first producer rings, the second does not.
        assert!(!page.sleep(REQ, &all_words()), "nothing set");
        assert!(f1.raise(REQ, tx.as_raw_fd()));
        assert!(!f2.raise(REQ, tx.as_raw_fd()));
        assert_eq!(bells(&rx), 1);
        // Input came before the sleep: the consumer sees it and stays awake.
        page.wake(REQ);
        assert!(page.sleep(REQ, &all_words()));
        page.wake(REQ);
        // The other direction has its own bits.
        assert_eq!(page.take(1, k), 0);
        // A dropped connection's bit is free again.
        let freed = f2.bit();
        drop(f2);
        let (f3, _) = for_peer(u32::MAX - 1).unwrap();
        assert_eq!(f3.bit(), freed);
    }

    fn fd_dup(fd: RawFd) -> OwnedFd {
        // SAFETY: dup of a live descriptor; the copy is owned right after.
        unsafe { OwnedFd::from_raw_fd(libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0)) }
    }

    #[test]
    fn a_page_is_checked_before_it_is_mapped_and_the_bit_against_it() {
        let memfd = |len: i64, seal: bool| {
            // SAFETY: plain calls; the descriptor is owned right after.
            unsafe {
                let fd = libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
                assert!(fd >= 0);
                assert_eq!(libc::ftruncate(fd, len), 0);
                if seal {
                    assert_eq!(libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
                }
                OwnedFd::from_raw_fd(fd)
            }
        };
        let e = |r: io::Result<Flag>| r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e(accept(memfd(4096, false), 0)).contains("may shrink"));
        assert!(e(accept(memfd(8192, true), 0)).contains("another size"));
        assert!(e(accept(memfd(4096, true), u64::from(BITS))).contains("out of range"));
        assert!(e(accept(memfd(4096, true), u64::MAX)).contains("out of range"));
        let (x, _y) = pair();
        assert!(e(accept(OwnedFd::from(x), 0)).contains("may shrink"));
        // A good one, passed twice (two connections): mapped once.
        let good = memfd(4096, true);
        let again = good.try_clone().unwrap();
        let a = accept(good, 5).unwrap();
        let b = accept(again, BITS as u64 - 1).unwrap();
        assert!(Arc::ptr_eq(a.page(), b.page()));
        assert_eq!(b.bit(), BITS - 1);
    }
}
