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

    /// Copies `data` in at `offset` (whole 4-byte words, see [`check_words`]), through a
    /// 4-aligned copy only when `data` is not 4-aligned itself.
    pub fn copy_to(&self, offset: u64, data: &[u8]) -> Result<()> {
        check_words(offset, data.len())?;
        let bounce;
        let src = if (data.as_ptr() as usize).is_multiple_of(4) {
            data.as_ptr()
        } else {
            bounce = aligned_copy(data);
            bounce.as_ptr().cast::<u8>()
        };
        // SAFETY: valid DM; bounds checked by the safe layer; `src` is a 4-aligned source of
        // `data.len()` bytes (`data` itself, or `bounce`, alive to the end of the call).
        errno_ret("ibv_memcpy_to_dm", unsafe {
            sys::ibv_memcpy_to_dm(self.dm.as_ptr(), offset, src.cast(), data.len())
        })
    }

    /// Copies out from `offset` (whole 4-byte words, see [`check_words`]), through a
    /// 4-aligned buffer only when `out` is not 4-aligned itself.
    pub fn copy_from(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        check_words(offset, out.len())?;
        if (out.as_ptr() as usize).is_multiple_of(4) {
            // SAFETY: valid DM; bounds checked by the safe layer; `out` is a 4-aligned,
            // writable destination of `out.len()` bytes.
            return errno_ret("ibv_memcpy_from_dm", unsafe {
                sys::ibv_memcpy_from_dm(out.as_mut_ptr().cast(), self.dm.as_ptr(), offset, out.len())
            });
        }
        let mut buf = vec![0u32; out.len() / 4];
        // SAFETY: valid DM; bounds checked by the safe layer; `buf` is a 4-aligned, writable
        // destination of `out.len()` bytes.
        errno_ret("ibv_memcpy_from_dm", unsafe {
            sys::ibv_memcpy_from_dm(buf.as_mut_ptr().cast(), self.dm.as_ptr(), offset, out.len())
        })?;
        // SAFETY: `buf` holds `out.len()` bytes, just written; no overlap.
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr().cast::<u8>(), out.as_mut_ptr(), out.len()) };
        Ok(())
    }
}

/// `data` (whole words) in a 4-aligned buffer.
fn aligned_copy(data: &[u8]) -> Vec<u32> {
    let mut buf = vec![0u32; data.len() / 4];
    // SAFETY: `buf` holds `data.len()` bytes (whole words); the two don't overlap.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.as_mut_ptr().cast::<u8>(), data.len()) };
    buf
}

/// A copy of `len` bytes at `offset` must be whole 4-byte words at a 4-byte offset: mlx5
/// reads and writes device memory a 32-bit word at a time, through the host buffer as
/// `uint32_t *` (so that buffer must be 4-aligned too), and refuses anything else (`EINVAL`).
fn check_words(offset: u64, len: usize) -> Result<()> {
    if !offset.is_multiple_of(4) || !len.is_multiple_of(4) {
        return Err(Error::InvalidArgument(format!(
            "device memory copy of {len} bytes at offset {offset}: the device moves whole 4-byte words at 4-byte offsets"
        )));
    }
    Ok(())
}

impl Drop for Dm {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_dm; regions on it hold the public DM, so none is left.
        released("ibv_free_dm", &self.dev.name, unsafe { sys::ibv_free_dm(self.dm.as_ptr()) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// mlx5 moves device memory in 32-bit words through a `uint32_t *` host buffer: a copy
    /// at an odd offset or of a partial word is refused with a clear error before the call,
    /// and the host side is always a 4-aligned buffer.
    #[test]
    fn device_memory_copies_are_whole_aligned_words() {
        for (offset, len) in [(2, 8), (4, 6), (1, 3)] {
            assert!(matches!(check_words(offset, len), Err(Error::InvalidArgument(_))), "{offset}+{len}");
        }
        assert!(check_words(8, 16).is_ok() && check_words(0, 0).is_ok());
        // An unaligned source is copied into an aligned buffer, bytes unchanged.
        let bytes: Vec<u8> = (0..17).collect();
        let buf = aligned_copy(&bytes[1..]);
        assert_eq!(buf.len(), 4);
        assert!((buf.as_ptr() as usize).is_multiple_of(4));
        // SAFETY: 16 initialised bytes of `buf`.
        let got = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), 16) };
        assert_eq!(got, &bytes[1..]);
    }
}
