//! A byte stream over a pipe: `AsyncRead + AsyncWrite`, so tokio code can use RDMA as it
//! uses a socket.
//!
//! Writes are copied into a registered staging chunk and sent as pipe messages (one in
//! flight at a time: `poll_write` accepts the next bytes once the previous message's
//! [`rwrite`](Pipe::rwrite) has resolved, which for a message of at most the pipe's
//! `inline_max` bytes is when it was posted); the peer's ring and its releases are the
//! credits. As with a socket, a completed `flush` means the bytes were handed to the NIC,
//! not that the peer has them: a transport failure surfaces on a later call. Each message
//! carries a one-byte kind (data or end-of-stream), so `shutdown` gives the reader EOF.
//! Reads copy out of the landed block and release it once consumed.
//!
//! Each message costs one boxed future (an allocation); for allocation-free transfers use
//! [`Pipe::rwrite`] and [`Pipe::recv`] directly.
//!
//! # Example
//!
//! ```
//! use rdmakit_channel::{Pipe, PipeConfig, stream::PipeStream};
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let pd = rdmakit_verbs::Context::open_soft().alloc_pd()?;
//! let (a, b) = Pipe::pair(&pd, PipeConfig::default(), PipeConfig::default()).await?;
//! let (mut tx, mut rx) = (PipeStream::new(a, 4096)?, PipeStream::new(b, 4096)?);
//! let writer = tokio::spawn(async move {
//!     tx.write_all(&[7u8; 10_000]).await?; // several messages of at most the chunk length
//!     tx.shutdown().await // the reader sees end-of-stream
//! });
//! let mut all = Vec::new();
//! rx.read_to_end(&mut all).await?;
//! writer.await??;
//! assert_eq!(all, vec![7u8; 10_000]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use rdmakit_verbs::{AccessFlags, LocalSlice, MemoryRegion};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::error::{BufResult, ChannelError, Result};
use crate::pipe::{Pipe, RecvGuard};

const KIND_DATA: u8 = 0;
const KIND_EOF: u8 = 1;
/// Data messages without data one `poll_read` takes before it yields (see `poll_read`).
const EMPTY_PER_POLL: usize = 16;

type WriteFut = Pin<Box<dyn Future<Output = BufResult<(), LocalSlice>> + Send>>;
type RecvFut = Pin<Box<dyn Future<Output = Result<RecvGuard>> + Send>>;

/// An `AsyncRead + AsyncWrite` stream over a [`Pipe`] (both ends need receive rings to be
/// full duplex).
pub struct PipeStream {
    pipe: Pipe,
    staging: MemoryRegion,
    writing: Option<WriteFut>,
    recv: Option<RecvFut>,
    /// The message being read and how far.
    current: Option<(RecvGuard, usize)>,
    eof: bool,
    shut: bool,
}

impl std::fmt::Debug for PipeStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipeStream").field("pipe", &self.pipe).field("eof", &self.eof).finish()
    }
}

fn io_err(e: ChannelError) -> io::Error {
    let kind = match e {
        ChannelError::Broken { .. } => io::ErrorKind::ConnectionReset,
        ChannelError::Timeout(_) => io::ErrorKind::TimedOut,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e)
}

impl PipeStream {
    /// A stream over `pipe`, writing in messages of at most `chunk` bytes (capped to half
    /// the peer's ring less the kind byte, so two can be in the ring at once, and to what
    /// one message can carry).
    pub fn new(pipe: Pipe, chunk: usize) -> Result<PipeStream> {
        if chunk == 0 {
            return Err(ChannelError::Invalid("a stream chunk needs at least one byte"));
        }
        let half = usize::try_from(pipe.peer_ring_len() / 2).unwrap_or(usize::MAX);
        // A message's length is a u32; one byte of it is the kind.
        let mut chunk = chunk.min(u32::MAX as usize - 1);
        if half > 1 {
            chunk = chunk.min(half - 1);
        }
        let staging = pipe.qp().pd().alloc_mr(chunk + 1, AccessFlags::LOCAL_WRITE)?;
        Ok(PipeStream { pipe, staging, writing: None, recv: None, current: None, eof: false, shut: false })
    }

    fn chunk(&self) -> usize {
        self.staging.len() - 1
    }

    /// The largest message body this stream writes.
    pub fn chunk_len(&self) -> usize {
        self.chunk()
    }

    /// Drives the message in flight; `Ready(Ok)` when there is none.
    fn poll_inflight(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(f) = self.writing.as_mut() {
            let (r, _slice) = ready!(f.as_mut().poll(cx));
            self.writing = None;
            r.map_err(io_err)?;
        }
        Poll::Ready(Ok(()))
    }

    fn start(&mut self, kind: u8, data: &[u8]) -> io::Result<()> {
        self.staging.write_at(0, &[kind]).map_err(|e| io_err(e.into()))?;
        self.staging.write_at(1, data).map_err(|e| io_err(e.into()))?;
        // `data` is at most a chunk, which fits a u32 with the kind byte (see `new`).
        let len =
            u32::try_from(data.len() + 1).map_err(|_| io_err(ChannelError::Invalid("chunk too large")))?;
        let slice = self.staging.slice(0, len).map_err(|e| io_err(e.into()))?;
        let pipe = self.pipe.clone();
        self.writing = Some(Box::pin(async move { pipe.rwrite(slice).await }));
        Ok(())
    }
}

impl AsyncWrite for PipeStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.shut {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::BrokenPipe, "stream shut down")));
        }
        ready!(self.poll_inflight(cx))?;
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let n = buf.len().min(self.chunk());
        self.start(KIND_DATA, &buf[..n])?;
        // The bytes are in the staging chunk: they count as written. Start the transfer.
        let _ = self.poll_inflight(cx)?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_inflight(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_inflight(cx))?;
        if !self.shut {
            // Shut only once the end-of-stream is under way: if it cannot start, a later
            // shutdown tries again rather than report success with nothing sent.
            self.start(KIND_EOF, &[])?;
            self.shut = true;
        }
        self.poll_inflight(cx)
    }
}

impl AsyncRead for PipeStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        // A peer's data messages without data, taken in this call: past a few, the call
        // yields (woken at once), so that a peer sending them as fast as it gets credit
        // cannot keep this task from returning to its runtime.
        let mut empty = 0;
        loop {
            if empty == EMPTY_PER_POLL {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            if self.eof || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            if let Some((guard, pos)) = self.current.as_mut() {
                let left = guard.len() - *pos;
                let n = left.min(buf.remaining());
                guard.read_at(*pos as u64, &mut buf.initialize_unfilled_to(n)[..n]).map_err(io_err)?;
                buf.advance(n);
                *pos += n;
                if *pos == guard.len() {
                    self.current = None; // releases the block
                }
                return Poll::Ready(Ok(()));
            }
            if self.recv.is_none() {
                let pipe = self.pipe.clone();
                self.recv = Some(Box::pin(async move { pipe.recv().await }));
            }
            let guard = ready!(self.recv.as_mut().expect("set above").as_mut().poll(cx));
            self.recv = None;
            let guard = guard.map_err(io_err)?;
            let mut kind = [0u8; 1];
            guard.read_at(0, &mut kind).map_err(io_err)?;
            match kind[0] {
                KIND_EOF => self.eof = true,
                KIND_DATA if guard.len() > 1 => self.current = Some((guard, 1)),
                KIND_DATA => empty += 1,
                k => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("pipe stream: unknown message kind {k}"),
                    )));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PipeConfig;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Wake, Waker};

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A peer that sends data messages with no data (its kind byte only), as fast as it
    /// gets credit: each was taken and the next awaited within the same `poll_read`, so a
    /// reader whose messages kept coming never returned to its runtime. After
    /// [`EMPTY_PER_POLL`] of them it yields (woken at once, to go on).
    #[test]
    #[cfg_attr(miri, ignore = "tokio's runtime and the soft NIC's timer thread")]
    fn empty_data_messages_make_a_read_yield_not_spin() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let pd = rdmakit_verbs::Context::open_soft().alloc_pd().unwrap();
            let cfg = PipeConfig::default();
            let (w, r) = Pipe::pair(&pd, cfg, cfg).await.unwrap();
            let empties = (EMPTY_PER_POLL + 8).min(cfg.slots as usize - 1);
            assert!(empties > EMPTY_PER_POLL, "the test needs more queued than a poll takes");
            let kind = pd.alloc_mr(1, AccessFlags::LOCAL_WRITE).unwrap();
            for _ in 0..empties {
                w.rwrite(kind.local().unwrap()).await.0.unwrap(); // KIND_DATA (0), no data
            }
            w.flush().await.unwrap();
            let mut s = PipeStream::new(r, 4096).unwrap();
            let count = Arc::new(Count(AtomicUsize::new(0)));
            let waker = Waker::from(count.clone());
            let mut cx = Context::from_waker(&waker);
            let mut b = [0u8; 16];
            let mut buf = ReadBuf::new(&mut b);
            let first = Pin::new(&mut s).poll_read(&mut cx, &mut buf);
            assert!(first.is_pending(), "nothing to read yet: {first:?}");
            assert_eq!(count.0.load(Ordering::Relaxed), 1, "it yielded, woken to go on");
            assert_eq!(buf.filled().len(), 0);
        });
    }
}
