//! rpipe-style pipes: `rwrite` into the peer's remote heap, `recv` with an exclusive guard,
//! and `publish`/`rread` for the pull direction.
//!
//! A pipe end owns one connected RC queue pair and its completion queue. Each end may
//! advertise a **receive ring** (a registered segment of its memory): the other end runs a
//! next-fit [`HeapAllocator`] over it, so an `rwrite` RDMA-writes straight into the
//! receiver's memory (zero copy), and the receiver's [`HeapOwner`] hands blocks back in
//! coalesced free batches when the application drops its [`RecvGuard`] (the rfree). The
//! allocator never hands out a range the owner still holds, so **a writer can never
//! overwrite data the reader has not released**: that is the flow control. An end with
//! `ring_len = 0` only sends (a half-duplex pipe); two rings make it full duplex.
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
//! Control messages (hello, credits, publish, read-done) are inline sends of at most 64
//! bytes into receive buffers each end keeps posted, so the QP needs
//! `max_inline_data >= 64`; the QP should retry RNR without limit (the default).
//!
//! Cancel safety: an `rwrite` future owns its source slice; once the writes are posted,
//! dropping the future leaves the block handed over to the reader and the slice held by
//! the verbs layer's in-flight table until the NIC is done with it. A dropped `recv`
//! takes nothing. A guard dropped or leaked never frees memory the NIC writes: leaking it
//! only keeps its block out of the ring.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use rdmakit_memory::heap::{
    AllocNotice, AllocPolicy, FreeBatch, HeapAllocator, HeapConfig, HeapError, HeapId, HeapOwner,
    RemoteBlock, RemoteSegment,
};
use rdmakit_verbs::cm::Connection;
use rdmakit_verbs::{
    AccessFlags, CompletionQueue, LocalSlice, MemoryRegion, QueuePair, RecvWr, RemoteRegion, SendWr,
    WcOpcode, WcStatus, WorkCompletion,
};

use crate::driver::{Driver, PollMode};
use crate::error::{BufResult, ChannelError, Result};

const HEAP: HeapId = HeapId(0);
/// Receive buffers each end keeps posted for control messages and immediates.
const RECV_SLOTS: u32 = 128;
/// Size of one control message buffer; control messages go inline, so at most this.
const MSG_LEN: u32 = 64;
/// Bytes per mailbox slot: `offset u64, len u64, seq u64`.
const MAILBOX_SLOT: u64 = 24;

const TAG_HELLO: u8 = 1;
const TAG_CREDIT: u8 = 2;
const TAG_PUBLISHED: u8 = 3;
const TAG_READ_DONE: u8 = 4;
const TAG_NEED: u8 = 5;

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
#[derive(Clone, Copy, Debug)]
pub struct PipeConfig {
    /// Bytes of the receive ring this end offers its peer (0: this end only sends).
    pub ring_len: u64,
    /// How this end wants to be notified of incoming data.
    pub notify: NotifyMode,
    /// How this end waits for completions.
    pub poll: PollMode,
    /// Most messages the peer may have sent this end and this end not yet received.
    pub slots: u32,
    /// How long connecting waits for the peer's hello.
    pub connect_timeout: Duration,
}

impl Default for PipeConfig {
    fn default() -> Self {
        PipeConfig {
            ring_len: 1 << 20,
            notify: NotifyMode::WriteImm,
            poll: PollMode::Event,
            slots: 32,
            connect_timeout: Duration::from_secs(10),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Hello {
    ring: RemoteRegion,
    mailbox: RemoteRegion,
    notify: NotifyMode,
    slots: u32,
}

#[derive(Clone, Copy, Debug)]
struct Published {
    id: u64,
    remote: RemoteRegion,
}

struct State {
    broken: Option<(WcStatus, &'static str)>,
    protocol: Option<String>,
    /// Signalled send-queue requests posted and completed (they complete in order).
    posted: u64,
    done: u64,
    peer: Option<Hello>,
    // ---- writer role (into the peer's ring)
    alloc: Option<HeapAllocator>,
    notes_sent: u64,
    peer_consumed: u64,
    /// A request for credits is on its way (cleared when credits arrive).
    need_sent: bool,
    // ---- reader role (our ring)
    owner: Option<HeapOwner>,
    imm_ready: VecDeque<(u64, u64)>,
    consumed: u64,
    /// Credits that could not be posted yet (the send queue was full).
    unsent: VecDeque<Vec<u8>>,
    // ---- publish / rread
    next_pub: u64,
    published_in: VecDeque<Published>,
    read_done: Vec<(u64, bool)>,
}

impl State {
    fn check(&self) -> Result<()> {
        if let Some((status, what)) = self.broken {
            return Err(ChannelError::Broken { status, what });
        }
        if let Some(p) = &self.protocol {
            return Err(ChannelError::Protocol(p.clone()));
        }
        Ok(())
    }
}

struct Inner {
    qp: QueuePair,
    driver: Driver<State>,
    config: PipeConfig,
    recv: MemoryRegion,
    ring: Option<MemoryRegion>,
    mailbox: MemoryRegion,
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
    /// Makes a pipe end of `qp` (connected RC, `max_inline_data >= 64`), whose send and
    /// receive completions go to `cq` and nothing else's, and exchanges rings with the peer
    /// end (which must call this too).
    pub async fn connect(qp: QueuePair, cq: CompletionQueue, config: PipeConfig) -> Result<Pipe> {
        Self::connect_inner(qp, cq, config, None).await
    }

    /// A pipe end over an established connection (`rdmakit_verbs::cm`), kept open by the
    /// pipe. The connection's QP must have `max_inline_data >= 64`.
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
        let caps = rdmakit_verbs::QpCaps {
            max_send_wr: 256,
            max_recv_wr: RECV_SLOTS + 8,
            max_inline_data: MSG_LEN,
            ..Default::default()
        };
        let (ca, cb) = (ctx.create_cq(1024)?, ctx.create_cq(1024)?);
        let qa = pd.create_qp(&ca, &ca, caps)?;
        let qb = pd.create_qp(&cb, &cb, caps)?;
        let opts = rdmakit_verbs::ConnectOptions::default();
        qa.connect(&qb.endpoint()?, &opts)?;
        qb.connect(&qa.endpoint()?, &opts)?;
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
        let pd = qp.pd().clone();
        let recv = pd.alloc_mr((RECV_SLOTS * MSG_LEN) as usize, AccessFlags::LOCAL_WRITE)?;
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
                o.add_segment(RemoteSegment::new(r.addr(), r.len() as u64, r.rkey()))?;
                Some(o)
            }
            None => None,
        };
        let state = State {
            broken: None,
            protocol: None,
            posted: 0,
            done: 0,
            peer: None,
            alloc: None,
            notes_sent: 0,
            peer_consumed: 0,
            need_sent: false,
            owner,
            imm_ready: VecDeque::new(),
            consumed: 0,
            unsent: VecDeque::new(),
            next_pub: 1,
            published_in: VecDeque::new(),
            read_done: Vec::new(),
        };
        let inner = Arc::new(Inner {
            qp,
            driver: Driver::new(cq, config.poll, state),
            config,
            recv,
            ring,
            mailbox,
            _conn: conn,
        });
        for slot in 0..RECV_SLOTS {
            inner.post_recv(slot)?;
        }
        // Hello: our ring and mailbox (empty descriptors when we have no ring).
        let empty = RemoteRegion { addr: 0, len: 0, rkey: 0 };
        let ring_desc = inner.ring.as_ref().map_or(empty, MemoryRegion::remote);
        let mut hello = vec![TAG_HELLO];
        hello.extend_from_slice(&ring_desc.encode());
        hello.extend_from_slice(&inner.mailbox.remote().encode());
        hello.push(u8::from(config.notify == NotifyMode::WriteImm));
        hello.extend_from_slice(&config.slots.to_le_bytes());
        inner.driver.with(|st| inner.send_inline(st, &hello))?;
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

    /// rwrite: RDMA-writes `src` into a block of the peer's ring and notifies the peer.
    /// Waits for ring space (and a notification slot) first: the reader releasing blocks
    /// is the credit. Resolves when `src` may be reused, returning it.
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
        inner
            .wait(|st| {
                if let Err(e) = st.check() {
                    return Some(Err(e));
                }
                if let Some(t) = ticket {
                    return (st.done >= t).then_some(Ok(()));
                }
                let peer = st.peer?;
                if peer.ring.len == 0 {
                    return Some(Err(ChannelError::Invalid("the peer offers no receive ring")));
                }
                if len > peer.ring.len {
                    return Some(Err(ChannelError::TooLarge { what: "message", len, limit: peer.ring.len }));
                }
                if st.notes_sent - st.peer_consumed >= u64::from(peer.slots) {
                    return inner.ask_for_credit(st); // wait for the reader to take notifications
                }
                let block = match st.alloc.as_mut().expect("set with the hello").alloc(len) {
                    Ok(b) => b,
                    Err(HeapError::Exhausted { .. }) => return inner.ask_for_credit(st), // wait for frees
                    Err(e) => return Some(Err(e.into())),
                };
                match inner.post_rwrite(st, &peer, src, block, len) {
                    Ok(t) => {
                        ticket = Some(t);
                        None // poll for the completion
                    }
                    Err(e) => Some(Err(e)),
                }
            })
            .await
    }

    /// Waits for the next message and returns an exclusive guard over its block; dropping
    /// the guard releases the block to the writer (the rfree).
    pub async fn recv(&self) -> Result<RecvGuard> {
        if self.inner.ring.is_none() {
            return Err(ChannelError::Invalid("this pipe end has no receive ring"));
        }
        let inner = &self.inner;
        let take = |st: &mut State| -> Option<Result<(u64, u64)>> {
            if let Some(x) = inner.next_landed(st) {
                return Some(x);
            }
            st.check().err().map(Err)
        };
        let (addr, len) = match inner.config.notify {
            NotifyMode::WriteImm => inner.wait(take).await?,
            // The mailbox is memory: poll it, whatever the CQ mode.
            NotifyMode::Flag => {
                inner.driver.wait_mode(PollMode::Busy, |st, wc| inner.on_wc(st, wc), take).await?
            }
        };
        Ok(RecvGuard { pipe: self.inner.clone(), addr, len, released: false })
    }

    /// [`recv`](Self::recv) with a deadline.
    pub async fn recv_timeout(&self, timeout: Duration) -> Result<RecvGuard> {
        tokio::time::timeout(timeout, self.recv()).await.unwrap_or(Err(ChannelError::Timeout(timeout)))
    }

    /// The owner side of `rread`: publishes `src` (a slice of a region with remote read
    /// access) to the peer and waits until the peer has read it. Returns `src`.
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
        let id = inner.driver.with(|st| -> Result<u64> {
            st.check()?;
            let id = st.next_pub;
            st.next_pub += 1;
            let mut m = vec![TAG_PUBLISHED];
            m.extend_from_slice(&id.to_le_bytes());
            m.extend_from_slice(&remote.addr.to_le_bytes());
            m.extend_from_slice(&remote.len.to_le_bytes());
            m.extend_from_slice(&remote.rkey.to_le_bytes());
            inner.send_inline(st, &m)?;
            Ok(id)
        })?;
        inner
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
            .await
    }

    /// rread: waits for the peer's next published slice, RDMA-reads it into `dst`, and
    /// tells the peer. Returns the bytes read and `dst`. A publication larger than `dst` is
    /// refused (the peer's `publish` fails) and reported as [`ChannelError::TooLarge`].
    pub async fn rread(&self, dst: LocalSlice) -> BufResult<usize, LocalSlice> {
        let r = self.rread_inner(&dst).await;
        (r, dst)
    }

    async fn rread_inner(&self, dst: &LocalSlice) -> Result<usize> {
        let inner = &self.inner;
        let p = inner
            .wait(|st| st.published_in.pop_front().map(Ok).or_else(|| st.check().err().map(Err)))
            .await?;
        let len = p.remote.len;
        let done = |ok: bool| {
            let mut m = vec![TAG_READ_DONE];
            m.extend_from_slice(&p.id.to_le_bytes());
            m.push(u8::from(ok));
            m
        };
        if len > u64::from(dst.len()) {
            inner.driver.with(|st| inner.send_inline(st, &done(false)))?;
            return Err(ChannelError::TooLarge { what: "publication", len, limit: u64::from(dst.len()) });
        }
        let local = dst.region().slice(dst.offset(), len as u32)?;
        let ticket = inner.driver.with(|st| -> Result<u64> {
            st.check()?;
            inner.qp.post_send(SendWr::read(local, p.remote.slice(0, len as u32)?))?;
            st.posted += 1;
            Ok(st.posted)
        })?;
        inner.wait(|st| if st.done >= ticket { Some(Ok(())) } else { st.check().err().map(Err) }).await?;
        inner.driver.with(|st| inner.send_inline(st, &done(true)))?;
        Ok(len as usize)
    }
}

impl Inner {
    fn post_recv(&self, slot: u32) -> Result<()> {
        let s = self.recv.slice(u64::from(slot * MSG_LEN), MSG_LEN)?;
        self.qp.post_recv(RecvWr::new(s).wr_id(u64::from(slot)))?;
        Ok(())
    }

    async fn wait<R>(&self, ready: impl FnMut(&mut State) -> Option<Result<R>>) -> Result<R> {
        self.driver.wait(|st, wc| self.on_wc(st, wc), ready).await
    }

    /// Posts a signalled inline send; on a full send queue, keeps it for later.
    fn send_inline(&self, st: &mut State, m: &[u8]) -> Result<()> {
        match self.qp.post_send(SendWr::send_inline(m)) {
            Ok(()) => {
                st.posted += 1;
                Ok(())
            }
            Err(rdmakit_verbs::Error::QueueFull { .. }) => {
                st.unsent.push_back(m.to_vec());
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    fn post_rwrite(
        &self,
        st: &mut State,
        peer: &Hello,
        src: &LocalSlice,
        block: RemoteBlock,
        len: u64,
    ) -> Result<u64> {
        let dst = block.region().slice(0, len as u32)?;
        let offset = block.addr - peer.ring.addr;
        let r = match peer.notify {
            NotifyMode::WriteImm => {
                let imm =
                    u32::try_from(offset / 8).map_err(|_| ChannelError::Invalid("ring beyond 32 GiB"))?;
                self.qp.post_send(SendWr::write(src.clone(), dst).with_imm(imm))
            }
            NotifyMode::Flag => {
                let slot = st.notes_sent % u64::from(peer.slots);
                let mut h = [0u8; MAILBOX_SLOT as usize];
                h[0..8].copy_from_slice(&offset.to_le_bytes());
                h[8..16].copy_from_slice(&len.to_le_bytes());
                // The sequence word last: the reader polls it.
                h[16..24].copy_from_slice(&(st.notes_sent + 1).to_le_bytes());
                let flag = peer.mailbox.slice(slot * MAILBOX_SLOT, MAILBOX_SLOT as u32)?;
                // Two posts rather than a batch: no allocation per message. (A failure
                // between them is as final as a batch refused part-way.)
                self.qp
                    .post_send(SendWr::write(src.clone(), dst).unsignaled())
                    .and_then(|()| self.qp.post_send(SendWr::write_inline(&h, flag)))
            }
        };
        if let Err(e) = r {
            // The block is lost to the ring; the pipe cannot recover its accounting.
            st.protocol = Some(format!("posting an rwrite failed: {e}"));
            return Err(e.into());
        }
        st.posted += 1;
        st.notes_sent += 1;
        Ok(st.posted)
    }

    /// The next landed block, registered with the owner and taken by the consumer.
    fn next_landed(&self, st: &mut State) -> Option<Result<(u64, u64)>> {
        let ring = self.ring.as_ref()?;
        let (offset, len) = match self.config.notify {
            NotifyMode::WriteImm => st.imm_ready.pop_front()?,
            NotifyMode::Flag => {
                let slot = st.consumed % u64::from(self.config.slots);
                let at = slot * MAILBOX_SLOT;
                let seq = self.mailbox.read_u64(at + 16).ok()?;
                if seq != st.consumed + 1 {
                    return None;
                }
                (self.mailbox.read_u64(at).ok()?, self.mailbox.read_u64(at + 8).ok()?)
            }
        };
        st.consumed += 1;
        let block = RemoteBlock {
            addr: ring.addr() + offset,
            len: len.next_multiple_of(8),
            rkey: ring.rkey(),
            segment: 0,
        };
        let owner = st.owner.as_mut().expect("a ring has an owner");
        let r = owner.register(&AllocNotice::new(HEAP, block)).and_then(|()| owner.consume(block.addr));
        Some(match r {
            Ok(_) => Ok((block.addr, len)),
            Err(e) => {
                st.protocol = Some(format!("the writer sent an invalid block: {e}"));
                Err(e.into())
            }
        })
    }

    /// Blocked on credits: asks the reader once to return what it has freed, then waits.
    fn ask_for_credit<R>(&self, st: &mut State) -> Option<Result<R>> {
        if !st.need_sent {
            st.need_sent = true;
            if let Err(e) = self.send_inline(st, &[TAG_NEED]) {
                return Some(Err(e));
            }
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
            let ring = self.ring.as_ref().map_or(0, |r| r.len() as u64);
            let due = owner.pending_free_blocks() >= (self.config.slots as usize / 4).max(1)
                || owner.pending_free_bytes() >= ring / 4;
            if due {
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
            let batch = owner.take_free_batch(1);
            let mut m = vec![TAG_CREDIT];
            m.extend_from_slice(&st.consumed.to_le_bytes());
            batch.encode_into(&mut m);
            if let Err(e) = self.send_inline(st, &m) {
                tracing::warn!(error = %e, "pipe: returning credit failed");
                return;
            }
        }
    }

    /// Applies one completion to the state.
    fn on_wc(&self, st: &mut State, wc: &WorkCompletion) {
        if !wc.status.is_success() {
            if st.broken.is_none() {
                let what = match wc.opcode {
                    WcOpcode::RECV | WcOpcode::RECV_RDMA_WITH_IMM => "a receive",
                    WcOpcode::RDMA_READ => "an rread",
                    _ => "a send or write",
                };
                st.broken = Some((wc.status, what));
            }
            return;
        }
        match wc.opcode {
            WcOpcode::RECV_RDMA_WITH_IMM => {
                self.repost(st, wc.wr_id);
                let offset = u64::from(wc.imm.unwrap_or(0)) * 8;
                st.imm_ready.push_back((offset, u64::from(wc.byte_len)));
            }
            WcOpcode::RECV => {
                let mut m = [0u8; MSG_LEN as usize];
                let n = (wc.byte_len as usize).min(m.len());
                let slot = wc.wr_id.min(u64::from(RECV_SLOTS - 1));
                let ok = self.recv.read_at(slot * u64::from(MSG_LEN), &mut m[..n]).is_ok();
                self.repost(st, wc.wr_id);
                if ok {
                    if let Err(e) = self.on_message(st, &m[..n]) {
                        st.protocol.get_or_insert(e);
                    }
                }
            }
            _ => {
                st.done += 1;
                // Room on the send queue again: post credits that had to wait.
                while let Some(m) = st.unsent.pop_front() {
                    if self.qp.post_send(SendWr::send_inline(&m)).is_err() {
                        st.unsent.push_front(m);
                        break;
                    }
                    st.posted += 1;
                }
            }
        }
    }

    fn repost(&self, st: &mut State, wr_id: u64) {
        let posted = u32::try_from(wr_id).ok().filter(|s| *s < RECV_SLOTS).map(|s| self.post_recv(s));
        if !matches!(posted, Some(Ok(()))) {
            st.protocol.get_or_insert_with(|| format!("cannot repost receive {wr_id}"));
        }
    }

    fn on_message(&self, st: &mut State, m: &[u8]) -> std::result::Result<(), String> {
        let bad = |what: &str| format!("malformed {what} message ({} bytes)", m.len());
        let u64_at = |i: usize| m.get(i..i + 8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
        match m.first().copied() {
            Some(TAG_HELLO) if m.len() == 46 => {
                let ring = RemoteRegion::decode(&m[1..21]).map_err(|e| e.to_string())?;
                let mailbox = RemoteRegion::decode(&m[21..41]).map_err(|e| e.to_string())?;
                let notify = if m[41] == 1 { NotifyMode::WriteImm } else { NotifyMode::Flag };
                let slots = u32::from_le_bytes(m[42..46].try_into().expect("4 bytes"));
                if st.peer.is_some() || slots == 0 || u64::from(slots) * MAILBOX_SLOT > mailbox.len {
                    return Err(bad("hello"));
                }
                if ring.len > 0 {
                    let mut a = HeapAllocator::new(HeapConfig::new(HEAP, AllocPolicy::NextFit));
                    a.add_segment(RemoteSegment::from(ring)).map_err(|e| e.to_string())?;
                    st.alloc = Some(a);
                }
                st.peer = Some(Hello { ring, mailbox, notify, slots });
                Ok(())
            }
            Some(TAG_CREDIT) => {
                let consumed = u64_at(1).ok_or_else(|| bad("credit"))?;
                if consumed > st.notes_sent {
                    return Err(bad("credit"));
                }
                st.peer_consumed = st.peer_consumed.max(consumed);
                st.need_sent = false;
                if m.len() == 9 {
                    return Ok(()); // notification slots only
                }
                let batch = FreeBatch::decode(&m[9..]).map_err(|e| e.to_string())?;
                let alloc = st.alloc.as_mut().ok_or_else(|| bad("credit"))?;
                alloc.apply_free_batch(&batch).map_err(|e| e.to_string())
            }
            Some(TAG_PUBLISHED) if m.len() == 25 => {
                let id = u64_at(1).ok_or_else(|| bad("publish"))?;
                let addr = u64_at(9).ok_or_else(|| bad("publish"))?;
                let len = u32::from_le_bytes(m[17..21].try_into().expect("4 bytes"));
                let rkey = u32::from_le_bytes(m[21..25].try_into().expect("4 bytes"));
                st.published_in
                    .push_back(Published { id, remote: RemoteRegion { addr, len: u64::from(len), rkey } });
                Ok(())
            }
            Some(TAG_NEED) if m.len() == 1 => {
                // The writer is blocked: return everything freed, even below the batch size,
                // and the notification slots taken so far.
                if st.owner.as_ref().is_some_and(|o| o.pending_free_blocks() > 0) {
                    self.flush_credits(st);
                } else {
                    // Notification slots only: a credit without a free batch.
                    let mut m = vec![TAG_CREDIT];
                    m.extend_from_slice(&st.consumed.to_le_bytes());
                    self.send_inline(st, &m).map_err(|e| e.to_string())?;
                }
                Ok(())
            }
            Some(TAG_READ_DONE) if m.len() == 10 => {
                st.read_done.push((u64_at(1).ok_or_else(|| bad("read-done"))?, m[9] == 1));
                Ok(())
            }
            _ => Err(bad("unknown")),
        }
    }
}

/// Exclusive access to a block that landed in this end's ring. Dropping it (or
/// [`release`](Self::release)) hands the block back to the writer.
pub struct RecvGuard {
    pipe: Arc<Inner>,
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

    fn ring(&self) -> &MemoryRegion {
        self.pipe.ring.as_ref().expect("guards come from a ring")
    }

    /// Copies bytes of the message from `offset` into `out`.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        if offset.checked_add(out.len() as u64).is_none_or(|e| e > self.len) {
            return Err(rdmakit_verbs::Error::OutOfBounds {
                what: "pipe message",
                offset,
                len: out.len() as u64,
                size: self.len,
            }
            .into());
        }
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
