//! MEMIC: regions of the NIC's on-chip memory, addressed like any other memory.
//!
//! ConnectX NICs have a little memory of their own (128–256 KiB, `max_dm_size`). Atomics
//! on it complete without a PCIe round trip to host memory, which is why UCX places
//! fetch-and-add targets there (Roie Danino, "Use in-chip memory for RDMA operations", UCF 2023). Device
//! memory is registered zero-based, so every allocation starts at address 0; to give a
//! region a unique non-zero address that remote peers use like any other, rdmakit does as
//! UCX does:
//!
//! 1. round the length up to a power of two of at least max(atomic alignment, 64 B), and
//!    refuse more than `max_dm_size`;
//! 2. allocate the device memory (`ibv_alloc_dm`);
//! 3. reserve an equal virtual range with `mmap(PROT_NONE)`, so no host mapping can ever
//!    take those addresses;
//! 4. register the device memory zero-based;
//! 5. map the reserved address onto offset 0 of that registration through an indirect
//!    key (a KSM mkey).
//!
//! The region's [`remote`](MemicRegion::remote) descriptor carries the reserved address and
//! the indirect key. The CPU reaches the bytes only through copy calls.
//!
//! [`Placement::NicRequired`] fails without device memory; [`Placement::NicPreferred`] falls
//! back to host memory, as OpenSHMEM's `SHMEM_HINT_DEVICE_NIC_MEM` does, and the region
//! reports where it [lives](MemicRegion::location). [`Memic::open`] probes the device once
//! (a tiny allocation plus key creation), so a device that advertises device memory but
//! cannot map it falls back cleanly at allocation instead of failing later.
//! [`CounterPool`] sub-allocates many 8-byte atomic counters from one region.
//!
//! On the soft NIC all of this runs (device memory, zero-based registration and the KSM
//! key are emulated). On mlx5 the key at the reserved address is a KSM mkey made with DEVX
//! `CREATE_MKEY` (start address = the reservation, one entity = the whole zero-based DM
//! registration); where the device refuses DEVX, the documented fallback is a zero-based
//! indirect key bound by UMR, whose descriptor has address 0 (and its own rkey), and
//! [`MemicRegion::mapping`] says which one a region got. Untested on hardware; rxe has no
//! device memory at all, so there the probe fails and `NicPreferred` regions live in host
//! memory.
//!
//! # Example
//! ```
//! use rdmakit_memory::memic::{Location, Memic, Placement};
//! let pd = rdmakit_verbs::Context::open_soft().alloc_pd()?;
//! let memic = Memic::open(&pd);
//! let region = memic.alloc(100, Placement::NicRequired)?;
//! assert_eq!((region.location(), region.len()), (Location::Nic, 128));
//! assert_ne!(region.remote().addr, 0); // a unique address, not the DM's zero base
//! region.write_u64(0, 41)?;
//! assert_eq!(region.read_u64(0)?, 41);
//! # Ok::<(), rdmakit_verbs::Error>(())
//! ```

mod counters;
// The address reservation is mmap(PROT_NONE)/munmap: FFI by nature.
#[allow(unsafe_code)]
mod reserve;

pub use counters::{Counter, CounterPool};

use rdmakit_verbs::mlx5::{IndirectMkey, KsmEntry};
use rdmakit_verbs::{
    AccessFlags, DeviceMemory, Error, LocalSlice, MemoryRegion, ProtectionDomain, RemoteRegion, Result,
};

use reserve::Reservation;

/// Smallest MEMIC allocation: UCX's minimum (and a multiple of the 8-byte atomic size).
pub const MIN_ALLOC: u64 = 64;

/// Where a region must or may live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// On the NIC, or an error.
    NicRequired,
    /// On the NIC if it can, else in host memory.
    NicPreferred,
}

/// Where a region lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// NIC on-chip memory, through an indirect key at a reserved address.
    Nic,
    /// Registered host memory (the `NicPreferred` fallback).
    Host,
}

/// MEMIC allocation on one protection domain, with the result of the device probe.
#[derive(Clone, Debug)]
pub struct Memic {
    pd: ProtectionDomain,
    /// `None` if the device can place regions on the NIC, else why not.
    unavailable: Option<String>,
}

impl Memic {
    /// Probes the PD's device: a tiny device-memory allocation, its zero-based registration
    /// and an indirect key at a reserved address. The outcome decides every later
    /// allocation's placement.
    pub fn open(pd: &ProtectionDomain) -> Memic {
        let unavailable = match NicRegion::create(pd, MIN_ALLOC) {
            Ok(_) => None,
            Err(e) => {
                tracing::debug!(device = pd.context().name(), reason = %e, "MEMIC unavailable; host fallback only");
                Some(e.to_string())
            }
        };
        Memic { pd: pd.clone(), unavailable }
    }

    /// Why regions cannot be placed on the NIC, or `None` if they can.
    pub fn unavailable_reason(&self) -> Option<&str> {
        self.unavailable.as_deref()
    }

    /// The length an allocation of `len` bytes takes: a power of two of at least 64 bytes.
    pub fn rounded_len(len: u64) -> Option<u64> {
        len.max(MIN_ALLOC).checked_next_power_of_two()
    }

    /// Allocates a region of at least `len` bytes (rounded as [`rounded_len`](Self::rounded_len)
    /// says), zeroed, with remote read, write and atomic access.
    pub fn alloc(&self, len: u64, placement: Placement) -> Result<MemicRegion> {
        if len == 0 {
            return Err(Error::InvalidArgument("a MEMIC region needs at least one byte".into()));
        }
        let size = Self::rounded_len(len)
            .ok_or_else(|| Error::InvalidArgument(format!("a {len}-byte MEMIC region is too large")))?;
        let nic = match &self.unavailable {
            None => NicRegion::create(&self.pd, size),
            Some(reason) => Err(Error::Unsupported(format!(
                "{}: no MEMIC on this device ({reason})",
                self.pd.context().name()
            ))),
        };
        let backing = match (nic, placement) {
            (Ok(n), _) => Backing::Nic(n),
            (Err(e), Placement::NicRequired) => return Err(e),
            (Err(e), Placement::NicPreferred) => {
                tracing::debug!(reason = %e, "MEMIC: host fallback");
                let len =
                    usize::try_from(size).map_err(|_| Error::InvalidArgument("region too large".into()))?;
                Backing::Host(self.pd.alloc_mr(len, AccessFlags::ALL_REMOTE)?)
            }
        };
        let region = MemicRegion { backing, len: size };
        region.zero()?;
        Ok(region)
    }
}

/// A region on the NIC. Fields drop in order: the key, then the registration and the
/// device memory. The address reservation the key points into is the key's own
/// ([`IndirectMkey::keep_alive`]): a clone of the key's region, which lets peers use the
/// key, keeps the range reserved too, so no other region can take the address meanwhile.
#[derive(Debug)]
struct NicRegion {
    key: IndirectMkey,
    mapping: Mapping,
    dm_mr: MemoryRegion,
    dm: DeviceMemory,
    /// The reserved range's start.
    reserved: u64,
}

impl NicRegion {
    fn create(pd: &ProtectionDomain, size: u64) -> Result<NicRegion> {
        let max = pd.context().attr().max_dm_size;
        if max == 0 {
            return Err(Error::Unsupported(format!("{} has no device memory", pd.context().name())));
        }
        if size > max {
            return Err(Error::DeviceMemoryExhausted { requested: size, available: max, capacity: max });
        }
        let dm = pd.context().alloc_dm(size)?;
        let reservation = Reservation::new(size)?;
        let dm_mr = pd.register_dm(&dm, 0, size, AccessFlags::ALL_REMOTE)?;
        let entries = [KsmEntry::whole(&dm_mr)];
        let (key, mapping) = match pd.create_ksm_mkey(reservation.addr(), &entries, AccessFlags::ALL_REMOTE) {
            Ok(key) => (key, Mapping::ReservedAddress),
            // mlx5 without DEVX: a UMR-bound key, zero-based (address 0), still a key of its own.
            Err(Error::Unsupported(why)) => {
                tracing::debug!(%why, "MEMIC: no KSM key at the reserved address; zero-based UMR key");
                (pd.create_ksm_mkey(0, &entries, AccessFlags::ALL_REMOTE)?, Mapping::ZeroBased)
            }
            Err(e) => return Err(e),
        };
        let reserved = reservation.addr();
        key.keep_alive(reservation);
        Ok(NicRegion { key, mapping, dm_mr, dm, reserved })
    }
}

#[derive(Debug)]
enum Backing {
    Nic(NicRegion),
    Host(MemoryRegion),
}

/// How a region's bytes appear to peers (see [`MemicRegion::mapping`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapping {
    /// NIC memory at the reserved, unique, non-zero address, through a KSM key (the seed's
    /// design: the soft NIC, and mlx5 with DEVX).
    ReservedAddress,
    /// NIC memory at address 0 of a key of its own (mlx5 without DEVX: a zero-based indirect
    /// key bound by UMR).
    ZeroBased,
    /// Host memory (the `NicPreferred` fallback): an ordinary registered region.
    Host,
}

/// A MEMIC region: NIC memory at a unique address, or host memory for a fallback.
///
/// Remote peers use [`remote`](Self::remote) like any region's descriptor; local work
/// requests use [`region`](Self::region). The CPU copies with the `read_*`/`write_*` calls.
#[derive(Debug)]
pub struct MemicRegion {
    backing: Backing,
    len: u64,
}

impl MemicRegion {
    /// Where the region lives.
    pub fn location(&self) -> Location {
        match self.backing {
            Backing::Nic(_) => Location::Nic,
            Backing::Host(_) => Location::Host,
        }
    }

    /// How peers address the region: at its reserved address, zero-based, or in host memory.
    pub fn mapping(&self) -> Mapping {
        match &self.backing {
            Backing::Nic(n) => n.mapping,
            Backing::Host(_) => Mapping::Host,
        }
    }

    /// Length in bytes (the rounded length).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: regions have at least 64 bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region as work requests name it: the indirect key (NIC) or the host region.
    pub fn region(&self) -> &MemoryRegion {
        match &self.backing {
            Backing::Nic(n) => n.key.region(),
            Backing::Host(mr) => mr,
        }
    }

    /// The descriptor peers use: a unique non-zero address and its key.
    pub fn remote(&self) -> RemoteRegion {
        self.region().remote()
    }

    /// A local slice for work requests (e.g. the result buffer of a local atomic).
    pub fn slice(&self, offset: u64, len: u32) -> Result<LocalSlice> {
        self.region().slice(offset, len)
    }

    /// The device memory behind the region, if it is on the NIC.
    pub fn device_memory(&self) -> Option<&DeviceMemory> {
        match &self.backing {
            Backing::Nic(n) => Some(&n.dm),
            Backing::Host(_) => None,
        }
    }

    /// The region's zero-based device-memory registration, if it is on the NIC.
    pub fn device_memory_region(&self) -> Option<&MemoryRegion> {
        match &self.backing {
            Backing::Nic(n) => Some(&n.dm_mr),
            Backing::Host(_) => None,
        }
    }

    /// The reserved virtual address the region appears at: with
    /// [`Mapping::ReservedAddress`] only (a zero-based key is addressed from 0, and host
    /// memory at its own address; see [`remote`](Self::remote) for what peers use).
    pub fn reserved_addr(&self) -> Option<u64> {
        match &self.backing {
            Backing::Nic(n) if n.mapping == Mapping::ReservedAddress => Some(n.reserved),
            _ => None,
        }
    }

    /// Copies `data` into the region at `offset`.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        match &self.backing {
            Backing::Nic(n) => n.dm.copy_to(offset, data).map_err(|e| retag(e, self.len)),
            Backing::Host(mr) => mr.write_at(offset, data),
        }
    }

    /// Copies from the region at `offset` into `out`.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        match &self.backing {
            Backing::Nic(n) => n.dm.copy_from(offset, out).map_err(|e| retag(e, self.len)),
            Backing::Host(mr) => mr.read_at(offset, out),
        }
    }

    /// Reads the native-endian `u64` at `offset` (as atomics leave it).
    pub fn read_u64(&self, offset: u64) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read_at(offset, &mut b)?;
        Ok(u64::from_ne_bytes(b))
    }

    /// Writes a native-endian `u64` at `offset`.
    pub fn write_u64(&self, offset: u64, v: u64) -> Result<()> {
        self.write_at(offset, &v.to_ne_bytes())
    }

    fn zero(&self) -> Result<()> {
        let zeros = [0u8; 4096];
        let mut at = 0;
        while at < self.len {
            let n = (self.len - at).min(zeros.len() as u64);
            self.write_at(at, &zeros[..n as usize])?;
            at += n;
        }
        Ok(())
    }
}

/// Device-memory bounds errors name the region, not the raw allocation.
fn retag(e: Error, size: u64) -> Error {
    match e {
        Error::OutOfBounds { offset, len, .. } => {
            Error::OutOfBounds { what: "MEMIC region", offset, len, size }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests;
