//! The measurement loops, following perftest's definitions: latency tests time each
//! operation's round trip (write-lat and send-lat are ping-pongs reported as half the round
//! trip), and bandwidth tests keep a window of requests outstanding and time the whole run.
//!
//! A run is counted in iterations, or timed (`-D`): then, as perftest does, the first and
//! last `margin` seconds are left out and only what completes in between is counted.
//!
//! The peer learns that one size of a run is over from a stop mark: the byte [`STOP`] in
//! the last byte of a write-lat ping, or the immediate [`STOP_IMM`] on a send. Neither side
//! needs to know how many iterations the other will run, so timed runs and `-a` sweeps work
//! across processes too.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use rdmakit_verbs::*;

use crate::rig::{self, Params, Side, Test};

/// How long one wait may take before the run is declared stuck.
pub(crate) const STUCK: Duration = Duration::from_secs(30);

/// The last byte of a write-lat ping that ends a size (stamps are 1..=250).
const STOP: u8 = 255;
/// The immediate of the send that ends a send test's size.
const STOP_IMM: u32 = 0x5354_4f50;
/// `wr_id` of that send.
const STOP_WR: u64 = u64::MAX;
/// `wr_id` of receives.
const RECV_WR: u64 = u64::MAX - 1;

/// Above this many iterations perftest does not measure the peak bandwidth.
pub const PEAK_MAX_ITERS: u32 = 20_000;
/// Empty CQ polls of the bandwidth loop per clock read (for its stuck-peer deadline).
const POLLS_PER_CLOCK: u32 = 256;

/// A bandwidth result: rates, so that directions and QPs add up as perftest adds them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Bw {
    /// Average bytes per second.
    pub bytes_per_sec: f64,
    /// Best of 8 equal slices of the run; `None` where perftest does not measure it (timed
    /// runs, more than 20000 iterations).
    pub peak_bytes_per_sec: Option<f64>,
    /// Messages per second.
    pub msgs_per_sec: f64,
    /// Operations counted (per QP in a counted run; all of them in a timed run).
    pub iters: u64,
    /// Operations per requested completion on this side (perftest's `-Q`); 0 where the
    /// test does not post them itself (pipes).
    pub cq_mod: u32,
}

impl Bw {
    /// Two directions, or two QPs, together: rates add.
    pub fn add(self, o: Bw, sum_iters: bool) -> Bw {
        Bw {
            bytes_per_sec: self.bytes_per_sec + o.bytes_per_sec,
            peak_bytes_per_sec: self.peak_bytes_per_sec.zip(o.peak_bytes_per_sec).map(|(a, b)| a + b),
            msgs_per_sec: self.msgs_per_sec + o.msgs_per_sec,
            // Saturating: one side's count may be a peer's report.
            iters: if sum_iters { self.iters.saturating_add(o.iters) } else { self.iters.max(o.iters) },
            cq_mod: self.cq_mod.max(o.cq_mod),
        }
    }

    const MAGIC: u64 = 0x7264_6d61_6b69_7452;

    /// The 40-byte report a bidirectional peer writes into the other side's buffer.
    fn encode(&self) -> [u8; 40] {
        let mut b = [0u8; 40];
        b[..8].copy_from_slice(&Bw::MAGIC.to_le_bytes());
        b[8..16].copy_from_slice(&self.bytes_per_sec.to_le_bytes());
        b[16..24].copy_from_slice(&self.peak_bytes_per_sec.unwrap_or(f64::NAN).to_le_bytes());
        b[24..32].copy_from_slice(&self.msgs_per_sec.to_le_bytes());
        b[32..40].copy_from_slice(&self.iters.to_le_bytes());
        b
    }

    /// `None` until the report is there (its magic word); then the report, or what is
    /// wrong with it (a rate that is not a finite, non-negative number).
    fn decode(b: &[u8; 40]) -> Option<std::result::Result<Bw, String>> {
        let w = |i: usize| <[u8; 8]>::try_from(&b[i..i + 8]).expect("8");
        if u64::from_le_bytes(w(0)) != Bw::MAGIC {
            return None;
        }
        let f = |i: usize| f64::from_le_bytes(w(i));
        let peak = f(16);
        let (bytes, msgs) = (f(8), f(24));
        let rate = |x: f64| x.is_finite() && x >= 0.0;
        if !rate(bytes) || !rate(msgs) || !(peak.is_nan() || rate(peak)) {
            return Some(Err(format!("rates {bytes} B/s, {msgs} msgs/s, peak {peak} B/s")));
        }
        Some(Ok(Bw {
            bytes_per_sec: bytes,
            peak_bytes_per_sec: (!peak.is_nan()).then_some(peak),
            msgs_per_sec: msgs,
            iters: u64::from_le_bytes(w(32)),
            cq_mod: 0, // the peer's own: not reported
        }))
    }
}

/// What a run measured.
pub enum Measured {
    /// Per-iteration latencies in microseconds.
    Latency(Vec<f64>),
    /// A timed latency run: operations counted in the sampled window and their mean.
    LatencyTimed { iters: u64, avg_us: f64, per_sec: f64 },
    /// A bandwidth run.
    Bandwidth(Bw),
}

fn err(what: &str) -> Error {
    Error::InvalidArgument(what.to_owned())
}

fn reap(cq: &CompletionQueue) -> Result<WorkCompletion> {
    let wc = cq.spin(STUCK)?;
    wc.ok()
}

/// Calls `ready` until it says yes, and fails with [`Error::Timeout`] once `patience` has
/// passed. The clock is read only every 256 calls, and not at all when the answer comes by
/// then: such a loop is what a latency test measures, and every measured side must wait
/// alike (a clock read per wait cost the put side of `ckdirect-seed` about 90 ns a half
/// round trip that its send/recv side did not pay).
pub(crate) fn spin_until(patience: Duration, mut ready: impl FnMut() -> Result<bool>) -> Result<()> {
    let mut start: Option<Instant> = None;
    let mut spins = 0u32;
    while !ready()? {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(256) {
            let waited = start.get_or_insert_with(Instant::now).elapsed();
            if waited > patience {
                return Err(Error::Timeout(waited));
            }
        }
    }
    Ok(())
}

/// Spins until byte `at` of `mr` equals `v` or [`STOP`]; true for `v`.
fn spin_byte(mr: &MemoryRegion, at: u64, v: u8) -> Result<bool> {
    let mut b = [0u8; 1];
    let waited = spin_until(STUCK, || {
        mr.read_at(at, &mut b)?;
        let seen = b[0] == v || b[0] == STOP;
        if !seen {
            std::hint::spin_loop();
        }
        Ok(seen)
    });
    match waited {
        Ok(()) => Ok(b[0] == v),
        Err(Error::Timeout(_)) => Err(err(&format!(
            "no answer from the peer in {STUCK:?}: byte {at} of the buffer is {}, waited for {v}",
            b[0]
        ))),
        Err(e) => Err(e),
    }
}

/// The inline limit this side uses: the run's `-I`, within what its QP allows.
fn inline_limit(side: &Side, p: &Params) -> u32 {
    if matches!(p.test, Test::ReadLat | Test::ReadBw | Test::AtomicLat | Test::AtomicBw) {
        return 0; // perftest: reads and atomics never go inline
    }
    p.inline.min(side.qp.caps().max_inline_data)
}

/// A private copy of the message when it goes inline.
fn inline_payload(side: &Side, p: &Params) -> Option<Vec<u8>> {
    (p.size <= inline_limit(side, p)).then(|| vec![0; p.size as usize])
}

/// write-lat's ping, prepared once as perftest builds its requests once: inline from a
/// private copy when the size goes inline, else from the registered buffer at `at`.
struct Ping {
    wr: PreparedSend,
    inline: Option<Vec<u8>>,
    /// Offset of the outgoing message's last byte in the side's buffer.
    last: u64,
}

impl Ping {
    fn new(side: &Side, p: &Params, from: u64, dst: RemoteSlice) -> Result<Ping> {
        let inline = inline_payload(side, p);
        let wr = match &inline {
            Some(bytes) => side.qp.prepare_send(SendWr::write_inline(bytes, dst))?,
            None => side.qp.prepare_send(SendWr::write(side.buf.slice(from, p.size)?, dst))?,
        };
        Ok(Ping { wr, inline, last: from + u64::from(p.size - 1) })
    }

    /// Posts the ping with last byte `v`.
    fn post(&mut self, side: &Side, v: u8) -> Result<()> {
        match &mut self.inline {
            Some(bytes) => {
                if let Some(last) = bytes.last_mut() {
                    *last = v;
                }
                self.wr.post_inline(bytes)
            }
            None => {
                side.buf.write_at(self.last, &[v])?;
                self.wr.post()
            }
        }
    }
}

fn stamp(i: u64) -> u8 {
    (i % 250) as u8 + 1
}

/// How a bandwidth test waits for completions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CqWait {
    /// Busy-poll the CQ (perftest's default).
    #[default]
    Poll,
    /// Sleep on the completion channel when nothing is ready (perftest's `--events`).
    /// On a machine with few cores this leaves the CPU to a software NIC's threads.
    Event,
}

/// Where a run is: counted, or timed with perftest's margins.
struct Span {
    timed: Option<(Instant, Duration, Duration, Duration)>,
    iters: u64,
    sample_start: Option<(Instant, u64)>,
    sample_end: Option<(Instant, u64)>,
}

impl Span {
    fn new(p: &Params) -> Span {
        let timed = (p.duration > 0).then(|| {
            let margin = Duration::from_secs(u64::from(p.margin));
            let total = Duration::from_secs(u64::from(p.duration));
            (Instant::now(), margin, total.saturating_sub(margin), total)
        });
        Span { timed, iters: u64::from(p.iters), sample_start: None, sample_end: None }
    }

    /// Called with the operations done so far; false once the run is over.
    fn go_on(&mut self, done: u64) -> bool {
        let Some((start, margin, end, total)) = self.timed else {
            return done < self.iters;
        };
        let t = start.elapsed();
        if t >= margin && self.sample_start.is_none() {
            self.sample_start = Some((Instant::now(), done));
        }
        if t >= end && self.sample_end.is_none() {
            self.sample_end = Some((Instant::now(), done));
        }
        t < total
    }

    /// The sampled window of a timed run: operations and seconds.
    fn sample(&self) -> Option<(u64, f64)> {
        let ((t0, n0), (t1, n1)) = (self.sample_start?, self.sample_end?);
        Some((n1 - n0, (t1 - t0).as_secs_f64()))
    }

    fn is_timed(&self) -> bool {
        self.timed.is_some()
    }
}

/// The client's side of one size of a test, busy-polling for completions.
pub fn run(side: &Side, p: &Params, bar: &ProgressBar) -> Result<Measured> {
    run_with(side, p, bar, CqWait::Poll)
}

/// The client's side of one size of a test; bandwidth tests wait for completions as `wait`
/// says. In a bidirectional run the peer's direction is added from its report.
pub fn run_with(side: &Side, p: &Params, bar: &ProgressBar, wait: CqWait) -> Result<Measured> {
    match p.test {
        Test::WriteLat => write_lat(side, p, bar),
        Test::SendLat => send_lat(side, p, bar),
        Test::ReadLat | Test::AtomicLat => read_lat(side, p, bar),
        Test::WriteBw | Test::ReadBw | Test::SendBw | Test::AtomicBw => {
            let mine = bandwidth(side, p, bar, wait, true, p.bidir && p.test == Test::SendBw)?;
            if !p.bidir {
                return Ok(Measured::Bandwidth(mine));
            }
            // The two sides swap reports: the peer's figures, and a barrier between sizes.
            send_report(side, &mine)?;
            let theirs = peer_report(side)?;
            Ok(Measured::Bandwidth(mine.add(theirs, p.duration > 0)))
        }
        Test::PipeLat | Test::PipeBw | Test::PutLat => {
            Err(err("channel tests run in the channel module (a bug if reached)"))
        }
    }
}

/// Latency samples taken as perftest takes them: one clock read as each iteration posts,
/// and a sample is the time from one post to the next (half of it for a ping-pong), so it
/// covers the whole iteration, the loop's own work included. The last sample ends when the
/// loop does (perftest drops it: its `iters - 1` samples).
/// An empty vector with room for `n` samples, or an error saying `-n` is too large.
pub(crate) fn samples_vec<T>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| {
        Error::InvalidArgument(format!(
            "-n: cannot keep {n} samples of {} bytes in memory ({e})",
            size_of::<T>()
        ))
    })?;
    Ok(v)
}

pub(crate) struct Stamps {
    at: Vec<Instant>,
    /// False in a timed run, which counts iterations and keeps no samples.
    keep: bool,
}

impl Stamps {
    /// Room for a stamp per iteration when `keep`: a clear error, not an abort, when
    /// `-n` asks for more than memory holds.
    pub(crate) fn new(keep: bool, iters: u32) -> Result<Stamps> {
        Ok(Stamps { at: samples_vec(if keep { iters as usize + 1 } else { 0 })?, keep })
    }

    fn for_span(span: &Span, iters: u32) -> Result<Stamps> {
        Stamps::new(!span.is_timed(), iters)
    }

    /// An iteration posts now.
    #[inline]
    pub(crate) fn post(&mut self) {
        if self.keep {
            self.at.push(Instant::now());
        }
    }

    /// The samples in microseconds: the differences of successive stamps, the last to now,
    /// divided by 2 for a round trip (`half`).
    pub(crate) fn samples(mut self, half: bool) -> Vec<f64> {
        if self.keep {
            self.at.push(Instant::now());
        }
        let div = if half { 2.0 } else { 1.0 };
        self.at.windows(2).map(|w| (w[1] - w[0]).as_secs_f64() * 1e6 / div).collect()
    }

    fn finish(self, span: &Span, half: bool) -> Result<Measured> {
        latency_result(span, self.samples(half), half)
    }
}

fn latency_result(span: &Span, lat: Vec<f64>, half: bool) -> Result<Measured> {
    if !span.is_timed() {
        return Ok(Measured::Latency(lat));
    }
    let (n, secs) = span.sample().ok_or_else(|| err("the timed run ended before its sample window"))?;
    if n == 0 {
        return Err(err("no operation completed in the sampled window"));
    }
    let rtt = if half { 2.0 } else { 1.0 };
    Ok(Measured::LatencyTimed { iters: n, avg_us: secs * 1e6 / n as f64 / rtt, per_sec: n as f64 / secs })
}

/// Where write-lat's outgoing message starts: the upper half of the buffer, so that no size
/// of a sweep sends from the byte a later size polls.
fn upper_half(side: &Side) -> u64 {
    ((side.buf.len() - rig::REPORT_LEN) / 2) as u64
}

fn write_lat(side: &Side, p: &Params, bar: &ProgressBar) -> Result<Measured> {
    // Write from the upper half of our buffer into the lower half of the peer's; the peer
    // answers into the lower half of ours. The last byte carries the round.
    let size = p.size;
    let mut ping = Ping::new(side, p, upper_half(side), side.peer_buf.slice(0, size)?)?;
    let mut span = Span::new(p);
    let mut stamps = Stamps::for_span(&span, p.iters)?;
    let mut i = 0u64;
    while span.go_on(i) {
        let v = stamp(i);
        stamps.post();
        ping.post(side, v)?;
        // Our write's completion is reaped while the peer turns the ping around, as
        // perftest does (post, poll the CQ, then wait for the answer): reaping it after the
        // answer put a CQ poll on the round trip that perftest does not time.
        reap(&side.cq)?;
        if !spin_byte(&side.buf, u64::from(size - 1), v)? {
            return Err(err("the peer ended the run early"));
        }
        i += 1;
        tick(bar, i);
    }
    let result = stamps.finish(&span, true);
    // Tell the peer this size is over, and wait for it to answer with the same mark: the
    // next size's first ping must not overwrite this one before the peer has seen it.
    ping.post(side, STOP)?;
    reap(&side.cq)?;
    spin_byte(&side.buf, u64::from(size - 1), STOP)?;
    result
}

fn read_lat(side: &Side, p: &Params, bar: &ProgressBar) -> Result<Measured> {
    let size = p.size;
    let mut span = Span::new(p);
    let mut stamps = Stamps::for_span(&span, p.iters)?;
    let mut i = 0u64;
    let wr = side.qp.prepare_send(match p.test {
        Test::ReadLat => SendWr::read(side.buf.slice(0, size)?, side.peer_buf.slice(0, size)?),
        _ => SendWr::fetch_add(side.buf.slice(0, 8)?, side.peer_atomic.slice(0, 8)?, 1),
    })?;
    while span.go_on(i) {
        stamps.post();
        wr.post()?;
        reap(&side.cq)?;
        i += 1;
        tick(bar, i);
    }
    stamps.finish(&span, false)
}

/// Keeps `want` receives posted on `side` (covering the whole buffer: any size fits), from
/// one receive prepared on first use, as perftest re-posts one it built before timing.
fn top_up_recvs(side: &Side, want: u32) -> Result<()> {
    let want = recv_target(&side.qp, want);
    if side.posted_recvs.load(Ordering::Relaxed) >= want {
        return Ok(());
    }
    let recv = match side.recv.get() {
        Some(r) => r,
        None => {
            let r = prepare_recv(&side.qp, &side.buf)?;
            side.recv.get_or_init(|| r)
        }
    };
    while side.posted_recvs.load(Ordering::Relaxed) < want {
        recv.post()?;
        side.posted_recvs.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Receives to keep posted when a test asks for `want`: what the QP holds, at least one.
fn recv_target(qp: &QueuePair, want: u32) -> u32 {
    want.min(qp.caps().max_recv_wr.saturating_sub(1)).max(1)
}

/// The receive every test posts: the buffer but its report area.
fn prepare_recv(qp: &QueuePair, buf: &MemoryRegion) -> Result<PreparedRecv> {
    let len = (buf.len() - rig::REPORT_LEN) as u32;
    qp.prepare_recv(RecvWr::new(buf.slice(0, len)?).wr_id(RECV_WR))
}

/// The server's receives for a test that sends to it, posted on its new QP before the
/// client learns that the connection is up (perftest posts them before its handshake): a
/// first send that found none would be refused with a receiver-not-ready NAK and retried
/// only after the RNR timer, at least a kernel tick (4 ms) on rxe, which a short message
/// rate run measured. Returns the prepared receive and how many were posted.
pub(crate) fn prepost_recvs(
    qp: &QueuePair,
    buf: &MemoryRegion,
    p: &Params,
) -> Result<Option<(PreparedRecv, u32)>> {
    let want = match p.test {
        Test::SendBw => p.rx_depth,
        Test::SendLat => 2,
        _ => return Ok(None),
    };
    let want = recv_target(qp, want);
    let recv = prepare_recv(qp, buf)?;
    for _ in 0..want {
        recv.post()?;
    }
    Ok(Some((recv, want)))
}

/// One received message: counts the receive off; true if it is the stop mark.
fn received(side: &Side, wc: &WorkCompletion) -> bool {
    side.posted_recvs.fetch_sub(1, Ordering::Relaxed);
    wc.imm == Some(STOP_IMM)
}

/// A send of this size: inline from `inline` when it is there.
fn send_wr<'a>(inline: &'a Option<Vec<u8>>, src: &LocalSlice) -> SendWr<'a> {
    match inline {
        Some(bytes) => SendWr::send_inline(bytes),
        None => SendWr::send(src.clone()),
    }
}

/// A receive completion of another kind than a send's (a peer writing with immediate into
/// the buffer) in a test whose peer only sends.
fn only_sends(opcode: WcOpcode) -> Error {
    Error::Malformed {
        what: "the peer's traffic",
        reason: format!("a {opcode:?} completion where only sends come"),
    }
}

fn send_stop(side: &Side) -> Result<()> {
    side.qp.post_send(SendWr::send_empty().with_imm(STOP_IMM).wr_id(STOP_WR))
}

/// Completions of a ping-pong that arrived before they were waited for (a peer's next
/// message can land before our own send's completion is reaped).
#[derive(Default)]
struct Banked {
    recvs: u32,
    sends: u32,
    stopped: bool,
}

impl Banked {
    /// Waits until `recvs` receives and `sends` sends have completed (counting those
    /// banked); returns whether a stop mark arrived among the receives.
    fn wait(&mut self, side: &Side, recvs: u32, sends: u32) -> Result<bool> {
        while self.recvs < recvs || self.sends < sends {
            let wc = reap(&side.cq)?;
            if wc.opcode.is_recv() {
                if wc.opcode != WcOpcode::RECV {
                    return Err(only_sends(wc.opcode));
                }
                self.stopped |= received(side, &wc);
                self.recvs += 1;
            } else {
                self.sends += 1;
            }
        }
        self.recvs -= recvs;
        self.sends -= sends;
        Ok(recvs > 0 && std::mem::take(&mut self.stopped))
    }
}

fn send_lat(side: &Side, p: &Params, bar: &ProgressBar) -> Result<Measured> {
    let src = side.buf.slice(0, p.size)?;
    let inline = inline_payload(side, p);
    let send = side.qp.prepare_send(send_wr(&inline, &src))?;
    let mut span = Span::new(p);
    let mut stamps = Stamps::for_span(&span, p.iters)?;
    let mut i = 0u64;
    let mut banked = Banked::default();
    top_up_recvs(side, 2)?;
    while span.go_on(i) {
        stamps.post();
        send.post()?;
        if banked.wait(side, 1, 1)? {
            return Err(err("the peer ended the run early"));
        }
        top_up_recvs(side, 2)?;
        i += 1;
        tick(bar, i);
    }
    let result = stamps.finish(&span, true);
    send_stop(side)?;
    banked.wait(side, 0, 1)?;
    result
}

/// The bandwidth loop. `send`: this side issues the test's operations (writes, reads,
/// sends, atomics) with a window of `p.window`; `recv`: it also receives the peer's sends
/// until their stop mark. Returns this side's figures (zero if it only received).
fn bandwidth(side: &Side, p: &Params, bar: &ProgressBar, wait: CqWait, send: bool, recv: bool) -> Result<Bw> {
    let size = if p.test.is_atomic() { 8 } else { p.size };
    let stride = u64::from(size.max(64));
    let room = side.buf.len().min(side.peer_buf.len as usize);
    let slots = rig::slots(room, size).min(p.window.max(1) as usize) as u64;
    let window = u64::from(p.window.clamp(1, side.qp.caps().max_send_wr.saturating_sub(2).max(1)));
    let inline = if send { inline_payload(side, p) } else { None };
    let make = |i: u64| -> Result<SendWr<'_>> {
        let slot = (i % slots) * stride;
        let local = side.buf.slice(slot, size)?;
        Ok(match p.test {
            Test::WriteBw => match &inline {
                Some(bytes) => SendWr::write_inline(bytes, side.peer_buf.slice(slot, size)?),
                None => SendWr::write(local, side.peer_buf.slice(slot, size)?),
            },
            Test::ReadBw => SendWr::read(local, side.peer_buf.slice(slot, size)?),
            Test::SendBw => send_wr(&inline, &local),
            _ => SendWr::fetch_add(local, side.peer_atomic.slice(0, 8)?, 1),
        })
    };
    // Each slot's request prepared once, signalled and not, as perftest builds its requests
    // before timing: a post is then the in-flight slot and the provider call.
    let (mut loud, mut quiet) = (Vec::new(), Vec::new());
    if send {
        for i in 0..slots {
            let wr = make(i)?;
            quiet.push(side.qp.prepare_send(wr.clone().unsignaled())?);
            loud.push(side.qp.prepare_send(wr)?);
        }
    }
    if recv {
        top_up_recvs(side, p.rx_depth)?;
    }
    let mut span = Span::new(p);
    // perftest's peak: the best mean time per operation over any run of consecutive
    // operations, from posting the first to completing the last; so it keeps every post and
    // completion time, and skips the peak above 20000 iterations.
    let peak_wanted = send && !span.is_timed() && p.iters <= PEAK_MAX_ITERS;
    let (mut posted_at, mut completed_at) = (Vec::new(), Vec::new());
    if peak_wanted {
        posted_at.reserve(p.iters as usize);
        completed_at.reserve(p.iters as usize);
    }
    let start = Instant::now();
    let (mut posted, mut done) = (0u64, 0u64);
    let mut sending = send;
    let mut stop_sent = !(send && p.test == Test::SendBw);
    let mut stop_done = stop_sent;
    let mut recv_done = !recv;
    // Empty polls since the last completion, and when the first clock read among them
    // was: the clock is read only every `POLLS_PER_CLOCK` empty polls (perftest reads none
    // while it polls; a read per empty poll made each of this loop's spins several times
    // as long, and on a host with fewer cores than busy threads that is CPU a software
    // NIC's threads need). The deadline thus runs from at most that many polls after the
    // last completion.
    let (mut empty_polls, mut stalled_since) = (0u32, None::<Instant>);
    let mut wcs = [WorkCompletion::default(); 16];
    let mut secs = 0.0;
    let cq_mod = u64::from(p.cq_mod_at(size, wait == CqWait::Event));
    // Operations posted since the last one that asked for a completion.
    let mut unsignaled = 0u64;
    loop {
        if sending && !span.go_on(done) {
            sending = false;
            secs = start.elapsed().as_secs_f64();
        }
        while sending && posted - done < window && (span.is_timed() || posted < u64::from(p.iters)) {
            // As perftest: every `cq_mod`-th operation asks for a completion, and so does the
            // last of an untimed run; the completion's `wr_id` says how many it retires (an
            // RC send queue completes in order).
            let last = !span.is_timed() && posted + 1 == u64::from(p.iters);
            unsignaled += 1;
            let k = (posted % slots) as usize;
            if unsignaled >= cq_mod || last {
                loud[k].set_wr_id(unsignaled);
                loud[k].post()?;
                unsignaled = 0;
            } else {
                quiet[k].post()?;
            }
            if peak_wanted {
                posted_at.push(Instant::now());
            }
            posted += 1;
        }
        if !sending && unsignaled > 0 {
            // A timed run stopped between two requested completions: one more operation,
            // signalled, retires the unsignalled ones (it is outside the sample window).
            side.qp.post_send(make(posted)?.wr_id(unsignaled + 1))?;
            posted += 1;
            unsignaled = 0;
        }
        if !sending && posted == done && !stop_sent {
            send_stop(side)?;
            stop_sent = true;
        }
        if !sending && posted == done && stop_done && recv_done {
            break;
        }
        // In a sweep a receiver takes one completion at a time: what follows this size's
        // stop mark belongs to the next size (the sender may run ahead into receives posted
        // earlier). With one size nothing follows it, and the receiver takes them in
        // batches, as perftest's does.
        let batch = if recv && p.in_sweep { 1 } else { wcs.len() };
        let mut n = side.cq.poll(&mut wcs[..batch])?;
        if n == 0 && wait == CqWait::Event {
            wcs[0] = side.cq.wait(Some(STUCK))?;
            n = 1;
        }
        if n == 0 {
            empty_polls = empty_polls.wrapping_add(1);
            if empty_polls.is_multiple_of(POLLS_PER_CLOCK)
                && stalled_since.get_or_insert_with(Instant::now).elapsed() > STUCK
            {
                return Err(Error::Timeout(STUCK));
            }
            continue;
        }
        (empty_polls, stalled_since) = (0, None);
        for wc in &wcs[..n] {
            let wc = wc.ok()?;
            if wc.opcode.is_recv() {
                // Only sends are this test's to take: a peer writing with immediate into
                // the buffer consumes a receive too.
                if wc.opcode != WcOpcode::RECV {
                    return Err(only_sends(wc.opcode));
                }
                if received(side, &wc) {
                    recv_done = true;
                } else {
                    top_up_recvs(side, p.rx_depth)?;
                }
            } else if wc.wr_id == STOP_WR {
                stop_done = true;
            } else {
                // Operations this completion retires (set when posting; at least one).
                let n = wc.wr_id.max(1);
                if n > posted - done {
                    return Err(err("a completion retires more operations than are in flight"));
                }
                done += n;
                if peak_wanted {
                    let at = Instant::now();
                    completed_at.extend(std::iter::repeat_n(at, n as usize));
                }
                tick(bar, done);
            }
        }
    }
    if !send {
        return Ok(Bw::default());
    }
    let (ops, secs) = match span.sample() {
        Some(s) => s,
        None if span.is_timed() => return Err(err("the timed run ended before its sample window")),
        None => (done, secs),
    };
    let secs = secs.max(1e-9);
    let avg = ops as f64 * f64::from(size) / secs;
    Ok(Bw {
        bytes_per_sec: avg,
        peak_bytes_per_sec: peak_wanted.then(|| peak_rate(&posted_at, &completed_at, size).max(avg)),
        msgs_per_sec: ops as f64 / secs,
        iters: if span.is_timed() { ops } else { u64::from(p.iters) },
        cq_mod: cq_mod as u32,
    })
}

/// perftest's peak bandwidth: the smallest mean time per operation over any run `i..=j` of
/// consecutive operations (`completed[j] - posted[i]`, over `j - i + 1`), as bytes per
/// second. Quadratic, which is why perftest stops measuring it above 20000 iterations.
///
/// The instants become seconds since the first post once, and the inner loop is a
/// subtraction, a multiplication by a tabled reciprocal and a minimum over plain arrays,
/// which the compiler vectorises: 20000 operations take a few hundred milliseconds instead
/// of seconds of `Instant` arithmetic (a cost paid after the run, but one that delays the
/// next size of a sweep).
fn peak_rate(posted: &[Instant], completed: &[Instant], size: u32) -> f64 {
    let Some(&t0) = posted.first() else { return 0.0 };
    let secs = |t: &Instant| t.saturating_duration_since(t0).as_secs_f64();
    let p: Vec<f64> = posted.iter().map(secs).collect();
    let c: Vec<f64> = completed.iter().map(secs).collect();
    // inv[m] = 1 / (m + 1): the operations in a run of m + 1.
    let inv: Vec<f64> = (1..=c.len()).map(|m| 1.0 / m as f64).collect();
    let mut best = f64::INFINITY;
    for (i, &pi) in p.iter().enumerate() {
        let Some(cs) = c.get(i..) else { break };
        let run = cs.iter().zip(&inv).fold(f64::INFINITY, |m, (&ck, &r)| m.min((ck - pi).max(0.0) * r));
        best = best.min(run);
    }
    if best.is_finite() && best > 0.0 { f64::from(size) / best } else { 0.0 }
}

/// Where the bidirectional report lands in a buffer (its last `REPORT_LEN` bytes); an
/// error for a buffer too small to hold one (a peer's, as it described it).
fn report_at(len: u64) -> Result<u64> {
    len.checked_sub(rig::REPORT_LEN as u64)
        .ok_or_else(|| err(&format!("a buffer of {len} bytes has no room for the bidirectional report")))
}

/// Writes this side's figures into the peer's buffer (bidirectional runs). Each side of a
/// bidirectional run sends its report and then waits for the peer's, so neither starts the
/// next size of a sweep before the other has finished this one.
fn send_report(side: &Side, bw: &Bw) -> Result<()> {
    let at = report_at(side.peer_buf.len)?;
    side.qp.post_send(SendWr::write_inline(&bw.encode(), side.peer_buf.slice(at, 40)?))?;
    reap(&side.cq).map(drop)
}

/// Waits for the peer's report, and clears it for the next size.
fn peer_report(side: &Side) -> Result<Bw> {
    let at = report_at(side.buf.len() as u64)?;
    let start = Instant::now();
    let mut b = [0u8; 40];
    loop {
        side.buf.read_at(at, &mut b)?;
        if let Some(bw) = Bw::decode(&b) {
            side.buf.write_at(at, &[0; 40])?;
            return bw.map_err(|reason| Error::Malformed { what: "the peer's report", reason });
        }
        if start.elapsed() > STUCK * 4 {
            return Err(Error::Timeout(STUCK * 4));
        }
        std::thread::yield_now();
    }
}

fn tick(bar: &ProgressBar, i: u64) {
    if i.is_multiple_of(1024) {
        bar.set_position(i);
    }
}

/// The server's side of a test, every size of it: answers write-lat and send-lat
/// ping-pongs, keeps receives posted for send-bw, runs its own direction of a
/// bidirectional test (and reports it), and otherwise stays out of the way (the NIC serves
/// one-sided operations).
pub fn serve(side: &Side, p: &Params) -> Result<()> {
    if p.size == 0 || p.size > rig::MAX_SIZE {
        return Err(err("message size out of range"));
    }
    // send-lat: a receive reaped early may be the next size's first message.
    let mut banked = Banked::default();
    for size in p.sizes() {
        let p = p.at(size);
        match p.test {
            Test::WriteLat => {
                let mut ping = Ping::new(side, &p, upper_half(side), side.peer_buf.slice(0, size)?)?;
                for i in 0u64.. {
                    let v = stamp(i);
                    let more = spin_byte(&side.buf, u64::from(size - 1), v)?;
                    // Answer a ping with its stamp, the stop mark with the stop mark.
                    ping.post(side, if more { v } else { STOP })?;
                    reap(&side.cq)?;
                    if !more {
                        break;
                    }
                }
            }
            Test::SendLat => {
                let src = side.buf.slice(0, size)?;
                let inline = inline_payload(side, &p);
                let send = side.qp.prepare_send(send_wr(&inline, &src))?;
                loop {
                    top_up_recvs(side, 2)?;
                    if banked.wait(side, 1, 0)? {
                        break;
                    }
                    send.post()?;
                    banked.wait(side, 0, 1)?;
                }
            }
            Test::SendBw => {
                let bw = bandwidth(side, &p, &ProgressBar::hidden(), CqWait::Poll, p.bidir, true)?;
                if p.bidir {
                    send_report(side, &bw)?;
                    peer_report(side)?;
                }
            }
            Test::WriteBw | Test::ReadBw | Test::AtomicBw if p.bidir => {
                let bw = bandwidth(side, &p, &ProgressBar::hidden(), CqWait::Poll, true, false)?;
                send_report(side, &bw)?;
                peer_report(side)?;
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod peak_tests {
    use super::*;
    use std::time::Duration;

    /// The definition, written out: the smallest mean time per operation over any run.
    fn by_definition(posted: &[Instant], completed: &[Instant], size: u32) -> f64 {
        let mut best = f64::INFINITY;
        for (i, p) in posted.iter().enumerate() {
            for (k, c) in completed.iter().enumerate().skip(i) {
                best = best.min(c.saturating_duration_since(*p).as_secs_f64() / (k - i + 1) as f64);
            }
        }
        if best.is_finite() && best > 0.0 { f64::from(size) / best } else { 0.0 }
    }

    #[test]
    fn peak_rate_is_the_fastest_run_of_consecutive_operations() {
        let t0 = Instant::now();
        let at = |us: u64| t0 + Duration::from_micros(us);
        // Operations posted every 10 µs and completed 25 µs later, except a burst of three
        // completed together at 100 µs: that run (posted 40, 50, 60) is the peak, 3 ops in
        // 60 µs.
        let posted: Vec<_> = (0..10).map(|i| at(10 * i)).collect();
        let mut completed: Vec<_> = (0..10).map(|i| at(10 * i + 25)).collect();
        for c in &mut completed[4..7] {
            *c = at(100);
        }
        completed[7] = at(100);
        let (fast, slow) = (peak_rate(&posted, &completed, 4096), by_definition(&posted, &completed, 4096));
        assert!((fast - slow).abs() <= slow * 1e-9, "{fast} vs {slow}");
        // An irregular pattern, compared with the definition.
        let mut x = 7u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % 50
        };
        let mut t = 0;
        let posted: Vec<_> = (0..500)
            .map(|_| {
                t += next();
                at(t)
            })
            .collect();
        let mut u = 0;
        let completed: Vec<_> = posted
            .iter()
            .map(|p| {
                u = u.max(p.duration_since(t0).as_micros() as u64) + next();
                at(u)
            })
            .collect();
        let (fast, slow) = (peak_rate(&posted, &completed, 64), by_definition(&posted, &completed, 64));
        assert!((fast - slow).abs() <= slow * 1e-9, "{fast} vs {slow}");
        assert_eq!(peak_rate(&[], &[], 8), 0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's report is its word: rates that are not finite non-negative numbers are an
    /// error, not figures printed (and its count, added to ours, saturates).
    #[test]
    fn a_peers_report_with_impossible_figures_is_refused() {
        let good =
            Bw { bytes_per_sec: 1e9, peak_bytes_per_sec: None, msgs_per_sec: 1e6, iters: 5, cq_mod: 0 };
        assert!(
            matches!(Bw::decode(&good.encode()), Some(Ok(b)) if b.iters == 5 && b.peak_bytes_per_sec.is_none())
        );
        assert!(Bw::decode(&[0; 40]).is_none(), "no magic: not there yet");
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            let b = Bw { bytes_per_sec: bad, ..good };
            assert!(matches!(Bw::decode(&b.encode()), Some(Err(_))), "{bad} B/s");
            let b = Bw { peak_bytes_per_sec: Some(bad).filter(|x| !x.is_nan()), msgs_per_sec: bad, ..good };
            assert!(matches!(Bw::decode(&b.encode()), Some(Err(_))), "{bad} msgs/s");
        }
        let huge = Bw { iters: u64::MAX, ..good };
        assert_eq!(good.add(huge, true).iters, u64::MAX);
    }
}
