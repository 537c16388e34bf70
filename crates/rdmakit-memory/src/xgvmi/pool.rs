//! The host side: a LIFO pool of UMR mkeys opened to other vHCAs.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rdmakit_verbs::{Error, Result};

use super::PackedKey;

/// What the pool needs from the host's device: [`HostFunction`](super::HostFunction)
/// over `rdmakit_verbs::mlx5`, or a model in tests.
pub trait HostKeyOps {
    /// An indirect mkey, opened to other vHCAs. Dropping it destroys it.
    type Key;
    /// What gets exported (a registered region).
    type Region: Clone;

    /// The host function's vHCA id.
    fn vhca_id(&self) -> u32;
    /// The largest region one UMR work request can bind (mlx5: 2 GiB).
    fn umr_max_len(&self) -> u64;
    /// The length of `region` in bytes.
    fn region_len(region: &Self::Region) -> u64;
    /// The key's mkey number.
    fn mkey(key: &Self::Key) -> u32;
    /// Creates a free (unbound) UMR-capable indirect key and opens it to other vHCAs with
    /// `access_key`.
    fn create_pool_key(&self, access_key: &[u8; 32]) -> Result<Self::Key>;
    /// Binds `key` to all of `region`, zero-based, with a UMR work request, and waits for it.
    fn bind(&self, key: &Self::Key, region: &Self::Region) -> Result<()>;
    /// Invalidates `key` with `LOCAL_INV` and waits: every later use of the key, through
    /// aliases too, fails; operations already under way finish.
    fn invalidate(&self, key: &Self::Key) -> Result<()>;
    /// A key of its own for a region UMR cannot serve, bound to it and opened to other
    /// vHCAs with `access_key`.
    fn create_plain_key(&self, region: &Self::Region, access_key: &[u8; 32]) -> Result<Self::Key>;
}

/// How a pool behaves.
///
/// Start from [`new`](Self::new) and change what you need with the `with_*` setters (the
/// struct is `#[non_exhaustive]`, so fields can be added without breaking you).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct PoolConfig {
    /// Keys created when the pool is made; the others are created at first use.
    pub precreate: usize,
    /// Most pool keys that may exist at once. An export beyond it gets a plain key (counted
    /// in [`PoolStats::fallback`]) rather than growing the pool.
    pub max_keys: usize,
    /// The secret keys are opened to other vHCAs with; aliases must present it.
    pub access_key: [u8; 32],
}

impl PoolConfig {
    /// Lazy creation up to `max_keys`, with `access_key`.
    pub fn new(max_keys: usize, access_key: [u8; 32]) -> Self {
        PoolConfig { precreate: 0, max_keys, access_key }
    }
}

impl PoolConfig {
    /// Sets [`precreate`](Self::precreate).
    pub const fn with_precreate(mut self, precreate: usize) -> Self {
        self.precreate = precreate;
        self
    }

    /// Sets [`max_keys`](Self::max_keys).
    pub const fn with_max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// Sets [`access_key`](Self::access_key).
    pub const fn with_access_key(mut self, access_key: [u8; 32]) -> Self {
        self.access_key = access_key;
        self
    }
}

/// Counters of a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Pool keys created (each costs an mkey creation and an access change).
    pub created: u64,
    /// Exports served by a key that already existed (a UMR bind only).
    pub reused: u64,
    /// Exports live now (pool and plain keys).
    pub in_use: u64,
    /// Pool keys waiting in the pool.
    pub free: u64,
    /// Exports served by a plain key: region too large for UMR, or the pool at `max_keys`.
    pub fallback: u64,
    /// Keys destroyed because binding or invalidating them failed.
    pub discarded: u64,
}

struct State<K> {
    /// LIFO: the head is the end of the vector (the key released last is reused first).
    free: Vec<PoolKey<K>>,
    /// Pool keys in existence (free or exported).
    live: usize,
    stats: PoolStats,
}

struct PoolKey<K> {
    key: K,
    uuid: u64,
}

struct Inner<O: HostKeyOps> {
    ops: O,
    config: PoolConfig,
    state: Mutex<State<O::Key>>,
    uuid_base: u64,
    next_uuid: AtomicU64,
}

/// A fresh export generation ([`PackedKey::export_gen`]): the host's boot time (the
/// kernel's `btime`, in seconds since the epoch) plus its monotonic clock, in nanoseconds,
/// made strictly increasing within this process. Generations are so ordered across every
/// pool and process of the host, not only within one key incarnation: an incarnation
/// created after another was destroyed (perhaps by another pool, with the number the device
/// recycled) exports later generations, which lets a DPU refuse a late export of the
/// destroyed one ([`AliasCache::import`](super::AliasCache::import)). The boot time keeps
/// that order across a reboot of the host while the DPU's cache lives on (a BlueField's
/// Arm cores keep running): the monotonic clock alone restarts near 0, and every key
/// number the device handed out again would have been refused as stale until evicted.
/// (A wall clock stepped back by more than the host's uptime between two boots would
/// still break that order; without `/proc/stat`, the monotonic clock alone is used.)
#[allow(unsafe_code)] // reads the monotonic clock, which std's opaque `Instant` does not expose
fn next_export_gen() -> u64 {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC is always available on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let now = if rc == 0 {
        (ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64)
    } else {
        0
    };
    let now = now.saturating_add(boot_epoch_ns());
    let mut last = LAST.load(Ordering::Relaxed);
    loop {
        let next = now.max(last.saturating_add(1));
        match LAST.compare_exchange_weak(last, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return next,
            Err(seen) => last = seen,
        }
    }
}

/// The host's boot time in nanoseconds since the Unix epoch (`btime` of `/proc/stat`, read
/// once: every process of one boot reads the same value), or 0 where it cannot be read.
fn boot_epoch_ns() -> u64 {
    static EPOCH: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(|| {
        if cfg!(miri) {
            return 0; // Miri's isolation refuses to open files
        }
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let secs = stat.lines().find_map(|l| l.strip_prefix("btime ")?.trim().parse::<u64>().ok());
        secs.map_or(0, |s| s.saturating_mul(1_000_000_000))
    })
}

/// A LIFO pool of UMR mkeys opened to other vHCAs (the host side of cross-GVMI).
///
/// Cloning shares the pool. See the [module docs](super) for the design.
pub struct UmrMkeyPool<O: HostKeyOps> {
    inner: Arc<Inner<O>>,
}

impl<O: HostKeyOps> Clone for UmrMkeyPool<O> {
    fn clone(&self) -> Self {
        UmrMkeyPool { inner: self.inner.clone() }
    }
}

impl<O: HostKeyOps> UmrMkeyPool<O> {
    /// A pool over `ops`, pre-creating `config.precreate` keys (at most `max_keys`).
    pub fn new(ops: O, config: PoolConfig) -> Result<Self> {
        if config.max_keys == 0 {
            return Err(Error::InvalidArgument("a UMR mkey pool needs max_keys >= 1".into()));
        }
        // A per-pool random base: uuids of two pools (or two runs) do not collide, so a DPU
        // never takes a new key for the old one that had its number.
        let uuid_base = RandomState::new().hash_one(std::process::id());
        let inner = Arc::new(Inner {
            ops,
            config,
            state: Mutex::new(State { free: Vec::new(), live: 0, stats: PoolStats::default() }),
            uuid_base,
            next_uuid: AtomicU64::new(1),
        });
        let pool = UmrMkeyPool { inner };
        for _ in 0..pool.inner.config.precreate.min(pool.inner.config.max_keys) {
            let key = pool.create_pool_key()?;
            let mut st = pool.state();
            st.live += 1;
            st.stats.created += 1;
            st.free.push(key);
        }
        Ok(pool)
    }

    /// The device operations.
    pub fn ops(&self) -> &O {
        &self.inner.ops
    }

    /// The counters.
    pub fn stats(&self) -> PoolStats {
        let st = self.state();
        PoolStats { free: st.free.len() as u64, ..st.stats }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State<O::Key>> {
        // The state stays consistent under a panic (no partial updates), so a poisoned
        // lock is still usable.
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fresh_uuid(&self) -> u64 {
        let n = self.inner.next_uuid.fetch_add(1, Ordering::Relaxed);
        self.inner.uuid_base.wrapping_add(n).max(1)
    }

    fn create_pool_key(&self) -> Result<PoolKey<O::Key>> {
        let key = self.inner.ops.create_pool_key(&self.inner.config.access_key)?;
        Ok(PoolKey { key, uuid: self.fresh_uuid() })
    }

    /// Exports `region` to other vHCAs: takes the key at the head of the pool (creating one
    /// if the pool is empty and below `max_keys`), binds it to the region with a UMR work
    /// request, and returns the export, whose [`Export::packed`] goes to the DPU. Regions
    /// larger than UMR can bind, and exports beyond `max_keys`, get a plain key.
    pub fn export(&self, region: &O::Region) -> Result<Export<O>> {
        let len = O::region_len(region);
        if len == 0 {
            return Err(Error::InvalidArgument("cannot export an empty region".into()));
        }
        let taken = if len > self.inner.ops.umr_max_len() {
            None
        } else {
            let mut st = self.state();
            match st.free.pop() {
                Some(k) => Some((k, true)),
                None if st.live < self.inner.config.max_keys => {
                    // Count the key before creating it so that concurrent exports cannot
                    // over-provision; undone below if creation fails.
                    st.live += 1;
                    drop(st);
                    match self.create_pool_key() {
                        Ok(k) => {
                            self.state().stats.created += 1;
                            Some((k, false))
                        }
                        Err(e) => {
                            self.state().live -= 1;
                            return Err(e);
                        }
                    }
                }
                None => None,
            }
        };
        let Some((pk, reused)) = taken else { return self.export_plain(region, len) };
        if let Err(e) = self.inner.ops.bind(&pk.key, region) {
            let mut st = self.state();
            st.live -= 1;
            st.stats.discarded += 1;
            drop(st);
            drop(pk); // state unknown after a failed UMR: destroy rather than reuse
            return Err(e);
        }
        let mut st = self.state();
        st.stats.in_use += 1;
        if reused {
            st.stats.reused += 1;
        }
        drop(st);
        let packed = self.packed(&pk, len, true);
        Ok(Export { pool: self.clone(), key: Some(pk), pooled: true, region: region.clone(), packed })
    }

    fn export_plain(&self, region: &O::Region, len: u64) -> Result<Export<O>> {
        let key = self.inner.ops.create_plain_key(region, &self.inner.config.access_key)?;
        let pk = PoolKey { key, uuid: self.fresh_uuid() };
        let mut st = self.state();
        st.stats.fallback += 1;
        st.stats.in_use += 1;
        drop(st);
        let packed = self.packed(&pk, len, false);
        Ok(Export { pool: self.clone(), key: Some(pk), pooled: false, region: region.clone(), packed })
    }

    /// The packed form of a key just bound (or made) for one export: with a fresh export
    /// generation, so an older export of the same key is recognisably stale.
    fn packed(&self, pk: &PoolKey<O::Key>, len: u64, pooled: bool) -> PackedKey {
        PackedKey {
            mkey: O::mkey(&pk.key),
            vhca_id: self.inner.ops.vhca_id(),
            uuid: pk.uuid,
            export_gen: next_export_gen(),
            addr: 0,
            len,
            pooled,
            access_key: self.inner.config.access_key,
        }
    }

    fn release_key(&self, pk: PoolKey<O::Key>, pooled: bool) -> Result<()> {
        let result = if pooled { self.inner.ops.invalidate(&pk.key) } else { Ok(()) };
        let mut st = self.state();
        st.stats.in_use -= 1;
        match (&result, pooled) {
            (Ok(()), true) => st.free.push(pk),
            (Err(_), true) => {
                // A key that could not be invalidated must not serve again: destroy it.
                st.live -= 1;
                st.stats.discarded += 1;
                drop(st);
                drop(pk);
            }
            (_, false) => {
                drop(st);
                drop(pk); // a plain key lives for one export
            }
        }
        result
    }
}

/// One export of a region. Releasing it (explicitly or by drop) invalidates the key and
/// returns it to the head of the pool; it keeps the region alive until then.
pub struct Export<O: HostKeyOps> {
    pool: UmrMkeyPool<O>,
    key: Option<PoolKey<O::Key>>,
    pooled: bool,
    region: O::Region,
    packed: PackedKey,
}

impl<O: HostKeyOps> Export<O> {
    /// What the DPU needs to alias the key.
    pub fn packed(&self) -> PackedKey {
        self.packed
    }

    /// True if the key came from the pool (false: a plain key made for this export).
    pub fn is_pooled(&self) -> bool {
        self.pooled
    }

    /// The exported region.
    pub fn region(&self) -> &O::Region {
        &self.region
    }

    /// Invalidates the key and returns it to the pool, reporting a failure to invalidate
    /// (the key is then destroyed instead of reused).
    pub fn release(mut self) -> Result<()> {
        match self.key.take() {
            Some(pk) => self.pool.release_key(pk, self.pooled),
            None => Ok(()),
        }
    }
}

impl<O: HostKeyOps> Drop for Export<O> {
    fn drop(&mut self) {
        if let Some(pk) = self.key.take()
            && let Err(e) = self.pool.release_key(pk, self.pooled)
        {
            tracing::warn!(error = %e, "UMR mkey pool: invalidation at release failed; key destroyed");
        }
    }
}

impl<O: HostKeyOps> std::fmt::Debug for Export<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export").field("packed", &self.packed).field("pooled", &self.pooled).finish()
    }
}
