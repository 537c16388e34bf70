//! Memory regions (`ibv_reg_mr`), deregistered once.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rdmakit_sys as sys;

use super::conv::{nonnull, nonnull_os, released};
use super::*;
use crate::error::{Error, Result};
use crate::types::AccessFlags;

/// A registered memory region.
pub(crate) struct Mr {
    pub(super) mr: NonNull<sys::ibv_mr>,
    pub(super) done: AtomicBool,
    pub(super) _pd: Arc<PdShared>,
}

// SAFETY: an MR handle is immutable after registration; deregistration is guarded by
// `done`.
unsafe impl Send for Mr {}
// SAFETY: `&Mr` reads the immutable `ibv_mr` fields; deregistration is idempotent through the
// atomic `done` flag.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers `len` bytes at `ptr` (`ibv_reg_mr`).
    ///
    /// # Safety
    /// The memory must stay allocated until the returned region is deregistered.
    pub unsafe fn reg(pd: &Pd, ptr: *mut u8, len: usize, access: AccessFlags) -> Result<Mr> {
        // SAFETY: valid PD; the caller guarantees the memory's lifetime.
        let mr = unsafe { sys::ibv_reg_mr(pd.inner.pd.as_ptr(), ptr.cast(), len, access.bits() as i32) };
        Ok(Mr::new(nonnull("ibv_reg_mr", mr)?, pd.inner.clone()))
    }

    /// Registers device memory zero-based (`ibv_reg_dm_mr`).
    pub fn reg_dm(pd: &Pd, dm: &Dm, offset: u64, len: u64, access: AccessFlags) -> Result<Mr> {
        let access = (access | AccessFlags::ZERO_BASED).bits();
        // SAFETY: valid PD and DM (the returned Mr keeps the DM's device alive; the safe
        // layer keeps the DM itself alive through the region).
        let mr =
            unsafe { sys::ibv_reg_dm_mr(pd.inner.pd.as_ptr(), dm.dm.as_ptr(), offset, len as usize, access) };
        match nonnull_os(mr) {
            Ok(mr) => Ok(Mr::new(mr, pd.inner.clone())),
            // The header's inline sets EOPNOTSUPP when the provider has no `reg_dm_mr`.
            Err(os) if os.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                Err(Error::Unsupported("ibv_reg_dm_mr not supported by the provider".into()))
            }
            Err(source) => Err(Error::Os { call: "ibv_reg_dm_mr", source }),
        }
    }

    /// Registers a dma-buf (`ibv_reg_dmabuf_mr`).
    ///
    /// # Safety
    /// See `ProtectionDomain::register_dmabuf`.
    pub unsafe fn reg_dmabuf(
        pd: &Pd,
        offset: u64,
        len: usize,
        iova: u64,
        fd: i32,
        access: AccessFlags,
    ) -> Result<Mr> {
        // SAFETY: valid PD; the caller guarantees the dma-buf's validity and lifetime.
        let mr = unsafe {
            sys::ibv_reg_dmabuf_mr(pd.inner.pd.as_ptr(), offset, len, iova, fd, access.bits() as i32)
        };
        Ok(Mr::new(nonnull("ibv_reg_dmabuf_mr", mr)?, pd.inner.clone()))
    }

    pub(super) fn new(mr: NonNull<sys::ibv_mr>, pd: Arc<PdShared>) -> Mr {
        Mr { mr, done: AtomicBool::new(false), _pd: pd }
    }

    pub fn lkey(&self) -> u32 {
        // SAFETY: valid until deregistered, which only `deregister`/drop do.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    pub fn rkey(&self) -> u32 {
        // SAFETY: the `ibv_mr` stays valid until deregistered, which only `deregister`/drop do,
        // and its `rkey` is never written after registration.
        unsafe { (*self.mr.as_ptr()).rkey }
    }

    /// `ibv_dereg_mr`; true on success (or if already done). On failure the NIC may still
    /// access the memory, and the caller must not free it.
    pub fn deregister(&self) -> bool {
        if self.done.swap(true, Ordering::AcqRel) {
            return true;
        }
        // SAFETY: registered, and deregistered once (guarded by `done`).
        released("ibv_dereg_mr", &self._pd.dev.name, unsafe { sys::ibv_dereg_mr(self.mr.as_ptr()) })
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        self.deregister();
    }
}
