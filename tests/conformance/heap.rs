//! Conformance cases for remote heaps (rmalloc/rfree) carried over a connected QP pair:
//! the same control messages and RDMA writes on the soft NIC and on rdma-core.

use std::sync::atomic::{AtomicBool, Ordering};

use libtest_mimic::Failed;
use rdmakit::channel::heap::{HeapEndpoint, OwnerLimits};
use rdmakit::memory::heap::{AllocPolicy, HeapConfig, HeapId};
use rdmakit::*;

use crate::check_eq;
use crate::fixture::{Case, case};
use crate::fixture::{Env, WAIT};

/// The heap cases, run on both providers by `main`.
pub const CASES: &[Case] = &[
    case("heap_next_fit_deferred_round_trip", next_fit_deferred),
    case("heap_best_fit_immediate_round_trip", best_fit_immediate),
];

fn endpoints(env: &Env) -> Result<(HeapEndpoint, HeapEndpoint, ProtectionDomain), Failed> {
    let p = env.pair()?;
    let limits = OwnerLimits::default().with_segment_len(256 << 10).with_max_heap_bytes(4 << 20);
    let a = HeapEndpoint::new(p.a, p.cq_a, limits, WAIT)?;
    let b = HeapEndpoint::new(p.b, p.cq_b, limits, WAIT)?;
    Ok((a, b, p.pd))
}

/// Runs `alloc_side` while the owner `b` consumes `n` blocks, checking each block's
/// contents with `check`, and freeing each.
fn with_owner(
    b: HeapEndpoint,
    heap: HeapId,
    n: usize,
    alloc_side: impl FnOnce() -> Result<(), Failed>,
) -> Result<HeapEndpoint, Failed> {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let owner = s.spawn(|| -> Result<HeapEndpoint, String> {
            let mut b = b;
            let mut seen = 0;
            while seen < n && !stop.load(Ordering::Relaxed) {
                b.poll_messages().map_err(|e| e.to_string())?;
                while let Some(l) = b.try_recv_block(heap).ok().flatten() {
                    let mut head = [0u8; 8];
                    b.read(&l, 0, &mut head).map_err(|e| e.to_string())?;
                    if u64::from_le_bytes(head) != seen as u64 {
                        return Err(format!("block {seen} carried {}", u64::from_le_bytes(head)));
                    }
                    b.rfree(l).map_err(|e| e.to_string())?;
                    seen += 1;
                }
            }
            Ok(b)
        });
        let r = alloc_side();
        stop.store(r.is_err(), Ordering::Relaxed);
        let b = owner.join().map_err(|_| "owner thread panicked")??;
        r.map(|()| b)
    })
}

fn round_trips(env: &Env, policy: AllocPolicy, heap: HeapId) -> Result<(), Failed> {
    let (mut a, b, pd) = endpoints(env)?;
    let n = 64;
    let src = pd.alloc_mr(16 << 10, AccessFlags::LOCAL_WRITE)?;
    let b = with_owner(b, heap, n, || {
        a.create_heap(HeapConfig::new(heap, policy), 256 << 10)?;
        for i in 0..n {
            let len = 8 + (i * 997) % ((16 << 10) - 8);
            src.write_at(0, &(i as u64).to_le_bytes())?;
            let block = a.rmalloc(heap, len as u64)?;
            a.write(heap, &block, 0, src.slice(0, len as u32)?)?;
        }
        Ok(())
    })?;
    let mut b = b;
    b.flush_frees(heap)?;
    let stats = b.owner_stats(heap)?;
    check_eq!(stats.held_blocks, 0);
    Ok(())
}

fn next_fit_deferred(env: &Env) -> Result<(), Failed> {
    round_trips(env, AllocPolicy::NextFit, HeapId(1))
}

fn best_fit_immediate(env: &Env) -> Result<(), Failed> {
    round_trips(env, AllocPolicy::BestFit, HeapId(2))
}
