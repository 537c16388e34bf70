//! The connection tests need rdma_cm, which needs an RDMA-capable kernel: they run in
//! the rxe VM (`scripts/rxe-vm.sh <test binary> rdma::cm`, which sets
//! `RDMAKIT_RXE_IP`) and print "skipped" elsewhere.

use std::net::IpAddr;
use std::thread;

use super::connector::CmConnector;
use super::listener::CmListener;
use super::*;
use crate::raw::{RawOp, RawSendWr, Sge};
use crate::rdma::{Context, Cq, Pd};
use crate::types::{QpCaps, QpState};
use crate::wc::WorkCompletion;

const T: Duration = Duration::from_secs(20);

fn rxe_ip() -> Option<IpAddr> {
    match std::env::var("RDMAKIT_RXE_IP") {
        Ok(ip) => Some(ip.parse().expect("RDMAKIT_RXE_IP is an IP address")),
        Err(_) => {
            eprintln!("skipped: RDMAKIT_RXE_IP is unset (rdma_cm tests run in scripts/rxe-vm.sh)");
            None
        }
    }
}

/// A device's PD, CQ and QP (fields drop in order: the QP before its CQ).
struct Side {
    qp: Qp,
    cq: Cq,
    pd: Pd,
    _ctx: Context,
}

fn side(device: &str) -> Side {
    let ctx = Context::open(Some(device)).expect("open device");
    let pd = ctx.alloc_pd().expect("pd");
    let cq = ctx.create_cq(64).expect("cq");
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
    Side { qp, cq, pd, _ctx: ctx }
}

fn poll_one(cq: &Cq) -> WorkCompletion {
    let start = Instant::now();
    let mut wcs = [WorkCompletion::default(); 1];
    loop {
        if cq.poll(&mut wcs).expect("poll") == 1 {
            return wcs[0];
        }
        assert!(start.elapsed() < T, "no completion within {T:?}");
        thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn private_data_length_fits_its_field() {
    assert_eq!(data_len(&[0; 255]).unwrap(), 255);
    assert!(matches!(data_len(&[0; 256]), Err(Error::InvalidArgument(_))));
}

#[test]
fn sockaddr_round_trip() {
    for addr in ["10.77.0.1:7471", "[fe80::1]:9"] {
        let addr: SocketAddr = addr.parse().unwrap();
        assert_eq!(from_sockaddr(&to_sockaddr(addr)).unwrap(), addr);
    }
}

#[test]
fn no_rdma_kernel_is_no_device() {
    if std::env::var_os("RDMAKIT_RXE_IP").is_some() {
        return;
    }
    // Only meaningful on a host whose kernel has no RDMA (like the dev machines).
    if !matches!(crate::rdma::device_names(), Err(Error::NoDevice { .. })) {
        eprintln!("skipped: this host has RDMA support");
        return;
    }
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let e = CmListener::bind(addr, 1).err().expect("bind must fail without RDMA");
    assert!(matches!(e, Error::NoDevice { .. }), "{e}");
    let e = CmConnector::resolve(addr, Duration::from_secs(1), None).err().expect("resolve must fail");
    assert!(matches!(e, Error::NoDevice { .. }), "{e}");
}

/// Connect, exchange private data both ways, RDMA-write from the connector into the
/// acceptor's buffer (address and rkey in the acceptor's private data), disconnect.
#[test]
fn connect_write_disconnect() {
    let Some(ip) = rxe_ip() else { return };
    let listener = CmListener::bind(SocketAddr::new(ip, 0), 8).expect("bind");
    let addr = listener.local_addr().expect("local_addr");
    assert_eq!(addr.ip(), ip);
    assert_ne!(addr.port(), 0);
    let dev = listener.device_name().expect("bound to a device");
    if let Ok(want) = std::env::var("RDMAKIT_RXE_DEV") {
        assert_eq!(dev, want);
    }
    const CLIENT_HELLO: &[u8] = b"rdmakit client hello";
    const PAYLOAD: &[u8] = b"written through rdma_cm";

    let server = thread::spawn(move || {
        let req = listener.get_request(Some(T)).expect("get_request");
        let data = req.private_data();
        assert_eq!(&data[..CLIENT_HELLO.len()], CLIENT_HELLO);
        assert!(data[CLIENT_HELLO.len()..].iter().all(|b| *b == 0), "padding is zeros");
        let s = side(&req.device_name());
        let mut buf = vec![0u8; 4096];
        // SAFETY: `buf` outlives the region (dropped at the end of this closure, after
        // the region, which is declared later).
        let mr = unsafe { s.pd.reg_mr(buf.as_mut_ptr(), buf.len(), AccessFlags::ALL_REMOTE) }.expect("mr");
        let mut reply = Vec::new();
        reply.extend_from_slice(b"RKW1");
        reply.extend_from_slice(&(buf.as_ptr() as u64).to_le_bytes());
        reply.extend_from_slice(&mr.rkey().to_le_bytes());
        let conn =
            req.accept(&s.qp, &ConnectOptions::default(), &reply, Some(T), &mut || Ok(())).expect("accept");
        assert!(conn.wait_disconnected(T).expect("wait_disconnected"), "saw DISCONNECTED");
        // The write was acknowledged before the peer disconnected.
        // SAFETY: `buf` is live; volatile reads because the NIC wrote it.
        let got: Vec<u8> =
            (0..PAYLOAD.len()).map(|i| unsafe { ptr::read_volatile(buf.as_ptr().add(i)) }).collect();
        assert_eq!(got, PAYLOAD);
        assert!(conn.wait_disconnected(Duration::ZERO).unwrap(), "stays disconnected");
        drop(mr);
        drop(buf);
    });

    let connector = CmConnector::resolve(addr, T, None).expect("resolve");
    assert_eq!(connector.device_name(), dev);
    let c = side(&connector.device_name());
    let mut src = PAYLOAD.to_vec();
    // SAFETY: `src` outlives the region (dropped explicitly below).
    let mr = unsafe { c.pd.reg_mr(src.as_mut_ptr(), src.len(), AccessFlags::LOCAL_WRITE) }.expect("mr");
    let (conn, reply) =
        connector.connect(&c.qp, &ConnectOptions::default(), CLIENT_HELLO, T).expect("connect");
    assert_eq!(&reply[..4], b"RKW1", "acceptor's private data");
    let remote_addr = u64::from_le_bytes(reply[4..12].try_into().unwrap());
    let rkey = u32::from_le_bytes(reply[12..16].try_into().unwrap());
    assert!(reply[16..].iter().all(|b| *b == 0));
    let wr = RawSendWr {
        wr_id: 7,
        op: RawOp::Write { imm: None },
        sge: Some(Sge { addr: src.as_ptr() as u64, len: src.len() as u32, lkey: mr.lkey() }),
        inline: None,
        remote_addr,
        rkey,
        signaled: true,
        fence: false,
        solicited: false,
    };
    c.qp.post_send(&[wr]).map_err(|(_, e)| e).expect("post_send");
    let wc = poll_one(&c.cq);
    assert!(wc.status.is_success(), "write completed with {:?}", wc.status);
    assert_eq!(wc.wr_id, 7);

    conn.disconnect().expect("disconnect");
    conn.disconnect().expect("disconnect is idempotent");
    assert!(conn.wait_disconnected(T).expect("wait_disconnected"), "local side sees DISCONNECTED too");
    server.join().expect("acceptor thread");
    drop(conn);
    drop(c);
    drop(mr);
    drop(src);
}

/// A rejected connect fails with `ConnectionRejected` carrying the rejecter's private
/// data; an oversize reject is refused (and the dropped request rejected without data).
#[test]
fn reject_carries_private_data() {
    let Some(ip) = rxe_ip() else { return };
    let listener = CmListener::bind(SocketAddr::new(ip, 0), 8).expect("bind");
    let addr = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let req = listener.get_request(Some(T)).expect("get_request");
        assert!(matches!(req.reject(&[0; 256]), Err(Error::InvalidArgument(_))));
        // The oversize reject consumed (and rejected) the request; answer the next one.
        let req = listener.get_request(Some(T)).expect("second get_request");
        req.reject(b"go away").expect("reject");
    });
    for attempt in 0..2 {
        let connector = CmConnector::resolve(addr, T, None).expect("resolve");
        let c = side(&connector.device_name());
        let start = Instant::now();
        let e = connector.connect(&c.qp, &ConnectOptions::default(), b"hi", T).err().expect("rejected");
        assert!(start.elapsed() < Duration::from_secs(10), "rejected quickly");
        let Error::ConnectionRejected { reason, private_data } = &e else { panic!("{e}") };
        assert!(reason.contains("RDMA_CM_EVENT_REJECTED"), "{reason}");
        if attempt == 1 {
            assert!(reason.contains("status 28"), "{reason}");
            assert_eq!(&private_data[..7], b"go away");
        }
        eprintln!("attempt {attempt}: {e}");
    }
    server.join().unwrap();
}

/// A wildcard listener (no device until a request arrives), timeouts, and the
/// acceptor disconnecting first.
#[test]
fn wildcard_listener_acceptor_disconnects() {
    let Some(ip) = rxe_ip() else { return };
    let any =
        if ip.is_ipv4() { IpAddr::from(Ipv4Addr::UNSPECIFIED) } else { IpAddr::from(Ipv6Addr::UNSPECIFIED) };
    let listener = CmListener::bind(SocketAddr::new(any, 0), 8).expect("bind");
    assert_eq!(listener.device_name(), None);
    let port = listener.local_addr().expect("local_addr").port();
    assert_ne!(port, 0);
    let start = Instant::now();
    let e = listener.get_request(Some(Duration::from_millis(200))).err().expect("nobody connects");
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    assert!(start.elapsed() < Duration::from_secs(5));

    let (go, wait_go) = std::sync::mpsc::channel::<()>();
    let server = thread::spawn(move || {
        let req = listener.get_request(Some(T)).expect("get_request");
        let s = side(&req.device_name());
        let conn =
            req.accept(&s.qp, &ConnectOptions::default(), b"srv", Some(T), &mut || Ok(())).expect("accept");
        assert_eq!(s.qp.state(), QpState::ReadyToSend);
        wait_go.recv().unwrap();
        conn.disconnect().expect("disconnect");
        assert!(conn.wait_disconnected(T).unwrap(), "acceptor sees its own disconnect complete");
    });
    let connector = CmConnector::resolve(SocketAddr::new(ip, port), T, None).expect("resolve");
    let c = side(&connector.device_name());
    let (conn, reply) = connector.connect(&c.qp, &ConnectOptions::default(), b"", T).expect("connect");
    assert_eq!(&reply[..3], b"srv");
    assert_eq!(c.qp.state(), QpState::ReadyToSend);
    assert!(!conn.wait_disconnected(Duration::from_millis(100)).unwrap(), "still connected");
    go.send(()).unwrap();
    assert!(conn.wait_disconnected(T).unwrap(), "connector sees the peer's disconnect");
    assert!(conn.wait_disconnected(Duration::ZERO).unwrap());
    conn.disconnect().expect("disconnect after the peer did");
    server.join().expect("acceptor thread");
}

/// Nobody listens: a typed error within seconds, not a hang.
#[test]
fn connect_without_listener_fails_fast() {
    let Some(ip) = rxe_ip() else { return };
    // A port that was free a moment ago.
    let port = {
        let l = CmListener::bind(SocketAddr::new(ip, 0), 1).expect("bind");
        l.local_addr().unwrap().port()
    };
    let connector = CmConnector::resolve(SocketAddr::new(ip, port), T, None).expect("resolve");
    let c = side(&connector.device_name());
    let start = Instant::now();
    let e = connector.connect(&c.qp, &ConnectOptions::default(), b"anyone?", T).err().expect("no listener");
    let took = start.elapsed();
    eprintln!("no listener: {e} after {took:?}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    match &e {
        Error::ConnectionRejected { reason, .. } => assert!(reason.contains("REJECTED"), "{reason}"),
        Error::Os { source, .. } => {
            let msg = source.to_string();
            assert!(msg.contains("UNREACHABLE") || msg.contains("CONNECT_ERROR"), "{msg}")
        }
        e => panic!("unexpected error {e}"),
    }
}

/// An address no route leads to: an error within the timeout, not a hang.
#[test]
fn unroutable_address_fails_in_time() {
    if rxe_ip().is_none() {
        return;
    }
    let start = Instant::now();
    let e = CmConnector::resolve("192.0.2.1:7471".parse().unwrap(), Duration::from_secs(3), None)
        .err()
        .expect("TEST-NET-1 is not routable in the VM");
    let took = start.elapsed();
    eprintln!("unroutable: {e} after {took:?}");
    assert!(took < Duration::from_secs(6), "took {took:?}");
    assert!(matches!(e, Error::Os { .. } | Error::Timeout(_) | Error::NoDevice { .. }), "{e}");
}

#[test]
fn oversize_private_data_is_invalid() {
    let Some(ip) = rxe_ip() else { return };
    let connector = CmConnector::resolve(SocketAddr::new(ip, 9), T, None).expect("resolve");
    let c = side(&connector.device_name());
    let e = connector.connect(&c.qp, &ConnectOptions::default(), &[1; 256], T).err().expect("too long");
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}

/// The async calls: the listener's and both ids' event channels awaited through tokio's
/// `AsyncFd`; two connections handshake at once, and a listener wait is cancelled
/// (dropped) without losing the request that comes after.
#[cfg(feature = "async")]
#[test]
fn async_accept_and_connect() {
    let Some(ip) = rxe_ip() else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let listener = std::sync::Arc::new(CmListener::bind(SocketAddr::new(ip, 0), 8).expect("bind"));
        let addr = listener.local_addr().expect("local_addr");
        // A cancelled wait takes nothing.
        let waited = tokio::time::timeout(Duration::from_millis(100), listener.get_request_async()).await;
        assert!(waited.is_err(), "nobody connected yet");
        let server = tokio::spawn({
            let listener = listener.clone();
            async move {
                let mut accepted = Vec::new();
                for _ in 0..2 {
                    let req = listener.get_request_async().await.expect("get_request_async");
                    let s = side(&req.device_name());
                    let conn =
                        tokio::time::timeout(T, req.accept_async(&s.qp, &ConnectOptions::default(), b"srv"))
                            .await
                            .expect("accept in time")
                            .expect("accept_async");
                    assert_eq!(s.qp.state(), QpState::ReadyToSend);
                    accepted.push((conn, s));
                }
                accepted
            }
        });
        let connect = |hello: &'static [u8]| async move {
            let connector = tokio::time::timeout(T, CmConnector::resolve_async(addr, T, None))
                .await
                .unwrap()
                .expect("resolve");
            let c = side(&connector.device_name());
            let (conn, reply) =
                tokio::time::timeout(T, connector.connect_async(&c.qp, &ConnectOptions::default(), hello))
                    .await
                    .unwrap()
                    .expect("connect_async");
            assert_eq!(&reply[..3], b"srv");
            assert_eq!(c.qp.state(), QpState::ReadyToSend);
            (conn, c)
        };
        let (a, b) = tokio::join!(connect(b"one"), connect(b"two"));
        let accepted = server.await.expect("acceptor task");
        assert_eq!(accepted.len(), 2);
        for (conn, _) in [a, b] {
            conn.disconnect().expect("disconnect");
        }
        for (conn, _) in &accepted {
            assert!(conn.wait_disconnected(T).unwrap(), "acceptor sees the disconnect");
        }
    });
}
