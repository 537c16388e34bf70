//! The control channel every connection of this crate shares: pipes, put handles and heap
//! endpoints send their control messages through one `ControlSlots`, in one numbering of
//! [`Message`]s, with one total decoder ([`Message::decode`]).
//!
//! # Protocol
//!
//! Each end keeps `slots` receive buffers of `slot_len` bytes posted in one registered
//! region (`wr_id` = slot index). A control message is a send into the next posted buffer:
//! inline when it fits the QP's `max_inline_data`, else copied into one of the end's send
//! buffers. A received slot is read, **reposted**, then decoded, in that order, for every
//! completion reaped, so a malformed message never costs a slot or the messages behind it.
//! When the send queue (or every send buffer) is full, messages wait in a bounded backlog,
//! posted in order as sends complete.
//!
//! Every message starts with a tag byte from one table:
//!
//! | tag | message | bytes after the tag |
//! | --- | --- | --- |
//! | `0x01` | [`Message::KeepAlive`] | none |
//! | `0x10` | [`Message::PipeHello`] | ring (20), mailbox (20), notify (u8: 0 flag, 1 write-imm), slots (u32), max ring (u64) |
//! | `0x11` | [`Message::Credit`] | consumed (u64), then an optional free batch |
//! | `0x12` | [`Message::Published`] | id (u64), addr (u64), len (u32), rkey (u32) |
//! | `0x13` | [`Message::ReadDone`] | id (u64), ok (u8: 0 or 1) |
//! | `0x14` | [`Message::NeedCredit`] | none |
//! | `0x20` | [`Message::Assoc`] | handle (u32), ready word addr (u64), rkey (u32), epoch (u32, not 0) |
//! | `0x21` | [`Message::Deassoc`] | handle (u32), epoch (u32) |
//! | `0x40` | [`Message::HeapCreate`] | heap (u32), policy (u8), sync (u8: 0 deferred, 1 immediate), align (u64), len (u64) |
//! | `0x41` | [`Message::HeapGrant`] | heap (u32), base (u64), len (u64), rkey (u32) |
//! | `0x42` | [`Message::HeapRefuse`] | heap (u32), len (u64) |
//! | `0x43` | [`Message::HeapGrow`] | heap (u32), len (u64) |
//! | `0x44` | [`Message::HeapReady`] | heap (u32), addr (u64) |
//! | `0x45` | [`Message::HeapFreed`] | heap (u32) |
//! | `0x46` | [`Message::HeapSync`] | a [`HeapMessage`] (its own encoding) |
//!
//! Integers are little-endian. Every length is checked before a byte is read. Pipes use
//! the heap growth messages (`HeapGrow`, `HeapGrant`, `HeapRefuse`, `HeapFreed`) for their
//! ring, as heap 0.
//!
//! # Liveness
//!
//! One-sided protocols go quiet while they wait: a writer blocked on credits has nothing
//! in flight, so no transport timer runs and a dead reader is never noticed. So an end that
//! waits with nothing in flight sends a [`Message::KeepAlive`] every
//! [`KEEPALIVE_INTERVAL`] (the peer's NIC acknowledges it; the peer discards it when it
//! next polls). A dead peer's NIC answers nothing: the keep-alive's retries run out and it
//! completes with an error (`RETRY_EXC_ERR`, on the soft NIC and on rdma-core alike),
//! which breaks the channel: every blocked operation returns
//! [`ChannelError::Broken`] (see [`ChannelError::is_peer_gone`]). The bound after the
//! peer's death is the interval plus the QP's transport budget,
//! `4.096 µs × 2^timeout × (retry_cnt + 1)` (about 0.47 s with the default
//! `ConnectOptions`).
//!
//! A keep-alive takes one of the peer's receive slots until the peer polls again; the
//! peer reposts it then. A peer that stops polling for long enough lets keep-alives fill
//! its slots; then they wait behind receiver-not-ready NAKs (retried without limit), which
//! is still an alive peer, not an error.
//!
//! # Example: the total decoder
//!
//! ```
//! use rdmakit_channel::{DecodeError, Message};
//!
//! let credit = Message::Credit { consumed: 3, batch: None };
//! assert_eq!(Message::decode(&credit.encode()), Ok(credit));
//! // What a hostile peer sends is an error, never a panic or an out-of-bounds read.
//! assert_eq!(Message::decode(&[]), Err(DecodeError::Empty));
//! assert!(matches!(Message::decode(&[0x7f]), Err(DecodeError::UnknownTag(0x7f))));
//! assert!(matches!(Message::decode(&[0x11, 1, 2]), Err(DecodeError::Length { .. })));
//! ```

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rdmakit_memory::heap::{AllocPolicy, FreeBatch, HeapConfig, HeapId, HeapMessage, SyncMode, WireError};
use rdmakit_verbs::{
    AccessFlags, CompletionQueue, MemoryRegion, QueuePair, RecvWr, RemoteRegion, RemoteSlice, SendWr,
    WcOpcode, WcStatus, WorkCompletion,
};

use crate::error::{ChannelError, Result};
use crate::pipe::NotifyMode;

/// How often an end that waits with nothing in flight sends a keep-alive.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_millis(100);

/// Most requests [`ControlSlots::post_lazy`] posts unsignalled in a row.
const MAX_UNSIGNALED_RUN: u32 = 16;

/// The shallowest send queue a channel takes: requests posted without a CQ poll first keep
/// within half of it, and a pipe's flag-mode rwrite and a sequenced put post two at once.
pub const MIN_SEND_WR: u32 = 4;

/// Bytes per pipe mailbox slot: `offset u64, len u64, seq u64`.
pub(crate) const MAILBOX_SLOT: u64 = 24;

mod tag {
    pub const KEEP_ALIVE: u8 = 0x01;
    pub const PIPE_HELLO: u8 = 0x10;
    pub const CREDIT: u8 = 0x11;
    pub const PUBLISHED: u8 = 0x12;
    pub const READ_DONE: u8 = 0x13;
    pub const NEED_CREDIT: u8 = 0x14;
    pub const ASSOC: u8 = 0x20;
    pub const DEASSOC: u8 = 0x21;
    pub const HEAP_CREATE: u8 = 0x40;
    pub const HEAP_GRANT: u8 = 0x41;
    pub const HEAP_REFUSE: u8 = 0x42;
    pub const HEAP_GROW: u8 = 0x43;
    pub const HEAP_READY: u8 = 0x44;
    pub const HEAP_FREED: u8 = 0x45;
    pub const HEAP_SYNC: u8 = 0x46;
}

/// Every control message of the crate's protocols (the table in the [module docs](self)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Message {
    /// Liveness probe; carries nothing and is discarded on arrival.
    KeepAlive,
    /// Pipe: this end's receive ring (empty: none), mailbox, notification mode and slots.
    PipeHello {
        /// The receive ring (`len == 0`: this end only sends).
        ring: RemoteRegion,
        /// The flag-mode mailbox: `slots` × 24 bytes.
        mailbox: RemoteRegion,
        /// How this end wants to be notified.
        notify: NotifyMode,
        /// Notifications this end accepts before it returns credits.
        slots: u32,
        /// Most bytes the ring may grow to when asked (`<= ring.len`: it never grows).
        max_ring: u64,
    },
    /// Pipe: the reader has consumed `consumed` notifications, and frees these ranges.
    Credit {
        /// Notifications consumed so far.
        consumed: u64,
        /// Ranges of the ring freed, if any.
        batch: Option<FreeBatch>,
    },
    /// Pipe: a slice published for the peer to `rread`.
    Published {
        /// The publication's number.
        id: u64,
        /// Where to read it.
        remote: RemoteSlice,
    },
    /// Pipe: publication `id` has been read (`ok`) or refused.
    ReadDone {
        /// The publication.
        id: u64,
        /// Whether it was read.
        ok: bool,
    },
    /// Pipe: the writer is blocked; return every credit now.
    NeedCredit,
    /// Put: a sender associated with receive handle `handle` in epoch `epoch`.
    Assoc {
        /// The receiver's handle.
        handle: u32,
        /// The sender's ready word (8 bytes).
        ready: RemoteSlice,
        /// The association's epoch (never 0).
        epoch: u32,
    },
    /// Put: the association `epoch` of `handle` ended.
    Deassoc {
        /// The receiver's handle.
        handle: u32,
        /// The association's epoch.
        epoch: u32,
    },
    /// Heap: make this heap with a first segment of at least `len` bytes.
    HeapCreate {
        /// The heap's parameters.
        config: HeapConfig,
        /// Bytes wanted.
        len: u64,
    },
    /// Heap: a new segment.
    HeapGrant {
        /// The heap.
        heap: HeapId,
        /// The segment.
        segment: RemoteRegion,
    },
    /// Heap: no segment of `len` bytes.
    HeapRefuse {
        /// The heap.
        heap: HeapId,
        /// Bytes that were asked for.
        len: u64,
    },
    /// Heap: the heap is full, a segment of at least `len` bytes please.
    HeapGrow {
        /// The heap.
        heap: HeapId,
        /// Bytes wanted.
        len: u64,
    },
    /// Heap (immediate mode): the data of the acknowledged block at `addr` has landed.
    HeapReady {
        /// The heap.
        heap: HeapId,
        /// The block's address.
        addr: u64,
    },
    /// Heap: answer to a growth request: frees were just sent, try again.
    HeapFreed {
        /// The heap.
        heap: HeapId,
    },
    /// Heap: an allocator/owner synchronisation message.
    HeapSync(HeapMessage),
}

/// A control message that does not decode.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// No bytes at all.
    #[error("empty control message")]
    Empty,
    /// A tag no message has.
    #[error("unknown control message tag {0:#04x}")]
    UnknownTag(u8),
    /// The wrong length for its kind.
    #[error("{what} message of {got} bytes, expected {expected}")]
    Length {
        /// The message kind.
        what: &'static str,
        /// Bytes it has.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// A field out of its range.
    #[error("{what} message: {reason}")]
    Invalid {
        /// The message kind.
        what: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// A heap synchronisation message (or a credit's free batch) that does not decode.
    #[error("heap message: {0}")]
    Heap(#[from] WireError),
    /// Longer than a receive slot (a peer that ignores the slot length).
    #[error("control message of {got} bytes exceeds the {limit}-byte slot")]
    TooLong {
        /// Bytes received.
        got: u64,
        /// The slot length.
        limit: u32,
    },
}

/// Little-endian reads over a message whose length was checked first.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn u8(&mut self) -> u8 {
        let (v, rest) = self.0.split_first().expect("length checked before reading");
        self.0 = rest;
        *v
    }

    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let (v, rest) = self.0.split_at(N);
        self.0 = rest;
        v.try_into().expect("split at N")
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes())
    }

    fn region(&mut self) -> RemoteRegion {
        RemoteRegion { addr: self.u64(), len: self.u64(), rkey: self.u32() }
    }

    fn heap(&mut self) -> HeapId {
        HeapId(self.u32())
    }
}

fn exact(what: &'static str, m: &[u8], body: usize) -> std::result::Result<(), DecodeError> {
    if m.len() == 1 + body {
        Ok(())
    } else {
        Err(DecodeError::Length { what, expected: 1 + body, got: m.len() })
    }
}

fn policy_code(p: AllocPolicy) -> u8 {
    match p {
        AllocPolicy::NextFit => 0,
        AllocPolicy::FirstFit => 1,
        AllocPolicy::BestFit => 2,
        AllocPolicy::WorstFit => 3,
    }
}

impl Message {
    /// Appends the encoding to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let region = |out: &mut Vec<u8>, r: &RemoteRegion| out.extend_from_slice(&r.encode());
        match self {
            Message::KeepAlive => out.push(tag::KEEP_ALIVE),
            Message::PipeHello { ring, mailbox, notify, slots, max_ring } => {
                out.push(tag::PIPE_HELLO);
                region(out, ring);
                region(out, mailbox);
                out.push(u8::from(*notify == NotifyMode::WriteImm));
                out.extend_from_slice(&slots.to_le_bytes());
                out.extend_from_slice(&max_ring.to_le_bytes());
            }
            Message::Credit { consumed, batch } => {
                out.push(tag::CREDIT);
                out.extend_from_slice(&consumed.to_le_bytes());
                if let Some(b) = batch {
                    b.encode_into(out);
                }
            }
            Message::Published { id, remote } => {
                out.push(tag::PUBLISHED);
                out.extend_from_slice(&id.to_le_bytes());
                out.extend_from_slice(&remote.addr.to_le_bytes());
                out.extend_from_slice(&remote.len.to_le_bytes());
                out.extend_from_slice(&remote.rkey.to_le_bytes());
            }
            Message::ReadDone { id, ok } => {
                out.push(tag::READ_DONE);
                out.extend_from_slice(&id.to_le_bytes());
                out.push(u8::from(*ok));
            }
            Message::NeedCredit => out.push(tag::NEED_CREDIT),
            Message::Assoc { handle, ready, epoch } => {
                out.push(tag::ASSOC);
                out.extend_from_slice(&handle.to_le_bytes());
                out.extend_from_slice(&ready.addr.to_le_bytes());
                out.extend_from_slice(&ready.rkey.to_le_bytes());
                out.extend_from_slice(&epoch.to_le_bytes());
            }
            Message::Deassoc { handle, epoch } => {
                out.push(tag::DEASSOC);
                out.extend_from_slice(&handle.to_le_bytes());
                out.extend_from_slice(&epoch.to_le_bytes());
            }
            Message::HeapCreate { config, len } => {
                out.push(tag::HEAP_CREATE);
                out.extend_from_slice(&config.heap().0.to_le_bytes());
                out.push(policy_code(config.policy()));
                out.push(u8::from(config.sync() == SyncMode::Immediate));
                out.extend_from_slice(&config.align().to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
            }
            Message::HeapGrant { heap, segment } => {
                out.push(tag::HEAP_GRANT);
                out.extend_from_slice(&heap.0.to_le_bytes());
                out.extend_from_slice(&segment.addr.to_le_bytes());
                out.extend_from_slice(&segment.len.to_le_bytes());
                out.extend_from_slice(&segment.rkey.to_le_bytes());
            }
            Message::HeapRefuse { heap, len } | Message::HeapGrow { heap, len } => {
                out.push(if matches!(self, Message::HeapRefuse { .. }) {
                    tag::HEAP_REFUSE
                } else {
                    tag::HEAP_GROW
                });
                out.extend_from_slice(&heap.0.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
            }
            Message::HeapReady { heap, addr } => {
                out.push(tag::HEAP_READY);
                out.extend_from_slice(&heap.0.to_le_bytes());
                out.extend_from_slice(&addr.to_le_bytes());
            }
            Message::HeapFreed { heap } => {
                out.push(tag::HEAP_FREED);
                out.extend_from_slice(&heap.0.to_le_bytes());
            }
            Message::HeapSync(m) => {
                out.push(tag::HEAP_SYNC);
                out.extend_from_slice(&m.encode());
            }
        }
    }

    /// The encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.encode_into(&mut v);
        v
    }

    /// Decodes one message. Total: any byte string gives a message or a [`DecodeError`],
    /// never a panic; every length is checked before a field is read.
    pub fn decode(m: &[u8]) -> std::result::Result<Message, DecodeError> {
        let (&t, _) = m.split_first().ok_or(DecodeError::Empty)?;
        let mut f = Fields(&m[1..]);
        Ok(match t {
            tag::KEEP_ALIVE => {
                exact("keep-alive", m, 0)?;
                Message::KeepAlive
            }
            tag::PIPE_HELLO => {
                exact("pipe hello", m, 20 + 20 + 1 + 4 + 8)?;
                let (ring, mailbox) = (f.region(), f.region());
                let notify = match f.u8() {
                    0 => NotifyMode::Flag,
                    1 => NotifyMode::WriteImm,
                    _ => {
                        return Err(DecodeError::Invalid {
                            what: "pipe hello",
                            reason: "unknown notify mode",
                        });
                    }
                };
                let slots = f.u32();
                let room = u64::from(slots).checked_mul(MAILBOX_SLOT);
                if slots == 0 || room.is_none_or(|r| r > mailbox.len) {
                    return Err(DecodeError::Invalid {
                        what: "pipe hello",
                        reason: "slots do not fit the mailbox",
                    });
                }
                if ring.addr.checked_add(ring.len).is_none()
                    || mailbox.addr.checked_add(mailbox.len).is_none()
                {
                    return Err(DecodeError::Invalid { what: "pipe hello", reason: "region overflows" });
                }
                let max_ring = f.u64();
                Message::PipeHello { ring, mailbox, notify, slots, max_ring }
            }
            tag::CREDIT => {
                if m.len() < 9 {
                    return Err(DecodeError::Length { what: "credit", expected: 9, got: m.len() });
                }
                let consumed = f.u64();
                let batch = if m.len() == 9 { None } else { Some(FreeBatch::decode(&m[9..])?) };
                Message::Credit { consumed, batch }
            }
            tag::PUBLISHED => {
                exact("publish", m, 8 + 8 + 4 + 4)?;
                let id = f.u64();
                let remote = RemoteSlice { addr: f.u64(), len: f.u32(), rkey: f.u32() };
                if remote.addr.checked_add(u64::from(remote.len)).is_none() {
                    return Err(DecodeError::Invalid { what: "publish", reason: "region overflows" });
                }
                Message::Published { id, remote }
            }
            tag::READ_DONE => {
                exact("read-done", m, 8 + 1)?;
                let id = f.u64();
                let ok = match f.u8() {
                    0 => false,
                    1 => true,
                    _ => {
                        return Err(DecodeError::Invalid { what: "read-done", reason: "flag is not 0 or 1" });
                    }
                };
                Message::ReadDone { id, ok }
            }
            tag::NEED_CREDIT => {
                exact("need-credit", m, 0)?;
                Message::NeedCredit
            }
            tag::ASSOC => {
                exact("associate", m, 4 + 8 + 4 + 4)?;
                let handle = f.u32();
                let ready = RemoteSlice { addr: f.u64(), len: 8, rkey: f.u32() };
                let epoch = f.u32();
                if epoch == 0 {
                    return Err(DecodeError::Invalid { what: "associate", reason: "epoch 0" });
                }
                Message::Assoc { handle, ready, epoch }
            }
            tag::DEASSOC => {
                exact("deassociate", m, 4 + 4)?;
                Message::Deassoc { handle: f.u32(), epoch: f.u32() }
            }
            tag::HEAP_CREATE => {
                exact("heap create", m, 4 + 1 + 1 + 8 + 8)?;
                let heap = f.heap();
                let policy = AllocPolicy::ALL
                    .get(usize::from(f.u8()))
                    .copied()
                    .ok_or(DecodeError::Invalid { what: "heap create", reason: "unknown policy" })?;
                let sync = match f.u8() {
                    0 => SyncMode::Deferred,
                    1 => SyncMode::Immediate,
                    _ => {
                        return Err(DecodeError::Invalid {
                            what: "heap create",
                            reason: "unknown sync mode",
                        });
                    }
                };
                let config =
                    HeapConfig::new(heap, policy).with_sync(sync).with_align(f.u64()).map_err(|_| {
                        DecodeError::Invalid { what: "heap create", reason: "alignment not a power of two" }
                    })?;
                Message::HeapCreate { config, len: f.u64() }
            }
            tag::HEAP_GRANT => {
                exact("heap grant", m, 4 + 8 + 8 + 4)?;
                let heap = f.heap();
                let segment = RemoteRegion::new(f.u64(), f.u64(), f.u32());
                if segment.end().is_none() {
                    return Err(DecodeError::Invalid { what: "heap grant", reason: "segment overflows" });
                }
                Message::HeapGrant { heap, segment }
            }
            tag::HEAP_REFUSE => {
                exact("heap refuse", m, 4 + 8)?;
                Message::HeapRefuse { heap: f.heap(), len: f.u64() }
            }
            tag::HEAP_GROW => {
                exact("heap grow", m, 4 + 8)?;
                Message::HeapGrow { heap: f.heap(), len: f.u64() }
            }
            tag::HEAP_READY => {
                exact("heap ready", m, 4 + 8)?;
                Message::HeapReady { heap: f.heap(), addr: f.u64() }
            }
            tag::HEAP_FREED => {
                exact("heap freed", m, 4)?;
                Message::HeapFreed { heap: f.heap() }
            }
            tag::HEAP_SYNC => Message::HeapSync(HeapMessage::decode(&m[1..])?),
            other => return Err(DecodeError::UnknownTag(other)),
        })
    }
}

/// The shape of one end's control channel.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ControlConfig {
    /// Receive slots kept posted.
    pub slots: u32,
    /// Bytes per slot: the longest message accepted.
    pub slot_len: u32,
    /// Send buffers for messages longer than the QP's inline limit (0: inline only).
    pub send_slots: u32,
    /// Most messages waiting for room on the send queue.
    pub backlog: usize,
    /// Keep-alive interval while waiting with nothing in flight.
    pub keepalive: Duration,
}

impl ControlConfig {
    /// `slots` receive slots of `slot_len` bytes, inline sends only, a backlog of at most
    /// `backlog` messages, keep-alives every [`KEEPALIVE_INTERVAL`].
    pub fn new(slots: u32, slot_len: u32, backlog: usize) -> ControlConfig {
        ControlConfig { slots, slot_len, send_slots: 0, backlog, keepalive: KEEPALIVE_INTERVAL }
    }
}

/// What a completion meant, once the control channel has applied its part.
#[derive(Debug)]
pub(crate) enum Event {
    /// A control message (keep-alives are not reported).
    Message(Message),
    /// A control message that did not decode (its slot is reposted all the same).
    Malformed(DecodeError),
    /// A write with immediate landed (its slot is reposted).
    Imm {
        /// The immediate.
        imm: u32,
        /// Bytes written.
        byte_len: u32,
    },
}

#[derive(Clone, Debug)]
enum Failure {
    Broken(WcStatus, &'static str),
    Malformed(DecodeError),
    Protocol(String),
}

/// One end's control channel over a connected RC QP: its receive slots, send buffers and
/// backlog, the count of signalled requests in flight, and liveness (see the
/// [module docs](self)). Every signalled request on the QP must be posted through it.
pub(crate) struct ControlSlots {
    qp: QueuePair,
    cfg: ControlConfig,
    recv: MemoryRegion,
    send: Option<MemoryRegion>,
    inline_max: usize,
    /// Signalled send-queue requests posted and completed (they complete in order).
    posted: u64,
    done: u64,
    /// Send buffers in use, oldest first, with the ticket that frees each.
    send_busy: VecDeque<(u32, u64)>,
    next_send: u32,
    backlog: VecDeque<Vec<u8>>,
    failure: Option<Failure>,
    /// Requests posted in a row without a signalled one (by `post_unsignaled` and
    /// `post_lazy`), and the most `post_lazy` lets run before it signals one.
    unsignaled_run: u32,
    signal_every: u32,
    /// Every request posted so far: posting reads no clock; [`tick`](Self::tick) notices
    /// that this moved and dates the activity (see there).
    sent: u64,
    /// `sent` when `tick` last looked, and when that was.
    sent_at_tick: u64,
    last_tick: Instant,
    /// When the last request went out, as `tick` dates it (never later than the truth).
    last_sent: Instant,
    scratch: Vec<u8>,
    keepalives: u64,
}

impl std::fmt::Debug for ControlSlots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlSlots")
            .field("cfg", &self.cfg)
            .field("posted", &self.posted)
            .field("done", &self.done)
            .field("backlog", &self.backlog.len())
            .field("failure", &self.failure)
            .finish()
    }
}

impl ControlSlots {
    /// Allocates the slot region (and send buffers) on `qp`'s PD and posts every slot.
    pub fn new(qp: QueuePair, cfg: ControlConfig) -> Result<ControlSlots> {
        let send_wr = qp.caps().max_send_wr;
        if send_wr < MIN_SEND_WR {
            return Err(ChannelError::QueueTooSmall {
                what: "send queue (max_send_wr; half of it for requests posted without a poll)",
                needed: u64::from(MIN_SEND_WR),
                got: u64::from(send_wr),
            });
        }
        if qp.caps().max_recv_wr < cfg.slots {
            return Err(ChannelError::Invalid("the QP's max_recv_wr is below the control slots"));
        }
        let len = |n: u32| -> Result<usize> {
            usize::try_from(u64::from(n) * u64::from(cfg.slot_len))
                .map_err(|_| ChannelError::Invalid("control slots too large"))
        };
        let pd = qp.pd().clone();
        let recv = pd.alloc_mr(len(cfg.slots)?, AccessFlags::LOCAL_WRITE)?;
        let send = match cfg.send_slots {
            0 => None,
            n => Some(pd.alloc_mr(len(n)?, AccessFlags::LOCAL_WRITE)?),
        };
        let inline_max = (qp.caps().max_inline_data as usize).min(cfg.slot_len as usize);
        // A quarter of the send queue at most, so that the requests one signalled
        // completion retires never hold much of it.
        let signal_every = (qp.caps().max_send_wr / 4).clamp(1, MAX_UNSIGNALED_RUN);
        let now = Instant::now();
        let c = ControlSlots {
            qp,
            cfg,
            recv,
            send,
            inline_max,
            posted: 0,
            done: 0,
            send_busy: VecDeque::new(),
            next_send: 0,
            backlog: VecDeque::new(),
            failure: None,
            unsignaled_run: 0,
            signal_every,
            sent: 0,
            sent_at_tick: 0,
            last_tick: now,
            last_sent: now,
            scratch: Vec::with_capacity(64),
            keepalives: 0,
        };
        for slot in 0..cfg.slots {
            c.post_recv(slot)?;
        }
        Ok(c)
    }

    fn post_recv(&self, slot: u32) -> Result<()> {
        let s = self.recv.slice(u64::from(slot) * u64::from(self.cfg.slot_len), self.cfg.slot_len)?;
        self.qp.post_recv(RecvWr::new(s).wr_id(u64::from(slot)))?;
        Ok(())
    }

    /// The QP.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// Checks that `cq`, which takes every completion of this channel's QP, can hold them
    /// all at once: a signalled request per send-queue entry and a completed receive per
    /// control slot. A smaller one could overrun (a burst of associations, say, before the
    /// next poll), which breaks the endpoint for good.
    pub fn check_cq(&self, cq: &CompletionQueue) -> Result<()> {
        let needed = u64::from(self.qp.caps().max_send_wr) + u64::from(self.cfg.slots);
        if u64::from(cq.capacity()) < needed {
            return Err(ChannelError::QueueTooSmall {
                what: "completion queue (the QP's max_send_wr plus the endpoint's receive slots)",
                needed,
                got: u64::from(cq.capacity()),
            });
        }
        Ok(())
    }

    /// Whether `n` more requests may be posted without polling the CQ first: they leave
    /// half the send queue free for what the completions not yet reaped still hold (a
    /// snapshot of the in-flight count, exact when this thread alone posts and polls).
    pub fn room_for(&self, n: usize) -> bool {
        self.qp.outstanding_sends() + n <= self.qp.caps().max_send_wr as usize / 2
    }

    /// Whether `n` more requests fit in the send queue at all (after a poll: what is still
    /// outstanding then really is).
    pub fn fits(&self, n: usize) -> bool {
        self.qp.outstanding_sends() + n <= self.qp.caps().max_send_wr as usize
    }

    /// The keep-alive interval.
    pub fn keepalive_interval(&self) -> Duration {
        self.cfg.keepalive
    }

    /// Keep-alives sent so far.
    #[allow(dead_code)]
    pub fn keepalives(&self) -> u64 {
        self.keepalives
    }

    /// Nothing in flight and nothing waiting to be posted.
    pub fn idle(&self) -> bool {
        self.posted == self.done && self.backlog.is_empty()
    }

    /// Requests posted so far (messages, keep-alives, the owner's own requests).
    #[cfg(test)]
    pub fn requests_sent(&self) -> u64 {
        self.sent
    }

    /// Messages waiting in the backlog.
    #[cfg(test)]
    pub fn backlog_len(&self) -> usize {
        self.backlog.len()
    }

    /// Whether a message can be sent now: posted, or queued in the backlog (which is not
    /// full). A message that cannot is the caller's to keep and send later.
    pub fn can_send(&self) -> bool {
        self.backlog.len() < self.cfg.backlog
    }

    /// [`can_send`](Self::can_send) as a result: the error a send would give now. Asked
    /// before a change of state that a message must carry, so that no room means no change.
    pub fn ensure_room(&self) -> Result<()> {
        if self.can_send() {
            return Ok(());
        }
        Err(ChannelError::TooLarge {
            what: "control backlog",
            len: self.backlog.len() as u64 + 1,
            limit: self.cfg.backlog as u64,
        })
    }

    /// Signalled requests completed so far (tickets at or below are done).
    pub fn done(&self) -> u64 {
        self.done
    }

    /// Signalled requests posted so far: the next one's ticket is one more.
    pub fn posted(&self) -> u64 {
        self.posted
    }

    /// Sends a keep-alive, signalled, and returns a ticket that completes no earlier than
    /// it: once [`done`](Self::done) reaches it, every request posted before this call has
    /// completed (RC completes in order), unsignalled ones included.
    pub fn fence(&mut self) -> Result<u64> {
        self.send(&Message::KeepAlive)?;
        // Control messages go out in order, so the keep-alive's ticket is at least this.
        Ok(self.posted + self.backlog.len() as u64)
    }

    /// Broken (a failed request) or a protocol violation: the error every later
    /// operation returns.
    pub fn check(&self) -> Result<()> {
        match &self.failure {
            None => Ok(()),
            Some(Failure::Broken(status, what)) => Err(ChannelError::Broken { status: *status, what }),
            Some(Failure::Malformed(e)) => Err(ChannelError::Malformed(e.clone())),
            Some(Failure::Protocol(p)) => Err(ChannelError::Protocol(p.clone())),
        }
    }

    /// Records a protocol violation (the first one sticks).
    pub fn fail(&mut self, why: String) {
        self.failure.get_or_insert(Failure::Protocol(why));
    }

    /// Records a message that did not decode, for protocols where that ends the
    /// connection (the first failure sticks).
    pub fn fail_malformed(&mut self, e: DecodeError) {
        self.failure.get_or_insert(Failure::Malformed(e));
    }

    /// Posts a signalled request; returns its ticket (complete once [`done`](Self::done)
    /// reaches it).
    #[inline]
    pub fn post(&mut self, wr: SendWr<'_>) -> Result<u64> {
        self.qp.post_send(wr)?;
        self.posted += 1;
        self.sent += 1;
        self.unsignaled_run = 0;
        Ok(self.posted)
    }

    /// Posts an unsignalled request (a later signalled one on the same QP reports it).
    #[inline]
    pub fn post_unsignaled(&mut self, wr: SendWr<'_>) -> Result<()> {
        self.qp.post_send(wr.unsignaled())?;
        self.sent += 1;
        self.unsignaled_run = self.unsignaled_run.saturating_add(1);
        Ok(())
    }

    /// Posts a request nobody waits for: unsignalled, except one in every
    /// `min(max_send_wr / 4, 16)` in a row, which retires those before it from the send
    /// queue (RC completes in order). A failed request still completes, with an error,
    /// which breaks the channel as a signalled one would.
    #[inline]
    pub fn post_lazy(&mut self, wr: SendWr<'_>) -> Result<()> {
        if self.unsignaled_run + 1 >= self.signal_every {
            self.post(wr).map(drop)
        } else {
            self.post_unsignaled(wr)
        }
    }

    /// Posts `first` unsignalled and then `then`, signalled, with one provider call (one
    /// doorbell): a data write and the write that announces it. Returns `then`'s ticket.
    pub fn post_two(&mut self, first: SendWr<'_>, then: SendWr<'_>) -> Result<u64> {
        self.post_pair(first, then, true)?;
        Ok(self.posted)
    }

    /// [`post_two`](Self::post_two) for requests nobody waits for: `then` is signalled as
    /// [`post_lazy`](Self::post_lazy) would choose.
    pub fn post_two_lazy(&mut self, first: SendWr<'_>, then: SendWr<'_>) -> Result<()> {
        // As `post_unsignaled(first)` then `post_lazy(then)` would decide.
        let signal = self.unsignaled_run + 2 >= self.signal_every;
        self.post_pair(first, then, signal)
    }

    fn post_pair(&mut self, first: SendWr<'_>, then: SendWr<'_>, signal: bool) -> Result<()> {
        let then = if signal { then } else { then.unsignaled() };
        if let Err(e) = self.qp.post_send_array([first.unsignaled(), then]) {
            if let rdmakit_verbs::Error::Post { posted, .. } = &e {
                // `first` went; a later signalled request reports it.
                self.sent += *posted as u64;
                self.unsignaled_run = self.unsignaled_run.saturating_add(*posted as u32);
            }
            return Err(e.into());
        }
        self.sent += 2;
        if signal {
            self.posted += 1;
            self.unsignaled_run = 0;
        } else {
            self.unsignaled_run = self.unsignaled_run.saturating_add(2);
        }
        Ok(())
    }

    /// Sends `m`, or queues it behind earlier ones when the send queue is full.
    pub fn send(&mut self, m: &Message) -> Result<()> {
        self.send_with(m, true)
    }

    /// [`send`](Self::send) for a message sent at most once per thing the caller holds (a
    /// deassociation, once per associated handle): queued even beyond the backlog's bound,
    /// which the number of those things bounds instead, so that ending something never fails
    /// for want of room.
    pub fn send_owed(&mut self, m: &Message) -> Result<()> {
        self.send_with(m, false)
    }

    fn send_with(&mut self, m: &Message, bounded: bool) -> Result<()> {
        let mut bytes = std::mem::take(&mut self.scratch);
        bytes.clear();
        m.encode_into(&mut bytes);
        let r = self.send_bytes(&bytes, bounded);
        self.scratch = bytes;
        r
    }

    fn send_bytes(&mut self, bytes: &[u8], bounded: bool) -> Result<()> {
        if bytes.len() > self.cfg.slot_len as usize {
            return Err(ChannelError::TooLarge {
                what: "control message",
                len: bytes.len() as u64,
                limit: u64::from(self.cfg.slot_len),
            });
        }
        if self.backlog.is_empty() && self.try_post(bytes)? {
            return Ok(());
        }
        if bounded && self.backlog.len() >= self.cfg.backlog {
            return Err(ChannelError::TooLarge {
                what: "control backlog",
                len: self.backlog.len() as u64 + 1,
                limit: self.cfg.backlog as u64,
            });
        }
        self.backlog.push_back(bytes.to_vec());
        Ok(())
    }

    /// Posts `bytes` now if the send queue (and a send buffer, if needed) has room.
    fn try_post(&mut self, bytes: &[u8]) -> Result<bool> {
        let r = if bytes.len() <= self.inline_max {
            self.qp.post_send(SendWr::send_inline(bytes))
        } else {
            let Some(send) = &self.send else {
                return Err(ChannelError::Invalid("control message longer than the QP's inline limit"));
            };
            while self.send_busy.front().is_some_and(|&(_, t)| t <= self.done) {
                self.send_busy.pop_front();
            }
            if self.send_busy.len() >= self.cfg.send_slots as usize {
                return Ok(false);
            }
            let slot = self.next_send;
            let at = u64::from(slot) * u64::from(self.cfg.slot_len);
            send.write_at(at, bytes)?;
            let wr = SendWr::send(send.slice(at, bytes.len() as u32)?);
            let r = self.qp.post_send(wr);
            if r.is_ok() {
                self.next_send = (slot + 1) % self.cfg.send_slots;
                self.send_busy.push_back((slot, self.posted + 1));
            }
            r
        };
        match r {
            Ok(()) => {
                self.posted += 1;
                self.sent += 1;
                self.unsignaled_run = 0;
                Ok(true)
            }
            Err(rdmakit_verbs::Error::QueueFull { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Posts what waits in the backlog, in order, while there is room.
    fn flush_backlog(&mut self) {
        while let Some(m) = self.backlog.pop_front() {
            match self.try_post(&m) {
                Ok(true) => {}
                Ok(false) => {
                    self.backlog.push_front(m);
                    return;
                }
                Err(e) => {
                    self.fail(format!("posting a control message failed: {e}"));
                    return;
                }
            }
        }
    }

    /// Applies one completion: counts finished sends (posting the backlog behind them),
    /// reads, reposts and decodes a received slot, and records a failed request. Returns
    /// what the owner must act on.
    pub fn on_wc(&mut self, wc: &WorkCompletion) -> Option<Event> {
        if !wc.status.is_success() {
            if !matches!(self.failure, Some(Failure::Broken(..))) {
                let what = match wc.opcode {
                    WcOpcode::RECV | WcOpcode::RECV_RDMA_WITH_IMM => "a receive",
                    WcOpcode::RDMA_READ => "an RDMA read",
                    _ => "a send, write or keep-alive",
                };
                // A failed request outranks a protocol error: it says the peer is gone.
                self.failure = Some(Failure::Broken(wc.status, what));
            }
            return None;
        }
        match wc.opcode {
            WcOpcode::RECV_RDMA_WITH_IMM => {
                self.repost(wc.wr_id);
                Some(Event::Imm { imm: wc.imm.unwrap_or(0), byte_len: wc.byte_len })
            }
            WcOpcode::RECV => {
                let Some(slot) = u32::try_from(wc.wr_id).ok().filter(|s| *s < self.cfg.slots) else {
                    self.fail(format!("a receive completion names slot {}", wc.wr_id));
                    return None;
                };
                let n = wc.byte_len;
                let read = if n > self.cfg.slot_len {
                    Err(DecodeError::TooLong { got: u64::from(n), limit: self.cfg.slot_len })
                } else {
                    let mut m = std::mem::take(&mut self.scratch);
                    m.clear();
                    m.resize(n as usize, 0);
                    let at = u64::from(slot) * u64::from(self.cfg.slot_len);
                    let r = match self.recv.read_at(at, &mut m) {
                        Ok(()) => Message::decode(&m),
                        Err(_) => Err(DecodeError::TooLong { got: u64::from(n), limit: self.cfg.slot_len }),
                    };
                    self.scratch = m;
                    r
                };
                self.repost(wc.wr_id);
                match read {
                    Ok(Message::KeepAlive) => None,
                    Ok(m) => Some(Event::Message(m)),
                    Err(e) => Some(Event::Malformed(e)),
                }
            }
            _ => {
                self.done += 1;
                self.flush_backlog();
                None
            }
        }
    }

    fn repost(&mut self, wr_id: u64) {
        let posted = u32::try_from(wr_id).ok().filter(|s| *s < self.cfg.slots).map(|s| self.post_recv(s));
        if !matches!(posted, Some(Ok(()))) {
            self.fail(format!("cannot repost receive slot {wr_id}"));
        }
    }

    /// Called while an operation waits: posts the backlog, and sends a keep-alive when
    /// nothing is in flight and none was sent for an interval.
    ///
    /// Posting reads no clock: a request posted since the previous tick is dated at that
    /// tick (it went out between the two), which is never later than the truth, so a
    /// keep-alive is due at most one interval after the last request (possibly sooner),
    /// and tick-to-tick at most one per interval.
    pub fn tick(&mut self) {
        let now = Instant::now();
        if self.sent != self.sent_at_tick {
            self.sent_at_tick = self.sent;
            self.last_sent = self.last_tick;
        }
        self.last_tick = now;
        self.flush_backlog();
        if self.failure.is_some() || self.posted != self.done || !self.backlog.is_empty() {
            return;
        }
        if now.saturating_duration_since(self.last_sent) < self.cfg.keepalive {
            return;
        }
        self.keepalives += 1;
        if let Err(e) = self.send(&Message::KeepAlive) {
            self.fail(format!("posting a keep-alive failed: {e}"));
        }
        self.sent_at_tick = self.sent;
        self.last_sent = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmakit_memory::heap::{AllocNotice, FreeRange, RemoteBlock};

    fn samples() -> Vec<Message> {
        let r = RemoteRegion { addr: 0x1000, len: 4096, rkey: 7 };
        let batch = FreeBatch::new(HeapId(3), 0, vec![FreeRange { addr: 0x1000, len: 64 }]).unwrap();
        let block = RemoteBlock { addr: 0x1000, len: 64, rkey: 7, segment: 0 };
        vec![
            Message::KeepAlive,
            Message::PipeHello { ring: r, mailbox: r, notify: NotifyMode::Flag, slots: 4, max_ring: 1 << 30 },
            Message::Credit { consumed: 9, batch: None },
            Message::Credit { consumed: 9, batch: Some(batch.clone()) },
            Message::Published { id: 1, remote: RemoteSlice { addr: 5, len: 6, rkey: 7 } },
            Message::ReadDone { id: 2, ok: true },
            Message::NeedCredit,
            Message::Assoc { handle: 1, ready: RemoteSlice { addr: 8, len: 8, rkey: 9 }, epoch: 3 },
            Message::Deassoc { handle: 1, epoch: 3 },
            Message::HeapCreate {
                config: HeapConfig::new(HeapId(1), AllocPolicy::BestFit).with_align(64).unwrap(),
                len: 1 << 20,
            },
            Message::HeapGrant { heap: HeapId(1), segment: RemoteRegion::new(0x1000, 4096, 3) },
            Message::HeapRefuse { heap: HeapId(1), len: 5 },
            Message::HeapGrow { heap: HeapId(1), len: 6 },
            Message::HeapReady { heap: HeapId(1), addr: 0x1000 },
            Message::HeapFreed { heap: HeapId(1) },
            Message::HeapSync(HeapMessage::FreeBatch(batch)),
            Message::HeapSync(HeapMessage::AllocNotice(AllocNotice::new(HeapId(1), block))),
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for m in samples() {
            assert_eq!(Message::decode(&m.encode()).as_ref(), Ok(&m), "{m:?}");
        }
    }

    #[test]
    fn every_truncation_and_extension_is_an_error() {
        for m in samples() {
            let b = m.encode();
            for cut in 0..b.len() {
                // A credit without its batch is a valid credit.
                if matches!(m, Message::Credit { batch: Some(_), .. }) && cut == 9 {
                    continue;
                }
                assert!(Message::decode(&b[..cut]).is_err(), "{m:?} cut at {cut}");
            }
            let mut longer = b.clone();
            longer.push(0);
            assert!(Message::decode(&longer).is_err(), "{m:?} with a trailing byte");
        }
    }

    #[test]
    fn hostile_fields_are_refused() {
        let r = RemoteRegion { addr: 0x1000, len: 24, rkey: 7 };
        let hello = |slots, notify| {
            let mut b =
                Message::PipeHello { ring: r, mailbox: r, notify: NotifyMode::Flag, slots, max_ring: 0 }
                    .encode();
            b[41] = notify;
            b
        };
        assert!(Message::decode(&hello(1, 0)).is_ok());
        assert!(Message::decode(&hello(2, 0)).is_err(), "two slots in a 24-byte mailbox");
        assert!(Message::decode(&hello(0, 0)).is_err());
        assert!(Message::decode(&hello(u32::MAX, 0)).is_err());
        assert!(Message::decode(&hello(1, 2)).is_err(), "unknown notify mode");
        let mut bad = Message::ReadDone { id: 1, ok: true }.encode();
        bad[9] = 7;
        assert!(Message::decode(&bad).is_err());
        let mut grant = Message::HeapGrant { heap: HeapId(1), segment: RemoteRegion::new(u64::MAX, 2, 0) };
        assert!(Message::decode(&grant.encode()).is_err(), "an overflowing segment");
        grant = Message::HeapGrant { heap: HeapId(1), segment: RemoteRegion::new(1, 2, 0) };
        assert!(Message::decode(&grant.encode()).is_ok());
        let mut create =
            Message::HeapCreate { config: HeapConfig::new(HeapId(1), AllocPolicy::NextFit), len: 1 }.encode();
        create[6] = 3; // sync mode
        assert!(Message::decode(&create).is_err());
        assert_eq!(Message::decode(&[]), Err(DecodeError::Empty));
        assert_eq!(Message::decode(&[0xee]), Err(DecodeError::UnknownTag(0xee)));
    }

    proptest::proptest! {
        /// Total: every byte string decodes or errors, and what decodes re-encodes to itself.
        #[test]
        fn decoding_is_total(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..80)) {
            if let Ok(m) = Message::decode(&bytes) {
                proptest::prop_assert_eq!(m.encode(), bytes);
            }
        }

        #[test]
        fn decoding_is_total_with_known_tags(
            t in proptest::sample::select(vec![0x01u8, 0x10, 0x11, 0x12, 0x13, 0x14, 0x20, 0x21, 0x40, 0x41, 0x42, 0x43, 0x44, 0x45, 0x46]),
            rest in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
        ) {
            let mut b = vec![t];
            b.extend_from_slice(&rest);
            if let Ok(m) = Message::decode(&b) {
                proptest::prop_assert_eq!(m.encode(), b);
            }
        }
    }
}
