//! Typed errors. Verbs has three failure channels, all of which end up as an [`Error`]:
//! a NULL return with `errno` (`ibv_reg_mr`), an errno returned directly (`ibv_post_send`,
//! `ibv_modify_qp`), and a work completion whose status is not `IBV_WC_SUCCESS`. Each
//! provider maps its own calls' conventions (the rdma-core provider in `rdma/conv.rs`, plus
//! `ibv_poll_cq`'s negative count and librdmacm's -1 + errno where they are called).

use std::io;

use crate::types::QpState;
use crate::wc::WcOpcode;

pub use crate::wc::WcStatus;

/// Every error rdmakit's verbs layer returns.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No device of the requested provider exists on this machine. This is a normal
    /// condition (no RDMA NIC, no `rdma_rxe`), not a bug.
    #[error("no RDMA device available ({provider}): {reason}")]
    NoDevice {
        /// Provider that was asked.
        provider: &'static str,
        /// Why, e.g. "ibv_get_device_list: Function not implemented (os error 38)".
        reason: String,
    },
    /// A device with this name does not exist.
    #[error("RDMA device `{0}` not found")]
    DeviceNotFound(String),
    /// The provider was not compiled in: the `verbs` cargo feature is off, or rdma-core's
    /// development files or libclang were missing when rdmakit was built (`reason` says which
    /// and names the packages to install).
    #[error("provider `{provider}` is not built into this binary: {reason}")]
    ProviderUnavailable {
        /// The provider asked for (`"verbs"`).
        provider: &'static str,
        /// Why it is missing, for a person.
        reason: &'static str,
    },
    /// A verbs call (or its soft twin) failed with an OS error.
    #[error("{call} failed: {source}")]
    Os {
        /// The C function, e.g. `"ibv_reg_mr"`.
        call: &'static str,
        /// The errno it reported.
        #[source]
        source: io::Error,
    },
    /// An argument was rejected before reaching the device.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A local offset/length pair does not fit in its region.
    #[error("range {offset}..{offset}+{len} is out of bounds of a {size}-byte {what}")]
    OutOfBounds {
        /// What was indexed ("memory region", "device memory", ...).
        what: &'static str,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// Size of the object.
        size: u64,
    },
    /// A work request completed with an error status.
    #[error("work request {wr_id:#x} ({opcode:?}) completed with {status}")]
    Completion {
        /// Verbs status of the completion.
        status: WcStatus,
        /// The user's `wr_id`.
        wr_id: u64,
        /// The operation, when the provider reports it (not for flushed requests).
        opcode: WcOpcode,
    },
    /// The send or receive queue has no free slot (`max_send_wr`/`max_recv_wr` requests
    /// are outstanding; unsignalled requests are reclaimed only by a later signalled one).
    #[error("{queue} queue full: {depth} work requests outstanding")]
    QueueFull {
        /// "send" or "receive".
        queue: &'static str,
        /// The queue's depth.
        depth: u32,
    },
    /// Posting a list of work requests stopped part-way: `posted` of them were posted (and
    /// will complete), the rest were not.
    #[error("post failed after {posted} work requests were posted: {source}")]
    Post {
        /// How many work requests from the start of the list were accepted.
        posted: usize,
        /// Why the next one was refused.
        #[source]
        source: Box<Error>,
    },
    /// More completions arrived than the completion queue can hold; completions were lost,
    /// the CQ is in error and the QPs attached to it were moved to the error state.
    #[error("completion queue overrun (capacity {capacity}); completions were lost")]
    CqOverrun {
        /// The CQ's capacity.
        capacity: u32,
    },
    /// The operation is not allowed in the QP's current state.
    #[error("queue pair {qp_num:#x} is in state {state:?}; cannot {op}")]
    QpState {
        /// QP number.
        qp_num: u32,
        /// Its state.
        state: QpState,
        /// What was attempted.
        op: &'static str,
    },
    /// Device memory could not be allocated.
    #[error("device memory exhausted: {requested} bytes requested, {available} of {capacity} free")]
    DeviceMemoryExhausted {
        /// Requested length.
        requested: u64,
        /// Largest free block at the time.
        available: u64,
        /// Total device memory.
        capacity: u64,
    },
    /// The device or provider does not support the feature.
    #[error("not supported: {0}")]
    Unsupported(String),
    /// The connection manager refused the connection (`RDMA_CM_EVENT_REJECTED`): the peer
    /// application rejected it, or no one listens at the address, or the peer's CM could
    /// not accept the parameters.
    #[error("connection rejected: {reason}")]
    ConnectionRejected {
        /// The event name and status (on InfiniBand and RoCE the CM reject reason, e.g.
        /// 8 = invalid service ID: nothing listens on that port; 28 = rejected by the
        /// peer application).
        reason: String,
        /// The private data carried by the reject (on InfiniBand and RoCE padded with
        /// zeros to the reject message's fixed size).
        private_data: Vec<u8>,
    },
    /// A waiting call gave up.
    #[error("timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// An object is still used by outstanding work (e.g. `into_inner` on a region that a
    /// work request still references).
    #[error("{0} is still in use by outstanding work requests")]
    Busy(&'static str),
    /// The device refused access to an object (for example an alias of another vHCA's
    /// key presenting the wrong access key, or a key not opened to other vHCAs).
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// A bounded table is full of entries still in use: nothing could be evicted to make
    /// room (for example a DPU's alias cache whose every alias an import holds).
    #[error("{what} is full: {limit} entries, all in use")]
    LimitReached {
        /// The table.
        what: &'static str,
        /// Its bound.
        limit: u64,
    },
    /// A descriptor received from a peer could not be decoded.
    #[error("malformed {what}: {reason}")]
    Malformed {
        /// What was being decoded.
        what: &'static str,
        /// What was wrong.
        reason: String,
    },
}

impl Error {
    /// The last OS error, attributed to `call`.
    #[cfg_attr(not(rdmakit_verbs), allow(dead_code))]
    pub(crate) fn last_os(call: &'static str) -> Error {
        Error::Os { call, source: io::Error::last_os_error() }
    }

    /// An errno value returned directly by `call`.
    #[cfg_attr(not(rdmakit_verbs), allow(dead_code))]
    pub(crate) fn errno(call: &'static str, errno: i32) -> Error {
        Error::Os { call, source: io::Error::from_raw_os_error(errno) }
    }

    /// The verbs status, if this error is a failed work completion.
    pub fn wc_status(&self) -> Option<WcStatus> {
        match self {
            Error::Completion { status, .. } => Some(*status),
            Error::Post { source, .. } => source.wc_status(),
            _ => None,
        }
    }

    /// The OS errno, if this error carries one.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::Os { source, .. } => source.raw_os_error(),
            Error::Post { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// `Result` with rdmakit's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_status_is_kept_not_panicking() {
        let s = WcStatus(4242);
        assert_eq!(s.name(), None);
        assert_eq!(format!("{s:?}"), "WcStatus(4242)");
        assert_eq!(WcStatus::REM_ACCESS_ERR.name(), Some("IBV_WC_REM_ACCESS_ERR"));
        assert_eq!(WcStatus(10), WcStatus::REM_ACCESS_ERR);
    }

    #[test]
    fn errors_carry_context() {
        let e =
            Error::Completion { status: WcStatus::REM_ACCESS_ERR, wr_id: 7, opcode: WcOpcode::RDMA_WRITE };
        assert_eq!(e.wc_status(), Some(WcStatus::REM_ACCESS_ERR));
        let msg = e.to_string();
        assert!(msg.contains("IBV_WC_REM_ACCESS_ERR") && msg.contains("0x7"), "{msg}");
        let p = Error::Post { posted: 2, source: Box::new(Error::errno("ibv_post_send", 12)) };
        assert_eq!(p.raw_os_error(), Some(12));
    }
}
