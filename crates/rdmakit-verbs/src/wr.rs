//! Work request builders. Building is safe and checks what can be checked locally; the
//! queue pair takes ownership of the buffers when the request is posted.

use crate::error::{Error, Result};
use crate::mr::LocalSlice;
use crate::raw::{RawOp, RawRecvWr, RawSendWr};
use crate::types::RemoteSlice;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Write,
    Read,
    Send,
    FetchAdd { add: u64 },
    CompareSwap { compare: u64, swap: u64 },
}

/// A send-queue work request: RDMA write (optionally with immediate), RDMA read, send
/// (optionally with immediate), fetch-and-add or compare-and-swap.
///
/// Signalled by default (a completion is generated); see [`unsignaled`](Self::unsignaled).
///
/// # Examples
/// ```
/// # use rdmakit_verbs::*;
/// # let ctx = Context::open_soft();
/// # let pd = ctx.alloc_pd()?;
/// # let mr = pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
/// # let remote = mr.remote();
/// let wr = SendWr::write(mr.slice(0, 8)?, remote.slice(8, 8)?).wr_id(7).with_imm(0xbeef);
/// let atomic = SendWr::fetch_add(mr.slice(16, 8)?, remote.slice(24, 8)?, 1);
/// # let _ = (wr, atomic);
/// # Ok::<(), Error>(())
/// ```
#[derive(Clone, Debug)]
#[must_use = "a work request does nothing until posted"]
pub struct SendWr<'a> {
    pub(crate) wr_id: u64,
    pub(crate) kind: Kind,
    pub(crate) local: Option<LocalSlice>,
    pub(crate) inline: Option<&'a [u8]>,
    pub(crate) remote: Option<RemoteSlice>,
    pub(crate) imm: Option<u32>,
    pub(crate) signaled: bool,
    pub(crate) fence: bool,
    pub(crate) solicited: bool,
}

impl<'a> SendWr<'a> {
    fn new(
        kind: Kind,
        local: Option<LocalSlice>,
        inline: Option<&'a [u8]>,
        remote: Option<RemoteSlice>,
    ) -> Self {
        SendWr {
            wr_id: 0,
            kind,
            local,
            inline,
            remote,
            imm: None,
            signaled: true,
            fence: false,
            solicited: false,
        }
    }

    /// RDMA write of `local` into `remote` (`IBV_WR_RDMA_WRITE`). Lengths must match.
    #[doc(alias = "IBV_WR_RDMA_WRITE")]
    pub fn write(local: LocalSlice, remote: RemoteSlice) -> Self {
        SendWr::new(Kind::Write, Some(local), None, Some(remote))
    }

    /// RDMA write of inline bytes (`IBV_SEND_INLINE`): copied into the request when it is
    /// posted, so `data` needs no registration and may be reused at once.
    pub fn write_inline(data: &'a [u8], remote: RemoteSlice) -> Self {
        SendWr::new(Kind::Write, None, Some(data), Some(remote))
    }

    /// RDMA read of `remote` into `local` (`IBV_WR_RDMA_READ`). `local` needs
    /// `LOCAL_WRITE`.
    #[doc(alias = "IBV_WR_RDMA_READ")]
    pub fn read(local: LocalSlice, remote: RemoteSlice) -> Self {
        SendWr::new(Kind::Read, Some(local), None, Some(remote))
    }

    /// Send of `local` into the peer's next posted receive (`IBV_WR_SEND`).
    #[doc(alias = "IBV_WR_SEND")]
    pub fn send(local: LocalSlice) -> Self {
        SendWr::new(Kind::Send, Some(local), None, None)
    }

    /// Send of inline bytes.
    pub fn send_inline(data: &'a [u8]) -> Self {
        SendWr::new(Kind::Send, None, Some(data), None)
    }

    /// A zero-length send (with [`with_imm`](Self::with_imm): a pure notification).
    pub fn send_empty() -> Self {
        SendWr::new(Kind::Send, None, None, None)
    }

    /// Fetch-and-add on the 8 remote bytes at `remote` (`IBV_WR_ATOMIC_FETCH_AND_ADD`); the
    /// original value lands in `local` (8 bytes, `LOCAL_WRITE`), native-endian.
    #[doc(alias = "IBV_WR_ATOMIC_FETCH_AND_ADD")]
    pub fn fetch_add(local: LocalSlice, remote: RemoteSlice, add: u64) -> Self {
        SendWr::new(Kind::FetchAdd { add }, Some(local), None, Some(remote))
    }

    /// Compare-and-swap on the 8 remote bytes at `remote` (`IBV_WR_ATOMIC_CMP_AND_SWP`):
    /// if they equal `compare` they become `swap`; the original lands in `local`.
    #[doc(alias = "IBV_WR_ATOMIC_CMP_AND_SWP")]
    pub fn compare_swap(local: LocalSlice, remote: RemoteSlice, compare: u64, swap: u64) -> Self {
        SendWr::new(Kind::CompareSwap { compare, swap }, Some(local), None, Some(remote))
    }

    /// Sets the `wr_id` the completion will carry.
    pub fn wr_id(mut self, wr_id: u64) -> Self {
        self.wr_id = wr_id;
        self
    }

    /// Adds immediate data (writes and sends only): the peer's receive completion carries
    /// it (`IBV_WR_RDMA_WRITE_WITH_IMM`, `IBV_WR_SEND_WITH_IMM`); a write with immediate
    /// consumes one of the peer's posted receives.
    pub fn with_imm(mut self, imm: u32) -> Self {
        self.imm = Some(imm);
        self
    }

    /// No completion on success (`IBV_SEND_SIGNALED` unset). Errors still complete. Its
    /// queue slot is reclaimed when a later signalled request's completion is reaped, so a
    /// queue of only unsignalled requests fills up.
    pub fn unsignaled(mut self) -> Self {
        self.signaled = false;
        self
    }

    /// Sets whether a completion is generated on success.
    pub fn signaled(mut self, yes: bool) -> Self {
        self.signaled = yes;
        self
    }

    /// Waits for earlier reads and atomics before starting (`IBV_SEND_FENCE`).
    pub fn fence(mut self) -> Self {
        self.fence = true;
        self
    }

    /// Asks for a solicited event at the peer (`IBV_SEND_SOLICITED`).
    pub fn solicited(mut self) -> Self {
        self.solicited = true;
        self
    }

    /// Payload length.
    pub fn len(&self) -> u32 {
        match (&self.inline, &self.local) {
            (Some(d), _) => d.len() as u32,
            (None, Some(l)) => l.len,
            (None, None) => 0,
        }
    }

    /// True for zero-length requests.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks the request against the QP's limits and builds the provider form.
    pub(crate) fn to_raw(&self, max_inline: u32) -> Result<RawSendWr<'a>> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if let Some(d) = self.inline {
            if !matches!(self.kind, Kind::Write | Kind::Send) {
                return bad("inline data is only for writes and sends".into());
            }
            if d.len() > max_inline as usize {
                return bad(format!(
                    "inline payload of {} bytes exceeds max_inline_data {max_inline}",
                    d.len()
                ));
            }
        }
        if self.imm.is_some() && !matches!(self.kind, Kind::Write | Kind::Send) {
            return bad("immediate data is only for writes and sends".into());
        }
        let len = self.len();
        let (remote_addr, rkey) = match (self.kind, self.remote) {
            (Kind::Send, _) => (0, 0),
            (Kind::FetchAdd { .. } | Kind::CompareSwap { .. }, Some(r)) => {
                if len != 8 || r.len != 8 {
                    return bad(format!("atomics move 8 bytes (local {len}, remote {})", r.len));
                }
                // The IB spec requires 8-byte aligned atomic targets. Providers differ in how
                // they refuse one (rxe: EINVAL at post; mlx5: a remote error completion), so
                // refuse it here, the same everywhere.
                if r.addr % 8 != 0 {
                    return bad(format!("atomic target {:#x} is not 8-byte aligned", r.addr));
                }
                (r.addr, r.rkey)
            }
            (_, Some(r)) => {
                if r.len != len {
                    return bad(format!("local length {len} differs from remote length {}", r.len));
                }
                (r.addr, r.rkey)
            }
            (_, None) => return bad("one-sided operation without a remote target".into()),
        };
        let op = match self.kind {
            Kind::Write => RawOp::Write { imm: self.imm },
            Kind::Read => RawOp::Read,
            Kind::Send => RawOp::Send { imm: self.imm },
            Kind::FetchAdd { add } => RawOp::FetchAdd { add },
            Kind::CompareSwap { compare, swap } => RawOp::CompareSwap { compare, swap },
        };
        Ok(RawSendWr {
            wr_id: 0,
            op,
            sge: if self.inline.is_none() && len > 0 {
                self.local.as_ref().map(LocalSlice::sge)
            } else {
                None
            },
            inline: self.inline,
            remote_addr,
            rkey,
            signaled: self.signaled,
            fence: self.fence,
            solicited: self.solicited,
        })
    }
}

/// A receive-queue work request: a buffer for the next incoming send (or a slot for an
/// incoming write with immediate).
#[derive(Clone, Debug)]
#[must_use = "a work request does nothing until posted"]
pub struct RecvWr {
    pub(crate) wr_id: u64,
    pub(crate) local: Option<LocalSlice>,
}

impl RecvWr {
    /// A receive into `local` (needs `LOCAL_WRITE`).
    pub fn new(local: LocalSlice) -> RecvWr {
        RecvWr { wr_id: 0, local: Some(local) }
    }

    /// A receive with no buffer: takes zero-length sends and writes with immediate.
    pub fn empty() -> RecvWr {
        RecvWr { wr_id: 0, local: None }
    }

    /// Sets the `wr_id` the completion will carry.
    pub fn wr_id(mut self, wr_id: u64) -> RecvWr {
        self.wr_id = wr_id;
        self
    }

    pub(crate) fn to_raw(&self) -> RawRecvWr {
        RawRecvWr { wr_id: 0, sge: self.local.as_ref().filter(|l| l.len > 0).map(LocalSlice::sge) }
    }
}
