//! Property test: random sequences of writes, reads and atomics against a model of the
//! target's memory. After every operation, what the NIC returned must match the model,
//! and at the end the whole target must equal it.

use libtest_mimic::Failed;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use rdmakit::*;

use crate::fixture::{Env, wait_ok};

const TARGET: usize = 2048;
const SLOTS: u64 = (TARGET / 8) as u64;

#[derive(Clone, Debug)]
enum Op {
    Write { off: u64, len: u32, seed: u8 },
    Read { off: u64, len: u32 },
    FetchAdd { slot: u64, add: u64 },
    CmpSwap { slot: u64, hit: bool, swap: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..TARGET as u64, 1..512u32, any::<u8>()).prop_map(|(off, len, seed)| {
            let len = len.min((TARGET as u64 - off) as u32).max(1);
            let off = off.min(TARGET as u64 - u64::from(len));
            Op::Write { off, len, seed }
        }),
        (0..TARGET as u64, 1..512u32).prop_map(|(off, len)| {
            let len = len.min((TARGET as u64 - off) as u32).max(1);
            let off = off.min(TARGET as u64 - u64::from(len));
            Op::Read { off, len }
        }),
        (0..SLOTS, any::<u64>()).prop_map(|(slot, add)| Op::FetchAdd { slot, add }),
        (0..SLOTS, any::<bool>(), any::<u64>()).prop_map(|(slot, hit, swap)| Op::CmpSwap { slot, hit, swap }),
    ]
}

pub fn random_ops_match_model(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let target = p.pd.alloc_mr(TARGET, AccessFlags::ALL_REMOTE)?;
    let local = p.pd.alloc_mr(TARGET, AccessFlags::LOCAL_WRITE)?;
    let cases = if env.provider == ProviderKind::Verbs { 16 } else { 64 };
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let result = runner.run(&proptest::collection::vec(op(), 1..40), |ops| {
        let mut model = vec![0u8; TARGET];
        target.fill(0).map_err(fail)?;
        for op in &ops {
            apply(&p, &target, &local, &mut model, op)
                .map_err(|e| TestCaseError::fail(format!("{op:?}: {e}")))?;
        }
        let got = target.to_vec().map_err(fail)?;
        prop_assert!(got == model, "target memory differs from the model after {} ops", ops.len());
        Ok(())
    });
    result.map_err(|e| e.to_string().into())
}

fn fail(e: Error) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

fn apply(
    p: &crate::fixture::Pair,
    target: &MemoryRegion,
    local: &MemoryRegion,
    model: &mut [u8],
    op: &Op,
) -> Result<(), String> {
    let r = target.remote();
    let post = |wr: SendWr<'_>| -> Result<(), String> {
        p.a.post_send(wr).map_err(|e| e.to_string())?;
        wait_ok(&p.cq_a).map(|_| ()).map_err(|e| format!("{e:?}"))
    };
    match *op {
        Op::Write { off, len, seed } => {
            let data: Vec<u8> = (0..len).map(|i| seed.wrapping_add(i as u8)).collect();
            local.write_at(0, &data).map_err(|e| e.to_string())?;
            post(SendWr::write(
                local.slice(0, len).map_err(|e| e.to_string())?,
                r.slice(off, len).map_err(|e| e.to_string())?,
            ))?;
            model[off as usize..(off + u64::from(len)) as usize].copy_from_slice(&data);
        }
        Op::Read { off, len } => {
            post(SendWr::read(
                local.slice(0, len).map_err(|e| e.to_string())?,
                r.slice(off, len).map_err(|e| e.to_string())?,
            ))?;
            let mut got = vec![0; len as usize];
            local.read_at(0, &mut got).map_err(|e| e.to_string())?;
            if got[..] != model[off as usize..(off + u64::from(len)) as usize] {
                return Err("read returned data that differs from the model".into());
            }
        }
        Op::FetchAdd { slot, add } => {
            let at = (slot * 8) as usize;
            let old = u64::from_ne_bytes(model[at..at + 8].try_into().expect("8"));
            post(SendWr::fetch_add(
                local.slice(0, 8).map_err(|e| e.to_string())?,
                r.slice(slot * 8, 8).map_err(|e| e.to_string())?,
                add,
            ))?;
            let got = local.read_u64(0).map_err(|e| e.to_string())?;
            if got != old {
                return Err(format!("fetch-add returned {got}, model had {old}"));
            }
            model[at..at + 8].copy_from_slice(&old.wrapping_add(add).to_ne_bytes());
        }
        Op::CmpSwap { slot, hit, swap } => {
            let at = (slot * 8) as usize;
            let old = u64::from_ne_bytes(model[at..at + 8].try_into().expect("8"));
            let compare = if hit { old } else { old ^ 1 };
            post(SendWr::compare_swap(
                local.slice(0, 8).map_err(|e| e.to_string())?,
                r.slice(slot * 8, 8).map_err(|e| e.to_string())?,
                compare,
                swap,
            ))?;
            let got = local.read_u64(0).map_err(|e| e.to_string())?;
            if got != old {
                return Err(format!("cmp-swap returned {got}, model had {old}"));
            }
            if hit {
                model[at..at + 8].copy_from_slice(&swap.to_ne_bytes());
            }
        }
    }
    Ok(())
}
