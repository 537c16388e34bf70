//! Soft completion queue: a bounded queue of completions, an eventfd for wake-ups, and
//! the wakers of tasks awaiting it on tokio.
//!
//! Like a hardware CQ it has a fixed capacity; a completion that does not fit is an overrun:
//! the CQ goes to error (every later poll reports it) and the producing QP goes to error,
//! so the loss is always visible.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::task::Waker;

use crate::error::{Error, Result};
use crate::wc::WorkCompletion;

/// A queue found empty this many times in a row (by any thread: the count is the queue's,
/// so a thread that polls many queues once each is not taken for a spinning one) makes the
/// poller yield the CPU once: the soft NIC's work is done by threads of this process (its
/// wire's loop, the timer), which a hardware NIC does not need, and on a host with fewer
/// cores than busy threads a poller that never yields keeps them waiting for its time
/// slice to end.
const YIELD_EVERY: u32 = 64;

pub(crate) struct SoftCq {
    capacity: u32,
    state: Mutex<CqState>,
    /// Whether `state` has completions or an overrun to report: set and cleared under its
    /// lock, read without it, so that a thread busy-polling an empty queue does not take
    /// the lock the NIC's thread needs to add completions.
    ready: AtomicBool,
    /// Empty polls in a row, by any thread (see [`YIELD_EVERY`]).
    empty_polls: AtomicU32,
    /// Created on first use: polling-only users never pay for an fd.
    event_fd: OnceLock<std::io::Result<OwnedFd>>,
}

struct CqState {
    queue: VecDeque<WorkCompletion>,
    overrun: bool,
    /// `req_notify` was called and no event has fired since.
    armed: bool,
    /// Waits in progress ([`Wait`]), by registration: woken by the next completion
    /// directly, which costs no system call when their runtime is awake and one (tokio's,
    /// shared by every CQ it waits for) when it sleeps, where the eventfd costs a write
    /// and a read per completion. A wait given up takes its entry with it.
    waker: Option<(u64, Waker)>,
    /// More of them, when several tasks await one CQ (rare).
    more_wakers: Vec<(u64, Waker)>,
    /// The next registration's number.
    next_wait: u64,
}

impl SoftCq {
    pub fn new(capacity: u32) -> SoftCq {
        SoftCq {
            capacity,
            state: Mutex::new(CqState {
                queue: VecDeque::with_capacity((capacity as usize).min(4096)),
                overrun: false,
                armed: false,
                waker: None,
                more_wakers: Vec::new(),
                next_wait: 0,
            }),
            ready: AtomicBool::new(false),
            empty_polls: AtomicU32::new(0),
            event_fd: OnceLock::new(),
        }
    }

    /// Adds a completion. Returns false on overrun (the completion is lost and the CQ is
    /// now in error).
    pub fn push(&self, wc: WorkCompletion) -> bool {
        let mut st = self.state.lock().expect("cq lock");
        let ok = if st.overrun {
            false
        } else if st.queue.len() >= self.capacity as usize {
            st.overrun = true;
            tracing::warn!(capacity = self.capacity, "soft NIC: completion queue overrun");
            false
        } else {
            st.queue.push_back(wc);
            true
        };
        self.ready.store(true, Ordering::Release);
        self.wake(st);
        ok
    }

    /// Completions that cannot all fit are owed to this queue (more than it holds, none
    /// of them visible yet): it overruns now, as it would once they came.
    pub fn overrun(&self) {
        let mut st = self.state.lock().expect("cq lock");
        if !std::mem::replace(&mut st.overrun, true) {
            tracing::warn!(capacity = self.capacity, "soft NIC: completion queue overrun");
        }
        self.ready.store(true, Ordering::Release);
        self.wake(st);
    }

    /// How many completions the queue holds.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Wakes what waits on the queue (an overrun too, so that waiters see the error
    /// instead of sleeping for ever), after releasing its lock.
    fn wake(&self, mut st: std::sync::MutexGuard<'_, CqState>) {
        let signal = std::mem::take(&mut st.armed);
        let waker = st.waker.take();
        let more = if st.more_wakers.is_empty() { Vec::new() } else { std::mem::take(&mut st.more_wakers) };
        drop(st);
        if signal {
            self.signal();
        }
        if let Some((_, w)) = waker {
            w.wake();
        }
        more.into_iter().for_each(|(_, w)| w.wake());
    }

    /// Registers (or renews) wait `id`'s waker `w`, to be woken by the next completion (or
    /// an overrun), unless there is one already: false then, and the caller polls again
    /// instead of waiting.
    fn register(&self, id: &mut Option<u64>, w: &Waker) -> bool {
        let mut guard = self.state.lock().expect("cq lock");
        let st = &mut *guard;
        if !st.queue.is_empty() || st.overrun {
            return false;
        }
        if let Some(i) = *id
            && let Some((_, old)) =
                st.waker.iter_mut().chain(st.more_wakers.iter_mut()).find(|(x, _)| *x == i)
        {
            if !old.will_wake(w) {
                old.clone_from(w);
            }
            return true;
        }
        let i = st.next_wait;
        st.next_wait = i.wrapping_add(1);
        *id = Some(i);
        match st.waker {
            None => st.waker = Some((i, w.clone())),
            Some(_) => st.more_wakers.push((i, w.clone())),
        }
        true
    }

    /// Forgets wait `id` (gone already if a completion woke it).
    fn deregister(&self, id: u64) {
        let mut st = self.state.lock().expect("cq lock");
        if st.waker.as_ref().is_some_and(|(x, _)| *x == id) {
            st.waker = None;
        } else {
            st.more_wakers.retain(|(x, _)| *x != id);
        }
    }

    /// Waits registered.
    #[cfg(test)]
    pub fn waiters(&self) -> usize {
        let st = self.state.lock().expect("cq lock");
        usize::from(st.waker.is_some()) + st.more_wakers.len()
    }

    /// Moves up to `out.len()` completions into `out`.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        // Nothing since the last poll that emptied it (a completion added meanwhile is
        // seen by the next poll; a thread arming the queue takes the lock, after which
        // either it sees the flag or the completion's producer sees it armed).
        if !self.ready.load(Ordering::Acquire) {
            if self.empty_polls.fetch_add(1, Ordering::Relaxed) % YIELD_EVERY == YIELD_EVERY - 1 {
                std::thread::yield_now();
            }
            return Ok(0);
        }
        self.empty_polls.store(0, Ordering::Relaxed);
        let mut st = self.state.lock().expect("cq lock");
        if st.overrun {
            return Err(Error::CqOverrun { capacity: self.capacity });
        }
        let n = out.len().min(st.queue.len());
        for (slot, wc) in out.iter_mut().zip(st.queue.drain(..n)) {
            *slot = wc;
        }
        if st.queue.is_empty() {
            self.ready.store(false, Ordering::Relaxed);
        }
        Ok(n)
    }

    /// Arms the CQ: the next completion (or an overrun) signals the event fd.
    pub fn req_notify(&self) -> Result<()> {
        self.fd()?;
        self.state.lock().expect("cq lock").armed = true;
        Ok(())
    }

    /// The eventfd that becomes readable when an armed CQ gets a completion.
    pub fn fd(&self) -> Result<RawFd> {
        let fd = self.event_fd.get_or_init(|| {
            // SAFETY: plain syscall; a non-negative return is a fresh fd we now own.
            let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if fd < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                // SAFETY: `fd` is a new, valid descriptor owned by nobody else.
                Ok(unsafe { OwnedFd::from_raw_fd(fd) })
            }
        });
        match fd {
            Ok(fd) => Ok(fd.as_raw_fd()),
            Err(e) => Err(Error::Os { call: "eventfd", source: std::io::Error::from(e.kind()) }),
        }
    }

    /// Consumes pending events; returns whether there was one.
    pub fn take_event(&self) -> bool {
        let Some(Ok(fd)) = self.event_fd.get() else { return false };
        let mut v = 0u64;
        // SAFETY: reading 8 bytes into a local u64 from our own non-blocking eventfd.
        let n = unsafe { libc::read(fd.as_raw_fd(), (&raw mut v).cast(), 8) };
        n == 8
    }

    fn signal(&self) {
        if let Some(Ok(fd)) = self.event_fd.get() {
            let one = 1u64;
            // SAFETY: writing 8 bytes from a local u64 to our own eventfd. Failure (counter
            // saturated) still leaves the fd readable, which is all a waiter needs.
            unsafe { libc::write(fd.as_raw_fd(), (&raw const one).cast(), 8) };
        }
    }

    /// Drops queued completions of a destroyed QP (as `ibv_destroy_qp` cleans the CQ).
    pub fn remove_qp(&self, qpn: u32) {
        self.state.lock().expect("cq lock").queue.retain(|wc| wc.qp_num != qpn);
    }
}

/// One wait for a completion of a [`SoftCq`] (`CompletionQueue::next` on the soft NIC):
/// its waker is registered while it waits and deregistered when it is dropped, so waits
/// given up (a timeout, a `select!` lost) leave nothing behind however many there are.
pub(crate) struct Wait<'a> {
    cq: &'a SoftCq,
    id: Option<u64>,
}

// Only `CompletionQueue::next` waits, which needs the `async` feature.
#[cfg_attr(not(feature = "async"), allow(dead_code))]
impl<'a> Wait<'a> {
    pub(crate) fn new(cq: &'a SoftCq) -> Wait<'a> {
        Wait { cq, id: None }
    }

    /// Registers `w` to be woken by the next completion; false if one is there already
    /// (poll again instead of waiting).
    pub(crate) fn register(&mut self, w: &Waker) -> bool {
        self.cq.register(&mut self.id, w)
    }
}

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.cq.deregister(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrun_is_sticky_and_reported() {
        let cq = SoftCq::new(2);
        assert!(cq.push(WorkCompletion { wr_id: 1, ..Default::default() }));
        assert!(cq.push(WorkCompletion { wr_id: 2, ..Default::default() }));
        assert!(!cq.push(WorkCompletion { wr_id: 3, ..Default::default() }));
        let mut out = [WorkCompletion::default(); 4];
        assert!(matches!(cq.poll(&mut out), Err(Error::CqOverrun { capacity: 2 })));
    }

    #[test]
    fn poll_drains_in_order() {
        let cq = SoftCq::new(8);
        for i in 0..5 {
            cq.push(WorkCompletion { wr_id: i, ..Default::default() });
        }
        let mut out = [WorkCompletion::default(); 3];
        assert_eq!(cq.poll(&mut out).unwrap(), 3);
        assert_eq!(out.map(|w| w.wr_id), [0, 1, 2]);
        assert_eq!(cq.poll(&mut out).unwrap(), 2);
        assert_eq!(out[1].wr_id, 4);
    }

    /// A poller spinning on the queue without its lock (the `ready` flag) misses no
    /// completion a producer thread adds meanwhile, and sees them in order.
    #[test]
    fn a_busy_poller_sees_every_completion_of_a_concurrent_producer() {
        let total: u64 = if cfg!(miri) { 200 } else { 200_000 };
        let cq = std::sync::Arc::new(SoftCq::new(1024));
        let producer = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                let mut i = 0;
                while i < total {
                    if cq.state.lock().unwrap().queue.len() < 1000 {
                        assert!(cq.push(WorkCompletion { wr_id: i, ..Default::default() }));
                        i += 1;
                    } else {
                        std::thread::yield_now();
                    }
                }
            })
        };
        let mut next = 0;
        let mut out = [WorkCompletion::default(); 16];
        let mut last = std::time::Instant::now();
        while next < total {
            let n = cq.poll(&mut out).unwrap();
            if n > 0 {
                last = std::time::Instant::now();
            }
            assert!(last.elapsed() < std::time::Duration::from_secs(10), "stuck at {next} of {total}");
            for wc in &out[..n] {
                assert_eq!(wc.wr_id, next);
                next += 1;
            }
        }
        producer.join().unwrap();
        assert_eq!(cq.poll(&mut out).unwrap(), 0);
    }

    #[cfg(not(miri))]
    #[test]
    fn armed_cq_signals_its_fd() {
        let cq = SoftCq::new(8);
        cq.req_notify().unwrap();
        assert!(!cq.take_event());
        cq.push(WorkCompletion::default());
        assert!(cq.take_event());
        // Disarmed after one event.
        cq.push(WorkCompletion::default());
        assert!(!cq.take_event());
    }

    /// Counts its wakes.
    struct Count(std::sync::atomic::AtomicUsize);
    impl std::task::Wake for Count {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn registered_wakers_are_woken_once_by_the_next_completion() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let cq = SoftCq::new(8);
        let (a, b) = (Arc::new(Count(AtomicUsize::new(0))), Arc::new(Count(AtomicUsize::new(0))));
        let (wa, wb) = (Waker::from(a.clone()), Waker::from(b.clone()));
        // Two waits (one registering twice: kept once, as its own entry) on an empty CQ.
        let (mut ka, mut kb) = (Wait::new(&cq), Wait::new(&cq));
        assert!(ka.register(&wa));
        assert!(ka.register(&wa));
        assert!(kb.register(&wb));
        assert_eq!(cq.waiters(), 2);
        cq.push(WorkCompletion::default());
        let woken_a = a.0.load(Ordering::SeqCst);
        assert!((1..=2).contains(&woken_a), "{woken_a}");
        assert_eq!(b.0.load(Ordering::SeqCst), 1);
        // With a completion queued, nothing is registered: the caller polls instead.
        assert!(!ka.register(&wa));
        cq.push(WorkCompletion::default());
        assert_eq!(a.0.load(Ordering::SeqCst), woken_a, "a waker is woken only after a registration");
        // An overrun wakes too (the waiter then sees the error).
        let small = SoftCq::new(1);
        small.push(WorkCompletion::default());
        let mut out = [WorkCompletion::default(); 1];
        small.poll(&mut out).unwrap();
        let mut kc = Wait::new(&small);
        assert!(kc.register(&wb));
        small.push(WorkCompletion::default());
        assert_eq!(b.0.load(Ordering::SeqCst), 2);
        // A wait dropped before any completion takes its registration with it.
        let idle = SoftCq::new(4);
        let mut kd = Wait::new(&idle);
        assert!(kd.register(&wa));
        drop(kd);
        assert_eq!(idle.waiters(), 0);
    }
}
