//! RC queue pairs: state transitions, endpoints, posting.

use std::mem::MaybeUninit;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rdmakit_sys as sys;

use super::conv::{errno_ret, nonnull};
use super::*;
use crate::error::{Error, Result};
use crate::raw::{RawRecvWr, RawSendWr};
use crate::types::{AccessFlags, ConnectOptions, ProviderKind, QpAddress, QpCaps, QpState};

/// An RC queue pair.
pub(crate) struct Qp {
    pub(super) qp: NonNull<sys::ibv_qp>,
    pub(super) caps: QpCaps,
    pub(super) destroyed: AtomicBool,
    pub(super) _pd: Arc<PdShared>,
    pub(super) _cqs: (Arc<Device>, Arc<Device>),
}

// SAFETY: ibv_post_send/recv, ibv_modify_qp and ibv_query_qp are thread-safe in rdma-core;
// destruction is guarded by `destroyed` and happens only from the owner's Drop.
unsafe impl Send for Qp {}
// SAFETY: every `&Qp` method is a thread-safe libibverbs call (posting, modify, query) or reads
// immutable data; destroy is idempotent through the `destroyed` flag.
unsafe impl Sync for Qp {}

impl Qp {
    /// Creates an RC QP in `pd` on the two CQs (`ibv_create_qp`), with the capacities granted.
    pub fn create(pd: &Pd, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp> {
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
        let qp = nonnull("ibv_create_qp", unsafe { sys::ibv_create_qp(pd.inner.pd.as_ptr(), &mut init) })?;
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
            _pd: pd.inner.clone(),
            _cqs: (send_cq.dev.clone(), recv_cq.dev.clone()),
        })
    }

    pub(super) fn ptr(&self) -> *mut sys::ibv_qp {
        self.qp.as_ptr()
    }

    pub(super) fn dev(&self) -> &Device {
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
        // SAFETY: ibv_qp_init_attr is plain C data (integers, pointers): all-zero is a valid value.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        let mask = sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32;
        // SAFETY: valid QP; valid out-structs.
        if unsafe { sys::ibv_query_qp(self.ptr(), &mut attr, mask, &mut init) } != 0 {
            return QpState::Unknown(u32::MAX);
        }
        conv::qp_state(attr.qp_state)
    }

    pub(super) fn port(&self, port_num: u8) -> Result<sys::ibv_port_attr> {
        self.dev().port(port_num)
    }

    pub(super) fn gid(&self, port_num: u8, index: u8) -> Result<[u8; 16]> {
        self.dev().gid(port_num, index)
    }

    pub(super) fn gid_index(&self, opts: &ConnectOptions, port: &sys::ibv_port_attr) -> u8 {
        self.dev().choose_gid(opts.port_num, opts.gid_index, port).index
    }

    pub fn address(&self, opts: &ConnectOptions, psn: u32) -> Result<QpAddress> {
        let port = self.port(opts.port_num)?;
        let index = self.gid_index(opts, &port);
        Ok(QpAddress {
            provider: ProviderKind::Verbs,
            lid: port.lid,
            gid: self.gid(opts.port_num, index)?,
            qp_num: self.qpn(),
            psn,
            // The connection token is the soft NIC's; rdma-core ignores it.
            token: [0; 16],
        })
    }

    pub(super) fn modify(&self, attr: &mut sys::ibv_qp_attr, mask: u32, what: &'static str) -> Result<()> {
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

    pub fn modify_to_rtr(&self, remote: &QpAddress, opts: &ConnectOptions) -> Result<()> {
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
        // At least 1 (a read needs a responder resource), within the device's responder
        // limit (a device reporting 0 gets 0: it serves no reads).
        attr.max_dest_rd_atomic = opts.max_rd_atomic.max(1).min(self.dev().max_qp_rd_atom);
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
        // The initiator depth, within the device's initiator limit (`max_qp_init_rd_atom`).
        attr.max_rd_atomic = opts.max_rd_atomic.max(1).min(self.dev().max_qp_init_rd_atom);
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
            errno_ret("ibv_post_send", rc).map_err(|e| (posted + bad_index(bad, wrs_ptr, n), e))?;
            posted += n;
        }
        Ok(())
    }

    /// Posts a request filled in once (`t`) as provider request `wr_id`, with `inline` as
    /// the payload of an inline request: one copy of the template on the stack, two fields
    /// set, one `ibv_post_send`.
    pub fn post_prepared(
        &self,
        t: &SendTemplate,
        wr_id: u64,
        inline: Option<&[u8]>,
    ) -> std::result::Result<(), (usize, Error)> {
        let mut wr = t.wr;
        let mut sge = t.sge;
        wr.wr_id = wr_id;
        if let Some(data) = inline {
            sge.addr = data.as_ptr() as u64;
            sge.length = data.len() as u32;
            wr.num_sge = i32::from(!data.is_empty());
        }
        wr.sg_list = &mut sge;
        wr.next = ptr::null_mut();
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: valid QP; one request whose SGE is on this stack frame and points into
        // registered memory kept alive by the safe layer's in-flight table, or to inline data
        // that ibv_post_send copies before returning.
        let rc = unsafe { sys::ibv_post_send(self.ptr(), &mut wr, &mut bad) };
        errno_ret("ibv_post_send", rc).map_err(|e| (0, e))
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
            errno_ret("ibv_post_recv", rc).map_err(|e| (posted + bad_index(bad, wrs_ptr, n), e))?;
            posted += n;
        }
        Ok(())
    }
}

/// Index of `bad` (the first request a provider refused) in the list at `base` of `n`
/// requests; pointer arithmetic on addresses only, nothing is dereferenced.
pub(super) fn bad_index<T>(bad: *mut T, base: *mut T, n: usize) -> usize {
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

/// A send request in `struct ibv_send_wr` form, filled in once for many posts
/// ([`crate::PreparedSend`]).
pub(crate) struct SendTemplate {
    wr: sys::ibv_send_wr,
    sge: sys::ibv_sge,
}

// SAFETY: the template's pointers (`sg_list`, `next`, an inline SGE's address) are null:
// each post sets them in its own copy on its stack. The rest is plain integers.
unsafe impl Send for SendTemplate {}
// SAFETY: as above; posts only copy the template.
unsafe impl Sync for SendTemplate {}

impl SendTemplate {
    /// Fills in `raw` (its inline bytes, if any, only make it an inline request: each post
    /// gives its own).
    pub fn new(raw: &RawSendWr<'_>) -> SendTemplate {
        // SAFETY: all-zero ibv_send_wr / ibv_sge are valid values (null pointers, zeros).
        let (mut wr, mut sge): (sys::ibv_send_wr, sys::ibv_sge) =
            unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        conv::fill_send_wr(&mut wr, &mut sge, raw);
        if raw.inline.is_some() {
            sge.addr = 0;
        }
        wr.sg_list = ptr::null_mut();
        wr.next = ptr::null_mut();
        SendTemplate { wr, sge }
    }
}
