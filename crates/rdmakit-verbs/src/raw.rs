//! The provider-neutral form of a posted work request.
//!
//! The safe layer ([`crate::wr`]) checks and owns everything, then hands providers these
//! plain records: addresses and keys, like `struct ibv_send_wr`. Providers never see an
//! `Arc`; the safe layer's in-flight table keeps the memory alive instead.

/// One scatter/gather element, `struct ibv_sge`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// One KSM entry of an indirect key, in order from the key's offset 0: `len` bytes at
/// `addr` of the region whose lkey is `key`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RawKsm {
    pub addr: u64,
    pub len: u64,
    pub key: u32,
}

/// The operation of a send-queue work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RawOp {
    Write { imm: Option<u32> },
    Read,
    Send { imm: Option<u32> },
    FetchAdd { add: u64 },
    CompareSwap { compare: u64, swap: u64 },
}

/// A send-queue work request as providers receive it.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(rdmakit_verbs), allow(dead_code))]
pub(crate) struct RawSendWr<'a> {
    /// rdmakit's internal id (the in-flight sequence number), not the user's.
    pub wr_id: u64,
    pub op: RawOp,
    /// Local buffer, if any (none for zero-length and inline requests).
    pub sge: Option<Sge>,
    /// Inline payload, copied by the provider before `post_send` returns.
    pub inline: Option<&'a [u8]>,
    pub remote_addr: u64,
    pub rkey: u32,
    pub signaled: bool,
    pub fence: bool,
    pub solicited: bool,
}

impl RawSendWr<'_> {
    /// Payload length in bytes.
    pub fn len(&self) -> u32 {
        match (self.inline, self.sge) {
            (Some(d), _) => d.len() as u32,
            (None, Some(s)) => s.len,
            (None, None) => 0,
        }
    }
}

/// A receive-queue work request as providers receive it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawRecvWr {
    pub wr_id: u64,
    pub sge: Option<Sge>,
}
