//! Protection domains: the scope in which keys and QPs must agree.

use std::sync::Arc;

use crate::cq::CompletionQueue;
use crate::device::{Context, CtxBackend};
use crate::dm::DeviceMemory;
use crate::error::Result;
use crate::mr::MemoryRegion;
use crate::qp::QueuePair;
use crate::types::{AccessFlags, QpCaps};

/// A protection domain (`struct ibv_pd`). Memory regions and QPs of one PD can work
/// together; a key from another PD is refused by the NIC.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

/// Fields drop in order: the provider object before the parent it needs.
pub(crate) struct PdInner {
    pub(crate) backend: PdBackend,
    pub(crate) ctx: Context,
}

pub(crate) enum PdBackend {
    Soft(u64),
    #[cfg(rdmakit_verbs)]
    Verbs(crate::rdma::Pd),
}

/// The one place a protection domain dispatches to its provider.
impl PdBackend {
    fn alloc(ctx: &Context) -> Result<PdBackend> {
        match ctx.backend() {
            CtxBackend::Soft(dev) => Ok(PdBackend::Soft(dev.alloc_pd())),
            #[cfg(rdmakit_verbs)]
            CtxBackend::Verbs(c) => Ok(PdBackend::Verbs(crate::rdma::Pd::alloc(c)?)),
        }
    }
}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain").field("device", &self.inner.ctx.name()).finish()
    }
}

impl ProtectionDomain {
    pub(crate) fn new(ctx: &Context) -> Result<ProtectionDomain> {
        let backend = PdBackend::alloc(ctx)?;
        Ok(ProtectionDomain { inner: Arc::new(PdInner { ctx: ctx.clone(), backend }) })
    }

    /// The device this PD belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// The provider object behind this PD.
    pub(crate) fn backend(&self) -> &PdBackend {
        &self.inner.backend
    }

    /// True if `other` is a handle of this same protection domain.
    pub(crate) fn same_pd(&self, other: &ProtectionDomain) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Allocates `len` zeroed, page-aligned bytes and registers them (`ibv_reg_mr`).
    ///
    /// On a soft device with the same-host path on, a region for remote write or read
    /// lives in its own memfd, which a requester of another process on this host may map
    /// (once this device grants it) to place its writes and reads directly; see the
    /// README's soft NIC section. [`register`](Self::register)ed vectors stay on the heap
    /// and reach such requesters through the rings.
    ///
    /// # Examples
    /// ```
    /// use rdmakit_verbs::{AccessFlags, Context};
    /// let pd = Context::open_soft().alloc_pd()?;
    /// let mr = pd.alloc_mr(4096, AccessFlags::ALL_REMOTE)?;
    /// mr.write_at(0, b"hello")?;
    /// let mut back = [0u8; 5];
    /// mr.read_at(0, &mut back)?;
    /// assert_eq!(&back, b"hello");
    /// # Ok::<(), rdmakit_verbs::Error>(())
    /// ```
    #[doc(alias = "ibv_reg_mr")]
    pub fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        MemoryRegion::alloc(self, len, access)
    }

    /// Registers a vector the region takes ownership of. Get it back with
    /// [`MemoryRegion::try_into_vec`] once no work request uses it.
    #[doc(alias = "ibv_reg_mr")]
    pub fn register(&self, bytes: Vec<u8>, access: AccessFlags) -> Result<MemoryRegion> {
        MemoryRegion::from_vec(self, bytes, access)
    }

    /// Registers memory the caller owns (`ibv_reg_mr` on `addr..addr + len`), for buffers that
    /// rdmakit did not allocate: an application's I/O buffers, a registration cache's ranges
    /// (see `rdmakit_memory::xgvmi::RangeCache`). The region never frees the memory.
    ///
    /// `addr` must be 8-byte aligned and `len` a non-zero multiple of 8
    /// ([`Error::InvalidArgument`](crate::Error::InvalidArgument) otherwise): the soft NIC and the
    /// region's copy calls move whole aligned words.
    ///
    /// Dropping the region's last handle deregisters it and returns once no NIC access
    /// reaches the memory any more, as `ibv_dereg_mr` does: on the soft NIC it waits for
    /// every access already in progress to finish (a peer's write still landing). Accesses a
    /// peer could keep going for as long as it likes let go instead: a send's payload still
    /// queued for a peer is copied out of the memory, and a read or atomic outstanding
    /// through an indirect key over it completes with `LOC_PROT_ERR` when its answer comes.
    ///
    /// # Safety
    /// - `addr..addr + len` is allocated, readable and writable, and stays so until this region
    ///   and every clone of it (including those held by in-flight work requests) is dropped.
    /// - While the region exists, that memory is read and written only through rdmakit (the
    ///   region's copy calls) or by the NIC and the peers given its rkey: no Rust reference to
    ///   it may exist and no other code may access it, since a peer may write it at any time.
    pub unsafe fn register_raw(
        &self,
        addr: std::ptr::NonNull<u8>,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        // SAFETY: forwarded contract.
        unsafe { MemoryRegion::from_raw(self, addr, len, access) }
    }

    /// Registers `len` bytes of device memory from `offset`, zero-based
    /// (`ibv_reg_dm_mr` with `IBV_ACCESS_ZERO_BASED`): peers address it from 0.
    #[doc(alias = "ibv_reg_dm_mr")]
    pub fn register_dm(
        &self,
        dm: &DeviceMemory,
        offset: u64,
        len: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        MemoryRegion::from_dm(self, dm, offset, len, access)
    }

    /// Registers a dma-buf (`ibv_reg_dmabuf_mr`), typically GPU memory exported by its
    /// driver, so the NIC reads and writes it directly (GPUDirect RDMA).
    ///
    /// The region has no CPU access through rdmakit: its copy methods return
    /// [`Error::Unsupported`](crate::Error::Unsupported). Only the verbs provider supports
    /// it; the soft NIC returns `Unsupported`.
    ///
    /// **Untested here**: no machine rdmakit is tested on has a GPU and an RDMA NIC; the call
    /// follows `ibv_reg_dmabuf_mr(3)` and is compiled and linked against rdma-core.
    ///
    /// # Safety
    /// `fd` must be a dma-buf file descriptor covering `offset..offset + len`, and the
    /// memory it exports must stay allocated until the region is dropped and every work
    /// request using it has completed. The caller must not access that memory through
    /// other means in ways that race with the NIC.
    #[doc(alias = "ibv_reg_dmabuf_mr")]
    pub unsafe fn register_dmabuf(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        // SAFETY: forwarded contract.
        unsafe { MemoryRegion::from_dmabuf(self, fd, offset, len, iova, access) }
    }

    /// Creates an RC queue pair (`ibv_create_qp`) in state RESET; connect it with
    /// [`QueuePair::connect`].
    #[doc(alias = "ibv_create_qp")]
    pub fn create_qp(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCaps,
    ) -> Result<QueuePair> {
        QueuePair::new(self, send_cq, recv_cq, caps)
    }
}
