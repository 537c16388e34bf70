//! A first look at rdmakit: two queue pairs on the soft NIC doing an RDMA write, an RDMA
//! read and a fetch-and-add, then a request the remote NIC refuses.
//!
//! `cargo run --example soft_quickstart` (no RDMA hardware needed). Set
//! `RDMAKIT_PROVIDER=verbs` to run the same code on a real device (or rxe).

use rdmakit::*;

fn main() -> Result<()> {
    // `open_default` picks a verbs device if there is one, else the soft NIC; this example
    // wants the soft NIC unless told otherwise.
    let ctx = match std::env::var(PROVIDER_ENV).as_deref() {
        Ok("verbs") | Ok("auto") => Context::open_default()?,
        _ => Context::open_soft(),
    };
    let attr = ctx.attr();
    println!(
        "device {} ({} provider), {} KiB of device memory",
        attr.name,
        attr.provider,
        attr.max_dm_size / 1024
    );

    // One protection domain; each side gets its own completion queue and QP. In a real
    // program the two sides are two processes or hosts that swap `QpAddress`s out of band.
    let pd = ctx.alloc_pd()?;
    let (cq_a, cq_b) = (ctx.create_cq(64)?, ctx.create_cq(64)?);
    let a = pd.create_qp(&cq_a, &cq_a, QpCaps::default())?;
    let b = pd.create_qp(&cq_b, &cq_b, QpCaps::default())?;
    let opts = ConnectOptions::default();
    a.connect(&b.address()?, &opts)?;
    b.connect(&a.address()?, &opts)?;
    println!("connected QP {:#x} <-> QP {:#x}", a.qp_num(), b.qp_num());

    // B exposes 4 KiB; A only ever sees B's (addr, len, rkey) descriptor.
    let b_mem = pd.alloc_mr(4096, AccessFlags::ALL_REMOTE)?;
    let b_remote = b_mem.remote();
    println!("B advertises addr={:#x} len={} rkey={:#x}", b_remote.addr, b_remote.len, b_remote.rkey);
    let a_mem = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;

    // 1. RDMA write: A's bytes land in B's memory; B's CPU does nothing.
    let msg = b"hello from A, by RDMA write";
    a_mem.write_at(0, msg)?;
    let len = msg.len() as u32;
    a.post_send(SendWr::write(a_mem.slice(0, len)?, b_remote.slice(0, len)?).wr_id(1))?;
    let wc = cq_a.wait(None)?.ok()?;
    let mut seen = vec![0u8; msg.len()];
    b_mem.read_at(0, &mut seen)?;
    println!("write  (wr_id {}): B now holds {:?}", wc.wr_id, String::from_utf8_lossy(&seen));
    assert_eq!(seen, msg, "the write did not land in B's memory");

    // 2. RDMA read: A fetches it back into another part of its own memory.
    a.post_send(SendWr::read(a_mem.slice(1024, len)?, b_remote.slice(0, len)?).wr_id(2))?;
    let wc = cq_a.wait(None)?.ok()?;
    let mut back = vec![0u8; msg.len()];
    a_mem.read_at(1024, &mut back)?;
    println!("read   (wr_id {}): {} bytes back, equal: {}", wc.wr_id, wc.byte_len, back == msg);
    assert_eq!(back, msg, "the read did not bring B's bytes back");

    // 3. Fetch-and-add on a counter in B's memory; A gets the value before the add.
    b_mem.write_u64(2048, 40)?;
    for round in 0..2 {
        a.post_send(SendWr::fetch_add(a_mem.slice(2048, 8)?, b_remote.slice(2048, 8)?, 1).wr_id(3 + round))?;
        cq_a.wait(None)?.ok()?;
        let (old, now) = (a_mem.read_u64(2048)?, b_mem.read_u64(2048)?);
        println!("fetch-add +1: old value {old}, counter now {now}");
        assert_eq!((old, now), (40 + round, 41 + round), "fetch-and-add returned or left the wrong value");
    }

    // 4. A write outside B's region: B's NIC refuses it and A gets a typed error.
    let past_end = RemoteSlice::new(b_remote.addr + 4090, 16, b_remote.rkey);
    a.post_send(SendWr::write(a_mem.slice(0, 16)?, past_end).wr_id(9))?;
    match cq_a.wait(None)?.ok() {
        Err(e) => println!("out-of-bounds write refused: {e}"),
        Ok(wc) => panic!("an out-of-bounds write succeeded: {wc:?}"),
    }
    println!("QP A is now {:?}; its later requests flush", a.state());
    Ok(())
}
