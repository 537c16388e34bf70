//! The measurement loops, following perftest's definitions: latency tests time each
//! operation's round trip (write-lat is a ping-pong reported as half the round trip), and
//! bandwidth tests keep a window of requests outstanding and time the whole run.

use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use rdmakit_verbs::*;

use crate::rig::{Params, Side, Test};

/// How long one wait may take before the run is declared stuck.
const STUCK: Duration = Duration::from_secs(30);

/// What a run measured.
pub enum Measured {
    /// Per-iteration latencies in microseconds.
    Latency(Vec<f64>),
    /// Whole-run bandwidth: total bytes, seconds, and the best of 8 equal slices.
    Bandwidth { bytes: u64, secs: f64, peak_bytes_per_sec: f64 },
}

fn err(what: &str) -> Error {
    Error::InvalidArgument(what.to_owned())
}

fn reap(cq: &CompletionQueue) -> Result<WorkCompletion> {
    let wc = cq.spin(STUCK)?;
    wc.ok()
}

/// Spins until byte `at` of `mr` equals `v`.
fn spin_byte(mr: &MemoryRegion, at: u64, v: u8) -> Result<()> {
    let start = Instant::now();
    let mut b = [0u8; 1];
    loop {
        mr.read_at(at, &mut b)?;
        if b[0] == v {
            return Ok(());
        }
        if start.elapsed() > STUCK {
            return Err(Error::Timeout(STUCK));
        }
        std::hint::spin_loop();
    }
}

/// For write-lat: a private copy of the message when it fits the QP's inline limit, so
/// small pings go inline, as perftest's latency tests do.
fn inline_payload(side: &Side, size: u32) -> Option<Vec<u8>> {
    (size <= side.qp.caps().max_inline_data).then(|| vec![0; size as usize])
}

/// One write-lat ping whose last byte is `v`: inline from `inline` when it is there, else
/// from the registered `src` (whose last byte the caller has set).
fn ping<'a>(inline: &'a mut Option<Vec<u8>>, src: &LocalSlice, dst: RemoteSlice, v: u8) -> SendWr<'a> {
    match inline {
        Some(bytes) => {
            if let Some(last) = bytes.last_mut() {
                *last = v;
            }
            SendWr::write_inline(bytes, dst)
        }
        None => SendWr::write(src.clone(), dst),
    }
}

fn stamp(i: u32) -> u8 {
    (i % 250) as u8 + 1
}

/// How a bandwidth test waits for completions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CqWait {
    /// Busy-poll the CQ (perftest's default).
    #[default]
    Poll,
    /// Sleep on the completion channel when nothing is ready (perftest's `--use_event`).
    /// On a machine with few cores this leaves the CPU to a software NIC's threads.
    Event,
}

/// The client's side of a test, busy-polling for completions.
pub fn run(side: &Side, p: &Params, bar: &ProgressBar) -> Result<Measured> {
    run_with(side, p, bar, CqWait::Poll)
}

/// The client's side of a test; bandwidth tests wait for completions as `wait` says.
pub fn run_with(side: &Side, p: &Params, bar: &ProgressBar, wait: CqWait) -> Result<Measured> {
    let size = p.size;
    match p.test {
        Test::WriteLat => {
            // Write from the upper half of our buffer into the lower half of the peer's; the
            // peer answers into the lower half of ours. The last byte carries the round.
            let src = side.buf.slice(u64::from(size.max(64)), size)?;
            let dst = side.peer_buf.slice(0, size)?;
            let mut lat = Vec::with_capacity(p.iters as usize);
            let mut inline = inline_payload(side, size);
            for i in 0..p.iters {
                let v = stamp(i);
                side.buf.write_at(u64::from(size.max(64) + size - 1), &[v])?;
                let t = Instant::now();
                side.qp.post_send(ping(&mut inline, &src, dst, v))?;
                spin_byte(&side.buf, u64::from(size - 1), v)?;
                lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
                reap(&side.cq)?;
                tick(bar, i);
            }
            Ok(Measured::Latency(lat))
        }
        Test::ReadLat | Test::AtomicLat => {
            let mut lat = Vec::with_capacity(p.iters as usize);
            for i in 0..p.iters {
                let wr = match p.test {
                    Test::ReadLat => SendWr::read(side.buf.slice(0, size)?, side.peer_buf.slice(0, size)?),
                    _ => SendWr::fetch_add(side.buf.slice(0, 8)?, side.peer_atomic.slice(0, 8)?, 1),
                };
                let t = Instant::now();
                side.qp.post_send(wr)?;
                reap(&side.cq)?;
                lat.push(t.elapsed().as_secs_f64() * 1e6);
                tick(bar, i);
            }
            Ok(Measured::Latency(lat))
        }
        Test::WriteBw | Test::ReadBw | Test::SendBw | Test::AtomicBw => bandwidth(side, p, bar, wait),
        Test::PipeLat | Test::PipeBw | Test::PutLat => {
            Err(err("channel tests run in the channel module (a bug if reached)"))
        }
    }
}

fn bandwidth(side: &Side, p: &Params, bar: &ProgressBar, wait: CqWait) -> Result<Measured> {
    let size = if p.test == Test::AtomicBw { 8 } else { p.size };
    let slots = (side.buf.len() / size.max(64) as usize).max(1) as u32;
    let window = p.window.clamp(1, side.qp.caps().max_send_wr);
    let make = |i: u32| -> Result<SendWr<'static>> {
        let slot = u64::from(i % slots) * u64::from(size.max(64));
        let local = side.buf.slice(slot, size)?;
        Ok(match p.test {
            Test::WriteBw => SendWr::write(local, side.peer_buf.slice(slot, size)?),
            Test::ReadBw => SendWr::read(local, side.peer_buf.slice(slot, size)?),
            Test::SendBw => SendWr::send(local),
            _ => SendWr::fetch_add(local, side.peer_atomic.slice(0, 8)?, 1),
        })
    };
    let slice = (p.iters / 8).max(1);
    let mut slice_start = Instant::now();
    let mut peak: f64 = 0.0;
    let start = Instant::now();
    let (mut posted, mut done) = (0u32, 0u32);
    let mut wcs = [WorkCompletion::default(); 16];
    while done < p.iters {
        while posted < p.iters && posted - done < window {
            side.qp.post_send(make(posted)?)?;
            posted += 1;
        }
        let mut n = side.cq.poll(&mut wcs)?;
        if n == 0 && wait == CqWait::Event {
            wcs[0] = side.cq.wait(Some(STUCK))?;
            n = 1;
        }
        for wc in &wcs[..n] {
            wc.ok()?;
            done += 1;
            if done % slice == 0 {
                let secs = slice_start.elapsed().as_secs_f64();
                peak = peak.max(f64::from(slice) * f64::from(size) / secs.max(1e-9));
                slice_start = Instant::now();
            }
            tick(bar, done);
        }
        if n == 0 && start.elapsed() > STUCK * 4 {
            return Err(Error::Timeout(STUCK * 4));
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let bytes = u64::from(p.iters) * u64::from(size);
    Ok(Measured::Bandwidth { bytes, secs, peak_bytes_per_sec: peak.max(bytes as f64 / secs) })
}

fn tick(bar: &ProgressBar, i: u32) {
    if i % 1024 == 0 {
        bar.set_position(u64::from(i));
    }
}

/// The server's side of a test: answers write ping-pongs, keeps receives posted for
/// send-bw, and otherwise stays out of the way (the NIC serves one-sided operations).
pub fn serve(side: &Side, p: &Params) -> Result<()> {
    let size = p.size;
    if size == 0 || size > crate::rig::MAX_SIZE {
        return Err(err("message size out of range"));
    }
    match p.test {
        Test::WriteLat => {
            let src = side.buf.slice(u64::from(size.max(64)), size)?;
            let dst = side.peer_buf.slice(0, size)?;
            let mut inline = inline_payload(side, size);
            for i in 0..p.iters {
                let v = stamp(i);
                spin_byte(&side.buf, u64::from(size - 1), v)?;
                side.buf.write_at(u64::from(size.max(64) + size - 1), &[v])?;
                side.qp.post_send(ping(&mut inline, &src, dst, v))?;
                reap(&side.cq)?;
            }
            Ok(())
        }
        Test::SendBw => {
            let window = side.qp.caps().max_recv_wr.min(p.window.max(1) + 4);
            let recv = || side.buf.slice(0, size).map(RecvWr::new);
            let mut posted = 0;
            while posted < window.min(p.iters) {
                side.qp.post_recv(recv()?)?;
                posted += 1;
            }
            let mut got = 0;
            while got < p.iters {
                reap(&side.cq)?;
                got += 1;
                if posted < p.iters {
                    side.qp.post_recv(recv()?)?;
                    posted += 1;
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}
