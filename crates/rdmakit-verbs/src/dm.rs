//! Device memory (`ibv_alloc_dm`): bytes on the NIC itself (mlx5 MEMIC), reachable by the
//! CPU only through copy calls, and by the NIC without a PCIe round trip.

use std::sync::Arc;

use crate::device::{Context, CtxBackend};
use crate::error::{Error, Result};
use crate::shared_mem::{Dst, Src, copy};
use crate::soft::dm::SoftDm;

/// An allocation of device memory. Freed when the last handle (and every memory region
/// registered on it) is dropped.
///
/// # Examples
/// ```
/// use rdmakit_verbs::{AccessFlags, Context};
/// let ctx = Context::open_soft();
/// let dm = ctx.alloc_dm(64)?;
/// dm.copy_to(0, &42u64.to_ne_bytes())?;
/// let mr = ctx.alloc_pd()?.register_dm(&dm, 0, 64, AccessFlags::ALL_REMOTE)?;
/// assert_eq!(mr.addr(), 0); // zero-based
/// assert_eq!(mr.read_u64(0)?, 42);
/// # Ok::<(), rdmakit_verbs::Error>(())
/// ```
#[derive(Clone)]
pub struct DeviceMemory {
    pub(crate) inner: Arc<DmInner>,
}

/// Fields drop in order: the provider object before the parent it needs.
pub(crate) struct DmInner {
    pub(crate) backend: DmBackend,
    pub(crate) ctx: Context,
    pub(crate) len: u64,
}

pub(crate) enum DmBackend {
    Soft(Arc<SoftDm>),
    #[cfg(rdmakit_verbs)]
    Verbs(crate::rdma::Dm),
}

/// The one place device memory dispatches to its provider.
impl DmBackend {
    fn alloc(ctx: &Context, len: u64, max: u64) -> Result<DmBackend> {
        match ctx.backend() {
            CtxBackend::Soft(dev) => {
                let _ = max;
                Ok(DmBackend::Soft(Arc::new(SoftDm::alloc(dev, len)?)))
            }
            #[cfg(rdmakit_verbs)]
            CtxBackend::Verbs(c) => Ok(DmBackend::Verbs(crate::rdma::Dm::alloc(c, len, max)?)),
        }
    }

    /// Copies `data` in at `offset`.
    ///
    /// # Safety
    /// `offset..offset + data.len()` lies inside the allocation.
    unsafe fn copy_to(&self, offset: u64, data: &[u8]) -> Result<()> {
        match self {
            DmBackend::Soft(dm) => {
                // SAFETY: `offset..offset + data.len()` lies in the allocation (caller's
                // contract), which `dm` keeps alive; DM bytes are only accessed through
                // `shared_mem`, and `data` is a private source of that length.
                unsafe {
                    copy(Src::Private(data.as_ptr()), Dst::Shared(dm.ptr().add(offset as usize)), data.len())
                };
                Ok(())
            }
            #[cfg(rdmakit_verbs)]
            DmBackend::Verbs(dm) => dm.copy_to(offset, data),
        }
    }

    /// Copies out from `offset` into `out`.
    ///
    /// # Safety
    /// `offset..offset + out.len()` lies inside the allocation.
    unsafe fn copy_from(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        match self {
            DmBackend::Soft(dm) => {
                // SAFETY: `offset..offset + out.len()` lies in the allocation (caller's
                // contract), which `dm` keeps alive; DM bytes are only accessed through
                // `shared_mem`, and `out` is a private destination of that length.
                unsafe {
                    copy(
                        Src::Shared(dm.ptr().add(offset as usize)),
                        Dst::Private(out.as_mut_ptr()),
                        out.len(),
                    )
                };
                Ok(())
            }
            #[cfg(rdmakit_verbs)]
            DmBackend::Verbs(dm) => dm.copy_from(offset, out),
        }
    }
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMemory").field("len", &self.inner.len).finish()
    }
}

impl DeviceMemory {
    pub(crate) fn new(ctx: &Context, len: u64) -> Result<DeviceMemory> {
        let max = ctx.attr().max_dm_size;
        if max == 0 {
            return Err(Error::Unsupported(format!("{} has no device memory (max_dm_size = 0)", ctx.name())));
        }
        if len == 0 {
            return Err(Error::InvalidArgument("device memory length must be non-zero".into()));
        }
        if len > max {
            return Err(Error::DeviceMemoryExhausted { requested: len, available: max, capacity: max });
        }
        let backend = DmBackend::alloc(ctx, len, max)?;
        Ok(DeviceMemory { inner: Arc::new(DmInner { backend, ctx: ctx.clone(), len }) })
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len
    }

    /// Always false: allocations have at least one byte.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    fn check(&self, offset: u64, len: usize) -> Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.inner.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                what: "device memory",
                offset,
                len: len as u64,
                size: self.inner.len,
            }),
        }
    }

    /// Copies `data` into device memory at `offset` (`ibv_memcpy_to_dm`). On mlx5 the
    /// offset and length must be multiples of 4 (the device moves 32-bit words);
    /// [`Error::InvalidArgument`] otherwise.
    #[doc(alias = "ibv_memcpy_to_dm")]
    pub fn copy_to(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        // SAFETY: `check` just proved `offset..offset + data.len()` inside the allocation.
        unsafe { self.inner.backend.copy_to(offset, data) }
    }

    /// Copies from device memory at `offset` into `out` (`ibv_memcpy_from_dm`), with the
    /// same rule as [`copy_to`](Self::copy_to) on mlx5.
    #[doc(alias = "ibv_memcpy_from_dm")]
    pub fn copy_from(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        // SAFETY: `check` just proved `offset..offset + out.len()` inside the allocation.
        unsafe { self.inner.backend.copy_from(offset, out) }
    }
}
