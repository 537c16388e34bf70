//! Connection management through librdmacm (`rdma_cm`), in "manual QP" mode.
//!
//! rdmakit creates its QPs itself, on its own `ibv_context` of the same device; librdmacm
//! only resolves addresses and routes and runs the CM handshake (REQ/REP/RTU, DREQ/DREP).
//! The QP attributes for INIT, RTR and RTS come from `rdma_init_qp_attr` and are applied
//! with `ibv_modify_qp`; `rdma_connect`/`rdma_accept` carry our QP number.
//!
//! Every id owns its own event channel (an accepted id is migrated off the listener's), and
//! every channel's fd is non-blocking: waiting is `poll(2)` with a deadline, so no call can
//! block past its timeout. Events are copied out and acknowledged at once, so destroying an
//! id never waits for an unacknowledged event.
//!
//! Private data: the front (`cm.rs`) checks the rdma_cm limit before calling in here. On InfiniBand and RoCE
//! the CM messages have fixed-size private data fields, so what the peer receives is
//! padded with zeros (56 bytes in a connect request, 196 in a reply, 148 in a reject);
//! framing the length is up to the caller.

use std::ffi::CStr;
use std::io;
use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::ptr::{self, NonNull};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdmakit_sys as sys;
use sys::rdma_cm_event_type as ev;

use super::Qp;
use super::conv::{self, errno_ret};
use crate::error::{Error, Result};
use crate::types::{AccessFlags, ConnectOptions};

use super::LINK_LAYER_INFINIBAND;

/// Mask bits 21-23 that old rdma_ucm kernels set for RoCE; librdmacm clears them on
/// InfiniBand ports before `ibv_modify_qp` (see `ucma_modify_qp_rtr`), and so do we.
const ROCE_RESERVED_MASK: u32 = 0x00e0_0000;

/// The length of private data as `rdma_conn_param` carries it (one byte). The front checks
/// the rdma_cm limit before it calls in here; this only refuses what the C field cannot
/// hold, so that nothing is truncated.
fn data_len(data: &[u8]) -> Result<u8> {
    u8::try_from(data.len())
        .map_err(|_| Error::InvalidArgument(format!("private data of {} bytes", data.len())))
}

/// The last OS error of a librdmacm call (they return -1 and set errno). `ENODEV` (no
/// RDMA in the kernel, or no device for the address) becomes [`Error::NoDevice`].
fn cm_error(call: &'static str) -> Error {
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::ENODEV) | Some(libc::ENOSYS) => {
            Error::NoDevice { provider: "verbs", reason: format!("{call}: {err}") }
        }
        _ => Error::Os { call, source: err },
    }
}

fn cm_ret(call: &'static str, rc: i32) -> Result<()> {
    if rc == 0 { Ok(()) } else { Err(cm_error(call)) }
}

/// `rdma_event_str`, e.g. `"RDMA_CM_EVENT_REJECTED"`.
fn event_name(kind: u32) -> String {
    // SAFETY: rdma_event_str takes any value and returns a pointer to a static string
    // ("UNKNOWN EVENT" for values it does not know).
    let s = unsafe { sys::rdma_event_str(kind) };
    if s.is_null() {
        return format!("RDMA_CM_EVENT({kind})");
    }
    // SAFETY: non-null, NUL-terminated and static.
    unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
}

/// Names of the common IB CM reject reasons (`enum ib_cm_rej_reason`).
fn reject_reason(status: i32) -> &'static str {
    match status {
        1 => "no QP",
        3 => "no resources",
        4 => "timeout",
        5 => "unsupported",
        8 => "invalid service ID: nothing listens there",
        10 => "stale connection",
        26 => "invalid MTU",
        27 => "insufficient responder resources",
        28 => "rejected by the peer application",
        29 => "invalid RNR retry",
        _ => "",
    }
}

/// Describes an event status: negative values are errnos, positive ones CM reasons.
fn describe_status(status: i32) -> String {
    if status < 0 {
        format!("status {status}: {}", io::Error::from_raw_os_error(-status))
    } else {
        match reject_reason(status) {
            "" => format!("status {status}"),
            r => format!("status {status}: {r}"),
        }
    }
}

/// A wait limit: `None` waits without limit.
struct Deadline {
    start: Instant,
    limit: Option<Duration>,
}

impl Deadline {
    fn new(limit: Option<Duration>) -> Deadline {
        Deadline { start: Instant::now(), limit }
    }

    fn remaining(&self) -> Option<Duration> {
        self.limit.map(|l| l.saturating_sub(self.start.elapsed()))
    }

    /// The remaining time in whole milliseconds for librdmacm's own timeouts, at least 1.
    fn remaining_ms(&self) -> i32 {
        self.remaining().map_or(i32::MAX, |d| d.as_millis().clamp(1, i32::MAX as u128) as i32)
    }

    fn error(&self) -> Error {
        Error::Timeout(self.limit.unwrap_or_default())
    }
}

/// One CM event, copied out of librdmacm's and already acknowledged.
struct Event {
    kind: u32,
    status: i32,
    /// The event's id: for a connect request, the new id (ours to destroy).
    id: *mut sys::rdma_cm_id,
    private_data: Vec<u8>,
    /// From the connection parameters, already seen from the receiver's side: the
    /// responder resources the peer needs from us, and the initiator depth it allows us.
    responder_resources: u8,
    initiator_depth: u8,
}

impl Event {
    /// Copies the event and acknowledges it.
    ///
    /// # Safety
    /// `raw` must be an event returned by `rdma_get_cm_event` and not yet acknowledged; it
    /// is acknowledged (freed) here.
    unsafe fn take(raw: NonNull<sys::rdma_cm_event>) -> Event {
        let p = raw.as_ptr();
        // SAFETY: `p` is a live event (caller's contract). The type is read as a plain u32
        // so that no assumption is made about which values the C enum may hold.
        let kind = unsafe { ptr::addr_of!((*p).event).cast::<u32>().read() };
        // SAFETY: `p` is a live event (caller's contract); `status` and `id` are plain fields.
        let (status, id) = unsafe { ((*p).status, (*p).id) };
        let conn_event = matches!(
            kind,
            ev::RDMA_CM_EVENT_CONNECT_REQUEST
                | ev::RDMA_CM_EVENT_CONNECT_RESPONSE
                | ev::RDMA_CM_EVENT_REJECTED
                | ev::RDMA_CM_EVENT_ESTABLISHED
        );
        let mut event =
            Event { kind, status, id, private_data: Vec::new(), responder_resources: 0, initiator_depth: 0 };
        if conn_event {
            // SAFETY: for these events on an RC id the union holds the connection
            // parameters (librdmacm zeroes the whole event before filling it).
            let conn = unsafe { ptr::addr_of!((*p).param.conn).read() };
            event.responder_resources = conn.responder_resources;
            event.initiator_depth = conn.initiator_depth;
            if !conn.private_data.is_null() && conn.private_data_len > 0 {
                // SAFETY: librdmacm points `private_data` at `private_data_len` bytes inside
                // the event, valid until it is acknowledged below.
                let data = unsafe {
                    std::slice::from_raw_parts(
                        conn.private_data.cast::<u8>(),
                        usize::from(conn.private_data_len),
                    )
                };
                event.private_data = data.to_vec();
            }
        }
        // SAFETY: acknowledges (and frees) the event, once; nothing refers to it afterwards.
        if unsafe { sys::rdma_ack_cm_event(p) } != 0 {
            let err = io::Error::last_os_error();
            tracing::error!(event = %event_name(kind), "rdma_ack_cm_event failed: {err}");
        }
        event
    }

    fn name(&self) -> String {
        event_name(self.kind)
    }

    /// True for the events that end an address resolution, a connection attempt or a
    /// connection.
    fn is_failure(&self) -> bool {
        matches!(
            self.kind,
            ev::RDMA_CM_EVENT_ADDR_ERROR
                | ev::RDMA_CM_EVENT_ROUTE_ERROR
                | ev::RDMA_CM_EVENT_UNREACHABLE
                | ev::RDMA_CM_EVENT_REJECTED
                | ev::RDMA_CM_EVENT_CONNECT_ERROR
                | ev::RDMA_CM_EVENT_DEVICE_REMOVAL
                | ev::RDMA_CM_EVENT_DISCONNECTED
        )
    }

    /// The typed error for a failure event met during `call`.
    fn into_error(self, call: &'static str) -> Error {
        let what = format!("{} ({})", self.name(), describe_status(self.status));
        match self.kind {
            ev::RDMA_CM_EVENT_REJECTED => {
                Error::ConnectionRejected { reason: what, private_data: self.private_data }
            }
            ev::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                Error::NoDevice { provider: "verbs", reason: format!("{what}: the RDMA device was removed") }
            }
            ev::RDMA_CM_EVENT_DISCONNECTED => {
                Error::Os { call, source: io::Error::new(io::ErrorKind::ConnectionReset, what) }
            }
            _ => {
                let kind = if self.status < 0 {
                    io::Error::from_raw_os_error(-self.status).kind()
                } else {
                    io::ErrorKind::Other
                };
                Error::Os { call, source: io::Error::new(kind, what) }
            }
        }
    }
}

/// `sockaddr_storage` from a `SocketAddr`.
fn to_sockaddr(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let p = ptr::addr_of_mut!(ss);
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { p.cast::<libc::sockaddr_in>().write(sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo().to_be(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { p.cast::<libc::sockaddr_in6>().write(sin6) };
        }
    }
    ss
}

/// `SocketAddr` from a `sockaddr_storage` (IPv4 and IPv6 only).
fn from_sockaddr(ss: &libc::sockaddr_storage) -> Result<SocketAddr> {
    let p: *const libc::sockaddr_storage = ss;
    match i32::from(ss.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in; it is large enough
            // and aligned for it.
            let sin = unsafe { p.cast::<libc::sockaddr_in>().read() };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Ok(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(sin.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6; sockaddr_storage is
            // large enough and aligned for it.
            let sin6 = unsafe { p.cast::<libc::sockaddr_in6>().read() };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Ok(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(sin6.sin6_port),
                u32::from_be(sin6.sin6_flowinfo),
                sin6.sin6_scope_id,
            )))
        }
        family => Err(Error::Unsupported(format!("rdma_cm address family {family}"))),
    }
}

/// An rdma_cm id with its own event channel; destroys the id, then the channel.
struct CmId {
    id: NonNull<sys::rdma_cm_id>,
    channel: NonNull<sys::rdma_event_channel>,
    /// The channel's fd in tokio's reactor, registered by the first async wait.
    #[cfg(feature = "async")]
    afd: std::sync::OnceLock<tokio::io::unix::AsyncFd<ChannelFd>>,
}

/// An event channel's fd as `AsyncFd` sees it; the channel owns and closes it.
#[cfg(feature = "async")]
struct ChannelFd(i32);

#[cfg(feature = "async")]
impl std::os::fd::AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> i32 {
        self.0
    }
}

// SAFETY: librdmacm calls are thread-safe (it locks its id and channel state internally);
// the id and channel are only destroyed by Drop, which has exclusive access.
unsafe impl Send for CmId {}
// SAFETY: `&CmId` methods are librdmacm calls on the id, which it locks internally; nothing
// Rust-side is mutated through a shared reference.
unsafe impl Sync for CmId {}

/// `rdma_create_event_channel`, made non-blocking.
fn create_channel() -> Result<NonNull<sys::rdma_event_channel>> {
    // SAFETY: no preconditions; NULL + errno on failure.
    let channel = unsafe { sys::rdma_create_event_channel() };
    let channel = NonNull::new(channel).ok_or_else(|| cm_error("rdma_create_event_channel"))?;
    // SAFETY: the channel was just created; its fd is open.
    if let Err(e) = unsafe { conv::set_nonblocking((*channel.as_ptr()).fd) } {
        // SAFETY: the channel has no ids; destroyed once.
        unsafe { sys::rdma_destroy_event_channel(channel.as_ptr()) };
        return Err(e);
    }
    Ok(channel)
}

impl CmId {
    fn new(id: NonNull<sys::rdma_cm_id>, channel: NonNull<sys::rdma_event_channel>) -> CmId {
        CmId {
            id,
            channel,
            #[cfg(feature = "async")]
            afd: std::sync::OnceLock::new(),
        }
    }

    /// A new RC (`RDMA_PS_TCP`) id on a new channel.
    fn create() -> Result<CmId> {
        let channel = create_channel()?;
        let mut id = ptr::null_mut();
        // SAFETY: valid channel; `id` is a local out-pointer; no user context.
        let rc = unsafe {
            sys::rdma_create_id(channel.as_ptr(), &mut id, ptr::null_mut(), sys::rdma_port_space::RDMA_PS_TCP)
        };
        match NonNull::new(id) {
            Some(id) if rc == 0 => Ok(CmId::new(id, channel)),
            _ => {
                let e = cm_error("rdma_create_id");
                // SAFETY: no id was created on the channel; destroyed once.
                unsafe { sys::rdma_destroy_event_channel(channel.as_ptr()) };
                Err(e)
            }
        }
    }

    /// Takes ownership of the id of a connect request (its event already acknowledged) by
    /// moving it to a channel of its own. On failure the request is rejected and the id
    /// destroyed.
    fn adopt(id: NonNull<sys::rdma_cm_id>) -> Result<CmId> {
        let migrated = create_channel().and_then(|channel| {
            // SAFETY: `id` is a live id whose events have all been acknowledged (otherwise
            // rdma_migrate_id would wait for them); `channel` is valid.
            match cm_ret("rdma_migrate_id", unsafe { sys::rdma_migrate_id(id.as_ptr(), channel.as_ptr()) }) {
                Ok(()) => Ok(channel),
                Err(e) => {
                    // SAFETY: no id is on the new channel; destroyed once.
                    unsafe { sys::rdma_destroy_event_channel(channel.as_ptr()) };
                    Err(e)
                }
            }
        });
        match migrated {
            Ok(channel) => Ok(CmId::new(id, channel)),
            Err(e) => {
                // SAFETY: a live connect-request id that we own; rejected, then destroyed
                // once; it stays on the listener's channel, which outlives this call.
                unsafe {
                    sys::rdma_reject(id.as_ptr(), ptr::null(), 0);
                    sys::rdma_destroy_id(id.as_ptr());
                }
                Err(e)
            }
        }
    }

    fn ptr(&self) -> *mut sys::rdma_cm_id {
        self.id.as_ptr()
    }

    fn fd(&self) -> i32 {
        // SAFETY: the channel lives as long as `self`.
        unsafe { (*self.channel.as_ptr()).fd }
    }

    /// The verbs device of the id, once it is bound to one.
    fn device_name(&self) -> Option<String> {
        // SAFETY: the id lives as long as `self`; `verbs` is NULL or librdmacm's open
        // context of the device the id is bound to.
        let verbs = unsafe { (*self.ptr()).verbs };
        if verbs.is_null() {
            return None;
        }
        // SAFETY: a live context; `device` is set when it is opened.
        let dev = unsafe { (*verbs).device };
        (!dev.is_null()).then(|| super::device_name(dev))
    }

    /// The next event on this id's channel if one is queued, acknowledged.
    fn try_event(&self) -> Result<Option<Event>> {
        loop {
            let mut raw = ptr::null_mut();
            // SAFETY: valid channel with a non-blocking fd, so this returns at once; `raw`
            // is a local out-pointer.
            let rc = unsafe { sys::rdma_get_cm_event(self.channel.as_ptr(), &mut raw) };
            if rc == 0 {
                let raw = NonNull::new(raw).ok_or_else(|| Error::Os {
                    call: "rdma_get_cm_event",
                    source: io::Error::other("returned no event"),
                })?;
                // SAFETY: a fresh, unacknowledged event, taken once.
                return Ok(Some(unsafe { Event::take(raw) }));
            }
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EAGAIN) => return Ok(None),
                Some(libc::EINTR) => continue,
                _ => return Err(Error::Os { call: "rdma_get_cm_event", source: err }),
            }
        }
    }

    /// The next event on this id's channel, acknowledged. Times out with
    /// [`Error::Timeout`].
    fn next_event(&self, deadline: &Deadline) -> Result<Event> {
        loop {
            if let Some(event) = self.try_event()? {
                return Ok(event);
            }
            let wait_ms = match deadline.remaining() {
                None => -1,
                Some(d) if d.is_zero() => return Err(deadline.error()),
                // Rounded up, so that a sub-millisecond remainder does not spin.
                Some(d) => d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
            };
            let mut pfd = libc::pollfd { fd: self.fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: `pfd` is one valid pollfd on this stack frame; the count passed is 1.
            if unsafe { libc::poll(&mut pfd, 1, wait_ms) } < 0 {
                let err = io::Error::last_os_error();
                if err.raw_os_error() != Some(libc::EINTR) {
                    return Err(Error::Os { call: "poll", source: err });
                }
            }
        }
    }

    /// The channel's fd registered with tokio's reactor (once; needs a runtime).
    #[cfg(feature = "async")]
    fn async_fd(&self) -> Result<&tokio::io::unix::AsyncFd<ChannelFd>> {
        if let Some(a) = self.afd.get() {
            return Ok(a);
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::InvalidArgument("async rdma_cm calls need a tokio runtime".into()));
        }
        // SAFETY: the fd is the event channel's, closed only by `rdma_destroy_event_channel`
        // in `CmId`'s `Drop`, which drops this `AsyncFd` first (a leaked `CmId` leaks both):
        // it stays open while registered.
        let afd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(
                ChannelFd(self.fd()),
                tokio::io::Interest::READABLE,
            )
        }
        .map_err(|e| Error::Os { call: "AsyncFd::register", source: e.into() })?;
        // A racing caller may have set it first; theirs wins and ours deregisters on drop.
        let _ = self.afd.set(afd);
        Ok(self.afd.get().expect("just set"))
    }

    /// The next event on this id's channel, awaited on tokio (the fd is non-blocking, so
    /// `rdma_get_cm_event` answers `EAGAIN` until the reactor reports it readable).
    /// Cancel-safe: an event is only taken in the step that returns it.
    #[cfg(feature = "async")]
    async fn next_event_async(&self) -> Result<Event> {
        let afd = self.async_fd()?;
        loop {
            if let Some(event) = self.try_event()? {
                return Ok(event);
            }
            let mut guard =
                afd.readable().await.map_err(|source| Error::Os { call: "AsyncFd::readable", source })?;
            guard.clear_ready();
        }
    }

    /// [`wait_for`](Self::wait_for) on tokio.
    #[cfg(feature = "async")]
    async fn wait_for_async(&self, want: u32, call: &'static str) -> Result<Event> {
        loop {
            let event = self.next_event_async().await?;
            if event.kind == want {
                return Ok(event);
            }
            if event.is_failure() {
                return Err(event.into_error(call));
            }
            tracing::debug!(event = %event.name(), status = event.status, "rdma_cm: skipping event");
        }
    }

    /// Waits for an event of type `want`; failure events become errors (attributed to
    /// `call`), other events are logged and skipped.
    fn wait_for(&self, want: u32, call: &'static str, deadline: &Deadline) -> Result<Event> {
        loop {
            let event = self.next_event(deadline)?;
            if event.kind == want {
                return Ok(event);
            }
            if event.is_failure() {
                return Err(event.into_error(call));
            }
            tracing::debug!(event = %event.name(), status = event.status, "rdma_cm: skipping event");
        }
    }

    /// `rdma_init_qp_attr` for `state`: the attributes and mask to apply.
    fn qp_attr(&self, state: u32) -> Result<(sys::ibv_qp_attr, u32)> {
        // SAFETY: all-zero is a valid attribute struct.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = state;
        let mut mask = 0;
        // SAFETY: live id; `attr` and `mask` are local out-values.
        cm_ret("rdma_init_qp_attr", unsafe { sys::rdma_init_qp_attr(self.ptr(), &mut attr, &mut mask) })?;
        Ok((attr, mask as u32))
    }

    /// The device's `(max_qp_rd_atom, max_qp_init_rd_atom)`, the limits librdmacm checks
    /// responder resources and initiator depth against.
    fn rd_atomic_limits(&self) -> Result<(u8, u8)> {
        // SAFETY: live id.
        let verbs = unsafe { (*self.ptr()).verbs };
        if verbs.is_null() {
            return Err(Error::InvalidArgument("rdma_cm id is not bound to a device".into()));
        }
        let mut attr = MaybeUninit::<sys::ibv_device_attr>::zeroed();
        // SAFETY: librdmacm's open context of the id's device; valid out-struct.
        errno_ret("ibv_query_device", unsafe { sys::ibv_query_device(verbs, attr.as_mut_ptr()) })?;
        // SAFETY: filled by a successful query (and zeroed before).
        let attr = unsafe { attr.assume_init() };
        Ok((attr.max_qp_rd_atom.clamp(0, 255) as u8, attr.max_qp_init_rd_atom.clamp(0, 255) as u8))
    }

    /// The QP must live on the id's device (by name: rdmakit opens its own context).
    fn check_qp(&self, qp: &Qp) -> Result<()> {
        let cm_dev = self.device_name().unwrap_or_default();
        if cm_dev != qp.dev().name {
            return Err(Error::InvalidArgument(format!(
                "the QP is on device `{}` but rdma_cm routes this connection through `{cm_dev}`",
                qp.dev().name
            )));
        }
        Ok(())
    }

    /// RESET (or INIT) -> INIT, with the caller's access flags.
    fn qp_to_init(&self, qp: &Qp, opts: &ConnectOptions) -> Result<()> {
        opts.validate()?;
        let (mut attr, mut mask) = self.qp_attr(sys::ibv_qp_state::IBV_QPS_INIT)?;
        attr.qp_access_flags = (opts.access & !AccessFlags::ZERO_BASED).bits();
        mask |= sys::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0;
        if let Some(pkey_index) = opts.pkey_index {
            attr.pkey_index = pkey_index;
            mask |= sys::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0;
        }
        qp.modify(&mut attr, mask, "RESET -> INIT (rdma_cm)")
    }

    /// INIT -> RTR; `responder_resources` overrides the CM's `max_dest_rd_atomic` (the
    /// passive side, which chose it for its reply).
    fn qp_to_rtr(&self, qp: &Qp, opts: &ConnectOptions, responder_resources: Option<u8>) -> Result<()> {
        use sys::ibv_qp_attr_mask as m;
        let (mut attr, mut mask) = self.qp_attr(sys::ibv_qp_state::IBV_QPS_RTR)?;
        // SAFETY: live id; port_num is set once the id is bound to a device.
        let port_num = unsafe { (*self.ptr()).port_num };
        if qp.port(port_num)?.link_layer == LINK_LAYER_INFINIBAND {
            mask &= !ROCE_RESERVED_MASK;
        }
        if let Some(r) = responder_resources {
            attr.max_dest_rd_atomic = r;
        }
        if let Some(mtu) = opts.mtu {
            attr.path_mtu =
                if mask & m::IBV_QP_PATH_MTU.0 != 0 { attr.path_mtu.min(mtu as u32) } else { mtu as u32 };
            mask |= m::IBV_QP_PATH_MTU.0;
        }
        attr.min_rnr_timer = opts.min_rnr_timer;
        mask |= m::IBV_QP_MIN_RNR_TIMER.0;
        // The route's SL, traffic class, flow label and hop limit, unless the caller set them.
        mask |= super::conv::apply_path_options(&mut attr, opts);
        qp.modify(&mut attr, mask, "INIT -> RTR (rdma_cm)")
    }

    /// RTR -> RTS with the caller's timeout and retry counts; `initiator_depth` overrides
    /// the CM's `max_rd_atomic` (the passive side).
    fn qp_to_rts(&self, qp: &Qp, opts: &ConnectOptions, initiator_depth: Option<u8>) -> Result<()> {
        use sys::ibv_qp_attr_mask as m;
        let (mut attr, mut mask) = self.qp_attr(sys::ibv_qp_state::IBV_QPS_RTS)?;
        if let Some(d) = initiator_depth {
            attr.max_rd_atomic = d;
        }
        attr.timeout = opts.timeout;
        attr.retry_cnt = opts.retry_cnt.min(7);
        attr.rnr_retry = opts.rnr_retry.min(7);
        mask |= m::IBV_QP_TIMEOUT.0 | m::IBV_QP_RETRY_CNT.0 | m::IBV_QP_RNR_RETRY.0;
        qp.modify(&mut attr, mask, "RTR -> RTS (rdma_cm)")
    }

    /// Best-effort `rdma_reject` without private data.
    fn reject_quietly(&self) {
        // SAFETY: live id; no private data.
        if unsafe { sys::rdma_reject(self.ptr(), ptr::null(), 0) } != 0 {
            tracing::debug!("rdma_reject failed: {}", io::Error::last_os_error());
        }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // Out of tokio's reactor before the channel (and its fd) goes.
        #[cfg(feature = "async")]
        drop(self.afd.take());
        // SAFETY: a live id we own, destroyed once; every event read from its channel was
        // acknowledged at once, so this does not wait for one.
        if unsafe { sys::rdma_destroy_id(self.ptr()) } != 0 {
            // The channel may still be referenced by the id: leak both rather than free it.
            tracing::error!("rdma_destroy_id failed: {}", io::Error::last_os_error());
            return;
        }
        // SAFETY: its only id is destroyed; destroyed once.
        unsafe { sys::rdma_destroy_event_channel(self.channel.as_ptr()) };
    }
}

/// Connection parameters for `rdma_connect`/`rdma_accept`. `data` must outlive the call.
fn conn_param(
    qp: &Qp,
    data: &[u8],
    resp: u8,
    init: u8,
    opts: &ConnectOptions,
) -> Result<sys::rdma_conn_param> {
    Ok(sys::rdma_conn_param {
        private_data: if data.is_empty() { ptr::null() } else { data.as_ptr().cast() },
        private_data_len: data_len(data)?,
        responder_resources: resp,
        initiator_depth: init,
        flow_control: 1,
        retry_count: opts.retry_cnt.min(7),
        rnr_retry_count: opts.rnr_retry.min(7),
        srq: 0,
        qp_num: qp.qpn(),
    })
}

/// Moves a QP that reached RTR of a failed connection to ERR, so it does not keep talking
/// to a peer that is not connected.
fn abort_qp(qp: &Qp) {
    if let Err(e) = qp.modify_to_err() {
        tracing::warn!(qp_num = qp.qpn(), "moving the QP of a failed rdma_cm connection to ERR: {e}");
    }
}

/// A listening rdma_cm id with its event channel.
pub(crate) struct CmListener {
    cm: CmId,
}

impl CmListener {
    /// `rdma_bind_addr` + `rdma_listen`. Port 0 picks a free port (see [`Self::local_addr`]).
    pub fn bind(addr: SocketAddr, backlog: i32) -> Result<CmListener> {
        let cm = CmId::create()?;
        let mut sa = to_sockaddr(addr);
        // SAFETY: live id; `sa` is a valid socket address of its family.
        cm_ret("rdma_bind_addr", unsafe {
            sys::rdma_bind_addr(cm.ptr(), ptr::addr_of_mut!(sa).cast::<libc::sockaddr>())
        })?;
        // SAFETY: live, bound id.
        cm_ret("rdma_listen", unsafe { sys::rdma_listen(cm.ptr(), backlog) })?;
        Ok(CmListener { cm })
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        // SAFETY: live id; librdmacm keeps the bound source address in the route, in a
        // union whose storage member covers it all.
        let ss = unsafe {
            ptr::addr_of!((*self.cm.ptr()).route.addr.__bindgen_anon_1)
                .cast::<libc::sockaddr_storage>()
                .read()
        };
        from_sockaddr(&ss)
    }

    /// Name of the verbs device the listener is bound to (None when bound to a wildcard
    /// address).
    pub fn device_name(&self) -> Option<String> {
        self.cm.device_name()
    }

    /// Waits for the next CONNECT_REQUEST (other events are logged and skipped). `None`
    /// waits without limit.
    pub fn get_request(&self, timeout: Option<Duration>) -> Result<CmRequest> {
        let deadline = Deadline::new(timeout);
        loop {
            if let Some(req) = request_of(self.cm.next_event(&deadline)?)? {
                return Ok(req);
            }
        }
    }

    /// [`get_request`](Self::get_request) on tokio, without limit. Cancel-safe.
    #[cfg(feature = "async")]
    pub async fn get_request_async(&self) -> Result<CmRequest> {
        loop {
            if let Some(req) = request_of(self.cm.next_event_async().await?)? {
                return Ok(req);
            }
        }
    }
}

/// A listener's event as a request: `Ok(None)` for events that are logged and skipped.
fn request_of(event: Event) -> Result<Option<CmRequest>> {
    match event.kind {
        ev::RDMA_CM_EVENT_CONNECT_REQUEST => {
            let Some(id) = NonNull::new(event.id) else {
                tracing::error!("rdma_cm: connect request without an id");
                return Ok(None);
            };
            let cm = CmId::adopt(id)?;
            Ok(Some(CmRequest {
                cm: Some(cm),
                private_data: event.private_data,
                responder_resources: event.responder_resources,
                initiator_depth: event.initiator_depth,
            }))
        }
        ev::RDMA_CM_EVENT_DEVICE_REMOVAL => Err(event.into_error("rdma_listen")),
        _ => {
            let (name, status) = (event.name(), event.status);
            tracing::debug!(event = %name, status, "rdma_cm listener: skipping event");
            Ok(None)
        }
    }
}

/// A connect request: owns the new id (rejected and destroyed on drop unless accepted).
pub(crate) struct CmRequest {
    /// `None` once accepted or rejected.
    cm: Option<CmId>,
    private_data: Vec<u8>,
    /// The responder resources the requester wants (its initiator depth).
    responder_resources: u8,
    /// The initiator depth the requester allows (its responder resources).
    initiator_depth: u8,
}

impl CmRequest {
    fn take(&mut self) -> Result<CmId> {
        self.cm.take().ok_or_else(|| Error::InvalidArgument("connect request already answered".into()))
    }

    /// The peer's private data (on InfiniBand and RoCE, zero-padded to 56 bytes).
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// The device of the new id (`id->verbs->device`).
    pub fn device_name(&self) -> String {
        self.cm.as_ref().and_then(CmId::device_name).unwrap_or_default()
    }

    /// INIT -> RTR -> RTS for `qp` with the CM's attributes (access flags from
    /// `opts.access`; `opts.timeout`, `retry_cnt`, `rnr_retry`, `min_rnr_timer` and `mtu`
    /// applied), then `rdma_accept` with `private_data`, then waits for ESTABLISHED
    /// (`None`: no limit of ours; the CM gives up after its own REP retries).
    ///
    /// On failure the request is rejected (if not yet accepted) and a QP that was
    /// modified is moved to ERR.
    pub fn accept(
        mut self,
        qp: &Qp,
        opts: &ConnectOptions,
        private_data: &[u8],
        timeout: Option<Duration>,
    ) -> Result<CmConn> {
        let deadline = Deadline::new(timeout);
        let cm = self.start_accept(qp, opts, private_data)?;
        match cm.wait_for(ev::RDMA_CM_EVENT_ESTABLISHED, "rdma_accept", &deadline) {
            Ok(_) => Ok(CmConn::new(cm)),
            Err(e) => {
                abort_qp(qp);
                Err(e)
            }
        }
    }

    /// [`accept`](Self::accept) on tokio, without a limit of its own (the caller bounds it
    /// with `tokio::time::timeout`; dropping the future destroys the id, which ends the
    /// attempt).
    #[cfg(feature = "async")]
    pub async fn accept_async(
        mut self,
        qp: &Qp,
        opts: &ConnectOptions,
        private_data: &[u8],
    ) -> Result<CmConn> {
        let cm = self.start_accept(qp, opts, private_data)?;
        match cm.wait_for_async(ev::RDMA_CM_EVENT_ESTABLISHED, "rdma_accept").await {
            Ok(_) => Ok(CmConn::new(cm)),
            Err(e) => {
                abort_qp(qp);
                Err(e)
            }
        }
    }

    /// The QP to RTS and `rdma_accept`: the id, waiting for ESTABLISHED.
    fn start_accept(&mut self, qp: &Qp, opts: &ConnectOptions, private_data: &[u8]) -> Result<CmId> {
        let cm = self.take()?;
        if let Err(e) = cm.check_qp(qp) {
            cm.reject_quietly();
            return Err(e);
        }
        let accepted = (|| {
            let (max_rd, max_init) = cm.rd_atomic_limits()?;
            let resp = opts.max_rd_atomic.min(self.responder_resources).max(1).min(max_rd);
            let init = opts.max_rd_atomic.min(self.initiator_depth).max(1).min(max_init);
            let mut param = conn_param(qp, private_data, resp, init, opts)?;
            cm.qp_to_init(qp, opts)?;
            cm.qp_to_rtr(qp, opts, Some(resp))?;
            cm.qp_to_rts(qp, opts, Some(init))?;
            // SAFETY: live connect-request id; `param` and the private data it points to
            // outlive the call, which copies them.
            cm_ret("rdma_accept", unsafe { sys::rdma_accept(cm.ptr(), &mut param) })
        })();
        if let Err(e) = accepted {
            cm.reject_quietly();
            abort_qp(qp);
            return Err(e);
        }
        Ok(cm)
    }

    /// `rdma_reject` with `private_data` (the front checked its length against the CM
    /// limit). More than the C field holds: `InvalidArgument`, and the request (consumed)
    /// is rejected without private data.
    pub fn reject(mut self, private_data: &[u8]) -> Result<()> {
        let len = data_len(private_data)?;
        let cm = self.take()?;
        // SAFETY: live connect-request id; the private data outlives the call.
        cm_ret("rdma_reject", unsafe { sys::rdma_reject(cm.ptr(), private_data.as_ptr().cast(), len) })
    }
}

impl Drop for CmRequest {
    fn drop(&mut self) {
        if let Some(cm) = self.cm.take() {
            cm.reject_quietly();
        }
    }
}

/// The active side: an id whose address and route are resolved.
pub(crate) struct CmConnector {
    cm: CmId,
}

impl CmConnector {
    /// `rdma_resolve_addr` + `rdma_resolve_route`, both within `timeout`. `tos`, when given,
    /// is set on the id first (`RDMA_OPTION_ID_TOS`), so the route and rdma_cm's own packets
    /// carry that traffic class.
    pub fn resolve(addr: SocketAddr, timeout: Duration, tos: Option<u8>) -> Result<CmConnector> {
        let deadline = Deadline::new(Some(timeout));
        let cm = Self::start_resolve(addr, tos, &deadline)?;
        cm.wait_for(ev::RDMA_CM_EVENT_ADDR_RESOLVED, "rdma_resolve_addr", &deadline)?;
        Self::resolve_route(&cm, &deadline)?;
        cm.wait_for(ev::RDMA_CM_EVENT_ROUTE_RESOLVED, "rdma_resolve_route", &deadline)?;
        Ok(CmConnector { cm })
    }

    /// [`resolve`](Self::resolve) on tokio (librdmacm's own timeouts still come from
    /// `timeout`; the caller bounds the whole with `tokio::time::timeout`).
    #[cfg(feature = "async")]
    pub async fn resolve_async(addr: SocketAddr, timeout: Duration, tos: Option<u8>) -> Result<CmConnector> {
        let deadline = Deadline::new(Some(timeout));
        let cm = Self::start_resolve(addr, tos, &deadline)?;
        cm.wait_for_async(ev::RDMA_CM_EVENT_ADDR_RESOLVED, "rdma_resolve_addr").await?;
        Self::resolve_route(&cm, &deadline)?;
        cm.wait_for_async(ev::RDMA_CM_EVENT_ROUTE_RESOLVED, "rdma_resolve_route").await?;
        Ok(CmConnector { cm })
    }

    /// A new id, its TOS set, `rdma_resolve_addr` started.
    fn start_resolve(addr: SocketAddr, tos: Option<u8>, deadline: &Deadline) -> Result<CmId> {
        let cm = CmId::create()?;
        if let Some(mut tos) = tos {
            // SAFETY: live id; the option value is a u8 of the size passed, read during the call.
            cm_ret("rdma_set_option(TOS)", unsafe {
                sys::rdma_set_option(
                    cm.ptr(),
                    sys::RDMA_OPTION_ID as i32,
                    sys::RDMA_OPTION_ID_TOS as i32,
                    ptr::addr_of_mut!(tos).cast(),
                    std::mem::size_of::<u8>(),
                )
            })?;
        }
        let mut dst = to_sockaddr(addr);
        // SAFETY: live id; `dst` is a valid socket address; no source address.
        cm_ret("rdma_resolve_addr", unsafe {
            sys::rdma_resolve_addr(
                cm.ptr(),
                ptr::null_mut(),
                ptr::addr_of_mut!(dst).cast::<libc::sockaddr>(),
                deadline.remaining_ms(),
            )
        })?;
        Ok(cm)
    }

    fn resolve_route(cm: &CmId, deadline: &Deadline) -> Result<()> {
        // SAFETY: live id with a resolved address.
        cm_ret("rdma_resolve_route", unsafe { sys::rdma_resolve_route(cm.ptr(), deadline.remaining_ms()) })
    }

    /// The device the route goes through: the QP must be created on it.
    pub fn device_name(&self) -> String {
        self.cm.device_name().unwrap_or_default()
    }

    /// INIT (CM attributes, `opts.access`), `rdma_connect` with our QP number and
    /// `private_data`, waits for CONNECT_RESPONSE, then RTR and RTS (CM attributes with
    /// `opts` applied as in [`CmRequest::accept`]) and `rdma_establish`. Returns the
    /// connection and the peer's private data (on InfiniBand and RoCE zero-padded to 196
    /// bytes).
    ///
    /// On failure before the response the QP is left in INIT; after it, the QP is moved to
    /// ERR.
    pub fn connect(
        self,
        qp: &Qp,
        opts: &ConnectOptions,
        private_data: &[u8],
        timeout: Duration,
    ) -> Result<(CmConn, Vec<u8>)> {
        let deadline = Deadline::new(Some(timeout));
        self.start_connect(qp, opts, private_data)?;
        let response = self.cm.wait_for(ev::RDMA_CM_EVENT_CONNECT_RESPONSE, "rdma_connect", &deadline)?;
        self.establish(qp, opts, response)
    }

    /// [`connect`](Self::connect) on tokio, without a limit of its own (the caller bounds
    /// it; dropping the future destroys the id, which ends the attempt).
    #[cfg(feature = "async")]
    pub async fn connect_async(
        self,
        qp: &Qp,
        opts: &ConnectOptions,
        private_data: &[u8],
    ) -> Result<(CmConn, Vec<u8>)> {
        self.start_connect(qp, opts, private_data)?;
        let response = self.cm.wait_for_async(ev::RDMA_CM_EVENT_CONNECT_RESPONSE, "rdma_connect").await?;
        self.establish(qp, opts, response)
    }

    /// INIT and `rdma_connect`.
    fn start_connect(&self, qp: &Qp, opts: &ConnectOptions, private_data: &[u8]) -> Result<()> {
        let cm = &self.cm;
        cm.check_qp(qp)?;
        let (max_rd, max_init) = cm.rd_atomic_limits()?;
        let resp = opts.max_rd_atomic.min(max_rd);
        let init = opts.max_rd_atomic.min(max_init);
        let mut param = conn_param(qp, private_data, resp, init, opts)?;
        cm.qp_to_init(qp, opts)?;
        // SAFETY: live id with a resolved route; `param` and the private data it points to
        // outlive the call, which copies them.
        cm_ret("rdma_connect", unsafe { sys::rdma_connect(cm.ptr(), &mut param) })
    }

    /// After the CONNECT_RESPONSE: RTR, RTS and `rdma_establish`.
    fn establish(self, qp: &Qp, opts: &ConnectOptions, response: Event) -> Result<(CmConn, Vec<u8>)> {
        let cm = self.cm;
        let established = (|| {
            cm.qp_to_rtr(qp, opts, None)?;
            cm.qp_to_rts(qp, opts, None)?;
            // SAFETY: live id that received a connect response; sends the RTU.
            cm_ret("rdma_establish", unsafe { sys::rdma_establish(cm.ptr()) })
        })();
        if let Err(e) = established {
            cm.reject_quietly();
            abort_qp(qp);
            return Err(e);
        }
        Ok((CmConn::new(cm), response.private_data))
    }
}

/// An established connection's id and channel, kept for the connection's life.
pub(crate) struct CmConn {
    cm: CmId,
    /// Cleared once `rdma_disconnect` was called.
    connected: AtomicBool,
    /// Set once DISCONNECTED was seen.
    disconnected: AtomicBool,
    /// Serialises event readers.
    events: Mutex<()>,
}

impl CmConn {
    fn new(cm: CmId) -> CmConn {
        CmConn {
            cm,
            connected: AtomicBool::new(true),
            disconnected: AtomicBool::new(false),
            events: Mutex::new(()),
        }
    }

    /// `rdma_disconnect`, once (later calls, and calls after the peer disconnected, do
    /// nothing). The QP is not touched: move it to ERR to flush its work requests.
    pub fn disconnect(&self) -> Result<()> {
        if !self.connected.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        // SAFETY: live, connected id.
        if unsafe { sys::rdma_disconnect(self.cm.ptr()) } != 0 {
            let err = io::Error::last_os_error();
            // EINVAL: the CM already left the connected state (the peer disconnected).
            if err.raw_os_error() != Some(libc::EINVAL) {
                return Err(Error::Os { call: "rdma_disconnect", source: err });
            }
        }
        Ok(())
    }

    /// Waits for DISCONNECTED (peer or local disconnect); `Ok(true)` if seen (now or
    /// before), `Ok(false)` on timeout. Answers a peer's disconnect request at once.
    pub fn wait_disconnected(&self, timeout: Duration) -> Result<bool> {
        if self.disconnected.load(Ordering::Acquire) {
            return Ok(true);
        }
        let deadline = Deadline::new(Some(timeout));
        let _guard = self.events.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if self.disconnected.load(Ordering::Acquire) {
                return Ok(true);
            }
            let event = match self.cm.next_event(&deadline) {
                Ok(event) => event,
                Err(Error::Timeout(_)) => return Ok(false),
                Err(e) => return Err(e),
            };
            match event.kind {
                ev::RDMA_CM_EVENT_DISCONNECTED => {
                    self.disconnected.store(true, Ordering::Release);
                    // The peer's DREQ waits for our DREP, which rdma_disconnect sends.
                    if let Err(e) = self.disconnect() {
                        tracing::debug!("rdma_cm: answering a disconnect: {e}");
                    }
                    return Ok(true);
                }
                ev::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                    self.disconnected.store(true, Ordering::Release);
                    self.connected.store(false, Ordering::Release);
                    return Err(event.into_error("rdma_disconnect"));
                }
                _ => tracing::debug!(event = %event.name(), status = event.status, "rdma_cm: skipping event"),
            }
        }
    }
}

impl Drop for CmConn {
    fn drop(&mut self) {
        if let Err(e) = self.disconnect() {
            tracing::warn!("rdma_cm: disconnect on drop: {e}");
        }
        // `cm` is dropped next: the id, then its channel.
    }
}

#[cfg(test)]
mod tests {
    //! The connection tests need rdma_cm, which needs an RDMA-capable kernel: they run in
    //! the rxe VM (`scripts/rxe-vm.sh <test binary> rdma::cm`, which sets
    //! `RDMAKIT_RXE_IP`) and print "skipped" elsewhere.

    use std::net::IpAddr;
    use std::thread;

    use super::super::{Context, Cq, Pd};
    use super::*;
    use crate::raw::{RawOp, RawSendWr, Sge};
    use crate::types::{QpCaps, QpState};
    use crate::wc::WorkCompletion;

    const T: Duration = Duration::from_secs(20);

    fn rxe_ip() -> Option<IpAddr> {
        match std::env::var("RDMAKIT_RXE_IP") {
            Ok(ip) => Some(ip.parse().expect("RDMAKIT_RXE_IP is an IP address")),
            Err(_) => {
                eprintln!("skipped: RDMAKIT_RXE_IP is unset (rdma_cm tests run in scripts/rxe-vm.sh)");
                None
            }
        }
    }

    /// A device's PD, CQ and QP (fields drop in order: the QP before its CQ).
    struct Side {
        qp: Qp,
        cq: Cq,
        pd: Pd,
        _ctx: Context,
    }

    fn side(device: &str) -> Side {
        let ctx = Context::open(Some(device)).expect("open device");
        let pd = ctx.alloc_pd().expect("pd");
        let cq = ctx.create_cq(64).expect("cq");
        let qp = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
        Side { qp, cq, pd, _ctx: ctx }
    }

    fn poll_one(cq: &Cq) -> WorkCompletion {
        let start = Instant::now();
        let mut wcs = [WorkCompletion::default(); 1];
        loop {
            if cq.poll(&mut wcs).expect("poll") == 1 {
                return wcs[0];
            }
            assert!(start.elapsed() < T, "no completion within {T:?}");
            thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn private_data_length_fits_its_field() {
        assert_eq!(data_len(&[0; 255]).unwrap(), 255);
        assert!(matches!(data_len(&[0; 256]), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn sockaddr_round_trip() {
        for addr in ["10.77.0.1:7471", "[fe80::1]:9"] {
            let addr: SocketAddr = addr.parse().unwrap();
            assert_eq!(from_sockaddr(&to_sockaddr(addr)).unwrap(), addr);
        }
    }

    #[test]
    fn no_rdma_kernel_is_no_device() {
        if std::env::var_os("RDMAKIT_RXE_IP").is_some() {
            return;
        }
        // Only meaningful on a host whose kernel has no RDMA (like the dev machines).
        if !matches!(super::super::device_names(), Err(Error::NoDevice { .. })) {
            eprintln!("skipped: this host has RDMA support");
            return;
        }
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let e = CmListener::bind(addr, 1).err().expect("bind must fail without RDMA");
        assert!(matches!(e, Error::NoDevice { .. }), "{e}");
        let e = CmConnector::resolve(addr, Duration::from_secs(1), None).err().expect("resolve must fail");
        assert!(matches!(e, Error::NoDevice { .. }), "{e}");
    }

    /// Connect, exchange private data both ways, RDMA-write from the connector into the
    /// acceptor's buffer (address and rkey in the acceptor's private data), disconnect.
    #[test]
    fn connect_write_disconnect() {
        let Some(ip) = rxe_ip() else { return };
        let listener = CmListener::bind(SocketAddr::new(ip, 0), 8).expect("bind");
        let addr = listener.local_addr().expect("local_addr");
        assert_eq!(addr.ip(), ip);
        assert_ne!(addr.port(), 0);
        let dev = listener.device_name().expect("bound to a device");
        if let Ok(want) = std::env::var("RDMAKIT_RXE_DEV") {
            assert_eq!(dev, want);
        }
        const CLIENT_HELLO: &[u8] = b"rdmakit client hello";
        const PAYLOAD: &[u8] = b"written through rdma_cm";

        let server = thread::spawn(move || {
            let req = listener.get_request(Some(T)).expect("get_request");
            let data = req.private_data();
            assert_eq!(&data[..CLIENT_HELLO.len()], CLIENT_HELLO);
            assert!(data[CLIENT_HELLO.len()..].iter().all(|b| *b == 0), "padding is zeros");
            let s = side(&req.device_name());
            let mut buf = vec![0u8; 4096];
            // SAFETY: `buf` outlives the region (dropped at the end of this closure, after
            // the region, which is declared later).
            let mr =
                unsafe { s.pd.reg_mr(buf.as_mut_ptr(), buf.len(), AccessFlags::ALL_REMOTE) }.expect("mr");
            let mut reply = Vec::new();
            reply.extend_from_slice(b"RKW1");
            reply.extend_from_slice(&(buf.as_ptr() as u64).to_le_bytes());
            reply.extend_from_slice(&mr.rkey().to_le_bytes());
            let conn = req.accept(&s.qp, &ConnectOptions::default(), &reply, Some(T)).expect("accept");
            assert!(conn.wait_disconnected(T).expect("wait_disconnected"), "saw DISCONNECTED");
            // The write was acknowledged before the peer disconnected.
            // SAFETY: `buf` is live; volatile reads because the NIC wrote it.
            let got: Vec<u8> =
                (0..PAYLOAD.len()).map(|i| unsafe { ptr::read_volatile(buf.as_ptr().add(i)) }).collect();
            assert_eq!(got, PAYLOAD);
            assert!(conn.wait_disconnected(Duration::ZERO).unwrap(), "stays disconnected");
            drop(mr);
            drop(buf);
        });

        let connector = CmConnector::resolve(addr, T, None).expect("resolve");
        assert_eq!(connector.device_name(), dev);
        let c = side(&connector.device_name());
        let mut src = PAYLOAD.to_vec();
        // SAFETY: `src` outlives the region (dropped explicitly below).
        let mr = unsafe { c.pd.reg_mr(src.as_mut_ptr(), src.len(), AccessFlags::LOCAL_WRITE) }.expect("mr");
        let (conn, reply) =
            connector.connect(&c.qp, &ConnectOptions::default(), CLIENT_HELLO, T).expect("connect");
        assert_eq!(&reply[..4], b"RKW1", "acceptor's private data");
        let remote_addr = u64::from_le_bytes(reply[4..12].try_into().unwrap());
        let rkey = u32::from_le_bytes(reply[12..16].try_into().unwrap());
        assert!(reply[16..].iter().all(|b| *b == 0));
        let wr = RawSendWr {
            wr_id: 7,
            op: RawOp::Write { imm: None },
            sge: Some(Sge { addr: src.as_ptr() as u64, len: src.len() as u32, lkey: mr.lkey() }),
            inline: None,
            remote_addr,
            rkey,
            signaled: true,
            fence: false,
            solicited: false,
        };
        c.qp.post_send(&[wr]).map_err(|(_, e)| e).expect("post_send");
        let wc = poll_one(&c.cq);
        assert!(wc.status.is_success(), "write completed with {:?}", wc.status);
        assert_eq!(wc.wr_id, 7);

        conn.disconnect().expect("disconnect");
        conn.disconnect().expect("disconnect is idempotent");
        assert!(conn.wait_disconnected(T).expect("wait_disconnected"), "local side sees DISCONNECTED too");
        server.join().expect("acceptor thread");
        drop(conn);
        drop(c);
        drop(mr);
        drop(src);
    }

    /// A rejected connect fails with `ConnectionRejected` carrying the rejecter's private
    /// data; an oversize reject is refused (and the dropped request rejected without data).
    #[test]
    fn reject_carries_private_data() {
        let Some(ip) = rxe_ip() else { return };
        let listener = CmListener::bind(SocketAddr::new(ip, 0), 8).expect("bind");
        let addr = listener.local_addr().unwrap();
        let server = thread::spawn(move || {
            let req = listener.get_request(Some(T)).expect("get_request");
            assert!(matches!(req.reject(&[0; 256]), Err(Error::InvalidArgument(_))));
            // The oversize reject consumed (and rejected) the request; answer the next one.
            let req = listener.get_request(Some(T)).expect("second get_request");
            req.reject(b"go away").expect("reject");
        });
        for attempt in 0..2 {
            let connector = CmConnector::resolve(addr, T, None).expect("resolve");
            let c = side(&connector.device_name());
            let start = Instant::now();
            let e = connector.connect(&c.qp, &ConnectOptions::default(), b"hi", T).err().expect("rejected");
            assert!(start.elapsed() < Duration::from_secs(10), "rejected quickly");
            let Error::ConnectionRejected { reason, private_data } = &e else { panic!("{e}") };
            assert!(reason.contains("RDMA_CM_EVENT_REJECTED"), "{reason}");
            if attempt == 1 {
                assert!(reason.contains("status 28"), "{reason}");
                assert_eq!(&private_data[..7], b"go away");
            }
            eprintln!("attempt {attempt}: {e}");
        }
        server.join().unwrap();
    }

    /// A wildcard listener (no device until a request arrives), timeouts, and the
    /// acceptor disconnecting first.
    #[test]
    fn wildcard_listener_acceptor_disconnects() {
        let Some(ip) = rxe_ip() else { return };
        let any = if ip.is_ipv4() {
            IpAddr::from(Ipv4Addr::UNSPECIFIED)
        } else {
            IpAddr::from(Ipv6Addr::UNSPECIFIED)
        };
        let listener = CmListener::bind(SocketAddr::new(any, 0), 8).expect("bind");
        assert_eq!(listener.device_name(), None);
        let port = listener.local_addr().expect("local_addr").port();
        assert_ne!(port, 0);
        let start = Instant::now();
        let e = listener.get_request(Some(Duration::from_millis(200))).err().expect("nobody connects");
        assert!(matches!(e, Error::Timeout(_)), "{e}");
        assert!(start.elapsed() < Duration::from_secs(5));

        let (go, wait_go) = std::sync::mpsc::channel::<()>();
        let server = thread::spawn(move || {
            let req = listener.get_request(Some(T)).expect("get_request");
            let s = side(&req.device_name());
            let conn = req.accept(&s.qp, &ConnectOptions::default(), b"srv", Some(T)).expect("accept");
            assert_eq!(s.qp.state(), QpState::ReadyToSend);
            wait_go.recv().unwrap();
            conn.disconnect().expect("disconnect");
            assert!(conn.wait_disconnected(T).unwrap(), "acceptor sees its own disconnect complete");
        });
        let connector = CmConnector::resolve(SocketAddr::new(ip, port), T, None).expect("resolve");
        let c = side(&connector.device_name());
        let (conn, reply) = connector.connect(&c.qp, &ConnectOptions::default(), b"", T).expect("connect");
        assert_eq!(&reply[..3], b"srv");
        assert_eq!(c.qp.state(), QpState::ReadyToSend);
        assert!(!conn.wait_disconnected(Duration::from_millis(100)).unwrap(), "still connected");
        go.send(()).unwrap();
        assert!(conn.wait_disconnected(T).unwrap(), "connector sees the peer's disconnect");
        assert!(conn.wait_disconnected(Duration::ZERO).unwrap());
        conn.disconnect().expect("disconnect after the peer did");
        server.join().expect("acceptor thread");
    }

    /// Nobody listens: a typed error within seconds, not a hang.
    #[test]
    fn connect_without_listener_fails_fast() {
        let Some(ip) = rxe_ip() else { return };
        // A port that was free a moment ago.
        let port = {
            let l = CmListener::bind(SocketAddr::new(ip, 0), 1).expect("bind");
            l.local_addr().unwrap().port()
        };
        let connector = CmConnector::resolve(SocketAddr::new(ip, port), T, None).expect("resolve");
        let c = side(&connector.device_name());
        let start = Instant::now();
        let e =
            connector.connect(&c.qp, &ConnectOptions::default(), b"anyone?", T).err().expect("no listener");
        let took = start.elapsed();
        eprintln!("no listener: {e} after {took:?}");
        assert!(took < Duration::from_secs(10), "took {took:?}");
        match &e {
            Error::ConnectionRejected { reason, .. } => assert!(reason.contains("REJECTED"), "{reason}"),
            Error::Os { source, .. } => {
                let msg = source.to_string();
                assert!(msg.contains("UNREACHABLE") || msg.contains("CONNECT_ERROR"), "{msg}")
            }
            e => panic!("unexpected error {e}"),
        }
    }

    /// An address no route leads to: an error within the timeout, not a hang.
    #[test]
    fn unroutable_address_fails_in_time() {
        if rxe_ip().is_none() {
            return;
        }
        let start = Instant::now();
        let e = CmConnector::resolve("192.0.2.1:7471".parse().unwrap(), Duration::from_secs(3), None)
            .err()
            .expect("TEST-NET-1 is not routable in the VM");
        let took = start.elapsed();
        eprintln!("unroutable: {e} after {took:?}");
        assert!(took < Duration::from_secs(6), "took {took:?}");
        assert!(matches!(e, Error::Os { .. } | Error::Timeout(_) | Error::NoDevice { .. }), "{e}");
    }

    #[test]
    fn oversize_private_data_is_invalid() {
        let Some(ip) = rxe_ip() else { return };
        let connector = CmConnector::resolve(SocketAddr::new(ip, 9), T, None).expect("resolve");
        let c = side(&connector.device_name());
        let e = connector.connect(&c.qp, &ConnectOptions::default(), &[1; 256], T).err().expect("too long");
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
}
