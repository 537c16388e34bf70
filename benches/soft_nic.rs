//! Soft NIC micro-benchmarks, in-process, with the physical limit beside them in the same
//! run: an 8-byte RDMA write plus its completion (latency; built per post and prepared
//! once), and a 1 MiB RDMA write plus its
//! completion against a plain `memcpy` of 1 MiB (bandwidth).
//!
//! `cargo bench --bench soft_nic`; HTML reports land in `target/criterion/report/`.

#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rdmakit::*;

struct Rig {
    a: QueuePair,
    _b: QueuePair,
    cq: CompletionQueue,
    src: MemoryRegion,
    dst: MemoryRegion,
}

fn rig(len: usize) -> Rig {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().expect("pd");
    let cq = ctx.create_cq(1024).expect("cq");
    let cq_b = ctx.create_cq(1024).expect("cq");
    let a = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
    let b = pd.create_qp(&cq_b, &cq_b, QpCaps::default()).expect("qp");
    let opts = ConnectOptions::default();
    a.connect(&b.address().expect("ep"), &opts).expect("connect");
    b.connect(&a.address().expect("ep"), &opts).expect("connect");
    let src = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE).expect("mr");
    let dst = pd.alloc_mr(len, AccessFlags::ALL_REMOTE).expect("mr");
    src.fill(0x5a).expect("fill");
    Rig { a, _b: b, cq, src, dst }
}

fn write_and_reap(r: &Rig, local: &LocalSlice, remote: RemoteSlice) {
    r.a.post_send(SendWr::write(local.clone(), remote)).expect("post");
    loop {
        if let Some(wc) = r.cq.poll_one().expect("poll") {
            black_box(wc.ok().expect("completion"));
            break;
        }
    }
}

fn small_write(c: &mut Criterion) {
    let r = rig(8);
    let local = r.src.local().expect("slice");
    let remote = r.dst.remote().slice(0, 8).expect("slice");
    let mut g = c.benchmark_group("soft_nic_latency");
    g.bench_function("write_8B_plus_completion", |b| b.iter(|| write_and_reap(&r, &local, remote)));
    // The same write checked and converted once (`PreparedSend`), as perftest posts requests
    // it built before timing.
    let prepared = r.a.prepare_send(SendWr::write(local.clone(), remote)).expect("prepare");
    g.bench_function("prepared_write_8B_plus_completion", |b| {
        b.iter(|| {
            prepared.post().expect("post");
            loop {
                if let Some(wc) = r.cq.poll_one().expect("poll") {
                    black_box(wc.ok().expect("completion"));
                    break;
                }
            }
        })
    });
    g.bench_function("write_inline_8B_plus_completion", |b| {
        let data = 42u64.to_ne_bytes();
        b.iter(|| {
            r.a.post_send(SendWr::write_inline(&data, remote)).expect("post");
            while r.cq.poll_one().expect("poll").is_none() {}
        })
    });
    g.finish();
}

fn bandwidth(c: &mut Criterion) {
    let mut g = c.benchmark_group("soft_nic_bandwidth");
    for len in [64 * 1024usize, 1 << 20] {
        g.throughput(Throughput::Bytes(len as u64));
        let r = rig(len);
        let local = r.src.local().expect("slice");
        let remote = r.dst.remote().slice(0, len as u32).expect("slice");
        g.bench_with_input(BenchmarkId::new("rdma_write_plus_completion", len), &len, |b, _| {
            b.iter(|| write_and_reap(&r, &local, remote))
        });
        let src = vec![0x5au8; len];
        let mut dst = vec![0u8; len];
        g.bench_with_input(BenchmarkId::new("memcpy", len), &len, |b, _| {
            b.iter(|| {
                dst.copy_from_slice(black_box(&src));
                black_box(&mut dst);
            })
        });
    }
    g.finish();
}

criterion_group!(benches, small_write, bandwidth);
criterion_main!(benches);
