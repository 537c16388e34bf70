//! The rdma-core provider: thin owners of libibverbs objects.
//!
//! One file per C object, each made on its own side (`Pd::alloc(ctx)`, `Mr::reg(pd, ..)`,
//! `Qp::create(pd, ..)`, ...). Each object holds an `Arc` of the object it was created from
//! (MR → PD → device), so the C objects are destroyed children-first whatever order the safe
//! layer drops them in. Return conventions are mapped in [`conv`]: NULL + errno, errno
//! returned, a negative count, and the 0-or-errno of a release. Outside it, a few queries
//! whose failure is an answer (no event pending, no GID type, the QP state unknown) test
//! their result in place, DEVX commands check the firmware's status and syndrome in
//! `mlx5dv`, and librdmacm's calls are mapped in `cm`. Everything here trusts the safe layer
//! for buffer lifetimes (see the `# Safety` sections); it adds no checks the NIC makes itself.

pub(crate) mod cm;
mod conv;
mod cq;
mod device;
mod dm;
pub(crate) mod mlx5dv;
mod mr;
mod pd;
mod qp;

pub(crate) use cq::Cq;
use device::Device;
use device::device_name;
pub(crate) use device::{Context, device_names};
pub(crate) use dm::Dm;
pub(crate) use mr::Mr;
pub(crate) use pd::Pd;
use pd::PdShared;
pub(crate) use qp::{Qp, SendTemplate};

/// `ibv_port_attr::link_layer` of a RoCE port (the header's value, as the field's `u8`).
const LINK_LAYER_ETHERNET: u8 = rdmakit_sys::IBV_LINK_LAYER_ETHERNET as u8;
/// `ibv_port_attr::link_layer` of an InfiniBand port.
const LINK_LAYER_INFINIBAND: u8 = rdmakit_sys::IBV_LINK_LAYER_INFINIBAND as u8;
/// The async event of a CQ error (overrun), as the raw `u32` the event is read as.
const EVENT_CQ_ERR: u32 = rdmakit_sys::ibv_event_type::IBV_EVENT_CQ_ERR as u32;
