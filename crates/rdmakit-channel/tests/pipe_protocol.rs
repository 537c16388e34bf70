//! A pipe end facing a misbehaving peer (a raw QP speaking the wire protocol wrongly):
//! malformed or lying control messages, and a peer that never answers, give typed errors,
//! never hangs or corruption.

use std::time::Duration;

use rdmakit_channel::*;
use rdmakit_verbs::*;

struct Raw {
    qp: QueuePair,
    cq: CompletionQueue,
    pd: ProtectionDomain,
    rx: MemoryRegion,
}

/// A pipe end's QP and CQ, and a raw peer QP connected to it with receives posted.
fn setup() -> (QueuePair, CompletionQueue, Raw) {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd().unwrap();
    let caps = QpCaps::default().with_max_send_wr(256).with_max_recv_wr(200).with_max_inline_data(64);
    let (ca, cb) = (ctx.create_cq(1024).unwrap(), ctx.create_cq(1024).unwrap());
    let qa = pd.create_qp(&ca, &ca, caps).unwrap();
    let qb = pd.create_qp(&cb, &cb, caps).unwrap();
    qa.connect(&qb.address().unwrap(), &ConnectOptions::default()).unwrap();
    qb.connect(&qa.address().unwrap(), &ConnectOptions::default()).unwrap();
    let rx = pd.alloc_mr(64 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    for i in 0..64u64 {
        qb.post_recv(RecvWr::new(rx.slice(i * 64, 64).unwrap()).wr_id(i)).unwrap();
    }
    (qa, ca, Raw { qp: qb, cq: cb, pd, rx })
}

fn config() -> PipeConfig {
    PipeConfig::default().with_ring_len(4096).with_connect_timeout(Duration::from_secs(2))
}

/// The pipe's hello as the raw peer receives it: (ring, mailbox, wants write-with-imm).
async fn pipe_hello(raw: &Raw) -> (RemoteRegion, RemoteRegion, bool) {
    let wc = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let Some(wc) = raw.cq.poll_one().unwrap() {
                if wc.opcode == WcOpcode::RECV {
                    return wc;
                }
            } else {
                tokio::task::yield_now().await;
            }
        }
    })
    .await
    .expect("the pipe sends its hello");
    let mut m = vec![0u8; wc.byte_len as usize];
    raw.rx.read_at(wc.wr_id * 64, &mut m).unwrap();
    match Message::decode(&m).unwrap() {
        Message::PipeHello { ring, mailbox, notify, .. } => (ring, mailbox, notify == NotifyMode::WriteImm),
        other => panic!("expected a hello, got {other:?}"),
    }
}

/// A well-formed hello from the raw peer: no ring of its own, a mailbox it never reads.
fn raw_hello(mailbox: &MemoryRegion) -> Vec<u8> {
    Message::PipeHello {
        ring: RemoteRegion { addr: 0, len: 0, rkey: 0 },
        mailbox: mailbox.remote(),
        notify: NotifyMode::WriteImm,
        slots: 4,
        max_ring: 0,
    }
    .encode()
}

/// A write-with-immediate pipe end connected to a raw writer, which has written one
/// 8-byte message (`rawbytes`) at the start of the pipe's ring. Returns the ring too.
async fn pipe_with_a_raw_writer() -> (Raw, Pipe, RemoteRegion) {
    let (qa, ca, raw) = setup();
    let mailbox = raw.pd.alloc_mr(4 * 24, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let connecting = tokio::spawn(Pipe::connect(qa, ca, config()));
    let (ring, _, _) = pipe_hello(&raw).await;
    send(&raw, &raw_hello(&mailbox));
    let pipe = connecting.await.unwrap().unwrap();
    let src = raw.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, b"rawbytes").unwrap();
    raw.qp.post_send(SendWr::write(src.local().unwrap(), ring.slice(0, 8).unwrap()).with_imm(0)).unwrap();
    (raw, pipe, ring)
}

fn send(raw: &Raw, m: &[u8]) {
    raw.qp.post_send(SendWr::send_inline(m)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_hello_is_a_protocol_error() {
    let (qa, ca, raw) = setup();
    let connecting = tokio::spawn(Pipe::connect(qa, ca, config()));
    pipe_hello(&raw).await;
    let hello = raw_hello(&raw.rx);
    send(&raw, &hello[..4]); // truncated
    let r = connecting.await.unwrap();
    assert!(matches!(r, Err(ChannelError::Malformed(DecodeError::Length { .. }))), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_tag_is_a_protocol_error() {
    let (qa, ca, raw) = setup();
    let connecting = tokio::spawn(Pipe::connect(qa, ca, config()));
    pipe_hello(&raw).await;
    send(&raw, &[0xEE; 10]);
    let r = connecting.await.unwrap();
    assert!(matches!(r, Err(ChannelError::Malformed(DecodeError::UnknownTag(0xEE)))), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_times_out() {
    let (qa, ca, raw) = setup();
    let cfg = config().with_connect_timeout(Duration::from_millis(200));
    let r = Pipe::connect(qa, ca, cfg).await;
    assert!(matches!(r, Err(ChannelError::Timeout(_))), "{r:?}");
    drop(raw);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credit_for_messages_never_sent_is_a_protocol_error() {
    let (qa, ca, raw) = setup();
    let mailbox = raw.pd.alloc_mr(4 * 24, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let connecting = tokio::spawn(Pipe::connect(qa, ca, config()));
    pipe_hello(&raw).await;
    send(&raw, &raw_hello(&mailbox));
    let pipe = connecting.await.unwrap().unwrap();
    // The peer claims to have consumed 999 notifications: the pipe sent none.
    send(&raw, &Message::Credit { consumed: 999, batch: None }.encode());
    let r = pipe.recv_timeout(Duration::from_secs(5)).await;
    assert!(matches!(r, Err(ChannelError::Protocol(_))), "{r:?}");
    // Every later operation reports it too (the pipe's accounting cannot be trusted).
    let r = pipe.recv_timeout(Duration::from_secs(5)).await;
    assert!(matches!(r, Err(ChannelError::Protocol(_))), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_announcing_a_block_outside_the_ring_is_refused() {
    let (qa, ca, raw) = setup();
    let mailbox = raw.pd.alloc_mr(4 * 24, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let connecting = tokio::spawn(Pipe::connect(qa, ca, config()));
    let (ring, _, imm) = pipe_hello(&raw).await;
    assert!(imm, "the pipe asked for write-with-immediate");
    send(&raw, &raw_hello(&mailbox));
    let pipe = connecting.await.unwrap().unwrap();
    // A legal 8-byte write whose immediate claims an offset far beyond the 4 KiB ring.
    let src = raw.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    raw.qp
        .post_send(SendWr::write(src.local().unwrap(), ring.slice(0, 8).unwrap()).with_imm(1 << 20))
        .unwrap();
    let r = pipe.recv_timeout(Duration::from_secs(5)).await;
    assert!(matches!(r, Err(ChannelError::Protocol(_)) | Err(ChannelError::Heap(_))), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_raw_write_with_imm_is_received() {
    // The control case for the test above: the same write at offset 0 is a message.
    let (_raw, pipe, _) = pipe_with_a_raw_writer().await;
    let g = pipe.recv_timeout(Duration::from_secs(5)).await.unwrap();
    assert_eq!(g.to_vec().unwrap(), b"rawbytes");
}

/// A flag-mode pipe whose raw writer announces a block with peer-chosen words that would
/// overflow `ring + offset` and the length's rounding: a typed error, no wrap or panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mailbox_with_overflowing_words_is_refused() {
    for (offset, len) in [(u64::MAX - 3, 8u64), (0, u64::MAX - 2), (0, 0)] {
        let (qa, ca, raw) = setup();
        let mailbox = raw.pd.alloc_mr(4 * 24, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
        let cfg = config().with_notify(NotifyMode::Flag);
        let connecting = tokio::spawn(Pipe::connect(qa, ca, cfg));
        let (_, pipe_mailbox, imm) = pipe_hello(&raw).await;
        assert!(!imm, "the pipe asked for flag notifications");
        send(&raw, &raw_hello(&mailbox));
        let pipe = connecting.await.unwrap().unwrap();
        let words = raw.pd.alloc_mr(24, AccessFlags::LOCAL_WRITE).unwrap();
        words.write_at(0, &offset.to_le_bytes()).unwrap();
        words.write_at(8, &len.to_le_bytes()).unwrap();
        words.write_at(16, &1u64.to_le_bytes()).unwrap();
        raw.qp.post_send(SendWr::write(words.local().unwrap(), pipe_mailbox.slice(0, 24).unwrap())).unwrap();
        let r = pipe.recv_timeout(Duration::from_secs(5)).await;
        assert!(
            matches!(r, Err(ChannelError::Protocol(_)) | Err(ChannelError::Heap(_))),
            "{offset} {len}: {r:?}"
        );
    }
}

/// A peer flooding write-with-immediate notifications beyond its credits is a protocol
/// error, not an unbounded queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_beyond_the_credits_are_refused() {
    let (qa, ca, raw) = setup();
    let mailbox = raw.pd.alloc_mr(4 * 24, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let cfg = config().with_slots(4);
    let connecting = tokio::spawn(Pipe::connect(qa, ca, cfg));
    let (ring, _, _) = pipe_hello(&raw).await;
    send(&raw, &raw_hello(&mailbox));
    let pipe = connecting.await.unwrap().unwrap();
    let src = raw.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    // Distinct blocks, so only the count is wrong.
    for i in 0..40u32 {
        let dst = ring.slice(u64::from(i) * 8, 8).unwrap();
        raw.qp.post_send(SendWr::write(src.local().unwrap(), dst).with_imm(i)).unwrap();
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The first is a message; the flood behind it breaks the pipe. Guards are held (no
    // credit goes back) until the end, and then dropped: forgetting them would leak the
    // pipe, which the AddressSanitizer tier's leak checker reports.
    let mut r = Ok(());
    let mut held = Vec::new();
    for _ in 0..8 {
        match pipe.recv_timeout(Duration::from_secs(5)).await {
            Ok(g) => held.push(g),
            Err(e) => {
                r = Err(e);
                break;
            }
        }
    }
    assert!(matches!(r, Err(ChannelError::Protocol(_))), "{r:?}");
    drop(held);
}

/// The next control message the raw peer receives, driving `pipe` meanwhile (a short
/// `recv` that times out: the pipe answers while it waits).
async fn next_answer(raw: &Raw, pipe: &Pipe) -> Message {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(wc) = raw.cq.poll_one().unwrap() {
            if wc.opcode == WcOpcode::RECV {
                let mut m = vec![0u8; wc.byte_len as usize];
                raw.rx.read_at(wc.wr_id * 64, &mut m).unwrap();
                match Message::decode(&m).unwrap() {
                    // The pipe's liveness probe when it has sent nothing for a while (under
                    // ThreadSanitizer a test can take that long): not an answer.
                    Message::KeepAlive => continue,
                    other => return other,
                }
            }
            continue;
        }
        assert!(std::time::Instant::now() < deadline, "no answer from the pipe");
        let _ = pipe.recv_timeout(Duration::from_millis(5)).await;
    }
}

/// A hostile writer asks the reader to grow its ring again and again, for absurd sizes and
/// many times: the reader registers nothing beyond `max_ring_len`, answers every request
/// (a grant within the budget, else a refusal), and stays usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn growth_requests_are_bounded_by_max_ring_len() {
    use rdmakit_memory::heap::HeapId;
    let (qa, ca, raw) = setup();
    let mailbox = raw.pd.alloc_mr(4 * 24, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let cfg = config().with_max_ring_len(16 << 10);
    let connecting = tokio::spawn(Pipe::connect(qa, ca, cfg));
    pipe_hello(&raw).await;
    send(&raw, &raw_hello(&mailbox));
    let pipe = connecting.await.unwrap().unwrap();
    let grow = |len| Message::HeapGrow { heap: HeapId(0), len }.encode();
    // Absurd: refused, nothing registered.
    send(&raw, &grow(1 << 40));
    assert!(matches!(next_answer(&raw, &pipe).await, Message::HeapRefuse { .. }));
    send(&raw, &grow(0));
    assert!(matches!(next_answer(&raw, &pipe).await, Message::HeapRefuse { .. }));
    assert_eq!(pipe.ring_len(), 4096);
    // Within the budget: granted.
    send(&raw, &grow(8192));
    match next_answer(&raw, &pipe).await {
        Message::HeapGrant { segment, .. } => assert_eq!(segment.len, 8192),
        other => panic!("expected a grant, got {other:?}"),
    }
    assert_eq!(pipe.ring_len(), 12 << 10);
    // A flood of small requests: at most the 4 KiB left is granted, the rest refused.
    for _ in 0..40 {
        send(&raw, &grow(8));
    }
    let mut granted = 0;
    for _ in 0..40 {
        match next_answer(&raw, &pipe).await {
            Message::HeapGrant { segment, .. } => granted += segment.len,
            Message::HeapRefuse { .. } => {}
            other => panic!("unexpected answer {other:?}"),
        }
    }
    assert_eq!(granted, 4096);
    assert_eq!((pipe.ring_len(), pipe.ring_segments()), (16 << 10, 3));
    // Still usable: nothing failed.
    assert!(matches!(pipe.recv_timeout(Duration::from_millis(20)).await, Err(ChannelError::Timeout(_))));
}

/// A reader that answers the writer's growth request with a segment smaller than asked
/// (8 bytes, again and again) once made one `rwrite` ask without end, each grant adding a
/// row to the writer's allocator: the first short grant is a protocol error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_segment_smaller_than_asked_is_a_protocol_error() {
    use rdmakit_memory::heap::HeapId;
    let (qa, ca, raw) = setup();
    let mailbox = raw.pd.alloc_mr(4 * 24, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let ring = raw.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let connecting = tokio::spawn(Pipe::connect(qa.clone(), ca, config()));
    pipe_hello(&raw).await;
    let hello = Message::PipeHello {
        ring: ring.remote(),
        mailbox: mailbox.remote(),
        notify: NotifyMode::WriteImm,
        slots: 4,
        max_ring: 1 << 20,
    };
    send(&raw, &hello.encode());
    let pipe = connecting.await.unwrap().unwrap();
    // 256 bytes do not fit the 64-byte ring: the writer asks it to grow.
    let src = qa.pd().alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    let writing = tokio::spawn(async move {
        let (r, _) = pipe.rwrite(src.local().unwrap()).await;
        r
    });
    let mut grants = 0u64;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !writing.is_finished() && grants < 100 {
        assert!(std::time::Instant::now() < deadline, "neither a request nor an end");
        let Some(wc) = raw.cq.poll_one().unwrap() else {
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        };
        if wc.opcode != WcOpcode::RECV {
            continue;
        }
        let mut m = vec![0u8; wc.byte_len as usize];
        raw.rx.read_at(wc.wr_id * 64, &mut m).unwrap();
        raw.qp.post_recv(RecvWr::new(raw.rx.slice(wc.wr_id * 64, 64).unwrap()).wr_id(wc.wr_id)).unwrap();
        if let Message::HeapGrow { len, .. } = Message::decode(&m).unwrap() {
            assert!(len >= 256, "asked for {len} bytes");
            let segment = RemoteRegion::new(0x10_0000 + grants * 4096, 8, 5);
            send(&raw, &Message::HeapGrant { heap: HeapId(0), segment }.encode());
            grants += 1;
        }
    }
    let r = tokio::time::timeout(Duration::from_secs(5), writing).await.expect("the rwrite ended").unwrap();
    assert!(matches!(r, Err(ChannelError::Protocol(_))), "{r:?}");
    assert_eq!(grants, 1, "the writer asked again after a short grant");
}

/// A ring segment nobody asked for is a protocol error, not a change of the writer's
/// allocator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unasked_ring_segment_is_a_protocol_error() {
    use rdmakit_memory::heap::HeapId;
    let (qa, ca, raw) = setup();
    let mailbox = raw.pd.alloc_mr(4 * 24, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let connecting = tokio::spawn(Pipe::connect(qa, ca, config()));
    pipe_hello(&raw).await;
    send(&raw, &raw_hello(&mailbox));
    let pipe = connecting.await.unwrap().unwrap();
    let seg = RemoteRegion::new(0x10_0000, 4096, 5);
    send(&raw, &Message::HeapGrant { heap: HeapId(0), segment: seg }.encode());
    let r = pipe.recv_timeout(Duration::from_secs(5)).await;
    assert!(matches!(r, Err(ChannelError::Protocol(_))), "{r:?}");
    assert_eq!(pipe.peer_ring_len(), 0);
}

/// A writer that asks for credit again and again while it takes none of the answers in
/// (its receives run out, so the reader's answers wait behind receiver-not-ready) fills
/// the reader's control channel. The reader must neither fail nor lose what it owes: once
/// the writer reads again, the block its application released comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_credit_requests_neither_breaks_the_reader_nor_loses_its_frees() {
    const ASKS: usize = 4000; // more than the send queue and the backlog hold
    let (raw, pipe, ring) = pipe_with_a_raw_writer().await;
    let g = pipe.recv_timeout(Duration::from_secs(5)).await.unwrap();
    // The flood: the raw writer's 64 receives are not reposted, so the answers pile up.
    let ask = Message::NeedCredit.encode();
    let (mut asked, mut taken) = (0, Vec::new());
    let start = std::time::Instant::now();
    while asked < ASKS {
        assert!(start.elapsed() < Duration::from_secs(20), "the flood stalled at {asked}");
        while let Some(wc) = raw.cq.poll_one().unwrap() {
            if wc.opcode == WcOpcode::RECV {
                taken.push(wc.wr_id); // an answer, left in its receive buffer
            }
        }
        if raw.qp.outstanding_sends() < 200 {
            send(&raw, &ask);
            asked += 1;
        } else {
            // The reader takes the requests in when its application calls it.
            let _ = pipe.recv_timeout(Duration::from_millis(1)).await;
        }
    }
    for _ in 0..50 {
        let _ = pipe.recv_timeout(Duration::from_millis(1)).await;
    }
    // The application releases the message: its block is owed to the writer.
    drop(g);
    pipe.return_credits().expect("a flood of requests does not break the reader");
    assert!(taken.len() <= 64, "only the writer's 64 receives were there to take answers");
    // The writer reads again (its receives posted anew): among the answers, the free
    // batch with the block.
    for &slot in &taken {
        raw.qp.post_recv(RecvWr::new(raw.rx.slice(slot * 64, 64).unwrap()).wr_id(slot)).unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut freed = false;
    let (mut got, mut last) = (0, None);
    while !freed {
        assert!(
            std::time::Instant::now() < deadline,
            "the released block never came back; {got} answers, last {last:?}"
        );
        match raw.cq.poll_one().unwrap() {
            Some(wc) if wc.opcode == WcOpcode::RECV => {
                let mut m = vec![0u8; wc.byte_len as usize];
                raw.rx.read_at(wc.wr_id * 64, &mut m).unwrap();
                raw.qp
                    .post_recv(RecvWr::new(raw.rx.slice(wc.wr_id * 64, 64).unwrap()).wr_id(wc.wr_id))
                    .unwrap();
                got += 1;
                last = Some(Message::decode(&m).unwrap());
                if let Message::Credit { batch: Some(b), .. } = Message::decode(&m).unwrap() {
                    freed = b.ranges().iter().any(|r| r.addr == ring.addr && r.len >= 8);
                }
            }
            Some(_) => {}
            None => {
                let _ = pipe.recv_timeout(Duration::from_millis(1)).await;
            }
        }
    }
}

/// A reader's hello offering a ring beyond the 32 GiB a write-with-immediate can address
/// (offsets travel in 8-byte units in 32 bits) is refused at the hello; the writer once
/// took it, then lost a block of the ring to every rwrite placed beyond 32 GiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_offering_a_ring_beyond_32_gib_is_refused() {
    let (qa, ca, raw) = setup();
    let mailbox = raw.pd.alloc_mr(4 * 24, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let connecting = tokio::spawn(Pipe::connect(qa, ca, config()));
    pipe_hello(&raw).await;
    let hello = Message::PipeHello {
        ring: RemoteRegion { addr: 1 << 40, len: 64 << 30, rkey: 7 },
        mailbox: mailbox.remote(),
        notify: NotifyMode::WriteImm,
        slots: 4,
        max_ring: 0,
    };
    send(&raw, &hello.encode());
    let r = connecting.await.unwrap();
    assert!(matches!(r, Err(ChannelError::Protocol(_))), "{:?}", r.map(|_| ()));
}
