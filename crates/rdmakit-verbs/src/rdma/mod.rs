//! The rdma-core provider: thin owners of libibverbs objects.
//!
//! Each object holds an `Arc` of the object it was created from (MR → PD → device), so
//! the C objects are destroyed children-first whatever order the safe layer drops them in.
//! Return conventions are mapped once, in [`conv`]: NULL + errno, errno returned, and a
//! negative count. Everything here trusts the safe layer for buffer lifetimes (see the
//! `# Safety` sections); it adds no checks the NIC makes itself.

pub(crate) mod cm;
mod conv;
pub(crate) mod mlx5dv;

use std::collections::HashSet;
use std::ffi::CStr;
use std::mem::MaybeUninit;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use rdmakit_sys as sys;

use self::conv::{errno_ret, nonnull};
use crate::error::{Error, Result, WcStatus};
use crate::raw::{RawRecvWr, RawSendWr};
use crate::types::{
    AccessFlags, ConnectOptions, DeviceAttr, Endpoint, GidEntry, GidKind, ProviderKind, QpCaps, QpState,
};
use crate::wc::{WcOpcode, WorkCompletion};

/// `IBV_LINK_LAYER_ETHERNET`.
const LINK_LAYER_ETHERNET: u8 = 2;
/// `IBV_EVENT_CQ_ERR`.
const EVENT_CQ_ERR: u32 = 0;

/// Lists the names of the verbs devices.
///
/// # Errors
/// [`Error::NoDevice`] when rdma-core cannot list devices at all (no RDMA support in the
/// kernel: `ENOSYS`), with the errno in the reason.
pub(crate) fn device_names() -> Result<Vec<String>> {
    let list = DeviceList::get()?;
    Ok(list.iter().map(device_name).collect())
}

/// `ibv_get_device_list`, freed on drop.
struct DeviceList {
    list: NonNull<*mut sys::ibv_device>,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<DeviceList> {
        let mut n = 0;
        // SAFETY: `n` is a valid out-pointer; the call allocates the list it returns.
        let list = unsafe { sys::ibv_get_device_list(&mut n) };
        match NonNull::new(list) {
            Some(list) => Ok(DeviceList { list, len: n.max(0) as usize }),
            None => Err(Error::NoDevice {
                provider: "verbs",
                reason: format!("ibv_get_device_list: {}", std::io::Error::last_os_error()),
            }),
        }
    }

    fn iter(&self) -> impl Iterator<Item = *mut sys::ibv_device> + '_ {
        // SAFETY: the list holds `len` device pointers, valid until it is freed (on drop,
        // which the borrow of `self` prevents while iterating).
        (0..self.len).map(move |i| unsafe { *self.list.as_ptr().add(i) })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: returned by ibv_get_device_list, freed once.
        unsafe { sys::ibv_free_device_list(self.list.as_ptr()) };
    }
}

fn device_name(dev: *mut sys::ibv_device) -> String {
    // SAFETY: `dev` comes from a live device list; the name is a NUL-terminated string
    // inside the device struct.
    let name = unsafe { sys::ibv_get_device_name(dev) };
    if name.is_null() {
        return String::from("?");
    }
    // SAFETY: non-null, NUL-terminated per ibv_get_device_name(3).
    unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
}

/// The open device (`ibv_context`), shared by every object made from it.
struct Device {
    ctx: NonNull<sys::ibv_context>,
    name: String,
    max_qp_rd_atom: u8,
    /// CQs that reported `IBV_EVENT_CQ_ERR` (overrun), by address.
    overrun: Mutex<HashSet<usize>>,
}

// SAFETY: libibverbs contexts are thread-safe (rdma-core documents verbs calls as safe to
// make from several threads); the only Rust-side state is behind a mutex.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device; every child holds an `Arc<Device>`, so all
        // were destroyed before this runs.
        let rc = unsafe { sys::ibv_close_device(self.ctx.as_ptr()) };
        if rc != 0 {
            tracing::error!(device = %self.name, "ibv_close_device failed");
        }
    }
}

impl Device {
    fn port(&self, port_num: u8) -> Result<sys::ibv_port_attr> {
        let mut pa = MaybeUninit::<sys::ibv_port_attr>::zeroed();
        // SAFETY: open context, valid out-struct (zeroed, so fields an older kernel does not
        // fill read as 0).
        errno_ret("ibv_query_port", unsafe {
            sys::___ibv_query_port(self.ctx.as_ptr(), port_num, pa.as_mut_ptr())
        })?;
        // SAFETY: filled by a successful query.
        Ok(unsafe { pa.assume_init() })
    }

    fn gid(&self, port_num: u8, index: u8) -> Result<[u8; 16]> {
        let mut gid = MaybeUninit::<sys::ibv_gid>::zeroed();
        // SAFETY: open context, valid out-pointer.
        errno_ret("ibv_query_gid", unsafe {
            sys::ibv_query_gid(self.ctx.as_ptr(), port_num, i32::from(index), gid.as_mut_ptr())
        })?;
        // SAFETY: filled by a successful query; `raw` covers the whole union.
        Ok(unsafe { gid.assume_init().raw })
    }

    /// The GID table entry's type (`ibv_query_gid_ex`); `None` when the entry is empty or the
    /// kernel cannot say.
    fn gid_kind(&self, port_num: u8, index: u8) -> Option<GidKind> {
        let mut entry = MaybeUninit::<sys::ibv_gid_entry>::zeroed();
        // SAFETY: open context, valid out-pointer, flags 0.
        let rc = unsafe {
            sys::ibv_query_gid_ex(
                self.ctx.as_ptr(),
                u32::from(port_num),
                u32::from(index),
                entry.as_mut_ptr(),
                0,
            )
        };
        if rc != 0 {
            return None;
        }
        // SAFETY: filled by a successful query.
        let entry = unsafe { entry.assume_init() };
        Some(match entry.gid_type {
            sys::IBV_GID_TYPE_IB => GidKind::Ib,
            sys::IBV_GID_TYPE_ROCE_V1 => GidKind::RoceV1,
            sys::IBV_GID_TYPE_ROCE_V2 => GidKind::RoceV2,
            other => GidKind::Other(other),
        })
    }

    /// The GID a connection uses: `explicit`, then `RDMAKIT_GID_INDEX`, then on RoCE the first
    /// RoCE v2 entry with an IPv4-mapped address, then the first RoCE v2 entry, then (kernels
    /// that cannot report types) the first IPv4-mapped entry; on InfiniBand index 0. RoCE v2
    /// is what perftest, UCX and rdma_cm users expect; on ConnectX the v1 and v2 entries of an
    /// address alternate, so "the first IPv4-mapped entry" alone would pick v1.
    fn choose_gid(&self, port_num: u8, explicit: Option<u8>, port: &sys::ibv_port_attr) -> GidChoice {
        let pick = |index: u8| GidChoice { index, kind: self.gid_kind(port_num, index) };
        if let Some(i) = explicit {
            return pick(i);
        }
        if let Some(i) = std::env::var("RDMAKIT_GID_INDEX").ok().and_then(|v| v.parse().ok()) {
            return pick(i);
        }
        if port.link_layer != LINK_LAYER_ETHERNET {
            return pick(0);
        }
        let ipv4_mapped = |g: &[u8; 16]| g[..10] == [0; 10] && g[10..12] == [0xff, 0xff];
        let mut first_v2 = None;
        let mut first_mapped = None;
        for i in 0..port.gid_tbl_len.clamp(0, 255) as u8 {
            let Ok(g) = self.gid(port_num, i) else { continue };
            if g == [0; 16] {
                continue;
            }
            let kind = self.gid_kind(port_num, i);
            let mapped = ipv4_mapped(&g);
            if kind == Some(GidKind::RoceV2) && mapped {
                return GidChoice { index: i, kind };
            }
            if kind == Some(GidKind::RoceV2) && first_v2.is_none() {
                first_v2 = Some(GidChoice { index: i, kind });
            }
            if mapped && first_mapped.is_none() {
                first_mapped = Some(GidChoice { index: i, kind });
            }
        }
        first_v2.or(first_mapped).unwrap_or_else(|| pick(0))
    }

    /// Reads pending async events without blocking, recording CQ overruns.
    fn drain_async_events(&self) {
        loop {
            let mut ev = MaybeUninit::<sys::ibv_async_event>::zeroed();
            // SAFETY: the context is open; its async fd was made non-blocking at open, so
            // this returns -1 (EAGAIN) instead of blocking when no event is pending.
            let rc = unsafe { sys::ibv_get_async_event(self.ctx.as_ptr(), ev.as_mut_ptr()) };
            if rc != 0 {
                return;
            }
            // SAFETY: filled by a successful ibv_get_async_event. The event type is read as
            // a plain u32 so that a value unknown to rdma-sys's Rust enum is not UB.
            let kind = unsafe { ptr::addr_of!((*ev.as_ptr()).event_type).cast::<u32>().read() };
            if kind == EVENT_CQ_ERR {
                // SAFETY: for CQ events the element union holds the CQ pointer.
                let cq = unsafe { (*ev.as_ptr()).element.cq } as usize;
                self.overrun.lock().expect("overrun set").insert(cq);
            }
            tracing::warn!(device = %self.name, event = kind, "verbs async event");
            // SAFETY: acknowledges the event just read.
            unsafe { sys::ibv_ack_async_event(ev.as_mut_ptr()) };
        }
    }
}

/// A GID table entry chosen for connections (see [`Device::choose_gid`]).
#[derive(Clone, Copy, Debug)]
struct GidChoice {
    index: u8,
    kind: Option<GidKind>,
}

/// An open verbs device.
pub(crate) struct Context {
    dev: Arc<Device>,
}

impl Context {
    pub fn open(name: Option<&str>) -> Result<Context> {
        let list = DeviceList::get()?;
        let found = list.iter().find(|d| name.is_none_or(|n| device_name(*d) == n));
        let Some(dev) = found else {
            return Err(match name {
                Some(n) => Error::DeviceNotFound(n.to_owned()),
                None => Error::NoDevice { provider: "verbs", reason: "rdma-core lists no devices".into() },
            });
        };
        let dev_name = device_name(dev);
        // On mlx5, open with DEVX so that `crate::mlx5` can issue firmware commands; fall
        // back to a plain open (DEVX needs a capable kernel and device).
        let ctx = match mlx5dv::open_devx(dev) {
            Some(ctx) => ctx,
            // SAFETY: `dev` is from the live list; opening does not need the list afterwards.
            None => nonnull("ibv_open_device", unsafe { sys::ibv_open_device(dev) })?,
        };
        // SAFETY: the context is open; its async_fd is a valid descriptor we may set flags on.
        unsafe { conv::set_nonblocking((*ctx.as_ptr()).async_fd) }?;
        let mut device =
            Device { ctx, name: dev_name, max_qp_rd_atom: 1, overrun: Mutex::new(HashSet::new()) };
        let attr = query_device(&device)?;
        device.max_qp_rd_atom = attr.max_qp_rd_atom.min(255) as u8;
        Ok(Context { dev: Arc::new(device) })
    }

    pub fn query(&self) -> Result<DeviceAttr> {
        query_device(&self.dev)
    }

    /// The GID entry a connection on `port_num` uses (see `Device::choose_gid`).
    pub fn gid(&self, port_num: u8, explicit: Option<u8>) -> Result<GidEntry> {
        let port = self.dev.port(port_num)?;
        let choice = self.dev.choose_gid(port_num, explicit, &port);
        Ok(GidEntry { index: choice.index, gid: self.dev.gid(port_num, choice.index)?, kind: choice.kind })
    }

    pub fn alloc_pd(&self) -> Result<Pd> {
        // SAFETY: the context is open.
        let pd = nonnull("ibv_alloc_pd", unsafe { sys::ibv_alloc_pd(self.dev.ctx.as_ptr()) })?;
        Ok(Pd { inner: Arc::new(PdShared { pd, dev: self.dev.clone() }) })
    }

    pub fn create_cq(&self, cqe: u32) -> Result<Cq> {
        let ctx = self.dev.ctx.as_ptr();
        // SAFETY: the context is open.
        let channel = nonnull("ibv_create_comp_channel", unsafe { sys::ibv_create_comp_channel(ctx) })?;
        // SAFETY: the channel was just created; its fd is valid.
        if let Err(e) = unsafe { conv::set_nonblocking((*channel.as_ptr()).fd) } {
            // SAFETY: destroying the channel we created, unused.
            unsafe { sys::ibv_destroy_comp_channel(channel.as_ptr()) };
            return Err(e);
        }
        let cqe = i32::try_from(cqe).map_err(|_| Error::InvalidArgument("CQ size too large".into()))?;
        // SAFETY: open context, valid channel; no cq_context.
        let cq = unsafe { sys::ibv_create_cq(ctx, cqe, ptr::null_mut(), channel.as_ptr(), 0) };
        match nonnull("ibv_create_cq", cq) {
            Ok(cq) => Ok(Cq {
                cq,
                channel,
                dev: self.dev.clone(),
                last_event_check: std::sync::atomic::AtomicU64::new(0),
                created: std::time::Instant::now(),
            }),
            Err(e) => {
                // SAFETY: as above.
                unsafe { sys::ibv_destroy_comp_channel(channel.as_ptr()) };
                Err(e)
            }
        }
    }

    pub fn alloc_dm(&self, len: u64, max: u64) -> Result<Dm> {
        let mut attr = sys::ibv_alloc_dm_attr {
            length: len as usize,
            // 8-byte alignment: device-memory atomics need it.
            log_align_req: 3,
            comp_mask: 0,
        };
        // SAFETY: open context; `attr` is a valid, initialised attribute struct.
        let dm = unsafe { sys::ibv_alloc_dm(self.dev.ctx.as_ptr(), &mut attr) };
        let errno = || std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        // The header's inline sets EOPNOTSUPP when the provider has no `alloc_dm` at all.
        match NonNull::new(dm) {
            None => match errno() {
                libc::ENOMEM | libc::ENOSPC => {
                    Err(Error::DeviceMemoryExhausted { requested: len, available: 0, capacity: max })
                }
                libc::EOPNOTSUPP | libc::ENOSYS => {
                    Err(Error::Unsupported(format!("{}: device memory not supported", self.dev.name)))
                }
                e => Err(Error::errno("ibv_alloc_dm", e)),
            },
            Some(dm) => Ok(Dm { dm, dev: self.dev.clone() }),
        }
    }
}

fn query_device(dev: &Device) -> Result<DeviceAttr> {
    let ctx = dev.ctx.as_ptr();
    let input = sys::ibv_query_device_ex_input { comp_mask: 0 };
    let mut ex = MaybeUninit::<sys::ibv_device_attr_ex>::zeroed();
    // SAFETY: open context, valid input and zeroed output (rdma-sys's fallback path does not
    // clear it, so it must start zeroed).
    let rc = unsafe { sys::ibv_query_device_ex(ctx, &input, ex.as_mut_ptr()) };
    let (attr, max_dm_size) = if rc == 0 {
        // SAFETY: filled by a successful query (and zero-initialised before).
        let ex = unsafe { ex.assume_init() };
        (ex.orig_attr, ex.max_dm_size)
    } else {
        let mut a = MaybeUninit::<sys::ibv_device_attr>::zeroed();
        // SAFETY: open context, valid output.
        errno_ret("ibv_query_device", unsafe { sys::ibv_query_device(ctx, a.as_mut_ptr()) })?;
        // SAFETY: filled by a successful query.
        (unsafe { a.assume_init() }, 0)
    };
    let fw: Vec<u8> = attr.fw_ver.iter().take_while(|c| **c != 0).map(|c| *c as u8).collect();
    Ok(DeviceAttr {
        name: dev.name.clone(),
        provider: ProviderKind::Verbs,
        fw_ver: String::from_utf8_lossy(&fw).into_owned(),
        vendor_id: attr.vendor_id,
        max_mr_size: attr.max_mr_size,
        max_qp_wr: attr.max_qp_wr.max(0) as u32,
        max_cqe: attr.max_cqe.max(0) as u32,
        max_sge: attr.max_sge.max(0) as u32,
        max_qp_rd_atom: attr.max_qp_rd_atom.max(0) as u32,
        atomic_cap: attr.atomic_cap,
        max_dm_size,
        phys_port_cnt: attr.phys_port_cnt,
    })
}

struct PdShared {
    pd: NonNull<sys::ibv_pd>,
    dev: Arc<Device>,
}

// SAFETY: a PD is an immutable handle to a thread-safe context object.
unsafe impl Send for PdShared {}
// SAFETY: as above.
unsafe impl Sync for PdShared {}

impl Drop for PdShared {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd; every MR and QP holds an `Arc<PdShared>`.
        if unsafe { sys::ibv_dealloc_pd(self.pd.as_ptr()) } != 0 {
            tracing::error!(device = %self.dev.name, "ibv_dealloc_pd failed");
        }
    }
}

/// A protection domain.
pub(crate) struct Pd {
    inner: Arc<PdShared>,
}

impl Pd {
    /// Registers `len` bytes at `ptr` (`ibv_reg_mr`).
    ///
    /// # Safety
    /// The memory must stay allocated until the returned region is deregistered.
    pub unsafe fn reg_mr(&self, ptr: *mut u8, len: usize, access: AccessFlags) -> Result<Mr> {
        // SAFETY: valid PD; the caller guarantees the memory's lifetime.
        let mr = unsafe { sys::ibv_reg_mr(self.inner.pd.as_ptr(), ptr.cast(), len, access.bits() as i32) };
        Ok(Mr::new(nonnull("ibv_reg_mr", mr)?, self.inner.clone()))
    }

    /// Registers device memory zero-based (`ibv_reg_dm_mr`).
    pub fn reg_dm_mr(&self, dm: &Dm, offset: u64, len: u64, access: AccessFlags) -> Result<Mr> {
        let access = (access | AccessFlags::ZERO_BASED).bits();
        // SAFETY: valid PD and DM (the returned Mr keeps the DM's device alive; the safe
        // layer keeps the DM itself alive through the region).
        let mr = unsafe {
            sys::ibv_reg_dm_mr(self.inner.pd.as_ptr(), dm.dm.as_ptr(), offset, len as usize, access)
        };
        if mr.is_null() && std::io::Error::last_os_error().raw_os_error() == Some(libc::EOPNOTSUPP) {
            // The header's inline sets EOPNOTSUPP when the provider has no `reg_dm_mr`.
            return Err(Error::Unsupported("ibv_reg_dm_mr not supported by the provider".into()));
        }
        Ok(Mr::new(nonnull("ibv_reg_dm_mr", mr)?, self.inner.clone()))
    }

    /// Registers a dma-buf (`ibv_reg_dmabuf_mr`).
    ///
    /// # Safety
    /// See `ProtectionDomain::register_dmabuf`.
    pub unsafe fn reg_dmabuf_mr(
        &self,
        offset: u64,
        len: usize,
        iova: u64,
        fd: i32,
        access: AccessFlags,
    ) -> Result<Mr> {
        // SAFETY: valid PD; the caller guarantees the dma-buf's validity and lifetime.
        let mr = unsafe {
            sys::ibv_reg_dmabuf_mr(self.inner.pd.as_ptr(), offset, len, iova, fd, access.bits() as i32)
        };
        Ok(Mr::new(nonnull("ibv_reg_dmabuf_mr", mr)?, self.inner.clone()))
    }

    pub fn create_qp(&self, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp> {
        // SAFETY: an all-zero ibv_qp_init_attr is a valid value (null pointers, zero caps).
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.cq.as_ptr();
        init.recv_cq = recv_cq.cq.as_ptr();
        init.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap = sys::ibv_qp_cap {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: caps.max_send_sge,
            max_recv_sge: caps.max_recv_sge,
            max_inline_data: caps.max_inline_data,
        };
        // SAFETY: valid PD and CQs of the same device; `init` is initialised.
        let qp = nonnull("ibv_create_qp", unsafe { sys::ibv_create_qp(self.inner.pd.as_ptr(), &mut init) })?;
        // ibv_create_qp writes back the capabilities it granted.
        let granted = QpCaps {
            max_send_wr: init.cap.max_send_wr,
            max_recv_wr: init.cap.max_recv_wr,
            max_send_sge: init.cap.max_send_sge,
            max_recv_sge: init.cap.max_recv_sge,
            max_inline_data: init.cap.max_inline_data,
        };
        Ok(Qp {
            qp,
            caps: granted,
            destroyed: AtomicBool::new(false),
            _pd: self.inner.clone(),
            _cqs: (send_cq.dev.clone(), recv_cq.dev.clone()),
        })
    }
}

/// A registered memory region.
pub(crate) struct Mr {
    mr: NonNull<sys::ibv_mr>,
    done: AtomicBool,
    _pd: Arc<PdShared>,
}

// SAFETY: an MR handle is immutable after registration; deregistration is guarded by
// `done`.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    fn new(mr: NonNull<sys::ibv_mr>, pd: Arc<PdShared>) -> Mr {
        Mr { mr, done: AtomicBool::new(false), _pd: pd }
    }

    pub fn lkey(&self) -> u32 {
        // SAFETY: valid until deregistered, which only `deregister`/drop do.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr.as_ptr()).rkey }
    }

    /// `ibv_dereg_mr`; true on success (or if already done). On failure the NIC may still
    /// access the memory, and the caller must not free it.
    pub fn deregister(&self) -> bool {
        if self.done.swap(true, Ordering::AcqRel) {
            return true;
        }
        // SAFETY: registered, and deregistered once (guarded by `done`).
        let rc = unsafe { sys::ibv_dereg_mr(self.mr.as_ptr()) };
        if rc != 0 {
            tracing::error!(rc, "ibv_dereg_mr failed");
        }
        rc == 0
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        self.deregister();
    }
}

/// A completion queue with its own completion channel.
pub(crate) struct Cq {
    cq: NonNull<sys::ibv_cq>,
    channel: NonNull<sys::ibv_comp_channel>,
    dev: Arc<Device>,
    /// When the async event queue was last read for overruns (ns since `created`).
    last_event_check: std::sync::atomic::AtomicU64,
    created: std::time::Instant,
}

// SAFETY: ibv_poll_cq, ibv_req_notify_cq and channel reads are thread-safe in rdma-core
// (providers lock the CQ); the safe layer also serialises polling.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    pub fn capacity(&self) -> u32 {
        // SAFETY: valid CQ.
        unsafe { (*self.cq.as_ptr()).cqe }.max(0) as u32
    }

    pub fn fd(&self) -> i32 {
        // SAFETY: valid channel.
        unsafe { (*self.channel.as_ptr()).fd }
    }

    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        const CHUNK: usize = 16;
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done).min(CHUNK);
            let mut wcs = MaybeUninit::<[sys::ibv_wc; CHUNK]>::uninit();
            // SAFETY: valid CQ; room for `want` ibv_wc entries.
            let n = unsafe { sys::ibv_poll_cq(self.cq.as_ptr(), want as i32, wcs.as_mut_ptr().cast()) };
            if n < 0 {
                return Err(Error::Os { call: "ibv_poll_cq", source: std::io::Error::from_raw_os_error(-n) });
            }
            let base = wcs.as_ptr().cast::<sys::ibv_wc>();
            for i in 0..n as usize {
                // SAFETY: ibv_poll_cq initialised the first `n` entries.
                let wc = unsafe { &*base.add(i) };
                out[done + i] = convert_wc(wc);
            }
            done += n as usize;
            if (n as usize) < want {
                break;
            }
        }
        if done == 0 && self.event_check_due() {
            // An overrun is reported by an async event, not by poll: check for it when the
            // queue looks empty (a lost completion would otherwise go unnoticed), at most
            // once a millisecond so that a spinning poller does not make a syscall per spin.
            self.dev.drain_async_events();
            if self.dev.overrun.lock().expect("overrun set").contains(&(self.cq.as_ptr() as usize)) {
                return Err(Error::CqOverrun { capacity: self.capacity() });
            }
        }
        Ok(done)
    }

    fn event_check_due(&self) -> bool {
        let now = self.created.elapsed().as_nanos() as u64;
        let last = self.last_event_check.load(Ordering::Relaxed);
        now.saturating_sub(last) >= 1_000_000
            && self.last_event_check.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }

    pub fn req_notify(&self) -> Result<()> {
        // SAFETY: valid CQ.
        errno_ret("ibv_req_notify_cq", unsafe { sys::ibv_req_notify_cq(self.cq.as_ptr(), 0) })
    }

    /// Reads and acknowledges every pending channel event.
    pub fn take_events(&self) {
        let mut n = 0u32;
        loop {
            let mut cq = ptr::null_mut();
            let mut ctx = ptr::null_mut();
            // SAFETY: valid channel (non-blocking fd); out-pointers are locals.
            if unsafe { sys::ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut ctx) } != 0 {
                break;
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: acknowledges exactly the events read from this CQ's own channel.
            unsafe { sys::ibv_ack_cq_events(self.cq.as_ptr(), n) };
        }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        self.take_events();
        // Acknowledge any async event still naming this CQ (destroy would wait for it).
        self.dev.drain_async_events();
        // SAFETY: created by ibv_create_cq; QPs using it hold the public CQ, so none is
        // left; all events are acknowledged (destroy would wait for them otherwise).
        if unsafe { sys::ibv_destroy_cq(self.cq.as_ptr()) } != 0 {
            tracing::error!("ibv_destroy_cq failed");
        } else {
            // The overrun flag is keyed by address: it must not outlive the CQ, or a new CQ
            // allocated at the same address would report an overrun it never had.
            self.dev.overrun.lock().expect("overrun set").remove(&(self.cq.as_ptr() as usize));
        }
        // SAFETY: its only CQ is destroyed.
        unsafe { sys::ibv_destroy_comp_channel(self.channel.as_ptr()) };
    }
}

fn convert_wc(wc: &sys::ibv_wc) -> WorkCompletion {
    let with_imm = wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
    WorkCompletion {
        wr_id: wc.wr_id,
        status: WcStatus(wc.status),
        opcode: WcOpcode(wc.opcode),
        byte_len: wc.byte_len,
        // SAFETY: reading the immediate member of a plain-integer union.
        imm: with_imm.then(|| u32::from_be(unsafe { wc.__bindgen_anon_1.imm_data })),
        qp_num: wc.qp_num,
        vendor_err: wc.vendor_err,
    }
}

/// Device memory.
pub(crate) struct Dm {
    dm: NonNull<sys::ibv_dm>,
    dev: Arc<Device>,
}

// SAFETY: ibv_memcpy_{to,from}_dm are thread-safe provider calls on an immutable handle.
unsafe impl Send for Dm {}
// SAFETY: as above.
unsafe impl Sync for Dm {}

impl Dm {
    pub fn copy_to(&self, offset: u64, data: &[u8]) -> Result<()> {
        // SAFETY: valid DM; bounds checked by the safe layer; `data` is a valid source.
        errno_ret("ibv_memcpy_to_dm", unsafe {
            sys::ibv_memcpy_to_dm(self.dm.as_ptr(), offset, data.as_ptr().cast(), data.len())
        })
    }

    pub fn copy_from(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        // SAFETY: as above, into a valid destination.
        errno_ret("ibv_memcpy_from_dm", unsafe {
            sys::ibv_memcpy_from_dm(out.as_mut_ptr().cast(), self.dm.as_ptr(), offset, out.len())
        })
    }
}

impl Drop for Dm {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_dm; regions on it hold the public DM, so none is left.
        if unsafe { sys::ibv_free_dm(self.dm.as_ptr()) } != 0 {
            tracing::error!(device = %self.dev.name, "ibv_free_dm failed");
        }
    }
}

/// An RC queue pair.
pub(crate) struct Qp {
    qp: NonNull<sys::ibv_qp>,
    caps: QpCaps,
    destroyed: AtomicBool,
    _pd: Arc<PdShared>,
    _cqs: (Arc<Device>, Arc<Device>),
}

// SAFETY: ibv_post_send/recv, ibv_modify_qp and ibv_query_qp are thread-safe in rdma-core;
// destruction is guarded by `destroyed` and happens only from the owner's Drop.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl Qp {
    fn ptr(&self) -> *mut sys::ibv_qp {
        self.qp.as_ptr()
    }

    fn dev(&self) -> &Device {
        &self._pd.dev
    }

    pub fn qpn(&self) -> u32 {
        // SAFETY: valid QP.
        unsafe { (*self.ptr()).qp_num }
    }

    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    pub fn state(&self) -> QpState {
        // SAFETY: all-zero attribute structs are valid values.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        let mask = sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32;
        // SAFETY: valid QP; valid out-structs.
        if unsafe { sys::ibv_query_qp(self.ptr(), &mut attr, mask, &mut init) } != 0 {
            return QpState::Unknown(u32::MAX);
        }
        conv::qp_state(attr.qp_state)
    }

    fn port(&self, port_num: u8) -> Result<sys::ibv_port_attr> {
        self.dev().port(port_num)
    }

    fn gid(&self, port_num: u8, index: u8) -> Result<[u8; 16]> {
        self.dev().gid(port_num, index)
    }

    fn gid_index(&self, opts: &ConnectOptions, port: &sys::ibv_port_attr) -> u8 {
        self.dev().choose_gid(opts.port_num, opts.gid_index, port).index
    }

    pub fn endpoint(&self, opts: &ConnectOptions, psn: u32) -> Result<Endpoint> {
        let port = self.port(opts.port_num)?;
        let index = self.gid_index(opts, &port);
        Ok(Endpoint {
            provider: ProviderKind::Verbs,
            lid: port.lid,
            gid: self.gid(opts.port_num, index)?,
            qp_num: self.qpn(),
            psn,
        })
    }

    fn modify(&self, attr: &mut sys::ibv_qp_attr, mask: u32, what: &'static str) -> Result<()> {
        // SAFETY: valid QP; `attr` initialised for the fields named in `mask`.
        let rc = unsafe { sys::ibv_modify_qp(self.ptr(), attr, mask as i32) };
        errno_ret("ibv_modify_qp", rc).map_err(|e| match e {
            Error::Os { source, .. } => Error::Os {
                call: "ibv_modify_qp",
                source: std::io::Error::new(source.kind(), format!("{what}: {source}")),
            },
            e => e,
        })
    }

    pub fn modify_to_init(&self, opts: &ConnectOptions) -> Result<()> {
        opts.validate()?;
        use sys::ibv_qp_attr_mask as m;
        // SAFETY: all-zero is a valid attribute struct.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = opts.pkey_index.unwrap_or(0);
        attr.port_num = opts.port_num;
        attr.qp_access_flags = (opts.access & !AccessFlags::ZERO_BASED).bits();
        let mask = m::IBV_QP_STATE.0 | m::IBV_QP_PKEY_INDEX.0 | m::IBV_QP_PORT.0 | m::IBV_QP_ACCESS_FLAGS.0;
        self.modify(&mut attr, mask, "RESET -> INIT")
    }

    pub fn modify_to_rtr(&self, remote: &Endpoint, opts: &ConnectOptions) -> Result<()> {
        if remote.provider != ProviderKind::Verbs {
            return Err(Error::InvalidArgument(format!(
                "cannot connect a verbs QP to a {} endpoint",
                remote.provider
            )));
        }
        use sys::ibv_qp_attr_mask as m;
        let port = self.port(opts.port_num)?;
        // SAFETY: all-zero is a valid attribute struct.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = opts.mtu.map_or(port.active_mtu, |mtu| mtu as u32);
        attr.dest_qp_num = remote.qp_num;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = opts.max_rd_atomic.min(self.dev().max_qp_rd_atom).max(1);
        attr.min_rnr_timer = opts.min_rnr_timer;
        attr.ah_attr.port_num = opts.port_num;
        attr.ah_attr.dlid = remote.lid;
        if port.link_layer == LINK_LAYER_ETHERNET || remote.gid != [0; 16] {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = sys::ibv_gid { raw: remote.gid };
            attr.ah_attr.grh.sgid_index = self.gid_index(opts, &port);
            attr.ah_attr.grh.hop_limit = 64;
        }
        // Service level and GRH fields the caller chose (the same helper as the CM path).
        conv::apply_path_options(&mut attr, opts);
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_AV.0
            | m::IBV_QP_PATH_MTU.0
            | m::IBV_QP_DEST_QPN.0
            | m::IBV_QP_RQ_PSN.0
            | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
            | m::IBV_QP_MIN_RNR_TIMER.0;
        self.modify(&mut attr, mask, "INIT -> RTR")
    }

    pub fn modify_to_rts(&self, opts: &ConnectOptions, psn: u32) -> Result<()> {
        use sys::ibv_qp_attr_mask as m;
        // SAFETY: all-zero is a valid attribute struct.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = psn;
        attr.timeout = opts.timeout;
        attr.retry_cnt = opts.retry_cnt.min(7);
        attr.rnr_retry = opts.rnr_retry.min(7);
        attr.max_rd_atomic = opts.max_rd_atomic.min(self.dev().max_qp_rd_atom).max(1);
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_TIMEOUT.0
            | m::IBV_QP_RETRY_CNT.0
            | m::IBV_QP_RNR_RETRY.0
            | m::IBV_QP_SQ_PSN.0
            | m::IBV_QP_MAX_QP_RD_ATOMIC.0;
        self.modify(&mut attr, mask, "RTR -> RTS")
    }

    pub fn modify_to_err(&self) -> Result<()> {
        // SAFETY: all-zero is a valid attribute struct.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut attr, sys::ibv_qp_attr_mask::IBV_QP_STATE.0, "-> ERR")
    }

    /// Moves to ERR and destroys the QP. True if it is destroyed (now or before): the NIC
    /// then no longer touches its buffers.
    pub fn destroy(&self) -> bool {
        if self.destroyed.load(Ordering::Acquire) {
            return true;
        }
        let _ = self.modify_to_err();
        // SAFETY: created by ibv_create_qp; destroyed once (flag set only on success).
        let rc = unsafe { sys::ibv_destroy_qp(self.ptr()) };
        if rc == 0 {
            self.destroyed.store(true, Ordering::Release);
        }
        rc == 0
    }

    pub fn post_send(&self, raws: &[RawSendWr<'_>]) -> std::result::Result<(), (usize, Error)> {
        const CHUNK: usize = 16;
        let mut posted = 0;
        for chunk in raws.chunks(CHUNK) {
            // Only the `n` entries used are initialised (a single post writes one, not 16).
            let mut wrs = [const { MaybeUninit::<sys::ibv_send_wr>::uninit() }; CHUNK];
            let mut sges = [const { MaybeUninit::<sys::ibv_sge>::uninit() }; CHUNK];
            let n = chunk.len();
            let wrs_ptr = wrs.as_mut_ptr().cast::<sys::ibv_send_wr>();
            let sges_ptr = sges.as_mut_ptr().cast::<sys::ibv_sge>();
            for (i, raw) in chunk.iter().enumerate() {
                // SAFETY: `i < n <= CHUNK`; all-zero ibv_send_wr / ibv_sge are valid values
                // (null pointers, zeros), written before the references to them are made.
                let (wr, sge) = unsafe {
                    wrs_ptr.add(i).write(std::mem::zeroed());
                    sges_ptr.add(i).write(std::mem::zeroed());
                    (&mut *wrs_ptr.add(i), &mut *sges_ptr.add(i))
                };
                conv::fill_send_wr(wr, sge, raw);
                wr.sg_list = sges_ptr.wrapping_add(i);
                wr.next = if i + 1 < n { wrs_ptr.wrapping_add(i + 1) } else { ptr::null_mut() };
            }
            let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
            // SAFETY: valid QP; a well-formed list of `n` requests whose SGEs point into
            // registered memory kept alive by the safe layer's in-flight table, or to inline
            // data that ibv_post_send copies before returning.
            let rc = unsafe { sys::ibv_post_send(self.ptr(), wrs_ptr, &mut bad) };
            if rc != 0 {
                return Err((posted + bad_index(bad, wrs_ptr, n), Error::errno("ibv_post_send", rc)));
            }
            posted += n;
        }
        Ok(())
    }

    pub fn post_recv(&self, raws: &[RawRecvWr]) -> std::result::Result<(), (usize, Error)> {
        const CHUNK: usize = 16;
        let mut posted = 0;
        for chunk in raws.chunks(CHUNK) {
            // Only the `n` entries used are initialised.
            let mut wrs = [const { MaybeUninit::<sys::ibv_recv_wr>::uninit() }; CHUNK];
            let mut sges = [const { MaybeUninit::<sys::ibv_sge>::uninit() }; CHUNK];
            let n = chunk.len();
            let wrs_ptr = wrs.as_mut_ptr().cast::<sys::ibv_recv_wr>();
            let sges_ptr = sges.as_mut_ptr().cast::<sys::ibv_sge>();
            for (i, raw) in chunk.iter().enumerate() {
                let (sg_list, num_sge) = match raw.sge {
                    Some(s) => {
                        // SAFETY: `i < n <= CHUNK`: in bounds of `sges`.
                        unsafe {
                            sges_ptr.add(i).write(sys::ibv_sge { addr: s.addr, length: s.len, lkey: s.lkey })
                        };
                        (sges_ptr.wrapping_add(i), 1)
                    }
                    None => (ptr::null_mut(), 0),
                };
                let next = if i + 1 < n { wrs_ptr.wrapping_add(i + 1) } else { ptr::null_mut() };
                // SAFETY: `i < n <= CHUNK`: in bounds of `wrs`; every field is written.
                unsafe {
                    wrs_ptr.add(i).write(sys::ibv_recv_wr { wr_id: raw.wr_id, next, sg_list, num_sge })
                };
            }
            let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
            // SAFETY: valid QP; SGEs point into registered memory kept alive by the safe
            // layer's in-flight table.
            let rc = unsafe { sys::ibv_post_recv(self.ptr(), wrs_ptr, &mut bad) };
            if rc != 0 {
                return Err((posted + bad_index(bad, wrs_ptr, n), Error::errno("ibv_post_recv", rc)));
            }
            posted += n;
        }
        Ok(())
    }
}

/// Index of `bad` (the first request a provider refused) in the list at `base` of `n`
/// requests; pointer arithmetic on addresses only, nothing is dereferenced.
fn bad_index<T>(bad: *mut T, base: *mut T, n: usize) -> usize {
    if bad.is_null() {
        return 0;
    }
    ((bad as usize).saturating_sub(base as usize) / size_of::<T>()).min(n)
}

impl Drop for Qp {
    fn drop(&mut self) {
        if !self.destroy() {
            tracing::error!(qp_num = self.qpn(), "ibv_destroy_qp failed");
        }
    }
}
