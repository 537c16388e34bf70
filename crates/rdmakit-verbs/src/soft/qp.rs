//! Soft RC queue pairs.
//!
//! The requester side executes its send queue strictly in order under the send-queue lock
//! (RC ordering). Each request is carried to the peer QP over a [`Link`] and applied by the
//! peer's *responder* code, which checks the peer's keys, protection domain, access flags,
//! bounds and receive queue, then touches the peer's memory: the peer application does
//! nothing, as with a real NIC. The result comes back as a completion on the requester's
//! send CQ (and, for sends and writes with immediate, on the responder's receive CQ).
//!
//! A request the responder cannot take yet (no receive posted: RNR; peer gone or not
//! connected: no response) stays at the head of the send queue and blocks the ones behind
//! it, retried by the timer engine and by the peer's next `post_recv`, until its retry
//! budget from [`ConnectOptions`] runs out and it fails with `RNR_RETRY_EXC_ERR` or
//! `RETRY_EXC_ERR`, moving the QP to the error state.
//!
//! Lock order (deadlock freedom): a thread holds at most one send-queue lock, and may take
//! receive-queue locks and CQ locks under it; receive-queue holders take only CQ locks.
//! Work that would need a second send-queue lock (flushing a peer that went to error) is
//! deferred until the first is released.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::SoftDevice;
use super::cq::SoftCq;
use super::engine;
use super::mr::{Fault, MrEntry};
use super::tcp::TcpLink;
use super::wire::{self, Frame};
use crate::error::{Error, Result, WcStatus};
use crate::raw::{RawOp, RawRecvWr, RawSendWr, Sge};
use crate::shared_mem::{self, Dst, Src};
use crate::types::{AccessFlags, ConnectOptions, Endpoint, ProviderKind, QpCaps, QpState};
use crate::wc::{WcOpcode, WorkCompletion};

/// Largest inline payload the soft NIC accepts.
pub(crate) const MAX_INLINE: usize = 256;

const RESET: u8 = 0;
const INIT: u8 = 1;
const RTR: u8 = 2;
const RTS: u8 = 3;
const ERR: u8 = 4;

fn state_of(s: u8) -> QpState {
    match s {
        RESET => QpState::Reset,
        INIT => QpState::Init,
        RTR => QpState::ReadyToReceive,
        RTS => QpState::ReadyToSend,
        _ => QpState::Error,
    }
}

/// How a requester reaches its responder: a QP in this process (requests run at once), or
/// a QP of another process over TCP (requests are sent, answered later, in order).
pub(crate) enum Link {
    Local { gid: [u8; 16], qpn: u32, peer: Weak<SoftQp> },
    Tcp(TcpLink),
}

impl Link {
    fn local_peer(gid: &[u8; 16], qpn: u32, peer: &mut Weak<SoftQp>) -> Option<Arc<SoftQp>> {
        if let Some(p) = peer.upgrade() {
            return Some(p);
        }
        // Not there at RTR time (or gone): look again; a destroyed QP stays gone.
        let p = SoftDevice::by_gid(gid)?.find_qp(qpn)?;
        *peer = Arc::downgrade(&p);
        Some(p)
    }
}

/// Connection tokens of the soft bootstrap (see [`SoftQp::set_tokens`]).
#[derive(Clone, Copy, Default)]
struct Tokens {
    rx: [u8; 16],
    tx: [u8; 16],
}

/// The verdict on a Hello.
pub(crate) enum Auth {
    /// It is the connected peer: serve it.
    Accepted,
    /// The QP is not connected yet: ask again later.
    NotYet,
    /// Not the connected peer, or the QP already serves one.
    Refused,
}

/// Who sent a request, as the responder sees it.
pub(crate) struct Requester<'a> {
    gid: [u8; 16],
    qpn: u32,
    /// An in-process requester to kick when a receive is posted after an RNR.
    waiter: Option<&'a Weak<SoftQp>>,
}

impl Requester<'static> {
    /// A requester in another process.
    pub fn remote(gid: [u8; 16], qpn: u32) -> Self {
        Requester { gid, qpn, waiter: None }
    }
}

/// The local end of a sent read or atomic: where its response data goes.
struct LocalTarget {
    ptr: *mut u8,
    len: u32,
    _entry: Arc<MrEntry>,
}

// SAFETY: `_entry` keeps the registration's memory alive and `ptr` points into it; the bytes
// are only written through `shared_mem`, which is sound from any thread.
unsafe impl Send for LocalTarget {}

/// A request sent over TCP and not yet answered.
struct Sent {
    p: Pending,
    psn: u32,
    at: Instant,
    target: Option<LocalTarget>,
}

/// A send request kept because it could not run yet.
struct Pending {
    wr_id: u64,
    op: RawOp,
    sge: Option<Sge>,
    inline: Option<Box<[u8]>>,
    remote_addr: u64,
    rkey: u32,
    signaled: bool,
}

impl Pending {
    fn from_raw(wr: &RawSendWr<'_>) -> Pending {
        Pending {
            wr_id: wr.wr_id,
            op: wr.op,
            sge: wr.sge,
            inline: wr.inline.map(Box::from),
            remote_addr: wr.remote_addr,
            rkey: wr.rkey,
            signaled: wr.signaled,
        }
    }

    fn view(&self) -> RawSendWr<'_> {
        RawSendWr {
            wr_id: self.wr_id,
            op: self.op,
            sge: self.sge,
            inline: self.inline.as_deref(),
            remote_addr: self.remote_addr,
            rkey: self.rkey,
            signaled: self.signaled,
            fence: false,
            solicited: false,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum RetryKind {
    Rnr,
    Transport,
}

struct Retry {
    kind: RetryKind,
    /// `None`: retry forever (rnr_retry = 7, timeout = 0).
    deadline: Option<Instant>,
}

struct Sq {
    pending: VecDeque<Pending>,
    /// Sent over TCP, awaiting their responses (oldest first).
    sent: VecDeque<Sent>,
    next_psn: u32,
    link: Option<Link>,
    opts: ConnectOptions,
    retry: Option<Retry>,
}

struct Rq {
    posted: VecDeque<RawRecvWr>,
    /// Requesters that got an RNR NAK from us; kicked when a receive is posted.
    rnr_waiters: Vec<Weak<SoftQp>>,
}

/// What one execution attempt of a send request gave.
enum Outcome {
    Done(WcStatus, u32),
    Rnr,
    NoResponse,
}

/// Work to do after the send-queue lock is released.
#[derive(Default)]
struct Deferred {
    kick: Vec<Arc<SoftQp>>,
}

pub(crate) struct SoftQp {
    qpn: u32,
    device: Arc<SoftDevice>,
    pd: u64,
    send_cq: Arc<SoftCq>,
    recv_cq: Arc<SoftCq>,
    state: AtomicU8,
    /// Remote access this QP grants as a responder (`IBV_QP_ACCESS_FLAGS`).
    access: AtomicU32,
    remote_qpn: AtomicU32,
    /// The remote QP's initial PSN (from its endpoint), set at RTR.
    remote_psn: AtomicU32,
    /// Our initial PSN: the first request we send carries it, and a requester in another
    /// process proves it knows it in its Hello.
    psn: u32,
    /// Connection tokens from the soft bootstrap (zero when endpoints were exchanged
    /// otherwise): `rx` is what a requester must present to us, `tx` what we present.
    tokens: Mutex<Tokens>,
    /// True once a requester in another process authenticated against this QP: one
    /// connection per connected QP, so a replayed Hello gets nothing.
    claimed: AtomicBool,
    /// Most outstanding send requests (bounds the link's queue).
    max_send_wr: u32,
    /// The earliest timer armed for this QP and not fired yet: later ones are not queued
    /// (the earlier one re-evaluates everything), so timers stay one per QP at a time.
    timer: Mutex<Option<Instant>>,
    /// Set once, at RTR.
    remote_gid: OnceLock<[u8; 16]>,
    sq: Mutex<Sq>,
    rq: Mutex<Rq>,
    me: Weak<SoftQp>,
}

impl SoftQp {
    pub fn create(
        device: &Arc<SoftDevice>,
        psn: u32,
        pd: u64,
        send_cq: Arc<SoftCq>,
        recv_cq: Arc<SoftCq>,
        caps: QpCaps,
    ) -> Result<Arc<SoftQp>> {
        let cfg = device.config();
        if caps.max_send_wr == 0 || caps.max_send_wr > cfg.max_qp_wr || caps.max_recv_wr > cfg.max_qp_wr {
            return Err(Error::InvalidArgument(format!(
                "queue depths send {} / recv {} must be 1..={} on {}",
                caps.max_send_wr,
                caps.max_recv_wr,
                cfg.max_qp_wr,
                device.name()
            )));
        }
        if caps.max_send_sge > 1 || caps.max_recv_sge > 1 {
            return Err(Error::Unsupported("the soft NIC takes one SGE per work request".into()));
        }
        if caps.max_inline_data > cfg.max_inline_data {
            return Err(Error::InvalidArgument(format!(
                "max_inline_data {} exceeds the device's {}",
                caps.max_inline_data, cfg.max_inline_data
            )));
        }
        let qp = Arc::new_cyclic(|me| SoftQp {
            qpn: device.alloc_qpn(),
            device: device.clone(),
            pd,
            send_cq,
            recv_cq,
            state: AtomicU8::new(RESET),
            access: AtomicU32::new(0),
            remote_qpn: AtomicU32::new(0),
            remote_psn: AtomicU32::new(0),
            psn: psn & 0x00ff_ffff,
            tokens: Mutex::new(Tokens::default()),
            claimed: AtomicBool::new(false),
            max_send_wr: caps.max_send_wr,
            timer: Mutex::new(None),
            remote_gid: OnceLock::new(),
            sq: Mutex::new(Sq {
                pending: VecDeque::new(),
                sent: VecDeque::new(),
                next_psn: psn & 0x00ff_ffff,
                link: None,
                opts: ConnectOptions::default(),
                retry: None,
            }),
            rq: Mutex::new(Rq { posted: VecDeque::new(), rnr_waiters: Vec::new() }),
            me: me.clone(),
        });
        device.register_qp(&qp);
        Ok(qp)
    }

    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    pub fn state(&self) -> QpState {
        state_of(self.state.load(Ordering::Acquire))
    }

    /// The endpoint peers connect to; `lid` carries the device's TCP port so that QPs of
    /// other processes can reach it.
    pub fn endpoint(&self) -> Endpoint {
        let lid = self.device.port();
        Endpoint {
            provider: ProviderKind::Soft,
            lid,
            gid: self.device.gid(),
            qp_num: self.qpn,
            psn: self.psn,
        }
    }

    /// Sets the connection tokens the soft bootstrap exchanged (before RTR).
    pub fn set_tokens(&self, rx: [u8; 16], tx: [u8; 16]) {
        *self.tokens.lock().expect("tokens") = Tokens { rx, tx };
    }

    /// Checks a Hello from another process against what this QP was connected to: the
    /// requester's GID, QPN and initial PSN, our initial PSN, and our connection token.
    /// One requester connection per QP.
    pub fn authenticate(
        &self,
        gid: &[u8; 16],
        qpn: u32,
        src_psn: u32,
        dst_psn: u32,
        token: &[u8; 16],
    ) -> Auth {
        match self.state.load(Ordering::Acquire) {
            RESET | INIT => return Auth::NotYet,
            RTR | RTS => {}
            _ => return Auth::Refused,
        }
        let rx = self.tokens.lock().expect("tokens").rx;
        // Compare every field whatever the first mismatch (no early exit on secrets).
        let token_ok = rx.iter().zip(token).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
        let ok = token_ok
            & (self.remote_psn.load(Ordering::Acquire) == src_psn)
            & (self.psn == dst_psn)
            & (self.remote_qpn.load(Ordering::Acquire) == qpn)
            & (self.remote_gid.get() == Some(gid));
        if ok && !self.claimed.swap(true, Ordering::AcqRel) { Auth::Accepted } else { Auth::Refused }
    }

    fn bad_transition(&self, to: &'static str) -> Error {
        Error::QpState { qp_num: self.qpn, state: self.state(), op: to }
    }

    /// RESET → INIT.
    pub fn modify_to_init(&self, access: AccessFlags) -> Result<()> {
        access.validate()?;
        match self.state.load(Ordering::Acquire) {
            RESET | INIT => {
                self.access.store(access.bits(), Ordering::Release);
                self.state.store(INIT, Ordering::Release);
                Ok(())
            }
            _ => Err(self.bad_transition("move to INIT")),
        }
    }

    /// INIT → RTR, aimed at `remote`.
    pub fn modify_to_rtr(&self, remote: &Endpoint, opts: &ConnectOptions) -> Result<()> {
        if remote.provider != ProviderKind::Soft {
            return Err(Error::InvalidArgument(format!(
                "cannot connect a soft QP to a {} endpoint",
                remote.provider
            )));
        }
        if self.state.load(Ordering::Acquire) != INIT {
            return Err(self.bad_transition("move to RTR"));
        }
        let link = match SoftDevice::by_gid(&remote.gid) {
            // A device of this process: direct.
            Some(dev) => {
                let peer = dev.find_qp(remote.qp_num).map(|p| Arc::downgrade(&p)).unwrap_or_default();
                Link::Local { gid: remote.gid, qpn: remote.qp_num, peer }
            }
            // Another process: over TCP to the address in the GID and the port in the LID.
            None => {
                let ip = std::net::Ipv4Addr::new(remote.gid[4], remote.gid[5], remote.gid[6], remote.gid[7]);
                let me = self.me.upgrade().expect("a QP being modified is alive");
                let hello = Frame::Hello {
                    src_gid: self.device.gid(),
                    src_qpn: self.qpn,
                    dst_qpn: remote.qp_num,
                    src_psn: self.psn,
                    dst_psn: remote.psn & 0x00ff_ffff,
                    token: self.tokens.lock().expect("tokens").tx,
                };
                // Frames in the queue: at most the outstanding requests, twice over when an
                // RNR NAK makes them go back (the queue may still hold the first copies).
                let queue = 2 * self.max_send_wr as usize + 2;
                Link::Tcp(TcpLink::connect(&me, std::net::SocketAddr::from((ip, remote.lid)), hello, queue))
            }
        };
        let mut sq = self.sq.lock().expect("sq lock");
        if self.state.load(Ordering::Acquire) != INIT {
            return Err(self.bad_transition("move to RTR"));
        }
        sq.link = Some(link);
        sq.opts = *opts;
        // INIT -> RTR happens once (there is no way back to INIT), so this is the only set.
        let _ = self.remote_gid.set(remote.gid);
        self.remote_qpn.store(remote.qp_num, Ordering::Release);
        self.remote_psn.store(remote.psn & 0x00ff_ffff, Ordering::Release);
        self.state.store(RTR, Ordering::Release);
        Ok(())
    }

    /// RTR → RTS.
    pub fn modify_to_rts(&self) -> Result<()> {
        match self.state.compare_exchange(RTR, RTS, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Ok(()),
            Err(_) => Err(self.bad_transition("move to RTS")),
        }
    }

    /// Any state → ERR: outstanding requests flush.
    pub fn modify_to_err(&self) {
        let mut d = Deferred::default();
        {
            let mut sq = self.sq.lock().expect("sq lock");
            self.enter_error(&mut sq, &mut d);
        }
        run_deferred(d);
    }

    /// Called by the safe layer when the QP object is destroyed.
    pub fn destroy(&self) {
        self.state.store(ERR, Ordering::Release);
        self.device.unregister_qp(self.qpn);
        {
            let mut sq = self.sq.lock().expect("sq lock");
            sq.pending.clear();
            sq.link = None;
        }
        self.rq.lock().expect("rq lock").posted.clear();
        self.send_cq.remove_qp(self.qpn);
        self.recv_cq.remove_qp(self.qpn);
    }

    /// Posts send requests. On refusal returns how many were posted and why.
    pub fn post_send(&self, wrs: &[RawSendWr<'_>]) -> std::result::Result<(), (usize, Error)> {
        let st = self.state.load(Ordering::Acquire);
        if st != RTS && st != ERR {
            return Err((0, self.bad_transition("post a send request")));
        }
        let mut d = Deferred::default();
        let mut sq = self.sq.lock().expect("sq lock");
        if st == ERR {
            // Flush what is queued first, so flush completions keep posting order.
            self.progress(&mut sq, &mut d);
        }
        // Inline length, lengths and alignment were checked by `SendWr::to_raw`.
        for wr in wrs {
            if self.state.load(Ordering::Acquire) == ERR {
                self.complete_send(wr, WcStatus::WR_FLUSH_ERR, 0, true);
                continue;
            }
            if sq.pending.is_empty() && sq.retry.is_none() {
                // Fast path: nothing ahead of it, run it now (no copy of the request).
                match self.run_head(&mut sq, wr, &mut d) {
                    Step::Completed | Step::Failed => {}
                    Step::Blocked => sq.pending.push_back(Pending::from_raw(wr)),
                    Step::Sent(psn, target) => self.push_sent(&mut sq, Pending::from_raw(wr), psn, target),
                }
            } else {
                sq.pending.push_back(Pending::from_raw(wr));
            }
        }
        drop(sq);
        run_deferred(d);
        Ok(())
    }

    /// Posts receive requests.
    pub fn post_recv(&self, wrs: &[RawRecvWr]) -> std::result::Result<(), (usize, Error)> {
        let st = self.state.load(Ordering::Acquire);
        if st == RESET {
            return Err((0, self.bad_transition("post a receive request")));
        }
        let waiters = {
            let mut rq = self.rq.lock().expect("rq lock");
            for wr in wrs {
                if self.state.load(Ordering::Acquire) == ERR {
                    self.complete_recv(wr.wr_id, WcStatus::WR_FLUSH_ERR, WcOpcode::RECV, 0, None);
                } else {
                    rq.posted.push_back(*wr);
                }
            }
            std::mem::take(&mut rq.rnr_waiters)
        };
        // A requester waiting on our RNR NAK can go now.
        for w in waiters {
            if let Some(qp) = w.upgrade() {
                qp.kick();
            }
        }
        Ok(())
    }

    /// Re-runs the send queue (after a timer or a peer's receive).
    pub fn on_timer(&self) {
        *self.timer.lock().expect("timer slot") = None;
        self.kick();
    }

    fn kick(&self) {
        let mut d = Deferred::default();
        {
            let mut sq = self.sq.lock().expect("sq lock");
            self.progress(&mut sq, &mut d);
        }
        run_deferred(d);
    }

    /// Runs pending requests from the head until one blocks or the queue is empty.
    fn progress(&self, sq: &mut MutexGuard<'_, Sq>, d: &mut Deferred) {
        if self.sent_timed_out(sq) {
            let s = sq.sent.pop_front().expect("timed out, so not empty");
            self.complete_send(&s.p.view(), WcStatus::RETRY_EXC_ERR, 0, true);
            self.enter_error(sq, d);
        }
        while let Some(head) = sq.pending.pop_front() {
            if self.state.load(Ordering::Acquire) == ERR {
                self.complete_send(&head.view(), WcStatus::WR_FLUSH_ERR, 0, true);
                continue;
            }
            match self.run_head(sq, &head.view(), d) {
                Step::Completed | Step::Failed => {}
                Step::Sent(psn, target) => self.push_sent(sq, head, psn, target),
                Step::Blocked => {
                    sq.pending.push_front(head);
                    return;
                }
            }
        }
    }

    /// Records a request sent over TCP; arms the transport timer for the oldest one.
    fn push_sent(&self, sq: &mut Sq, p: Pending, psn: u32, target: Option<LocalTarget>) {
        let now = Instant::now();
        if sq.sent.is_empty() {
            self.arm_transport_timer(sq, now);
        }
        sq.sent.push_back(Sent { p, psn, at: now, target });
    }

    fn arm_transport_timer(&self, sq: &Sq, from: Instant) {
        if let Some(budget) = sq.opts.transport_budget() {
            self.schedule(from + budget);
        }
    }

    /// True if the oldest unanswered request has used up the transport retry budget (the
    /// peer died, hangs, or the link broke). Re-arms the timer otherwise.
    fn sent_timed_out(&self, sq: &Sq) -> bool {
        let Some(front) = sq.sent.front() else { return false };
        let Some(budget) = sq.opts.transport_budget() else { return false };
        if front.at.elapsed() >= budget {
            return true;
        }
        self.arm_transport_timer(sq, front.at);
        false
    }

    /// Executes the request at the head of the send queue and handles its outcome.
    fn run_head(&self, sq: &mut Sq, wr: &RawSendWr<'_>, d: &mut Deferred) -> Step {
        let outcome = match sq.link.as_mut() {
            Some(Link::Tcp(link)) if !link.is_dead() => match self.remote_request(wr, sq.next_psn) {
                Ok((frame, target, tail)) => {
                    if link.send(frame, tail) {
                        let psn = sq.next_psn;
                        sq.next_psn = super::tcp::next_psn(psn);
                        return Step::Sent(psn, target);
                    }
                    Outcome::NoResponse
                }
                Err(status) => Outcome::Done(status, 0),
            },
            Some(Link::Tcp(_)) | None => Outcome::NoResponse,
            Some(Link::Local { gid, qpn, peer }) => match Link::local_peer(gid, *qpn, peer) {
                Some(peer) => self.execute(wr, &peer, d),
                None => Outcome::NoResponse,
            },
        };
        let (kind, exceeded) = match outcome {
            Outcome::Done(status, len) => {
                sq.retry = None;
                let delivered = self.complete_send(wr, status, len, false);
                if status.is_success() && delivered {
                    return Step::Completed;
                }
                self.enter_error(sq, d);
                return Step::Failed;
            }
            Outcome::Rnr => (RetryKind::Rnr, WcStatus::RNR_RETRY_EXC_ERR),
            Outcome::NoResponse => (RetryKind::Transport, WcStatus::RETRY_EXC_ERR),
        };
        if self.keep_retrying(sq, kind) {
            return Step::Blocked;
        }
        sq.retry = None;
        self.complete_send(wr, exceeded, 0, true);
        self.enter_error(sq, d);
        Step::Failed
    }

    /// Starts or continues a retry wait; false once the budget is spent.
    fn keep_retrying(&self, sq: &mut Sq, kind: RetryKind) -> bool {
        let now = Instant::now();
        let (budget, interval) = match kind {
            RetryKind::Rnr => {
                let one = ConnectOptions { rnr_retry: 0, ..sq.opts }.rnr_budget();
                (sq.opts.rnr_budget(), one.unwrap_or(Duration::from_millis(1)))
            }
            RetryKind::Transport => {
                let one = ConnectOptions { retry_cnt: 0, ..sq.opts }.transport_budget();
                (sq.opts.transport_budget(), one.unwrap_or(Duration::from_secs(1)))
            }
        };
        match &sq.retry {
            Some(r) if r.kind == kind => {
                if r.deadline.is_some_and(|dl| now >= dl) {
                    return false;
                }
            }
            _ => sq.retry = Some(Retry { kind, deadline: budget.map(|b| now + b) }),
        }
        let next = now + interval;
        let at = match sq.retry.as_ref().and_then(|r| r.deadline) {
            Some(dl) => next.min(dl),
            None => next,
        };
        self.schedule(at);
        true
    }

    /// Arms a timer at `at` unless one at or before `at` is already armed (it will
    /// re-evaluate the queue and re-arm as needed): one pending timer per QP.
    fn schedule(&self, at: Instant) {
        let mut t = self.timer.lock().expect("timer slot");
        if t.is_some_and(|armed| armed <= at) {
            return;
        }
        *t = Some(at);
        drop(t);
        engine::schedule(at, self.me.clone());
    }

    /// Moves to ERR and flushes both queues. The caller holds our send-queue lock.
    fn enter_error(&self, sq: &mut Sq, d: &mut Deferred) {
        self.state.store(ERR, Ordering::Release);
        sq.retry = None;
        while let Some(s) = sq.sent.pop_front() {
            self.complete_send(&s.p.view(), WcStatus::WR_FLUSH_ERR, 0, true);
        }
        while let Some(p) = sq.pending.pop_front() {
            self.complete_send(&p.view(), WcStatus::WR_FLUSH_ERR, 0, true);
        }
        let waiters = self.flush_rq();
        d.kick.extend(waiters.iter().filter_map(Weak::upgrade));
    }

    /// Flushes posted receives; returns the requesters that were waiting on us.
    fn flush_rq(&self) -> Vec<Weak<SoftQp>> {
        let mut rq = self.rq.lock().expect("rq lock");
        while let Some(r) = rq.posted.pop_front() {
            self.complete_recv(r.wr_id, WcStatus::WR_FLUSH_ERR, WcOpcode::RECV, 0, None);
        }
        std::mem::take(&mut rq.rnr_waiters)
    }

    /// Responder-side fatal error (as IB's class A/C errors): the responder QP goes to ERR.
    /// Its send queue is flushed after the requester's lock is released.
    fn responder_error(&self, d: &mut Deferred) {
        self.state.store(ERR, Ordering::Release);
        let _ = self.flush_rq();
        if let Some(me) = self.me.upgrade() {
            d.kick.push(me);
        }
    }

    /// Reports a send completion; returns false if the CQ overran.
    fn complete_send(&self, wr: &RawSendWr<'_>, status: WcStatus, len: u32, force: bool) -> bool {
        if !status.is_success() {
            // An RC requester error moves the QP to ERR; do it before the completion is
            // visible, so whoever reaps it sees the new state.
            self.state.store(ERR, Ordering::Release);
        }
        if !(wr.signaled || force || !status.is_success()) {
            return true;
        }
        let opcode = match wr.op {
            RawOp::Write { .. } => WcOpcode::RDMA_WRITE,
            RawOp::Read => WcOpcode::RDMA_READ,
            RawOp::Send { .. } => WcOpcode::SEND,
            RawOp::FetchAdd { .. } => WcOpcode::FETCH_ADD,
            RawOp::CompareSwap { .. } => WcOpcode::COMP_SWAP,
        };
        let ok = self.send_cq.push(WorkCompletion {
            wr_id: wr.wr_id,
            status,
            opcode,
            byte_len: len,
            imm: None,
            qp_num: self.qpn,
            vendor_err: 0,
        });
        if !ok {
            self.state.store(ERR, Ordering::Release);
        }
        ok
    }

    fn complete_recv(&self, wr_id: u64, status: WcStatus, opcode: WcOpcode, len: u32, imm: Option<u32>) {
        let ok = self.recv_cq.push(WorkCompletion {
            wr_id,
            status,
            opcode,
            byte_len: len,
            imm,
            qp_num: self.qpn,
            vendor_err: 0,
        });
        if !ok {
            self.state.store(ERR, Ordering::Release);
        }
    }

    // ---- requester ----

    /// Checks the request's local buffer as the HCA does (lkey, PD, bounds, access).
    /// Returns the bytes as a copy source (inline data is the caller's, so `Private`) and,
    /// for a registered buffer, its pointer and the entry keeping it alive.
    fn resolve_local(&self, wr: &RawSendWr<'_>) -> std::result::Result<LocalBuf, WcStatus> {
        let writes_local = matches!(wr.op, RawOp::Read | RawOp::FetchAdd { .. } | RawOp::CompareSwap { .. });
        if matches!(wr.op, RawOp::FetchAdd { .. } | RawOp::CompareSwap { .. }) && wr.len() != 8 {
            return Err(WcStatus::LOC_LEN_ERR);
        }
        match (wr.inline, wr.sge) {
            (Some(data), _) if !writes_local => {
                Ok(LocalBuf { src: Src::Private(data.as_ptr()), ptr: std::ptr::null_mut(), entry: None })
            }
            (Some(_), _) => Err(WcStatus::LOC_QP_OP_ERR),
            (None, Some(sge)) if sge.len > 0 => {
                let need = if writes_local { AccessFlags::LOCAL_WRITE } else { AccessFlags::empty() };
                let (p, entry) = self
                    .device
                    .mrs
                    .resolve(sge.lkey, self.pd, sge.addr, u64::from(sge.len), need)
                    .map_err(|_| WcStatus::LOC_PROT_ERR)?;
                Ok(LocalBuf { src: Src::Shared(p), ptr: p, entry: Some(entry) })
            }
            _ => Ok(LocalBuf { src: Src::Private(std::ptr::null()), ptr: std::ptr::null_mut(), entry: None }),
        }
    }

    /// Runs a request against a responder QP of this process.
    fn execute(&self, wr: &RawSendWr<'_>, peer: &SoftQp, d: &mut Deferred) -> Outcome {
        let len = wr.len();
        let local = match self.resolve_local(wr) {
            Ok(l) => l,
            Err(status) => return Outcome::Done(status, 0),
        };
        let me = Requester { gid: self.device.gid(), qpn: self.qpn, waiter: Some(&self.me) };
        if !peer.accepts_from(&me) {
            return Outcome::NoResponse;
        }
        let (src, dst) = (local.src, Dst::Shared(local.ptr));
        match wr.op {
            RawOp::Write { imm } => peer.respond_write(&me, src, len, wr.remote_addr, wr.rkey, imm, d),
            RawOp::Read => peer.respond_read(dst, len, wr.remote_addr, wr.rkey, d),
            RawOp::Send { imm } => peer.respond_send(&me, src, len, imm, d),
            op => peer.respond_atomic(dst, wr.remote_addr, wr.rkey, op, d),
        }
    }

    /// Builds the frame for a request to a responder in another process. A write or send
    /// from a registered region leaves its payload in the region (`SharedTail`): the link's
    /// writer thread hands it to the socket from there, without a copy.
    fn remote_request(
        &self,
        wr: &RawSendWr<'_>,
        psn: u32,
    ) -> std::result::Result<(Frame, Option<LocalTarget>, Option<SharedTail>), WcStatus> {
        let len = wr.len();
        if len > wire::MAX_MESSAGE {
            return Err(WcStatus::LOC_LEN_ERR);
        }
        let local = self.resolve_local(wr)?;
        let (data, tail) = match (&local.entry, wr.op) {
            // Large payloads only: smaller ones are cheaper copied into the link's buffer,
            // which batches many requests into one system call.
            (Some(e), RawOp::Write { .. } | RawOp::Send { .. }) if len >= SHARED_TAIL_MIN => {
                (Vec::new(), Some(SharedTail { ptr: local.ptr, len: len as usize, _entry: e.clone() }))
            }
            (_, RawOp::Write { .. } | RawOp::Send { .. }) => {
                let mut data = Vec::<u8>::with_capacity(len as usize);
                // `local.src`: a checked registration kept alive by `local.entry`, or inline
                // data borrowed for this call.
                // SAFETY: `local.src` is valid for `len` bytes; `data`'s spare capacity is
                // ours, `len` bytes, and the copy initialises exactly what `set_len` exposes.
                unsafe {
                    shared_mem::copy(local.src, Dst::Private(data.as_mut_ptr()), len as usize);
                    data.set_len(len as usize);
                }
                (data, None)
            }
            _ => (Vec::new(), None),
        };
        let target = || local.entry.clone().map(|e| LocalTarget { ptr: local.ptr, len, _entry: e });
        let (addr, rkey) = (wr.remote_addr, wr.rkey);
        Ok(match wr.op {
            RawOp::Write { imm } => (Frame::Write { psn, addr, rkey, imm, data }, None, tail),
            RawOp::Send { imm } => (Frame::Send { psn, imm, data }, None, tail),
            RawOp::Read => (Frame::Read { psn, addr, rkey, len }, target(), None),
            RawOp::FetchAdd { add } => (Frame::FetchAdd { psn, addr, rkey, add }, target(), None),
            RawOp::CompareSwap { compare, swap } => {
                (Frame::CmpSwap { psn, addr, rkey, compare, swap }, target(), None)
            }
        })
    }

    /// The most data bytes an answer may carry now: what the oldest request sent over TCP
    /// and not answered yet expects back (a read's length, an atomic's 8 bytes, else 0).
    pub fn response_data_limit(&self) -> usize {
        let sq = self.sq.lock().expect("sq lock");
        sq.sent.front().and_then(|s| s.target.as_ref()).map_or(0, |t| t.len as usize)
    }

    /// A response from the remote responder (called by the link's reader thread).
    pub fn on_remote_response(&self, f: Frame) {
        let mut d = Deferred::default();
        {
            let mut sq = self.sq.lock().expect("sq lock");
            let psn = match &f {
                Frame::Ack { psn, .. } | Frame::RnrNak { psn } => *psn,
                _ => return,
            };
            if sq.sent.front().is_none_or(|s| s.psn != psn) {
                // Not the oldest outstanding request: a confused or hostile peer.
                tracing::error!(qp = self.qpn, psn, "soft NIC: response out of order; ignored");
                return;
            }
            match f {
                Frame::Ack { status, data, .. } => {
                    let s = sq.sent.pop_front().expect("checked above");
                    sq.retry = None;
                    let mut status = WcStatus(status);
                    let mut len = 0;
                    if status.is_success() {
                        match (&s.target, s.p.op) {
                            (Some(t), RawOp::Read | RawOp::FetchAdd { .. } | RawOp::CompareSwap { .. }) => {
                                if data.len() == t.len as usize {
                                    // SAFETY: `t.ptr` is the checked local buffer of `t.len`
                                    // bytes, kept alive by `t._entry`; `data` is ours.
                                    unsafe {
                                        shared_mem::copy(
                                            Src::Private(data.as_ptr()),
                                            Dst::Shared(t.ptr),
                                            data.len(),
                                        )
                                    };
                                    len = t.len;
                                } else {
                                    status = WcStatus::BAD_RESP_ERR;
                                }
                            }
                            (None, RawOp::Read) if data.is_empty() => {}
                            _ => len = s.p.view().len(),
                        }
                    }
                    let delivered = self.complete_send(&s.p.view(), status, len, false);
                    if !status.is_success() || !delivered {
                        self.enter_error(&mut sq, &mut d);
                    } else if sq.retry.is_none() && !sq.pending.is_empty() {
                        self.progress(&mut sq, &mut d);
                    }
                }
                Frame::RnrNak { .. } => {
                    // Go back N: the responder dropped everything after the NAKed request;
                    // it all returns to the head of the queue, in order, with the same PSNs.
                    while let Some(s) = sq.sent.pop_back() {
                        sq.pending.push_front(s.p);
                    }
                    sq.next_psn = psn;
                    if !self.keep_retrying(&mut sq, RetryKind::Rnr) {
                        let head = sq.pending.pop_front().expect("the NAKed request");
                        sq.retry = None;
                        self.complete_send(&head.view(), WcStatus::RNR_RETRY_EXC_ERR, 0, true);
                        self.enter_error(&mut sq, &mut d);
                    }
                }
                _ => {}
            }
        }
        run_deferred(d);
    }

    // ---- responder ----

    /// A request from a QP of another process (called by the device's connection
    /// thread). Returns the response, or `None` to drop the request silently, as a NIC
    /// drops packets for a QP that is not connected to their sender.
    pub fn serve_remote(&self, from: &Requester<'_>, f: Frame) -> Option<Frame> {
        if !self.accepts_from(from) {
            return None;
        }
        let mut d = Deferred::default();
        let (psn, outcome, data) = match f {
            Frame::Write { psn, addr, rkey, imm, data } => {
                let len = data.len() as u32;
                (
                    psn,
                    self.respond_write(from, Src::Private(data.as_ptr()), len, addr, rkey, imm, &mut d),
                    Vec::new(),
                )
            }
            Frame::Send { psn, imm, data } => (
                psn,
                self.respond_send(from, Src::Private(data.as_ptr()), data.len() as u32, imm, &mut d),
                Vec::new(),
            ),
            Frame::Read { psn, len, .. } if len > wire::MAX_MESSAGE => {
                (psn, Outcome::Done(WcStatus::REM_INV_REQ_ERR, 0), Vec::new())
            }
            Frame::Read { psn, addr, rkey, len } => {
                let mut buf = vec![0u8; len as usize];
                (psn, self.respond_read(Dst::Private(buf.as_mut_ptr()), len, addr, rkey, &mut d), buf)
            }
            Frame::FetchAdd { psn, addr, rkey, add } => {
                let mut buf = vec![0u8; 8];
                let out = self.respond_atomic(
                    Dst::Private(buf.as_mut_ptr()),
                    addr,
                    rkey,
                    RawOp::FetchAdd { add },
                    &mut d,
                );
                (psn, out, buf)
            }
            Frame::CmpSwap { psn, addr, rkey, compare, swap } => {
                let mut buf = vec![0u8; 8];
                let op = RawOp::CompareSwap { compare, swap };
                (psn, self.respond_atomic(Dst::Private(buf.as_mut_ptr()), addr, rkey, op, &mut d), buf)
            }
            _ => return None,
        };
        run_deferred(d);
        Some(match outcome {
            Outcome::Done(status, _) => {
                let data = if status.is_success() { data } else { Vec::new() };
                Frame::Ack { psn, status: status.0, data }
            }
            Outcome::Rnr => Frame::RnrNak { psn },
            Outcome::NoResponse => return None,
        })
    }

    /// The most data bytes a write to `addr` with `rkey` can land: the bytes of the key's
    /// range from `addr` if the QP and the key allow remote writes there, else 0.
    pub fn write_data_limit(&self, addr: u64, rkey: u32) -> usize {
        let qp_access = AccessFlags::from_bits_truncate(self.access.load(Ordering::Acquire));
        if !qp_access.contains(AccessFlags::REMOTE_WRITE) {
            return 0;
        }
        let Some(top) = self.device.mrs.lookup(rkey) else { return 0 };
        if self.device.mrs.resolve(rkey, self.pd, addr, 1, AccessFlags::REMOTE_WRITE).is_err() {
            return 0;
        }
        let end = top.base.saturating_add(top.len);
        end.saturating_sub(addr).min(u64::from(wire::MAX_MESSAGE)) as usize
    }

    /// Answers a write whose `data_len` bytes of data were too many for its target (read
    /// and dropped by the connection): the error the target check gives for that length,
    /// and the responder error that follows, as if the data had been kept.
    pub fn refuse_write(&self, from: &Requester<'_>, f: Frame, data_len: usize) -> Option<Frame> {
        if !self.accepts_from(from) {
            return None;
        }
        let Frame::Write { psn, addr, rkey, .. } = f else { return None };
        let len = u32::try_from(data_len).unwrap_or(u32::MAX);
        let status =
            self.target(addr, rkey, len, AccessFlags::REMOTE_WRITE).err().unwrap_or(WcStatus::REM_ACCESS_ERR);
        let mut d = Deferred::default();
        self.responder_error(&mut d);
        run_deferred(d);
        Some(Frame::Ack { psn, status: status.0, data: Vec::new() })
    }

    /// A connected responder takes packets only from its own remote QP, in RTR or RTS.
    fn accepts_from(&self, from: &Requester<'_>) -> bool {
        let st = self.state.load(Ordering::Acquire);
        (st == RTR || st == RTS)
            && self.remote_qpn.load(Ordering::Acquire) == from.qpn
            && self.remote_gid.get() == Some(&from.gid)
    }

    /// Resolves a remote target: QP-level then region-level permission, bounds.
    fn target(
        &self,
        addr: u64,
        rkey: u32,
        len: u32,
        need: AccessFlags,
    ) -> std::result::Result<(*mut u8, Option<Arc<MrEntry>>), WcStatus> {
        let qp_access = AccessFlags::from_bits_truncate(self.access.load(Ordering::Acquire));
        if !qp_access.contains(need) {
            return Err(WcStatus::REM_INV_REQ_ERR);
        }
        if len == 0 {
            // Zero-length RDMA operations carry no key check (IB spec).
            return Ok((std::ptr::null_mut(), None));
        }
        match self.device.mrs.resolve(rkey, self.pd, addr, u64::from(len), need) {
            Ok((p, entry)) => Ok((p, Some(entry))),
            Err(Fault::Key | Fault::Pd | Fault::Bounds | Fault::Access) => Err(WcStatus::REM_ACCESS_ERR),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn respond_write(
        &self,
        from: &Requester<'_>,
        src: Src,
        len: u32,
        addr: u64,
        rkey: u32,
        imm: Option<u32>,
        d: &mut Deferred,
    ) -> Outcome {
        let (dst, _entry) = match self.target(addr, rkey, len, AccessFlags::REMOTE_WRITE) {
            Ok(t) => t,
            Err(status) => {
                self.responder_error(d);
                return Outcome::Done(status, 0);
            }
        };
        let recv = if imm.is_some() {
            match self.take_recv(from) {
                Some(r) => Some(r),
                None => return Outcome::Rnr,
            }
        } else {
            None
        };
        // SAFETY: `src` is valid for `len` bytes (the requester's checked registration, inline
        // data, or a received frame); `dst` was checked against our registration, which
        // `_entry` keeps alive; registered memory is only accessed through `shared_mem`.
        unsafe { shared_mem::copy(src, Dst::Shared(dst), len as usize) };
        if let Some(r) = recv {
            self.complete_recv(r.wr_id, WcStatus::SUCCESS, WcOpcode::RECV_RDMA_WITH_IMM, len, imm);
        }
        Outcome::Done(WcStatus::SUCCESS, len)
    }

    fn respond_read(&self, dst: Dst, len: u32, addr: u64, rkey: u32, d: &mut Deferred) -> Outcome {
        match self.target(addr, rkey, len, AccessFlags::REMOTE_READ) {
            Ok((src, _entry)) => {
                // SAFETY: as in `respond_write`, with the roles swapped; `dst` is the
                // requester's checked buffer or a response buffer of `len` bytes.
                unsafe { shared_mem::copy(Src::Shared(src), dst, len as usize) };
                Outcome::Done(WcStatus::SUCCESS, len)
            }
            Err(status) => {
                self.responder_error(d);
                Outcome::Done(status, 0)
            }
        }
    }

    fn respond_send(
        &self,
        from: &Requester<'_>,
        src: Src,
        len: u32,
        imm: Option<u32>,
        d: &mut Deferred,
    ) -> Outcome {
        let Some(recv) = self.take_recv(from) else { return Outcome::Rnr };
        let opcode = WcOpcode::RECV;
        let cap = recv.sge.map_or(0, |s| s.len);
        if len > cap {
            self.complete_recv(recv.wr_id, WcStatus::LOC_LEN_ERR, opcode, len, None);
            self.responder_error(d);
            return Outcome::Done(WcStatus::REM_INV_REQ_ERR, 0);
        }
        let mut _entry = None;
        if len > 0 {
            let sge = recv.sge.expect("len <= cap implies an sge");
            let dst = self.device.mrs.resolve(
                sge.lkey,
                self.pd,
                sge.addr,
                u64::from(len),
                AccessFlags::LOCAL_WRITE,
            );
            match dst {
                Ok((dst, e)) => {
                    _entry = Some(e);
                    // SAFETY: as in `respond_write`; `dst` was checked for `len` bytes.
                    unsafe { shared_mem::copy(src, Dst::Shared(dst), len as usize) };
                }
                Err(_) => {
                    self.complete_recv(recv.wr_id, WcStatus::LOC_PROT_ERR, opcode, 0, None);
                    self.responder_error(d);
                    return Outcome::Done(WcStatus::REM_OP_ERR, 0);
                }
            }
        }
        self.complete_recv(recv.wr_id, WcStatus::SUCCESS, opcode, len, imm);
        Outcome::Done(WcStatus::SUCCESS, len)
    }

    /// Fetch-and-add or compare-and-swap on our memory; the original value goes to
    /// `result` (8 bytes).
    fn respond_atomic(&self, result: Dst, addr: u64, rkey: u32, op: RawOp, d: &mut Deferred) -> Outcome {
        let cell = match self.target(addr, rkey, 8, AccessFlags::REMOTE_ATOMIC) {
            // The NIC address and the host pointer must both be 8-aligned (a device-memory
            // region registered at an odd offset has aligned addresses but not pointers).
            Ok((cell, entry)) if addr.is_multiple_of(8) && (cell as usize).is_multiple_of(8) => (cell, entry),
            Ok(_) => {
                self.responder_error(d);
                return Outcome::Done(WcStatus::REM_INV_REQ_ERR, 0);
            }
            Err(status) => {
                self.responder_error(d);
                return Outcome::Done(status, 0);
            }
        };
        // SAFETY: `cell.0` is 8 bytes inside a live registration (checked; `cell.1` keeps it
        // alive) and 8-aligned (checked); all accesses to registered memory are atomic.
        let word = unsafe { shared_mem::atomic_u64(cell.0) };
        let old = match op {
            RawOp::FetchAdd { add } => word.fetch_add(add, Ordering::SeqCst),
            RawOp::CompareSwap { compare, swap } => {
                match word.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(v) | Err(v) => v,
                }
            }
            _ => unreachable!("respond_atomic is called for atomics only"),
        };
        let bytes = old.to_ne_bytes();
        // SAFETY: `result` is the requester's checked 8-byte local buffer or an 8-byte
        // response buffer; `bytes` is ours.
        unsafe { shared_mem::copy(Src::Private(bytes.as_ptr()), result, 8) };
        Outcome::Done(WcStatus::SUCCESS, 8)
    }

    /// Takes the next posted receive, or registers an in-process `from` for a kick and
    /// returns `None`.
    fn take_recv(&self, from: &Requester<'_>) -> Option<RawRecvWr> {
        let mut rq = self.rq.lock().expect("rq lock");
        let r = rq.posted.pop_front();
        if let (None, Some(w)) = (&r, from.waiter)
            && !rq.rnr_waiters.iter().any(|x| x.ptr_eq(w))
        {
            rq.rnr_waiters.push(w.clone());
        }
        r
    }
}

/// A request's local buffer, resolved.
struct LocalBuf {
    src: Src,
    ptr: *mut u8,
    entry: Option<Arc<MrEntry>>,
}

/// Payloads from this size on go to the socket straight from the region.
const SHARED_TAIL_MIN: u32 = 128 * 1024;

/// A request's payload left in its registered region, for the link to send from there.
pub(crate) struct SharedTail {
    pub ptr: *mut u8,
    pub len: usize,
    /// Keeps the region's bytes alive until the payload is on the socket.
    _entry: Arc<MrEntry>,
}

// SAFETY: `ptr` points into memory `_entry` keeps alive; it is only read by the kernel
// (`send(2)`), never through a Rust reference, so moving it to the writer thread is sound.
unsafe impl Send for SharedTail {}

enum Step {
    Completed,
    Blocked,
    Failed,
    /// Sent over TCP with this PSN; the response completes it.
    Sent(u32, Option<LocalTarget>),
}

fn run_deferred(mut d: Deferred) {
    // Each kick may defer more (a chain of QPs going to error); run until quiet.
    while let Some(qp) = d.kick.pop() {
        let mut more = Deferred::default();
        {
            let mut sq = qp.sq.lock().expect("sq lock");
            qp.progress(&mut sq, &mut more);
        }
        d.kick.append(&mut more.kick);
    }
}
