//! Memory regions (`ibv_reg_mr`), deregistered once.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rdmakit_sys as sys;

use super::*;

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
        let rc = unsafe { sys::ibv_dereg_mr(self.mr.as_ptr()) };
        if rc != 0 {
            tracing::error!(rc, "ibv_dereg_mr failed");
        }
        rc == 0
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        self.deregister();
    }
}
