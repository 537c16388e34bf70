//! The seeds' own measurements, rerun through rdmakit, printed in the seeds' table shapes
//! beside the seeds' figures (which come from ConnectX-6 / BlueField-3 hardware; ours come
//! from whatever device the run names, on this project's machines the soft NIC or rxe).
//!
//! - `memic-atomics`: the UCX MEMIC talk's ucx_perftest table: fetch-and-add and posted
//!   atomic add, windows 1 and 16, target in host memory and in device memory.
//! - `xgvmi-export`: the cross-GVMI UMR mkey pool talk's cost table: what exporting a host
//!   buffer to a DPU costs per step with a key made per export, beside the pool's export.

use std::time::{Duration, Instant};

use rdmakit_memory::xgvmi::{AliasCache, DpuFunction, HostFunction, PoolConfig, UmrMkeyPool};
use rdmakit_verbs::mlx5::KsmEntry;
use rdmakit_verbs::*;

const WAIT: Duration = Duration::from_secs(10);

/// The seeds' figures, UCX 1.16 on two ConnectX-6 nodes: (latency µs, rate ops/s).
const MEMIC_SEED: [[(f64, f64); 4]; 2] = [
    // fetch & add: window 1 host, window 1 MEMIC, window 16 host, window 16 MEMIC
    [(1.653, 604_999.0), (1.426, 701_437.0), (0.42, 2_381_344.0), (0.123, 8_131_869.0)],
    // atomic add (posted)
    [(0.627, 1_595_301.0), (0.299, 3_341_689.0), (0.588, 1_699_894.0), (0.3, 3_328_350.0)],
];

/// One atomic benchmark's outcome: mean time per operation and operations per second.
#[derive(Clone, Copy, Debug)]
struct Rate {
    per_op_us: f64,
    ops_per_sec: f64,
}

/// Where the counter lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    Host,
    DeviceMemory,
}

/// A loopback pair: the requester posts atomics at the responder's 8-byte target.
struct AtomicRig {
    qp: QueuePair,
    cq: CompletionQueue,
    scratch: MemoryRegion,
    target: RemoteSlice,
    _keep: (QueuePair, CompletionQueue, MemoryRegion, Option<DeviceMemory>),
}

/// The send queue depth; posted adds are signaled every `SIGNAL_EVERY` to recycle it.
const SQ_DEPTH: u32 = 256;
const SIGNAL_EVERY: u64 = 32;

fn atomic_rig(ctx: &Context, target: Target) -> Result<AtomicRig> {
    let pd = ctx.alloc_pd()?;
    let (ca, cb) = (ctx.create_cq(SQ_DEPTH * 2)?, ctx.create_cq(16)?);
    let caps = QpCaps::default().with_max_send_wr(SQ_DEPTH);
    let (a, b) = (pd.create_qp(&ca, &ca, caps)?, pd.create_qp(&cb, &cb, caps)?);
    a.connect(&b.address()?, &ConnectOptions::default())?;
    b.connect(&a.address()?, &ConnectOptions::default())?;
    let (region, dm) = match target {
        Target::Host => (pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?, None),
        Target::DeviceMemory => {
            let dm = ctx.alloc_dm(64)?;
            (pd.register_dm(&dm, 0, 64, AccessFlags::ALL_REMOTE)?, Some(dm))
        }
    };
    let scratch = pd.alloc_mr(16 * 8, AccessFlags::LOCAL_WRITE)?;
    Ok(AtomicRig { qp: a, cq: ca, scratch, target: region.remote().slice(0, 8)?, _keep: (b, cb, region, dm) })
}

/// Fetch-and-add with up to `window` outstanding, every one signaled and its result landed.
fn fetch_add(rig: &AtomicRig, iters: u64, window: u64) -> Result<Rate> {
    let (mut posted, mut done) = (0u64, 0u64);
    let start = Instant::now();
    while done < iters {
        while posted < iters && posted - done < window {
            let slot = rig.scratch.slice((posted % 16) * 8, 8)?;
            rig.qp.post_send(SendWr::fetch_add(slot, rig.target, 1).wr_id(posted))?;
            posted += 1;
        }
        rig.cq.spin(WAIT)?.ok()?;
        done += 1;
    }
    Ok(rate(start.elapsed(), iters))
}

/// A posted add, as UCX's `ucp_add`: nothing waits for it. Verbs has no non-fetching
/// atomic, so it is a fetch-and-add whose result goes to a scratch word nobody reads,
/// unsignaled except every `SIGNAL_EVERY`-th (to recycle send-queue slots) and the last
/// (the flush). The window does not bound posted operations (they complete at post), which
/// is why the seed's two columns for it are within 7 % of each other.
fn posted_add(rig: &AtomicRig, iters: u64) -> Result<Rate> {
    let mut signaled_out = 0u64;
    let start = Instant::now();
    for i in 0..iters {
        let signal = i % SIGNAL_EVERY == SIGNAL_EVERY - 1 || i == iters - 1;
        let slot = rig.scratch.slice((i % 16) * 8, 8)?;
        let wr = SendWr::fetch_add(slot, rig.target, 1).wr_id(i).signaled(signal);
        rig.qp.post_send(wr)?;
        if signal {
            signaled_out += 1;
            // Keep the unreaped operations within the send queue.
            if signaled_out * SIGNAL_EVERY >= u64::from(SQ_DEPTH) - SIGNAL_EVERY {
                rig.cq.spin(WAIT)?.ok()?;
                signaled_out -= 1;
            }
        }
    }
    while signaled_out > 0 {
        rig.cq.spin(WAIT)?.ok()?;
        signaled_out -= 1;
    }
    Ok(rate(start.elapsed(), iters))
}

fn rate(t: Duration, iters: u64) -> Rate {
    let s = t.as_secs_f64();
    Rate { per_op_us: s * 1e6 / iters as f64, ops_per_sec: iters as f64 / s }
}

/// Runs the MEMIC table on `ctx` and prints it beside the seed's.
pub fn memic_atomics(ctx: &Context, iters: u64) -> Result<()> {
    let host = atomic_rig(ctx, Target::Host)?;
    let dm = match atomic_rig(ctx, Target::DeviceMemory) {
        Ok(r) => Ok(r),
        Err(e) => Err(e.to_string()),
    };
    println!(
        "memic-atomics on {} ({:?} provider), {iters} operations per cell, median of 3 runs; seed: UCX 1.16 ucx_perftest, 2 nodes with ConnectX-6",
        ctx.name(),
        ctx.provider()
    );
    if let Err(why) = &dm {
        println!("device memory unavailable ({why}): its columns are n/a");
    }
    println!(
        "{:<13} {:<13} {:>10} {:>10} {:>7}   {:>10} {:>10} {:>7}   {:<8}",
        "", "", "w1 host", "w1 DM", "diff", "w16 host", "w16 DM", "diff", ""
    );
    for (op, name) in [(0usize, "Fetch & Add"), (1, "Atomic Add")] {
        // Each cell is the median of three runs (this machine is shared; one run can land
        // on a noisy moment).
        let run = |rig: &AtomicRig, window: u64| -> Result<Rate> {
            let mut v = (0..3)
                .map(|_| if op == 0 { fetch_add(rig, iters, window) } else { posted_add(rig, iters) })
                .collect::<Result<Vec<Rate>>>()?;
            v.sort_by(|a, b| a.per_op_us.total_cmp(&b.per_op_us));
            Ok(v[1])
        };
        let mut ours = Vec::new();
        for window in [1u64, 16] {
            ours.push(Some(run(&host, window)?));
            ours.push(match &dm {
                Ok(rig) => Some(run(rig, window)?),
                Err(_) => None,
            });
        }
        let seed = MEMIC_SEED[op];
        let cell = |r: Option<Rate>, f: fn(Rate) -> f64| r.map_or("n/a".into(), |r| format!("{:.3}", f(r)));
        let diff = |a: Option<Rate>, b: Option<Rate>, f: fn(Rate) -> f64| match (a, b) {
            (Some(a), Some(b)) => format!("{:+.0}%", (f(b) / f(a) - 1.0) * 100.0),
            _ => "n/a".into(),
        };
        let lat = |r: Rate| r.per_op_us;
        let mops = |r: Rate| r.ops_per_sec / 1e6;
        for (what, f, seed_f) in [
            ("latency [us]", lat as fn(Rate) -> f64, (|s: (f64, f64)| s.0) as fn((f64, f64)) -> f64),
            ("rate [Mops/s]", mops, |s: (f64, f64)| s.1 / 1e6),
        ] {
            println!(
                "{:<13} {:<13} {:>10} {:>10} {:>7}   {:>10} {:>10} {:>7}   rdmakit",
                name,
                what,
                cell(ours[0], f),
                cell(ours[1], f),
                diff(ours[0], ours[1], f),
                cell(ours[2], f),
                cell(ours[3], f),
                diff(ours[2], ours[3], f)
            );
            let s = |i: usize| format!("{:.3}", seed_f(seed[i]));
            let sd =
                |a: usize, b: usize| format!("{:+.0}%", (seed_f(seed[b]) / seed_f(seed[a]) - 1.0) * 100.0);
            println!(
                "{:<13} {:<13} {:>10} {:>10} {:>7}   {:>10} {:>10} {:>7}   seed",
                "",
                "",
                s(0),
                s(1),
                sd(0, 1),
                s(2),
                s(3),
                sd(2, 3)
            );
        }
    }
    if ctx.provider() == ProviderKind::Soft {
        println!(
            "soft NIC: host memory and device memory are both software here, so the DM columns show rdmakit's own cost, not a PCIe round trip saved"
        );
    }
    Ok(())
}

/// The sizes of the xgvmi talk's table, up to `max`.
pub fn xgvmi_sizes(max: u64) -> Vec<u64> {
    [16u64 << 10, 1 << 20, 64 << 20, 1 << 30].into_iter().filter(|&s| s <= max).collect()
}

/// A row of the table: its name, the step's cost, and the talk's figures if it has the step.
type StepRow = (&'static str, fn(&Steps) -> u64, Option<[u64; 4]>);

/// Step costs in ns, per size.
struct Steps {
    register: u64,
    key_create: u64,
    key_export: u64,
    alias_create: u64,
    alias_destroy: u64,
    key_destroy: u64,
    deregister: u64,
    pool_export: u64,
    pool_import: u64,
    pool_release: u64,
}

fn ns(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Median of `runs` measurements of each step.
fn xgvmi_steps(host: &Context, dpu: &Context, size: u64, runs: usize) -> Result<Steps> {
    const ACCESS_KEY: [u8; 32] = [0x5a; 32];
    let (hpd, dpd) = (host.alloc_pd()?, dpu.alloc_pd()?);
    let umr = hpd.create_umr_queue()?;
    let vhca = host.vhca_id()?;
    let len = usize::try_from(size).map_err(|_| Error::InvalidArgument("size".into()))?;
    let pool =
        UmrMkeyPool::new(HostFunction::new(&hpd, AccessFlags::ALL_REMOTE)?, PoolConfig::new(4, ACCESS_KEY))?;
    let aliases = AliasCache::new(DpuFunction::new(&dpd, AccessFlags::LOCAL_WRITE));
    let mut samples: Vec<[u64; 10]> = Vec::with_capacity(runs);
    for _ in 0..runs {
        let mut s = [0u64; 10];
        // The per-export path, as the talk's "previous" flow: register the buffer, make a
        // key over it, open it to other vHCAs, the DPU makes an alias; then tear down.
        let t = Instant::now();
        let mr = hpd.alloc_mr(len, AccessFlags::ALL_REMOTE)?;
        s[0] = ns(t);
        let t = Instant::now();
        let key = hpd.create_indirect_mkey(0, size, AccessFlags::ALL_REMOTE)?;
        umr.bind(&key, &[KsmEntry::whole(&mr)])?;
        s[1] = ns(t);
        let t = Instant::now();
        key.allow_other_vhca_access(&ACCESS_KEY)?;
        s[2] = ns(t);
        let t = Instant::now();
        let alias = dpd.create_alias_mkey(vhca, key.key(), &ACCESS_KEY, AccessFlags::LOCAL_WRITE)?;
        s[3] = ns(t);
        let t = Instant::now();
        drop(alias);
        s[4] = ns(t);
        let t = Instant::now();
        drop(key);
        s[5] = ns(t);
        // The pool's path over the same buffer: UMR bind of a pooled key, the DPU's alias
        // from its hash map, LOCAL_INV at release.
        let t = Instant::now();
        let export = pool.export(&mr)?;
        s[7] = ns(t);
        let t = Instant::now();
        let imported = aliases.import(&export.packed())?;
        s[8] = ns(t);
        drop(imported);
        let t = Instant::now();
        export.release()?;
        s[9] = ns(t);
        let t = Instant::now();
        drop(mr);
        s[6] = ns(t);
        samples.push(s);
    }
    let med = |i: usize| {
        let mut v: Vec<u64> = samples.iter().map(|s| s[i]).collect();
        v.sort_unstable();
        v[v.len() / 2]
    };
    Ok(Steps {
        register: med(0),
        key_create: med(1),
        key_export: med(2),
        alias_create: med(3),
        alias_destroy: med(4),
        key_destroy: med(5),
        deregister: med(6),
        pool_export: med(7),
        pool_import: med(8),
        pool_release: med(9),
    })
}

/// Runs the xgvmi table on `host` (which must have a DPU-side function) and prints it.
pub fn xgvmi_export(host: &Context, max_size: u64, runs: usize) -> Result<()> {
    let dpu = host.open_function()?;
    let sizes = xgvmi_sizes(max_size);
    if sizes.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "--max-size {max_size} is below the smallest size (16 KiB)"
        )));
    }
    let steps: Vec<Steps> = sizes.iter().map(|&s| xgvmi_steps(host, &dpu, s, runs)).collect::<Result<_>>()?;
    println!(
        "xgvmi-export on {} ({:?} provider), ns per step, median of {runs}; seed (BlueField, UCX) beside each row where the talk has it",
        host.name(),
        host.provider()
    );
    let label = |s: u64| match s {
        s if s >= 1 << 30 => format!("{} GB", s >> 30),
        s if s >= 1 << 20 => format!("{} MB", s >> 20),
        s => format!("{} KB", s >> 10),
    };
    print!("{:<34}", "cost (ns)");
    for &s in &sizes {
        print!(" {:>14}", label(s));
    }
    println!();
    // The talk's rows (ns at 16 KB, 1 MB, 64 MB, 1 GB), where a step has one.
    let seed: [StepRow; 10] = [
        ("host registration", |s| s.register, Some([165_139, 320_991, 5_833_211, 114_294_081])),
        ("host mkey creation", |s| s.key_create, Some([158_753, 159_132, 158_678, 160_000])),
        ("host mkey export", |s| s.key_export, Some([94_778, 101_124, 107_185, 185_765])),
        ("dpu alias creation", |s| s.alias_create, Some([176_168, 176_198, 176_236, 196_198])),
        ("dpu alias destruction", |s| s.alias_destroy, Some([149_525, 149_585, 149_687, 159_722])),
        ("host mkey destroy", |s| s.key_destroy, Some([137_371, 137_560, 136_885, 138_362])),
        ("host deregistration", |s| s.deregister, Some([74_027, 132_564, 386_428, 2_473_056])),
        ("pool: export (UMR bind)", |s| s.pool_export, None),
        ("pool: dpu import (hash hit)", |s| s.pool_import, None),
        ("pool: release (LOCAL_INV)", |s| s.pool_release, None),
    ];
    for (name, f, talk) in seed {
        print!("{name:<34}");
        for st in &steps {
            print!(" {:>14}", f(st));
        }
        println!("   rdmakit");
        if let Some(t) = talk {
            print!("{:<34}", "");
            for (i, _) in sizes.iter().enumerate() {
                print!(" {:>14}", t[i]);
            }
            println!("   seed");
        }
    }
    print!("{:<34}", "per-export / pool (export+import)");
    for st in &steps {
        let per = st.key_create + st.key_export + st.alias_create;
        let pool = (st.pool_export + st.pool_import).max(1);
        print!(" {:>13.1}x", per as f64 / pool as f64);
    }
    println!("   rdmakit (the talk: ~1 us UMR bind against 0.5 ms of key work)");
    if host.provider() == ProviderKind::Soft {
        println!(
            "soft NIC: keys, aliases and UMR are emulated in software, so these are rdmakit's own costs; registration is an allocation of zeroed memory"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fetch_add_and_posted_add_lands_exactly_once() {
        let ctx = Context::open_soft();
        let rig = atomic_rig(&ctx, Target::Host).expect("rig");
        fetch_add(&rig, 1000, 16).expect("fetch-and-add");
        // Not a multiple of SIGNAL_EVERY: the last, signaled one flushes the tail.
        posted_add(&rig, 1001).expect("posted add");
        assert_eq!(rig._keep.2.read_u64(0).expect("read"), 2001);
        assert_eq!(rig.qp.outstanding(), (0, 0), "every posted add was reaped");
    }

    #[test]
    fn the_xgvmi_sizes_are_the_talks_up_to_the_limit() {
        assert_eq!(xgvmi_sizes(1 << 20), vec![16 << 10, 1 << 20]);
        assert_eq!(xgvmi_sizes(1 << 30).len(), 4);
        assert!(xgvmi_sizes(1 << 10).is_empty());
        let ctx = Context::open_soft();
        let dpu = ctx.open_function().expect("a DPU function on the soft NIC");
        let s = xgvmi_steps(&ctx, &dpu, 16 << 10, 1).expect("one run of every step");
        assert!(s.pool_export > 0 && s.key_create > 0);
    }
}
