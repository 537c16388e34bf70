//! Cross-GVMI memory keys through a pool of UMR mkeys, and the DPU side's alias map.
//!
//! On a DPU (BlueField), a process on the Arm cores can move memory of a host process to a
//! remote peer without the host CPU: the host opens one of its memory keys to the DPU's
//! function (its *vHCA*, or GVMI) with an access key, and the DPU creates an **alias** of that
//! key in its own protection domain, usable as an lkey (and rkey). Doing that per buffer is
//! slow: creating an indirect mkey (~220 µs), opening it to another vHCA (~140 µs) and
//! creating the alias on the DPU (~200 µs) add up to 0.8–0.9 ms per buffer in the UCX
//! measurements (Yong Qin, "Cross-GVMI UMR Mkey Pool", UCF 2023), while re-pointing an existing
//! indirect mkey at another region with a UMR work request costs about 1 µs.
//!
//! So, as UCX's UMR mkey pool does:
//! - the **host** keeps a LIFO [`UmrMkeyPool`] of indirect mkeys, each created and opened to
//!   other vHCAs once. [`UmrMkeyPool::export`] takes the key at the head, binds it to the
//!   region with a UMR work request, and returns a [`PackedKey`] `{mkey, vhca_id, uuid,
//!   export_gen}`;
//!   releasing the export invalidates the key (`LOCAL_INV`) and puts it back at the head.
//!   Keys are created lazily (or pre-created up to a configured count) and never beyond
//!   what is in use at once. A region UMR cannot serve (over 2 GiB on mlx5) gets a plain
//!   indirect key of its own instead, destroyed at release.
//! - the **DPU** keeps an [`AliasCache`], a hash map keyed by `(vhca_id << 32) | mkey`.
//!   Because pooled keys keep their number across exports, the alias made for the first
//!   export of a key serves every later one: a hit costs a hash lookup. The `uuid` names the
//!   incarnation of the host key; a different uuid under the same map key means the host
//!   key was destroyed and its number reused, so the cached alias is stale and is destroyed
//!   and re-created. Only pool keys are cached. The `export_gen` is fresh at every bind and
//!   ordered across the host and its reboots (boot time plus monotonic clock): once the DPU
//!   has imported a newer export of a key, an older one (whose buffer the host has taken
//!   back, and which the shared alias no longer reaches) is refused, whether the key was
//!   re-bound or destroyed and its number given to a new incarnation, and an import held
//!   across the re-bind fails
//!   [`AliasCache::check_current`] once the DPU has imported a newer export of that key
//!   (until then the DPU cannot know of the re-bind, and a held alias reaches the new
//!   buffer: the host must not re-bind a key while the DPU may still use an export of it).
//! - a [`RangeCache`] registers the application's own buffers by address range, as UCX's
//!   rcache that the talk reuses on host and DPU: a lookup inside a cached registration is a
//!   hit (an ordered-map lookup and a reference count), a miss registers the range merged
//!   with the cached registrations it overlaps, idle registrations are evicted
//!   least recently used beyond a byte limit, and [`RangeCache::invalidate`] is the rule for
//!   memory about to be freed or remapped. Export a cached range by passing its
//!   [`RangeRegistration::region`] to [`UmrMkeyPool::export`] (the whole cached
//!   registration is exported; its [`offset`](RangeRegistration::offset) says where the
//!   range starts). Heap rings and pipe rings are rdmakit's own allocations, so they need no
//!   cache.
//! - a [`RegistrationCache`] lets short-lived buffers rdmakit allocates reuse registrations
//!   by size class, the case where the pool pays off (a buffer per iteration, exported each
//!   time).
//!
//! The pool and the cache are generic over the device operations ([`HostKeyOps`],
//! [`AliasOps`]), so their logic is tested apart from any device; [`HostFunction`] and
//! [`DpuFunction`] implement them over `rdmakit_verbs::mlx5` (emulated by the soft NIC).
//! Pool keys are zero-based: a peer addresses byte `i` of the exported region as
//! `PackedKey::addr + i` with `addr == 0`.
//!
//! # Example: host exports, DPU imports, a stale export is refused
//!
//! ```
//! use rdmakit_memory::xgvmi::{AliasCache, DpuFunction, HostFunction, PoolConfig, UmrMkeyPool};
//! use rdmakit_verbs::{AccessFlags, Context};
//!
//! let host = Context::open_soft();
//! let dpu = host.open_function()?; // the DPU's function on the same NIC
//! let (hpd, dpd) = (host.alloc_pd()?, dpu.alloc_pd()?);
//! let pool = UmrMkeyPool::new(HostFunction::new(&hpd, AccessFlags::ALL_REMOTE)?, PoolConfig::new(4, [1; 32]))?;
//! let aliases = AliasCache::new(DpuFunction::new(&dpd, AccessFlags::LOCAL_WRITE));
//! let (a, b) = (hpd.alloc_mr(4096, AccessFlags::ALL_REMOTE)?, hpd.alloc_mr(4096, AccessFlags::ALL_REMOTE)?);
//!
//! let first = pool.export(&a)?;
//! let old = first.packed();
//! let imported = aliases.import(&old)?;
//! first.release()?; // the host takes `a` back: LOCAL_INV, the key returns to the pool
//!
//! let second = pool.export(&b)?; // the same key, re-bound to `b` by UMR
//! assert_eq!(second.packed().mkey, old.mkey);
//! assert!(aliases.import(&second.packed())?.hit); // the alias is shared
//! assert!(aliases.check_current(&imported).is_err()); // the old import no longer reaches `a`
//! assert!(aliases.import(&old).is_err()); // and the stale export is refused
//! # Ok::<(), rdmakit_verbs::Error>(())
//! ```

mod alias;
mod device;
mod packed;
mod pool;
mod regcache;

#[cfg(test)]
#[allow(unsafe_code)] // the range cache test registers the test's own memory
mod tests;

pub use alias::{AliasCache, AliasOps, AliasStats, DEFAULT_ALIAS_CAPACITY, ImportedAlias};
pub use device::{DpuFunction, HostFunction};
pub use packed::{PackedKey, PackedKeyError};
pub use pool::{Export, HostKeyOps, PoolConfig, PoolStats, UmrMkeyPool};
pub use regcache::{
    CachedRegion, RangeCache, RangeCacheStats, RangeRegistration, RegCacheStats, RegistrationCache,
};
