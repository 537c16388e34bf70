//! MEMIC counters shared by several peers with fetch-and-add.
//!
//! One "server" holds a pool of 8-byte counters in NIC on-chip memory (emulated by the soft
//! NIC; on a device without device memory they fall back to host memory and the example
//! says so). Four peers, each with its own QP and thread, hammer the counters with
//! fetch-and-add; the totals must come out exact.
//!
//! `cargo run --example memic_counters`

use std::time::Duration;

use rdmakit::memory::memic::{Counter, CounterPool, Memic, Placement};
use rdmakit::*;

const PEERS: u64 = 4;
const ADDS: u64 = 2_000;
const COUNTERS: usize = 3;

fn main() -> Result<()> {
    let server = Context::open_soft_with(SoftConfig::default())?;
    let spd = server.alloc_pd()?;
    let memic = Memic::open(&spd);
    if let Some(why) = memic.unavailable_reason() {
        println!("no MEMIC on {}: {why}", server.name());
    }
    let pool = CounterPool::new(&memic, COUNTERS as u32, Placement::NicPreferred)?;
    let counters: Vec<_> =
        (0..COUNTERS).map(|_| pool.alloc().map(|c| c.expect("free counter"))).collect::<Result<_>>()?;
    println!(
        "{} counters live in {:?} memory: one {}-byte region at address {:#x}",
        COUNTERS,
        pool.location(),
        pool.region().len(),
        pool.region().remote().addr
    );
    let targets: Vec<RemoteSlice> = counters.iter().map(Counter::remote).collect::<Result<_>>()?;

    std::thread::scope(|s| -> Result<()> {
        let mut workers = Vec::new();
        for peer in 0..PEERS {
            // Each peer: its own device, QP and result buffer, connected to a server QP.
            let ctx = Context::open_soft_with(SoftConfig::default())?;
            let pd = ctx.alloc_pd()?;
            let cq = ctx.create_cq(64)?;
            let qp = pd.create_qp(&cq, &cq, QpCaps::default())?;
            let scq = server.create_cq(64)?;
            let sqp = spd.create_qp(&scq, &scq, QpCaps::default())?;
            qp.connect(&sqp.address()?, &ConnectOptions::default())?;
            sqp.connect(&qp.address()?, &ConnectOptions::default())?;
            let targets = targets.clone();
            workers.push(s.spawn(move || -> Result<()> {
                let _server_side = (sqp, scq);
                let result = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
                for i in 0..ADDS {
                    let target = targets[(i as usize + peer as usize) % COUNTERS];
                    qp.post_send(SendWr::fetch_add(result.local()?, target, peer + 1))?;
                    cq.wait(Some(Duration::from_secs(10)))?.ok()?;
                }
                Ok(())
            }));
        }
        for w in workers {
            w.join().expect("peer thread")?;
        }
        Ok(())
    })?;

    let total: u64 = counters.iter().map(Counter::get).sum::<Result<u64>>()?;
    let expected: u64 = (1..=PEERS).map(|p| p * ADDS).sum();
    for (i, c) in counters.iter().enumerate() {
        println!("counter {i}: {}", c.get()?);
    }
    println!("total {total}, expected {expected}: {}", if total == expected { "exact" } else { "WRONG" });
    assert_eq!(total, expected);
    Ok(())
}
