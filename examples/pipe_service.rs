//! A tokio service's front door: a [`PipeListener`] accepts pipes, and each is served by a
//! task of its own (`loop { let pipe = listener.accept().await?; tokio::spawn(serve(pipe)); }`).
//! Clients dial with [`Pipe::connect_to`]. Handshakes run concurrently: a client that
//! connects and then says nothing holds only its own handshake, never the others'.
//!
//! The service sums the bytes of every message and answers each with the sum; 32 clients
//! connect at once (one of them silent, from a plain TCP socket), send their messages, and
//! check every answer. Runs on the soft NIC, or on an RDMA device with
//! `RDMAKIT_PROVIDER=verbs RDMAKIT_SERVICE_ADDR=<device IP>:0`.
//!
//! `cargo run --example pipe_service`

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rdmakit::channel::{Pipe, PipeConfig, PipeListener};
use rdmakit::*;

const CLIENTS: u64 = 32;
const MESSAGES: u64 = 50;

/// One client's session: answer each message with the sum of its bytes, until it goes.
async fn serve(pipe: Pipe, pd: ProtectionDomain) -> rdmakit::channel::Result<u64> {
    let answer = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    let mut served = 0;
    while let Ok(msg) = pipe.recv().await {
        let sum: u64 = msg.to_vec()?.iter().map(|&b| u64::from(b)).sum();
        msg.release();
        answer.write_at(0, &sum.to_le_bytes())?;
        pipe.rwrite(answer.local()?).await.0?;
        served += 1;
    }
    Ok(served)
}

async fn client(pd: ProtectionDomain, addr: SocketAddr, id: u64) -> rdmakit::channel::Result<u64> {
    let pipe = Pipe::connect_to(&pd, addr, PipeConfig::default().with_ring_len(64 << 10)).await?;
    let src = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
    for i in 0..MESSAGES {
        let len = 1 + ((id * 131 + i * 17) % 4096) as u32;
        let data: Vec<u8> = (0..len).map(|j| (id as u32 ^ i as u32 ^ j) as u8).collect();
        src.write_at(0, &data)?;
        pipe.rwrite(src.slice(0, len)?).await.0?;
        let answer = pipe.recv().await?.to_vec()?;
        let want: u64 = data.iter().map(|&b| u64::from(b)).sum();
        assert_eq!(answer, want.to_le_bytes(), "client {id}: message {i}'s sum");
    }
    Ok(MESSAGES)
}

#[tokio::main]
async fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let ctx = Context::open_default()?;
    let pd = ctx.alloc_pd()?;
    let addr: SocketAddr =
        std::env::var("RDMAKIT_SERVICE_ADDR").as_deref().unwrap_or("127.0.0.1:0").parse()?;
    let listener = PipeListener::bind(&pd, addr, PipeConfig::default().with_ring_len(64 << 10))?;
    let addr = listener.local_addr();
    println!("serving on {addr} ({:?} provider, device {})", ctx.provider(), ctx.name());

    // The service.
    let server = tokio::spawn({
        let pd = pd.clone();
        async move {
            let mut sessions = tokio::task::JoinSet::new();
            loop {
                let pipe = listener.accept().await?;
                sessions.spawn(serve(pipe, pd.clone()));
                // Stop after the last client, for the example's sake.
                if sessions.len() as u64 == CLIENTS {
                    let mut total = 0;
                    while let Some(r) = sessions.join_next().await {
                        total += r.expect("session task")?;
                    }
                    return Ok::<u64, rdmakit::channel::ChannelError>(total);
                }
            }
        }
    });

    // A client that connects and says nothing (soft provider: its bootstrap socket).
    let silent =
        (ctx.provider() == ProviderKind::Soft).then(|| std::net::TcpStream::connect(addr)).transpose()?;

    let start = Instant::now();
    let clients: Vec<_> = (0..CLIENTS).map(|id| tokio::spawn(client(pd.clone(), addr, id))).collect();
    let mut sent = 0;
    for c in clients {
        sent += c.await??;
    }
    let took = start.elapsed();
    let served = tokio::time::timeout(Duration::from_secs(60), server).await???;
    println!(
        "{CLIENTS} clients, {sent} messages answered and checked in {took:?} (one silent client ignored)"
    );
    assert_eq!(served, sent);
    drop(silent);
    Ok(())
}
