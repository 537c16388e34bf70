//! Protection domains (`ibv_alloc_pd`) and what is created in them: MRs, DM registrations, QPs.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use rdmakit_sys as sys;

use super::conv::nonnull;
use super::*;
use crate::error::{Error, Result};
use crate::types::{AccessFlags, QpCaps};

pub(super) struct PdShared {
    pub(super) pd: NonNull<sys::ibv_pd>,
    pub(super) dev: Arc<Device>,
}

// SAFETY: a PD is an immutable handle to a thread-safe context object.
unsafe impl Send for PdShared {}
// SAFETY: `&PdShared` only hands the PD pointer to libibverbs calls that take it concurrently
// (registration, QP creation), which rdma-core makes thread-safe.
unsafe impl Sync for PdShared {}

impl Drop for PdShared {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd; every MR and QP holds an `Arc<PdShared>`.
        if unsafe { sys::ibv_dealloc_pd(self.pd.as_ptr()) } != 0 {
            tracing::error!(device = %self.dev.name, "ibv_dealloc_pd failed");
        }
    }
}

/// A protection domain.
pub(crate) struct Pd {
    pub(super) inner: Arc<PdShared>,
}

impl Pd {
    /// Registers `len` bytes at `ptr` (`ibv_reg_mr`).
    ///
    /// # Safety
    /// The memory must stay allocated until the returned region is deregistered.
    pub unsafe fn reg_mr(&self, ptr: *mut u8, len: usize, access: AccessFlags) -> Result<Mr> {
        // SAFETY: valid PD; the caller guarantees the memory's lifetime.
        let mr = unsafe { sys::ibv_reg_mr(self.inner.pd.as_ptr(), ptr.cast(), len, access.bits() as i32) };
        Ok(Mr::new(nonnull("ibv_reg_mr", mr)?, self.inner.clone()))
    }

    /// Registers device memory zero-based (`ibv_reg_dm_mr`).
    pub fn reg_dm_mr(&self, dm: &Dm, offset: u64, len: u64, access: AccessFlags) -> Result<Mr> {
        let access = (access | AccessFlags::ZERO_BASED).bits();
        // SAFETY: valid PD and DM (the returned Mr keeps the DM's device alive; the safe
        // layer keeps the DM itself alive through the region).
        let mr = unsafe {
            sys::ibv_reg_dm_mr(self.inner.pd.as_ptr(), dm.dm.as_ptr(), offset, len as usize, access)
        };
        if mr.is_null() && std::io::Error::last_os_error().raw_os_error() == Some(libc::EOPNOTSUPP) {
            // The header's inline sets EOPNOTSUPP when the provider has no `reg_dm_mr`.
            return Err(Error::Unsupported("ibv_reg_dm_mr not supported by the provider".into()));
        }
        Ok(Mr::new(nonnull("ibv_reg_dm_mr", mr)?, self.inner.clone()))
    }

    /// Registers a dma-buf (`ibv_reg_dmabuf_mr`).
    ///
    /// # Safety
    /// See `ProtectionDomain::register_dmabuf`.
    pub unsafe fn reg_dmabuf_mr(
        &self,
        offset: u64,
        len: usize,
        iova: u64,
        fd: i32,
        access: AccessFlags,
    ) -> Result<Mr> {
        // SAFETY: valid PD; the caller guarantees the dma-buf's validity and lifetime.
        let mr = unsafe {
            sys::ibv_reg_dmabuf_mr(self.inner.pd.as_ptr(), offset, len, iova, fd, access.bits() as i32)
        };
        Ok(Mr::new(nonnull("ibv_reg_dmabuf_mr", mr)?, self.inner.clone()))
    }

    pub fn create_qp(&self, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp> {
        // SAFETY: an all-zero ibv_qp_init_attr is a valid value (null pointers, zero caps).
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.cq.as_ptr();
        init.recv_cq = recv_cq.cq.as_ptr();
        init.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap = sys::ibv_qp_cap {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: caps.max_send_sge,
            max_recv_sge: caps.max_recv_sge,
            max_inline_data: caps.max_inline_data,
        };
        // SAFETY: valid PD and CQs of the same device; `init` is initialised.
        let qp = nonnull("ibv_create_qp", unsafe { sys::ibv_create_qp(self.inner.pd.as_ptr(), &mut init) })?;
        // ibv_create_qp writes back the capabilities it granted.
        let granted = QpCaps {
            max_send_wr: init.cap.max_send_wr,
            max_recv_wr: init.cap.max_recv_wr,
            max_send_sge: init.cap.max_send_sge,
            max_recv_sge: init.cap.max_recv_sge,
            max_inline_data: init.cap.max_inline_data,
        };
        Ok(Qp {
            qp,
            caps: granted,
            destroyed: AtomicBool::new(false),
            _pd: self.inner.clone(),
            _cqs: (send_cq.dev.clone(), recv_cq.dev.clone()),
        })
    }
}
