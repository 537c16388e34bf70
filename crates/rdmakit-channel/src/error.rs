//! Errors of the channel layer, and the buffer-returning result of one-sided operations.

use rdmakit_verbs::WcStatus;

/// What can go wrong on a pipe or a put handle.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChannelError {
    /// The verbs layer refused an operation (posting, registration, connection).
    #[error(transparent)]
    Verbs(#[from] rdmakit_verbs::Error),
    /// The remote heap behind a pipe refused (a message larger than the ring, say).
    #[error(transparent)]
    Heap(#[from] rdmakit_memory::heap::HeapError),
    /// A work request failed, so the connection is broken: every later operation fails too.
    /// `RETRY_EXC_ERR` usually means the peer died.
    #[error("connection broken: {status} on {what}")]
    Broken {
        /// The completion status that broke it.
        status: WcStatus,
        /// What the failed request was doing.
        what: &'static str,
    },
    /// A control message from the peer does not decode.
    #[error("malformed control message: {0}")]
    Malformed(#[from] crate::control::DecodeError),
    /// No such heap on this heap endpoint.
    #[error("no heap {0:?} on this endpoint")]
    UnknownHeap(rdmakit_memory::heap::HeapId),
    /// The peer sent something the protocol does not allow.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A message does not fit: larger than the peer's receive ring, say.
    #[error("{what} of {len} bytes exceeds {limit}")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its length.
        len: u64,
        /// The limit.
        limit: u64,
    },
    /// A put handle already has a transaction the receiver has not marked ready, or the
    /// send queue has no room for the put now: retry.
    #[error("put handle busy: the receiver has not consumed the previous put, or the send queue is full")]
    Busy,
    /// The queue pair or completion queue handed to an endpoint is too small for it: a
    /// completion queue that could overrun, or a send queue too shallow to make progress.
    #[error("{what}: at least {needed} needed, {got} given")]
    QueueTooSmall {
        /// Which queue, and what it must hold.
        what: &'static str,
        /// The least it must hold.
        needed: u64,
        /// What it holds.
        got: u64,
    },
    /// The handle or pipe end has no such role (a put from a receiver-side handle, say).
    #[error("invalid use: {0}")]
    Invalid(&'static str),
    /// A wait ran out of time.
    #[error("timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// The operation was handed to the NIC, but its completion was not seen within the
    /// time-out (a peer busy elsewhere, taking no messages in): it will still take effect
    /// when the peer gets to it, so it must not be repeated.
    #[error(
        "{what} posted, but not confirmed within {after:?}: it takes effect when the peer gets to it; do not repeat it"
    )]
    Unconfirmed {
        /// What was posted.
        what: &'static str,
        /// How long this side waited.
        after: std::time::Duration,
    },
}

impl ChannelError {
    /// Whether this error means the peer is gone (or the connection to it is): a failed
    /// work request, such as the keep-alive of a blocked operation whose retries ran out
    /// (`RETRY_EXC_ERR`).
    pub fn is_peer_gone(&self) -> bool {
        matches!(self, ChannelError::Broken { .. })
    }
}

/// `offset .. offset + len` within `size` bytes of `what`, else `OutOfBounds`.
pub(crate) fn check_range(what: &'static str, offset: u64, len: usize, size: u64) -> Result<()> {
    if offset.checked_add(len as u64).is_none_or(|e| e > size) {
        return Err(rdmakit_verbs::Error::OutOfBounds { what, offset, len: len as u64, size }.into());
    }
    Ok(())
}

/// Result of channel operations.
pub type Result<T> = std::result::Result<T, ChannelError>;

/// The result of an operation that took ownership of a buffer: the outcome and the buffer,
/// returned whether the operation succeeded or not (tokio-uring's `BufResult`).
pub type BufResult<T, B> = (Result<T>, B);
