//! A tokio service that streams over an `AsyncWrite` pipe: the server answers each request
//! line with a report streamed back through `tokio::io` calls, unchanged code that would work
//! on a `TcpStream`.
//!
//! `cargo run --example stream_service`

use rdmakit::channel::stream::PipeStream;
use rdmakit::channel::{Pipe, PipeConfig};
use rdmakit::*;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// Generic over the transport: the same function serves a TCP socket or an RDMA pipe.
async fn serve<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(stream: S) -> std::io::Result<u64> {
    let (r, mut w) = tokio::io::split(stream);
    let mut lines = BufReader::new(r).lines();
    let mut served = 0;
    while let Some(line) = lines.next_line().await? {
        let n: usize = line.trim().parse().unwrap_or(0);
        // A "report" of n lines, streamed as it is produced.
        for i in 0..n {
            w.write_all(format!("{line}: row {i} of {n}\n").as_bytes()).await?;
        }
        w.write_all(b"END\n").await?;
        w.flush().await?;
        served += 1;
    }
    w.shutdown().await?;
    Ok(served)
}

#[tokio::main]
async fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let pd = Context::open_soft().alloc_pd()?;
    let (client_end, server_end) = Pipe::pair(&pd, PipeConfig::default(), PipeConfig::default()).await?;
    let server = tokio::spawn(serve(PipeStream::new(server_end, 32 << 10)?));

    let client = PipeStream::new(client_end, 32 << 10)?;
    let (r, mut w) = tokio::io::split(client);
    let mut reader = BufReader::new(r);
    for n in [3usize, 1000, 20_000] {
        w.write_all(format!("{n}\n").as_bytes()).await?;
        w.flush().await?;
        let (mut rows, mut bytes) = (0, 0);
        loop {
            let mut line = String::new();
            bytes += reader.read_line(&mut line).await?;
            if line == "END\n" {
                break;
            }
            rows += 1;
        }
        println!("asked for {n} rows: got {rows} rows, {bytes} bytes over the RDMA pipe");
        assert_eq!(rows, n);
    }
    w.shutdown().await?;
    let mut rest = Vec::new();
    reader.read_to_end(&mut rest).await?;
    println!("server answered {} requests", server.await??);
    Ok(())
}
