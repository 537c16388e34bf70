//! rdmakit-channel: async one-sided transfers on top of `rdmakit-verbs`.
//!
//! Two seed designs, for `.await`ing from tokio services:
//! - [`pipe`]: rpipe-style pipes. `rwrite` RDMA-writes straight into a block the writer
//!   allocated in the reader's remote heap (`rdmakit_memory::heap`), then notifies the
//!   reader with a flag written after the data or with a write-with-immediate; the reader
//!   gets an exclusive [`RecvGuard`] and dropping it is the rfree, which
//!   is also the writer's credit. `publish`/`rread` pull data the other way.
//!   [`stream::PipeStream`] makes a pipe an `AsyncRead + AsyncWrite` byte stream.
//! - [`put`]: CkDirect-style persistent put handles: a receive buffer set up once, a
//!   sender associated once, then one RDMA write per iteration, detected by a sequence word
//!   written after the data (so any payload is seen, unlike CkDirect's sentinel). The
//!   receiver's calls carry CkDirect's names and meanings (`ready_mark`, `ready_poll_q`,
//!   `ready`, `ready_poll`; the table is in [`put`]).
//! - [`heap`]: the rmalloc paper's remote heaps between two endpoints (the allocator core is
//!   `rdmakit_memory::heap`; this is its transport).
//!
//! All three speak through one [`control`] channel: receive slots, typed [`Message`]s with a
//! total decoder, a send backlog, and **liveness**: an operation blocked with nothing in
//! flight sends keep-alives, so a dead peer becomes [`ChannelError::Broken`] within
//! [`KEEPALIVE_INTERVAL`] plus the QP's transport budget (see [`control`]).
//!
//! **Cancel safety.** Operations take ownership of their buffers and return them with the
//! result ([`BufResult`]). Once a request is posted, the verbs layer's in-flight table holds
//! its memory region until the NIC's completion is reaped, whoever reaps it; dropping a
//! future therefore never frees or reuses memory the NIC may still touch, and the
//! completion it was waiting for is applied by the next operation that makes progress
//! (the crate's completion driver). Receive guards and put handles never hand out `&[u8]` over memory a peer
//! may write, except through `unsafe fn`s.
//!
//! # Example: a message through a pipe, notified by write with immediate
//!
//! ```
//! use rdmakit_channel::{NotifyMode, Pipe, PipeConfig};
//! use rdmakit_verbs::{AccessFlags, Context};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let pd = Context::open_soft().alloc_pd()?;
//! let mut cfg = PipeConfig::default();
//! cfg.notify = NotifyMode::WriteImm; // the reader may sleep on completion events
//! let (writer, reader) = Pipe::pair(&pd, cfg, cfg).await?;
//! let src = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE)?;
//! src.write_at(0, &42u64.to_le_bytes())?;
//! let (sent, _src) = writer.rwrite(src.slice(0, 8)?).await;
//! sent?;
//! let guard = reader.recv().await?;
//! let mut word = [0u8; 8];
//! guard.read_at(0, &mut word)?; // a copy: no `&[u8]` over memory a peer may write
//! assert_eq!(u64::from_le_bytes(word), 42);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

// No unsafe code but the two escape hatches that hand out a slice over registered memory
// (`RecvGuard::as_slice`, `BlockView::as_mut_slice`), each an `unsafe fn` with its contract.
#![deny(unsafe_code)]

pub mod control;
mod driver;
mod error;
pub mod heap;
mod linger;
pub mod listener;
pub mod pipe;
pub mod put;
pub mod stream;

pub use control::{DecodeError, KEEPALIVE_INTERVAL, Message};
pub use driver::PollMode;
pub use error::{BufResult, ChannelError, Result};
pub use listener::{PipeListener, pipe_cm_options};
pub use pipe::{NotifyMode, Pipe, PipeConfig, RecvGuard};
