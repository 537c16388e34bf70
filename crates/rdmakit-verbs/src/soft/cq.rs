//! Soft completion queue: a bounded queue of completions and an eventfd for wake-ups.
//!
//! Like a hardware CQ it has a fixed capacity; a completion that does not fit is an overrun:
//! the CQ goes to error (every later poll reports it) and the producing QP goes to error,
//! so the loss is always visible.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Mutex, OnceLock};

use crate::error::{Error, Result};
use crate::wc::WorkCompletion;

pub(crate) struct SoftCq {
    capacity: u32,
    state: Mutex<CqState>,
    /// Created on first use: polling-only users never pay for an fd.
    event_fd: OnceLock<std::io::Result<OwnedFd>>,
}

struct CqState {
    queue: VecDeque<WorkCompletion>,
    overrun: bool,
    /// `req_notify` was called and no event has fired since.
    armed: bool,
}

impl SoftCq {
    pub fn new(capacity: u32) -> SoftCq {
        SoftCq {
            capacity,
            state: Mutex::new(CqState {
                queue: VecDeque::with_capacity((capacity as usize).min(4096)),
                overrun: false,
                armed: false,
            }),
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
        // An overrun also wakes waiters, so they see the error instead of sleeping forever.
        if st.armed {
            st.armed = false;
            drop(st);
            self.signal();
        }
        ok
    }

    /// Moves up to `out.len()` completions into `out`.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut st = self.state.lock().expect("cq lock");
        if st.overrun {
            return Err(Error::CqOverrun { capacity: self.capacity });
        }
        let n = out.len().min(st.queue.len());
        for (slot, wc) in out.iter_mut().zip(st.queue.drain(..n)) {
            *slot = wc;
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
}
