//! Connection management through librdmacm (`rdma_cm`), in "manual QP" mode.
//!
//! rdmakit creates its QPs itself, on its own `ibv_context` of the same device; librdmacm
//! only resolves addresses and routes and runs the CM handshake (REQ/REP/RTU, DREQ/DREP).
//! The QP attributes for INIT, RTR and RTS come from `rdma_init_qp_attr` and are applied
//! with `ibv_modify_qp`; `rdma_connect`/`rdma_accept` carry our QP number.
//!
//! Every id owns its own event channel (an accepted id is migrated off the listener's), and
//! every channel's fd is non-blocking: waiting is `poll(2)` with a deadline, so no call can
//! block past its timeout, or, for the `_async` calls, tokio's `AsyncFd` on the same fd
//! (`rdma_get_cm_event` answers `EAGAIN` until it is readable). Events are copied out and acknowledged at once, so destroying an
//! id never waits for an unacknowledged event.
//!
//! Files: this one holds what both sides share (errors, events, the id and its channel, the
//! QP-attribute steps, the established connection); [`listener`] the passive side
//! (`CmListener`, `CmRequest`); [`connector`] the active side (`CmConnector`).
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

pub(crate) mod connector;
pub(crate) mod listener;
#[cfg(test)]
mod tests;

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
    afd: crate::cq::Registered<ChannelFd>,
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
            afd: Default::default(),
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
        self.afd.get_or_register(|| {
            if tokio::runtime::Handle::try_current().is_err() {
                return Err(Error::InvalidArgument("async rdma_cm calls need a tokio runtime".into()));
            }
            // SAFETY: the fd is the event channel's, closed only by
            // `rdma_destroy_event_channel` in `CmId`'s `Drop`, which drops this `AsyncFd` first
            // (a leaked `CmId` leaks both): it stays open while registered.
            unsafe {
                tokio::io::unix::AsyncFd::register_with_interest(
                    ChannelFd(self.fd()),
                    tokio::io::Interest::READABLE,
                )
            }
            .map_err(|e| Error::Os { call: "AsyncFd::register", source: e.into() })
        })
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
