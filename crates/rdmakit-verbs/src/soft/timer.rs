//! The soft NIC's timers: one background thread that wakes QPs whose head request is
//! waiting for a retry (RNR NAK back-off, transport timeout), as an HCA's timers would, or
//! for a same-host grant (its deadline, its answer, or a bulk direct copy the wire's loop
//! leaves to this thread: `super::direct`). Everything else happens on the threads that
//! post and poll.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Condvar, Mutex, OnceLock, Weak};
use std::time::Instant;

use super::qp::SoftQp;

struct Timer {
    at: Instant,
    seq: u64,
    qp: Weak<SoftQp>,
}

impl PartialEq for Timer {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Timer {}
impl PartialOrd for Timer {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timer {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

struct TimerThread {
    timers: Mutex<(BinaryHeap<Reverse<Timer>>, u64)>,
    wake: Condvar,
}

fn timer_thread() -> &'static TimerThread {
    static THREAD: OnceLock<&'static TimerThread> = OnceLock::new();
    THREAD.get_or_init(|| {
        let e: &'static TimerThread = Box::leak(Box::new(TimerThread {
            timers: Mutex::new((BinaryHeap::new(), 0)),
            wake: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("rdmakit-soft-timers".into())
            .spawn(move || run(e))
            .expect("spawn soft NIC timer thread");
        e
    })
}

/// Calls `qp.on_timer()` at `at` (if the QP still exists).
pub(crate) fn schedule(at: Instant, qp: Weak<SoftQp>) {
    let e = timer_thread();
    let mut t = e.timers.lock().expect("timer lock");
    t.1 += 1;
    let seq = t.1;
    t.0.push(Reverse(Timer { at, seq, qp }));
    drop(t);
    e.wake.notify_one();
}

/// Timers queued and not fired yet (all QPs of the process).
pub(crate) fn pending() -> usize {
    timer_thread().timers.lock().expect("timer lock").0.len()
}

fn run(e: &'static TimerThread) {
    let mut t = e.timers.lock().expect("timer lock");
    loop {
        let now = Instant::now();
        match t.0.peek() {
            None => t = e.wake.wait(t).expect("timer lock"),
            Some(Reverse(top)) if top.at > now => {
                let d = top.at - now;
                t = e.wake.wait_timeout(t, d).expect("timer lock").0;
            }
            Some(_) => {
                let Reverse(timer) = t.0.pop().expect("peeked");
                drop(t);
                if let Some(qp) = timer.qp.upgrade() {
                    qp.on_timer();
                }
                t = e.timers.lock().expect("timer lock");
            }
        }
    }
}
