//! Device memory emulation (`ibv_alloc_dm`): a fixed pool of "on-chip" bytes per device.
//!
//! As on ConnectX MEMIC, the CPU reaches it only through copy calls, allocations are
//! rounded to the device's granularity, and running out is an allocation error, not a crash.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// Allocation granularity (and alignment) of device memory, as on mlx5 (64 B).
pub(crate) const DM_ALIGN: u64 = 64;

/// The largest device memory a soft device may have (real NICs have at most a few MiB).
pub(crate) const MAX_DM_CAPACITY: u64 = 1 << 30;

/// The device's pool.
pub(crate) struct DmPool {
    mem: Option<NonNull<u8>>,
    capacity: u64,
    /// Free blocks: offset → length, coalesced.
    free: Mutex<BTreeMap<u64, u64>>,
}

// SAFETY: the pool's bytes are only accessed through `shared_mem` atomic copies and
// `AtomicU64` cells; the free list is behind a mutex.
unsafe impl Send for DmPool {}
// SAFETY: through `&DmPool` the bytes are reached only by atomic copies and `AtomicU64` cells,
// and the free list only under its mutex.
unsafe impl Sync for DmPool {}

impl DmPool {
    /// A pool of `capacity` bytes (rounded down to [`DM_ALIGN`]). A capacity above
    /// [`MAX_DM_CAPACITY`] is an `InvalidArgument`; an allocation failure is an error, not
    /// an abort.
    pub fn new(capacity: u64) -> Result<DmPool> {
        if capacity > MAX_DM_CAPACITY {
            return Err(Error::InvalidArgument(format!(
                "soft NIC device memory of {capacity} bytes exceeds the {MAX_DM_CAPACITY}-byte maximum"
            )));
        }
        let capacity = capacity / DM_ALIGN * DM_ALIGN;
        let mem = if capacity == 0 {
            None
        } else {
            let layout = Layout::from_size_align(capacity as usize, 4096)
                .map_err(|e| Error::InvalidArgument(format!("device memory of {capacity} bytes: {e}")))?;
            // SAFETY: non-zero size layout.
            let p = unsafe { alloc_zeroed(layout) };
            Some(NonNull::new(p).ok_or_else(|| Error::Os {
                call: "alloc",
                source: std::io::Error::from(std::io::ErrorKind::OutOfMemory),
            })?)
        };
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Ok(DmPool { mem, capacity, free: Mutex::new(free) })
    }

    /// Bytes not allocated.
    #[cfg(test)]
    pub fn free_bytes(&self) -> u64 {
        self.free.lock().expect("dm free list").values().sum()
    }

    /// First-fit allocation of `len` bytes (rounded up to [`DM_ALIGN`]). Returns the offset.
    pub fn alloc(&self, len: u64) -> Result<u64> {
        if self.capacity == 0 {
            return Err(Error::Unsupported("device has no device memory (max_dm_size = 0)".into()));
        }
        if len == 0 {
            return Err(Error::InvalidArgument("device memory length must be non-zero".into()));
        }
        let want = len.div_ceil(DM_ALIGN).saturating_mul(DM_ALIGN);
        let mut free = self.free.lock().expect("dm free list");
        let found = free.iter().find(|(_, l)| **l >= want).map(|(o, l)| (*o, *l));
        match found {
            Some((off, l)) => {
                free.remove(&off);
                if l > want {
                    free.insert(off + want, l - want);
                }
                Ok(off)
            }
            None => Err(Error::DeviceMemoryExhausted {
                requested: len,
                available: free.values().copied().max().unwrap_or(0),
                capacity: self.capacity,
            }),
        }
    }

    /// Returns a block to the pool, merging it with free neighbours.
    pub fn free(&self, off: u64, len: u64) {
        let len = len.div_ceil(DM_ALIGN) * DM_ALIGN;
        let mut free = self.free.lock().expect("dm free list");
        let (mut start, mut size) = (off, len);
        if let Some((&po, &pl)) = free.range(..off).next_back()
            && po + pl == off
        {
            free.remove(&po);
            start = po;
            size += pl;
        }
        if let Some(&nl) = free.get(&(off + len)) {
            free.remove(&(off + len));
            size += nl;
        }
        free.insert(start, size);
    }

    /// Pointer to byte `off` of the pool.
    ///
    /// The pointer is valid while the pool lives; callers keep the pool alive (through the
    /// device `Arc`) and access the bytes only atomically.
    pub fn ptr(&self, off: u64) -> *mut u8 {
        let base = self.mem.map_or(std::ptr::null_mut(), NonNull::as_ptr);
        base.wrapping_add(off as usize)
    }
}

impl Drop for DmPool {
    fn drop(&mut self) {
        if let Some(p) = self.mem {
            let layout = Layout::from_size_align(self.capacity as usize, 4096).expect("dm layout");
            // SAFETY: allocated in `new` with this layout; the pool is being dropped, so no
            // allocation (which holds the device, which holds the pool) is alive.
            unsafe { dealloc(p.as_ptr(), layout) };
        }
    }
}

/// One `ibv_alloc_dm` allocation on a soft device. Freed on drop.
pub(crate) struct SoftDm {
    pub device: Arc<super::SoftDevice>,
    pub offset: u64,
    pub len: u64,
}

impl SoftDm {
    pub fn alloc(device: &Arc<super::SoftDevice>, len: u64) -> Result<SoftDm> {
        let offset = device.dm.alloc(len)?;
        Ok(SoftDm { device: device.clone(), offset, len })
    }

    /// Pointer to byte 0 of this allocation (see [`DmPool::ptr`]).
    pub fn ptr(&self) -> *mut u8 {
        self.device.dm.ptr(self.offset)
    }
}

impl Drop for SoftDm {
    fn drop(&mut self) {
        self.device.dm.free(self.offset, self.len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_exhaustion_and_coalescing() {
        let pool = DmPool::new(1024).unwrap();
        let a = pool.alloc(1).unwrap();
        let b = pool.alloc(100).unwrap();
        assert_eq!((a, b), (0, 64));
        let err = pool.alloc(1024).unwrap_err();
        assert!(matches!(err, Error::DeviceMemoryExhausted { requested: 1024, available: 832, .. }));
        pool.free(a, 1);
        pool.free(b, 100);
        assert_eq!(pool.free_bytes(), 1024);
        assert_eq!(pool.alloc(1024).unwrap(), 0);
        assert!(DmPool::new(0).unwrap().alloc(8).is_err());
        assert!(matches!(DmPool::new(u64::MAX), Err(Error::InvalidArgument(_))));
    }
}
