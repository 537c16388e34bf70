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
//! it, retried by the timer thread and by the peer's next `post_recv`, until its retry
//! budget from [`ConnectOptions`] runs out and it fails with `RNR_RETRY_EXC_ERR` or
//! `RETRY_EXC_ERR`, moving the QP to the error state.
//!
//! Lock order (deadlock freedom): a thread holds at most one send-queue lock, and may take
//! receive-queue locks and CQ locks under it; receive-queue holders take only CQ locks.
//! Work that would need a second send-queue lock (flushing a peer that went to error) is
//! deferred until the first is released.

mod requester;
pub(crate) use requester::ResponseData;
mod responder;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::SoftDevice;
use super::cq::SoftCq;
use super::direct::Miss;
use super::mr::{Fault, MrEntry};
use super::tcp::TcpLink;
use super::timer;
use super::wire::{self, Frame};
use crate::error::{Error, Result, WcStatus};
use crate::raw::{RawOp, RawRecvWr, RawSendWr, Sge};
use crate::shared_mem::{self, Dst, Src};
use crate::types::{AccessFlags, ConnectOptions, ProviderKind, QpAddress, QpCaps, QpState};
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
    /// `token` is what this requester presents, as a Hello over the wire does: the peer is
    /// served only if it is the responder's connection token (see [`Link::local_peer`]).
    Local {
        gid: [u8; 16],
        qpn: u32,
        peer: Weak<SoftQp>,
        token: [u8; 16],
    },
    Tcp(TcpLink),
}

impl Link {
    /// The responder of a local link, once it exists and has taken `token`: a QP of this
    /// process is no more trusted on its GID and number alone than one of another process
    /// (a connection manager's peer declares both; see `SoftQp::authenticate`). Checked
    /// when the peer is first found, which is after both sides' tokens are set (the peer's
    /// before it answers, ours before RTR); a mismatch drops the request, as a responder
    /// drops what is not for it, and the requester runs out of retries.
    fn local_peer(
        gid: &[u8; 16],
        qpn: u32,
        peer: &mut Weak<SoftQp>,
        token: &[u8; 16],
    ) -> Option<Arc<SoftQp>> {
        if let Some(p) = peer.upgrade() {
            return Some(p);
        }
        // Not found yet (or gone): look again; a destroyed QP stays gone.
        let p = SoftDevice::by_gid(gid)?.find_qp(qpn)?;
        if !p.takes_token(token) {
            tracing::debug!(qpn, "soft NIC: a local requester presented the wrong connection token; dropped");
            return None;
        }
        *peer = Arc::downgrade(&p);
        Some(p)
    }
}

/// Connection tokens: `rx` is what a requester of another process must present to this QP
/// (random per QP, carried in its [`QpAddress`]; the soft bootstrap may replace it), `tx`
/// what this QP presents to its peer when the soft bootstrap set it explicitly (otherwise
/// the token of the endpoint it is connected to).
#[derive(Clone, Copy)]
struct Tokens {
    rx: [u8; 16],
    tx: Option<[u8; 16]>,
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
    /// Keeps the memory at `ptr` alive; `None` once the region was deregistered while the
    /// request was outstanding ([`SoftQp::revoke_targets`]): its answer then lands nowhere
    /// and the request completes with `LOC_PROT_ERR`, as a NIC's would on a key gone.
    entry: Option<Arc<MrEntry>>,
}

// SAFETY: `entry` keeps the registration's memory alive and `ptr` points into it (and is not
// written once `entry` is gone); the bytes are only written through `shared_mem`, which is
// sound from any thread.
unsafe impl Send for LocalTarget {}

/// [`LocalTarget`]s alive in the process: a deregistration looks for targets to revoke
/// ([`super::revoke`]) only when there are some, and so takes no QP's lock otherwise.
static LIVE_TARGETS: AtomicUsize = AtomicUsize::new(0);

impl LocalTarget {
    fn new(ptr: *mut u8, len: u32, entry: Arc<MrEntry>) -> LocalTarget {
        LIVE_TARGETS.fetch_add(1, Ordering::SeqCst);
        LocalTarget { ptr, len, entry: Some(entry) }
    }
}

impl Drop for LocalTarget {
    fn drop(&mut self) {
        LIVE_TARGETS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether any read or atomic is outstanding over the wire with a local target.
pub(crate) fn targets_outstanding() -> bool {
    LIVE_TARGETS.load(Ordering::SeqCst) > 0
}

/// A request sent over TCP and not yet answered.
struct Sent {
    p: Pending,
    psn: u32,
    /// When its transport timer started: when it was sent, or when the request before it
    /// was answered if that came later (an HCA restarts the timer on every acknowledgement
    /// that retires outstanding requests: a deep queue that moves is not a dead peer).
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
    /// Waits for every earlier read and atomic of the QP to complete (`IBV_SEND_FENCE`).
    fence: bool,
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
            fence: wr.fence,
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
            fence: self.fence,
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
    /// Flush completions of later receives, waiting for the taken receives whose
    /// completion is not published yet ([`SoftQp::unpublished`]): completions of a queue
    /// come in the order its requests were posted, a flush included. At most the receive
    /// CQ's capacity: beyond, the CQ overruns.
    flushed_after: Vec<WorkCompletion>,
}

/// What one execution attempt of a send request gave.
enum Outcome {
    Done(WcStatus, u32),
    Rnr,
    NoResponse,
}

/// Work to do after the send-queue lock is released.
#[derive(Default)]
pub(crate) struct Deferred {
    kick: Vec<Arc<SoftQp>>,
    /// Receive completions a responder made, held until the answer to their request is
    /// written ([`Deferred::holding`]); `None`: they are published at once.
    recvs: Option<Vec<HeldRecv>>,
}

/// A receive completion held back, with the QP whose receive queue it belongs to.
struct HeldRecv {
    qp: Arc<SoftQp>,
    wc: WorkCompletion,
}

impl Deferred {
    /// Work that also holds the receive completions of the requests served with it until
    /// [`release`](Self::release): a device serving another process writes its answer (the
    /// ACK) first. On a NIC the ACK leaves as the data lands; here, an application that
    /// sees its message and exits at once would otherwise take the unwritten ACK with it,
    /// and the sender's write would fail with `RETRY_EXC_ERR` although it was delivered.
    pub(crate) fn holding() -> Deferred {
        Deferred { kick: Vec::new(), recvs: Some(Vec::new()) }
    }

    /// Publishes the held receive completions, in order, then runs the rest; keeps holding
    /// (and keeps its buffer: no allocation per batch).
    pub(crate) fn release(&mut self) {
        self.publish_held();
        if !self.kick.is_empty() {
            run_deferred(Deferred { kick: std::mem::take(&mut self.kick), recvs: None });
        }
    }

    /// Publishes the held receive completions, in order.
    fn publish_held(&mut self) {
        if let Some(held) = &mut self.recvs {
            for r in held.drain(..) {
                r.qp.publish_taken(r.wc);
            }
        }
    }
}

impl Drop for Deferred {
    /// Receive completions still held are published: a receive's completion is never lost,
    /// and the flushes of later receives wait for it.
    fn drop(&mut self) {
        self.publish_held();
    }
}

pub(crate) struct SoftQp {
    qpn: u32,
    pub(super) device: Arc<SoftDevice>,
    pd: u64,
    send_cq: Arc<SoftCq>,
    recv_cq: Arc<SoftCq>,
    state: AtomicU8,
    /// Receives taken from the receive queue whose completion is not published yet (one
    /// being filled, or its completion held back by a [`Deferred`]). Raised under the
    /// receive-queue lock; lowered without it (see [`publish_taken`](Self::publish_taken)).
    unpublished: AtomicU32,
    /// Remote access this QP grants as a responder (`IBV_QP_ACCESS_FLAGS`).
    access: AtomicU32,
    remote_qpn: AtomicU32,
    /// The remote QP's initial PSN (from its endpoint), set at RTR.
    remote_psn: AtomicU32,
    /// Our initial PSN: the first request we send carries it, and a requester in another
    /// process proves it knows it in its Hello.
    psn: u32,
    /// Connection tokens (see [`Tokens`]).
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
    /// The gate of the same-host connection this QP serves (one per QP): closed when the
    /// QP goes to ERR, so the requester stops placing accesses directly (`super::direct`).
    gate: OnceLock<super::shm::Gate>,
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
            tokens: Mutex::new(Tokens { rx: super::random(), tx: None }),
            claimed: AtomicBool::new(false),
            max_send_wr: caps.max_send_wr,
            timer: Mutex::new(None),
            remote_gid: OnceLock::new(),
            gate: OnceLock::new(),
            sq: Mutex::new(Sq {
                pending: VecDeque::new(),
                sent: VecDeque::new(),
                next_psn: psn & 0x00ff_ffff,
                link: None,
                opts: ConnectOptions::default(),
                retry: None,
            }),
            rq: Mutex::new(Rq {
                posted: VecDeque::new(),
                rnr_waiters: Vec::new(),
                flushed_after: Vec::new(),
            }),
            unpublished: AtomicU32::new(0),
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
    /// other processes can reach it, `token` what a requester of another process must
    /// present.
    pub fn address(&self) -> QpAddress {
        let lid = self.device.port();
        QpAddress {
            provider: ProviderKind::Soft,
            lid,
            gid: self.device.gid(),
            qp_num: self.qpn,
            psn: self.psn,
            token: self.tokens.lock().expect("tokens").rx,
        }
    }

    /// Sets the connection tokens the soft bootstrap exchanged (before RTR): they replace
    /// this QP's own token and, when `tx` is given, the one in the peer's endpoint. The
    /// requester sets its own (`tx` not known yet) before it sends its request: the peer
    /// may dial before the reply has come back here.
    pub fn set_tokens(&self, rx: [u8; 16], tx: Option<[u8; 16]>) {
        *self.tokens.lock().expect("tokens") = Tokens { rx, tx };
    }

    /// Whether `token` is this QP's connection token (compared in constant time).
    fn takes_token(&self, token: &[u8; 16]) -> bool {
        let rx = self.tokens.lock().expect("tokens").rx;
        rx.iter().zip(token).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
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
            // Not connected yet: the Hello may wait for the QP, but only if it carries what
            // the QP knows from its creation (its token and initial PSN, both in its
            // endpoint): else anyone guessing a QP number could hold the places of Hellos
            // waiting for it, and crowd out its real peer.
            RESET | INIT => {
                let known = self.takes_token(token) & (self.psn == dst_psn);
                return if known { Auth::NotYet } else { Auth::Refused };
            }
            RTR | RTS => {}
            _ => return Auth::Refused,
        }
        // Compare every field whatever the first mismatch (no early exit on secrets).
        let ok = self.takes_token(token)
            & (self.remote_psn.load(Ordering::Acquire) == src_psn)
            & (self.psn == dst_psn)
            & (self.remote_qpn.load(Ordering::Acquire) == qpn)
            & (self.remote_gid.get() == Some(gid));
        if ok && !self.claimed.swap(true, Ordering::AcqRel) { Auth::Accepted } else { Auth::Refused }
    }

    /// Gives back the claim of a Hello that was `Accepted` and then not served after all (the
    /// device serves too many connections, or the answer could not be written): the
    /// requester, which dials again with the same Hello, must not find the QP taken by
    /// nobody.
    pub fn release_claim(&self) {
        self.claimed.store(false, Ordering::Release);
    }

    /// Moves to ERR, closing the same-host gate if this QP serves one.
    fn set_err(&self) {
        self.state.store(ERR, Ordering::Release);
        // Pairs with the fence in `set_gate`: one of the two sees the other's store.
        std::sync::atomic::fence(Ordering::SeqCst);
        if let Some(g) = self.gate.get() {
            g.close();
        }
    }

    /// Takes the gate of the same-host connection that starts serving this QP's requester
    /// and opens it, unless the QP is no longer in RTR/RTS.
    pub(crate) fn set_gate(&self, gate: super::shm::Gate) {
        if self.gate.set(gate).is_ok() {
            let g = self.gate.get().expect("just set");
            g.open();
            // A move to ERR racing with this sees the gate set, or is seen here.
            std::sync::atomic::fence(Ordering::SeqCst);
            if !matches!(self.state.load(Ordering::Acquire), RTR | RTS) {
                g.close();
            }
        }
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
    pub fn modify_to_rtr(&self, remote: &QpAddress, opts: &ConnectOptions) -> Result<()> {
        if remote.provider != ProviderKind::Soft {
            return Err(Error::InvalidArgument(format!(
                "cannot connect a soft QP to a {} endpoint",
                remote.provider
            )));
        }
        if self.state.load(Ordering::Acquire) != INIT {
            return Err(self.bad_transition("move to RTR"));
        }
        let presented = self.tokens.lock().expect("tokens").tx.unwrap_or(remote.token);
        let link = match SoftDevice::by_gid(&remote.gid) {
            // A device of this process: direct, once the peer is found and has taken our
            // token (at the first request: the peer may not have its tokens yet).
            Some(_) => {
                Link::Local { gid: remote.gid, qpn: remote.qp_num, peer: Weak::new(), token: presented }
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
                    token: presented,
                };
                // Frames in the queue: at most the outstanding requests, twice over when an
                // RNR NAK makes them go back (the queue may still hold the first copies).
                let queue = 2 * self.max_send_wr as usize + 2;
                Link::Tcp(TcpLink::connect(
                    &me,
                    &remote.gid,
                    std::net::SocketAddr::from((ip, remote.lid)),
                    hello,
                    queue,
                ))
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
        drop(sq);
        // A requester of another process may be waiting for this: answer it now.
        super::tcp::qp_connected();
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
        self.set_err();
        self.device.unregister_qp(self.qpn);
        {
            let mut sq = self.sq.lock().expect("sq lock");
            sq.pending.clear();
            sq.link = None;
        }
        {
            let mut rq = self.rq.lock().expect("rq lock");
            rq.posted.clear();
            rq.flushed_after.clear();
        }
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
                    Step::Blocked | Step::Held => sq.pending.push_back(Pending::from_raw(wr)),
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
                    // The QP may have failed a moment ago, its queue not flushed yet: what
                    // was posted before goes first.
                    while let Some(r) = rq.posted.pop_front() {
                        self.flush_recv(&mut rq, r.wr_id);
                    }
                    self.flush_recv(&mut rq, wr.wr_id);
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

    /// Runs the send queue again soon, on the timer thread (from a thread that must not
    /// wait for the send-queue lock).
    pub(crate) fn kick_soon(&self) {
        self.schedule(Instant::now());
    }

    /// Runs the send queue again (after an event that may let its head go).
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
                Step::Blocked | Step::Held => {
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
        // Across processes the timer starts once the link is up (`transport_start`).
        let start = match &sq.link {
            Some(Link::Tcp(link)) => link.transport_start(front.at),
            _ => Some(front.at),
        };
        match start {
            Some(start) if start.elapsed() >= budget => true,
            Some(start) => {
                self.arm_transport_timer(sq, start);
                false
            }
            None => {
                // Still being set up: look again after a budget, or when the set-up's
                // grace ends if that is sooner.
                let grace = front.at + super::tcp::HELLO_TIMEOUT;
                self.schedule((Instant::now() + budget).min(grace));
                false
            }
        }
    }

    /// Executes the request at the head of the send queue and handles its outcome.
    fn run_head(&self, sq: &mut Sq, wr: &RawSendWr<'_>, d: &mut Deferred) -> Step {
        // A fenced request starts once every earlier read and atomic has completed (their
        // answers run the queue again): it may use what they bring back. Requests run in
        // order, so only those sent and unanswered can still be under way.
        if wr.fence
            && sq
                .sent
                .iter()
                .any(|s| matches!(s.p.op, RawOp::Read | RawOp::FetchAdd { .. } | RawOp::CompareSwap { .. }))
        {
            return Step::Held;
        }
        // Same-host: placed directly when a grant allows it (see `super::direct`).
        let mut placed = None;
        if let Some(Link::Tcp(link)) = &sq.link
            && link.is_same_host()
        {
            if sq.sent.is_empty()
                && wr.len() > super::direct::LOOP_COPY_MAX
                && super::tcp::on_wire_thread()
                && Self::can_place(link, wr).is_ok()
            {
                // A bulk copy let go by an answer or a grant: made by the timer thread, not
                // the wire's loop, which serves every connection of the process.
                self.schedule(Instant::now());
                return Step::Held;
            }
            if sq.sent.is_empty() {
                match self.place_direct(link, wr) {
                    Ok(()) => placed = Some(Outcome::Done(WcStatus::SUCCESS, wr.len())),
                    Err(Miss::Wait(until)) => {
                        // The answer to the grant asked for kicks the queue; the timer, if
                        // none comes.
                        self.schedule(until);
                        return Step::Held;
                    }
                    Err(Miss::Ask | Miss::Ring) => {}
                }
            } else if sq.sent.back().is_some_and(|s| Self::can_place_op(&s.p.view()))
                && matches!(Self::can_place(link, wr), Ok(()) | Err(Miss::Wait(_)))
            {
                // Requests sent through the ring are unanswered, the last of them one that
                // could have been placed (it went before the grant): wait for them (their
                // answers run the queue again, as does the grant's) rather than follow them
                // through the ring, which in a pipeline of such requests would keep it busy
                // for good. Behind a send, an atomic or a write with immediate (a stream
                // mixing them), the request follows through the ring: waiting would cost a
                // round trip each time.
                return Step::Held;
            }
        }
        let outcome = match sq.link.as_mut() {
            _ if placed.is_some() => placed.take().expect("checked"),
            Some(Link::Tcp(link)) if !link.is_dead() => {
                match self.remote_request(wr, sq.next_psn, link.is_same_host()) {
                    Ok((frame, target, tail)) => {
                        if link.send(frame, tail) {
                            let psn = sq.next_psn;
                            sq.next_psn = super::tcp::next_psn(psn);
                            return Step::Sent(psn, target);
                        }
                        Outcome::NoResponse
                    }
                    Err(status) => Outcome::Done(status, 0),
                }
            }
            Some(Link::Tcp(_)) | None => Outcome::NoResponse,
            Some(Link::Local { gid, qpn, peer, token }) => match Link::local_peer(gid, *qpn, peer, token) {
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
        timer::schedule(at, self.me.clone());
    }

    /// Moves to ERR and flushes both queues. The caller holds our send-queue lock.
    fn enter_error(&self, sq: &mut Sq, d: &mut Deferred) {
        self.set_err();
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

    /// Flushes posted receives; returns the requesters that were waiting on us. The flush
    /// completions come after those of receives already taken (see [`SoftQp::unpublished`]).
    fn flush_rq(&self) -> Vec<Weak<SoftQp>> {
        let mut rq = self.rq.lock().expect("rq lock");
        while let Some(r) = rq.posted.pop_front() {
            self.flush_recv(&mut rq, r.wr_id);
        }
        std::mem::take(&mut rq.rnr_waiters)
    }

    /// Completes receive `wr_id` with `WR_FLUSH_ERR`, at once or, while an earlier receive's
    /// completion is unpublished, right after it.
    fn flush_recv(&self, rq: &mut Rq, wr_id: u64) {
        let wc = WorkCompletion {
            wr_id,
            status: WcStatus::WR_FLUSH_ERR,
            opcode: WcOpcode::RECV,
            byte_len: 0,
            imm: None,
            qp_num: self.qpn,
            vendor_err: 0,
        };
        // After the error state was set (every flush is); pairs with `publish_taken`.
        if self.unpublished.load(Ordering::SeqCst) > 0 || !rq.flushed_after.is_empty() {
            if rq.flushed_after.len() >= self.recv_cq.capacity() as usize {
                // Held back until a taken receive completes, they could not all fit.
                self.recv_cq.overrun();
                return;
            }
            rq.flushed_after.push(wc);
        } else {
            self.publish_recv(wc);
        }
    }

    /// Responder-side fatal error (as IB's class A/C errors): the responder QP goes to ERR.
    /// Its send queue is flushed after the requester's lock is released.
    fn responder_error(&self, d: &mut Deferred) {
        self.set_err();
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
            self.set_err();
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
            self.set_err();
        }
        ok
    }

    /// Reports the completion of a receive taken from the queue ([`SoftQp::unpublished`]) now,
    /// or holds it in `d` if `d` holds them.
    fn complete_recv_via(
        &self,
        d: &mut Deferred,
        wr_id: u64,
        status: WcStatus,
        opcode: WcOpcode,
        len: u32,
        imm: Option<u32>,
    ) {
        let wc =
            WorkCompletion { wr_id, status, opcode, byte_len: len, imm, qp_num: self.qpn, vendor_err: 0 };
        // Only a holding `d` pays for the QP's handle (an atomic upgrade).
        match d.recvs.as_mut().and_then(|held| Some((held, self.me.upgrade()?))) {
            Some((held, qp)) => held.push(HeldRecv { qp, wc }),
            None => self.publish_taken(wc),
        }
    }

    /// Publishes the completion of a receive taken from the queue, then, once no taken
    /// receive is left unpublished, the flushes of later receives that waited for it.
    ///
    /// No lock on the way of a QP that works: flushes are made only after the error state
    /// is set, and a flush that saw this receive unpublished (and waits in
    /// `flushed_after`) was made before the count fell, so the state read after it is
    /// `ERR` and the waiting flushes are published here, in order.
    fn publish_taken(&self, wc: WorkCompletion) {
        self.publish_recv(wc);
        let before = self.unpublished.fetch_sub(1, Ordering::SeqCst);
        debug_assert!(before > 0, "a receive completion published twice");
        if before == 1 && self.state.load(Ordering::SeqCst) == ERR {
            let mut rq = self.rq.lock().expect("rq lock");
            if self.unpublished.load(Ordering::SeqCst) == 0 {
                for wc in std::mem::take(&mut rq.flushed_after) {
                    self.publish_recv(wc);
                }
            }
        }
    }

    fn publish_recv(&self, wc: WorkCompletion) {
        let ok = self.recv_cq.push(wc);
        if !ok {
            self.set_err();
        }
    }
}
/// A request's local buffer, resolved.
struct LocalBuf {
    src: Src,
    ptr: *mut u8,
    entry: Option<Arc<MrEntry>>,
}

/// Payloads from this size on go to the socket straight from the region: a TCP socket's
/// output is gathered (`sendmsg` over the queued chunks), so a payload left in its region
/// costs an entry of a call, where a copy costs a buffer of its size (allocated by the
/// poster, freed by the loop: at 64 KiB, both threads' page faults and the copy made writes
/// three times slower; measured in the closing note of issue 12, session 44).
const SHARED_TAIL_MIN: u32 = 1024;
/// The same through same-host rings: the loop copies a tail from the region into the ring
/// itself, so only payloads small enough to batch are worth a copy of their own.
const SHARED_TAIL_MIN_SAME_HOST: u32 = 2 * 1024;

/// The size from which a payload goes out from its region as a [`SharedTail`].
fn tail_min(same_host: bool) -> u32 {
    if same_host { SHARED_TAIL_MIN_SAME_HOST } else { SHARED_TAIL_MIN }
}

/// A payload left in its registered region, for the connection to send from there: a
/// request's (the requester's region) or a read response's (the responder's).
pub(crate) struct SharedTail {
    pub ptr: *mut u8,
    pub len: usize,
    /// Keeps `ptr` valid until the payload is on the socket.
    hold: TailHold,
}

/// What keeps a [`SharedTail`]'s bytes alive.
enum TailHold {
    /// The region's entry: the bytes are read from the region as they go out.
    Region(Arc<MrEntry>),
    /// A copy of the region's bytes, made when it was deregistered while they waited
    /// ([`TailCopies`]), shared by every tail within it. Whole `u64` words: the bytes are
    /// still read as shared memory is, a word at a time, which must stay inside the
    /// allocation. A `Vec`, whose buffer stays put and keeps `ptr` valid when moved.
    Copied { _words: Arc<Vec<u64>> },
}

// SAFETY: `ptr` points into memory `hold` keeps alive (the region's, or a copy); it is only
// read by the kernel (`send(2)`) or through `shared_mem`, never through a Rust reference, so
// moving it to the writer thread is sound.
unsafe impl Send for SharedTail {}

impl SharedTail {
    fn new(ptr: *mut u8, len: usize, entry: Arc<MrEntry>) -> SharedTail {
        SharedTail { ptr, len, hold: TailHold::Region(entry) }
    }

    /// Whether the payload is read from the region whose entry `entry` is.
    pub(crate) fn reads(&self, entry: &Weak<MrEntry>) -> bool {
        matches!(&self.hold, TailHold::Region(e) if std::ptr::eq(Arc::as_ptr(e), entry.as_ptr()))
    }
}

/// Copies of a deregistered region's bytes that queued payloads still need, one per run of
/// overlapping payloads: however many requests sent the same bytes, they are copied once
/// (at most the region's size in all).
///
/// A deregistration waiting for the region's entry (`crate::mr`'s `Drain`) must not wait
/// for a peer that reads slowly, so the payloads are copied out of the region and the entry
/// let go. What the peer then gets is the region's content at deregistration, as a NIC may
/// have read it by then.
pub(crate) struct TailCopies {
    entry: Weak<MrEntry>,
    /// Payloads (start, length) seen by [`note`](Self::note).
    ranges: Vec<(*mut u8, usize)>,
    /// Merged runs: start address, end address, and the copy.
    runs: Vec<(usize, usize, *mut u8, Arc<Vec<u64>>)>,
}

impl TailCopies {
    /// Copies for payloads from the region whose entry is `entry`.
    pub(crate) fn new(entry: Weak<MrEntry>) -> TailCopies {
        TailCopies { entry, ranges: Vec::new(), runs: Vec::new() }
    }

    /// First pass: notes `t`'s range if it reads the region.
    pub(crate) fn note(&mut self, t: &SharedTail) {
        if t.reads(&self.entry) && t.len > 0 {
            self.ranges.push((t.ptr, t.len));
        }
    }

    /// Between the passes: merges the ranges into runs and copies each run once.
    ///
    /// # Safety
    /// The caller holds the entry: the region's bytes stay valid through the copy (the
    /// tails noted may be dropped meanwhile by other threads).
    pub(crate) unsafe fn copy(&mut self) {
        self.ranges.sort_unstable_by_key(|r| r.0 as usize);
        let mut runs: Vec<(usize, usize, *mut u8)> = Vec::new();
        for &(ptr, len) in &self.ranges {
            let at = ptr as usize;
            match runs.last_mut() {
                Some(run) if at <= run.1 => run.1 = run.1.max(at + len),
                _ => runs.push((at, at + len, ptr)),
            }
        }
        for (lo, hi, from) in runs {
            let mut words = vec![0u64; (hi - lo).div_ceil(8)];
            let to = words.as_mut_ptr().cast::<u8>();
            // SAFETY: `from..from + (hi - lo)` lies within the region (a union of payloads
            // checked against it), valid while the caller holds its entry; `words` is ours,
            // at least `hi - lo` bytes.
            unsafe { shared_mem::copy(Src::Shared(from), Dst::Private(to), hi - lo) };
            self.runs.push((lo, hi, to, Arc::new(words)));
        }
        self.ranges = Vec::new();
    }

    /// Second pass: points `t` at the copy of its run and lets the region go.
    pub(crate) fn rehome(&self, t: &mut SharedTail) {
        if !t.reads(&self.entry) {
            return;
        }
        let at = t.ptr as usize;
        // The runs are sorted and disjoint: the only candidate is the last starting at or
        // before `at`. A tail not noted (queued by a post that looked the key up as it went)
        // keeps reading the region; the deregistration's wait revokes again for it.
        let i = self.runs.partition_point(|r| r.0 <= at);
        let Some((lo, _, to, words)) = i.checked_sub(1).map(|i| &self.runs[i]).filter(|r| at + t.len <= r.1)
        else {
            return;
        };
        t.ptr = to.wrapping_add(at - lo);
        t.hold = TailHold::Copied { _words: words.clone() };
    }
}

/// Where a frame's data lands as it arrives off the wire, so that it is never stored whole:
/// a remote write's into its target region, or a read's response into the requester's
/// buffer. The range was checked, for the whole length, when the placement was chosen, and
/// is checked again before each piece lands ([`hold`](Placement::hold)).
pub(crate) struct Placement {
    ptr: *mut u8,
    len: usize,
    whose: Whose,
    /// The data's last aligned word, held back until its last byte has arrived and then
    /// landed whole, last (see [`LastWord`]).
    last: std::cell::RefCell<LastWord>,
}

/// Whose memory a [`Placement`] writes, and what must still hold for a piece to land there.
enum Whose {
    /// A remote write's target in this responder's region (QP access, key, PD, region
    /// access, bounds checked again before each piece): a region deregistered, a key
    /// invalidated or a QP moved out of RTR/RTS meanwhile stops the data. The entry is held
    /// only while a piece lands (the `Weak` keeps its allocation, so its address names no
    /// other region): a deregistration waits for no writer stalled inside its frame.
    Target { entry: Option<Weak<MrEntry>>, qp: Weak<SoftQp>, from: ([u8; 16], u32), addr: u64, rkey: u32 },
    /// A read's response landing in this requester's own buffer (the oldest outstanding
    /// request's, read `psn`). The entry is held only while a piece lands: a deregistration
    /// revokes the read's target and waits for no responder; the rest is then discarded.
    Response { entry: Weak<MrEntry>, qp: Weak<SoftQp>, psn: u32 },
}

/// Leave for a [`Placement`] to take a piece now, kept while the piece lands: it holds the
/// region's entry, so the memory stays registered until it is dropped.
pub(crate) struct Held {
    _entry: Option<Arc<MrEntry>>,
}

// SAFETY: `ptr` is written only under a `Held`, whose entry keeps the memory alive; it is
// only written through `shared_mem` (as a NIC writes registered memory), never through a
// Rust reference, so the wire's thread may hold it.
unsafe impl Send for Placement {}

/// The bytes of a write that fall in the aligned word holding its last byte.
///
/// A write lands in pieces as its data arrives (socket reads, ring wraps), so a piece could
/// end inside that word: a reader polling the word (a put handle's sentinel, `write-lat`'s
/// last byte) would see it half new while its last bytes are still on the way. `shared_mem`
/// stores the last aligned word of each copy last, whole, with release ordering; holding the
/// word's bytes back until the final piece makes that true of the whole write, as it is of
/// a write applied in one copy.
pub(crate) struct LastWord {
    /// Offset of the held bytes in the target: the start of the aligned word holding the
    /// last byte (or 0 for a write shorter than that word's part).
    at: usize,
    held: [u8; 8],
}

impl LastWord {
    /// For a write of `len` bytes landing at address `dst`.
    pub(crate) fn new(dst: usize, len: usize) -> LastWord {
        let at = if len == 0 { 0 } else { (((dst + len - 1) & !7).saturating_sub(dst)).min(len) };
        LastWord { at, held: [0; 8] }
    }

    /// Splits a piece of `n` bytes at offset `at` of a `len`-byte write: how many of its
    /// first bytes land now, and where in the held word the rest goes. Returns
    /// `(direct, held_from)`.
    pub(crate) fn split(&self, at: usize, n: usize) -> (usize, usize) {
        let direct = self.at.saturating_sub(at).min(n);
        (direct, (at + direct).saturating_sub(self.at))
    }

    /// Whether a piece of `n` bytes at offset `at` of a `len`-byte write completes it: then,
    /// and only then, the held word lands. An empty piece completes nothing, even at the
    /// end (every ring read that does not wrap gives one, its second half): landing the
    /// word again there would rewrite it after a reader that saw it had moved on (a put
    /// handle's `ready_mark` restoring its sentinel), a second put out of nothing.
    pub(crate) fn completes(&self, at: usize, n: usize, len: usize) -> bool {
        n > 0 && at + n == len && self.at < len
    }
}

impl Placement {
    /// The data length the target was checked for.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether the data may still land, and if so the leave to land a piece under.
    ///
    /// A write's target: the QP serves the requester and the key allows the whole range *in
    /// the same region, at the same place*, as when the placement was chosen (an indirect
    /// key invalidated and bound elsewhere meanwhile resolves again, but to other bytes: the
    /// rest of the write must not land in the region the key no longer maps).
    ///
    /// A read's response: the read is still the QP's oldest outstanding request, and its
    /// buffer's region was not deregistered meanwhile.
    pub(crate) fn hold(&self) -> Option<Held> {
        match &self.whose {
            Whose::Target { entry: then, qp, from, addr, rkey } => {
                let qp = qp.upgrade()?;
                let from = Requester::remote(from.0, from.1);
                let len = u32::try_from(self.len).unwrap_or(u32::MAX);
                if !qp.accepts_from(&from) {
                    return None;
                }
                let (ptr, now) = qp.target(*addr, *rkey, len, AccessFlags::REMOTE_WRITE).ok()?;
                let same_region = match (&now, then) {
                    (Some(now), Some(then)) => std::ptr::eq(Arc::as_ptr(now), then.as_ptr()),
                    (None, None) => true,
                    _ => false,
                };
                (ptr == self.ptr && same_region).then_some(Held { _entry: now })
            }
            Whose::Response { entry, qp, psn } => {
                let entry = entry.upgrade()?;
                qp.upgrade()?.awaits_response_in(*psn, &entry).then_some(Held { _entry: Some(entry) })
            }
        }
    }

    /// Lands `data` at offset `at` of the target, under `_held` (from [`hold`](Self::hold)).
    ///
    /// # Safety
    /// `at + data.len()` must not exceed [`len`](Self::len), and `_held` must come from this
    /// placement's `hold`.
    pub(crate) unsafe fn land(&self, _held: &Held, at: usize, data: &[u8]) {
        // SAFETY: `data` is private memory valid for its length; the caller's contract (its
        // `Held` is `_held`).
        unsafe { self.land_piece(at, Src::Private(data.as_ptr()), data.len(), false) }
    }

    /// Lands a piece: its bytes before the last word now, the last word's into the held
    /// copy, and the held word whole once the piece ends the write.
    ///
    /// # Safety
    /// `src` valid for reads of `n` bytes; `at + n <= len`; the caller holds a [`Held`] from
    /// this placement's [`hold`](Self::hold).
    unsafe fn land_piece(&self, at: usize, src: Src, n: usize, across_cores: bool) {
        debug_assert!(at + n <= self.len);
        let mut last = self.last.borrow_mut();
        let (direct, held_from) = last.split(at, n);
        if direct > 0 {
            // SAFETY: the target is valid for `len` bytes, its registration kept alive by
            // the caller's `Held`, and `at + direct <= len`; `src` is valid for `n >= direct`
            // bytes (caller); registered memory is only written through `shared_mem`.
            unsafe {
                let dst = Dst::Shared(self.ptr.add(at));
                if across_cores {
                    shared_mem::copy_across_cores(src, dst, direct);
                } else {
                    shared_mem::copy(src, dst, direct);
                }
            }
        }
        if direct < n {
            let rest = n - direct;
            // SAFETY: `held_from + rest` is at most the word's part of the write (at most 8
            // bytes), because the piece ends within the write; `src + direct` is valid for
            // `rest` bytes (caller); `held` is private.
            unsafe {
                shared_mem::copy(src.add(direct), Dst::Private(last.held.as_mut_ptr().add(held_from)), rest);
            }
        }
        if last.completes(at, n, self.len) {
            // The final piece: the last word, whole and last, with release ordering.
            let (word_at, held) = (last.at, last.held);
            // SAFETY: `word_at .. len` is inside the target (at most 8 bytes); `held` is a
            // private copy of those bytes.
            unsafe {
                shared_mem::copy(
                    Src::Private(held.as_ptr()),
                    Dst::Shared(self.ptr.add(word_at)),
                    self.len - word_at,
                );
            }
        }
    }

    /// How many of the `max` bytes from offset `at` on may be received straight into the
    /// target ([`recv_direct`](Self::recv_direct)): all but the held last word's.
    pub(crate) fn direct_span(&self, at: usize, max: usize) -> usize {
        self.last.borrow().split(at, max).0
    }

    /// Receives up to `n` bytes of the data, from offset `at` on, straight from TCP socket
    /// `fd` into the target: the socket's bytes land where they belong with no copy through
    /// a buffer (the kernel's copy is the only one, as for a raw TCP stream). `Ok(0)`: the
    /// peer closed the stream.
    ///
    /// # Safety
    /// `n <= self.direct_span(at, n)` (so `at + n <= len`, and the held word is not
    /// touched), and `_held` must come from this placement's [`hold`](Self::hold).
    pub(crate) unsafe fn recv_direct(
        &self,
        _held: &Held,
        fd: std::os::fd::RawFd,
        at: usize,
        n: usize,
    ) -> std::io::Result<usize> {
        debug_assert!(n <= self.direct_span(at, n));
        // SAFETY: the target is valid for `len` bytes, kept registered by the caller's
        // `Held`, and `at + n` stays before the held word (caller); the kernel writes it as
        // a NIC's DMA would, and the held word lands after it, last, through `land`.
        unsafe { shared_mem::recv(fd, self.ptr.add(at), n) }
    }

    /// Lands `n` bytes from `src` at offset `at` of the target, copied as memory another
    /// core wrote last (a same-host ring).
    ///
    /// # Safety
    /// `src` must be valid for reads of `n` bytes (shared memory read byte-wise atomically),
    /// `at + n` must not exceed [`len`](Self::len), and `_held` must come from this
    /// placement's [`hold`](Self::hold).
    pub(crate) unsafe fn land_from(&self, _held: &Held, at: usize, src: Src, n: usize) {
        // SAFETY: forwarded contract.
        unsafe { self.land_piece(at, src, n, true) }
    }
}

enum Step {
    Completed,
    Blocked,
    /// Waits in the queue for what lets it be placed directly (same-host): the answers to
    /// the requests sent before it (which it must not overtake), the grant asked for (or
    /// its timer), or the timer thread (a bulk copy the wire's loop leaves to it).
    Held,
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

#[cfg(test)]
mod last_word_tests {
    use super::LastWord;

    /// Lands a `len`-byte write at address `dst` in the pieces `cuts` makes, as
    /// `Placement::land_piece` does, and returns the stores in order as byte ranges of the
    /// target (the held word's bytes go through `held`).
    fn stores(dst: usize, len: usize, cuts: &[usize]) -> Vec<(usize, usize)> {
        let mut last = LastWord::new(dst, len);
        let mut out = Vec::new();
        let mut bounds: Vec<usize> = cuts.iter().copied().filter(|&c| c > 0 && c < len).collect();
        bounds.sort_unstable();
        bounds.dedup();
        bounds.push(len);
        let mut piece = |at: usize, n: usize| {
            let (direct, held_from) = last.split(at, n);
            if direct > 0 {
                out.push((at, at + direct));
            }
            if direct < n {
                assert!(held_from + (n - direct) <= 8, "held bytes overflow the word");
                last.held[held_from..held_from + n - direct].fill(1);
            }
            if last.completes(at, n, len) {
                assert!(last.held[..len - last.at].iter().all(|&b| b == 1), "a held byte was never given");
                out.push((last.at, len));
            }
        };
        let mut at = 0;
        for end in bounds {
            piece(at, end - at);
            at = end;
        }
        // An empty piece at the end, as a ring read that does not wrap gives.
        piece(len, 0);
        out
    }

    // Index arithmetic only, no unsafe and no shared memory: under Miri its tens of millions of
    // byte updates took the CI tier past its time limit, and would check nothing the native
    // run does not.
    #[test]
    #[cfg_attr(miri, ignore = "pure index arithmetic; the native test run covers it")]
    fn the_last_word_of_a_write_lands_last_and_whole_however_it_is_cut() {
        for dst in 0x1000..0x1008 {
            for len in (1..40).chain([4095, 4096, 4097, 65536]) {
                let word_start = ((dst + len - 1) & !7).max(dst) - dst;
                // One cut anywhere, and cuts on both sides of the word's start.
                let mut cut_sets: Vec<Vec<usize>> = (0..=len.min(64)).map(|c| vec![len - c]).collect();
                cut_sets.push(vec![word_start.saturating_sub(3), word_start + 1, word_start + 5]);
                cut_sets.push((1..len.min(40)).collect());
                for cuts in cut_sets {
                    let s = stores(dst, len, &cuts);
                    // Every byte stored exactly once.
                    let mut covered = vec![0u8; len];
                    for &(a, b) in &s {
                        covered[a..b].iter_mut().for_each(|c| *c += 1);
                    }
                    assert!(covered.iter().all(|&c| c == 1), "dst {dst:#x} len {len} cuts {cuts:?}: {s:?}");
                    // The last store is the whole last-word part, and only it touches it.
                    let &(a, b) = s.last().unwrap();
                    assert_eq!((a, b), (word_start, len), "dst {dst:#x} len {len} cuts {cuts:?}");
                    assert!(b - a <= 8 && (dst + a) / 8 == (dst + b - 1) / 8, "one aligned word");
                    assert!(s[..s.len() - 1].iter().all(|&(_, e)| e <= word_start));
                }
            }
        }
    }
}

#[cfg(test)]
mod claim_tests {
    use super::*;
    use crate::{ConnectOptions, Context, QpCaps};

    /// One requester connection per QP: a second Hello is refused while the first holds the
    /// claim, and accepted once a claim that was not served is given back.
    #[test]
    fn a_claim_not_served_is_given_back() {
        let ctx = Context::open_soft();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let a = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
        let b = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
        let (ea, eb) = (a.address().unwrap(), b.address().unwrap());
        a.connect(&eb, &ConnectOptions::default()).unwrap();
        b.connect(&ea, &ConnectOptions::default()).unwrap();
        let qp = SoftDevice::default_device().find_qp(eb.qp_num).expect("b is on the default device");
        let hello = || qp.authenticate(&ea.gid, ea.qp_num, ea.psn, eb.psn, &eb.token);
        assert!(matches!(hello(), Auth::Accepted));
        assert!(matches!(hello(), Auth::Refused), "the QP serves one requester connection");
        qp.release_claim();
        assert!(matches!(hello(), Auth::Accepted), "the claim came back");
    }
}

#[cfg(test)]
mod shared_tail_tests {
    use super::*;
    use crate::{AccessFlags, Context};

    fn read(t: &SharedTail) -> Vec<u8> {
        let mut out = vec![0u8; t.len];
        // SAFETY: a tail's `ptr` is valid for its `len` bytes while it lives.
        unsafe { shared_mem::copy(Src::Shared(t.ptr), Dst::Private(out.as_mut_ptr()), t.len) };
        out
    }

    /// Payloads copied out of a deregistered region keep their bytes and let the region's
    /// entry go; overlapping ones share one copy; another region's are left alone. (Under
    /// Miri: the copies are read word by word, at odd offsets and lengths, after the tails
    /// moved.)
    #[test]
    fn tails_copied_out_keep_their_bytes_share_copies_and_let_the_region_go() {
        let device = SoftDevice::default_device();
        let pd = Context::open_soft().alloc_pd().unwrap();
        let (mr, other) = (
            pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap(),
            pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap(),
        );
        for i in 0..32 {
            mr.write_u64(i * 8, 0x0101_0101_0101_0101 * i).unwrap();
        }
        let entry = device.mrs.lookup(mr.lkey()).expect("the region's entry");
        let (ptr, _) = entry.resolve(None, mr.addr(), 256, AccessFlags::LOCAL_WRITE).unwrap();
        let other_entry = device.mrs.lookup(other.lkey()).unwrap();
        let (optr, _) = other_entry.resolve(None, other.addr(), 64, AccessFlags::LOCAL_WRITE).unwrap();
        // Two overlapping payloads (one run), one apart at an odd offset and length (another
        // run), and one of another region.
        let mut tails = vec![
            SharedTail::new(ptr, 64, entry.clone()),
            SharedTail::new(ptr.wrapping_add(32), 64, entry.clone()),
            SharedTail::new(ptr.wrapping_add(163), 45, entry.clone()),
            SharedTail::new(optr, 64, other_entry.clone()),
        ];
        let before: Vec<Vec<u8>> = tails.iter().map(read).collect();
        assert_eq!(Arc::strong_count(&entry), 5, "table, three tails and this test");
        let mut copies = TailCopies::new(Arc::downgrade(&entry));
        tails.iter().for_each(|t| copies.note(t));
        // SAFETY: `entry` is held.
        unsafe { copies.copy() };
        assert_eq!(copies.runs.len(), 2, "overlapping payloads share a copy");
        tails.iter_mut().for_each(|t| copies.rehome(t));
        drop(copies);
        assert_eq!(Arc::strong_count(&entry), 2, "the tails let the entry go");
        assert_eq!(tails[3].ptr, optr, "another region's payload stays where it is");
        mr.fill(0).unwrap();
        let moved: Vec<SharedTail> = tails.into_iter().collect();
        let after: Vec<Vec<u8>> = moved.iter().map(read).collect();
        assert_eq!(after, before, "the bytes as they were at the copy");
    }
}
