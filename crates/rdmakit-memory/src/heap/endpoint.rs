//! Remote heaps over a connected queue pair: rmalloc → write → consume → rfree between
//! two endpoints, as the rmalloc paper runs them.
//!
//! A [`HeapEndpoint`] is one side of an endpoint pair. Either side may own heaps (register
//! their segments and consume what lands there) and allocate in the other side's heaps;
//! heaps are created on demand by the allocating side and named by [`HeapId`]s.
//!
//! Control messages travel as sends on the same RC queue pair as the data writes, into
//! receive buffers each side keeps posted ([`RECV_SLOTS`] of [`SLOT_LEN`] bytes):
//!
//! | message | from | meaning |
//! | --- | --- | --- |
//! | `Create` | allocating side | make heap `h` with this policy, sync mode, alignment and a first segment of at least `n` bytes |
//! | `Grow` | allocating side | heap `h` is full: a segment of at least `n` bytes, please |
//! | `Grant` / `Refuse` | owner | here is a new segment (base, length, rkey) / no |
//! | [`AllocNotice`] | allocating side | deferred mode: block `b` holds data (sent *after* the data's RDMA write on the same QP, so RC ordering places the data first); immediate mode: may I use block `b`? |
//! | [`AllocAck`] | owner | immediate mode: yes, and here are the ranges freed since the last one |
//! | `Ready` | allocating side | immediate mode: the data of acknowledged block `b` has landed |
//! | `Freed` | owner | answer to `Grow`: the frees just sent may suffice; try again |
//! | [`FreeBatch`](super::FreeBatch) | owner | these ranges are free again (coalesced, numbered) |
//!
//! **Credits.** Each side reposts a receive as soon as it has taken a message out, and
//! connects with an unlimited RNR retry budget: a sender that outruns the receiver's
//! posted buffers is held back by RNR NAKs and retries, never fails. An owner sends a
//! free batch once [`FREE_BATCH_BLOCKS`] blocks or a quarter of a heap's bytes wait, and
//! at once when the allocating side asks to grow, so frees return before the heap grows.
//!
//! Every wait has a deadline: a peer that dies gives [`EndpointError::Timeout`] or an error
//! completion, never a hang. Malformed messages are [`EndpointError::Protocol`].

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use rdmakit_verbs::{
    AccessFlags, CompletionQueue, LocalSlice, MemoryRegion, ProtectionDomain, QueuePair, RecvWr, SendWr,
    WcOpcode, WorkCompletion,
};

use super::{
    AllocAck, AllocNotice, AllocPolicy, HeapAllocator, HeapConfig, HeapError, HeapId, HeapMessage, HeapOwner,
    HeapStats, OwnerStats, RemoteBlock, RemoteSegment, SyncMode, WireError,
};

/// Receive buffers each side keeps posted.
pub const RECV_SLOTS: u32 = 32;
/// Bytes per receive buffer: the largest control message.
pub const SLOT_LEN: u32 = 16 * 1024;
/// Most ranges in one free batch, so that a batch (or an acknowledgement carrying one)
/// fits a receive buffer.
pub const MAX_BATCH_RANGES: usize = 512;
/// An owner returns frees once this many blocks wait.
pub const FREE_BATCH_BLOCKS: usize = 64;

const TAG_CREATE: u8 = 0x41;
const TAG_GRANT: u8 = 0x42;
const TAG_REFUSE: u8 = 0x43;
const TAG_GROW: u8 = 0x44;
const TAG_READY: u8 = 0x45;
const TAG_FREED: u8 = 0x46;

/// What can go wrong between two heap endpoints.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// The verbs layer failed (posting, an error completion, the QP in the error state).
    #[error(transparent)]
    Verbs(#[from] rdmakit_verbs::Error),
    /// The heap refused the operation (exhausted, double free, unknown block, ...).
    #[error(transparent)]
    Heap(#[from] HeapError),
    /// A control message could not be decoded.
    #[error("malformed heap message: {0}")]
    Wire(#[from] WireError),
    /// The peer broke the protocol.
    #[error("heap protocol error: {0}")]
    Protocol(String),
    /// No such heap on this side.
    #[error("no heap {0:?} on this endpoint")]
    UnknownHeap(HeapId),
    /// The peer did not answer in time (it may have died).
    #[error("no answer from the peer within {0:?}")]
    Timeout(Duration),
}

/// Result of heap endpoint operations.
pub type Result<T> = std::result::Result<T, EndpointError>;

/// How an owner grows its heaps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OwnerLimits {
    /// Smallest segment registered (requests ask for at least the block that did not fit).
    pub segment_len: u64,
    /// Most bytes of segments per heap; growth beyond is refused.
    pub max_heap_bytes: u64,
}

impl Default for OwnerLimits {
    fn default() -> Self {
        OwnerLimits { segment_len: 1 << 20, max_heap_bytes: 64 << 20 }
    }
}

/// A block that landed in a heap this side owns, taken by the consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LandedBlock {
    /// The heap.
    pub heap: HeapId,
    /// The block (its address is in this side's segment address space).
    pub block: RemoteBlock,
}

struct Owned {
    owner: HeapOwner,
    sync: SyncMode,
    segments: Vec<MemoryRegion>,
    bytes: u64,
    /// Blocks whose data has landed, oldest first, not yet taken by the consumer.
    ready: VecDeque<RemoteBlock>,
}

enum Answer {
    Grant(HeapId, RemoteSegment),
    Refuse(HeapId, u64),
    Freed(HeapId),
    Ack(AllocAck),
}

/// One side of an endpoint pair's remote heaps, over a connected RC queue pair.
pub struct HeapEndpoint {
    qp: QueuePair,
    cq: CompletionQueue,
    pd: ProtectionDomain,
    recv: MemoryRegion,
    send: MemoryRegion,
    /// Rotating send slot (sends complete in order, so a slot is free once the one
    /// `RECV_SLOTS` later is posted after waiting for it).
    send_slot: u32,
    limits: OwnerLimits,
    timeout: Duration,
    allocating: HashMap<HeapId, HeapAllocator>,
    owned: HashMap<HeapId, Owned>,
    answers: VecDeque<Answer>,
    /// Signalled sends not yet completed.
    unacked_sends: u32,
    /// The connection the QP came from, kept open while the endpoint lives.
    _conn: Option<rdmakit_verbs::cm::Connection>,
}

impl HeapEndpoint {
    /// One side of the pair over `qp` (connected, with an unlimited RNR retry budget
    /// preferably), whose send and receive completions both go to `cq`. Posts the receive
    /// buffers. `timeout` bounds every wait for the peer.
    pub fn new(qp: QueuePair, cq: CompletionQueue, limits: OwnerLimits, timeout: Duration) -> Result<Self> {
        let pd = qp.pd().clone();
        let recv = pd.alloc_mr((RECV_SLOTS * SLOT_LEN) as usize, AccessFlags::LOCAL_WRITE)?;
        let send = pd.alloc_mr((RECV_SLOTS * SLOT_LEN) as usize, AccessFlags::LOCAL_WRITE)?;
        let ep = HeapEndpoint {
            qp,
            cq,
            pd,
            recv,
            send,
            send_slot: 0,
            limits,
            timeout,
            allocating: HashMap::new(),
            owned: HashMap::new(),
            answers: VecDeque::new(),
            unacked_sends: 0,
            _conn: None,
        };
        for slot in 0..RECV_SLOTS {
            ep.post_recv(slot)?;
        }
        Ok(ep)
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

    fn post_recv(&self, slot: u32) -> Result<()> {
        let s = self.recv.slice(u64::from(slot * SLOT_LEN), SLOT_LEN)?;
        self.qp.post_recv(RecvWr::new(s).wr_id(u64::from(slot)))?;
        Ok(())
    }

    /// The queue pair.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    // ---- allocating side ----

    /// Creates heap `config.heap()` in the peer's memory, with a first segment of at least
    /// `initial_len` bytes, and waits for the peer's grant.
    pub fn create_heap(&mut self, config: HeapConfig, initial_len: u64) -> Result<()> {
        let heap = config.heap();
        if self.allocating.contains_key(&heap) {
            return Err(EndpointError::Protocol(format!("heap {heap:?} exists already")));
        }
        let mut m = vec![TAG_CREATE];
        m.extend_from_slice(&heap.0.to_le_bytes());
        m.push(policy_code(config.policy()));
        m.push(u8::from(config.sync() == SyncMode::Immediate));
        m.extend_from_slice(&config.align().to_le_bytes());
        m.extend_from_slice(&initial_len.to_le_bytes());
        self.send_msg(&m)?;
        match self.wait_answer(heap)? {
            Answer::Grant(_, seg) => {
                let mut a = HeapAllocator::new(config);
                a.add_segment(seg)?;
                self.allocating.insert(heap, a);
                Ok(())
            }
            Answer::Refuse(_, n) => Err(HeapError::GrowthRefused { requested: n }.into()),
            Answer::Ack(_) | Answer::Freed(_) => {
                Err(EndpointError::Protocol("unexpected answer to a heap creation".into()))
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
            self.send_msg(&AllocNotice::new(heap, block).encode())?;
            let ack = match self.wait_answer(heap)? {
                Answer::Ack(a) => a,
                _ => return Err(EndpointError::Protocol("expected an acknowledgement".into())),
            };
            return Ok(self.allocator(heap)?.confirm(&ack)?);
        }
        Ok(block)
    }

    fn grow_and_alloc(&mut self, heap: HeapId, size: u64, requested: u64) -> Result<RemoteBlock> {
        // At most: one round returning the owner's pending frees, one growing.
        for _ in 0..3 {
            let mut m = vec![TAG_GROW];
            m.extend_from_slice(&heap.0.to_le_bytes());
            m.extend_from_slice(&requested.to_le_bytes());
            self.send_msg(&m)?;
            match self.wait_answer(heap)? {
                Answer::Grant(_, seg) => {
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
                    return Err(EndpointError::Protocol("acknowledgement for a growth request".into()));
                }
            }
        }
        Err(EndpointError::Protocol("the owner keeps answering growth requests with frees".into()))
    }

    /// Writes `src` into `block` at `offset` with an RDMA write and tells the owner the data
    /// is there (deferred: the block's notice; immediate: `Ready`), then waits until the
    /// notice is sent, so `src` may be reused on return. The whole block is handed over
    /// whatever part was written.
    pub fn write(&mut self, heap: HeapId, block: &RemoteBlock, offset: u64, src: LocalSlice) -> Result<()> {
        let sync = self.allocator(heap)?.config().sync();
        let dst = block.region().slice(offset, src.len())?;
        self.qp.post_send(SendWr::write(src, dst).unsignaled())?;
        match sync {
            SyncMode::Deferred => self.send_msg(&AllocNotice::new(heap, *block).encode())?,
            SyncMode::Immediate => {
                let mut m = vec![TAG_READY];
                m.extend_from_slice(&heap.0.to_le_bytes());
                m.extend_from_slice(&block.addr.to_le_bytes());
                self.send_msg(&m)?;
            }
        }
        self.drain_sends()
    }

    /// The allocating side's view of heap `heap`.
    pub fn heap_stats(&self, heap: HeapId) -> Result<HeapStats> {
        Ok(self.allocating.get(&heap).ok_or(EndpointError::UnknownHeap(heap))?.stats())
    }

    fn allocator(&mut self, heap: HeapId) -> Result<&mut HeapAllocator> {
        self.allocating.get_mut(&heap).ok_or(EndpointError::UnknownHeap(heap))
    }

    // ---- owner side ----

    /// The next block that landed in heap `heap` (this side owns it), waiting up to the
    /// endpoint's timeout. The block is now in use by the consumer: read it with
    /// [`read`](Self::read), then [`rfree`](Self::rfree) it.
    pub fn recv_block(&mut self, heap: HeapId) -> Result<LandedBlock> {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(owned) = self.owned.get_mut(&heap) {
                if let Some(block) = owned.ready.pop_front() {
                    owned.owner.consume(block.addr)?;
                    return Ok(LandedBlock { heap, block });
                }
            }
            self.progress_until(deadline)?;
        }
    }

    /// The next block that landed in heap `heap`, if one has (processes arrived messages
    /// first, without waiting).
    pub fn try_recv_block(&mut self, heap: HeapId) -> Result<Option<LandedBlock>> {
        self.poll_messages()?;
        let owned = self.owned.get_mut(&heap).ok_or(EndpointError::UnknownHeap(heap))?;
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
        let owned = self.owned.get(&landed.heap).ok_or(EndpointError::UnknownHeap(landed.heap))?;
        let b = landed.block;
        if offset.checked_add(out.len() as u64).is_none_or(|e| e > b.len) {
            return Err(rdmakit_verbs::Error::OutOfBounds {
                what: "heap block",
                offset,
                len: out.len() as u64,
                size: b.len,
            }
            .into());
        }
        let mr = owned.segments.get(b.segment as usize).ok_or(HeapError::UnknownBlock { addr: b.addr })?;
        Ok(mr.read_at(b.addr - mr.addr() + offset, out)?)
    }

    /// rfree: the consumer is done with the block; it returns to the allocating side in a
    /// batch (see the module docs for when).
    pub fn rfree(&mut self, landed: LandedBlock) -> Result<()> {
        let owned = self.owned.get_mut(&landed.heap).ok_or(EndpointError::UnknownHeap(landed.heap))?;
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
            return Err(EndpointError::UnknownHeap(heap));
        }
        self.flush_frees_nowait(heap)?;
        self.drain_sends()
    }

    /// The owner's view of heap `heap`.
    pub fn owner_stats(&self, heap: HeapId) -> Result<OwnerStats> {
        Ok(self.owned.get(&heap).ok_or(EndpointError::UnknownHeap(heap))?.owner.stats())
    }

    /// Processes whatever control messages have arrived, without waiting: the owner side
    /// answers creation and growth requests and records landed blocks, the allocating side
    /// takes in free batches. Call it when the owner side is otherwise idle.
    pub fn poll_messages(&mut self) -> Result<()> {
        let mut wcs = [WorkCompletion::default(); 16];
        loop {
            let n = self.cq.poll(&mut wcs)?;
            for wc in &wcs[..n] {
                self.on_completion(wc)?;
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    // ---- machinery ----

    fn progress_until(&mut self, deadline: Instant) -> Result<()> {
        let now = Instant::now();
        if now >= deadline {
            return Err(EndpointError::Timeout(self.timeout));
        }
        match self.cq.wait(Some((deadline - now).min(Duration::from_millis(50)))) {
            Ok(wc) => self.on_completion(&wc),
            Err(rdmakit_verbs::Error::Timeout(_)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    fn wait_answer(&mut self, heap: HeapId) -> Result<Answer> {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(i) = self.answers.iter().position(|a| answer_heap(a) == heap) {
                return Ok(self.answers.remove(i).expect("index from position"));
            }
            self.progress_until(deadline)?;
        }
    }

    fn drain_sends(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        while self.unacked_sends > 0 {
            self.progress_until(deadline)?;
        }
        Ok(())
    }

    fn send_msg(&mut self, bytes: &[u8]) -> Result<()> {
        if bytes.len() > SLOT_LEN as usize {
            return Err(EndpointError::Protocol(format!(
                "a {}-byte control message exceeds a slot",
                bytes.len()
            )));
        }
        // Keep fewer signalled sends outstanding than there are send slots, so a slot is
        // never rewritten while its send may still read it.
        let deadline = Instant::now() + self.timeout;
        while self.unacked_sends + 1 >= RECV_SLOTS {
            self.progress_until(deadline)?;
        }
        let slot = self.send_slot;
        self.send_slot = (slot + 1) % RECV_SLOTS;
        let at = u64::from(slot * SLOT_LEN);
        self.send.write_at(at, bytes)?;
        self.qp.post_send(SendWr::send(self.send.slice(at, bytes.len() as u32)?).wr_id(u64::MAX))?;
        self.unacked_sends += 1;
        Ok(())
    }

    fn on_completion(&mut self, wc: &WorkCompletion) -> Result<()> {
        let wc = wc.ok()?;
        if wc.opcode != WcOpcode::RECV {
            // One of our sends (RDMA writes are unsignalled).
            self.unacked_sends = self.unacked_sends.saturating_sub(1);
            return Ok(());
        }
        let slot = u32::try_from(wc.wr_id).ok().filter(|s| *s < RECV_SLOTS);
        let slot = slot.ok_or_else(|| EndpointError::Protocol(format!("receive with wr_id {}", wc.wr_id)))?;
        let mut msg = vec![0u8; wc.byte_len as usize];
        self.recv.read_at(u64::from(slot * SLOT_LEN), &mut msg)?;
        self.post_recv(slot)?;
        self.on_message(&msg)
    }

    fn on_message(&mut self, m: &[u8]) -> Result<()> {
        let proto =
            |what: &str| EndpointError::Protocol(format!("malformed {what} message ({} bytes)", m.len()));
        match m.first().copied() {
            Some(TAG_CREATE) => {
                let (heap, rest) = take_heap(m).ok_or_else(|| proto("create"))?;
                if rest.len() != 18 {
                    return Err(proto("create"));
                }
                let policy = policy_from(rest[0]).ok_or_else(|| proto("create"))?;
                let sync = if rest[1] == 1 { SyncMode::Immediate } else { SyncMode::Deferred };
                let align = u64::from_le_bytes(rest[2..10].try_into().expect("8 bytes"));
                let len = u64::from_le_bytes(rest[10..18].try_into().expect("8 bytes"));
                let config = HeapConfig::new(heap, policy).with_sync(sync).with_align(align)?;
                self.on_create(config, len)
            }
            Some(TAG_GROW) => {
                let (heap, rest) = take_heap(m).ok_or_else(|| proto("grow"))?;
                let len = u64::from_le_bytes(rest.try_into().map_err(|_| proto("grow"))?);
                self.on_grow(heap, len)
            }
            Some(TAG_GRANT) => {
                let (heap, rest) = take_heap(m).ok_or_else(|| proto("grant"))?;
                if rest.len() != 20 {
                    return Err(proto("grant"));
                }
                let base = u64::from_le_bytes(rest[0..8].try_into().expect("8 bytes"));
                let len = u64::from_le_bytes(rest[8..16].try_into().expect("8 bytes"));
                let rkey = u32::from_le_bytes(rest[16..20].try_into().expect("4 bytes"));
                self.answers.push_back(Answer::Grant(heap, RemoteSegment::new(base, len, rkey)));
                Ok(())
            }
            Some(TAG_REFUSE) => {
                let (heap, rest) = take_heap(m).ok_or_else(|| proto("refuse"))?;
                let len = u64::from_le_bytes(rest.try_into().map_err(|_| proto("refuse"))?);
                self.answers.push_back(Answer::Refuse(heap, len));
                Ok(())
            }
            Some(TAG_FREED) => {
                let (heap, rest) = take_heap(m).ok_or_else(|| proto("freed"))?;
                if !rest.is_empty() {
                    return Err(proto("freed"));
                }
                self.answers.push_back(Answer::Freed(heap));
                Ok(())
            }
            Some(TAG_READY) => {
                let (heap, rest) = take_heap(m).ok_or_else(|| proto("ready"))?;
                let addr = u64::from_le_bytes(rest.try_into().map_err(|_| proto("ready"))?);
                let owned = self.owned.get_mut(&heap).ok_or(EndpointError::UnknownHeap(heap))?;
                let block = owned
                    .owner
                    .blocks()
                    .find(|(b, _)| b.addr == addr)
                    .map(|(b, _)| b)
                    .ok_or(HeapError::UnknownBlock { addr })?;
                owned.ready.push_back(block);
                Ok(())
            }
            Some(_) => match HeapMessage::decode(m)? {
                HeapMessage::FreeBatch(b) => Ok(self.allocator(b.heap())?.apply_free_batch(&b)?),
                HeapMessage::AllocAck(a) => {
                    self.answers.push_back(Answer::Ack(a));
                    Ok(())
                }
                HeapMessage::AllocNotice(n) => self.on_notice(&n),
            },
            None => Err(proto("empty")),
        }
    }

    fn on_notice(&mut self, n: &AllocNotice) -> Result<()> {
        let owned = self.owned.get_mut(&n.heap).ok_or(EndpointError::UnknownHeap(n.heap))?;
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
                let owned = self.owned.get_mut(&n.heap).ok_or(EndpointError::UnknownHeap(n.heap))?;
                let ack = owned.owner.acknowledge(n)?;
                self.send_msg(&ack.encode())
            }
        }
    }

    fn on_create(&mut self, config: HeapConfig, len: u64) -> Result<()> {
        let heap = config.heap();
        if self.owned.contains_key(&heap) {
            return self.refuse(heap, len);
        }
        self.owned.insert(
            heap,
            Owned {
                owner: HeapOwner::new(heap),
                sync: config.sync(),
                segments: Vec::new(),
                bytes: 0,
                ready: VecDeque::new(),
            },
        );
        self.grant(heap, len)
    }

    fn on_grow(&mut self, heap: HeapId, len: u64) -> Result<()> {
        let Some(owned) = self.owned.get(&heap) else { return self.refuse(heap, len) };
        if owned.owner.pending_free_blocks() > 0 {
            // Return what the consumer has freed first: it may be all the allocator needs.
            self.flush_frees_nowait(heap)?;
            let mut m = vec![TAG_FREED];
            m.extend_from_slice(&heap.0.to_le_bytes());
            return self.send_msg(&m);
        }
        self.grant(heap, len)
    }

    fn flush_frees_nowait(&mut self, heap: HeapId) -> Result<()> {
        loop {
            let Some(o) = self.owned.get_mut(&heap) else { return Ok(()) };
            if o.owner.pending_free_blocks() == 0 {
                return Ok(());
            }
            let batch = o.owner.take_free_batch(MAX_BATCH_RANGES);
            self.send_msg(&batch.encode())?;
        }
    }

    fn grant(&mut self, heap: HeapId, min_len: u64) -> Result<()> {
        let limits = self.limits;
        let owned = self.owned.get_mut(&heap).ok_or(EndpointError::UnknownHeap(heap))?;
        let len = min_len.max(limits.segment_len);
        if min_len == 0 || owned.bytes.saturating_add(len) > limits.max_heap_bytes {
            return self.refuse(heap, min_len);
        }
        let Ok(ulen) = usize::try_from(len) else { return self.refuse(heap, min_len) };
        let mr = match self.pd.alloc_mr(ulen, AccessFlags::REMOTE_WRITE | AccessFlags::LOCAL_WRITE) {
            Ok(mr) => mr,
            Err(e) => {
                tracing::warn!(?heap, len, error = %e, "heap segment registration failed; refusing growth");
                return self.refuse(heap, min_len);
            }
        };
        let seg = RemoteSegment::new(mr.addr(), len, mr.rkey());
        owned.owner.add_segment(seg)?;
        owned.segments.push(mr);
        owned.bytes += len;
        let mut m = vec![TAG_GRANT];
        m.extend_from_slice(&heap.0.to_le_bytes());
        m.extend_from_slice(&seg.base.to_le_bytes());
        m.extend_from_slice(&seg.len.to_le_bytes());
        m.extend_from_slice(&seg.rkey.to_le_bytes());
        self.send_msg(&m)
    }

    fn refuse(&mut self, heap: HeapId, len: u64) -> Result<()> {
        let mut m = vec![TAG_REFUSE];
        m.extend_from_slice(&heap.0.to_le_bytes());
        m.extend_from_slice(&len.to_le_bytes());
        self.send_msg(&m)
    }
}

fn answer_heap(a: &Answer) -> HeapId {
    match a {
        Answer::Grant(h, _) | Answer::Refuse(h, _) | Answer::Freed(h) => *h,
        Answer::Ack(a) => a.heap,
    }
}

fn take_heap(m: &[u8]) -> Option<(HeapId, &[u8])> {
    let id = m.get(1..5)?;
    Some((HeapId(u32::from_le_bytes(id.try_into().ok()?)), &m[5..]))
}

fn policy_code(p: AllocPolicy) -> u8 {
    match p {
        AllocPolicy::NextFit => 0,
        AllocPolicy::FirstFit => 1,
        AllocPolicy::BestFit => 2,
        AllocPolicy::WorstFit => 3,
    }
}

fn policy_from(b: u8) -> Option<AllocPolicy> {
    AllocPolicy::ALL.get(usize::from(b)).copied()
}

impl std::fmt::Debug for HeapEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeapEndpoint")
            .field("qp", &self.qp.qp_num())
            .field("allocating", &self.allocating.keys().collect::<Vec<_>>())
            .field("owned", &self.owned.keys().collect::<Vec<_>>())
            .finish()
    }
}
