//! A registration cache: short-lived buffers reuse registered regions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rdmakit_verbs::{AccessFlags, Error, MemoryRegion, ProtectionDomain, Result};

/// Counters of a registration cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
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

/// Counters of a [`RangeCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RangeCacheStats {
    /// Lookups served by a cached registration covering the whole range.
    pub hits: u64,
    /// Lookups that registered (possibly merging cached neighbours).
    pub misses: u64,
    /// Cached registrations folded into a larger one because the new range overlapped them.
    pub merged: u64,
    /// Idle registrations dropped to stay under the byte limit (least recently used first).
    pub evicted: u64,
    /// Registrations removed by [`RangeCache::invalidate`].
    pub invalidated: u64,
    /// Registrations in the cache now (in use or idle).
    pub entries: u64,
    /// Bytes of idle registrations (nobody holds them) in the cache now.
    pub idle_bytes: u64,
}

struct RangeEntry {
    end: u64,
    region: MemoryRegion,
    users: usize,
    last_used: u64,
}

struct RangeState {
    /// Registrations by start address; they never overlap each other.
    map: std::collections::BTreeMap<u64, RangeEntry>,
    clock: u64,
    stats: RangeCacheStats,
    /// Every [`RangeCache`] clone is gone: nothing idle is kept (see [`Open`]).
    closed: bool,
}

struct RangeShared {
    pd: ProtectionDomain,
    access: AccessFlags,
    max_idle_bytes: u64,
    state: Mutex<RangeState>,
}

/// A registration cache over memory the application owns, by address range, as UCX's rcache
/// (the seed talk reuses it on the host and the DPU): [`register`](Self::register) finds a
/// cached registration covering the range (a hit is an ordered-map lookup and a reference
/// count), or registers the range, merged with every cached registration it overlaps, so
/// that later lookups of the neighbourhood hit. (Ranges that only touch stay apart: they may
/// be two allocations, which one registration must not span.) Registrations nobody holds stay
/// cached up to a byte limit and are evicted least recently used first.
///
/// # Memory that is freed or remapped
/// The cache cannot see the application free or `munmap` memory. The rule, which
/// [`register`](Self::register)'s safety contract states: before memory that was registered
/// through the cache is freed, remapped or handed to code that touches it directly, call
/// [`invalidate`](Self::invalidate) on its range and drop every [`RangeRegistration`] for
/// it. Invalidation removes the cached registrations at once; one still held by a
/// registration handle (or an in-flight work request) is deregistered when the last holder
/// lets go.
///
/// ```
/// use rdmakit_memory::xgvmi::RangeCache;
/// use rdmakit_verbs::{AccessFlags, Context};
/// let pd = Context::open_soft().alloc_pd()?;
/// let cache = RangeCache::new(&pd, AccessFlags::ALL_REMOTE, 1 << 20);
/// let mut buf = vec![0u64; 1024]; // the application's memory (8-byte aligned)
/// let base = std::ptr::NonNull::new(buf.as_mut_ptr().cast::<u8>()).unwrap();
/// // SAFETY: `buf` outlives the cache's registrations of it (invalidated below) and is not
/// // touched directly meanwhile.
/// let r = unsafe { cache.register(base, 8192)? };
/// r.region().write_at(r.offset(), b"hello!!!")?;
/// let again = unsafe { cache.register(base.add(8), 64)? }; // inside: a hit
/// assert_eq!(cache.stats().hits, 1);
/// drop((r, again));
/// cache.invalidate(base.as_ptr() as u64, 8192);
/// assert_eq!(&buf[0].to_ne_bytes(), b"hello!!!");
/// # Ok::<(), rdmakit_verbs::Error>(())
/// ```
#[derive(Clone)]
pub struct RangeCache {
    shared: Arc<RangeShared>,
    /// Held by the cache and its clones only, not by registrations: the last one closes
    /// the cache.
    _open: Arc<Open>,
}

/// Closes a [`RangeCache`] when its last clone is dropped. [`register`](RangeCache::register)'s
/// contract lets the application free its memory once it has dropped the cache and every
/// registration of that memory, so the registrations nobody holds are deregistered then (a
/// registration of other memory, still held, must not keep them), and each one still held
/// is deregistered when its last holder lets go, instead of being cached.
struct Open(Arc<RangeShared>);

impl Drop for Open {
    fn drop(&mut self) {
        let mut st = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        st.closed = true;
        let idle = evict_idle(&mut st, 0);
        drop(st);
        drop(idle); // deregistered outside the lock
    }
}

/// Removes idle registrations, least recently used first, until at most `limit` idle
/// bytes remain; returns them, to be dropped (deregistered) outside the lock.
fn evict_idle(st: &mut RangeState, limit: u64) -> Vec<MemoryRegion> {
    let mut evicted = Vec::new();
    while st.stats.idle_bytes > limit {
        let Some((&s, _)) = st.map.iter().filter(|(_, e)| e.users == 0).min_by_key(|(_, e)| e.last_used)
        else {
            break;
        };
        let e = st.map.remove(&s).expect("found above");
        st.stats.idle_bytes -= e.end - s;
        st.stats.evicted += 1;
        evicted.push(e.region);
    }
    st.stats.entries = st.map.len() as u64;
    evicted
}

/// A range registered through a [`RangeCache`]: the cached registration covering it, and
/// where the range starts in it. Dropping it lets the cache keep or evict the registration.
pub struct RangeRegistration {
    region: MemoryRegion,
    start: u64,
    offset: u64,
    len: u64,
    cache: Arc<RangeShared>,
}

impl RangeCache {
    /// A cache of registrations on `pd` with `access`, keeping at most `max_idle_bytes` of
    /// registrations nobody holds.
    pub fn new(pd: &ProtectionDomain, access: AccessFlags, max_idle_bytes: u64) -> Self {
        let shared = Arc::new(RangeShared {
            pd: pd.clone(),
            access,
            max_idle_bytes,
            state: Mutex::new(RangeState {
                map: std::collections::BTreeMap::new(),
                clock: 0,
                stats: RangeCacheStats::default(),
                closed: false,
            }),
        });
        RangeCache { _open: Arc::new(Open(shared.clone())), shared }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RangeState> {
        // Every update leaves the map consistent before it can panic: usable after a poison.
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A registration covering `addr..addr + len`: cached if one covers it, else a new one
    /// spanning the range and every cached registration it overlaps. `addr` and
    /// `len` must be multiples of 8 (see [`ProtectionDomain::register_raw`]).
    ///
    /// # Safety
    /// `addr..addr + len` is memory the caller owns that is allocated, readable and writable,
    /// and stays so, untouched by any code but rdmakit and the NIC (no Rust references to it),
    /// until the caller has called [`invalidate`](Self::invalidate) on it (or dropped the
    /// cache) **and** dropped every [`RangeRegistration`] and work request using it. This is
    /// [`ProtectionDomain::register_raw`]'s contract, extended to the cache's lifetime: an idle
    /// cached registration still lets the NIC and peers reach the memory. And `addr` must
    /// carry the provenance of the whole allocation it lies in (derived from the
    /// allocation's own pointer, e.g. `vec.as_mut_ptr().add(off)`, not from a sub-slice's
    /// `as_mut_ptr()`): a miss merges the cached ranges that overlap `addr..addr + len` into
    /// one registration, based at `addr` moved to the union's start, and the NIC then
    /// reaches the union through that pointer.
    #[allow(unsafe_code)] // registers memory the application owns: its contract is the caller's
    pub unsafe fn register(&self, addr: std::ptr::NonNull<u8>, len: usize) -> Result<RangeRegistration> {
        let start = addr.as_ptr() as u64;
        let end = start.checked_add(len as u64).filter(|_| len > 0).ok_or_else(|| {
            Error::InvalidArgument(format!("range of {len} bytes at {start:#x} is empty or wraps"))
        })?;
        // `register_raw`'s rule, checked here too: a hit would not reach it.
        if !start.is_multiple_of(8) || !len.is_multiple_of(8) {
            return Err(Error::InvalidArgument(format!(
                "range of {len} bytes at {start:#x}: address and length must be multiples of 8"
            )));
        }
        let mut st = self.lock();
        st.clock += 1;
        let now = st.clock;
        // The registration starting at or before `start`, if it reaches `end`: a hit.
        if let Some((&s, e)) = st.map.range_mut(..=start).next_back()
            && e.end >= end
        {
            e.users += 1;
            e.last_used = now;
            let region = e.region.clone();
            if e.users == 1 {
                st.stats.idle_bytes -= e.end - s;
            }
            st.stats.hits += 1;
            return Ok(self.handle(region, s, start, len as u64));
        }
        // A miss: fold in every cached registration that overlaps the range. Overlapping
        // ranges share bytes, so they lie in the same allocation as this one: the union is
        // one allocation's memory, every byte of it vouched for. Merely touching ranges may be
        // two adjacent allocations, which no one pointer may span: they stay apart.
        let (mut lo, mut hi) = (start, end);
        let neighbours: Vec<u64> =
            st.map.range(..end).rev().take_while(|(_, e)| e.end > start).map(|(&s, _)| s).collect();
        let mut folded = Vec::with_capacity(neighbours.len());
        for s in neighbours {
            let e = st.map.remove(&s).expect("listed above");
            lo = lo.min(s);
            hi = hi.max(e.end);
            if e.users == 0 {
                st.stats.idle_bytes -= e.end - s;
            }
            st.stats.merged += 1;
            folded.push(e.region);
        }
        st.stats.misses += 1;
        // The caller's pointer, moved to the union's start: it carries the provenance of the
        // caller's whole allocation (the contract), which holds the whole union (see above).
        let base = std::ptr::NonNull::new(addr.as_ptr().with_addr(lo as usize))
            .expect("a range start inside the caller's allocation");
        // SAFETY: every byte of lo..hi lies in one allocation, in ranges some caller
        // registered under this contract (this one, or folded neighbours overlapping it),
        // none invalidated.
        let region = unsafe { self.shared.pd.register_raw(base, (hi - lo) as usize, self.shared.access) };
        let region = match region {
            Ok(r) => r,
            Err(e) => {
                st.stats.entries = st.map.len() as u64;
                return Err(e);
            }
        };
        st.map.insert(lo, RangeEntry { end: hi, region: region.clone(), users: 1, last_used: now });
        st.stats.entries = st.map.len() as u64;
        drop(st);
        drop(folded); // deregistered outside the lock, once nobody else holds them
        Ok(self.handle(region, lo, start, len as u64))
    }

    fn handle(&self, region: MemoryRegion, entry_start: u64, start: u64, len: u64) -> RangeRegistration {
        RangeRegistration {
            region,
            start: entry_start,
            offset: start - entry_start,
            len,
            cache: self.shared.clone(),
        }
    }

    /// Removes every cached registration overlapping `addr..addr + len` (call it before that
    /// memory is freed or remapped). Ones still held are deregistered when released. Returns
    /// how many were removed.
    pub fn invalidate(&self, addr: u64, len: u64) -> usize {
        let end = addr.saturating_add(len);
        let mut st = self.lock();
        let hit: Vec<u64> =
            st.map.range(..end).rev().take_while(|(_, e)| e.end > addr).map(|(&s, _)| s).collect();
        let mut removed = Vec::with_capacity(hit.len());
        for s in &hit {
            let e = st.map.remove(s).expect("listed above");
            if e.users == 0 {
                st.stats.idle_bytes -= e.end - s;
            }
            removed.push(e.region);
        }
        st.stats.invalidated += hit.len() as u64;
        st.stats.entries = st.map.len() as u64;
        drop(st);
        drop(removed);
        hit.len()
    }

    /// The counters.
    pub fn stats(&self) -> RangeCacheStats {
        self.lock().stats
    }
}

impl RangeRegistration {
    /// The registration (it may cover more than this range: use [`offset`](Self::offset)).
    pub fn region(&self) -> &MemoryRegion {
        &self.region
    }

    /// Where this range starts in [`region`](Self::region).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The range's length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: ranges have at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A local slice of exactly this range, for work requests.
    pub fn local(&self) -> Result<rdmakit_verbs::LocalSlice> {
        let len = u32::try_from(self.len).map_err(|_| Error::InvalidArgument("range over 4 GiB".into()))?;
        self.region.slice(self.offset, len)
    }

    /// The descriptor of exactly this range, for a peer.
    pub fn remote(&self) -> Result<rdmakit_verbs::RemoteRegion> {
        let r = self.region.remote();
        Ok(rdmakit_verbs::RemoteRegion { addr: r.addr + self.offset, len: self.len, rkey: r.rkey })
    }
}

impl Drop for RangeRegistration {
    fn drop(&mut self) {
        let mut st = self.cache.state.lock().unwrap_or_else(|e| e.into_inner());
        let idle = {
            let Some(e) = st.map.get_mut(&self.start) else { return };
            // An invalidated and re-registered range may start here too: only ours counts.
            if !e.region.same_registration(&self.region) {
                return;
            }
            e.users -= 1;
            (e.users == 0).then_some(e.end - self.start)
        };
        let Some(bytes) = idle else { return };
        st.stats.idle_bytes += bytes;
        let limit = if st.closed { 0 } else { self.cache.max_idle_bytes };
        let evicted = evict_idle(&mut st, limit);
        drop(st);
        drop(evicted); // deregistered outside the lock
    }
}
