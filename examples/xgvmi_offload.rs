//! Cross-GVMI offload: a DPU function moves host memory to a remote peer, without the host
//! CPU touching the data path, through keys from the host's UMR mkey pool and aliases from
//! the DPU's cache.
//!
//! Per iteration the host takes a temporary buffer from a registration cache, fills it,
//! exports it (a UMR bind of a pooled key) and sends the 74-byte packed key to the DPU; the
//! DPU imports it (an alias-cache hit after the first time) and RDMA-writes the host's bytes
//! to the remote peer; the host then releases the export (LOCAL_INV, key back to the pool).
//!
//! Then the seed's pull flow: the host exports one more buffer, the DPU packs an rkey of its
//! alias for the remote peer, which RDMA-reads the host's bytes through it; after the host
//! releases the export, the same read fails with `REM_ACCESS_ERR`.
//!
//! `cargo run --example xgvmi_offload`

use std::sync::mpsc;
use std::time::Duration;

use rdmakit::memory::xgvmi::*;
use rdmakit::*;

const ITERS: u8 = 16;
const LEN: u32 = 4096;

fn main() -> Result<()> {
    let host = Context::open_soft_with(SoftConfig::default())?;
    let dpu = host.open_function()?;
    let remote = Context::open_soft_with(SoftConfig::default())?;
    println!(
        "host vHCA {}, DPU vHCA {} (same NIC), remote peer {}",
        host.vhca_id()?,
        dpu.vhca_id()?,
        remote.name()
    );
    let (hpd, dpd, rpd) = (host.alloc_pd()?, dpu.alloc_pd()?, remote.alloc_pd()?);
    let access_key = [0x3c; 32];

    // The DPU's QP to the remote peer, and the peer's sink.
    let (dcq, rcq) = (dpu.create_cq(16)?, remote.create_cq(16)?);
    let dqp = dpd.create_qp(&dcq, &dcq, QpCaps::default())?;
    let rqp = rpd.create_qp(&rcq, &rcq, QpCaps::default())?;
    dqp.connect(&rqp.address()?, &ConnectOptions::default())?;
    rqp.connect(&dqp.address()?, &ConnectOptions::default())?;
    let sink = rpd.alloc_mr(LEN as usize * usize::from(ITERS), AccessFlags::ALL_REMOTE)?;
    let sink_desc = sink.remote();

    let (to_dpu, dpu_rx) = mpsc::channel::<[u8; PackedKey::ENCODED_LEN]>();
    let (to_host, host_rx) = mpsc::channel::<()>();
    let pull_pd = dpd.clone();
    let dpu_side = std::thread::spawn(move || -> Result<AliasStats> {
        let cache = AliasCache::new(DpuFunction::new(&dpd, AccessFlags::LOCAL_WRITE));
        for (i, wire) in dpu_rx.iter().enumerate() {
            let key = PackedKey::decode(&wire)
                .map_err(|e| Error::Malformed { what: "packed key", reason: e.to_string() })?;
            let imported = cache.import(&key)?;
            let dst = sink_desc.slice(i as u64 * u64::from(LEN), LEN)?;
            dqp.post_send(SendWr::write(imported.alias.region().slice(0, LEN)?, dst))?;
            dcq.wait(Some(Duration::from_secs(10)))?.ok()?;
            to_host.send(()).map_err(|_| Error::InvalidArgument("host gone".into()))?;
        }
        Ok(cache.stats())
    });

    let pool =
        UmrMkeyPool::new(HostFunction::new(&hpd, AccessFlags::ALL_REMOTE)?, PoolConfig::new(4, access_key))?;
    let buffers = RegistrationCache::new(&hpd, AccessFlags::ALL_REMOTE, 1 << 20);
    for i in 0..ITERS {
        let buf = buffers.get(LEN as usize)?;
        buf.write_at(0, &vec![i; LEN as usize])?;
        let export = pool.export(buf.region())?;
        to_dpu.send(export.packed().encode()).map_err(|_| Error::InvalidArgument("DPU gone".into()))?;
        host_rx.recv().map_err(|_| Error::InvalidArgument("DPU failed".into()))?;
        export.release()?;
    }
    drop(to_dpu);
    let alias_stats = dpu_side.join().expect("DPU thread")?;

    let data = sink.to_vec()?;
    let ok =
        (0..ITERS).all(|i| data[usize::from(i) * LEN as usize..][..LEN as usize].iter().all(|&b| b == i));
    println!(
        "{ITERS} buffers of {LEN} bytes moved host -> DPU alias -> remote: {}",
        if ok { "all intact" } else { "CORRUPT" }
    );
    println!("host pool:   {:?}", pool.stats());
    println!("DPU aliases: {alias_stats:?}");
    println!("host buffers (registration cache): {:?}", buffers.stats());
    assert!(ok);

    // The pull flow: host export -> DPU alias -> packed alias rkey -> remote RDMA READ.
    let (pcq, qcq) = (dpu.create_cq(4)?, remote.create_cq(4)?);
    let pqp = pull_pd.create_qp(&pcq, &pcq, QpCaps::default())?;
    let qqp = rpd.create_qp(&qcq, &qcq, QpCaps::default())?;
    pqp.connect(&qqp.address()?, &ConnectOptions::default())?;
    qqp.connect(&pqp.address()?, &ConnectOptions::default())?;
    let buf = buffers.get(LEN as usize)?;
    buf.write_at(0, &vec![0xa5; LEN as usize])?;
    let export = pool.export(buf.region())?;
    let wire = export.packed().encode();
    let cache =
        AliasCache::new(DpuFunction::new(&pull_pd, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ));
    let packed = PackedKey::decode(&wire)
        .map_err(|e| Error::Malformed { what: "packed key", reason: e.to_string() })?;
    let rkey_for_peer = cache.import(&packed)?.remote().encode();
    let desc = RemoteRegion::decode(&rkey_for_peer)?;
    let landing = rpd.alloc_mr(LEN as usize, AccessFlags::LOCAL_WRITE)?;
    qqp.post_send(SendWr::read(landing.local()?, desc.slice(0, LEN)?))?;
    qcq.wait(Some(Duration::from_secs(10)))?.ok()?;
    let pulled = landing.to_vec()?.iter().all(|&b| b == 0xa5);
    println!(
        "remote peer read {LEN} host bytes through the DPU alias rkey: {}",
        if pulled { "intact" } else { "CORRUPT" }
    );
    export.release()?;
    qqp.post_send(SendWr::read(landing.local()?, desc.slice(0, LEN)?))?;
    let after = qcq.wait(Some(Duration::from_secs(10)))?;
    println!("the same read after the host's LOCAL_INV: {:?}", after.status);
    assert!(pulled && after.status == WcStatus::REM_ACCESS_ERR);
    Ok(())
}
