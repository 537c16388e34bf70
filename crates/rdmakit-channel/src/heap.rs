//! Remote heaps over a connected queue pair: rmalloc → write → consume → rfree between
//! two endpoints, as the rmalloc paper runs them.
//!
//! A [`HeapEndpoint`] is one side of an endpoint pair. Either side may own heaps (register
//! their segments and consume what lands there) and allocate in the other side's heaps;
//! heaps are created on demand by the allocating side and named by [`HeapId`]s.
//!
//! The allocating side stages a block's contents in a local view before sending them, as
//! the rpipe seed's `rmem(rp, addr)`: [`rmalloc`](HeapEndpoint::rmalloc), then
//! [`rmem`](HeapEndpoint::rmem) (a [`BlockView`]: a registered local buffer, written by copy
//! or, under an `unsafe` contract, in place), then [`rwrite`](HeapEndpoint::rwrite).
//!
//! This is the transport of the allocator core in `rdmakit_memory::heap`. Control messages
//! travel through the connection's [control channel](crate::control) (sends on the same RC
//! queue pair as the data writes, into [`RECV_SLOTS`] receive buffers of [`SLOT_LEN`] bytes
//! each side keeps posted):
//!
//! | message | from | meaning |
//! | --- | --- | --- |
//! | [`HeapCreate`](Message::HeapCreate) | allocating side | make heap `h` with this policy, sync mode, alignment and a first segment of at least `n` bytes |
//! | [`HeapGrow`](Message::HeapGrow) | allocating side | heap `h` is full: a segment of at least `n` bytes, please |
//! | [`HeapGrant`](Message::HeapGrant) / [`HeapRefuse`](Message::HeapRefuse) | owner | here is a new segment (base, length, rkey) / no |
//! | [`AllocNotice`] | allocating side | deferred mode: block `b` holds data (sent *after* the data's RDMA write on the same QP, so RC ordering places the data first); immediate mode: may I use block `b`? |
//! | [`AllocAck`] | owner | immediate mode: yes, and here are the ranges freed since the last one |
//! | [`HeapReady`](Message::HeapReady) | allocating side | immediate mode: the data of acknowledged block `b` has landed |
//! | [`HeapFreed`](Message::HeapFreed) | owner | answer to `Grow`: the frees just sent may suffice; try again |
//! | [`FreeBatch`](rdmakit_memory::heap::FreeBatch) | owner | these ranges are free again (coalesced, numbered) |
//!
//! **Credits.** Each side reposts a receive as soon as it has taken a message out, and
//! connects with an unlimited RNR retry budget: a sender that outruns the receiver's
//! posted buffers is held back by RNR NAKs and retries, never fails. An owner sends a
//! free batch once [`FREE_BATCH_BLOCKS`] blocks or a quarter of a heap's bytes wait, and
//! at once when the allocating side asks to grow, so frees return before the heap grows.
//!
//! **Limits.** A peer decides how many heaps it creates and how often it asks to grow
//! them: [`OwnerLimits`] bounds the bytes per heap and in all heaps this side owns, and the
//! answers queued unasked for.
//!
//! Every wait has a deadline, and a wait with nothing in flight sends keep-alives: a peer
//! that dies gives [`ChannelError::Broken`] within the bound of [`crate::control`] (or
//! [`ChannelError::Timeout`] at the latest), never a hang. A request whose answer does not
//! come in time returns `Timeout`; its answer, when it comes, is taken for it and not for
//! the next request: a heap created, a segment added, or, for an immediate `rmalloc`, its
//! block confirmed and left allocated, unused. A malformed message is reported
//! ([`ChannelError::Malformed`], [`ChannelError::Protocol`]) without losing the messages
//! behind it; one met while a call waits for its own answer or for its writes to go out is
//! not that call's error: the call goes on, and the next call that takes messages in
//! (`poll_messages`, `rmalloc`, `write`, `create_heap`, `recv_block`, `try_recv_block`)
//! reports it.
//!
//! # Example: rmalloc, write, consume, rfree between two endpoints
//!
//! ```
//! use std::time::Duration;
//! use rdmakit_channel::heap::{HeapEndpoint, OwnerLimits};
//! use rdmakit_memory::heap::{AllocPolicy, HeapConfig, HeapId};
//! use rdmakit_verbs::{AccessFlags, ConnectOptions, Context, QpCaps};
//!
//! let ctx = Context::open_soft();
//! let pd = ctx.alloc_pd()?;
//! let (cw, cr) = (ctx.create_cq(256)?, ctx.create_cq(256)?);
//! let (w, r) = (pd.create_qp(&cw, &cw, QpCaps::default())?, pd.create_qp(&cr, &cr, QpCaps::default())?);
//! w.connect(&r.address()?, &ConnectOptions::default())?;
//! r.connect(&w.address()?, &ConnectOptions::default())?;
//! let wait = Duration::from_secs(5);
//! let mut writer = HeapEndpoint::new(w, cw, OwnerLimits::default(), wait)?;
//! let mut reader = HeapEndpoint::new(r, cr, OwnerLimits::default(), wait)?;
//! let heap = HeapId(1);
//!
//! // The owner (reader) answers the writer's requests and consumes what lands.
//! let owner = std::thread::spawn(move || -> Result<Vec<u8>, rdmakit_channel::ChannelError> {
//!     let landed = loop {
//!         match reader.try_recv_block(heap) {
//!             Ok(Some(block)) => break block,
//!             Ok(None) | Err(rdmakit_channel::ChannelError::UnknownHeap(_)) => reader.poll_messages()?,
//!             Err(e) => return Err(e),
//!         }
//!     };
//!     let mut text = vec![0u8; 5];
//!     reader.read(&landed, 0, &mut text)?;
//!     reader.rfree(landed)?; // the block returns to the writer in the next free batch
//!     Ok(text)
//! });
//!
//! writer.create_heap(HeapConfig::new(heap, AllocPolicy::NextFit), 64 << 10)?;
//! let block = writer.rmalloc(heap, 5)?; // an address in the reader's memory
//! let view = writer.rmem(heap, &block)?; // rmem: a local view to fill
//! view.write_at(0, b"hello")?;
//! writer.rwrite(&view)?; // one RDMA write, then the notice
//! assert_eq!(owner.join().expect("owner thread")?, b"hello");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use rdmakit_memory::heap::{
    AllocAck, AllocNotice, HeapAllocator, HeapConfig, HeapError, HeapId, HeapMessage, HeapOwner, HeapStats,
    OwnerBlockState, OwnerStats, RemoteBlock, SyncMode,
};
use rdmakit_verbs::{
    AccessFlags, CompletionQueue, LocalSlice, MemoryRegion, ProtectionDomain, QueuePair, RemoteRegion, SendWr,
};

use crate::control::{ControlConfig, ControlSlots, Event, Message};
use crate::error::{ChannelError, Result, check_range};

/// Receive buffers each side keeps posted.
pub const RECV_SLOTS: u32 = 32;
/// Bytes per receive buffer: the largest control message.
pub const SLOT_LEN: u32 = 16 * 1024;
/// Most ranges in one free batch, so that a batch (or an acknowledgement carrying one)
/// fits a receive buffer.
pub const MAX_BATCH_RANGES: usize = 512;
/// An owner returns frees once this many blocks wait.
pub const FREE_BATCH_BLOCKS: usize = 64;

/// Most messages queued that the peer sends unasked: answers nobody waits for yet.
const MAX_ANSWERS: usize = 1024;
/// Growth requests one `rmalloc` may send while the owner keeps answering with frees
/// (rounds after which the heap is still full) before it reports a protocol error.
const GROW_ROUNDS: usize = 16;
/// The most segments a peer's heap (or a pipe reader's ring) may have here: beyond, this
/// side does not ask it to grow (`rmalloc` gives [`HeapError::GrowthRefused`]; a pipe writer
/// waits for frees). A segment is a row in the allocator and a step of its searches.
pub(crate) const MAX_PEER_SEGMENTS: usize = 4096;

/// How an owner grows its heaps, and what one peer may make it hold.
///
/// Start from [`Default`] and change what you need with the `with_*` setters (the struct is
/// `#[non_exhaustive]`, so fields can be added without breaking you).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct OwnerLimits {
    /// Smallest segment registered (requests ask for at least the block that did not fit).
    pub segment_len: u64,
    /// Most bytes of segments per heap; growth beyond is refused.
    pub max_heap_bytes: u64,
    /// Most bytes of segments in all heaps the peer creates on this side; beyond, creation
    /// and growth are refused.
    pub max_total_bytes: u64,
    /// Most blocks the peer may have this side track in one heap (handed out, in use, or
    /// freed and not yet returned): each costs a map entry whatever its size, so bytes
    /// alone do not bound the bookkeeping (8-byte blocks of a 64 MiB heap would be eight
    /// million). A notice beyond it is a protocol error.
    pub max_blocks: usize,
}

impl Default for OwnerLimits {
    fn default() -> Self {
        OwnerLimits {
            segment_len: 1 << 20,
            max_heap_bytes: 64 << 20,
            max_total_bytes: 256 << 20,
            max_blocks: 1 << 20,
        }
    }
}

impl OwnerLimits {
    /// Sets [`segment_len`](Self::segment_len).
    pub const fn with_segment_len(mut self, segment_len: u64) -> Self {
        self.segment_len = segment_len;
        self
    }

    /// Sets [`max_heap_bytes`](Self::max_heap_bytes).
    pub const fn with_max_heap_bytes(mut self, max_heap_bytes: u64) -> Self {
        self.max_heap_bytes = max_heap_bytes;
        self
    }

    /// Sets [`max_blocks`](Self::max_blocks).
    pub const fn with_max_blocks(mut self, max_blocks: usize) -> Self {
        self.max_blocks = max_blocks;
        self
    }

    /// Sets [`max_total_bytes`](Self::max_total_bytes).
    pub const fn with_max_total_bytes(mut self, max_total_bytes: u64) -> Self {
        self.max_total_bytes = max_total_bytes;
        self
    }
}

/// A block that landed in a heap this side owns, taken by the consumer. Only the endpoint
/// makes them, so its address always lies in one of its segments. Neither `Copy` nor
/// `Clone`: [`HeapEndpoint::rfree`] takes it, so a block cannot be freed twice through a
/// copy (which, once its address was allocated again, would free a newer, unread block).
#[derive(Debug, PartialEq, Eq)]
pub struct LandedBlock {
    heap: HeapId,
    block: RemoteBlock,
}

impl LandedBlock {
    /// The heap.
    pub fn heap(&self) -> HeapId {
        self.heap
    }

    /// The block (its address is in this side's segment address space).
    pub fn block(&self) -> RemoteBlock {
        self.block
    }

    /// Bytes in the block.
    pub fn len(&self) -> u64 {
        self.block.len
    }

    /// True for an empty block (never: the allocator hands out none).
    pub fn is_empty(&self) -> bool {
        self.block.len == 0
    }
}

/// The rpipe seed's `rmem(rp, addr)` on the writing side: a local view of a block this side
/// allocated in the peer's heap ([`HeapEndpoint::rmem`]), to stage the block's contents
/// before [`HeapEndpoint::rwrite`] sends them (the seed's `ptr = rmem(rp, addr); *ptr =
/// val; rwrite(rp, addr)`).
///
/// The view is a local registered buffer of the block's length (the peer's memory is not
/// mapped here, so "local view" means a staging copy that `rwrite` RDMA-writes, zero copy
/// from there on). It has no remote access and is never shared with a peer. CPU access goes
/// by copy ([`write_at`](Self::write_at), [`read_at`](Self::read_at), ...), which is sound
/// whatever the NIC does, or through [`as_mut_slice`](Self::as_mut_slice), an `unsafe fn`
/// whose contract rules out a write of the view still in flight.
#[derive(Debug)]
pub struct BlockView {
    heap: HeapId,
    block: RemoteBlock,
    buf: MemoryRegion,
}

impl BlockView {
    /// The heap the block belongs to.
    pub fn heap(&self) -> HeapId {
        self.heap
    }

    /// The remote block this view stages.
    pub fn block(&self) -> RemoteBlock {
        self.block
    }

    /// Bytes in the view (the block's length).
    pub fn len(&self) -> u64 {
        self.block.len
    }

    /// True for an empty view (never: the allocator hands out no empty block).
    pub fn is_empty(&self) -> bool {
        self.block.len == 0
    }

    /// Copies `src` into the view at `offset` (bounds-checked).
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<()> {
        check_range("block view", offset, src.len(), self.block.len)?;
        Ok(self.buf.write_at(offset, src)?)
    }

    /// Copies bytes of the view from `offset` into `out` (bounds-checked).
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        check_range("block view", offset, out.len(), self.block.len)?;
        Ok(self.buf.read_at(offset, out)?)
    }

    /// Writes `v` little-endian at `offset`.
    pub fn write_u64(&self, offset: u64, v: u64) -> Result<()> {
        self.write_at(offset, &v.to_le_bytes())
    }

    /// Sets every byte of the view to `byte`.
    pub fn fill(&self, byte: u8) -> Result<()> {
        Ok(self.buf.fill(byte)?)
    }

    /// The view's bytes as a vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        Ok(self.buf.to_vec()?)
    }

    /// The view's bytes in place, to build the block's contents without a copy (the seed's
    /// `*ptr = val`).
    ///
    /// # Safety
    /// No RDMA write from this view may still be in flight while the slice lives: every
    /// [`HeapEndpoint::rwrite`] of it has returned `Ok` (which it does only once the NIC
    /// has finished reading the view). After an `rwrite` that failed, the request may still
    /// be executing; use the copying methods then. (Nothing else can reach the buffer: it
    /// has no remote access and `&mut self` excludes other references.)
    #[allow(unsafe_code)] // the escape hatch to a slice over the view, with its contract
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the buffer is host memory allocated by `rmem` (never device memory), so
        // this is `Some`; `&mut self` excludes every other reference to it, no peer holds a
        // key with remote access, and the caller guarantees no work request reads it now.
        unsafe { self.buf.as_mut_slice() }.expect("a block view is host memory")
    }
}

struct Owned {
    owner: HeapOwner,
    sync: SyncMode,
    segments: Vec<MemoryRegion>,
    bytes: u64,
    /// Blocks whose data has landed, oldest first, not yet taken by the consumer.
    ready: Ready,
}

/// Landed blocks in order, and their addresses for a look-up in constant time: a peer's
/// ready announcements are checked against the queue, which holds up to
/// `OwnerLimits::max_blocks` (a scan of it per announcement was quadratic in the peer's
/// blocks).
#[derive(Default)]
struct Ready {
    order: VecDeque<RemoteBlock>,
    addrs: std::collections::HashSet<u64>,
}

impl Ready {
    fn push_back(&mut self, b: RemoteBlock) {
        self.addrs.insert(b.addr);
        self.order.push_back(b);
    }

    fn pop_front(&mut self) -> Option<RemoteBlock> {
        let b = self.order.pop_front()?;
        self.addrs.remove(&b.addr);
        Some(b)
    }

    fn contains(&self, addr: u64) -> bool {
        self.addrs.contains(&addr)
    }
}

#[derive(Debug)]
enum Answer {
    Grant(HeapId, RemoteRegion),
    Refuse(HeapId, u64),
    Freed(HeapId),
    Ack(AllocAck),
}

/// A request whose wait for its answer timed out: the answer still comes (the owner answers
/// every request, in order), and must be taken for that request, not for the next one.
#[derive(Clone, Copy, Debug)]
enum Owed {
    /// `create_heap` of this heap: a late grant creates it.
    Create(HeapConfig),
    /// A growth request: a late grant adds the segment.
    Grow,
    /// An immediate `rmalloc`: a late acknowledgement confirms its block, which nobody
    /// holds (it stays allocated, unused) but whose acknowledgement's frees count.
    Alloc,
}

/// One side of an endpoint pair's remote heaps, over a connected RC queue pair.
pub struct HeapEndpoint {
    ctl: ControlSlots,
    cq: CompletionQueue,
    pd: ProtectionDomain,
    limits: OwnerLimits,
    timeout: Duration,
    allocating: HashMap<HeapId, HeapAllocator>,
    owned: HashMap<HeapId, Owned>,
    /// Bytes of segments in all owned heaps.
    owned_bytes: u64,
    answers: VecDeque<Answer>,
    /// Per heap, the requests whose answers are late, oldest first.
    owed: HashMap<HeapId, VecDeque<Owed>>,
    /// The first error a peer's message caused while a call waited for its own answer or
    /// for its requests to go out. That call goes on (its answer still pairs with its
    /// request, and what it posted stays posted); the next call that takes messages in
    /// reports this one.
    stashed: Option<ChannelError>,
    /// The connection the QP came from, kept open while the endpoint lives.
    _conn: Option<rdmakit_verbs::cm::Connection>,
}

impl HeapEndpoint {
    /// One side of the pair over `qp` (connected, with an unlimited RNR retry budget
    /// preferably, `max_recv_wr >= RECV_SLOTS`), whose send and receive completions both go
    /// to `cq`, which must hold `max_send_wr + RECV_SLOTS` completions (refused with
    /// [`ChannelError::QueueTooSmall`] otherwise). Posts the receive buffers. `timeout`
    /// bounds every wait for the peer (one longer than a year counts as a year).
    pub fn new(qp: QueuePair, cq: CompletionQueue, limits: OwnerLimits, timeout: Duration) -> Result<Self> {
        let pd = qp.pd().clone();
        let config =
            ControlConfig { send_slots: RECV_SLOTS, ..ControlConfig::new(RECV_SLOTS, SLOT_LEN, 4096) };
        let ctl = ControlSlots::new(qp, config)?;
        ctl.check_cq(&cq)?;
        Ok(HeapEndpoint {
            ctl,
            cq,
            pd,
            limits,
            // Deadlines are `now + timeout`: a year stands for any longer one (`Duration::MAX`
            // would overflow the clock).
            timeout: timeout.min(Duration::from_secs(365 * 24 * 3600)),
            allocating: HashMap::new(),
            owned: HashMap::new(),
            owned_bytes: 0,
            answers: VecDeque::new(),
            owed: HashMap::new(),
            stashed: None,
            _conn: None,
        })
    }

    /// One side of the pair over an established connection (`rdmakit_verbs::cm`: rdma_cm on
    /// verbs, the TCP bootstrap on the soft NIC), which the endpoint keeps open.
    pub fn from_connection(
        conn: rdmakit_verbs::cm::Connection,
        limits: OwnerLimits,
        timeout: Duration,
    ) -> Result<Self> {
        let mut ep = HeapEndpoint::new(conn.qp().clone(), conn.cq().clone(), limits, timeout)?;
        ep._conn = Some(conn);
        Ok(ep)
    }

    /// The queue pair.
    pub fn qp(&self) -> &QueuePair {
        self.ctl.qp()
    }

    // ---- allocating side ----

    /// Creates heap `config.heap()` in the peer's memory, with a first segment of at least
    /// `initial_len` bytes, and waits for the peer's grant.
    pub fn create_heap(&mut self, config: HeapConfig, initial_len: u64) -> Result<()> {
        let heap = config.heap();
        if self.allocating.contains_key(&heap) {
            return Err(ChannelError::Protocol(format!("heap {heap:?} exists already")));
        }
        self.take_stashed()?;
        self.ctl.send(&Message::HeapCreate { config, len: initial_len })?;
        match self.wait_answer(heap, Owed::Create(config))? {
            Answer::Grant(_, seg) => {
                let mut a = HeapAllocator::new(config);
                a.add_segment(seg)?;
                self.allocating.insert(heap, a);
                Ok(())
            }
            Answer::Refuse(_, n) => Err(HeapError::GrowthRefused { requested: n }.into()),
            Answer::Ack(_) | Answer::Freed(_) => {
                Err(ChannelError::Protocol("unexpected answer to a heap creation".into()))
            }
        }
    }

    /// rmalloc: a block of at least `size` bytes in the peer's heap. Deferred heaps answer
    /// at once (after taking in any free batches that arrived); when full, the peer is
    /// asked to grow the heap, and a refusal is [`HeapError::GrowthRefused`]. Immediate
    /// heaps synchronise with the owner before returning.
    pub fn rmalloc(&mut self, heap: HeapId, size: u64) -> Result<RemoteBlock> {
        self.poll_messages()?;
        let block = match self.allocator(heap)?.alloc(size) {
            Ok(b) => b,
            Err(HeapError::Exhausted { requested, .. }) => self.grow_and_alloc(heap, size, requested)?,
            Err(e) => return Err(e.into()),
        };
        if self.allocator(heap)?.config().sync() == SyncMode::Immediate {
            self.ctl.send(&Message::HeapSync(AllocNotice::new(heap, block).into()))?;
            let ack = match self.wait_answer(heap, Owed::Alloc)? {
                Answer::Ack(a) => a,
                _ => return Err(ChannelError::Protocol("expected an acknowledgement".into())),
            };
            return Ok(self.allocator(heap)?.confirm(&ack)?);
        }
        Ok(block)
    }

    fn grow_and_alloc(&mut self, heap: HeapId, size: u64, requested: u64) -> Result<RemoteBlock> {
        // The owner answers a growth request with its pending frees first, and grows only
        // when it has none. A consumer that keeps freeing while we ask can answer with
        // frees several times in a row, each round making room that may still be too small
        // or too scattered: a run of rounds, not one. The bound keeps an owner that answers
        // `Freed` forever from holding us: each round is one request and one answer.
        // Each grant is a row in the allocator and a step of its searches: past
        // `MAX_PEER_SEGMENTS` the heap does not grow, as if the owner had refused.
        if self.allocator(heap)?.segments().len() >= MAX_PEER_SEGMENTS {
            return Err(HeapError::GrowthRefused { requested }.into());
        }
        for _ in 0..GROW_ROUNDS {
            self.ctl.send(&Message::HeapGrow { heap, len: requested })?;
            match self.wait_answer(heap, Owed::Grow)? {
                Answer::Grant(_, seg) => {
                    // Smaller than asked, it would not hold the block, and each rmalloc
                    // would leave a useless segment behind.
                    if seg.len < requested {
                        return Err(ChannelError::Protocol(format!(
                            "a heap segment of {} bytes where {requested} were asked for",
                            seg.len
                        )));
                    }
                    self.allocator(heap)?.add_segment(seg)?;
                    return Ok(self.allocator(heap)?.alloc(size)?);
                }
                Answer::Refuse(..) => {
                    return self.allocator(heap)?.alloc(size).map_err(|e| match e {
                        HeapError::Exhausted { requested, .. } => {
                            HeapError::GrowthRefused { requested }.into()
                        }
                        other => other.into(),
                    });
                }
                // The owner sent its pending frees (already applied, they came first).
                Answer::Freed(_) => match self.allocator(heap)?.alloc(size) {
                    Err(HeapError::Exhausted { .. }) => continue,
                    other => return Ok(other?),
                },
                Answer::Ack(_) => {
                    return Err(ChannelError::Protocol("acknowledgement for a growth request".into()));
                }
            }
        }
        Err(ChannelError::Protocol("the owner keeps answering growth requests with frees".into()))
    }

    /// Writes `src` into `block` at `offset` with an RDMA write and tells the owner the data
    /// is there (deferred: the block's notice; immediate: `Ready`), then waits until the
    /// notice is sent, so `src` may be reused on return. The whole block is handed over
    /// whatever part was written.
    ///
    /// An owner that takes no messages in for longer than the endpoint's time-out leaves
    /// the notice unconfirmed: [`ChannelError::Unconfirmed`]. The write and its notice are
    /// posted then, and the block lands when the owner gets to it; writing it again would
    /// be a second notice for one block (a protocol error). Leave `src` unchanged until a
    /// later `write` or [`flush_frees`](Self::flush_frees) returns `Ok`: each waits for
    /// every earlier request to complete, so the NIC has read `src` by then.
    pub fn write(&mut self, heap: HeapId, block: &RemoteBlock, offset: u64, src: LocalSlice) -> Result<()> {
        let sync = self.allocator(heap)?.config().sync();
        let dst = block.region().slice(offset, src.len())?;
        self.take_stashed()?;
        self.ctl.check()?;
        // The send queue may be full of answers to the peer's requests (they wait in the
        // backlog behind it): wait for completions to make room, within the time-out.
        let deadline = Instant::now() + self.timeout;
        while !self.ctl.fits(1) {
            self.progress_until(deadline)?;
        }
        self.ctl.post_unsignaled(SendWr::write(src, dst))?;
        match sync {
            SyncMode::Deferred => self.ctl.send(&Message::HeapSync(AllocNotice::new(heap, *block).into()))?,
            SyncMode::Immediate => self.ctl.send(&Message::HeapReady { heap, addr: block.addr })?,
        }
        self.drain_sends().map_err(|e| match e {
            ChannelError::Timeout(after) => ChannelError::Unconfirmed { what: "heap write", after },
            e => e,
        })
    }

    /// rmem: a local view of `block`, which this side allocated in the peer's heap `heap`
    /// (see [`BlockView`]). Registers a staging buffer of the block's length (at most
    /// 4 GiB, one work request), zeroed. The block must lie in one of the heap's segments.
    pub fn rmem(&self, heap: HeapId, block: &RemoteBlock) -> Result<BlockView> {
        let a = self.allocating.get(&heap).ok_or(ChannelError::UnknownHeap(heap))?;
        let inside = a.segments().get(block.segment as usize).is_some_and(|s| {
            s.rkey == block.rkey
                && block.len > 0
                && block.addr >= s.addr
                && block
                    .addr
                    .checked_add(block.len)
                    .is_some_and(|e| s.addr.checked_add(s.len).is_some_and(|se| e <= se))
        });
        if !inside {
            return Err(HeapError::UnknownBlock { addr: block.addr }.into());
        }
        if block.len > u64::from(u32::MAX) {
            return Err(ChannelError::TooLarge {
                what: "block view",
                len: block.len,
                limit: u64::from(u32::MAX),
            });
        }
        let buf = self.pd.alloc_mr(block.len as usize, AccessFlags::LOCAL_WRITE)?;
        Ok(BlockView { heap, block: *block, buf })
    }

    /// rwrite: RDMA-writes the whole `view` into its block and tells the owner the data is
    /// there, as [`write`](Self::write) does; returns once the NIC is done reading the view,
    /// so it may be rewritten (even through [`BlockView::as_mut_slice`]).
    pub fn rwrite(&mut self, view: &BlockView) -> Result<()> {
        let src = view.buf.local()?;
        self.write(view.heap, &view.block, 0, src)
    }

    /// The allocating side's view of heap `heap`.
    pub fn heap_stats(&self, heap: HeapId) -> Result<HeapStats> {
        Ok(self.allocating.get(&heap).ok_or(ChannelError::UnknownHeap(heap))?.stats())
    }

    fn allocator(&mut self, heap: HeapId) -> Result<&mut HeapAllocator> {
        self.allocating.get_mut(&heap).ok_or(ChannelError::UnknownHeap(heap))
    }

    // ---- owner side ----

    /// The next block that landed in heap `heap` (this side owns it), waiting up to the
    /// endpoint's timeout. The block is now in use by the consumer: read it with
    /// [`read`](Self::read), then [`rfree`](Self::rfree) it.
    pub fn recv_block(&mut self, heap: HeapId) -> Result<LandedBlock> {
        self.take_stashed()?;
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(owned) = self.owned.get_mut(&heap)
                && let Some(block) = owned.ready.pop_front()
            {
                owned.owner.consume(block.addr)?;
                return Ok(LandedBlock { heap, block });
            }
            self.progress_until(deadline)?;
        }
    }

    /// The next block that landed in heap `heap`, if one has (processes arrived messages
    /// first, without waiting).
    pub fn try_recv_block(&mut self, heap: HeapId) -> Result<Option<LandedBlock>> {
        self.poll_messages()?;
        let owned = self.owned.get_mut(&heap).ok_or(ChannelError::UnknownHeap(heap))?;
        match owned.ready.pop_front() {
            Some(block) => {
                owned.owner.consume(block.addr)?;
                Ok(Some(LandedBlock { heap, block }))
            }
            None => Ok(None),
        }
    }

    /// Copies `out.len()` bytes of a landed block from `offset` out of this side's memory.
    pub fn read(&self, landed: &LandedBlock, offset: u64, out: &mut [u8]) -> Result<()> {
        let owned = self.owned.get(&landed.heap).ok_or(ChannelError::UnknownHeap(landed.heap))?;
        let b = landed.block;
        check_range("heap block", offset, out.len(), b.len)?;
        let mr = owned.segments.get(b.segment as usize).ok_or(HeapError::UnknownBlock { addr: b.addr })?;
        let at = (b.addr.checked_sub(mr.addr()))
            .and_then(|x| x.checked_add(offset))
            .ok_or(HeapError::UnknownBlock { addr: b.addr })?;
        Ok(mr.read_at(at, out)?)
    }

    /// rfree: the consumer is done with the block; it returns to the allocating side in a
    /// batch (see the module docs for when).
    ///
    /// # Errors
    /// `UnknownHeap`, or the owner's refusal (a block not landed or already freed): nothing
    /// changed. An error from sending a batch that became due (`Timeout` while the peer
    /// takes no control messages, or the connection's failure) comes after the free was
    /// recorded: the block is free on this side either way, and its batch goes with a later
    /// flush ([`flush_frees`](Self::flush_frees), or the next due `rfree`).
    pub fn rfree(&mut self, landed: LandedBlock) -> Result<()> {
        let owned = self.owned.get_mut(&landed.heap).ok_or(ChannelError::UnknownHeap(landed.heap))?;
        owned.owner.rfree(landed.block.addr)?;
        let due = owned.owner.pending_free_blocks() >= FREE_BATCH_BLOCKS
            || owned.owner.pending_free_bytes() >= owned.bytes / 4;
        if due && owned.sync == SyncMode::Deferred {
            self.flush_frees(landed.heap)?;
        }
        Ok(())
    }

    /// Sends the frees of heap `heap` waiting on this side now, and waits until they are
    /// on their way.
    pub fn flush_frees(&mut self, heap: HeapId) -> Result<()> {
        if !self.owned.contains_key(&heap) {
            return Err(ChannelError::UnknownHeap(heap));
        }
        self.flush_frees_nowait(heap)?;
        self.drain_sends()
    }

    /// The owner's view of heap `heap`.
    pub fn owner_stats(&self, heap: HeapId) -> Result<OwnerStats> {
        Ok(self.owned.get(&heap).ok_or(ChannelError::UnknownHeap(heap))?.owner.stats())
    }

    /// Processes whatever control messages have arrived, without waiting: the owner side
    /// answers creation and growth requests and records landed blocks, the allocating side
    /// takes in free batches. Call it when the owner side is otherwise idle (in a loop, it
    /// also keeps the connection watched).
    ///
    /// Every completion reaped is processed: a malformed message is reported (the first
    /// error is returned) but the messages behind it are kept and every slot reposted.
    pub fn poll_messages(&mut self) -> Result<()> {
        let mut wcs = [rdmakit_verbs::WorkCompletion::default(); 16];
        let mut first: Option<ChannelError> = self.stashed.take();
        loop {
            let n = self.cq.poll(&mut wcs)?;
            for wc in &wcs[..n] {
                if let Err(e) = self.on_completion(wc) {
                    first.get_or_insert(e);
                }
            }
            if n < wcs.len() {
                break;
            }
        }
        self.ctl.tick();
        match first {
            Some(e) => Err(e),
            None => self.ctl.check(),
        }
    }

    // ---- machinery ----

    fn progress_until(&mut self, deadline: Instant) -> Result<()> {
        self.ctl.check()?;
        let now = Instant::now();
        if now >= deadline {
            return Err(ChannelError::Timeout(self.timeout));
        }
        let wait = (deadline - now).min(Duration::from_millis(50)).min(self.ctl.keepalive_interval());
        let r = match self.cq.wait(Some(wait)) {
            Ok(wc) => self.on_completion(&wc),
            Err(rdmakit_verbs::Error::Timeout(_)) => Ok(()),
            Err(e) => Err(e.into()),
        };
        self.ctl.tick();
        r.and_then(|()| self.ctl.check())
    }

    /// [`progress_until`](Self::progress_until) for a call waiting for its own answer or
    /// completions: an error a message of the peer caused, while the endpoint still works,
    /// is not this call's; it is stashed for the next call, and the wait goes on (failing
    /// here would leave this call's answer to pair with the next request, or make the
    /// caller post again what is already posted).
    fn progress_for_own(&mut self, deadline: Instant) -> Result<()> {
        match self.progress_until(deadline) {
            Err(
                e @ (ChannelError::Protocol(_)
                | ChannelError::Malformed(_)
                | ChannelError::Heap(_)
                | ChannelError::UnknownHeap(_)
                | ChannelError::TooLarge { .. }),
            ) if self.ctl.check().is_ok() => {
                self.stashed.get_or_insert(e);
                Ok(())
            }
            r => r,
        }
    }

    /// Reports (once) the error a peer's message caused during an earlier call's wait.
    fn take_stashed(&mut self) -> Result<()> {
        self.stashed.take().map_or(Ok(()), Err)
    }

    /// Waits for the answer to the request just sent for `heap` (`owed` says what it was).
    /// Timed out, the request is remembered as owed: its answer, when it comes, is taken for
    /// it ([`take_late`](Self::take_late)), not for this heap's next request.
    fn wait_answer(&mut self, heap: HeapId, owed: Owed) -> Result<Answer> {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(i) = self.answers.iter().position(|a| answer_heap(a) == heap) {
                return Ok(self.answers.remove(i).expect("index from position"));
            }
            if let Err(e) = self.progress_for_own(deadline) {
                if matches!(e, ChannelError::Timeout(_)) {
                    let q = self.owed.entry(heap).or_default();
                    if q.len() >= MAX_ANSWERS {
                        // An owner that never answers: no more bookkeeping for it.
                        self.ctl
                            .fail(format!("more than {MAX_ANSWERS} requests of heap {heap:?} unanswered"));
                    } else {
                        q.push_back(owed);
                    }
                }
                return Err(e);
            }
        }
    }

    /// A late answer to a request that timed out (the oldest owed for its heap), applied
    /// as that request would have: a heap created, a segment added, a block confirmed.
    fn take_late(&mut self, owed: Owed, a: Answer) -> Result<()> {
        match (owed, a) {
            (Owed::Create(config), Answer::Grant(heap, seg)) => {
                if let std::collections::hash_map::Entry::Vacant(v) = self.allocating.entry(heap) {
                    let mut alloc = HeapAllocator::new(config);
                    alloc.add_segment(seg)?;
                    v.insert(alloc);
                }
                Ok(())
            }
            (Owed::Grow, Answer::Grant(heap, seg)) => {
                self.allocator(heap)?.add_segment(seg)?;
                Ok(())
            }
            (Owed::Create(_) | Owed::Grow, Answer::Refuse(..)) | (Owed::Grow, Answer::Freed(_)) => Ok(()),
            (Owed::Alloc, Answer::Ack(ack)) => {
                self.allocator(ack.heap)?.confirm(&ack)?;
                Ok(())
            }
            (owed, a) => Err(ChannelError::Protocol(format!("a late {a:?} to a timed-out {owed:?} request"))),
        }
    }

    fn drain_sends(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        while !self.ctl.idle() {
            self.progress_for_own(deadline)?;
        }
        Ok(())
    }

    fn on_completion(&mut self, wc: &rdmakit_verbs::WorkCompletion) -> Result<()> {
        match self.ctl.on_wc(wc) {
            None => self.ctl.check(),
            Some(Event::Message(m)) => self.on_message(m),
            Some(Event::Malformed(e)) => Err(e.into()),
            Some(Event::Imm { .. }) => {
                Err(ChannelError::Protocol("a write with immediate on a heap endpoint".into()))
            }
        }
    }

    fn answer(&mut self, a: Answer) -> Result<()> {
        let heap = answer_heap(&a);
        if let Some(owed) = self.owed.get_mut(&heap).and_then(VecDeque::pop_front) {
            return self.take_late(owed, a);
        }
        if self.answers.len() >= MAX_ANSWERS {
            return Err(ChannelError::Protocol(format!("more than {MAX_ANSWERS} answers nobody asked for")));
        }
        self.answers.push_back(a);
        Ok(())
    }

    fn on_message(&mut self, m: Message) -> Result<()> {
        match m {
            Message::HeapCreate { config, len } => self.on_create(config, len),
            Message::HeapGrow { heap, len } => self.on_grow(heap, len),
            Message::HeapGrant { heap, segment } => self.answer(Answer::Grant(heap, segment)),
            Message::HeapRefuse { heap, len } => self.answer(Answer::Refuse(heap, len)),
            Message::HeapFreed { heap } => self.answer(Answer::Freed(heap)),
            Message::HeapReady { heap, addr } => {
                let owned = self.owned.get_mut(&heap).ok_or(ChannelError::UnknownHeap(heap))?;
                if owned.sync != SyncMode::Immediate {
                    // A deferred heap's notice is the announcement.
                    return Err(ChannelError::Protocol(format!(
                        "a ready announcement in deferred heap {heap:?}"
                    )));
                }
                // Only a block handed out and not announced yet: one the consumer took
                // (in use) or freed must not be delivered again, nor one already queued.
                let (block, state) = owned.owner.block(addr).ok_or(HeapError::UnknownBlock { addr })?;
                if state != OwnerBlockState::HandedOut || owned.ready.contains(addr) {
                    return Err(ChannelError::Protocol(format!(
                        "block {addr:#x} announced again ({state:?} on this side)"
                    )));
                }
                owned.ready.push_back(block);
                Ok(())
            }
            Message::HeapSync(HeapMessage::FreeBatch(b)) => {
                Ok(self.allocator(b.heap())?.apply_free_batch(&b)?)
            }
            Message::HeapSync(HeapMessage::AllocAck(a)) => self.answer(Answer::Ack(a)),
            Message::HeapSync(HeapMessage::AllocNotice(n)) => self.on_notice(&n),
            other => Err(ChannelError::Protocol(format!("unexpected message on a heap endpoint: {other:?}"))),
        }
    }

    fn on_notice(&mut self, n: &AllocNotice) -> Result<()> {
        let owned = self.owned.get_mut(&n.heap).ok_or(ChannelError::UnknownHeap(n.heap))?;
        if owned.owner.tracked_blocks() >= self.limits.max_blocks {
            return Err(ChannelError::Protocol(format!(
                "the peer holds more than {} blocks in heap {:?} (OwnerLimits::max_blocks)",
                self.limits.max_blocks, n.heap
            )));
        }
        match owned.sync {
            SyncMode::Deferred => {
                owned.owner.register(n)?;
                owned.ready.push_back(n.block);
                Ok(())
            }
            SyncMode::Immediate => {
                // Frees beyond what an acknowledgement can carry go first, in batches.
                if owned.owner.pending_free_blocks() > MAX_BATCH_RANGES {
                    self.flush_frees_nowait(n.heap)?;
                }
                // The acknowledgement registers the block and takes frees: only with room
                // to send it.
                self.ctl.ensure_room()?;
                let owned = self.owned.get_mut(&n.heap).ok_or(ChannelError::UnknownHeap(n.heap))?;
                let ack = owned.owner.acknowledge(n)?;
                self.ctl.send(&Message::HeapSync(ack.into()))
            }
        }
    }

    fn on_create(&mut self, config: HeapConfig, len: u64) -> Result<()> {
        let heap = config.heap();
        if self.owned.contains_key(&heap) || !self.may_register(0, len) {
            return self.refuse(heap, len);
        }
        self.owned.insert(
            heap,
            Owned {
                owner: HeapOwner::new(heap),
                sync: config.sync(),
                segments: Vec::new(),
                bytes: 0,
                ready: Ready::default(),
            },
        );
        let r = self.grant(heap, len);
        // Refused after all (registration failed): no empty heap stays behind.
        if self.owned.get(&heap).is_some_and(|o| o.bytes == 0) {
            self.owned.remove(&heap);
        }
        r
    }

    fn on_grow(&mut self, heap: HeapId, len: u64) -> Result<()> {
        let Some(owned) = self.owned.get(&heap) else { return self.refuse(heap, len) };
        if owned.owner.pending_free_blocks() > 0 {
            // Return what the consumer has freed first: it may be all the allocator needs.
            self.flush_frees_nowait(heap)?;
            return self.ctl.send(&Message::HeapFreed { heap });
        }
        self.grant(heap, len)
    }

    /// Sends the frees pending in `heap` in batches, as long as the control channel has room:
    /// a batch is taken (its blocks, its sequence number) only to be sent, and the rest wait
    /// for a later flush.
    fn flush_frees_nowait(&mut self, heap: HeapId) -> Result<()> {
        loop {
            let Some(o) = self.owned.get_mut(&heap) else { return Ok(()) };
            if o.owner.pending_free_blocks() == 0 || !self.ctl.can_send() {
                return Ok(());
            }
            let batch = o.owner.take_free_batch(MAX_BATCH_RANGES);
            self.ctl.send(&Message::HeapSync(batch.into()))?;
        }
    }

    /// Whether a segment of `len` (at least `segment_len`) bytes more fits the limits, for
    /// a heap holding `heap_bytes`.
    fn may_register(&self, heap_bytes: u64, min_len: u64) -> bool {
        let len = min_len.max(self.limits.segment_len);
        min_len > 0
            && heap_bytes.checked_add(len).is_some_and(|b| b <= self.limits.max_heap_bytes)
            && self.owned_bytes.checked_add(len).is_some_and(|b| b <= self.limits.max_total_bytes)
    }

    fn grant(&mut self, heap: HeapId, min_len: u64) -> Result<()> {
        // The segment is registered with the owner before the grant goes: only with room to
        // send it, or the two sides' segment numbers would part.
        self.ctl.ensure_room()?;
        let limits = self.limits;
        let heap_bytes = self.owned.get(&heap).ok_or(ChannelError::UnknownHeap(heap))?.bytes;
        if !self.may_register(heap_bytes, min_len) {
            return self.refuse(heap, min_len);
        }
        let len = min_len.max(limits.segment_len);
        let owned = self.owned.get_mut(&heap).ok_or(ChannelError::UnknownHeap(heap))?;
        let Ok(ulen) = usize::try_from(len) else { return self.refuse(heap, min_len) };
        let mr = match self.pd.alloc_mr(ulen, AccessFlags::REMOTE_WRITE | AccessFlags::LOCAL_WRITE) {
            Ok(mr) => mr,
            Err(e) => {
                tracing::warn!(?heap, len, error = %e, "heap segment registration failed; refusing growth");
                return self.refuse(heap, min_len);
            }
        };
        let seg = RemoteRegion::new(mr.addr(), len, mr.rkey());
        owned.owner.add_segment(seg)?;
        owned.segments.push(mr);
        owned.bytes += len;
        self.owned_bytes += len;
        self.ctl.send(&Message::HeapGrant { heap, segment: seg })
    }

    fn refuse(&mut self, heap: HeapId, len: u64) -> Result<()> {
        self.ctl.send(&Message::HeapRefuse { heap, len })
    }
}

fn answer_heap(a: &Answer) -> HeapId {
    match a {
        Answer::Grant(h, _) | Answer::Refuse(h, _) | Answer::Freed(h) => *h,
        Answer::Ack(a) => a.heap,
    }
}

impl std::fmt::Debug for HeapEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeapEndpoint")
            .field("qp", &self.ctl.qp().qp_num())
            .field("allocating", &self.allocating.keys().collect::<Vec<_>>())
            .field("owned", &self.owned.keys().collect::<Vec<_>>())
            .finish()
    }
}
