//! Device memory (`ibv_alloc_dm`): copies in and out.

use std::ptr::NonNull;
use std::sync::Arc;

use rdmakit_sys as sys;

use super::conv::{errno_ret, nonnull_os, released};
use super::*;
use crate::error::{Error, Result};

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
    /// Allocates `len` bytes of device memory on `ctx` (`ibv_alloc_dm`), 8-byte aligned;
    /// `max` is the device's capacity, for the error.
    pub fn alloc(ctx: &Context, len: u64, max: u64) -> Result<Dm> {
        let mut attr = sys::ibv_alloc_dm_attr {
            length: len as usize,
            // 8-byte alignment: device-memory atomics need it.
            log_align_req: 3,
            comp_mask: 0,
        };
        // SAFETY: open context; `attr` is a valid, initialised attribute struct.
        let dm = unsafe { sys::ibv_alloc_dm(ctx.dev.ctx.as_ptr(), &mut attr) };
        // The header's inline sets EOPNOTSUPP when the provider has no `alloc_dm` at all.
        match nonnull_os(dm) {
            Err(os) => match os.raw_os_error().unwrap_or(0) {
                libc::ENOMEM | libc::ENOSPC => {
                    Err(Error::DeviceMemoryExhausted { requested: len, available: 0, capacity: max })
                }
                libc::EOPNOTSUPP | libc::ENOSYS => {
                    Err(Error::Unsupported(format!("{}: device memory not supported", ctx.dev.name)))
                }
                e => Err(Error::errno("ibv_alloc_dm", e)),
            },
            Ok(dm) => Ok(Dm { dm, dev: ctx.dev.clone() }),
        }
    }

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
        released("ibv_free_dm", &self.dev.name, unsafe { sys::ibv_free_dm(self.dm.as_ptr()) });
    }
}
