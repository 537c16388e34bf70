//! MEMIC on the soft NIC: placement, fallback, exhaustion, remote atomics through the
//! indirect key at the reserved address, counters.

use std::time::Duration;

use rdmakit_verbs::*;

use super::*;

const WAIT: Option<Duration> = Some(Duration::from_secs(10));

fn device(dm: u64) -> ProtectionDomain {
    Context::open_soft_with(SoftConfig::default().with_dm_capacity(dm)).unwrap().alloc_pd().unwrap()
}

fn qp_pair(pd: &ProtectionDomain) -> (QueuePair, CompletionQueue, QueuePair) {
    let cq = pd.context().create_cq(256).unwrap();
    let a = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    let b = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    a.connect(&b.address().unwrap(), &ConnectOptions::default()).unwrap();
    b.connect(&a.address().unwrap(), &ConnectOptions::default()).unwrap();
    (a, cq, b)
}

#[test]
fn lengths_round_to_powers_of_two_of_at_least_64() {
    assert_eq!(Memic::rounded_len(1), Some(64));
    assert_eq!(Memic::rounded_len(64), Some(64));
    assert_eq!(Memic::rounded_len(65), Some(128));
    assert_eq!(Memic::rounded_len(4000), Some(4096));
    assert_eq!(Memic::rounded_len(u64::MAX), None);
}

#[test]
fn nic_region_has_a_unique_address_and_takes_remote_atomics() {
    let pd = device(256 << 10);
    let memic = Memic::open(&pd);
    assert_eq!(memic.unavailable_reason(), None);
    let (r1, r2) =
        (memic.alloc(8, Placement::NicRequired).unwrap(), memic.alloc(8, Placement::NicRequired).unwrap());
    assert_eq!((r1.location(), r1.len()), (Location::Nic, 64));
    let (d1, d2) = (r1.remote(), r2.remote());
    assert!(d1.addr != 0 && d2.addr != 0 && d1.addr != d2.addr, "{d1:?} {d2:?}");
    assert_eq!(Some(d1.addr), r1.reserved_addr());
    assert_eq!(r1.device_memory_region().unwrap().addr(), 0, "the DM registration itself is zero-based");

    let (qp, cq, _peer) = qp_pair(&pd);
    let res = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    for i in 0..10u64 {
        qp.post_send(SendWr::fetch_add(res.local().unwrap(), d1.slice(8, 8).unwrap(), 3)).unwrap();
        cq.wait(WAIT).unwrap().ok().unwrap();
        assert_eq!(res.read_u64(0).unwrap(), i * 3);
    }
    assert_eq!(r1.read_u64(8).unwrap(), 30);
    // Write and read through the descriptor.
    let src = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, b"on-chip memory!!").unwrap();
    qp.post_send(SendWr::write(src.local().unwrap(), d2.slice(32, 16).unwrap())).unwrap();
    cq.wait(WAIT).unwrap().ok().unwrap();
    let mut got = [0u8; 16];
    r2.read_at(32, &mut got).unwrap();
    assert_eq!(&got, b"on-chip memory!!");
    // Past the region's end: a remote access error, not someone else's memory.
    let out_of_bounds = RemoteRegion { addr: d2.addr + 60, len: 8, rkey: d2.rkey };
    qp.post_send(SendWr::write(src.slice(0, 8).unwrap(), out_of_bounds.slice(0, 8).unwrap())).unwrap();
    assert_eq!(cq.wait(WAIT).unwrap().status, WcStatus::REM_ACCESS_ERR);
    assert!(r2.read_at(60, &mut got).is_err(), "CPU copies are bounds-checked too");
}

/// A clone of a region's key outlives the region: the key still works for peers, so its
/// address stays reserved, and a region made meanwhile gets another address (two live keys
/// at one address would break the addresses' uniqueness).
#[test]
fn a_clone_of_the_key_keeps_its_address_reserved() {
    let pd = device(256 << 10);
    let memic = Memic::open(&pd);
    let r = memic.alloc(4096, Placement::NicRequired).unwrap();
    let addr = r.reserved_addr().unwrap();
    let key = r.region().clone();
    drop(r);
    let (qp, cq, _peer) = qp_pair(&pd);
    let res = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    qp.post_send(SendWr::fetch_add(res.local().unwrap(), key.remote().slice(0, 8).unwrap(), 5)).unwrap();
    cq.wait(WAIT).unwrap().ok().unwrap();
    assert!(mapped(addr), "the address of a key still in use was given up");
    let mut later = Vec::new();
    for _ in 0..4 {
        let other = memic.alloc(4096, Placement::NicRequired).unwrap();
        assert_ne!(other.reserved_addr(), Some(addr), "the address of a key still in use was given again");
        later.push(other);
    }
    // Through the clone, the key still reaches the first region's memory.
    qp.post_send(SendWr::fetch_add(res.local().unwrap(), key.remote().slice(0, 8).unwrap(), 1)).unwrap();
    cq.wait(WAIT).unwrap().ok().unwrap();
    assert_eq!(res.read_u64(0).unwrap(), 5);
    // (Whether the range is unmapped once the clone goes is not checked here: a test
    // running in parallel may map that range again at once.)
    drop(later);
    drop(key);
}

/// Whether `addr` lies in a mapping of this process (`/proc/self/maps`).
fn mapped(addr: u64) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines().filter_map(|l| l.split_whitespace().next()?.split_once('-')).any(|(lo, hi)| {
        let (lo, hi) = (u64::from_str_radix(lo, 16).unwrap(), u64::from_str_radix(hi, 16).unwrap());
        (lo..hi).contains(&addr)
    })
}

#[test]
fn exhaustion_and_the_size_limit_are_typed_errors() {
    let pd = device(4096);
    let memic = Memic::open(&pd);
    assert!(matches!(memic.alloc(8192, Placement::NicRequired), Err(Error::DeviceMemoryExhausted { .. })));
    let regions: Vec<_> = (0..4).map(|_| memic.alloc(1024, Placement::NicRequired).unwrap()).collect();
    assert!(matches!(memic.alloc(64, Placement::NicRequired), Err(Error::DeviceMemoryExhausted { .. })));
    // NicPreferred falls back when the NIC is full, and says so.
    let fallback = memic.alloc(64, Placement::NicPreferred).unwrap();
    assert_eq!(fallback.location(), Location::Host);
    drop(regions);
    assert_eq!(memic.alloc(64, Placement::NicRequired).unwrap().location(), Location::Nic);
    assert!(memic.alloc(0, Placement::NicPreferred).is_err());
}

#[test]
fn a_device_without_memory_falls_back_or_refuses() {
    let pd = device(0);
    let memic = Memic::open(&pd);
    assert!(memic.unavailable_reason().is_some());
    assert!(memic.alloc(64, Placement::NicRequired).is_err());
    let r = memic.alloc(64, Placement::NicPreferred).unwrap();
    assert_eq!(r.location(), Location::Host);
    assert!(r.device_memory().is_none() && r.reserved_addr().is_none());
    // The fallback is a plain region: remote atomics work the same.
    let (qp, cq, _peer) = qp_pair(&pd);
    let res = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    qp.post_send(SendWr::fetch_add(res.local().unwrap(), r.remote().slice(0, 8).unwrap(), 9)).unwrap();
    cq.wait(WAIT).unwrap().ok().unwrap();
    assert_eq!(r.read_u64(0).unwrap(), 9);
}

#[test]
fn counters_are_sub_allocated_and_recycled() {
    let pd = device(256 << 10);
    let memic = Memic::open(&pd);
    let pool = CounterPool::new(&memic, 100, Placement::NicRequired).unwrap();
    assert_eq!(pool.location(), Location::Nic);
    assert_eq!(pool.region().len(), 1024, "100 counters of 8 bytes: one 1 KiB region");
    let counters: Vec<_> = (0..128).map(|_| pool.alloc().unwrap().unwrap()).collect();
    assert!(pool.alloc().unwrap().is_none(), "all 128 slots in use");
    let (qp, cq, _peer) = qp_pair(&pd);
    let res = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    for (i, c) in counters.iter().enumerate() {
        qp.post_send(SendWr::fetch_add(res.local().unwrap(), c.remote().unwrap(), i as u64 + 1)).unwrap();
        cq.wait(WAIT).unwrap().ok().unwrap();
    }
    for (i, c) in counters.iter().enumerate() {
        assert_eq!(c.get().unwrap(), i as u64 + 1, "counter {i} saw only its own adds");
    }
    drop(counters);
    assert_eq!(pool.available(), 128);
    let again = pool.alloc().unwrap().unwrap();
    assert_eq!(again.get().unwrap(), 0, "a recycled counter starts at zero");
    assert!(CounterPool::new(&memic, 0, Placement::NicRequired).is_err());
}
