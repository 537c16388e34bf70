//! The soft NIC: a user-space RDMA device written in Rust.
//!
//! It is the provider rdmakit falls back to when no verbs device exists, and the one its
//! tests always run. It enforces what a real HCA enforces — key validity, protection
//! domains, access flags, bounds, atomic alignment, QP states, CQ capacity, RC ordering —
//! and reports violations with the same completion statuses as libibverbs.
//!
//! Structure, one file per NIC object:
//! - `mr`: the device's key table (memory regions, lkey = rkey as on mlx5);
//! - `dm`: device memory (on-chip memory emulation: zero-based, copy access only);
//! - `cq`: completion queues with a capacity and an eventfd for wake-ups;
//! - `qp`: RC queue pairs: the requester executes the send queue in order, the responder
//!   side applies one-sided operations to its own memory without the application's help;
//! - `timer`: the timer thread that drives retries (RNR, transport) as a NIC's timers do;
//! - `shm` and `direct`: processes of one host, through rings in shared memory, and plain
//!   writes and reads placed by the requester into the responder's region mapped by grant.
//!
//! Devices in one process reach each other through the in-process fabric (a registry keyed
//! by GID); devices in other processes or hosts through TCP (`tcp`: each device opens a
//! port, `RDMAKIT_SOFT_ADDR`, when it first hands out an endpoint). The seam between the
//! two is `qp::Link`.
//!
//! # Example: the checks a NIC makes, made in software
//!
//! A write through a valid rkey lands; the same write with a forged rkey, or past the end of
//! the region, completes with the status a hardware responder gives, and the QP then goes to
//! the error state as an RC QP does.
//!
//! ```
//! use std::time::Duration;
//! use rdmakit_verbs::{AccessFlags, ConnectOptions, Context, QpCaps, SendWr, SoftConfig, WcStatus};
//!
//! let ctx = Context::open_soft_with(SoftConfig::default())?;
//! let pd = ctx.alloc_pd()?;
//! let (ca, cb) = (ctx.create_cq(8)?, ctx.create_cq(8)?);
//! let (a, b) = (pd.create_qp(&ca, &ca, QpCaps::default())?, pd.create_qp(&cb, &cb, QpCaps::default())?);
//! a.connect(&b.address()?, &ConnectOptions::default())?;
//! b.connect(&a.address()?, &ConnectOptions::default())?;
//! let (src, dst) = (pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?, pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?);
//! src.write_at(0, b"hello")?;
//!
//! a.post_send(SendWr::write(src.slice(0, 5)?, dst.remote().slice(0, 5)?))?;
//! ca.wait(Some(Duration::from_secs(5)))?.ok()?;
//! let mut got = [0u8; 5];
//! dst.read_at(0, &mut got)?;
//! assert_eq!(&got, b"hello");
//!
//! let mut forged = dst.remote();
//! forged.rkey ^= 1;
//! a.post_send(SendWr::write(src.slice(0, 5)?, forged.slice(0, 5)?))?;
//! let wc = ca.wait(Some(Duration::from_secs(5)))?;
//! assert_eq!(wc.status, WcStatus::REM_ACCESS_ERR);
//! # Ok::<(), rdmakit_verbs::Error>(())
//! ```

pub(crate) mod bootstrap;
pub(crate) mod cq;
/// Direct placement between processes of one host. Public for its counter; not a stable
/// API.
#[doc(hidden)]
pub mod direct;
pub(crate) mod dm;
pub(crate) mod flags;
pub(crate) mod mr;
pub(crate) mod qp;
/// The soft NIC's same-host rings. Public for the hostile-peer tests; not a stable API.
#[doc(hidden)]
pub mod shm;
mod tcp;
mod timer;
/// The soft NIC's TCP wire format. Public for fuzzing (`fuzz/`); not a stable API.
#[doc(hidden)]
#[allow(missing_docs)]
pub mod wire;

pub use shm::SHM_ENV;
#[doc(hidden)]
pub use tcp::ANSWER_DELAY_ENV;
#[doc(hidden)]
pub use tcp::RateLimit;
pub use tcp::SOFT_ADDR_ENV;
/// The production frame reader over a byte string, for the fuzz target (`fuzz/`); not a
/// stable API.
#[doc(hidden)]
pub use tcp::fuzz_read_frames;

/// Soft NIC timers queued and not fired yet, process-wide (for tests that bound them); not
/// a stable API.
#[doc(hidden)]
pub fn pending_timers() -> usize {
    timer::pending()
}

use std::collections::HashMap;
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock, RwLock, Weak};

use crate::error::{Error, Result};
use crate::types::{DeviceAttr, ProviderKind};

/// PCI-style vendor id the soft NIC reports: "SOFT".
pub const SOFT_VENDOR_ID: u32 = 0x534f_4654;

/// The largest `SoftConfig::max_qp_wr` a soft device takes (real HCAs: 32K).
pub const MAX_QP_WR: u32 = 1 << 20;

/// Settings of a soft NIC device.
///
/// Start from [`Default`] and change what you need with the `with_*` setters (the struct is
/// `#[non_exhaustive]`, so fields can be added without breaking you).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SoftConfig {
    /// Device memory capacity in bytes (`max_dm_size`), at most 1 GiB. ConnectX-6 has
    /// 256 KiB.
    pub dm_capacity: u64,
    /// Most outstanding work requests per queue (at most [`MAX_QP_WR`]).
    pub max_qp_wr: u32,
    /// Most entries per completion queue.
    pub max_cqe: u32,
    /// Largest inline payload.
    pub max_inline_data: u32,
    /// Whether peers in other processes of this host are reached through shared memory
    /// (and this device offers it to them) rather than over TCP; the process-wide
    /// `RDMAKIT_SOFT_SHM=0` turns it off for every device.
    pub same_host_shm: bool,
    /// Bytes of each of the two rings (requests, responses) of a same-host connection this
    /// device's QPs open: a power of two from 64 KiB to 8 MiB, default 2 MiB. A connection
    /// maps both, shared by the two processes (`2 × ring + 4 KiB`, resident as used); a
    /// larger ring lets larger writes stream without waiting for the peer.
    pub same_host_ring: usize,
}

impl Default for SoftConfig {
    fn default() -> Self {
        SoftConfig {
            dm_capacity: 256 * 1024,
            max_qp_wr: 16 * 1024,
            max_cqe: 4 * 1024 * 1024,
            max_inline_data: qp::MAX_INLINE as u32,
            same_host_shm: true,
            same_host_ring: shm::DEFAULT_RING,
        }
    }
}

impl SoftConfig {
    /// Sets [`dm_capacity`](Self::dm_capacity).
    pub const fn with_dm_capacity(mut self, dm_capacity: u64) -> Self {
        self.dm_capacity = dm_capacity;
        self
    }

    /// Sets [`max_qp_wr`](Self::max_qp_wr).
    pub const fn with_max_qp_wr(mut self, max_qp_wr: u32) -> Self {
        self.max_qp_wr = max_qp_wr;
        self
    }

    /// Sets [`same_host_shm`](Self::same_host_shm).
    pub const fn with_same_host_shm(mut self, on: bool) -> Self {
        self.same_host_shm = on;
        self
    }

    /// Sets [`same_host_ring`](Self::same_host_ring).
    pub const fn with_same_host_ring(mut self, bytes: usize) -> Self {
        self.same_host_ring = bytes;
        self
    }

    /// Sets [`max_cqe`](Self::max_cqe).
    pub const fn with_max_cqe(mut self, max_cqe: u32) -> Self {
        self.max_cqe = max_cqe;
        self
    }

    /// Sets [`max_inline_data`](Self::max_inline_data).
    pub const fn with_max_inline_data(mut self, max_inline_data: u32) -> Self {
        self.max_inline_data = max_inline_data;
        self
    }
}

/// One soft NIC device. Shared by every context opened on it.
pub(crate) struct SoftDevice {
    name: String,
    gid: [u8; 16],
    config: SoftConfig,
    pub(crate) mrs: Arc<mr::KeyTable>,
    qps: Mutex<HashMap<u32, Weak<qp::SoftQp>>>,
    /// Where the device listens for other processes (its IPv4 address is in the GID).
    addr: SocketAddrV4,
    /// The TCP port, once listening (0 if listening failed).
    port: OnceLock<u16>,
    next_qpn: AtomicU32,
    next_pd: AtomicU64,
    pub(crate) dm: dm::DmPool,
    /// This function's vHCA id (GVMI), unique in the process.
    vhca_id: u32,
    /// The physical NIC this function belongs to (the vHCA id of its first function):
    /// aliases reach only keys of functions of the same NIC.
    nic: u32,
}

/// Every live soft function by vHCA id, for aliases of other functions' keys.
static VHCAS: LazyLock<RwLock<HashMap<u32, Weak<SoftDevice>>>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));

/// The in-process fabric: every live soft device by GID.
static FABRIC: LazyLock<RwLock<HashMap<[u8; 16], Weak<SoftDevice>>>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));
static DEVICE_SEQ: AtomicU32 = AtomicU32::new(1);
static DEFAULT_DEVICE: OnceLock<Arc<SoftDevice>> = OnceLock::new();

/// `N` bytes from the operating system's random source (`getrandom`): rkeys, initial PSNs
/// and connection tokens, which peers must not be able to predict.
pub(crate) fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    // The OS source does not fail on supported systems once seeded; a failure here is an
    // environment fault no safe fallback exists for (predictable keys would be unsound).
    getrandom::fill(&mut b).expect("the operating system's random source failed");
    b
}

/// Name of the process-wide default soft device.
pub const DEFAULT_NAME: &str = "soft0";

impl SoftDevice {
    /// The process-wide `soft0` device (default configuration).
    pub(crate) fn default_device() -> Arc<SoftDevice> {
        DEFAULT_DEVICE
            .get_or_init(|| {
                SoftDevice::create(0, SoftConfig::default(), None)
                    .expect("the default soft configuration is valid")
            })
            .clone()
    }

    /// A new, independent device (`softN`) on the in-process fabric.
    pub(crate) fn new_device(config: SoftConfig) -> Result<Arc<SoftDevice>> {
        if config.max_qp_wr == 0 || config.max_cqe == 0 {
            return Err(Error::InvalidArgument("soft NIC queue limits must be non-zero".into()));
        }
        // Queues preallocate per work request: a limit beyond this would let one QP ask for
        // more memory than any machine has (an allocation failure aborts).
        if config.max_qp_wr > MAX_QP_WR {
            return Err(Error::InvalidArgument(format!(
                "max_qp_wr {} exceeds the soft NIC's {MAX_QP_WR}",
                config.max_qp_wr
            )));
        }
        if config.max_inline_data as usize > qp::MAX_INLINE {
            return Err(Error::InvalidArgument(format!(
                "max_inline_data {} exceeds the soft NIC's {}",
                config.max_inline_data,
                qp::MAX_INLINE
            )));
        }
        let ring = config.same_host_ring;
        if !ring.is_power_of_two() || !(shm::MIN_RING..=shm::MAX_RING).contains(&ring) {
            return Err(Error::InvalidArgument(format!(
                "same_host_ring {ring} is not a power of two from {} to {} bytes",
                shm::MIN_RING,
                shm::MAX_RING
            )));
        }
        SoftDevice::create(DEVICE_SEQ.fetch_add(1, Ordering::Relaxed), config, None)
    }

    /// Another function (vHCA) of the same NIC as `self`, as a DPU's Arm-side function is
    /// to the host's: its own keys, PDs and QPs, and aliases onto keys `self` opens to it.
    pub(crate) fn new_function(&self) -> Result<Arc<SoftDevice>> {
        SoftDevice::create(DEVICE_SEQ.fetch_add(1, Ordering::Relaxed), self.config.clone(), Some(self.nic))
    }

    /// The live function with vHCA id `vhca`.
    pub(crate) fn by_vhca(vhca: u32) -> Option<Arc<SoftDevice>> {
        VHCAS.read().expect("vhca registry").get(&vhca).and_then(Weak::upgrade)
    }

    pub(crate) fn vhca_id(&self) -> u32 {
        self.vhca_id
    }

    pub(crate) fn nic(&self) -> u32 {
        self.nic
    }

    /// Device `index` is named `soft<index>`; index 0 is the default device.
    fn create(index: u32, config: SoftConfig, nic: Option<u32>) -> Result<Arc<SoftDevice>> {
        let name = format!("soft{index}");
        // GID: fe80:<16 random bits>:<IPv4 of the port>:<pid>:<device index>. Unique per
        // host, process and device; peers in other processes reach the device at that IPv4
        // address. The random bits make a device's GID, which a requester's Hello must name,
        // unguessable from its address and pid.
        let addr = tcp::configured_addr();
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[2..4].copy_from_slice(&random::<2>());
        gid[4..8].copy_from_slice(&addr.ip().octets());
        gid[8..12].copy_from_slice(&std::process::id().to_be_bytes());
        gid[12..16].copy_from_slice(&index.to_be_bytes());
        let dev = Arc::new(SoftDevice {
            name,
            gid,
            dm: dm::DmPool::new(config.dm_capacity)?,
            config,
            mrs: Arc::new(mr::KeyTable::new()),
            qps: Mutex::new(HashMap::new()),
            addr,
            port: OnceLock::new(),
            // QP numbers are 24-bit; start away from 0 like real devices.
            next_qpn: AtomicU32::new(0x11),
            next_pd: AtomicU64::new(1),
            vhca_id: index,
            nic: nic.unwrap_or(index),
        });
        FABRIC.write().expect("fabric lock").insert(gid, Arc::downgrade(&dev));
        VHCAS.write().expect("vhca registry").insert(index, Arc::downgrade(&dev));
        Ok(dev)
    }

    /// Finds a live device by GID on the in-process fabric.
    pub(crate) fn by_gid(gid: &[u8; 16]) -> Option<Arc<SoftDevice>> {
        FABRIC.read().expect("fabric lock").get(gid).and_then(Weak::upgrade)
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn gid(&self) -> [u8; 16] {
        self.gid
    }

    pub(crate) fn config(&self) -> &SoftConfig {
        &self.config
    }

    pub(crate) fn attr(&self) -> DeviceAttr {
        DeviceAttr {
            name: self.name.clone(),
            provider: ProviderKind::Soft,
            fw_ver: concat!("rdmakit-soft ", env!("CARGO_PKG_VERSION")).to_owned(),
            vendor_id: SOFT_VENDOR_ID,
            max_mr_size: u64::from(u32::MAX),
            max_qp_wr: self.config.max_qp_wr,
            max_cqe: self.config.max_cqe,
            max_sge: 1,
            max_qp_rd_atom: 16,
            max_qp_init_rd_atom: 16,
            atomic_cap: 1,
            max_dm_size: self.config.dm_capacity,
            phys_port_cnt: 1,
        }
    }

    /// The device's TCP port, opening it on first use; 0 if it cannot listen (then only
    /// QPs in this process can reach it).
    pub(crate) fn port(self: &Arc<Self>) -> u16 {
        // Miri has no sockets; in-process peers do not need the port.
        if cfg!(miri) {
            return 0;
        }
        *self.port.get_or_init(|| match tcp::listen(self, self.addr) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(addr = %self.addr, error = %e, "soft NIC: cannot listen; in-process peers only");
                0
            }
        })
    }

    pub(crate) fn alloc_pd(&self) -> u64 {
        self.next_pd.fetch_add(1, Ordering::Relaxed)
    }

    /// Sets the next QP number (tests: a number recycled, as providers do).
    #[cfg(test)]
    pub(crate) fn set_next_qpn(&self, n: u32) {
        self.next_qpn.store(n, Ordering::Relaxed);
    }

    fn alloc_qpn(&self) -> u32 {
        loop {
            let n = self.next_qpn.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
            if n > 1 {
                return n;
            }
        }
    }

    fn register_qp(&self, qp: &Arc<qp::SoftQp>) {
        self.qps.lock().expect("qp table").insert(qp.qpn(), Arc::downgrade(qp));
    }

    fn unregister_qp(&self, qpn: u32) {
        self.qps.lock().expect("qp table").remove(&qpn);
    }

    pub(crate) fn find_qp(&self, qpn: u32) -> Option<Arc<qp::SoftQp>> {
        self.qps.lock().expect("qp table").get(&qpn).and_then(Weak::upgrade)
    }
}

/// Memory the caller owns is being deregistered (its key is gone), and its key's `entry` may
/// still be held by accesses in progress: those that could hold it for as long as a peer
/// likes let go of it. Reads and atomics outstanding with their answer due there, on any
/// function's QP (an alias reaches the region from another function), will complete with
/// `LOC_PROT_ERR` (the QPs are visited only while some read or atomic is outstanding over
/// the wire); payloads queued for a peer are copied out of it.
pub(crate) fn revoke(entry: &Arc<mr::MrEntry>) {
    if qp::targets_outstanding() {
        let devices: Vec<Arc<SoftDevice>> =
            VHCAS.read().expect("vhca registry").values().filter_map(Weak::upgrade).collect();
        for d in devices {
            let qps: Vec<Arc<qp::SoftQp>> =
                d.qps.lock().expect("qp table").values().filter_map(Weak::upgrade).collect();
            for qp in qps {
                qp.revoke_targets(entry);
            }
        }
    }
    tcp::copy_out_tails(Arc::downgrade(entry));
}

impl Drop for SoftDevice {
    fn drop(&mut self) {
        if let Ok(mut f) = FABRIC.write() {
            f.remove(&self.gid);
        }
        if let Ok(mut v) = VHCAS.write() {
            v.remove(&self.vhca_id);
        }
    }
}
