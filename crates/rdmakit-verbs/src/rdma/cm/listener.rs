//! The passive side of rdma_cm: a listening id, and the connect requests it hands out.

use std::net::SocketAddr;
use std::ptr::{self, NonNull};
use std::time::Duration;

use rdmakit_sys as sys;
use sys::rdma_cm_event_type as ev;

use super::{
    CmConn, CmId, Deadline, Event, abort_qp, cm_ret, conn_param, data_len, from_sockaddr, to_sockaddr,
};
use crate::error::{Error, Result};
use crate::rdma::Qp;
use crate::types::ConnectOptions;

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
    /// `before_answer` runs once the QP is in RTS and before `rdma_accept` sends the reply:
    /// receives posted there are in place before the peer can send.
    ///
    /// On failure the request is rejected (if not yet accepted) and a QP that was
    /// modified is moved to ERR.
    pub fn accept(
        mut self,
        qp: &Qp,
        opts: &ConnectOptions,
        private_data: &[u8],
        timeout: Option<Duration>,
        before_answer: &mut dyn FnMut() -> Result<()>,
    ) -> Result<CmConn> {
        let deadline = Deadline::new(timeout);
        let cm = self.start_accept(qp, opts, private_data, before_answer)?;
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
        let cm = self.start_accept(qp, opts, private_data, &mut || Ok(()))?;
        match cm.wait_for_async(ev::RDMA_CM_EVENT_ESTABLISHED, "rdma_accept").await {
            Ok(_) => Ok(CmConn::new(cm)),
            Err(e) => {
                abort_qp(qp);
                Err(e)
            }
        }
    }

    /// The QP to RTS and `rdma_accept`: the id, waiting for ESTABLISHED.
    fn start_accept(
        &mut self,
        qp: &Qp,
        opts: &ConnectOptions,
        private_data: &[u8],
        before_answer: &mut dyn FnMut() -> Result<()>,
    ) -> Result<CmId> {
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
            before_answer()?;
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
