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
//! the verbs provider these calls need an mlx5 device and return [`Error::Unsupported`]
//! elsewhere (rxe has no mlx5dv).
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

/// One KSM entry: `len` bytes of `region` from `offset`.
#[derive(Clone, Debug)]
pub struct KsmEntry {
    /// The region the entry maps to (any key of the same PD, device memory included).
    pub region: MemoryRegion,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes mapped.
    pub len: u64,
}

impl KsmEntry {
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
#[derive(Debug)]
pub struct UmrQueue {
    pd: ProtectionDomain,
}

fn soft_device(ctx: &Context) -> Result<&Arc<SoftDevice>> {
    match &ctx.inner.backend {
        CtxBackend::Soft(d) => Ok(d),
        #[cfg(feature = "verbs")]
        CtxBackend::Verbs(_) => Err(Error::Unsupported(format!(
            "{}: mlx5 indirect keys, UMR and cross-vHCA aliases are emulated by the soft NIC only; \
             the verbs provider's mlx5dv/DEVX path is not implemented yet",
            ctx.name()
        ))),
    }
}

fn soft_pd(pd: &ProtectionDomain) -> Result<(&Arc<SoftDevice>, u64)> {
    let dev = soft_device(&pd.inner.ctx)?;
    match &pd.inner.backend {
        PdBackend::Soft(id) => Ok((dev, *id)),
        #[cfg(feature = "verbs")]
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
        let (dev, pd_id) = soft_pd(self)?;
        let key = dev.mrs.register_indirect(pd_id, base, len, access);
        Ok(IndirectMkey { region: mkey_region(self, dev, key, Kind::Indirect, base, len, access) })
    }

    /// Creates an indirect key already mapping `entries` from `base` (a KSM mkey created
    /// through DEVX on mlx5): for ranges UMR cannot bind, and for keys that never change,
    /// such as a MEMIC region's.
    pub fn create_ksm_mkey(
        &self,
        base: u64,
        entries: &[KsmEntry],
        access: AccessFlags,
    ) -> Result<IndirectMkey> {
        let len = entries.iter().try_fold(0u64, |a, e| a.checked_add(e.len));
        let len = len.ok_or_else(|| Error::InvalidArgument("KSM entries overflow".into()))?;
        let key = self.create_indirect_mkey(base, len, access)?;
        bind_soft(&key, entries)?;
        Ok(key)
    }

    /// Creates a queue for UMR work requests on this PD's keys.
    pub fn create_umr_queue(&self) -> Result<UmrQueue> {
        soft_pd(self)?;
        Ok(UmrQueue { pd: self.clone() })
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
        Ok(soft_device(self)?.vhca_id())
    }

    /// Opens another function (vHCA) of the same soft NIC, as a BlueField DPU's Arm-side
    /// function is to the host's: its own vHCA id, keys, PDs and QPs, and aliases onto the
    /// keys this function opens to it. Soft NIC only (on hardware, open the other
    /// function's device by name).
    pub fn open_function(&self) -> Result<Context> {
        let dev = soft_device(self)?;
        Ok(Context::from_soft_device(dev.new_function()))
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
        #[cfg_attr(not(feature = "verbs"), allow(irrefutable_let_patterns))]
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
        bind_soft(key, entries)
    }

    /// Invalidates `key` (`IBV_WR_LOCAL_INV`) and waits: later uses of it, and of aliases
    /// of it, fail with a protection error; operations already executing finish.
    #[doc(alias = "IBV_WR_LOCAL_INV")]
    pub fn invalidate(&self, key: &IndirectMkey) -> Result<()> {
        self.check_key(key)?;
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
