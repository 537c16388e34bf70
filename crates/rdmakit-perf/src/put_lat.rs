//! `put-lat`: a ping-pong of CkDirect-style persistent put handles (rdmakit-channel's
//! `put` module); half the round trip, as `ib_send_lat` reports for `send-lat` (its
//! baseline at the same `-s`).
//!
//! In loopback both ends run on this thread. Across processes (`--server`/`--connect`)
//! each end makes its receive handle, then RDMA-writes the handle's descriptor into the
//! last [`REPORT_LEN`] bytes of the peer's buffer (whose descriptor came with the
//! connection), with a tag word last; the peer waits for the tag and decodes the
//! descriptor as untrusted input ([`HandleDesc::decode`], and its length must be the
//! size asked for). The client puts first; the server marks each put done
//! (`ready`) and puts back.

use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use rdmakit_channel::ChannelError;
use rdmakit_channel::PollMode;
use rdmakit_channel::put::{Detection, HandleDesc, PutEndpoint, RecvHandle, SendHandle};
use rdmakit_verbs::{AccessFlags, Error, MemoryRegion, Result, SendWr};

use crate::channel::chan;
use crate::measure::{Measured, Stamps, spin_until};
use crate::rig::{Params, REPORT_LEN, Side};

/// Longest a wait for the peer may take before the run gives up.
const PATIENCE: Duration = Duration::from_secs(30);

/// Where the descriptor's tag word sits in the exchange area (written last).
const TAG_AT: usize = REPORT_LEN - 8;

fn malformed(reason: String) -> Error {
    Error::Malformed { what: "put handle descriptor", reason }
}

/// The tag of the descriptor exchange for one size (never 0, which a fresh buffer holds).
fn tag(size: u32) -> u64 {
    0x5075_7400_0000_0000 | u64::from(size)
}

/// One end of the ping-pong: its receive handle (and buffer), and its send handle
/// associated with the peer's receive handle.
struct End {
    ep: PutEndpoint,
    recv: RecvHandle,
    send: SendHandle,
    _buf: MemoryRegion,
}

impl End {
    /// Puts, retrying while the peer has not marked the previous put done.
    fn put(&self) -> Result<()> {
        spin_until(PATIENCE, || match self.send.put() {
            Ok(()) => Ok(true),
            Err(ChannelError::Busy) => Ok(false),
            Err(e) => Err(chan(e)),
        })
    }

    /// Waits for the peer's put (a dead peer ends it: `ready_poll` keeps the connection
    /// watched).
    fn wait(&self) -> Result<()> {
        spin_until(PATIENCE, || Ok(self.ep.ready_poll().map_err(chan)? > 0))
    }
}

fn endpoint(side: &Side) -> Result<PutEndpoint> {
    PutEndpoint::new(side.qp.clone(), side.cq.clone(), PollMode::Busy).map_err(chan)
}

/// The out-of-band value of sentinel handles: the payloads here never end with it.
const SENTINEL: u64 = u64::MAX;

/// A receive handle over `buf`, detecting puts as the run asks.
fn handle(ep: &PutEndpoint, buf: &MemoryRegion, p: &Params) -> Result<RecvHandle> {
    let (initial, detection) =
        if p.sentinel { (SENTINEL, Detection::Sentinel) } else { (0, Detection::SequenceWord) };
    ep.create_handle_with(buf, |_| {}, initial, detection).map_err(chan)
}

fn recv_buffer(side: &Side, size: u32) -> Result<MemoryRegion> {
    side.qp.pd().alloc_mr(size as usize, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
}

/// Both ends in this process.
fn loopback(a: &Side, b: &Side, p: &Params) -> Result<(End, End)> {
    let size = p.size;
    let (ea, eb) = (endpoint(a)?, endpoint(b)?);
    let (ra, rb) = (recv_buffer(a, size)?, recv_buffer(b, size)?);
    let (ha, hb) = (handle(&ea, &ra, p)?, handle(&eb, &rb, p)?);
    let to_b = ea.assoc_local_buffer(&hb.desc().map_err(chan)?, a.buf.slice(0, size)?).map_err(chan)?;
    let to_a = eb.assoc_local_buffer(&ha.desc().map_err(chan)?, b.buf.slice(0, size)?).map_err(chan)?;
    Ok((End { ep: ea, recv: ha, send: to_b, _buf: ra }, End { ep: eb, recv: hb, send: to_a, _buf: rb }))
}

/// This process's end, the peer's in another: exchanges handle descriptors through the
/// exchange areas at the end of both sides' buffers.
fn across(side: &Side, p: &Params) -> Result<End> {
    let size = p.size;
    let ep = endpoint(side)?;
    let buf = recv_buffer(side, size)?;
    let recv = handle(&ep, &buf, p)?;
    let mut area = [0u8; REPORT_LEN];
    area[..HandleDesc::ENCODED_LEN].copy_from_slice(&recv.desc().map_err(chan)?.encode());
    area[TAG_AT..].copy_from_slice(&tag(size).to_le_bytes());
    // The peer's buffer descriptor came from the peer: its length is checked here, its
    // range by `slice`.
    let at = side
        .peer_buf
        .len
        .checked_sub(REPORT_LEN as u64)
        .ok_or_else(|| malformed(format!("the peer's buffer is {} bytes", side.peer_buf.len)))?;
    // Unsignalled: the endpoint counts the signalled requests on this QP as its own. A
    // failed write still completes (with an error), which breaks the endpoint.
    let dst = side.peer_buf.slice(at, REPORT_LEN as u32)?;
    side.qp.post_send(SendWr::write_inline(&area, dst).unsignaled())?;

    // The peer's descriptor, in this side's exchange area: the tag last.
    let mine = (side.buf.len() - REPORT_LEN) as u64;
    let start = Instant::now();
    while side.buf.load_u64_acquire(mine + TAG_AT as u64)? != tag(size) {
        ep.progress().map_err(chan)?;
        if start.elapsed() >= PATIENCE {
            return Err(Error::Timeout(start.elapsed()));
        }
        std::hint::spin_loop();
    }
    let mut d = [0u8; HandleDesc::ENCODED_LEN];
    side.buf.read_at(mine, &mut d)?;
    let desc = HandleDesc::decode(&d).map_err(|e| malformed(e.to_string()))?;
    if desc.buf.len != u64::from(size) {
        return Err(malformed(format!("a handle of {} bytes for {size}-byte puts", desc.buf.len)));
    }
    if desc.sentinel.is_some() != p.sentinel {
        return Err(malformed("the peer's handle detects puts another way".into()));
    }
    let send = ep.assoc_local_buffer(&desc, side.buf.slice(0, size)?).map_err(chan)?;
    Ok(End { ep, recv, send, _buf: buf })
}

fn tick(bar: &ProgressBar, i: u32) {
    if i.is_multiple_of(1024) {
        bar.set_position(u64::from(i));
    }
}

/// The client's side: against `peer` in this process (loopback), or against a server
/// running [`serve`] (`peer` is `None`).
pub fn run(side: &Side, peer: Option<&Side>, p: &Params, bar: &ProgressBar) -> Result<Measured> {
    // As every latency test here (and perftest): one clock read per iteration, a sample
    // from one iteration's start to the next's, so the receiver's ready calls count too.
    let mut stamps = Stamps::new(true, p.iters)?;
    match peer {
        Some(b) => {
            let (a, b) = loopback(side, b, p)?;
            // Queued once; each iteration's `ready` marks the put done and queues again
            // (CkDirect's loop, as the server's below).
            b.recv.ready_poll_q().map_err(chan)?;
            a.recv.ready_poll_q().map_err(chan)?;
            for i in 0..p.iters {
                stamps.post();
                a.put()?;
                b.wait()?;
                b.put()?;
                a.wait()?;
                b.recv.ready().map_err(chan)?;
                a.recv.ready().map_err(chan)?;
                tick(bar, i);
            }
        }
        None => {
            let a = across(side, p)?;
            a.recv.ready_poll_q().map_err(chan)?;
            for i in 0..p.iters {
                stamps.post();
                a.put()?;
                a.wait()?;
                a.recv.ready().map_err(chan)?;
                tick(bar, i);
            }
        }
    }
    Ok(Measured::Latency(stamps.samples(true)))
}

/// The server's side of a put-lat run: waits for each put, marks it done, puts back.
pub fn serve(side: &Side, p: &Params) -> Result<()> {
    let b = across(side, p)?;
    b.recv.ready_poll_q().map_err(chan)?;
    for _ in 0..p.iters {
        b.wait()?;
        b.recv.ready().map_err(chan)?;
        b.put()?;
    }
    // Keep the endpoint (the words the client's last writes land in) until the client is
    // done with it.
    if let Some(c) = &side.conn {
        c.wait_disconnected(Duration::from_secs(3600))?;
    }
    Ok(())
}
