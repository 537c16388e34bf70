//! rmalloc → write → consume → rfree between two endpoints, as the rmalloc paper runs it.
//!
//! The reader owns a heap of its memory; the writer allocates blocks in it (next-fit,
//! deferred synchronisation), RDMA-writes messages there and tells the reader; the reader
//! consumes each and frees it, and the frees flow back to the writer in coalesced batches.
//! Run with `cargo run --example rmalloc_pipe`.

use std::time::Duration;

use rdmakit::channel::heap::{HeapEndpoint, OwnerLimits};
use rdmakit::memory::heap::{AllocPolicy, HeapConfig, HeapId};
use rdmakit::*;

/// The `i`-th message: 11 to 3012 bytes.
fn message(i: u32) -> String {
    format!("message {i}: {}", "x".repeat((i as usize * 37) % 3000))
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd()?;
    let (cw, cr) = (ctx.create_cq(256)?, ctx.create_cq(256)?);
    let w = pd.create_qp(&cw, &cw, QpCaps::default())?;
    let r = pd.create_qp(&cr, &cr, QpCaps::default())?;
    w.connect(&r.address()?, &ConnectOptions::default())?;
    r.connect(&w.address()?, &ConnectOptions::default())?;
    let limits = OwnerLimits::default().with_segment_len(64 << 10).with_max_heap_bytes(1 << 20);
    let mut writer = HeapEndpoint::new(w, cw, limits, Duration::from_secs(5))?;
    let mut reader = HeapEndpoint::new(r, cr, limits, Duration::from_secs(5))?;
    let heap = HeapId(1);

    // rpipe/rmalloc: the writer asks for a heap in the reader's memory.
    let reader_thread = std::thread::spawn(move || -> std::result::Result<usize, String> {
        let mut bytes = 0;
        for i in 0..200u32 {
            let landed = loop {
                match reader.try_recv_block(heap) {
                    Ok(Some(l)) => break l,
                    Ok(None) | Err(rdmakit::channel::ChannelError::UnknownHeap(_)) => {
                        reader.poll_messages().map_err(|e| e.to_string())?
                    }
                    Err(e) => return Err(e.to_string()),
                }
            };
            let mut text = vec![0u8; landed.len() as usize];
            reader.read(&landed, 0, &mut text).map_err(|e| e.to_string())?;
            // Blocks are rounded up to 8 bytes, and a reused block keeps older bytes past
            // the message: check the message itself, which the reader can recompute.
            let want = message(i);
            if !text.starts_with(want.as_bytes()) {
                return Err(format!("message {i} arrived corrupted in block {:?}", landed.block()));
            }
            let text = want.as_str();
            if i % 50 == 0 {
                let head: String = text.chars().take(16).collect();
                println!(
                    "reader: block {:#x}+{} holds {} bytes: {head:?}...",
                    landed.block().addr,
                    landed.len(),
                    text.len()
                );
            }
            bytes += text.len();
            reader.rfree(landed).map_err(|e| e.to_string())?; // rfree
        }
        reader.flush_frees(heap).map_err(|e| e.to_string())?;
        Ok(bytes)
    });

    writer.create_heap(HeapConfig::new(heap, AllocPolicy::NextFit), 64 << 10)?;
    let src = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
    let mut sent = 0;
    for i in 0..200u32 {
        let msg = message(i);
        sent += msg.len();
        src.write_at(0, msg.as_bytes())?; // rmem: the writer's registered source
        let block = writer.rmalloc(heap, msg.len() as u64)?; // rmalloc
        writer.write(heap, &block, 0, src.slice(0, msg.len() as u32)?)?; // rwrite + notice
    }
    let bytes = reader_thread.join().map_err(|_| "reader panicked")??;
    assert_eq!(bytes, sent, "the reader consumed other bytes than the writer sent");
    std::thread::sleep(Duration::from_millis(50));
    writer.poll_messages()?; // take in the last free batch
    let s = writer.heap_stats(heap)?;
    println!(
        "moved {bytes} bytes in 200 messages through a {} KiB heap of {} segment(s)",
        s.total >> 10,
        s.segments
    );
    println!(
        "writer's view now: {} of {} bytes free in {} range(s), fragmentation {:.3}",
        s.free, s.total, s.free_blocks, s.fragmentation
    );
    assert!(s.free <= s.total && s.total >= 64 << 10, "impossible heap figures: {s:?}");
    Ok(())
}
