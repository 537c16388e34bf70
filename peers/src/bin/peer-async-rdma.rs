//! rdmakit's write benchmarks through datenlord's `async-rdma` crate (tokio).
//!
//! async-rdma hands a region to one side at a time (a `LocalMr` is moved to the peer to be
//! written, and handed back), so a side cannot spin on bytes the peer writes into its region
//! as rdmakit-perf's write-lat does. Its own way to learn that a write landed is a write with
//! immediate and `receive_write_imm`; that is what write-lat uses here. write-bw keeps
//! `--tx-depth` writes in flight, each into its own remote region (a `RemoteMr` is written
//! through `&mut`, so one region serves one write at a time).

use std::alloc::Layout;
use std::io;
use std::process::ExitCode;
use std::time::Instant;

use async_rdma::{LocalMr, Rdma, RdmaBuilder, RemoteMr};
use futures::stream::{FuturesUnordered, StreamExt};
use rdmakit_peers_bench::{Measured, Opts, Test};

const CRATE: &str = "async-rdma 0.5.0";

fn main() -> ExitCode {
    let run = || -> io::Result<()> {
        let o = rdmakit_peers_bench::opts()?;
        let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
        rt.block_on(run(&o))
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{CRATE}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn layout(size: u32) -> io::Result<Layout> {
    Layout::from_size_align(size as usize, 8).map_err(io::Error::other)
}

async fn run(o: &Opts) -> io::Result<()> {
    if !matches!(o.test, Test::WriteLat | Test::WriteBw) {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "only write-lat and write-bw are measured through async-rdma",
        ));
    }
    let builder = RdmaBuilder::new()
        .set_dev(o.device)
        .set_gid_index(o.gid_index as usize)
        .set_qp_max_send_wr(o.window + 16)
        .set_qp_max_recv_wr(o.window + 16);
    let server = o.server.is_some();
    let rdma = match (o.server, o.connect) {
        (Some(a), _) => builder.listen(a).await?,
        (_, Some(a)) => builder.connect(a).await?,
        _ => return Err(io::Error::other("no address")),
    };
    let done_mr = rdma.alloc_local_mr(layout(8)?)?;
    match (o.test, server) {
        (Test::WriteLat, _) => {
            let mut rmr = rdma.request_remote_mr(layout(o.size)?).await?;
            let lmr = rdma.alloc_local_mr(layout(o.size)?)?;
            let mut lat = Vec::with_capacity(o.iters as usize);
            for i in 0..o.iters {
                let t = Instant::now();
                if server {
                    rdma.receive_write_imm().await?;
                    rdma.write_with_imm(&lmr, &mut rmr, i).await?;
                } else {
                    rdma.write_with_imm(&lmr, &mut rmr, i).await?;
                    rdma.receive_write_imm().await?;
                    lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
                }
            }
            finish(&rdma, &done_mr, server).await?;
            if !server {
                rdmakit_peers_bench::report(CRATE, o, &Measured::Latency(lat));
            }
        }
        (Test::WriteBw, true) => finish(&rdma, &done_mr, true).await?,
        (Test::WriteBw, false) => {
            let window = o.window.min(o.iters);
            let mut free: Vec<(LocalMr, RemoteMr)> = Vec::with_capacity(window as usize);
            for _ in 0..window {
                let r = rdma.request_remote_mr(layout(o.size)?).await?;
                free.push((rdma.alloc_local_mr(layout(o.size)?)?, r));
            }
            let rdma = &rdma;
            let write = |(l, mut r): (LocalMr, RemoteMr)| async move {
                rdma.write(&l, &mut r).await.map(|()| (l, r))
            };
            let mut inflight = FuturesUnordered::new();
            let start = Instant::now();
            let mut posted = 0u32;
            for pair in free.drain(..) {
                inflight.push(write(pair));
                posted += 1;
            }
            while let Some(done) = inflight.next().await {
                let pair = done?;
                if posted < o.iters {
                    inflight.push(write(pair));
                    posted += 1;
                }
            }
            let secs = start.elapsed().as_secs_f64().max(1e-9);
            finish(rdma, &done_mr, false).await?;
            let n = f64::from(o.iters);
            rdmakit_peers_bench::report(
                CRATE,
                o,
                &Measured::Bandwidth { bytes_per_sec: n * f64::from(o.size) / secs, msgs_per_sec: n / secs },
            );
        }
        _ => unreachable!("checked above"),
    }
    Ok(())
}

/// The end of a run: the client sends one message, the server waits for it, so neither side
/// drops its connection while the other still uses it.
async fn finish(rdma: &Rdma, mr: &LocalMr, server: bool) -> io::Result<()> {
    if server { rdma.receive().await.map(drop) } else { rdma.send(mr).await }
}
