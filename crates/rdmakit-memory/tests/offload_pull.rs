//! The cross-GVMI offload flow as the seed talk draws it, on the soft NIC's emulation of mlx5
//! functions: the host maps a buffer into a pooled UMR key and packs it; its DPU imports the
//! packed key as an alias and packs an rkey of that alias; a remote peer (another NIC)
//! RDMA-reads the host's bytes through the alias. Once the host releases the export
//! (LOCAL_INV), the same read fails with a typed remote-access error, not stale data.

use std::time::Duration;

use rdmakit_memory::xgvmi::{AliasCache, DpuFunction, HostFunction, PackedKey, PoolConfig, UmrMkeyPool};
use rdmakit_verbs::*;

const LEN: u32 = 8192;
const SECRET: [u8; 32] = [0x5a; 32];

#[test]
fn a_remote_peer_reads_host_memory_through_the_dpu_alias_until_the_host_invalidates() -> Result<()> {
    let host = Context::open_soft_with(SoftConfig::default())?;
    let dpu = host.open_function()?;
    let remote = Context::open_soft_with(SoftConfig::default())?;
    let (hpd, dpd, rpd) = (host.alloc_pd()?, dpu.alloc_pd()?, remote.alloc_pd()?);

    // The DPU function's QP and the remote peer's, connected: the remote side reads from
    // the DPU function's memory space (its alias).
    let (dcq, rcq) = (dpu.create_cq(8)?, remote.create_cq(8)?);
    let dqp = dpd.create_qp(&dcq, &dcq, QpCaps::default())?;
    let rqp = rpd.create_qp(&rcq, &rcq, QpCaps::default())?;
    dqp.connect(&rqp.address()?, &ConnectOptions::default())?;
    rqp.connect(&dqp.address()?, &ConnectOptions::default())?;

    // Host: a buffer, a pooled key bound to it, the packed key on the wire.
    let buffer = hpd.alloc_mr(LEN as usize, AccessFlags::ALL_REMOTE)?;
    let pattern: Vec<u8> = (0..LEN).map(|i| (i * 7 % 251) as u8).collect();
    buffer.write_at(0, &pattern)?;
    let pool =
        UmrMkeyPool::new(HostFunction::new(&hpd, AccessFlags::ALL_REMOTE)?, PoolConfig::new(2, SECRET))?;
    let export = pool.export(&buffer)?;
    let wire = export.packed().encode();

    // DPU: the alias, and an rkey of it packed for the remote peer.
    let cache = AliasCache::new(DpuFunction::new(&dpd, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ));
    let packed = PackedKey::decode(&wire)
        .map_err(|e| Error::Malformed { what: "packed key", reason: e.to_string() })?;
    let imported = cache.import(&packed)?;
    let alias_desc = imported.remote().encode();

    // Remote peer: RDMA READ through the alias rkey.
    let desc = RemoteRegion::decode(&alias_desc)?;
    assert_eq!(desc.len, u64::from(LEN));
    let sink = rpd.alloc_mr(LEN as usize, AccessFlags::LOCAL_WRITE)?;
    rqp.post_send(SendWr::read(sink.local()?, desc.slice(0, LEN)?).wr_id(1))?;
    let wc = rcq.wait(Some(Duration::from_secs(5)))?;
    wc.ok()?;
    assert_eq!(sink.to_vec()?, pattern, "the remote read returned the host's bytes");

    // Host: release the export (LOCAL_INV). The alias now reaches nothing.
    export.release()?;
    rqp.post_send(SendWr::read(sink.local()?, desc.slice(0, LEN)?).wr_id(2))?;
    let wc = rcq.wait(Some(Duration::from_secs(5)))?;
    assert_eq!(wc.wr_id, 2);
    assert_eq!(wc.status, WcStatus::REM_ACCESS_ERR, "a read through an invalidated key: {wc:?}");
    match wc.ok() {
        Err(Error::Completion { status, .. }) => assert_eq!(status, WcStatus::REM_ACCESS_ERR),
        other => panic!("expected a typed completion error, got {other:?}"),
    }
    println!("remote read through the DPU alias: {LEN} bytes intact; after LOCAL_INV: {:?}", wc.status);
    Ok(())
}
