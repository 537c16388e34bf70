//! The device: listing, opening (`ibv_open_device`), attributes, ports and GIDs, async events.

use std::collections::HashSet;
use std::ffi::CStr;
use std::mem::MaybeUninit;
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex};

use rdmakit_sys as sys;

use super::conv::{errno_ret, nonnull, released};
use super::*;
use crate::error::{Error, Result};
use crate::types::{DeviceAttr, GidEntry, GidKind, ProviderKind};

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
pub(super) struct DeviceList {
    pub(super) list: NonNull<*mut sys::ibv_device>,
    pub(super) len: usize,
}

impl DeviceList {
    pub(super) fn get() -> Result<DeviceList> {
        let mut n = 0;
        // SAFETY: `n` is a valid out-pointer; the call allocates the list it returns.
        let list = unsafe { sys::ibv_get_device_list(&mut n) };
        match conv::nonnull_os(list) {
            Ok(list) => Ok(DeviceList { list, len: n.max(0) as usize }),
            Err(os) => {
                Err(Error::NoDevice { provider: "verbs", reason: format!("ibv_get_device_list: {os}") })
            }
        }
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = *mut sys::ibv_device> + '_ {
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

pub(super) fn device_name(dev: *mut sys::ibv_device) -> String {
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
pub(super) struct Device {
    pub(super) ctx: NonNull<sys::ibv_context>,
    pub(super) name: String,
    /// Responder depth: most RDMA reads and atomics a QP of this device serves at once
    /// (`max_dest_rd_atomic`'s limit).
    pub(super) max_qp_rd_atom: u8,
    /// Initiator depth: most a QP of this device has outstanding (`max_rd_atomic`'s limit).
    pub(super) max_qp_init_rd_atom: u8,
    /// CQs that reported `IBV_EVENT_CQ_ERR` (overrun), by address.
    pub(super) overrun: Mutex<HashSet<usize>>,
}

// SAFETY: libibverbs contexts are thread-safe (rdma-core documents verbs calls as safe to
// make from several threads); the only Rust-side state is behind a mutex.
unsafe impl Send for Device {}
// SAFETY: `&Device` makes libibverbs context calls, thread-safe in rdma-core, and touches its
// own state only through the overrun set's mutex.
unsafe impl Sync for Device {}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device; every child holds an `Arc<Device>`, so all
        // were destroyed before this runs.
        released("ibv_close_device", &self.name, unsafe { sys::ibv_close_device(self.ctx.as_ptr()) });
    }
}

impl Device {
    pub(super) fn port(&self, port_num: u8) -> Result<sys::ibv_port_attr> {
        let mut pa = MaybeUninit::<sys::ibv_port_attr>::zeroed();
        // SAFETY: open context, valid out-struct (zeroed, so fields an older kernel does not
        // fill read as 0).
        errno_ret("ibv_query_port", unsafe {
            sys::___ibv_query_port(self.ctx.as_ptr(), port_num, pa.as_mut_ptr())
        })?;
        // SAFETY: filled by a successful query.
        Ok(unsafe { pa.assume_init() })
    }

    pub(super) fn gid(&self, port_num: u8, index: u8) -> Result<[u8; 16]> {
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
    pub(super) fn gid_kind(&self, port_num: u8, index: u8) -> Option<GidKind> {
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
        Some(kind_of(unsafe { entry.assume_init() }.gid_type))
    }

    /// The port's non-empty GID entries (index, GID, type) from one `ibv_query_gid_table`
    /// call, instead of two queries per index; `None` where the kernel cannot list the table.
    fn gid_table(&self, port_num: u8, tbl_len: usize) -> Option<Vec<GidRow>> {
        // The call lists every port's entries; start with room for two ports, then grow.
        let mut cap = tbl_len.max(1) * 2;
        for _ in 0..4 {
            let mut entries: Vec<sys::ibv_gid_entry> = Vec::with_capacity(cap);
            // SAFETY: open context; `entries` has room for `cap` entries, which the call
            // writes at most; flags 0.
            let n = unsafe { sys::ibv_query_gid_table(self.ctx.as_ptr(), entries.as_mut_ptr(), cap, 0) };
            if let Ok(n) = usize::try_from(n) {
                // SAFETY: the call initialised the first `n` (<= `cap`) entries.
                unsafe { entries.set_len(n.min(cap)) };
                let listed = entries.iter().filter(|e| e.port_num == u32::from(port_num));
                return Some(
                    listed
                        .filter_map(|e| {
                            // SAFETY: `raw` covers the whole GID union.
                            let gid = unsafe { e.gid.raw };
                            Some((u8::try_from(e.gid_index).ok()?, gid, Some(kind_of(e.gid_type))))
                        })
                        .collect(),
                );
            }
            cap *= 2;
        }
        None
    }

    /// The GID a connection uses: `explicit`, then `RDMAKIT_GID_INDEX`, then on RoCE the first
    /// RoCE v2 entry with an IPv4-mapped address, then the first RoCE v2 entry, then (kernels
    /// that cannot report types) the first IPv4-mapped entry; on InfiniBand index 0. RoCE v2
    /// is what perftest, UCX and rdma_cm users expect; on ConnectX the v1 and v2 entries of an
    /// address alternate, so "the first IPv4-mapped entry" alone would pick v1.
    pub(super) fn choose_gid(
        &self,
        port_num: u8,
        explicit: Option<u8>,
        port: &sys::ibv_port_attr,
    ) -> GidChoice {
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
        let tbl_len = port.gid_tbl_len.clamp(0, 255) as usize;
        // One table read; kernels without it are asked entry by entry.
        let entries = self.gid_table(port_num, tbl_len).unwrap_or_else(|| {
            (0..tbl_len as u8)
                .filter_map(|i| Some((i, self.gid(port_num, i).ok()?, self.gid_kind(port_num, i))))
                .collect()
        });
        let mut first_v2 = None;
        let mut first_mapped = None;
        for (i, g, kind) in entries {
            if g == [0; 16] {
                continue;
            }
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
    pub(super) fn drain_async_events(&self) {
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
pub(super) struct GidChoice {
    pub(super) index: u8,
    pub(super) kind: Option<GidKind>,
}

/// An open verbs device.
pub(crate) struct Context {
    pub(super) dev: Arc<Device>,
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
        // Owned (closed on drop) before anything else can fail.
        let mut device = Device {
            ctx,
            name: dev_name,
            max_qp_rd_atom: 1,
            max_qp_init_rd_atom: 1,
            overrun: Mutex::new(HashSet::new()),
        };
        // SAFETY: the context is open; its async_fd is a valid descriptor we may set flags on.
        unsafe { conv::set_nonblocking((*device.ctx.as_ptr()).async_fd) }?;
        let attr = query_device(&device)?;
        device.max_qp_rd_atom = attr.max_qp_rd_atom.min(255) as u8;
        device.max_qp_init_rd_atom = attr.max_qp_init_rd_atom.min(255) as u8;
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

    /// `ibv_alloc_pd` (see [`Pd::alloc`]); for the tests of `rdma::cm`.
    #[cfg(test)]
    pub fn alloc_pd(&self) -> Result<Pd> {
        Pd::alloc(self)
    }

    /// `ibv_create_cq` (see [`Cq::create`]); for the tests of `rdma::cm`.
    #[cfg(test)]
    pub fn create_cq(&self, cqe: u32) -> Result<Cq> {
        Cq::create(self, cqe)
    }
}

pub(super) fn query_device(dev: &Device) -> Result<DeviceAttr> {
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
        max_qp_init_rd_atom: attr.max_qp_init_rd_atom.max(0) as u32,
        atomic_cap: attr.atomic_cap,
        max_dm_size,
        phys_port_cnt: attr.phys_port_cnt,
    })
}

/// A GID table entry: index, GID, and its type when the kernel says.
type GidRow = (u8, [u8; 16], Option<GidKind>);

/// An `ibv_gid_type` value as rdmakit's [`GidKind`].
fn kind_of(gid_type: u32) -> GidKind {
    match gid_type {
        sys::IBV_GID_TYPE_IB => GidKind::Ib,
        sys::IBV_GID_TYPE_ROCE_V1 => GidKind::RoceV1,
        sys::IBV_GID_TYPE_ROCE_V2 => GidKind::RoceV2,
        other => GidKind::Other(other),
    }
}
