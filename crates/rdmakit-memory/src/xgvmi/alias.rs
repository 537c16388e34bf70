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
    /// Aliases nobody held, dropped to keep the cache within its capacity (what the cache
    /// had seen of their keys is kept, so late exports of them stay refused).
    pub evicted: u64,
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
    /// When it was last imported (the table's tick): the least recently used idle alias
    /// goes first when the cache is full.
    last_used: u64,
    uuid: u64,
    /// The access key the firmware accepted when it made the alias: a later packed key is
    /// served this alias only if it presents the same one.
    access_key: [u8; 32],
    /// The newest export generation imported for this key incarnation.
    latest_gen: u64,
    alias: Arc<A>,
}

impl<A> Entry<A> {
    fn seen(&self) -> Seen {
        Seen { uuid: self.uuid, latest_gen: self.latest_gen }
    }
}

/// What the cache has seen of a key: its incarnation and the newest export generation.
#[derive(Clone, Copy)]
struct Seen {
    uuid: u64,
    latest_gen: u64,
}

impl Seen {
    /// Whether `key` is older than what was seen of its key: an earlier export of this
    /// incarnation (re-bound since), or an export of an incarnation no newer than this one
    /// (destroyed, its number since given to this one). Either's alias would reach a newer
    /// buffer. (Equal generations of two incarnations cannot both be genuine: the cached one
    /// stays.)
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

/// The aliases the cache holds by default ([`AliasCache::with_capacity`]).
pub const DEFAULT_ALIAS_CAPACITY: usize = 16 * 1024;

/// Keys whose alias was evicted, remembered per alias the cache may hold.
const FORGOTTEN_PER_ALIAS: usize = 16;

/// The maps and counters, under one lock.
struct Table<A> {
    /// The cached aliases, at most `capacity`.
    live: HashMap<u64, Entry<A>>,
    /// Keys whose idle alias was evicted: what was seen of each, so that a late export of
    /// one stays refused (at most `capacity * FORGOTTEN_PER_ALIAS`).
    evicted: HashMap<u64, Seen>,
    /// By vHCA: the newest generation among its evicted keys forgotten to keep `evicted`
    /// bounded: an export of that vHCA no newer than this, of a key the cache knows
    /// nothing of, is refused (it may be a late export of a forgotten one; the host exports
    /// it again, with a new generation). Each vHCA's own: generations are what each host
    /// declares, and one declaring the highest must not raise another's floor. At most one
    /// entry per vHCA whose aliases the device created.
    floors: HashMap<u32, u64>,
    /// Counts imports (for `last_used`).
    tick: u64,
    stats: AliasStats,
}

impl<A> Table<A> {
    /// For a key with no cached alias: refused if it is a late export of an evicted key,
    /// or older than every key forgotten since.
    fn refuse_forgotten(&mut self, key: &PackedKey) -> Result<()> {
        let latest = match self.evicted.get(&key.map_key()) {
            Some(seen) if seen.is_newer_than(key) => seen.latest_gen,
            Some(_) => return Ok(()),
            None => match self.floors.get(&key.vhca_id) {
                Some(&floor) if key.export_gen <= floor => floor,
                _ => return Ok(()),
            },
        };
        self.stats.refused_stale += 1;
        Err(stale_export(key, latest))
    }

    /// Evicts the least recently used aliases no import holds, an eighth of `capacity` (at
    /// least one), remembering what was seen of their keys. Returns them, to be dropped
    /// (destroyed) after the lock.
    fn evict_idle(&mut self, capacity: usize) -> Vec<Arc<A>> {
        let mut idle: Vec<(u64, u64)> = self
            .live
            .iter()
            .filter(|(_, e)| Arc::strong_count(&e.alias) == 1)
            .map(|(&k, e)| (e.last_used, k))
            .collect();
        let n = (capacity / 8).max(1).min(idle.len());
        if n == 0 {
            return Vec::new();
        }
        idle.select_nth_unstable(n - 1); // the n least recently used first
        let mut out = Vec::with_capacity(n);
        for &(_, k) in idle.iter().take(n) {
            if let Some(e) = self.live.remove(&k) {
                self.evicted.insert(k, e.seen());
                out.push(e.alias);
            }
        }
        self.stats.evicted += out.len() as u64;
        self.trim(capacity);
        out
    }

    /// Remembers what was seen of a key with no cached alias (a plain key's), unless
    /// something newer of it is remembered already.
    fn remember(&mut self, k: u64, seen: Seen, capacity: usize) {
        let e = self.evicted.entry(k).or_insert(seen);
        if seen.latest_gen > e.latest_gen {
            *e = seen;
        }
        self.trim(capacity);
    }

    /// Keeps what is remembered of keys bounded.
    fn trim(&mut self, capacity: usize) {
        // The oldest half goes, and each vHCA's floor rises to the newest generation of
        // its own forgotten.
        let bound = capacity.saturating_mul(FORGOTTEN_PER_ALIAS);
        if self.evicted.len() > bound {
            let mut gens: Vec<u64> = self.evicted.values().map(|s| s.latest_gen).collect();
            let mid = gens.len() / 2;
            let (_, &mut cut, _) = gens.select_nth_unstable(mid);
            let floors = &mut self.floors;
            self.evicted.retain(|&k, s| {
                if s.latest_gen > cut {
                    return true;
                }
                let floor = floors.entry((k >> 32) as u32).or_insert(0); // `PackedKey::map_key`
                *floor = (*floor).max(s.latest_gen);
                false
            });
        }
    }
}

/// A hash map from host keys to their aliases on the DPU, as UCX's cross-GVMI map.
///
/// A hit is a hash lookup and an `Arc` clone. An alias stays usable while anyone holds it;
/// the cache drops its reference when the entry turns stale or is evicted.
///
/// The cache is bounded: at most its capacity of aliases (firmware objects of the DPU's
/// function), [`DEFAULT_ALIAS_CAPACITY`] unless [`with_capacity`](Self::with_capacity)
/// says otherwise. When full, the least recently imported aliases that no import holds are
/// dropped (the host's keys may be long destroyed: nothing tells the DPU); an import
/// that finds every alias held is refused ([`Error::LimitReached`]). What the cache had
/// seen of an evicted key stays (about 24 bytes, up to 16 per alias of capacity), so that
/// a late export of it is still refused; beyond that the oldest are forgotten, and an
/// export older than the newest forgotten one of its vHCA, of a key the cache knows
/// nothing of, is refused too (the host exports it again). A plain key's alias is not
/// cached, but what was seen of the key is remembered the same way: a late export of an
/// older incarnation of its number is refused.
pub struct AliasCache<O: AliasOps> {
    ops: O,
    capacity: usize,
    map: Mutex<Table<O::Alias>>,
}

impl<O: AliasOps> AliasCache<O> {
    /// An empty cache over `ops`, holding at most [`DEFAULT_ALIAS_CAPACITY`] aliases.
    pub fn new(ops: O) -> Self {
        Self::with_capacity(ops, DEFAULT_ALIAS_CAPACITY)
    }

    /// An empty cache over `ops`, holding at most `capacity` aliases (at least 1).
    pub fn with_capacity(ops: O, capacity: usize) -> Self {
        let table = Table {
            live: HashMap::new(),
            evicted: HashMap::new(),
            floors: HashMap::new(),
            tick: 0,
            stats: AliasStats::default(),
        };
        AliasCache { ops, capacity: capacity.max(1), map: Mutex::new(table) }
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
            // Not cached, but remembered as an evicted key is: a late export of an older
            // incarnation of the number (destroyed since, the number given to another key)
            // would alias that other key's buffer.
            self.lock().refuse_forgotten(key)?;
            let alias = Arc::new(self.ops.create_alias(key)?);
            let mut g = self.lock();
            g.stats.uncached += 1;
            g.remember(key.map_key(), Seen { uuid: key.uuid, latest_gen: key.export_gen }, self.capacity);
            return Ok(ImportedAlias { alias, key: *key, hit: false });
        }
        let mk = key.map_key();
        {
            let mut g = self.lock();
            let t = &mut *g;
            t.tick += 1;
            if let Some(e) = t.live.get_mut(&mk) {
                if e.uuid == key.uuid && e.access_key != key.access_key {
                    return Err(Error::PermissionDenied(format!(
                        "packed key {:#x} (vHCA {}) presents another access key than its alias was made with",
                        key.mkey, key.vhca_id
                    )));
                }
                // Refused without a firmware command.
                if e.seen().is_newer_than(key) {
                    t.stats.refused_stale += 1;
                    return Err(stale_export(key, e.latest_gen));
                }
                if e.uuid == key.uuid {
                    e.latest_gen = key.export_gen;
                    e.last_used = t.tick;
                    t.stats.hits += 1;
                    return Ok(ImportedAlias { alias: e.alias.clone(), key: *key, hit: true });
                }
            } else {
                t.refuse_forgotten(key)?;
            }
            // A newer incarnation (or none cached): a new alias below. The cached one is
            // replaced only once the firmware has accepted the new packed key, so a forged
            // one cannot evict it.
        }
        // Created without the lock: alias creation is a firmware command (~200 µs on
        // BlueField-3); other imports proceed meanwhile.
        let alias = Arc::new(self.ops.create_alias(key)?);
        let mut g = self.lock();
        let t = &mut *g;
        // Idle aliases evicted to make room, and the entry of an older incarnation that this
        // one replaces: destroyed (when their last Arc goes) after the lock is released, as
        // firmware commands.
        let mut dropped = Vec::new();
        // Looked at again: another import may have changed the table meanwhile.
        if !t.live.contains_key(&mk) {
            t.refuse_forgotten(key)?;
            if t.live.len() >= self.capacity {
                dropped = t.evict_idle(self.capacity);
                if t.live.len() >= self.capacity {
                    drop(g);
                    return Err(Error::LimitReached { what: "the alias cache", limit: self.capacity as u64 });
                }
            }
            t.evicted.remove(&mk);
        }
        let tick = t.tick;
        let fresh = || Entry {
            last_used: tick,
            uuid: key.uuid,
            access_key: key.access_key,
            latest_gen: key.export_gen,
            alias: alias.clone(),
        };
        // A concurrent import of the same incarnation may have won the race: keep one.
        let entry = t.live.entry(mk).or_insert_with(fresh);
        if entry.seen().is_newer_than(key) {
            t.stats.refused_stale += 1;
            let e = stale_export(key, entry.latest_gen);
            drop(g);
            drop(dropped);
            return Err(e);
        }
        let replaced = entry.uuid != key.uuid;
        if replaced {
            dropped.push(std::mem::replace(entry, fresh()).alias);
        }
        entry.latest_gen = key.export_gen;
        entry.last_used = tick;
        let imported = ImportedAlias { alias: entry.alias.clone(), key: *key, hit: false };
        if replaced {
            t.stats.stale += 1;
        } else {
            t.stats.misses += 1;
        }
        drop(g);
        drop(dropped);
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
        match g.live.get(&key.map_key()) {
            Some(e) if e.uuid == key.uuid && e.latest_gen == key.export_gen => Ok(()),
            Some(e) if e.uuid == key.uuid => Err(stale_export(key, e.latest_gen)),
            _ => Err(Error::PermissionDenied(format!(
                "export of key {:#x} (vHCA {}) is no longer cached: the key was re-created or evicted",
                key.mkey, key.vhca_id
            ))),
        }
    }

    /// Drops the cached alias of `(vhca_id, mkey)`, if any, and what the cache remembers of
    /// the key (when the host says the key is gone for good).
    pub fn evict(&self, vhca_id: u32, mkey: u32) -> bool {
        let mk = (u64::from(vhca_id) << 32) | u64::from(mkey);
        let mut g = self.lock();
        g.evicted.remove(&mk);
        let gone = g.live.remove(&mk);
        drop(g);
        gone.is_some() // (its alias destroyed here, after the lock)
    }

    /// The counters.
    pub fn stats(&self) -> AliasStats {
        let g = self.lock();
        AliasStats { cached: g.live.len() as u64, ..g.stats }
    }
}
