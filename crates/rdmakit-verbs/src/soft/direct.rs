//! Direct placement between processes of one host: a requester maps the target region
//! itself and places its RDMA writes (and takes its reads) with one copy, on its own
//! thread, without waking the responder's loop.
//!
//! Through the rings (`super::shm`) a write's bytes are copied twice (region → ring →
//! region) and each hop wakes a thread of the other process: an 8-byte write round trip
//! between two processes took about 15 µs against 0.2 µs in one. Here:
//! - a region allocated by rdmakit for remote access ([`ProtectionDomain::alloc_mr`]) on a
//!   soft device with the same-host path on lives in its own memfd (not the heap), followed
//!   by a control page whose first word says whether the registration is alive;
//! - a requester QP linked through rings asks its responder for a key it writes to or
//!   reads from (`KeyRequest`, sent once per key); the responder's NIC checks the key as it
//!   checks a request (it exists, it is a plain region of this memory, its PD is the QP's,
//!   and its access flags and the QP's allow remote write or read), passes the memfd on the
//!   authenticated link's Unix socket and answers with the region's range and the access
//!   it grants (`KeyGrant`);
//! - the requester checks the memfd (shared memory sealed against shrinking, of the size
//!   the grant states, not one of its own) and maps it;
//! - from then on a write or read of that key, when nothing the QP sent through the ring is
//!   still unanswered (RC order), is checked against the grant (access, bounds), the
//!   region's alive word and the responder QP's gate word (in the rings' control page,
//!   closed when the responder QP leaves RTR/RTS or is destroyed), then copied, and
//!   completes at once. Anything else goes through the ring as before, where the
//!   responder answers it with the status a NIC gives.
//!
//! **What the grant costs in isolation.** A peer that was granted a key can write (or
//! read) the region's pages until the region is deregistered, whatever its QP does: the
//! gate and alive words are honoured by rdmakit, not enforced by the kernel. The grant
//! goes only to the QP the region's PD and access flags admit, over a link whose peer
//! proved it is the connected QP and runs as this user (who could already read and write
//! this process's memory through `/proc`). After deregistration the region's pages are
//! never used again by this process (each region has its own memfd, unmapped at the end):
//! a late write lands in pages nobody reads.
//!
//! **Limits.** Each such region holds a descriptor; at most a quarter of the process's
//! descriptor limit goes to them (the rest are heap-allocated as before, and take the
//! rings). A link holds at most `MAX_GRANTS` (64) grants, and a device gives at most as
//! many per connection.
//!
//! [`ProtectionDomain::alloc_mr`]: crate::ProtectionDomain::alloc_mr

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::types::AccessFlags;

/// Bytes of a region file's control page (after the region's pages).
pub(crate) const PAGE: usize = 4096;

/// Grants one link keeps (distinct keys it maps).
pub const MAX_GRANTS: usize = 64;

/// Writes and reads placed directly, process-wide (for tests and benchmarks that check the
/// path was taken); not a stable API.
static PLACED: AtomicU64 = AtomicU64::new(0);

/// Operations placed directly by this process so far.
pub fn direct_placements() -> u64 {
    PLACED.load(Ordering::Relaxed)
}

pub(crate) fn count_placement() {
    PLACED.fetch_add(1, Ordering::Relaxed);
}

/// Region files alive in this process, against [`file_budget`].
static FILES: AtomicUsize = AtomicUsize::new(0);

/// A quarter of the soft descriptor limit: region files must not starve sockets and rings.
fn file_budget() -> usize {
    static BUDGET: OnceLock<usize> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes into the local it is given.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut r) } != 0 {
            return 0;
        }
        usize::try_from(r.rlim_cur / 4).unwrap_or(usize::MAX)
    })
}

/// The (device, inode) of region files this process made: a peer handing one back as a
/// grant must not get this process writing its own region through a second mapping.
static OURS: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());

fn file_id(fd: &OwnedFd) -> io::Result<(libc::stat, (u64, u64))> {
    // SAFETY: zeroed `stat` is valid; fstat writes into it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a live local of the right type; `fd` is open.
    if unsafe { libc::fstat(fd.as_raw_fd(), &raw mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let id = (st.st_dev, st.st_ino);
    Ok((st, id))
}

/// A region's memory in its own sealed memfd: `len` bytes mapped from offset 0, then the
/// control page. Unmapped, its alive word cleared first, on drop.
pub(crate) struct RegionFile {
    fd: OwnedFd,
    base: NonNull<u8>,
    map_len: usize,
    id: (u64, u64),
}

// SAFETY: the mapping is owned by this value; its bytes are reached only through raw
// pointers with `shared_mem` copies or atomics (the region's rules), from any thread.
unsafe impl Send for RegionFile {}
// SAFETY: as above; `&RegionFile` exposes the pointer, the length and an atomic word.
unsafe impl Sync for RegionFile {}

impl RegionFile {
    /// A file for a region of `len` bytes (the page after them is the control page), or
    /// `None` when the budget is spent or the system refuses (the caller uses the heap).
    pub(crate) fn create(len: usize) -> Option<RegionFile> {
        if cfg!(miri) {
            return None;
        }
        let data = len.max(1).checked_next_multiple_of(PAGE)?;
        let map_len = data.checked_add(PAGE)?;
        if FILES.fetch_add(1, Ordering::AcqRel) >= file_budget() {
            FILES.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        match Self::create_file(map_len) {
            Ok(f) => Some(f),
            Err(e) => {
                FILES.fetch_sub(1, Ordering::AcqRel);
                tracing::debug!(error = %e, len, "soft NIC: no memfd for a region; heap memory, rings only");
                None
            }
        }
    }

    fn create_file(map_len: usize) -> io::Result<RegionFile> {
        // SAFETY: a NUL-terminated name; valid flags.
        let fd = unsafe {
            libc::memfd_create(c"rdmakit-soft-region".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor, now owned.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let size =
            libc::off_t::try_from(map_len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: plain calls on a descriptor we own.
        unsafe {
            if libc::ftruncate(fd.as_raw_fd(), size) != 0 {
                return Err(io::Error::last_os_error());
            }
            // Sealed against shrinking and growing: a peer mapping it can never fault
            // (SIGBUS) on pages cut from under it, nor can we.
            let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
            if libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        let base = map_shared(&fd, map_len)?;
        let (_, id) = match file_id(&fd) {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: mapped just above with this length; nothing refers to it yet.
                unsafe { libc::munmap(base.as_ptr().cast(), map_len) };
                return Err(e);
            }
        };
        OURS.lock().expect("region files").push(id);
        let f = RegionFile { fd, base, map_len, id };
        f.alive().store(1, Ordering::Release);
        Ok(f)
    }

    /// The region's first byte (page-aligned; the file's pages are zero-filled).
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub(crate) fn map_len(&self) -> usize {
        self.map_len
    }

    pub(crate) fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// The alive word: 1 while the region is registered.
    fn alive(&self) -> &AtomicU64 {
        // SAFETY: the control page is the mapping's last page, 8-aligned; peers change the
        // word only as an atomic (a hostile one may, which only misleads its own writes).
        unsafe { &*self.base.as_ptr().add(self.map_len - PAGE).cast::<AtomicU64>() }
    }

    /// Tells every peer that mapped the region that it is gone (deregistration).
    pub(crate) fn revoke(&self) {
        self.alive().store(0, Ordering::Release);
    }
}

impl Drop for RegionFile {
    fn drop(&mut self) {
        self.revoke();
        // SAFETY: mapped by `create_file` with this length; the region owning this file is
        // being dropped, so nothing of this process refers to the mapping any more.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.map_len) };
        OURS.lock().expect("region files").retain(|&o| o != self.id);
        FILES.fetch_sub(1, Ordering::AcqRel);
    }
}

fn map_shared(fd: &OwnedFd, len: usize) -> io::Result<NonNull<u8>> {
    // SAFETY: a fresh shared mapping chosen by the kernel; nothing else is at that address.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(NonNull::new(p.cast()).expect("mmap does not return null on success"))
}

// ---- the life page: whether the responder's process is alive, without a system call ----
//
// A write placed into a region of a process that has died would complete with success,
// where a NIC gives `RETRY_EXC_ERR` (no ACK comes); the wire's loop notices the end of the
// link only some time later. So each process that grants keys shares one page whose first
// word holds the thread id of its wire loop, registered with the kernel as a robust futex
// of that thread (`set_robust_list`): when the thread exits, as every thread does when its
// process dies however it dies, the kernel sets `FUTEX_OWNER_DIED` in the word. A
// requester reads the word before each direct access: one load of a line nobody writes.
// The list the kernel walks at the thread's exit lives in this process's private memory
// (only the word it names is shared), so a peer cannot steer it.

/// The kernel's robust futex list head (`struct robust_list_head`).
#[repr(C)]
struct RobustHead {
    /// First entry (`struct robust_list`): the one node, which points back here.
    next: *mut RobustNode,
    /// The futex word of an entry is at the entry's address plus this.
    futex_offset: isize,
    list_op_pending: *mut RobustNode,
}

/// One entry (`struct robust_list`).
#[repr(C)]
struct RobustNode {
    next: *mut RobustHead,
}

struct Robust {
    head: std::cell::UnsafeCell<RobustHead>,
    node: std::cell::UnsafeCell<RobustNode>,
}

// SAFETY: written once, by the one thread that registers them with the kernel
// (`watch_word`'s contract); only the kernel reads them afterwards.
unsafe impl Sync for Robust {}

impl Robust {
    const fn new() -> Robust {
        Robust {
            head: std::cell::UnsafeCell::new(RobustHead {
                next: std::ptr::null_mut(),
                futex_offset: 0,
                list_op_pending: std::ptr::null_mut(),
            }),
            node: std::cell::UnsafeCell::new(RobustNode { next: std::ptr::null_mut() }),
        }
    }
}

/// The wire's loop thread's list.
static ROBUST: Robust = Robust::new();

/// This process's life page (its memfd), once the wire's loop registered it.
static LIFE: OnceLock<Option<OwnedFd>> = OnceLock::new();

/// Called by the wire's loop thread as it starts: creates the life page and registers its
/// word as a robust futex of this thread. Without it (an error, or Miri) keys are not
/// granted and everything goes through the rings.
pub(crate) fn watch_loop_thread() {
    LIFE.get_or_init(|| {
        if cfg!(miri) {
            return None;
        }
        match life_page() {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::debug!(error = %e, "soft NIC: no life page; same-host direct placement off");
                None
            }
        }
    });
}

fn life_page() -> io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated name; valid flags.
    let fd = unsafe {
        libc::memfd_create(c"rdmakit-soft-life".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor, now owned.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain calls on a descriptor we own.
    unsafe {
        if libc::ftruncate(fd.as_raw_fd(), PAGE as libc::off_t) != 0 {
            return Err(io::Error::last_os_error());
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        if libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    // Mapped for the rest of the process: the kernel writes the word as the thread exits.
    let word = map_shared(&fd, PAGE)?.as_ptr().cast::<AtomicU64>();
    // SAFETY: the page stays mapped for the rest of the process; `LIFE`'s initialisation
    // runs once, on this thread, so `ROBUST` is registered once.
    unsafe { watch_word(word, &ROBUST)? };
    Ok(fd)
}

/// Writes this thread's id into `word` and registers it, through the list storage `r`,
/// as a robust futex of this thread: the kernel sets `FUTEX_OWNER_DIED` in it when the
/// thread exits. Replaces glibc's list for this thread, which must hold no robust pthread
/// mutexes.
///
/// # Safety
/// `word` must stay mapped (8-aligned, readable and writable) for the rest of the process,
/// and `r` must be used for no other thread.
unsafe fn watch_word(word: *const AtomicU64, r: &'static Robust) -> io::Result<()> {
    // SAFETY: gettid(2) has no preconditions.
    let tid = unsafe { libc::gettid() } as u32;
    // The futex word is 32 bits: the low half of the (little-endian) word.
    // SAFETY: valid per the contract.
    unsafe { (*word).store(u64::from(tid), Ordering::Release) };
    let head = r.head.get();
    let node = r.node.get();
    // SAFETY: `r` is this thread's alone (the contract); the kernel reads it only after
    // `set_robust_list` below.
    unsafe {
        (*node).next = head;
        (*head).next = node;
        (*head).futex_offset = (word as isize).wrapping_sub(node as isize);
        (*head).list_op_pending = std::ptr::null_mut();
    }
    // SAFETY: registers the list above (static, valid for the life of the process) for
    // this thread.
    let rc = unsafe { libc::syscall(libc::SYS_set_robust_list, head, size_of::<RobustHead>()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// This process's life page to pass with a grant; `None`: it has none (no grants).
pub(crate) fn life_fd() -> Option<&'static OwnedFd> {
    LIFE.get().and_then(Option::as_ref)
}

/// Whether the life word says its process lives: a thread id, and no `FUTEX_OWNER_DIED`.
fn lives(word: u64) -> bool {
    let w = word as u32;
    w & libc::FUTEX_TID_MASK != 0 && w & libc::FUTEX_OWNER_DIED == 0
}

/// A region of the peer, mapped here by a grant.
struct Grant {
    rkey: u32,
    access: AccessFlags,
    addr: u64,
    len: u64,
    base: NonNull<u8>,
    map_len: usize,
}

impl Drop for Grant {
    fn drop(&mut self) {
        // SAFETY: mapped by `GrantTable::insert` with this length; a grant is dropped only
        // under the table's lock, which every copy through it holds.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.map_len) };
    }
}

/// What a requester link knows of its peer's keys: grants (mapped regions), and the keys
/// asked for and not answered or refused (asked once).
#[derive(Default)]
pub(crate) struct GrantTable {
    grants: Vec<Grant>,
    asked: Vec<Ask>,
    /// The peer process's life page (see [`watch_loop_thread`]), with its first grant.
    life: Option<LifePage>,
}

/// A key asked for.
struct Ask {
    rkey: u32,
    /// When the ask went; accesses to the key wait for the answer until [`GRANT_WAIT`]
    /// after it.
    at: std::time::Instant,
    answered: bool,
}

/// How long accesses to a key wait for the answer to the grant asked for it before they
/// go through the ring (a peer that does not answer loses only this, once per key).
pub(crate) const GRANT_WAIT: std::time::Duration = std::time::Duration::from_millis(20);

/// Why an access is not placed directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Miss {
    /// No grant and none asked for: ask.
    Ask,
    /// Asked, not answered yet: wait until then for it.
    Wait(std::time::Instant),
    /// Through the ring (refused, no room for more grants, outside the grant, revoked).
    Ring,
}

/// A peer's life page, mapped here.
struct LifePage {
    base: NonNull<u8>,
}

impl LifePage {
    fn lives(&self) -> bool {
        // SAFETY: the page is mapped while `self` lives, 8-aligned; the peer (and the kernel
        // at its end) change the word only atomically.
        lives(unsafe { &*self.base.as_ptr().cast::<AtomicU64>() }.load(Ordering::Acquire))
    }
}

impl Drop for LifePage {
    fn drop(&mut self) {
        // SAFETY: mapped by `GrantTable::insert` with this length; dropped under the table's
        // lock, which every check through it holds.
        unsafe { libc::munmap(self.base.as_ptr().cast(), PAGE) };
    }
}

/// Checks a passed descriptor is shared memory of exactly `len` bytes sealed against
/// shrinking (so a mapping of it can never fault), and returns its identity.
fn check_file(fd: &OwnedFd, len: usize) -> io::Result<(u64, u64)> {
    // SAFETY: fcntl on a descriptor we own; F_GET_SEALS fails on anything but a memfd.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "a granted file that may shrink"));
    }
    let (st, id) = file_id(fd)?;
    if (st.st_mode & libc::S_IFMT) != libc::S_IFREG || st.st_size as u64 != len as u64 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "a granted file of another size"));
    }
    Ok(id)
}

// SAFETY: the grants' mappings are owned by the table and reached only under its lock
// (`Mutex<GrantTable>`), through `shared_mem` copies and atomics.
unsafe impl Send for GrantTable {}

/// Where a direct access goes.
pub(crate) struct Target {
    pub ptr: *mut u8,
}

impl GrantTable {
    /// The local address of `addr..addr + len` of key `rkey` if a live grant allows
    /// `need` there.
    pub(crate) fn target(&self, rkey: u32, addr: u64, len: u64, need: AccessFlags) -> Result<Target, Miss> {
        let Some(g) = self.grants.iter().find(|g| g.rkey == rkey) else {
            return Err(match self.asked.iter().find(|a| a.rkey == rkey) {
                Some(a) if !a.answered && a.at.elapsed() < GRANT_WAIT => Miss::Wait(a.at + GRANT_WAIT),
                Some(_) => Miss::Ring,
                None if self.asked.len() < MAX_GRANTS => Miss::Ask,
                None => Miss::Ring,
            });
        };
        if !self.life.as_ref().is_some_and(LifePage::lives) {
            return Err(Miss::Ring);
        }
        if !g.access.contains(need) {
            return Err(Miss::Ring);
        }
        let off = match addr.checked_sub(g.addr) {
            Some(off) if off.checked_add(len).is_some_and(|end| end <= g.len) => off,
            _ => return Err(Miss::Ring),
        };
        // SAFETY: the control page is the mapping's last page, 8-aligned, mapped while the
        // grant lives; the responder changes the word only atomically.
        let alive = unsafe { &*g.base.as_ptr().add(g.map_len - PAGE).cast::<AtomicU64>() };
        if alive.load(Ordering::Acquire) != 1 {
            return Err(Miss::Ring);
        }
        // `off + len <= g.len <= map_len - PAGE`: inside the mapping.
        Ok(Target { ptr: g.base.as_ptr().wrapping_add(off as usize) })
    }

    /// Records that `rkey` was asked for now; returns when accesses stop waiting for it.
    pub(crate) fn asked(&mut self, rkey: u32) -> std::time::Instant {
        let at = std::time::Instant::now();
        if !self.asked.iter().any(|a| a.rkey == rkey) {
            self.asked.push(Ask { rkey, at, answered: false });
        }
        at + GRANT_WAIT
    }

    /// Forgets an ask that could not be sent (asked again later).
    pub(crate) fn unask(&mut self, rkey: u32) {
        self.asked.retain(|a| a.rkey != rkey);
    }

    /// Takes a grant for `rkey` (whose memfd is `fd`, with the peer's life page `life`),
    /// after checking the files match it; a refusal (`access` without remote write or
    /// read) leaves the key on the rings. Err: the peer sent what no honest responder sends
    /// (the link ends).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn insert(
        &mut self,
        rkey: u32,
        access: u32,
        addr: u64,
        len: u64,
        map_len: u64,
        fd: Option<OwnedFd>,
        life: Option<OwnedFd>,
    ) -> io::Result<()> {
        let Some(ask) = self.asked.iter_mut().find(|a| a.rkey == rkey && !a.answered) else {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a grant nobody asked for"));
        };
        // Answered, whatever comes of it: a refusal or a bad file leaves the key on the ring.
        ask.answered = true;
        let access =
            AccessFlags::from_bits_truncate(access) & (AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ);
        let Some(fd) = fd else {
            return if access.is_empty() {
                Ok(())
            } else {
                Err(io::Error::new(io::ErrorKind::InvalidData, "a grant without its memfd"))
            };
        };
        if access.is_empty() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a memfd with a refusal"));
        }
        let map = usize::try_from(map_len).ok().filter(|&m| {
            m.is_multiple_of(PAGE)
                && m >= 2 * PAGE
                && addr.checked_add(len).is_some()
                && len <= (m - PAGE) as u64
                && isize::try_from(m).is_ok()
        });
        let Some(map_len) = map else {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a grant of a bad size"));
        };
        let Some(life) = life else {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a grant without the peer's life page"));
        };
        let id = check_file(&fd, map_len)?;
        if OURS.lock().expect("region files").contains(&id) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a grant of one of our own regions"));
        }
        if self.life.is_none() {
            check_file(&life, PAGE)?;
            self.life = Some(LifePage { base: map_shared(&life, PAGE)? });
        }
        let base = map_shared(&fd, map_len)?;
        // The descriptor is not needed once mapped.
        drop(fd);
        self.grants.push(Grant { rkey, access, addr, len, base, map_len });
        Ok(())
    }
}

#[cfg(test)]
#[cfg(not(miri))]
mod tests {
    use super::*;

    fn memfd(len: usize, seal: bool) -> OwnedFd {
        // SAFETY: a NUL-terminated name; valid flags.
        let fd = unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: fresh, now owned.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain calls on a descriptor we own.
        unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0);
            if seal {
                assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
            }
        }
        fd
    }

    /// The kernel marks a watched word when its thread ends: what tells a requester that
    /// the process it places into has died (every thread ends with it).
    #[test]
    fn a_watched_word_says_when_its_thread_has_ended() {
        static R: Robust = Robust::new();
        let page = memfd(PAGE, true);
        let base = map_shared(&page, PAGE).unwrap();
        let word = base.as_ptr().cast::<AtomicU64>() as usize;
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            // SAFETY: the page is mapped for the rest of the test process (never unmapped);
            // `R` serves this thread only.
            unsafe { watch_word(word as *const AtomicU64, &R).unwrap() };
            rx.recv().unwrap();
        });
        // SAFETY: mapped above, never unmapped.
        let w = unsafe { &*(word as *const AtomicU64) };
        let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while w.load(Ordering::Acquire) == 0 {
            assert!(std::time::Instant::now() < end);
            std::thread::yield_now();
        }
        assert!(lives(w.load(Ordering::Acquire)), "the thread runs");
        tx.send(()).unwrap();
        t.join().unwrap();
        assert!(
            !lives(w.load(Ordering::Acquire)),
            "the kernel marked the word: {:#x}",
            w.load(Ordering::Acquire)
        );
    }

    fn asked(t: &mut GrantTable, rkey: u32) {
        t.asked(rkey);
    }

    /// What a hostile responder may send as a grant is checked before anything is mapped.
    #[test]
    fn bad_grants_are_refused() {
        let life = || Some(memfd(PAGE, true));
        let w = (AccessFlags::REMOTE_WRITE).bits();
        let mut t = GrantTable::default();
        // Not asked for.
        assert!(t.insert(1, w, 0, 8, 2 * PAGE as u64, Some(memfd(2 * PAGE, true)), life()).is_err());
        // A file that may shrink.
        asked(&mut t, 2);
        assert!(t.insert(2, w, 0, 8, 2 * PAGE as u64, Some(memfd(2 * PAGE, false)), life()).is_err());
        // A file of another size than stated.
        asked(&mut t, 3);
        assert!(t.insert(3, w, 0, 8, 2 * PAGE as u64, Some(memfd(3 * PAGE, true)), life()).is_err());
        // A range past the file's data pages.
        asked(&mut t, 4);
        assert!(
            t.insert(4, w, 0, PAGE as u64 + 1, 2 * PAGE as u64, Some(memfd(2 * PAGE, true)), life()).is_err()
        );
        // A grant with no memfd, a refusal with one, a grant with no life page.
        asked(&mut t, 5);
        assert!(t.insert(5, w, 0, 8, 2 * PAGE as u64, None, life()).is_err());
        asked(&mut t, 6);
        assert!(t.insert(6, 0, 0, 8, 2 * PAGE as u64, Some(memfd(2 * PAGE, true)), life()).is_err());
        asked(&mut t, 7);
        assert!(t.insert(7, w, 0, 8, 2 * PAGE as u64, Some(memfd(2 * PAGE, true)), None).is_err());
        // One of our own regions handed back.
        let own = RegionFile::create(8).expect("a region file");
        asked(&mut t, 8);
        let dup = own.fd().try_clone().unwrap();
        assert!(t.insert(8, w, 0, 8, own.map_len() as u64, Some(dup), life()).is_err());
        // A refusal is taken, once.
        asked(&mut t, 9);
        t.insert(9, 0, 0, 0, 0, None, None).unwrap();
        assert!(t.insert(9, 0, 0, 0, 0, None, None).is_err());
        assert_eq!(t.target(9, 0, 8, AccessFlags::REMOTE_WRITE).err(), Some(Miss::Ring));
        assert!(t.grants.is_empty());
    }

    /// A good grant maps the region; accesses are checked against its access, bounds, the
    /// alive word and the peer's life word.
    #[test]
    fn a_grant_is_checked_on_every_access() {
        let region = RegionFile::create(100).expect("a region file");
        // Pose as another process's region: forget it is ours.
        OURS.lock().unwrap().retain(|&o| o != region.id);
        let life = memfd(PAGE, true);
        let life_base = map_shared(&life, PAGE).unwrap();
        // SAFETY: mapped above, never unmapped in this test.
        let life_word = unsafe { &*life_base.as_ptr().cast::<AtomicU64>() };
        life_word.store(1234, Ordering::Release);
        let mut t = GrantTable::default();
        assert_eq!(t.target(7, 1000, 8, AccessFlags::REMOTE_READ).err(), Some(Miss::Ask));
        t.asked(7);
        assert!(matches!(t.target(7, 1000, 8, AccessFlags::REMOTE_READ).err(), Some(Miss::Wait(_))));
        let fd = region.fd().try_clone().unwrap();
        let read = AccessFlags::REMOTE_READ.bits();
        t.insert(7, read, 1000, 100, region.map_len() as u64, Some(fd), Some(life.try_clone().unwrap()))
            .unwrap();
        assert!(t.target(7, 1000, 100, AccessFlags::REMOTE_READ).is_ok());
        assert!(t.target(7, 1092, 8, AccessFlags::REMOTE_READ).is_ok());
        assert_eq!(t.target(7, 1093, 8, AccessFlags::REMOTE_READ).err(), Some(Miss::Ring), "past the end");
        assert_eq!(t.target(7, 999, 8, AccessFlags::REMOTE_READ).err(), Some(Miss::Ring), "before the start");
        assert_eq!(t.target(7, u64::MAX, 8, AccessFlags::REMOTE_READ).err(), Some(Miss::Ring), "wrapping");
        assert_eq!(t.target(7, 1000, 8, AccessFlags::REMOTE_WRITE).err(), Some(Miss::Ring), "not granted");
        life_word.store(1234 | libc::FUTEX_OWNER_DIED as u64, Ordering::Release);
        assert_eq!(t.target(7, 1000, 8, AccessFlags::REMOTE_READ).err(), Some(Miss::Ring), "peer died");
        life_word.store(1234, Ordering::Release);
        region.revoke();
        assert_eq!(t.target(7, 1000, 8, AccessFlags::REMOTE_READ).err(), Some(Miss::Ring), "deregistered");
        // SAFETY: mapped above; nothing refers to it any more.
        unsafe { libc::munmap(life_base.as_ptr().cast(), PAGE) };
    }
}
