//! Conformance cases for the channel crate: a pipe in both notification modes and a put
//! handle, over the same connected QPs on the soft NIC and on rdma-core.

use libtest_mimic::Failed;
use rdmakit::channel::put::PutEndpoint;
use rdmakit::channel::{ChannelError, NotifyMode, Pipe, PipeConfig, PollMode};
use rdmakit::*;

use crate::check_eq;
use crate::fixture::{Case, case};
use crate::fixture::{Env, WAIT};

/// The channel cases, run on both providers by `main`.
pub const CASES: &[Case] = &[
    case("pipe_write_imm_round_trips", pipe_write_imm),
    case("pipe_flag_round_trips", pipe_flag),
    case("put_handle_round_trips", put_handle),
    case("pipe_blocked_write_fails_when_the_reader_is_dropped", pipe_liveness),
    case("pipe_ring_grows_under_each_policy", pipe_growth),
];

/// Each allocation policy over a reader's ring that starts at 8 KiB and may grow to
/// 32 KiB: the reader holds four 6 KiB messages (more than the first segment holds), so the
/// writer's requests grow the ring; every message arrives intact.
fn pipe_growth(env: &Env) -> Result<(), Failed> {
    use rdmakit::memory::heap::AllocPolicy;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    for policy in AllocPolicy::ALL {
        let p = env.pair_with(caps(), 1024, env.opts())?;
        let reader = PipeConfig::default().with_ring_len(8 << 10).with_max_ring_len(32 << 10);
        let writer = PipeConfig::default().with_ring_len(0).with_policy(policy);
        rt.block_on(async {
            let (a, b) =
                tokio::try_join!(Pipe::connect(p.a, p.cq_a, writer), Pipe::connect(p.b, p.cq_b, reader))?;
            let b2 = b.clone();
            let held = tokio::spawn(async move {
                let mut held = Vec::new();
                for _ in 0..4 {
                    held.push(b2.recv_timeout(WAIT).await?);
                }
                Ok::<_, ChannelError>(held)
            });
            let src = p.pd.alloc_mr(6 << 10, AccessFlags::LOCAL_WRITE)?;
            for i in 0..4u8 {
                src.fill(i + 1)?;
                tokio::time::timeout(WAIT, a.rwrite(src.local()?)).await.map_err(|_| "rwrite timed out")?.0?;
            }
            let held = held.await.map_err(|e| e.to_string())??;
            for (i, g) in held.iter().enumerate() {
                check_eq!(g.to_vec()?, vec![i as u8 + 1; 6 << 10]);
            }
            if b.ring_segments() < 2 || b.ring_len() > 32 << 10 {
                return Err(format!(
                    "{policy:?}: ring {} bytes in {} segments",
                    b.ring_len(),
                    b.ring_segments()
                )
                .into());
            }
            check_eq!(a.peer_ring_len(), b.ring_len());
            Ok::<(), Failed>(())
        })?;
    }
    Ok(())
}

/// Liveness bound of the default connection options: the keep-alive interval plus the
/// transport budget (4.096 µs × 2^14 × 7 tries, about 0.47 s), with a wide margin for a
/// loaded machine or VM.
const LIVENESS_BOUND: std::time::Duration = std::time::Duration::from_secs(10);

/// A writer blocked on credits (nothing in flight) whose reader's QP is destroyed: its
/// keep-alive goes unanswered and the blocked `rwrite` fails with a broken connection
/// within the bound, on either provider.
fn pipe_liveness(env: &Env) -> Result<(), Failed> {
    let p = env.pair_with(caps(), 1024, env.opts())?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let cfg = PipeConfig::default().with_ring_len(64 << 10).with_slots(4);
    rt.block_on(async {
        let (a, b) = tokio::try_join!(Pipe::connect(p.a, p.cq_a, cfg), Pipe::connect(p.b, p.cq_b, cfg))?;
        let src = p.pd.alloc_mr(1024, AccessFlags::LOCAL_WRITE)?;
        for _ in 0..4 {
            a.rwrite(src.local()?).await.0?;
        }
        let blocked =
            tokio::time::timeout(std::time::Duration::from_millis(100), a.rwrite(src.local()?)).await;
        if blocked.is_ok() {
            return Err("the fifth write should wait for credits".into());
        }
        drop(b); // the reader's QP is destroyed: nothing answers the writer any more
        let start = std::time::Instant::now();
        let r = tokio::time::timeout(LIVENESS_BOUND, a.rwrite(src.local()?)).await;
        match r {
            Err(_) => {
                Err(format!("rwrite still blocked {LIVENESS_BOUND:?} after the reader went away").into())
            }
            Ok((Ok(()), _)) => Err("rwrite succeeded with the reader gone".into()),
            Ok((Err(e), _)) if e.is_peer_gone() => {
                eprintln!(
                    "conformance: {} blocked rwrite failed after {:?}: {e}",
                    env.provider,
                    start.elapsed()
                );
                Ok(())
            }
            Ok((Err(e), _)) => Err(format!("expected a peer-gone error, got {e}").into()),
        }
    })
}

fn caps() -> QpCaps {
    QpCaps::default().with_max_send_wr(256).with_max_recv_wr(160).with_max_inline_data(64)
}

fn pipe_round_trips(env: &Env, notify: NotifyMode) -> Result<(), Failed> {
    let p = env.pair_with(caps(), 1024, env.opts())?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let cfg = PipeConfig::default().with_notify(notify).with_poll(PollMode::Event).with_ring_len(64 << 10);
    rt.block_on(async {
        let (a, b) = tokio::try_join!(Pipe::connect(p.a, p.cq_a, cfg), Pipe::connect(p.b, p.cq_b, cfg))?;
        let reader = tokio::spawn(async move {
            let mut lens = Vec::new();
            for i in 0..100usize {
                let g = b.recv_timeout(WAIT).await?;
                let v = g.to_vec()?;
                if v.iter().any(|&x| x != i as u8) {
                    return Err(ChannelError::Protocol(format!("message {i} corrupted")));
                }
                lens.push(v.len());
            }
            Ok::<_, ChannelError>(lens)
        });
        let src = p.pd.alloc_mr(20_000, AccessFlags::LOCAL_WRITE)?;
        let mut expect = Vec::new();
        for i in 0..100usize {
            let len = 1 + (i * 4099) % 20_000;
            src.write_at(0, &vec![i as u8; len])?;
            a.rwrite(src.slice(0, len as u32)?).await.0?;
            expect.push(len);
        }
        let lens = reader.await.map_err(|e| e.to_string())??;
        check_eq!(lens, expect);
        Ok(())
    })
}

fn pipe_write_imm(env: &Env) -> Result<(), Failed> {
    pipe_round_trips(env, NotifyMode::WriteImm)
}

fn pipe_flag(env: &Env) -> Result<(), Failed> {
    pipe_round_trips(env, NotifyMode::Flag)
}

fn put_handle(env: &Env) -> Result<(), Failed> {
    let p = env.pair_with(caps(), 1024, env.opts())?;
    let sender = PutEndpoint::new(p.a, p.cq_a, PollMode::Busy)?;
    let receiver = PutEndpoint::new(p.b, p.cq_b, PollMode::Busy)?;
    let rbuf = p.pd.alloc_mr(4096, AccessFlags::ALL_REMOTE)?;
    let sbuf = p.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let g2 = got.clone();
    let h =
        receiver.create_handle(&rbuf, move |b| g2.lock().unwrap().push(b.read_u64(4088).unwrap_or(0)), 7)?;
    let sh = sender.assoc_local_buffer(&h.desc()?, sbuf.local()?)?;
    for i in 0..20u64 {
        // The last word equals the sentinel on every other put: still detected.
        sbuf.write_u64(4088, if i % 2 == 0 { 7 } else { i })?;
        h.ready_poll_q()?;
        let start = std::time::Instant::now();
        loop {
            match sh.put() {
                Ok(()) => break,
                Err(ChannelError::Busy) if start.elapsed() < WAIT => sender.progress()?,
                Err(e) => return Err(e.into()),
            }
        }
        let start = std::time::Instant::now();
        while receiver.ready_poll()? == 0 {
            if start.elapsed() > WAIT {
                return Err(format!("put {i} not detected").into());
            }
        }
        h.ready()?;
    }
    let expect: Vec<u64> = (0..20).map(|i| if i % 2 == 0 { 7 } else { i }).collect();
    check_eq!(*got.lock().unwrap(), expect);
    Ok(())
}
