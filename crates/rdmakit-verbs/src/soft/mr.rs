//! The soft NIC's key table: what a real HCA keeps in its memory translation tables.
//!
//! Each registration gets one key used as both lkey and rkey (as on mlx5). Keys are drawn
//! at random from the operating system's random source: a peer cannot predict the key of a
//! region it was not given, and an off-by-one or stale key is invalid rather than someone
//! else's region.
//!
//! Besides direct keys (a region's bytes), the table holds the mlx5 key kinds rdmakit
//! emulates: **indirect** keys (KSM/UMR: an address range mapped onto other keys, re-bound
//! and invalidated at run time) and **aliases** (a key of this function standing for a key
//! of another vHCA that opened it with an access key). Resolution follows the chain to a
//! direct key and returns that key's entry, which keeps the bytes alive while an operation
//! uses them, whatever is re-bound or dropped meanwhile.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, RwLock, Weak};

use crate::error::Error;
use crate::raw::RawKsm;
use crate::types::AccessFlags;

/// One key as the NIC sees it.
pub(crate) struct MrEntry {
    /// Protection domain id.
    pub pd: u64,
    /// Address of byte 0 as peers name it: the virtual address, or 0 when zero-based.
    pub base: u64,
    pub len: u64,
    pub access: AccessFlags,
    target: Target,
    /// The access key other vHCAs must present to alias this key, once opened to them.
    cross_vhca: RwLock<Option<[u8; 32]>>,
}

/// What a key translates to.
enum Target {
    /// Bytes of a region.
    Direct {
        ptr: *mut u8,
        /// Keeps the bytes alive while this entry (or an operation holding it) exists.
        _keep: Arc<dyn Any + Send + Sync>,
    },
    /// An indirect key: its range maps onto other keys; `None` while free or invalidated.
    Indirect(RwLock<Option<Arc<Binding>>>),
    /// An alias of key `key` of another function (vHCA) of the same NIC.
    Alias { owner: Weak<KeyTable>, key: u32 },
}

/// The current translation of an indirect key: consecutive entries from offset 0.
pub(crate) struct Binding {
    segs: Vec<Seg>,
}

/// One KSM entry: `len` bytes at `start` (offset in the indirect key's range) map to
/// `target` at `target_addr`.
pub(crate) struct Seg {
    pub start: u64,
    pub len: u64,
    pub target: Arc<MrEntry>,
    pub target_addr: u64,
}

impl Binding {
    /// Entries in order, each starting where the previous one ended.
    pub fn new(segs: Vec<Seg>) -> Binding {
        Binding { segs }
    }
}

// SAFETY: `ptr` is only dereferenced through `shared_mem`'s byte-wise atomic copies and
// `AtomicU64` cells, which are sound from any thread; `_keep` (Send + Sync) owns the memory
// it points into, so the pointer stays valid wherever the entry travels.
unsafe impl Send for MrEntry {}
// SAFETY: shared use reads the pointer and length (plain data) and touches the bytes only
// through atomic copies and `AtomicU64` cells; the other fields are locks and plain data.
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

/// How many key hops a resolution may take (alias -> indirect -> direct, and one spare).
const MAX_HOPS: u32 = 4;

impl MrEntry {
    /// The memfd of a plain region a same-host requester may map (`super::direct`): a
    /// direct key over all of a [`HostBuffer`](crate::mr::HostBuffer) that has one,
    /// addressed by its virtual address.
    pub fn region_file(&self) -> Option<&super::direct::RegionFile> {
        let Target::Direct { ptr, _keep } = &self.target else { return None };
        let buf = _keep.downcast_ref::<crate::mr::HostBuffer>()?;
        let f = buf.file()?;
        (*ptr == f.ptr() && self.base == f.ptr() as u64 && self.len == buf.len() as u64).then_some(f)
    }

    /// Checks `addr..addr+len` against this key for an access needing `need` from
    /// protection domain `pd` (`None`: an alias crossing functions, where the alias's own
    /// PD was checked) and follows indirect keys and aliases to the bytes. Returns the
    /// local pointer to `addr` and the direct entry that keeps it alive.
    pub fn resolve(
        self: &Arc<Self>,
        pd: Option<u64>,
        addr: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<(*mut u8, Arc<MrEntry>), Fault> {
        self.resolve_hops(pd, addr, len, need, 0)
    }

    fn resolve_hops(
        self: &Arc<Self>,
        pd: Option<u64>,
        addr: u64,
        len: u64,
        need: AccessFlags,
        hops: u32,
    ) -> Result<(*mut u8, Arc<MrEntry>), Fault> {
        if hops > MAX_HOPS {
            return Err(Fault::Key);
        }
        if pd.is_some_and(|pd| pd != self.pd) {
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
        match &self.target {
            // `off < self.len` (or len == 0 and off <= len), so the add stays in the allocation.
            Target::Direct { ptr, .. } => Ok((ptr.wrapping_add(off as usize), self.clone())),
            Target::Indirect(b) => {
                let b = b.read().unwrap_or_else(|e| e.into_inner()).clone().ok_or(Fault::Key)?;
                // The entry holding `off`; an access must lie within one entry.
                let i = b.segs.partition_point(|s| s.start <= off).checked_sub(1).ok_or(Fault::Bounds)?;
                let seg = &b.segs[i];
                let within = off - seg.start;
                if within.checked_add(len).is_none_or(|e| e > seg.len) {
                    return Err(Fault::Bounds);
                }
                // Entries were checked to be in this key's PD when bound.
                seg.target.resolve_hops(None, seg.target_addr + within, len, need, hops + 1)
            }
            Target::Alias { owner, key } => {
                let owner = owner.upgrade().ok_or(Fault::Key)?;
                let target = owner.lookup(*key).ok_or(Fault::Key)?;
                if target.cross_vhca_key().is_none() {
                    return Err(Fault::Access);
                }
                target.resolve_hops(None, addr, len, need, hops + 1)
            }
        }
    }

    /// Checks `addr..addr+len` against this direct key (PD, access, bounds) and returns the
    /// local pointer; indirect keys and aliases resolve through [`resolve`](Self::resolve).
    #[cfg(test)]
    pub fn check(
        self: &Arc<Self>,
        pd: u64,
        addr: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<*mut u8, Fault> {
        self.resolve(Some(pd), addr, len, need).map(|(p, _)| p)
    }

    /// Re-binds an indirect key (`None`: invalidate). False if the key is not indirect.
    pub fn rebind(&self, binding: Option<Binding>) -> bool {
        match &self.target {
            Target::Indirect(b) => {
                *b.write().unwrap_or_else(|e| e.into_inner()) = binding.map(Arc::new);
                true
            }
            _ => false,
        }
    }

    /// Opens the key to other vHCAs with `access_key`.
    pub fn allow_cross_vhca(&self, access_key: [u8; 32]) {
        *self.cross_vhca.write().unwrap_or_else(|e| e.into_inner()) = Some(access_key);
    }

    /// The access key, if the key is open to other vHCAs.
    pub fn cross_vhca_key(&self) -> Option<[u8; 32]> {
        *self.cross_vhca.read().unwrap_or_else(|e| e.into_inner())
    }
}

/// The device-wide table of keys.
pub(crate) struct KeyTable {
    map: RwLock<Keys>,
}

/// Keys to entries. Hashed with FxHash, not the standard SipHash: every post looks a key
/// up, and SipHash was about a quarter of a soft write's cost in the verbs layer. A keyed
/// hash defends a table whose *inserted* keys an attacker picks; here only this table
/// inserts, and the keys it inserts are uniform random draws, so a peer's forged keys can
/// only miss: the probe length of a lookup is set by our keys, not theirs.
type Keys = HashMap<u32, Arc<MrEntry>, rustc_hash::FxBuildHasher>;

impl KeyTable {
    pub fn new() -> KeyTable {
        KeyTable { map: RwLock::new(Keys::default()) }
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
        let key = self.fresh_key(&map);
        map.insert(
            key,
            Arc::new(MrEntry {
                pd,
                base,
                len,
                access,
                target: Target::Direct { ptr, _keep: keep },
                cross_vhca: RwLock::new(None),
            }),
        );
        key
    }

    /// Creates a free indirect key of `len` bytes from `base` in PD `pd`.
    pub fn register_indirect(&self, pd: u64, base: u64, len: u64, access: AccessFlags) -> u32 {
        self.insert_with(|| MrEntry {
            pd,
            base,
            len,
            access,
            target: Target::Indirect(RwLock::new(None)),
            cross_vhca: RwLock::new(None),
        })
    }

    /// Creates an alias in PD `pd` of key `key` of the function whose table is `owner`.
    pub fn register_alias(
        &self,
        pd: u64,
        owner: &Arc<KeyTable>,
        key: u32,
        base: u64,
        len: u64,
        access: AccessFlags,
    ) -> u32 {
        self.insert_with(|| MrEntry {
            pd,
            base,
            len,
            access,
            target: Target::Alias { owner: Arc::downgrade(owner), key },
            cross_vhca: RwLock::new(None),
        })
    }

    fn insert_with(&self, entry: impl FnOnce() -> MrEntry) -> u32 {
        let mut map = self.map.write().expect("key table");
        let key = self.fresh_key(&map);
        map.insert(key, Arc::new(entry()));
        key
    }

    fn fresh_key(&self, map: &Keys) -> u32 {
        loop {
            // Unpredictable keys (a random 32-bit draw per registration); the loop skips 0
            // and any key in use.
            let key = u32::from_ne_bytes(super::random());
            if key != 0 && !map.contains_key(&key) {
                return key;
            }
        }
    }

    /// Resolves `key` for an access from PD `pd` (see [`MrEntry::resolve`]).
    pub fn resolve(
        &self,
        key: u32,
        pd: u64,
        addr: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<(*mut u8, Arc<MrEntry>), Fault> {
        self.lookup(key).ok_or(Fault::Key)?.resolve(Some(pd), addr, len, need)
    }

    /// Invalidates `key`. Operations already holding the entry finish; new ones fail, and
    /// so do a same-host requester's direct accesses (`super::direct`) from now on.
    /// Returns the entry, which accesses in progress may still hold.
    pub fn deregister(&self, key: u32) -> Option<Arc<MrEntry>> {
        let gone = self.map.write().expect("key table").remove(&key);
        if let Some(f) = gone.as_ref().and_then(|e| e.region_file()) {
            f.revoke();
        }
        gone
    }

    pub fn lookup(&self, key: u32) -> Option<Arc<MrEntry>> {
        self.map.read().expect("key table").get(&key).cloned()
    }

    /// Number of live registrations (for tests and leak checks).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.map.read().expect("key table").len()
    }

    /// The soft UMR: binds indirect key `key`, covering `key_len` bytes, to `entries`
    /// (checked by the caller: non-empty, inside their regions, of the key's PD), consecutive
    /// from offset 0.
    pub fn bind_indirect(&self, key: u32, key_len: u64, entries: &[RawKsm]) -> crate::error::Result<()> {
        let mut segs = Vec::with_capacity(entries.len());
        let mut start = 0u64;
        for (i, e) in entries.iter().enumerate() {
            let target = self.lookup(e.key).ok_or_else(|| {
                Error::InvalidArgument(format!("KSM entry {i}: region no longer registered"))
            })?;
            segs.push(Seg { start, len: e.len, target, target_addr: e.addr });
            start = start.saturating_add(e.len);
        }
        if start > key_len {
            return Err(Error::InvalidArgument(format!(
                "KSM entries map {start} bytes; the key covers {key_len}"
            )));
        }
        self.indirect(key)?.rebind(Some(Binding::new(segs)));
        Ok(())
    }

    /// The soft `LOCAL_INV`: indirect key `key` maps nothing until bound again.
    pub fn invalidate_indirect(&self, key: u32) -> crate::error::Result<()> {
        self.indirect(key)?.rebind(None);
        Ok(())
    }

    /// Opens `key` to other vHCAs of the NIC with `access_key`.
    pub fn allow_cross_vhca(&self, key: u32, access_key: [u8; 32]) -> crate::error::Result<()> {
        self.indirect(key)?.allow_cross_vhca(access_key);
        Ok(())
    }

    /// Creates an alias in PD `pd` of key `mkey` of vHCA `vhca_id`, whose table is `owner`,
    /// if that key is open to other vHCAs with `access_key`. Returns the alias key and the
    /// range it covers (base, length).
    pub fn alias_of(
        &self,
        pd: u64,
        owner: &Arc<KeyTable>,
        vhca_id: u32,
        mkey: u32,
        access_key: &[u8; 32],
        access: AccessFlags,
    ) -> crate::error::Result<(u32, u64, u64)> {
        let entry = owner
            .lookup(mkey)
            .ok_or_else(|| Error::InvalidArgument(format!("vHCA {vhca_id} has no key {mkey:#x}")))?;
        match entry.cross_vhca_key() {
            None => {
                return Err(Error::PermissionDenied(format!(
                    "key {mkey:#x} of vHCA {vhca_id} is not open to other vHCAs"
                )));
            }
            Some(k) if k != *access_key => {
                return Err(Error::PermissionDenied(format!(
                    "wrong access key for key {mkey:#x} of vHCA {vhca_id}"
                )));
            }
            Some(_) => {}
        }
        let key = self.register_alias(pd, owner, mkey, entry.base, entry.len, access);
        Ok((key, entry.base, entry.len))
    }

    /// The entry of a live key of the mlx5 kinds (`crate::mlx5`).
    fn indirect(&self, key: u32) -> crate::error::Result<Arc<MrEntry>> {
        self.lookup(key).ok_or_else(|| Error::InvalidArgument("indirect key destroyed".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_pd_access_and_bounds() {
        let table = KeyTable::new();
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
        if key.wrapping_add(1) != 0 {
            assert!(table.lookup(key.wrapping_add(1)).is_none());
        }
        assert!(table.deregister(key).is_some());
        assert!(table.lookup(key).is_none());
        assert!(table.deregister(key).is_none());
        assert_eq!(table.len(), 0);
    }
}
