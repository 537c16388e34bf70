//! Direct placement between processes of one host: a requester maps the target region
//! itself and places its RDMA writes (and takes its reads) with one copy, on its own
//! thread, without waking the responder's loop.
//!
//! Through the rings (`super::shm`) a write's bytes are copied twice (region → ring →
//! region) and each hop wakes a thread of the other process: an 8-byte write round trip
//! between two processes took about 15 µs against 0.2 µs in one. Here:
//! - a region allocated by rdmakit for remote access ([`ProtectionDomain::alloc_mr`]) on a
//!   soft device with the same-host path on lives in its own sealed memfd (not the heap),
//!   and owns a slot of the process's *status file*, which holds the slot's registration
//!   tag while the region is registered (0 after);
//! - the status file's first word is the *life word*: the thread id of the wire's loop,
//!   registered with the kernel as a robust futex of that thread, which the kernel marks
//!   (`FUTEX_OWNER_DIED`) when the thread ends, as every thread does when its process dies
//!   however it dies;
//! - a requester QP linked through rings, once its responder opened the gate (in the
//!   rings' control page: the responder knows direct placement, and its QP serves this
//!   link), asks for a key it writes to or reads from (`KeyRequest`); the responder's NIC
//!   checks the key as it checks a request (a plain region of this process in a memfd, of
//!   the QP's PD, remote write or read allowed by both the region and the QP) and passes
//!   the region's memfd (opened read-only when the grant is read-only) and a read-only
//!   descriptor of its status file on the link's Unix socket, then answers with the range,
//!   the access and the slot and tag (`KeyGrant`);
//! - the requester checks both files (shared memory of tmpfs, sealed against shrinking, of
//!   the stated size, not one of its own) and maps them: the region read-write only for a
//!   write grant, the status file read-only, after checking the region file is the one the
//!   grant names (its inode: descriptors and frames are paired by their order on the socket
//!   alone, and a link that ever drops a descriptor takes no more grants);
//! - from then on a plain write or read of that key, when nothing the QP sent through the
//!   ring is still unanswered (RC order), is checked against the grant (access, bounds), the
//!   gate, the life word and the region's slot (still its tag), then copied, and completes
//!   at once. A grant whose slot no longer holds its tag is dropped (unmapped). Anything
//!   else goes through the ring as before, where the responder answers with the status a
//!   NIC gives.
//!
//! **What a grant costs in isolation.** A peer granted a key for writing can write the
//! region's pages until the region is deregistered, whatever its QP does (the gate and the
//! status words are honoured by rdmakit, not enforced by the kernel). No peer can write the
//! status file, nor a region registered without remote write: both are sealed against new
//! writable mappings (`F_SEAL_FUTURE_WRITE`), whatever descriptor a peer reopens. A
//! read-only grant of a region registered with remote write (the QP allows only reads) is
//! passed and mapped read-only, but the peer could reopen it for writing: that limit is
//! honoured by rdmakit, not enforced by the kernel; likewise a write grant passes the
//! region's read-write file, which the peer could also read. Grants go only to the QP the
//! region's PD and access flags admit, over a link whose peer proved it is the connected QP
//! and runs as this user (checked by the device when it accepts the connection: another
//! user could reopen a region file beyond its grant, since a memfd's inode is mode 0777; a
//! process of this user could already read and write this process's memory through
//! `/proc`, unless a ptrace policy such as Yama's forbids it). After deregistration the region's
//! pages are never used again by this process (each region has its own memfd): a late
//! write lands in pages nobody reads, which stay allocated while a peer maps them.
//! There is a window between a requester's checks and its copy: a write racing the
//! responder's death or deregistration may land after it, as a NIC's write in flight does.
//!
//! **Limits.** Each such region holds a descriptor and a mapping: at most a quarter of the
//! process's descriptor limit, a quarter of `vm.max_map_count` and 65535 go to them (the
//! rest are heap-allocated as before and use the rings). A link keeps at most
//! `MAX_GRANTS` (64) grants and asks for at most two at a time, and remembers up to 4096
//! refused keys; a device gives at most 64 grants per connection over its life. Peers'
//! files mapped here (grants, status files) share the region files' budget, and the bytes
//! grants map, each exactly the pages of the region it names, total at most the host's
//! physical memory (a sparse file commits nothing, so without that bound a hostile peer
//! could take the address space). After `fork`
//! a child shares such a region's pages instead of getting a copy, and uses neither the
//! status file nor direct placement (it is not the process that made them).
//!
//! [`ProtectionDomain::alloc_mr`]: crate::ProtectionDomain::alloc_mr

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::types::AccessFlags;

/// Bytes of a page.
pub(crate) const PAGE: usize = 4096;

/// Grants one link keeps, and one served connection gives over its life.
pub const MAX_GRANTS: usize = 64;

/// Grants one link waits for at once (each brings two descriptors: see `shm`'s stash).
const MAX_UNANSWERED: usize = 2;

/// Region slots in a status file (slot 0 unused).
const SLOTS: usize = 65536;

/// Bytes of a status file: the life word's page, then one 8-byte word per slot.
pub(crate) const STATUS_LEN: usize = PAGE + SLOTS * 8;

/// Largest direct access the wire's loop makes itself when a grant or an answer lets a
/// held request go; larger ones go to the timer thread, so that a bulk copy does not hold
/// every other connection of the process.
pub(crate) const LOOP_COPY_MAX: u32 = 16 * 1024;

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

/// How many region files this process may hold: each is a descriptor and a mapping, which
/// must not starve the application, the sockets and the rings of either.
fn file_budget() -> usize {
    static BUDGET: OnceLock<usize> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes into the local it is given.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut r) } != 0 {
            return 0;
        }
        let fds = usize::try_from(r.rlim_cur / 4).unwrap_or(usize::MAX);
        let maps = std::fs::read_to_string("/proc/sys/vm/max_map_count")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(65530);
        fds.min(maps / 4).min(SLOTS - 1)
    })
}

/// The (device, inode) of files this process made (region and status files): a peer
/// handing one back as a grant must not get this process writing its own memory through a
/// second mapping.
static OURS: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());

pub(crate) fn file_id(fd: &OwnedFd) -> io::Result<(libc::stat, (u64, u64))> {
    // SAFETY: zeroed `stat` is valid; fstat writes into it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a live local of the right type; `fd` is open.
    if unsafe { libc::fstat(fd.as_raw_fd(), &raw mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let id = (st.st_dev, st.st_ino);
    Ok((st, id))
}

/// A memfd of `len` bytes sealed against shrinking and growing (a peer mapping it can
/// never fault on pages cut from under it, nor can we); [`seal_final`] ends its sealing.
pub(crate) fn sealed_memfd(name: &std::ffi::CStr, len: usize) -> io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated name; valid flags.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor, now owned.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let size = libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: plain calls on a descriptor we own.
    unsafe {
        if libc::ftruncate(fd.as_raw_fd(), size) != 0 {
            return Err(io::Error::last_os_error());
        }
        if libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(fd)
}

/// Seals `fd` for good, against any new writable mapping or write too when `read_only`
/// (`F_SEAL_FUTURE_WRITE`: the mappings this process made already keep writing; no peer
/// can get a writable one, whatever descriptor it reopens), and records it as ours.
fn seal_final(fd: &OwnedFd, read_only: bool) -> io::Result<()> {
    let mut seals = libc::F_SEAL_SEAL;
    if read_only {
        seals |= libc::F_SEAL_FUTURE_WRITE;
    }
    // SAFETY: fcntl on a descriptor we own.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let (_, id) = file_id(fd)?;
    OURS.lock().expect("our files").push(id);
    Ok(())
}

/// A read-only descriptor of the file `fd` is open on (through `/proc/self/fd`): what a
/// peer that may only read gets.
fn reopen_read_only(fd: &OwnedFd) -> io::Result<OwnedFd> {
    let path = std::ffi::CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).expect("no NUL");
    // SAFETY: a NUL-terminated path; valid flags.
    let ro = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if ro < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor, now owned.
    Ok(unsafe { OwnedFd::from_raw_fd(ro) })
}

pub(crate) fn map_shared(fd: &OwnedFd, len: usize, writable: bool) -> io::Result<NonNull<u8>> {
    let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
    // SAFETY: a fresh shared mapping chosen by the kernel; nothing else is at that address.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(NonNull::new(p.cast()).expect("mmap does not return null on success"))
}

// ---- this process's status file ----

/// This process's status file, mapped for the rest of the process.
struct Status {
    /// Read-only descriptor, passed with every grant.
    ro: OwnedFd,
    base: NonNull<u8>,
    /// The process that made it: a child after `fork` shares the mapping and must not use
    /// it (its regions would write the parent's slots).
    pid: u32,
}

// SAFETY: the mapping lives for the rest of the process and is reached only through
// atomics; the descriptor is plain data.
unsafe impl Send for Status {}
// SAFETY: as above.
unsafe impl Sync for Status {}

static STATUS: OnceLock<Option<Status>> = OnceLock::new();

/// The status file, made on first use; `None` without one (Miri, or the system refused).
fn status() -> Option<&'static Status> {
    let st = STATUS
        .get_or_init(|| {
            if cfg!(miri) {
                return None;
            }
            let make = || -> io::Result<Status> {
                let fd = sealed_memfd(c"rdmakit-soft-status", STATUS_LEN)?;
                let base = map_shared(&fd, STATUS_LEN, true)?;
                // Written only through this mapping (and by the kernel at the loop
                // thread's end): no peer can map it writable, whatever it reopens.
                match seal_final(&fd, true).and_then(|()| reopen_read_only(&fd)) {
                    Ok(ro) => Ok(Status { ro, base, pid: std::process::id() }),
                    Err(e) => {
                        // SAFETY: mapped just above; nothing refers to it yet.
                        unsafe { libc::munmap(base.as_ptr().cast(), STATUS_LEN) };
                        Err(e)
                    }
                }
            };
            make()
                .map_err(|e| tracing::debug!(error = %e, "soft NIC: no status file; no direct placement"))
                .ok()
        })
        .as_ref()?;
    (st.pid == std::process::id()).then_some(st)
}

impl Status {
    /// The life word (the kernel's futex word: 32 bits).
    fn life(&self) -> &AtomicU32 {
        // SAFETY: the file's first word, mapped for good, 8-aligned.
        unsafe { &*self.base.as_ptr().cast::<AtomicU32>() }
    }

    fn slot(&self, slot: u32) -> &AtomicU64 {
        debug_assert!((1..SLOTS as u32).contains(&slot));
        // SAFETY: within the mapping (slot < SLOTS), 8-aligned.
        unsafe { &*self.base.as_ptr().add(PAGE + 8 * slot as usize).cast::<AtomicU64>() }
    }
}

/// Free status slots and the next never used.
struct Slots {
    free: Vec<u32>,
    next: u32,
}

static SLOT_TABLE: Mutex<Slots> = Mutex::new(Slots { free: Vec::new(), next: 1 });

/// Registration tags: never 0, never reused, so a grant's slot taken again by another
/// region does not pass for its own.
static NEXT_TAG: AtomicU64 = AtomicU64::new(1);

fn take_slot() -> Option<u32> {
    let mut t = SLOT_TABLE.lock().expect("status slots");
    if let Some(s) = t.free.pop() {
        return Some(s);
    }
    let s = t.next;
    if (s as usize) < SLOTS {
        t.next += 1;
        Some(s)
    } else {
        None
    }
}

/// Whether a life word says its process lives: a thread id, and no `FUTEX_OWNER_DIED`.
fn lives(w: u32) -> bool {
    w & libc::FUTEX_TID_MASK != 0 && w & libc::FUTEX_OWNER_DIED == 0
}

// ---- region files ----

/// A region's memory in its own sealed memfd (its `len` bytes rounded up to pages), with a
/// slot of the status file holding its tag while registered. Unmapped, its slot cleared
/// first, on drop.
pub(crate) struct RegionFile {
    fd: OwnedFd,
    base: NonNull<u8>,
    map_len: usize,
    id: (u64, u64),
    slot: u32,
    tag: u64,
}

// SAFETY: the mapping is owned by this value; its bytes are reached only through raw
// pointers with `shared_mem` copies or atomics (the region's rules), from any thread.
unsafe impl Send for RegionFile {}
// SAFETY: as above; `&RegionFile` exposes the pointer, the length and atomic words.
unsafe impl Sync for RegionFile {}

impl RegionFile {
    /// A file for a region of `len` bytes, or `None` when the budget is spent or the system
    /// refuses (the caller uses the heap).
    /// `peers_write`: whether the region takes remote writes; if not, its file is sealed so
    /// that no peer can ever map it writable.
    pub(crate) fn create(len: usize, peers_write: bool) -> Option<RegionFile> {
        let status = status()?;
        let map_len = len.max(1).checked_next_multiple_of(PAGE)?;
        if FILES.fetch_add(1, Ordering::AcqRel) >= file_budget() {
            FILES.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        let Some(slot) = take_slot() else {
            FILES.fetch_sub(1, Ordering::AcqRel);
            return None;
        };
        let made = sealed_memfd(c"rdmakit-soft-region", map_len).and_then(|fd| {
            let base = map_shared(&fd, map_len, true)?;
            match seal_final(&fd, !peers_write).and_then(|()| file_id(&fd)) {
                Ok((_, id)) => Ok((fd, base, id)),
                Err(e) => {
                    // SAFETY: mapped just above; nothing refers to it yet.
                    unsafe { libc::munmap(base.as_ptr().cast(), map_len) };
                    if let Ok((_, id)) = file_id(&fd) {
                        OURS.lock().expect("our files").retain(|&o| o != id);
                    }
                    Err(e)
                }
            }
        });
        match made {
            Ok((fd, base, id)) => {
                let tag = NEXT_TAG.fetch_add(1, Ordering::Relaxed);
                status.slot(slot).store(tag, Ordering::Release);
                Some(RegionFile { fd, base, map_len, id, slot, tag })
            }
            Err(e) => {
                SLOT_TABLE.lock().expect("status slots").free.push(slot);
                FILES.fetch_sub(1, Ordering::AcqRel);
                tracing::debug!(error = %e, len, "soft NIC: no memfd for a region; heap memory, rings only");
                None
            }
        }
    }

    /// The region's first byte (page-aligned; the file's pages are zero-filled).
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub(crate) fn map_len(&self) -> usize {
        self.map_len
    }

    /// The status slot and the tag it holds while the region is registered.
    pub(crate) fn slot_tag(&self) -> (u32, u64) {
        (self.slot, self.tag)
    }

    /// The file's inode (a grant names it, so that the requester checks what it maps).
    pub(crate) fn ino(&self) -> u64 {
        self.id.1
    }

    /// A descriptor for a peer granted `access`: the file itself to write, read-only
    /// otherwise.
    pub(crate) fn fd_for(&self, access: AccessFlags) -> io::Result<OwnedFd> {
        if access.contains(AccessFlags::REMOTE_WRITE) {
            self.fd.try_clone()
        } else {
            reopen_read_only(&self.fd)
        }
    }

    /// Tells every peer that mapped the region that it is gone (deregistration).
    pub(crate) fn revoke(&self) {
        if let Some(st) = status() {
            let _ = st.slot(self.slot).compare_exchange(self.tag, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
    }
}

impl Drop for RegionFile {
    fn drop(&mut self) {
        self.revoke();
        // SAFETY: mapped by `create` with this length; the region owning this file is being
        // dropped, so nothing of this process refers to the mapping any more.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.map_len) };
        OURS.lock().expect("our files").retain(|&o| o != self.id);
        SLOT_TABLE.lock().expect("status slots").free.push(self.slot);
        FILES.fetch_sub(1, Ordering::AcqRel);
    }
}

// ---- the life word ----
//
// A write placed into a region of a process that has died would complete with success,
// where a NIC gives `RETRY_EXC_ERR` (no ACK comes); the wire's loop notices the end of the
// link only some time later. So the status file's first word holds the thread id of the
// wire's loop, registered with the kernel as a robust futex of that thread
// (`set_robust_list`). A requester reads the word before each direct access: one load of a
// line nobody writes. The list the kernel walks at the thread's exit lives in this
// process's private memory (only the word it names is shared, and read-only to peers), so
// no peer can steer it.

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

/// Whether the wire's loop thread watches the life word (then grants may be given).
static WATCHED: AtomicBool = AtomicBool::new(false);

/// Called by the wire's loop thread as it starts: registers the life word as a robust
/// futex of this thread. Without it (an error, or Miri) keys are not granted and
/// everything goes through the rings.
pub(crate) fn watch_loop_thread() {
    let Some(st) = status() else { return };
    if WATCHED.load(Ordering::Acquire) {
        return;
    }
    // SAFETY: the status file is mapped for the rest of the process; one wire loop per
    // process calls this, once (`WATCHED`), so `ROBUST` serves one thread.
    match unsafe { watch_word(st.life(), &ROBUST) } {
        Ok(()) => WATCHED.store(true, Ordering::Release),
        Err(e) => tracing::debug!(error = %e, "soft NIC: no robust futex; no direct placement"),
    }
}

/// This process's status file (read-only) to pass with a grant; `None`: no grants.
pub(crate) fn status_fd() -> Option<&'static OwnedFd> {
    WATCHED.load(Ordering::Acquire).then(|| status().map(|s| &s.ro)).flatten()
}

// ---- the requester's side ----

/// Mappings of peers' files (grants and status files) alive in this process, against the
/// same budget as region files: many links must not exhaust `vm.max_map_count`.
static MAPPED: AtomicUsize = AtomicUsize::new(0);

/// Takes one mapping from the budget; false when it is spent.
fn take_mapping() -> bool {
    if MAPPED.fetch_add(1, Ordering::AcqRel) >= file_budget() {
        MAPPED.fetch_sub(1, Ordering::AcqRel);
        return false;
    }
    true
}

/// The largest region a grant may map (a hostile peer's sparse file must not take the
/// address space).
const MAX_GRANT_MAP: u64 = 1 << 40;

/// Bytes of peers' region files mapped in this process by grants. Mapping a shared file
/// commits no memory, so without this bound a hostile responder could answer every ask
/// with a huge sparse file and take the address space, until this process's own
/// allocations fail; see [`grant_bytes_budget`].
static MAPPED_BYTES: AtomicU64 = AtomicU64::new(0);

/// The most bytes grants may map at once in this process: the host's physical memory (at
/// least 1 GiB). Honest peers' regions are memory of this host, so they fit; beyond it a
/// grant is refused and its key stays on the rings.
fn grant_bytes_budget() -> u64 {
    static BUDGET: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *BUDGET.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let (pages, size) =
            unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
        let ram = u64::try_from(pages).ok().zip(u64::try_from(size).ok()).map(|(p, s)| p.saturating_mul(s));
        ram.unwrap_or(0).max(1 << 30)
    })
}

/// Takes `n` bytes from the grants' budget; false when they are not there.
fn take_grant_bytes(n: u64) -> bool {
    MAPPED_BYTES
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
            used.checked_add(n).filter(|&u| u <= grant_bytes_budget())
        })
        .is_ok()
}

/// A region of the peer, mapped here by a grant.
struct Grant {
    rkey: u32,
    access: AccessFlags,
    addr: u64,
    len: u64,
    base: NonNull<u8>,
    map_len: usize,
    slot: u32,
    tag: u64,
}

// SAFETY: the mapping is owned by the grant; its bytes are reached only through
// `shared_mem` copies, from any thread.
unsafe impl Send for Grant {}
// SAFETY: as above; `&Grant` exposes plain data and the mapping's address.
unsafe impl Sync for Grant {}

impl Drop for Grant {
    fn drop(&mut self) {
        // SAFETY: mapped by `GrantTable::take` with this length; the last holder (the
        // table, or a copy in progress through a `Target`) is gone.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.map_len) };
        MAPPED.fetch_sub(1, Ordering::AcqRel);
        MAPPED_BYTES.fetch_sub(self.map_len as u64, Ordering::AcqRel);
    }
}

/// The peer's status file, mapped here read-only.
struct PeerStatus {
    base: NonNull<u8>,
}

impl PeerStatus {
    fn lives(&self) -> bool {
        // SAFETY: the mapping (STATUS_LEN bytes) lives while `self` does; its first word,
        // changed by the peer and the kernel only atomically.
        lives(unsafe { &*self.base.as_ptr().cast::<AtomicU32>() }.load(Ordering::Acquire))
    }

    fn slot(&self, slot: u32) -> u64 {
        debug_assert!((1..SLOTS as u32).contains(&slot));
        // SAFETY: within the mapping (checked slot), 8-aligned, changed only atomically.
        unsafe { &*self.base.as_ptr().add(PAGE + 8 * slot as usize).cast::<AtomicU64>() }
            .load(Ordering::Acquire)
    }
}

impl Drop for PeerStatus {
    fn drop(&mut self) {
        // SAFETY: mapped by `GrantTable::insert` with this length; dropped under the table's
        // lock, which every check through it holds.
        unsafe { libc::munmap(self.base.as_ptr().cast(), STATUS_LEN) };
        MAPPED.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a requester link knows of its peer's keys: grants (mapped regions), the keys asked
/// for (answered or not), and the peer's status file.
#[derive(Default)]
pub(crate) struct GrantTable {
    grants: Vec<std::sync::Arc<Grant>>,
    asked: Vec<Ask>,
    /// Keys refused (or whose grant was not taken), not asked for again; the oldest are
    /// forgotten beyond [`MAX_REFUSED`].
    refused: std::collections::VecDeque<u32>,
    /// The same keys, looked up on every access to a key without a grant.
    refused_set: rustc_hash::FxHashSet<u32>,
    status: Option<PeerStatus>,
}

/// Refused keys a link remembers.
const MAX_REFUSED: usize = 4096;

// SAFETY: the grants' mappings are owned by the table and reached only under its lock
// (`Mutex<GrantTable>`), through `shared_mem` copies and atomics.
unsafe impl Send for GrantTable {}

/// A key asked for and not answered yet.
struct Ask {
    rkey: u32,
    /// When the ask went; accesses to the key wait for the answer until [`GRANT_WAIT`]
    /// after it.
    at: Instant,
}

/// How long accesses to a key wait for the answer to the grant asked for it before they
/// go through the ring (a peer that does not answer costs this, once per key).
pub(crate) const GRANT_WAIT: Duration = Duration::from_millis(20);

/// Why an access is not placed directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Miss {
    /// No grant and none asked for: ask.
    Ask,
    /// Asked, not answered yet: wait until then for it.
    Wait(Instant),
    /// Through the ring (refused, no room for more grants, outside the grant, revoked).
    Ring,
}

/// Where a direct access goes; holds the grant's mapping while the copy runs, outside
/// the table's lock (which the wire's loop takes to add grants).
pub(crate) struct Target {
    pub ptr: *mut u8,
    _grant: std::sync::Arc<Grant>,
}

/// Checks a passed descriptor is shared memory (tmpfs: a hugetlbfs file could fault when
/// its pool runs dry) of exactly `len` bytes sealed against shrinking (so a mapping of it
/// can never fault), and not one of this process's own files.
fn check_file(fd: &OwnedFd, len: usize) -> io::Result<()> {
    let id = check_sealed(fd, len, "a granted file")?;
    if is_any_of_ours(id) {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "a granted file of our own"));
    }
    Ok(())
}

/// Whether the file with identity `id` (device, inode) is one this process made: a region
/// file, a link's rings, or a flag page. A peer handing one back (it may hold one through a
/// grant or its own link) must not have this process use its own memory as the peer's:
/// every descriptor a peer passes is checked against all three.
pub(crate) fn is_any_of_ours(id: (u64, u64)) -> bool {
    // One lock at a time (a guard in a `||` chain would live to the end of it).
    let region = OURS.lock().expect("our files").contains(&id);
    region || super::shm::is_ours(id) || super::flags::is_made(id)
}

/// Checks a descriptor a peer passed is shared memory (tmpfs: a hugetlbfs file could fault
/// when its pool runs dry) of exactly `len` bytes sealed against shrinking (so a mapping of
/// it can never fault); returns its identity (device, inode). The error says which check
/// failed, after `what` (what the descriptor was passed as).
pub(crate) fn check_sealed(fd: &OwnedFd, len: usize, what: &str) -> io::Result<(u64, u64)> {
    let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, format!("{what} {why}"));
    // SAFETY: fcntl on a descriptor we own; F_GET_SEALS fails on anything but a memfd.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(bad("that may shrink"));
    }
    // SAFETY: zeroed `statfs` is valid; fstatfs writes into it.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `fs` is a live local of the right type; `fd` is open.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &raw mut fs) } != 0 || fs.f_type != libc::TMPFS_MAGIC {
        return Err(bad("not in shared memory"));
    }
    let (st, id) = file_id(fd)?;
    if (st.st_mode & libc::S_IFMT) != libc::S_IFREG || st.st_size as u64 != len as u64 {
        return Err(bad("of another size"));
    }
    Ok(id)
}

impl GrantTable {
    /// The local address of `addr..addr + len` of key `rkey` if a live grant allows
    /// `need` there. A grant whose region is gone is dropped here (unmapped once no copy
    /// runs through it).
    pub(crate) fn target(
        &mut self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<Target, Miss> {
        let Some(i) = self.grants.iter().position(|g| g.rkey == rkey) else {
            let unanswered = self.asked.len();
            return Err(match self.asked.iter().find(|a| a.rkey == rkey) {
                Some(a) if a.at.elapsed() < GRANT_WAIT => Miss::Wait(a.at + GRANT_WAIT),
                Some(_) => Miss::Ring,
                None if self.refused_set.contains(&rkey) => Miss::Ring,
                None if unanswered < MAX_UNANSWERED && self.grants.len() + unanswered < MAX_GRANTS => {
                    Miss::Ask
                }
                None => Miss::Ring,
            });
        };
        let Some(status) = &self.status else { return Err(Miss::Ring) };
        if !status.lives() {
            return Err(Miss::Ring);
        }
        let g = &self.grants[i];
        if status.slot(g.slot) != g.tag {
            // Deregistered: unmapped (its pages may then be freed), and asked for again if
            // the key is ever used (and refused).
            self.grants.swap_remove(i);
            return Err(Miss::Ring);
        }
        if !g.access.contains(need) {
            return Err(Miss::Ring);
        }
        let off = match addr.checked_sub(g.addr) {
            Some(off) if off.checked_add(len).is_some_and(|end| end <= g.len) => off,
            _ => return Err(Miss::Ring),
        };
        // `off + len <= g.len <= map_len`: inside the mapping.
        Ok(Target { ptr: g.base.as_ptr().wrapping_add(off as usize), _grant: g.clone() })
    }

    /// Records that `rkey` was asked for now; returns when accesses stop waiting for it.
    pub(crate) fn asked(&mut self, rkey: u32) -> Instant {
        let at = Instant::now();
        if !self.asked.iter().any(|a| a.rkey == rkey) {
            self.asked.push(Ask { rkey, at });
        }
        at + GRANT_WAIT
    }

    /// Whether an ask for `rkey` is unanswered.
    pub(crate) fn is_asked(&self, rkey: u32) -> bool {
        self.asked.iter().any(|a| a.rkey == rkey)
    }

    /// Forgets an ask that could not be sent (asked again later).
    pub(crate) fn unask(&mut self, rkey: u32) {
        self.asked.retain(|a| a.rkey != rkey);
    }

    /// Remembers a key not to ask for again (the oldest forgotten beyond [`MAX_REFUSED`]:
    /// asked again, and refused again).
    fn refuse(&mut self, rkey: u32) {
        if !self.refused_set.insert(rkey) {
            return;
        }
        if self.refused.len() >= MAX_REFUSED
            && let Some(old) = self.refused.pop_front()
        {
            self.refused_set.remove(&old);
        }
        self.refused.push_back(rkey);
    }

    /// Takes the answer to the ask for `rkey`: a grant (`fd` the region's memfd, `status`
    /// the peer's status file) is checked and mapped; anything else, or anything that does
    /// not check out (a refusal, missing or bad files, no room to map them here), leaves the
    /// key on the ring. `Err` says why it was not taken, for the log; nothing a peer sends
    /// here ends the link.
    pub(crate) fn insert(
        &mut self,
        grant: GrantMsg,
        fd: Option<OwnedFd>,
        status: Option<OwnedFd>,
    ) -> io::Result<()> {
        let rkey = grant.rkey;
        let Some(i) = self.asked.iter().position(|a| a.rkey == rkey) else {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a grant nobody asked for"));
        };
        // Answered, whatever comes of it.
        self.asked.swap_remove(i);
        let taken = self.take(grant, fd, status);
        if !matches!(taken, Ok(true)) {
            self.refuse(rkey);
        }
        taken.map(|_| ())
    }

    /// [`insert`](Self::insert) once the ask is answered: `Ok(true)` if the grant was
    /// taken.
    fn take(&mut self, grant: GrantMsg, fd: Option<OwnedFd>, status: Option<OwnedFd>) -> io::Result<bool> {
        let GrantMsg { rkey, access, addr, len, map_len, slot, tag, ino } = grant;
        let access =
            AccessFlags::from_bits_truncate(access) & (AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ);
        if access.is_empty() {
            return Ok(false);
        }
        let (Some(fd), Some(status)) = (fd, status) else {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a grant without its files"));
        };
        // Exactly the region's pages, as the device makes its region files: a grant that
        // maps more than it names only takes address space.
        let map = usize::try_from(map_len).ok().filter(|_| {
            map_len <= MAX_GRANT_MAP
                && addr.checked_add(len).is_some()
                && len.max(1).checked_next_multiple_of(PAGE as u64) == Some(map_len)
        });
        let (Some(map_len), true) = (map, (1..SLOTS as u32).contains(&slot) && tag != 0) else {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a grant of a bad size or slot"));
        };
        check_file(&fd, map_len)?;
        // The file is the region the grant names: the descriptors and the frame are paired
        // by their order on the socket alone.
        if file_id(&fd)?.0.st_ino != ino {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a granted file that is not the region"));
        }
        let over = || io::Error::new(io::ErrorKind::OutOfMemory, "the budget of peers' mappings is spent");
        if self.status.is_none() {
            check_file(&status, STATUS_LEN)?;
            if !take_mapping() {
                return Err(over());
            }
            match map_shared(&status, STATUS_LEN, false) {
                Ok(base) => self.status = Some(PeerStatus { base }),
                Err(e) => {
                    MAPPED.fetch_sub(1, Ordering::AcqRel);
                    return Err(e);
                }
            }
        }
        if !take_grant_bytes(map_len as u64) {
            return Err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                "the budget of bytes peers may map is spent",
            ));
        }
        if !take_mapping() {
            MAPPED_BYTES.fetch_sub(map_len as u64, Ordering::AcqRel);
            return Err(over());
        }
        let base = match map_shared(&fd, map_len, access.contains(AccessFlags::REMOTE_WRITE)) {
            Ok(b) => b,
            Err(e) => {
                MAPPED.fetch_sub(1, Ordering::AcqRel);
                MAPPED_BYTES.fetch_sub(map_len as u64, Ordering::AcqRel);
                return Err(e);
            }
        };
        // The descriptors are not needed once mapped.
        drop((fd, status));
        self.grants.push(std::sync::Arc::new(Grant { rkey, access, addr, len, base, map_len, slot, tag }));
        Ok(true)
    }
}

/// The fields of a `KeyGrant` frame.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GrantMsg {
    pub rkey: u32,
    pub access: u32,
    pub addr: u64,
    pub len: u64,
    pub map_len: u64,
    pub slot: u32,
    pub tag: u64,
    /// The region file's inode.
    pub ino: u64,
}

/// Writes this thread's id into `word` and registers it, through the list storage `r`,
/// as a robust futex of this thread: the kernel sets `FUTEX_OWNER_DIED` in it when the
/// thread exits. Replaces glibc's list for this thread, which must hold no robust pthread
/// mutexes.
///
/// # Safety
/// `word` must stay mapped (8-aligned, readable and writable) for the rest of the process,
/// and `r` must be used for no other thread.
unsafe fn watch_word(word: *const AtomicU32, r: &'static Robust) -> io::Result<()> {
    // SAFETY: gettid(2) has no preconditions.
    let tid = unsafe { libc::gettid() } as u32;
    // SAFETY: valid per the contract.
    unsafe { (*word).store(tid, Ordering::Release) };
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
        let base = map_shared(&page, PAGE, true).unwrap();
        let word = base.as_ptr().cast::<AtomicU32>() as usize;
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            // SAFETY: the page is mapped for the rest of the test process (never unmapped);
            // `R` serves this thread only.
            unsafe { watch_word(word as *const AtomicU32, &R).unwrap() };
            rx.recv().unwrap();
        });
        // SAFETY: mapped above, never unmapped.
        let w = unsafe { &*(word as *const AtomicU32) };
        let end = Instant::now() + Duration::from_secs(10);
        while w.load(Ordering::Acquire) == 0 {
            assert!(Instant::now() < end);
            std::thread::yield_now();
        }
        assert!(lives(w.load(Ordering::Acquire)), "the thread runs");
        tx.send(()).unwrap();
        t.join().unwrap();
        let after = w.load(Ordering::Acquire);
        assert!(!lives(after), "the kernel marked the word: {after:#x}");
    }

    fn ino(fd: &OwnedFd) -> u64 {
        file_id(fd).unwrap().0.st_ino
    }

    fn msg(rkey: u32, access: AccessFlags, len: u64, map_len: usize) -> GrantMsg {
        GrantMsg {
            rkey,
            access: access.bits(),
            addr: 0,
            len,
            map_len: map_len as u64,
            slot: 1,
            tag: 1,
            ino: 0,
        }
    }

    /// A grant message for `fd` (its inode).
    fn msg_for(fd: &OwnedFd, rkey: u32, access: AccessFlags, len: u64, map_len: usize) -> GrantMsg {
        GrantMsg { ino: ino(fd), ..msg(rkey, access, len, map_len) }
    }

    /// What a hostile responder may send as a grant is checked before anything is mapped;
    /// none of it is taken.
    #[test]
    fn bad_grants_are_not_taken() {
        let status = || Some(memfd(STATUS_LEN, true));
        let w = AccessFlags::REMOTE_WRITE;
        let mut t = GrantTable::default();
        // Not asked for.
        assert!(t.insert(msg(1, w, 8, PAGE), Some(memfd(PAGE, true)), status()).is_err());
        let mut bad = |rkey: u32, m: GrantMsg, fd: Option<OwnedFd>, st: Option<OwnedFd>, why: &str| {
            t.asked(rkey);
            assert!(t.insert(m, fd, st).is_err(), "{why}");
            assert_eq!(t.target(rkey, 0, 8, w).err(), Some(Miss::Ring), "{why}: the key stays on the ring");
        };
        let f = memfd(PAGE, false);
        bad(2, msg_for(&f, 2, w, 8, PAGE), Some(f), status(), "a file that may shrink");
        let f = memfd(2 * PAGE, true);
        bad(3, msg_for(&f, 3, w, 8, PAGE), Some(f), status(), "another size than stated");
        let f = memfd(PAGE, true);
        bad(4, msg_for(&f, 4, w, PAGE as u64 + 1, PAGE), Some(f), status(), "a range past the file");
        let f = memfd(2 * PAGE, true);
        bad(14, msg_for(&f, 14, w, 8, 2 * PAGE), Some(f), status(), "a mapping past the region's pages");
        bad(5, msg(5, w, 8, PAGE), None, status(), "no memfd");
        let f = memfd(PAGE, true);
        bad(6, msg_for(&f, 6, w, 8, PAGE), Some(f), None, "no status file");
        let f = memfd(PAGE, true);
        bad(7, msg_for(&f, 7, w, 8, PAGE), Some(f), Some(memfd(PAGE, true)), "a status file too small");
        let f = memfd(PAGE, true);
        bad(8, GrantMsg { slot: 0, ..msg_for(&f, 8, w, 8, PAGE) }, Some(f), status(), "slot 0");
        let f = memfd(PAGE, true);
        let past = GrantMsg { slot: SLOTS as u32, ..msg_for(&f, 9, w, 8, PAGE) };
        bad(9, past, Some(f), status(), "a slot past the file");
        // Another file than the one the grant names (out of step with its frame).
        bad(13, msg(13, w, 8, PAGE), Some(memfd(PAGE, true)), status(), "not the region named");
        // One of our own regions handed back.
        let own = RegionFile::create(8, true).expect("a region file");
        let dup = own.fd.try_clone().unwrap();
        bad(10, msg_for(&dup, 10, w, 8, own.map_len()), Some(dup), status(), "our own region");
        // A file of hugetlbfs (it may fault when its pool runs dry) is refused where the
        // system has one; not shared memory of tmpfs either: a regular file.
        let plain =
            std::fs::File::create(std::env::temp_dir().join(format!("rdmakit-grant-{}", std::process::id())))
                .unwrap();
        plain.set_len(PAGE as u64).unwrap();
        let plain = OwnedFd::from(plain);
        bad(11, msg_for(&plain, 11, w, 8, PAGE), Some(plain), status(), "not shared memory");
        let _ =
            std::fs::remove_file(std::env::temp_dir().join(format!("rdmakit-grant-{}", std::process::id())));
        // A refusal is taken, once, and the key not asked for again.
        t.asked(12);
        t.insert(GrantMsg { access: 0, ..msg(12, w, 0, 0) }, None, None).unwrap();
        assert!(t.insert(GrantMsg { access: 0, ..msg(12, w, 0, 0) }, None, None).is_err());
        assert_eq!(t.target(12, 0, 8, w).err(), Some(Miss::Ring));
        assert!(t.grants.is_empty() && t.status.is_none());
    }

    /// A hostile responder answering asks with huge sparse files (mapping them commits no
    /// memory) takes at most the grants' byte budget of this process's address space: past
    /// it, grants are refused and their keys stay on the rings; bytes come back when a
    /// grant is dropped.
    #[test]
    fn grants_map_at_most_the_byte_budget() {
        let r = AccessFlags::REMOTE_READ;
        let budget = grant_bytes_budget();
        // Two of these do not fit together, whatever small grants other tests hold.
        let half = (budget / 2 + PAGE as u64).next_multiple_of(PAGE as u64);
        let grant = |t: &mut GrantTable, rkey: u32, len: u64| {
            let f = memfd(len as usize, true);
            t.asked(rkey);
            t.insert(msg_for(&f, rkey, r, len, len as usize), Some(f), Some(memfd(STATUS_LEN, true)))
        };
        let mut t = GrantTable::default();
        grant(&mut t, 1, half).expect("half the budget is granted");
        let e = grant(&mut t, 2, half).expect_err("a second half is past the budget");
        assert_eq!(e.kind(), io::ErrorKind::OutOfMemory, "{e}");
        assert_eq!(t.target(2, 0, 8, r).err(), Some(Miss::Ring), "the key stays on the rings");
        // The reviewer's attack: 1 TiB files named for 8-byte keys, or as whole regions.
        if MAX_GRANT_MAP > budget {
            assert!(grant(&mut t, 3, MAX_GRANT_MAP).is_err(), "a 1 TiB region past the budget");
        }
        drop(t);
        let mut t = GrantTable::default();
        grant(&mut t, 1, half).expect("the bytes came back with the grant");
    }

    /// The list storage of the forked child of the life-word test (its own copy).
    static CHILD_ROBUST: Robust = Robust::new();

    /// The life word across processes, against the kernel: the first word of a status file
    /// shared with a child process, watched by the child's thread as the wire's loop watches its own,
    /// says "alive" (the child's thread id) while the child runs, and the kernel marks it
    /// (`FUTEX_OWNER_DIED`) when the child is killed with SIGKILL, which gives it no chance
    /// to say anything. This is what a requester reads before each direct access. (The
    /// cross-process suite cannot catch the life word at work: its requester's loop sees
    /// the link's socket end as soon as the peer dies, and drops the grants.)
    #[test]
    fn the_kernel_marks_a_killed_processs_life_word() {
        // A status file as a process makes its own: the life word is its first word.
        let status_file = memfd(STATUS_LEN, true);
        let st = map_shared(&status_file, STATUS_LEN, true).unwrap();
        let word = st.as_ptr().cast::<AtomicU32>();
        // The child says it is registered in an unused word of the life word's page: the
        // life word itself is written before `set_robust_list`, and a child killed between
        // the two leaves it unmarked (a race of this test, not of the wire's loop, which
        // grants nothing before its registration returned).
        // SAFETY: 8 bytes into the mapping's first page, 4-aligned.
        let registered = unsafe { st.as_ptr().add(8) }.cast::<AtomicU32>();
        // SAFETY: fork(2); the child runs only async-signal-safe code (two stores, two
        // system calls, pause) and never returns from this block.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: `word` stays mapped for the child's life; `CHILD_ROBUST` is used by
            // this thread only (the child's one thread).
            if unsafe { watch_word(word, &CHILD_ROBUST) }.is_err() {
                // SAFETY: ends the child at once, without running the parent's destructors.
                unsafe { libc::_exit(1) };
            }
            // SAFETY: mapped for the child's life; an atomic in shared memory.
            unsafe { (*registered).store(1, Ordering::Release) };
            loop {
                // SAFETY: waits for a signal (the SIGKILL).
                unsafe { libc::pause() };
            }
        }
        // SAFETY: the mapping lives until the munmap below; the child and the kernel change
        // the word only atomically.
        let (w, ready) = unsafe { (&*word, &*registered) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while ready.load(Ordering::Acquire) == 0 && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        // The child's one thread's id is its pid.
        let alive = w.load(Ordering::Acquire);
        let mut status = 0;
        // SAFETY: kill(2) and waitpid(2) on our own child.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
        }
        let dead = w.load(Ordering::Acquire);
        // SAFETY: mapped above, no reference to it is used after this.
        unsafe { libc::munmap(st.as_ptr().cast(), STATUS_LEN) };
        assert!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL,
            "child status {status:#x}"
        );
        assert_eq!(alive, pid as u32, "the watched word holds the child's thread id");
        assert!(lives(alive));
        // The kernel keeps only the waiters bit (none here), clears the id and sets
        // FUTEX_OWNER_DIED (`handle_futex_death`).
        assert_eq!(dead, libc::FUTEX_OWNER_DIED, "the kernel marked the word");
        assert!(!lives(dead));
    }

    /// A grant maps the region (read-only for a read grant); accesses are checked against
    /// its access, bounds, the peer's life word and the region's slot, and a grant whose
    /// slot no longer holds its tag is dropped.
    #[test]
    fn a_grant_is_checked_on_every_access() {
        let region = memfd(PAGE, true);
        let peer_status = memfd(STATUS_LEN, true);
        let st = map_shared(&peer_status, STATUS_LEN, true).unwrap();
        // SAFETY: mapped above (read-write, as the peer has it), unmapped at the end.
        let (life, slot3) = unsafe {
            (&*st.as_ptr().cast::<AtomicU32>(), &*st.as_ptr().add(PAGE + 8 * 3).cast::<AtomicU64>())
        };
        life.store(1234, Ordering::Release);
        slot3.store(99, Ordering::Release);
        let mut t = GrantTable::default();
        let r = AccessFlags::REMOTE_READ;
        assert_eq!(t.target(7, 1000, 8, r).err(), Some(Miss::Ask));
        t.asked(7);
        assert!(matches!(t.target(7, 1000, 8, r).err(), Some(Miss::Wait(_))));
        t.asked(8);
        assert_eq!(t.target(9, 1000, 8, r).err(), Some(Miss::Ring), "two grants awaited at most");
        let m = GrantMsg {
            rkey: 7,
            access: r.bits(),
            addr: 1000,
            len: 100,
            map_len: PAGE as u64,
            slot: 3,
            tag: 99,
            ino: ino(&region),
        };
        t.insert(m, Some(reopen_read_only(&region).unwrap()), Some(reopen_read_only(&peer_status).unwrap()))
            .unwrap();
        assert!(t.target(7, 1000, 100, r).is_ok());
        assert!(t.target(7, 1092, 8, r).is_ok());
        assert_eq!(t.target(7, 1093, 8, r).err(), Some(Miss::Ring), "past the end");
        assert_eq!(t.target(7, 999, 8, r).err(), Some(Miss::Ring), "before the start");
        assert_eq!(t.target(7, u64::MAX, 8, r).err(), Some(Miss::Ring), "wrapping");
        assert_eq!(t.target(7, 1000, 8, AccessFlags::REMOTE_WRITE).err(), Some(Miss::Ring), "not granted");
        life.store(1234 | libc::FUTEX_OWNER_DIED, Ordering::Release);
        assert_eq!(t.target(7, 1000, 8, r).err(), Some(Miss::Ring), "peer died");
        life.store(1234, Ordering::Release);
        assert!(t.target(7, 1000, 8, r).is_ok());
        // The slot taken by another registration: this grant is gone for good.
        slot3.store(100, Ordering::Release);
        assert_eq!(t.target(7, 1000, 8, r).err(), Some(Miss::Ring), "deregistered");
        slot3.store(99, Ordering::Release);
        assert!(t.grants.is_empty(), "a dead grant is dropped");
        assert_eq!(t.target(7, 1000, 8, r).err(), Some(Miss::Ask), "and asked again if used");
        // A read grant's mapping cannot be written: its descriptor is read-only.
        t.asked(7);
        let rw = GrantMsg { access: (r | AccessFlags::REMOTE_WRITE).bits(), ..m };
        assert!(
            t.insert(
                rw,
                Some(reopen_read_only(&region).unwrap()),
                Some(reopen_read_only(&peer_status).unwrap())
            )
            .is_err(),
            "a write grant of a read-only descriptor cannot be mapped"
        );
        // SAFETY: mapped above; the references into it are not used after this.
        unsafe { libc::munmap(st.as_ptr().cast(), STATUS_LEN) };
    }

    /// What no peer can do whatever descriptor it holds: map the status file, or a region
    /// that takes no remote writes, writable (sealed `F_SEAL_FUTURE_WRITE`; a reopen of the
    /// read-only descriptor for writing is refused too).
    #[test]
    fn sealed_files_cannot_be_mapped_writable_by_anyone() {
        let ro_region = RegionFile::create(100, false).expect("a region file");
        let ro = ro_region.fd_for(AccessFlags::REMOTE_READ).unwrap();
        let path =
            |fd: &OwnedFd| std::ffi::CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
        for (fd, len) in [(&ro, ro_region.map_len()), (&status().unwrap().ro, STATUS_LEN)] {
            assert!(map_shared(fd, len, true).is_err(), "mapped writable through the read-only descriptor");
            // SAFETY: a NUL-terminated path; valid flags.
            let rw = unsafe { libc::open(path(fd).as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
            if rw >= 0 {
                // SAFETY: a fresh descriptor, now owned.
                let rw = unsafe { OwnedFd::from_raw_fd(rw) };
                assert!(map_shared(&rw, len, true).is_err(), "mapped writable after a reopen");
            }
        }
        // The owner's own mapping still writes.
        let v = 7u64;
        // SAFETY: the region's mapping, 8 bytes of it, written by its owner.
        unsafe {
            crate::shared_mem::copy(
                crate::shared_mem::Src::Private((&raw const v).cast()),
                crate::shared_mem::Dst::Shared(ro_region.ptr()),
                8,
            )
        };
        // A region that takes remote writes can be mapped writable by a grantee.
        let rw_region = RegionFile::create(100, true).expect("a region file");
        let fd = rw_region.fd_for(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ).unwrap();
        let m = map_shared(&fd, rw_region.map_len(), true).unwrap();
        // SAFETY: mapped just above.
        unsafe { libc::munmap(m.as_ptr().cast(), rw_region.map_len()) };
    }

    #[test]
    fn region_files_hold_their_tag_while_registered() {
        let f = RegionFile::create(100, true).expect("a region file");
        let (slot, tag) = f.slot_tag();
        let st = status().unwrap();
        assert_eq!(st.slot(slot).load(Ordering::Acquire), tag);
        f.revoke();
        assert_eq!(st.slot(slot).load(Ordering::Acquire), 0);
        // A read-only descriptor cannot be mapped for writing.
        let ro = f.fd_for(AccessFlags::REMOTE_READ).unwrap();
        assert!(map_shared(&ro, f.map_len(), true).is_err());
        let g = RegionFile::create(100, true).expect("a region file");
        assert_ne!(g.slot_tag().1, tag, "tags are never reused");
    }
}
