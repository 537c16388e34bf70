//! rpipe-style pipes: `rwrite` into the peer's remote heap, `recv` with an exclusive guard,
//! and `publish`/`rread` for the pull direction.
//!
//! A pipe end owns one connected RC queue pair and its completion queue. Each end may
//! advertise a **receive ring** (a registered segment of its memory): the other end runs a
//! [`HeapAllocator`] over it (the rmalloc paper's pipe on top of its heaps; the writer's
//! [`PipeConfig::policy`] picks next-fit, the default and the paper's fastest, first-fit,
//! best-fit or worst-fit), so an `rwrite` RDMA-writes straight into the receiver's memory
//! (zero copy), and the receiver's [`HeapOwner`] hands blocks back in coalesced free
//! batches when the application drops its [`RecvGuard`] (the rfree). The allocator never
//! hands out a range the owner still holds, so **a writer can never overwrite data the
//! reader has not released**: that is the flow control. Every policy runs with deferred
//! synchronisation (the paper's for next-fit): each message's notification is its block's
//! notice, and frees return as credits, so best-fit and worst-fit need no extra round trip. An end with `ring_len = 0` only
//! sends (a half-duplex pipe); two rings make it full duplex.
//!
//! **Growth.** A ring may grow, as the heap endpoint's heaps do: a writer that finds no room
//! (or a message larger than every segment) asks the reader with
//! [`HeapGrow`](Message::HeapGrow); the reader first returns what its application has
//! freed (answering [`HeapFreed`](Message::HeapFreed): try again), else registers a new
//! segment of at least the requested size (and at least `ring_len`) and answers
//! [`HeapGrant`](Message::HeapGrant), as long as its ring stays within
//! [`PipeConfig::max_ring_len`]; beyond, it answers [`HeapRefuse`](Message::HeapRefuse) and
//! the writer waits for frees from then on (a message larger than every segment is then
//! [`ChannelError::TooLarge`]). Notifications name a block by its offset in the ring's
//! segments laid end to end in the order they were granted.
//!
//! The receiver chooses how it is told a block landed ([`NotifyMode`]):
//! - [`NotifyMode::WriteImm`]: the data goes as one RDMA write with immediate; the
//!   receive completion is generated only after the data is placed (IB spec), so this is
//!   the spec-safe mode, and the receiver can sleep on completion events.
//! - [`NotifyMode::Flag`]: rpipe's notification flag. The data write is followed, on the same
//!   QP, by a small write of `{offset, len, seq}` into a slot of the receiver's mailbox,
//!   which the receiver polls. It relies on the NIC placing the two writes, and the bytes
//!   of the header, in order: RC guarantees the *order of execution*, and every NIC places
//!   in order in practice (perftest and CkDirect rely on it), but the IB spec does not
//!   promise placement order of bytes that are polled before a completion. The receiver
//!   polls memory, so `recv` spins (yielding) in this mode whatever the [`PollMode`].
//!
//! Control messages (hello, credits, publish, read-done, ring growth; [`Message`]) go
//! through the connection's [control channel](crate::control) as inline sends of at most
//! 64 bytes, so the QP needs `max_inline_data >= 64`; the QP should retry RNR without limit
//! (the default). A blocked operation sends keep-alives there, so a dead peer ends it with
//! [`ChannelError::Broken`] (see [`control`](crate::control) for the bound).
//!
//! Cancel safety: an `rwrite` future owns its source slice; once the writes are posted,
//! dropping the future leaves the block handed over to the reader and the slice held by
//! the verbs layer's in-flight table until the NIC is done with it. A dropped `recv`
//! takes nothing. A guard dropped or leaked never frees memory the NIC writes: leaking it
//! only keeps its block out of the ring.
//!
//! # Example: the pull direction, `publish` and `rread`
//!
//! ```
//! use rdmakit_channel::{Pipe, PipeConfig};
//! use rdmakit_verbs::{AccessFlags, Context};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let pd = Context::open_soft().alloc_pd()?;
//! let (owner, reader) = Pipe::pair(&pd, PipeConfig::default(), PipeConfig::default()).await?;
//! let data = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)?;
//! data.write_at(0, b"read from the owner's memory")?;
//! // `publish` resolves once the reader has read it (the owner's memory is then free again).
//! let published = tokio::spawn(async move { owner.publish(data.slice(0, 28).expect("slice")).await.0 });
//! let dst = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
//! let (n, dst_slice) = reader.rread(dst.local()?).await;
//! assert_eq!(n?, 28);
//! drop(dst_slice);
//! published.await??;
//! let mut got = vec![0u8; 28];
//! dst.read_at(0, &mut got)?;
//! assert_eq!(&got[..], b"read from the owner's memory");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use rdmakit_memory::heap::{
    AllocNotice, AllocPolicy, HeapAllocator, HeapConfig, HeapError, HeapId, HeapOwner, RemoteBlock, SyncMode,
};
use rdmakit_verbs::cm::Connection;
use rdmakit_verbs::{
    AccessFlags, CompletionQueue, LocalSlice, MemoryRegion, QueuePair, RemoteRegion, RemoteSlice, SendWr,
    WorkCompletion,
};

use crate::control::{ControlConfig, ControlSlots, Event, MAILBOX_SLOT, Message};
use crate::driver::{Controlled, Driver, PollMode};
use crate::error::{BufResult, ChannelError, Result, check_range};

const HEAP: HeapId = HeapId(0);
/// Receive buffers each end keeps posted for control messages and immediates.
pub(crate) const RECV_SLOTS: u32 = 128;
/// Size of one control message buffer; control messages go inline, so at most this.
pub(crate) const MSG_LEN: u32 = 64;
/// Most publications from the peer waiting for an `rread`, and read-done answers waiting
/// for their `publish`: beyond, the peer is flooding.
const MAX_QUEUED: usize = 1024;

/// Control messages a pipe end may queue behind a full send queue: its own publications
/// (up to [`MAX_QUEUED`]), its answers to the peer's (as many), and room for credits and
/// ring growth. Messages owed beyond it (credits, answers, a growth answer) wait in the
/// state, coalesced, and go out as completions drain the backlog: none is dropped.
const CONTROL_BACKLOG: usize = 2 * MAX_QUEUED + 4 * RECV_SLOTS as usize;
/// Most bytes of a ring, all segments: an immediate names a block by its offset / 8 in 32 bits.
const MAX_RING: u64 = 8 << 32;
/// The longest message an rwrite copies into its request (inline) instead of having the
/// NIC read it: such an rwrite resolves once posted, with no wait for its completion.
const INLINE_MAX: u32 = 256;
/// How long a writer waits for credits before it says so (once per wait) in the log.
const CREDIT_WAIT_WARNING: Duration = Duration::from_secs(1);

/// How a receiver learns that a block landed (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NotifyMode {
    /// A flag written after the data (rpipe's NFP); relies on in-order placement.
    Flag,
    /// RDMA write with immediate (spec-safe).
    #[default]
    WriteImm,
}

/// The settings of one pipe end.
///
/// Start from [`Default`] and change what you need with the `with_*` setters (the struct is
/// `#[non_exhaustive]`, so fields can be added without breaking you).
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct PipeConfig {
    /// Bytes of the receive ring this end offers its peer (0: this end only sends), and
    /// the smallest segment it adds when the ring grows: a multiple of 8.
    pub ring_len: u64,
    /// Most bytes the receive ring may grow to when the writer asks (see the module docs);
    /// at most `ring_len` (0, the default, included): the ring never grows.
    pub max_ring_len: u64,
    /// The policy of this end's allocator over the peer's ring (the writer's side).
    pub policy: AllocPolicy,
    /// How this end wants to be notified of incoming data.
    pub notify: NotifyMode,
    /// How this end waits for completions.
    pub poll: PollMode,
    /// Most messages the peer may have sent this end and this end not yet received (1 to
    /// 64; default 64). Released blocks go back to the writer once a quarter of the slots
    /// (or of the ring) wait, so fewer slots mean more credit messages, each a completion
    /// for the writer to take and a receive to repost: at 32 slots instead of 64, an 8-byte
    /// rwrite cost about 15 ns more on the soft NIC. Each slot is a 24-byte mailbox entry
    /// of this end's registered memory (which flag mode writes into).
    pub slots: u32,
    /// Longest message this end's `rwrite` posts inline, resolving once posted (at most
    /// 256 and the QP's `max_inline_data`; 0: every `rwrite` waits for its write's
    /// completion). See [`Pipe::rwrite`].
    pub inline_max: u32,
    /// How long connecting waits for the peer's hello.
    pub connect_timeout: Duration,
}

impl Default for PipeConfig {
    fn default() -> Self {
        PipeConfig {
            ring_len: 1 << 20,
            max_ring_len: 0,
            policy: AllocPolicy::NextFit,
            notify: NotifyMode::WriteImm,
            poll: PollMode::Event,
            slots: 64,
            inline_max: INLINE_MAX,
            connect_timeout: Duration::from_secs(10),
        }
    }
}

impl PipeConfig {
    /// Sets [`ring_len`](Self::ring_len).
    pub const fn with_ring_len(mut self, ring_len: u64) -> Self {
        self.ring_len = ring_len;
        self
    }

    /// Sets [`max_ring_len`](Self::max_ring_len).
    pub const fn with_max_ring_len(mut self, max_ring_len: u64) -> Self {
        self.max_ring_len = max_ring_len;
        self
    }

    /// Sets [`policy`](Self::policy).
    pub const fn with_policy(mut self, policy: AllocPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets [`notify`](Self::notify).
    pub const fn with_notify(mut self, notify: NotifyMode) -> Self {
        self.notify = notify;
        self
    }

    /// Sets [`poll`](Self::poll).
    pub const fn with_poll(mut self, poll: PollMode) -> Self {
        self.poll = poll;
        self
    }

    /// Sets [`slots`](Self::slots).
    pub const fn with_slots(mut self, slots: u32) -> Self {
        self.slots = slots;
        self
    }

    /// Sets [`inline_max`](Self::inline_max).
    pub const fn with_inline_max(mut self, inline_max: u32) -> Self {
        self.inline_max = inline_max;
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout).
    pub const fn with_connect_timeout(mut self, connect_timeout: Duration) -> Self {
        self.connect_timeout = connect_timeout;
        self
    }
}

#[derive(Clone, Copy, Debug)]
struct Hello {
    ring: RemoteRegion,
    mailbox: RemoteRegion,
    notify: NotifyMode,
    slots: u32,
    /// Most bytes the peer's ring may grow to.
    max_ring: u64,
}

#[derive(Clone, Copy, Debug)]
struct Published {
    id: u64,
    remote: RemoteSlice,
}

struct Publishing {
    /// Keeps the published region alive (and registered) while the peer may read it.
    #[allow(dead_code)]
    src: LocalSlice,
    /// The `publish` future was dropped: nobody waits for the answer.
    abandoned: bool,
}

struct State {
    ctl: ControlSlots,
    peer: Option<Hello>,
    // ---- writer role (into the peer's ring)
    alloc: Option<HeapAllocator>,
    /// Where each of the peer's ring segments starts in the ring's offsets (segments end
    /// to end in grant order).
    seg_starts: Vec<u64>,
    /// Bytes of the peer's ring, all segments.
    peer_ring_bytes: u64,
    /// The peer's largest ring segment: no larger message fits.
    largest_seg: u64,
    /// A growth request is on its way, for this many bytes (cleared by the answer; a smaller
    /// grant is a protocol error).
    grow_sent: Option<u64>,
    /// The peer refused to grow its ring: wait for frees from now on.
    growth_refused: bool,
    notes_sent: u64,
    peer_consumed: u64,
    /// A request for credits is on its way (cleared when credits arrive).
    need_sent: bool,
    /// When this end started waiting for credits, until it has said once that it is still
    /// waiting (`None` again once it has, or when credits arrive).
    need_since: Option<std::time::Instant>,
    // ---- reader role (our ring)
    owner: Option<HeapOwner>,
    /// Our ring's segments with where each starts in the ring's offsets, in grant order.
    segs: Vec<(u64, MemoryRegion)>,
    /// Bytes of our ring, all segments.
    ring_bytes: u64,
    imm_ready: VecDeque<(u64, u64)>,
    consumed: u64,
    /// `consumed` as the last credit sent told the writer.
    credited: u64,
    /// The writer asked for credit when there was none to give: the next release or
    /// consumed message is returned at once (an empty answer would only make it ask
    /// again, and the two ends would trade messages as fast as they can while "waiting").
    writer_waiting: bool,
    // ---- publish / rread
    next_pub: u64,
    published_in: VecDeque<Published>,
    /// Reads posted for publications (ticket, id): the read-done goes out when the read
    /// completes, whoever reaps it.
    reads: VecDeque<(u64, u64)>,
    /// This end's publications the peer has not answered: their slices stay alive.
    publishing: std::collections::HashMap<u64, Publishing>,
    read_done: Vec<(u64, bool)>,
    /// Signalled requests posted before the latest inline rwrite ([`ControlSlots::posted`]):
    /// it has completed once [`ControlSlots::done`] passes this.
    inline_mark: Option<u64>,
    // ---- messages owed to the peer, kept while the control channel is full
    /// Credits (released blocks, notification slots) to return.
    credits_owed: bool,
    /// Answers to the peer's publications (id, read or refused), bounded by the
    /// publications taken in.
    answers_owed: VecDeque<(u64, bool)>,
    /// The answer to the peer's growth request of this many bytes.
    grow_owed: Option<u64>,
}

impl State {
    fn check(&self) -> Result<()> {
        self.ctl.check()
    }
}

impl Controlled for State {
    fn control(&mut self) -> &mut ControlSlots {
        &mut self.ctl
    }
}

struct Inner {
    qp: QueuePair,
    driver: Driver<State>,
    config: PipeConfig,
    ring: Option<MemoryRegion>,
    mailbox: MemoryRegion,
    /// Messages up to this long go inline: the least of [`INLINE_MAX`], the QP's limit and
    /// [`PipeConfig::inline_max`].
    inline_max: u64,
    _conn: Option<Connection>,
}

/// One end of a pipe. Cheap to clone; operations from several tasks may run at once.
#[derive(Clone)]
pub struct Pipe {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Pipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipe")
            .field("qp", &self.inner.qp.qp_num())
            .field("config", &self.inner.config)
            .finish()
    }
}

impl Pipe {
    /// Makes a pipe end of `qp` (connected RC, `max_inline_data >= 64`, `max_recv_wr >=
    /// 128`, `max_send_wr >= 4`), whose send and receive completions go to `cq` and nothing
    /// else's, and exchanges rings with the peer end (which must call this too).
    ///
    /// `cq` must hold every completion the pipe can have outstanding, `max_send_wr + 128`
    /// (its receive slots), or it could overrun: a smaller one is refused with
    /// [`ChannelError::QueueTooSmall`], as is a shallower send queue.
    pub async fn connect(qp: QueuePair, cq: CompletionQueue, config: PipeConfig) -> Result<Pipe> {
        Self::connect_inner(qp, cq, config, None).await
    }

    /// A pipe end over an established connection (`rdmakit_verbs::cm`), kept open by the
    /// pipe. The connection's QP and CQ must be sized as for [`connect`](Self::connect).
    pub async fn from_connection(conn: Connection, config: PipeConfig) -> Result<Pipe> {
        let (qp, cq) = (conn.qp().clone(), conn.cq().clone());
        Self::connect_inner(qp, cq, config, Some(conn)).await
    }

    /// Two connected pipe ends on `pd`'s device, in this process.
    pub async fn pair(
        pd: &rdmakit_verbs::ProtectionDomain,
        a: PipeConfig,
        b: PipeConfig,
    ) -> Result<(Pipe, Pipe)> {
        let ctx = pd.context();
        let caps = rdmakit_verbs::QpCaps::default()
            .with_max_send_wr(256)
            .with_max_recv_wr(RECV_SLOTS + 8)
            .with_max_inline_data(MSG_LEN);
        let (ca, cb) = (ctx.create_cq(1024)?, ctx.create_cq(1024)?);
        let qa = pd.create_qp(&ca, &ca, caps)?;
        let qb = pd.create_qp(&cb, &cb, caps)?;
        let opts = rdmakit_verbs::ConnectOptions::default();
        qa.connect(&qb.address()?, &opts)?;
        qb.connect(&qa.address()?, &opts)?;
        tokio::try_join!(Pipe::connect(qa, ca, a), Pipe::connect(qb, cb, b))
    }

    async fn connect_inner(
        qp: QueuePair,
        cq: CompletionQueue,
        config: PipeConfig,
        conn: Option<Connection>,
    ) -> Result<Pipe> {
        if qp.caps().max_inline_data < MSG_LEN {
            return Err(ChannelError::Invalid("pipe QPs need max_inline_data >= 64"));
        }
        if qp.caps().max_recv_wr < RECV_SLOTS {
            return Err(ChannelError::Invalid("pipe QPs need max_recv_wr >= 128"));
        }
        if config.slots == 0 || config.slots > RECV_SLOTS / 2 {
            return Err(ChannelError::Invalid("PipeConfig::slots must be in 1..=64"));
        }
        if config.max_ring_len.max(config.ring_len) > MAX_RING {
            return Err(ChannelError::Invalid("a pipe's ring is at most 32 GiB"));
        }
        if !config.ring_len.is_multiple_of(8) {
            // The writer places 8-byte-aligned blocks: it refuses a ring of another size.
            return Err(ChannelError::Invalid("PipeConfig::ring_len must be a multiple of 8"));
        }
        let pd = qp.pd().clone();
        let qp_inline = qp.caps().max_inline_data;
        let ctl = ControlSlots::new(qp.clone(), ControlConfig::new(RECV_SLOTS, MSG_LEN, CONTROL_BACKLOG))?;
        ctl.check_cq(&cq)?;
        let ring = match config.ring_len {
            0 => None,
            n => Some(pd.alloc_mr(
                usize::try_from(n).map_err(|_| ChannelError::Invalid("ring too large"))?,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            )?),
        };
        let mailbox = pd.alloc_mr(
            (u64::from(config.slots) * MAILBOX_SLOT) as usize,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )?;
        let owner = match &ring {
            Some(r) => {
                let mut o = HeapOwner::new(HEAP);
                o.add_segment(RemoteRegion::new(r.addr(), r.len() as u64, r.rkey()))?;
                Some(o)
            }
            None => None,
        };
        let segs: Vec<(u64, MemoryRegion)> = ring.iter().map(|r| (0, r.clone())).collect();
        let state = State {
            ctl,
            peer: None,
            alloc: None,
            seg_starts: Vec::new(),
            peer_ring_bytes: 0,
            largest_seg: 0,
            grow_sent: None,
            growth_refused: false,
            ring_bytes: segs.first().map_or(0, |(_, r)| r.len() as u64),
            segs,
            notes_sent: 0,
            peer_consumed: 0,
            need_sent: false,
            need_since: None,
            owner,
            imm_ready: VecDeque::new(),
            consumed: 0,
            credited: 0,
            writer_waiting: false,
            next_pub: 1,
            published_in: VecDeque::new(),
            reads: VecDeque::new(),
            publishing: std::collections::HashMap::new(),
            read_done: Vec::new(),
            inline_mark: None,
            credits_owed: false,
            answers_owed: VecDeque::new(),
            grow_owed: None,
        };
        let inner = Arc::new(Inner {
            qp,
            driver: Driver::new(cq, config.poll, state),
            config,
            inline_max: u64::from(qp_inline.min(INLINE_MAX).min(config.inline_max)),
            ring,
            mailbox,
            _conn: conn,
        });
        // Hello: our ring and mailbox (empty descriptors when we have no ring).
        let empty = RemoteRegion { addr: 0, len: 0, rkey: 0 };
        let hello = Message::PipeHello {
            ring: inner.ring.as_ref().map_or(empty, MemoryRegion::remote),
            mailbox: inner.mailbox.remote(),
            notify: config.notify,
            slots: config.slots,
            max_ring: config.max_ring_len,
        };
        inner.driver.with(|st| st.ctl.send(&hello))?;
        let pipe = Pipe { inner };
        let wait = pipe.inner.wait(|st| {
            if let Err(e) = st.check() {
                return Some(Err(e));
            }
            st.peer.map(|_| Ok(()))
        });
        match tokio::time::timeout(config.connect_timeout, wait).await {
            Ok(r) => r?,
            Err(_) => return Err(ChannelError::Timeout(config.connect_timeout)),
        }
        Ok(pipe)
    }

    /// The configuration of this end.
    pub fn config(&self) -> &PipeConfig {
        &self.inner.config
    }

    /// The QP.
    pub fn qp(&self) -> &QueuePair {
        &self.inner.qp
    }

    /// Messages `rwrite` has handed to the NIC so far (each arrives exactly once, whether
    /// or not its future was awaited to the end).
    pub fn messages_sent(&self) -> u64 {
        self.inner.driver.with(|st| st.notes_sent)
    }

    /// Bytes of the receive ring the peer offers, all segments granted so far (0: it only
    /// sends).
    pub fn peer_ring_len(&self) -> u64 {
        self.inner.driver.with(|st| st.peer_ring_bytes)
    }

    /// Bytes of this end's receive ring, all segments (it grows when the writer asks, up to
    /// [`PipeConfig::max_ring_len`]).
    pub fn ring_len(&self) -> u64 {
        self.inner.driver.with(|st| st.ring_bytes)
    }

    /// Segments of this end's receive ring (1 until it grows; 0 without a ring).
    pub fn ring_segments(&self) -> usize {
        self.inner.driver.with(|st| st.segs.len())
    }

    /// rwrite: RDMA-writes `src` into a block of the peer's ring and notifies the peer.
    /// Waits for ring space (and a notification slot) first: the reader releasing blocks
    /// is the credit. Resolves when `src` may be reused, returning it.
    ///
    /// A message of at most [`PipeConfig::inline_max`] bytes (256 by default; never more
    /// than the QP's `max_inline_data`) is copied into the request when it is posted, as
    /// a verbs user posts small writes inline, so the call resolves once the request is
    /// posted, without waiting for its completion. Like a socket's `write`, an `Ok` then
    /// means "handed to the NIC", not "delivered": a transport failure of that write (the
    /// peer gone) breaks the pipe, and the next operation reports it; [`flush`](Self::flush)
    /// waits for delivery, and a dropped end lingers (up to a second; on a tokio runtime in
    /// one blocking task shared by every end dropped meanwhile) until its inline rwrites
    /// have completed. A longer message
    /// resolves when its write has completed.
    pub async fn rwrite(&self, src: LocalSlice) -> BufResult<(), LocalSlice> {
        let r = self.rwrite_inner(&src).await;
        (r, src)
    }

    async fn rwrite_inner(&self, src: &LocalSlice) -> Result<()> {
        let len = u64::from(src.len());
        if len == 0 {
            return Err(ChannelError::Invalid("rwrite of an empty slice"));
        }
        let inner = &self.inner;
        // One wait: post when there is room, then until the last request completes.
        let mut ticket: Option<u64> = None;
        let mut step = |st: &mut State| {
            if let Err(e) = st.check() {
                return Some(Err(e));
            }
            if let Some(t) = ticket {
                return (st.ctl.done() >= t).then_some(Ok(()));
            }
            let peer = st.peer?;
            if peer.ring.len == 0 {
                return Some(Err(ChannelError::Invalid("the peer offers no receive ring")));
            }
            if len > st.largest_seg {
                // A segment that large would take the ring beyond what the peer allows.
                let room = peer.max_ring.saturating_sub(st.peer_ring_bytes);
                if st.growth_refused || len > room {
                    return Some(Err(ChannelError::TooLarge { what: "message", len, limit: st.largest_seg }));
                }
                return inner.ask_to_grow(st, len); // no segment is large enough
            }
            if st.notes_sent - st.peer_consumed >= u64::from(peer.slots) {
                return inner.ask_for_credit(st); // wait for the reader to take notifications
            }
            // The requests of this rwrite: the data (with immediate), or the data and its
            // mailbox note.
            let requests = if peer.notify == NotifyMode::Flag { 2 } else { 1 };
            let room = if len <= inner.inline_max {
                // Inline rwrites retire lazily (one in every few is signalled): a writer
                // that only posts them waits for completions instead of filling the queue.
                st.ctl.room_for(requests)
            } else {
                // More rwrites in flight than the QP's send queue holds (the application's
                // QP may be shallower than the pipe's slots) wait for completions too.
                st.ctl.fits(requests)
            };
            if !room {
                return None;
            }
            let block = match st.alloc.as_mut().expect("set with the hello").alloc(len) {
                Ok(b) => b,
                // Wait for frees; the growth request returns them first, then grows.
                Err(HeapError::Exhausted { .. }) if !st.growth_refused => {
                    return inner.ask_to_grow(st, len);
                }
                Err(HeapError::Exhausted { .. }) => return inner.ask_for_credit(st),
                Err(e) => return Some(Err(e.into())),
            };
            match inner.post_rwrite(st, &peer, src, block, len) {
                Ok(Some(t)) => {
                    ticket = Some(t);
                    None // poll for the completion
                }
                Ok(None) => Some(Ok(())), // copied into the request: `src` is free now
                Err(e) => Some(Err(e)),
            }
        };
        // An inline rwrite with credit and room finishes when posted: try that first,
        // without an (often empty) poll of the CQ before it.
        if len <= inner.inline_max
            && let Some(r) = inner.driver.try_unpolled(&mut step)
        {
            return r;
        }
        inner.wait(step).await
    }

    /// Waits until every request this end has posted so far has completed: after it, the
    /// peer has every message an earlier [`rwrite`](Self::rwrite) handed to the NIC (or
    /// the pipe is broken, and this says so). An inline rwrite resolves when posted; this
    /// is the wait for its delivery.
    pub async fn flush(&self) -> Result<()> {
        let mut ticket: Option<u64> = None;
        self.inner
            .wait(|st| {
                if let Err(e) = st.check() {
                    return Some(Err(e));
                }
                match ticket {
                    Some(t) => (st.ctl.done() >= t).then_some(Ok(())),
                    None if !st.ctl.can_send() => None, // the fence waits for room
                    None => match st.ctl.fence() {
                        Ok(t) => {
                            ticket = Some(t);
                            None
                        }
                        Err(e) => Some(Err(e)),
                    },
                }
            })
            .await
    }

    /// Sends the writer, now, every block this end's application has released and not yet
    /// returned as credit.
    ///
    /// Released blocks go back in batches (once a quarter of [`PipeConfig::slots`] or of
    /// the ring waits), and a writer that runs out of room asks for the rest, which this
    /// end answers the next time it runs: any call on it (`recv`, `rwrite`, ...). An
    /// application that drives both ends of a pipe from one task, or whose reader stops
    /// calling the pipe while its writer may need room, calls this after releasing:
    /// otherwise the writer may wait for credit the reader holds back.
    pub fn return_credits(&self) -> Result<()> {
        self.inner.driver.with(|st| {
            st.check()?;
            self.inner.flush_credits(st);
            st.check()
        })
    }

    /// Waits for the next message and returns an exclusive guard over its block; dropping
    /// the guard releases the block to the writer (the rfree).
    pub async fn recv(&self) -> Result<RecvGuard> {
        if self.inner.ring.is_none() {
            return Err(ChannelError::Invalid("this pipe end has no receive ring"));
        }
        let inner = &self.inner;
        let take = |st: &mut State| -> Option<Result<(MemoryRegion, u64, u64)>> {
            if let Some(x) = inner.next_landed(st) {
                return Some(x);
            }
            st.check().err().map(Err)
        };
        let (seg, addr, len) = match inner.config.notify {
            NotifyMode::WriteImm => inner.wait(take).await?,
            // The mailbox is memory: poll it, whatever the CQ mode. A message already there
            // needs no CQ poll first (the driver still polls once every few such steps).
            NotifyMode::Flag => match inner.driver.try_unpolled(|st| inner.next_landed(st)) {
                Some(r) => r?,
                None => inner.driver.wait_mode(PollMode::Busy, |st, wc| inner.on_wc(st, wc), take).await?,
            },
        };
        Ok(RecvGuard { pipe: self.inner.clone(), seg, addr, len, released: false })
    }

    /// [`recv`](Self::recv) with a deadline.
    pub async fn recv_timeout(&self, timeout: Duration) -> Result<RecvGuard> {
        tokio::time::timeout(timeout, self.recv()).await.unwrap_or(Err(ChannelError::Timeout(timeout)))
    }

    /// The owner side of `rread`: publishes `src` (a slice of a region with remote read
    /// access) to the peer and waits until the peer has read it. Returns `src`.
    ///
    /// Cancel safety: once published, the pipe keeps `src`'s region alive until the peer
    /// answers, even if this future is dropped, so the peer never reads freed memory.
    pub async fn publish(&self, src: LocalSlice) -> BufResult<(), LocalSlice> {
        let r = self.publish_inner(&src).await;
        (r, src)
    }

    async fn publish_inner(&self, src: &LocalSlice) -> Result<()> {
        if !src.region().access().contains(AccessFlags::REMOTE_READ) {
            return Err(ChannelError::Invalid("published slices need REMOTE_READ access"));
        }
        let remote = src.region().remote().slice(src.offset(), src.len())?;
        let inner = &self.inner;
        // Published in one step with its message; with the control channel full (a peer that
        // takes no messages in for a while), the step waits for room.
        let id = inner
            .wait(|st| {
                if let Err(e) = st.check() {
                    return Some(Err(e));
                }
                if st.publishing.len() >= MAX_QUEUED {
                    return Some(Err(ChannelError::TooLarge {
                        what: "publications awaiting the peer",
                        len: st.publishing.len() as u64 + 1,
                        limit: MAX_QUEUED as u64,
                    }));
                }
                if !st.ctl.can_send() {
                    return None;
                }
                let id = st.next_pub;
                if let Err(e) = st.ctl.send(&Message::Published { id, remote }) {
                    return Some(Err(e));
                }
                st.next_pub += 1;
                st.publishing.insert(id, Publishing { src: src.clone(), abandoned: false });
                Some(Ok(id))
            })
            .await?;
        // Dropped before the answer was taken: the publication stays alive, marked
        // abandoned; or, if the answer already came (another call applied it), the answer
        // is thrown away, which nobody else would take.
        struct Abandon<'a>(&'a Inner, u64, bool);
        impl Drop for Abandon<'_> {
            fn drop(&mut self) {
                if !self.2 {
                    self.0.driver.with(|st| {
                        if let Some(p) = st.publishing.get_mut(&self.1) {
                            p.abandoned = true;
                        }
                        st.read_done.retain(|(i, _)| *i != self.1);
                    });
                }
            }
        }
        let mut guard = Abandon(inner, id, false);
        let r = inner
            .wait(|st| match st.read_done.iter().position(|(i, _)| *i == id) {
                Some(k) => {
                    let (_, ok) = st.read_done.swap_remove(k);
                    Some(if ok {
                        Ok(())
                    } else {
                        Err(ChannelError::Protocol("the reader refused the data".into()))
                    })
                }
                None => st.check().err().map(Err),
            })
            .await;
        guard.2 = true;
        r
    }

    /// rread: waits for the peer's next published slice, RDMA-reads it into `dst`, and
    /// tells the peer. Returns the bytes read and `dst`. A publication larger than `dst` is
    /// refused (the peer's `publish` fails) and reported as [`ChannelError::TooLarge`].
    ///
    /// Cancel safety: a publication is taken in the same step that posts its read, and the
    /// peer is told when the read completes whoever reaps it: dropping this future never
    /// loses a publication or leaves the peer's `publish` waiting.
    pub async fn rread(&self, dst: LocalSlice) -> BufResult<usize, LocalSlice> {
        let r = self.rread_inner(&dst).await;
        (r, dst)
    }

    async fn rread_inner(&self, dst: &LocalSlice) -> Result<usize> {
        let inner = &self.inner;
        let (len, ticket) = inner
            .wait(|st| {
                if let Err(e) = st.check() {
                    return Some(Err(e));
                }
                if !st.ctl.fits(1) {
                    return None; // the send queue is full: wait for completions
                }
                let p = st.published_in.pop_front()?;
                let len = p.remote.len;
                if len > dst.len() {
                    Inner::answer_read(st, p.id, false);
                    return Some(Err(ChannelError::TooLarge {
                        what: "publication",
                        len: u64::from(len),
                        limit: u64::from(dst.len()),
                    }));
                }
                let posted = dst
                    .region()
                    .slice(dst.offset(), len)
                    .map_err(ChannelError::from)
                    .and_then(|local| st.ctl.post(SendWr::read(local, p.remote)));
                match posted {
                    Ok(ticket) => {
                        st.reads.push_back((ticket, p.id));
                        Some(Ok((len, ticket)))
                    }
                    Err(e) => {
                        // Not read: back at the front for the next rread.
                        st.published_in.push_front(p);
                        Some(Err(e))
                    }
                }
            })
            .await?;
        inner
            .wait(|st| if st.ctl.done() >= ticket { Some(Ok(())) } else { st.check().err().map(Err) })
            .await?;
        Ok(len as usize)
    }
}

impl Drop for Inner {
    /// Inline rwrites resolve when posted, and destroying the QP would discard any not yet
    /// executed: like a socket's close, the end lingers until they have completed (a fence,
    /// then the QP kept alive until nothing is outstanding), for at most
    /// [`LINGER`](crate::linger::LINGER), so a peer that never answers cannot block the code
    /// dropping the pipe: on a tokio runtime, in one task of its blocking pool shared by
    /// every end dropped meanwhile ([`crate::linger`]); elsewhere the dropping thread waits.
    fn drop(&mut self) {
        // Only an inline rwrite not yet followed by a completed signalled request; then a
        // fence, in the same critical section.
        let fenced = self.driver.with(|st| {
            let pending = st.check().is_ok() && st.inline_mark.is_some_and(|m| st.ctl.done() <= m);
            pending && st.ctl.fence().is_ok()
        });
        if !fenced {
            return;
        }
        crate::linger::linger(crate::linger::Remains {
            qp: self.qp.clone(),
            cq: self.driver.cq().clone(),
            _conn: self._conn.take(),
            deadline: std::time::Instant::now() + crate::linger::LINGER,
        });
    }
}

impl Inner {
    async fn wait<R>(&self, post_or_done: impl FnMut(&mut State) -> Option<Result<R>>) -> Result<R> {
        self.driver.wait(|st, wc| self.on_wc(st, wc), post_or_done).await
    }

    /// Posts an rwrite of `src` into `block`. Returns the ticket to wait for, or `None` for
    /// a message of at most [`Inner::inline_max`] bytes, copied into the request when
    /// posted (and its completion reaped lazily, as control messages are).
    fn post_rwrite(
        &self,
        st: &mut State,
        peer: &Hello,
        src: &LocalSlice,
        block: RemoteBlock,
        len: u64,
    ) -> Result<Option<u64>> {
        let dst = block.region().slice(0, src.len())?;
        // A small stack buffer for the common tiny message; the full one only when needed
        // (zeroing 256 bytes per call shows in the 8-byte latency).
        let mut small = [0u8; 32];
        let mut big;
        let inline = match usize::try_from(len) {
            Ok(n) if len <= self.inline_max => {
                let buf: &mut [u8] = if n <= small.len() {
                    &mut small[..n]
                } else {
                    big = [0u8; INLINE_MAX as usize];
                    &mut big[..n]
                };
                src.region().read_at(src.offset(), buf)?;
                Some(&*buf)
            }
            _ => None,
        };
        // The block's offset in the ring's segments laid end to end.
        let seg = st.alloc.as_ref().and_then(|a| a.segments().get(block.segment as usize)).copied();
        let start = st.seg_starts.get(block.segment as usize).copied();
        let (Some(seg), Some(start)) = (seg, start) else {
            return Err(ChannelError::Protocol(format!("block in unknown segment {}", block.segment)));
        };
        let offset = start + (block.addr - seg.addr);
        let data = match inline {
            Some(b) => {
                // Done once a signalled request posted after it is: the ticket after this.
                st.inline_mark = Some(st.ctl.posted());
                SendWr::write_inline(b, dst)
            }
            None => SendWr::write(src.clone(), dst),
        };
        let r = match peer.notify {
            NotifyMode::WriteImm => {
                let imm =
                    u32::try_from(offset / 8).map_err(|_| ChannelError::Invalid("ring beyond 32 GiB"))?;
                match inline {
                    Some(_) => st.ctl.post_lazy(data.with_imm(imm)).map(|()| None),
                    None => st.ctl.post(data.with_imm(imm)).map(Some),
                }
            }
            NotifyMode::Flag => {
                let slot = st.notes_sent % u64::from(peer.slots);
                let mut h = [0u8; MAILBOX_SLOT as usize];
                h[0..8].copy_from_slice(&offset.to_le_bytes());
                h[8..16].copy_from_slice(&len.to_le_bytes());
                // The sequence word last: the reader polls it (and the NIC stores a write's
                // last aligned word last, with release semantics).
                h[16..24].copy_from_slice(&(st.notes_sent + 1).to_le_bytes());
                let flag = peer.mailbox.slice(slot * MAILBOX_SLOT, MAILBOX_SLOT as u32)?;
                // Both with one doorbell, the data first.
                let note = SendWr::write_inline(&h, flag);
                match inline {
                    Some(_) => st.ctl.post_two_lazy(data, note).map(|()| None),
                    None => st.ctl.post_two(data, note).map(Some),
                }
            }
        };
        match r {
            Ok(ticket) => {
                st.notes_sent += 1;
                Ok(ticket)
            }
            Err(e) => {
                // The block is lost to the ring; the pipe cannot recover its accounting.
                st.ctl.fail(format!("posting an rwrite failed: {e}"));
                Err(e)
            }
        }
    }

    /// The next landed block, registered with the owner and taken by the consumer: its
    /// segment, address and length.
    fn next_landed(&self, st: &mut State) -> Option<Result<(MemoryRegion, u64, u64)>> {
        self.ring.as_ref()?;
        let (offset, len) = match self.config.notify {
            NotifyMode::WriteImm => st.imm_ready.pop_front()?,
            NotifyMode::Flag => {
                let slot = st.consumed % u64::from(self.config.slots);
                let at = slot * MAILBOX_SLOT;
                // Acquire: the NIC stores the sequence word last, with release semantics,
                // so the offset and length read below are the ones written with it.
                let seq = self.mailbox.load_u64_acquire(at + 16).ok()?;
                if seq != st.consumed + 1 {
                    return None;
                }
                (self.mailbox.read_u64(at).ok()?, self.mailbox.read_u64(at + 8).ok()?)
            }
        };
        st.consumed += 1;
        // Peer-controlled words: checked before any arithmetic. The offset names a segment
        // (laid end to end in grant order) and a place in it.
        let found = (|| {
            let (k, (start, mr)) =
                st.segs.iter().enumerate().rev().find(|(_, (start, _))| *start <= offset)?;
            let within = offset - start;
            if within >= mr.len() as u64 {
                return None;
            }
            let addr = mr.addr().checked_add(within)?;
            let padded = len.checked_next_multiple_of(8)?;
            let block = RemoteBlock { addr, len: padded, rkey: mr.rkey(), segment: u32::try_from(k).ok()? };
            (len > 0).then(|| (mr.clone(), block))
        })();
        let Some((mr, block)) = found else {
            let e = format!("the writer announced an invalid block (offset {offset}, {len} bytes)");
            st.ctl.fail(e.clone());
            return Some(Err(ChannelError::Protocol(e)));
        };
        let owner = st.owner.as_mut().expect("a ring has an owner");
        let r = owner.register(&AllocNotice::new(HEAP, block)).and_then(|()| owner.consume(block.addr));
        if r.is_ok() && st.writer_waiting {
            // A notification slot came free for a writer that waits for one.
            self.return_all_credits(st);
        }
        Some(match r {
            Ok(_) => Ok((mr, block.addr, len)),
            Err(e) => {
                st.ctl.fail(format!("the writer sent an invalid block: {e}"));
                Err(e.into())
            }
        })
    }

    /// No room in the peer's ring: asks the reader once to grow it (it returns its frees
    /// first), then waits for the answer.
    fn ask_to_grow<R>(&self, st: &mut State, len: u64) -> Option<Result<R>> {
        if st.grow_sent.is_none() && st.ctl.can_send() {
            st.grow_sent = Some(len);
            if let Err(e) = st.ctl.send(&Message::HeapGrow { heap: HEAP, len }) {
                return Some(Err(e));
            }
        }
        None
    }

    /// The reader's answer to a growth request: the frees pending first (then "try
    /// again"), else a new segment within `max_ring_len`, else a refusal.
    fn on_grow(&self, st: &mut State, len: u64) -> std::result::Result<(), String> {
        let Some(owner) = st.owner.as_ref() else {
            return Err("a growth request, but this end has no ring".into());
        };
        if owner.pending_free_blocks() > 0 {
            self.flush_credits(st);
            if st.credits_owed || !st.ctl.can_send() {
                st.grow_owed = Some(len); // answered after the frees, once there is room
                return Ok(());
            }
            return st.ctl.send(&Message::HeapFreed { heap: HEAP }).map_err(|e| e.to_string());
        }
        // Segments are whole 8-byte words, as the writer's allocator requires: a budget
        // that is not (a `max_ring_len` of any size) is rounded down.
        let budget = self.config.max_ring_len.saturating_sub(st.ring_bytes) & !7;
        let want = len.checked_next_multiple_of(8).map(|l| l.max(self.config.ring_len).min(budget));
        let seg = match want {
            Some(n) if len > 0 && n >= len => usize::try_from(n).ok().and_then(|n| {
                self.qp.pd().alloc_mr(n, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).ok()
            }),
            _ => None,
        };
        let Some(mr) = seg else {
            return st.ctl.send(&Message::HeapRefuse { heap: HEAP, len }).map_err(|e| e.to_string());
        };
        let segment = RemoteRegion::new(mr.addr(), mr.len() as u64, mr.rkey());
        st.owner.as_mut().expect("checked above").add_segment(segment).map_err(|e| e.to_string())?;
        st.segs.push((st.ring_bytes, mr));
        st.ring_bytes += segment.len;
        st.ctl.send(&Message::HeapGrant { heap: HEAP, segment }).map_err(|e| e.to_string())
    }

    /// Blocked on credits: asks the reader once to return what it has freed, then waits.
    /// Still waiting after [`CREDIT_WAIT_WARNING`], it says so once (a reader that is alive
    /// but never runs, as with both ends driven from one task, holds its releases back).
    fn ask_for_credit<R>(&self, st: &mut State) -> Option<Result<R>> {
        if !st.need_sent && st.ctl.can_send() {
            st.need_sent = true;
            st.need_since = Some(std::time::Instant::now());
            if let Err(e) = st.ctl.send(&Message::NeedCredit) {
                return Some(Err(e));
            }
        } else if st.need_since.is_some_and(|t| t.elapsed() >= CREDIT_WAIT_WARNING) {
            st.need_since = None;
            tracing::warn!(
                qp = self.qp.qp_num(),
                "pipe: a writer has waited {CREDIT_WAIT_WARNING:?} for room the reader has not returned; \
                 the reader's end returns released blocks when it runs (see Pipe::return_credits)"
            );
        }
        None
    }

    /// The rfree: frees the block; credits go back in batches (when a quarter of the
    /// notification slots or of the ring waits, or when the writer asks).
    fn release(&self, addr: u64) {
        self.driver.with(|st| {
            let Some(owner) = st.owner.as_mut() else { return };
            if owner.rfree(addr).is_err() {
                return;
            }
            let ring = st.ring_bytes;
            let due = owner.pending_free_blocks() >= (self.config.slots as usize / 4).max(1)
                || owner.pending_free_bytes() >= ring / 4;
            if due || st.writer_waiting {
                self.flush_credits(st);
            }
        });
    }

    /// Sends every pending free back, one range per inline message.
    fn flush_credits(&self, st: &mut State) {
        loop {
            let Some(owner) = st.owner.as_mut() else { return };
            if owner.pending_free_blocks() == 0 {
                return;
            }
            if !st.ctl.can_send() {
                // The frees stay with the owner, taken once there is room: never lost.
                st.credits_owed = true;
                return;
            }
            let batch = owner.take_free_batch(1);
            if let Err(e) = st.ctl.send(&Message::Credit { consumed: st.consumed, batch: Some(batch) }) {
                st.ctl.fail(format!("returning credit failed: {e}"));
                return;
            }
            st.credited = st.consumed;
            st.writer_waiting = false;
        }
    }

    /// Applies one completion to the state.
    fn on_wc(&self, st: &mut State, wc: &WorkCompletion) {
        match st.ctl.on_wc(wc) {
            None => {}
            Some(Event::Imm { imm, byte_len }) => {
                if self.ring.is_none() || st.imm_ready.len() >= self.config.slots as usize {
                    st.ctl.fail("the writer exceeded its notification credits".into());
                } else {
                    st.imm_ready.push_back((u64::from(imm) * 8, u64::from(byte_len)));
                }
            }
            Some(Event::Message(m)) => {
                if let Err(e) = self.on_message(st, m) {
                    st.ctl.fail(e);
                }
            }
            Some(Event::Malformed(e)) => st.ctl.fail_malformed(e),
        }
        // Reads that completed, whoever reaped them: tell the publisher.
        while let Some(&(ticket, id)) = st.reads.front() {
            if st.ctl.done() < ticket {
                break;
            }
            st.reads.pop_front();
            Inner::answer_read(st, id, true);
        }
        // Completions drain the backlog: what is owed goes out now.
        if st.credits_owed || st.grow_owed.is_some() || !st.answers_owed.is_empty() {
            self.pay_owed(st);
        }
    }

    /// Answers the peer's publication `id` (read, or refused), now or, with the control
    /// channel full, once it has room, in order.
    fn answer_read(st: &mut State, id: u64, ok: bool) {
        if st.answers_owed.is_empty() && st.ctl.can_send() {
            if let Err(e) = st.ctl.send(&Message::ReadDone { id, ok }) {
                st.ctl.fail(format!("answering a publication failed: {e}"));
            }
        } else if st.answers_owed.len() >= MAX_QUEUED {
            // The backlog holds MAX_QUEUED answers already, and as many more wait here: the
            // peer takes none of them in, yet publishes on.
            st.ctl.fail("the peer takes no answers to its publications in".into());
        } else {
            st.answers_owed.push_back((id, ok));
        }
    }

    /// Sends what the control channel had no room for, in turn, while it has room.
    fn pay_owed(&self, st: &mut State) {
        while st.ctl.can_send() {
            let Some((id, ok)) = st.answers_owed.pop_front() else { break };
            if let Err(e) = st.ctl.send(&Message::ReadDone { id, ok }) {
                st.ctl.fail(format!("answering a publication failed: {e}"));
                return;
            }
        }
        if st.credits_owed && st.ctl.can_send() {
            st.credits_owed = false;
            self.return_all_credits(st);
        }
        if let Some(len) = st.grow_owed
            && st.ctl.can_send()
            && !st.credits_owed
        {
            st.grow_owed = None;
            if let Err(e) = self.on_grow(st, len) {
                st.ctl.fail(e);
            }
        }
    }

    /// Returns every released block and the notification slots taken so far, now (as a
    /// blocked writer's `NeedCredit` asks): the frees in batches, or a credit of the
    /// notification slots alone when nothing was freed; when there is neither, the writer
    /// is answered at the next release or consumed message instead.
    fn return_all_credits(&self, st: &mut State) {
        if st.owner.as_ref().is_some_and(|o| o.pending_free_blocks() > 0) {
            self.flush_credits(st);
        } else if st.consumed == st.credited {
            st.writer_waiting = true;
        } else if !st.ctl.can_send() {
            st.credits_owed = true;
        } else if let Err(e) = st.ctl.send(&Message::Credit { consumed: st.consumed, batch: None }) {
            st.ctl.fail(format!("returning credit failed: {e}"));
        } else {
            st.credited = st.consumed;
            st.writer_waiting = false;
        }
    }

    fn on_message(&self, st: &mut State, m: Message) -> std::result::Result<(), String> {
        match m {
            Message::PipeHello { ring, mailbox, notify, slots, max_ring } => {
                if st.peer.is_some() {
                    return Err("a second hello".into());
                }
                // What a write with immediate can address (offsets in 8-byte units, 32 bits);
                // growth keeps to it too (`HeapGrant`).
                if ring.len > MAX_RING {
                    return Err(format!("a ring of {} bytes, beyond 32 GiB", ring.len));
                }
                if ring.len > 0 {
                    // Deferred whatever the policy: the notification of each message is
                    // its block's notice, and frees come back as credits.
                    let config = HeapConfig::new(HEAP, self.config.policy).with_sync(SyncMode::Deferred);
                    let mut a = HeapAllocator::new(config);
                    a.add_segment(ring).map_err(|e| e.to_string())?;
                    st.alloc = Some(a);
                    st.seg_starts = vec![0];
                    st.peer_ring_bytes = ring.len;
                    st.largest_seg = ring.len;
                    // A ring that cannot grow: never ask (the writer waits for frees, and a
                    // message larger than the ring is refused at once).
                    st.growth_refused = max_ring <= ring.len;
                }
                st.peer = Some(Hello { ring, mailbox, notify, slots, max_ring });
                Ok(())
            }
            Message::Credit { consumed, batch } => {
                if consumed > st.notes_sent {
                    return Err(format!("credit for {consumed} messages, {} sent", st.notes_sent));
                }
                st.peer_consumed = st.peer_consumed.max(consumed);
                st.need_sent = false;
                st.need_since = None;
                let Some(batch) = batch else { return Ok(()) }; // notification slots only
                let alloc = st.alloc.as_mut().ok_or("a free batch, but the peer has no ring")?;
                alloc.apply_free_batch(&batch).map_err(|e| e.to_string())
            }
            Message::Published { id, remote } => {
                if st.published_in.len() >= MAX_QUEUED {
                    return Err(format!("more than {MAX_QUEUED} publications unread"));
                }
                st.published_in.push_back(Published { id, remote });
                Ok(())
            }
            Message::NeedCredit => {
                // The writer is blocked: return everything freed, even below the batch size,
                // and the notification slots taken so far.
                self.return_all_credits(st);
                Ok(())
            }
            Message::HeapGrow { heap: HEAP, len } => {
                if st.grow_owed.is_some() {
                    return Err("a growth request before the answer to the last".into());
                }
                if !st.ctl.can_send() {
                    st.grow_owed = Some(len); // answered once there is room
                    return Ok(());
                }
                self.on_grow(st, len)
            }
            Message::HeapGrant { heap: HEAP, segment } => {
                let Some(asked) = st.grow_sent.take() else {
                    return Err("a ring segment nobody asked for".into());
                };
                // A segment smaller than the request leaves the write that asked without room,
                // to ask again: a reader granting a few bytes at a time would grow this
                // end's segment table by a row per round, without end.
                if segment.len < asked {
                    return Err(format!(
                        "a ring segment of {} bytes where {asked} were asked for",
                        segment.len
                    ));
                }
                let alloc = st.alloc.as_mut().ok_or("a ring segment, but the peer has no ring")?;
                let end = st.peer_ring_bytes.checked_add(segment.len).filter(|&e| e <= MAX_RING);
                let end = end.ok_or("the peer's ring grew beyond 32 GiB")?;
                alloc.add_segment(segment).map_err(|e| e.to_string())?;
                st.seg_starts.push(st.peer_ring_bytes);
                st.peer_ring_bytes = end;
                st.largest_seg = st.largest_seg.max(segment.len);
                // Nothing is asked past the cap, so no grant can go beyond it.
                if st.seg_starts.len() >= crate::heap::MAX_PEER_SEGMENTS {
                    st.growth_refused = true; // from now on, wait for frees
                }
                Ok(())
            }
            Message::HeapRefuse { heap: HEAP, .. } => {
                st.grow_sent = None;
                st.growth_refused = true;
                Ok(())
            }
            // The frees went first (on the same QP): try the allocation again.
            Message::HeapFreed { heap: HEAP } => {
                st.grow_sent = None;
                Ok(())
            }
            Message::ReadDone { id, ok } => {
                let p = st.publishing.remove(&id).ok_or_else(|| format!("read-done for publication {id}"))?;
                if !p.abandoned {
                    st.read_done.push((id, ok));
                }
                Ok(())
            }
            other => Err(format!("unexpected message on a pipe: {other:?}")),
        }
    }
}

/// Exclusive access to a block that landed in this end's ring. Dropping it (or
/// [`release`](Self::release)) hands the block back to the writer.
pub struct RecvGuard {
    pipe: Arc<Inner>,
    /// The ring segment holding the block.
    seg: MemoryRegion,
    addr: u64,
    len: u64,
    released: bool,
}

impl std::fmt::Debug for RecvGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvGuard")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}

impl RecvGuard {
    /// Bytes in the message.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True for an empty message (never: `rwrite` refuses them).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the block starts in its ring segment: the placement the writer's
    /// [`PipeConfig::policy`] chose (for tests and diagnostics).
    pub fn segment_offset(&self) -> u64 {
        self.addr - self.seg.addr()
    }

    fn ring(&self) -> &MemoryRegion {
        &self.seg
    }

    /// Copies bytes of the message from `offset` into `out`.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        check_range("pipe message", offset, out.len(), self.len)?;
        let ring = self.ring();
        Ok(ring.read_at(self.addr - ring.addr() + offset, out)?)
    }

    /// The message as a vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len as usize];
        self.read_at(0, &mut v)?;
        Ok(v)
    }

    /// The message's bytes in place, without a copy.
    ///
    /// # Safety
    /// Nothing may write the block while the slice lives. The writer never writes a block
    /// the reader holds (the pipe's protocol), but a peer that breaks the protocol, or one
    /// holding the ring's rkey outside the pipe, could: use this only with trusted peers.
    #[allow(unsafe_code)] // the escape hatch to a slice over the ring, with its contract
    pub unsafe fn as_slice(&self) -> &[u8] {
        let ring = self.ring();
        let start = (self.addr - ring.addr()) as usize;
        // SAFETY: the ring is host memory allocated by the pipe and the block lies inside it
        // (the owner checked it at registration), so this is `Some`; only the block's bytes
        // are covered, and the caller guarantees nothing writes them meanwhile.
        unsafe { ring.as_slice_at(start, self.len as usize) }
            .expect("a ring block is host memory inside the ring")
    }

    /// Releases the block now (the rfree); the same as dropping the guard.
    pub fn release(mut self) {
        self.released = true;
        self.pipe.release(self.addr);
    }
}

impl Drop for RecvGuard {
    fn drop(&mut self) {
        if !self.released {
            self.pipe.release(self.addr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmakit_verbs::Context;
    use std::future::Future;

    /// A writer blocked on ring space the reader holds, while the reader's end waits for a
    /// message: the two ends exchange nothing but keep-alives (they used to trade requests
    /// for credit and empty credits as fast as they could), and the writer goes on as soon
    /// as the reader releases a block.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_blocked_writer_and_a_waiting_reader_are_quiet_until_a_release() {
        let pd = Context::open_soft().alloc_pd().unwrap();
        let cfg = PipeConfig::default().with_ring_len(4096);
        let (a, b) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
        let src = pd.alloc_mr(512, AccessFlags::LOCAL_WRITE).unwrap();
        let mut held = Vec::new();
        for _ in 0..8 {
            a.rwrite(src.slice(0, 512).unwrap()).await.0.unwrap();
            held.push(b.recv_timeout(Duration::from_secs(5)).await.unwrap());
        }
        let (a2, b2, s2) = (a.clone(), b.clone(), src.slice(0, 512).unwrap());
        let writer = tokio::spawn(async move { a2.rwrite(s2).await.0 });
        let reader = tokio::spawn(async move { b2.recv_timeout(Duration::from_secs(20)).await.map(drop) });
        tokio::time::sleep(Duration::from_millis(300)).await; // the request for credit, answered or not
        let sent = |p: &Pipe| p.inner.driver.with(|st| st.ctl.requests_sent());
        let before = (sent(&a), sent(&b));
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (wrote, read) = (sent(&a) - before.0, sent(&b) - before.1);
        // Keep-alives (every 100 ms with nothing in flight) and little else.
        assert!(wrote <= 30 && read <= 30, "requests in a second of waiting: writer {wrote}, reader {read}");
        assert!(!writer.is_finished(), "the ring is full: the writer waits");
        drop(held.pop()); // one block released
        let r = tokio::time::timeout(Duration::from_secs(5), writer).await;
        r.expect("the writer went on after the release").unwrap().unwrap();
        reader.await.unwrap().expect("the reader got the message");
    }

    /// A `publish` dropped after another call applied its answer (the peer's `ReadDone`)
    /// leaves no answer behind: nobody would ever take it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_publish_dropped_after_its_answer_came_leaves_nothing_behind() {
        let pd = Context::open_soft().alloc_pd().unwrap();
        let (a, b) = Pipe::pair(&pd, PipeConfig::default(), PipeConfig::default()).await.unwrap();
        let data = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ).unwrap();
        let dst = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        for _ in 0..3 {
            let mut publish = Box::pin(a.publish(data.slice(0, 8).unwrap()));
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            assert!(publish.as_mut().poll(&mut cx).is_pending(), "published, not yet read");
            let (n, _) = b.rread(dst.local().unwrap()).await;
            assert_eq!(n.unwrap(), 8);
            // Another call on the publishing end takes the peer's answer in.
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while a.inner.driver.with(|st| st.read_done.is_empty()) {
                assert!(std::time::Instant::now() < deadline, "the answer never came");
                a.flush().await.unwrap();
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            drop(publish);
            let (publishing, answers) = a.inner.driver.with(|st| (st.publishing.len(), st.read_done.len()));
            assert_eq!((publishing, answers), (0, 0), "what a dropped publish left behind");
        }
    }
}
