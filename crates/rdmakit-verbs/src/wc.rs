//! Work completions: what a completion queue hands back for each finished work request.

use std::fmt;

use crate::error::{Error, Result};

/// Declares a verbs enumeration as a transparent `u32` newtype: one constant per C value
/// (with the C name as a doc alias), `name()` giving the C spelling, and a `Debug` that prints
/// it. Values libibverbs does not define are kept as they are (printed as `Type(n)`), never a
/// panic or undefined behaviour.
macro_rules! verbs_enum {
    ($(#[$tdoc:meta])* $ty:ident, $cenum:literal {
        $($(#[$doc:meta])* $name:ident = $val:expr, $cname:literal;)*
    }) => {
        $(#[$tdoc])*
        #[doc(alias = $cenum)]
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
        #[repr(transparent)]
        pub struct $ty(pub u32);

        impl $ty {
            $( $(#[$doc])* #[doc(alias = $cname)] pub const $name: $ty = $ty($val); )*

            /// The verbs name of this value (e.g. `"IBV_WC_REM_ACCESS_ERR"`), or `None` if
            /// libibverbs does not define it.
            pub fn name(self) -> Option<&'static str> {
                match self.0 {
                    $( $val => Some($cname), )*
                    _ => None,
                }
            }
        }

        impl fmt::Debug for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self.name() {
                    Some(n) => f.write_str(n),
                    None => write!(f, concat!(stringify!($ty), "({})"), self.0),
                }
            }
        }
    };
}

verbs_enum! {
    /// A work completion status, `enum ibv_wc_status`, as a transparent newtype.
    ///
    /// Unknown values (a newer provider, a vendor extension) are kept as they are, never
    /// turned into a panic; [`WcStatus::name`] gives the verbs spelling.
    WcStatus, "ibv_wc_status" {
    /// The operation completed successfully.
    SUCCESS = 0, "IBV_WC_SUCCESS";
    /// Local length error: a receive buffer too small for the incoming message.
    LOC_LEN_ERR = 1, "IBV_WC_LOC_LEN_ERR";
    /// Local QP operation error: an internal consistency error, e.g. inline data too long.
    LOC_QP_OP_ERR = 2, "IBV_WC_LOC_QP_OP_ERR";
    /// Local EE context operation error (RD only).
    LOC_EEC_OP_ERR = 3, "IBV_WC_LOC_EEC_OP_ERR";
    /// Local protection error: a local buffer's lkey, bounds or access flags do not allow
    /// the operation.
    LOC_PROT_ERR = 4, "IBV_WC_LOC_PROT_ERR";
    /// Work request flushed: the QP was in the error state.
    WR_FLUSH_ERR = 5, "IBV_WC_WR_FLUSH_ERR";
    /// Memory window bind error.
    MW_BIND_ERR = 6, "IBV_WC_MW_BIND_ERR";
    /// Bad response from the responder.
    BAD_RESP_ERR = 7, "IBV_WC_BAD_RESP_ERR";
    /// Local access error (a protection error on an incoming RDMA write with immediate).
    LOC_ACCESS_ERR = 8, "IBV_WC_LOC_ACCESS_ERR";
    /// Remote invalid request: the responder rejected the request (e.g. a message longer
    /// than its receive buffer, a misaligned atomic).
    REM_INV_REQ_ERR = 9, "IBV_WC_REM_INV_REQ_ERR";
    /// Remote access error: bad rkey, out-of-bounds address or missing remote access flag.
    REM_ACCESS_ERR = 10, "IBV_WC_REM_ACCESS_ERR";
    /// Remote operation error: the responder could not complete the operation.
    REM_OP_ERR = 11, "IBV_WC_REM_OP_ERR";
    /// Transport retry counter exceeded: the peer did not answer (dead, or QP gone).
    RETRY_EXC_ERR = 12, "IBV_WC_RETRY_EXC_ERR";
    /// RNR retry counter exceeded: the peer had no receive posted for too long.
    RNR_RETRY_EXC_ERR = 13, "IBV_WC_RNR_RETRY_EXC_ERR";
    /// Local RDD violation (RD only).
    LOC_RDD_VIOL_ERR = 14, "IBV_WC_LOC_RDD_VIOL_ERR";
    /// Remote invalid RD request.
    REM_INV_RD_REQ_ERR = 15, "IBV_WC_REM_INV_RD_REQ_ERR";
    /// Remote aborted.
    REM_ABORT_ERR = 16, "IBV_WC_REM_ABORT_ERR";
    /// Invalid EE context number.
    INV_EECN_ERR = 17, "IBV_WC_INV_EECN_ERR";
    /// Invalid EE context state.
    INV_EEC_STATE_ERR = 18, "IBV_WC_INV_EEC_STATE_ERR";
    /// Fatal error.
    FATAL_ERR = 19, "IBV_WC_FATAL_ERR";
    /// Response timeout.
    RESP_TIMEOUT_ERR = 20, "IBV_WC_RESP_TIMEOUT_ERR";
    /// General error.
    GENERAL_ERR = 21, "IBV_WC_GENERAL_ERR";
    /// Tag matching error.
    TM_ERR = 22, "IBV_WC_TM_ERR";
    /// Tag matching rendezvous incomplete.
    TM_RNDV_INCOMPLETE = 23, "IBV_WC_TM_RNDV_INCOMPLETE";
    }
}

impl WcStatus {
    /// True for `IBV_WC_SUCCESS`.
    pub fn is_success(self) -> bool {
        self == WcStatus::SUCCESS
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

verbs_enum! {
    /// The operation a completion reports, `enum ibv_wc_opcode`, as a transparent newtype.
    WcOpcode, "ibv_wc_opcode" {
    /// A send completed (requester side).
    SEND = 0, "IBV_WC_SEND";
    /// An RDMA write (with or without immediate) completed (requester side).
    RDMA_WRITE = 1, "IBV_WC_RDMA_WRITE";
    /// An RDMA read completed; the local buffer holds the data.
    RDMA_READ = 2, "IBV_WC_RDMA_READ";
    /// A compare-and-swap completed; the local buffer holds the original value.
    COMP_SWAP = 3, "IBV_WC_COMP_SWAP";
    /// A fetch-and-add completed; the local buffer holds the original value.
    FETCH_ADD = 4, "IBV_WC_FETCH_ADD";
    /// A receive consumed an incoming send.
    RECV = 128, "IBV_WC_RECV";
    /// A receive was consumed by an incoming RDMA write with immediate.
    RECV_RDMA_WITH_IMM = 129, "IBV_WC_RECV_RDMA_WITH_IMM";
    }
}

impl WcOpcode {
    /// True for the receive-side opcodes.
    pub fn is_recv(self) -> bool {
        self.0 & 128 != 0
    }
}

/// One work completion (`struct ibv_wc`, the fields rdmakit's users need).
#[doc(alias = "ibv_wc")]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
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
