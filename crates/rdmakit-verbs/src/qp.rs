//! RC queue pairs: the state machine, connection by endpoint exchange, and posting.

use std::sync::Arc;

pub use crate::types::QpState;

use crate::cq::CompletionQueue;
use crate::cq::CqBackend;
use crate::error::{Error, Result};
use crate::inflight::Inflight;
use crate::mr::MemoryRegion;
use crate::pd::{PdBackend, ProtectionDomain};
use crate::prepared::{PreparedBackend, PreparedSend};
use crate::raw::{RawRecvWr, RawSendWr};
use crate::soft::qp::SoftQp;
use crate::types::{ConnectOptions, QpAddress, QpCaps};
use crate::wr::{RecvWr, SendWr};

/// A reliable-connected queue pair (`struct ibv_qp`, `IBV_QPT_RC`).
///
/// Posting is thread-safe. Each posted request holds its local buffer until its completion
/// is reaped (or the QP is destroyed), so no buffer can be freed under the NIC.
///
/// Dropping the last handle moves the QP to the error state and destroys it; then the
/// buffers of requests that never completed are released.
///
/// # Examples
/// ```
/// use rdmakit_verbs::*;
/// let ctx = Context::open_soft();
/// let pd = ctx.alloc_pd()?;
/// let cq = ctx.create_cq(16)?;
/// let a = pd.create_qp(&cq, &cq, QpCaps::default())?;
/// let b = pd.create_qp(&cq, &cq, QpCaps::default())?;
/// a.connect(&b.address()?, &ConnectOptions::default())?;
/// b.connect(&a.address()?, &ConnectOptions::default())?;
///
/// let src = pd.alloc_mr(8, AccessFlags::ALL_REMOTE)?;
/// let dst = pd.alloc_mr(8, AccessFlags::ALL_REMOTE)?;
/// src.write_at(0, b"rdmakit!")?;
/// a.post_send(SendWr::write(src.local()?, dst.remote().slice(0, 8)?).wr_id(1))?;
/// let wc = cq.wait(None)?.ok()?;
/// assert_eq!(wc.wr_id, 1);
/// assert_eq!(dst.to_vec()?, b"rdmakit!");
/// # Ok::<(), Error>(())
/// ```
#[derive(Clone)]
pub struct QueuePair {
    pub(crate) inner: Arc<QpInner>,
}

/// Fields drop in order (after `Drop` destroyed the QP): the provider object, then the
/// in-flight buffers, then the parents.
pub(crate) struct QpInner {
    backend: QpBackend,
    inflight: Arc<Inflight>,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    pd: ProtectionDomain,
    caps: QpCaps,
    qpn: u32,
    psn: u32,
}

pub(crate) enum QpBackend {
    Soft(Arc<SoftQp>),
    #[cfg(rdmakit_verbs)]
    Verbs(crate::rdma::Qp),
}

/// The one place a queue pair dispatches to its provider.
impl QpBackend {
    /// Creates the provider's QP; returns it with the capacities granted. The caller checked
    /// that the CQs and the PD share a device.
    fn create(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        psn: u32,
        caps: QpCaps,
    ) -> Result<(QpBackend, QpCaps)> {
        match (pd.backend(), &send_cq.inner.backend, &recv_cq.inner.backend) {
            (PdBackend::Soft(pd_id), CqBackend::Soft(scq), CqBackend::Soft(rcq)) => {
                let Some(dev) = pd.context().backend().soft() else {
                    unreachable!("soft PD on a soft device")
                };
                let qp = SoftQp::create(dev, psn, *pd_id, scq.clone(), rcq.clone(), caps)?;
                Ok((QpBackend::Soft(qp), caps))
            }
            #[cfg(rdmakit_verbs)]
            (PdBackend::Verbs(vpd), CqBackend::Verbs(scq), CqBackend::Verbs(rcq)) => {
                let qp = crate::rdma::Qp::create(vpd, scq, rcq, caps)?;
                let caps = qp.caps();
                Ok((QpBackend::Verbs(qp), caps))
            }
            #[cfg(rdmakit_verbs)]
            _ => unreachable!("a PD and CQs of one device share a provider"),
        }
    }

    fn qpn(&self) -> u32 {
        match self {
            QpBackend::Soft(q) => q.qpn(),
            #[cfg(rdmakit_verbs)]
            QpBackend::Verbs(q) => q.qpn(),
        }
    }

    fn state(&self) -> QpState {
        match self {
            QpBackend::Soft(q) => q.state(),
            #[cfg(rdmakit_verbs)]
            QpBackend::Verbs(q) => q.state(),
        }
    }

    fn address(&self, opts: &ConnectOptions, psn: u32) -> Result<QpAddress> {
        match self {
            QpBackend::Soft(q) => {
                let _ = (opts, psn);
                Ok(q.address())
            }
            #[cfg(rdmakit_verbs)]
            QpBackend::Verbs(q) => q.address(opts, psn),
        }
    }

    fn modify_to_init(&self, opts: &ConnectOptions) -> Result<()> {
        match self {
            QpBackend::Soft(q) => q.modify_to_init(opts.access),
            #[cfg(rdmakit_verbs)]
            QpBackend::Verbs(q) => q.modify_to_init(opts),
        }
    }

    /// INIT → RTR → RTS.
    fn modify_to_rts(&self, remote: &QpAddress, opts: &ConnectOptions, psn: u32) -> Result<()> {
        match self {
            QpBackend::Soft(q) => {
                let _ = psn;
                q.modify_to_rtr(remote, opts)?;
                q.modify_to_rts()
            }
            #[cfg(rdmakit_verbs)]
            QpBackend::Verbs(q) => {
                q.modify_to_rtr(remote, opts)?;
                q.modify_to_rts(opts, psn)
            }
        }
    }

    fn modify_to_error(&self) -> Result<()> {
        match self {
            QpBackend::Soft(q) => {
                q.modify_to_err();
                Ok(())
            }
            #[cfg(rdmakit_verbs)]
            QpBackend::Verbs(q) => q.modify_to_err(),
        }
    }

    fn post_send(&self, raws: &[RawSendWr<'_>]) -> std::result::Result<(), (usize, Error)> {
        match self {
            QpBackend::Soft(qp) => qp.post_send(raws),
            #[cfg(rdmakit_verbs)]
            QpBackend::Verbs(qp) => qp.post_send(raws),
        }
    }

    /// The provider's own form of a checked request, built once for many posts.
    fn prepare_send(&self, raw: &RawSendWr<'_>) -> PreparedBackend {
        match self {
            QpBackend::Soft(_) => {
                let _ = raw; // the soft NIC takes the provider-neutral form as it is
                PreparedBackend::Soft
            }
            #[cfg(rdmakit_verbs)]
            QpBackend::Verbs(_) => PreparedBackend::Verbs(crate::rdma::SendTemplate::new(raw)),
        }
    }

    /// Posts a prepared request as provider request `seq`, with `inline` as its payload.
    fn post_prepared(
        &self,
        raw: &RawSendWr<'static>,
        prepared: &PreparedBackend,
        seq: u64,
        inline: Option<&[u8]>,
    ) -> std::result::Result<(), (usize, Error)> {
        match (self, prepared) {
            (QpBackend::Soft(qp), PreparedBackend::Soft) => {
                qp.post_send(std::slice::from_ref(&RawSendWr { wr_id: seq, inline, ..*raw }))
            }
            #[cfg(rdmakit_verbs)]
            (QpBackend::Verbs(qp), PreparedBackend::Verbs(t)) => qp.post_prepared(t, seq, inline),
            #[cfg(rdmakit_verbs)]
            _ => unreachable!("a request is prepared by the QP it posts to"),
        }
    }

    fn post_recv(&self, raws: &[RawRecvWr]) -> std::result::Result<(), (usize, Error)> {
        match self {
            QpBackend::Soft(qp) => qp.post_recv(raws),
            #[cfg(rdmakit_verbs)]
            QpBackend::Verbs(qp) => qp.post_recv(raws),
        }
    }

    /// Destroys the QP (a soft QP goes to the error state first); false if the provider
    /// refused, so the NIC may still use the QP's buffers.
    fn destroy(&self) -> bool {
        match self {
            QpBackend::Soft(q) => {
                q.modify_to_err();
                q.destroy();
                true
            }
            #[cfg(rdmakit_verbs)]
            QpBackend::Verbs(q) => q.destroy(),
        }
    }

    fn set_soft_tokens(&self, rx: [u8; 16], tx: Option<[u8; 16]>) {
        match self {
            QpBackend::Soft(q) => q.set_tokens(rx, tx),
            #[cfg(rdmakit_verbs)]
            QpBackend::Verbs(_) => {}
        }
    }

    #[cfg(rdmakit_verbs)]
    fn verbs(&self) -> Option<&crate::rdma::Qp> {
        match self {
            QpBackend::Verbs(q) => Some(q),
            QpBackend::Soft(_) => None,
        }
    }
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &format_args!("{:#x}", self.inner.qpn))
            .field("state", &self.state())
            .finish()
    }
}

impl QueuePair {
    pub(crate) fn new(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCaps,
    ) -> Result<QueuePair> {
        for cq in [send_cq, recv_cq] {
            if !cq.context().same_device(pd.context()) {
                return Err(Error::InvalidArgument("CQ and PD belong to different devices".into()));
            }
        }
        let psn = initial_psn();
        let (backend, caps) = QpBackend::create(pd, send_cq, recv_cq, psn, caps)?;
        let qpn = backend.qpn();
        let inflight = Arc::new(Inflight::new(caps.max_send_wr, caps.max_recv_wr));
        // A recycled QP number: a tag its earlier QPs' completions, left in the CQ, cannot
        // carry. (Nothing else can register this number before we do: it is ours.)
        let mut avoid = Vec::new();
        send_cq.tags_in_use(qpn, &mut avoid);
        recv_cq.tags_in_use(qpn, &mut avoid);
        inflight.retag_avoiding(&avoid);
        send_cq.register(qpn, inflight.clone());
        recv_cq.register(qpn, inflight.clone());
        Ok(QueuePair {
            inner: Arc::new(QpInner {
                backend,
                inflight,
                send_cq: send_cq.clone(),
                recv_cq: recv_cq.clone(),
                pd: pd.clone(),
                caps,
                qpn,
                psn,
            }),
        })
    }

    /// The rdma-core QP behind this one, if it is a verbs QP.
    #[cfg(rdmakit_verbs)]
    pub(crate) fn verbs_qp(&self) -> Option<&crate::rdma::Qp> {
        self.inner.backend.verbs()
    }

    /// QP number.
    pub fn qp_num(&self) -> u32 {
        self.inner.qpn
    }

    /// The queue sizes the provider granted.
    pub fn caps(&self) -> QpCaps {
        self.inner.caps
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }

    /// The send completion queue.
    pub fn send_cq(&self) -> &CompletionQueue {
        &self.inner.send_cq
    }

    /// The receive completion queue.
    pub fn recv_cq(&self) -> &CompletionQueue {
        &self.inner.recv_cq
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        self.inner.backend.state()
    }

    /// Outstanding (send, receive) requests whose completions were not reaped yet.
    pub fn outstanding(&self) -> (usize, usize) {
        self.inner.inflight.outstanding()
    }

    /// Outstanding send requests, read without taking the in-flight lock: a snapshot, which
    /// posts and polls on other threads may have changed either way since (exact when this
    /// thread alone posts and polls).
    pub fn outstanding_sends(&self) -> usize {
        self.inner.inflight.outstanding_sends()
    }

    /// What a peer needs to connect to this QP, using the default GID choice.
    pub fn address(&self) -> Result<QpAddress> {
        self.address_with(&ConnectOptions::default())
    }

    /// What a peer needs to connect to this QP, with the port and GID index of `opts`.
    pub fn address_with(&self, opts: &ConnectOptions) -> Result<QpAddress> {
        self.inner.backend.address(opts, self.inner.psn)
    }

    /// RESET → INIT, granting peers `opts.access`. Post receives after this and before
    /// the peer starts sending. [`connect`](Self::connect) does it when needed.
    #[doc(alias = "ibv_modify_qp")]
    pub fn modify_to_init(&self, opts: &ConnectOptions) -> Result<()> {
        opts.validate()?;
        self.inner.backend.modify_to_init(opts)
    }

    /// Connects to `remote`: (RESET →) INIT → RTR → RTS.
    ///
    /// # Errors
    /// [`Error::QpState`] if the QP is past INIT; provider errors for unreachable or
    /// mismatched endpoints (a soft QP cannot connect to a verbs endpoint).
    pub fn connect(&self, remote: &QpAddress, opts: &ConnectOptions) -> Result<()> {
        if self.state() == QpState::Reset {
            self.modify_to_init(opts)?;
        }
        self.inner.backend.modify_to_rts(remote, opts, self.inner.psn)
    }

    /// Moves the QP to the error state: outstanding and later requests complete with
    /// `WR_FLUSH_ERR`.
    pub fn modify_to_error(&self) -> Result<()> {
        self.inner.backend.modify_to_error()
    }

    pub(crate) fn check_same_device(&self, wr_local: Option<&crate::mr::LocalSlice>) -> Result<()> {
        if let Some(l) = wr_local
            && !l.mr.context().same_device(self.inner.pd.context())
        {
            return Err(Error::InvalidArgument("the local buffer is registered on another device".into()));
        }
        Ok(())
    }

    /// Posts one send-queue request (`ibv_post_send`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a request that cannot be valid (length mismatch,
    /// inline too long, a buffer from another device); [`Error::QueueFull`];
    /// [`Error::QpState`] before RTS. Failures the NIC detects (keys, bounds, access,
    /// a dead peer) arrive as error completions instead.
    #[doc(alias = "ibv_post_send")]
    pub fn post_send(&self, wr: SendWr<'_>) -> Result<()> {
        self.check_same_device(wr.local.as_ref())?;
        let mut raw = wr.to_raw(self.inner.caps.max_inline_data)?;
        let mut q = self.inner.inflight.lock();
        raw.wr_id = q.push_send(wr.wr_id, wr.local.map(|l| l.mr))?;
        // The slot is pushed and the lock held across the post, so slots stay in posting
        // order and a completion polled on another thread always finds its slot.
        self.post_raw_send(&mut q, std::slice::from_ref(&raw))
    }

    /// The provider's form of `raw` (the inline bytes still in it), for [`PreparedSend`].
    pub(crate) fn prepare_backend(&self, raw: &RawSendWr<'_>) -> PreparedBackend {
        self.inner.backend.prepare_send(raw)
    }

    /// Posts a prepared request: its in-flight slot and the provider call, under the
    /// in-flight lock as [`post_send`](Self::post_send) does. The slot holds no region: the
    /// `PreparedSend` holds it, and hands it to the table if dropped before the post
    /// retires ([`keep_prepared_region`](Self::keep_prepared_region)); the post's number
    /// goes to `last_post`.
    pub(crate) fn post_prepared(&self, p: &PreparedSend, inline: Option<&[u8]>) -> Result<()> {
        let (wr_id, raw, prepared, last_post) = p.parts();
        let mut q = self.inner.inflight.lock();
        let seq = q.push_send(wr_id, None)?;
        match self.inner.backend.post_prepared(raw, prepared, seq, inline) {
            Ok(()) => {
                if let Some(last) = last_post {
                    // Under the lock: posts of one request from several threads store
                    // growing numbers.
                    last.store(q.posted(), std::sync::atomic::Ordering::Relaxed);
                }
                Ok(())
            }
            Err((posted, e)) => {
                q.unpush_send(1 - posted);
                Err(post_error(posted, e))
            }
        }
    }

    /// Keeps `mr`, the region of a dropped [`PreparedSend`] whose last post was numbered
    /// `last`, until the send queue has retired that post.
    pub(crate) fn keep_prepared_region(&self, last: u64, mr: MemoryRegion) {
        self.inner.inflight.lock().keep(last, mr);
    }

    /// Posts several send-queue requests with one provider call.
    ///
    /// # Errors
    /// [`Error::Post`] with the number that were posted (those will complete) when the
    /// provider refuses one part-way; the same errors as [`post_send`](Self::post_send)
    /// before anything is posted.
    pub fn post_send_batch<'a>(&self, wrs: impl IntoIterator<Item = SendWr<'a>>) -> Result<()> {
        let wrs: Vec<SendWr<'a>> = wrs.into_iter().collect();
        let mut raws: Vec<RawSendWr<'a>> = Vec::with_capacity(wrs.len());
        for wr in &wrs {
            self.check_same_device(wr.local.as_ref())?;
            raws.push(wr.to_raw(self.inner.caps.max_inline_data)?);
        }
        self.push_and_post(&mut raws, wrs)
    }

    /// [`post_send_batch`](Self::post_send_batch) for a fixed number of requests, without
    /// allocating: a data write and the flag write that announces it, say, go to the NIC
    /// together (one `ibv_post_send`, one doorbell), in order.
    ///
    /// # Errors
    /// As for [`post_send_batch`](Self::post_send_batch).
    ///
    /// # Example
    /// ```
    /// use rdmakit_verbs::*;
    /// # fn main() -> Result<()> {
    /// let ctx = Context::open_soft();
    /// let pd = ctx.alloc_pd()?;
    /// let cq = ctx.create_cq(16)?;
    /// let caps = QpCaps::default().with_max_inline_data(16);
    /// let (a, b) = (pd.create_qp(&cq, &cq, caps)?, pd.create_qp(&cq, &cq, caps)?);
    /// a.connect(&b.address()?, &ConnectOptions::default())?;
    /// b.connect(&a.address()?, &ConnectOptions::default())?;
    /// let (src, dst) = (pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?, pd.alloc_mr(72, AccessFlags::ALL_REMOTE)?);
    /// src.write_at(0, &[7; 64])?;
    /// // The payload, then a flag word after it: one doorbell, completed in order.
    /// a.post_send_array([
    ///     SendWr::write(src.local()?, dst.remote().slice(0, 64)?).unsignaled(),
    ///     SendWr::write_inline(&1u64.to_le_bytes(), dst.remote().slice(64, 8)?),
    /// ])?;
    /// cq.spin(std::time::Duration::from_secs(5))?.ok()?;
    /// assert_eq!(dst.read_u64(64)?, 1);
    /// # Ok(()) }
    /// ```
    pub fn post_send_array<'a, const N: usize>(&self, wrs: [SendWr<'a>; N]) -> Result<()> {
        let Some(first) = wrs.first() else { return Ok(()) };
        let max_inline = self.inner.caps.max_inline_data;
        self.check_same_device(first.local.as_ref())?;
        let mut raws = [first.to_raw(max_inline)?; N];
        for (raw, wr) in raws.iter_mut().zip(&wrs).skip(1) {
            self.check_same_device(wr.local.as_ref())?;
            *raw = wr.to_raw(max_inline)?;
        }
        self.push_and_post(&mut raws, wrs)
    }

    /// Pushes the in-flight slots of `wrs`, whose provider forms are `raws` (in order),
    /// then posts them with one provider call.
    fn push_and_post<'a>(
        &self,
        raws: &mut [RawSendWr<'a>],
        wrs: impl IntoIterator<Item = SendWr<'a>>,
    ) -> Result<()> {
        // Declared before the lock, so that requests never pushed (after a refused one)
        // drop after it: one may hold its region's last handle.
        let mut wrs = wrs.into_iter();
        let mut q = self.inner.inflight.lock();
        for (i, (raw, wr)) in raws.iter_mut().zip(&mut wrs).enumerate() {
            match q.push_send(wr.wr_id, wr.local.map(|l| l.mr)) {
                Ok(id) => raw.wr_id = id,
                Err(e) => {
                    q.unpush_send(i);
                    return Err(e);
                }
            }
        }
        self.post_raw_send(&mut q, raws)
    }

    /// Hands requests whose slots are pushed to the provider; drops the slots of those it
    /// refused. The caller holds the in-flight lock across the call.
    fn post_raw_send(&self, q: &mut crate::inflight::Queues, raws: &[RawSendWr<'_>]) -> Result<()> {
        self.inner.backend.post_send(raws).map_err(|(posted, e)| {
            q.unpush_send(raws.len() - posted);
            post_error(posted, e)
        })
    }

    /// Posts one receive (`ibv_post_recv`).
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        self.check_same_device(wr.local.as_ref())?;
        let mut raw = wr.to_raw();
        let mut q = self.inner.inflight.lock();
        raw.wr_id = q.push_recv(wr.wr_id, wr.local.map(|l| l.mr))?;
        self.post_raw_recv(&mut q, std::slice::from_ref(&raw))
    }

    /// Posts a prepared receive: its in-flight slot (with its own clone of the region) and
    /// the provider call.
    pub(crate) fn post_prepared_recv(
        &self,
        wr_id: u64,
        mr: Option<&MemoryRegion>,
        raw: &RawRecvWr,
    ) -> Result<()> {
        let mut q = self.inner.inflight.lock();
        let seq = q.push_recv(wr_id, mr.cloned())?;
        self.post_raw_recv(&mut q, std::slice::from_ref(&RawRecvWr { wr_id: seq, ..*raw }))
    }

    /// Posts several receives with one provider call.
    pub fn post_recv_batch(&self, wrs: impl IntoIterator<Item = RecvWr>) -> Result<()> {
        // Taken and checked before the lock: the caller's iterator runs unlocked, and
        // requests not pushed (after a refused one) drop after the lock, as one may hold
        // its region's last handle.
        let mut wrs: Vec<RecvWr> = wrs.into_iter().collect();
        for wr in &wrs {
            self.check_same_device(wr.local.as_ref())?;
        }
        let mut raws: Vec<RawRecvWr> = wrs.iter().map(RecvWr::to_raw).collect();
        let mut q = self.inner.inflight.lock();
        for (i, (raw, wr)) in raws.iter_mut().zip(&mut wrs).enumerate() {
            match q.push_recv(wr.wr_id, wr.local.take().map(|l| l.mr)) {
                Ok(id) => raw.wr_id = id,
                Err(e) => {
                    q.unpush_recv(i); // this batch's, pushed so far
                    return Err(e);
                }
            }
        }
        self.post_raw_recv(&mut q, &raws)
    }

    /// Hands receives whose slots are pushed to the provider; drops the slots of those it
    /// refused. The caller holds the in-flight lock across the call.
    fn post_raw_recv(&self, q: &mut crate::inflight::Queues, raws: &[RawRecvWr]) -> Result<()> {
        self.inner.backend.post_recv(raws).map_err(|(posted, e)| {
            q.unpush_recv(raws.len() - posted);
            post_error(posted, e)
        })
    }
}

impl Drop for QpInner {
    fn drop(&mut self) {
        if self.backend.destroy() {
            // The NIC no longer touches this QP's buffers: release them.
            self.send_cq.unregister(self.qpn, &self.inflight);
            self.recv_cq.unregister(self.qpn, &self.inflight);
        } else {
            // The provider refused to destroy the QP, so the NIC may still use its buffers:
            // keep them alive forever rather than risk a use-after-free.
            tracing::error!(qp_num = self.qpn, "ibv_destroy_qp failed; leaking its in-flight buffers");
            std::mem::forget(self.inflight.clone());
        }
    }
}

/// A refusal after `posted` requests were accepted: the plain error if none were.
fn post_error(posted: usize, e: Error) -> Error {
    if posted == 0 { e } else { Error::Post { posted, source: Box::new(e) } }
}

/// A random 24-bit initial PSN from the operating system's source: on the soft NIC it is
/// part of what authenticates a peer, so it must not be predictable.
fn initial_psn() -> u32 {
    u32::from_ne_bytes(crate::soft::random()) & 0x00ff_ffff
}

impl QueuePair {
    /// Sets the soft NIC connection tokens the soft bootstrap exchanged (`rx`: what the
    /// peer presents to us; `tx`: what we present to it). No-op on verbs QPs.
    pub(crate) fn set_soft_tokens(&self, rx: [u8; 16], tx: Option<[u8; 16]>) {
        self.inner.backend.set_soft_tokens(rx, tx);
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;
    use std::time::Duration;

    use crate::mr::ON_RELEASE;
    use crate::*;

    /// Two QPs with `caps`, connected to each other, on one CQ of the shared soft device.
    fn shallow_pair(caps: QpCaps) -> (ProtectionDomain, CompletionQueue, QueuePair, QueuePair) {
        let ctx = Context::open_soft();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let (a, b) = (pd.create_qp(&cq, &cq, caps).unwrap(), pd.create_qp(&cq, &cq, caps).unwrap());
        a.connect(&b.address().unwrap(), &ConnectOptions::default()).unwrap();
        b.connect(&a.address().unwrap(), &ConnectOptions::default()).unwrap();
        (pd, cq, a, b)
    }

    /// A request can hold its region's last handle (the caller moved the region in), and
    /// releasing it deregisters the region: a system call, or on the soft NIC a wait for
    /// its accesses. That happens after the CQ's registry and the QP's in-flight table are
    /// unlocked, so that posts and polls on other threads do not wait for it: on reaping
    /// (`poll_one` and `poll`), and on a post refused for a full queue.
    #[test]
    fn a_requests_last_region_handle_is_deregistered_after_the_locks() {
        let (pd, cq, a, b) = shallow_pair(QpCaps::default().with_max_send_wr(1).with_max_recv_wr(1));
        let dst = pd.alloc_mr(64, AccessFlags::ALL_REMOTE).unwrap();
        // Whether the registry and `a`'s table were free at each deregistration.
        let seen = Rc::new(RefCell::new(Vec::new()));
        let (registry, table, log) = (cq.inner.clone(), a.inner.inflight.clone(), seen.clone());
        ON_RELEASE.set(Some(Box::new(move || {
            log.borrow_mut().push((registry.qps.try_lock().is_ok(), table.q.try_lock().is_ok()));
        })));
        let given_up = |n: u8| {
            let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
            src.write_at(0, &[n; 64]).unwrap();
            SendWr::write(src.local().unwrap(), dst.remote().slice(0, 64).unwrap())
        };
        // Reaped by `poll_one`, then by `poll`.
        a.post_send(given_up(1)).unwrap();
        assert_eq!(seen.borrow().len(), 0, "the request holds the region");
        cq.spin(Duration::from_secs(5)).unwrap().ok().unwrap();
        assert_eq!(*seen.borrow(), [(true, true)]);
        a.post_send(given_up(2)).unwrap();
        let mut wcs = [WorkCompletion::default(); 4];
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while cq.poll(&mut wcs).unwrap() == 0 {
            assert!(std::time::Instant::now() < deadline, "no completion");
        }
        assert_eq!(*seen.borrow(), [(true, true); 2]);
        // Refused: the send queue (depth 1) is full.
        a.post_send(given_up(3).unsignaled()).unwrap();
        let refused = a.post_send(given_up(4));
        assert!(matches!(refused, Err(Error::QueueFull { .. })), "{refused:?}");
        assert_eq!(*seen.borrow(), [(true, true); 3]);
        // A receive refused likewise.
        let inbox = || RecvWr::new(pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap().local().unwrap());
        b.post_recv(inbox()).unwrap();
        let (registry, table, log) = (cq.inner.clone(), b.inner.inflight.clone(), seen.clone());
        ON_RELEASE.set(Some(Box::new(move || {
            log.borrow_mut().push((registry.qps.try_lock().is_ok(), table.q.try_lock().is_ok()));
        })));
        assert!(matches!(b.post_recv(inbox()), Err(Error::QueueFull { .. })));
        assert_eq!(*seen.borrow(), [(true, true); 4]);
        ON_RELEASE.set(None);
        assert_eq!(dst.read_u64(0).unwrap(), u64::from_ne_bytes([3; 8]), "the accepted writes landed");
    }

    /// A prepared request holds its region for its posts (their slots take no handle of
    /// their own). Dropped with posts outstanding, it leaves the region to the QP until the
    /// last of them is reaped, an unsignalled one included (retired by a later signalled
    /// completion); then the region is deregistered after the locks, as a slot's last handle
    /// is. Dropped with none outstanding, or never posted, it lets the region go at once.
    #[test]
    fn a_dropped_prepared_requests_region_lives_until_its_posts_are_reaped() {
        let (pd, cq, a, _b) = shallow_pair(QpCaps::default().with_max_send_wr(8));
        let dst = pd.alloc_mr(64, AccessFlags::ALL_REMOTE).unwrap();
        let seen = Rc::new(RefCell::new(Vec::new()));
        let (registry, table, log) = (cq.inner.clone(), a.inner.inflight.clone(), seen.clone());
        ON_RELEASE.set(Some(Box::new(move || {
            log.borrow_mut().push((registry.qps.try_lock().is_ok(), table.q.try_lock().is_ok()));
        })));
        // A request holding its region's last handle.
        let prepared = |n: u8, signaled: bool| {
            let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
            src.write_at(0, &[n; 64]).unwrap();
            let wr = SendWr::write(src.local().unwrap(), dst.remote().slice(0, 64).unwrap());
            a.prepare_send(if signaled { wr } else { wr.unsignaled() }).unwrap()
        };
        let reap = || cq.spin(Duration::from_secs(5)).unwrap().ok().unwrap();
        let released = || seen.borrow().len();

        // Two posts outstanding when it is dropped: kept through the first one's reaping.
        let twice = prepared(1, true);
        twice.post().unwrap();
        twice.post().unwrap();
        drop(twice);
        assert_eq!(released(), 0, "dropped with two posts outstanding");
        reap();
        assert_eq!(released(), 0, "one post still outstanding");
        reap();
        assert_eq!(*seen.borrow(), [(true, true)], "released after the last post, after the locks");

        // An unsignalled post, retired by another request's signalled completion.
        let quiet = prepared(2, false);
        quiet.post().unwrap();
        drop(quiet);
        let loud = prepared(3, true);
        loud.post().unwrap();
        assert_eq!(released(), 1, "the unsignalled post is outstanding");
        reap();
        assert_eq!(released(), 2, "retired with the signalled completion after it");

        // Reaped before the drop, and never posted: released at the drop.
        drop(loud);
        assert_eq!(released(), 3);
        drop(prepared(4, true));
        assert_eq!(released(), 4);
        ON_RELEASE.set(None);
        assert_eq!(*seen.borrow(), [(true, true); 4]);
        assert_eq!(a.inner.inflight.outstanding(), (0, 0));
        assert_eq!(dst.read_u64(0).unwrap(), u64::from_ne_bytes([3; 8]), "the writes landed");
    }

    /// A batch refused part-way: the requests after the refused one were never pushed, and
    /// their regions (last handles) must also be deregistered after the in-flight lock.
    #[test]
    fn a_refused_batchs_unpushed_regions_are_deregistered_after_the_lock() {
        let (pd, cq, a, b) = shallow_pair(QpCaps::default().with_max_send_wr(1).with_max_recv_wr(2));
        let dst = pd.alloc_mr(64, AccessFlags::ALL_REMOTE).unwrap();
        let inbox = || RecvWr::new(pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap().local().unwrap());
        b.post_recv(inbox()).unwrap();
        let seen = Rc::new(RefCell::new(Vec::new()));
        let (registry, ta, tb, log) =
            (cq.inner.clone(), a.inner.inflight.clone(), b.inner.inflight.clone(), seen.clone());
        ON_RELEASE.set(Some(Box::new(move || {
            log.borrow_mut().push((
                registry.qps.try_lock().is_ok(),
                ta.q.try_lock().is_ok(),
                tb.q.try_lock().is_ok(),
            ));
        })));
        let given_up = || {
            let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
            SendWr::write(src.local().unwrap(), dst.remote().slice(0, 64).unwrap())
        };
        // Send batch: #1 pushed then unpushed, #2 refused (QueueFull), #3 never pushed.
        let r = a.post_send_batch([given_up(), given_up(), given_up()]);
        assert!(matches!(r, Err(Error::QueueFull { .. })), "{r:?}");
        // post_send_array likewise.
        let r = a.post_send_array([given_up(), given_up(), given_up()]);
        assert!(matches!(r, Err(Error::QueueFull { .. })), "{r:?}");
        // Receive batch, behind a receive posted before it: #1 fills the queue (depth 2).
        let r = b.post_recv_batch([inbox(), inbox(), inbox()]);
        assert!(matches!(r, Err(Error::QueueFull { .. })), "{r:?}");
        ON_RELEASE.set(None);
        assert_eq!(*seen.borrow(), [(true, true, true); 9]);
        assert_eq!(
            b.inner.inflight.outstanding(),
            (0, 1),
            "the refused batch took back its own receives only"
        );
    }

    /// A QP destroyed with a receive posted leaves a completion of it in the CQ (a flush,
    /// or one a provider had queued), and the provider gives its number to a new QP whose
    /// table drew the same tag (tags come from 2^11 values): `create_qp` gives the new QP
    /// another tag, and the old completion retires none of its requests.
    #[test]
    fn a_qp_created_under_a_recycled_number_is_not_reached_by_the_old_qps_completions() {
        // A device of its own: other tests' QPs must not take (or be given) its numbers.
        let ctx = Context::open_soft_with(SoftConfig::default()).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let soft = ctx.backend().soft().unwrap().clone();
        let caps = QpCaps::default().with_max_recv_wr(4);
        let inbox = || RecvWr::new(pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap().local().unwrap());
        let tag = 0x123 << 52;
        let peer = pd.create_qp(&cq, &cq, caps).unwrap();
        let to_peer = peer.address().unwrap();
        soft.set_next_qpn(0x4242);
        crate::inflight::FIRST_TAG.set(Some(tag));
        let old = pd.create_qp(&cq, &cq, caps).unwrap();
        assert_eq!((old.qp_num(), old.inner.inflight.tag()), (0x4242, tag));
        old.connect(&to_peer, &ConnectOptions::default()).unwrap();
        old.post_recv(inbox().wr_id(1)).unwrap();
        // The provider's wr_id of that receive: sequence 1, the tag, the receive bit.
        let stale = 1 | tag | 1 << 63;
        drop(old);
        soft.set_next_qpn(0x4242);
        crate::inflight::FIRST_TAG.set(Some(tag));
        let new = pd.create_qp(&cq, &cq, caps).unwrap();
        assert_eq!(new.qp_num(), 0x4242, "the number was recycled");
        assert_ne!(new.inner.inflight.tag(), tag, "the destroyed QP's tag was taken again");
        new.connect(&to_peer, &ConnectOptions::default()).unwrap();
        new.post_recv(inbox().wr_id(2)).unwrap();
        let wc = WorkCompletion { wr_id: stale, qp_num: 0x4242, ..Default::default() };
        assert!(leave_in_cq(&cq, wc));
        let mut wcs = [WorkCompletion::default(); 4];
        let n = cq.poll(&mut wcs).unwrap();
        assert!(wcs[..n].iter().all(|wc| wc.wr_id != 2), "the new QP's receive was retired: {:?}", &wcs[..n]);
        assert_eq!(new.inner.inflight.outstanding(), (0, 1));
    }

    /// Leaves `wc` in the soft CQ under `cq`, as a provider would.
    fn leave_in_cq(cq: &CompletionQueue, wc: WorkCompletion) -> bool {
        match &cq.inner.backend {
            crate::cq::CqBackend::Soft(soft) => soft.push(wc),
            #[cfg(rdmakit_verbs)]
            crate::cq::CqBackend::Verbs(_) => unreachable!("a soft CQ"),
        }
    }
}
