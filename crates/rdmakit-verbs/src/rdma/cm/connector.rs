//! The active side of rdma_cm: resolving an address and route, then connecting.

use std::net::SocketAddr;
use std::ptr;
use std::time::Duration;

use rdmakit_sys as sys;
use sys::rdma_cm_event_type as ev;

use super::{CmConn, CmId, Deadline, Event, abort_qp, cm_ret, conn_param, to_sockaddr};
use crate::error::Result;
use crate::rdma::Qp;
use crate::types::ConnectOptions;

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
        let limits = self.start_connect(qp, opts, private_data)?;
        let response = self.cm.wait_for(ev::RDMA_CM_EVENT_CONNECT_RESPONSE, "rdma_connect", &deadline)?;
        self.establish(qp, opts, limits, response)
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
        let limits = self.start_connect(qp, opts, private_data)?;
        let response = self.cm.wait_for_async(ev::RDMA_CM_EVENT_CONNECT_RESPONSE, "rdma_connect").await?;
        self.establish(qp, opts, limits, response)
    }

    /// INIT and `rdma_connect`; returns the device's read and atomic limits
    /// (`CmId::rd_atomic_limits`), which the reply's depths are held to.
    fn start_connect(&self, qp: &Qp, opts: &ConnectOptions, private_data: &[u8]) -> Result<(u8, u8)> {
        let cm = &self.cm;
        cm.check_qp(qp)?;
        let (max_rd, max_init) = cm.rd_atomic_limits()?;
        let resp = opts.max_rd_atomic.min(max_rd);
        let init = opts.max_rd_atomic.min(max_init);
        let mut param = conn_param(qp, private_data, resp, init, opts)?;
        cm.qp_to_init(qp, opts)?;
        // SAFETY: live id with a resolved route; `param` and the private data it points to
        // outlive the call, which copies them.
        cm_ret("rdma_connect", unsafe { sys::rdma_connect(cm.ptr(), &mut param) })?;
        Ok((max_rd, max_init))
    }

    /// After the CONNECT_RESPONSE: RTR, RTS and `rdma_establish`. The reply's read and
    /// atomic depths are the peer's word: held to what this side asked for (as the passive
    /// side holds a request's), not taken up to the device's maximum.
    fn establish(
        self,
        qp: &Qp,
        opts: &ConnectOptions,
        (max_rd, max_init): (u8, u8),
        response: Event,
    ) -> Result<(CmConn, Vec<u8>)> {
        let cm = self.cm;
        let established = (|| {
            let resp = opts.max_rd_atomic.min(response.initiator_depth).max(1).min(max_rd);
            let init = opts.max_rd_atomic.min(response.responder_resources).max(1).min(max_init);
            cm.qp_to_rtr(qp, opts, Some(resp))?;
            cm.qp_to_rts(qp, opts, Some(init))?;
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
