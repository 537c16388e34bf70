//! Memory regions: registered bytes the NIC may read and write.
//!
//! A region *owns* its memory (allocated by rdmakit, or a `Vec<u8>` given to it), is
//! byte-only, and never hands out `&[u8]`/`&mut [u8]` in safe code: the NIC or a peer may
//! write it at any moment, so the CPU reads and writes it with copies ([`read_at`],
//! [`write_at`]) that are sound under concurrent access. Work requests hold a clone of the
//! region until their completion is reaped, so the memory outlives every request that
//! references it, whatever the application drops or leaks.
//!
//! [`read_at`]: MemoryRegion::read_at
//! [`write_at`]: MemoryRegion::write_at

use std::alloc::Layout;
use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::dm::{DeviceMemory, DmBackend};
use crate::error::{Error, Result};
use crate::pd::{PdBackend, ProtectionDomain};
use crate::shared_mem::{self, Dst, Src};
use crate::types::{AccessFlags, RemoteRegion};

/// Bytes owned by a memory region.
pub(crate) struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    owner: Owner,
}

enum Owner {
    Alloc(Layout),
    Vec {
        cap: usize,
    },
    /// Memory the caller owns ([`ProtectionDomain::register_raw`]): never freed here.
    External,
    /// A memfd a same-host peer may map (`crate::soft::direct`).
    File(crate::soft::direct::RegionFile),
}

// SAFETY: the buffer is plain memory (heap, the caller's, or a memfd mapping a same-host
// peer may also map) owned by this value or vouched for; its bytes are accessed only
// through `shared_mem` (byte-wise atomic) or by the NIC, never through references, so
// sharing and sending it across threads is sound.
unsafe impl Send for HostBuffer {}
// SAFETY: `&HostBuffer` exposes only the pointer and length (plain data); every access to the
// bytes behind it is an atomic copy or the NIC's, so concurrent use from threads is defined.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Page-aligned and padded to a multiple of 8 bytes (the `shared_mem` padding
    /// invariant).
    ///
    /// Sizes are checked, never wrapped: a length whose padded size overflows or exceeds
    /// what an allocation may be (`isize::MAX` after rounding to the page alignment) is an
    /// [`Error::InvalidArgument`], so a region never claims more bytes than it owns.
    fn alloc(len: usize) -> Result<HostBuffer> {
        let too_big =
            || Error::InvalidArgument(format!("a region of {len} bytes exceeds the largest allocation"));
        let size = len.max(1).checked_next_multiple_of(8).ok_or_else(too_big)?;
        let layout = Layout::from_size_align(size, 4096).map_err(|_| too_big())?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| Error::Os {
            call: "alloc",
            source: std::io::Error::from(std::io::ErrorKind::OutOfMemory),
        })?;
        Ok(HostBuffer { ptr, len, owner: Owner::Alloc(layout) })
    }

    /// Takes the vector as it is if it meets the `shared_mem` padding invariant (8-aligned,
    /// capacity padded to a multiple of 8), else copies it into a buffer that does.
    ///
    /// The padding bytes after `len` up to the next multiple of 8 are zeroed: the portable
    /// copy path reads whole aligned words, and those bytes of a vector's spare capacity are
    /// otherwise uninitialised.
    fn from_vec(mut v: Vec<u8>) -> Result<HostBuffer> {
        // A vector's length is at most isize::MAX, so this cannot overflow; checked anyway.
        let padded = v.len().checked_next_multiple_of(8).ok_or_else(|| {
            Error::InvalidArgument(format!("a region of {} bytes exceeds the largest allocation", v.len()))
        })?;
        if v.capacity() < padded {
            v.reserve_exact(padded - v.len());
        }
        let pad = padded - v.len();
        for b in &mut v.spare_capacity_mut()[..pad] {
            b.write(0);
        }
        if !(v.as_ptr() as usize).is_multiple_of(8) || !v.capacity().is_multiple_of(8) {
            let b = HostBuffer::alloc(v.len())?;
            // SAFETY: `b` is fresh and not yet shared; `v` is ours; `len` bytes each.
            unsafe { shared_mem::copy(Src::Private(v.as_ptr()), Dst::Shared(b.ptr()), v.len()) };
            return Ok(b);
        }
        let mut v = std::mem::ManuallyDrop::new(v);
        let (len, cap) = (v.len(), v.capacity());
        let ptr = NonNull::new(v.as_mut_ptr()).expect("Vec pointer is non-null");
        Ok(HostBuffer { ptr, len, owner: Owner::Vec { cap } })
    }

    /// Memory the caller owns and vouches for (see [`ProtectionDomain::register_raw`]): an
    /// 8-aligned address and a length that is a whole number of 8-byte words, so the
    /// `shared_mem` padding invariant holds with no padding.
    fn external(ptr: NonNull<u8>, len: usize) -> Result<HostBuffer> {
        if len == 0 || !len.is_multiple_of(8) || !(ptr.as_ptr() as usize).is_multiple_of(8) {
            return Err(Error::InvalidArgument(format!(
                "raw registration of {len} bytes at {ptr:p}: needs an 8-byte-aligned address and a \
                 non-zero multiple of 8 bytes"
            )));
        }
        if isize::try_from(len).is_err() || (ptr.as_ptr() as usize).checked_add(len).is_none() {
            return Err(Error::InvalidArgument(format!(
                "raw registration of {len} bytes wraps the address space"
            )));
        }
        Ok(HostBuffer { ptr, len, owner: Owner::External })
    }

    /// A region in its own memfd, which the soft NIC may let a same-host requester map
    /// (`crate::soft::direct`); `None` when no file can be had (the caller uses the heap).
    fn alloc_file(len: usize, peers_write: bool) -> Option<HostBuffer> {
        let f = crate::soft::direct::RegionFile::create(len, peers_write)?;
        let ptr = NonNull::new(f.ptr()).expect("a mapping is not null");
        Some(HostBuffer { ptr, len, owner: Owner::File(f) })
    }

    /// Whether the memory is the caller's ([`ProtectionDomain::register_raw`]).
    pub(crate) fn is_external(&self) -> bool {
        matches!(self.owner, Owner::External)
    }

    /// The region's memfd, if it has one.
    pub(crate) fn file(&self) -> Option<&crate::soft::direct::RegionFile> {
        match &self.owner {
            Owner::File(f) => Some(f),
            _ => None,
        }
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn into_vec(self) -> Vec<u8> {
        let me = std::mem::ManuallyDrop::new(self);
        match me.owner {
            // SAFETY: these are exactly the parts `from_vec` took apart, and `me` will not
            // be dropped, so the vector is reassembled once.
            Owner::Vec { cap } => unsafe { Vec::from_raw_parts(me.ptr.as_ptr(), me.len, cap) },
            Owner::File(_) => {
                let mut v = vec![0u8; me.len];
                // SAFETY: `me.ptr` is valid for `len` bytes (the mapping); `v` is private.
                unsafe {
                    shared_mem::copy(Src::Shared(me.ptr.as_ptr()), Dst::Private(v.as_mut_ptr()), me.len)
                };
                // SAFETY: `me` is not dropped (ManuallyDrop): the file is moved out once and
                // dropped here, unmapping the region after the copy.
                drop(unsafe { std::ptr::read(&me.owner) });
                v
            }
            Owner::Alloc(layout) => {
                let mut v = vec![0u8; me.len];
                // SAFETY: `me.ptr` is valid for `len` bytes; `v` is private.
                unsafe {
                    shared_mem::copy(Src::Shared(me.ptr.as_ptr()), Dst::Private(v.as_mut_ptr()), me.len)
                };
                // SAFETY: allocated in `alloc` with this layout, freed once here.
                unsafe { std::alloc::dealloc(me.ptr.as_ptr(), layout) };
                v
            }
            Owner::External => {
                let mut v = vec![0u8; me.len];
                // SAFETY: valid for `len` bytes per `register_raw`'s contract; `v` is private.
                unsafe {
                    shared_mem::copy(Src::Shared(me.ptr.as_ptr()), Dst::Private(v.as_mut_ptr()), me.len)
                };
                v
            }
        }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        match self.owner {
            // SAFETY: allocated in `alloc` with this layout; dropped once.
            Owner::Alloc(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) },
            // SAFETY: the parts of a `Vec<u8>` taken apart in `from_vec`.
            Owner::Vec { cap } => drop(unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), self.len, cap) }),
            // The caller's memory: theirs to free, after this registration is gone.
            Owner::External => {}
            // The file unmaps itself.
            Owner::File(_) => {}
        }
    }
}

/// Where a region's bytes live.
pub(crate) enum MrMemory {
    Host(Arc<HostBuffer>),
    Device {
        dm: DeviceMemory,
        offset: u64,
    },
    /// Exported by another driver (GPU); no CPU access.
    DmaBuf,
    /// An mlx5 indirect or alias key: no bytes of its own (see `crate::mlx5`).
    Mkey(Arc<crate::mlx5::MkeyState>),
}

pub(crate) enum MrBackend {
    Soft {
        device: Arc<crate::soft::SoftDevice>,
        key: u32,
        /// For memory the caller owns ([`ProtectionDomain::register_raw`]): signalled when
        /// the soft NIC lets go of the key's entry (see [`Drain`]).
        drain: Option<Arc<Drain>>,
    },
    #[cfg(rdmakit_verbs)]
    Verbs(crate::rdma::Mr),
    /// An mlx5 indirect mkey (`crate::mlx5`), destroyed when dropped.
    #[cfg(rdmakit_verbs)]
    VerbsMkey(crate::rdma::mlx5dv::Mkey),
    /// An mlx5 KSM mkey made by DEVX `CREATE_MKEY` (`crate::mlx5`), destroyed when dropped.
    #[cfg(rdmakit_verbs)]
    VerbsKsm(crate::rdma::mlx5dv::KsmKey),
    /// An mlx5 mkey alias of another vHCA's key (`crate::mlx5`), destroyed when dropped.
    #[cfg(rdmakit_verbs)]
    VerbsAlias(crate::rdma::mlx5dv::Alias),
}

/// Deregistration fencing for memory rdmakit does not own. The soft NIC reaches a region's
/// bytes through its key's entry, which every access in progress holds (a peer's write
/// landing, a send's payload on its way to a socket); for memory rdmakit owns, the entry
/// keeps the bytes alive on its own. For the caller's memory it cannot, so deregistration
/// waits until the entry is gone, as `ibv_dereg_mr` returns only once the NIC no longer
/// reaches the memory.
pub(crate) struct Drain {
    gone: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
}

/// What the key's entry holds instead of the buffer alone: signals [`Drain`] when dropped.
struct DrainOnDrop {
    _buf: Arc<HostBuffer>,
    drain: Arc<Drain>,
}

impl Drop for DrainOnDrop {
    fn drop(&mut self) {
        *self.drain.gone.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.drain.cv.notify_all();
    }
}

impl Drain {
    /// Blocks until the entry is gone: as long as an access holds it. Those that a peer
    /// could keep going for as long as it likes let go first (`soft::revoke`, run by the
    /// caller): payloads waiting for a peer to read them are copied out of the region, and
    /// reads and atomics outstanding with their answer due in it will fail with
    /// `LOC_PROT_ERR`. The rest end by themselves or within the wire's timeouts (a peer's
    /// write landing, a stalled peer's frame). `again` revokes once more, after 10 ms,
    /// 100 ms and then every second while the wait lasts: a post that looked the key up just
    /// before it went queues its access after the first revocation. A warning says when
    /// the wait is long. (On a NIC the deregistration returns at once and later accesses
    /// fault; the soft NIC would need a revocation check at every copy to do the same.)
    fn wait(&self, mut again: impl FnMut()) {
        let start = std::time::Instant::now();
        let mut warned = false;
        for round in 0u32.. {
            let pause = match round {
                0 => std::time::Duration::from_millis(10),
                1 => std::time::Duration::from_millis(100),
                _ => std::time::Duration::from_secs(1),
            };
            {
                let gone = self.gone.lock().unwrap_or_else(|e| e.into_inner());
                let (gone, _) =
                    self.cv.wait_timeout_while(gone, pause, |gone| !*gone).unwrap_or_else(|e| e.into_inner());
                if *gone {
                    return;
                }
            }
            // Not under the lock: the revocation may let the entry go, whose drop takes it.
            again();
            if !warned && start.elapsed() >= std::time::Duration::from_secs(1) {
                warned = true;
                tracing::warn!(
                    waited = ?start.elapsed(),
                    "deregistering caller-owned memory waits for the soft NIC's accesses in progress"
                );
            }
        }
    }
}

/// Fields drop in order: deregistration (`backend`) before the memory (`mem`) before the
/// PD (`pd`).
pub(crate) struct MrInner {
    pub(crate) backend: MrBackend,
    pub(crate) mem: MrMemory,
    pub(crate) pd: ProtectionDomain,
    pub(crate) access: AccessFlags,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
}

impl MrInner {
    /// Keeps this region's memory alive for the rest of the process: a key whose
    /// deregistration or destruction failed may still let the NIC, or a peer, reach it.
    fn leak_memory(&self, what: &str) {
        tracing::error!(lkey = self.lkey, "{what} failed; leaking the memory the key reaches");
        match &self.mem {
            MrMemory::Host(b) => std::mem::forget(b.clone()),
            MrMemory::Device { dm, .. } => std::mem::forget(dm.clone()),
            MrMemory::DmaBuf => {}
            // The regions an indirect key maps stay registered, and their memory allocated.
            MrMemory::Mkey(m) => std::mem::forget(m.clone()),
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Runs as a region's deregistration starts on this thread: tests look at which locks
    /// are held then.
    pub(crate) static ON_RELEASE: std::cell::RefCell<Option<Box<dyn FnMut()>>> =
        const { std::cell::RefCell::new(None) };
}

impl Drop for MrInner {
    fn drop(&mut self) {
        // (Not while the hook runs or is being dropped, nor once the thread's locals are
        // gone: a test that failed with its hook set drops it at thread exit.)
        #[cfg(test)]
        let _ = ON_RELEASE.try_with(|f| f.try_borrow_mut().map(|mut f| f.as_mut().map(|f| f())));
        if let Err(call) = self.backend.release() {
            self.leak_memory(call);
        }
    }
}

/// The one place a memory region dispatches to its provider. Each constructor returns the
/// provider's key with its (lkey, rkey).
impl MrBackend {
    /// Registers host memory `buf` in `pd`.
    fn reg_host(
        pd: &ProtectionDomain,
        buf: &Arc<HostBuffer>,
        access: AccessFlags,
    ) -> Result<(MrBackend, u32, u32)> {
        let (ptr, len) = (buf.ptr(), buf.len);
        match pd.backend() {
            PdBackend::Soft(pd_id) => {
                let Some(device) = pd.context().backend().soft() else {
                    unreachable!("soft PD on a soft context")
                };
                // The caller's memory outlives the key's entry only if deregistration waits
                // for it ([`Drain`]); memory rdmakit owns is kept alive by the entry itself.
                let (keep, drain): (Arc<dyn Any + Send + Sync>, _) = if buf.is_external() {
                    let drain =
                        Arc::new(Drain { gone: std::sync::Mutex::new(false), cv: Default::default() });
                    (Arc::new(DrainOnDrop { _buf: buf.clone(), drain: drain.clone() }), Some(drain))
                } else {
                    (buf.clone(), None)
                };
                // For the caller's memory, deregistration waits until `keep` is dropped, and
                // `register_raw`'s contract keeps the memory until then.
                // SAFETY: `ptr` is valid for `len` bytes while `keep` lives (above);
                // rdmakit accesses registered memory only through `shared_mem`.
                let key = unsafe { device.mrs.register(*pd_id, ptr as u64, len as u64, access, ptr, keep) };
                Ok((MrBackend::Soft { device: device.clone(), key, drain }, key, key))
            }
            #[cfg(rdmakit_verbs)]
            PdBackend::Verbs(vpd) => {
                // SAFETY: the buffer outlives the registration: `MrInner` drops `backend`
                // (deregistering) before `mem`, and holds `mem` (an `Arc` of the buffer).
                let mr = unsafe { crate::rdma::Mr::reg(vpd, ptr, len, access)? };
                let (l, r) = (mr.lkey(), mr.rkey());
                Ok((MrBackend::Verbs(mr), l, r))
            }
        }
    }

    /// Registers `offset..offset + len` of `dm` zero-based; the caller checked the range and
    /// that `pd` and `dm` share a device.
    fn reg_dm(
        pd: &ProtectionDomain,
        dm: &DeviceMemory,
        offset: u64,
        len: u64,
        access: AccessFlags,
    ) -> Result<(MrBackend, u32, u32)> {
        match (pd.backend(), &dm.inner.backend) {
            (PdBackend::Soft(pd_id), DmBackend::Soft(sdm)) => {
                let ptr = sdm.ptr().wrapping_add(offset as usize);
                let keep: Arc<dyn Any + Send + Sync> = sdm.clone();
                // SAFETY: `ptr..ptr+len` lies inside the DM allocation (the caller checked),
                // which `keep` holds; DM bytes are accessed only through `shared_mem`.
                let key = unsafe { sdm.device.mrs.register(*pd_id, 0, len, access, ptr, keep) };
                Ok((MrBackend::Soft { device: sdm.device.clone(), key, drain: None }, key, key))
            }
            #[cfg(rdmakit_verbs)]
            (PdBackend::Verbs(vpd), DmBackend::Verbs(vdm)) => {
                let mr = crate::rdma::Mr::reg_dm(vpd, vdm, offset, len, access)?;
                let (l, r) = (mr.lkey(), mr.rkey());
                Ok((MrBackend::Verbs(mr), l, r))
            }
            #[cfg(rdmakit_verbs)]
            _ => unreachable!("PD and DM share a context, so a provider"),
        }
    }

    /// Registers a dma-buf (verbs provider only).
    ///
    /// # Safety
    /// See [`ProtectionDomain::register_dmabuf`].
    unsafe fn reg_dmabuf(
        pd: &ProtectionDomain,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<(MrBackend, u32, u32)> {
        match pd.backend() {
            PdBackend::Soft(_) => {
                let _ = (fd, offset, len, iova, access);
                Err(Error::Unsupported("dma-buf registration needs the verbs provider".into()))
            }
            #[cfg(rdmakit_verbs)]
            PdBackend::Verbs(vpd) => {
                use std::os::fd::AsRawFd;
                // SAFETY: the caller's contract is `register_dmabuf`'s, which this forwards.
                let mr =
                    unsafe { crate::rdma::Mr::reg_dmabuf(vpd, offset, len, iova, fd.as_raw_fd(), access)? };
                let (l, r) = (mr.lkey(), mr.rkey());
                Ok((MrBackend::Verbs(mr), l, r))
            }
        }
    }

    /// Deregisters or destroys the key. `Err` names the call that failed: the NIC may
    /// still reach the memory.
    fn release(&self) -> std::result::Result<(), &'static str> {
        let (done, call) = match self {
            MrBackend::Soft { device, key, drain } => {
                // Nothing outside the soft NIC reaches the memory: a key already gone is fine.
                let entry = device.mrs.deregister(*key);
                if let Some(d) = drain {
                    // Accesses a peer could keep going for as long as it likes let go of
                    // the memory first: a slow reader or a silent responder does not hold the
                    // deregistration.
                    let again = entry.as_ref().map(Arc::downgrade);
                    if let Some(e) = entry {
                        crate::soft::revoke(&e);
                    }
                    // A post that looked the key up just before it went may queue its
                    // access after that: while the entry lives, revoke again.
                    d.wait(|| {
                        if let Some(e) = again.as_ref().and_then(std::sync::Weak::upgrade) {
                            crate::soft::revoke(&e);
                        }
                    });
                }
                (true, "")
            }
            #[cfg(rdmakit_verbs)]
            MrBackend::Verbs(mr) => (mr.deregister(), "ibv_dereg_mr"),
            #[cfg(rdmakit_verbs)]
            MrBackend::VerbsMkey(mkey) => (mkey.destroy(), "mlx5dv_destroy_mkey"),
            #[cfg(rdmakit_verbs)]
            MrBackend::VerbsKsm(ksm) => (ksm.destroy(), "mlx5dv_devx_obj_destroy (KSM mkey)"),
            #[cfg(rdmakit_verbs)]
            MrBackend::VerbsAlias(alias) => (alias.destroy(), "mlx5dv_devx_obj_destroy (mkey alias)"),
        };
        if done { Ok(()) } else { Err(call) }
    }
}

/// A registered memory region (`struct ibv_mr`).
///
/// Cloning is cheap and shares the registration; it is deregistered when the last clone,
/// including those held by in-flight work requests, is dropped.
#[derive(Clone)]
pub struct MemoryRegion {
    pub(crate) inner: Arc<MrInner>,
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.inner.addr))
            .field("len", &self.inner.len)
            .field("lkey", &format_args!("{:#x}", self.inner.lkey))
            .field("rkey", &format_args!("{:#x}", self.inner.rkey))
            .field("access", &self.inner.access)
            .finish()
    }
}

impl MemoryRegion {
    /// A region of `pd` from the provider's key and its (lkey, rkey), over `mem`, at
    /// `range` (the address the NIC uses for byte 0, the length).
    pub(crate) fn assemble(
        pd: &ProtectionDomain,
        keys: (MrBackend, u32, u32),
        mem: MrMemory,
        access: AccessFlags,
        range: (u64, u64),
    ) -> MemoryRegion {
        let (backend, lkey, rkey) = keys;
        let (addr, len) = range;
        MemoryRegion {
            inner: Arc::new(MrInner { backend, mem, pd: pd.clone(), access, addr, len, lkey, rkey }),
        }
    }

    pub(crate) fn alloc(pd: &ProtectionDomain, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        if len == 0 {
            return Err(Error::InvalidArgument("a memory region needs at least one byte".into()));
        }
        // Remote access on a soft device with the same-host path on: a memfd, so that a
        // requester of another process may map it (`soft::direct`).
        let shareable = access.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ)
            && pd.context().backend().soft().is_some_and(|d| d.config().same_host_shm)
            && crate::soft::shm::enabled();
        let peers_write = access.contains(AccessFlags::REMOTE_WRITE);
        let buf = match shareable.then(|| HostBuffer::alloc_file(len, peers_write)).flatten() {
            Some(b) => b,
            None => HostBuffer::alloc(len)?,
        };
        MemoryRegion::register_host(pd, buf, access)
    }

    /// # Safety
    /// See [`ProtectionDomain::register_raw`].
    pub(crate) unsafe fn from_raw(
        pd: &ProtectionDomain,
        ptr: NonNull<u8>,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        MemoryRegion::register_host(pd, HostBuffer::external(ptr, len)?, access)
    }

    pub(crate) fn from_vec(pd: &ProtectionDomain, v: Vec<u8>, access: AccessFlags) -> Result<MemoryRegion> {
        if v.is_empty() {
            return Err(Error::InvalidArgument("a memory region needs at least one byte".into()));
        }
        MemoryRegion::register_host(pd, HostBuffer::from_vec(v)?, access)
    }

    fn register_host(pd: &ProtectionDomain, buf: HostBuffer, access: AccessFlags) -> Result<MemoryRegion> {
        access.validate()?;
        if access.contains(AccessFlags::ZERO_BASED) {
            return Err(Error::InvalidArgument("ZERO_BASED applies to device memory regions".into()));
        }
        let buf = Arc::new(buf);
        let (addr, len) = (buf.ptr() as u64, buf.len);
        let keys = MrBackend::reg_host(pd, &buf, access)?;
        Ok(MemoryRegion::assemble(pd, keys, MrMemory::Host(buf), access, (addr, len as u64)))
    }

    pub(crate) fn from_dm(
        pd: &ProtectionDomain,
        dm: &DeviceMemory,
        offset: u64,
        len: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        access.validate()?;
        if len == 0 || offset.checked_add(len).is_none_or(|e| e > dm.len()) {
            return Err(Error::OutOfBounds { what: "device memory", offset, len, size: dm.len() });
        }
        if !pd.context().same_device(&dm.inner.ctx) {
            return Err(Error::InvalidArgument("device memory and PD are on different devices".into()));
        }
        let access = access | AccessFlags::ZERO_BASED;
        let keys = MrBackend::reg_dm(pd, dm, offset, len, access)?;
        Ok(MemoryRegion::assemble(pd, keys, MrMemory::Device { dm: dm.clone(), offset }, access, (0, len)))
    }

    /// # Safety
    /// See [`ProtectionDomain::register_dmabuf`].
    pub(crate) unsafe fn from_dmabuf(
        pd: &ProtectionDomain,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        access.validate()?;
        // SAFETY: the caller's contract is `register_dmabuf`'s, which this forwards.
        let keys = unsafe { MrBackend::reg_dmabuf(pd, fd, offset, len, iova, access)? };
        Ok(MemoryRegion::assemble(pd, keys, MrMemory::DmaBuf, access, (iova, len as u64)))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len as usize
    }

    /// Always false: regions have at least one byte.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The address the NIC uses for byte 0: the virtual address, or 0 for zero-based
    /// (device memory) regions.
    pub fn addr(&self) -> u64 {
        self.inner.addr
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.inner.lkey
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.inner.rkey
    }

    /// The access the region was registered with.
    pub fn access(&self) -> AccessFlags {
        self.inner.access
    }

    /// The protection domain it belongs to.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }

    /// The device it is registered on.
    pub(crate) fn context(&self) -> &crate::device::Context {
        self.inner.pd.context()
    }

    /// True if this region lives in device memory.
    pub fn is_device_memory(&self) -> bool {
        matches!(self.inner.mem, MrMemory::Device { .. })
    }

    /// The descriptor to give peers.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion { addr: self.inner.addr, len: self.inner.len, rkey: self.inner.rkey }
    }

    /// The local part `offset..offset + len`, for use in a work request.
    pub fn slice(&self, offset: u64, len: u32) -> Result<LocalSlice> {
        self.check(offset, u64::from(len))?;
        Ok(LocalSlice { mr: self.clone(), offset, len })
    }

    /// The whole region as a local slice (regions over 4 GiB need [`slice`](Self::slice)).
    pub fn local(&self) -> Result<LocalSlice> {
        let len = u32::try_from(self.inner.len)
            .map_err(|_| Error::InvalidArgument("a work request moves at most 4 GiB; use slice()".into()))?;
        self.slice(0, len)
    }

    fn check(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.inner.len => Ok(()),
            _ => Err(Error::OutOfBounds { what: "memory region", offset, len, size: self.inner.len }),
        }
    }

    /// Copies `data` into the region at `offset`.
    ///
    /// Sound even while the NIC or a peer accesses the region (bytes may then interleave).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check(offset, data.len() as u64)?;
        match &self.inner.mem {
            // SAFETY: in bounds (checked); the buffer lives as long as `self`; copies into
            // registered memory are byte-wise atomic; `data` is a private borrow.
            MrMemory::Host(b) => unsafe {
                shared_mem::copy(
                    Src::Private(data.as_ptr()),
                    Dst::Shared(b.ptr().add(offset as usize)),
                    data.len(),
                );
                Ok(())
            },
            MrMemory::Device { dm, offset: base } => dm.copy_to(base + offset, data),
            MrMemory::DmaBuf | MrMemory::Mkey(_) => Err(self.no_cpu_access()),
        }
    }

    /// Copies `out.len()` bytes from the region at `offset` into `out`.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len() as u64)?;
        match &self.inner.mem {
            // SAFETY: as in `write_at`, in the other direction.
            MrMemory::Host(b) => unsafe {
                shared_mem::copy(
                    Src::Shared(b.ptr().add(offset as usize)),
                    Dst::Private(out.as_mut_ptr()),
                    out.len(),
                );
                Ok(())
            },
            MrMemory::Device { dm, offset: base } => dm.copy_from(base + offset, out),
            MrMemory::DmaBuf | MrMemory::Mkey(_) => Err(self.no_cpu_access()),
        }
    }

    /// Why the CPU cannot copy to or from this region (a dma-buf or an mlx5 key).
    fn no_cpu_access(&self) -> Error {
        match &self.inner.mem {
            MrMemory::DmaBuf => Error::Unsupported("no CPU access to a dma-buf region".into()),
            _ => Error::Unsupported(
                "no CPU access through an mlx5 indirect or alias key: copy through the region it maps".into(),
            ),
        }
    }

    /// Reads a native-endian `u64` at `offset` (e.g. an atomic's result).
    pub fn read_u64(&self, offset: u64) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read_at(offset, &mut b)?;
        Ok(u64::from_ne_bytes(b))
    }

    /// Loads the native-endian `u64` at `offset` with acquire ordering: a flag or sequence
    /// word a peer writes after the data it announces. The soft NIC stores the last aligned
    /// word of every write last, with release ordering, so bytes read from the region after
    /// seeing the word are at least as new as the write that carried it. The word must be
    /// 8-aligned in memory.
    pub fn load_u64_acquire(&self, offset: u64) -> Result<u64> {
        self.check(offset, 8)?;
        match &self.inner.mem {
            MrMemory::Host(b) => {
                let p = b.ptr().wrapping_add(offset as usize);
                if !(p as usize).is_multiple_of(8) {
                    return Err(Error::Unsupported("an acquire load needs an 8-aligned word".into()));
                }
                // SAFETY: `p .. p + 8` is inside the buffer (bounds checked above), which lives
                // as long as `self`; `p` is 8-aligned (checked); every access to registered host
                // memory is atomic (through `shared_mem`), so an atomic load does not race.
                let word = unsafe { shared_mem::atomic_u64(p) };
                Ok(word.load(std::sync::atomic::Ordering::Acquire))
            }
            _ => {
                let v = self.read_u64(offset)?;
                std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
                Ok(v)
            }
        }
    }

    /// Writes a native-endian `u64` at `offset` (e.g. an atomic target's initial value).
    pub fn write_u64(&self, offset: u64, v: u64) -> Result<()> {
        self.write_at(offset, &v.to_ne_bytes())
    }

    /// Sets every byte to `byte`.
    pub fn fill(&self, byte: u8) -> Result<()> {
        match &self.inner.mem {
            // SAFETY: the whole buffer, which lives as long as `self`.
            MrMemory::Host(b) => unsafe {
                shared_mem::fill(b.ptr(), byte, self.len());
                Ok(())
            },
            MrMemory::Device { .. } => self.write_at(0, &vec![byte; self.len()]),
            // Before allocating: a key's region may name a range far larger than memory.
            MrMemory::DmaBuf | MrMemory::Mkey(_) => Err(self.no_cpu_access()),
        }
    }

    /// Copies the whole region out.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        // Before allocating: a key's region may name a range far larger than memory.
        if matches!(self.inner.mem, MrMemory::DmaBuf | MrMemory::Mkey(_)) {
            return Err(self.no_cpu_access());
        }
        let mut v = vec![0u8; self.len()];
        self.read_at(0, &mut v)?;
        Ok(v)
    }

    /// True if this handle is the only one: no clone and no in-flight work request holds the
    /// region, so no operation posted through rdmakit can still touch it (peers holding its
    /// rkey still can: revoke by dropping the region). Registration caches use it to decide
    /// whether a region may be handed to a new user.
    pub fn is_unique(&self) -> bool {
        // No `Weak` to a region is ever made, so a count of 1 cannot grow behind our back.
        Arc::strong_count(&self.inner) == 1
    }

    /// True if `other` is a handle of the same registration (a clone of this one).
    pub fn same_registration(&self, other: &MemoryRegion) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Deregisters the region and gives its bytes back (the original vector when it was
    /// registered from one and met the alignment rules, else a copy), if nothing else (a clone, an
    /// in-flight work request) still holds it; otherwise returns the region unchanged.
    pub fn try_into_vec(self) -> std::result::Result<Vec<u8>, MemoryRegion> {
        let MrMemory::Host(buf) = &self.inner.mem else { return Err(self) };
        // No `Weak` to a region is ever made, so a count of 1 cannot grow behind our back.
        if Arc::strong_count(&self.inner) != 1 {
            return Err(self);
        }
        let buf = buf.clone();
        drop(self); // the last handle: deregisters
        match Arc::try_unwrap(buf) {
            Ok(buf) => Ok(buf.into_vec()),
            // An operation of the soft NIC that looked the key up just before deregistration
            // may hold the buffer for the length of one copy. Copy out rather than wait.
            Err(buf) => {
                let mut v = vec![0u8; buf.len];
                // SAFETY: the buffer is alive (we hold an Arc) and `v` is private.
                unsafe { shared_mem::copy(Src::Shared(buf.ptr()), Dst::Private(v.as_mut_ptr()), buf.len) };
                Ok(v)
            }
        }
    }

    /// A shared slice over the region's bytes, for zero-copy reads.
    ///
    /// Returns `None` for device-memory and dma-buf regions.
    ///
    /// # Safety
    /// For the lifetime of the returned slice, nothing may write the region: no posted or
    /// future work request may write it (RDMA read or atomic into it, receives), no peer
    /// may write it (do not advertise an rkey with remote write/atomic access, or make sure
    /// the protocol forbids it), and no other thread may call `write_at`/`fill`.
    pub unsafe fn as_slice(&self) -> Option<&[u8]> {
        match &self.inner.mem {
            // SAFETY: valid for `len` bytes while `self` lives; no writer per the contract.
            MrMemory::Host(b) => Some(unsafe { std::slice::from_raw_parts(b.ptr(), self.len()) }),
            _ => None,
        }
    }

    /// A shared slice over `len` bytes of the region from `offset`, for zero-copy reads of
    /// one part while other parts may change (a block of a receive ring, say).
    ///
    /// Returns `None` for device-memory and dma-buf regions, and for a range outside the
    /// region.
    ///
    /// # Safety
    /// The CPU copy path accesses registered memory in whole aligned 8-byte words, so the
    /// constraint covers every aligned 8-byte word the range touches (from
    /// `offset` rounded down to a multiple of 8 to `offset + len` rounded up), not only the
    /// range itself:
    /// - for the lifetime of the returned slice, nothing may write those words: no work
    ///   request (RDMA read or atomic into them, receives), no peer, no other thread through
    ///   `write_at`/`fill`; bytes of the region outside those words are not constrained;
    /// - every write of those bytes by the NIC, a peer or another thread must
    ///   *happen-before* this call: for NIC and peer writes, reap the completion that
    ///   reports them (or observe a flag the protocol writes after them with acquire
    ///   semantics, e.g. through [`read_at`](Self::read_at)) before calling.
    ///
    /// # Examples
    /// ```
    /// use rdmakit_verbs::{AccessFlags, Context};
    /// let mr = Context::open_soft().alloc_pd()?.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    /// mr.write_at(8, b"abc")?;
    /// // SAFETY: nothing writes the region while the slices live (no QP uses it).
    /// let (part, outside) = unsafe { (mr.as_slice_at(8, 3), mr.as_slice_at(60, 8)) };
    /// assert_eq!((part, outside), (Some(&b"abc"[..]), None));
    /// # Ok::<(), rdmakit_verbs::Error>(())
    /// ```
    pub unsafe fn as_slice_at(&self, offset: usize, len: usize) -> Option<&[u8]> {
        let end = offset.checked_add(len)?;
        match &self.inner.mem {
            MrMemory::Host(b) if end <= self.len() => {
                // SAFETY: `offset..end` lies within the buffer, valid while `self` lives; no
                // writer of those bytes per the contract; no reference covers the rest.
                Some(unsafe { std::slice::from_raw_parts(b.ptr().add(offset), len) })
            }
            _ => None,
        }
    }

    /// An exclusive slice over the region's bytes, for zero-copy writes.
    ///
    /// Returns `None` for device-memory and dma-buf regions.
    ///
    /// # Safety
    /// For the lifetime of the returned slice, nothing else may read or write the region:
    /// no posted work request may reference it, no peer may access it remotely, and no
    /// other reference from `as_slice`/`as_mut_slice` may exist.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> Option<&mut [u8]> {
        match &self.inner.mem {
            // SAFETY: valid for `len` bytes; exclusive per the contract.
            MrMemory::Host(b) => Some(unsafe { std::slice::from_raw_parts_mut(b.ptr(), self.len()) }),
            _ => None,
        }
    }
}

/// A bounds-checked local part of a memory region, as a work request's buffer.
///
/// Holds a clone of the region, which the queue pair keeps until the request completes.
#[derive(Clone, Debug)]
pub struct LocalSlice {
    pub(crate) mr: MemoryRegion,
    pub(crate) offset: u64,
    pub(crate) len: u32,
}

impl LocalSlice {
    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// True if zero bytes long.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Offset in the region.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The region.
    pub fn region(&self) -> &MemoryRegion {
        &self.mr
    }

    pub(crate) fn sge(&self) -> crate::raw::Sge {
        crate::raw::Sge { addr: self.mr.inner.addr + self.offset, len: self.len, lkey: self.mr.inner.lkey }
    }
}
