//! Protection domains (`ibv_alloc_pd`). What is created in one is made on its own side:
//! `Mr::reg`, `Qp::create`, and the mlx5 keys of `mlx5dv`.

use std::ptr::NonNull;
use std::sync::Arc;

use rdmakit_sys as sys;

use super::conv::{nonnull, released};
use super::*;
use crate::error::Result;

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
        released("ibv_dealloc_pd", &self.dev.name, unsafe { sys::ibv_dealloc_pd(self.pd.as_ptr()) });
    }
}

/// A protection domain.
pub(crate) struct Pd {
    pub(super) inner: Arc<PdShared>,
    /// The PD's mlx5 UMR queue (a dedicated QP and CQ), made on first use and shared by every
    /// key of the PD (`crate::mlx5::UmrQueue`). It holds `inner`, not this.
    pub(super) umr: std::sync::Mutex<Option<Arc<std::sync::Mutex<mlx5dv::UmrQp>>>>,
}

impl Pd {
    /// Allocates a protection domain on `ctx` (`ibv_alloc_pd`).
    pub fn alloc(ctx: &Context) -> Result<Pd> {
        // SAFETY: the context is open.
        let pd = nonnull("ibv_alloc_pd", unsafe { sys::ibv_alloc_pd(ctx.dev.ctx.as_ptr()) })?;
        Ok(Pd { inner: Arc::new(PdShared { pd, dev: ctx.dev.clone() }), umr: std::sync::Mutex::new(None) })
    }

    /// `ibv_reg_mr` (see [`Mr::reg`]); for the tests of `rdma::cm`.
    ///
    /// # Safety
    /// See [`Mr::reg`].
    #[cfg(test)]
    pub unsafe fn reg_mr(&self, ptr: *mut u8, len: usize, access: crate::types::AccessFlags) -> Result<Mr> {
        // SAFETY: the caller's contract is `Mr::reg`'s, which this forwards.
        unsafe { Mr::reg(self, ptr, len, access) }
    }

    /// `ibv_create_qp` (see [`Qp::create`]); for the tests of `rdma::cm`.
    #[cfg(test)]
    pub fn create_qp(&self, send_cq: &Cq, recv_cq: &Cq, caps: crate::types::QpCaps) -> Result<Qp> {
        Qp::create(self, send_cq, recv_cq, caps)
    }
}
