//! Completion queues with their completion channels: polling, notification, overrun detection.

use std::mem::MaybeUninit;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use rdmakit_sys as sys;

use super::conv::{errno_ret, nonnull, released};
use super::*;
use crate::error::{Error, Result, WcStatus};
use crate::wc::{WcOpcode, WorkCompletion};

/// A completion queue with its own completion channel.
pub(crate) struct Cq {
    pub(super) cq: NonNull<sys::ibv_cq>,
    pub(super) channel: NonNull<sys::ibv_comp_channel>,
    pub(super) dev: Arc<Device>,
    /// When the async event queue was last read for overruns (ns since `created`).
    pub(super) last_event_check: std::sync::atomic::AtomicU64,
    /// Empty polls since the last one that found something (see `check_overrun`).
    pub(super) empty_polls: std::sync::atomic::AtomicU32,
    pub(super) created: std::time::Instant,
}

// SAFETY: ibv_poll_cq, ibv_req_notify_cq and channel reads are thread-safe in rdma-core
// (providers lock the CQ); the safe layer also serialises polling.
unsafe impl Send for Cq {}
// SAFETY: `&Cq` methods poll, arm and read events through provider calls that lock the CQ,
// and update only atomics on the Rust side.
unsafe impl Sync for Cq {}

impl Cq {
    /// Creates a CQ of at least `cqe` entries on `ctx` with its own completion channel,
    /// non-blocking (`ibv_create_comp_channel`, `ibv_create_cq`).
    pub fn create(ctx: &Context, cqe: u32) -> Result<Cq> {
        let dev = &ctx.dev;
        let ctx = dev.ctx.as_ptr();
        // SAFETY: the context is open.
        let channel = nonnull("ibv_create_comp_channel", unsafe { sys::ibv_create_comp_channel(ctx) })?;
        // SAFETY: the channel was just created; its fd is valid.
        if let Err(e) = unsafe { conv::set_nonblocking((*channel.as_ptr()).fd) } {
            // SAFETY: destroying the channel we created, unused.
            unsafe { sys::ibv_destroy_comp_channel(channel.as_ptr()) };
            return Err(e);
        }
        let cqe = i32::try_from(cqe).map_err(|_| Error::InvalidArgument("CQ size too large".into()))?;
        // SAFETY: open context, valid channel; no cq_context.
        let cq = unsafe { sys::ibv_create_cq(ctx, cqe, ptr::null_mut(), channel.as_ptr(), 0) };
        match nonnull("ibv_create_cq", cq) {
            Ok(cq) => Ok(Cq {
                cq,
                channel,
                dev: dev.clone(),
                last_event_check: std::sync::atomic::AtomicU64::new(0),
                empty_polls: std::sync::atomic::AtomicU32::new(0),
                created: std::time::Instant::now(),
            }),
            Err(e) => {
                // SAFETY: the channel was created above and no CQ uses it (creation failed):
                // destroying it once here is the only release.
                unsafe { sys::ibv_destroy_comp_channel(channel.as_ptr()) };
                Err(e)
            }
        }
    }

    pub fn capacity(&self) -> u32 {
        // SAFETY: valid CQ.
        unsafe { (*self.cq.as_ptr()).cqe }.max(0) as u32
    }

    pub fn fd(&self) -> i32 {
        // SAFETY: valid channel.
        unsafe { (*self.channel.as_ptr()).fd }
    }

    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        const CHUNK: usize = 16;
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done).min(CHUNK);
            // The `want` entries the provider may fill are zeroed, not left uninitialised: a
            // provider writes only the fields valid for each completion (mlx5 leaves
            // `byte_len` of a write and everything but `wr_id`, `status` and `vendor_err` of
            // an error unwritten). Only those: a latency loop polls one at a time.
            let mut wcs = MaybeUninit::<[sys::ibv_wc; CHUNK]>::uninit();
            // SAFETY: `want <= CHUNK` entries of our own array.
            unsafe { std::ptr::write_bytes(wcs.as_mut_ptr().cast::<sys::ibv_wc>(), 0, want) };
            // SAFETY: valid CQ; room for `want` ibv_wc entries.
            let n = unsafe { sys::ibv_poll_cq(self.cq.as_ptr(), want as i32, wcs.as_mut_ptr().cast()) };
            let n = match conv::count("ibv_poll_cq", n) {
                Ok(n) => n,
                // Completions already taken from the CQ must reach the caller (their requests'
                // buffers are released when they are reaped): report them, and the error at
                // the next poll.
                Err(_) if done > 0 => break,
                Err(e) => return Err(e),
            };
            let base = wcs.as_ptr().cast::<sys::ibv_wc>();
            for i in 0..n {
                // SAFETY: `i < n <= want`: the entry was zeroed (every ibv_wc field is a plain
                // integer or a union of them, for which all-zero is valid), then written by
                // the provider.
                let wc = unsafe { &*base.add(i) };
                out[done + i] = convert_wc(wc);
            }
            done += n;
            if (n) < want {
                break;
            }
        }
        if done == 0 {
            self.check_overrun()?;
        } else {
            self.found_some();
        }
        Ok(done)
    }

    /// Polls one completion: one `ibv_wc` on the stack, no batch loop.
    pub fn poll_one(&self) -> Result<Option<WorkCompletion>> {
        // Zeroed: see `poll`.
        let mut wc = MaybeUninit::<sys::ibv_wc>::zeroed();
        // SAFETY: valid CQ; room for one ibv_wc.
        let n = unsafe { sys::ibv_poll_cq(self.cq.as_ptr(), 1, wc.as_mut_ptr()) };
        if conv::count("ibv_poll_cq", n)? == 0 {
            self.check_overrun()?;
            return Ok(None);
        }
        self.found_some();
        // SAFETY: zeroed (valid for every field), then written by the provider.
        Ok(Some(convert_wc(unsafe { wc.assume_init_ref() })))
    }

    /// A poll found completions: the next empty poll checks for an overrun. The counter is
    /// written only when it is not already zero, so a CQ that always has completions does
    /// not dirty its line once per completion.
    fn found_some(&self) {
        if self.empty_polls.load(Ordering::Relaxed) != 0 {
            self.empty_polls.store(0, Ordering::Relaxed);
        }
    }

    /// Called when a poll found the queue empty. An overrun is reported by an async event,
    /// not by poll: look for it when the queue looks empty (a lost completion would
    /// otherwise go unnoticed), at most once a millisecond so that a spinning poller does
    /// not make a syscall per spin. The clock is read on the first empty poll after one
    /// that found something and then on every 32nd: a clock read costs about what the
    /// empty poll itself does, and a latency loop polls empty many times per operation.
    fn check_overrun(&self) -> Result<()> {
        // A relaxed load and store, not an atomic add: racing pollers may lose a count,
        // which only moves the next clock read.
        let n = self.empty_polls.load(Ordering::Relaxed);
        self.empty_polls.store(n.wrapping_add(1), Ordering::Relaxed);
        if !n.is_multiple_of(32) || !self.event_check_due() {
            return Ok(());
        }
        self.dev.drain_async_events();
        if self.dev.overrun.lock().expect("overrun set").contains(&(self.cq.as_ptr() as usize)) {
            return Err(Error::CqOverrun { capacity: self.capacity() });
        }
        Ok(())
    }

    pub(super) fn event_check_due(&self) -> bool {
        let now = self.created.elapsed().as_nanos() as u64;
        let last = self.last_event_check.load(Ordering::Relaxed);
        now.saturating_sub(last) >= 1_000_000
            && self.last_event_check.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }

    pub fn req_notify(&self) -> Result<()> {
        // SAFETY: valid CQ.
        errno_ret("ibv_req_notify_cq", unsafe { sys::ibv_req_notify_cq(self.cq.as_ptr(), 0) })
    }

    /// Reads and acknowledges every pending channel event.
    pub fn take_events(&self) {
        let mut n = 0u32;
        loop {
            let mut cq = ptr::null_mut();
            let mut ctx = ptr::null_mut();
            // SAFETY: valid channel (non-blocking fd); out-pointers are locals.
            if unsafe { sys::ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut ctx) } != 0 {
                break;
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: acknowledges exactly the events read from this CQ's own channel.
            unsafe { sys::ibv_ack_cq_events(self.cq.as_ptr(), n) };
        }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        self.take_events();
        // Acknowledge any async event still naming this CQ (destroy would wait for it).
        self.dev.drain_async_events();
        // SAFETY: created by ibv_create_cq; QPs using it hold the public CQ, so none is
        // left; all events are acknowledged (destroy would wait for them otherwise).
        if released("ibv_destroy_cq", &self.dev.name, unsafe { sys::ibv_destroy_cq(self.cq.as_ptr()) }) {
            // The overrun flag is keyed by address: it must not outlive the CQ, or a new CQ
            // allocated at the same address would report an overrun it never had.
            self.dev.overrun.lock().expect("overrun set").remove(&(self.cq.as_ptr() as usize));
        }
        // SAFETY: its only CQ is destroyed.
        unsafe { sys::ibv_destroy_comp_channel(self.channel.as_ptr()) };
    }
}

/// What rdmakit reports of a completion the provider wrote into a zeroed `ibv_wc`. Verbs
/// defines only `wr_id`, `status`, `qp_num` and `vendor_err` of an error completion
/// (ibv_poll_cq(3)), and a provider may leave the rest unwritten: `byte_len`, the flags
/// and the immediate are taken from successful completions only, `vendor_err` from
/// failed ones; `opcode` is what the provider left (0 where it wrote nothing).
pub(super) fn convert_wc(wc: &sys::ibv_wc) -> WorkCompletion {
    let ok = wc.status == sys::ibv_wc_status::IBV_WC_SUCCESS;
    let with_imm = ok && wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
    WorkCompletion {
        wr_id: wc.wr_id,
        status: WcStatus(wc.status),
        opcode: WcOpcode(wc.opcode),
        byte_len: if ok { wc.byte_len } else { 0 },
        // SAFETY: reading the immediate member of a plain-integer union.
        imm: with_imm.then(|| u32::from_be(unsafe { wc.__bindgen_anon_1.imm_data })),
        qp_num: wc.qp_num,
        vendor_err: if ok { 0 } else { wc.vendor_err },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `ibv_wc` with every byte `b`: fields a provider left unwritten hold garbage.
    fn filled(b: u8) -> sys::ibv_wc {
        let mut wc = MaybeUninit::<sys::ibv_wc>::zeroed();
        // SAFETY: writing bytes into our own buffer; every field of ibv_wc is a plain integer
        // (or a union of them), valid for any bytes.
        unsafe {
            std::ptr::write_bytes(wc.as_mut_ptr().cast::<u8>(), b, size_of::<sys::ibv_wc>());
            wc.assume_init()
        }
    }

    /// What mlx5 writes on an error completion: `wr_id`, `status`, `vendor_err` (and
    /// `qp_num`, `wc_flags`); the rest is not reported as if it were data.
    #[test]
    fn an_error_completion_reports_only_what_verbs_defines() {
        let mut wc = filled(0xa5);
        wc.wr_id = 8;
        wc.status = sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
        wc.vendor_err = 0x79;
        wc.qp_num = 0x123;
        wc.wc_flags = sys::ibv_wc_flags::IBV_WC_WITH_IMM.0;
        let out = convert_wc(&wc);
        assert_eq!(
            (out.wr_id, out.status, out.qp_num, out.vendor_err),
            (8, WcStatus::WR_FLUSH_ERR, 0x123, 0x79)
        );
        assert_eq!((out.byte_len, out.imm), (0, None), "unwritten fields of an error completion");
    }

    /// A successful completion carries no vendor syndrome, whatever the field holds.
    #[test]
    fn a_successful_completion_has_no_vendor_error() {
        let mut wc = filled(0xa5);
        wc.status = sys::ibv_wc_status::IBV_WC_SUCCESS;
        wc.byte_len = 64;
        wc.wc_flags = 0;
        let out = convert_wc(&wc);
        assert_eq!((out.vendor_err, out.byte_len, out.imm), (0, 64, None));
    }
}
