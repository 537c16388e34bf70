//! Hostile peers against `rdmakit-perf`'s servers and clients: each test plays a peer that
//! sends what the real one never would, with `rdmakit_verbs::cm` directly.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdmakit_verbs::cm::{self, CmOptions};
use rdmakit_verbs::{AccessFlags, Context, RemoteRegion};

const BIN: &str = env!("CARGO_BIN_EXE_rdmakit-perf");

/// Starts `args` (a `--server 127.0.0.1:0` run) and returns it with its address; the rest of
/// its stderr is collected by a thread whose handle is returned.
fn server(args: &[&str]) -> (Child, SocketAddr, std::thread::JoinHandle<String>) {
    let mut child =
        Command::new(BIN).args(args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("server");
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    let addr = line.split_whitespace().find_map(|w| w.parse::<SocketAddr>().ok()).expect(&line);
    let rest = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    (child, addr, rest)
}

/// Waits up to `limit` for `child` to exit; kills it and returns `None` if it does not.
fn exits_within(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// A perftest request as `rig::Params::encode` lays it out (25 bytes), then the client's buffer.
#[allow(clippy::too_many_arguments)]
fn request(
    test: u8,
    size: u32,
    iters: u32,
    window: u32,
    qps: u8,
    flags: u8,
    duration: u16,
    margin: u8,
    buf: &RemoteRegion,
) -> Vec<u8> {
    let mut b = vec![test, 0];
    b.extend_from_slice(&size.to_le_bytes());
    b.extend_from_slice(&iters.to_le_bytes());
    b.extend_from_slice(&window.to_le_bytes());
    b.extend_from_slice(&512u16.to_le_bytes()); // rx depth
    b.extend_from_slice(&0u16.to_le_bytes()); // inline
    b.push(qps);
    b.push(flags);
    b.extend_from_slice(&duration.to_le_bytes());
    b.push(margin);
    b.extend_from_slice(&0u16.to_le_bytes()); // cq mod
    assert_eq!(b.len(), 25);
    b.extend_from_slice(&buf.encode());
    b
}

const WRITE_BW: u8 = 1;
const BIDIR: u8 = 1;

fn cm_opts() -> CmOptions {
    CmOptions::default().with_cqe(4096).with_timeout(Duration::from_secs(10))
}

/// A client that asks for two QPs, connects one and goes away: the server must not wait
/// for the second one forever.
#[test]
fn a_client_that_connects_fewer_qps_than_it_asked_for_does_not_hang_the_server() {
    let (mut srv, addr, err) = server(&["write-bw", "--server", "127.0.0.1:0"]);
    {
        let pd = Context::open_soft().alloc_pd().unwrap();
        let buf = pd.alloc_mr(1 << 16, AccessFlags::ALL_REMOTE).unwrap();
        let req = request(WRITE_BW, 65536, 100, 16, 2, 0, 0, 0, &buf.remote());
        let conn = cm::connect(&pd, addr, &cm_opts(), &req).expect("the first QP connects");
        conn.disconnect().unwrap();
    } // the client is gone
    // It waits 10 s for each next QP.
    let status = exits_within(&mut srv, Duration::from_secs(60));
    let said = err.join().unwrap();
    assert!(
        status.is_some(),
        "the server still waits for the second QP 60 s after its only client went away; it said:\n{said}"
    );
    assert!(said.contains("asked for 2 QPs and connected 1"), "{said}");
}

/// A request the server must refuse at the handshake: the client's connection is
/// rejected, and the server says why, does not panic, and waits for the next client.
fn refused_at_the_handshake(req: impl FnOnce(&RemoteRegion) -> Vec<u8>, buf_len: usize, why: &str) {
    let (mut srv, addr, err) = server(&["write-bw", "--server", "127.0.0.1:0"]);
    let pd = Context::open_soft().alloc_pd().unwrap();
    let buf = pd.alloc_mr(buf_len, AccessFlags::ALL_REMOTE).unwrap();
    let r = cm::connect(&pd, addr, &cm_opts(), &req(&buf.remote()));
    assert!(r.is_err(), "the server accepted a request it must refuse ({why})");
    std::thread::sleep(Duration::from_millis(500));
    let alive = srv.try_wait().unwrap().is_none();
    let _ = srv.kill();
    let _ = srv.wait();
    let said = err.join().unwrap();
    assert!(!said.contains("panicked"), "the server panicked:\n{said}");
    assert!(alive, "the server ended after one bad client:\n{said}");
    assert!(said.contains(why), "the server did not say why ({why}):\n{said}");
}

/// A bidirectional client whose buffer is smaller than the report area (64 bytes): the
/// server refuses it, instead of panicking on `len - 64` once the test ran.
#[test]
fn a_bidirectional_client_with_a_tiny_buffer_is_refused_not_a_panic() {
    refused_at_the_handshake(|b| request(WRITE_BW, 8, 5, 1, 1, BIDIR, 0, 0, b), 32, "under the report's 64");
}

/// A timed run whose duration is not more than twice the margin (the CLI refuses it; a
/// client may send it anyway): refused, instead of a sample window that wraps.
#[test]
fn a_timed_run_with_margins_wider_than_the_duration_is_refused_not_a_panic() {
    // 3 s with 2 s margins: the window's end (1 s) comes before its start (2 s).
    refused_at_the_handshake(|b| request(WRITE_BW, 8, 5, 1, 1, BIDIR, 3, 2, b), 1 << 16, "twice the margin");
}

/// Stray connections (a port scan, a health check: TCP opened and closed) do not end a
/// server: the real client that comes next is served. The listener drops them itself,
/// before any request (logged at debug level), so the server has nothing to say of them.
#[test]
fn a_stray_connection_does_not_end_the_server() {
    let (mut srv, addr, err) = server(&["write-bw", "--server", "127.0.0.1:0"]);
    for _ in 0..3 {
        drop(TcpStream::connect(addr).unwrap());
    }
    let out = Command::new(BIN)
        .args(["write-bw", "--connect", &addr.to_string(), "-n", "20", "--json"])
        .output()
        .unwrap();
    let status = exits_within(&mut srv, Duration::from_secs(30));
    let said = err.join().unwrap();
    assert!(
        out.status.success(),
        "the client after the stray connections: {}\nserver:\n{said}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(status.is_some_and(|s| s.success()), "{status:?}\n{said}");
    assert!(!said.contains("failed before its test began"), "{said}");
}

/// A connection that opens and then says nothing (which held the server's handshakes for
/// the CM's 30 s when they were read one at a time) does not delay the real client that
/// comes after it.
#[test]
fn a_silent_connection_does_not_hold_the_server() {
    let (mut srv, addr, err) = server(&["write-bw", "--server", "127.0.0.1:0"]);
    let silent = TcpStream::connect(addr).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    let out = Command::new(BIN)
        .args(["write-bw", "--connect", &addr.to_string(), "-n", "20", "--json"])
        .output()
        .unwrap();
    let took = start.elapsed();
    let status = exits_within(&mut srv, Duration::from_secs(30));
    let said = err.join().unwrap();
    drop(silent);
    assert!(
        out.status.success(),
        "the client behind a silent connection: {}\nserver:\n{said}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(status.is_some_and(|s| s.success()), "{status:?}\n{said}");
    assert!(took < Duration::from_secs(20), "the client waited {took:?} behind a silent connection");
}

/// A transfer receiver that announces slots of 4 GiB - 1 bytes (the CLI's own limit is
/// 1 GiB): the sender must refuse the ring, not allocate `slot x window` bytes for it.
#[test]
fn a_transfer_receiver_cannot_make_the_sender_allocate_gigabytes() {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let listener = cm::Listener::bind(&ctx, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let ring = pd.alloc_mr(4096, AccessFlags::ALL_REMOTE).unwrap();
    let flags = pd.alloc_mr(64, AccessFlags::ALL_REMOTE).unwrap();
    let (slot, slots) = (u32::MAX, 4u32);
    let mut info = b"RKXF\x01".to_vec();
    info.extend_from_slice(&slot.to_le_bytes());
    info.extend_from_slice(&slots.to_le_bytes());
    // The descriptor's length is the receiver's word: it claims the whole ring.
    let r = ring.remote();
    info.extend_from_slice(&RemoteRegion::new(r.addr, u64::from(slot) * u64::from(slots), r.rkey).encode());
    info.extend_from_slice(&flags.remote().encode());
    let fake = std::thread::spawn(move || {
        let conn = listener.accept(&pd, &cm_opts(), &info);
        std::thread::sleep(Duration::from_secs(3));
        drop(conn);
    });
    // The sender in 6 GiB of address space: plenty for a transfer of 2 MiB chunks.
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v 6291456; exec {BIN} transfer --connect {addr} --bytes 1MiB"))
        .output()
        .unwrap();
    fake.join().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        said.contains("protocol"),
        "the sender took a ring of {slots} slots of {slot} bytes instead of refusing it:\n{said}"
    );
}

/// `cmd` (the binary, or a wrapper running it) started as a receiver waiting for its
/// sender, with the web gauge on: the process, the gauge's address, and the thread draining
/// its stderr.
fn gauge_server(mut cmd: Command) -> (Child, String, std::thread::JoinHandle<std::io::Result<()>>) {
    let mut child = cmd
        .args(["transfer", "--server", "127.0.0.1:0", "--gauge-http", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut gauge = None;
    for _ in 0..4 {
        let mut line = String::new();
        err.read_line(&mut line).unwrap();
        if let Some(g) = line.trim().strip_prefix("rdmakit-perf: gauge at http://") {
            gauge = Some(g.trim_end_matches('/').to_owned());
            break;
        }
    }
    let t = std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()).map(drop));
    (child, gauge.expect("the gauge's address"), t)
}

/// The gauge holds a client for at most a few seconds until its request is complete:
/// 64 clients that trickle their request a byte at a time must not lock everyone else out.
#[test]
fn slow_gauge_clients_do_not_lock_out_the_others() {
    // A receiver waiting for its sender keeps the gauge up for as long as the test needs.
    let (mut srv, gauge, _err) = gauge_server(Command::new(BIN));
    let mut slow: Vec<TcpStream> = (0..64).map(|_| TcpStream::connect(&gauge).unwrap()).collect();
    // One byte each every 2 s (under the gauge's 5 s read timeout), for 12 s.
    let head = b"GET / HTTP/1.1\r\nHost: x\r\n";
    for i in 0..6 {
        for s in &mut slow {
            let _ = s.write_all(&head[i..i + 1]);
        }
        std::thread::sleep(Duration::from_secs(2));
    }
    let mut s = TcpStream::connect(&gauge).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    let _ = srv.kill();
    let _ = srv.wait();
    assert!(
        resp.starts_with("HTTP/1.1 200"),
        "12 s after 64 clients started trickling, the page is refused: {:?}",
        resp.lines().next()
    );
}

/// CPU seconds the process `pid` has used (utime + stime from /proc, at 100 ticks a second).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) start at state, field 3.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    (f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()) as f64 / 100.0
}

/// A gauge whose process is out of file descriptors (clients keep connecting) must not spin
/// a core on the failing `accept`: it waits before trying again.
#[test]
fn a_gauge_out_of_descriptors_does_not_spin() {
    let mut prlimit = Command::new("prlimit");
    prlimit.args(["--nofile=40", BIN]);
    let (mut child, gauge, _err) = gauge_server(prlimit);
    // More silent clients than the process has descriptors left: the rest wait in the
    // listener's backlog, and each accept fails with EMFILE.
    let _clients: Vec<TcpStream> = (0..60).filter_map(|_| TcpStream::connect(&gauge).ok()).collect();
    std::thread::sleep(Duration::from_millis(500));
    let before = cpu_seconds(child.id());
    std::thread::sleep(Duration::from_secs(2));
    let used = cpu_seconds(child.id()) - before;
    let _ = child.kill();
    let _ = child.wait();
    assert!(used < 0.5, "the gauge used {used:.2} s of CPU in 2 s while out of descriptors");
}

const PIPE_LAT: u8 = 8;
const PIPE_BW: u8 = 9;

/// A pipe test on several QPs (the CLI refuses it; a client may send it anyway, and each
/// QP's ring was the client's to size): refused at the handshake.
#[test]
fn a_pipe_test_on_several_qps_is_refused() {
    refused_at_the_handshake(|b| request(PIPE_BW, 8 << 20, 5, 1000, 2, 0, 0, 0, b), 1 << 16, "several QPs");
}

/// A second QP asking for other parameters than the first (which the server runs on every
/// QP): here a small buffer without the bidirectional flag, while the first asked for a
/// bidirectional run, whose report needs 64 bytes. Refused, where it used to panic.
#[test]
fn a_second_qp_with_other_parameters_than_the_first_is_refused() {
    let (mut srv, addr, err) = server(&["write-bw", "--server", "127.0.0.1:0"]);
    let pd = Context::open_soft().alloc_pd().unwrap();
    let big = pd.alloc_mr(1 << 16, AccessFlags::ALL_REMOTE).unwrap();
    let tiny = pd.alloc_mr(32, AccessFlags::ALL_REMOTE).unwrap();
    let first =
        cm::connect(&pd, addr, &cm_opts(), &request(WRITE_BW, 8, 5, 1, 2, BIDIR, 0, 0, &big.remote()));
    let _first = first.expect("the first QP connects");
    let _second = cm::connect(&pd, addr, &cm_opts(), &request(WRITE_BW, 8, 5, 1, 2, 0, 0, 0, &tiny.remote()));
    let status = exits_within(&mut srv, Duration::from_secs(30));
    let said = err.join().unwrap();
    assert!(!said.contains("panicked"), "the server panicked:\n{said}");
    assert!(status.is_some_and(|s| !s.success()), "the server went on:\n{said}");
    assert!(said.contains("other parameters than QP 1"), "{said}");
}

/// A pipe-lat client against a fresh `pipe-lat` server: runs `behave` on its pipe and
/// buffer, then waits up to 60 s, its runtime (and so its pipe's keep-alives) running, for
/// the server to end; returns whether it did, and what it said.
fn pipe_lat_client(
    iters: u32,
    behave: impl AsyncFnOnce(&rdmakit_channel::Pipe, &rdmakit_verbs::MemoryRegion),
) -> (Option<std::process::ExitStatus>, String) {
    use rdmakit_channel::{NotifyMode, Pipe, PipeConfig};
    let (mut srv, addr, err) = server(&["pipe-lat", "--server", "127.0.0.1:0"]);
    let pd = Context::open_soft().alloc_pd().unwrap();
    let buf = pd.alloc_mr(1 << 16, AccessFlags::ALL_REMOTE).unwrap();
    let caps = rdmakit_verbs::QpCaps::default()
        .with_max_send_wr(256)
        .with_max_recv_wr(168)
        .with_max_inline_data(256);
    let opts = cm_opts().with_caps(caps);
    let conn =
        cm::connect(&pd, addr, &opts, &request(PIPE_LAT, 8, iters, 1, 1, 0, 0, 0, &buf.remote())).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let config = PipeConfig::default().with_notify(NotifyMode::WriteImm);
    let pipe =
        rt.block_on(Pipe::connect(conn.qp().clone(), conn.cq().clone(), config)).expect("the pipe's hello");
    let status = rt.block_on(async {
        behave(&pipe, &buf).await;
        let started = Instant::now();
        loop {
            if let Some(s) = srv.try_wait().unwrap() {
                break Some(s);
            }
            if started.elapsed() > Duration::from_secs(60) {
                let _ = srv.kill();
                let _ = srv.wait();
                break None;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    drop((pipe, conn));
    (status, err.join().unwrap())
}

/// A pipe-lat client that completes the pipe's hello and then sends nothing, its process
/// alive (its pipe answers keep-alives): the server gives up after 30 s, as every other
/// server loop does, instead of waiting for ever.
#[test]
fn a_silent_pipe_client_does_not_hold_the_server_for_ever() {
    let (status, said) = pipe_lat_client(1000, async |_, _| {});
    assert!(status.is_some(), "the server still waits for a silent client after 60 s:\n{said}");
    assert!(said.contains("timed out") || said.contains("Timeout"), "{said}");
}

const SEND_BW: u8 = 4;

/// A send-bw client that writes with immediate into the server's buffer (its descriptor
/// comes with the answer) instead of sending: the completion is a receive's, not a send's,
/// and the server, which posts no sends, took it for one and panicked (`clamp(1, 0)`). It
/// must say what the client did instead.
#[test]
fn a_write_with_immediate_into_a_send_test_is_an_error_not_a_panic() {
    use rdmakit_verbs::SendWr;
    let (mut srv, addr, err) = server(&["send-bw", "--server", "127.0.0.1:0"]);
    let pd = Context::open_soft().alloc_pd().unwrap();
    let buf = pd.alloc_mr(1 << 16, AccessFlags::ALL_REMOTE).unwrap();
    let conn = cm::connect(&pd, addr, &cm_opts(), &request(SEND_BW, 8, 1000, 16, 1, 0, 0, 0, &buf.remote()))
        .expect("the client connects");
    let theirs = RemoteRegion::decode(&conn.peer_private_data()[..RemoteRegion::ENCODED_LEN]).unwrap();
    let wr = SendWr::write(buf.slice(0, 8).unwrap(), theirs.slice(0, 8).unwrap()).with_imm(7);
    conn.qp().post_send(wr).unwrap();
    assert!(conn.cq().wait(Some(Duration::from_secs(10))).unwrap().status.is_success());
    let status = exits_within(&mut srv, Duration::from_secs(60));
    drop(conn);
    let said = err.join().unwrap();
    assert!(!said.contains("panicked"), "the server panicked:\n{said}");
    assert!(status.is_some(), "the server still runs 60 s later:\n{said}");
    assert!(said.contains("RECV_RDMA_WITH_IMM"), "the server did not say what came:\n{said}");
}

/// A pipe-lat client that sends its pings but never takes the server's answers (its process
/// alive, its pipe answering keep-alives): the server's answers run out of credit, and it
/// waited for credit for ever, busy polling. It gives up after 30 s, as its other waits do.
#[test]
fn a_pipe_client_that_never_takes_its_answers_does_not_hold_the_server_for_ever() {
    let (status, said) = pipe_lat_client(100_000, async |pipe, buf| {
        // More pings than the server has credit for answers; none of its answers taken.
        for _ in 0..1000 {
            let ping = buf.slice(0, 8).unwrap();
            if tokio::time::timeout(Duration::from_secs(5), pipe.rwrite(ping)).await.is_err() {
                break; // the server stopped taking pings: it waits for credit
            }
        }
    });
    assert!(status.is_some(), "the server still waits for credit 60 s later:\n{said}");
    assert!(said.contains("timed out") || said.contains("Timeout"), "{said}");
}
