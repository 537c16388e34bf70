//! The responder side of a soft QP: what the peer's NIC does with a request, with no help
//! from the peer application: key, PD, access and bounds checks, then the write, read,
//! send or atomic on the target memory, and the receive completion.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::*;

impl SoftQp {
    /// A request from a QP of another process (called by the device's connection
    /// thread). Returns the response, or `None` to drop the request silently, as a NIC
    /// drops packets for a QP that is not connected to their sender. What follows from it
    /// (receive completions if `d` holds them, QPs to kick) is left in `d` for the caller
    /// to release once the response is written.
    ///
    /// A read of `same_host`'s tail size or more is answered from the region itself: the
    /// response comes with its data as a [`SharedTail`], which the connection sends from
    /// the region as the peer takes it (as a NIC reads the responder's memory while it
    /// sends the response). A peer's read then costs the loop neither a copy nor memory of
    /// its size, however slowly the peer takes it.
    pub fn serve_remote(
        &self,
        from: &Requester<'_>,
        f: Frame,
        d: &mut Deferred,
        same_host: bool,
    ) -> Option<(Frame, Option<SharedTail>)> {
        if !self.accepts_from(from) {
            return None;
        }
        if let Frame::Read { psn, addr, rkey, len } = f
            && len >= tail_min(same_host)
            && len <= wire::MAX_MESSAGE
        {
            return Some(match self.target(addr, rkey, len, AccessFlags::REMOTE_READ) {
                Ok((ptr, Some(entry))) => {
                    let ack = Frame::Ack { psn, status: WcStatus::SUCCESS.0, data: Vec::new() };
                    (ack, Some(SharedTail::new(ptr, len as usize, entry)))
                }
                // A length of 0 has no region (and does not come here).
                Ok((_, None)) => (Frame::Ack { psn, status: WcStatus::SUCCESS.0, data: Vec::new() }, None),
                Err(status) => {
                    self.responder_error(d);
                    (Frame::Ack { psn, status: status.0, data: Vec::new() }, None)
                }
            });
        }
        let (psn, outcome, data) = match f {
            Frame::Write { psn, addr, rkey, imm, data } => {
                let len = data.len() as u32;
                (
                    psn,
                    self.respond_write(from, Src::Private(data.as_ptr()), len, addr, rkey, imm, d),
                    Vec::new(),
                )
            }
            Frame::Send { psn, imm, data } => (
                psn,
                self.respond_send(from, Src::Private(data.as_ptr()), data.len() as u32, imm, d),
                Vec::new(),
            ),
            Frame::Read { psn, len, .. } if len > wire::MAX_MESSAGE => {
                // An invalid request, as any other: the responder goes to error too.
                self.responder_error(d);
                (psn, Outcome::Done(WcStatus::REM_INV_REQ_ERR, 0), Vec::new())
            }
            Frame::Read { psn, addr, rkey, len } => {
                let mut buf = vec![0u8; len as usize];
                (psn, self.respond_read(Dst::Private(buf.as_mut_ptr()), len, addr, rkey, d), buf)
            }
            Frame::FetchAdd { psn, addr, rkey, add } => {
                let mut buf = vec![0u8; 8];
                let out = self.respond_atomic(
                    Dst::Private(buf.as_mut_ptr()),
                    addr,
                    rkey,
                    RawOp::FetchAdd { add },
                    d,
                );
                (psn, out, buf)
            }
            Frame::CmpSwap { psn, addr, rkey, compare, swap } => {
                let mut buf = vec![0u8; 8];
                let op = RawOp::CompareSwap { compare, swap };
                (psn, self.respond_atomic(Dst::Private(buf.as_mut_ptr()), addr, rkey, op, d), buf)
            }
            _ => return None,
        };
        let reply = match outcome {
            Outcome::Done(status, _) => {
                let data = if status.is_success() { data } else { Vec::new() };
                Frame::Ack { psn, status: status.0, data }
            }
            Outcome::Rnr => Frame::RnrNak { psn },
            Outcome::NoResponse => return None,
        };
        Some((reply, None))
    }

    /// A grant of key `rkey` to a same-host requester `from` (see `super::super::direct`):
    /// the `KeyGrant` frame and a descriptor of the region's memfd to pass before it
    /// (read-only unless the grant allows remote writes). `None`
    /// (refused) unless the QP serves `from`, the key is a plain region of this process's
    /// memory in a memfd, of this QP's PD, and both its access flags and the QP's allow
    /// remote write or read; the grant carries what both allow.
    pub fn grant(&self, from: &Requester<'_>, rkey: u32) -> Option<(Frame, std::os::fd::OwnedFd)> {
        if !self.accepts_from(from) {
            return None;
        }
        let entry = self.device.mrs.lookup(rkey)?;
        let file = entry.region_file()?;
        if entry.pd != self.pd {
            return None;
        }
        let qp_access = AccessFlags::from_bits_truncate(self.access.load(Ordering::Acquire));
        let access = entry.access & qp_access & (AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ);
        if access.is_empty() {
            return None;
        }
        let fd = file.fd_for(access).ok()?;
        let (slot, tag) = file.slot_tag();
        let frame = Frame::KeyGrant {
            rkey,
            access: access.bits(),
            addr: entry.base,
            len: entry.len,
            map_len: file.map_len() as u64,
            slot,
            tag,
            ino: file.ino(),
        };
        Some((frame, fd))
    }

    /// Where a plain write (no immediate) of `len` data bytes from `from` lands, if it
    /// would succeed: the checks of [`respond_write`](Self::respond_write), made before the
    /// data arrives so that it can land as it does. `None`: the write is served the usual
    /// way (stored, then refused or applied with the status the checks give).
    pub fn place_write(&self, from: &Requester<'_>, addr: u64, rkey: u32, len: usize) -> Option<Placement> {
        if !self.accepts_from(from) {
            return None;
        }
        let n = u32::try_from(len).ok().filter(|&n| n > 0 && n <= wire::MAX_MESSAGE)?;
        let (ptr, entry) = self.target(addr, rkey, n, AccessFlags::REMOTE_WRITE).ok()?;
        let me = self.me.clone();
        let last = std::cell::RefCell::new(super::LastWord::new(ptr as usize, len));
        let entry = entry.as_ref().map(Arc::downgrade);
        let whose = Whose::Target { entry, qp: me, from: (from.gid, from.qpn), addr, rkey };
        Some(Placement { ptr, len, whose, last })
    }

    /// The answer to a write whose data landed through [`place_write`](Self::place_write).
    /// `None` if the QP no longer serves `from` (dropped, as a NIC drops such packets).
    pub fn placed_write_done(&self, from: &Requester<'_>, psn: u32) -> Option<Frame> {
        self.accepts_from(from).then_some(Frame::Ack { psn, status: WcStatus::SUCCESS.0, data: Vec::new() })
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

    /// Answers a write or a send whose `data_len` bytes of data were read and dropped by
    /// the connection (more than its target or the head receive could take when its header
    /// arrived), as if the data had been kept. Its receive completion or flush goes into
    /// `d`, behind the completions `d` holds, as [`serve_remote`]'s do.
    ///
    /// - A write: the error the target check gives for that length, and the responder error
    ///   that follows.
    /// - A send: a receive still at the head and too small completes with `LOC_LEN_ERR` and
    ///   the responder goes to error, as in `respond_send`; no receive posted is an RNR
    ///   NAK. A receive large enough posted meanwhile is not taken: the answer is an RNR NAK
    ///   too, and the requester's retry brings the data to it.
    ///
    /// [`serve_remote`]: Self::serve_remote
    pub fn refuse(&self, from: &Requester<'_>, f: Frame, data_len: usize, d: &mut Deferred) -> Option<Frame> {
        if !self.accepts_from(from) {
            return None;
        }
        let len = u32::try_from(data_len).unwrap_or(u32::MAX);
        match f {
            Frame::Write { psn, addr, rkey, .. } => {
                let status = self
                    .target(addr, rkey, len, AccessFlags::REMOTE_WRITE)
                    .err()
                    .unwrap_or(WcStatus::REM_ACCESS_ERR);
                self.responder_error(d);
                Some(Frame::Ack { psn, status: status.0, data: Vec::new() })
            }
            Frame::Send { psn, .. } => Some(self.refuse_send(psn, len, d)),
            _ => None,
        }
    }

    /// The most data bytes a send can bring now: what the receive at the head of the queue
    /// takes (0 if none is posted). A connection stores no more of a send's data than
    /// that (the rest is dropped as it arrives, and the send answered by
    /// [`refuse`](Self::refuse)), so a peer's sends cost the responder at most the
    /// receive buffers its application posted.
    pub fn send_data_limit(&self) -> usize {
        let rq = self.rq.lock().expect("rq lock");
        rq.posted.front().and_then(|r| r.sge).map_or(0, |s| s.len.min(wire::MAX_MESSAGE) as usize)
    }

    /// [`refuse`](Self::refuse) for send `psn` of `len` bytes.
    fn refuse_send(&self, psn: u32, len: u32, d: &mut Deferred) -> Frame {
        // Taken only if too small, under one lock: a receive that could take the data must
        // not be consumed by a send whose data is gone.
        let small = {
            let mut rq = self.rq.lock().expect("rq lock");
            if rq.posted.front().is_some_and(|r| r.sge.map_or(0, |s| s.len) < len) {
                // Its completion is owed: flushes of later receives wait for it.
                self.unpublished.fetch_add(1, Ordering::SeqCst);
                rq.posted.pop_front()
            } else {
                None
            }
        };
        match small {
            Some(r) => {
                self.complete_recv_via(d, r.wr_id, WcStatus::LOC_LEN_ERR, WcOpcode::RECV, len, None);
                self.responder_error(d);
                Frame::Ack { psn, status: WcStatus::REM_INV_REQ_ERR.0, data: Vec::new() }
            }
            None => Frame::RnrNak { psn },
        }
    }

    /// A connected responder takes packets only from its own remote QP, in RTR or RTS.
    pub(super) fn accepts_from(&self, from: &Requester<'_>) -> bool {
        let st = self.state.load(Ordering::Acquire);
        (st == RTR || st == RTS)
            && self.remote_qpn.load(Ordering::Acquire) == from.qpn
            && self.remote_gid.get() == Some(&from.gid)
    }

    /// Resolves a remote target: QP-level then region-level permission, bounds.
    pub(super) fn target(
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
    pub(super) fn respond_write(
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
            self.complete_recv_via(d, r.wr_id, WcStatus::SUCCESS, WcOpcode::RECV_RDMA_WITH_IMM, len, imm);
        }
        Outcome::Done(WcStatus::SUCCESS, len)
    }

    pub(super) fn respond_read(&self, dst: Dst, len: u32, addr: u64, rkey: u32, d: &mut Deferred) -> Outcome {
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

    pub(super) fn respond_send(
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
            self.complete_recv_via(d, recv.wr_id, WcStatus::LOC_LEN_ERR, opcode, len, None);
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
                    self.complete_recv_via(d, recv.wr_id, WcStatus::LOC_PROT_ERR, opcode, 0, None);
                    self.responder_error(d);
                    return Outcome::Done(WcStatus::REM_OP_ERR, 0);
                }
            }
        }
        self.complete_recv_via(d, recv.wr_id, WcStatus::SUCCESS, opcode, len, imm);
        Outcome::Done(WcStatus::SUCCESS, len)
    }

    /// Fetch-and-add or compare-and-swap on our memory; the original value goes to
    /// `result` (8 bytes).
    pub(super) fn respond_atomic(
        &self,
        result: Dst,
        addr: u64,
        rkey: u32,
        op: RawOp,
        d: &mut Deferred,
    ) -> Outcome {
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
    pub(super) fn take_recv(&self, from: &Requester<'_>) -> Option<RawRecvWr> {
        let mut rq = self.rq.lock().expect("rq lock");
        let r = rq.posted.pop_front();
        if r.is_some() {
            // Its completion is owed: flushes of later receives wait for it.
            self.unpublished.fetch_add(1, Ordering::SeqCst);
        }
        if let (None, Some(w)) = (&r, from.waiter)
            && !rq.rnr_waiters.iter().any(|x| x.ptr_eq(w))
        {
            rq.rnr_waiters.push(w.clone());
        }
        r
    }
}
