//! The pool and the alias cache over a model of the device: keys, bindings, invalidation,
//! access keys and aliases, with failure injection.

use std::cell::Cell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, Mutex};

use rdmakit_verbs::{Error, Result};

use super::*;

/// The model device: key number -> (bound region, valid, access key); aliases resolve
/// through it, as the soft NIC's do.
#[derive(Default)]
struct Device {
    keys: HashMap<u32, ModelKeyState>,
    next: u32,
    creates: u64,
    binds: u64,
    fail_next_bind: bool,
    fail_next_invalidate: bool,
}

struct ModelKeyState {
    region: Option<u64>,
    access_key: [u8; 32],
}

#[derive(Clone, Default)]
struct Model(Arc<Mutex<Device>>);

struct Key {
    mkey: u32,
    dev: Model,
}

impl Drop for Key {
    fn drop(&mut self) {
        self.dev.0.lock().unwrap().keys.remove(&self.mkey);
    }
}

const UMR_MAX: u64 = 1 << 31;

impl Model {
    fn dev(&self) -> std::sync::MutexGuard<'_, Device> {
        self.0.lock().unwrap()
    }

    fn new_key(&self, region: Option<u64>, access_key: &[u8; 32]) -> Key {
        let mut d = self.dev();
        d.next += 0x100; // a real device recycles numbers; the model does too (see below)
        d.creates += 1;
        let mkey = d.next;
        d.keys.insert(mkey, ModelKeyState { region, access_key: *access_key });
        Key { mkey, dev: self.clone() }
    }

    /// What an alias of `(mkey)` reaches now: the bound region, or an error as a NIC's
    /// protection check would give.
    fn resolve(&self, mkey: u32) -> std::result::Result<u64, &'static str> {
        match self.dev().keys.get(&mkey) {
            None => Err("no such key"),
            Some(ModelKeyState { region: None, .. }) => Err("key invalidated"),
            Some(ModelKeyState { region: Some(r), .. }) => Ok(*r),
        }
    }
}

/// Regions are named by an id and have a length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Region {
    id: u64,
    len: u64,
}

impl HostKeyOps for Model {
    type Key = Key;
    type Region = Region;
    fn vhca_id(&self) -> u32 {
        7
    }
    fn umr_max_len(&self) -> u64 {
        UMR_MAX
    }
    fn region_len(r: &Region) -> u64 {
        r.len
    }
    fn mkey(k: &Key) -> u32 {
        k.mkey
    }
    fn create_pool_key(&self, access_key: &[u8; 32]) -> Result<Key> {
        Ok(self.new_key(None, access_key))
    }
    fn bind(&self, key: &Key, region: &Region) -> Result<()> {
        let mut d = self.dev();
        d.binds += 1;
        if std::mem::take(&mut d.fail_next_bind) {
            return Err(Error::InvalidArgument("injected UMR failure".into()));
        }
        let st = d.keys.get_mut(&key.mkey).expect("pool keys exist");
        assert!(st.region.is_none(), "UMR onto a key that was not invalidated");
        st.region = Some(region.id);
        Ok(())
    }
    fn invalidate(&self, key: &Key) -> Result<()> {
        let mut d = self.dev();
        if std::mem::take(&mut d.fail_next_invalidate) {
            return Err(Error::InvalidArgument("injected LOCAL_INV failure".into()));
        }
        d.keys.get_mut(&key.mkey).expect("pool keys exist").region = None;
        Ok(())
    }
    fn create_plain_key(&self, region: &Region, access_key: &[u8; 32]) -> Result<Key> {
        Ok(self.new_key(Some(region.id), access_key))
    }
}

/// The DPU: aliases check the access key at creation, then resolve through the host key.
#[derive(Clone)]
struct Dpu {
    host: Model,
    created: Rc<Cell<u64>>,
}

struct Alias {
    mkey: u32,
    host: Model,
}

impl Alias {
    fn reach(&self) -> std::result::Result<u64, &'static str> {
        self.host.resolve(self.mkey)
    }
}

impl AliasOps for Dpu {
    type Alias = Alias;
    fn create_alias(&self, key: &PackedKey) -> Result<Alias> {
        let d = self.host.dev();
        let st = d.keys.get(&key.mkey).ok_or_else(|| Error::InvalidArgument("no such host key".into()))?;
        if st.access_key != key.access_key {
            return Err(Error::InvalidArgument("access key refused".into()));
        }
        self.created.set(self.created.get() + 1);
        Ok(Alias { mkey: key.mkey, host: self.host.clone() })
    }
}

const SECRET: [u8; 32] = [0x5a; 32];

fn region(id: u64) -> Region {
    Region { id, len: 4096 }
}

#[test]
fn keys_are_created_lazily_and_reused_lifo() {
    let model = Model::default();
    let pool = UmrMkeyPool::new(model.clone(), PoolConfig::new(4, SECRET)).unwrap();
    assert_eq!(model.dev().creates, 0, "lazy: nothing created up front");
    let a = pool.export(&region(1)).unwrap();
    let b = pool.export(&region(2)).unwrap();
    assert_eq!(pool.stats().created, 2);
    let (ka, kb) = (a.packed().mkey, b.packed().mkey);
    assert_ne!(ka, kb);
    assert_eq!(model.resolve(ka), Ok(1));
    assert_eq!(model.resolve(kb), Ok(2));
    a.release().unwrap();
    assert_eq!(model.resolve(ka), Err("key invalidated"));
    b.release().unwrap();
    // LIFO: the key released last (b's) serves the next export.
    let c = pool.export(&region(3)).unwrap();
    assert_eq!(c.packed().mkey, kb);
    assert_eq!(model.resolve(kb), Ok(3));
    let s = pool.stats();
    assert_eq!((s.created, s.reused, s.in_use, s.free, s.fallback), (2, 1, 1, 1, 0));
    assert_eq!(model.dev().creates, 2);
}

#[test]
fn precreated_keys_and_no_over_provisioning() {
    let model = Model::default();
    let mut cfg = PoolConfig::new(2, SECRET);
    cfg.precreate = 5; // capped at max_keys
    let pool = UmrMkeyPool::new(model.clone(), cfg).unwrap();
    assert_eq!((pool.stats().created, pool.stats().free), (2, 2));
    let a = pool.export(&region(1)).unwrap();
    let b = pool.export(&region(2)).unwrap();
    // The pool is at max_keys: the third export gets a plain key, the pool does not grow.
    let c = pool.export(&region(3)).unwrap();
    assert!(a.is_pooled() && b.is_pooled() && !c.is_pooled());
    assert_eq!(pool.stats().created, 2);
    assert_eq!(pool.stats().fallback, 1);
    let plain = c.packed().mkey;
    drop(c);
    assert_eq!(model.resolve(plain), Err("no such key"), "plain keys are destroyed at release");
    drop((a, b));
    assert_eq!(pool.stats().free, 2);
    assert_eq!(pool.stats().in_use, 0);
}

#[test]
fn regions_beyond_umr_get_plain_keys() {
    let model = Model::default();
    let pool = UmrMkeyPool::new(model.clone(), PoolConfig::new(4, SECRET)).unwrap();
    let big = Region { id: 9, len: UMR_MAX + 1 };
    let e = pool.export(&big).unwrap();
    assert!(!e.is_pooled());
    assert_eq!(e.packed().len, UMR_MAX + 1);
    assert_eq!(model.resolve(e.packed().mkey), Ok(9));
    assert_eq!(pool.stats().created, 0);
    assert!(pool.export(&Region { id: 1, len: 0 }).is_err());
}

#[test]
fn failed_bind_or_invalidate_destroys_the_key() {
    let model = Model::default();
    let pool = UmrMkeyPool::new(model.clone(), PoolConfig::new(1, SECRET)).unwrap();
    model.dev().fail_next_bind = true;
    assert!(pool.export(&region(1)).is_err());
    assert_eq!(pool.stats().discarded, 1);
    assert!(model.dev().keys.is_empty(), "the failed key was destroyed");
    // The slot it held is free again: a new key can be created within max_keys = 1.
    let e = pool.export(&region(2)).unwrap();
    assert!(e.is_pooled());
    let k = e.packed().mkey;
    model.dev().fail_next_invalidate = true;
    assert!(e.release().is_err());
    assert_eq!(model.resolve(k), Err("no such key"), "never reused after a failed LOCAL_INV");
    let s = pool.stats();
    assert_eq!((s.discarded, s.free, s.in_use), (2, 0, 0));
    assert!(pool.export(&region(3)).unwrap().is_pooled());
}

#[test]
fn alias_cache_hits_misses_and_stale_incarnations() {
    let model = Model::default();
    let pool = UmrMkeyPool::new(model.clone(), PoolConfig::new(1, SECRET)).unwrap();
    let dpu = Dpu { host: model.clone(), created: Rc::default() };
    let cache = AliasCache::new(dpu.clone());

    let e1 = pool.export(&region(1)).unwrap();
    let a1 = cache.import(&e1.packed()).unwrap();
    assert!(!a1.hit);
    assert_eq!(a1.alias.reach(), Ok(1));
    e1.release().unwrap();
    // Used after its key was invalidated: the alias reaches nothing.
    assert_eq!(a1.alias.reach(), Err("key invalidated"));

    // The same pool key, re-bound: a hit, and the old alias reaches the new region.
    let e2 = pool.export(&region(2)).unwrap();
    assert_eq!(e2.packed().map_key(), e1_key(&a1));
    let a2 = cache.import(&e2.packed()).unwrap();
    assert!(a2.hit);
    assert!(Arc::ptr_eq(&a1.alias, &a2.alias));
    assert_eq!(a2.alias.reach(), Ok(2));
    assert_eq!(dpu.created.get(), 1);
    drop(e2);

    // The host key is destroyed and its number reused by a new incarnation (new uuid, and
    // a later export): the cached alias is stale and is re-created.
    let old = a2.key;
    let reborn = PackedKey { uuid: old.uuid ^ 1, export_gen: old.export_gen + 1, ..old };
    let a3 = cache.import(&reborn).unwrap();
    assert!(!a3.hit && !Arc::ptr_eq(&a3.alias, &a2.alias));
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.stale, s.uncached, s.cached), (1, 1, 1, 0, 1));
    assert_eq!(dpu.created.get(), 2);
}

/// The cache holds at most its capacity of aliases: held ones are never evicted (an import
/// that finds every alias held is refused), idle ones go least recently used first, and a
/// late export of an evicted key is still refused.
#[test]
fn the_alias_cache_is_bounded_and_remembers_what_it_evicted() {
    let model = Model::default();
    let pool = UmrMkeyPool::new(model.clone(), PoolConfig::new(64, SECRET)).unwrap();
    let dpu = Dpu { host: model.clone(), created: Rc::default() };
    let cache = AliasCache::with_capacity(dpu.clone(), 4);
    let exports: Vec<_> = (0..6).map(|i| pool.export(&region(i)).unwrap()).collect();
    let packed: Vec<PackedKey> = exports.iter().map(|e| e.packed()).collect();
    let held: Vec<_> = packed[..4].iter().map(|p| cache.import(p).unwrap()).collect();
    let Err(err) = cache.import(&packed[4]) else { panic!("a fifth alias while four are held") };
    assert!(matches!(err, Error::LimitReached { limit: 4, .. }), "{err}");
    assert_eq!((cache.stats().cached, cache.stats().evicted), (4, 0));
    drop(held);
    cache.import(&packed[0]).unwrap(); // used again: now the most recent
    let a4 = cache.import(&packed[4]).unwrap();
    assert!(!a4.hit);
    let s = cache.stats();
    assert_eq!((s.cached, s.evicted), (4, 1));
    // Key 1 was the least recently used: it went, and key 0 stayed.
    assert!(cache.import(&packed[0]).unwrap().hit);
    // A late export of the evicted key (older than the one seen) is refused without a
    // firmware command; the export it had seen is taken again.
    let created = dpu.created.get();
    let late = PackedKey { export_gen: packed[1].export_gen - 1, ..packed[1] };
    let Err(err) = cache.import(&late) else { panic!("a late export of an evicted key") };
    assert!(err.to_string().contains("stale export"), "{err}");
    assert_eq!(dpu.created.get(), created);
    assert!(!cache.import(&packed[1]).unwrap().hit);
    drop(exports);
}

/// What the cache remembers of evicted keys is bounded too: beyond it the oldest are
/// forgotten, and an export no newer than them, of a key the cache knows nothing of, is
/// refused (the host exports it again).
#[test]
fn forgotten_keys_raise_a_floor_under_unknown_exports() {
    let model = Model::default();
    let pool = UmrMkeyPool::new(model.clone(), PoolConfig::new(64, SECRET)).unwrap();
    let cache = AliasCache::with_capacity(Dpu { host: model.clone(), created: Rc::default() }, 1);
    let exports: Vec<_> = (0..40).map(|i| pool.export(&region(i)).unwrap()).collect();
    for e in &exports {
        cache.import(&e.packed()).unwrap(); // each evicts the one before
    }
    let s = cache.stats();
    assert_eq!((s.cached, s.evicted), (1, 39));
    let Err(err) = cache.import(&exports[0].packed()) else { panic!("an export older than the forgotten") };
    assert!(err.to_string().contains("stale export"), "{err}");
    // Exported again, it is newer than anything forgotten.
    drop(exports);
    let again = pool.export(&region(0)).unwrap();
    cache.import(&again.packed()).unwrap();
}

/// The floor under unknown exports is each vHCA's own. A host (vHCA 9) declaring the
/// highest generation on keys of its own filled what the cache remembers with them, and
/// when the oldest half was forgotten, the floor it raised for everyone was that
/// generation: every later import of a key the cache did not hold, of any vHCA, was refused
/// for good. (Found by review.)
#[test]
fn one_host_declaring_huge_generations_raises_only_its_own_floor() {
    let model = Model::default();
    let pool = UmrMkeyPool::new(model.clone(), PoolConfig::new(64, SECRET)).unwrap();
    let cache = AliasCache::with_capacity(Dpu { host: model.clone(), created: Rc::default() }, 1);
    let own_vhca = pool.export(&region(99)).unwrap().packed().vhca_id;
    assert_ne!(own_vhca, 9);
    let hostile: Vec<_> = (0..40).map(|i| pool.export(&region(i)).unwrap()).collect();
    for e in &hostile {
        let forged = PackedKey { vhca_id: 9, export_gen: u64::MAX, ..e.packed() };
        // Each evicts the one before; some are forgotten, and once vHCA 9's floor is the
        // highest generation its next ones are refused: its own doing.
        let _ = cache.import(&forged);
    }
    drop(hostile);
    let genuine = pool.export(&region(100)).unwrap();
    assert_eq!(genuine.packed().vhca_id, own_vhca);
    cache.import(&genuine.packed()).expect("another vHCA's fresh export is not under vHCA 9's floor");
}

/// A plain key (made for one export, destroyed with it) is not cached, but what was seen of
/// it is remembered: once the DPU has imported an export of a newer incarnation of the same
/// number, a late export of the older one (whose buffer is gone, its key number now the
/// newer key's) is refused, where it made an alias of the newer key. (Found by review.)
#[test]
fn a_late_export_of_an_older_plain_key_under_a_reused_number_is_refused() {
    let model = Model::default();
    let pool = UmrMkeyPool::new(model.clone(), PoolConfig::new(4, SECRET)).unwrap();
    let cache = AliasCache::new(Dpu { host: model.clone(), created: Rc::default() });
    let big = pool.export(&Region { id: 1, len: UMR_MAX + 4096 }).unwrap();
    let old = big.packed();
    assert!(!old.pooled, "a region past the UMR limit gets a plain key");
    // The number's next incarnation (the model keeps the key: the device accepts it).
    let newer = PackedKey { uuid: old.uuid ^ 1, export_gen: old.export_gen + 1, ..old };
    cache.import(&newer).unwrap();
    let Err(err) = cache.import(&old) else { panic!("a late export of the older incarnation") };
    assert!(err.to_string().contains("stale export"), "{err}");
    cache.import(&newer).expect("the newer one still imports");
}

/// Every bind of a pool key is a new export generation: once the DPU has imported the newer
/// export, the older one (whose buffer the host has taken back) is refused, and an import
/// held across the re-bind reports itself stale instead of writing into the new buffer.
#[test]
fn a_stale_export_of_a_rebound_key_is_refused() {
    let model = Model::default();
    let pool = UmrMkeyPool::new(model.clone(), PoolConfig::new(1, SECRET)).unwrap();
    let cache = AliasCache::new(Dpu { host: model.clone(), created: Rc::default() });

    let e1 = pool.export(&region(1)).unwrap();
    let p1 = e1.packed();
    let a1 = cache.import(&p1).unwrap();
    cache.check_current(&a1).unwrap();
    e1.release().unwrap();

    let e2 = pool.export(&region(2)).unwrap();
    let p2 = e2.packed();
    assert_eq!((p2.mkey, p2.uuid), (p1.mkey, p1.uuid), "the same pool key, re-bound");
    assert!(p2.export_gen > p1.export_gen, "every bind is a new generation");
    let a2 = cache.import(&p2).unwrap();
    assert!(a2.hit, "the alias is still shared across binds");
    cache.check_current(&a2).unwrap();

    // The old export, replayed or still held, no longer passes.
    let Err(err) = cache.import(&p1) else { panic!("a stale export must be refused") };
    assert!(err.to_string().contains("stale export"), "{err}");
    let Err(err) = cache.check_current(&a1) else { panic!("the old import is stale") };
    assert!(matches!(err, rdmakit_verbs::Error::PermissionDenied(_)), "{err}");
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.refused_stale), (1, 1, 1));
    // Its encoding carries the generation across the wire.
    assert_eq!(PackedKey::decode(&p1.encode()).unwrap().export_gen, p1.export_gen);
}

#[test]
#[cfg_attr(miri, ignore = "the boot time comes from /proc/stat, which Miri's isolation refuses")]
fn export_generations_follow_the_wall_clock_so_a_rebooted_host_stays_newer() {
    // The generation is the host's boot time plus its monotonic clock: about the wall clock
    // (to the second of `btime`), so a host that rebooted while the DPU's cache lived on
    // exports later generations than before, instead of restarting near 0 and having every
    // recycled key number refused as stale.
    let pool = UmrMkeyPool::new(Model::default(), PoolConfig::new(1, SECRET)).unwrap();
    let generation = pool.export(&region(1)).unwrap().packed().export_gen;
    let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let off = (i128::from(generation) - wall as i128).abs();
    assert!(off < 120_000_000_000, "generation {generation} is {off} ns from the wall clock {wall}");
}

fn e1_key(a: &ImportedAlias<Alias>) -> u64 {
    a.key.map_key()
}

#[test]
fn plain_keys_are_not_cached_and_access_keys_are_checked() {
    let model = Model::default();
    let pool = UmrMkeyPool::new(model.clone(), PoolConfig::new(1, SECRET)).unwrap();
    let cache = AliasCache::new(Dpu { host: model.clone(), created: Rc::default() });
    let big = pool.export(&Region { id: 5, len: UMR_MAX * 2 }).unwrap();
    let a = cache.import(&big.packed()).unwrap();
    let b = cache.import(&big.packed()).unwrap();
    assert!(!a.hit && !b.hit && !Arc::ptr_eq(&a.alias, &b.alias));
    assert_eq!(cache.stats().uncached, 2);
    assert_eq!(cache.stats().cached, 0);

    let e = pool.export(&region(1)).unwrap();
    let forged = PackedKey { access_key: [0; 32], ..e.packed() };
    assert!(cache.import(&forged).is_err());
    assert_eq!(cache.stats().cached, 0, "a refused alias is not cached");
    assert!(cache.import(&e.packed()).is_ok());
    assert!(cache.evict(e.packed().vhca_id, e.packed().mkey));
    assert!(!cache.evict(e.packed().vhca_id, e.packed().mkey));
}

#[test]
fn packed_keys_round_trip_and_reject_garbage() {
    let k = PackedKey {
        mkey: 0x1234_5678,
        vhca_id: 3,
        uuid: u64::MAX - 5,
        export_gen: 0x0102_0304_0506_0708,
        addr: 0,
        len: 1 << 40,
        pooled: true,
        access_key: [7; 32],
    };
    let b = k.encode();
    assert_eq!(PackedKey::decode(&b), Ok(k));
    assert_eq!(k.map_key(), (3 << 32) | 0x1234_5678);
    assert!(matches!(PackedKey::decode(&b[..10]), Err(PackedKeyError::Length { .. })));
    let mut bad = b;
    bad[0] = 1; // the format before export generations
    assert_eq!(PackedKey::decode(&bad), Err(PackedKeyError::Version(1)));
    let mut bad = b;
    bad[1] = 9;
    assert_eq!(PackedKey::decode(&bad), Err(PackedKeyError::Flags(9)));
}

#[test]
fn registration_cache_reuses_only_idle_regions() {
    use rdmakit_verbs::{AccessFlags, Context};
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let cache = RegistrationCache::new(&pd, AccessFlags::ALL_REMOTE, 64 << 10);
    let a = cache.get(100).unwrap();
    assert_eq!((a.len(), a.region().len()), (100, 128));
    let key = a.rkey();
    drop(a);
    let b = cache.get(120).unwrap();
    assert_eq!(b.rkey(), key, "same size class: the registration is reused");
    // A region still held elsewhere (as an in-flight request would) is not reused.
    let held = b.region().clone();
    drop(b);
    let c = cache.get(128).unwrap();
    assert_ne!(c.rkey(), key);
    drop(held);
    // Over the byte budget: evicted.
    let big: Vec<_> = (0..3).map(|_| cache.get(32 << 10).unwrap()).collect();
    drop(big);
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.busy_on_return, s.evicted), (1, 5, 1, 1));
    assert!(s.cached_bytes <= 64 << 10);
    assert!(cache.get(0).is_err());
}

/// The pool and the cache over the soft NIC's mlx5 emulation: a DPU function writes host
/// memory to a remote peer through cached aliases of pool keys, buffer after buffer.
#[test]
fn pool_and_cache_on_the_soft_nic() {
    use rdmakit_verbs::{AccessFlags, ConnectOptions, Context, QpCaps, SendWr, SoftConfig, WcStatus};
    let wait = Some(std::time::Duration::from_secs(10));
    let host = Context::open_soft_with(SoftConfig::default()).unwrap();
    let dpu = host.open_function().unwrap();
    let peer = Context::open_soft_with(SoftConfig::default()).unwrap();
    let (hpd, dpd, ppd) = (host.alloc_pd().unwrap(), dpu.alloc_pd().unwrap(), peer.alloc_pd().unwrap());
    let pool = UmrMkeyPool::new(
        HostFunction::new(&hpd, AccessFlags::ALL_REMOTE).unwrap(),
        PoolConfig::new(4, SECRET),
    )
    .unwrap();
    let cache = AliasCache::new(DpuFunction::new(&dpd, AccessFlags::LOCAL_WRITE));
    let buffers = RegistrationCache::new(&hpd, AccessFlags::ALL_REMOTE, 1 << 20);

    let (dcq, pcq) = (dpu.create_cq(16).unwrap(), peer.create_cq(16).unwrap());
    let qp = dpd.create_qp(&dcq, &dcq, QpCaps::default()).unwrap();
    let pqp = ppd.create_qp(&pcq, &pcq, QpCaps::default()).unwrap();
    qp.connect(&pqp.address().unwrap(), &ConnectOptions::default()).unwrap();
    pqp.connect(&qp.address().unwrap(), &ConnectOptions::default()).unwrap();
    let sink = ppd.alloc_mr(4096, AccessFlags::ALL_REMOTE).unwrap();

    let mut last = None;
    for i in 0..20u8 {
        let buf = buffers.get(1000).unwrap(); // a temporary buffer per iteration
        buf.write_at(0, &[i; 1000]).unwrap();
        let export = pool.export(buf.region()).unwrap();
        let wire = export.packed().encode(); // what the host sends the DPU
        let imported = cache.import(&PackedKey::decode(&wire).unwrap()).unwrap();
        qp.post_send(SendWr::write(
            imported.alias.region().slice(0, 1000).unwrap(),
            sink.remote().slice(0, 1000).unwrap(),
        ))
        .unwrap();
        dcq.wait(wait).unwrap().ok().unwrap();
        assert_eq!(sink.to_vec().unwrap()[..1000], [i; 1000]);
        export.release().unwrap();
        last = Some(imported);
    }
    let s = pool.stats();
    assert_eq!((s.created, s.reused, s.in_use, s.fallback), (1, 19, 0, 0));
    let a = cache.stats();
    assert_eq!((a.misses, a.hits, a.stale), (1, 19, 0));
    assert_eq!(buffers.stats().hits, 19);
    // The released key is invalidated: the cached alias gets a protection error now.
    let alias = last.unwrap().alias;
    qp.post_send(SendWr::write(alias.region().slice(0, 8).unwrap(), sink.remote().slice(0, 8).unwrap()))
        .unwrap();
    assert_eq!(dcq.wait(wait).unwrap().status, WcStatus::LOC_PROT_ERR);
}

/// The range cache over memory the test owns: hits inside a cached range, merging of
/// overlapping and touching ranges, eviction of idle registrations by size (least recently
/// used first), invalidation, and a peer's write landing in the application's own buffer.
#[test]
fn range_cache_registers_the_applications_memory() {
    use rdmakit_verbs::{AccessFlags, Context, SendWr};
    use std::ptr::NonNull;
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    // 64 KiB of the application's memory, as u64 words (8-byte aligned).
    let mut app = vec![0u64; 8192];
    let base = app.as_mut_ptr().cast::<u8>();
    let at = |off: usize| NonNull::new(base.wrapping_add(off)).unwrap();
    let cache = RangeCache::new(&pd, AccessFlags::ALL_REMOTE, 8 << 10);
    let reg = |off: usize, len: usize| {
        // SAFETY: `app` lives until after the final `invalidate`, and is not touched directly
        // while any of it is registered (the test reads it only at the end).
        unsafe { cache.register(at(off), len) }
    };
    {
        let a = reg(0, 4096).unwrap();
        let inside = reg(512, 64).unwrap();
        assert!(inside.region().same_registration(a.region()));
        assert_eq!((inside.offset(), inside.len()), (512, 64));
        let s = cache.stats();
        assert_eq!((s.hits, s.misses, s.entries), (1, 1, 1));
        // Overlapping the end of [0, 4096): one registration [0, 6144) replaces it.
        let b = reg(3072, 3072).unwrap();
        assert_eq!((b.offset(), b.region().len()), (3072, 6144));
        let s = cache.stats();
        assert_eq!((s.misses, s.merged, s.entries), (2, 1, 1));
        // A range only touching it ([6144, 8192)) stays apart: it could be another allocation.
        let c = reg(6144, 2048).unwrap();
        assert_eq!((c.offset(), c.region().len()), (0, 2048));
        assert_eq!(cache.stats().entries, 2);
        let d = reg(100 * 8, 8).unwrap();
        assert!(d.region().same_registration(b.region()), "inside [0, 6144): a hit");
        // A range overlapping both folds them into one registration, [0, 8192).
        let e = reg(6000, 200).unwrap();
        assert_eq!((e.offset(), e.region().len()), (6000, 8192));
        let s = cache.stats();
        assert_eq!((s.merged, s.entries), (3, 1));
        a.region().write_at(a.offset() + 8, &7u64.to_ne_bytes()).unwrap();
        // Inside a cached registration, unaligned ranges are refused too, as on a miss
        // (`register_raw`'s rule), not served.
        let hits = cache.stats().hits;
        for (off, len) in [(8 * 3 + 1, 8), (64, 12)] {
            assert!(matches!(reg(off, len), Err(rdmakit_verbs::Error::InvalidArgument(_))), "{off}+{len}");
        }
        assert_eq!(cache.stats().hits, hits);

        // A peer writes into the application's buffer through the cached registration.
        let cq = ctx.create_cq(4).unwrap();
        let (qa, _qb) = connected_pair(&pd, &cq);
        let src = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
        src.write_u64(0, 0xfeed).unwrap();
        qa.post_send(SendWr::write(src.local().unwrap(), d.remote().unwrap().slice(0, 8).unwrap())).unwrap();
        cq.wait(Some(std::time::Duration::from_secs(5))).unwrap().ok().unwrap();
    }
    // Everything released: the merged registration (8 KiB) is idle and within the limit.
    assert_eq!(cache.stats().idle_bytes, 8192);
    // Two more disjoint idle ranges push it over 8 KiB: least recently used first.
    for off in [16384, 24576] {
        drop(reg(off, 4096).unwrap());
    }
    let s = cache.stats();
    assert_eq!((s.evicted, s.entries, s.idle_bytes), (1, 2, 8192), "{s:?}");
    // Invalidation before the memory goes away.
    assert_eq!(cache.invalidate(base as u64, 64 << 10), 2);
    assert_eq!(cache.stats().entries, 0);
    // No registration is left: the application reads its own buffer again.
    assert_eq!(app[1], 7);
    assert_eq!(app[100], 0xfeed);
    // Unaligned ranges are refused, not registered.
    let odd = reg(3, 8);
    assert!(matches!(odd, Err(rdmakit_verbs::Error::InvalidArgument(_))));
}

/// A packed key is data from another party: one that names a cached key but presents the
/// wrong access key must neither be served the cached alias nor disturb the entry (its
/// generation, or the entry itself for another incarnation); only the firmware check of a new
/// alias, or a match of the cached one's access key, proves it.
#[test]
fn a_forged_packed_key_cannot_use_or_disturb_the_cached_alias() {
    let model = Model::default();
    let pool = UmrMkeyPool::new(model.clone(), PoolConfig::new(1, SECRET)).unwrap();
    let dpu = Dpu { host: model.clone(), created: Rc::default() };
    let cache = AliasCache::new(dpu.clone());
    let e = pool.export(&region(1)).unwrap();
    let good = e.packed();
    let a = cache.import(&good).unwrap();

    // Same key and incarnation, wrong access key, a generation from the far future.
    let forged = PackedKey { access_key: [0; 32], export_gen: u64::MAX, ..good };
    assert!(cache.import(&forged).is_err(), "a wrong access key was served the cached alias");
    // The legitimate export is still current, and still a hit.
    cache.check_current(&a).unwrap();
    assert!(cache.import(&good).unwrap().hit);

    // Another incarnation with a wrong access key: refused, and the cached alias stays.
    let reborn = PackedKey { uuid: good.uuid ^ 1, access_key: [0; 32], ..good };
    assert!(cache.import(&reborn).is_err());
    assert!(cache.import(&good).unwrap().hit, "a refused import evicted the cached alias");
    assert_eq!(dpu.created.get(), 1);
}

/// `register`'s contract lets the application free its memory once it has dropped the cache
/// and every registration of that memory. A registration of *other* memory still held must
/// not keep the idle ones alive: dropping the cache deregisters them at once, and one still
/// held goes when its holder lets go, instead of being cached. (Found by review: every
/// registration kept the cache's shared state, and with it every idle registration, so a
/// peer holding an idle one's rkey could still write into memory the application had freed.)
#[test]
fn dropping_the_range_cache_deregisters_what_nobody_holds() {
    use rdmakit_verbs::{AccessFlags, Context, SendWr, WcStatus};
    use std::ptr::NonNull;
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let (mut a, mut b) = (vec![0u64; 512], vec![0u64; 512]);
    let (pa, pb) = (
        NonNull::new(a.as_mut_ptr().cast::<u8>()).unwrap(),
        NonNull::new(b.as_mut_ptr().cast::<u8>()).unwrap(),
    );
    let cache = RangeCache::new(&pd, AccessFlags::ALL_REMOTE, 1 << 20);
    let clone = cache.clone();
    // SAFETY: `a` and `b` outlive every registration here and are read only once the
    // contract says nothing registers them (a registration still held of `a`, `ra`, is
    // dropped before `a` is read).
    let ra = unsafe { cache.register(pa, 4096) }.unwrap();
    // SAFETY: as above.
    let rb = unsafe { cache.register(pb, 4096) }.unwrap();
    let (a_remote, b_remote) = (ra.remote().unwrap(), rb.remote().unwrap());
    drop(rb); // idle in the cache
    drop(cache);
    assert_eq!(clone.stats().entries, 2, "a clone keeps the cache open");
    drop(clone); // the last handle: `b` may be freed now

    let cq = ctx.create_cq(4).unwrap();
    let (qa, _qb) = connected_pair(&pd, &cq);
    let src = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_u64(0, 0xdead_beef).unwrap();
    let write = |to: rdmakit_verbs::RemoteRegion| {
        qa.post_send(SendWr::write(src.local().unwrap(), to.slice(0, 8).unwrap())).unwrap();
        cq.wait(Some(std::time::Duration::from_secs(5))).unwrap().status
    };
    // The one still held works until it is dropped, and is not cached after.
    assert_eq!(write(a_remote), WcStatus::SUCCESS);
    assert_eq!(write(b_remote), WcStatus::REM_ACCESS_ERR, "an idle registration outlived the cache");
    drop(ra);
    // The QP went to the error state with the refused write: a fresh pair for the last look.
    let (qc, _qd) = connected_pair(&pd, &cq);
    qc.post_send(SendWr::write(src.local().unwrap(), a_remote.slice(0, 8).unwrap())).unwrap();
    let last = cq.wait(Some(std::time::Duration::from_secs(5))).unwrap().status;
    assert_eq!(last, WcStatus::REM_ACCESS_ERR, "a registration released after the cache closed was kept");
    assert_eq!((a[0], b[0]), (0xdead_beef, 0));
}

/// A packed key of a destroyed incarnation that arrives after the DPU imported the newer
/// incarnation (the host destroyed the key, the device gave its number to a new one) is
/// refused: its alias would reach the new incarnation's buffer, and taking it would evict
/// the current entry. Export generations are ordered across incarnations (and across the
/// pools of a host) for this. (Found by review: any other uuid replaced the cached entry.)
#[test]
fn a_late_export_of_a_destroyed_incarnation_is_refused() {
    let model = Model::default();
    let pool = UmrMkeyPool::new(model.clone(), PoolConfig::new(1, SECRET)).unwrap();
    let cache = AliasCache::new(Dpu { host: model.clone(), created: Rc::default() });
    let e1 = pool.export(&region(1)).unwrap();
    let old = e1.packed();
    drop(e1);
    drop(pool); // its key is destroyed
    // A second pool of the same host function (its keys share the device's numbers); the
    // model hands the new key the old number, as a device that recycles numbers does.
    let other = UmrMkeyPool::new(model.clone(), PoolConfig::new(1, SECRET)).unwrap();
    let e2 = other.export(&region(2)).unwrap();
    let mut reborn = e2.packed();
    assert!(reborn.export_gen > old.export_gen, "a later export of another pool is newer");
    reborn.mkey = old.mkey;
    model.dev().keys.insert(old.mkey, ModelKeyState { region: Some(2), access_key: SECRET });
    let current = cache.import(&reborn).unwrap();
    assert_eq!(current.alias.reach(), Ok(2));

    let Err(err) = cache.import(&old) else { panic!("a late export of a destroyed incarnation was taken") };
    assert!(err.to_string().contains("stale export"), "{err}");
    cache.check_current(&current).expect("the current incarnation stays cached");
    assert_eq!(cache.stats().refused_stale, 1);
}

/// Two connected RC QPs of `pd` on the soft NIC, both on `cq`.
fn connected_pair(
    pd: &rdmakit_verbs::ProtectionDomain,
    cq: &rdmakit_verbs::CompletionQueue,
) -> (rdmakit_verbs::QueuePair, rdmakit_verbs::QueuePair) {
    use rdmakit_verbs::{ConnectOptions, QpCaps};
    let (a, b) =
        (pd.create_qp(cq, cq, QpCaps::default()).unwrap(), pd.create_qp(cq, cq, QpCaps::default()).unwrap());
    a.connect(&b.address().unwrap(), &ConnectOptions::default()).unwrap();
    b.connect(&a.address().unwrap(), &ConnectOptions::default()).unwrap();
    (a, b)
}
