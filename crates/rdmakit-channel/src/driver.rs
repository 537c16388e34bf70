//! Completion progress for one completion queue, driven by the futures that wait on it.
//!
//! There is no background task: whichever future needs progress takes completions from
//! the CQ, hands each to the owner's handler under its state lock, and wakes the other
//! waiters. Two modes:
//! - [`PollMode::Busy`] polls the CQ and yields to the executor between polls: lowest
//!   latency, one core busy while waiting;
//! - [`PollMode::Event`] sleeps until the CQ has a completion (`ibv_get_cq_event` on the
//!   completion channel through tokio's reactor, or the soft NIC waking the task itself):
//!   no CPU while idle.
//!
//! Cancel safety: a completion leaves the CQ only in the same synchronous step that applies
//! it to the state, so dropping a waiting future loses nothing; the buffers of requests in
//! flight are held by the verbs layer's in-flight table until their completion is reaped,
//! whoever reaps it. Waiting allocates nothing.
//!
//! Liveness: while a wait is blocked, the state's [`ControlSlots`] gets a
//! [`tick`](ControlSlots::tick) every keep-alive interval (a timer in event mode, a clock
//! check between polls in busy mode), which sends a keep-alive when nothing is in flight;
//! a dead peer then fails it, and the failure is what the waiting condition returns.

use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use std::time::{Duration, Instant};

use rdmakit_verbs::{CompletionQueue, WorkCompletion};
use tokio::sync::Notify;

use crate::control::ControlSlots;
use crate::error::Result;

/// A driver's state: it holds the connection's control channel.
pub(crate) trait Controlled {
    /// The control channel.
    fn control(&mut self) -> &mut ControlSlots;
}

/// Completions taken per CQ poll.
const POLL_BATCH: usize = 8;

/// Steps [`Driver::try_unpolled`] takes in a row before the CQ must be polled again.
const UNPOLLED_MAX: usize = 16;

/// Rounds a busy-mode wait polls before it first yields to the executor.
const BUSY_SPIN_ROUNDS: u32 = 64;

/// How a driver waits for completions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PollMode {
    /// Poll the CQ, yielding between polls (latency).
    Busy,
    /// Sleep on completion events (CPU efficiency).
    #[default]
    Event,
}

/// Progress for one CQ whose completions update a state `S`.
#[derive(Debug)]
pub(crate) struct Driver<S> {
    cq: CompletionQueue,
    mode: PollMode,
    keepalive: Duration,
    state: Mutex<S>,
    notify: Notify,
    /// Futures registered to be woken: wake-ups are skipped (no lock taken) when zero.
    waiters: AtomicUsize,
    /// Steps taken by [`try_unpolled`](Self::try_unpolled) since the CQ was last polled.
    unpolled: AtomicUsize,
}

/// Counts a registered waiter for as long as it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<S: Controlled> Driver<S> {
    /// A driver over `cq` for `state`.
    pub(crate) fn new(cq: CompletionQueue, mode: PollMode, mut state: S) -> Self {
        let keepalive = state.control().keepalive_interval();
        Driver {
            cq,
            mode,
            keepalive,
            state: Mutex::new(state),
            notify: Notify::new(),
            waiters: AtomicUsize::new(0),
            unpolled: AtomicUsize::new(0),
        }
    }

    /// The CQ this driver takes completions from.
    pub(crate) fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// Runs `f` on the state (never across an await).
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut S) -> R) -> R {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut g)
    }

    /// Wakes every waiter (after a state change they may care about).
    pub(crate) fn wake_all(&self) {
        // Pairs with the waiter's increment-then-recheck in `wait_mode`: either the waiter
        // sees the change on its re-check, or this sees the waiter and wakes it.
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.notify.notify_waiters();
        }
    }

    /// Takes every completion available now and applies it with `handle`, then runs `then`
    /// on the state in the same critical section (one lock instead of two on the fast path;
    /// what `then` sees includes every completion taken). Returns what `then` returned.
    pub(crate) fn progress_then<R>(
        &self,
        handle: &mut impl FnMut(&mut S, &WorkCompletion),
        then: impl FnOnce(&mut S) -> R,
    ) -> Result<R> {
        // A small batch: the array is initialised on every call, and on the latency path
        // there are one or two completions to take.
        let mut wcs = [WorkCompletion::default(); POLL_BATCH];
        let mut total = 0;
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if self.unpolled.load(Ordering::Relaxed) != 0 {
            self.unpolled.store(0, Ordering::Relaxed);
        }
        loop {
            let n = match self.cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    drop(g);
                    if total > 0 {
                        self.wake_all();
                    }
                    return Err(e.into());
                }
            };
            for wc in &wcs[..n] {
                handle(&mut g, wc);
            }
            total += n;
            if n < wcs.len() {
                break;
            }
            // Let other threads in between full batches.
            drop(g);
            g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        }
        let r = then(&mut g);
        drop(g);
        if total > 0 {
            self.wake_all();
        }
        Ok(r)
    }

    /// Runs `step` on the state without polling the CQ first, unless that was done
    /// [`UNPOLLED_MAX`] times since the last poll; `None` then, and when `step` returns
    /// `None`. For a step that needs no completion to finish (a post whose completion
    /// nobody waits for): it skips an empty poll, and the next wait, or the next step
    /// past the limit, takes what came meanwhile.
    pub(crate) fn try_unpolled<R>(&self, step: impl FnOnce(&mut S) -> Option<R>) -> Option<R> {
        if self.unpolled.load(Ordering::Relaxed) >= UNPOLLED_MAX {
            return None;
        }
        self.with(|st| {
            let r = step(st);
            if r.is_some() {
                // Under the lock, as every other write of the count: no atomic add needed.
                self.unpolled.store(self.unpolled.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            }
            r
        })
    }

    /// Sends a keep-alive if one is due (see [`ControlSlots::tick`]).
    fn tick(&self) {
        self.with(|s| s.control().tick());
    }

    /// Runs `post_or_done` (under the state lock) until it returns `Some`, making
    /// progress with `handle` meanwhile. `post_or_done` posts what the operation can post
    /// now and returns `Some` once it has finished (or failed); it must not block.
    pub(crate) async fn wait<R>(
        &self,
        handle: impl FnMut(&mut S, &WorkCompletion),
        post_or_done: impl FnMut(&mut S) -> Option<Result<R>>,
    ) -> Result<R> {
        self.wait_mode(self.mode, handle, post_or_done).await
    }

    /// [`wait`](Self::wait) in the given mode: [`PollMode::Busy`] for conditions no
    /// completion announces (a flag in memory).
    pub(crate) async fn wait_mode<R>(
        &self,
        mode: PollMode,
        mut handle: impl FnMut(&mut S, &WorkCompletion),
        mut post_or_done: impl FnMut(&mut S) -> Option<Result<R>>,
    ) -> Result<R> {
        // Fast path, without registering: a post and its completion often take two rounds
        // (the condition posts a request, the next round finds its completion). Busy mode
        // spins a little longer before it starts yielding to the executor.
        let rounds = if mode == PollMode::Busy { BUSY_SPIN_ROUNDS } else { 2 };
        for _ in 0..rounds {
            if let Some(r) = self.progress_then(&mut handle, &mut post_or_done)? {
                return r;
            }
        }
        let mut last_tick = Instant::now();
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            self.waiters.fetch_add(1, Ordering::SeqCst);
            let _waiting = Waiting(&self.waiters);
            // (Re-)check now that a wake-up cannot be missed.
            if let Some(r) = self.progress_then(&mut handle, &mut post_or_done)? {
                return r;
            }
            match mode {
                PollMode::Busy => {
                    if last_tick.elapsed() >= self.keepalive {
                        last_tick = Instant::now();
                        self.tick();
                    }
                    tokio::task::yield_now().await
                }
                PollMode::Event => {
                    // The completion `next` takes must be applied in the same step, under
                    // the state lock: applied after the lock is re-taken, a concurrent
                    // `progress` could apply later completions first (messages would be
                    // seen out of order). So the future is polled under the lock.
                    let next = self.cq.next();
                    tokio::pin!(next);
                    let applied = std::future::poll_fn(|cx| {
                        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
                        next.as_mut().poll(cx).map(|r| r.map(|wc| handle(&mut g, &wc)))
                    });
                    tokio::select! {
                        r = applied => {
                            r?;
                            self.wake_all();
                        }
                        _ = &mut notified => {}
                        _ = tokio::time::sleep(self.keepalive.saturating_sub(last_tick.elapsed())) => {
                            last_tick = Instant::now();
                            self.tick();
                        }
                    }
                }
            }
        }
    }
}
