//! A registration cache: short-lived buffers reuse registered regions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rdmakit_verbs::{AccessFlags, Error, MemoryRegion, ProtectionDomain, Result};

/// Counters of a registration cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegCacheStats {
    /// Requests served by a cached region.
    pub hits: u64,
    /// Requests that registered a new region.
    pub misses: u64,
    /// Regions deregistered on return because the cache was full.
    pub evicted: u64,
    /// Regions returned while something else (a clone, an in-flight work request) still
    /// held them: not reused, deregistered when the last holder lets go.
    pub busy_on_return: u64,
    /// Bytes of registered regions waiting in the cache.
    pub cached_bytes: u64,
}

/// Idle regions by size class (log2) and the counters, under one lock.
type Table = (HashMap<u32, Vec<MemoryRegion>>, RegCacheStats);

struct Shared {
    pd: ProtectionDomain,
    access: AccessFlags,
    max_cached_bytes: u64,
    state: Mutex<Table>,
}

/// Registered regions by power-of-two size class, handed out and taken back.
///
/// A region comes back to the cache when its [`CachedRegion`] is dropped, and only if
/// nothing else still holds it ([`MemoryRegion::is_unique`]): a region an in-flight work
/// request still references is never handed to a new user. Peers that were given the
/// region's rkey can still reach it, as with any registration cache; export regions to
/// peers through keys you revoke (the UMR pool's exports are invalidated at release).
#[derive(Clone)]
pub struct RegistrationCache {
    shared: Arc<Shared>,
}

/// A region from the cache; returns to it on drop.
pub struct CachedRegion {
    region: Option<MemoryRegion>,
    len: usize,
    cache: Arc<Shared>,
}

impl RegistrationCache {
    /// A cache of regions registered on `pd` with `access`, keeping at most
    /// `max_cached_bytes` of idle registrations.
    pub fn new(pd: &ProtectionDomain, access: AccessFlags, max_cached_bytes: u64) -> Self {
        RegistrationCache {
            shared: Arc::new(Shared {
                pd: pd.clone(),
                access,
                max_cached_bytes,
                state: Mutex::new((HashMap::new(), RegCacheStats::default())),
            }),
        }
    }

    fn class(len: usize) -> Result<(u32, usize)> {
        let size = len.max(64).checked_next_power_of_two().ok_or_else(|| {
            Error::InvalidArgument(format!("a {len}-byte buffer is too large for the registration cache"))
        })?;
        Ok((size.trailing_zeros(), size))
    }

    /// A registered region of at least `len` bytes (its size class, a power of two of at
    /// least 64 bytes): a cached one if there is one, else a new registration. Its contents
    /// are whatever the last user left.
    pub fn get(&self, len: usize) -> Result<CachedRegion> {
        if len == 0 {
            return Err(Error::InvalidArgument("a cached region needs at least one byte".into()));
        }
        let (class, size) = Self::class(len)?;
        {
            let mut g = lock(&self.shared);
            let (map, stats) = &mut *g;
            if let Some(region) = map.get_mut(&class).and_then(Vec::pop) {
                stats.hits += 1;
                stats.cached_bytes -= size as u64;
                return Ok(CachedRegion { region: Some(region), len, cache: self.shared.clone() });
            }
            stats.misses += 1;
        }
        let region = self.shared.pd.alloc_mr(size, self.shared.access)?;
        Ok(CachedRegion { region: Some(region), len, cache: self.shared.clone() })
    }

    /// The counters.
    pub fn stats(&self) -> RegCacheStats {
        lock(&self.shared).1
    }
}

fn lock(s: &Shared) -> std::sync::MutexGuard<'_, Table> {
    // Updates are single operations plus counters: consistent even after a panic elsewhere.
    s.state.lock().unwrap_or_else(|e| e.into_inner())
}

impl CachedRegion {
    /// The region (its length is the size class, at least [`len`](Self::len)).
    pub fn region(&self) -> &MemoryRegion {
        self.region.as_ref().expect("present until drop")
    }

    /// The length asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: cached regions have at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::ops::Deref for CachedRegion {
    type Target = MemoryRegion;
    fn deref(&self) -> &MemoryRegion {
        self.region()
    }
}

impl Drop for CachedRegion {
    fn drop(&mut self) {
        let Some(region) = self.region.take() else { return };
        let size = region.len() as u64;
        let mut g = lock(&self.cache);
        let (map, stats) = &mut *g;
        if !region.is_unique() {
            stats.busy_on_return += 1;
            return;
        }
        if stats.cached_bytes + size > self.cache.max_cached_bytes {
            stats.evicted += 1;
            drop(g);
            drop(region); // deregistered outside the lock
            return;
        }
        stats.cached_bytes += size;
        map.entry(size.trailing_zeros()).or_default().push(region);
    }
}
