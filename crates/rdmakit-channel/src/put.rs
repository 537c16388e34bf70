//! CkDirect-style persistent put handles: the same transfer between the same partners every
//! iteration, set up once and then one RDMA write per iteration.
//!
//! As in Charm++'s CkDirect (Eric Bohm et al., "CkDirect: Charm++ RDMA Put", 2008): the receiver
//! creates a handle over its receive buffer with a callback ([`PutEndpoint::create_handle`])
//! and ships the handle's [`HandleDesc`] to the sender; the sender associates a local
//! buffer with it ([`PutEndpoint::assoc_local_buffer`]) and then [`put`](SendHandle::put)s
//! every iteration. The receiver's ready calls mean what CkDirect's mean:
//!
//! | rdmakit | CkDirect | meaning |
//! | --- | --- | --- |
//! | [`PutEndpoint::create_handle`] | `CkDirect_createHandle` | receiver: a handle over a receive buffer, with a callback and an initial value |
//! | [`PutEndpoint::assoc_local_buffer`] | `CkDirect_assocLocalBuffer` | sender: associate a send buffer with the handle |
//! | [`SendHandle::put`] | `CkDirect_put` | sender: the transfer ([`ChannelError::Busy`] while the receiver has not marked the previous put done) |
//! | [`RecvHandle::ready_mark`] | `CkDirect_readyMark` | receiver: done with the data (the sender may put again), but **do not start polling** yet |
//! | [`RecvHandle::ready_poll_q`] | `CkDirect_readyPollQ` | receiver: the data was already marked; **start checking** for the next put (queue the handle) |
//! | [`RecvHandle::ready`] | `CkDirect_ready` | receiver: both at once: done with the data, start checking |
//! | [`PutEndpoint::ready_poll`] | the runtime's poll of its ready queue | receiver: check every queued handle, run the callback of each whose put landed |
//!
//! The split scheme is the slides' "reducing polling overhead": polling costs grow with the
//! queued handles only, so a receiver marks a handle done as soon as it has consumed the
//! data ([`ready_mark`](RecvHandle::ready_mark), which lets the sender go on) and queues it
//! for polling only when it expects the next put
//! ([`ready_poll_q`](RecvHandle::ready_poll_q)). A put that completed between the two is
//! detected by the first poll after `ready_poll_q`. A receive loop ported from Charm++:
//!
//! ```text
//! h = CkDirect_createHandle(...)     let h = ep.create_handle(&buf, callback, initial)?;
//! CkDirect_readyPollQ(&h)            h.ready_poll_q()?;   // a fresh handle has nothing to mark
//! loop:                              loop {
//!   (scheduler polls; callback)        while ep.ready_poll()? == 0 {}   // runs the callback
//!   compute on the data                compute(&buf);
//!   CkDirect_readyMark(&h)             h.ready_mark()?;     // the sender may put again
//!   other work                         other_work();
//!   CkDirect_readyPollQ(&h)            h.ready_poll_q()?;
//!   -- or, in one call --              -- or --
//!   CkDirect_ready(&h)                 h.ready()?;
//! ```
//!
//! A newly created handle counts as marked (there is no data to be done with) but is not
//! queued: call [`ready_poll_q`](RecvHandle::ready_poll_q) (or `ready`) before the first
//! put is expected. `ready_poll_q` on a handle whose latest put has not been marked done is
//! refused ([`ChannelError::Invalid`]): its sender would stay `Busy` and the poll would wait
//! forever.
//!
//! Two ways to detect a put ([`Detection`], chosen per handle with
//! [`PutEndpoint::create_handle_with`]; the sender learns it from the [`HandleDesc`]):
//! - [`Detection::Sentinel`] is CkDirect's: a put is one RDMA write, seen when the buffer's
//!   last 8 bytes leave the handle's `initial_value` (its "out of band pattern"), and
//!   `ready_mark` writes that value back locally. As in CkDirect, one transaction per handle
//!   at a time is the application's to keep, and a payload ending in the value is never
//!   seen (so `put` refuses one). This is the mode whose round trip beats a send/recv
//!   ping-pong, as the slides claim.
//! - [`Detection::SequenceWord`], the default, trades two more writes per put for the two
//!   guarantees CkDirect leaves to the application; it differs from CkDirect as follows.
//!
//! Differences of the default from CkDirect, on purpose:
//! - **Detection.** CkDirect detects a put by the last double of the buffer changing from
//!   an `initial_value`, so a payload ending in that value is never seen. Here each put is
//!   followed, on the same QP, by an 8-byte write of the put's sequence number into a word
//!   beside the buffer; the receiver polls that word. This relies on the NIC placing the two
//!   writes in order (as CkDirect and perftest do; see [`pipe`](crate::pipe) for the
//!   caveat). `initial_value` is still written into the buffer's last 8 bytes by each
//!   `ready_mark` that marks a put done (before the sender may put again), for code that
//!   looks at it, but detection never depends on it.
//! - **One transaction per handle, enforced.** CkDirect leaves "only 1 transaction per
//!   handle at a time" to the application. Here a `put` before the receiver marked the
//!   previous one done fails with [`ChannelError::Busy`] instead of overwriting data the
//!   receiver may be reading: `ready_mark` RDMA-writes the consumed sequence number into the
//!   sender's handle state, which `put` checks locally.
//! - **Associations are epochs.** Each `assoc_local_buffer` takes a fresh epoch (a per-endpoint
//!   counter) that tags the sequence words its puts write and the ready words the receiver
//!   writes back (`epoch << 40 | count`). The receiver learns the epoch from the
//!   association message (sent on the same QP before any put); a word of another epoch counts
//!   as zero. So a sender can deassociate and another associate with the same handle (its
//!   counts start again from zero), and a late write of an old association (a stale ready
//!   signal into a reused sender slot, an old sequence word into a reused handle slot) is
//!   never mistaken for the current one.
//!
//! Callbacks run on the thread that calls [`PutEndpoint::ready_poll`], inside that call,
//! without the endpoint's lock (a callback may call `ready_mark`, `ready` or `ready_poll`).
//! Several threads may poll at once: a handle's put counts as seen only together with its
//! callback, so a put that lands while the handle's callback is still running (on another
//! thread) stays queued until that callback has returned.
//! [`RecvHandle::next_put`] is the async variant: a future per iteration (it polls the
//! sequence word, yielding to the executor between polls; dropping it takes nothing).
//!
//! # Example: a put handle awaited from async code
//!
//! ```
//! use rdmakit_channel::{PollMode, put::PutEndpoint};
//! use rdmakit_verbs::{AccessFlags, ConnectOptions, Context, QpCaps};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let ctx = Context::open_soft();
//! let pd = ctx.alloc_pd()?;
//! let (ca, cb) = (ctx.create_cq(256)?, ctx.create_cq(256)?);
//! let (qa, qb) = (pd.create_qp(&ca, &ca, QpCaps::default())?, pd.create_qp(&cb, &cb, QpCaps::default())?);
//! qa.connect(&qb.address()?, &ConnectOptions::default())?;
//! qb.connect(&qa.address()?, &ConnectOptions::default())?;
//! let tx = PutEndpoint::new(qa, ca, PollMode::Busy)?;
//! let rx = PutEndpoint::new(qb, cb, PollMode::Busy)?;
//! let ghost = pd.alloc_mr(32, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
//! let handle = rx.create_handle(&ghost, |_| {}, 0)?;
//! let edge = pd.alloc_mr(32, AccessFlags::LOCAL_WRITE)?;
//! let put = tx.assoc_local_buffer(&handle.desc()?, edge.local()?)?;
//! edge.write_u64(0, 0x5eed)?;
//! handle.ready_poll_q()?;
//! put.put()?;
//! handle.next_put().await?; // resolves when the put has landed
//! assert_eq!(ghost.read_u64(0)?, 0x5eed);
//! handle.ready_mark()?; // done with the data: the sender may put again
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use rdmakit_verbs::{
    AccessFlags, CompletionQueue, LocalSlice, MemoryRegion, QueuePair, RemoteRegion, SendWr, WorkCompletion,
};

use crate::control::{ControlConfig, ControlSlots, Event, Message};
use crate::driver::{Controlled, Driver, PollMode};
use crate::error::{ChannelError, Result};

/// Most handles per endpoint and role.
pub const MAX_HANDLES: u32 = 256;
const RECV_SLOTS: u32 = 32;
const MSG_LEN: u32 = 64;
/// Sequence and ready words hold an association epoch above a 40-bit count.
const COUNT_BITS: u32 = 40;
const EPOCH_MASK: u32 = (1 << (64 - COUNT_BITS)) - 1;

/// A sequence or ready word: `epoch` (never 0 for a live association) above `count`.
fn word(epoch: u32, count: u64) -> u64 {
    (u64::from(epoch) << COUNT_BITS) | (count & ((1 << COUNT_BITS) - 1))
}

/// The count in `w` if it belongs to association `epoch`, else 0 (a stale or reset word).
fn count_for(w: u64, epoch: Option<u32>) -> u64 {
    match epoch {
        Some(ep) if (w >> COUNT_BITS) as u32 == ep => w & ((1 << COUNT_BITS) - 1),
        _ => 0,
    }
}

/// How a receiver sees that a put has landed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Detection {
    /// rdmakit's default: each put is followed by an 8-byte write of its sequence number
    /// into a word beside the buffer, and the receiver's `ready_mark` writes the consumed
    /// count back to the sender, whose next `put` is [`Busy`](ChannelError::Busy) until
    /// then. Any payload is seen; one transaction per handle is enforced. Three RDMA writes
    /// per put.
    #[default]
    SequenceWord,
    /// CkDirect's own scheme ("out of band pattern"): a put is **one** RDMA write, seen when
    /// the buffer's last 8 bytes differ from the handle's `initial_value`, and
    /// `ready_mark` only writes `initial_value` back into them, locally. As in CkDirect:
    /// - a payload whose last 8 bytes equal `initial_value` would never be seen: such a
    ///   `put` is refused ([`ChannelError::Invalid`]); pick a value the data never ends
    ///   with (a NaN pattern for `f64` data);
    /// - "only 1 transaction per handle at a time" is the application's: a `put` before
    ///   the receiver's `ready_mark` of the previous one is not detected as `Busy`; it may
    ///   land while the receiver reads the buffer (torn data, never undefined behaviour:
    ///   the buffer is only ever read through copies) or be lost to the `ready_mark` that
    ///   rewrites the sentinel. Applications with iteration boundaries (the seed's use case:
    ///   halo exchanges, ping-pongs) get that order for free;
    /// - the buffer must start and end 8-aligned, so that its last 8 bytes are the word a
    ///   NIC places last (see [`pipe`](crate::pipe) for the ordering caveat on hardware).
    Sentinel,
}

/// What the receiver ships to the sender: where a handle's buffer and sequence word are,
/// and how its puts are detected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandleDesc {
    /// The handle's number on the receiver.
    pub id: u32,
    /// The receive buffer.
    pub buf: RemoteRegion,
    /// The handle's sequence word (8 bytes; unused with [`Detection::Sentinel`]).
    pub seq: RemoteRegion,
    /// With [`Detection::Sentinel`]: the handle's `initial_value` (a put whose payload ends
    /// with it is refused); `None` with [`Detection::SequenceWord`].
    pub sentinel: Option<u64>,
}

/// Bit 31 of an encoded descriptor's id: the handle uses [`Detection::Sentinel`], and the
/// last 8 bytes carry its value.
const SENTINEL_BIT: u32 = 1 << 31;

impl HandleDesc {
    /// Encoded length.
    pub const ENCODED_LEN: usize = 4 + 20 + 20 + 8;

    /// How the receiver detects this handle's puts.
    pub fn detection(&self) -> Detection {
        if self.sentinel.is_some() { Detection::Sentinel } else { Detection::SequenceWord }
    }

    /// Little-endian encoding.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        let flag = if self.sentinel.is_some() { SENTINEL_BIT } else { 0 };
        out[0..4].copy_from_slice(&(self.id | flag).to_le_bytes());
        out[4..24].copy_from_slice(&self.buf.encode());
        out[24..44].copy_from_slice(&self.seq.encode());
        out[44..52].copy_from_slice(&self.sentinel.unwrap_or(0).to_le_bytes());
        out
    }

    /// Decodes [`encode`](Self::encode)'s output; anything else is an error.
    pub fn decode(b: &[u8]) -> Result<HandleDesc> {
        if b.len() != Self::ENCODED_LEN {
            return Err(ChannelError::Protocol(format!(
                "a handle descriptor is {} bytes, got {}",
                Self::ENCODED_LEN,
                b.len()
            )));
        }
        let seq = RemoteRegion::decode(&b[24..44])?;
        if seq.len != 8 {
            return Err(ChannelError::Protocol("a handle's sequence word is 8 bytes".into()));
        }
        let buf = RemoteRegion::decode(&b[4..24])?;
        if buf.addr.checked_add(buf.len).is_none() || seq.addr.checked_add(seq.len).is_none() {
            return Err(ChannelError::Protocol("a handle descriptor's region overflows".into()));
        }
        let raw = u32::from_le_bytes(b[0..4].try_into().expect("4 bytes"));
        let value = u64::from_le_bytes(b[44..52].try_into().expect("8 bytes"));
        let sentinel = match raw & SENTINEL_BIT {
            0 if value != 0 => {
                return Err(ChannelError::Protocol(
                    "a sequence-word handle's descriptor carries a sentinel".into(),
                ));
            }
            0 => None,
            _ if buf.len < 8 || !buf.addr.is_multiple_of(8) || !buf.len.is_multiple_of(8) => {
                return Err(ChannelError::Protocol(
                    "a sentinel handle's buffer is not whole aligned words".into(),
                ));
            }
            _ => Some(value),
        };
        Ok(HandleDesc { id: raw & !SENTINEL_BIT, buf, seq, sentinel })
    }
}

type Callback = Box<dyn FnMut(&MemoryRegion) + Send>;

struct RecvEntry {
    buf: MemoryRegion,
    callback: Option<Callback>,
    initial_value: u64,
    detection: Detection,
    /// Puts marked done (`ready_mark`) so far; never more than `seen`.
    consumed: u64,
    /// Puts seen (callback fired, or `next_put` returned) so far.
    seen: u64,
    /// In the poll queue (`ready_poll_q`), awaiting a put.
    queued: bool,
    /// The sender's ready word for this handle, once associated.
    sender_ready: Option<RemoteRegion>,
    /// The current association's epoch (from its `TAG_ASSOC`): sequence words of other
    /// epochs (an earlier sender's late write) are not puts.
    epoch: Option<u32>,
    /// This handle's incarnation of its slot (slots are reused after `destroy`).
    incarnation: u64,
    /// In [`State::deferred_marks`]: a ready signal waits for room in the send queue. When
    /// it goes out it carries the handle's state then (its association, the puts marked
    /// done), so one entry per handle is enough, whatever happens meanwhile.
    mark_deferred: bool,
}

impl RecvEntry {
    /// Puts landed on this handle as far as its memory says: the count in its sequence word
    /// (`words`, slot `id`), or, for a sentinel handle, one more than seen once its last
    /// word differs from `initial_value`.
    fn landed(&self, words: &MemoryRegion, id: u32) -> Result<u64> {
        Ok(match self.detection {
            Detection::SequenceWord => count_for(words.load_u64_acquire(u64::from(id) * 8)?, self.epoch),
            Detection::Sentinel => {
                let w = self.buf.load_u64_acquire(self.buf.len() as u64 - 8)?;
                // Seen but not marked: the sentinel is still the put's, not a new one.
                let fresh = w != self.initial_value && self.consumed == self.seen;
                self.seen + u64::from(fresh)
            }
        })
    }
}

struct SendEntry {
    desc: HandleDesc,
    src: LocalSlice,
    /// The source's last word, whose value must differ from the sentinel (sentinel handles).
    last_word: u64,
    puts: u64,
    /// This association's epoch, tagged on every sequence word it writes.
    epoch: u32,
}

struct State {
    ctl: ControlSlots,
    recv: Vec<Option<RecvEntry>>,
    send: Vec<Option<SendEntry>>,
    /// The poll queue: handles awaiting a put (CkDirect's ready queue).
    queued: VecDeque<u32>,
    /// Handles whose ready signal waits for room in the send queue, in marking order (one
    /// entry per handle, however often it is marked or associated meanwhile; a slot
    /// destroyed and created again may leave one stale entry, skipped).
    deferred_marks: VecDeque<u32>,
    /// The epoch of the next association this endpoint makes as a sender (never 0).
    next_epoch: u32,
    /// The incarnation of the next receive handle.
    next_incarnation: u64,
}

impl Controlled for State {
    fn control(&mut self) -> &mut ControlSlots {
        &mut self.ctl
    }
}

struct Inner {
    driver: Driver<State>,
    /// Receiver role: one sequence word per handle (peers write it).
    seq_words: MemoryRegion,
    /// Sender role: one ready word per handle (the receiver writes it).
    ready_words: MemoryRegion,
}

/// Both roles of persistent put handles over one connected RC queue pair.
#[derive(Clone)]
pub struct PutEndpoint {
    inner: Arc<Inner>,
}

/// The receiver's handle.
pub struct RecvHandle {
    ep: PutEndpoint,
    id: u32,
}

/// The sender's handle, associated with a local buffer.
pub struct SendHandle {
    ep: PutEndpoint,
    id: u32,
}

impl PutEndpoint {
    /// An endpoint over `qp` (connected RC, `max_inline_data >= 64`, `max_send_wr >= 4`),
    /// whose completions go to `cq` only. `cq` must hold `max_send_wr + 32` completions (the
    /// send queue and the endpoint's receive slots), or it could overrun when many handles
    /// are associated at once: a smaller one is refused with [`ChannelError::QueueTooSmall`].
    pub fn new(qp: QueuePair, cq: CompletionQueue, poll: PollMode) -> Result<PutEndpoint> {
        if qp.caps().max_inline_data < MSG_LEN {
            return Err(ChannelError::Invalid("put endpoints need max_inline_data >= 64"));
        }
        let pd = qp.pd().clone();
        let words = (MAX_HANDLES * 8) as usize;
        let remote = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let ctl =
            ControlSlots::new(qp.clone(), ControlConfig::new(RECV_SLOTS, MSG_LEN, 4 * MAX_HANDLES as usize))?;
        ctl.check_cq(&cq)?;
        let inner = Arc::new(Inner {
            seq_words: pd.alloc_mr(words, remote)?,
            ready_words: pd.alloc_mr(words, remote)?,
            driver: Driver::new(
                cq,
                poll,
                State {
                    ctl,
                    recv: Vec::new(),
                    send: Vec::new(),
                    queued: VecDeque::new(),
                    deferred_marks: VecDeque::new(),
                    next_epoch: 1,
                    next_incarnation: 0,
                },
            ),
        });
        Ok(PutEndpoint { inner })
    }

    /// Receiver (`CkDirect_createHandle`): a handle over `recv_buf` (remote write access),
    /// whose `callback` runs in [`ready_poll`](Self::ready_poll) when a put has landed.
    /// `initial_value` is written into the buffer's last 8 bytes now and at each
    /// [`ready_mark`](RecvHandle::ready_mark) that marks a put done (CkDirect compatibility
    /// only). The handle starts marked (no data to be done with) and not queued: call
    /// [`ready_poll_q`](RecvHandle::ready_poll_q) or [`ready`](RecvHandle::ready) before
    /// the first put is expected.
    pub fn create_handle(
        &self,
        recv_buf: &MemoryRegion,
        callback: impl FnMut(&MemoryRegion) + Send + 'static,
        initial_value: u64,
    ) -> Result<RecvHandle> {
        self.create_handle_with(recv_buf, callback, initial_value, Detection::SequenceWord)
    }

    /// [`create_handle`](Self::create_handle) with a choice of [`Detection`]: with
    /// [`Detection::Sentinel`] a put is one RDMA write, as in CkDirect, and the
    /// application keeps to one transaction per handle at a time (see there).
    pub fn create_handle_with(
        &self,
        recv_buf: &MemoryRegion,
        callback: impl FnMut(&MemoryRegion) + Send + 'static,
        initial_value: u64,
        detection: Detection,
    ) -> Result<RecvHandle> {
        if !recv_buf.access().contains(AccessFlags::REMOTE_WRITE) || recv_buf.len() < 8 {
            return Err(ChannelError::Invalid("a put handle's buffer needs REMOTE_WRITE and 8+ bytes"));
        }
        let whole_words =
            recv_buf.remote().addr.is_multiple_of(8) && (recv_buf.len() as u64).is_multiple_of(8);
        if detection == Detection::Sentinel && !whole_words {
            return Err(ChannelError::Invalid(
                "a sentinel handle's buffer must start and end 8-aligned (its last word is the sentinel)",
            ));
        }
        let id = self.inner.driver.with(|st| {
            let id = st.recv.iter().position(Option::is_none).unwrap_or(st.recv.len());
            if id >= MAX_HANDLES as usize {
                return Err(ChannelError::Invalid("too many put handles on this endpoint"));
            }
            let entry = RecvEntry {
                buf: recv_buf.clone(),
                callback: Some(Box::new(callback)),
                initial_value,
                detection,
                consumed: 0,
                seen: 0,
                queued: false,
                sender_ready: None,
                epoch: None,
                incarnation: st.next_incarnation,
                mark_deferred: false,
            };
            st.next_incarnation += 1;
            if id == st.recv.len() {
                st.recv.push(Some(entry));
            } else {
                st.recv[id] = Some(entry);
            }
            Ok(id as u32)
        })?;
        self.inner.seq_words.write_u64(u64::from(id) * 8, 0)?;
        recv_buf.write_u64(recv_buf.len() as u64 - 8, initial_value)?;
        Ok(RecvHandle { ep: self.clone(), id })
    }

    /// Sender (`CkDirect_assocLocalBuffer`): associates `send_buf` with the receiver's
    /// handle `desc` (their lengths must match), and tells the receiver where to signal
    /// readiness.
    pub fn assoc_local_buffer(&self, desc: &HandleDesc, send_buf: LocalSlice) -> Result<SendHandle> {
        // A descriptor built here rather than decoded gets `decode`'s checks too (a sentinel
        // handle's buffer is whole aligned words, 8 bytes or more; no region overflows).
        if HandleDesc::decode(&desc.encode())? != *desc {
            return Err(ChannelError::Invalid("a handle descriptor whose id uses the sentinel flag's bit"));
        }
        if u64::from(send_buf.len()) != desc.buf.len {
            return Err(ChannelError::Invalid("the send buffer's length differs from the handle's"));
        }
        let last_word = send_buf.offset() + u64::from(send_buf.len()).saturating_sub(8);
        let inner = &self.inner;
        let (id, epoch) = inner.driver.with(|st| -> Result<(u32, u32)> {
            st.check()?;
            let id = st.send.iter().position(Option::is_none).unwrap_or(st.send.len());
            if id >= MAX_HANDLES as usize {
                return Err(ChannelError::Invalid("too many put handles on this endpoint"));
            }
            let epoch = st.next_epoch;
            st.next_epoch = (st.next_epoch % EPOCH_MASK) + 1;
            let entry = SendEntry { desc: *desc, src: send_buf, last_word, puts: 0, epoch };
            if id == st.send.len() {
                st.send.push(Some(entry));
            } else {
                st.send[id] = Some(entry);
            }
            Ok((id as u32, epoch))
        })?;
        // From here on the handle owns the slot: dropping it on an error frees the slot.
        let handle = SendHandle { ep: self.clone(), id };
        if desc.sentinel.is_some() {
            // CkDirect's scheme: nothing to tell the receiver, nothing to wait for.
            return Ok(handle);
        }
        inner.ready_words.write_u64(u64::from(id) * 8, 0)?;
        let ready = inner.ready_words.remote().slice(u64::from(id) * 8, 8)?;
        let m = Message::Assoc { handle: desc.id, ready, epoch };
        inner.driver.with(|st| st.ctl.send(&m))?;
        Ok(handle)
    }

    /// Receiver: checks every queued handle (and only those: see
    /// [`ready_poll_q`](RecvHandle::ready_poll_q)) and runs the callback of each whose put
    /// has landed, on this thread, taking it out of the queue. Returns how many fired.
    ///
    /// Safe to call from several threads at once: a put counts as seen only when its
    /// callback is run for it, so a put on a handle whose callback is still running
    /// elsewhere is left queued for a later call.
    ///
    /// Called in a loop while waiting, it also keeps the connection watched: a dead sender
    /// makes it return [`ChannelError::Broken`] within the bound of [`crate::control`].
    pub fn ready_poll(&self) -> Result<usize> {
        let inner = &self.inner;
        // The first queued handle is looked at in the same critical section as any poll
        // (the others one lock each); when that already says nothing will fire, the watch
        // (see below) is kept there too. A landed put is seen in memory, not in the CQ: the
        // step runs without a CQ poll first, and the driver polls once every few such steps.
        let step = |st: &mut State| -> Result<(usize, Option<Job>, bool)> {
            st.check()?;
            let queued = st.queued.len();
            let job = if queued > 0 { inner.take_job(st)? } else { None };
            let watched = job.is_none() && queued <= 1;
            if watched {
                Inner::watch_locked(st)?;
            }
            Ok((queued, job, watched))
        };
        let (queued, mut job, watched) = match inner.driver.try_unpolled(|st| Some(step(st))) {
            Some(r) => r?,
            None => {
                let on_wc = &mut |st: &mut State, wc: &WorkCompletion| inner.on_wc(st, wc);
                inner.driver.progress_then(on_wc, step)??
            }
        };
        let mut fired = 0;
        for i in 0..queued {
            if i > 0 {
                job = inner.driver.with(|st| inner.take_job(st))?;
            }
            if let Some((id, incarnation, mut cb, buf)) = job.take() {
                cb(&buf);
                fired += 1;
                let orphan = inner.driver.with(|st| {
                    // Not if the callback destroyed the handle (and the slot was reused).
                    match st.recv.get_mut(id as usize) {
                        Some(Some(e)) if e.incarnation == incarnation => {
                            e.callback = Some(cb);
                            None
                        }
                        _ => Some(cb),
                    }
                });
                // Dropped without the lock: it may own handles of this endpoint, whose drop
                // takes the lock.
                drop(orphan);
            }
        }
        if fired == 0 && !watched {
            inner.watch()?; // blocked: the caller polls again
        }
        Ok(fired)
    }

    /// Makes progress on completions (association messages, finished puts) without waiting.
    pub fn progress(&self) -> Result<()> {
        self.inner.progress_and_watch()
    }
}

/// A put to report: the handle, its incarnation, its callback (taken out to run without
/// the lock) and its buffer.
type Job = (u32, u64, Callback, MemoryRegion);

impl Inner {
    /// Takes the first queued handle out of the poll queue: its job if its put has landed
    /// and its callback is in; else it goes back to the end of the queue.
    fn take_job(&self, st: &mut State) -> Result<Option<Job>> {
        st.check()?;
        let Some(id) = st.queued.pop_front() else { return Ok(None) };
        let Some(e) = st.recv.get_mut(id as usize).and_then(Option::as_mut) else { return Ok(None) };
        let seq = e.landed(&self.seq_words, id)?;
        // Not yet; or the callback is out, running for the previous put on another
        // thread: this put is seen with its own callback once that one is back.
        if seq <= e.seen || e.callback.is_none() {
            st.queued.push_back(id); // stays in the queue
            return Ok(None);
        }
        e.seen = seq;
        e.queued = false;
        Ok(e.callback.take().map(|cb| (id, e.incarnation, cb, e.buf.clone())))
    }

    /// Applies what has completed and reports a failure (one lock). Keeps no watch on the
    /// connection: an operation that finds itself blocked (a poll that found no put, a
    /// `Busy` put) calls [`watch`](Self::watch) too, so a call that gets on pays no clock
    /// read for keep-alives.
    fn progress(&self) -> Result<()> {
        self.driver.progress_then(&mut |st, wc| self.on_wc(st, wc), |st| st.check())?
    }

    /// Called by an operation that is blocked (its caller will retry): sends a keep-alive
    /// if one is due, so a dead peer ends the wait, and reports a failure.
    fn watch(&self) -> Result<()> {
        self.driver.with(Inner::watch_locked)
    }

    /// [`watch`](Self::watch) under the lock.
    fn watch_locked(st: &mut State) -> Result<()> {
        st.ctl.tick();
        st.check()
    }

    /// [`progress`](Self::progress) and [`watch`](Self::watch).
    fn progress_and_watch(&self) -> Result<()> {
        self.progress()?;
        self.watch()
    }

    fn on_wc(&self, st: &mut State, wc: &WorkCompletion) {
        let event = st.ctl.on_wc(wc);
        if !st.deferred_marks.is_empty() {
            st.post_deferred_marks(); // a completion may have made room
        }
        let m = match event {
            Some(Event::Message(m)) => m,
            None => return,
            Some(Event::Malformed(e)) => {
                // Handles are independent: a bad message is the peer's loss, not the endpoint's.
                rdmakit_verbs::warn_limited!(error = %e, "put endpoint: ignoring a malformed control message");
                return;
            }
            Some(Event::Imm { .. }) => {
                rdmakit_verbs::warn_limited!("put endpoint: ignoring a write with immediate");
                return;
            }
        };
        match m {
            Message::Assoc { handle, ready, epoch } => {
                let Some(e) = st.recv.get_mut(handle as usize).and_then(Option::as_mut) else {
                    rdmakit_verbs::warn_limited!(handle, "put endpoint: association with an unknown handle");
                    return;
                };
                // A new association counts its puts from zero, in its own epoch.
                e.sender_ready = Some(RemoteRegion { addr: ready.addr, len: 8, rkey: ready.rkey });
                e.epoch = Some(epoch);
                e.seen = 0;
                e.consumed = 0;
            }
            Message::Deassoc { handle, epoch } => {
                // Only the current association's: a late one must not end a newer one.
                if let Some(e) = st.recv.get_mut(handle as usize).and_then(Option::as_mut)
                    && e.epoch == Some(epoch)
                {
                    e.sender_ready = None;
                    e.epoch = None;
                }
            }
            other => {
                rdmakit_verbs::warn_limited!(message = ?other, "put endpoint: ignoring a message of another protocol")
            }
        }
    }
}

impl State {
    fn check(&self) -> Result<()> {
        self.ctl.check()
    }

    /// `ready_mark` under the lock.
    fn mark(&mut self, id: u32) -> Result<()> {
        let e = self.recv[id as usize].as_mut().ok_or(ChannelError::Invalid("destroyed handle"))?;
        if e.consumed == e.seen {
            // Nothing to be done with: the buffer may hold the next put already.
            return Ok(());
        }
        // CkDirect's sentinel (what detects the next put of a sentinel handle; for
        // compatibility otherwise), written before the sender may put again.
        e.buf.write_u64(e.buf.len() as u64 - 8, e.initial_value)?;
        e.consumed = e.seen;
        let (Some(target), Some(epoch)) = (e.sender_ready, e.epoch) else {
            // Nobody to tell: the sender deassociated after its put.
            return Ok(());
        };
        if e.detection == Detection::Sentinel {
            // Nobody to tell: the application's iteration boundaries order the next put.
            return Ok(());
        }
        // The ready signal. Earlier deferred ones go first, and with no room (a send queue
        // that control messages or other handles' signals keep full) it waits its turn:
        // marking done never fails for want of room.
        if self.deferred_marks.is_empty() && self.ctl.room_for(1) {
            let v = word(epoch, e.consumed).to_le_bytes();
            // Nobody waits for its completion (RC reports a failure all the same).
            return self.ctl.post_lazy(SendWr::write_inline(&v, target.slice(0, 8)?));
        }
        if !std::mem::replace(&mut e.mark_deferred, true) {
            self.deferred_marks.push_back(id);
        }
        self.post_deferred_marks();
        self.check()
    }

    /// Posts handle `id`'s deferred ready signal: its sender's ready word gets the count of
    /// puts marked done, in the current association's epoch (a signal for an association
    /// made after the marking says zero, what that sender starts from; RC keeps it ahead
    /// of any later one).
    fn post_mark(&mut self, id: u32) -> Result<()> {
        let Some(e) = self.recv.get_mut(id as usize).and_then(Option::as_mut) else { return Ok(()) };
        e.mark_deferred = false;
        let (Some(target), Some(epoch)) = (e.sender_ready, e.epoch) else { return Ok(()) };
        let v = word(epoch, e.consumed).to_le_bytes();
        self.ctl.post_lazy(SendWr::write_inline(&v, target.slice(0, 8)?))
    }

    /// Posts the deferred ready signals, in order, while the send queue has room. A handle
    /// destroyed meanwhile has nothing owed (its slot is empty, or a new handle's without
    /// the flag).
    fn post_deferred_marks(&mut self) {
        while self.ctl.room_for(1) {
            let Some(id) = self.deferred_marks.pop_front() else { return };
            let owed = self.recv.get(id as usize).and_then(Option::as_ref).is_some_and(|e| e.mark_deferred);
            if owed && let Err(e) = self.post_mark(id) {
                self.ctl.fail(format!("posting a ready signal failed: {e}"));
                return;
            }
        }
    }

    /// `ready_poll_q` under the lock.
    fn queue(&mut self, id: u32) -> Result<()> {
        let e = self.recv[id as usize].as_mut().ok_or(ChannelError::Invalid("destroyed handle"))?;
        if e.consumed < e.seen {
            return Err(ChannelError::Invalid(
                "ready_poll_q on a handle whose latest put is not marked done: call ready_mark first (or ready)",
            ));
        }
        if !e.queued {
            e.queued = true;
            self.queued.push_back(id);
        }
        Ok(())
    }
}

impl RecvHandle {
    /// What the sender needs (ship it with [`HandleDesc::encode`]).
    pub fn desc(&self) -> Result<HandleDesc> {
        let buf = self.ep.inner.driver.with(|st| st.recv[self.id as usize].as_ref().map(|e| e.buf.remote()));
        let buf = buf.ok_or(ChannelError::Invalid("destroyed handle"))?;
        let words = self.ep.inner.seq_words.remote();
        let seq = RemoteRegion { addr: words.addr + u64::from(self.id) * 8, len: 8, rkey: words.rkey };
        let sentinel = self.ep.inner.driver.with(|st| {
            st.recv[self.id as usize]
                .as_ref()
                .and_then(|e| (e.detection == Detection::Sentinel).then_some(e.initial_value))
        });
        Ok(HandleDesc { id: self.id, buf, seq, sentinel })
    }

    /// `CkDirect_readyMark`: done with the data of the latest put. The sender may put
    /// again (its `put` stops being [`Busy`](ChannelError::Busy)), but the handle is **not**
    /// queued for polling: call [`ready_poll_q`](Self::ready_poll_q) when the next put is
    /// expected (a put landing meanwhile is detected then).
    ///
    /// Writes `initial_value` into the buffer's last 8 bytes first (CkDirect's sentinel),
    /// then signals the sender. With the send queue more than half full (many handles
    /// marked in a row, say), the signal waits in the endpoint and goes out, in marking
    /// order, as completions make room: this endpoint's next CQ poll (`ready_poll`,
    /// `next_put`, any call that polls) posts it.
    ///
    /// Nothing to mark (a fresh handle, a second call, a put that landed but was not seen
    /// yet) makes it a no-op that touches neither the buffer nor the sender: the next put
    /// may already be there.
    pub fn ready_mark(&self) -> Result<()> {
        // No CQ poll: marking needs no completion applied first (a put can only have been
        // seen once its association was; a late one is told apart by its epoch), and
        // whoever saw the put (`ready_poll`, `next_put`) polls the CQ.
        self.ep.inner.driver.with(|st| st.check().and_then(|()| st.mark(self.id)))
    }

    /// `CkDirect_readyPollQ`: the data was already marked done; start checking for the next
    /// put (queue the handle for [`PutEndpoint::ready_poll`]). Idempotent.
    ///
    /// [`ChannelError::Invalid`] if the latest put seen has not been marked done: its
    /// sender would stay `Busy`, so the poll would wait forever.
    pub fn ready_poll_q(&self) -> Result<()> {
        self.ep.inner.driver.with(|st| st.queue(self.id))
    }

    /// `CkDirect_ready`: done with the data and start checking for the next put:
    /// [`ready_mark`](Self::ready_mark) then [`ready_poll_q`](Self::ready_poll_q), in one
    /// step.
    pub fn ready(&self) -> Result<()> {
        // No CQ poll, as in `ready_mark`.
        self.ep.inner.driver.with(|st| {
            st.check()?;
            st.mark(self.id)?;
            st.queue(self.id)
        })
    }

    /// Whether the latest put seen has been marked done (or none was seen yet).
    pub fn is_marked(&self) -> bool {
        self.ep
            .inner
            .driver
            .with(|st| st.recv[self.id as usize].as_ref().is_some_and(|e| e.consumed == e.seen))
    }

    /// Whether a sender is associated with this handle, as far as this end has heard: its
    /// association arrived and no deassociation since.
    pub fn is_associated(&self) -> bool {
        self.ep.inner.driver.with(|st| st.recv[self.id as usize].as_ref().is_some_and(|e| e.epoch.is_some()))
    }

    /// Whether the handle is queued for [`PutEndpoint::ready_poll`].
    pub fn is_queued(&self) -> bool {
        self.ep.inner.driver.with(|st| st.recv[self.id as usize].as_ref().is_some_and(|e| e.queued))
    }

    /// Async variant: waits for the next put to land (a future per iteration), then returns
    /// without running the callback (and takes the handle out of the poll queue if it was
    /// queued). Mark it done with [`ready_mark`](Self::ready_mark) as with `ready_poll`.
    pub async fn next_put(&self) -> Result<()> {
        let inner = &self.ep.inner;
        let id = self.id;
        inner
            .driver
            .wait_mode(
                PollMode::Busy,
                |st, wc| inner.on_wc(st, wc),
                |st| {
                    if let Err(e) = st.check() {
                        return Some(Err(e));
                    }
                    let e = st.recv.get_mut(id as usize)?.as_mut()?;
                    let seq = match e.landed(&inner.seq_words, id) {
                        Ok(seq) => seq,
                        Err(e) => return Some(Err(e)),
                    };
                    (seq > e.seen).then(|| {
                        e.seen = seq;
                        // Seen here: no longer awaiting a put in the poll queue.
                        if std::mem::take(&mut e.queued) {
                            st.queued.retain(|&i| i != id);
                        }
                        Ok(())
                    })
                },
            )
            .await
    }

    /// [`next_put`](Self::next_put) with a deadline.
    pub async fn next_put_timeout(&self, timeout: Duration) -> Result<()> {
        tokio::time::timeout(timeout, self.next_put()).await.unwrap_or(Err(ChannelError::Timeout(timeout)))
    }

    /// Puts seen on this handle so far.
    pub fn puts_seen(&self) -> u64 {
        self.ep.inner.driver.with(|st| st.recv[self.id as usize].as_ref().map_or(0, |e| e.seen))
    }

    /// Destroys the handle; its slot may be reused by a later `create_handle`, whose
    /// detection ignores this handle's association (epochs). One-sided writes cannot be
    /// refused: a sender still associated may land at most one more put (the receiver no
    /// longer signals `ready`, so later ones are `Busy`) in this handle's buffer, or fail on
    /// the connection if the application has deregistered that region. Deassociate first
    /// (an application-level agreement, as in CkDirect) to avoid both.
    pub fn destroy(self) {}
}

impl Drop for RecvHandle {
    fn drop(&mut self) {
        let entry = self.ep.inner.driver.with(|st| {
            st.queued.retain(|&i| i != self.id);
            st.recv.get_mut(self.id as usize).and_then(Option::take)
        });
        // Dropped after the lock: the callback is the application's and may own other
        // handles of this endpoint (their drop takes the lock), and the buffer's last
        // handle deregisters it.
        drop(entry);
    }
}

impl SendHandle {
    /// `CkDirect_put`: puts the associated buffer into the receiver's: one RDMA write, then
    /// the sequence word. Returns once posted; [`ChannelError::Busy`] if the receiver has not
    /// marked the previous put done ([`RecvHandle::ready_mark`] or [`RecvHandle::ready`]),
    /// or if the send queue has no room for it even after a CQ poll (control messages, such
    /// as the associations of many handles made at once, or this endpoint's ready signals,
    /// keep it full for now). Either way the caller retries; nothing was posted.
    ///
    /// The send buffer stays registered (this handle and the QP's in-flight table hold it)
    /// until the write completes, but its bytes are read by the NIC some time after `put`
    /// returns: rewrite it only once [`is_ready`](Self::is_ready) (the receiver has seen and
    /// consumed the put, so the write has been placed), or the put may carry the new bytes.
    ///
    /// A put does not poll the CQ first while the send queue has room: a write that failed
    /// (refused by the receiver's NIC, a connection gone) is reported by a later call on the
    /// endpoint, at most a few calls later, as [`ChannelError::Broken`].
    pub fn put(&self) -> Result<()> {
        let inner = &self.ep.inner;
        // Nobody waits for a put's completions (they are signalled now and then, to retire
        // requests from the send queue): with room in the queue, a put is decided without a
        // CQ poll first, as an inline rwrite is, and the driver polls once every few such
        // steps.
        if let Some(r) = inner
            .driver
            .try_unpolled(|st| self.has_room(st, ControlSlots::room_for).then(|| self.post_put(st)))
        {
            return r;
        }
        // Polled: completions retire requests (and post what waited behind them). A queue
        // still too full for the put's requests means control messages or ready signals
        // fill it for now: `Busy`, as for an unconsumed put, and the caller retries.
        let on_wc = &mut |st: &mut State, wc: &WorkCompletion| inner.on_wc(st, wc);
        inner.driver.progress_then(on_wc, |st| {
            if self.has_room(st, ControlSlots::fits) {
                return self.post_put(st);
            }
            Inner::watch_locked(st)?;
            Err(ChannelError::Busy)
        })?
    }

    /// Whether the send queue has room for this put's requests by `rule`
    /// ([`ControlSlots::room_for`] without a poll first, [`ControlSlots::fits`] after one).
    /// A deassociated handle says yes: the put reports it.
    fn has_room(&self, st: &State, rule: fn(&ControlSlots, usize) -> bool) -> bool {
        st.send[self.id as usize].as_ref().is_none_or(|e| rule(&st.ctl, requests(e)))
    }

    /// Posts the put, or says why not: [`ChannelError::Busy`] (the connection watched, the
    /// caller retries) while the receiver has not consumed the previous one.
    fn post_put(&self, st: &mut State) -> Result<()> {
        st.check()?;
        let e = st.send[self.id as usize].as_mut().ok_or(ChannelError::Invalid("deassociated handle"))?;
        let posted = match e.desc.sentinel {
            Some(sentinel) => post_sentinel_put(e, &mut st.ctl, sentinel),
            None => post_sequenced_put(e, &mut st.ctl, &self.ep.inner.ready_words, self.id),
        };
        match posted {
            Ok(()) => {
                e.puts += 1;
                Ok(())
            }
            Err(ChannelError::Busy) => {
                Inner::watch_locked(st)?; // blocked: the caller retries
                Err(ChannelError::Busy)
            }
            Err(err) => Err(err),
        }
    }

    /// Puts done so far.
    pub fn puts(&self) -> u64 {
        self.ep.inner.driver.with(|st| st.send[self.id as usize].as_ref().map_or(0, |e| e.puts))
    }

    /// Whether the receiver has consumed every put so far (a `put` would not be `Busy`,
    /// unless the send queue is full).
    ///
    /// A [`Detection::Sentinel`] handle tracks nothing (its `put` is never `Busy`; the
    /// application's iteration boundaries order its puts): always true while associated.
    pub fn is_ready(&self) -> Result<bool> {
        let inner = &self.ep.inner;
        // The ready word is in memory: the answer needs no CQ poll first (as a put's post),
        // and the driver polls once every few such steps. A no keeps the connection watched.
        let step = |st: &mut State| -> Result<bool> {
            st.check()?;
            let w = inner.ready_words.load_u64_acquire(u64::from(self.id) * 8)?;
            let ready = st.send[self.id as usize]
                .as_ref()
                .is_some_and(|e| e.desc.sentinel.is_some() || count_for(w, Some(e.epoch)) >= e.puts);
            if !ready {
                Inner::watch_locked(st)?; // the caller waits for it
            }
            Ok(ready)
        };
        let ready = match inner.driver.try_unpolled(|st| Some(step(st))) {
            Some(r) => r?,
            None => {
                let on_wc = &mut |st: &mut State, wc: &WorkCompletion| inner.on_wc(st, wc);
                inner.driver.progress_then(on_wc, step)??
            }
        };
        Ok(ready)
    }

    /// Ends the association and tells the receiver. Fails only with the connection: the
    /// message waits for room in the send queue however full it is (one per handle). A
    /// sentinel association (CkDirect's scheme) told the receiver nothing, and ends
    /// without a message.
    pub fn deassociate(self) -> Result<()> {
        let inner = &self.ep.inner;
        // A sentinel association told the receiver nothing (CkDirect's scheme): nothing to
        // undo there. Sent anyway, its deassociation would be queued beyond the backlog's
        // bound, with no association message bounding it.
        let assoc = inner.driver.with(|st| {
            st.send[self.id as usize]
                .as_ref()
                .filter(|e| e.desc.sentinel.is_none())
                .map(|e| (e.desc.id, e.epoch))
        });
        if let Some((handle, epoch)) = assoc {
            inner.driver.with(|st| st.ctl.send_owed(&Message::Deassoc { handle, epoch }))?;
        }
        Ok(())
    }
}

/// CkDirect's put: one write, the payload's last word flags it.
fn post_sentinel_put(e: &SendEntry, ctl: &mut ControlSlots, sentinel: u64) -> Result<()> {
    if e.src.region().read_u64(e.last_word)? == sentinel {
        return Err(ChannelError::Invalid(
            "the payload ends with the handle's initial value, so the receiver would never see it",
        ));
    }
    ctl.post_lazy(SendWr::write(e.src.clone(), e.desc.buf.slice(0, e.src.len())?))
}

/// Send-queue requests a put of `e` posts: CkDirect's one write, or the data and its
/// sequence word.
fn requests(e: &SendEntry) -> usize {
    if e.desc.sentinel.is_some() { 1 } else { 2 }
}

/// The default put: [`ChannelError::Busy`] until the receiver has consumed the previous
/// one (its ready word), then the data and the sequence word that announces it.
fn post_sequenced_put(
    e: &SendEntry,
    ctl: &mut ControlSlots,
    ready_words: &MemoryRegion,
    id: u32,
) -> Result<()> {
    let ready = count_for(ready_words.load_u64_acquire(u64::from(id) * 8)?, Some(e.epoch));
    if ready < e.puts {
        return Err(ChannelError::Busy);
    }
    let seq = word(e.epoch, e.puts + 1).to_le_bytes();
    let data = SendWr::write(e.src.clone(), e.desc.buf.slice(0, e.src.len())?);
    let seq_dst = e.desc.seq.slice(0, 8)?;
    // One doorbell for both, data first. Nobody waits for their completions (the
    // receiver's ready word says the data was placed).
    ctl.post_two_lazy(data, SendWr::write_inline(&seq, seq_dst))
}

impl Drop for SendHandle {
    fn drop(&mut self) {
        let entry = self.ep.inner.driver.with(|st| st.send.get_mut(self.id as usize).and_then(Option::take));
        // After the lock: the source buffer's last handle deregisters it.
        drop(entry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sender and a receiver endpoint on one soft device, and a sentinel handle (value 7)
    /// of the receiver over 16 bytes.
    fn sentinel_handle() -> (rdmakit_verbs::ProtectionDomain, PutEndpoint, PutEndpoint, RecvHandle) {
        use rdmakit_verbs::{ConnectOptions, Context, QpCaps};
        let pd = Context::open_soft().alloc_pd().unwrap();
        let ctx = pd.context();
        let (ca, cb) = (ctx.create_cq(1024).unwrap(), ctx.create_cq(1024).unwrap());
        let caps = QpCaps::default().with_max_inline_data(64);
        let (a, b) = (pd.create_qp(&ca, &ca, caps).unwrap(), pd.create_qp(&cb, &cb, caps).unwrap());
        a.connect(&b.address().unwrap(), &ConnectOptions::default()).unwrap();
        b.connect(&a.address().unwrap(), &ConnectOptions::default()).unwrap();
        let sender = PutEndpoint::new(a, ca, PollMode::Busy).unwrap();
        let receiver = PutEndpoint::new(b, cb, PollMode::Busy).unwrap();
        let buf = pd.alloc_mr(16, AccessFlags::ALL_REMOTE).unwrap();
        let h = receiver.create_handle_with(&buf, |_| {}, 7, Detection::Sentinel).unwrap();
        (pd, sender, receiver, h)
    }

    #[test]
    fn a_descriptor_built_by_hand_gets_the_checks_of_a_decoded_one() {
        let (pd, sender, _receiver, h) = sentinel_handle();
        let good = h.desc().unwrap();
        let sbuf = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
        // A sentinel handle over 4 bytes: its last word would lie partly outside the slice.
        let short = HandleDesc { buf: RemoteRegion { len: 4, ..good.buf }, ..good };
        let r = sender.assoc_local_buffer(&short, sbuf.slice(0, 4).unwrap());
        assert!(matches!(r, Err(ChannelError::Protocol(_))), "{:?}", r.err());
        // An id with the flag's bit, which the peer would read as another handle.
        let odd = HandleDesc { id: good.id | SENTINEL_BIT, sentinel: None, ..good };
        let r = sender.assoc_local_buffer(&odd, sbuf.local().unwrap());
        assert!(matches!(r, Err(ChannelError::Invalid(_))), "{:?}", r.err());
        sender.assoc_local_buffer(&good, sbuf.local().unwrap()).expect("the handle's own descriptor");
    }

    #[test]
    fn sentinel_associations_ended_in_a_loop_do_not_grow_the_control_backlog() {
        let (pd, sender, _receiver, h) = sentinel_handle();
        let sbuf = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
        // The receiver never runs, so nothing the sender queues leaves its backlog.
        let before = sender.inner.driver.with(|st| st.ctl.backlog_len());
        for _ in 0..5000 {
            let sh = sender.assoc_local_buffer(&h.desc().unwrap(), sbuf.local().unwrap()).unwrap();
            sh.deassociate().unwrap();
        }
        let after = sender.inner.driver.with(|st| st.ctl.backlog_len());
        assert_eq!(after, before, "sentinel associations queue nothing");
    }

    #[test]
    fn words_of_another_epoch_count_as_zero() {
        assert_eq!(count_for(word(3, 17), Some(3)), 17);
        assert_eq!(count_for(word(3, 17), Some(4)), 0);
        assert_eq!(count_for(word(3, 17), None), 0);
        // A reset word (0) is epoch 0, which no association uses.
        assert_eq!(count_for(0, Some(1)), 0);
        assert_eq!(
            count_for(word(EPOCH_MASK, (1 << COUNT_BITS) - 1), Some(EPOCH_MASK)),
            (1 << COUNT_BITS) - 1
        );
    }

    #[test]
    fn descriptors_round_trip_and_bad_ones_are_refused() {
        let d = HandleDesc {
            id: 9,
            buf: RemoteRegion { addr: 0x1000, len: 4096, rkey: 77 },
            seq: RemoteRegion { addr: 0x2000, len: 8, rkey: 78 },
            sentinel: None,
        };
        assert_eq!(HandleDesc::decode(&d.encode()).unwrap(), d);
        assert!(matches!(HandleDesc::decode(&d.encode()[..51]), Err(ChannelError::Protocol(_))));
        // A sentinel handle's descriptor carries its value (0 included).
        for v in [0, u64::MAX, 0x7ff8_dead_beef_0001] {
            let s = HandleDesc { sentinel: Some(v), ..d };
            assert_eq!(HandleDesc::decode(&s.encode()).unwrap(), s);
            assert_eq!(s.detection(), Detection::Sentinel);
        }
        // A value without the flag, or a sentinel over a buffer that is not whole words.
        let mut b = d.encode();
        b[44] = 1;
        assert!(matches!(HandleDesc::decode(&b), Err(ChannelError::Protocol(_))));
        for buf in [RemoteRegion { len: 4095, ..d.buf }, RemoteRegion { addr: 0x1001, ..d.buf }] {
            let s = HandleDesc { sentinel: Some(1), buf, ..d };
            assert!(matches!(HandleDesc::decode(&s.encode()), Err(ChannelError::Protocol(_))));
        }
        let mut bad = d;
        bad.seq.len = 16;
        assert!(matches!(HandleDesc::decode(&bad.encode()), Err(ChannelError::Protocol(_))));
        let mut bad = d;
        bad.buf.addr = u64::MAX - 10;
        assert!(matches!(HandleDesc::decode(&bad.encode()), Err(ChannelError::Protocol(_))));
    }
}
