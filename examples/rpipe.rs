//! The rmalloc/rpipe seed program in rdmakit's API: a writer and a reader connected by a
//! pipe over the soft NIC.
//!
//! | seed call | here |
//! | --- | --- |
//! | `rpipe(peer)` | [`Pipe::pair`] (or [`Pipe::connect`] over any connected QP) |
//! | `rmem` (network-compatible source memory) | `pd.alloc_mr(..)` |
//! | `rmalloc(pipe, n)` + `rwrite(...)` | [`Pipe::rwrite`]: allocates in the reader's remote heap, RDMA-writes, then the flag |
//! | probe flag, consume | [`Pipe::recv`] → [`RecvGuard`](rdmakit::channel::RecvGuard) |
//! | `rfree(ptr)` | dropping the guard (credits flow back to the writer in batches) |
//! | `rread(...)` | [`Pipe::publish`] on the data's owner, [`Pipe::rread`] on the reader |
//!
//! The pipe uses rpipe's notification flag (NFP: a flag written just after the data,
//! polled by the reader); `NotifyMode::WriteImm` is the spec-safe alternative.
//!
//! `cargo run --example rpipe`

use rdmakit::channel::{NotifyMode, Pipe, PipeConfig, PollMode};
use rdmakit::*;

#[tokio::main]
async fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let pd = Context::open_soft().alloc_pd()?;
    // rpipe(): both ends offer a 64 KiB remote heap and want the NFP flag.
    let cfg =
        PipeConfig::default().with_notify(NotifyMode::Flag).with_poll(PollMode::Busy).with_ring_len(64 << 10);
    let (writer, reader) = Pipe::pair(&pd, cfg, cfg).await?;

    let consumer = tokio::spawn({
        let reader = reader.clone();
        async move {
            let mut total = 0usize;
            for i in 0..1000 {
                let msg = reader.recv().await?; // probe the flag: the data is ready
                let bytes = msg.to_vec()?; // consume
                assert!(bytes.iter().all(|&b| b == (i % 251) as u8), "message {i} corrupted");
                total += bytes.len();
                drop(msg); // rfree(): the block goes back to the writer's heap
            }
            Ok::<_, rdmakit::channel::ChannelError>(total)
        }
    });

    // rmem: the writer's registered source buffer.
    let rmem = pd.alloc_mr(16 << 10, AccessFlags::LOCAL_WRITE)?;
    let mut sent = 0usize;
    for i in 0..1000usize {
        let len = 1 + (i * 131) % (16 << 10);
        rmem.write_at(0, &vec![(i % 251) as u8; len])?;
        // rmalloc + rwrite: a block of the reader's heap, the data, then the flag. Resolves
        // when rmem may be reused; waits when the reader has not freed enough (credits).
        let (r, _slice) = writer.rwrite(rmem.slice(0, len as u32)?).await;
        r?;
        sent += len;
    }
    let received = consumer.await??;
    println!("rwrite: 1000 messages, {sent} bytes sent, {received} bytes consumed through a 64 KiB heap");
    assert_eq!(received, sent, "the reader consumed other bytes than the writer sent");

    // rread: the data's owner stores it and raises the reader's flag; the reader pulls it.
    const TEXT: &[u8] = b"pulled by rread, zero copy from the owner's memory";
    let owned = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)?;
    owned.write_at(0, TEXT)?;
    let publisher = tokio::spawn(async move {
        let (r, _) = writer.publish(owned.slice(0, TEXT.len() as u32).expect("slice")).await;
        r
    });
    let dst = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
    let (n, _) = reader.rread(dst.local()?).await;
    let n = n?;
    publisher.await??;
    let mut text = vec![0u8; n];
    dst.read_at(0, &mut text)?;
    println!("rread: {:?}", String::from_utf8_lossy(&text));
    assert_eq!(&text[..], TEXT, "rread brought the wrong bytes");
    Ok(())
}
