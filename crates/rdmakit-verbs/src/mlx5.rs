//! mlx5 memory keys: indirect mkeys (KSM and UMR), cross-vHCA access, and aliases.
//!
//! ConnectX NICs translate addresses through *mkeys*. Besides the direct keys of memory
//! regions, mlx5 has **indirect** keys whose address range maps onto other keys (KSM
//! entries): rdmakit uses them to give zero-based device memory a unique non-zero address
//! (MEMIC) and, re-bound at run time by UMR work requests, as the reusable keys of a
//! cross-GVMI pool. A key can be **opened to other vHCAs** (functions of the same NIC, such as
//! a BlueField DPU's Arm-side function) with a 32-byte access key; the other function
//! creates an **alias** of it in its own protection domain and moves the host's memory with
//! it, without the host CPU.
//!
//! Every key here is a [`MemoryRegion`] as far as work requests go (`local()`, `slice()`,
//! `remote()`), with no bytes of its own: CPU copies go through the region it maps. A key
//! keeps the regions bound to it alive until it is re-bound, invalidated or dropped, and a
//! work request keeps the key alive until it completes.
//!
//! Providers: the soft NIC emulates all of it (functions, KSM, UMR, `LOCAL_INV`, access keys,
//! aliases, with the protection errors a NIC gives for a key used after invalidation). On
//! the verbs provider, indirect keys (`mlx5dv_create_mkey`), UMR binding
//! (`mlx5dv_wr_mr_list` on a dedicated self-connected QP) and `LOCAL_INV` call mlx5 direct
//! verbs; those keys are zero-based, as UMR keys are. The vHCA id (`QUERY_HCA_CAP`),
//! `allow_other_vhca_access` (`ALLOW_OTHER_VHCA_ACCESS`) and aliases (`CREATE_GENERAL_OBJECT`
//! of an mkey alias) are DEVX firmware commands built in PRM layout (`rdma/mlx5dv.rs` says
//! where each field comes from); a KSM key at a non-zero address (a DEVX `CREATE_MKEY`) is not
//! implemented, and everything returns [`Error::Unsupported`] on a non-mlx5 device (rxe has
//! no mlx5dv). The verbs path is compiled and linked but untested on hardware.
//!
//! # Example: an indirect key over two regions
//! ```
//! use rdmakit_verbs::{AccessFlags, Context, mlx5::KsmEntry};
//! let pd = Context::open_soft().alloc_pd()?;
//! let (a, b) = (pd.alloc_mr(4096, AccessFlags::ALL_REMOTE)?, pd.alloc_mr(4096, AccessFlags::ALL_REMOTE)?);
//! let key = pd.create_indirect_mkey(0x10_0000, 8192, AccessFlags::ALL_REMOTE)?;
//! let umr = pd.create_umr_queue()?;
//! umr.bind(&key, &[KsmEntry::whole(&a), KsmEntry::whole(&b)])?;
//! // Peers now write `key.region().remote()`: bytes 4096.. land in `b`.
//! assert_eq!(key.region().remote().addr, 0x10_0000);
//! umr.invalidate(&key)?; // later uses fail with a protection error
//! # Ok::<(), rdmakit_verbs::Error>(())
//! ```

use std::sync::{Arc, Mutex};

use crate::device::{Context, CtxBackend};
use crate::error::{Error, Result};
use crate::mr::{MemoryRegion, MrBackend, MrInner, MrMemory};
use crate::pd::{PdBackend, ProtectionDomain};
use crate::soft::SoftDevice;
use crate::soft::mr::{Binding, Seg};
use crate::types::AccessFlags;

/// The largest range one UMR work request can bind on mlx5 (2 GiB); larger regions need a
/// key of their own ([`ProtectionDomain::create_ksm_mkey`]).
pub const UMR_MAX_LEN: u64 = 1 << 31;

/// The length of an access key (`allow_other_vhca_access`).
pub const ACCESS_KEY_LEN: usize = 32;

/// What kind of key an [`MkeyState`] belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Indirect,
    Alias,
}

/// Provider-independent state of an indirect or alias key, kept in its region.
pub(crate) struct MkeyState {
    kind: Kind,
    /// The regions the key maps now (kept registered while bound).
    bound: Mutex<Vec<MemoryRegion>>,
}

/// One KSM entry: `len` bytes of `region` from `offset`, made with [`new`](Self::new) or
/// [`whole`](Self::whole).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct KsmEntry {
    /// The region the entry maps to (any key of the same PD, device memory included).
    pub region: MemoryRegion,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes mapped.
    pub len: u64,
}

impl KsmEntry {
    /// `len` bytes of `region` from `offset` (checked when the entry is bound).
    pub fn new(region: &MemoryRegion, offset: u64, len: u64) -> KsmEntry {
        KsmEntry { region: region.clone(), offset, len }
    }

    /// All of `region`.
    pub fn whole(region: &MemoryRegion) -> KsmEntry {
        KsmEntry { region: region.clone(), offset: 0, len: region.len() as u64 }
    }
}

/// An indirect mkey: `len` bytes from `base` mapped onto other keys, or free.
///
/// Use [`region`](Self::region) in work requests and remote descriptors.
#[derive(Clone, Debug)]
pub struct IndirectMkey {
    region: MemoryRegion,
}

/// An alias, in this function's protection domain, of a key of another vHCA.
#[derive(Clone, Debug)]
pub struct AliasMkey {
    region: MemoryRegion,
    vhca_id: u32,
    mkey: u32,
}

/// A queue for UMR work requests (re-binding indirect keys, `LOCAL_INV`), with its own
/// completion queue, as UCX keeps a dedicated UMR QP.
///
/// On mlx5 every `UmrQueue` of a protection domain shares one UMR QP and CQ, created on first
/// use (by [`ProtectionDomain::create_umr_queue`] or a KSM key) and destroyed with the PD: a
/// UMR only modifies keys of its own PD, and the PD is what UCX's memory domain has one of.
pub struct UmrQueue {
    pd: ProtectionDomain,
    /// The PD's mlx5 UMR QP on the verbs provider (one request at a time).
    #[cfg(rdmakit_verbs)]
    verbs: Option<Arc<Mutex<crate::rdma::mlx5dv::UmrQp>>>,
}

impl std::fmt::Debug for UmrQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UmrQueue").field("device", &self.pd.context().name()).finish()
    }
}

/// Most KSM entries a verbs indirect key is created with room for.
#[cfg(rdmakit_verbs)]
const VERBS_MAX_ENTRIES: u16 = 16;

fn soft_device(ctx: &Context) -> Result<&Arc<SoftDevice>> {
    match &ctx.inner.backend {
        CtxBackend::Soft(d) => Ok(d),
        #[cfg(rdmakit_verbs)]
        CtxBackend::Verbs(_) => Err(Error::Unsupported(format!(
            "{}: this is a soft-NIC feature (on hardware, open the other function's device by \
             name, or use the DEVX calls of the verbs provider)",
            ctx.name()
        ))),
    }
}

fn soft_pd(pd: &ProtectionDomain) -> Result<(&Arc<SoftDevice>, u64)> {
    let dev = soft_device(&pd.inner.ctx)?;
    match &pd.inner.backend {
        PdBackend::Soft(id) => Ok((dev, *id)),
        #[cfg(rdmakit_verbs)]
        PdBackend::Verbs(_) => unreachable!("a soft context has soft PDs"),
    }
}

fn mkey_region(
    pd: &ProtectionDomain,
    device: &Arc<SoftDevice>,
    key: u32,
    kind: Kind,
    base: u64,
    len: u64,
    access: AccessFlags,
) -> MemoryRegion {
    MemoryRegion {
        inner: Arc::new(MrInner {
            backend: MrBackend::Soft { device: device.clone(), key },
            mem: MrMemory::Mkey(Arc::new(MkeyState { kind, bound: Mutex::new(Vec::new()) })),
            pd: pd.clone(),
            access,
            addr: base,
            len,
            lkey: key,
            rkey: key,
        }),
    }
}

fn state(region: &MemoryRegion) -> &MkeyState {
    match &region.inner.mem {
        MrMemory::Mkey(s) => s,
        _ => unreachable!("mlx5 key types wrap mkey regions"),
    }
}

impl ProtectionDomain {
    /// Creates a free indirect mkey covering `len` bytes from `base` (`mlx5dv_create_mkey`
    /// with `MLX5DV_MKEY_INIT_ATTR_FLAGS_INDIRECT`). Bind it with a [`UmrQueue`].
    #[doc(alias = "mlx5dv_create_mkey")]
    pub fn create_indirect_mkey(&self, base: u64, len: u64, access: AccessFlags) -> Result<IndirectMkey> {
        access.validate()?;
        if len == 0 || base.checked_add(len).is_none() {
            return Err(Error::InvalidArgument(format!(
                "indirect key range {base:#x}+{len} is empty or wraps"
            )));
        }
        match &self.inner.backend {
            PdBackend::Soft(_) => {
                let (dev, pd_id) = soft_pd(self)?;
                let key = dev.mrs.register_indirect(pd_id, base, len, access);
                Ok(IndirectMkey { region: mkey_region(self, dev, key, Kind::Indirect, base, len, access) })
            }
            #[cfg(rdmakit_verbs)]
            PdBackend::Verbs(vpd) => {
                // Keys bound by UMR (`mlx5dv_wr_mr_list`) are zero-based; a key at a non-zero
                // base is made already mapped, by `create_ksm_mkey` (DEVX CREATE_MKEY).
                if base != 0 {
                    return Err(Error::Unsupported(
                        "verbs indirect keys bound by UMR are zero-based: use create_ksm_mkey for a non-zero base"
                            .into(),
                    ));
                }
                let mk = vpd.create_indirect_mkey(VERBS_MAX_ENTRIES)?;
                let key = mk.lkey();
                Ok(IndirectMkey {
                    region: MemoryRegion {
                        inner: Arc::new(MrInner {
                            backend: MrBackend::VerbsMkey(mk),
                            mem: MrMemory::Mkey(Arc::new(MkeyState {
                                kind: Kind::Indirect,
                                bound: Mutex::new(Vec::new()),
                            })),
                            pd: self.clone(),
                            access,
                            addr: 0,
                            len,
                            lkey: key,
                            rkey: key,
                        }),
                    },
                })
            }
        }
    }

    /// Creates an indirect key already mapping `entries` from `base`: for ranges UMR cannot
    /// bind, and for keys that never change, such as a MEMIC region's.
    ///
    /// On mlx5 a non-zero `base` makes a KSM mkey with DEVX `CREATE_MKEY` (the entries must
    /// then be equal power-of-two spans, and the key cannot be re-bound or invalidated);
    /// `Error::Unsupported` where DEVX refuses. A `base` of 0 makes a zero-based indirect key
    /// bound by UMR. The soft NIC takes any base and entries.
    pub fn create_ksm_mkey(
        &self,
        base: u64,
        entries: &[KsmEntry],
        access: AccessFlags,
    ) -> Result<IndirectMkey> {
        let len = entries.iter().try_fold(0u64, |a, e| a.checked_add(e.len));
        let len = len.ok_or_else(|| Error::InvalidArgument("KSM entries overflow".into()))?;
        match &self.inner.backend {
            PdBackend::Soft(_) => {
                let key = self.create_indirect_mkey(base, len, access)?;
                bind_soft(&key, entries)?;
                Ok(key)
            }
            // At a non-zero base: a KSM mkey by DEVX CREATE_MKEY, the only way mlx5 gives an
            // indirect key a start address of our choosing.
            #[cfg(rdmakit_verbs)]
            PdBackend::Verbs(vpd) if base != 0 => self.create_devx_ksm(vpd, base, len, entries, access),
            // At address 0: a UMR-bound indirect key (zero-based, as `mlx5dv_wr_mr_list` makes them).
            #[cfg(rdmakit_verbs)]
            PdBackend::Verbs(_) => {
                let key = self.create_indirect_mkey(0, len, access)?;
                self.create_umr_queue()?.bind(&key, entries)?;
                Ok(key)
            }
        }
    }

    /// DEVX `CREATE_MKEY` of a KSM key from `base`: the entries must be equal power-of-two
    /// spans (KSM maps fixed-size entities), each inside its own region of this PD. The key is
    /// fixed: it cannot be re-bound or invalidated, only dropped.
    #[cfg(rdmakit_verbs)]
    fn create_devx_ksm(
        &self,
        vpd: &crate::rdma::Pd,
        base: u64,
        len: u64,
        entries: &[KsmEntry],
        access: AccessFlags,
    ) -> Result<IndirectMkey> {
        access.validate()?;
        if len == 0 || base.checked_add(len).is_none() {
            return Err(Error::InvalidArgument(format!("KSM key range {base:#x}+{len} is empty or wraps")));
        }
        let entity = entries[0].len;
        if !entity.is_power_of_two() || entries.iter().any(|e| e.len != entity) {
            return Err(Error::Unsupported(
                "a KSM key maps equal power-of-two entities; these entries differ in length".into(),
            ));
        }
        let mut raw = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            if e.offset.checked_add(e.len).is_none_or(|end| end > e.region.len() as u64) {
                return Err(Error::InvalidArgument(format!("KSM entry {i}: outside its region")));
            }
            if !Arc::ptr_eq(&e.region.inner.pd.inner, &self.inner) {
                return Err(Error::InvalidArgument(format!(
                    "KSM entry {i}: region of another protection domain"
                )));
            }
            raw.push((e.region.lkey(), e.region.addr() + e.offset));
        }
        let ksm = vpd.create_ksm_key(base, entity.trailing_zeros() as u8, &raw, access)?;
        let key = ksm.key();
        Ok(IndirectMkey {
            region: MemoryRegion {
                inner: Arc::new(MrInner {
                    backend: MrBackend::VerbsKsm(ksm),
                    mem: MrMemory::Mkey(Arc::new(MkeyState {
                        kind: Kind::Indirect,
                        // The entries' regions stay registered while the key lives.
                        bound: Mutex::new(entries.iter().map(|e| e.region.clone()).collect()),
                    })),
                    pd: self.clone(),
                    access,
                    addr: base,
                    len,
                    lkey: key,
                    rkey: key,
                }),
            },
        })
    }

    /// Creates a queue for UMR work requests on this PD's keys.
    pub fn create_umr_queue(&self) -> Result<UmrQueue> {
        match (&self.inner.backend, &self.inner.ctx.inner.backend) {
            (PdBackend::Soft(_), _) => Ok(UmrQueue {
                pd: self.clone(),
                #[cfg(rdmakit_verbs)]
                verbs: None,
            }),
            #[cfg(rdmakit_verbs)]
            (PdBackend::Verbs(vpd), CtxBackend::Verbs(vctx)) => {
                let mut shared = self.inner.umr.lock().unwrap_or_else(|e| e.into_inner());
                let umr = match &*shared {
                    Some(umr) => umr.clone(),
                    None => shared
                        .insert(Arc::new(Mutex::new(vpd.create_umr_qp(vctx, VERBS_MAX_ENTRIES)?)))
                        .clone(),
                };
                Ok(UmrQueue { pd: self.clone(), verbs: Some(umr) })
            }
            #[cfg(rdmakit_verbs)]
            _ => unreachable!("a PD and its context share a provider"),
        }
    }

    /// Creates an alias in this PD of key `mkey` of the function `vhca_id` of the same NIC,
    /// presenting `access_key` (`MLX5_CMD_OP_CREATE_GENERAL_OBJECT` of the mkey alias type
    /// on mlx5). The alias covers the same range as the key and is usable as an lkey (and as
    /// an rkey if `access` grants remote access). Fails if the key does not exist, is not
    /// open to other vHCAs, or the access key differs.
    pub fn create_alias_mkey(
        &self,
        vhca_id: u32,
        mkey: u32,
        access_key: &[u8; ACCESS_KEY_LEN],
        access: AccessFlags,
    ) -> Result<AliasMkey> {
        access.validate()?;
        #[cfg(rdmakit_verbs)]
        if let PdBackend::Verbs(vpd) = &self.inner.backend {
            let alias = vpd.create_alias(vhca_id, mkey, access_key)?;
            let key = alias.key();
            // The host key's range is not visible here; the NIC checks the real bounds.
            let region = MemoryRegion {
                inner: Arc::new(MrInner {
                    backend: MrBackend::VerbsAlias(alias),
                    mem: MrMemory::Mkey(Arc::new(MkeyState {
                        kind: Kind::Alias,
                        bound: Mutex::new(Vec::new()),
                    })),
                    pd: self.clone(),
                    access,
                    addr: 0,
                    len: UMR_MAX_LEN,
                    lkey: key,
                    rkey: key,
                }),
            };
            return Ok(AliasMkey { region, vhca_id, mkey });
        }
        let (dev, pd_id) = soft_pd(self)?;
        let owner = SoftDevice::by_vhca(vhca_id).filter(|o| o.nic() == dev.nic()).ok_or_else(|| {
            Error::InvalidArgument(format!("no vHCA {vhca_id} on the NIC of {}", dev.name()))
        })?;
        let entry = owner
            .mrs
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
        let key = dev.mrs.register_alias(pd_id, &owner.mrs, mkey, entry.base, entry.len, access);
        Ok(AliasMkey {
            region: mkey_region(self, dev, key, Kind::Alias, entry.base, entry.len, access),
            vhca_id,
            mkey,
        })
    }
}

impl Context {
    /// This function's vHCA id (GVMI): what other functions name it by.
    pub fn vhca_id(&self) -> Result<u32> {
        match &self.inner.backend {
            CtxBackend::Soft(dev) => Ok(dev.vhca_id()),
            #[cfg(rdmakit_verbs)]
            CtxBackend::Verbs(vctx) => vctx.vhca_id(),
        }
    }

    /// Opens another function (vHCA) of the same soft NIC, as a BlueField DPU's Arm-side
    /// function is to the host's: its own vHCA id, keys, PDs and QPs, and aliases onto the
    /// keys this function opens to it. Soft NIC only (on hardware, open the other
    /// function's device by name).
    pub fn open_function(&self) -> Result<Context> {
        let dev = soft_device(self)?;
        Ok(Context::from_soft_device(dev.new_function()?))
    }
}

fn bind_soft(key: &IndirectMkey, entries: &[KsmEntry]) -> Result<()> {
    let r = &key.region;
    let (dev, _) = soft_pd(&r.inner.pd)?;
    let mut segs = Vec::with_capacity(entries.len());
    let mut start = 0u64;
    for (i, e) in entries.iter().enumerate() {
        let bad = |why: &str| Error::InvalidArgument(format!("KSM entry {i}: {why}"));
        if e.len == 0 {
            return Err(bad("empty"));
        }
        if !Arc::ptr_eq(&e.region.inner.pd.inner, &r.inner.pd.inner) {
            return Err(bad("region of another protection domain"));
        }
        if e.offset.checked_add(e.len).is_none_or(|end| end > e.region.len() as u64) {
            return Err(bad("outside its region"));
        }
        #[cfg_attr(not(rdmakit_verbs), allow(irrefutable_let_patterns))]
        let MrBackend::Soft { key: tkey, .. } = &e.region.inner.backend else {
            return Err(bad("region of another provider"));
        };
        let target = dev.mrs.lookup(*tkey).ok_or_else(|| bad("region no longer registered"))?;
        segs.push(Seg { start, len: e.len, target, target_addr: e.region.addr() + e.offset });
        start += e.len;
    }
    if start > r.len() as u64 {
        return Err(Error::InvalidArgument(format!(
            "KSM entries map {start} bytes; the key covers {}",
            r.len()
        )));
    }
    let entry =
        dev.mrs.lookup(r.lkey()).ok_or_else(|| Error::InvalidArgument("indirect key destroyed".into()))?;
    let mut bound = state(r).bound.lock().unwrap_or_else(|e| e.into_inner());
    entry.rebind(Some(Binding::new(segs)));
    *bound = entries.iter().map(|e| e.region.clone()).collect();
    Ok(())
}

/// Binds through the mlx5 UMR QP: entries become (address, length, lkey) SGEs.
#[cfg(rdmakit_verbs)]
fn bind_verbs(
    umr: &Mutex<crate::rdma::mlx5dv::UmrQp>,
    key: &IndirectMkey,
    entries: &[KsmEntry],
) -> Result<()> {
    let MrBackend::VerbsMkey(mk) = &key.region.inner.backend else {
        return Err(Error::InvalidArgument("not a verbs indirect key".into()));
    };
    let mut sges = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        if e.len == 0 || e.offset.checked_add(e.len).is_none_or(|end| end > e.region.len() as u64) {
            return Err(Error::InvalidArgument(format!("KSM entry {i}: empty or outside its region")));
        }
        if !Arc::ptr_eq(&e.region.inner.pd.inner, &key.region.inner.pd.inner) {
            return Err(Error::InvalidArgument(format!(
                "KSM entry {i}: region of another protection domain"
            )));
        }
        let len =
            u32::try_from(e.len).map_err(|_| Error::InvalidArgument(format!("KSM entry {i}: over 4 GiB")))?;
        sges.push((e.region.addr() + e.offset, len, e.region.lkey()));
    }
    let mut bound = state(&key.region).bound.lock().unwrap_or_else(|e| e.into_inner());
    umr.lock().unwrap_or_else(|e| e.into_inner()).bind(mk, key.region.access(), &sges)?;
    *bound = entries.iter().map(|e| e.region.clone()).collect();
    Ok(())
}

impl IndirectMkey {
    /// The key as a region, for work requests and remote descriptors (lkey = rkey).
    pub fn region(&self) -> &MemoryRegion {
        &self.region
    }

    /// The mkey number.
    pub fn key(&self) -> u32 {
        self.region.lkey()
    }

    /// True while the key maps something (bound, not invalidated).
    pub fn is_bound(&self) -> bool {
        !state(&self.region).bound.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
    }

    /// Opens the key to other vHCAs of the NIC, which may alias it presenting `access_key`
    /// (`MLX5_CMD_OP_ALLOW_OTHER_VHCA_ACCESS` on mlx5). Stays open across re-binds.
    pub fn allow_other_vhca_access(&self, access_key: &[u8; ACCESS_KEY_LEN]) -> Result<()> {
        #[cfg(rdmakit_verbs)]
        if let MrBackend::VerbsMkey(mk) = &self.region.inner.backend {
            return mk.allow_other_vhca_access(access_key);
        }
        let (dev, _) = soft_pd(&self.region.inner.pd)?;
        let entry = dev
            .mrs
            .lookup(self.key())
            .ok_or_else(|| Error::InvalidArgument("indirect key destroyed".into()))?;
        entry.allow_cross_vhca(*access_key);
        Ok(())
    }
}

impl AliasMkey {
    /// The alias as a region, for work requests (lkey) and, with remote access, peers.
    pub fn region(&self) -> &MemoryRegion {
        &self.region
    }

    /// The alias's own mkey number (in this function).
    pub fn key(&self) -> u32 {
        self.region.lkey()
    }

    /// The vHCA id and mkey it aliases.
    pub fn target(&self) -> (u32, u32) {
        (self.vhca_id, self.mkey)
    }
}

impl UmrQueue {
    /// Binds `key` to `entries` from its base with a UMR work request, and waits for its
    /// completion (`mlx5dv_wr_mr_list` on mlx5). A bound key must be invalidated first, as
    /// on hardware; ranges above [`UMR_MAX_LEN`] are refused.
    #[doc(alias = "mlx5dv_wr_mr_list")]
    pub fn bind(&self, key: &IndirectMkey, entries: &[KsmEntry]) -> Result<()> {
        self.check_key(key)?;
        let total = entries.iter().try_fold(0u64, |a, e| a.checked_add(e.len)).unwrap_or(u64::MAX);
        if total > UMR_MAX_LEN {
            return Err(Error::Unsupported(format!(
                "UMR binds at most {UMR_MAX_LEN} bytes ({total} asked): use a KSM key of its own"
            )));
        }
        if key.is_bound() {
            return Err(Error::InvalidArgument(format!(
                "indirect key {:#x} is bound: invalidate it before re-binding",
                key.key()
            )));
        }
        #[cfg(rdmakit_verbs)]
        if let Some(umr) = &self.verbs {
            return bind_verbs(umr, key, entries);
        }
        bind_soft(key, entries)
    }

    /// Invalidates `key` (`IBV_WR_LOCAL_INV`) and waits: later uses of it, and of aliases
    /// of it, fail with a protection error; operations already executing finish.
    #[doc(alias = "IBV_WR_LOCAL_INV")]
    pub fn invalidate(&self, key: &IndirectMkey) -> Result<()> {
        self.check_key(key)?;
        #[cfg(rdmakit_verbs)]
        if let MrBackend::VerbsKsm(_) = &key.region.inner.backend {
            return Err(Error::InvalidArgument(
                "a KSM key made by CREATE_MKEY maps its entries for life: drop it instead".into(),
            ));
        }
        #[cfg(rdmakit_verbs)]
        if let (Some(umr), MrBackend::VerbsMkey(mk)) = (&self.verbs, &key.region.inner.backend) {
            let mut bound = state(&key.region).bound.lock().unwrap_or_else(|e| e.into_inner());
            umr.lock().unwrap_or_else(|e| e.into_inner()).invalidate(mk)?;
            bound.clear();
            return Ok(());
        }
        let (dev, _) = soft_pd(&self.pd)?;
        let entry = dev
            .mrs
            .lookup(key.key())
            .ok_or_else(|| Error::InvalidArgument("indirect key destroyed".into()))?;
        let mut bound = state(&key.region).bound.lock().unwrap_or_else(|e| e.into_inner());
        entry.rebind(None);
        bound.clear();
        Ok(())
    }

    fn check_key(&self, key: &IndirectMkey) -> Result<()> {
        if !Arc::ptr_eq(&key.region.inner.pd.inner, &self.pd.inner) {
            return Err(Error::InvalidArgument("UMR on a key of another protection domain".into()));
        }
        debug_assert_eq!(state(&key.region).kind, Kind::Indirect);
        Ok(())
    }
}
