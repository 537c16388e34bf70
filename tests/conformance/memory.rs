//! Conformance cases for the memory crate's device-memory features (MEMIC placement and its
//! host fallback on devices without device memory), run on both providers: on rxe, which
//! has no device memory, they check the fallback and the typed refusal.

use libtest_mimic::Failed;
use rdmakit::memory::memic::{CounterPool, Location, Mapping, Memic, Placement};
use rdmakit::*;

use crate::fixture::{Case, case};
use crate::fixture::{Env, Needs, wait_ok};
use crate::{check, check_eq};

/// The memory cases, run on both providers by `main`.
pub const CASES: &[Case] = &[
    case("memic_nic_preferred_places_or_falls_back", memic_nic_preferred),
    case("memic_nic_required_matches_the_probe", memic_nic_required),
    case("memic_counters_take_remote_fetch_add", memic_counters),
    // On a verbs device without mlx5 the first is reported ignored (with the reason), never
    // passed; the second checks the clean refusals there instead.
    Case { name: "mlx5_umr_keys_bind_and_invalidate", needs: Needs::Mlx5, run: mlx5_umr_keys },
    Case { name: "mlx5_calls_are_clean_refusals_elsewhere", needs: Needs::NotMlx5, run: mlx5_refused },
];

/// Indirect keys bound by UMR: a fetch-and-add through the key lands in the bound region,
/// and LOCAL_INV unbinds it. On the soft NIC (emulated) and on mlx5 devices.
fn mlx5_umr_keys(env: &Env) -> Result<(), Failed> {
    use rdmakit::mlx5::KsmEntry;
    let p = env.pair()?;
    let key = p.pd.create_indirect_mkey(0, 1 << 20, AccessFlags::ALL_REMOTE)?;
    let umr = p.pd.create_umr_queue()?;
    let target = p.pd.alloc_mr(4096, AccessFlags::ALL_REMOTE)?;
    umr.bind(&key, &[KsmEntry::whole(&target)])?;
    let result = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    p.a.post_send(SendWr::fetch_add(result.local()?, key.region().remote().slice(64, 8)?, 5))?;
    wait_ok(&p.cq_a)?;
    check_eq!(target.read_u64(64)?, 5);
    umr.invalidate(&key)?;
    check!(!key.is_bound(), "still bound after LOCAL_INV");
    Ok(())
}

/// On verbs devices without mlx5dv (rxe) every mlx5 call is a typed refusal, never a crash.
fn mlx5_refused(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    check!(
        matches!(p.pd.create_indirect_mkey(0, 1 << 20, AccessFlags::ALL_REMOTE), Err(Error::Unsupported(_))),
        "an indirect key on a device without mlx5dv"
    );
    check!(p.pd.create_umr_queue().is_err(), "a UMR queue on a device without mlx5dv");
    check!(env.ctx.vhca_id().is_err(), "a vHCA id without DEVX");
    Ok(())
}

/// `NicPreferred` always gives a region that remote atomics reach, on the NIC exactly when
/// the probe found usable device memory.
fn memic_nic_preferred(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let memic = Memic::open(&p.pd);
    let region = memic.alloc(100, Placement::NicPreferred)?;
    let expected = if memic.unavailable_reason().is_none() { Location::Nic } else { Location::Host };
    check_eq!(region.location(), expected);
    check_eq!(region.len(), 128);
    // Where peers find it, per provider and capability:
    // - soft NIC: NIC memory at the reserved address (its KSM key always maps one);
    // - verbs with device memory: at the reserved address through a DEVX KSM key, or, where
    //   the device refuses DEVX, at address 0 of a zero-based UMR key of its own (never
    //   expected on the soft NIC, and never on rxe, which has no device memory);
    // - verbs without device memory (rxe): host memory, an ordinary region.
    match (env.provider, region.location(), region.mapping()) {
        (_, Location::Nic, Mapping::ReservedAddress) => {
            check_eq!(Some(region.remote().addr), region.reserved_addr());
            check!(region.remote().addr != 0, "the reserved address is never 0");
        }
        (ProviderKind::Verbs, Location::Nic, Mapping::ZeroBased) => {
            check_eq!(region.remote().addr, 0);
            check!(region.reserved_addr().is_none(), "a zero-based key is not at its reservation");
        }
        (_, Location::Host, Mapping::Host) => {
            check!(region.reserved_addr().is_none(), "a host region has no reservation");
            check!(region.remote().addr != 0, "a host region has its buffer's address");
        }
        other => return Err(format!("unexpected placement {other:?}").into()),
    }
    let result = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    let target = region.remote().slice(64, 8)?;
    for _ in 0..3 {
        p.a.post_send(SendWr::fetch_add(result.local()?, target, 7))?;
        wait_ok(&p.cq_a)?;
    }
    check_eq!((result.read_u64(0)?, region.read_u64(64)?), (14, 21));
    Ok(())
}

/// `NicRequired` succeeds exactly when the probe did, and otherwise is a typed error.
fn memic_nic_required(env: &Env) -> Result<(), Failed> {
    let pd = env.ctx.alloc_pd()?;
    let memic = Memic::open(&pd);
    match (memic.unavailable_reason(), memic.alloc(64, Placement::NicRequired)) {
        (None, Ok(r)) => check_eq!(r.location(), Location::Nic),
        (Some(_), Err(Error::Unsupported(_) | Error::DeviceMemoryExhausted { .. })) => {}
        (reason, other) => return Err(format!("probe said {reason:?}, NicRequired gave {other:?}").into()),
    }
    // Beyond max_dm_size is refused even where device memory exists.
    if memic.unavailable_reason().is_none() {
        let too_big = env.ctx.attr().max_dm_size * 2;
        check!(
            matches!(memic.alloc(too_big, Placement::NicRequired), Err(Error::DeviceMemoryExhausted { .. })),
            "an allocation above max_dm_size was not refused"
        );
    }
    Ok(())
}

/// Counters sub-allocated from one region each see exactly their own remote adds.
fn memic_counters(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let pool = CounterPool::new(&Memic::open(&p.pd), 16, Placement::NicPreferred)?;
    let counters: Vec<_> =
        (0..16).map(|_| pool.alloc()?.ok_or(Error::Busy("counter pool"))).collect::<Result<_>>()?;
    let result = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    for (i, c) in counters.iter().enumerate() {
        p.a.post_send(SendWr::fetch_add(result.local()?, c.remote()?, i as u64 + 1))?;
        wait_ok(&p.cq_a)?;
    }
    for (i, c) in counters.iter().enumerate() {
        check_eq!(c.get()?, i as u64 + 1);
    }
    Ok(())
}
