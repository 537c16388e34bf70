//! The soft NIC across processes: this test binary re-runs itself as a passive peer
//! process (`peer_process`, selected by `RDMAKIT_TEST_PEER=1`) that publishes an endpoint
//! and two regions, then only sleeps. Everything the client does to it is served by the
//! peer's soft NIC progress engine: through the same-host shared-memory rings, and again
//! over TCP (the `_over_tcp` variants, with that path turned off on both sides).
//!
//! The binary has its own `main` (`harness = false`, libtest-mimic): the peer is a mode of
//! the binary, not a test, so it is never counted as one (it used to be a test function
//! that returned at once outside its parent: a pass that tested nothing).
//!
//! `RDMAKIT_SOFT_ADDR` picks the address both sides listen on (loopback by default; the
//! network-namespace test sets the veth addresses).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Trial};
use rdmakit::*;

fn main() {
    match std::env::var("RDMAKIT_TEST_PEER").as_deref() {
        Ok("1") => return peer_process(),
        Ok("many") => return many_qps_peer_process(),
        _ => {}
    }
    let args = Arguments::from_args();
    type Case = (&'static str, fn(Path));
    let tests: [Case; 9] = [
        (
            "writes_and_reads_are_placed_directly_on_the_same_host",
            writes_and_reads_are_placed_directly_on_the_same_host,
        ),
        ("direct_access_keeps_the_responders_checks", direct_access_keeps_the_responders_checks),
        ("one_sided_and_two_sided_ops_across_processes", one_sided_and_two_sided_ops_across_processes),
        ("send_waits_for_a_late_receive_across_processes", send_waits_for_a_late_receive_across_processes),
        (
            "killed_peer_gives_retry_exceeded_within_the_budget",
            killed_peer_gives_retry_exceeded_within_the_budget,
        ),
        (
            "a_receiver_exiting_on_its_message_does_not_fail_the_send",
            a_receiver_exiting_on_its_message_does_not_fail_the_send,
        ),
        (
            "a_target_exiting_on_a_polled_write_does_not_fail_the_write",
            a_target_exiting_on_a_polled_write_does_not_fail_the_write,
        ),
        (
            "more_qps_than_the_peer_keeps_waiting_all_get_through_across_processes",
            more_qps_than_the_peer_keeps_waiting_all_get_through_across_processes,
        ),
        (
            "a_late_answer_after_retry_exceeded_is_no_protocol_error",
            a_late_answer_after_retry_exceeded_is_no_protocol_error,
        ),
    ];
    let mut trials: Vec<Trial> = tests
        .into_iter()
        .flat_map(|(name, f)| {
            [
                Trial::test(name, move || {
                    f(Path::SameHost);
                    Ok(())
                }),
                Trial::test(format!("{name}_over_tcp"), move || {
                    f(Path::Tcp);
                    Ok(())
                }),
            ]
        })
        .collect();
    trials.push(Trial::test("hostile_bytes_on_the_port_are_dropped", || {
        hostile_bytes_on_the_port_are_dropped();
        Ok(())
    }));
    libtest_mimic::run(&args, trials).exit();
}

/// How the client reaches the peer process.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path {
    /// Shared-memory rings (the default between processes of one host).
    SameHost,
    /// TCP: the same-host path off in both processes.
    Tcp,
}

impl Path {
    /// Small rings (64 KiB) on the same-host path: frames wrap and wait for room often.
    fn config(self) -> SoftConfig {
        SoftConfig::default().with_same_host_shm(self == Path::SameHost).with_same_host_ring(64 * 1024)
    }
}

/// Mappings of same-host rings in this process (`/proc/self/maps` names their memfd).
fn ring_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:rdmakit-soft-rings"))
        .count()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

/// Short transport budget so dead-peer tests finish fast: 4.096 µs × 2^12 × 4 ≈ 67 ms.
fn opts() -> ConnectOptions {
    ConnectOptions::default().with_timeout(12).with_retry_cnt(3)
}

/// The peer process (this binary with `RDMAKIT_TEST_PEER=1`). Prints `EP <endpoint> MR
/// <region> RX <region>`, reads the client's endpoint, connects, posts a receive into RX
/// after `RDMAKIT_TEST_RECV_DELAY_MS`, prints `READY`, then idles until its stdin closes
/// (or, with `RDMAKIT_TEST_EXIT_ON_RECV`, exits as soon as that receive completes; with
/// `RDMAKIT_TEST_EXIT_ON_WRITE`, as soon as RX's first byte changes, polled in memory).
fn peer_process() {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    let mr = pd.alloc_mr(1 << 20, AccessFlags::ALL_REMOTE).unwrap();
    let rx = pd.alloc_mr(4096, AccessFlags::ALL_REMOTE).unwrap();
    // Read-only to peers, and a region of another protection domain than the QP's.
    let ro = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ).unwrap();
    let other_pd = ctx.alloc_pd().unwrap();
    let other = other_pd.alloc_mr(4096, AccessFlags::ALL_REMOTE).unwrap();
    for i in 0..1024u64 {
        mr.write_u64(i * 8, i).unwrap();
    }
    ro.write_u64(0, 0x5eed).unwrap();
    let mut mr = Some(mr);
    let mut qp = Some(qp);
    let mut out = std::io::stdout();
    let (qpr, mrr) = (qp.as_ref().unwrap(), mr.as_ref().unwrap());
    qpr.modify_to_init(&opts()).unwrap();
    writeln!(
        out,
        "EP {} MR {} RX {} RO {} OTHER {}",
        hex(&qpr.address().unwrap().encode()),
        hex(&mrr.remote().encode()),
        hex(&rx.remote().encode()),
        hex(&ro.remote().encode()),
        hex(&other.remote().encode())
    )
    .unwrap();
    out.flush().unwrap();
    let mut line = String::new();
    let mut stdin = BufReader::new(std::io::stdin());
    stdin.read_line(&mut line).unwrap();
    let peer = QpAddress::decode(&unhex(line.trim().strip_prefix("EP ").unwrap())).unwrap();
    let qpr = qp.as_ref().unwrap();
    qpr.connect(&peer, &opts()).unwrap();
    writeln!(out, "CONNECTED").unwrap();
    out.flush().unwrap();
    let delay = std::env::var("RDMAKIT_TEST_RECV_DELAY_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    std::thread::sleep(Duration::from_millis(delay));
    qpr.post_recv(RecvWr::new(rx.local().unwrap())).unwrap();
    writeln!(out, "READY").unwrap();
    out.flush().unwrap();
    if std::env::var_os("RDMAKIT_TEST_EXIT_ON_WRITE").is_some() {
        // Exit the moment a write lands, seen in memory (as a put handle or a pipe sees
        // one), with no completion of ours in between.
        let end = Instant::now() + Duration::from_secs(30);
        while rx.read_u64(0).unwrap() & 0xff == 0 {
            assert!(Instant::now() < end, "no write landed");
            std::hint::spin_loop();
        }
        std::process::exit(0);
    }
    if std::env::var_os("RDMAKIT_TEST_EXIT_ON_RECV").is_some() {
        // Exit the moment the receive completes, as a client does once it has its answer.
        let wc = cq.wait(Some(Duration::from_secs(30))).expect("the receive completes");
        std::process::exit(if wc.status.is_success() { 0 } else { 3 });
    }
    // Idle: the NIC does the work. Answers `RINGS` (how many same-host rings this process
    // maps), `PEEK <offset>` (MR's word there), `DEREG` (drops MR) and `DESTROY` (drops the
    // QP), each with a line; exits when the client closes our stdin.
    loop {
        line.clear();
        if stdin.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        let cmd: Vec<&str> = line.split_whitespace().collect();
        match cmd.as_slice() {
            ["RINGS"] => writeln!(out, "RINGS {}", ring_mappings()).unwrap(),
            ["PEEK", off] => {
                let v = mr.as_ref().map(|m| m.read_u64(off.parse().unwrap()).unwrap());
                writeln!(out, "PEEKED {}", v.unwrap_or(u64::MAX)).unwrap();
            }
            ["DEREG"] => {
                mr = None;
                writeln!(out, "DEREGISTERED").unwrap();
            }
            ["DESTROY"] => {
                qp = None;
                writeln!(out, "DESTROYED").unwrap();
            }
            _ => {}
        }
        out.flush().unwrap();
    }
    drop((mr, rx, ro, other, qp));
}

struct Peer {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
    ep: QpAddress,
    mr: RemoteRegion,
    rx: RemoteRegion,
    /// Remote read only.
    ro: RemoteRegion,
    /// In another PD of the peer than its QP's.
    other: RemoteRegion,
}

/// The command that runs the peer: this test binary, behind the whitespace-separated
/// prefix in `RDMAKIT_TEST_PEER_WRAP` if set (e.g. `ip netns exec rdmakit-b`, to run the
/// peer in another network namespace). `RDMAKIT_TEST_PEER_SOFT_ADDR`, if set, is the
/// peer's `RDMAKIT_SOFT_ADDR`; otherwise it inherits ours.
fn peer_command() -> Command {
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
    if let Ok(addr) = std::env::var("RDMAKIT_TEST_PEER_SOFT_ADDR") {
        cmd.env("RDMAKIT_SOFT_ADDR", addr);
    }
    cmd
}

/// The peer command in `role` (its `RDMAKIT_TEST_PEER`) over `path`, stdin and stdout piped.
fn peer_in_role(role: &str, path: Path) -> Command {
    let mut cmd = peer_command();
    if path == Path::Tcp {
        cmd.env(rdmakit_verbs::soft::SHM_ENV, "0");
    }
    cmd.env("RDMAKIT_TEST_PEER", role).stdin(Stdio::piped()).stdout(Stdio::piped());
    cmd
}

fn spawn_peer(recv_delay_ms: u64, path: Path) -> Peer {
    spawn_peer_with(recv_delay_ms, path, &[])
}

/// [`spawn_peer`] with more environment for the peer.
fn spawn_peer_with(recv_delay_ms: u64, path: Path, env: &[(&str, &str)]) -> Peer {
    let mut child = peer_in_role("1", path)
        .env("RDMAKIT_TEST_RECV_DELAY_MS", recv_delay_ms.to_string())
        .envs(env.iter().copied())
        .spawn()
        .expect("spawn the peer process");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let at = loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "peer exited before publishing its endpoint");
        if let Some(at) = line.find("EP ") {
            break at;
        }
    };
    let f: Vec<&str> = line[at..].split_whitespace().collect();
    let ep = QpAddress::decode(&unhex(f[1])).unwrap();
    assert_ne!(ep.lid, 0, "the peer's soft device is not listening");
    Peer {
        child,
        out,
        ep,
        mr: RemoteRegion::decode(&unhex(f[3])).unwrap(),
        rx: RemoteRegion::decode(&unhex(f[5])).unwrap(),
        ro: RemoteRegion::decode(&unhex(f[7])).unwrap(),
        other: RemoteRegion::decode(&unhex(f[9])).unwrap(),
    }
}

impl Peer {
    fn connect(&mut self, qp: &QueuePair) {
        self.connect_with(qp, &opts());
    }

    fn connect_with(&mut self, qp: &QueuePair, opts: &ConnectOptions) {
        qp.connect(&self.ep, opts).unwrap();
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "EP {}", hex(&qp.address().unwrap().encode())).unwrap();
        stdin.flush().unwrap();
    }

    /// How many same-host rings the peer process maps.
    fn rings(&mut self) -> usize {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "RINGS").unwrap();
        stdin.flush().unwrap();
        let mut line = String::new();
        loop {
            line.clear();
            assert!(self.out.read_line(&mut line).unwrap() > 0, "peer exited");
            if let Some(n) = line.trim().strip_prefix("RINGS ") {
                return n.parse().unwrap();
            }
        }
    }

    /// Sends the peer a command and waits for the line starting with `answer`; returns
    /// the rest of it.
    fn ask(&mut self, cmd: &str, answer: &str) -> String {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
        let mut line = String::new();
        loop {
            line.clear();
            assert!(self.out.read_line(&mut line).unwrap() > 0, "peer exited");
            if let Some(rest) = line.trim().strip_prefix(answer) {
                return rest.trim().to_string();
            }
        }
    }

    fn wait_ready(&mut self) {
        self.wait_for("READY");
    }

    fn wait_for(&mut self, what: &str) {
        let mut line = String::new();
        while !line.contains(what) {
            line.clear();
            assert!(self.out.read_line(&mut line).unwrap() > 0, "peer exited");
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait(cq: &CompletionQueue) -> WorkCompletion {
    cq.wait(Some(Duration::from_secs(20))).expect("completion")
}

struct Local {
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    same_host: bool,
}

fn local(path: Path) -> Local {
    let ctx = Context::open_soft_with(path.config()).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256).unwrap();
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    Local { pd, cq, qp, same_host: path == Path::SameHost }
}

fn one_sided_and_two_sided_ops_across_processes(path: Path) {
    let mut peer = spawn_peer(0, path);
    let l = local(path);
    peer.connect(&l.qp);
    peer.wait_ready();
    let buf = l.pd.alloc_mr(1 << 20, AccessFlags::LOCAL_WRITE).unwrap();

    // Read the peer's pattern, 1 MiB in one request.
    l.qp.post_send(SendWr::read(buf.local().unwrap(), peer.mr.slice(0, 1 << 20).unwrap()).wr_id(1)).unwrap();
    let wc = wait(&l.cq).ok().unwrap();
    assert_eq!((wc.wr_id, wc.byte_len), (1, 1 << 20));
    assert_eq!(buf.read_u64(8 * 1000).unwrap(), 1000);
    // That request reached the peer through the path under test: rings in shared memory
    // (the peer maps the ones of our QP, which it has now served, and of its own QP
    // connected back to us) or TCP.
    // A peer in another network namespace (`RDMAKIT_TEST_PEER_WRAP`) does not share our
    // abstract Unix sockets: TCP is the only path to it, and the requester falls back to it.
    let other_netns = std::env::var("RDMAKIT_TEST_PEER_WRAP").is_ok_and(|w| !w.trim().is_empty());
    let expected = if path == Path::SameHost && !other_netns { 2 } else { 0 };
    assert_eq!(peer.rings(), expected, "same-host rings mapped by the peer");

    // Write, then read back.
    buf.write_at(0, b"across processes").unwrap();
    let t = peer.mr.slice(4096, 16).unwrap();
    l.qp.post_send(SendWr::write(buf.slice(0, 16).unwrap(), t).wr_id(2)).unwrap();
    l.qp.post_send(SendWr::read(buf.slice(100, 16).unwrap(), t).wr_id(3)).unwrap();
    assert_eq!(wait(&l.cq).ok().unwrap().wr_id, 2);
    assert_eq!(wait(&l.cq).ok().unwrap().wr_id, 3);
    let mut got = [0u8; 16];
    buf.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"across processes");

    // Atomics.
    let c = peer.mr.slice(8 * 7, 8).unwrap();
    l.qp.post_send(SendWr::fetch_add(buf.slice(200, 8).unwrap(), c, 10)).unwrap();
    wait(&l.cq).ok().unwrap();
    assert_eq!(buf.read_u64(200).unwrap(), 7);
    l.qp.post_send(SendWr::compare_swap(buf.slice(208, 8).unwrap(), c, 17, 99)).unwrap();
    wait(&l.cq).ok().unwrap();
    assert_eq!(buf.read_u64(208).unwrap(), 17);

    // A send lands in the receive the peer posted; read it back to check.
    buf.write_at(300, b"a message").unwrap();
    l.qp.post_send(SendWr::send(buf.slice(300, 9).unwrap()).with_imm(5)).unwrap();
    wait(&l.cq).ok().unwrap();
    l.qp.post_send(SendWr::read(buf.slice(400, 9).unwrap(), peer.rx.slice(0, 9).unwrap())).unwrap();
    wait(&l.cq).ok().unwrap();
    let mut m = [0u8; 9];
    buf.read_at(400, &mut m).unwrap();
    assert_eq!(&m, b"a message");

    // A pipeline of 100 small writes (the queue holds 128), unsignalled but the last.
    for i in 0..100u32 {
        let wr = SendWr::write(buf.slice(0, 8).unwrap(), peer.mr.slice(8192 + 8 * u64::from(i), 8).unwrap());
        l.qp.post_send(if i == 99 { wr.wr_id(99) } else { wr.unsignaled() }).unwrap();
    }
    assert_eq!(wait(&l.cq).ok().unwrap().wr_id, 99);
    assert_eq!(l.qp.outstanding(), (0, 0));

    // Writes larger than the ring can take at once, small ones behind them, then a read of
    // the word all of them wrote: the small ones must not overtake (on the same-host path
    // they are posted straight into the ring only when nothing waits before them).
    // (Our rings are 64 KiB, `Path::config`; no posted source is touched until completion.)
    const BIG: u64 = 256 * 1024;
    const SMALL: u64 = 512 * 1024;
    const BACK: u64 = 768 * 1024;
    buf.write_u64(16, 7).unwrap();
    for i in 0..50u64 {
        buf.write_u64(SMALL + 8 * i, 1000 + i).unwrap();
    }
    for _ in 0..3 {
        let wr = SendWr::write(buf.slice(0, BIG as u32).unwrap(), peer.mr.slice(0, BIG as u32).unwrap());
        l.qp.post_send(wr.unsignaled()).unwrap();
    }
    for i in 0..50u64 {
        let wr = SendWr::write(buf.slice(SMALL + 8 * i, 8).unwrap(), peer.mr.slice(16, 8).unwrap());
        l.qp.post_send(wr.unsignaled()).unwrap();
    }
    l.qp.post_send(SendWr::read(buf.slice(BACK, 8).unwrap(), peer.mr.slice(16, 8).unwrap()).wr_id(77))
        .unwrap();
    assert_eq!(wait(&l.cq).ok().unwrap().wr_id, 77);
    assert_eq!(buf.read_u64(BACK).unwrap(), 1049, "a small write overtook a large one, or was lost");

    // A bad rkey is refused by the peer's NIC.
    let bad = RemoteSlice::new(peer.mr.addr, 8, peer.mr.rkey ^ 0x100);
    l.qp.post_send(SendWr::write(buf.slice(0, 8).unwrap(), bad)).unwrap();
    assert_eq!(wait(&l.cq).status, WcStatus::REM_ACCESS_ERR);
    assert_eq!(l.qp.state(), QpState::Error);
}

/// Same-host: once the peer granted the key, plain writes and reads are placed by the
/// requester itself (`soft::direct`), and land where the NIC's path puts them. Over TCP the
/// same operations give the same results.
fn writes_and_reads_are_placed_directly_on_the_same_host(path: Path) {
    let mut peer = spawn_peer(0, path);
    let l = local(path);
    peer.connect(&l.qp);
    peer.wait_ready();
    let buf = l.pd.alloc_mr(65536, AccessFlags::LOCAL_WRITE).unwrap();
    let before = rdmakit::soft::direct::direct_placements();
    const N: u64 = 500;
    for i in 0..N {
        buf.write_u64(8 * i, 0xab00_0000 + i).unwrap();
        let t = peer.mr.slice(16384 + 8 * i, 8).unwrap();
        l.qp.post_send(SendWr::write(buf.slice(8 * i, 8).unwrap(), t).unsignaled()).unwrap();
        l.qp.post_send(SendWr::read(buf.slice(4096 + 8 * i, 8).unwrap(), t).wr_id(i)).unwrap();
        assert_eq!(wait(&l.cq).ok().unwrap().wr_id, i);
        assert_eq!(buf.read_u64(4096 + 8 * i).unwrap(), 0xab00_0000 + i, "read back {i}");
    }
    // The peer sees them in its memory.
    assert_eq!(peer.ask(&format!("PEEK {}", 16384 + 8 * 7), "PEEKED"), (0xab00_0000u64 + 7).to_string());
    // A pipeline of writes, then a read of the last one's target: all in order.
    for k in 0..64u64 {
        buf.write_u64(32768 + 512 * k, k).unwrap();
    }
    for k in 0..64u64 {
        let src = buf.slice(32768 + 512 * k, 512).unwrap();
        let wr = SendWr::write(src, peer.mr.slice(65536 + 512 * k, 512).unwrap());
        l.qp.post_send(wr.unsignaled()).unwrap();
    }
    l.qp.post_send(
        SendWr::read(buf.slice(4096, 8).unwrap(), peer.mr.slice(65536 + 512 * 63, 8).unwrap()).wr_id(9),
    )
    .unwrap();
    assert_eq!(wait(&l.cq).ok().unwrap().wr_id, 9);
    assert_eq!(buf.read_u64(4096).unwrap(), 63);
    // An atomic goes through the ring; a write behind it to the same word must not overtake
    // it (RC order), nor a read behind both.
    for k in 0..20u64 {
        let word = peer.mr.slice(65536 + 8 * k, 8).unwrap();
        buf.write_u64(40960, 1_000_000 + k).unwrap();
        l.qp.post_send(SendWr::fetch_add(buf.slice(40968, 8).unwrap(), word, 5).wr_id(200 + k)).unwrap();
        l.qp.post_send(SendWr::write(buf.slice(40960, 8).unwrap(), word).unsignaled()).unwrap();
        l.qp.post_send(SendWr::read(buf.slice(40976, 8).unwrap(), word).wr_id(100 + k)).unwrap();
        assert_eq!(wait(&l.cq).ok().unwrap().wr_id, 200 + k);
        assert_eq!(wait(&l.cq).ok().unwrap().wr_id, 100 + k);
        assert_eq!(buf.read_u64(40976).unwrap(), 1_000_000 + k, "a read saw the word out of order");
        // Everything answered: the word holds the write's value, not the atomic's sum.
        l.qp.post_send(SendWr::read(buf.slice(40984, 8).unwrap(), word).wr_id(300 + k)).unwrap();
        assert_eq!(wait(&l.cq).ok().unwrap().wr_id, 300 + k);
        assert_eq!(buf.read_u64(40984).unwrap(), 1_000_000 + k, "a write overtook the atomic before it");
    }
    let placed = rdmakit::soft::direct::direct_placements() - before;
    if path == Path::SameHost && std::env::var("RDMAKIT_TEST_PEER_WRAP").is_err() {
        // The first access waits for the grant, then goes direct like the rest.
        assert!(placed >= 2 * N, "only {placed} of {} accesses placed directly", 2 * N + 65);
        // The proof that needs no counter: with every thread of the peer stopped, nothing
        // of it answers through the rings, and placed accesses still complete.
        let stopped = Stopped::new(&peer);
        for i in 0..100u64 {
            buf.write_u64(8 * i, 0xcd00 + i).unwrap();
            let t = peer.mr.slice(16384 + 8 * i, 8).unwrap();
            l.qp.post_send(SendWr::write(buf.slice(8 * i, 8).unwrap(), t).unsignaled()).unwrap();
            l.qp.post_send(SendWr::read(buf.slice(4096 + 8 * i, 8).unwrap(), t).wr_id(i)).unwrap();
            let wc =
                l.cq.wait(Some(Duration::from_secs(2)))
                    .expect("a placed access completes with the peer stopped");
            assert_eq!((wc.wr_id, wc.status), (i, WcStatus::SUCCESS));
            assert_eq!(buf.read_u64(4096 + 8 * i).unwrap(), 0xcd00 + i);
        }
        drop(stopped);
        assert_eq!(peer.ask(&format!("PEEK {}", 16384 + 8 * 99), "PEEKED"), (0xcd00u64 + 99).to_string());
    }
}

/// The peer's threads stopped (SIGSTOP) until dropped (SIGCONT).
struct Stopped(libc::pid_t);

impl Stopped {
    fn new(peer: &Peer) -> Stopped {
        let pid = peer.child.id() as libc::pid_t;
        // SAFETY: a signal to our own child.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
        // Stopped once /proc says so.
        let end = Instant::now() + Duration::from_secs(5);
        while !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap().contains(") T ") {
            assert!(Instant::now() < end, "the peer did not stop");
            std::thread::sleep(Duration::from_millis(1));
        }
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
}

/// Same-host direct access keeps every check the responder's NIC makes: a read-only key
/// is read (directly) but not written, a key of another PD of the peer is refused, a
/// deregistered region is no longer reachable, and a destroyed responder QP answers
/// nothing (the write times out). Each case on a fresh connection (the first error moves
/// the QP to the error state).
fn direct_access_keeps_the_responders_checks(path: Path) {
    let fresh = || {
        let mut peer = spawn_peer(0, path);
        let l = local(path);
        peer.connect(&l.qp);
        peer.wait_ready();
        let buf = l.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        (peer, l, buf)
    };
    let write = |l: &Local, buf: &MemoryRegion, t: RemoteSlice| {
        l.qp.post_send(SendWr::write(buf.slice(0, 8).unwrap(), t)).unwrap();
        wait(&l.cq)
    };

    // Read-only: read twice (the second directly), then a write is refused.
    let (peer, l, buf) = fresh();
    for i in 0..2 {
        l.qp.post_send(SendWr::read(buf.slice(8, 8).unwrap(), peer.ro.slice(0, 8).unwrap())).unwrap();
        wait(&l.cq).ok().unwrap();
        assert_eq!(buf.read_u64(8).unwrap(), 0x5eed, "read {i}");
    }
    assert_eq!(write(&l, &buf, peer.ro.slice(0, 8).unwrap()).status, WcStatus::REM_ACCESS_ERR);
    drop((peer, l));

    // Another PD of the peer than its QP's: refused.
    let (peer, l, buf) = fresh();
    assert_eq!(write(&l, &buf, peer.other.slice(0, 8).unwrap()).status, WcStatus::REM_ACCESS_ERR);
    drop((peer, l));

    // Past the end of a region that was granted (after a write that was placed).
    let (peer, l, buf) = fresh();
    write(&l, &buf, peer.mr.slice(0, 8).unwrap()).ok().unwrap();
    placed_while_stopped(&peer, &l, &buf);
    let past = RemoteSlice::new(peer.mr.addr + peer.mr.len - 4, 8, peer.mr.rkey);
    assert_eq!(write(&l, &buf, past).status, WcStatus::REM_ACCESS_ERR);
    drop((peer, l));

    // Deregistered after writes were placed (proved: they complete with the peer
    // stopped, on the same-host path): the next write is refused.
    let (mut peer, l, buf) = fresh();
    buf.write_u64(0, 77).unwrap();
    write(&l, &buf, peer.mr.slice(0, 8).unwrap()).ok().unwrap();
    placed_while_stopped(&peer, &l, &buf);
    assert_eq!(peer.ask("PEEK 0", "PEEKED"), "77");
    peer.ask("DEREG", "DEREGISTERED");
    assert_eq!(write(&l, &buf, peer.mr.slice(0, 8).unwrap()).status, WcStatus::REM_ACCESS_ERR);
    drop((peer, l));

    // The responder QP destroyed after writes were placed: nothing answers any more.
    let (mut peer, l, buf) = fresh();
    write(&l, &buf, peer.mr.slice(0, 8).unwrap()).ok().unwrap();
    placed_while_stopped(&peer, &l, &buf);
    peer.ask("DESTROY", "DESTROYED");
    assert_eq!(write(&l, &buf, peer.mr.slice(0, 8).unwrap()).status, WcStatus::RETRY_EXC_ERR);
}

/// Writes 8 bytes of `buf` to the peer's MR until one was placed directly, on the
/// same-host path (and at least three): the grant is asked for by the first access after
/// the peer's QP serves the link, and taken a round trip later. Over TCP: three plain
/// writes. Returns whether the path places directly.
fn until_placed_directly(peer: &Peer, l: &Local, buf: &MemoryRegion) -> bool {
    let direct = same_host_path(l);
    let before = rdmakit::soft::direct::direct_placements();
    for i in 0..100 {
        l.qp.post_send(SendWr::write(buf.slice(0, 8).unwrap(), peer.mr.slice(0, 8).unwrap())).unwrap();
        wait(&l.cq).ok().unwrap();
        if i >= 2 && (!direct || rdmakit::soft::direct::direct_placements() > before) {
            return direct;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("no write was placed directly in 100 tries");
}

/// On the same-host path: a write to the peer's MR completes with every thread of the
/// peer stopped, so it was placed directly. Over TCP: a plain write.
fn placed_while_stopped(peer: &Peer, l: &Local, buf: &MemoryRegion) {
    let direct = until_placed_directly(peer, l, buf);
    let _stopped = direct.then(|| Stopped::new(peer));
    l.qp.post_send(SendWr::write(buf.slice(0, 8).unwrap(), peer.mr.slice(0, 8).unwrap())).unwrap();
    let wc = l.cq.wait(Some(Duration::from_secs(2))).expect("the write completes");
    assert_eq!(wc.status, WcStatus::SUCCESS);
}

/// Whether `l` reaches its peer through the same-host path (rings and direct placement).
fn same_host_path(l: &Local) -> bool {
    l.same_host && std::env::var("RDMAKIT_TEST_PEER_WRAP").is_err()
}

fn send_waits_for_a_late_receive_across_processes(path: Path) {
    // The peer posts its receive 300 ms after connecting: the send gets RNR NAKs and is
    // retried (infinite RNR retries) until it lands.
    let mut peer = spawn_peer(300, path);
    let l = local(path);
    peer.connect(&l.qp);
    peer.wait_for("CONNECTED");
    let buf = l.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    buf.write_at(0, b"late").unwrap();
    l.qp.post_send(SendWr::send(buf.slice(0, 4).unwrap()).wr_id(1)).unwrap();
    l.qp.post_send(SendWr::write(buf.slice(0, 4).unwrap(), peer.mr.slice(0, 4).unwrap()).wr_id(2)).unwrap();
    assert_eq!(wait(&l.cq).ok().unwrap().wr_id, 1);
    assert_eq!(wait(&l.cq).ok().unwrap().wr_id, 2);
    peer.wait_ready();
}

/// A receiver that exits the moment its message arrives (a client with its answer) must not
/// fail the send that brought it. The peer's device is made to wait 200 ms before writing
/// its answers (`ANSWER_DELAY_ENV`). Before, the receive completion was published as the
/// data landed and the ACK written after it: the peer exited with its ACK unwritten, and
/// the send failed with `RETRY_EXC_ERR` although delivered (`pipe_service`'s 64-client test
/// saw it one run in ten: a verdict write failing after its client read it). Now a device
/// serving another process writes the answers of a batch before it publishes the batch's
/// receive completions.
fn a_receiver_exiting_on_its_message_does_not_fail_the_send(path: Path) {
    against_an_exiting_peer(path, "RDMAKIT_TEST_EXIT_ON_RECV", |buf, _| SendWr::send(buf));
}

/// The same for a write the target sees in memory (a put handle's, a pipe's): it may exit
/// the moment the bytes are there. A NIC has sent the ACK by then; the soft NIC's wire
/// writes it a moment after placing the data, so a process going away writes what its wire
/// has answered before it goes (an exit hook, bounded). The peer's device again waits 200 ms
/// before writing its answers.
fn a_target_exiting_on_a_polled_write_does_not_fail_the_write(path: Path) {
    against_an_exiting_peer(path, "RDMAKIT_TEST_EXIT_ON_WRITE", |buf, peer| {
        SendWr::write(buf, peer.rx.slice(0, 3).unwrap())
    });
}

/// A peer that exits as `exit_env` says, its device waiting 200 ms before it writes its
/// answers (`ANSWER_DELAY_ENV`): the request `wr` makes of 3 bytes must complete as
/// delivered, and the peer must have seen it.
fn against_an_exiting_peer(path: Path, exit_env: &str, wr: impl FnOnce(LocalSlice, &Peer) -> SendWr) {
    let mut peer =
        spawn_peer_with(0, path, &[(exit_env, "1"), (rdmakit_verbs::soft::ANSWER_DELAY_ENV, "200")]);
    let l = local(path);
    // A transport budget far above the delay (about 1 s per try).
    peer.connect_with(&l.qp, &ConnectOptions::default().with_timeout(18).with_retry_cnt(7));
    peer.wait_ready();
    let buf = l.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    buf.write_at(0, b"bye").unwrap();
    l.qp.post_send(wr(buf.slice(0, 3).unwrap(), &peer).wr_id(7)).unwrap();
    let wc = wait(&l.cq);
    let status = peer.child.wait().unwrap();
    assert!(status.success(), "{exit_env}: the peer did not get the request: {status}");
    assert_eq!(
        (wc.wr_id, wc.status),
        (7, WcStatus::SUCCESS),
        "{path:?}, {exit_env}: a delivered request failed"
    );
}

/// The soft NIC's log, captured for the whole binary (the wire's threads log, not the test's
/// thread): installed by the first test that asks for it.
fn captured_log() -> Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || Captured(sink.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        log
    })
    .clone()
}

struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A slow peer, not a hostile one: its device answers 300 ms late (`ANSWER_DELAY_ENV`), past
/// the requester's transport budget (about 67 ms). The send fails with `RETRY_EXC_ERR` as a
/// NIC's does, and the answer that comes afterwards is dropped as what it is. Before, it was
/// logged as an error, "response out of order", which names a confused or hostile peer.
fn a_late_answer_after_retry_exceeded_is_no_protocol_error(path: Path) {
    let log = captured_log();
    let mut peer = spawn_peer_with(0, path, &[(rdmakit_verbs::soft::ANSWER_DELAY_ENV, "300")]);
    let l = local(path);
    peer.connect_with(&l.qp, &opts());
    peer.wait_ready();
    // The answer names the QP and the send's PSN, this QP's first (from its address).
    let a = l.qp.address().unwrap();
    let ours = format!("qp={} psn={}", a.qp_num, a.psn);
    let buf = l.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    buf.write_at(0, b"late").unwrap();
    // A send: answered through the wire (a write on the same host may be placed directly).
    l.qp.post_send(SendWr::send(buf.slice(0, 4).unwrap()).wr_id(3)).unwrap();
    let wc = wait(&l.cq);
    assert_eq!((wc.wr_id, wc.status), (3, WcStatus::RETRY_EXC_ERR), "{path:?}");
    // The late answer arrives about 300 ms after the send.
    let deadline = Instant::now() + Duration::from_secs(5);
    let lines = loop {
        let text = String::from_utf8_lossy(&log.lock().unwrap()).into_owned();
        let lines: Vec<String> = text
            .lines()
            .filter(|l| l.contains("response") && l.ends_with(&ours))
            .map(str::to_owned)
            .collect();
        if !lines.is_empty() || Instant::now() > deadline {
            break lines;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        lines.iter().any(|l| l.contains("DEBUG") && l.contains("response after the QP failed")),
        "{path:?}: the late answer was not dropped as late: {lines:?}"
    );
    assert!(
        !lines.iter().any(|l| l.contains("ERROR")),
        "{path:?}: a late answer logged as an error: {lines:?}"
    );
}

/// A write to a killed peer fails as a NIC's does (no ACK comes: `RETRY_EXC_ERR`), within
/// the transport's budget. On the same-host path the requester holds a grant of the peer's
/// MR when the peer dies (it maps the region): the write must not be placed into the dead
/// process's pages with success. (The link's end drops the grants; the peer's life word,
/// tested against the kernel in `soft::direct`, covers the moment before the loop sees it.)
fn killed_peer_gives_retry_exceeded_within_the_budget(path: Path) {
    let mut peer = spawn_peer(0, path);
    let l = local(path);
    peer.connect(&l.qp);
    peer.wait_ready();
    let buf = l.pd.alloc_mr(1 << 16, AccessFlags::LOCAL_WRITE).unwrap();
    let t = peer.mr.slice(0, 1 << 16).unwrap();
    l.qp.post_send(SendWr::write(buf.local().unwrap(), t)).unwrap();
    wait(&l.cq).ok().unwrap();
    until_placed_directly(&peer, &l, &buf);

    peer.child.kill().unwrap();
    peer.child.wait().unwrap();
    let start = Instant::now();
    for i in 0..4 {
        l.qp.post_send(SendWr::write(buf.local().unwrap(), t).wr_id(i)).unwrap();
    }
    let first = wait(&l.cq);
    let took = start.elapsed();
    // Placed directly, it would have completed at once, with success.
    assert_eq!((first.wr_id, first.status), (0, WcStatus::RETRY_EXC_ERR));
    for i in 1..4 {
        let wc = wait(&l.cq);
        assert_eq!((wc.wr_id, wc.status), (i, WcStatus::WR_FLUSH_ERR));
    }
    assert_eq!(l.qp.state(), QpState::Error);
    eprintln!(
        "killed peer detected after {took:?} (transport budget {:?})",
        opts().transport_budget().unwrap()
    );
    // Budget ≈ 67 ms; allow generous scheduling slack, but it must be bounded.
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(l.qp.outstanding(), (0, 0));

    // Nothing else in the process broke: a fresh in-process pair works.
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8).unwrap();
    let (a, b) = (
        pd.create_qp(&cq, &cq, QpCaps::default()).unwrap(),
        pd.create_qp(&cq, &cq, QpCaps::default()).unwrap(),
    );
    a.connect(&b.address().unwrap(), &opts()).unwrap();
    b.connect(&a.address().unwrap(), &opts()).unwrap();
    let m = pd.alloc_mr(8, AccessFlags::ALL_REMOTE).unwrap();
    a.post_send(SendWr::write(m.local().unwrap(), m.remote().slice(0, 8).unwrap())).unwrap();
    wait(&cq).ok().unwrap();
}

fn hostile_bytes_on_the_port_are_dropped() {
    use std::net::TcpStream;
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8).unwrap();
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    let ep = qp.address().unwrap();
    let addr = (std::net::Ipv4Addr::new(ep.gid[4], ep.gid[5], ep.gid[6], ep.gid[7]), ep.lid);
    let mut read_before_hello = b"RK\x01\x0b\x18\x00\x00\x00".to_vec();
    read_before_hello.extend_from_slice(&[0u8; 24]); // a well-formed Read, but no Hello first
    let junk: [&[u8]; 4] = [
        b"GET / HTTP/1.1\r\n\r\n",
        b"RK\x01\x0a\xff\xff\xff\x7f",     // a 2 GiB frame
        b"RK\x01\x01\x04\x00\x00\x00abcd", // a Hello far too short
        &read_before_hello,
    ];
    for j in junk {
        let start = Instant::now();
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(j).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = [0u8; 16];
        // The device closes the connection (read returns 0 or an error), never answers.
        let n = std::io::Read::read(&mut s, &mut b).unwrap_or(0);
        assert_eq!(n, 0);
        assert!(start.elapsed() < Duration::from_secs(4), "the device did not drop the connection");
    }
    // The device still works.
    let qp2 = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    qp.connect(&qp2.address().unwrap(), &opts()).unwrap();
    qp2.connect(&qp.address().unwrap(), &opts()).unwrap();
    let m = pd.alloc_mr(8, AccessFlags::ALL_REMOTE).unwrap();
    qp.post_send(SendWr::write(m.local().unwrap(), m.remote().slice(0, 8).unwrap())).unwrap();
    wait(&cq).ok().unwrap();
}

/// QPs the many-QP peer makes: more than a device keeps waiting for their QPs (256).
const MANY: usize = 300;

/// A transport budget of about 8 s (4.096 µs × 2^18 × 8) for the many-QP test: its 300
/// connections are accepted at once, and a device slowed down (the sanitizer tiers run
/// this binary instrumented) answers the last of their first requests well after the
/// 67 ms of `opts`.
fn patient_opts() -> ConnectOptions {
    ConnectOptions::default().with_timeout(18).with_retry_cnt(7)
}

/// The many-QP peer (`RDMAKIT_TEST_PEER=many`): prints `MR <region>` and `MANY` endpoints
/// of QPs left unconnected, reads as many endpoints, and connects its QPs only when the
/// client says `GO` (after the client connected its QPs and posted on them); then prints
/// `CONNECTED` and idles until its stdin closes.
fn many_qps_peer_process() {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(1024).unwrap();
    let mr = pd.alloc_mr(8 * MANY, AccessFlags::ALL_REMOTE).unwrap();
    let qps: Vec<QueuePair> = (0..MANY).map(|_| pd.create_qp(&cq, &cq, QpCaps::default()).unwrap()).collect();
    let mut out = std::io::stdout();
    writeln!(out, "MR {}", hex(&mr.remote().encode())).unwrap();
    for qp in &qps {
        qp.modify_to_init(&patient_opts()).unwrap();
        writeln!(out, "EP {}", hex(&qp.address().unwrap().encode())).unwrap();
    }
    out.flush().unwrap();
    let mut stdin = BufReader::new(std::io::stdin());
    let mut line = String::new();
    let mut theirs = Vec::new();
    while theirs.len() < MANY {
        line.clear();
        stdin.read_line(&mut line).unwrap();
        theirs.push(QpAddress::decode(&unhex(line.trim().strip_prefix("EP ").unwrap())).unwrap());
    }
    line.clear();
    stdin.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "GO");
    for (qp, ep) in qps.iter().zip(&theirs) {
        qp.connect(ep, &patient_opts()).unwrap();
    }
    writeln!(out, "CONNECTED").unwrap();
    out.flush().unwrap();
    while stdin.read_line(&mut line).unwrap_or(0) > 0 {}
    drop(mr);
}

/// A host connecting more QPs than the peer device keeps waiting (256) and posting on them
/// before the peer connected any of its own: the peer closes the links over its bound, and
/// each dials again (rings first, then TCP) until the peer's QPs are connected. Before, the
/// rest failed with `RETRY_EXC_ERR`: 44 of 300 over TCP, and over the rings (which did not
/// dial again) as many, which is also how `rdmakit-perf scaling --pairs 1024` failed.
fn more_qps_than_the_peer_keeps_waiting_all_get_through_across_processes(path: Path) {
    let mut child = peer_in_role("many", path).spawn().expect("spawn the peer process");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let mut mr = None;
    let mut eps = Vec::new();
    while eps.len() < MANY {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "peer exited early");
        if let Some(m) = line.trim().strip_prefix("MR ") {
            mr = Some(RemoteRegion::decode(&unhex(m)).unwrap());
        } else if let Some(e) = line.trim().strip_prefix("EP ") {
            eps.push(QpAddress::decode(&unhex(e)).unwrap());
        }
    }
    let mr = mr.expect("the peer's region");
    let ctx = Context::open_soft_with(path.config()).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(1024).unwrap();
    let src = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, b"through!").unwrap();
    let mut msg = String::new();
    let qps: Vec<QueuePair> = eps
        .iter()
        .enumerate()
        .map(|(i, ep)| {
            let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
            qp.connect(ep, &patient_opts()).unwrap();
            qp.post_send(
                SendWr::write(src.local().unwrap(), mr.slice(8 * i as u64, 8).unwrap()).wr_id(i as u64),
            )
            .unwrap();
            msg += &format!("EP {}\n", hex(&qp.address().unwrap().encode()));
            qp
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let stdin = child.stdin.as_mut().unwrap();
    writeln!(stdin, "{msg}GO").unwrap();
    stdin.flush().unwrap();
    let mut failed = Vec::new();
    for _ in 0..qps.len() {
        let wc = cq.wait(Some(Duration::from_secs(30))).expect("every write completes");
        if !wc.status.is_success() {
            failed.push((wc.wr_id, wc.status));
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(failed.is_empty(), "{path:?}: {} of {MANY} writes failed: {failed:?}", failed.len());
}
