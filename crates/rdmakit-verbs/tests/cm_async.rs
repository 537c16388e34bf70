//! The async front door of `cm` on the soft provider: handshakes run concurrently, so a
//! silent or hostile client delays no other, is dropped within its budget, and the number
//! of handshakes in progress is bounded.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

mod common;

use rdmakit_verbs::cm::{AsyncListener, CmOptions, connect_async};
use rdmakit_verbs::{AccessFlags, Context, SendWr};

fn opts(timeout: Duration) -> CmOptions {
    CmOptions::default().with_timeout(timeout)
}

async fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Three clients open TCP connections and send nothing, each holding a handshake for its
/// 30 s budget; a real client connecting after them is accepted at once (a serial accept
/// would wait out the first silent one), and the connection works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_client_does_not_delay_another() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let o = opts(Duration::from_secs(30));
    let listener = AsyncListener::bind(&pd, "127.0.0.1:0".parse().unwrap(), &o, b"srv").unwrap();
    let addr = listener.local_addr();
    let silent: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // Let the listener take the silent connections first.
    tokio::time::sleep(Duration::from_millis(200)).await;

    let start = Instant::now();
    let client = tokio::spawn({
        let (pd, o) = (pd.clone(), o);
        async move { connect_async(&pd, addr, &o, b"cli").await }
    });
    let conn = listener.accept().await.unwrap();
    let took = start.elapsed();
    let cconn = client.await.unwrap().unwrap();
    eprintln!("accepted a client behind 3 silent ones in {took:?}");
    // Liveness bound, far below the silent clients' 30 s budget.
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert_eq!(conn.peer_private_data(), b"cli");
    assert_eq!(cconn.peer_private_data(), b"srv");
    assert_eq!(listener.failed_handshakes(), 0);

    // The connection carries data.
    let dst = pd.alloc_mr(8, AccessFlags::ALL_REMOTE).unwrap();
    let src = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, b"rdmakit!").unwrap();
    cconn.qp().post_send(SendWr::write(src.local().unwrap(), dst.remote().slice(0, 8).unwrap())).unwrap();
    cconn.cq().next().await.unwrap().ok().unwrap();
    assert_eq!(dst.to_vec().unwrap(), b"rdmakit!");
    drop(silent);
}

/// A silent client is dropped when its budget runs out: the listener closes its socket
/// and counts the failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_client_is_dropped_after_its_budget() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let listener =
        AsyncListener::bind(&pd, "127.0.0.1:0".parse().unwrap(), &opts(Duration::from_millis(500)), b"")
            .unwrap();
    let mut silent = TcpStream::connect(listener.local_addr()).unwrap();
    wait_until("the silent handshake fails", Duration::from_secs(10), || listener.failed_handshakes() == 1)
        .await;
    silent.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let n = silent.read(&mut [0u8; 64]).unwrap();
    assert_eq!(n, 0, "the listener closed the silent client's socket");
}

/// With at most 2 handshakes in progress, two silent clients hold both: a third client is
/// only served once one of them has been dropped (it gives way to the newer connection),
/// which shows the bound holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshakes_in_progress_are_bounded() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let o = opts(Duration::from_secs(1));
    let listener = AsyncListener::bind_with(&pd, "127.0.0.1:0".parse().unwrap(), &o, b"", 2).unwrap();
    let addr = listener.local_addr();
    let silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let client = tokio::spawn({
        let pd = pd.clone();
        let o = o.with_timeout(Duration::from_secs(20));
        async move { connect_async(&pd, addr, &o, b"third").await }
    });
    let conn = listener.accept().await.unwrap();
    assert_eq!(conn.peer_private_data(), b"third");
    assert!(listener.failed_handshakes() >= 1, "served before a silent client was dropped");
    client.await.unwrap().unwrap();
    drop(silent);
}

/// Silent clients holding every handshake slot, with a budget of 30 s each: a real client
/// is served at once, in the place of the oldest of them (before, it waited out their
/// budget), and later silent connections do not drop its handshake once its request came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_clients_holding_every_slot_give_way_to_a_real_one() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let o = opts(Duration::from_secs(30));
    let listener = AsyncListener::bind_with(&pd, "127.0.0.1:0".parse().unwrap(), &o, b"srv", 4).unwrap();
    let addr = listener.local_addr();
    let mut silent: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let start = Instant::now();
    let client = tokio::spawn({
        let pd = pd.clone();
        let o = o.with_timeout(Duration::from_secs(10));
        async move { connect_async(&pd, addr, &o, b"real").await }
    });
    // More silent ones behind it: they take the places of silent ones, not its.
    tokio::time::sleep(Duration::from_millis(300)).await;
    silent.extend((0..8).map(|_| TcpStream::connect(addr).unwrap()));
    let conn =
        tokio::time::timeout(Duration::from_secs(10), listener.accept()).await.expect("served").unwrap();
    let took = start.elapsed();
    assert_eq!(conn.peer_private_data(), b"real");
    client.await.unwrap().expect("the real client connects");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(listener.failed_handshakes() >= 1, "a silent handshake gave way");
    // The first silent client was dropped: it reads end-of-file.
    silent[0].set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(silent[0].read(&mut [0u8; 8]).unwrap(), 0, "the oldest silent client was closed");
}

/// A request whose length byte claims more private data than the CM limit is refused
/// before anything is read or allocated for it; the listener keeps accepting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_private_data_claim_is_refused() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let o = opts(Duration::from_secs(10));
    let listener = AsyncListener::bind(&pd, "127.0.0.1:0".parse().unwrap(), &o, b"").unwrap();
    let addr = listener.local_addr();
    // A well-formed request head from a real endpoint, with a length byte of 255.
    let cq = pd.context().create_cq(4).unwrap();
    let qp = pd.create_qp(&cq, &cq, Default::default()).unwrap();
    let mut m = b"RKCM\x02".to_vec();
    m.extend_from_slice(&qp.address().unwrap().encode());
    m.extend_from_slice(&[7u8; 16]);
    m.push(255);
    let mut hostile = TcpStream::connect(addr).unwrap();
    hostile.write_all(&m).unwrap();
    wait_until("the hostile handshake fails", Duration::from_secs(5), || listener.failed_handshakes() == 1)
        .await;
    // Still serving.
    let client = tokio::spawn({
        let pd = pd.clone();
        async move { connect_async(&pd, addr, &o, b"ok").await }
    });
    assert_eq!(listener.accept().await.unwrap().peer_private_data(), b"ok");
    client.await.unwrap().unwrap();
}

/// Our own private data over the limit is refused before anything is sent.
#[tokio::test]
async fn oversize_private_data_is_invalid() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let o = CmOptions::default();
    let e = AsyncListener::bind(&pd, "127.0.0.1:0".parse().unwrap(), &o, &[0; 57]).unwrap_err();
    assert!(matches!(e, rdmakit_verbs::Error::InvalidArgument(_)), "{e}");
    let e = connect_async(&pd, "127.0.0.1:9".parse().unwrap(), &o, &[0; 57]).await.unwrap_err();
    assert!(matches!(e, rdmakit_verbs::Error::InvalidArgument(_)), "{e}");
}

#[test]
fn absurd_handshake_bounds_are_typed_errors() {
    // usize::MAX used to reach tokio's Semaphore::new, which panics above its limit.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let pd = Context::open_soft().alloc_pd().unwrap();
        let addr = "127.0.0.1:0".parse().unwrap();
        for n in [0, AsyncListener::MAX_HANDSHAKES + 1, usize::MAX] {
            let r = AsyncListener::bind_with(&pd, addr, &CmOptions::default(), b"", n);
            assert!(matches!(r, Err(rdmakit_verbs::Error::InvalidArgument(_))), "{n}: {:?}", r.err());
        }
        assert!(
            AsyncListener::bind_with(&pd, addr, &CmOptions::default(), b"", AsyncListener::MAX_HANDSHAKES)
                .is_ok()
        );
    });
}

/// A soft CM request as a hostile client writes it by hand: "RKCM" 2 | endpoint |
/// token (16) | no private data.
fn cm_request(endpoint: &rdmakit_verbs::QpAddress) -> Vec<u8> {
    let mut m = b"RKCM\x02".to_vec();
    m.extend_from_slice(&endpoint.to_bytes());
    m.extend_from_slice(&[7u8; 16]);
    m.push(0);
    m
}

/// Reads a soft CM reply without private data: the server's endpoint.
fn cm_reply(s: &mut TcpStream) -> rdmakit_verbs::QpAddress {
    let mut r = vec![0u8; 5 + 1 + rdmakit_verbs::QpAddress::ENCODED_LEN + 16 + 1];
    s.read_exact(&mut r).unwrap();
    assert_eq!((&r[..5], r[5]), (&b"RKCM\x02"[..], 0), "accepted");
    rdmakit_verbs::QpAddress::from_bytes(&r[6..6 + rdmakit_verbs::QpAddress::ENCODED_LEN]).unwrap()
}

/// Identities are proven, not declared, in one process too. A client learns the server's
/// GID and QP number from one reply, then declares, in its next request, the endpoint of
/// the QP the server creates for that request (numbers are sequential): the server's QP is
/// connected to itself. Its requests must not be served (its peer never took its token),
/// so a write the server addresses to its "peer" fails instead of landing in its own memory.
#[tokio::test(flavor = "current_thread")]
async fn a_client_cannot_connect_the_servers_qp_to_itself() {
    use rdmakit_verbs::{ConnectOptions, ProviderKind, QpAddress, QpCaps, SoftConfig};
    // A device of its own, so that no other test's QP takes the number the client guesses.
    let pd = Context::open_soft_with(SoftConfig::default()).unwrap().alloc_pd().unwrap();
    let listener =
        AsyncListener::bind(&pd, "127.0.0.1:0".parse().unwrap(), &opts(Duration::from_secs(5)), b"").unwrap();
    let addr = listener.local_addr();

    // The first, well-formed request (its endpoint a QP of the client's) reveals the
    // server's GID, port and QP number.
    let mine = Context::open_soft().alloc_pd().unwrap();
    let cq = mine.context().create_cq(16).unwrap();
    let my_qp = mine.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    my_qp.modify_to_init(&ConnectOptions::default()).unwrap();
    let client = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&cm_request(&my_qp.address().unwrap())).unwrap();
        let server = cm_reply(&mut s);
        s.write_all(b"RKCM\x02\xff").unwrap();
        // The second request names the QP the server creates next.
        let next = QpAddress::new(ProviderKind::Soft, server.lid, server.gid, server.qp_num + 1, 0);
        let mut s2 = TcpStream::connect(addr).unwrap();
        s2.write_all(&cm_request(&next)).unwrap();
        let got = cm_reply(&mut s2);
        s2.write_all(b"RKCM\x02\xff").unwrap();
        (s, s2, my_qp, next, got)
    });
    let _first = listener.accept().await.unwrap();
    let spliced = tokio::time::timeout(Duration::from_secs(5), listener.accept()).await.unwrap().unwrap();
    let (_s, _s2, _my_qp, declared, server_ep) = client.await.unwrap();
    assert_eq!((server_ep.gid, server_ep.qp_num), (declared.gid, declared.qp_num), "the guess was right");

    // The server writes to "its peer": a region of its own.
    let own = pd.alloc_mr(8, AccessFlags::ALL_REMOTE).unwrap();
    let src = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_u64(0, 0x5e1f).unwrap();
    spliced.qp().post_send(SendWr::write(src.local().unwrap(), own.remote().slice(0, 8).unwrap())).unwrap();
    let wc = spliced.cq().wait(Some(Duration::from_secs(30))).unwrap();
    assert_eq!(own.read_u64(0).unwrap(), 0, "the write landed in the server's own memory ({:?})", wc.status);
    assert!(!wc.status.is_success(), "a QP whose peer never took its token completed a write");
}

/// A TCP address that never answers: a listener with a backlog of 0 whose one queued
/// connection is never accepted (Linux then drops further SYNs).
fn black_hole() -> (tokio::net::TcpListener, TcpStream, std::net::SocketAddr) {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let l = sock.listen(0).unwrap();
    let addr = l.local_addr().unwrap();
    let filler = TcpStream::connect(addr).unwrap();
    (l, filler, addr)
}

/// A client's request declares an endpoint on another host that never answers. Accepting
/// it must not block the runtime the listener runs on (the soft NIC once dialled the
/// declared address with a blocking 5 s connect inside `QueuePair::connect`, on the
/// handshake's worker); and the server must not dial an address other than the one the
/// request came from.
#[tokio::test(flavor = "current_thread")]
async fn a_declared_endpoint_that_never_answers_blocks_nothing() {
    use rdmakit_verbs::{ProviderKind, QpAddress};
    let (_hole, _filler, hole) = black_hole();
    let pd = Context::open_soft().alloc_pd().unwrap();
    let listener =
        AsyncListener::bind(&pd, "127.0.0.1:0".parse().unwrap(), &opts(Duration::from_secs(1)), b"").unwrap();
    // An endpoint of no device of this process: GID bytes 4..8 = 127.0.0.1, LID = the
    // black hole's port.
    let mut gid = [0u8; 16];
    gid[..2].copy_from_slice(&[0xfe, 0x80]);
    gid[4..8].copy_from_slice(&[127, 0, 0, 1]);
    gid[8..12].copy_from_slice(&0x7fff_fff0u32.to_be_bytes()); // no such process
    gid[15] = 0x42;
    let ep = QpAddress::new(ProviderKind::Soft, hole.port(), gid, 1234, 1);
    let mut s = TcpStream::connect(listener.local_addr()).unwrap();
    s.write_all(&cm_request(&ep)).unwrap();

    // Let the listener run: a 20 ms sleep should take about 20 ms.
    let start = Instant::now();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let took = start.elapsed();
    assert!(took < Duration::from_millis(900), "one hostile request blocked the runtime for {took:?}");
}

/// One source that completes its requests and then never finishes the handshake (no
/// READY) held a slot per connection for the whole budget: with every slot so held, a
/// client from anywhere else waited in the backlog until it gave up. A handshake that has
/// not finished an eighth of the budget after its connection (here 3.75 s; a client answers
/// within a round trip) now gives way to a newer connection when every slot is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_source_stalling_after_its_requests_does_not_hold_every_slot() {
    let pd = Context::open_soft().alloc_pd().unwrap();
    let o = opts(Duration::from_secs(30));
    // No private data in the reply: `cm_reply` reads one without.
    let listener = AsyncListener::bind_with(&pd, "127.0.0.1:0".parse().unwrap(), &o, b"", 2).unwrap();
    let addr = listener.local_addr();
    let cq = pd.context().create_cq(4).unwrap();
    let decoy = pd.create_qp(&cq, &cq, Default::default()).unwrap();
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut s = common::tcp_from(2, addr.port());
        s.write_all(&cm_request(&decoy.address().unwrap())).unwrap();
        cm_reply(&mut s); // answered: the handshake waits for its READY, which never comes
        stalled.push(s);
    }
    let start = Instant::now();
    let client = tokio::spawn({
        let pd = pd.clone();
        let o = o.with_timeout(Duration::from_secs(10));
        async move { connect_async(&pd, addr, &o, b"real").await }
    });
    let conn =
        tokio::time::timeout(Duration::from_secs(10), listener.accept()).await.expect("served").unwrap();
    assert_eq!(conn.peer_private_data(), b"real");
    client.await.unwrap().expect("the real client connects");
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    // The stalled source's oldest handshake gave way: it reads end-of-file.
    stalled[0].set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(stalled[0].read(&mut [0u8; 8]).unwrap(), 0, "the oldest stalled handshake was closed");
}
