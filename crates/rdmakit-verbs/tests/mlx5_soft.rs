//! The soft NIC's mlx5 key emulation: KSM and UMR-bound indirect keys, invalidation,
//! functions (vHCAs), access keys and aliases, checked through real work requests.

use std::time::Duration;

use rdmakit_verbs::mlx5::{ACCESS_KEY_LEN, KsmEntry, UMR_MAX_LEN};
use rdmakit_verbs::*;

const WAIT: Option<Duration> = Some(Duration::from_secs(10));
const SECRET: [u8; ACCESS_KEY_LEN] = [0xa5; ACCESS_KEY_LEN];

/// Two connected QPs on `ctx_a` and `ctx_b` (the same device or two), one shared CQ each.
fn pair(
    pd_a: &ProtectionDomain,
    pd_b: &ProtectionDomain,
) -> Result<(QueuePair, CompletionQueue, QueuePair, CompletionQueue)> {
    let (cq_a, cq_b) = (pd_a.context().create_cq(64)?, pd_b.context().create_cq(64)?);
    let a = pd_a.create_qp(&cq_a, &cq_a, QpCaps::default())?;
    let b = pd_b.create_qp(&cq_b, &cq_b, QpCaps::default())?;
    a.connect(&b.address()?, &ConnectOptions::default())?;
    b.connect(&a.address()?, &ConnectOptions::default())?;
    Ok((a, cq_a, b, cq_b))
}

#[test]
fn ksm_key_maps_a_range_onto_two_regions() -> Result<()> {
    let pd = Context::open_soft().alloc_pd()?;
    let (x, y) = (pd.alloc_mr(4096, AccessFlags::ALL_REMOTE)?, pd.alloc_mr(4096, AccessFlags::ALL_REMOTE)?);
    let key = pd.create_ksm_mkey(
        0x7000_0000,
        &[KsmEntry::new(&x, 1024, 1024), KsmEntry::whole(&y)],
        AccessFlags::ALL_REMOTE,
    )?;
    assert!(key.is_bound());
    let (qp, cq, _peer, _pcq) = pair(&pd, &pd)?;
    let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    src.write_at(0, &[7; 64])?;
    let remote = key.region().remote();
    assert_eq!((remote.addr, remote.len), (0x7000_0000, 1024 + 4096));
    // Offset 1000 of the key = offset 2024 of x; offset 1024 = offset 0 of y.
    qp.post_send(SendWr::write(src.slice(0, 8)?, remote.slice(1000, 8)?))?;
    qp.post_send(SendWr::write(src.slice(0, 8)?, remote.slice(1024, 8)?))?;
    cq.wait(WAIT)?.ok()?;
    cq.wait(WAIT)?.ok()?;
    assert_eq!(x.read_u64(2024)?, u64::from_ne_bytes([7; 8]));
    assert_eq!(y.read_u64(0)?, u64::from_ne_bytes([7; 8]));
    // An access crossing two entries, or past the key's range, is a remote access error.
    qp.post_send(SendWr::write(src.slice(0, 8)?, remote.slice(1020, 8)?))?;
    let wc = cq.wait(WAIT)?;
    assert_eq!(wc.status, WcStatus::REM_ACCESS_ERR);
    assert!(key.region().read_u64(0).is_err(), "no CPU access through an indirect key");
    Ok(())
}

#[test]
fn umr_bind_invalidate_rebind() -> Result<()> {
    let pd = Context::open_soft().alloc_pd()?;
    let umr = pd.create_umr_queue()?;
    let key = pd.create_indirect_mkey(0, 1 << 20, AccessFlags::ALL_REMOTE)?;
    let (r1, r2) = (pd.alloc_mr(256, AccessFlags::ALL_REMOTE)?, pd.alloc_mr(256, AccessFlags::ALL_REMOTE)?);
    let (qp, cq, _peer, _pcq) = pair(&pd, &pd)?;
    let res = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    let remote = key.region().remote();

    // Free key: a protection error.
    qp.post_send(SendWr::fetch_add(res.local()?, remote.slice(0, 8)?, 1))?;
    assert_eq!(cq.wait(WAIT)?.status, WcStatus::REM_ACCESS_ERR);
    let (qp, cq, _peer, _pcq) = pair(&pd, &pd)?; // the first QP is in the error state now

    umr.bind(&key, &[KsmEntry::whole(&r1)])?;
    qp.post_send(SendWr::fetch_add(res.local()?, remote.slice(8, 8)?, 5))?;
    cq.wait(WAIT)?.ok()?;
    assert_eq!(r1.read_u64(8)?, 5);
    // Bound keys must be invalidated before re-binding, as on hardware.
    assert!(umr.bind(&key, &[KsmEntry::whole(&r2)]).is_err());
    umr.invalidate(&key)?;
    assert!(!key.is_bound());
    umr.bind(&key, &[KsmEntry::whole(&r2)])?;
    qp.post_send(SendWr::fetch_add(res.local()?, remote.slice(8, 8)?, 3))?;
    cq.wait(WAIT)?.ok()?;
    assert_eq!((r1.read_u64(8)?, r2.read_u64(8)?), (5, 3));
    // Bounds of the binding, not of the key's range.
    qp.post_send(SendWr::fetch_add(res.local()?, remote.slice(256, 8)?, 1))?;
    assert_eq!(cq.wait(WAIT)?.status, WcStatus::REM_ACCESS_ERR);
    Ok(())
}

#[test]
fn umr_refuses_what_it_cannot_serve() -> Result<()> {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd()?;
    let other_pd = ctx.alloc_pd()?;
    let umr = pd.create_umr_queue()?;
    let key = pd.create_indirect_mkey(0, u64::MAX / 2, AccessFlags::ALL_REMOTE)?;
    let r = pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
    let huge = KsmEntry::new(&r, 0, UMR_MAX_LEN + 1);
    assert!(matches!(umr.bind(&key, &[huge]), Err(Error::Unsupported(_))));
    let foreign = other_pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
    assert!(umr.bind(&key, &[KsmEntry::whole(&foreign)]).is_err(), "entries must share the key's PD");
    assert!(umr.bind(&key, &[KsmEntry::new(&r, 32, 64)]).is_err());
    let other_key = other_pd.create_indirect_mkey(0, 64, AccessFlags::ALL_REMOTE)?;
    assert!(umr.invalidate(&other_key).is_err(), "UMR on another PD's key");
    assert!(pd.create_indirect_mkey(u64::MAX, 2, AccessFlags::ALL_REMOTE).is_err());
    Ok(())
}

#[test]
fn functions_have_their_own_vhca_ids() -> Result<()> {
    let host = Context::open_soft_with(SoftConfig::default())?;
    let dpu = host.open_function()?;
    assert_ne!(host.vhca_id()?, dpu.vhca_id()?);
    let other_nic = Context::open_soft_with(SoftConfig::default())?;
    // A key of another NIC cannot be aliased.
    let hpd = other_nic.alloc_pd()?;
    let key = hpd.create_indirect_mkey(0, 64, AccessFlags::ALL_REMOTE)?;
    key.allow_other_vhca_access(&SECRET)?;
    let err =
        dpu.alloc_pd()?.create_alias_mkey(other_nic.vhca_id()?, key.key(), &SECRET, AccessFlags::LOCAL_WRITE);
    assert!(err.is_err());
    Ok(())
}

#[test]
fn alias_needs_an_open_key_and_the_right_access_key() -> Result<()> {
    let host = Context::open_soft_with(SoftConfig::default())?;
    let dpu = host.open_function()?;
    let (hpd, dpd) = (host.alloc_pd()?, dpu.alloc_pd()?);
    let key = hpd.create_indirect_mkey(0, 4096, AccessFlags::ALL_REMOTE)?;
    let vhca = host.vhca_id()?;
    let closed = dpd.create_alias_mkey(vhca, key.key(), &SECRET, AccessFlags::LOCAL_WRITE);
    assert!(matches!(closed, Err(Error::PermissionDenied(_))), "{closed:?}");
    key.allow_other_vhca_access(&SECRET)?;
    let wrong = dpd.create_alias_mkey(vhca, key.key(), &[0; ACCESS_KEY_LEN], AccessFlags::LOCAL_WRITE);
    assert!(matches!(wrong, Err(Error::PermissionDenied(_))), "{wrong:?}");
    let missing = dpd.create_alias_mkey(vhca, key.key() ^ 0x55, &SECRET, AccessFlags::LOCAL_WRITE);
    assert!(missing.is_err());
    let alias = dpd.create_alias_mkey(vhca, key.key(), &SECRET, AccessFlags::LOCAL_WRITE)?;
    assert_eq!(alias.target(), (vhca, key.key()));
    Ok(())
}

/// The cross-GVMI flow: the host binds its buffer to a pool-style key and opens it; a QP of
/// the DPU function writes the host's bytes to a remote peer through an alias, without the
/// host CPU; after the host invalidates the key, the same alias gets a protection error.
#[test]
fn dpu_moves_host_memory_through_an_alias() -> Result<()> {
    let host = Context::open_soft_with(SoftConfig::default())?;
    let dpu = host.open_function()?;
    let remote_node = Context::open_soft_with(SoftConfig::default())?;
    let (hpd, dpd, rpd) = (host.alloc_pd()?, dpu.alloc_pd()?, remote_node.alloc_pd()?);

    let host_buf = hpd.alloc_mr(4096, AccessFlags::ALL_REMOTE)?;
    host_buf.write_at(0, b"host bytes, moved by the DPU")?;
    let umr = hpd.create_umr_queue()?;
    let key = hpd.create_indirect_mkey(0, 1 << 30, AccessFlags::ALL_REMOTE)?;
    key.allow_other_vhca_access(&SECRET)?;
    umr.bind(&key, &[KsmEntry::whole(&host_buf)])?;

    let alias = dpd.create_alias_mkey(host.vhca_id()?, key.key(), &SECRET, AccessFlags::LOCAL_WRITE)?;
    let sink = rpd.alloc_mr(4096, AccessFlags::ALL_REMOTE)?;
    let (qp, cq, _rqp, _rcq) = pair(&dpd, &rpd)?;
    qp.post_send(SendWr::write(alias.region().slice(0, 28)?, sink.remote().slice(100, 28)?))?;
    cq.wait(WAIT)?.ok()?;
    let mut got = [0u8; 28];
    sink.read_at(100, &mut got)?;
    assert_eq!(&got, b"host bytes, moved by the DPU");

    // RDMA read into host memory through the alias (the alias as a local write target).
    sink.write_at(0, b"reply")?;
    qp.post_send(SendWr::read(alias.region().slice(2000, 5)?, sink.remote().slice(0, 5)?))?;
    cq.wait(WAIT)?.ok()?;
    let mut reply = [0u8; 5];
    host_buf.read_at(2000, &mut reply)?;
    assert_eq!(&reply, b"reply");

    // Invalidated on the host: the alias is now a local protection error.
    umr.invalidate(&key)?;
    qp.post_send(SendWr::write(alias.region().slice(0, 8)?, sink.remote().slice(0, 8)?))?;
    let wc = cq.wait(WAIT)?;
    assert_eq!(wc.status, WcStatus::LOC_PROT_ERR);
    Ok(())
}

#[test]
fn dropping_everything_mid_binding_is_sound() -> Result<()> {
    // The key keeps its bound regions registered; the regions' handles can go first.
    let pd = Context::open_soft().alloc_pd()?;
    let umr = pd.create_umr_queue()?;
    let key = pd.create_indirect_mkey(0, 64, AccessFlags::ALL_REMOTE)?;
    {
        let r = pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
        r.write_u64(0, 99)?;
        umr.bind(&key, &[KsmEntry::whole(&r)])?;
    }
    let (qp, cq, _p, _pcq) = pair(&pd, &pd)?;
    let res = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    qp.post_send(SendWr::read(res.local()?, key.region().remote().slice(0, 8)?))?;
    cq.wait(WAIT)?.ok()?;
    assert_eq!(res.read_u64(0)?, 99);
    drop((umr, key));
    Ok(())
}

/// The front checks KSM entries before the provider sees them: every refusal is a typed
/// `InvalidArgument` and leaves the key free, so a correct bind still succeeds afterwards.
#[test]
fn refused_binds_leave_the_key_free() -> Result<()> {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd()?;
    let other_pd = ctx.alloc_pd()?;
    let umr = pd.create_umr_queue()?;
    let key = pd.create_indirect_mkey(0, 128, AccessFlags::ALL_REMOTE)?;
    let r = pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
    let foreign = other_pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
    let refused: [Vec<KsmEntry>; 4] = [
        vec![KsmEntry::new(&r, 0, 0)],
        vec![KsmEntry::whole(&r), KsmEntry::whole(&foreign)],
        vec![KsmEntry::new(&r, u64::MAX, 2)],
        // 192 bytes onto a key of 128.
        vec![KsmEntry::whole(&r), KsmEntry::whole(&r), KsmEntry::whole(&r)],
    ];
    for entries in &refused {
        match umr.bind(&key, entries) {
            Err(Error::InvalidArgument(_)) => {}
            other => panic!("expected InvalidArgument for {entries:?}, got {other:?}"),
        }
        assert!(!key.is_bound(), "a refused bind left the key bound");
    }
    assert!(matches!(
        pd.create_ksm_mkey(0x1000, &[KsmEntry::whole(&foreign)], AccessFlags::ALL_REMOTE),
        Err(Error::InvalidArgument(_))
    ));
    umr.bind(&key, &[KsmEntry::whole(&r), KsmEntry::whole(&r)])?;
    assert!(key.is_bound());
    Ok(())
}

#[test]
fn a_ksm_key_gets_the_checks_of_any_indirect_key() -> Result<()> {
    // A KSM key whose range wraps the address space, one of no bytes, and one with remote
    // write but not local write are refused as `create_indirect_mkey` refuses them (a
    // wrapping key's slices used to overflow the bounds arithmetic when posted).
    let pd = Context::open_soft().alloc_pd()?;
    let mr = pd.alloc_mr(4096, AccessFlags::ALL_REMOTE)?;
    let wraps = pd.create_ksm_mkey(u64::MAX - 7, &[KsmEntry::whole(&mr)], AccessFlags::ALL_REMOTE);
    assert!(matches!(wraps, Err(Error::InvalidArgument(_))), "{:?}", wraps.err());
    let empty = pd.create_ksm_mkey(0x1000, &[], AccessFlags::ALL_REMOTE);
    assert!(matches!(empty, Err(Error::InvalidArgument(_))), "{:?}", empty.err());
    let no_local = pd.create_ksm_mkey(0x1000, &[KsmEntry::whole(&mr)], AccessFlags::REMOTE_WRITE);
    assert!(no_local.is_err(), "remote write without local write");
    pd.create_ksm_mkey(0x1000, &[KsmEntry::whole(&mr)], AccessFlags::ALL_REMOTE)?;
    Ok(())
}

#[test]
fn cpu_copies_of_a_key_region_fail_before_allocating_its_length() -> Result<()> {
    // A key may name a terabyte; `to_vec` and `fill` used to allocate that much before
    // finding that the CPU cannot copy through a key (the allocation aborted the process).
    let pd = Context::open_soft().alloc_pd()?;
    let key = pd.create_indirect_mkey(0x1000, 1 << 40, AccessFlags::ALL_REMOTE)?;
    assert!(matches!(key.region().to_vec(), Err(Error::Unsupported(_))));
    assert!(matches!(key.region().fill(1), Err(Error::Unsupported(_))));
    Ok(())
}
