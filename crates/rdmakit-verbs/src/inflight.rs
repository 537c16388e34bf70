//! The in-flight table: what keeps buffers alive while the NIC may touch them.
//!
//! Every posted work request gets a slot holding a clone of its local memory region and
//! the user's `wr_id`; the provider sees only a sequence number. The slot is released when
//! the completion is reaped from the CQ (success, error or flush), or when the QP is
//! destroyed (after which the NIC no longer touches its buffers). Dropping or leaking any
//! user-side object therefore never frees memory under the NIC.
//!
//! The send queue completes in order on an RC QP, so it is a FIFO: a completion for
//! sequence number `s` also retires the unsignalled requests before it. Receives are always
//! signalled, so a receive completion retires its own slot only: a flush of later receives
//! reaped first (the soft NIC publishes it while an earlier receive is still being filled)
//! leaves the earlier one's region held until its own completion.
//!
//! A request prepared once and posted many times ([`crate::PreparedSend`]) holds its region
//! itself, and its slots hold none: no reference count is taken and released per post (two
//! atomic read-modify-writes on a counter every thread posting from that region shares).
//! Dropped with posts outstanding, it hands its region to the table ([`Queues::keep`]),
//! which keeps it until the send queue has retired the last of those posts.
//!
//! A slot can hold a region's last handle (the caller moved its region into the request),
//! and dropping that deregisters it: a system call on verbs (unpinning a large region takes
//! milliseconds), and on the soft NIC possibly a wait for its accesses to end. So a slot
//! released under a lock buries such a region instead ([`Queues::bury`]), and it is
//! deregistered after the locks are released: [`Locked`] does it when the in-flight lock
//! is let go, and a CQ poll, which also holds the CQ's registry, after both.

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::mr::{MemoryRegion, MrInner};
use crate::wc::WorkCompletion;

/// Bit 63 of the provider-visible `wr_id` marks receive requests.
const RECV_BIT: u64 = 1 << 63;
/// Bits 52 to 62: the table's tag, a number drawn per table (per QP), so that a completion
/// left in a shared CQ by a destroyed QP whose number a new QP took (rxe neither purges the
/// CQ on `ibv_destroy_qp` nor avoids reusing numbers) matches none of the new QP's slots:
/// the CQ's registry (`cq::Registry`) keeps a new QP off the tags such completions carry.
const TAG_SHIFT: u32 = 52;
const TAG_MASK: u64 = 0x7ff << TAG_SHIFT;
/// Bits 0 to 51: the request's sequence number (2^52 requests per QP).
const SEQ_MASK: u64 = (1 << TAG_SHIFT) - 1;

/// The next table's tag.
fn next_tag() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    #[cfg(test)]
    if let Some(tag) = FIRST_TAG.take() {
        return tag;
    }
    (NEXT.fetch_add(1, Ordering::Relaxed) << TAG_SHIFT) & TAG_MASK
}

#[cfg(test)]
thread_local! {
    /// The tag this thread's next table draws (tests: two tables 2^11 apart).
    pub(crate) static FIRST_TAG: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

struct Slot {
    seq: u64,
    user_wr_id: u64,
    /// Keeps the local buffer registered and allocated until the request completes.
    mr: Option<MemoryRegion>,
}

pub(crate) struct Queues {
    send: VecDeque<Slot>,
    recv: VecDeque<Slot>,
    next_seq: u64,
    /// This table's tag, in every provider `wr_id` it hands out.
    tag: u64,
    max_send: u32,
    max_recv: u32,
    /// `send.len()`, for [`Inflight::outstanding_sends`]: stored under the lock after
    /// every change, read without it.
    send_len: Arc<AtomicUsize>,
    /// Regions whose last handle a released slot held: deregistered once the lock is let
    /// go (empty, and unallocated, unless a caller gave its region up to a request).
    graves: Vec<MrInner>,
    /// Send requests accepted since the table was made (a post's number; a `u64` does
    /// not wrap). Those retired are the first `posted - send.len()` ([`Queues::retired`]).
    posted: u64,
    /// Regions of dropped prepared requests, each with the number of its last post: kept
    /// until that post has retired. Sorted by that number.
    kept: VecDeque<(u64, MemoryRegion)>,
}

/// The in-flight lock, held: releasing it deregisters the regions buried meanwhile, after
/// the lock is let go.
pub(crate) struct Locked<'a>(ManuallyDrop<MutexGuard<'a, Queues>>);

impl std::ops::Deref for Locked<'_> {
    type Target = Queues;
    fn deref(&self) -> &Queues {
        &self.0
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Queues {
        &mut self.0
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let graves = std::mem::take(&mut self.0.graves);
        // SAFETY: the guard is dropped here, once, and never used again (this is `Locked`'s
        // drop, and nothing else takes it out of the `ManuallyDrop`).
        unsafe { ManuallyDrop::drop(&mut self.0) };
        drop(graves);
    }
}

pub(crate) struct Inflight {
    pub(crate) q: Mutex<Queues>,
    send_len: Arc<AtomicUsize>,
}

impl Inflight {
    pub fn new(max_send: u32, max_recv: u32) -> Inflight {
        let send_len = Arc::new(AtomicUsize::new(0));
        Inflight {
            send_len: send_len.clone(),
            q: Mutex::new(Queues {
                send_len,
                send: VecDeque::with_capacity(max_send as usize),
                recv: VecDeque::with_capacity(max_recv as usize),
                next_seq: 1,
                tag: next_tag(),
                max_send,
                max_recv,
                graves: Vec::new(),
                posted: 0,
                kept: VecDeque::new(),
            }),
        }
    }

    /// Locks the table (for a post, or a run of completions under one lock).
    pub fn lock(&self) -> Locked<'_> {
        Locked(ManuallyDrop::new(self.q.lock().expect("inflight lock")))
    }

    /// The tag in every provider `wr_id` this table hands out.
    pub fn tag(&self) -> u64 {
        self.lock().tag
    }

    /// Draws another tag while this one is among `avoid` (tags a recycled QP number's
    /// earlier tables used in the same CQs; see `cq::Registry`). Only before the first
    /// post. With 2^11 tags, a list of them all (2^11 tables destroyed under one number
    /// with completions pending, and the CQ never found empty) keeps the drawn one.
    pub fn retag_avoiding(&self, avoid: &[u64]) {
        let mut q = self.lock();
        debug_assert_eq!(q.next_seq, 1, "retagged after a post");
        for _ in 0..=TAG_MASK >> TAG_SHIFT {
            if !avoid.contains(&q.tag) {
                return;
            }
            q.tag = next_tag();
        }
    }

    /// The tag of a destroyed QP's table whose requests may still complete (some were
    /// outstanding), under one lock; `None` if none was.
    pub fn tag_if_outstanding(&self) -> Option<u64> {
        let q = self.lock();
        (!q.send.is_empty() || !q.recv.is_empty()).then_some(q.tag)
    }

    /// Sets the tag (tests: a table that drew another's tag, 2^11 tables later).
    #[cfg(test)]
    pub fn force_tag(&self, tag: u64) {
        self.lock().tag = tag;
    }

    /// Number of outstanding (send, receive) requests.
    pub fn outstanding(&self) -> (usize, usize) {
        let q = self.lock();
        (q.send.len(), q.recv.len())
    }

    /// Outstanding send requests, read without the lock: a snapshot, which posts and polls
    /// on other threads may have changed either way since.
    pub fn outstanding_sends(&self) -> usize {
        self.send_len.load(Ordering::Relaxed)
    }
}

impl Queues {
    /// Maps a completion's provider `wr_id` back to the user's and releases the slots it
    /// retires. Returns false if no slot matched (a completion of a destroyed QP).
    pub fn complete(&mut self, wc: &mut WorkCompletion) -> bool {
        let recv = wc.wr_id & RECV_BIT != 0;
        if wc.wr_id & TAG_MASK != self.tag {
            return false; // another table's (a destroyed QP's)
        }
        let seq = wc.wr_id & SEQ_MASK;
        if recv {
            // The front on the fast path; a search (the slots are in sequence order) when a
            // later receive completed first.
            let slot = match self.recv.front() {
                Some(front) if front.seq == seq => self.recv.pop_front(),
                _ => self.recv.binary_search_by_key(&seq, |s| s.seq).ok().and_then(|i| self.recv.remove(i)),
            };
            let Some(slot) = slot else { return false };
            wc.wr_id = slot.user_wr_id;
            self.bury(slot.mr);
            return true;
        }
        // The completion retires the unsignalled requests before it, but only once it is
        // known to be one of this table's: a completion matching no slot retires nothing.
        let at = match self.send.front() {
            Some(front) if front.seq == seq => 0,
            _ => match self.send.binary_search_by_key(&seq, |s| s.seq) {
                Ok(i) => i,
                Err(_) => return false,
            },
        };
        for _ in 0..at {
            let earlier = self.send.pop_front().expect("earlier slots"); // unsignalled ones
            self.bury(earlier.mr);
        }
        let slot = self.send.pop_front().expect("the slot found");
        wc.wr_id = slot.user_wr_id;
        self.bury(slot.mr);
        self.send_len.store(self.send.len(), Ordering::Relaxed);
        let retired = self.retired();
        while self.kept.front().is_some_and(|(last, _)| *last <= retired) {
            let (_, mr) = self.kept.pop_front().expect("a kept region");
            self.bury(Some(mr));
        }
        true
    }

    /// How many send requests have retired: the slots in order, all but those still held.
    fn retired(&self) -> u64 {
        self.posted - self.send.len() as u64
    }

    /// The number of the last send request accepted ([`Queues::keep`] takes it).
    pub fn posted(&self) -> u64 {
        self.posted
    }

    /// Keeps `mr`, the region of a dropped prepared request whose last post was numbered
    /// `last`, until the send queue has retired that post; lets it go now if it has.
    pub fn keep(&mut self, last: u64, mr: MemoryRegion) {
        if last <= self.retired() {
            self.bury(Some(mr));
        } else {
            let at = self.kept.partition_point(|(l, _)| *l <= last);
            self.kept.insert(at, (last, mr));
        }
    }

    /// Lets go of a released slot's region; one whose last handle this was is kept for
    /// deregistration after the lock (see the module's docs).
    pub fn bury(&mut self, mr: Option<MemoryRegion>) {
        // `into_inner` drops the handle when it is not the last, atomically: no other
        // handle's drop can make this one the last afterwards.
        if let Some(last) = mr.and_then(|mr| Arc::into_inner(mr.inner)) {
            self.graves.push(last);
        }
    }

    /// Moves the regions buried so far into `out`, to deregister after further locks (a
    /// CQ's registry) are let go too.
    pub fn take_graves(&mut self, out: &mut Vec<MrInner>) {
        if !self.graves.is_empty() {
            out.append(&mut self.graves);
        }
    }

    /// Reserves a send slot; returns the provider `wr_id`.
    pub fn push_send(&mut self, user_wr_id: u64, mr: Option<MemoryRegion>) -> Result<u64> {
        if self.send.len() >= self.max_send as usize {
            self.bury(mr);
            return Err(Error::QueueFull { queue: "send", depth: self.max_send });
        }
        let seq = self.next_seq;
        self.next_seq = (seq + 1) & SEQ_MASK;
        self.send.push_back(Slot { seq, user_wr_id, mr });
        self.posted += 1;
        self.send_len.store(self.send.len(), Ordering::Relaxed);
        Ok(seq | self.tag)
    }

    /// Reserves a receive slot; returns the provider `wr_id`.
    pub fn push_recv(&mut self, user_wr_id: u64, mr: Option<MemoryRegion>) -> Result<u64> {
        if self.recv.len() >= self.max_recv as usize {
            self.bury(mr);
            return Err(Error::QueueFull { queue: "receive", depth: self.max_recv });
        }
        let seq = self.next_seq;
        self.next_seq = (seq + 1) & SEQ_MASK;
        self.recv.push_back(Slot { seq, user_wr_id, mr });
        Ok(seq | self.tag | RECV_BIT)
    }

    /// Drops the newest `n` send slots (requests the provider refused).
    pub fn unpush_send(&mut self, n: usize) {
        for _ in 0..n.min(self.send.len()) {
            let slot = self.send.pop_back().expect("a slot");
            self.bury(slot.mr);
            self.posted -= 1;
        }
        self.send_len.store(self.send.len(), Ordering::Relaxed);
    }

    /// Drops the newest `n` receive slots.
    pub fn unpush_recv(&mut self, n: usize) {
        for _ in 0..n.min(self.recv.len()) {
            let slot = self.recv.pop_back().expect("a slot");
            self.bury(slot.mr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signalled_completion_retires_earlier_unsignalled() {
        let inf = Inflight::new(8, 8);
        let ids: Vec<u64> = {
            let mut q = inf.lock();
            (0..3).map(|i| q.push_send(100 + i, None).unwrap()).collect()
        };
        assert_eq!(inf.outstanding_sends(), 3);
        let mut wc = WorkCompletion { wr_id: ids[1], ..Default::default() };
        assert!(inf.lock().complete(&mut wc));
        assert_eq!((wc.wr_id, inf.outstanding_sends()), (101, 1));
        let mut wc = WorkCompletion { wr_id: ids[2], ..Default::default() };
        assert!(inf.lock().complete(&mut wc));
        assert_eq!(wc.wr_id, 102);
        assert_eq!(inf.outstanding(), (0, 0));
        assert_eq!(inf.outstanding_sends(), 0);
    }

    #[test]
    fn queue_depth_is_enforced_and_recv_is_separate() {
        let inf = Inflight::new(2, 1);
        let mut q = inf.lock();
        q.push_send(1, None).unwrap();
        q.push_send(2, None).unwrap();
        assert!(matches!(q.push_send(3, None), Err(Error::QueueFull { queue: "send", depth: 2 })));
        let r = q.push_recv(9, None).unwrap();
        assert!(q.push_recv(10, None).is_err());
        q.unpush_send(1);
        assert_eq!(q.send.len(), 1);
        drop(q);
        assert_eq!(inf.outstanding_sends(), 1);
        let mut wc = WorkCompletion { wr_id: r, ..Default::default() };
        assert!(inf.lock().complete(&mut wc));
        assert_eq!(wc.wr_id, 9);
        let mut stray = WorkCompletion { wr_id: 999, ..Default::default() };
        assert!(!inf.lock().complete(&mut stray));
    }

    /// A completion matching no slot of this table (a destroyed QP's, left in a shared CQ,
    /// with a sequence number beyond this QP's, or another table's tag) retires nothing:
    /// the requests in flight keep their buffers.
    #[test]
    fn a_completion_matching_no_slot_retires_nothing() {
        let (inf, other) = (Inflight::new(8, 8), Inflight::new(8, 8));
        let ids: Vec<u64> = {
            let mut q = inf.lock();
            (0..3).map(|i| q.push_send(100 + i, None).unwrap()).collect()
        };
        let theirs = other.lock().push_send(7, None).unwrap();
        for stale in [ids[2] + 47, theirs, theirs | RECV_BIT] {
            let mut wc = WorkCompletion { wr_id: stale, ..Default::default() };
            assert!(!inf.lock().complete(&mut wc), "{stale:#x} matched");
            assert_eq!(inf.outstanding(), (3, 0), "a stale completion ({stale:#x}) retired requests");
        }
        let mut wc = WorkCompletion { wr_id: ids[2], ..Default::default() };
        assert!(inf.lock().complete(&mut wc));
        assert_eq!((wc.wr_id, inf.outstanding()), (102, (0, 0)));
    }

    /// Regions of dropped prepared requests are kept until the send queue has retired
    /// their last posts, whatever order the requests were dropped in; a post already
    /// retired lets its region go at once.
    #[test]
    fn kept_regions_go_as_their_last_posts_retire() {
        let pd = crate::Context::open_soft().alloc_pd().unwrap();
        let mr = || pd.alloc_mr(8, crate::AccessFlags::LOCAL_WRITE).unwrap();
        let inf = Inflight::new(8, 8);
        let mut q = inf.lock();
        let ids: Vec<u64> = (0..4).map(|i| q.push_send(i, None).unwrap()).collect();
        assert_eq!(q.posted(), 4);
        q.keep(4, mr());
        q.keep(2, mr());
        q.keep(3, mr());
        assert_eq!(q.kept.iter().map(|k| k.0).collect::<Vec<_>>(), [2, 3, 4]);
        // Posts 1 and 2 retire (the first unsignalled): the region kept for post 2 goes.
        let mut wc = WorkCompletion { wr_id: ids[1], ..Default::default() };
        assert!(q.complete(&mut wc));
        assert_eq!(q.kept.iter().map(|k| k.0).collect::<Vec<_>>(), [3, 4]);
        let mut wc = WorkCompletion { wr_id: ids[3], ..Default::default() };
        assert!(q.complete(&mut wc));
        assert!(q.kept.is_empty());
        q.keep(1, mr());
        assert!(q.kept.is_empty(), "a post already retired keeps nothing");
        // A refused post gives its number back.
        q.push_send(9, None).unwrap();
        q.unpush_send(1);
        assert_eq!((q.posted(), q.retired()), (4, 4));
    }

    /// A later receive's completion (a flush) reaped before an earlier one's leaves the
    /// earlier slot, and its region, held; the earlier completion still finds its slot.
    #[test]
    fn a_receive_completion_retires_its_own_slot_only() {
        let inf = Inflight::new(1, 4);
        let ids: Vec<u64> = {
            let mut q = inf.lock();
            (0..3).map(|i| q.push_recv(10 + i, None).unwrap()).collect()
        };
        let mut later = WorkCompletion { wr_id: ids[1], ..Default::default() };
        assert!(inf.lock().complete(&mut later));
        assert_eq!((later.wr_id, inf.outstanding()), (11, (0, 2)));
        let mut first = WorkCompletion { wr_id: ids[0], ..Default::default() };
        assert!(inf.lock().complete(&mut first));
        assert_eq!((first.wr_id, inf.outstanding()), (10, (0, 1)));
        let mut again = WorkCompletion { wr_id: ids[1], ..Default::default() };
        assert!(!inf.lock().complete(&mut again), "a slot retires once");
        let mut last = WorkCompletion { wr_id: ids[2], ..Default::default() };
        assert!(inf.lock().complete(&mut last));
        assert_eq!((last.wr_id, inf.outstanding()), (12, (0, 0)));
    }
}
