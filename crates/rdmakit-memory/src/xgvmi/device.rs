//! The pool's and the cache's device operations over `rdmakit_verbs::mlx5`.

use rdmakit_verbs::mlx5::{AliasMkey, IndirectMkey, KsmEntry, UMR_MAX_LEN, UmrQueue};
use rdmakit_verbs::{AccessFlags, MemoryRegion, ProtectionDomain, RemoteRegion, Result};

use super::{AliasOps, HostKeyOps, PackedKey};

/// The host function: pool keys are zero-based indirect mkeys of [`UMR_MAX_LEN`] bytes on
/// `pd`, bound and invalidated through a dedicated [`UmrQueue`].
#[derive(Debug)]
pub struct HostFunction {
    pd: ProtectionDomain,
    umr: UmrQueue,
    vhca_id: u32,
    access: AccessFlags,
}

impl HostFunction {
    /// The host side on `pd`: exported keys grant `access` (remote read and write, say).
    pub fn new(pd: &ProtectionDomain, access: AccessFlags) -> Result<HostFunction> {
        Ok(HostFunction {
            pd: pd.clone(),
            umr: pd.create_umr_queue()?,
            vhca_id: pd.context().vhca_id()?,
            access,
        })
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }
}

impl HostKeyOps for HostFunction {
    type Key = IndirectMkey;
    type Region = MemoryRegion;

    fn vhca_id(&self) -> u32 {
        self.vhca_id
    }

    fn umr_max_len(&self) -> u64 {
        UMR_MAX_LEN
    }

    fn region_len(region: &MemoryRegion) -> u64 {
        region.len() as u64
    }

    fn mkey(key: &IndirectMkey) -> u32 {
        key.key()
    }

    fn create_pool_key(&self, access_key: &[u8; 32]) -> Result<IndirectMkey> {
        let key = self.pd.create_indirect_mkey(0, UMR_MAX_LEN, self.access)?;
        key.allow_other_vhca_access(access_key)?;
        Ok(key)
    }

    fn bind(&self, key: &IndirectMkey, region: &MemoryRegion) -> Result<()> {
        self.umr.bind(key, &[KsmEntry::whole(region)])
    }

    fn invalidate(&self, key: &IndirectMkey) -> Result<()> {
        self.umr.invalidate(key)
    }

    fn create_plain_key(&self, region: &MemoryRegion, access_key: &[u8; 32]) -> Result<IndirectMkey> {
        let key = self.pd.create_ksm_mkey(0, &[KsmEntry::whole(region)], self.access)?;
        key.allow_other_vhca_access(access_key)?;
        Ok(key)
    }
}

/// The DPU function: aliases in `pd`, usable as lkeys (and rkeys if `access` says so).
#[derive(Clone, Debug)]
pub struct DpuFunction {
    pd: ProtectionDomain,
    access: AccessFlags,
}

impl DpuFunction {
    /// The DPU side on `pd`.
    pub fn new(pd: &ProtectionDomain, access: AccessFlags) -> DpuFunction {
        DpuFunction { pd: pd.clone(), access }
    }
}

impl super::ImportedAlias<AliasMkey> {
    /// The descriptor a remote peer reads or writes the host's buffer with, through this
    /// alias: the alias's rkey, the export's address and length (the seed's "DPU packs an
    /// rkey" step). The DPU function must have been made with the remote access it hands
    /// out; once the host releases the export, using it is a `REM_ACCESS_ERR` at the peer.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion { addr: self.key.addr, len: self.key.len, rkey: self.alias.region().rkey() }
    }
}

impl AliasOps for DpuFunction {
    type Alias = AliasMkey;

    fn create_alias(&self, key: &PackedKey) -> Result<AliasMkey> {
        self.pd.create_alias_mkey(key.vhca_id, key.mkey, &key.access_key, self.access)
    }
}
