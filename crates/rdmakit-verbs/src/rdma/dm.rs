//! Device memory (`ibv_alloc_dm`): copies in and out.

use std::ptr::NonNull;
use std::sync::Arc;

use rdmakit_sys as sys;

use super::conv::errno_ret;
use super::*;
use crate::error::Result;

/// Device memory.
pub(crate) struct Dm {
    pub(super) dm: NonNull<sys::ibv_dm>,
    pub(super) dev: Arc<Device>,
}

// SAFETY: ibv_memcpy_{to,from}_dm are thread-safe provider calls on an immutable handle.
unsafe impl Send for Dm {}
// SAFETY: `&Dm` only copies in and out with ibv_memcpy_{to,from}_dm, thread-safe provider calls
// on an immutable handle.
unsafe impl Sync for Dm {}

impl Dm {
    pub fn copy_to(&self, offset: u64, data: &[u8]) -> Result<()> {
        // SAFETY: valid DM; bounds checked by the safe layer; `data` is a valid source.
        errno_ret("ibv_memcpy_to_dm", unsafe {
            sys::ibv_memcpy_to_dm(self.dm.as_ptr(), offset, data.as_ptr().cast(), data.len())
        })
    }

    pub fn copy_from(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        // SAFETY: valid DM; bounds checked by the safe layer; `out` is a valid, writable
        // destination of `out.len()` bytes.
        errno_ret("ibv_memcpy_from_dm", unsafe {
            sys::ibv_memcpy_from_dm(out.as_mut_ptr().cast(), self.dm.as_ptr(), offset, out.len())
        })
    }
}

impl Drop for Dm {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_dm; regions on it hold the public DM, so none is left.
        if unsafe { sys::ibv_free_dm(self.dm.as_ptr()) } != 0 {
            tracing::error!(device = %self.dev.name, "ibv_free_dm failed");
        }
    }
}
