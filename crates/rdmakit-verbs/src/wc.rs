//! Work completions: what a completion queue hands back for each finished work request.

use std::fmt;

use crate::error::{Error, Result, WcStatus};

/// The operation a completion reports, `enum ibv_wc_opcode`, as a transparent newtype.
#[doc(alias = "ibv_wc_opcode")]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(transparent)]
pub struct WcOpcode(pub u32);

impl WcOpcode {
    /// A send completed (requester side).
    #[doc(alias = "IBV_WC_SEND")]
    pub const SEND: WcOpcode = WcOpcode(0);
    /// An RDMA write (with or without immediate) completed (requester side).
    #[doc(alias = "IBV_WC_RDMA_WRITE")]
    pub const RDMA_WRITE: WcOpcode = WcOpcode(1);
    /// An RDMA read completed; the local buffer holds the data.
    #[doc(alias = "IBV_WC_RDMA_READ")]
    pub const RDMA_READ: WcOpcode = WcOpcode(2);
    /// A compare-and-swap completed; the local buffer holds the original value.
    #[doc(alias = "IBV_WC_COMP_SWAP")]
    pub const COMP_SWAP: WcOpcode = WcOpcode(3);
    /// A fetch-and-add completed; the local buffer holds the original value.
    #[doc(alias = "IBV_WC_FETCH_ADD")]
    pub const FETCH_ADD: WcOpcode = WcOpcode(4);
    /// A receive consumed an incoming send.
    #[doc(alias = "IBV_WC_RECV")]
    pub const RECV: WcOpcode = WcOpcode(128);
    /// A receive was consumed by an incoming RDMA write with immediate.
    #[doc(alias = "IBV_WC_RECV_RDMA_WITH_IMM")]
    pub const RECV_RDMA_WITH_IMM: WcOpcode = WcOpcode(129);

    fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            0 => "SEND",
            1 => "RDMA_WRITE",
            2 => "RDMA_READ",
            3 => "COMP_SWAP",
            4 => "FETCH_ADD",
            128 => "RECV",
            129 => "RECV_RDMA_WITH_IMM",
            _ => return None,
        })
    }

    /// True for the receive-side opcodes.
    pub fn is_recv(self) -> bool {
        self.0 & 128 != 0
    }
}

impl fmt::Debug for WcOpcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "WcOpcode({})", self.0),
        }
    }
}

/// One work completion (`struct ibv_wc`, the fields rdmakit's users need).
#[doc(alias = "ibv_wc")]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct WorkCompletion {
    /// The `wr_id` the user gave the work request.
    pub wr_id: u64,
    /// Completion status.
    pub status: WcStatus,
    /// What completed. Not meaningful for flushed requests (`WR_FLUSH_ERR`).
    pub opcode: WcOpcode,
    /// Bytes transferred (receives: the message length).
    pub byte_len: u32,
    /// Immediate data, for sends/writes with immediate, as the sender gave it (host order).
    pub imm: Option<u32>,
    /// The local QP number.
    pub qp_num: u32,
    /// Vendor-specific error syndrome (0 on the soft NIC).
    pub vendor_err: u32,
}

impl Default for WcStatus {
    fn default() -> Self {
        WcStatus::SUCCESS
    }
}

impl WorkCompletion {
    /// `Ok(self)` if the status is success, the typed [`Error::Completion`] otherwise.
    pub fn ok(self) -> Result<WorkCompletion> {
        if self.status.is_success() {
            Ok(self)
        } else {
            Err(Error::Completion { status: self.status, wr_id: self.wr_id, opcode: self.opcode })
        }
    }
}
