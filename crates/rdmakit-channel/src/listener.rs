//! The front door of a pipe service: [`PipeListener`] accepts pipes on tokio, and
//! [`Pipe::connect_to`] dials one.
//!
//! ```no_run
//! # async fn serve(_: rdmakit_channel::Pipe) {}
//! # async fn run() -> rdmakit_channel::Result<()> {
//! use rdmakit_channel::{PipeConfig, PipeListener};
//! let pd = rdmakit_verbs::Context::open_default()?.alloc_pd()?;
//! let listener = PipeListener::bind(&pd, "0.0.0.0:7471".parse().unwrap(), PipeConfig::default())?;
//! loop {
//!     let pipe = listener.accept().await?;
//!     tokio::spawn(serve(pipe));
//! }
//! # }
//! ```
//!
//! Each pipe is set up in two steps, both run as a task per client, concurrently: the
//! connection's handshake ([`AsyncListener`], within [`CmOptions::timeout`]) and the pipes'
//! hello exchange on it (within [`PipeConfig::connect_timeout`]). A client that is silent
//! or slow at either step holds only its own task, and is dropped when its time is up; at
//! most `max_handshakes` clients are in either step at once, and as many set-up pipes
//! queue for [`PipeListener::accept`]. With every slot of a step held, a client that has
//! not finished that step an eighth of its time after it began (250 ms to 4 s: each step
//! is a round trip or two) gives way to a newer connection, so clients that stall on
//! purpose cannot keep the others out.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use rdmakit_verbs::cm::{AsyncListener, CmOptions, connect_async};
use rdmakit_verbs::{ProtectionDomain, QpCaps};
use tokio::sync::{Semaphore, TryAcquireError, mpsc};
use tokio::task::{AbortHandle, JoinSet};

use crate::error::{ChannelError, Result};
use crate::pipe::{MSG_LEN, Pipe, PipeConfig, RECV_SLOTS};

/// Accepts pipes at an address; see the [module docs](self).
pub struct PipeListener {
    local: SocketAddr,
    rx: tokio::sync::Mutex<mpsc::Receiver<Result<Pipe>>>,
    cm: Arc<AsyncListener>,
    failed: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for PipeListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipeListener").field("addr", &self.local).finish()
    }
}

/// Connection options a pipe's QP needs (inline control messages, receive slots, a CQ
/// for both queues), with `rdmakit_verbs`' defaults otherwise.
pub fn pipe_cm_options() -> CmOptions {
    CmOptions::default()
        .with_caps(
            QpCaps::default()
                .with_max_send_wr(256)
                .with_max_recv_wr(RECV_SLOTS + 8)
                .with_max_inline_data(MSG_LEN),
        )
        .with_cqe(1024)
}

impl PipeListener {
    /// Listens at `addr` (port 0 picks one) for pipes on `pd`'s device, each end made
    /// with `config`, connections with [`pipe_cm_options`]. Needs a tokio runtime.
    pub fn bind(pd: &ProtectionDomain, addr: SocketAddr, config: PipeConfig) -> Result<PipeListener> {
        Self::bind_with(pd, addr, &pipe_cm_options(), config, AsyncListener::DEFAULT_MAX_HANDSHAKES)
    }

    /// [`bind`](Self::bind) with connection options of the caller's (their QP must meet a
    /// pipe's needs, see [`pipe_cm_options`]) and at most `max_handshakes` clients (at
    /// least 1) in each set-up step at once.
    pub fn bind_with(
        pd: &ProtectionDomain,
        addr: SocketAddr,
        cm: &CmOptions,
        config: PipeConfig,
        max_handshakes: usize,
    ) -> Result<PipeListener> {
        let cm = Arc::new(AsyncListener::bind_with(pd, addr, cm, b"", max_handshakes)?);
        let local = cm.local_addr();
        let (tx, rx) = mpsc::channel(max_handshakes);
        let failed = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(run(
            cm.clone(),
            config,
            Arc::new(Semaphore::new(max_handshakes)),
            tx,
            failed.clone(),
        ));
        Ok(PipeListener { local, rx: tokio::sync::Mutex::new(rx), cm, failed, task })
    }

    /// The bound address (with the chosen port).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The next pipe, set up and ready. Errors are the listener's own, not a client's.
    /// Cancel-safe: a dropped call takes nothing.
    pub async fn accept(&self) -> Result<Pipe> {
        match self.rx.lock().await.recv().await {
            Some(r) => r,
            None => Err(ChannelError::Invalid("the pipe listener's task ended")),
        }
    }

    /// Clients dropped so far: failed or timed-out connection handshakes and pipe hellos.
    pub fn failed_handshakes(&self) -> u64 {
        self.cm.failed_handshakes() + self.failed.load(Ordering::Relaxed)
    }
}

impl Drop for PipeListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A pipe set-up in progress, as the listener's task tracks it.
struct SetUp {
    h: AbortHandle,
    /// Set up, waiting for [`PipeListener::accept`] (never dropped for a newer client).
    done: Arc<AtomicBool>,
    /// When its connection was taken.
    at: tokio::time::Instant,
}

async fn run(
    cm: Arc<AsyncListener>,
    config: PipeConfig,
    permits: Arc<Semaphore>,
    tx: mpsc::Sender<Result<Pipe>>,
    failed: Arc<AtomicU64>,
) {
    // Dropped with this task: aborts every pipe set-up in progress.
    let mut running = JoinSet::new();
    // Set-ups in progress, oldest first. The hello is one message each way: a set-up that
    // has not finished an eighth of `connect_timeout` after its connection (250 ms to 4 s)
    // is a client withholding its hello, and with every slot held it gives way to a newer
    // connection (such clients, renewed, held every slot).
    let mut setups: VecDeque<SetUp> = VecDeque::new();
    let stall = (config.connect_timeout / 8).clamp(Duration::from_millis(250), Duration::from_secs(4));
    loop {
        while running.try_join_next().is_some() {}
        let conn = tokio::select! {
            c = cm.accept() => c,
            () = tx.closed() => return,
        };
        let conn = match conn {
            Ok(c) => c,
            Err(e) => {
                if tx.send(Err(e.into())).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let permit = match permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(TryAcquireError::Closed) => return,
            // Every slot held: the oldest set-up gives way once it has stalled, unless a
            // slot frees first.
            Err(TryAcquireError::NoPermits) => loop {
                setups.retain(|x| !x.h.is_finished() && !x.done.load(Ordering::Acquire));
                let now = tokio::time::Instant::now();
                if setups.front().is_some_and(|x| now >= x.at + stall) {
                    let x = setups.pop_front().expect("just looked");
                    x.h.abort();
                    failed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!("pipe set-up dropped for a newer connection: it sent no hello");
                }
                let next = setups.front().map(|x| x.at + stall);
                // Freed when an aborted task is dropped (or by any other ending).
                tokio::select! {
                    p = permits.clone().acquire_owned() => match p {
                        Ok(p) => break p,
                        Err(_) => return,
                    },
                    () = async {
                        match next {
                            Some(t) => tokio::time::sleep_until(t).await,
                            None => std::future::pending().await,
                        }
                    } => {}
                    () = tx.closed() => return,
                }
            },
        };
        let (tx, failed) = (tx.clone(), failed.clone());
        let done = Arc::new(AtomicBool::new(false));
        let set = done.clone();
        let h = running.spawn(async move {
            // `from_connection` bounds its wait for the peer's hello by `connect_timeout`.
            match Pipe::from_connection(conn, config).await {
                Ok(pipe) => {
                    set.store(true, Ordering::Release);
                    drop(tx.send(Ok(pipe)).await);
                }
                Err(e) => {
                    failed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(error = %e, "pipe set-up failed");
                }
            }
            drop(permit);
        });
        setups.push_back(SetUp { h, done, at: tokio::time::Instant::now() });
    }
}

impl Pipe {
    /// Connects to a [`PipeListener`] at `addr` with a new connection on `pd` (options
    /// [`pipe_cm_options`]) and sets up this end with `config`.
    pub async fn connect_to(pd: &ProtectionDomain, addr: SocketAddr, config: PipeConfig) -> Result<Pipe> {
        Self::connect_to_with(pd, addr, &pipe_cm_options(), config).await
    }

    /// [`connect_to`](Self::connect_to) with connection options of the caller's.
    pub async fn connect_to_with(
        pd: &ProtectionDomain,
        addr: SocketAddr,
        cm: &CmOptions,
        config: PipeConfig,
    ) -> Result<Pipe> {
        let conn = connect_async(pd, addr, cm, b"").await?;
        Pipe::from_connection(conn, config).await
    }
}
