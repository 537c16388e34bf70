//! Completion queues: polling, blocking waits and async waits.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::device::{Context, CtxBackend};
use crate::error::{Error, Result};
use crate::inflight::Inflight;
use crate::soft::cq::SoftCq;
use crate::wc::WorkCompletion;

/// A completion queue (`struct ibv_cq` with its completion channel).
///
/// Polling is thread-safe. Completions come back with the `wr_id` the user gave; reaping a
/// completion is what releases the buffers of its work request.
///
/// Waiting: [`poll`](Self::poll) never blocks; [`wait`](Self::wait) blocks the thread on
/// the completion channel (verbs) or eventfd (soft NIC); [`next`](Self::next) awaits the
/// next completion on tokio (on the soft NIC, woken by the NIC through the task's waker).
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

/// Fields drop in order: the provider object before the parent it needs.
pub(crate) struct CqInner {
    pub(crate) backend: CqBackend,
    /// QPs whose completions land here. The lock also serialises polling, so completions
    /// are translated in the order the provider produced them.
    /// FxHash, not SipHash: every completion looks its QP up here (SipHash cost about 110
    /// instructions a completion on rxe), and QP numbers come from the provider, not from a
    /// peer, so nobody picks keys to collide.
    pub(crate) qps: Mutex<Registry>,
    pub(crate) ctx: Context,
    capacity: u32,
    #[cfg(feature = "async")]
    async_fd: Registered<RawFdHandle>,
}

/// The QPs whose completions land in a CQ, by QP number, and the in-flight tags of
/// destroyed ones whose completions may still be in it.
///
/// Providers recycle QP numbers, and rxe leaves a destroyed QP's completions in the CQ; a
/// completion finds its request by number, then by tag and sequence number. A tag is drawn
/// per table from 2^11 values, so a destroyed QP's tag is remembered here until it cannot
/// matter, and a new QP given the same number takes another.
#[derive(Default)]
pub(crate) struct Registry {
    live: HashMap<u32, Arc<Inflight>, rustc_hash::FxBuildHasher>,
    /// Per QP number, the tags of destroyed QPs that had requests outstanding. Cleared by
    /// a poll that finds the CQ empty (one that returns nothing, and no error): on rxe and
    /// mlx5 a QP's completions are all in the CQ by the time its destruction returns, so
    /// none of them is left after that. (The soft NIC may still publish the completion of
    /// a receive it was filling; it does not recycle QP numbers until its 24-bit counter
    /// wraps.)
    retired: HashMap<u32, Vec<u64>, rustc_hash::FxBuildHasher>,
}

impl Registry {
    /// The live QP numbered `qpn`.
    fn get(&self, qpn: &u32) -> Option<&Arc<Inflight>> {
        self.live.get(qpn)
    }

    /// The CQ was found empty: no destroyed QP's completion is left in it.
    fn drained(&mut self) {
        if !self.retired.is_empty() {
            self.retired.clear();
        }
    }

    /// Remembers the tag of `inflight`, a destroyed QP's table, if completions of its
    /// requests may still come.
    /// (A number's list holds each tag once: at most 2^11 entries.)
    fn retire(&mut self, qpn: u32, inflight: &Inflight) {
        if let Some(tag) = inflight.tag_if_outstanding() {
            let tags = self.retired.entry(qpn).or_default();
            if !tags.contains(&tag) {
                tags.push(tag);
            }
        }
    }
}

pub(crate) enum CqBackend {
    Soft(Arc<SoftCq>),
    #[cfg(rdmakit_verbs)]
    Verbs(crate::rdma::Cq),
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue").field("capacity", &self.inner.capacity).finish()
    }
}

impl CqBackend {
    /// Creates the provider's CQ for at least `cqe` completions; returns it with the
    /// capacity granted.
    fn create(ctx: &Context, cqe: u32) -> Result<(CqBackend, u32)> {
        match ctx.backend() {
            CtxBackend::Soft(_) => Ok((CqBackend::Soft(Arc::new(SoftCq::new(cqe))), cqe)),
            #[cfg(rdmakit_verbs)]
            CtxBackend::Verbs(c) => {
                let cq = crate::rdma::Cq::create(c, cqe)?;
                let cap = cq.capacity();
                Ok((CqBackend::Verbs(cq), cap))
            }
        }
    }

    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        match self {
            CqBackend::Soft(cq) => cq.poll(out),
            #[cfg(rdmakit_verbs)]
            CqBackend::Verbs(cq) => cq.poll(out),
        }
    }

    fn poll_one(&self) -> Result<Option<WorkCompletion>> {
        match self {
            CqBackend::Soft(cq) => {
                let mut out = [WorkCompletion::default()];
                Ok((cq.poll(&mut out)? == 1).then_some(out[0]))
            }
            #[cfg(rdmakit_verbs)]
            CqBackend::Verbs(cq) => cq.poll_one(),
        }
    }

    fn req_notify(&self) -> Result<()> {
        match self {
            CqBackend::Soft(cq) => cq.req_notify(),
            #[cfg(rdmakit_verbs)]
            CqBackend::Verbs(cq) => cq.req_notify(),
        }
    }

    fn fd(&self) -> Result<RawFd> {
        match self {
            CqBackend::Soft(cq) => cq.fd(),
            #[cfg(rdmakit_verbs)]
            CqBackend::Verbs(cq) => Ok(cq.fd()),
        }
    }

    /// The soft NIC's CQ, if this is one.
    #[cfg(feature = "async")]
    fn soft(&self) -> Option<&SoftCq> {
        match self {
            CqBackend::Soft(cq) => Some(cq),
            #[cfg(rdmakit_verbs)]
            CqBackend::Verbs(_) => None,
        }
    }

    /// Consumes the channel's pending events (`ibv_get_cq_event` + `ibv_ack_cq_events`).
    fn take_events(&self) {
        match self {
            CqBackend::Soft(cq) => {
                cq.take_event();
            }
            #[cfg(rdmakit_verbs)]
            CqBackend::Verbs(cq) => cq.take_events(),
        }
    }
}

impl CompletionQueue {
    pub(crate) fn new(ctx: &Context, cqe: u32) -> Result<CompletionQueue> {
        let max = ctx.attr().max_cqe;
        if cqe == 0 || cqe > max {
            return Err(Error::InvalidArgument(format!("CQ size {cqe} must be 1..={max} on {}", ctx.name())));
        }
        let (backend, capacity) = CqBackend::create(ctx, cqe)?;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                backend,
                qps: Mutex::new(Registry::default()),
                ctx: ctx.clone(),
                capacity,
                #[cfg(feature = "async")]
                async_fd: Registered::default(),
            }),
        })
    }

    /// How many completions the queue holds (the provider may round the request up).
    pub fn capacity(&self) -> u32 {
        self.inner.capacity
    }

    /// The device.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Moves up to `out.len()` completions into `out` and returns how many. Never blocks.
    ///
    /// Completions of a QP that was already destroyed are discarded; 0 means the queue
    /// was empty (a batch that held only discarded completions is followed by another).
    ///
    /// # Errors
    /// [`Error::CqOverrun`] once the queue has overrun (completions were lost); the error
    /// is sticky. Other provider failures as [`Error::Os`].
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        if out.is_empty() {
            return Ok(0); // (the loop below ends on a short batch, which an empty one is not)
        }
        // Regions whose last handle a retired request held: deregistered after the locks.
        let mut graves = Vec::new();
        let mut qps = self.inner.qps.lock().expect("cq registry lock");
        let mut kept = 0;
        loop {
            let n = self.inner.backend.poll(out)?;
            // Empty only if nothing came: a short batch can also be cut by a provider error
            // after some completions (reported at the next poll).
            if n == 0 && !out.is_empty() {
                qps.drained();
            }
            // Completions come in runs of one QP: lock its in-flight table once per run.
            let mut current: Option<(u32, crate::inflight::Locked<'_>)> = None;
            for i in 0..n {
                let mut wc = out[i];
                if current.as_ref().is_none_or(|(qpn, _)| *qpn != wc.qp_num) {
                    // Release the previous QP's lock before taking the next.
                    if let Some((_, mut q)) = current.take() {
                        q.take_graves(&mut graves);
                    }
                    current = qps.get(&wc.qp_num).map(|inf| (wc.qp_num, inf.lock()));
                }
                let known = current.as_mut().is_some_and(|(_, q)| q.complete(&mut wc));
                if known {
                    out[kept] = wc;
                    kept += 1;
                } else {
                    tracing::debug!(qp_num = wc.qp_num, "discarding a completion of a destroyed QP");
                }
            }
            if let Some((_, q)) = current.as_mut() {
                q.take_graves(&mut graves);
            }
            drop(current);
            // A full batch of discarded completions: more may wait behind it, and a caller
            // taking 0 for "empty" could go to sleep on them.
            if kept > 0 || n < out.len() {
                break;
            }
        }
        drop(qps);
        drop(graves);
        Ok(kept)
    }

    /// Polls one completion: [`poll`](Self::poll) for one, without its batch loop (a
    /// latency loop's every poll comes here). `None` means the queue was empty.
    pub fn poll_one(&self) -> Result<Option<WorkCompletion>> {
        let mut graves = Vec::new();
        let mut qps = self.inner.qps.lock().expect("cq registry lock");
        let found = loop {
            let Some(mut wc) = self.inner.backend.poll_one()? else {
                qps.drained();
                break None;
            };
            let known = qps.get(&wc.qp_num).is_some_and(|inf| {
                let mut q = inf.lock();
                let known = q.complete(&mut wc);
                q.take_graves(&mut graves);
                known
            });
            if known {
                break Some(wc);
            }
            // Discarded: look behind it (a `None` here would read as "empty", and
            // `poll_or_arm` would sleep with completions waiting).
            tracing::debug!(qp_num = wc.qp_num, "discarding a completion of a destroyed QP");
        };
        drop(qps);
        drop(graves);
        Ok(found)
    }

    /// Polls one completion; if there is none, arms the channel so the next one signals
    /// it, and polls again (one may have landed between the poll and arming).
    fn poll_or_arm(&self) -> Result<Option<WorkCompletion>> {
        if let Some(wc) = self.poll_one()? {
            return Ok(Some(wc));
        }
        self.inner.backend.req_notify()?;
        self.poll_one()
    }

    /// Blocks the thread until a completion arrives or `timeout` passes, sleeping on the
    /// completion channel (no busy polling).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<WorkCompletion> {
        // A timeout too long to add to the clock is no deadline.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            if let Some(wc) = self.poll_or_arm()? {
                return Ok(wc);
            }
            let ms = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Error::Timeout(timeout.unwrap_or_default()));
                    }
                    left.as_millis().clamp(1, i32::MAX as u128) as i32
                }
            };
            let mut pfd = libc::pollfd { fd: self.inner.backend.fd()?, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd on the stack, count 1.
            let r = unsafe { libc::poll(&mut pfd, 1, ms) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(Error::Os { call: "poll", source: e });
                }
            }
            self.inner.backend.take_events();
        }
    }

    /// Busy-polls until a completion arrives or `timeout` passes. Lowest latency; burns a
    /// core.
    pub fn spin(&self, timeout: Duration) -> Result<WorkCompletion> {
        // The clock is read once per `SPINS_PER_CLOCK` empty polls, not on every one: a
        // clock read costs as much as an empty poll, and the timeout is a bound, not a beat.
        // The first read starts the clock, so a completion found within the first
        // `SPINS_PER_CLOCK` polls costs no clock read at all; the timeout runs from there.
        const SPINS_PER_CLOCK: u32 = 256;
        let mut start: Option<Instant> = None;
        let mut spins = 0u32;
        loop {
            if let Some(wc) = self.poll_one()? {
                return Ok(wc);
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(SPINS_PER_CLOCK)
                && start.get_or_insert_with(Instant::now).elapsed() >= timeout
            {
                return Err(Error::Timeout(timeout));
            }
            std::hint::spin_loop();
        }
    }

    /// Awaits the next completion on tokio, woken by the completion channel (verbs) or by
    /// the soft NIC itself (its task's waker, without a file descriptor).
    ///
    /// On verbs the first call registers the channel with the runtime it runs on; later
    /// calls must run on the same runtime.
    ///
    /// # Cancel safety
    /// Cancel-safe: a completion is only taken from the queue in the same step that
    /// returns it, so dropping the future loses nothing.
    #[cfg(feature = "async")]
    pub async fn next(&self) -> Result<WorkCompletion> {
        if let Some(cq) = self.inner.backend.soft() {
            // The soft NIC wakes the task itself: no eventfd write and read per completion,
            // and a runtime awaiting many CQs is woken once for a burst of them.
            // The registration goes with this future, however it ends.
            let mut wait = crate::soft::cq::Wait::new(cq);
            return std::future::poll_fn(|cx| {
                loop {
                    if let Some(wc) = self.poll_one()? {
                        return std::task::Poll::Ready(Ok(wc));
                    }
                    if wait.register(cx.waker()) {
                        return std::task::Poll::Pending;
                    }
                }
            })
            .await;
        }
        let afd = self.async_fd()?;
        loop {
            if let Some(wc) = self.poll_or_arm()? {
                return Ok(wc);
            }
            let mut guard =
                afd.readable().await.map_err(|source| Error::Os { call: "AsyncFd::readable", source })?;
            self.inner.backend.take_events();
            guard.clear_ready();
        }
    }

    #[cfg(feature = "async")]
    fn async_fd(&self) -> Result<&tokio::io::unix::AsyncFd<RawFdHandle>> {
        self.inner.async_fd.get_or_register(|| {
            if tokio::runtime::Handle::try_current().is_err() {
                return Err(Error::InvalidArgument("CompletionQueue::next needs a tokio runtime".into()));
            }
            let fd = self.inner.backend.fd()?;
            // SAFETY: the fd is the CQ provider's (channel or eventfd), closed only when
            // `CqInner` drops, whose `Drop` drops this `AsyncFd` first (a leak leaks both): it
            // stays open.
            unsafe {
                tokio::io::unix::AsyncFd::register_with_interest(
                    RawFdHandle(fd),
                    tokio::io::Interest::READABLE,
                )
            }
            .map_err(|e| Error::Os { call: "AsyncFd::register", source: e.into() })
        })
    }

    /// Adds to `out` the tags a new in-flight table for QP number `qpn` must not take:
    /// those of destroyed QPs so numbered whose completions may still be here, and of the
    /// QP registered under that number if there is one (destroyed, and not yet
    /// unregistered: its number came back to the provider first).
    pub(crate) fn tags_in_use(&self, qpn: u32, out: &mut Vec<u64>) {
        let reg = self.inner.qps.lock().expect("cq registry lock");
        out.extend(reg.retired.get(&qpn).into_iter().flatten());
        out.extend(reg.live.get(&qpn).map(|inf| inf.tag()));
    }

    /// Routes completions numbered `qpn` to `inflight`, whose tag [`tags_in_use`] ruled
    /// out. A QP still registered under that number was destroyed: it is retired.
    ///
    /// [`tags_in_use`]: Self::tags_in_use
    pub(crate) fn register(&self, qpn: u32, inflight: Arc<Inflight>) {
        let mut reg = self.inner.qps.lock().expect("cq registry lock");
        if let Some(old) = reg.live.insert(qpn, inflight) {
            reg.retire(qpn, &old);
        }
    }

    /// Stops routing completions numbered `qpn` to `inflight`, a destroyed QP's table, and
    /// remembers its tag while its completions may still come. A QP that took the number
    /// since (it came back to the provider before this) stays registered.
    pub(crate) fn unregister(&self, qpn: u32, inflight: &Arc<Inflight>) {
        let mut reg = self.inner.qps.lock().expect("cq registry lock");
        if reg.live.get(&qpn).is_some_and(|live| Arc::ptr_eq(live, inflight)) {
            reg.live.remove(&qpn);
        }
        reg.retire(qpn, inflight);
    }
}

/// An fd registered with tokio's reactor by its first async wait, once: two first waits
/// racing must not both register it (with one reactor, the second registration fails).
#[cfg(feature = "async")]
pub(crate) struct Registered<T: std::os::fd::AsRawFd> {
    afd: std::sync::OnceLock<tokio::io::unix::AsyncFd<T>>,
    init: Mutex<()>,
}

#[cfg(feature = "async")]
impl<T: std::os::fd::AsRawFd> Default for Registered<T> {
    fn default() -> Self {
        Registered { afd: std::sync::OnceLock::new(), init: Mutex::new(()) }
    }
}

#[cfg(feature = "async")]
impl<T: std::os::fd::AsRawFd> Registered<T> {
    /// The registration, made by `register` on first use (one caller at a time).
    pub(crate) fn get_or_register(
        &self,
        register: impl FnOnce() -> Result<tokio::io::unix::AsyncFd<T>>,
    ) -> Result<&tokio::io::unix::AsyncFd<T>> {
        if let Some(a) = self.afd.get() {
            return Ok(a);
        }
        let _one = self.init.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = self.afd.get() {
            return Ok(a);
        }
        let afd = register()?;
        Ok(self.afd.get_or_init(|| afd))
    }

    /// Takes the registration out (to drop it before the fd closes).
    pub(crate) fn take(&mut self) -> Option<tokio::io::unix::AsyncFd<T>> {
        self.afd.take()
    }
}

/// The channel fd as `AsyncFd` sees it; the CQ's provider object owns and closes it.
#[cfg(feature = "async")]
pub(crate) struct RawFdHandle(RawFd);

#[cfg(feature = "async")]
impl std::os::fd::AsRawFd for RawFdHandle {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

impl Drop for CqInner {
    fn drop(&mut self) {
        // Deregister the fd from the reactor before the provider closes it.
        #[cfg(feature = "async")]
        drop(self.async_fd.take());
    }
}

#[cfg(test)]
mod registry_tests {
    use super::*;

    const RECV_BIT: u64 = 1 << 63;

    /// The soft NIC's CQ under `cq`, to leave completions in as a provider would.
    fn soft(cq: &CompletionQueue) -> &SoftCq {
        match &cq.inner.backend {
            CqBackend::Soft(cq) => cq,
            #[cfg(rdmakit_verbs)]
            CqBackend::Verbs(_) => unreachable!("a soft CQ"),
        }
    }

    /// A table registered as `QueuePair::new` registers one.
    fn table(cq: &CompletionQueue, qpn: u32, tag: Option<u64>) -> Arc<Inflight> {
        let inflight = Arc::new(Inflight::new(4, 4));
        if let Some(tag) = tag {
            inflight.force_tag(tag);
        }
        let mut avoid = Vec::new();
        cq.tags_in_use(qpn, &mut avoid);
        inflight.retag_avoiding(&avoid);
        cq.register(qpn, inflight.clone());
        inflight
    }

    /// A CQ with a table registered as QP `qpn`, one send request posted on it (its
    /// provider `wr_id` returned).
    fn with_one_request(qpn: u32) -> (CompletionQueue, u32, Arc<Inflight>, u64) {
        let cq = Context::open_soft().create_cq(16).unwrap();
        let old = table(&cq, qpn, None);
        let wr_id = old.lock().push_send(1, None).unwrap();
        (cq, qpn, old, wr_id)
    }

    fn completion(wr_id: u64, qp_num: u32) -> WorkCompletion {
        WorkCompletion { wr_id, qp_num, ..Default::default() }
    }

    /// A QP destroyed with a request in flight leaves its completion in the CQ (rxe does),
    /// and the provider gives its number to a new QP, whose table drew the same tag (tags
    /// come from 2^11 values): the new QP takes another tag, and the old completion retires
    /// none of its requests (it would release a buffer the NIC may still write).
    #[test]
    fn a_recycled_qp_number_does_not_take_a_destroyed_qps_completion() {
        let (cq, qpn, old, stale) = with_one_request(0x77);
        cq.unregister(qpn, &old);
        let new = table(&cq, qpn, Some(old.tag()));
        assert_ne!(new.tag(), old.tag(), "the destroyed QP's tag was taken again");
        let mine = new.lock().push_send(2, None).unwrap();
        assert_eq!(stale, mine & !(0x7ff << 52) | old.tag(), "the same sequence number");
        let old_wc = WorkCompletion { byte_len: 111, ..completion(stale, qpn) };
        assert!(soft(&cq).push(old_wc));
        assert!(soft(&cq).push(WorkCompletion { wr_id: stale | RECV_BIT, ..old_wc }));
        assert!(soft(&cq).push(WorkCompletion { byte_len: 222, ..completion(mine, qpn) }));
        // The destroyed QP's completions are discarded, and retire nothing of the new QP:
        // what comes is the new QP's own.
        let wc = cq.poll_one().unwrap().unwrap();
        assert_eq!((wc.wr_id, wc.byte_len), (2, 222));
        // Until a poll finds the CQ empty, the old tag stays ruled out; then it is free.
        let mut avoid = Vec::new();
        cq.tags_in_use(qpn, &mut avoid);
        assert_eq!(avoid, [old.tag(), new.tag()]);
        assert_eq!(cq.poll_one().unwrap(), None);
        avoid.clear();
        cq.tags_in_use(qpn, &mut avoid);
        assert_eq!(avoid, [new.tag()]);
        // A QP destroyed with nothing outstanding leaves no tag behind.
        cq.unregister(qpn, &new);
        avoid.clear();
        cq.tags_in_use(qpn, &mut avoid);
        assert_eq!(avoid, []);
    }

    /// Completions of destroyed QPs ahead of a live one: the polls skip them and return the
    /// live one, never an "empty" answer a waiter would sleep on.
    #[test]
    fn discarded_completions_do_not_hide_the_ones_behind_them() {
        let cq = Context::open_soft().create_cq(16).unwrap();
        let qpn = 0x79;
        let live = table(&cq, qpn, None);
        for want in [1, 2] {
            let mine = live.lock().push_send(want, None).unwrap();
            for stale in [0x5 << 52 | 1, 0x6 << 52 | 1, 0x7 << 52 | 1] {
                assert!(soft(&cq).push(completion(stale, 0x9999)), "a destroyed QP's");
            }
            assert!(soft(&cq).push(completion(mine, qpn)));
            if want == 1 {
                assert_eq!(cq.poll_one().unwrap().map(|wc| wc.wr_id), Some(1));
            } else {
                let mut wcs = [WorkCompletion::default(); 2];
                assert_eq!(cq.poll(&mut wcs).unwrap(), 1);
                assert_eq!(wcs[0].wr_id, 2);
            }
        }
        assert_eq!(cq.poll_one().unwrap(), None);
        let mut wcs = [WorkCompletion::default(); 2];
        assert_eq!(cq.poll(&mut wcs).unwrap(), 0);
    }

    /// The number of a destroyed QP comes back to the provider before the QP is
    /// unregistered here, and a new QP takes it meanwhile: the old QP's unregistration
    /// leaves the new one's registration (its completions would all be discarded).
    #[test]
    fn a_late_unregistration_leaves_the_qp_that_took_the_number() {
        let (cq, qpn, old, stale) = with_one_request(0x78);
        let new = table(&cq, qpn, Some(old.tag()));
        assert_ne!(new.tag(), old.tag(), "the registered QP's tag was taken");
        cq.unregister(qpn, &old);
        let mine = new.lock().push_send(2, None).unwrap();
        assert!(soft(&cq).push(completion(stale, qpn)));
        assert!(soft(&cq).push(completion(mine, qpn)));
        let mut wcs = [WorkCompletion::default(); 4];
        assert_eq!(cq.poll(&mut wcs).unwrap(), 1);
        assert_eq!(wcs[0].wr_id, 2, "the new QP's completion is delivered, the old one's discarded");
        assert_eq!(new.outstanding(), (0, 0));
    }
}

#[cfg(all(test, feature = "async", not(miri)))]
mod tests {
    use super::*;

    /// Awaits on an idle soft CQ, each from a task of its own and given up at once (a
    /// timeout, a `select!` lost): nothing of those waits may stay behind in the CQ, or a
    /// program doing that in a loop would grow it without bound.
    #[test]
    fn abandoned_waits_leave_nothing_behind() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let cq = Context::open_soft().create_cq(16).unwrap();
        rt.block_on(async {
            for _ in 0..1000 {
                let cq = cq.clone();
                tokio::spawn(async move {
                    let r = tokio::time::timeout(Duration::ZERO, cq.next()).await;
                    assert!(r.is_err(), "an idle CQ gave a completion");
                })
                .await
                .unwrap();
            }
        });
        let Some(soft) = cq.inner.backend.soft() else { unreachable!("a soft CQ") };
        assert_eq!(soft.waiters(), 0, "abandoned waits kept their wakers");
    }

    /// Two first waits racing on one reactor register the fd once: both get the same
    /// registration (registering one fd twice with one epoll fails with `EEXIST`).
    #[cfg(feature = "async")]
    #[test]
    fn racing_first_registrations_register_once() {
        struct Fd(RawFd);
        impl std::os::fd::AsRawFd for Fd {
            fn as_raw_fd(&self) -> RawFd {
                self.0
            }
        }
        // SAFETY: a plain eventfd of our own, closed at the end of the test.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK) };
        assert!(fd >= 0);
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        for _ in 0..50 {
            let reg = Registered::<Fd>::default();
            let barrier = std::sync::Barrier::new(2);
            let got: Vec<usize> = std::thread::scope(|s| {
                let racers: Vec<_> = (0..2)
                    .map(|_| {
                        s.spawn(|| {
                            let _in_runtime = rt.enter();
                            barrier.wait();
                            let afd = reg.get_or_register(|| {
                                std::thread::sleep(std::time::Duration::from_millis(2)); // widen the window
                                // SAFETY: the eventfd stays open until every registration
                                // is dropped (closed after the loop).
                                unsafe {
                                    tokio::io::unix::AsyncFd::register_with_interest(
                                        Fd(fd),
                                        tokio::io::Interest::READABLE,
                                    )
                                }
                                .map_err(|e| Error::Os { call: "AsyncFd::register", source: e.into() })
                            });
                            afd.map(|a| a as *const _ as usize).unwrap()
                        })
                    })
                    .collect();
                racers.into_iter().map(|r| r.join().unwrap()).collect()
            });
            assert_eq!(got[0], got[1], "one registration");
        }
        // SAFETY: ours; every registration was dropped with its `Registered`.
        unsafe { libc::close(fd) };
    }
}
