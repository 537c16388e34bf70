//! The rdma-core provider: thin owners of libibverbs objects.
//!
//! Each object holds an `Arc` of the object it was created from (MR → PD → device), so
//! the C objects are destroyed children-first whatever order the safe layer drops them in.
//! libibverbs' two common return conventions (NULL + errno, an errno returned) are mapped in
//! [`conv`]; `ibv_poll_cq`'s negative count is mapped where it is called (`cq.rs`), and
//! librdmacm's -1 + errno and its event statuses in `cm.rs`. Everything here trusts the safe layer for buffer lifetimes (see the
//! `# Safety` sections); it adds no checks the NIC makes itself.

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
pub(crate) use qp::Qp;

/// `ibv_port_attr::link_layer` of a RoCE port (the header's value, as the field's `u8`).
const LINK_LAYER_ETHERNET: u8 = rdmakit_sys::IBV_LINK_LAYER_ETHERNET as u8;
/// `ibv_port_attr::link_layer` of an InfiniBand port.
const LINK_LAYER_INFINIBAND: u8 = rdmakit_sys::IBV_LINK_LAYER_INFINIBAND as u8;
/// The async event of a CQ error (overrun), as the raw `u32` the event is read as.
const EVENT_CQ_ERR: u32 = rdmakit_sys::ibv_event_type::IBV_EVENT_CQ_ERR as u32;
