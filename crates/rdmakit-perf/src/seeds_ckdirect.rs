//! `ckdirect-seed`: the CkDirect slides' evaluation (Bohm et al., Charm++ RDMA put, 2008),
//! rerun through rdmakit's persistent put handles and printed in the slides' shapes.
//!
//! - Ping-pong: a put handle each way against a send/recv ping-pong of the same size on the
//!   same kind of loopback QP pair, and CkDirect's relative improvement in percent,
//!   `(t_sendrecv - t_put) / t_sendrecv`, over a size sweep (the slides' "Ping Pong,
//!   CkDirect relative improvement, by message size").
//! - Jacobi halo: the slides' Jacobi 3D shape in 2-D: `ranks` slabs of `rows` x `cols`
//!   doubles, each iteration every slab sends its top and bottom rows (faces of `cols`
//!   doubles) to its neighbours' ghost rows, then relaxes (5-point stencil). Timed per
//!   iteration with put handles (CkDirect's split scheme, as `examples/halo_exchange.rs`),
//!   by default detection and by CkDirect's sentinel, against the same exchange over
//!   send/recv; all three give bit-identical grids (checked). The sentinel's one
//!   transaction per handle is kept by the exchange itself: a slab's next face is put only
//!   after every ghost of the iteration was taken, so the previous put was consumed.
//!
//! The slides' figures are charts (BG/P "Surveyor", and the InfiniBand cluster "Abe" at
//! NCSA); their text gives no numbers, so the seed rows name the shape of the result only:
//! a positive improvement that shrinks as messages grow. The baseline here is raw verbs
//! send/recv, not Charm++ messaging (which adds its scheduler and envelope): a harder bar.
//!
//! Everything runs in one thread (as Charm++ runs several chares on one PE): the ping-pong
//! alternates the two sides; the halo exchange posts every slab's faces, then waits for
//! every slab's ghosts. Busy polling throughout. Each cell is the median of `runs` runs.

use std::time::{Duration, Instant};

use rdmakit_channel::PollMode;
use rdmakit_channel::put::{Detection, PutEndpoint, RecvHandle, SendHandle};
use rdmakit_verbs::*;

use crate::channel::chan;
use crate::measure::spin_until;
use crate::rig::{self, Params, Placement, Side, Test};
use crate::seeds_rpipe::median;

const STUCK: Duration = Duration::from_secs(30);
const RECV_WR: u64 = 1;
const SEND_WR: u64 = 2;

/// The ping-pong's sizes up to `max`: 8 B, then 1 KiB to 1 MiB by factors of 4.
pub fn sizes(max: u32) -> Vec<u32> {
    std::iter::once(8u32)
        .chain(std::iter::successors(Some(1024u32), |&s| s.checked_mul(4)).take_while(|&s| s <= 1 << 20))
        .filter(|&s| s <= max)
        .collect()
}

fn pair(ctx: &Context, copts: &ConnectOptions, test: Test, size: u32) -> Result<(Side, Side)> {
    rig::loopback(ctx, &Params::simple(test, size, 1, 16, Placement::Host), copts)
}

/// One end of a put-handle link: a receive handle over `ghost`, a send handle from `edge`
/// into the peer's receive handle.
struct PutEnd {
    ep: PutEndpoint,
    recv: RecvHandle,
    ghost: MemoryRegion,
    send: SendHandle,
    edge: MemoryRegion,
}

/// Two ends of a put-handle link of `len`-byte buffers over a fresh loopback QP pair,
/// detecting puts as `detection` says (a sentinel handle's out-of-band value is one the
/// zero-filled edges never end with).
fn put_link(
    ctx: &Context,
    copts: &ConnectOptions,
    len: u32,
    detection: Detection,
) -> Result<(PutEnd, PutEnd, (Side, Side))> {
    let (a, b) = pair(ctx, copts, Test::PutLat, 8)?;
    let ea = PutEndpoint::new(a.qp.clone(), a.cq.clone(), PollMode::Busy).map_err(chan)?;
    let eb = PutEndpoint::new(b.qp.clone(), b.cq.clone(), PollMode::Busy).map_err(chan)?;
    let pd = a.qp.pd();
    let n = len as usize;
    let (ga, gb) = (pd.alloc_mr(n, AccessFlags::ALL_REMOTE)?, pd.alloc_mr(n, AccessFlags::ALL_REMOTE)?);
    let (xa, xb) = (pd.alloc_mr(n, AccessFlags::LOCAL_WRITE)?, pd.alloc_mr(n, AccessFlags::LOCAL_WRITE)?);
    let initial = if detection == Detection::Sentinel { u64::MAX } else { 0 };
    let ha = ea.create_handle_with(&ga, |_| {}, initial, detection).map_err(chan)?;
    let hb = eb.create_handle_with(&gb, |_| {}, initial, detection).map_err(chan)?;
    let sa = ea.assoc_local_buffer(&hb.desc().map_err(chan)?, xa.local()?).map_err(chan)?;
    let sb = eb.assoc_local_buffer(&ha.desc().map_err(chan)?, xb.local()?).map_err(chan)?;
    Ok((
        PutEnd { ep: ea, recv: ha, ghost: ga, send: sa, edge: xa },
        PutEnd { ep: eb, recv: hb, ghost: gb, send: sb, edge: xb },
        (a, b),
    ))
}

impl PutEnd {
    /// Puts the edge buffer, waiting for the receiver to have consumed the previous put.
    fn put(&self) -> Result<()> {
        spin_until(STUCK, || self.send.is_ready().map_err(chan))?;
        self.send.put().map_err(chan)
    }

    /// Waits for the queued receive handle's put (runs its callback).
    fn wait(&self) -> Result<()> {
        spin_until(STUCK, || Ok(self.ep.ready_poll().map_err(chan)? > 0))
    }
}

/// One end of a send/recv link: receives land in `ghost`, sends go from `edge`.
struct MsgEnd {
    side: Side,
    ghost: MemoryRegion,
    edge: MemoryRegion,
    len: u32,
    /// A send posted and its completion not reaped yet.
    sending: bool,
    /// A receive completed and not taken yet (reaped while waiting for a send).
    received: bool,
}

fn msg_link(ctx: &Context, copts: &ConnectOptions, len: u32) -> Result<(MsgEnd, MsgEnd)> {
    let (a, b) = pair(ctx, copts, Test::SendLat, 8)?;
    let n = len as usize;
    let mk = |side: Side| -> Result<MsgEnd> {
        let pd = side.qp.pd();
        let ghost = pd.alloc_mr(n, AccessFlags::LOCAL_WRITE)?;
        let edge = pd.alloc_mr(n, AccessFlags::LOCAL_WRITE)?;
        side.qp.post_recv(RecvWr::new(ghost.local()?).wr_id(RECV_WR))?;
        Ok(MsgEnd { side, ghost, edge, len, sending: false, received: false })
    };
    Ok((mk(a)?, mk(b)?))
}

impl MsgEnd {
    /// Sends the edge buffer (after the previous send's completion: the buffer is free).
    fn send(&mut self) -> Result<()> {
        while self.sending {
            self.reap()?;
        }
        self.side.qp.post_send(SendWr::send(self.edge.slice(0, self.len)?).wr_id(SEND_WR))?;
        self.sending = true;
        Ok(())
    }

    /// Reaps one completion.
    fn reap(&mut self) -> Result<()> {
        let wc = self.side.cq.spin(STUCK)?.ok()?;
        match wc.wr_id {
            RECV_WR if !self.received => self.received = true,
            SEND_WR if self.sending => self.sending = false,
            other => return Err(Error::InvalidArgument(format!("an unexpected completion (wr_id {other})"))),
        }
        Ok(())
    }

    /// Waits for the peer's message in `ghost`; the caller reposts with [`repost`](Self::repost)
    /// once it has read it.
    fn wait(&mut self) -> Result<()> {
        while !self.received {
            self.reap()?;
        }
        self.received = false;
        Ok(())
    }

    fn repost(&self) -> Result<()> {
        self.side.qp.post_recv(RecvWr::new(self.ghost.local()?).wr_id(RECV_WR))
    }
}

/// Median half round trip (us) of `iters` put ping-pongs.
fn put_pingpong(a: &PutEnd, b: &PutEnd, iters: u32) -> Result<f64> {
    let mut lat = crate::measure::samples_vec(iters as usize)?;
    for _ in 0..iters {
        b.recv.ready_poll_q().map_err(chan)?;
        a.recv.ready_poll_q().map_err(chan)?;
        let t = Instant::now();
        a.put()?;
        b.wait()?;
        b.put()?;
        a.wait()?;
        lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        b.recv.ready_mark().map_err(chan)?;
        a.recv.ready_mark().map_err(chan)?;
    }
    Ok(median(&mut lat))
}

/// Median half round trip (us) of `iters` send/recv ping-pongs. The receives are posted
/// again outside the timed part, as the put ping-pong re-arms its handles outside it: each
/// side's receive is back before the next message can come.
fn msg_pingpong(a: &mut MsgEnd, b: &mut MsgEnd, iters: u32) -> Result<f64> {
    let mut lat = crate::measure::samples_vec(iters as usize)?;
    for _ in 0..iters {
        let t = Instant::now();
        a.send()?;
        b.wait()?;
        b.send()?;
        a.wait()?;
        lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        b.repost()?;
        a.repost()?;
    }
    Ok(median(&mut lat))
}

/// One row of the ping-pong table: half round trips in us.
pub struct PingPongRow {
    pub size: u32,
    /// Put handles, rdmakit's default detection (sequence word).
    pub put: f64,
    /// Put handles, CkDirect's sentinel (one write per put).
    pub put_sentinel: f64,
    /// Send/recv.
    pub send_recv: f64,
}

/// The ping-pong table's rows.
pub fn pingpong_rows(
    ctx: &Context,
    copts: &ConnectOptions,
    max: u32,
    iters: u32,
    runs: usize,
) -> Result<Vec<PingPongRow>> {
    let mut rows = Vec::new();
    for s in sizes(max) {
        let (pa, pb, _keep) = put_link(ctx, copts, s, Detection::SequenceWord)?;
        let (qa, qb, _keep_s) = put_link(ctx, copts, s, Detection::Sentinel)?;
        let (mut ma, mut mb) = msg_link(ctx, copts, s)?;
        // Warm up all three, then interleave their runs (the machine's load hits them alike).
        put_pingpong(&pa, &pb, iters.min(64))?;
        put_pingpong(&qa, &qb, iters.min(64))?;
        msg_pingpong(&mut ma, &mut mb, iters.min(64))?;
        let (mut vp, mut vq, mut vm) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..runs {
            vp.push(put_pingpong(&pa, &pb, iters)?);
            vq.push(put_pingpong(&qa, &qb, iters)?);
            vm.push(msg_pingpong(&mut ma, &mut mb, iters)?);
        }
        rows.push(PingPongRow {
            size: s,
            put: median(&mut vp),
            put_sentinel: median(&mut vq),
            send_recv: median(&mut vm),
        });
    }
    Ok(rows)
}

/// The grid of one slab: `rows + 2` rows (ghosts first and last) of `cols` doubles.
struct Slab {
    u: Vec<f64>,
    next: Vec<f64>,
    rows: usize,
    cols: usize,
}

impl Slab {
    fn new(rank: usize, rows: usize, cols: usize) -> Slab {
        let mut u = vec![0.0; (rows + 2) * cols];
        if rank == 0 {
            u[..cols].fill(1.0); // the hot top boundary
        }
        Slab { next: u.clone(), u, rows, cols }
    }

    fn row(&self, i: usize) -> &[f64] {
        &self.u[i * self.cols..(i + 1) * self.cols]
    }

    fn set_row(&mut self, i: usize, bytes: &[u8]) {
        let cols = self.cols;
        for (x, b) in self.u[i * cols..(i + 1) * cols].iter_mut().zip(bytes.chunks_exact(8)) {
            *x = f64::from_le_bytes(b.try_into().expect("8 bytes"));
        }
    }

    /// One Jacobi sweep over the interior (5-point; columns at the sides are fixed, a
    /// single column is a 1-D rod).
    fn relax(&mut self) {
        let c = self.cols;
        for i in 1..=self.rows {
            for j in 0..c {
                let up = self.u[(i - 1) * c + j];
                let down = self.u[(i + 1) * c + j];
                self.next[i * c + j] = if c < 3 {
                    0.5 * (up + down)
                } else if j == 0 || j == c - 1 {
                    self.u[i * c + j]
                } else {
                    0.25 * (up + down + self.u[i * c + j - 1] + self.u[i * c + j + 1])
                };
            }
        }
        let (rows, cols) = (self.rows, self.cols);
        self.u[cols..(rows + 1) * cols].copy_from_slice(&self.next[cols..(rows + 1) * cols]);
    }
}

fn row_bytes(row: &[f64]) -> Vec<u8> {
    row.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The halo exchange's transport between neighbours.
trait Halo {
    /// Posts this end's face (the bytes already in its edge buffer).
    fn post(&mut self) -> Result<()>;
    /// Waits for the neighbour's face and copies it out.
    fn take(&mut self, out: &mut [u8]) -> Result<()>;
    fn edge(&self) -> &MemoryRegion;
    /// Before the face is rewritten: the previous one may still be read by the NIC.
    fn edge_free(&mut self) -> Result<()>;
}

impl Halo for PutEnd {
    fn post(&mut self) -> Result<()> {
        self.recv.ready_poll_q().map_err(chan)?;
        self.send.put().map_err(chan)
    }
    fn take(&mut self, out: &mut [u8]) -> Result<()> {
        self.wait()?;
        self.ghost.read_at(0, out)?;
        self.recv.ready_mark().map_err(chan) // done with the data: the neighbour may put again
    }
    fn edge(&self) -> &MemoryRegion {
        &self.edge
    }
    fn edge_free(&mut self) -> Result<()> {
        spin_until(STUCK, || self.send.is_ready().map_err(chan))
    }
}

impl Halo for MsgEnd {
    fn post(&mut self) -> Result<()> {
        self.send()
    }
    fn take(&mut self, out: &mut [u8]) -> Result<()> {
        self.wait()?;
        self.ghost.read_at(0, out)?;
        self.repost()
    }
    fn edge(&self) -> &MemoryRegion {
        &self.edge
    }
    fn edge_free(&mut self) -> Result<()> {
        while self.sending {
            self.reap()?;
        }
        Ok(())
    }
}

/// Per iteration (us, the median over a run's iterations): the whole iteration, and the
/// exchange alone (posting the faces and taking the ghosts, without the relaxation).
#[derive(Clone, Copy, Debug)]
pub struct IterTime {
    /// The whole iteration.
    pub total: f64,
    /// The halo exchange alone.
    pub exchange: f64,
}

/// Runs `iters` Jacobi iterations over `links` (link r joins slab r's bottom to slab r+1's
/// top); returns the typical (median) times per iteration and the final grids.
fn jacobi<H: Halo>(
    links: &mut [(H, H)],
    rows: usize,
    cols: usize,
    iters: u32,
) -> Result<(IterTime, Vec<Vec<f64>>)> {
    let ranks = links.len() + 1;
    let mut slabs: Vec<Slab> = (0..ranks).map(|r| Slab::new(r, rows, cols)).collect();
    let mut buf = vec![0u8; cols * 8];
    let (mut totals, mut exchanges) =
        (crate::measure::samples_vec(iters as usize)?, crate::measure::samples_vec(iters as usize)?);
    for _ in 0..iters {
        let t = Instant::now();
        // Every slab posts its faces: its bottom row down the link below, its top row up.
        for (r, (down, up)) in links.iter_mut().enumerate() {
            down.edge_free()?;
            down.edge().write_at(0, &row_bytes(slabs[r].row(rows)))?;
            down.post()?;
            up.edge_free()?;
            up.edge().write_at(0, &row_bytes(slabs[r + 1].row(1)))?;
            up.post()?;
        }
        // Every slab takes its ghosts, then relaxes.
        for (r, (down, up)) in links.iter_mut().enumerate() {
            down.take(&mut buf)?; // slab r+1's top row into slab r's bottom ghost
            slabs[r].set_row(rows + 1, &buf);
            up.take(&mut buf)?;
            slabs[r + 1].set_row(0, &buf);
        }
        exchanges.push(t.elapsed().as_secs_f64() * 1e6);
        for s in &mut slabs {
            s.relax();
        }
        totals.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let time = IterTime { total: median(&mut totals), exchange: median(&mut exchanges) };
    Ok((time, slabs.into_iter().map(|s| s.u).collect()))
}

/// One row of the Jacobi table: the face's bytes and each transport's times per iteration.
#[derive(Clone, Copy, Debug)]
pub struct HaloRow {
    /// Bytes of a face (a row of doubles).
    pub face: u32,
    /// Put handles, default detection (sequence word and ready signal).
    pub put: IterTime,
    /// Put handles, CkDirect's sentinel (one write per face).
    pub put_sentinel: IterTime,
    /// Send/recv.
    pub send_recv: IterTime,
}

/// The links of one halo exchange: `ranks - 1` put-handle links detecting puts as
/// `detection` says (and their QP pairs, kept alive).
type PutLinks = (Vec<(PutEnd, PutEnd)>, Vec<(Side, Side)>);

fn put_links(
    ctx: &Context,
    copts: &ConnectOptions,
    ranks: usize,
    len: u32,
    detection: Detection,
) -> Result<PutLinks> {
    let (mut links, mut keep) = (Vec::new(), Vec::new());
    for _ in 0..ranks - 1 {
        let (a, b, k) = put_link(ctx, copts, len, detection)?;
        links.push((a, b));
        keep.push(k);
    }
    Ok((links, keep))
}

/// The rows of the Jacobi table, one per face size: the three transports run in turn,
/// `runs` times each, and each cell is the median of its runs.
pub fn jacobi_rows(
    ctx: &Context,
    copts: &ConnectOptions,
    ranks: usize,
    rows: usize,
    faces: &[u32],
    iters: u32,
    runs: usize,
) -> Result<Vec<HaloRow>> {
    if ranks < 2 {
        return Err(Error::InvalidArgument("--ranks must be at least 2 (a halo needs a neighbour)".into()));
    }
    let mut out = Vec::new();
    for &face in faces {
        let cols = (face as usize / 8).max(1);
        let len = (cols * 8) as u32;
        let (mut puts, _keep) = put_links(ctx, copts, ranks, len, Detection::SequenceWord)?;
        let (mut sentinels, _keep_s) = put_links(ctx, copts, ranks, len, Detection::Sentinel)?;
        let mut msgs = (0..ranks - 1).map(|_| msg_link(ctx, copts, len)).collect::<Result<Vec<_>>>()?;
        let (mut vp, mut vs, mut vm) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..runs {
            let (tp, gp) = jacobi(&mut puts, rows, cols, iters)?;
            let (ts, gs) = jacobi(&mut sentinels, rows, cols, iters)?;
            let (tm, gm) = jacobi(&mut msgs, rows, cols, iters)?;
            // The same arithmetic on the same ghosts: any difference is a lost or torn face.
            let same = |g: &[Vec<f64>]| {
                g.iter().flatten().zip(gm.iter().flatten()).all(|(a, b)| a.to_bits() == b.to_bits())
            };
            for (g, what) in [(&gp, "put-handle"), (&gs, "sentinel put-handle")] {
                if !same(g) {
                    return Err(Error::InvalidArgument(format!(
                        "jacobi: the {what} and send/recv grids differ ({face}-byte faces)"
                    )));
                }
            }
            vp.push(tp);
            vs.push(ts);
            vm.push(tm);
        }
        let med = |v: &[IterTime]| IterTime {
            total: median(&mut v.iter().map(|t| t.total).collect::<Vec<_>>()),
            exchange: median(&mut v.iter().map(|t| t.exchange).collect::<Vec<_>>()),
        };
        out.push(HaloRow { face: len, put: med(&vp), put_sentinel: med(&vs), send_recv: med(&vm) });
    }
    Ok(out)
}

fn label(size: u32) -> String {
    match size {
        s if s >= 1 << 20 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

/// The options of the CkDirect seed benchmark.
pub struct CkOpts {
    /// The largest ping-pong size.
    pub max_size: u32,
    /// Ping-pong round trips per run.
    pub iters: u32,
    /// Runs per cell (the median is reported).
    pub runs: usize,
    /// Slabs of the Jacobi grid.
    pub ranks: usize,
    /// Rows per slab.
    pub rows: usize,
    /// Face sizes of the Jacobi exchange, in bytes.
    pub faces: Vec<u32>,
    /// Jacobi iterations per run.
    pub jacobi_iters: u32,
}

/// The two tables of the CkDirect seed on `ctx`.
pub fn ckdirect_seed(ctx: &Context, copts: &ConnectOptions, o: &CkOpts) -> Result<()> {
    if sizes(o.max_size).is_empty() {
        return Err(Error::InvalidArgument(format!(
            "--max-size {} is below the smallest size (8 B)",
            o.max_size
        )));
    }
    let kind = if ctx.provider() == ProviderKind::Soft { "soft" } else { "rxe/verbs" };
    println!(
        "ckdirect-seed on {} ({:?} provider: {kind}), loopback in one thread, busy polling, median of {} runs; seed: CkDirect (Charm++), IBM BG/P \"Surveyor\" and the InfiniBand cluster \"Abe\"",
        ctx.name(),
        ctx.provider(),
        o.runs
    );
    println!();
    println!(
        "ping-pong, half round trip [us] (median of {} per run): put handles (default: sequence word; sentinel: CkDirect's one-write put) vs send/recv, CkDirect's relative improvement",
        o.iters
    );
    println!(
        "{:<10} {:>12} {:>12} {:>12} {:>12} {:>12}   {:<8}",
        "size", "put handle", "put sentinel", "send/recv", "improvement", "sentinel imp", ""
    );
    for r in pingpong_rows(ctx, copts, o.max_size, o.iters, o.runs)? {
        let m = r.send_recv;
        println!(
            "{:<10} {:>12.3} {:>12.3} {:>12.3} {:>11.1}% {:>11.1}%   {kind}",
            label(r.size),
            r.put,
            r.put_sentinel,
            m,
            (m - r.put) / m * 100.0,
            (m - r.put_sentinel) / m * 100.0
        );
    }
    println!(
        "{:<10} {:>12} {:>12} {:>12} {:>12} {:>12}   seed (charts only, on BG/P and Abe: CkDirect ahead of Charm++ messages, most at small sizes)",
        "", "", "", "", "> 0%", "> 0%"
    );
    println!();
    println!(
        "Jacobi halo exchange, {} slabs x {} rows, typical (median) of {} iterations per run: time per iteration [us] and the exchange alone, put handles (default; sentinel) vs send/recv",
        o.ranks, o.rows, o.jacobi_iters
    );
    println!(
        "{:<8} {:>10} {:>10} {:>10} {:>8} {:>8}   {:>10} {:>10} {:>10} {:>8} {:>8}   {:<8}",
        "face",
        "put: iter",
        "sent: iter",
        "s/r: iter",
        "imp",
        "sent imp",
        "put: exch",
        "sent: exch",
        "s/r: exch",
        "imp",
        "sent imp",
        ""
    );
    let imp = |base: f64, t: f64| (base - t) / base * 100.0;
    for r in jacobi_rows(ctx, copts, o.ranks, o.rows, &o.faces, o.jacobi_iters, o.runs)? {
        let (p, s, m) = (r.put, r.put_sentinel, r.send_recv);
        println!(
            "{:<8} {:>10.2} {:>10.2} {:>10.2} {:>7.1}% {:>7.1}%   {:>10.2} {:>10.2} {:>10.2} {:>7.1}% {:>7.1}%   {kind}",
            label(r.face),
            p.total,
            s.total,
            m.total,
            imp(m.total, p.total),
            imp(m.total, s.total),
            p.exchange,
            s.exchange,
            m.exchange,
            imp(m.exchange, p.exchange),
            imp(m.exchange, s.exchange)
        );
    }
    println!(
        "{:<8} {:>10} {:>10} {:>10} {:>8} {:>8}   {:>10} {:>10} {:>10} {:>8} {:>8}   seed (charts only: Jacobi 3D 1024x1024x512, iteration time improved by CkDirect on BG/P and Abe)",
        "", "", "", "", "> 0%", "> 0%", "", "", "", "", ""
    );
    if ctx.provider() == ProviderKind::Soft {
        println!(
            "soft NIC: software RDMA in this process; a put costs three writes by default (data, sequence word, the receiver's ready signal) and one with the sentinel, a send one message, all through the same software engine, so the comparison is of rdmakit's paths, not of an HCA's"
        );
    }
    Ok(())
}

/// `ckdirect-seed`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct CkArgs {
    #[command(flatten)]
    pub(crate) dev: crate::DeviceOpts,
    /// The largest ping-pong size (8 B, then 1 KiB to 1 MiB by factors of 4).
    #[arg(long, default_value_t = 1 << 20)]
    max_size: u32,
    /// Ping-pong round trips per run.
    #[arg(short = 'n', long, default_value_t = 2000)]
    iters: u32,
    /// Runs per cell; the median is reported.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Slabs of the Jacobi grid (neighbours in a line).
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// Rows of each slab.
    #[arg(long, default_value_t = 16)]
    rows: usize,
    /// Face sizes of the halo exchange in bytes (a row of doubles), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [64u32, 1024, 8192, 65536])]
    faces: Vec<u32>,
    /// Jacobi iterations per run.
    #[arg(long, default_value_t = 500)]
    jacobi_iters: u32,
}

/// Runs `ckdirect-seed` with `a`'s options.
pub(crate) fn run(ctx: &Context, copts: &ConnectOptions, a: &CkArgs) -> Result<()> {
    if a.faces.iter().any(|&f| !(8..=rig::MAX_SIZE).contains(&f)) {
        return Err(Error::InvalidArgument(format!("--faces must each be 8..={} bytes", rig::MAX_SIZE)));
    }
    if a.ranks < 2 {
        return Err(Error::InvalidArgument("--ranks must be at least 2 (a halo needs a neighbour)".into()));
    }
    let o = CkOpts {
        max_size: a.max_size.min(rig::MAX_SIZE),
        iters: a.iters.max(1),
        runs: a.runs.max(1),
        ranks: a.ranks,
        rows: a.rows.max(1),
        faces: a.faces.clone(),
        jacobi_iters: a.jacobi_iters.max(1),
    };
    ckdirect_seed(ctx, copts, &o)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole grid relaxed in one slab, for comparison.
    fn serial(ranks: usize, rows: usize, cols: usize, iters: u32) -> Vec<f64> {
        let mut s = Slab::new(0, ranks * rows, cols);
        for _ in 0..iters {
            s.relax();
        }
        s.u[cols..(ranks * rows + 1) * cols].to_vec()
    }

    fn interiors(grids: &[Vec<f64>], rows: usize, cols: usize) -> Vec<f64> {
        grids.iter().flat_map(|u| u[cols..(rows + 1) * cols].iter().copied()).collect()
    }

    /// All three transports' halo exchanges give exactly the single-slab result: every face
    /// arrives, whole and in its iteration (a lost or stale ghost would change the heat
    /// front), for a 1-D rod (one column) and a 2-D slab.
    #[test]
    fn both_halo_exchanges_match_the_serial_grid() {
        let ctx = Context::open_soft();
        let copts = ConnectOptions::default();
        let (ranks, rows, iters) = (3usize, 4usize, 40u32);
        for cols in [1usize, 16] {
            let len = (cols * 8) as u32;
            let want = serial(ranks, rows, cols, iters);
            let (mut puts, _keep) =
                put_links(&ctx, &copts, ranks, len, Detection::SequenceWord).expect("put links");
            let (mut sentinels, _keep_s) =
                put_links(&ctx, &copts, ranks, len, Detection::Sentinel).expect("sentinel put links");
            let mut msgs: Vec<_> =
                (0..ranks - 1).map(|_| msg_link(&ctx, &copts, len).expect("send/recv link")).collect();
            let (_, gp) = jacobi(&mut puts, rows, cols, iters).expect("put handles");
            let (_, gs) = jacobi(&mut sentinels, rows, cols, iters).expect("sentinel put handles");
            let (_, gm) = jacobi(&mut msgs, rows, cols, iters).expect("send/recv");
            // The heat reached the last slab: the exchange carried it across both links.
            assert!(want[want.len() - cols + cols / 2] > 0.0);
            assert_eq!(interiors(&gp, rows, cols), want, "put handles, {cols} columns");
            assert_eq!(interiors(&gs, rows, cols), want, "sentinel put handles, {cols} columns");
            assert_eq!(interiors(&gm, rows, cols), want, "send/recv, {cols} columns");
        }
    }

    #[test]
    fn the_sweep_sizes() {
        assert_eq!(sizes(8), [8]);
        assert_eq!(sizes(4096), [8, 1024, 4096]);
        assert_eq!(sizes(1 << 30).last(), Some(&(1 << 20)));
        assert!(sizes(4).is_empty());
    }
}
