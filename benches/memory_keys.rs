//! rdmakit-memory's key machinery on the soft NIC, side by side in one run:
//! - cross-GVMI export + release through the UMR mkey pool vs creating, opening and
//!   destroying an indirect key per export (what the pool avoids);
//! - the DPU's alias cache: a hit vs creating an alias per import (goal: a hit ≤ 100 ns);
//! - fetch-and-add on a MEMIC region vs on a host region.
//!
//! The soft NIC has no firmware, so its key creation costs microseconds where a
//! BlueField-3 takes ~0.8 ms (Yong Qin, "Cross-GVMI UMR Mkey Pool", UCF 2023); the pool's
//! ratio here is a floor of what it saves on hardware.
//!
//! `cargo bench --bench memory_keys`; HTML reports land in `target/criterion/report/`.

#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use rdmakit::memory::memic::{Memic, Placement};
use rdmakit::memory::xgvmi::*;
use rdmakit::mlx5::{KsmEntry, UMR_MAX_LEN};
use rdmakit::*;

const SECRET: [u8; 32] = [0x42; 32];

fn export(c: &mut Criterion) {
    let host = Context::open_soft_with(SoftConfig::default()).expect("host");
    let pd = host.alloc_pd().expect("pd");
    let region = pd.alloc_mr(64 << 10, AccessFlags::ALL_REMOTE).expect("mr");
    let pool = UmrMkeyPool::new(HostFunction::new(&pd, AccessFlags::ALL_REMOTE).expect("host"), {
        let mut cfg = PoolConfig::new(8, SECRET);
        cfg.precreate = 1;
        cfg
    })
    .expect("pool");
    let umr = pd.create_umr_queue().expect("umr");
    let mut g = c.benchmark_group("xgvmi_export");
    g.bench_function("pool_export_release", |b| {
        b.iter(|| {
            let e = pool.export(black_box(&region)).expect("export");
            black_box(e.packed());
            e.release().expect("release");
        })
    });
    g.bench_function("create_open_bind_destroy", |b| {
        b.iter(|| {
            let key = pd.create_indirect_mkey(0, UMR_MAX_LEN, AccessFlags::ALL_REMOTE).expect("key");
            key.allow_other_vhca_access(&SECRET).expect("open");
            umr.bind(&key, &[KsmEntry::whole(black_box(&region))]).expect("bind");
            black_box(key.key());
        })
    });
    g.finish();

    let dpu = host.open_function().expect("dpu");
    let dpd = dpu.alloc_pd().expect("pd");
    let cache = AliasCache::new(DpuFunction::new(&dpd, AccessFlags::LOCAL_WRITE));
    let exported = pool.export(&region).expect("export");
    let packed = exported.packed();
    cache.import(&packed).expect("warm");
    let ops = DpuFunction::new(&dpd, AccessFlags::LOCAL_WRITE);
    let mut g = c.benchmark_group("xgvmi_alias");
    g.bench_function("cache_hit", |b| b.iter(|| black_box(cache.import(black_box(&packed)).expect("hit"))));
    g.bench_function("create_alias_each_time", |b| {
        b.iter(|| black_box(ops.create_alias(black_box(&packed)).expect("alias")))
    });
    g.finish();
}

fn fetch_add(c: &mut Criterion) {
    let ctx = Context::open_soft_with(SoftConfig::default()).expect("ctx");
    let pd = ctx.alloc_pd().expect("pd");
    let cq = ctx.create_cq(64).expect("cq");
    let a = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
    let b = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
    a.connect(&b.address().expect("ep"), &ConnectOptions::default()).expect("connect");
    b.connect(&a.address().expect("ep"), &ConnectOptions::default()).expect("connect");
    let memic = Memic::open(&pd);
    let on_nic = memic.alloc(64, Placement::NicRequired).expect("memic");
    let host = pd.alloc_mr(64, AccessFlags::ALL_REMOTE).expect("host");
    let result = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).expect("result");
    let mut g = c.benchmark_group("fetch_add_8b");
    for (name, target) in [("memic", on_nic.remote()), ("host", host.remote())] {
        let target = target.slice(0, 8).expect("slice");
        g.bench_function(name, |bch| {
            bch.iter(|| {
                a.post_send(SendWr::fetch_add(result.local().expect("local"), target, 1)).expect("post");
                loop {
                    if let Some(wc) = cq.poll_one().expect("poll") {
                        wc.ok().expect("completion");
                        break;
                    }
                }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, export, fetch_add);
criterion_main!(benches);
