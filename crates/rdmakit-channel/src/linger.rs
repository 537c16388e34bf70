//! Dropped pipe ends waiting for their inline rwrites to complete.
//!
//! An inline rwrite resolves when it is posted, and destroying the QP at once would discard
//! it if the NIC had not executed it yet. So a dropped end with such a write outstanding
//! lingers, as a socket's close does: its QP, CQ and connection are kept until nothing is
//! outstanding, for at most [`LINGER`].
//!
//! On a tokio runtime one task of its blocking pool serves every end dropped on that
//! runtime while it runs (a runtime shutting down waits for it, up to the last end's
//! deadline), however many ends are dropped at once: a server dropping the pipes of a peer
//! host that died uses one thread for them, not one each (before, each end took a thread of
//! the blocking pool, up to its 512). Without a runtime, the dropping thread waits.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rdmakit_verbs::cm::Connection;
use rdmakit_verbs::{CompletionQueue, QueuePair, WorkCompletion};
use tokio::runtime;

/// Longest a dropped pipe end lingers for its inline rwrites to complete.
pub(crate) const LINGER: Duration = Duration::from_secs(1);

/// Longest sleep between two looks at the ends of a shared linger.
const PAUSE_MAX: Duration = Duration::from_millis(5);

/// What a dropped end leaves until its requests have completed.
pub(crate) struct Remains {
    /// Kept open while the QP lingers (dropped before the QP and CQ, as it always was).
    pub(crate) _conn: Option<Connection>,
    pub(crate) qp: QueuePair,
    /// The pipe's own CQ (`Pipe::connect`): its completions can be discarded.
    pub(crate) cq: CompletionQueue,
    pub(crate) deadline: Instant,
}

impl Remains {
    /// True once nothing is outstanding or the deadline has passed (the remains may go).
    fn settled(&self, now: Instant) -> bool {
        drained(&self.qp, &self.cq) || now >= self.deadline
    }
}

/// Reaps `cq` (the pipe's own: its completions can be discarded); true if `qp` then has
/// nothing outstanding.
fn drained(qp: &QueuePair, cq: &CompletionQueue) -> bool {
    let mut wcs = [WorkCompletion::default(); 8];
    while matches!(cq.poll(&mut wcs), Ok(n) if n > 0) {}
    qp.outstanding().0 == 0
}

/// The ends lingering in one runtime's shared task, and that task.
struct Shared {
    rt: runtime::Id,
    ends: Vec<Remains>,
    /// The running task's number (it runs while its runtime's entry exists).
    task: u64,
}

/// Per runtime with ends lingering (its task runs while its entry is here): each runtime's
/// task serves that runtime's ends only, so a runtime shutting down waits for its own.
static SHARED: Mutex<Vec<Shared>> = Mutex::new(Vec::new());
static NEXT_TASK: AtomicU64 = AtomicU64::new(0);

fn shared() -> std::sync::MutexGuard<'static, Vec<Shared>> {
    SHARED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Lets `r` linger: in the shared task of the current tokio runtime's blocking pool
/// (started if none runs), or on this thread without a runtime.
pub(crate) fn linger(r: Remains) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        linger_here(&r.qp, &r.cq, r.deadline);
        return;
    };
    let id = rt.id();
    let mut all = shared();
    if let Some(s) = all.iter_mut().find(|s| s.rt == id) {
        s.ends.push(r);
        return;
    }
    let task = NEXT_TASK.fetch_add(1, Ordering::Relaxed);
    all.push(Shared { rt: id, ends: vec![r], task });
    drop(all);
    let guard = Serving { rt: id, task };
    drop(rt.spawn_blocking(move || {
        serve(id);
        drop(guard);
    }));
}

/// Held by a runtime's shared task. Dropped while its runtime's entry is still its own, the
/// task never ran (a runtime shutting down drops what it is given) or panicked: the ends it
/// had to serve go at once, and the runtime's next linger starts a new task.
struct Serving {
    rt: runtime::Id,
    task: u64,
}

impl Drop for Serving {
    fn drop(&mut self) {
        let mut all = shared();
        if let Some(k) = all.iter().position(|s| s.rt == self.rt && s.task == self.task) {
            let gone = all.swap_remove(k);
            drop(all);
            drop(gone);
        }
    }
}

/// Shared tasks running now, and the most that ever ran at once (tests).
#[cfg(test)]
static SERVING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
#[cfg(test)]
static SERVING_MAX: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The shared task: looks at every lingering end, sleeping between looks (10 µs, doubling
/// to [`PAUSE_MAX`]), until none is left. The pause starts again from 10 µs only when the
/// task had no end left: an end arriving while others linger waits for the next look (at
/// most [`PAUSE_MAX`]), so a steady stream of dropped ends does not keep the task looking at
/// all of them every few microseconds. Returns the number of looks.
fn serve(rt: runtime::Id) -> usize {
    #[cfg(test)]
    {
        let now = SERVING.fetch_add(1, Ordering::SeqCst) + 1;
        SERVING_MAX.fetch_max(now, Ordering::SeqCst);
    }
    let mut looks = 0;
    let mut pause = Duration::from_micros(10);
    let mut mine: Vec<Remains> = Vec::new();
    loop {
        {
            let mut all = shared();
            // Only this task removes its runtime's entry while it runs.
            let Some(k) = all.iter().position(|s| s.rt == rt) else { return looks };
            if !all[k].ends.is_empty() {
                if mine.is_empty() {
                    pause = Duration::from_micros(10);
                }
                mine.append(&mut all[k].ends);
            }
            if mine.is_empty() {
                all.swap_remove(k);
                #[cfg(test)]
                SERVING.fetch_sub(1, Ordering::SeqCst);
                return looks;
            }
        }
        looks += 1;
        // Remains dropped here, outside the lock: their QP, CQ and connection close.
        let now = Instant::now();
        mine.retain(|r| !r.settled(now));
        if mine.is_empty() {
            continue;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(PAUSE_MAX);
    }
}

/// A dropped end's linger on this thread: until `qp` has nothing outstanding once `cq` is
/// reaped, or `deadline`. It sleeps on `cq`'s completion channel, waking on a completion; if
/// the channel fails, it polls with sleeps doubling from 10 µs to 5 ms. It never spins,
/// whatever the pipe's poll mode: a drop needs no low latency, and a peer that never
/// answers then costs no CPU. Returns how many times it looked.
pub(crate) fn linger_here(qp: &QueuePair, cq: &CompletionQueue, deadline: Instant) -> usize {
    let mut looks = 0;
    let mut channel = true;
    let mut pause = Duration::from_micros(10);
    loop {
        looks += 1;
        if drained(qp, cq) {
            return looks;
        }
        let Some(left) = deadline.checked_duration_since(Instant::now()) else { return looks };
        if channel {
            match cq.wait(Some(left)) {
                Ok(_) => {}
                Err(rdmakit_verbs::Error::Timeout(_)) => return looks,
                Err(e) => {
                    tracing::debug!(error = %e, "a dropped pipe end's CQ cannot be waited on: polling");
                    channel = false;
                }
            }
        } else {
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(PAUSE_MAX);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmakit_verbs::{AccessFlags, ConnectOptions, Context, MemoryRegion, QpCaps, RecvWr, SendWr};

    /// A QP with a send outstanding that never completes until its peer posts a receive (a
    /// peer that never answers: the requester retries "receiver not ready" for ever), its
    /// CQ, the peer, and a buffer for that receive.
    struct Stuck {
        a: QueuePair,
        cq: CompletionQueue,
        b: QueuePair,
        inbox: MemoryRegion,
        _src: MemoryRegion,
    }

    fn stuck() -> Stuck {
        let ctx = Context::open_soft();
        let cq = ctx.create_cq(8).expect("cq");
        let pd = ctx.alloc_pd().expect("pd");
        let caps = QpCaps::default();
        let (a, b) = (pd.create_qp(&cq, &cq, caps).expect("qp"), pd.create_qp(&cq, &cq, caps).expect("qp"));
        let opts = ConnectOptions::default(); // retries "not ready" for ever
        a.connect(&b.address().expect("address"), &opts).expect("connect");
        b.connect(&a.address().expect("address"), &opts).expect("connect");
        let src = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).expect("mr");
        let inbox = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).expect("mr");
        a.post_send(SendWr::send(src.local().expect("local"))).expect("post");
        Stuck { a, cq, b, inbox, _src: src }
    }

    impl Stuck {
        fn remains(&self, deadline: Instant) -> Remains {
            Remains { _conn: None, qp: self.a.clone(), cq: self.cq.clone(), deadline }
        }

        fn answer(&self) {
            self.b.post_recv(RecvWr::new(self.inbox.local().expect("local"))).expect("post_recv");
        }
    }

    /// The tests of the shared task take turns (it is one per process).
    static TURN: Mutex<()> = Mutex::new(());

    fn idle() -> bool {
        shared().is_empty()
    }

    /// On this thread, an end whose request never completes sleeps until its deadline,
    /// looking once; once the peer posts the receive 50 ms in, the linger returns at the
    /// send's completion, woken by it, not by polling.
    #[test]
    fn a_linger_here_sleeps_until_a_completion_or_its_deadline() {
        let s = stuck();
        let start = Instant::now();
        let looks = linger_here(&s.a, &s.cq, start + Duration::from_millis(100));
        assert!(start.elapsed() >= Duration::from_millis(100), "ended before its deadline");
        assert!(looks <= 2, "looked {looks} times");
        assert_eq!(s.a.outstanding().0, 1, "the send completed without a receive");

        let start = Instant::now();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                s.answer();
            });
            let looks = linger_here(&s.a, &s.cq, start + Duration::from_secs(5));
            let elapsed = start.elapsed();
            assert!(elapsed >= Duration::from_millis(50), "ended before the send completed: {elapsed:?}");
            assert!(elapsed < Duration::from_secs(2), "slept to its deadline: {elapsed:?}");
            assert!(looks <= 4, "looked {looks} times: it polled instead of sleeping on the channel");
        });
    }

    /// 64 ends dropped at once on a runtime whose peers never answer linger in one task of
    /// the blocking pool, not one thread each; all of them go at their deadline, and an end
    /// whose peer answers goes at its completion, long before its own.
    #[test]
    fn ends_dropped_at_once_linger_in_one_task() {
        let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).build().expect("runtime");
        let ends: Vec<Stuck> = (0..64).map(|_| stuck()).collect();
        SERVING_MAX.store(0, Ordering::SeqCst);
        let start = Instant::now();
        rt.block_on(async {
            for e in &ends {
                linger(e.remains(start + Duration::from_millis(300)));
            }
        });
        while !idle() {
            assert!(start.elapsed() < Duration::from_secs(5), "the ends still linger after 5 s");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(start.elapsed() >= Duration::from_millis(300), "an end went before its deadline");
        assert_eq!(SERVING_MAX.load(Ordering::SeqCst), 1, "more than one task lingered");
        assert!(ends.iter().all(|e| e.a.outstanding().0 == 1), "a send completed without a receive");

        let answered = stuck();
        let start = Instant::now();
        rt.block_on(async { linger(answered.remains(start + Duration::from_secs(5))) });
        std::thread::sleep(Duration::from_millis(20));
        answered.answer();
        while !idle() {
            assert!(start.elapsed() < Duration::from_secs(2), "the answered end waited for its deadline");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(answered.a.outstanding().0, 0, "the end went before its send completed");
    }

    /// An end dropped in the context of a runtime that has shut down: its task never runs.
    /// Nothing stays behind, and the next end starts a task that does.
    #[test]
    fn a_task_that_never_ran_leaves_nothing_behind() {
        let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let handle = rt.handle().clone();
        drop(rt);
        let e = stuck();
        {
            let _in = handle.enter();
            linger(e.remains(Instant::now() + Duration::from_secs(5)));
        }
        assert!(idle(), "an end waits for a task that will never run");

        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let start = Instant::now();
        rt.block_on(async { linger(e.remains(start + Duration::from_millis(50))) });
        while !idle() {
            assert!(start.elapsed() < Duration::from_secs(2), "the new task did not serve the end");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Two runtimes, each with an end lingering: each has its own task, and dropping one
    /// (which waits for its blocking tasks) waits for its own end only, not the other's.
    #[test]
    fn each_runtime_waits_for_its_own_ends_only() {
        let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
        let rt = || tokio::runtime::Builder::new_multi_thread().worker_threads(1).build().expect("runtime");
        let (a, b) = (rt(), rt());
        let (ea, eb) = (stuck(), stuck());
        let start = Instant::now();
        a.block_on(async { linger(ea.remains(start + Duration::from_millis(200))) });
        b.block_on(async { linger(eb.remains(start + Duration::from_secs(5))) });
        assert_eq!(shared().len(), 2, "one task per runtime");
        drop(a);
        let elapsed = start.elapsed();
        assert!(elapsed >= Duration::from_millis(200), "the runtime did not wait for its end: {elapsed:?}");
        assert!(elapsed < Duration::from_secs(2), "the runtime waited for the other's end: {elapsed:?}");
        eb.answer();
        drop(b);
        assert!(start.elapsed() < Duration::from_secs(3), "the answered end waited for its deadline");
        assert!(idle());
    }

    /// Ends arriving one every 2 ms while others linger (100 ms each, peers that never
    /// answer): the task backs off to its longest pause instead of starting over at 10 µs
    /// with each arrival, so its looks stay near one per 5 ms, not one per few microseconds.
    #[test]
    fn a_stream_of_dropped_ends_does_not_keep_the_task_looking() {
        let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let id = rt.handle().id();
        let ends: Vec<Stuck> = (0..50).map(|_| stuck()).collect();
        let start = Instant::now();
        shared().push(Shared {
            rt: id,
            ends: vec![ends[0].remains(start + Duration::from_millis(100))],
            task: u64::MAX,
        });
        let mut last = start + Duration::from_millis(100);
        let looks = std::thread::scope(|scope| {
            let task = scope.spawn(move || serve(id));
            for e in &ends[1..] {
                std::thread::sleep(Duration::from_millis(2));
                let mut all = shared();
                let entry = all.iter_mut().find(|s| s.rt == id).expect("the task runs while ends linger");
                last = Instant::now() + Duration::from_millis(100);
                entry.ends.push(e.remains(last));
            }
            task.join().expect("serve")
        });
        let took = start.elapsed();
        assert!(idle(), "the task left its entry behind");
        assert!(Instant::now() >= last, "ends went before their deadlines: {took:?}");
        // About 200 ms in all: about 40 looks at one per 5 ms. Starting over at 10 µs with
        // each arrival, the task looked 363 and 368 times in two runs.
        assert!(looks < 150, "{looks} looks in {took:?}");
    }
}
