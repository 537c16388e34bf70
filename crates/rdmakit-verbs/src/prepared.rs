//! Send requests checked once and posted many times.
//!
//! perftest builds its work requests once, before timing, and changes one field per post;
//! a loop that builds a [`SendWr`] per post pays for the building, the checks and the
//! conversion to the provider's form every time. Measured with callgrind on rxe, user-space
//! instructions per iteration went from 1,531 to 1,356 in write-lat and from 1,487 to 1,208
//! in read-lat when they moved to prepared requests (perftest: 757 and 732). A
//! [`PreparedSend`] does that work once: what is left per post is the in-flight slot and
//! the provider call.
//!
//! A `PreparedSend` holds its region for its posts (their slots take no handle of their own:
//! no reference count to raise and lower per post, on a counter every thread posting from
//! the region shares); dropped before they retire, it leaves the region to the queue pair,
//! which keeps it until they have.

use std::sync::atomic::AtomicU64;

use crate::error::{Error, Result};
use crate::mr::MemoryRegion;
use crate::qp::QueuePair;
use crate::raw::{RawOp, RawRecvWr, RawSendWr};
use crate::wr::{RecvWr, SendWr};

/// A send-queue request checked and converted once, posted as often as wanted
/// ([`QueuePair::prepare_send`]).
///
/// It holds its queue pair and its local region (if any): neither goes away while it
/// exists, and dropping it with posts outstanding leaves the region to the queue pair until
/// they have completed, so it frees nothing under the NIC. (Leaking it leaks the region.)
///
/// An inline request keeps a copy of the bytes it was prepared with; [`post`](Self::post)
/// sends those, [`post_inline`](Self::post_inline) sends others of an allowed length.
///
/// # Examples
/// ```
/// use rdmakit_verbs::*;
/// let ctx = Context::open_soft();
/// let pd = ctx.alloc_pd()?;
/// let cq = ctx.create_cq(16)?;
/// let a = pd.create_qp(&cq, &cq, QpCaps::default())?;
/// let b = pd.create_qp(&cq, &cq, QpCaps::default())?;
/// a.connect(&b.address()?, &ConnectOptions::default())?;
/// b.connect(&a.address()?, &ConnectOptions::default())?;
/// let dst = pd.alloc_mr(8, AccessFlags::ALL_REMOTE)?;
///
/// let mut ping = a.prepare_send(SendWr::write_inline(&[0; 8], dst.remote().slice(0, 8)?))?;
/// for round in 1..=3u64 {
///     ping.set_wr_id(round);
///     ping.post_inline(&round.to_le_bytes())?;
///     assert_eq!(cq.wait(None)?.ok()?.wr_id, round);
/// }
/// assert_eq!(dst.read_u64(0)?, 3);
/// # Ok::<(), Error>(())
/// ```
pub struct PreparedSend {
    qp: QueuePair,
    /// The user's `wr_id`, carried by each post's completion.
    wr_id: u64,
    /// The local region, kept for every post until it retires (see `Drop`).
    mr: Option<MemoryRegion>,
    /// The number of the last post in the QP's send queue (0: none yet), written under
    /// the QP's in-flight lock.
    last_post: AtomicU64,
    /// The checked request in the providers' form, without its inline bytes.
    raw: RawSendWr<'static>,
    /// The bytes of an inline request, as prepared.
    inline: Option<Box<[u8]>>,
    /// The provider's own form, built once.
    backend: PreparedBackend,
}

/// A request in the provider's own form.
pub(crate) enum PreparedBackend {
    /// The soft NIC takes the provider-neutral form as it is.
    Soft,
    /// `struct ibv_send_wr` and its SGE, filled in.
    #[cfg(rdmakit_verbs)]
    Verbs(crate::rdma::SendTemplate),
}

impl std::fmt::Debug for PreparedSend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedSend")
            .field("qp_num", &format_args!("{:#x}", self.qp.qp_num()))
            .field("wr_id", &self.wr_id)
            .field("op", &self.raw.op)
            .field("len", &self.len())
            .field("inline", &self.inline.is_some())
            .finish()
    }
}

impl QueuePair {
    /// Checks `wr` once, as [`post_send`](Self::post_send) would, and returns it ready to be
    /// posted many times with no further building or conversion.
    ///
    /// # Errors
    /// The same [`Error::InvalidArgument`] as `post_send` for a request that cannot be
    /// valid on this QP (lengths, inline size, a buffer of another device).
    pub fn prepare_send(&self, wr: SendWr<'_>) -> Result<PreparedSend> {
        self.check_same_device(wr.local.as_ref())?;
        let raw = wr.to_raw(self.caps().max_inline_data)?;
        let backend = self.prepare_backend(&raw);
        let inline: Option<Box<[u8]>> = raw.inline.map(Box::from);
        let raw = RawSendWr { inline: None, ..raw };
        Ok(PreparedSend {
            qp: self.clone(),
            wr_id: wr.wr_id,
            mr: wr.local.map(|l| l.mr),
            last_post: AtomicU64::new(0),
            raw,
            inline,
            backend,
        })
    }
}

impl PreparedSend {
    /// Posts the request as prepared (`ibv_post_send`).
    ///
    /// # Errors
    /// As [`QueuePair::post_send`]: [`Error::QueueFull`], [`Error::QpState`] before RTS, a
    /// provider refusal.
    #[doc(alias = "ibv_post_send")]
    pub fn post(&self) -> Result<()> {
        self.qp.post_prepared(self, self.inline.as_deref())
    }

    /// Posts the request with `data` as its inline payload instead of the prepared bytes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the request was not prepared inline, or `data` has
    /// another length than the remote target of a write or more bytes than the QP's
    /// `max_inline_data`; otherwise as [`post`](Self::post).
    pub fn post_inline(&self, data: &[u8]) -> Result<()> {
        let Some(prepared) = &self.inline else {
            return Err(Error::InvalidArgument("post_inline on a request not prepared inline".into()));
        };
        let fits = match self.raw.op {
            // A write's length is its remote target's, checked when it was prepared.
            RawOp::Write { .. } => data.len() == prepared.len(),
            _ => data.len() <= self.qp.caps().max_inline_data as usize,
        };
        if !fits {
            return Err(Error::InvalidArgument(format!(
                "inline payload of {} bytes where the prepared request takes {} (max_inline_data {})",
                data.len(),
                prepared.len(),
                self.qp.caps().max_inline_data
            )));
        }
        self.qp.post_prepared(self, Some(data))
    }

    /// Sets the `wr_id` the next posts' completions carry.
    pub fn set_wr_id(&mut self, wr_id: u64) {
        self.wr_id = wr_id;
    }

    /// The `wr_id` posts carry.
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// Payload length in bytes (an inline request's prepared length).
    pub fn len(&self) -> u32 {
        match &self.inline {
            Some(d) => d.len() as u32,
            None => self.raw.len(),
        }
    }

    /// True for a zero-length request.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The queue pair it posts to.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The request's parts for a post, and where the post's number goes if the request
    /// holds a region (written under the in-flight lock: the numbers stored only grow).
    pub(crate) fn parts(&self) -> (u64, &RawSendWr<'static>, &PreparedBackend, Option<&AtomicU64>) {
        (self.wr_id, &self.raw, &self.backend, self.mr.as_ref().map(|_| &self.last_post))
    }
}

impl Drop for PreparedSend {
    /// Posts still outstanding read or write the region: the queue pair keeps it until the
    /// send queue has retired the last of them.
    fn drop(&mut self) {
        let last = *self.last_post.get_mut();
        if let Some(mr) = self.mr.take()
            && last > 0
        {
            self.qp.keep_prepared_region(last, mr);
        }
    }
}

/// A receive checked once and posted as often as wanted ([`QueuePair::prepare_recv`]): a
/// ping-pong re-posts the same buffer after every message. Like [`PreparedSend`], it holds
/// its queue pair and region, and each post's in-flight slot takes its own clone of the
/// region.
///
/// # Examples
/// ```
/// use rdmakit_verbs::*;
/// let ctx = Context::open_soft();
/// let pd = ctx.alloc_pd()?;
/// let cq = ctx.create_cq(16)?;
/// let a = pd.create_qp(&cq, &cq, QpCaps::default())?;
/// let b = pd.create_qp(&cq, &cq, QpCaps::default())?;
/// a.connect(&b.address()?, &ConnectOptions::default())?;
/// b.connect(&a.address()?, &ConnectOptions::default())?;
/// let inbox = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
///
/// let recv = b.prepare_recv(RecvWr::new(inbox.local()?).wr_id(9))?;
/// let hello = a.prepare_send(SendWr::send_inline(b"hello!!!"))?;
/// for _ in 0..3 {
///     recv.post()?;
///     hello.post()?;
///     cq.wait(None)?.ok()?;
///     cq.wait(None)?.ok()?;
/// }
/// assert_eq!(inbox.to_vec()?, b"hello!!!");
/// # Ok::<(), Error>(())
/// ```
pub struct PreparedRecv {
    qp: QueuePair,
    wr_id: u64,
    mr: Option<MemoryRegion>,
    raw: RawRecvWr,
}

impl std::fmt::Debug for PreparedRecv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedRecv")
            .field("qp_num", &format_args!("{:#x}", self.qp.qp_num()))
            .field("wr_id", &self.wr_id)
            .field("len", &self.raw.sge.map_or(0, |s| s.len))
            .finish()
    }
}

impl QueuePair {
    /// Checks `wr` once, as [`post_recv`](Self::post_recv) would, and returns it ready to be
    /// posted many times.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a buffer registered on another device.
    pub fn prepare_recv(&self, wr: RecvWr) -> Result<PreparedRecv> {
        self.check_same_device(wr.local.as_ref())?;
        let raw = wr.to_raw();
        Ok(PreparedRecv { qp: self.clone(), wr_id: wr.wr_id, mr: wr.local.map(|l| l.mr), raw })
    }
}

impl PreparedRecv {
    /// Posts the receive (`ibv_post_recv`).
    ///
    /// # Errors
    /// As [`QueuePair::post_recv`]: [`Error::QueueFull`], a provider refusal.
    #[doc(alias = "ibv_post_recv")]
    pub fn post(&self) -> Result<()> {
        self.qp.post_prepared_recv(self.wr_id, self.mr.as_ref(), &self.raw)
    }

    /// Sets the `wr_id` the next posts' completions carry.
    pub fn set_wr_id(&mut self, wr_id: u64) {
        self.wr_id = wr_id;
    }

    /// The queue pair it posts to.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }
}
