//! Safe RDMA verbs over two providers: rdma-core (`libibverbs`) and a software NIC.
//!
//! One API, two providers:
//! - **verbs** (cargo feature `verbs`, on by default): real rdma-core, for RDMA NICs and
//!   the kernel's Soft-RoCE (`rdma_rxe`);
//! - **soft**: a user-space NIC in this crate that enforces verbs semantics (keys, access
//!   flags, bounds, ordering, completion statuses). It needs no hardware, so code and tests
//!   run anywhere.
//!
//! [`Context::open_default`] picks a verbs device when one exists and the soft NIC
//! otherwise; `RDMAKIT_PROVIDER=soft|verbs` forces one.
//!
//! # Soundness model
//! - Memory regions own their bytes and are byte-only. Safe code never gets a
//!   `&[u8]`/`&mut [u8]` over registered memory (the NIC or a peer may write it at any
//!   time); it copies with [`MemoryRegion::read_at`]/[`write_at`](MemoryRegion::write_at).
//!   The escape hatches [`MemoryRegion::as_slice`]/[`as_mut_slice`](MemoryRegion::as_mut_slice)
//!   are `unsafe fn`.
//! - A posted work request holds a clone of its local region until its completion is
//!   reaped or its QP is destroyed, so dropping or leaking anything on the user's side can
//!   not free memory under the NIC.
//! - Children hold their parents (`MemoryRegion` → `ProtectionDomain` → `Context`), so
//!   drop order is free.
//! - Remote descriptors are plain data: a stale or forged one earns an error completion
//!   from the remote NIC, never local undefined behaviour.
//!
//! # Getting started
//! ```
//! use rdmakit_verbs::*;
//!
//! let ctx = Context::open_soft();
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(64)?;
//! let (a, b) = (pd.create_qp(&cq, &cq, QpCaps::default())?, pd.create_qp(&cq, &cq, QpCaps::default())?);
//! a.connect(&b.address()?, &ConnectOptions::default())?;
//! b.connect(&a.address()?, &ConnectOptions::default())?;
//!
//! let counter = pd.alloc_mr(8, AccessFlags::ALL_REMOTE)?; // b's memory, in a real program
//! let result = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
//! a.post_send(SendWr::fetch_add(result.local()?, counter.remote().slice(0, 8)?, 5))?;
//! cq.wait(None)?.ok()?;
//! assert_eq!((result.read_u64(0)?, counter.read_u64(0)?), (0, 5));
//! # Ok::<(), Error>(())
//! ```

#![warn(missing_docs)]

pub mod cm;
mod cq;
mod device;
mod dm;
mod error;
mod inflight;
pub mod mlx5;
mod mr;
mod pd;
mod prepared;
mod qp;
mod raw;
mod shared_mem;
pub mod soft;
mod types;
mod wc;
mod wr;

#[cfg(rdmakit_verbs)]
mod rdma;

pub use cq::CompletionQueue;
pub use device::{
    Context, DEVICE_ENV, DeviceInfo, PROVIDER_ENV, VERBS_BUILT, VERBS_MISSING, devices,
    verbs_unavailable_reason,
};
pub use dm::DeviceMemory;
pub use error::{Error, Result, WcStatus};
pub use mr::{LocalSlice, MemoryRegion};
pub use pd::ProtectionDomain;
pub use prepared::{PreparedRecv, PreparedSend};
pub use qp::QueuePair;
#[doc(hidden)]
pub use soft::RateLimit;
pub use soft::SoftConfig;
pub use types::{
    AccessFlags, ConnectOptions, DeviceAttr, GidEntry, GidKind, Mtu, ProviderKind, QpAddress,
    QpAddressDecodeError, QpCaps, QpState, RemoteRegion, RemoteSlice,
};
pub use wc::{WcOpcode, WorkCompletion};
pub use wr::{RecvWr, SendWr};
