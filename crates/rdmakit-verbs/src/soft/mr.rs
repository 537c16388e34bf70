//! The soft NIC's key table: what a real HCA keeps in its memory translation tables.
//!
//! Each registration gets one key used as both lkey and rkey (as on mlx5). Keys are
//! scattered over the 32-bit space so that an off-by-one or stale key is invalid rather than
//! someone else's region.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};

use crate::types::AccessFlags;

/// One registered region as the NIC sees it.
pub(crate) struct MrEntry {
    /// Protection domain id.
    pub pd: u64,
    /// Address of byte 0 as peers name it: the virtual address, or 0 when zero-based.
    pub base: u64,
    pub len: u64,
    pub access: AccessFlags,
    /// Where the bytes are.
    ptr: *mut u8,
    /// Keeps the bytes alive while this entry (or an operation holding it) exists.
    _keep: Arc<dyn Any + Send + Sync>,
}

// SAFETY: `ptr` is only dereferenced through `shared_mem`'s byte-wise atomic copies and
// `AtomicU64` cells, which are sound from any thread; `_keep` (Send + Sync) owns the memory
// it points into, so the pointer stays valid wherever the entry travels.
unsafe impl Send for MrEntry {}
// SAFETY: as above; the entry has no interior mutability besides the pointed-to bytes,
// which are only accessed atomically.
unsafe impl Sync for MrEntry {}

/// Why an access was refused. Callers map it to the status their side reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fault {
    /// No such key (never registered, or deregistered).
    Key,
    /// The key belongs to another protection domain.
    Pd,
    /// The range is outside the region.
    Bounds,
    /// The region's access flags do not allow the operation.
    Access,
}

impl MrEntry {
    /// Checks `addr..addr+len` against this region for an access needing `need`, and
    /// returns the local pointer to `addr`.
    pub fn check(&self, pd: u64, addr: u64, len: u64, need: AccessFlags) -> Result<*mut u8, Fault> {
        if self.pd != pd {
            return Err(Fault::Pd);
        }
        if !self.access.contains(need) {
            return Err(Fault::Access);
        }
        let off = addr.checked_sub(self.base).ok_or(Fault::Bounds)?;
        match off.checked_add(len) {
            Some(end) if end <= self.len => {}
            _ => return Err(Fault::Bounds),
        }
        // `off < self.len` (or len == 0 and off <= len), so the add stays in the allocation.
        Ok(self.ptr.wrapping_add(off as usize))
    }
}

/// The device-wide table of keys.
pub(crate) struct KeyTable {
    map: RwLock<HashMap<u32, Arc<MrEntry>>>,
    next: AtomicU32,
    salt: u32,
}

impl KeyTable {
    pub fn new(device_index: u32) -> KeyTable {
        KeyTable {
            map: RwLock::new(HashMap::new()),
            next: AtomicU32::new(1),
            salt: device_index.wrapping_mul(0x0100_0193),
        }
    }

    /// Registers `len` bytes at `ptr`, addressed by peers from `base`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes for as long as `keep` is alive,
    /// and all other accesses to those bytes must be atomic (`shared_mem`).
    pub unsafe fn register(
        &self,
        pd: u64,
        base: u64,
        len: u64,
        access: AccessFlags,
        ptr: *mut u8,
        keep: Arc<dyn Any + Send + Sync>,
    ) -> u32 {
        let mut map = self.map.write().expect("key table");
        let key = loop {
            // An odd multiplier is a bijection on u32, so keys are unique until wrap-around;
            // the loop skips 0 and any key still in use after a wrap.
            let n = self.next.fetch_add(1, Ordering::Relaxed) ^ self.salt;
            let key = n.wrapping_mul(0x9E37_79B1);
            if key != 0 && !map.contains_key(&key) {
                break key;
            }
        };
        map.insert(key, Arc::new(MrEntry { pd, base, len, access, ptr, _keep: keep }));
        key
    }

    /// Invalidates `key`. Operations already holding the entry finish; new ones fail.
    pub fn deregister(&self, key: u32) -> bool {
        self.map.write().expect("key table").remove(&key).is_some()
    }

    pub fn lookup(&self, key: u32) -> Option<Arc<MrEntry>> {
        self.map.read().expect("key table").get(&key).cloned()
    }

    /// Number of live registrations (for tests and leak checks).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.map.read().expect("key table").len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_pd_access_and_bounds() {
        let table = KeyTable::new(3);
        let mem: Arc<Vec<u8>> = Arc::new(vec![0; 64]);
        let ptr = mem.as_ptr() as *mut u8;
        // SAFETY: the vector lives as long as the entry (it is the keepalive); no reference
        // to its contents is used while registered.
        let key = unsafe { table.register(1, 0x1000, 64, AccessFlags::REMOTE_READ, ptr, mem) };
        let e = table.lookup(key).unwrap();
        assert!(e.check(1, 0x1000, 64, AccessFlags::REMOTE_READ).is_ok());
        assert_eq!(e.check(2, 0x1000, 8, AccessFlags::REMOTE_READ), Err(Fault::Pd));
        assert_eq!(e.check(1, 0x1000, 8, AccessFlags::REMOTE_WRITE), Err(Fault::Access));
        assert_eq!(e.check(1, 0x1039, 8, AccessFlags::REMOTE_READ), Err(Fault::Bounds));
        assert_eq!(e.check(1, 0xfff, 1, AccessFlags::REMOTE_READ), Err(Fault::Bounds));
        assert_eq!(e.check(1, u64::MAX, 2, AccessFlags::REMOTE_READ), Err(Fault::Bounds));
        assert!(table.lookup(key.wrapping_add(1)).is_none());
        assert!(table.deregister(key));
        assert!(table.lookup(key).is_none());
        assert!(!table.deregister(key));
        assert_eq!(table.len(), 0);
    }
}
