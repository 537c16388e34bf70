//! The DPU side: aliases of host keys, cached by `(vhca_id << 32) | mkey`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rdmakit_verbs::{Error, Result};

use super::PackedKey;

/// What the cache needs from the DPU's device: [`DpuFunction`](super::DpuFunction)
/// over `rdmakit_verbs::mlx5`, or a model in tests.
pub trait AliasOps {
    /// An alias mkey in the DPU function's protection domain. Dropping it destroys it.
    type Alias;
    /// Creates an alias of the host key `key` (presenting its access key).
    fn create_alias(&self, key: &PackedKey) -> Result<Self::Alias>;
}

/// Counters of an alias cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AliasStats {
    /// Imports served by a cached alias.
    pub hits: u64,
    /// Imports of a pool key not in the cache (an alias was created and cached).
    pub misses: u64,
    /// Imports that found a cached alias of an older incarnation of the key (other uuid):
    /// it was destroyed and a new one created.
    pub stale: u64,
    /// Imports of plain (non-pool) keys: an alias created for that import alone.
    pub uncached: u64,
    /// Imports refused because a newer export of the same key had been imported: the host
    /// had re-bound the key to another buffer since.
    pub refused_stale: u64,
    /// Aliases in the cache now.
    pub cached: u64,
}

/// An imported key: the alias (shared with the cache for pool keys) and the packed key.
#[non_exhaustive]
pub struct ImportedAlias<A> {
    /// The alias; use it as an lkey in the DPU function's protection domain.
    pub alias: Arc<A>,
    /// What the host sent.
    pub key: PackedKey,
    /// True if the alias came from the cache.
    pub hit: bool,
}

struct Entry<A> {
    uuid: u64,
    /// The access key the firmware accepted when it made the alias: a later packed key is
    /// served this alias only if it presents the same one.
    access_key: [u8; 32],
    /// The newest export generation imported for this key incarnation.
    latest_gen: u64,
    alias: Arc<A>,
}

impl<A> Entry<A> {
    /// Whether `key` is older than what this entry has seen of its key: an earlier export of
    /// this incarnation (re-bound since), or an export of an incarnation no newer than this
    /// one (destroyed, its number since given to this one). Either's alias would reach a
    /// newer buffer. (Equal generations of two incarnations cannot both be genuine: the
    /// cached one stays.)
    fn is_newer_than(&self, key: &PackedKey) -> bool {
        key.export_gen < self.latest_gen || (key.uuid != self.uuid && key.export_gen == self.latest_gen)
    }
}

fn stale_export(key: &PackedKey, latest: u64) -> Error {
    Error::PermissionDenied(format!(
        "stale export of key {:#x} (vHCA {}): generation {} is older than the newest export of that key seen ({latest}): the host has re-bound or re-created the key since",
        key.mkey, key.vhca_id, key.export_gen
    ))
}

/// The map and its counters, under one lock.
type Table<A> = (HashMap<u64, Entry<A>>, AliasStats);

/// A hash map from host keys to their aliases on the DPU, as UCX's cross-GVMI map.
///
/// A hit is a hash lookup and an `Arc` clone. An alias stays usable while anyone holds it;
/// the cache drops its reference when the entry turns stale or is evicted.
pub struct AliasCache<O: AliasOps> {
    ops: O,
    map: Mutex<Table<O::Alias>>,
}

impl<O: AliasOps> AliasCache<O> {
    /// An empty cache over `ops`.
    pub fn new(ops: O) -> Self {
        AliasCache { ops, map: Mutex::new((HashMap::new(), AliasStats::default())) }
    }

    /// The device operations.
    pub fn ops(&self) -> &O {
        &self.ops
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table<O::Alias>> {
        // Every update is a single map operation plus counters: still consistent after a
        // panic elsewhere, so a poisoned lock is usable.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The alias for `key`: cached for a pool key (hit, or created on a miss, or re-created
    /// when the cached one belongs to an older incarnation), created for this import alone
    /// for a plain key. Refused ([`Error::PermissionDenied`], "stale export") when the cache
    /// has seen a newer export of the key: a later bind of the same incarnation, or a later
    /// incarnation under the same number (export generations are ordered across the host).
    /// The cache can tell only what it has seen: after [`evict`](Self::evict) a late export
    /// is taken as new.
    pub fn import(&self, key: &PackedKey) -> Result<ImportedAlias<O::Alias>> {
        if key.len == 0 {
            return Err(Error::InvalidArgument("packed key of an empty region".into()));
        }
        if !key.pooled {
            let alias = Arc::new(self.ops.create_alias(key)?);
            self.lock().1.uncached += 1;
            return Ok(ImportedAlias { alias, key: *key, hit: false });
        }
        let mk = key.map_key();
        {
            let mut g = self.lock();
            let (map, stats) = &mut *g;
            if let Some(e) = map.get_mut(&mk) {
                if e.uuid == key.uuid && e.access_key != key.access_key {
                    return Err(Error::PermissionDenied(format!(
                        "packed key {:#x} (vHCA {}) presents another access key than its alias was made with",
                        key.mkey, key.vhca_id
                    )));
                }
                // Refused without a firmware command.
                if e.is_newer_than(key) {
                    stats.refused_stale += 1;
                    return Err(stale_export(key, e.latest_gen));
                }
                if e.uuid == key.uuid {
                    e.latest_gen = key.export_gen;
                    stats.hits += 1;
                    return Ok(ImportedAlias { alias: e.alias.clone(), key: *key, hit: true });
                }
            }
            // A newer incarnation (or none cached): a new alias below. The cached one is
            // replaced only once the firmware has accepted the new packed key, so a forged
            // one cannot evict it.
        }
        // Created without the lock: alias creation is a firmware command (~200 µs on
        // BlueField-3); other imports proceed meanwhile.
        let alias = Arc::new(self.ops.create_alias(key)?);
        let mut g = self.lock();
        let (map, stats) = &mut *g;
        // A concurrent import of the same incarnation may have won the race: keep one.
        let fresh = || Entry {
            uuid: key.uuid,
            access_key: key.access_key,
            latest_gen: key.export_gen,
            alias: alias.clone(),
        };
        let entry = map.entry(mk).or_insert_with(fresh);
        // The replaced entry of an older incarnation; its alias is destroyed (when its last
        // Arc goes) after the lock is released: a firmware command.
        // Looked at again: another import may have changed the entry meanwhile.
        if entry.is_newer_than(key) {
            stats.refused_stale += 1;
            return Err(stale_export(key, entry.latest_gen));
        }
        let mut replaced = None;
        if entry.uuid != key.uuid {
            replaced = Some(std::mem::replace(entry, fresh()));
        }
        entry.latest_gen = key.export_gen;
        let imported = ImportedAlias { alias: entry.alias.clone(), key: *key, hit: false };
        if replaced.is_some() {
            stats.stale += 1;
        } else {
            stats.misses += 1;
        }
        drop(g);
        drop(replaced);
        Ok(imported)
    }

    /// Whether `imported` is still the newest export of its key that this cache has seen:
    /// an error once a newer export of the same pool key was imported (the host re-bound
    /// the key to another buffer, and this alias now reaches that one), or the key's entry
    /// was evicted or replaced. A DPU holding an import across calls checks it before each
    /// use; it costs a hash lookup. Plain keys are never re-bound: always current.
    pub fn check_current(&self, imported: &ImportedAlias<O::Alias>) -> Result<()> {
        let key = &imported.key;
        if !key.pooled {
            return Ok(());
        }
        let g = self.lock();
        match g.0.get(&key.map_key()) {
            Some(e) if e.uuid == key.uuid && e.latest_gen == key.export_gen => Ok(()),
            Some(e) if e.uuid == key.uuid => Err(stale_export(key, e.latest_gen)),
            _ => Err(Error::PermissionDenied(format!(
                "export of key {:#x} (vHCA {}) is no longer cached: the key was re-created or evicted",
                key.mkey, key.vhca_id
            ))),
        }
    }

    /// Drops the cached alias of `(vhca_id, mkey)`, if any (when the host says the key is
    /// gone for good).
    pub fn evict(&self, vhca_id: u32, mkey: u32) -> bool {
        let mut g = self.lock();
        g.0.remove(&((u64::from(vhca_id) << 32) | u64::from(mkey))).is_some()
    }

    /// The counters.
    pub fn stats(&self) -> AliasStats {
        let g = self.lock();
        AliasStats { cached: g.0.len() as u64, ..g.1 }
    }
}
