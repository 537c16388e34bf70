//! Pipes across two processes over the soft NIC's TCP transport and its connection
//! manager: this test binary re-runs itself as an echo peer (`pipe_echo_peer`, selected
//! by `RDMAKIT_PIPE_PEER=<mode>`). The peer listens, prints `LISTEN <addr>`, accepts one
//! connection, and sends every message it receives back; the tests check the echoes by
//! checksum in both notification modes, then kill the peer mid-pipe and expect errors,
//! not hangs.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use rdmakit_channel::*;
use rdmakit_verbs::cm::{CmOptions, Listener, connect};
use rdmakit_verbs::*;

mod common;
use common::cm_options;

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x1000_0000_01b3))
}

fn payload(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i.wrapping_mul(151) ^ j.wrapping_mul(13) ^ (j >> 8)) as u8).collect()
}

fn pipe_config(mode: &str) -> PipeConfig {
    let notify = if mode == "flag" { NotifyMode::Flag } else { NotifyMode::WriteImm };
    PipeConfig::default().with_notify(notify).with_ring_len(256 << 10)
}

const MAX: usize = 40_000;

/// The echo peer: a helper, not a test (reported as ignored); the tests below run it with
/// `--ignored` in the child process.
#[test]
#[ignore = "helper: runs only as the peer process of this file's tests"]
fn pipe_echo_peer() {
    let Ok(mode) = std::env::var("RDMAKIT_PIPE_PEER") else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async move {
        let ctx = Context::open_soft();
        let listener = Listener::bind(&ctx, "127.0.0.1:0".parse().unwrap()).unwrap();
        println!("LISTEN {}", listener.local_addr().unwrap());
        let pd = ctx.alloc_pd().unwrap();
        let conn = tokio::task::spawn_blocking({
            let pd = pd.clone();
            move || listener.accept(&pd, &cm_options(), b"").unwrap()
        })
        .await
        .unwrap();
        let pipe = Pipe::from_connection(conn, pipe_config(&mode)).await.unwrap();
        let src = pd.alloc_mr(MAX, AccessFlags::LOCAL_WRITE).unwrap();
        // Echo until the client goes away (then recv or rwrite fails, or times out).
        while let Ok(g) = pipe.recv_timeout(Duration::from_secs(30)).await {
            let data = g.to_vec().unwrap();
            g.release();
            src.write_at(0, &data).unwrap();
            if pipe.rwrite(src.slice(0, data.len() as u32).unwrap()).await.0.is_err() {
                break;
            }
        }
    });
}

/// The peer process; its stdout stays open (libtest in the child writes to it).
struct Peer(Child, #[allow(dead_code)] BufReader<ChildStdout>);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_peer(mode: &str) -> (Peer, SocketAddr) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "pipe_echo_peer", "--ignored", "--nocapture", "--test-threads=1"])
        .env("RDMAKIT_PIPE_PEER", mode)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the peer process");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    // libtest may print "test pipe_echo_peer ... " on the same line, before our output.
    let addr = loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the peer exited before listening");
        if let Some(at) = line.find("LISTEN ") {
            break line[at + 7..].trim().parse().unwrap();
        }
    };
    (Peer(child, out), addr)
}

/// A pipe end of `mode` connected to the peer process at `addr` with `opts`.
async fn client_pipe(pd: &ProtectionDomain, addr: SocketAddr, opts: CmOptions, mode: &str) -> Pipe {
    let conn = tokio::task::spawn_blocking({
        let pd = pd.clone();
        move || connect(&pd, addr, &opts, b"").unwrap()
    })
    .await
    .unwrap();
    Pipe::from_connection(conn, pipe_config(mode)).await.unwrap()
}

/// Takes `n` echoes from `pipe` in a task of its own: their lengths and checksums, in order.
fn read_echoes(pipe: &Pipe, n: usize) -> tokio::task::JoinHandle<Vec<(usize, u64)>> {
    let pipe = pipe.clone();
    tokio::spawn(async move {
        let mut sums = Vec::with_capacity(n);
        for _ in 0..n {
            let g = pipe.recv_timeout(Duration::from_secs(20)).await.expect("echo");
            sums.push((g.len(), checksum(&g.to_vec().unwrap())));
        }
        sums
    })
}

/// Echo `n` messages of many sizes through the peer process and check them, then kill the
/// peer and check that the pipe reports it.
async fn echo_then_kill(mode: &str, n: usize) {
    let (mut peer, addr) = spawn_peer(mode);
    let pd = Context::open_soft().alloc_pd().unwrap();
    let pipe = client_pipe(&pd, addr, cm_options(), mode).await;
    let reader = read_echoes(&pipe, n);
    let src = pd.alloc_mr(MAX, AccessFlags::LOCAL_WRITE).unwrap();
    let mut expect = Vec::with_capacity(n);
    for i in 0..n {
        let len = 1 + (i * 7919 + i * i) % MAX;
        let data = payload(i, len);
        src.write_at(0, &data).unwrap();
        let (r, _) = pipe.rwrite(src.slice(0, len as u32).unwrap()).await;
        r.expect("rwrite to the peer process");
        expect.push((len, checksum(&data)));
    }
    assert_eq!(reader.await.unwrap(), expect, "echoes differ from what was sent");

    // The peer dies mid-pipe: writes fail with a typed error within the transport's retry
    // budget, and a reader waiting for data gets its time-out; nothing hangs.
    peer.0.kill().unwrap();
    peer.0.wait().unwrap();
    let err = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if let (Err(e), _) = pipe.rwrite(src.slice(0, 64).unwrap()).await {
                return e;
            }
        }
    })
    .await
    .expect("a write to a dead peer must fail, not hang");
    assert!(matches!(err, ChannelError::Broken { .. }), "{err:?}");
    assert!(pipe.recv_timeout(Duration::from_millis(200)).await.is_err());
    // Once broken, it stays broken.
    let (r, _) = pipe.rwrite(src.slice(0, 8).unwrap()).await;
    assert!(matches!(r, Err(ChannelError::Broken { .. })), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_process_echo_write_imm_then_peer_dies() {
    echo_then_kill("imm", 300).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_process_echo_flag_then_peer_dies() {
    echo_then_kill("flag", 300).await;
}

/// A pipe whose QP's send queue is shallower than its notification slots (the
/// application chose the QP): more rwrites in flight than the queue holds must wait for
/// room, never break the pipe with a full send queue. Across processes, so completions
/// come late, from the peer's NIC, as on hardware.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_rwrites_in_flight_than_the_send_queue_holds() {
    many_rwrites_on_a_shallow_send_queue("imm").await;
    many_rwrites_on_a_shallow_send_queue("flag").await;
}

async fn many_rwrites_on_a_shallow_send_queue(mode: &str) {
    const WRITES: usize = 48;
    const LEN: usize = 4096; // above the inline limit: each waits for its completion
    let (_peer, addr) = spawn_peer(mode);
    let pd = Context::open_soft().alloc_pd().unwrap();
    let mut opts = cm_options();
    opts.caps.max_send_wr = 8;
    let pipe = client_pipe(&pd, addr, opts, mode).await;
    let reader = read_echoes(&pipe, WRITES);
    let srcs: Vec<_> = (0..WRITES)
        .map(|i| {
            let mr = pd.alloc_mr(LEN, AccessFlags::LOCAL_WRITE).unwrap();
            mr.write_at(0, &payload(i, LEN)).unwrap();
            mr
        })
        .collect();
    // Every rwrite in flight at once, each in a task of its own.
    let mut writes = tokio::task::JoinSet::new();
    for s in srcs {
        let pipe = pipe.clone();
        writes.spawn(async move { pipe.rwrite(s.local().unwrap()).await.0 });
    }
    while let Some(r) = writes.join_next().await {
        r.unwrap().unwrap_or_else(|e| panic!("{mode}: rwrite: {e}"));
    }
    let mut expect: Vec<_> = (0..WRITES).map(|i| (LEN, checksum(&payload(i, LEN)))).collect();
    expect.sort_unstable();
    let mut echoes = reader.await.unwrap();
    echoes.sort_unstable(); // the writes were in flight together: echoed in any order
    assert_eq!(echoes, expect, "echoes differ from what was sent");
}
