//! Peer liveness across processes over the soft NIC's TCP transport: an operation blocked
//! with nothing in flight must fail with a typed peer-gone error within a bound after the
//! peer process is killed with SIGKILL (it gets no chance to say goodbye).
//!
//! This test binary re-runs itself as the peer (`liveness_peer`, selected by
//! `RDMAKIT_LIVENESS_PEER=<mode>`): it listens, prints `LISTEN <addr>`, accepts one
//! connection, sets up its end (a pipe, a put endpoint or a heap endpoint), prints
//! `READY`, and then does nothing at all, so that the test's operation blocks; the test
//! kills it and times how long the blocked operation takes to fail.
//!
//! Across two network namespaces: run the binary in one with `RDMAKIT_SOFT_ADDR` on its
//! address, and set `RDMAKIT_TEST_PEER_WRAP="ip netns exec <other> env RDMAKIT_SOFT_ADDR=<ip>:0
//! RDMAKIT_LIVENESS_LISTEN=<ip>:0"` so that the peer runs, listens and serves in the other.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use rdmakit_channel::heap::{HeapEndpoint, OwnerLimits};
use rdmakit_channel::put::{HandleDesc, PutEndpoint};
use rdmakit_channel::*;
use rdmakit_memory::heap::{AllocPolicy, HeapConfig, HeapId, SyncMode};
use rdmakit_verbs::cm::{Listener, connect};
use rdmakit_verbs::*;

mod common;
use common::cm_options;

/// Transport budget: 4.096 µs × 2^16 per try, 4 tries (about 1.07 s); the keep-alive
/// interval adds 0.1 s. The bound leaves a wide margin for a loaded machine.
const BOUND: Duration = Duration::from_secs(15);

fn pipe_config() -> PipeConfig {
    PipeConfig::default().with_ring_len(64 << 10).with_slots(4)
}

const HEAP: HeapId = HeapId(1);

/// The idle peer: a helper, not a test (reported as ignored); the tests below run it with
/// `--ignored` in the child process.
#[test]
#[ignore = "helper: runs only as the peer process of this file's tests"]
fn liveness_peer() {
    let Ok(mode) = std::env::var("RDMAKIT_LIVENESS_PEER") else {
        return;
    };
    let ctx = Context::open_soft();
    // `RDMAKIT_LIVENESS_LISTEN`: the peer's listening address (another network namespace's).
    let at = std::env::var("RDMAKIT_LIVENESS_LISTEN").unwrap_or_else(|_| "127.0.0.1:0".into());
    let listener = Listener::bind(&ctx, at.parse().unwrap()).unwrap();
    println!("LISTEN {}", listener.local_addr().unwrap());
    let pd = ctx.alloc_pd().unwrap();
    let conn = listener.accept(&pd, &cm_options(), b"").unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // Everything the peer sets up stays alive (and idle) until it is killed.
    let mut keep: Vec<Box<dyn std::any::Any>> = Vec::new();
    match mode.as_str() {
        "pipe" => keep.push(Box::new(rt.block_on(Pipe::from_connection(conn, pipe_config())).unwrap())),
        "put-receiver" => {
            let ep = PutEndpoint::new(conn.qp().clone(), conn.cq().clone(), PollMode::Busy).unwrap();
            let buf = pd.alloc_mr(256, AccessFlags::ALL_REMOTE).unwrap();
            let h = ep.create_handle(&buf, |_| {}, 0).unwrap();
            let hex: String = h.desc().unwrap().encode().iter().map(|b| format!("{b:02x}")).collect();
            println!("DESC {hex}");
            // Let the association arrive, then stop polling: `ready` is never called.
            let start = Instant::now();
            while start.elapsed() < Duration::from_millis(500) {
                ep.progress().unwrap();
            }
            keep.extend([Box::new(h) as Box<dyn std::any::Any>, Box::new(ep), Box::new(buf), Box::new(conn)]);
        }
        "put-idle" => {
            let ep = PutEndpoint::new(conn.qp().clone(), conn.cq().clone(), PollMode::Busy).unwrap();
            keep.extend([Box::new(ep) as Box<dyn std::any::Any>, Box::new(conn)]);
        }
        "heap-owner" => {
            let mut ep =
                HeapEndpoint::from_connection(conn, OwnerLimits::default(), Duration::from_secs(60)).unwrap();
            // Answer the heap's creation, then stop polling: allocations wait for answers.
            while ep.owner_stats(HEAP).is_err() {
                ep.poll_messages().unwrap();
            }
            let start = Instant::now();
            while start.elapsed() < Duration::from_millis(300) {
                ep.poll_messages().unwrap();
            }
            keep.push(Box::new(ep));
        }
        other => panic!("unknown peer mode {other}"),
    }
    println!("READY");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// The peer process; killed (SIGKILL) on drop if the test has not done so.
struct Peer {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Peer {
    fn spawn(mode: &str) -> (Peer, SocketAddr) {
        // `RDMAKIT_TEST_PEER_WRAP`: a command prefix for the peer (e.g. `ip netns exec <ns>`).
        let exe = std::env::current_exe().unwrap();
        let wrap = std::env::var("RDMAKIT_TEST_PEER_WRAP").unwrap_or_default();
        let mut prefix = wrap.split_whitespace();
        let mut cmd = match prefix.next() {
            Some(program) => {
                let mut c = Command::new(program);
                c.args(prefix).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        let mut child = cmd
            .args(["--exact", "liveness_peer", "--ignored", "--nocapture", "--test-threads=1"])
            .env("RDMAKIT_LIVENESS_PEER", mode)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the peer process");
        let out = BufReader::new(child.stdout.take().unwrap());
        let mut peer = Peer { child, out };
        let addr = peer.line("LISTEN ").parse().unwrap();
        (peer, addr)
    }

    /// The rest of the first line holding `tag` (libtest may print before it).
    fn line(&mut self, tag: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(self.out.read_line(&mut line).unwrap() > 0, "the peer exited before {tag:?}");
            if let Some(at) = line.find(tag) {
                return line[at + tag.len()..].trim().to_string();
            }
        }
    }

    /// SIGKILL: the process dies without closing anything itself.
    fn kill_9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

fn connect_to(addr: SocketAddr) -> (ProtectionDomain, rdmakit_verbs::cm::Connection) {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let conn = connect(&pd, addr, &cm_options(), b"").unwrap();
    (pd, conn)
}

fn report(what: &str, took: Duration, e: &ChannelError) {
    assert!(e.is_peer_gone(), "{what}: expected a peer-gone error, got {e:?}");
    assert!(took < BOUND, "{what}: failed only after {took:?}");
    eprintln!("liveness (cross-process, kill -9): {what} failed {took:?} after the kill: {e}");
}

/// Starts `op` blocked against an idle peer, kills the peer, and times the failure.
async fn kill_while_blocked<T: std::fmt::Debug + Send + 'static>(
    what: &str,
    mut peer: Peer,
    op: impl std::future::Future<Output = rdmakit_channel::Result<T>> + Send + 'static,
) {
    let task = tokio::spawn(op);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!task.is_finished(), "{what}: should block while the peer is alive and idle");
    peer.kill_9();
    let start = Instant::now();
    let r = tokio::time::timeout(BOUND, task).await;
    let took = start.elapsed();
    match r {
        Err(_) => panic!("{what}: still blocked {BOUND:?} after kill -9"),
        Ok(r) => match r.unwrap() {
            Ok(v) => panic!("{what}: succeeded against a dead peer: {v:?}"),
            Err(e) => report(what, took, &e),
        },
    }
}

async fn pipe_to_idle_peer() -> (Peer, ProtectionDomain, Pipe) {
    let (mut peer, addr) = Peer::spawn("pipe");
    let (pd, conn) = tokio::task::spawn_blocking(move || connect_to(addr)).await.unwrap();
    let pipe = Pipe::from_connection(conn, pipe_config()).await.unwrap();
    peer.line("READY");
    (peer, pd, pipe)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_pipe_operations_fail_after_kill_9() {
    // rwrite: the peer never receives, so after `slots` messages the writer waits.
    let (peer, pd, pipe) = pipe_to_idle_peer().await;
    let src = pd.alloc_mr(1024, AccessFlags::LOCAL_WRITE).unwrap();
    for _ in 0..4 {
        pipe.rwrite(src.local().unwrap()).await.0.unwrap();
    }
    let slice = src.local().unwrap();
    kill_while_blocked("rwrite", peer, async move { pipe.rwrite(slice).await.0 }).await;

    // recv: the peer never writes.
    let (peer, _pd, pipe) = pipe_to_idle_peer().await;
    kill_while_blocked("recv", peer, async move { pipe.recv().await.map(|g| g.len()) }).await;

    // rread: the peer never publishes.
    let (peer, pd, pipe) = pipe_to_idle_peer().await;
    let dst = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap().local().unwrap();
    kill_while_blocked("rread", peer, async move { pipe.rread(dst).await.0 }).await;

    // publish: the peer never reads.
    let (peer, pd, pipe) = pipe_to_idle_peer().await;
    let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ).unwrap().local().unwrap();
    kill_while_blocked("publish", peer, async move { pipe.publish(src).await.0 }).await;

    // PipeStream::poll_read: nothing ever arrives.
    let (peer, _pd, pipe) = pipe_to_idle_peer().await;
    let mut stream = stream::PipeStream::new(pipe, 4096).unwrap();
    kill_while_blocked("poll_read", peer, async move {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 16];
        stream.read(&mut buf).await.map_err(|e| {
            // The stream's io::Error wraps the channel's error.
            match e.into_inner().map(|b| b.downcast::<ChannelError>()) {
                Some(Ok(c)) => *c,
                other => ChannelError::Protocol(format!("not a channel error: {other:?}")),
            }
        })
    })
    .await;
}

/// Polls `f` until it fails; returns the time from the kill.
fn sync_kill_while_blocked(what: &str, mut peer: Peer, mut f: impl FnMut() -> rdmakit_channel::Result<()>) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(300) {
        f().unwrap_or_else(|e| panic!("{what}: failed while the peer was alive: {e}"));
        std::thread::sleep(Duration::from_micros(200));
    }
    peer.kill_9();
    let start = Instant::now();
    loop {
        match f() {
            Ok(()) => {
                assert!(start.elapsed() < BOUND, "{what}: still waiting {BOUND:?} after kill -9");
                std::thread::sleep(Duration::from_micros(200));
            }
            Err(e) => return report(what, start.elapsed(), &e),
        }
    }
}

#[test]
fn blocked_put_handles_fail_after_kill_9() {
    // put: the receiver never calls ready, so puts are Busy.
    let (mut peer, addr) = Peer::spawn("put-receiver");
    let (pd, conn) = connect_to(addr);
    let ep = PutEndpoint::new(conn.qp().clone(), conn.cq().clone(), PollMode::Busy).unwrap();
    let hex = peer.line("DESC ");
    let bytes: Vec<u8> =
        (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
    let desc = HandleDesc::decode(&bytes).unwrap();
    let sbuf = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    let sh = ep.assoc_local_buffer(&desc, sbuf.local().unwrap()).unwrap();
    peer.line("READY");
    sh.put().unwrap();
    sync_kill_while_blocked("put", peer, || match sh.put() {
        Err(ChannelError::Busy) => Ok(()),
        other => other,
    });
    drop(conn);

    // ready_poll: no sender ever puts.
    let (mut peer, addr) = Peer::spawn("put-idle");
    let (pd, conn) = connect_to(addr);
    let ep = PutEndpoint::new(conn.qp().clone(), conn.cq().clone(), PollMode::Busy).unwrap();
    peer.line("READY");
    let rbuf = pd.alloc_mr(256, AccessFlags::ALL_REMOTE).unwrap();
    let h = ep.create_handle(&rbuf, |_| {}, 0).unwrap();
    h.ready_poll_q().unwrap();
    sync_kill_while_blocked("ready_poll", peer, || ep.ready_poll().map(|_| ()));
    drop(conn);
}

#[test]
fn blocked_rmalloc_fails_after_kill_9() {
    let (mut peer, addr) = Peer::spawn("heap-owner");
    let (_pd, conn) = connect_to(addr);
    // A time-out far beyond the bound: the error must come from liveness.
    let mut ep =
        HeapEndpoint::from_connection(conn, OwnerLimits::default(), Duration::from_secs(60)).unwrap();
    let config = HeapConfig::new(HEAP, AllocPolicy::NextFit).with_sync(SyncMode::Immediate);
    ep.create_heap(config, 1 << 20).unwrap();
    peer.line("READY");
    // Immediate mode: the allocation waits for the owner's acknowledgement, which the idle
    // owner never sends.
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let r = ep.rmalloc(HEAP, 64);
        tx.send(()).unwrap();
        r
    });
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "rmalloc should block on the idle owner");
    peer.kill_9();
    let start = Instant::now();
    rx.recv_timeout(BOUND).expect("rmalloc still blocked after kill -9");
    let took = start.elapsed();
    let e = worker.join().unwrap().expect_err("rmalloc succeeded against a dead owner");
    report("rmalloc", took, &e);
}
