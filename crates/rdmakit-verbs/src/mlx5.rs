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
//! where each field comes from), and so is the KSM key at a non-zero address that MEMIC uses
//! ([`ProtectionDomain::create_ksm_mkey`], a DEVX `CREATE_MKEY`, with a zero-based UMR key as
//! the fallback when the firmware refuses DEVX). Everything returns [`Error::Unsupported`] on
//! a non-mlx5 device (rxe has no mlx5dv). The verbs path is compiled and linked but has never
//! run on an mlx5 device.
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

use crate::device::Context;
use crate::error::{Error, Result};
use crate::mr::{MemoryRegion, MrBackend, MrMemory};
use crate::pd::{PdBackend, ProtectionDomain};
use crate::raw::RawKsm;
use crate::soft::SoftDevice;
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
    /// What the key's owner asked to outlive it ([`IndirectMkey::keep_alive`]): dropped
    /// with this state, after the key is destroyed (never, if destroying it failed).
    kept: Mutex<Vec<Box<dyn std::any::Any + Send>>>,
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
    backend: UmrBackend,
}

/// The provider of a [`UmrQueue`].
enum UmrBackend {
    /// The soft NIC re-binds its key table directly.
    Soft,
    /// The PD's mlx5 UMR QP (one request at a time).
    #[cfg(rdmakit_verbs)]
    Verbs(Arc<Mutex<crate::rdma::mlx5dv::UmrQp>>),
}

impl std::fmt::Debug for UmrQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UmrQueue").field("device", &self.pd.context().name()).finish()
    }
}

/// The soft NIC behind `ctx`, or the error of a soft-NIC-only feature.
fn soft_device(ctx: &Context) -> Result<&Arc<SoftDevice>> {
    ctx.backend().soft().ok_or_else(|| soft_only(ctx))
}

/// The error of a soft-NIC-only feature used on `ctx`.
fn soft_only(ctx: &Context) -> Error {
    Error::Unsupported(format!(
        "{}: this is a soft-NIC feature (on hardware, open the other function's device by \
         name, or use the DEVX calls of the verbs provider)",
        ctx.name()
    ))
}

/// A key region of this module: no bytes of its own, `bound` the regions it maps.
fn mkey_region(
    pd: &ProtectionDomain,
    keys: (MrBackend, u32),
    kind: Kind,
    bound: Vec<MemoryRegion>,
    range: (u64, u64),
    access: AccessFlags,
) -> MemoryRegion {
    let (backend, key) = keys;
    let state = MkeyState { kind, bound: Mutex::new(bound), kept: Mutex::new(Vec::new()) };
    MemoryRegion::assemble(pd, (backend, key, key), MrMemory::Mkey(Arc::new(state)), access, range)
}

fn state(region: &MemoryRegion) -> &MkeyState {
    match &region.inner.mem {
        MrMemory::Mkey(s) => s,
        _ => unreachable!("mlx5 key types wrap mkey regions"),
    }
}

/// Checks KSM entries against `pd` (non-empty, of this PD, inside their regions) and turns
/// them into the provider-neutral form, consecutive from offset 0.
fn raw_entries(pd: &ProtectionDomain, entries: &[KsmEntry]) -> Result<Vec<RawKsm>> {
    let mut raw = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        let bad = |why: &str| Error::InvalidArgument(format!("KSM entry {i}: {why}"));
        if e.len == 0 {
            return Err(bad("empty"));
        }
        if !e.region.pd().same_pd(pd) {
            return Err(bad("region of another protection domain"));
        }
        if e.offset.checked_add(e.len).is_none_or(|end| end > e.region.len() as u64) {
            return Err(bad("outside its region"));
        }
        raw.push(RawKsm { addr: e.region.addr() + e.offset, len: e.len, key: e.region.lkey() });
    }
    Ok(raw)
}

/// The one place the mlx5 keys dispatch to their provider: key creation on a PD's
/// provider, and the UMR operations on a queue's.
impl UmrBackend {
    /// Most KSM entries a verbs indirect key is created with room for.
    #[cfg(rdmakit_verbs)]
    const VERBS_MAX_ENTRIES: u16 = 16;

    fn create_indirect_mkey(
        pd: &ProtectionDomain,
        base: u64,
        len: u64,
        access: AccessFlags,
    ) -> Result<IndirectMkey> {
        let keys = match pd.backend() {
            PdBackend::Soft(pd_id) => {
                let dev = soft_device(pd.context())?;
                let key = dev.mrs.register_indirect(*pd_id, base, len, access);
                (MrBackend::Soft { device: dev.clone(), key, drain: None }, key)
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
                let mk = vpd.create_indirect_mkey(Self::VERBS_MAX_ENTRIES)?;
                let key = mk.lkey();
                (MrBackend::VerbsMkey(mk), key)
            }
        };
        Ok(IndirectMkey { region: mkey_region(pd, keys, Kind::Indirect, Vec::new(), (base, len), access) })
    }

    /// An indirect key already mapping `entries` from `base`, `len` bytes in all.
    fn create_ksm_mkey(
        pd: &ProtectionDomain,
        base: u64,
        len: u64,
        entries: &[KsmEntry],
        access: AccessFlags,
    ) -> Result<IndirectMkey> {
        match pd.backend() {
            PdBackend::Soft(_) => {
                let key = UmrBackend::create_indirect_mkey(pd, base, len, access)?;
                bind_entries(&UmrBackend::Soft, &key.region, entries)?;
                Ok(key)
            }
            // At a non-zero base: a KSM mkey by DEVX CREATE_MKEY, the only way mlx5 gives an
            // indirect key a start address of our choosing.
            #[cfg(rdmakit_verbs)]
            PdBackend::Verbs(vpd) if base != 0 => {
                access.validate()?;
                let (log_entity, raw) = UmrBackend::devx_ksm_entries(pd, base, len, entries)?;
                let ksm = vpd.create_ksm_key(base, log_entity, &raw, access)?;
                let key = ksm.key();
                // The entries' regions stay registered while the key lives.
                let bound = entries.iter().map(|e| e.region.clone()).collect();
                let region = mkey_region(
                    pd,
                    (MrBackend::VerbsKsm(ksm), key),
                    Kind::Indirect,
                    bound,
                    (base, len),
                    access,
                );
                Ok(IndirectMkey { region })
            }
            // At address 0: a UMR-bound indirect key (zero-based, as `mlx5dv_wr_mr_list` makes them).
            #[cfg(rdmakit_verbs)]
            PdBackend::Verbs(_) => {
                let key = UmrBackend::create_indirect_mkey(pd, 0, len, access)?;
                pd.create_umr_queue()?.bind(&key, entries)?;
                Ok(key)
            }
        }
    }

    /// The PD's UMR queue provider: on mlx5 its one UMR QP, made on first use.
    fn of(pd: &ProtectionDomain) -> Result<UmrBackend> {
        match (pd.backend(), pd.context().backend()) {
            (PdBackend::Soft(_), _) => Ok(UmrBackend::Soft),
            #[cfg(rdmakit_verbs)]
            (PdBackend::Verbs(vpd), crate::device::CtxBackend::Verbs(vctx)) => {
                Ok(UmrBackend::Verbs(vpd.umr_qp(vctx, Self::VERBS_MAX_ENTRIES)?))
            }
            #[cfg(rdmakit_verbs)]
            _ => unreachable!("a PD and its context share a provider"),
        }
    }

    fn create_alias_mkey(
        pd: &ProtectionDomain,
        vhca_id: u32,
        mkey: u32,
        access_key: &[u8; ACCESS_KEY_LEN],
        access: AccessFlags,
    ) -> Result<AliasMkey> {
        let (keys, range) = match pd.backend() {
            PdBackend::Soft(pd_id) => {
                let dev = soft_device(pd.context())?;
                let owner =
                    SoftDevice::by_vhca(vhca_id).filter(|o| o.nic() == dev.nic()).ok_or_else(|| {
                        Error::InvalidArgument(format!("no vHCA {vhca_id} on the NIC of {}", dev.name()))
                    })?;
                let (key, base, len) =
                    dev.mrs.alias_of(*pd_id, &owner.mrs, vhca_id, mkey, access_key, access)?;
                ((MrBackend::Soft { device: dev.clone(), key, drain: None }, key), (base, len))
            }
            #[cfg(rdmakit_verbs)]
            PdBackend::Verbs(vpd) => {
                let alias = vpd.create_alias(vhca_id, mkey, access_key)?;
                let key = alias.key();
                // The host key's range is not visible here; the NIC checks the real bounds.
                ((MrBackend::VerbsAlias(alias), key), (0, UMR_MAX_LEN))
            }
        };
        let region = mkey_region(pd, keys, Kind::Alias, Vec::new(), range, access);
        Ok(AliasMkey { region, vhca_id, mkey })
    }

    /// Opens indirect key `key` to other vHCAs.
    fn allow_other_vhca_access(key: &MemoryRegion, access_key: &[u8; ACCESS_KEY_LEN]) -> Result<()> {
        match &key.inner.backend {
            MrBackend::Soft { device, key: k, .. } => device.mrs.allow_cross_vhca(*k, *access_key),
            #[cfg(rdmakit_verbs)]
            MrBackend::VerbsMkey(mk) => mk.allow_other_vhca_access(access_key),
            #[cfg(rdmakit_verbs)]
            _ => Err(soft_only(key.context())),
        }
    }

    /// The checks and the entry list of a DEVX `CREATE_MKEY` KSM key from `base`: the entries
    /// must be equal power-of-two spans (KSM maps fixed-size entities), each inside its own
    /// region of `pd`. Returns log2 of the span and the (lkey, address) of each entry.
    #[cfg(rdmakit_verbs)]
    fn devx_ksm_entries(
        pd: &ProtectionDomain,
        base: u64,
        len: u64,
        entries: &[KsmEntry],
    ) -> Result<(u8, Vec<(u32, u64)>)> {
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
            if !e.region.pd().same_pd(pd) {
                return Err(Error::InvalidArgument(format!(
                    "KSM entry {i}: region of another protection domain"
                )));
            }
            raw.push((e.region.lkey(), e.region.addr() + e.offset));
        }
        Ok((entity.trailing_zeros() as u8, raw))
    }

    /// Binds indirect key `key` to the checked entries `raw`.
    fn bind(&self, key: &MemoryRegion, raw: &[RawKsm]) -> Result<()> {
        match self {
            UmrBackend::Soft => {
                soft_device(key.context())?.mrs.bind_indirect(key.lkey(), key.len() as u64, raw)
            }
            #[cfg(rdmakit_verbs)]
            UmrBackend::Verbs(umr) => {
                let MrBackend::VerbsMkey(mk) = &key.inner.backend else {
                    return Err(Error::InvalidArgument("not a verbs indirect key".into()));
                };
                umr.lock().unwrap_or_else(|e| e.into_inner()).bind(mk, key.access(), raw)
            }
        }
    }

    /// Invalidates indirect key `key`.
    fn invalidate(&self, key: &MemoryRegion) -> Result<()> {
        match self {
            UmrBackend::Soft => soft_device(key.context())?.mrs.invalidate_indirect(key.lkey()),
            #[cfg(rdmakit_verbs)]
            UmrBackend::Verbs(umr) => match &key.inner.backend {
                MrBackend::VerbsMkey(mk) => umr.lock().unwrap_or_else(|e| e.into_inner()).invalidate(mk),
                MrBackend::VerbsKsm(_) => Err(Error::InvalidArgument(
                    "a KSM key made by CREATE_MKEY maps its entries for life: drop it instead".into(),
                )),
                _ => Err(Error::InvalidArgument("not a verbs indirect key".into())),
            },
        }
    }
}

/// Binds indirect key `key` (of `umr`'s PD, free) to `entries`, checked here before the
/// provider sees them, and records the regions it now maps.
fn bind_entries(umr: &UmrBackend, key: &MemoryRegion, entries: &[KsmEntry]) -> Result<()> {
    let raw = raw_entries(key.pd(), entries)?;
    let mut bound = state(key).bound.lock().unwrap_or_else(|e| e.into_inner());
    if let Err(e) = umr.bind(key, &raw) {
        if matches!(e, Error::Timeout(_)) {
            // The UMR may still execute: until the key is destroyed it may map the new
            // entries as well as the old ones, so it holds both.
            bound.extend(entries.iter().map(|e| e.region.clone()));
        }
        return Err(e);
    }
    let old = std::mem::replace(&mut *bound, entries.iter().map(|e| e.region.clone()).collect());
    drop(bound);
    // Outside the lock: dropping a caller-owned region waits for the NIC's accesses to it.
    drop(old);
    Ok(())
}

/// The range and access every indirect key must have: at least one byte, `base + len`
/// within the address space (a region's bounds arithmetic relies on it), valid flags.
fn check_indirect(base: u64, len: u64, access: AccessFlags) -> Result<()> {
    access.validate()?;
    if len == 0 || base.checked_add(len).is_none() {
        return Err(Error::InvalidArgument(format!("indirect key range {base:#x}+{len} is empty or wraps")));
    }
    Ok(())
}

impl ProtectionDomain {
    /// Creates a free indirect mkey covering `len` bytes from `base` (`mlx5dv_create_mkey`
    /// with `MLX5DV_MKEY_INIT_ATTR_FLAGS_INDIRECT`). Bind it with a [`UmrQueue`].
    #[doc(alias = "mlx5dv_create_mkey")]
    pub fn create_indirect_mkey(&self, base: u64, len: u64, access: AccessFlags) -> Result<IndirectMkey> {
        check_indirect(base, len, access)?;
        UmrBackend::create_indirect_mkey(self, base, len, access)
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
        // The same rules as any indirect key, for every provider: no key of no bytes, none
        // whose range wraps the address space, valid access flags.
        check_indirect(base, len, access)?;
        UmrBackend::create_ksm_mkey(self, base, len, entries, access)
    }

    /// Creates a queue for UMR work requests on this PD's keys.
    pub fn create_umr_queue(&self) -> Result<UmrQueue> {
        Ok(UmrQueue { pd: self.clone(), backend: UmrBackend::of(self)? })
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
        UmrBackend::create_alias_mkey(self, vhca_id, mkey, access_key, access)
    }
}

impl Context {
    /// This function's vHCA id (GVMI): what other functions name it by.
    pub fn vhca_id(&self) -> Result<u32> {
        self.backend().vhca_id()
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

    /// Keeps `owner` alive for as long as the key exists: it is dropped after the key is
    /// destroyed, when the last clone of [`region`](Self::region) goes (and never, if the
    /// provider refused to destroy the key). For what the key's addresses depend on, such as
    /// the address range a KSM key's base was reserved in: while a clone of the region
    /// lets peers use the key, that range stays reserved.
    pub fn keep_alive(&self, owner: impl std::any::Any + Send) {
        state(&self.region).kept.lock().unwrap_or_else(|e| e.into_inner()).push(Box::new(owner));
    }

    /// Opens the key to other vHCAs of the NIC, which may alias it presenting `access_key`
    /// (`MLX5_CMD_OP_ALLOW_OTHER_VHCA_ACCESS` on mlx5). Stays open across re-binds.
    pub fn allow_other_vhca_access(&self, access_key: &[u8; ACCESS_KEY_LEN]) -> Result<()> {
        UmrBackend::allow_other_vhca_access(&self.region, access_key)
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
        bind_entries(&self.backend, &key.region, entries)
    }

    /// Invalidates `key` (`IBV_WR_LOCAL_INV`) and waits: later uses of it, and of aliases
    /// of it, fail with a protection error; operations already executing finish.
    #[doc(alias = "IBV_WR_LOCAL_INV")]
    pub fn invalidate(&self, key: &IndirectMkey) -> Result<()> {
        self.check_key(key)?;
        let mut bound = state(&key.region).bound.lock().unwrap_or_else(|e| e.into_inner());
        self.backend.invalidate(&key.region)?;
        let old = std::mem::take(&mut *bound);
        drop(bound);
        // Outside the lock: dropping a caller-owned region waits for the NIC's accesses to it.
        drop(old);
        Ok(())
    }

    fn check_key(&self, key: &IndirectMkey) -> Result<()> {
        if !key.region.pd().same_pd(&self.pd) {
            return Err(Error::InvalidArgument("UMR on a key of another protection domain".into()));
        }
        debug_assert_eq!(state(&key.region).kind, Kind::Indirect);
        Ok(())
    }
}
