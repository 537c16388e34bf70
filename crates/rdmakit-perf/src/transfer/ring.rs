//! The two ends of the chunk ring.
//!
//! The receiver owns a ring of `slots` chunk slots and a flag byte per slot. The sender
//! writes chunk `k` into slot `k % slots` with RDMA write-with-immediate (the immediate is
//! the chunk's length; the receive completion tells the receiver it landed). The receiver
//! copies the chunk out ("consumes" it), checksums it, and sets the slot's flag to the
//! chunk's generation. Before reusing a slot the sender RDMA-reads the flags and checks
//! that the slot's previous chunk was consumed, as the seed's verbs demo does.
//!
//! Why flag bytes and not one consumed counter: a CPU store of the receiver and an RDMA
//! read of the sender may interleave byte-wise, and a torn 8-byte counter could read
//! higher than it is (the sender would overwrite an unconsumed chunk). A byte cannot
//! tear, and a slot's flag only ever moves from one generation to the next.
//!
//! At the end the sender SENDs `DONE` with its chunk count, byte count and CRC-32; the
//! receiver compares them with its own and answers with a `VERDICT` carrying its own.

use std::time::{Duration, Instant};

use rdmakit_verbs::*;

use super::source::{Pattern, read_full};
use super::{Error, Progress};

/// Private data the sender's connect request carries.
pub const HELLO: &[u8; 5] = b"RKXF\x01";

/// The ring's shape and descriptors, as the receiver announces them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingInfo {
    /// Bytes per slot.
    pub slot: u32,
    /// Number of slots.
    pub slots: u32,
    /// The slots.
    pub ring: RemoteRegion,
    /// One flag byte per slot.
    pub flags: RemoteRegion,
}

impl RingInfo {
    /// 53 bytes: magic, slot size, slots, two region descriptors.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = HELLO.to_vec();
        b.extend_from_slice(&self.slot.to_le_bytes());
        b.extend_from_slice(&self.slots.to_le_bytes());
        b.extend_from_slice(&self.ring.encode());
        b.extend_from_slice(&self.flags.encode());
        b
    }

    /// Decodes what [`encode`](Self::encode) made (trailing zero padding is fine).
    pub fn decode(b: &[u8]) -> Result<RingInfo, Error> {
        let n = RemoteRegion::ENCODED_LEN;
        if b.len() < 13 + 2 * n || &b[..5] != HELLO {
            return Err(Error::Protocol("the peer is not an rdmakit-perf transfer receiver".into()));
        }
        let u = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let info = RingInfo {
            slot: u(5),
            slots: u(9),
            ring: RemoteRegion::decode(&b[13..13 + n])?,
            flags: RemoteRegion::decode(&b[13 + n..13 + 2 * n])?,
        };
        // The receiver's word decides what the sender allocates (a source buffer of `slot`
        // bytes per window entry, a copy of the flags per read): within the CLI's limits.
        if info.slot == 0
            || u64::from(info.slot) > super::MAX_CHUNK
            || info.slots == 0
            || info.slots > super::MAX_SLOTS
            || info.ring.len < u64::from(info.slot) * u64::from(info.slots)
            || info.flags.len < u64::from(info.slots)
        {
            return Err(Error::Protocol(format!("the receiver's ring is inconsistent: {info:?}")));
        }
        Ok(info)
    }
}

/// The generation a slot's flag shows once chunk `k` was consumed: never 0 (the initial
/// value), and different for consecutive uses of a slot.
pub fn generation(k: u64, slots: u32) -> u8 {
    ((k / u64::from(slots)) % 255) as u8 + 1
}

/// What one end counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Tally {
    /// Chunks moved.
    pub chunks: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// CRC-32 of the bytes, in order.
    pub crc32: u32,
}

const MSG_LEN: usize = 32;

fn encode_msg(tag: u8, t: &Tally) -> [u8; MSG_LEN] {
    let mut b = [0u8; MSG_LEN];
    b[0] = tag;
    b[1..9].copy_from_slice(&t.chunks.to_le_bytes());
    b[9..17].copy_from_slice(&t.bytes.to_le_bytes());
    b[17..21].copy_from_slice(&t.crc32.to_le_bytes());
    b
}

fn decode_msg(tag: u8, b: &[u8]) -> Result<Tally, Error> {
    if b.len() < 21 || b[0] != tag {
        return Err(Error::Protocol(format!("expected a {:?} message, got {} bytes", tag as char, b.len())));
    }
    let u = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    Ok(Tally { chunks: u(1), bytes: u(9), crc32: u32::from_le_bytes(b[17..21].try_into().expect("4 bytes")) })
}

/// Queue and CQ sizes for the sender with `window` writes outstanding.
pub fn sender_caps(window: u32) -> (QpCaps, u32) {
    (QpCaps::default().with_max_send_wr(window + 4).with_max_recv_wr(4), window + 16)
}

/// Queue and CQ sizes for the receiver of a ring of `slots`.
pub fn receiver_caps(slots: u32) -> (QpCaps, u32) {
    (QpCaps::default().with_max_send_wr(4).with_max_recv_wr(slots + 4), slots + 16)
}

/// The receiver's memory: ring, flags, and receive buffers for the control messages.
pub struct ReceiverMem {
    ring: MemoryRegion,
    flags: MemoryRegion,
    msgs: MemoryRegion,
    slot: u32,
    slots: u32,
}

impl ReceiverMem {
    /// Allocates a ring of `slots` slots of `slot` bytes on `pd`.
    pub fn new(pd: &ProtectionDomain, slot: u32, slots: u32) -> Result<ReceiverMem, Error> {
        let ring = pd.alloc_mr(slot as usize * slots as usize, AccessFlags::ALL_REMOTE)?;
        let flags = pd.alloc_mr(slots as usize, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)?;
        let msgs = pd.alloc_mr(MSG_LEN * (slots as usize + 5), AccessFlags::LOCAL_WRITE)?;
        Ok(ReceiverMem { ring, flags, msgs, slot, slots })
    }

    /// What the sender needs.
    pub fn info(&self) -> RingInfo {
        RingInfo { slot: self.slot, slots: self.slots, ring: self.ring.remote(), flags: self.flags.remote() }
    }

    /// Posts the receives for chunks and the final message (before the sender starts).
    pub fn post_receives(&self, qp: &QueuePair) -> Result<(), Error> {
        for i in 0..self.slots + 4 {
            self.repost(qp, u64::from(i))?;
        }
        Ok(())
    }

    fn repost(&self, qp: &QueuePair, i: u64) -> Result<(), Error> {
        qp.post_recv(RecvWr::new(self.msgs.slice(i * MSG_LEN as u64, MSG_LEN as u32)?).wr_id(i))?;
        Ok(())
    }
}

/// The receiving end: consumes chunks until the sender's `DONE`, answers with its verdict.
pub fn receive(
    qp: &QueuePair,
    cq: &CompletionQueue,
    mem: &ReceiverMem,
    progress: &Progress,
    stuck: Duration,
) -> Result<(Tally, Tally), Error> {
    let mut crc = crc32fast::Hasher::new();
    let mut buf = vec![0u8; mem.slot as usize];
    let mut mine = Tally { chunks: 0, bytes: 0, crc32: 0 };
    loop {
        let wc = cq.wait(Some(stuck))?.ok()?;
        match wc.opcode {
            WcOpcode::RECV_RDMA_WITH_IMM => {
                mem.repost(qp, wc.wr_id)?;
                let len = wc.imm.unwrap_or(wc.byte_len);
                if len > mem.slot {
                    return Err(Error::Protocol(format!(
                        "chunk of {len} bytes for a {}-byte slot",
                        mem.slot
                    )));
                }
                let s = (mine.chunks % u64::from(mem.slots)) as u32;
                let chunk = &mut buf[..len as usize];
                mem.ring.read_at(u64::from(s) * u64::from(mem.slot), chunk)?;
                crc.update(chunk);
                mem.flags.write_at(u64::from(s), &[generation(mine.chunks, mem.slots)])?;
                mine.chunks += 1;
                mine.bytes += u64::from(len);
                progress.add(u64::from(len));
            }
            WcOpcode::RECV => {
                let mut b = [0u8; MSG_LEN];
                mem.msgs.read_at(wc.wr_id * MSG_LEN as u64, &mut b)?;
                let theirs = decode_msg(b'D', &b[..(wc.byte_len as usize).min(MSG_LEN)])?;
                mine.crc32 = crc.clone().finalize();
                let verdict = encode_msg(b'V', &mine);
                qp.post_send(SendWr::send_inline(&verdict))?;
                let wc = cq.wait(Some(stuck))?.ok()?;
                if wc.opcode != WcOpcode::SEND {
                    return Err(Error::Protocol(format!("unexpected {:?} after DONE", wc.opcode)));
                }
                return Ok((mine, theirs));
            }
            other => return Err(Error::Protocol(format!("unexpected completion {other:?} at the receiver"))),
        }
    }
}

/// Where the sender's bytes come from.
pub enum Input {
    /// The built-in pattern, this many bytes.
    Pattern(Pattern, u64),
    /// A TCP stream, up to this many bytes (until it ends when `None`).
    Tcp(std::net::TcpStream, Option<u64>),
}

/// The sending end's resources and settings.
pub struct Sender<'a> {
    /// The connected QP.
    pub qp: &'a QueuePair,
    /// Its CQ.
    pub cq: &'a CompletionQueue,
    /// The receiver's ring.
    pub ring: RingInfo,
    /// Bytes per chunk (at most the slot size).
    pub chunk: u32,
    /// Writes outstanding at most.
    pub window: u32,
    /// How long any one wait may take.
    pub stuck: Duration,
    /// Test hook: flip a byte of this chunk after checksumming it, as corruption in
    /// flight would.
    pub corrupt: Option<u64>,
}

/// Sender-side memory: `window` source slots, the flags snapshot, message buffers.
pub struct SenderMem {
    src: MemoryRegion,
    flags: MemoryRegion,
    msgs: MemoryRegion,
}

impl SenderMem {
    /// Allocates for `window` chunks of `chunk` bytes and a ring of `slots`.
    pub fn new(pd: &ProtectionDomain, chunk: u32, window: u32, slots: u32) -> Result<SenderMem, Error> {
        Ok(SenderMem {
            src: pd.alloc_mr(chunk as usize * window as usize, AccessFlags::LOCAL_WRITE)?,
            flags: pd.alloc_mr(slots as usize, AccessFlags::LOCAL_WRITE)?,
            msgs: pd.alloc_mr(2 * MSG_LEN, AccessFlags::LOCAL_WRITE)?,
        })
    }

    /// Posts the receive for the receiver's verdict.
    pub fn post_receive(&self, qp: &QueuePair) -> Result<(), Error> {
        qp.post_recv(RecvWr::new(self.msgs.slice(0, MSG_LEN as u32)?).wr_id(VERDICT_ID))?;
        Ok(())
    }
}

const FLAGS_ID: u64 = u64::MAX;
const DONE_ID: u64 = u64::MAX - 1;
const VERDICT_ID: u64 = u64::MAX - 2;

struct SendState {
    /// Lengths of the writes in flight, oldest first (completions come in order; a send
    /// completion's `byte_len` is not defined by verbs).
    lens: std::collections::VecDeque<u32>,
    posted: u64,
    completed: u64,
    consumed: u64,
    reading: bool,
    verdict: Option<Tally>,
    done_sent: bool,
}

impl Sender<'_> {
    fn handle(
        &self,
        st: &mut SendState,
        mem: &SenderMem,
        wc: WorkCompletion,
        progress: &Progress,
    ) -> Result<(), Error> {
        let wc = wc.ok()?;
        match wc.wr_id {
            FLAGS_ID => {
                st.reading = false;
                let mut flags = vec![0u8; self.ring.slots as usize];
                mem.flags.read_at(0, &mut flags)?;
                while st.consumed < st.posted
                    && flags[(st.consumed % u64::from(self.ring.slots)) as usize]
                        == generation(st.consumed, self.ring.slots)
                {
                    st.consumed += 1;
                }
            }
            DONE_ID => st.done_sent = true,
            VERDICT_ID => {
                let mut b = [0u8; MSG_LEN];
                mem.msgs.read_at(0, &mut b)?;
                st.verdict = Some(decode_msg(b'V', &b[..(wc.byte_len as usize).min(MSG_LEN)])?);
            }
            _ => {
                st.completed += 1;
                progress.add(u64::from(st.lens.pop_front().unwrap_or(0)));
            }
        }
        Ok(())
    }

    fn read_flags(&self, st: &mut SendState, mem: &SenderMem) -> Result<(), Error> {
        if !st.reading {
            let wr =
                SendWr::read(mem.flags.local()?, self.ring.flags.slice(0, self.ring.slots)?).wr_id(FLAGS_ID);
            self.qp.post_send(wr)?;
            st.reading = true;
        }
        Ok(())
    }

    fn wait(&self, st: &mut SendState, mem: &SenderMem, progress: &Progress) -> Result<(), Error> {
        let wc = self.cq.wait(Some(self.stuck))?;
        self.handle(st, mem, wc, progress)
    }

    /// Streams `input` through the ring; returns what was sent and the receiver's tally.
    pub fn run(
        &self,
        mem: &SenderMem,
        mut input: Input,
        progress: &Progress,
    ) -> Result<(Tally, Tally), Error> {
        let slots = u64::from(self.ring.slots);
        let window = u64::from(self.window);
        let mut st = SendState {
            lens: Default::default(),
            posted: 0,
            completed: 0,
            consumed: 0,
            reading: false,
            verdict: None,
            done_sent: false,
        };
        let mut crc = crc32fast::Hasher::new();
        let mut bytes = 0u64;
        let mut staging = match input {
            Input::Tcp(..) => vec![0u8; self.chunk as usize],
            Input::Pattern(..) => Vec::new(),
        };
        loop {
            let k = st.posted;
            // A free source slot: the write that used it last has completed.
            while k - st.completed >= window {
                self.wait(&mut st, mem, progress)?;
            }
            // A free ring slot: chunk k - slots was consumed. Read the flags early (half
            // the ring in use), block only when the ring is full.
            let mut idle = 0u32;
            let mut since = Instant::now();
            while k >= st.consumed + slots {
                self.read_flags(&mut st, mem)?;
                let before = st.consumed;
                while st.reading {
                    self.wait(&mut st, mem, progress)?;
                }
                if st.consumed == before {
                    // Nothing consumed yet: back off a little before reading again. Each
                    // read completes, so it is the ring staying full that says the receiver
                    // is stuck (hung, or never consuming).
                    if since.elapsed() > self.stuck {
                        return Err(Error::Rdma(rdmakit_verbs::Error::Timeout(self.stuck)));
                    }
                    idle = (idle + 1).min(10);
                    std::thread::sleep(Duration::from_micros(1 << idle));
                } else {
                    since = Instant::now();
                }
            }
            if k >= st.consumed + slots / 2 {
                self.read_flags(&mut st, mem)?;
            }
            // Fill the source slot.
            let at = (k % window) * u64::from(self.chunk);
            let len = match &mut input {
                Input::Pattern(p, total) => {
                    let len = (*total - bytes).min(u64::from(self.chunk)) as usize;
                    let mut off = at;
                    p.next(len, |piece| {
                        mem.src.write_at(off, piece)?;
                        crc.update(piece);
                        off += piece.len() as u64;
                        Ok(())
                    })?;
                    len
                }
                Input::Tcp(s, limit) => {
                    let want =
                        limit.map_or(u64::from(self.chunk), |l| (l - bytes).min(u64::from(self.chunk)));
                    let len = read_full(s, &mut staging[..want as usize])?;
                    mem.src.write_at(at, &staging[..len])?;
                    crc.update(&staging[..len]);
                    len
                }
            };
            if len == 0 {
                break;
            }
            if self.corrupt == Some(k) {
                let mut b = [0u8; 1];
                mem.src.read_at(at, &mut b)?;
                mem.src.write_at(at, &[!b[0]])?;
            }
            let dst = self.ring.ring.slice((k % slots) * u64::from(self.ring.slot), len as u32)?;
            self.qp.post_send(
                SendWr::write(mem.src.slice(at, len as u32)?, dst).with_imm(len as u32).wr_id(k),
            )?;
            st.posted += 1;
            st.lens.push_back(len as u32);
            bytes += len as u64;
        }
        while st.completed < st.posted || st.reading {
            self.wait(&mut st, mem, progress)?;
        }
        let mine = Tally { chunks: st.posted, bytes, crc32: crc.finalize() };
        let done = encode_msg(b'D', &mine);
        self.qp.post_send(SendWr::send_inline(&done).wr_id(DONE_ID))?;
        let start = Instant::now();
        while !(st.done_sent && st.verdict.is_some()) {
            self.wait(&mut st, mem, progress)?;
            if start.elapsed() > self.stuck {
                return Err(Error::Rdma(rdmakit_verbs::Error::Timeout(self.stuck)));
            }
        }
        Ok((mine, st.verdict.expect("checked above")))
    }
}

/// A receiver and a sender in one process, connected, their receives posted: the loopback
/// transfer's set-up.
pub struct Loopback {
    pub rcq: CompletionQueue,
    pub rqp: QueuePair,
    pub rmem: ReceiverMem,
    pub scq: CompletionQueue,
    pub sqp: QueuePair,
    pub smem: SenderMem,
}

impl Loopback {
    /// `slots` ring slots of `chunk` bytes, `window` writes in flight, on `pd`.
    pub fn new(
        pd: &ProtectionDomain,
        chunk: u32,
        slots: u32,
        window: u32,
        opts: &ConnectOptions,
    ) -> Result<Loopback, Error> {
        let ctx = pd.context();
        let (rcaps, rcqe) = receiver_caps(slots);
        let (scaps, scqe) = sender_caps(window);
        let rcq = ctx.create_cq(rcqe)?;
        let rqp = pd.create_qp(&rcq, &rcq, rcaps)?;
        let scq = ctx.create_cq(scqe)?;
        let sqp = pd.create_qp(&scq, &scq, scaps)?;
        let rmem = ReceiverMem::new(pd, chunk, slots)?;
        let smem = SenderMem::new(pd, chunk, window, slots)?;
        rqp.connect(&sqp.address_with(opts)?, opts)?;
        sqp.connect(&rqp.address_with(opts)?, opts)?;
        rmem.post_receives(&rqp)?;
        smem.post_receive(&sqp)?;
        Ok(Loopback { rcq, rqp, rmem, scq, sqp, smem })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_never_repeat_on_consecutive_uses_and_are_never_zero() {
        for slots in [1u32, 2, 8, 255, 256] {
            for k in 0..4000u64 {
                let g = generation(k, slots);
                assert_ne!(g, 0);
                assert_ne!(g, generation(k + u64::from(slots), slots));
            }
        }
    }

    #[test]
    fn messages_round_trip_and_reject_the_wrong_tag() {
        let t = Tally { chunks: 3, bytes: 5 << 30, crc32: 0xdead_beef };
        assert_eq!(decode_msg(b'D', &encode_msg(b'D', &t)).unwrap(), t);
        assert!(decode_msg(b'V', &encode_msg(b'D', &t)).is_err());
        assert!(decode_msg(b'D', &[b'D'; 5]).is_err());
    }

    /// A receiver that takes chunks but never consumes them (a hung or hostile one whose
    /// NIC still answers the flag reads): the sender must give up after `stuck`, as the
    /// `--timeout` help promises, not poll the flags forever.
    #[test]
    fn a_receiver_that_never_consumes_makes_the_sender_give_up() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let pd = Context::open_soft().alloc_pd().unwrap();
            let (slots, window, chunk) = (2u32, 2u32, 4096u32);
            let l = Loopback::new(&pd, chunk, slots, window, &ConnectOptions::default()).unwrap();
            let sender = Sender {
                qp: &l.sqp,
                cq: &l.scq,
                ring: l.rmem.info(),
                chunk,
                window,
                stuck: Duration::from_secs(1),
                corrupt: None,
            };
            let progress = super::super::Progress::new(None);
            let r = sender.run(&l.smem, Input::Pattern(Pattern::new(), 1 << 20), &progress);
            let _ = tx.send(r.is_err());
        });
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(failed) => assert!(failed, "the sender succeeded with nothing consumed"),
            Err(_) => panic!("the sender still waits for a free slot 20 s later (its stuck limit is 1 s)"),
        }
    }

    #[test]
    fn ring_info_round_trips_and_rejects_strangers() {
        let ctx = Context::open_soft();
        let pd = ctx.alloc_pd().unwrap();
        let mem = ReceiverMem::new(&pd, 4096, 4).unwrap();
        let mut b = mem.info().encode();
        assert!(b.len() <= rdmakit_verbs::cm::MAX_PRIVATE_DATA);
        b.resize(56, 0); // verbs pads private data
        assert_eq!(RingInfo::decode(&b).unwrap(), mem.info());
        assert!(RingInfo::decode(&[0u8; 56]).is_err());
        let mut short = mem.info();
        short.slots = 100;
        assert!(RingInfo::decode(&short.encode()).is_err());
    }
}
