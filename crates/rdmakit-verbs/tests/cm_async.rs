//! The async front door of `cm` on the soft provider: handshakes run concurrently, so a
//! silent or hostile client delays no other, is dropped within its budget, and the number
//! of handshakes in progress is bounded.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

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
/// only served once one of them has been dropped, which shows the bound holds.
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
