//! A 1-D Jacobi halo exchange with persistent put handles (CkDirect style) between four
//! ranks on the soft NIC, checked against a serial run.
//!
//! Each rank owns `N` cells of a rod with fixed ends; every iteration it puts its edge cells
//! into its neighbours' ghost cells (one RDMA write each, set up once), waits for its own
//! ghosts with CkDirect's split scheme: `ready_poll_q` (start checking) then `ready_poll`
//! (runs the callbacks), copies each ghost out and calls `ready_mark` at once (done with the
//! data: the neighbour may put again, but polling starts only next iteration), then relaxes.
//!
//! `cargo run --example halo_exchange`

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdmakit::channel::put::{PutEndpoint, RecvHandle, SendHandle};
use rdmakit::channel::{ChannelError, PollMode};
use rdmakit::*;

const RANKS: usize = 4;
const N: usize = 64;
const ITERS: usize = 200;

/// One rank's link to a neighbour: a put endpoint each way on one QP pair.
struct Link {
    ep: PutEndpoint,
    ghost: RecvHandle, // the neighbour's edge lands here
    ghost_buf: MemoryRegion,
    edge: SendHandle, // our edge goes there
    edge_buf: MemoryRegion,
}

fn serial() -> Vec<f64> {
    let mut u = vec![0.0; RANKS * N + 2];
    u[0] = 1.0; // hot left end, cold right end
    for _ in 0..ITERS {
        let prev = u.clone();
        for i in 1..=RANKS * N {
            u[i] = 0.5 * (prev[i - 1] + prev[i + 1]);
        }
    }
    u[1..=RANKS * N].to_vec()
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let pd = Context::open_soft().alloc_pd()?;
    let caps = QpCaps::default().with_max_inline_data(64);
    // links[r] = (link to the left neighbour, link to the right neighbour)
    let mut lefts: Vec<Option<Link>> = (0..RANKS).map(|_| None).collect();
    let mut rights: Vec<Option<Link>> = (0..RANKS).map(|_| None).collect();
    for r in 0..RANKS - 1 {
        let (ca, cb) = (pd.context().create_cq(256)?, pd.context().create_cq(256)?);
        let (qa, qb) = (pd.create_qp(&ca, &ca, caps)?, pd.create_qp(&cb, &cb, caps)?);
        qa.connect(&qb.address()?, &ConnectOptions::default())?;
        qb.connect(&qa.address()?, &ConnectOptions::default())?;
        let (ea, eb) = (PutEndpoint::new(qa, ca, PollMode::Busy)?, PutEndpoint::new(qb, cb, PollMode::Busy)?);
        let mk = |ep: &PutEndpoint| -> std::result::Result<(RecvHandle, MemoryRegion), ChannelError> {
            let buf = pd.alloc_mr(8, AccessFlags::ALL_REMOTE)?;
            Ok((ep.create_handle(&buf, |_| {}, f64::to_bits(-1.0))?, buf))
        };
        let ((ga, ga_buf), (gb, gb_buf)) = (mk(&ea)?, mk(&eb)?);
        let (sa_buf, sb_buf) =
            (pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?, pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?);
        let sa = ea.assoc_local_buffer(&gb.desc()?, sa_buf.local()?)?; // r's right edge -> r+1's left ghost
        let sb = eb.assoc_local_buffer(&ga.desc()?, sb_buf.local()?)?; // r+1's left edge -> r's right ghost
        rights[r] = Some(Link { ep: ea, ghost: ga, ghost_buf: ga_buf, edge: sa, edge_buf: sa_buf });
        lefts[r + 1] = Some(Link { ep: eb, ghost: gb, ghost_buf: gb_buf, edge: sb, edge_buf: sb_buf });
    }
    let result = Arc::new(Mutex::new(vec![0.0; RANKS * N]));
    std::thread::scope(|s| -> std::result::Result<(), ChannelError> {
        let mut ranks = Vec::new();
        for (rank, (left, right)) in lefts.into_iter().zip(rights).enumerate() {
            let result = result.clone();
            ranks.push(s.spawn(move || -> std::result::Result<(), ChannelError> {
                let mut u = vec![0.0f64; N + 2]; // with ghosts at 0 and N+1
                if rank == 0 {
                    u[0] = 1.0;
                }
                let links: Vec<(&Link, usize, usize)> = [(left.as_ref(), 1, 0), (right.as_ref(), N, N + 1)]
                    .into_iter()
                    .filter_map(|(l, edge, ghost)| l.map(|l| (l, edge, ghost)))
                    .collect();
                for _ in 0..ITERS {
                    for (l, edge, _) in &links {
                        // CkDirect_readyPollQ: the ghost was marked done last iteration;
                        // start checking for this iteration's put.
                        l.ghost.ready_poll_q()?;
                        // Until the neighbour has consumed our last put (a put now would be
                        // `Busy`), the NIC may still be reading the edge buffer: wait first.
                        let start = std::time::Instant::now();
                        while !l.edge.is_ready()? {
                            if start.elapsed() > Duration::from_secs(10) {
                                return Err(ChannelError::Timeout(Duration::from_secs(10)));
                            }
                        }
                        l.edge_buf.write_at(0, &u[*edge].to_ne_bytes())?;
                        l.edge.put()?;
                    }
                    for (l, _, ghost) in &links {
                        let start = std::time::Instant::now();
                        while l.ep.ready_poll()? == 0 {
                            if start.elapsed() > Duration::from_secs(10) {
                                return Err(ChannelError::Timeout(Duration::from_secs(10)));
                            }
                        }
                        let mut b = [0u8; 8];
                        l.ghost_buf.read_at(0, &mut b)?;
                        u[*ghost] = f64::from_ne_bytes(b);
                        // CkDirect_readyMark: done with the data (copied out); the neighbour
                        // may put again while this rank relaxes.
                        l.ghost.ready_mark()?;
                    }
                    let prev = u.clone();
                    for i in 1..=N {
                        u[i] = 0.5 * (prev[i - 1] + prev[i + 1]);
                    }
                }
                result.lock().expect("result")[rank * N..(rank + 1) * N].copy_from_slice(&u[1..=N]);
                Ok(())
            }));
        }
        // A rank that failed (a time-out, a broken link) fails the run.
        ranks.into_iter().try_for_each(|r| r.join().expect("rank thread panicked"))
    })?;
    let got = result.lock().expect("result").clone();
    let want = serial();
    let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    println!("{RANKS} ranks x {N} cells, {ITERS} iterations: max difference from the serial run {err:e}");
    println!("u[0..8] = {:?}", &got[..8].iter().map(|x| (x * 1000.0).round() / 1000.0).collect::<Vec<_>>());
    assert!(err < 1e-12, "halo exchange diverged from the serial computation");
    Ok(())
}
