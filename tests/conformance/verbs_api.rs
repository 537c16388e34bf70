//! Conformance cases for the verbs API (rdmakit-verbs): registration, one-sided and two-sided
//! operations, atomics, remote errors, QP states, CQs, GIDs, device memory and connection
//! setup. Each takes an [`Env`] and uses only rdmakit's public API, so it runs unchanged on
//! every provider.

use std::time::Duration;

use libtest_mimic::Failed;
use rdmakit::*;

use crate::fixture::{Case, Env, Needs, case, pattern, wait, wait_ok};
use crate::{check, check_eq};

/// The verbs cases, run on both providers by `main`.
pub const CASES: &[Case] = &[
    case("register_deregister", register_deregister),
    case("access_rule_enforced_at_registration", access_rule_enforced_at_registration),
    case("write_read_round_trip_1b_to_8mib", write_read_round_trip),
    case("write_with_imm_delivers_immediate", write_with_imm),
    case("send_recv", send_recv),
    case("send_larger_than_recv_buffer", send_larger_than_recv_buffer),
    case("fetch_add_and_cmp_swap", atomics),
    case("atomic_misaligned_is_rejected", atomic_misaligned),
    case("write_out_of_bounds_leaves_memory_untouched", write_out_of_bounds),
    case("read_out_of_bounds", read_out_of_bounds),
    case("wrong_rkey", wrong_rkey),
    case("missing_remote_access_flags", missing_access_flags),
    case("deregistered_rkey_is_refused", deregistered_rkey),
    case("other_pd_key_is_refused", other_pd_key),
    case("post_after_peer_qp_destroyed", post_after_peer_destroyed),
    case("rnr_retry_exceeded", rnr_retry_exceeded),
    case("post_before_rts_and_flush_in_error", post_states_and_flush),
    case("unsignaled_requests_retire_with_signaled", unsignaled_retire),
    case("send_queue_full", send_queue_full),
    case("cq_overrun_is_reported", cq_overrun),
    case("cq_overrun_flag_dies_with_its_cq", cq_overrun_flag_dies_with_its_cq),
    case("default_gid_is_chosen_by_type", default_gid_is_chosen_by_type),
    case("connect_options_path_fields", connect_options_path_fields),
    case("inline_write", inline_write),
    case("batch_post_keeps_order", batch_post_order),
    case("fenced_write_carries_what_an_earlier_read_brought", fenced_write_after_read),
    case("array_post_is_one_call_in_order_and_all_or_nothing", array_post),
    case("prepared_requests_post_as_built_ones", prepared_requests),
    case("async_completion_wait", async_wait),
    case("dropped_qp_releases_buffers", dropped_qp_releases_buffers),
    Case { name: "dm_alloc_past_capacity_fails_cleanly", needs: Needs::DeviceMemory, run: dm_capacity },
    Case { name: "dm_copy_round_trip_and_remote_access", needs: Needs::DeviceMemory, run: dm_round_trip },
    case("random_ops_match_memory_model", crate::model::random_ops_match_model),
    Case { name: "cm_connect_accept_write_disconnect", needs: Needs::CmAddress, run: cm_round_trip },
    Case { name: "cm_refused_and_limits", needs: Needs::CmAddress, run: cm_refused_and_limits },
    Case {
        name: "cm_receives_posted_before_the_answer",
        needs: Needs::CmAddress,
        run: cm_receives_posted_before_the_answer,
    },
];

fn register_deregister(env: &Env) -> Result<(), Failed> {
    let pd = env.ctx.alloc_pd()?;
    let mut keys = Vec::new();
    for (len, access) in [
        (1, AccessFlags::empty()),
        (4096, AccessFlags::LOCAL_WRITE),
        (65537, AccessFlags::ALL_REMOTE),
        (1 << 20, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ),
    ] {
        let mr = pd.alloc_mr(len, access)?;
        check_eq!(mr.len(), len);
        check_eq!(mr.access(), access);
        check_eq!(mr.addr() % 4096, 0);
        check_eq!(mr.remote().len, len as u64);
        keys.push((mr.lkey(), mr.rkey()));
    }
    let mut lkeys: Vec<u32> = keys.iter().map(|k| k.0).collect();
    lkeys.sort_unstable();
    lkeys.dedup();
    check_eq!(lkeys.len(), 4);
    // A region registered from a vector gives it back, contents included.
    let mr = pd.register(pattern(1000, 3), AccessFlags::ALL_REMOTE)?;
    mr.write_at(10, b"xyz")?;
    let clone = mr.clone();
    let mr = still_held(mr, "try_into_vec succeeded while a clone was alive")?;
    drop(clone);
    let v = mr.try_into_vec().map_err(|_| "try_into_vec failed with one handle")?;
    let mut want = pattern(1000, 3);
    want[10..13].copy_from_slice(b"xyz");
    check!(v == want, "vector contents changed");
    check!(pd.alloc_mr(0, AccessFlags::empty()).is_err(), "zero-length region accepted");
    Ok(())
}

fn access_rule_enforced_at_registration(env: &Env) -> Result<(), Failed> {
    let pd = env.ctx.alloc_pd()?;
    for bad in [AccessFlags::REMOTE_WRITE, AccessFlags::REMOTE_ATOMIC | AccessFlags::REMOTE_READ] {
        match pd.alloc_mr(64, bad) {
            Err(Error::InvalidArgument(_)) => {}
            other => return Err(format!("{bad:?}: expected InvalidArgument, got {other:?}").into()),
        }
    }
    Ok(())
}

fn write_read_round_trip(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let max = 8 << 20;
    let src = p.pd.alloc_mr(max, AccessFlags::LOCAL_WRITE)?;
    let dst = p.pd.alloc_mr(max, AccessFlags::ALL_REMOTE)?;
    let back = p.pd.alloc_mr(max, AccessFlags::LOCAL_WRITE)?;
    for (i, len) in [1usize, 7, 8, 63, 4096, 4097, 65536, 1 << 20, 8 << 20].into_iter().enumerate() {
        let data = pattern(len, i as u8);
        src.write_at(0, &data)?;
        let len32 = len as u32;
        p.a.post_send(SendWr::write(src.slice(0, len32)?, dst.remote().slice(0, len32)?).wr_id(i as u64))?;
        let wc = wait_ok(&p.cq_a)?;
        check_eq!((wc.wr_id, wc.opcode), (i as u64, WcOpcode::RDMA_WRITE));
        let mut got = vec![0; len];
        dst.read_at(0, &mut got)?;
        check!(got == data, "write of {len} bytes: data differs");
        // Read it back from a different offset of the target.
        back.fill(0)?;
        p.a.post_send(
            SendWr::read(back.slice(0, len32)?, dst.remote().slice(0, len32)?).wr_id(100 + i as u64),
        )?;
        let wc = wait_ok(&p.cq_a)?;
        check_eq!((wc.wr_id, wc.opcode, wc.byte_len), (100 + i as u64, WcOpcode::RDMA_READ, len32));
        back.read_at(0, &mut got)?;
        check!(got == data, "read of {len} bytes: data differs");
    }
    Ok(())
}

/// A read into a buffer, then a fenced write of that buffer (`IBV_SEND_FENCE`): the write
/// starts after the read has completed, so it carries what the read brought, whatever the
/// round trip of the read costs.
fn fenced_write_after_read(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let local = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    let remote = p.pd.alloc_mr(128, AccessFlags::ALL_REMOTE)?;
    for round in 1..=10u8 {
        remote.write_at(0, &[round; 64])?;
        local.fill(0)?;
        p.a.post_send(SendWr::read(local.slice(0, 64)?, remote.remote().slice(0, 64)?).unsignaled())?;
        p.a.post_send(SendWr::write(local.slice(0, 64)?, remote.remote().slice(64, 64)?).fence())?;
        wait_ok(&p.cq_a)?;
        let mut got = [0u8; 64];
        remote.read_at(64, &mut got)?;
        check!(
            got == [round; 64],
            "round {round}: the fenced write carried {:?}, not the read's bytes",
            &got[..4]
        );
    }
    Ok(())
}

fn write_with_imm(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let src = p.pd.alloc_mr(256, AccessFlags::LOCAL_WRITE)?;
    let dst = p.pd.alloc_mr(256, AccessFlags::ALL_REMOTE)?;
    src.write_at(0, &pattern(256, 9))?;
    p.b.post_recv(RecvWr::empty().wr_id(77))?;
    p.a.post_send(
        SendWr::write(src.slice(0, 200)?, dst.remote().slice(50, 200)?).with_imm(0xdead_beef).wr_id(5),
    )?;
    let wc = wait_ok(&p.cq_a)?;
    check_eq!((wc.wr_id, wc.opcode), (5, WcOpcode::RDMA_WRITE));
    let rc = wait_ok(&p.cq_b)?;
    check_eq!(
        (rc.wr_id, rc.opcode, rc.imm, rc.byte_len),
        (77, WcOpcode::RECV_RDMA_WITH_IMM, Some(0xdead_beef), 200)
    );
    let got = dst.to_vec()?;
    check!(got[50..250] == pattern(256, 9)[..200], "data differs");
    check!(
        got[..50].iter().all(|&b| b == 0) && got[250..].iter().all(|&b| b == 0),
        "bytes outside the target changed"
    );
    Ok(())
}

fn send_recv(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let src = p.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
    let rbuf = p.pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE)?;
    src.write_at(0, &pattern(4096, 1))?;
    p.b.post_recv(RecvWr::new(rbuf.slice(0, 4096)?).wr_id(1))?;
    p.b.post_recv(RecvWr::new(rbuf.slice(4096, 4096)?).wr_id(2))?;
    p.b.post_recv(RecvWr::empty().wr_id(3))?;
    p.a.post_send(SendWr::send(src.slice(0, 1000)?).wr_id(10))?;
    p.a.post_send(SendWr::send(src.slice(0, 4096)?).with_imm(42).wr_id(11))?;
    p.a.post_send(SendWr::send_empty().with_imm(7).wr_id(12))?;
    for want in [10, 11, 12] {
        let wc = wait_ok(&p.cq_a)?;
        check_eq!((wc.wr_id, wc.opcode), (want, WcOpcode::SEND));
    }
    let r1 = wait_ok(&p.cq_b)?;
    check_eq!((r1.wr_id, r1.opcode, r1.byte_len, r1.imm), (1, WcOpcode::RECV, 1000, None));
    let r2 = wait_ok(&p.cq_b)?;
    check_eq!((r2.wr_id, r2.byte_len, r2.imm), (2, 4096, Some(42)));
    let r3 = wait_ok(&p.cq_b)?;
    check_eq!((r3.wr_id, r3.byte_len, r3.imm), (3, 0, Some(7)));
    let got = rbuf.to_vec()?;
    check!(got[..1000] == pattern(4096, 1)[..1000], "first message differs");
    check!(got[4096..] == pattern(4096, 1)[..], "second message differs");
    check_eq!(p.b.outstanding(), (0, 0));
    Ok(())
}

fn send_larger_than_recv_buffer(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let src = p.pd.alloc_mr(128, AccessFlags::LOCAL_WRITE)?;
    let rbuf = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    rbuf.fill(0xee)?;
    p.b.post_recv(RecvWr::new(rbuf.local()?).wr_id(1))?;
    p.a.post_send(SendWr::send(src.local()?).wr_id(2))?;
    // The IB spec (and mlx5, and the soft NIC): an Invalid Request NAK, so the requester
    // sees REM_INV_REQ_ERR and the receive LOC_LEN_ERR. rxe treats it as a malformed
    // receive: REM_OP_ERR and LOC_QP_OP_ERR. Either pair is a clean, reported failure.
    let wc = wait(&p.cq_a)?;
    let rc = wait(&p.cq_b)?;
    check_eq!(rc.wr_id, 1);
    let pair = (wc.status, rc.status);
    check!(
        pair == (WcStatus::REM_INV_REQ_ERR, WcStatus::LOC_LEN_ERR)
            || (env.provider == ProviderKind::Verbs
                && pair == (WcStatus::REM_OP_ERR, WcStatus::LOC_QP_OP_ERR)),
        "statuses {pair:?}"
    );
    check_eq!(p.a.state(), QpState::Error);
    check!(rbuf.to_vec()?.iter().all(|&b| b == 0xee), "receive buffer changed");
    Ok(())
}

fn atomics(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let target = p.pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
    let result = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    target.write_u64(8, 40)?;
    let t = target.remote();
    p.a.post_send(SendWr::fetch_add(result.slice(0, 8)?, t.slice(8, 8)?, 2).wr_id(1))?;
    let wc = wait_ok(&p.cq_a)?;
    check_eq!((wc.wr_id, wc.opcode), (1, WcOpcode::FETCH_ADD));
    check_eq!((result.read_u64(0)?, target.read_u64(8)?), (40, 42));
    // Swap succeeds when the compare value matches...
    p.a.post_send(SendWr::compare_swap(result.slice(8, 8)?, t.slice(8, 8)?, 42, 1000).wr_id(2))?;
    check_eq!(wait_ok(&p.cq_a)?.opcode, WcOpcode::COMP_SWAP);
    check_eq!((result.read_u64(8)?, target.read_u64(8)?), (42, 1000));
    // ...and leaves memory alone when it does not.
    p.a.post_send(SendWr::compare_swap(result.slice(16, 8)?, t.slice(8, 8)?, 42, 5).wr_id(3))?;
    wait_ok(&p.cq_a)?;
    check_eq!((result.read_u64(16)?, target.read_u64(8)?), (1000, 1000));
    // Wrap-around of fetch-and-add.
    target.write_u64(16, u64::MAX)?;
    p.a.post_send(SendWr::fetch_add(result.slice(24, 8)?, t.slice(16, 8)?, 2))?;
    wait_ok(&p.cq_a)?;
    check_eq!((result.read_u64(24)?, target.read_u64(16)?), (u64::MAX, 1));
    // Atomics must be 8 bytes: refused before posting.
    check!(
        matches!(
            p.a.post_send(SendWr::fetch_add(result.slice(0, 4)?, t.slice(0, 4)?, 1)),
            Err(Error::InvalidArgument(_))
        ),
        "a 4-byte atomic was accepted"
    );
    Ok(())
}

fn atomic_misaligned(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let target = p.pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
    let result = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    target.fill(0x11)?;
    match p.a.post_send(SendWr::fetch_add(result.local()?, target.remote().slice(4, 8)?, 1)) {
        Err(Error::InvalidArgument(_)) => {}
        other => return Err(format!("misaligned atomic: expected InvalidArgument, got {other:?}").into()),
    }
    check_eq!(p.a.outstanding(), (0, 0));
    check_eq!(p.a.state(), QpState::ReadyToSend);
    check!(target.to_vec()?.iter().all(|&b| b == 0x11), "target changed");
    Ok(())
}

/// Posts `wr` on `a`, expects `status`, and checks that the QP went to error.
fn expect_remote_error(p: &crate::fixture::Pair, wr: SendWr<'_>, status: WcStatus) -> Result<(), Failed> {
    p.a.post_send(wr.wr_id(0xe))?;
    let wc = wait(&p.cq_a)?;
    check_eq!((wc.wr_id, wc.status), (0xe, status));
    check_eq!(p.a.state(), QpState::Error);
    Ok(())
}

fn write_out_of_bounds(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    let dst = p.pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
    src.fill(0xaa)?;
    dst.fill(0x55)?;
    let r = dst.remote();
    check!(r.slice(60, 8).is_err(), "descriptor allowed an out-of-range slice");
    // A raw target past the end: only the remote NIC can refuse it.
    expect_remote_error(
        &p,
        SendWr::write(src.slice(0, 8)?, RemoteSlice::new(r.addr + 60, 8, r.rkey)),
        WcStatus::REM_ACCESS_ERR,
    )?;
    check!(dst.to_vec()?.iter().all(|&b| b == 0x55), "target memory changed");
    Ok(())
}

fn read_out_of_bounds(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let local = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    let dst = p.pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
    local.fill(0x33)?;
    let r = dst.remote();
    expect_remote_error(
        &p,
        SendWr::read(local.slice(0, 16)?, RemoteSlice::new(r.addr - 8, 16, r.rkey)),
        WcStatus::REM_ACCESS_ERR,
    )?;
    check!(local.to_vec()?.iter().all(|&b| b == 0x33), "local memory changed");
    Ok(())
}

fn wrong_rkey(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    let dst = p.pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
    let r = dst.remote();
    expect_remote_error(
        &p,
        SendWr::write(src.slice(0, 8)?, RemoteSlice::new(r.addr, 8, r.rkey ^ 0x5a5a_0000)),
        WcStatus::REM_ACCESS_ERR,
    )?;
    check!(dst.to_vec()?.iter().all(|&b| b == 0), "target memory changed");
    Ok(())
}

fn missing_access_flags(env: &Env) -> Result<(), Failed> {
    type Make = fn(&MemoryRegion, &MemoryRegion) -> Result<SendWr<'static>, Error>;
    let cases: [(&str, AccessFlags, Make); 3] = [
        (
            "write",
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
            |l, t| Ok(SendWr::write(l.slice(0, 8)?, t.remote().slice(0, 8)?)),
        ),
        (
            "read",
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC,
            |l, t| Ok(SendWr::read(l.slice(0, 8)?, t.remote().slice(0, 8)?)),
        ),
        (
            "atomic",
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            |l, t| Ok(SendWr::fetch_add(l.slice(0, 8)?, t.remote().slice(0, 8)?, 1)),
        ),
    ];
    for (what, access, make) in cases {
        let p = env.pair()?;
        let local = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
        local.fill(0x77)?;
        let target = p.pd.alloc_mr(64, access)?;
        target.fill(0x99)?;
        expect_remote_error(&p, make(&local, &target)?, WcStatus::REM_ACCESS_ERR)
            .map_err(|e| format!("{what}: {}", e.message().unwrap_or("")))?;
        check!(target.to_vec()?.iter().all(|&b| b == 0x99), "{what}: target changed");
        check!(local.to_vec()?.iter().all(|&b| b == 0x77), "{what}: local changed");
    }
    Ok(())
}

fn deregistered_rkey(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    let gone = p.pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?.remote();
    // The region was dropped: its rkey is stale.
    expect_remote_error(
        &p,
        SendWr::write(src.slice(0, 8)?, RemoteSlice::new(gone.addr, 8, gone.rkey)),
        WcStatus::REM_ACCESS_ERR,
    )
}

fn other_pd_key(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let other_pd = env.ctx.alloc_pd()?;
    let foreign = other_pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    // A remote key of another PD than the responder QP's.
    expect_remote_error(
        &p,
        SendWr::write(src.slice(0, 8)?, foreign.remote().slice(0, 8)?),
        WcStatus::REM_ACCESS_ERR,
    )?;
    check!(foreign.to_vec()?.iter().all(|&b| b == 0), "foreign region changed");
    // A local key of another PD than the QP's.
    let p = env.pair()?;
    let target = p.pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
    p.a.post_send(SendWr::write(foreign.slice(0, 8)?, target.remote().slice(0, 8)?).wr_id(9))?;
    // mlx5 and the soft NIC report LOC_PROT_ERR; rxe reports LOC_QP_OP_ERR.
    let wc = wait(&p.cq_a)?;
    check_eq!(wc.wr_id, 9);
    check!(
        wc.status == WcStatus::LOC_PROT_ERR
            || (env.provider == ProviderKind::Verbs && wc.status == WcStatus::LOC_QP_OP_ERR),
        "status {:?}",
        wc.status
    );
    check!(target.to_vec()?.iter().all(|&b| b == 0), "target changed");
    Ok(())
}

fn post_after_peer_destroyed(env: &Env) -> Result<(), Failed> {
    // Short transport timeout so the retry budget is small: 4.096 µs × 2^10 × 2 ≈ 8 ms.
    let opts = env.opts().with_timeout(10).with_retry_cnt(1);
    let p = env.pair_with(QpCaps::default(), 64, opts)?;
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    let dst = p.pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
    let target = dst.remote().slice(0, 8)?;
    let crate::fixture::Pair { a, b, cq_a, .. } = p;
    drop(b);
    a.post_send(SendWr::write(src.slice(0, 8)?, target).wr_id(1))?;
    a.post_send(SendWr::write(src.slice(0, 8)?, target).wr_id(2))?;
    let wc = wait(&cq_a)?;
    check_eq!((wc.wr_id, wc.status), (1, WcStatus::RETRY_EXC_ERR));
    let wc = wait(&cq_a)?;
    check_eq!((wc.wr_id, wc.status), (2, WcStatus::WR_FLUSH_ERR));
    check_eq!(a.state(), QpState::Error);
    check!(dst.to_vec()?.iter().all(|&b| b == 0), "memory of the destroyed peer's region changed");
    Ok(())
}

fn rnr_retry_exceeded(env: &Env) -> Result<(), Failed> {
    let opts = env.opts().with_rnr_retry(1).with_min_rnr_timer(1);
    let p = env.pair_with(QpCaps::default(), 64, opts)?;
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    p.a.post_send(SendWr::send(src.local()?).wr_id(4))?;
    let wc = wait(&p.cq_a)?;
    check_eq!((wc.wr_id, wc.status), (4, WcStatus::RNR_RETRY_EXC_ERR));
    Ok(())
}

fn post_states_and_flush(env: &Env) -> Result<(), Failed> {
    let pd = env.ctx.alloc_pd()?;
    let cq = env.ctx.create_cq(64)?;
    let qp = pd.create_qp(&cq, &cq, QpCaps::default())?;
    let buf = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    check_eq!(qp.state(), QpState::Reset);
    check!(qp.post_recv(RecvWr::new(buf.local()?)).is_err(), "receive posted in RESET");
    let wr = SendWr::write(buf.slice(0, 8)?, RemoteSlice::new(0x1000, 8, 1));
    check!(qp.post_send(wr.clone()).is_err(), "send posted in RESET");
    check_eq!(qp.outstanding(), (0, 0));
    qp.modify_to_init(&env.opts())?;
    check_eq!(qp.state(), QpState::Init);
    qp.post_recv(RecvWr::new(buf.local()?).wr_id(5))?;
    check!(qp.post_send(wr.clone()).is_err(), "send posted in INIT");
    // Error state: the posted receive and every new request flush.
    qp.modify_to_error()?;
    check_eq!(qp.state(), QpState::Error);
    let wc = wait(&cq)?;
    check_eq!((wc.wr_id, wc.status), (5, WcStatus::WR_FLUSH_ERR));
    qp.post_send(wr.wr_id(6).unsignaled())?;
    let wc = wait(&cq)?;
    check_eq!((wc.wr_id, wc.status), (6, WcStatus::WR_FLUSH_ERR));
    check_eq!(qp.outstanding(), (0, 0));
    Ok(())
}

fn unsignaled_retire(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    let dst = p.pd.alloc_mr(64 * 8, AccessFlags::ALL_REMOTE)?;
    src.fill(1)?;
    for i in 0..7u64 {
        p.a.post_send(SendWr::write(src.local()?, dst.remote().slice(i * 64, 64)?).unsignaled().wr_id(i))?;
    }
    p.a.post_send(SendWr::write(src.local()?, dst.remote().slice(7 * 64, 64)?).wr_id(7))?;
    let wc = wait_ok(&p.cq_a)?;
    check_eq!(wc.wr_id, 7);
    check!(p.cq_a.poll_one()?.is_none(), "an unsignaled request produced a completion");
    check_eq!(p.a.outstanding(), (0, 0));
    check!(dst.to_vec()?.iter().all(|&b| b == 1), "not every write landed");
    Ok(())
}

fn send_queue_full(env: &Env) -> Result<(), Failed> {
    let caps = QpCaps::default().with_max_send_wr(4);
    let p = env.pair_with(caps, 64, env.opts())?;
    let depth = p.a.caps().max_send_wr;
    let src = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    let dst = p.pd.alloc_mr(8, AccessFlags::ALL_REMOTE)?;
    let wr = SendWr::write(src.local()?, dst.remote().slice(0, 8)?);
    // depth - 1 unsignalled requests and a signalled one fill the queue...
    for i in 0..depth - 1 {
        p.a.post_send(wr.clone().unsignaled().wr_id(u64::from(i)))?;
    }
    p.a.post_send(wr.clone().wr_id(99))?;
    match p.a.post_send(wr.clone()) {
        Err(Error::QueueFull { queue: "send", depth: d }) if d == depth => {}
        other => return Err(format!("expected QueueFull, got {other:?}").into()),
    }
    check_eq!(p.a.outstanding(), (depth as usize, 0));
    // ...until the signalled completion is reaped, which retires all of them.
    check_eq!(wait_ok(&p.cq_a)?.wr_id, 99);
    check_eq!(p.a.outstanding(), (0, 0));
    p.a.post_send(wr.wr_id(100))?;
    check_eq!(wait_ok(&p.cq_a)?.wr_id, 100);
    Ok(())
}

fn cq_overrun(env: &Env) -> Result<(), Failed> {
    let caps = QpCaps::default().with_max_send_wr(256);
    let p = env.pair_with(caps, 8, env.opts())?;
    let cap = p.cq_a.capacity();
    check!(cap < 256, "provider rounded the CQ to {cap}");
    let src = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    let dst = p.pd.alloc_mr(8, AccessFlags::ALL_REMOTE)?;
    for i in 0..=u64::from(cap) {
        p.a.post_send(SendWr::write(src.local()?, dst.remote().slice(0, 8)?).wr_id(i))?;
    }
    // Give the NIC time to produce every completion, then poll: the loss must be reported
    // (at once on the soft NIC; after the surviving entries on verbs, via the async event).
    std::thread::sleep(Duration::from_millis(if env.provider == ProviderKind::Verbs { 500 } else { 10 }));
    let mut got = 0u32;
    for _ in 0..50 {
        match p.cq_a.poll_one() {
            Ok(Some(_)) => got += 1,
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(Error::CqOverrun { .. }) => return Ok(()),
            Err(e) => return Err(format!("unexpected error {e}").into()),
        }
        check!(got <= cap, "{got} completions on a CQ of {cap}");
    }
    Err(format!("{got} completions on a CQ of {cap}, and no overrun reported").into())
}

/// An overrun is sticky for its CQ, and for its CQ only: CQs created after it was dropped
/// (at the same address, very likely, since the allocator reuses it) start clean.
fn cq_overrun_flag_dies_with_its_cq(env: &Env) -> Result<(), Failed> {
    cq_overrun(env)?;
    for i in 0..32 {
        let cq = env.ctx.create_cq(8)?;
        // The verbs provider reads async events when a poll finds the queue empty, at most
        // once a millisecond: poll across that interval.
        for _ in 0..2 {
            match cq.poll_one() {
                Ok(None) => {}
                other => return Err(format!("new CQ #{i}: {other:?} instead of an empty queue").into()),
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    Ok(())
}

/// With no GID index given, a RoCE port's connections use a RoCE v2 entry (what perftest, UCX
/// and rdma_cm users expect), preferring an IPv4-mapped one; the soft NIC reports its own kind.
fn default_gid_is_chosen_by_type(env: &Env) -> Result<(), Failed> {
    let chosen = env.ctx.gid(1, None)?;
    if env.provider == ProviderKind::Soft {
        check_eq!(chosen.kind, Some(GidKind::Soft));
        return Ok(());
    }
    if std::env::var_os("RDMAKIT_GID_INDEX").is_some() {
        return Err("RDMAKIT_GID_INDEX is set: the default choice cannot be observed".into());
    }
    // Read the table through explicit indices to know what the choice should have been.
    let mut entries = Vec::new();
    for i in 0..=255u8 {
        match env.ctx.gid(1, Some(i)) {
            Ok(e) if e.gid != [0; 16] => entries.push(e),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    let mapped = |e: &GidEntry| e.gid[..10] == [0; 10] && e.gid[10..12] == [0xff, 0xff];
    let best = entries
        .iter()
        .find(|e| e.kind == Some(GidKind::RoceV2) && mapped(e))
        .or_else(|| entries.iter().find(|e| e.kind == Some(GidKind::RoceV2)));
    match best {
        Some(best) => check_eq!((chosen.index, chosen.kind), (best.index, best.kind)),
        // InfiniBand (or a kernel without GID types): index 0 or the first IPv4-mapped entry.
        None => check!(
            chosen.index == 0 || entries.iter().any(|e| e.index == chosen.index && mapped(e)),
            "chose GID {} of {entries:?}",
            chosen.index
        ),
    }
    Ok(())
}

/// Service level, traffic class, flow label, hop limit and P_Key index reach the QP (a write
/// still lands with them set), and values the headers cannot carry are refused up front.
fn connect_options_path_fields(env: &Env) -> Result<(), Failed> {
    let opts = env
        .opts()
        .with_service_level(1)
        .with_traffic_class(32)
        .with_flow_label(0x1_2345)
        .with_hop_limit(8)
        .with_pkey_index(0);
    let p = env.pair_with(QpCaps::default(), 16, opts)?;
    let src = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    let dst = p.pd.alloc_mr(8, AccessFlags::ALL_REMOTE)?;
    src.write_u64(0, 0x5eed)?;
    p.a.post_send(SendWr::write(src.local()?, dst.remote().slice(0, 8)?).wr_id(1))?;
    check_eq!(wait_ok(&p.cq_a)?.wr_id, 1);
    check_eq!(dst.read_u64(0)?, 0x5eed);
    for bad in [env.opts().with_service_level(16), env.opts().with_flow_label(1 << 20)] {
        let pd = env.ctx.alloc_pd()?;
        let cq = env.ctx.create_cq(4)?;
        let qp = pd.create_qp(&cq, &cq, QpCaps::default())?;
        let peer = qp.address_with(&env.opts())?;
        match qp.connect(&peer, &bad) {
            Err(Error::InvalidArgument(_)) => {}
            other => return Err(format!("{bad:?}: {other:?} instead of InvalidArgument").into()),
        }
        check_eq!(qp.state(), QpState::Reset);
    }
    Ok(())
}

fn inline_write(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let dst = p.pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
    let max = p.a.caps().max_inline_data;
    check!(max >= 16, "max_inline_data {max}");
    let mut data = *b"inline payload!!";
    p.a.post_send(SendWr::write_inline(&data, dst.remote().slice(8, 16)?).wr_id(3))?;
    data.fill(0); // reusable at once: copied at post time
    check_eq!(wait_ok(&p.cq_a)?.wr_id, 3);
    let got = dst.to_vec()?;
    check!(&got[8..24] == b"inline payload!!", "inline data differs");
    let too_long = vec![0u8; max as usize + 1];
    check!(
        p.a.post_send(SendWr::write_inline(&too_long, dst.remote().slice(0, 1)?)).is_err(),
        "over-long inline accepted"
    );
    Ok(())
}

fn batch_post_order(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let src = p.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE)?;
    let dst = p.pd.alloc_mr(8, AccessFlags::ALL_REMOTE)?;
    let res = p.pd.alloc_mr(8 * 16, AccessFlags::LOCAL_WRITE)?;
    src.write_u64(0, 100)?;
    // write 100, then 10 fetch-adds of 1: RC ordering means each sees the previous.
    let t = dst.remote().slice(0, 8)?;
    let mut wrs = vec![SendWr::write(src.slice(0, 8)?, t).wr_id(0)];
    for i in 1..=10u64 {
        wrs.push(SendWr::fetch_add(res.slice(i * 8, 8)?, t, 1).wr_id(i));
    }
    p.a.post_send_batch(wrs)?;
    for i in 0..=10u64 {
        let wc = wait_ok(&p.cq_a)?;
        check_eq!(wc.wr_id, i);
    }
    for i in 1..=10u64 {
        check_eq!(res.read_u64(i * 8)?, 100 + i - 1);
    }
    check_eq!(dst.read_u64(0)?, 110);
    Ok(())
}

/// `post_send_array`: a data write and an inline flag write after it, in order, one
/// completion for both; a bad request anywhere, or a queue without room for all, posts none.
fn array_post(env: &Env) -> Result<(), Failed> {
    let caps = QpCaps::default().with_max_send_wr(4).with_max_inline_data(16);
    let p = env.pair_with(caps, 64, env.opts())?;
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    let dst = p.pd.alloc_mr(72, AccessFlags::ALL_REMOTE)?;
    src.fill(9)?;
    let flag = 7u64.to_le_bytes();
    let data = || -> Result<SendWr<'static>, Failed> {
        Ok(SendWr::write(src.local()?, dst.remote().slice(0, 64)?).unsignaled().wr_id(1))
    };
    p.a.post_send_array([data()?, SendWr::write_inline(&flag, dst.remote().slice(64, 8)?).wr_id(2)])?;
    check_eq!(wait_ok(&p.cq_a)?.wr_id, 2);
    check!(p.cq_a.poll_one()?.is_none(), "the unsignalled data write produced a completion");
    check_eq!(p.a.outstanding(), (0, 0));
    check_eq!(dst.read_u64(64)?, 7);
    check!(dst.to_vec()?[..64].iter().all(|&b| b == 9), "the data write did not land");

    // The second request cannot be valid: nothing is posted, the first included.
    let too_long = vec![0u8; p.a.caps().max_inline_data as usize + 1];
    match p.a.post_send_array([data()?, SendWr::write_inline(&too_long, dst.remote().slice(0, 1)?)]) {
        Err(Error::InvalidArgument(_)) => {}
        other => return Err(format!("expected InvalidArgument, got {other:?}").into()),
    }
    check_eq!(p.a.outstanding(), (0, 0));

    // Room for one of two: neither is posted.
    let depth = p.a.caps().max_send_wr;
    for i in 0..depth - 1 {
        p.a.post_send(data()?.wr_id(10 + u64::from(i)))?;
    }
    match p.a.post_send_array([data()?, data()?]) {
        Err(Error::QueueFull { queue: "send", .. }) => {}
        other => return Err(format!("expected QueueFull, got {other:?}").into()),
    }
    check_eq!(p.a.outstanding(), (depth as usize - 1, 0));
    p.a.post_send(data()?.signaled(true).wr_id(99))?;
    check_eq!(wait_ok(&p.cq_a)?.wr_id, 99);
    check_eq!(p.a.outstanding(), (0, 0));
    Ok(())
}

/// Requests prepared once and posted many times: writes, inline writes with a new payload
/// per post, fetch-and-add, sends with immediate into prepared receives; each post's
/// in-flight slot holds the region even after the prepared request is dropped; what `post_send` refuses, preparing
/// refuses.
fn prepared_requests(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    let dst = p.pd.alloc_mr(256, AccessFlags::ALL_REMOTE)?;
    let res = p.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE)?;
    src.fill(5)?;

    // Unsignalled posts of a prepared write: each slot holds `src` until a signalled
    // completion retires it, even with the prepared request gone.
    let quiet =
        p.a.prepare_send(SendWr::write(src.slice(0, 32)?, dst.remote().slice(0, 32)?).unsignaled())?;
    check_eq!(quiet.len(), 32);
    for _ in 0..3 {
        quiet.post()?;
    }
    drop(quiet);
    check_eq!(p.a.outstanding(), (3, 0));
    let src = still_held(src, "a region was released while posted requests referenced it")?;
    let mut loud =
        p.a.prepare_send(SendWr::write(src.slice(32, 32)?, dst.remote().slice(32, 32)?).wr_id(10))?;
    loud.post()?;
    check_eq!(wait_ok(&p.cq_a)?.wr_id, 10);
    loud.set_wr_id(11);
    loud.post()?;
    check_eq!(wait_ok(&p.cq_a)?.wr_id, 11);
    check_eq!(p.a.outstanding(), (0, 0));
    drop(loud);
    check!(src.is_unique(), "the region is still held after every completion was reaped");
    check!(dst.to_vec()?[..64].iter().all(|&b| b == 5), "a prepared write did not land");

    // Inline: the prepared bytes, then a new payload per post; lengths are checked.
    let ping = p.a.prepare_send(SendWr::write_inline(&[1; 8], dst.remote().slice(64, 8)?).wr_id(20))?;
    ping.post()?;
    check_eq!(wait_ok(&p.cq_a)?.wr_id, 20);
    check_eq!(dst.read_u64(64)?, u64::from_ne_bytes([1; 8]));
    for round in 1..=3u64 {
        ping.post_inline(&round.to_le_bytes())?;
        check_eq!(wait_ok(&p.cq_a)?.wr_id, 20);
        check!(dst.to_vec()?[64..72] == round.to_le_bytes(), "round {round}'s payload did not land");
    }
    check!(
        matches!(ping.post_inline(&[0; 7]), Err(Error::InvalidArgument(_))),
        "a short inline payload posted"
    );
    let plain = p.a.prepare_send(SendWr::write(src.slice(0, 8)?, dst.remote().slice(72, 8)?))?;
    check!(
        matches!(plain.post_inline(&[0; 8]), Err(Error::InvalidArgument(_))),
        "post_inline on a gathered write"
    );
    check_eq!(p.a.outstanding(), (0, 0));

    // Fetch-and-add: every post adds, and the original lands locally.
    let counter = dst.remote().slice(80, 8)?;
    let add = p.a.prepare_send(SendWr::fetch_add(res.slice(0, 8)?, counter, 3).wr_id(30))?;
    for i in 0..4u64 {
        add.post()?;
        check_eq!(wait_ok(&p.cq_a)?.wr_id, 30);
        check_eq!(res.read_u64(0)?, 3 * i);
    }
    check_eq!(dst.read_u64(80)?, 12);

    // A send with immediate: the receiver sees the prepared bytes and the immediate.
    let rbuf = p.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE)?;
    let hello = p.a.prepare_send(SendWr::send_inline(b"prepared").with_imm(0xfeed).wr_id(40))?;
    let recv = p.b.prepare_recv(RecvWr::new(rbuf.local()?).wr_id(41))?;
    for _ in 0..2 {
        recv.post()?;
        hello.post()?;
        check_eq!(wait_ok(&p.cq_a)?.wr_id, 40);
        let wc = wait_ok(&p.cq_b)?;
        check_eq!((wc.wr_id, wc.imm, wc.byte_len), (41, Some(0xfeed), 8));
        check!(&rbuf.to_vec()?[..8] == b"prepared", "the prepared send's bytes differ");
        rbuf.fill(0)?;
    }
    // A posted prepared receive holds its region with the prepared receive gone.
    recv.post()?;
    drop(recv);
    check_eq!(p.b.outstanding(), (0, 1));
    let rbuf = still_held(rbuf, "a region was released while a posted receive referenced it")?;
    hello.post()?;
    check_eq!(wait_ok(&p.cq_a)?.wr_id, 40);
    check_eq!(wait_ok(&p.cq_b)?.wr_id, 41);
    check!(&rbuf.to_vec()?[..8] == b"prepared", "the last receive's bytes differ");
    check!(rbuf.is_unique(), "the receive buffer is still held after its completion was reaped");

    // What post_send refuses, preparing refuses.
    let max = p.a.caps().max_inline_data as usize;
    let too_long = vec![0u8; max + 1];
    let big = p.pd.alloc_mr(max + 1, AccessFlags::ALL_REMOTE)?;
    check!(
        p.a.prepare_send(SendWr::write_inline(&too_long, big.remote().slice(0, max as u32 + 1)?)).is_err(),
        "an over-long inline request was prepared"
    );
    check!(
        p.a.prepare_send(SendWr::write(src.slice(0, 8)?, dst.remote().slice(0, 16)?)).is_err(),
        "a write with mismatched lengths was prepared"
    );
    Ok(())
}

fn async_wait(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let src = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    let rbuf = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    rt.block_on(async {
        // The receiver waits first; the send comes from another task a little later.
        p.b.post_recv(RecvWr::new(rbuf.local()?).wr_id(8))?;
        let a = p.a.clone();
        let src = src.clone();
        let sender = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            src.write_u64(0, 0x5eed)?;
            a.post_send(SendWr::send(src.local()?).wr_id(1))
        });
        let wc =
            tokio::time::timeout(Duration::from_secs(20), p.cq_b.next()).await.map_err(|_| "timed out")??;
        check_eq!((wc.wr_id, wc.status), (8, WcStatus::SUCCESS));
        sender.await.map_err(|e| e.to_string())??;
        let wc =
            tokio::time::timeout(Duration::from_secs(20), p.cq_a.next()).await.map_err(|_| "timed out")??;
        check_eq!(wc.wr_id, 1);
        check_eq!(rbuf.read_u64(0)?, 0x5eed);
        Ok::<(), Failed>(())
    })
}

fn dropped_qp_releases_buffers(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let rbuf = p.pd.register(vec![7u8; 64], AccessFlags::LOCAL_WRITE)?;
    p.b.post_recv(RecvWr::new(rbuf.local()?).wr_id(1))?;
    // The posted receive holds the region.
    let rbuf = still_held(rbuf, "a region was released while a posted receive referenced it")?;
    check_eq!(p.b.outstanding(), (0, 1));
    drop(p.b);
    let v = rbuf.try_into_vec().map_err(|_| "region still held after its QP was destroyed")?;
    check!(v == vec![7u8; 64], "receive buffer changed");
    Ok(())
}

fn dm_capacity(env: &Env) -> Result<(), Failed> {
    let max = env.ctx.attr().max_dm_size;
    match env.ctx.alloc_dm(max + 1) {
        Err(Error::DeviceMemoryExhausted { requested, .. }) => check_eq!(requested, max + 1),
        other => return Err(format!("alloc past capacity gave {other:?}").into()),
    }
    // Fill the device with 4 KiB blocks until it refuses, then free one and retry.
    let mut blocks = Vec::new();
    loop {
        match env.ctx.alloc_dm(4096) {
            Ok(dm) => blocks.push(dm),
            Err(Error::DeviceMemoryExhausted { .. }) => break,
            Err(e) => return Err(format!("unexpected {e}").into()),
        }
        check!(blocks.len() as u64 <= max / 4096, "more blocks than capacity");
    }
    check!(!blocks.is_empty(), "no block fit");
    blocks.pop();
    let again = env.ctx.alloc_dm(4096)?;
    drop((again, blocks));
    env.ctx.alloc_dm(max.min(64 * 1024))?;
    Ok(())
}

fn dm_round_trip(env: &Env) -> Result<(), Failed> {
    let p = env.pair()?;
    let dm = env.ctx.alloc_dm(4096)?;
    let data = pattern(4096, 5);
    dm.copy_to(0, &data)?;
    let mut back = vec![0; 4096];
    dm.copy_from(0, &mut back)?;
    check!(back == data, "DM copy round trip differs");
    check!(dm.copy_to(4090, &[0; 8]).is_err(), "DM copy past the end accepted");
    // Zero-based region on the DM: peers address it from 0.
    let mr = p.pd.register_dm(&dm, 0, 4096, AccessFlags::ALL_REMOTE)?;
    check_eq!(mr.addr(), 0);
    check!(mr.is_device_memory(), "not device memory");
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    src.write_at(0, b"to the NIC")?;
    p.a.post_send(SendWr::write(src.slice(0, 10)?, mr.remote().slice(100, 10)?))?;
    wait_ok(&p.cq_a)?;
    let mut got = [0u8; 10];
    dm.copy_from(100, &mut got)?;
    check!(&got == b"to the NIC", "remote write into DM differs");
    // A counter in DM: fetch-and-add.
    mr.write_u64(512, 9)?;
    let res = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    p.a.post_send(SendWr::fetch_add(res.local()?, mr.remote().slice(512, 8)?, 1))?;
    wait_ok(&p.cq_a)?;
    check_eq!((res.read_u64(0)?, mr.read_u64(512)?), (9, 10));
    Ok(())
}

fn cm_round_trip(env: &Env) -> Result<(), Failed> {
    use rdmakit::cm;
    let ip = crate::fixture::cm_ip(env.provider).ok_or("no address")?;
    let listener = cm::Listener::bind(&env.ctx, std::net::SocketAddr::new(ip, 0))?;
    let addr = listener.local_addr()?;
    let pd = env.ctx.alloc_pd()?;
    let opts = cm::CmOptions::default().with_connect(env.opts());
    let target = pd.alloc_mr(4096, AccessFlags::ALL_REMOTE)?;
    let server = std::thread::spawn({
        let (pd, target) = (pd.clone(), target.clone());
        move || -> Result<Vec<u8>, String> {
            let conn = listener
                .accept_timeout(&pd, &opts, &target.remote().encode(), Some(Duration::from_secs(20)))
                .map_err(|e| e.to_string())?;
            let request_data = conn.peer_private_data().to_vec();
            // Wait for the client's write, then its disconnect.
            if !conn.wait_disconnected(Duration::from_secs(20)).map_err(|e| e.to_string())? {
                return Err("no disconnect seen".into());
            }
            Ok(request_data)
        }
    });
    // The active side sets a traffic class (rdma_cm's TOS option and the QP's GRH) and a hop
    // limit: the connection and its write must work with them.
    let client_opts = opts.with_connect(env.opts().with_traffic_class(32).with_hop_limit(16));
    let conn = cm::connect(&pd, addr, &client_opts, b"client-hello")?;
    let region = RemoteRegion::decode(&conn.peer_private_data()[..RemoteRegion::ENCODED_LEN])?;
    check_eq!(region, target.remote());
    let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    src.write_at(0, b"written through an rdma_cm connection")?;
    conn.qp().post_send(SendWr::write(src.slice(0, 37)?, region.slice(100, 37)?).wr_id(1))?;
    check_eq!(wait_ok(conn.cq())?.wr_id, 1);
    let mut got = [0u8; 37];
    target.read_at(100, &mut got)?;
    check!(&got == b"written through an rdma_cm connection", "data differs");
    conn.disconnect()?;
    check_eq!(conn.qp().state(), QpState::Error);
    let request_data = server.join().map_err(|_| "server panicked")??;
    // Verbs pads private data with zeros to the CM field size; soft delivers it exactly.
    check!(request_data.starts_with(b"client-hello"), "request data {request_data:?}");
    check!(request_data[12..].iter().all(|&b| b == 0), "padding not zero");
    Ok(())
}

fn cm_refused_and_limits(env: &Env) -> Result<(), Failed> {
    use rdmakit::cm;
    let ip = crate::fixture::cm_ip(env.provider).ok_or("no address")?;
    let pd = env.ctx.alloc_pd()?;
    let opts = cm::CmOptions::default().with_connect(env.opts()).with_timeout(Duration::from_secs(5));
    // Nothing listens on this port (bound then dropped).
    let port = {
        let l = cm::Listener::bind(&env.ctx, std::net::SocketAddr::new(ip, 0))?;
        l.local_addr()?.port()
    };
    let start = std::time::Instant::now();
    match cm::connect(&pd, std::net::SocketAddr::new(ip, port), &opts, &[]) {
        Err(Error::ConnectionRejected { .. }) => {}
        other => return Err(format!("connect to a closed port gave {other:?}").into()),
    }
    check!(start.elapsed() < Duration::from_secs(5), "refusal took {:?}", start.elapsed());
    match cm::connect(&pd, std::net::SocketAddr::new(ip, port), &opts, &[0u8; 57]) {
        Err(Error::InvalidArgument(_)) => {}
        other => return Err(format!("57 bytes of private data gave {other:?}").into()),
    }
    let l = cm::Listener::bind(&env.ctx, std::net::SocketAddr::new(ip, 0))?;
    match l.accept_timeout(&pd, &opts, &[], Some(Duration::from_millis(200))) {
        Err(Error::Timeout(_)) => {}
        other => return Err(format!("accept with no request gave {other:?}").into()),
    }
    Ok(())
}

/// `accept_with`: receives posted in its hook are in place before the requester can send.
/// The hook takes its time before posting, and the requester sends at once without RNR
/// retries: a send that arrived before the receives would fail with RNR_RETRY_EXC_ERR. A
/// failing hook refuses the request and returns its error.
fn cm_receives_posted_before_the_answer(env: &Env) -> Result<(), Failed> {
    use rdmakit::cm;
    const N: u64 = 4;
    let ip = crate::fixture::cm_ip(env.provider).ok_or("no address")?;
    let listener = cm::Listener::bind(&env.ctx, std::net::SocketAddr::new(ip, 0))?;
    let addr = listener.local_addr()?;
    let pd = env.ctx.alloc_pd()?;
    let opts = cm::CmOptions::default().with_connect(env.opts());
    let inbox = pd.alloc_mr(16 * N as usize, AccessFlags::LOCAL_WRITE)?;
    let server = std::thread::spawn({
        let (pd, inbox) = (pd.clone(), inbox.clone());
        move || -> Result<(), String> {
            let conn = listener
                .accept_with(&pd, &opts, &[], Some(Duration::from_secs(20)), |qp, peer| {
                    if !peer.starts_with(b"early") {
                        return Err(Error::InvalidArgument(format!("request data {peer:?}")));
                    }
                    std::thread::sleep(Duration::from_millis(300));
                    for i in 0..N {
                        qp.post_recv(RecvWr::new(inbox.slice(i * 16, 16)?).wr_id(i))?;
                    }
                    Ok(())
                })
                .map_err(|e| e.to_string())?;
            for i in 0..N {
                let wc = wait_ok(conn.cq()).map_err(|e| format!("receive {i}: {e:?}"))?;
                if wc.wr_id != i || wc.byte_len != 5 {
                    return Err(format!("receive {i}: {wc:?}"));
                }
            }
            conn.wait_disconnected(Duration::from_secs(20)).map_err(|e| e.to_string())?;
            Ok(())
        }
    });
    let client_opts = opts.with_connect(env.opts().with_rnr_retry(0));
    let conn = cm::connect(&pd, addr, &client_opts, b"early")?;
    for i in 0..N {
        conn.qp().post_send(SendWr::send_inline(b"hello").wr_id(i))?;
    }
    for i in 0..N {
        check_eq!(wait_ok(conn.cq())?.wr_id, i);
    }
    conn.disconnect()?;
    server.join().map_err(|_| "server panicked")??;
    let mut got = [0u8; 5];
    inbox.read_at(16 * (N - 1), &mut got)?;
    check!(&got == b"hello", "received {got:?}");

    // A hook that fails: the request is refused, and accept returns the hook's error.
    let listener = cm::Listener::bind(&env.ctx, std::net::SocketAddr::new(ip, 0))?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn({
        let pd = pd.clone();
        move || {
            listener
                .accept_with(&pd, &opts, &[], Some(Duration::from_secs(20)), |_, _| {
                    Err(Error::InvalidArgument("not today".into()))
                })
                .map(drop)
        }
    });
    let refused = cm::connect(&pd, addr, &opts.with_timeout(Duration::from_secs(10)), b"late");
    check!(refused.is_err(), "a request whose hook failed was accepted");
    match server.join().map_err(|_| "server panicked")? {
        Err(Error::InvalidArgument(why)) if why == "not today" => {}
        other => return Err(format!("accept with a failing hook gave {other:?}").into()),
    }
    Ok(())
}

/// `mr` back if something (a clone, a posted request's in-flight slot) still holds it, so
/// that `try_into_vec` refuses; the test fails with `why` if the region was released.
fn still_held(mr: MemoryRegion, why: &str) -> Result<MemoryRegion, Failed> {
    match mr.try_into_vec() {
        Ok(_) => Err(why.into()),
        Err(mr) => Ok(mr),
    }
}
