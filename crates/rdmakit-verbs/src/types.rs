//! Plain data shared by both providers: access flags, device attributes, descriptors that
//! peers exchange out of band.

use std::fmt;

use crate::error::{Error, Result};

bitflags::bitflags! {
    /// Memory region and QP access rights, `enum ibv_access_flags`.
    ///
    /// Verbs rule, enforced by both providers: `REMOTE_WRITE` and `REMOTE_ATOMIC` require
    /// `LOCAL_WRITE`.
    #[doc(alias = "ibv_access_flags")]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct AccessFlags: u32 {
        /// The local NIC may write the region (needed for RDMA read and atomic results,
        /// and for receives).
        #[doc(alias = "IBV_ACCESS_LOCAL_WRITE")]
        const LOCAL_WRITE = 1;
        /// Peers may RDMA-write the region.
        #[doc(alias = "IBV_ACCESS_REMOTE_WRITE")]
        const REMOTE_WRITE = 2;
        /// Peers may RDMA-read the region.
        #[doc(alias = "IBV_ACCESS_REMOTE_READ")]
        const REMOTE_READ = 4;
        /// Peers may run atomics on the region.
        #[doc(alias = "IBV_ACCESS_REMOTE_ATOMIC")]
        const REMOTE_ATOMIC = 8;
        /// Remote addresses start at 0 instead of the virtual address (device memory).
        #[doc(alias = "IBV_ACCESS_ZERO_BASED")]
        const ZERO_BASED = 32;
        /// Relaxed PCIe ordering may be used.
        #[doc(alias = "IBV_ACCESS_RELAXED_ORDERING")]
        const RELAXED_ORDERING = 1 << 20;
    }
}

impl AccessFlags {
    /// Everything a peer may need: local write, remote write, read and atomic.
    pub const ALL_REMOTE: AccessFlags = AccessFlags::LOCAL_WRITE
        .union(AccessFlags::REMOTE_WRITE)
        .union(AccessFlags::REMOTE_READ)
        .union(AccessFlags::REMOTE_ATOMIC);

    /// Checks the verbs rule that remote write/atomic access needs local write.
    pub(crate) fn validate(self) -> Result<()> {
        if self.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
            && !self.contains(AccessFlags::LOCAL_WRITE)
        {
            return Err(Error::InvalidArgument(format!(
                "access {self:?}: REMOTE_WRITE and REMOTE_ATOMIC require LOCAL_WRITE"
            )));
        }
        Ok(())
    }
}

/// The type of a GID table entry: which wire protocol a connection using it speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GidKind {
    /// InfiniBand.
    Ib,
    /// RoCE v1 (Ethernet, layer 2).
    RoceV1,
    /// RoCE v2 (UDP/IP): what perftest, UCX and rdma_cm use by default on RoCE.
    RoceV2,
    /// The soft NIC's own addressing (its TCP wire).
    Soft,
    /// A type this version of rdmakit does not know (`ibv_gid_type` value).
    Other(u32),
}

/// The GID table entry a connection uses (see [`Context::gid`](crate::Context::gid)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GidEntry {
    /// Index in the port's GID table.
    pub index: u8,
    /// The GID.
    pub gid: [u8; 16],
    /// Its type, when the kernel reports it (`ibv_query_gid_ex`).
    pub kind: Option<GidKind>,
}

/// Which implementation is behind a [`Context`](crate::Context).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProviderKind {
    /// rdmakit's software NIC: in-process, no hardware needed.
    Soft,
    /// rdma-core's libibverbs (real HCAs, or Soft-RoCE `rdma_rxe`).
    Verbs,
}

impl ProviderKind {
    /// `"soft"` or `"verbs"`, the spelling `RDMAKIT_PROVIDER` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Soft => "soft",
            ProviderKind::Verbs => "verbs",
        }
    }
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the device can do (`ibv_query_device(_ex)`), the fields rdmakit uses.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceAttr {
    /// Device name, e.g. `mlx5_0`, `rxe0`, `soft0`.
    pub name: String,
    /// Which provider runs it.
    pub provider: ProviderKind,
    /// Firmware version string.
    pub fw_ver: String,
    /// PCI vendor id (`0xffffff` for rxe, `0x534f4654` "SOFT" for the soft NIC).
    pub vendor_id: u32,
    /// Largest memory region.
    pub max_mr_size: u64,
    /// Most outstanding work requests per queue.
    pub max_qp_wr: u32,
    /// Most entries per completion queue.
    pub max_cqe: u32,
    /// Most scatter/gather entries per work request.
    pub max_sge: u32,
    /// Most outstanding RDMA reads/atomics a QP may have as responder.
    pub max_qp_rd_atom: u32,
    /// Most outstanding RDMA reads/atomics a QP may initiate.
    pub max_qp_init_rd_atom: u32,
    /// Atomic support: 0 none, 1 HCA-atomic, 2 global.
    pub atomic_cap: u32,
    /// Device memory available for `ibv_alloc_dm` (0: none).
    pub max_dm_size: u64,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
}

/// Queue pair state, `enum ibv_qp_state`.
#[doc(alias = "ibv_qp_state")]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Just created; nothing can be posted.
    Reset,
    /// Initialised; receives may be posted.
    Init,
    /// Ready to receive.
    ReadyToReceive,
    /// Ready to send: fully connected.
    ReadyToSend,
    /// Send queue drain.
    SendQueueDrain,
    /// Send queue error.
    SendQueueError,
    /// Error: every outstanding and newly posted request completes with `WR_FLUSH_ERR`.
    Error,
    /// A value the provider reported that rdmakit does not know.
    Unknown(u32),
}

/// Path MTU, `enum ibv_mtu`.
#[doc(alias = "ibv_mtu")]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl Mtu {
    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }

    /// From the verbs enum value.
    pub fn from_raw(v: u32) -> Option<Mtu> {
        Some(match v {
            1 => Mtu::Mtu256,
            2 => Mtu::Mtu512,
            3 => Mtu::Mtu1024,
            4 => Mtu::Mtu2048,
            5 => Mtu::Mtu4096,
            _ => return None,
        })
    }
}

/// Sizes of a queue pair's queues, given at creation.
///
/// Start from [`Default`] and change what you need with the `with_*` setters (the struct is
/// `#[non_exhaustive]`, so fields can be added without breaking you).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpCaps {
    /// Outstanding send work requests.
    pub max_send_wr: u32,
    /// Outstanding receive work requests.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send request (rdmakit posts one).
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive request (rdmakit posts one).
    pub max_recv_sge: u32,
    /// Largest inline payload; the provider may raise it.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps { max_send_wr: 128, max_recv_wr: 128, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 }
    }
}

impl QpCaps {
    /// Sets [`max_send_wr`](Self::max_send_wr).
    pub const fn with_max_send_wr(mut self, max_send_wr: u32) -> Self {
        self.max_send_wr = max_send_wr;
        self
    }

    /// Sets [`max_recv_wr`](Self::max_recv_wr).
    pub const fn with_max_recv_wr(mut self, max_recv_wr: u32) -> Self {
        self.max_recv_wr = max_recv_wr;
        self
    }

    /// Sets [`max_send_sge`](Self::max_send_sge).
    pub const fn with_max_send_sge(mut self, max_send_sge: u32) -> Self {
        self.max_send_sge = max_send_sge;
        self
    }

    /// Sets [`max_recv_sge`](Self::max_recv_sge).
    pub const fn with_max_recv_sge(mut self, max_recv_sge: u32) -> Self {
        self.max_recv_sge = max_recv_sge;
        self
    }

    /// Sets [`max_inline_data`](Self::max_inline_data).
    pub const fn with_max_inline_data(mut self, max_inline_data: u32) -> Self {
        self.max_inline_data = max_inline_data;
        self
    }
}

/// How to take a QP from RESET to RTS against a peer (the `ibv_modify_qp` attributes).
///
/// Start from [`Default`] and change what you need with the `with_*` setters (the struct is
/// `#[non_exhaustive]`, so fields can be added without breaking you).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectOptions {
    /// Port number (1-based).
    pub port_num: u8,
    /// GID index for RoCE. `None` picks by type: the first RoCE v2 entry with an IPv4-mapped
    /// address, else the first RoCE v2 entry, else the first IPv4-mapped one, else index 0
    /// (the `RDMAKIT_GID_INDEX` environment variable overrides `None`).
    /// [`Context::gid`](crate::Context::gid) tells which entry that is.
    pub gid_index: Option<u8>,
    /// Path MTU; `None` uses the port's active MTU.
    pub mtu: Option<Mtu>,
    /// Remote access the QP allows peers (`IBV_QP_ACCESS_FLAGS`).
    pub access: AccessFlags,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout (0: infinite).
    pub timeout: u8,
    /// Transport retries before `RETRY_EXC_ERR` (0–7). The default is 6, not the 7 perftest
    /// and UCX use: Soft-RoCE (`rdma_rxe`) treats 7 as "retry forever" (the IB spec reserves
    /// that meaning for `rnr_retry`), so with 7 a dead peer is never reported there, and
    /// nothing built on the connection could notice it. With 6 the budget stays finite on
    /// every provider: 7 tries × 4.096 µs × 2^timeout, about 0.47 s by default.
    pub retry_cnt: u8,
    /// RNR retries before `RNR_RETRY_EXC_ERR` (0–6, 7 means infinite).
    pub rnr_retry: u8,
    /// Minimum RNR NAK timer exponent (verbs encoding, 1–31; 12 is 0.64 ms).
    pub min_rnr_timer: u8,
    /// Outstanding RDMA reads/atomics as initiator; clipped to the device limit.
    pub max_rd_atomic: u8,
    /// Service level, 0–15 (InfiniBand SL; on RoCE the priority it maps to). `None`: 0 on a
    /// hand-built connection, the route's on rdma_cm.
    pub service_level: Option<u8>,
    /// Traffic class of the GRH (the IP DSCP/ECN byte on RoCE v2). `None`: 0, or on rdma_cm
    /// the route's (rdma_cm also sends its own packets with the TOS set here).
    pub traffic_class: Option<u8>,
    /// Flow label of the GRH, 20 bits. `None`: 0 / the route's.
    pub flow_label: Option<u32>,
    /// Hop limit (IP TTL) of the GRH. `None`: 64 / the route's.
    pub hop_limit: Option<u8>,
    /// P_Key table index. `None`: 0 / the CM's.
    pub pkey_index: Option<u16>,
}

impl ConnectOptions {
    /// Checks the ranges the wire formats impose (SL 4 bits, flow label 20 bits), so a bad
    /// value is an error here and not a silently truncated header.
    pub fn validate(&self) -> crate::Result<()> {
        self.access.validate()?;
        if let Some(sl) = self.service_level.filter(|&sl| sl > 15) {
            return Err(crate::Error::InvalidArgument(format!("service_level {sl}: must be 0-15")));
        }
        if let Some(fl) = self.flow_label.filter(|&fl| fl >= 1 << 20) {
            return Err(crate::Error::InvalidArgument(format!("flow_label {fl:#x}: must fit in 20 bits")));
        }
        Ok(())
    }
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            port_num: 1,
            gid_index: None,
            mtu: None,
            access: AccessFlags::ALL_REMOTE,
            timeout: 14,
            retry_cnt: 6,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            service_level: None,
            traffic_class: None,
            flow_label: None,
            hop_limit: None,
            pkey_index: None,
        }
    }
}

impl ConnectOptions {
    /// Sets [`port_num`](Self::port_num).
    pub const fn with_port_num(mut self, port_num: u8) -> Self {
        self.port_num = port_num;
        self
    }

    /// Sets [`gid_index`](Self::gid_index) (a value, `Some(value)` or `None`).
    pub fn with_gid_index(mut self, gid_index: impl Into<Option<u8>>) -> Self {
        self.gid_index = gid_index.into();
        self
    }

    /// Sets [`mtu`](Self::mtu) (a value, `Some(value)` or `None`).
    pub fn with_mtu(mut self, mtu: impl Into<Option<Mtu>>) -> Self {
        self.mtu = mtu.into();
        self
    }

    /// Sets [`access`](Self::access).
    pub const fn with_access(mut self, access: AccessFlags) -> Self {
        self.access = access;
        self
    }

    /// Sets [`timeout`](Self::timeout).
    pub const fn with_timeout(mut self, timeout: u8) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets [`retry_cnt`](Self::retry_cnt).
    pub const fn with_retry_cnt(mut self, retry_cnt: u8) -> Self {
        self.retry_cnt = retry_cnt;
        self
    }

    /// Sets [`rnr_retry`](Self::rnr_retry).
    pub const fn with_rnr_retry(mut self, rnr_retry: u8) -> Self {
        self.rnr_retry = rnr_retry;
        self
    }

    /// Sets [`min_rnr_timer`](Self::min_rnr_timer).
    pub const fn with_min_rnr_timer(mut self, min_rnr_timer: u8) -> Self {
        self.min_rnr_timer = min_rnr_timer;
        self
    }

    /// Sets [`max_rd_atomic`](Self::max_rd_atomic).
    pub const fn with_max_rd_atomic(mut self, max_rd_atomic: u8) -> Self {
        self.max_rd_atomic = max_rd_atomic;
        self
    }

    /// Sets [`service_level`](Self::service_level) (a value, `Some(value)` or `None`).
    pub fn with_service_level(mut self, service_level: impl Into<Option<u8>>) -> Self {
        self.service_level = service_level.into();
        self
    }

    /// Sets [`traffic_class`](Self::traffic_class) (a value, `Some(value)` or `None`).
    pub fn with_traffic_class(mut self, traffic_class: impl Into<Option<u8>>) -> Self {
        self.traffic_class = traffic_class.into();
        self
    }

    /// Sets [`flow_label`](Self::flow_label) (a value, `Some(value)` or `None`).
    pub fn with_flow_label(mut self, flow_label: impl Into<Option<u32>>) -> Self {
        self.flow_label = flow_label.into();
        self
    }

    /// Sets [`hop_limit`](Self::hop_limit) (a value, `Some(value)` or `None`).
    pub fn with_hop_limit(mut self, hop_limit: impl Into<Option<u8>>) -> Self {
        self.hop_limit = hop_limit.into();
        self
    }

    /// Sets [`pkey_index`](Self::pkey_index) (a value, `Some(value)` or `None`).
    pub fn with_pkey_index(mut self, pkey_index: impl Into<Option<u16>>) -> Self {
        self.pkey_index = pkey_index.into();
        self
    }
}

impl ConnectOptions {
    /// The transport timeout budget: (retry_cnt + 1) × 4.096 µs × 2^timeout, or `None`
    /// for an infinite timeout.
    pub fn transport_budget(&self) -> Option<std::time::Duration> {
        if self.timeout == 0 {
            return None;
        }
        let one = 4096u64 << self.timeout.min(31); // nanoseconds
        Some(std::time::Duration::from_nanos(one * (u64::from(self.retry_cnt.min(7)) + 1)))
    }

    /// The RNR budget: (rnr_retry + 1) × the min RNR timer, `None` if infinite (7).
    pub fn rnr_budget(&self) -> Option<std::time::Duration> {
        if self.rnr_retry >= 7 {
            return None;
        }
        // IB spec table of RNR NAK timer values, in microseconds (index 0 = 655.36 ms).
        const RNR_US: [u64; 32] = [
            655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840, 5120,
            7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122880, 163840, 245760, 327680, 491520,
        ];
        let t = RNR_US[usize::from(self.min_rnr_timer.min(31))];
        Some(std::time::Duration::from_micros(t * (u64::from(self.rnr_retry) + 1)))
    }
}

/// What a peer needs to connect an RC QP to this one, exchanged out of band (a socket, a
/// file, rdma_cm private data). Encodes to a fixed, versioned 48-byte record
/// ([`to_bytes`](Self::to_bytes) / [`from_bytes`](Self::from_bytes)).
///
/// On the soft NIC the endpoint also carries the QP's connection token: a requester in
/// another process must present it in its first frame, so only a peer that was given the
/// endpoint (not one that guessed the GID, QPN and PSNs) is served. Treat a soft endpoint
/// as a secret between the two peers, as rdma_cm's private data would be. The verbs
/// provider carries zeros there and ignores the field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct QpAddress {
    /// Which provider the QP lives on; soft and verbs QPs cannot connect to each other.
    pub provider: ProviderKind,
    /// Port LID (InfiniBand); 0 on RoCE and the soft NIC.
    pub lid: u16,
    /// GID (RoCE address; on the soft NIC it names the device).
    pub gid: [u8; 16],
    /// QP number.
    pub qp_num: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// The soft NIC QP's connection token, random per QP (zero on the verbs provider,
    /// which ignores it): what a requester of another process must prove it knows.
    pub token: [u8; 16],
}

const ENDPOINT_MAGIC: [u8; 3] = *b"RKE";

/// Why bytes are not a [`QpAddress`] record ([`QpAddress::from_bytes`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QpAddressDecodeError {
    /// The record has the wrong length for its version.
    #[error("endpoint record of {got} bytes, expected {expected}")]
    Length {
        /// Bytes given.
        got: usize,
        /// Bytes a record of this version has.
        expected: usize,
    },
    /// The record does not start with the endpoint magic.
    #[error("not an endpoint record (bad magic)")]
    Magic,
    /// The unversioned 32-byte record of earlier releases, which carries no connection
    /// token.
    #[error(
        "endpoint record in the unversioned format of earlier releases (no connection token): re-encode it"
    )]
    Legacy,
    /// A record version this release does not read.
    #[error("endpoint record version {0}, this release reads version {v}", v = QpAddress::VERSION)]
    Version(u8),
    /// An unknown provider tag.
    #[error("unknown provider tag {0}")]
    Provider(u8),
    /// A reserved byte is not zero.
    #[error("reserved byte {0:#04x} is not zero")]
    Reserved(u8),
    /// The initial PSN has more than 24 bits.
    #[error("initial PSN {0:#x} has more than 24 bits")]
    Psn(u32),
}

impl QpAddress {
    /// An address built by hand (a QP's own comes from
    /// [`QueuePair::address`](crate::QueuePair::address), a peer's from
    /// [`from_bytes`](Self::from_bytes)), with a zero token: a soft NIC peer refuses it
    /// unless [`with_token`](Self::with_token) sets the one the QP was given.
    pub const fn new(provider: ProviderKind, lid: u16, gid: [u8; 16], qp_num: u32, psn: u32) -> QpAddress {
        QpAddress { provider, lid, gid, qp_num, psn, token: [0; 16] }
    }

    /// Sets [`token`](Self::token).
    pub const fn with_token(mut self, token: [u8; 16]) -> QpAddress {
        self.token = token;
        self
    }

    /// Encoded length ([`to_bytes`](Self::to_bytes)).
    pub const ENCODED_LEN: usize = 48;

    /// The record version [`to_bytes`](Self::to_bytes) writes and
    /// [`from_bytes`](Self::from_bytes) reads. (Version 3: the unversioned 32-byte records
    /// of earlier releases had their provider tag, 1 or 2, in the version byte's place.)
    pub const VERSION: u8 = 3;

    /// Encodes to the versioned record for an out-of-band exchange:
    ///
    /// | bytes  | field                                          |
    /// |--------|------------------------------------------------|
    /// | 0..3   | magic `RKE`                                    |
    /// | 3      | version ([`VERSION`](Self::VERSION))           |
    /// | 4      | provider: 1 soft, 2 verbs                      |
    /// | 5      | reserved, zero                                 |
    /// | 6..8   | LID, little-endian                             |
    /// | 8..24  | GID                                            |
    /// | 24..28 | QP number, little-endian                       |
    /// | 28..32 | initial PSN (24 bits), little-endian           |
    /// | 32..48 | connection token                               |
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[..3].copy_from_slice(&ENDPOINT_MAGIC);
        b[3] = Self::VERSION;
        b[4] = match self.provider {
            ProviderKind::Soft => 1,
            ProviderKind::Verbs => 2,
        };
        b[6..8].copy_from_slice(&self.lid.to_le_bytes());
        b[8..24].copy_from_slice(&self.gid);
        b[24..28].copy_from_slice(&self.qp_num.to_le_bytes());
        b[28..32].copy_from_slice(&(self.psn & 0x00ff_ffff).to_le_bytes());
        b[32..48].copy_from_slice(&self.token);
        b
    }

    /// Decodes a record [`to_bytes`](Self::to_bytes) produced. Total: any other bytes give
    /// a typed error, never a panic.
    pub fn from_bytes(b: &[u8]) -> std::result::Result<QpAddress, QpAddressDecodeError> {
        use QpAddressDecodeError as E;
        if b.len() < 4 {
            return Err(E::Length { got: b.len(), expected: Self::ENCODED_LEN });
        }
        if b[..3] != ENDPOINT_MAGIC {
            return Err(E::Magic);
        }
        match b[3] {
            1 | 2 => return Err(E::Legacy),
            Self::VERSION => {}
            v => return Err(E::Version(v)),
        }
        let b: &[u8; Self::ENCODED_LEN] =
            b.try_into().map_err(|_| E::Length { got: b.len(), expected: Self::ENCODED_LEN })?;
        let provider = match b[4] {
            1 => ProviderKind::Soft,
            2 => ProviderKind::Verbs,
            p => return Err(E::Provider(p)),
        };
        if b[5] != 0 {
            return Err(E::Reserved(b[5]));
        }
        let le32 = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let psn = le32(28);
        if psn > 0x00ff_ffff {
            return Err(E::Psn(psn));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[8..24]);
        let mut token = [0u8; 16];
        token.copy_from_slice(&b[32..48]);
        Ok(QpAddress { provider, lid: u16::from_le_bytes([b[6], b[7]]), gid, qp_num: le32(24), psn, token })
    }

    /// The same as [`to_bytes`](Self::to_bytes).
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        self.to_bytes()
    }

    /// [`from_bytes`](Self::from_bytes) with the crate's error type
    /// ([`Error::Malformed`]).
    pub fn decode(b: &[u8]) -> Result<QpAddress> {
        Self::from_bytes(b).map_err(|e| Error::Malformed { what: "endpoint", reason: e.to_string() })
    }
}

/// A remote memory region as its owner advertises it: address, length and rkey.
///
/// Send it to peers (see [`encode`](Self::encode)); they target it with
/// [`RemoteRegion::slice`]. It is plain data: holding one keeps nothing alive, and using a
/// stale one gives the peer a `REM_ACCESS_ERR`, never local undefined behaviour.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Address the owner's NIC translates (a virtual address, or 0 for zero-based regions).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RemoteRegion {
    /// Encoded length.
    pub const ENCODED_LEN: usize = 20;

    /// `len` bytes at `addr`, accessed with `rkey` (a descriptor a peer advertised, or a
    /// heap segment: see `rdmakit_memory::heap`).
    pub const fn new(addr: u64, len: u64, rkey: u32) -> Self {
        RemoteRegion { addr, len, rkey }
    }

    /// One past the last address, or `None` if `addr + len` overflows.
    pub const fn end(&self) -> Option<u64> {
        self.addr.checked_add(self.len)
    }

    /// The part `offset..offset + len`, checked against this descriptor.
    pub fn slice(&self, offset: u64, len: u32) -> Result<RemoteSlice> {
        // The descriptor comes from a peer: its address may be anything, so the sum is
        // checked too.
        match (offset.checked_add(u64::from(len)), self.addr.checked_add(offset)) {
            (Some(end), Some(addr)) if end <= self.len && addr.checked_add(u64::from(len)).is_some() => {
                Ok(RemoteSlice { addr, len, rkey: self.rkey })
            }
            _ => {
                Err(Error::OutOfBounds { what: "remote region", offset, len: u64::from(len), size: self.len })
            }
        }
    }

    /// Encodes as 20 little-endian bytes: addr, len, rkey.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..20].copy_from_slice(&self.rkey.to_le_bytes());
        b
    }

    /// Decodes what [`encode`](Self::encode) produced.
    pub fn decode(b: &[u8]) -> Result<RemoteRegion> {
        if b.len() != Self::ENCODED_LEN {
            return Err(Error::Malformed {
                what: "remote region",
                reason: format!("{} bytes, expected {}", b.len(), Self::ENCODED_LEN),
            });
        }
        Ok(RemoteRegion {
            addr: u64::from_le_bytes(b[..8].try_into().expect("8")),
            len: u64::from_le_bytes(b[8..16].try_into().expect("8")),
            rkey: u32::from_le_bytes(b[16..20].try_into().expect("4")),
        })
    }
}

/// A remote target of one work request: address, length and rkey.
///
/// Built from a [`RemoteRegion`] (bounds-checked against the descriptor) or raw with
/// [`RemoteSlice::new`]; a wrong address or key is the remote NIC's to reject.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteSlice {
    /// Remote address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Remote key.
    pub rkey: u32,
}

impl RemoteSlice {
    /// A raw remote target. Safe: the remote NIC validates it.
    pub fn new(addr: u64, len: u32, rkey: u32) -> RemoteSlice {
        RemoteSlice { addr, len, rkey }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_round_trip_and_rejects_garbage() {
        let e = QpAddress {
            provider: ProviderKind::Soft,
            lid: 3,
            gid: [7; 16],
            qp_num: 0x11,
            psn: 0x123456,
            token: *b"0123456789abcdef",
        };
        let b = e.to_bytes();
        assert_eq!(QpAddress::from_bytes(&b), Ok(e));
        assert_eq!(QpAddress::decode(&e.encode()).unwrap(), e);
        let v = QpAddress { provider: ProviderKind::Verbs, token: [0; 16], ..e };
        assert_eq!(QpAddress::from_bytes(&v.to_bytes()), Ok(v));
        use QpAddressDecodeError as E;
        assert_eq!(QpAddress::from_bytes(&[]), Err(E::Length { got: 0, expected: 48 }));
        assert_eq!(QpAddress::from_bytes(&b[..47]), Err(E::Length { got: 47, expected: 48 }));
        assert_eq!(
            QpAddress::from_bytes(&[b.as_slice(), &[0]].concat()),
            Err(E::Length { got: 49, expected: 48 })
        );
        assert_eq!(QpAddress::from_bytes(&[0u8; 48]), Err(E::Magic));
        let with = |at: usize, v: u8| {
            let mut c = b;
            c[at] = v;
            QpAddress::from_bytes(&c)
        };
        // The earlier unversioned records had the provider tag where the version is now.
        assert_eq!(with(3, 1), Err(E::Legacy));
        assert_eq!(with(3, 2), Err(E::Legacy));
        assert_eq!(with(3, 4), Err(E::Version(4)));
        assert_eq!(with(4, 9), Err(E::Provider(9)));
        assert_eq!(with(5, 1), Err(E::Reserved(1)));
        assert_eq!(with(31, 1), Err(E::Psn(0x0112_3456)));
        assert!(matches!(QpAddress::decode(&b[..31]), Err(Error::Malformed { .. })));
    }

    #[test]
    fn endpoint_decoding_is_total() {
        // Every length up to a record and a half, every value of each header byte, and
        // pseudo-random records: an endpoint or a typed error, never a panic; whatever
        // decodes re-encodes to the same bytes.
        let e = QpAddress {
            provider: ProviderKind::Soft,
            lid: 1,
            gid: [2; 16],
            qp_num: 3,
            psn: 4,
            token: [5; 16],
        };
        for len in 0..72 {
            let mut b = [e.to_bytes().as_slice(), &[0u8; 24]].concat();
            b.truncate(len);
            let _ = QpAddress::from_bytes(&b);
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..if cfg!(miri) { 200 } else { 20_000u32 } {
            let mut b = e.to_bytes();
            for _ in 0..1 + i % 4 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                b[(x % 48) as usize] = (x >> 8) as u8;
            }
            if let Ok(d) = QpAddress::from_bytes(&b) {
                assert_eq!(d.to_bytes(), b);
            }
        }
    }

    #[test]
    fn remote_region_round_trip_and_bounds() {
        let r = RemoteRegion { addr: 0x1000, len: 64, rkey: 42 };
        assert_eq!(RemoteRegion::decode(&r.encode()).unwrap(), r);
        assert_eq!(r.slice(56, 8).unwrap().addr, 0x1038);
        assert!(r.slice(57, 8).is_err());
        assert!(r.slice(u64::MAX, 8).is_err());
        assert!(RemoteRegion::decode(&[1, 2]).is_err());
    }

    #[test]
    fn access_rule_and_budgets() {
        assert!(AccessFlags::REMOTE_WRITE.validate().is_err());
        assert!(AccessFlags::ALL_REMOTE.validate().is_ok());
        assert!(AccessFlags::REMOTE_READ.validate().is_ok());
        let o = ConnectOptions { timeout: 10, retry_cnt: 1, ..Default::default() };
        assert_eq!(o.transport_budget().unwrap().as_nanos(), 2 * 4096 * 1024);
        assert_eq!(ConnectOptions::default().rnr_budget(), None);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
    }
}
