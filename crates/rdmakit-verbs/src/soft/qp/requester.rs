//! The requester side of a soft QP: resolving local buffers, executing a request against
//! a peer QP in this process, or sending it to a QP of another process and applying the
//! response.

use super::*;

impl SoftQp {
    /// Checks the request's local buffer as the HCA does (lkey, PD, bounds, access).
    /// Returns the bytes as a copy source (inline data is the caller's, so `Private`) and,
    /// for a registered buffer, its pointer and the entry keeping it alive.
    pub(super) fn resolve_local(&self, wr: &RawSendWr<'_>) -> std::result::Result<LocalBuf, WcStatus> {
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
    pub(super) fn execute(&self, wr: &RawSendWr<'_>, peer: &SoftQp, d: &mut Deferred) -> Outcome {
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

    /// Places a plain write or a read to a same-host responder directly, if its link holds
    /// a grant for the target (see `super::super::direct`): `Ok` once done (it completes
    /// with success). Anything else (other operations, zero length, a local buffer the
    /// HCA would refuse, no grant) is left to the ring, where the responder answers it;
    /// `Wait`: a grant was asked for, answered soon. The caller holds the send-queue lock
    /// and nothing of this QP is unanswered.
    pub(super) fn place_direct(&self, link: &TcpLink, wr: &RawSendWr<'_>) -> std::result::Result<(), Miss> {
        let Some(need) = direct_need(wr) else { return Err(Miss::Ring) };
        let len = wr.len();
        link.place_direct(wr.rkey, wr.remote_addr, u64::from(len), need, |target| {
            // The local buffer is resolved once a grant was found: an access left to the
            // ring resolves it there, once.
            let Ok(local) = self.resolve_local(wr) else { return false };
            // Both sides are shared memory, copied byte-wise atomically, the last word last.
            let (src, dst) = if need == AccessFlags::REMOTE_WRITE {
                (local.src, Dst::Shared(target))
            } else {
                (Src::Shared(target), Dst::Shared(local.ptr))
            };
            // SAFETY: `target` is the checked range of a live grant's mapping, `len` bytes,
            // kept mapped while this runs; `local` is the checked local buffer (or inline
            // bytes) of `len` bytes, kept alive by `local.entry` or borrowed for this call.
            unsafe { shared_mem::copy(src, dst, len as usize) };
            true
        })
    }

    /// Whether `wr` is of a kind placed directly (a plain write or read of some bytes).
    pub(super) fn can_place_op(wr: &RawSendWr<'_>) -> bool {
        direct_need(wr).is_some()
    }

    /// Whether [`place_direct`](Self::place_direct) could place `wr` once the requests
    /// before it are answered (`Ok`), or may after the grant it asks for now (`Wait`).
    pub(super) fn can_place(link: &TcpLink, wr: &RawSendWr<'_>) -> std::result::Result<(), Miss> {
        let need = direct_need(wr).ok_or(Miss::Ring)?;
        link.can_place(wr.rkey, wr.remote_addr, u64::from(wr.len()), need)
    }

    /// Builds the frame for a request to a responder in another process. A write or send
    /// from a registered region leaves its payload in the region (`SharedTail`): the link's
    /// writer thread hands it to the socket (or copies it into the same-host ring) from
    /// there, without a copy of its own.
    pub(super) fn remote_request(
        &self,
        wr: &RawSendWr<'_>,
        psn: u32,
        same_host: bool,
    ) -> std::result::Result<(Frame, Option<LocalTarget>, Option<SharedTail>), WcStatus> {
        let tail_min = tail_min(same_host);
        let len = wr.len();
        if len > wire::MAX_MESSAGE {
            return Err(WcStatus::LOC_LEN_ERR);
        }
        let local = self.resolve_local(wr)?;
        let (data, tail) = match (&local.entry, wr.op) {
            // From `tail_min` on: smaller payloads are cheaper copied into the frame.
            (Some(e), RawOp::Write { .. } | RawOp::Send { .. }) if len >= tail_min => {
                (Vec::new(), Some(SharedTail::new(local.ptr, len as usize, e.clone())))
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
        let target = || local.entry.clone().map(|e| LocalTarget::new(local.ptr, len, e));
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

    /// The region whose entry is `entry` is being deregistered: requests outstanding with
    /// their answer due in it let it go (their answer will land nowhere; see
    /// `LocalTarget::entry`).
    pub fn revoke_targets(&self, entry: &Arc<MrEntry>) {
        let mut sq = self.sq.lock().expect("sq lock");
        for s in &mut sq.sent {
            if let Some(t) = &mut s.target
                && t.entry.as_ref().is_some_and(|e| Arc::ptr_eq(e, entry))
            {
                t.entry = None;
            }
        }
    }

    /// Where the data of the response to read `psn`, `len` bytes, lands as it arrives: the
    /// read's own buffer, if the read is the oldest outstanding request, its region still
    /// registered and `len` what it asked for. `None`: the response is read as any other
    /// (and checked when it is whole).
    pub fn place_response(&self, psn: u32, len: usize) -> Option<Placement> {
        let sq = self.sq.lock().expect("sq lock");
        let s = sq.sent.front().filter(|s| s.psn == psn && matches!(s.p.op, RawOp::Read))?;
        let t = s.target.as_ref().filter(|t| t.len as usize == len && len > 0)?;
        let entry = Arc::downgrade(t.entry.as_ref()?);
        let last = std::cell::RefCell::new(super::LastWord::new(t.ptr as usize, len));
        Some(Placement { ptr: t.ptr, len, whose: Whose::Response { entry, qp: self.me.clone(), psn }, last })
    }

    /// Whether read `psn` is still the oldest outstanding request, its buffer in the region
    /// whose entry is `entry` (not revoked by a deregistration).
    pub(super) fn awaits_response_in(&self, psn: u32, entry: &Arc<MrEntry>) -> bool {
        let sq = self.sq.lock().expect("sq lock");
        sq.sent.front().is_some_and(|s| {
            s.psn == psn
                && s.target.as_ref().and_then(|t| t.entry.as_ref()).is_some_and(|e| Arc::ptr_eq(e, entry))
        })
    }

    /// A response from the remote responder (called by the link's reader thread), its data
    /// in the frame or, for a read's response, placed (or cut off) as it arrived (`data`).
    pub fn on_remote_response(&self, f: Frame, landed: ResponseData) {
        let mut d = Deferred::default();
        {
            let mut sq = self.sq.lock().expect("sq lock");
            let psn = match &f {
                Frame::Ack { psn, .. } | Frame::RnrNak { psn } => *psn,
                _ => return,
            };
            if sq.sent.front().is_none_or(|s| s.psn != psn) {
                if self.state.load(Ordering::Acquire) == super::ERR {
                    // The QP failed (a request timed out: `RETRY_EXC_ERR`, and its queue was
                    // flushed): a slow peer's late answer lands here, and is nothing more.
                    tracing::debug!(qp = self.qpn, psn, "soft NIC: response after the QP failed; dropped");
                } else {
                    // Not the oldest outstanding request: a confused or hostile peer.
                    // Rate-limited: the peer decides how many of these it sends.
                    crate::warn_limited!(qp = self.qpn, psn, "soft NIC: response out of order; ignored");
                }
                return;
            }
            match f {
                Frame::Ack { status, data, .. } => {
                    let s = sq.sent.pop_front().expect("checked above");
                    sq.retry = None;
                    // Progress: the timer of the next outstanding request runs from now.
                    if let Some(next) = sq.sent.front_mut() {
                        next.at = next.at.max(Instant::now());
                    }
                    let mut status = WcStatus(status);
                    let mut len = 0;
                    if status.is_success() {
                        match (&s.target, s.p.op) {
                            (Some(t), RawOp::Read) if !matches!(landed, ResponseData::InFrame) => {
                                // Placed whole (checked against `t` when it started, before
                                // each piece), or cut off when its region was deregistered.
                                if t.entry.is_none() || matches!(landed, ResponseData::Cut) {
                                    status = WcStatus::LOC_PROT_ERR;
                                } else {
                                    len = t.len;
                                }
                            }
                            (Some(t), RawOp::Read | RawOp::FetchAdd { .. } | RawOp::CompareSwap { .. }) => {
                                if t.entry.is_none() {
                                    // The local region was deregistered meanwhile.
                                    status = WcStatus::LOC_PROT_ERR;
                                } else if data.len() == t.len as usize {
                                    // SAFETY: `t.ptr` is the checked local buffer of `t.len`
                                    // bytes, kept alive by `t.entry`; `data` is ours.
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
}

/// The remote access a request placed directly needs: plain writes and reads that move
/// bytes; `None` for the rest (they go through the ring).
fn direct_need(wr: &RawSendWr<'_>) -> Option<AccessFlags> {
    if wr.len() == 0 {
        return None;
    }
    match wr.op {
        RawOp::Write { imm: None } => Some(AccessFlags::REMOTE_WRITE),
        RawOp::Read => Some(AccessFlags::REMOTE_READ),
        _ => None,
    }
}

/// Where a response's data is, for [`SoftQp::on_remote_response`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ResponseData {
    /// In the frame.
    InFrame,
    /// A read's response, landed in the read's buffer as it arrived
    /// ([`SoftQp::place_response`]).
    Placed,
    /// A read's response whose placement stopped part-way (its buffer's region was
    /// deregistered): the rest was discarded.
    Cut,
}
