//! libibverbs' common return conventions (NULL + errno, an errno returned), and request/state
//! conversions. `ibv_poll_cq`'s negative count is mapped in `cq.rs`, librdmacm's in `cm.rs`.

use std::ptr::NonNull;

use rdmakit_sys as sys;

use crate::error::{Error, Result};
use crate::raw::{RawOp, RawSendWr};
use crate::types::{ConnectOptions, QpState};

/// NULL + errno (`ibv_reg_mr`, `ibv_create_qp`, ...).
pub(super) fn nonnull<T>(call: &'static str, p: *mut T) -> Result<NonNull<T>> {
    NonNull::new(p).ok_or_else(|| Error::last_os(call))
}

/// NULL + errno, keeping the OS error for a caller that maps some errno values to errors of
/// its own (`ibv_alloc_dm`, `ibv_reg_dm_mr`, DEVX object creation).
pub(super) fn nonnull_os<T>(p: *mut T) -> std::result::Result<NonNull<T>, std::io::Error> {
    NonNull::new(p).ok_or_else(std::io::Error::last_os_error)
}

/// A count, or a negative errno (`ibv_poll_cq`).
pub(super) fn count(call: &'static str, n: i32) -> Result<usize> {
    usize::try_from(n).map_err(|_| Error::errno(call, n.saturating_neg()))
}

/// A call releasing an object (`ibv_dealloc_pd`, `ibv_destroy_cq`, ...): 0 or an errno, as
/// [`errno_ret`]. True on success; a failure is logged with the device, and the caller
/// decides what the still-live object means (usually: leak what it reaches).
pub(super) fn released(call: &'static str, device: &str, rc: i32) -> bool {
    match errno_ret(call, rc) {
        Ok(()) => true,
        Err(e) => {
            tracing::error!(device, error = %e, "{call} failed");
            false
        }
    }
}

/// An errno returned directly, 0 on success (`ibv_modify_qp`, `ibv_post_send`, ...). Some
/// providers return -1 and set errno instead; both are handled.
pub(super) fn errno_ret(call: &'static str, rc: i32) -> Result<()> {
    match rc {
        0 => Ok(()),
        -1 => Err(Error::last_os(call)),
        e => Err(Error::errno(call, e.abs())),
    }
}

/// Sets `O_NONBLOCK` on a descriptor owned by rdma-core (async fd, completion channel).
///
/// # Safety
/// `fd` must be an open descriptor.
pub(super) unsafe fn set_nonblocking(fd: i32) -> Result<()> {
    // SAFETY: fcntl on an open descriptor (caller's contract).
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: fcntl(F_SETFL) on the same open descriptor (caller's contract), with flags it
    // returned plus O_NONBLOCK.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(Error::last_os("fcntl(O_NONBLOCK)"));
    }
    Ok(())
}

pub(super) fn qp_state(s: u32) -> QpState {
    use sys::ibv_qp_state as q;
    match s {
        q::IBV_QPS_RESET => QpState::Reset,
        q::IBV_QPS_INIT => QpState::Init,
        q::IBV_QPS_RTR => QpState::ReadyToReceive,
        q::IBV_QPS_RTS => QpState::ReadyToSend,
        q::IBV_QPS_SQD => QpState::SendQueueDrain,
        q::IBV_QPS_SQE => QpState::SendQueueError,
        q::IBV_QPS_ERR => QpState::Error,
        other => QpState::Unknown(other),
    }
}

/// Fills one `ibv_send_wr` (zeroed by the caller) and its SGE from the provider-neutral
/// request. The caller links `sg_list` and `next`.
pub(super) fn fill_send_wr(wr: &mut sys::ibv_send_wr, sge: &mut sys::ibv_sge, raw: &RawSendWr<'_>) {
    use sys::ibv_send_flags as f;
    use sys::ibv_wr_opcode as o;
    wr.wr_id = raw.wr_id;
    let mut flags = 0;
    if raw.signaled {
        flags |= f::IBV_SEND_SIGNALED.0;
    }
    if raw.fence {
        flags |= f::IBV_SEND_FENCE.0;
    }
    if raw.solicited {
        flags |= f::IBV_SEND_SOLICITED.0;
    }
    match (raw.inline, raw.sge) {
        (Some(data), _) => {
            flags |= f::IBV_SEND_INLINE.0;
            *sge = sys::ibv_sge { addr: data.as_ptr() as u64, length: data.len() as u32, lkey: 0 };
            wr.num_sge = i32::from(!data.is_empty());
        }
        (None, Some(s)) => {
            *sge = sys::ibv_sge { addr: s.addr, length: s.len, lkey: s.lkey };
            wr.num_sge = 1;
        }
        (None, None) => wr.num_sge = 0,
    }
    wr.send_flags = flags;
    let imm = |wr: &mut sys::ibv_send_wr, v: u32| wr.__bindgen_anon_1.imm_data = v.to_be();
    match raw.op {
        RawOp::Write { imm: i } => {
            wr.opcode = if i.is_some() { o::IBV_WR_RDMA_WRITE_WITH_IMM } else { o::IBV_WR_RDMA_WRITE };
            if let Some(v) = i {
                imm(wr, v);
            }
            wr.wr.rdma.remote_addr = raw.remote_addr;
            wr.wr.rdma.rkey = raw.rkey;
        }
        RawOp::Read => {
            wr.opcode = o::IBV_WR_RDMA_READ;
            wr.wr.rdma.remote_addr = raw.remote_addr;
            wr.wr.rdma.rkey = raw.rkey;
        }
        RawOp::Send { imm: i } => {
            wr.opcode = if i.is_some() { o::IBV_WR_SEND_WITH_IMM } else { o::IBV_WR_SEND };
            if let Some(v) = i {
                imm(wr, v);
            }
        }
        RawOp::FetchAdd { add } => {
            wr.opcode = o::IBV_WR_ATOMIC_FETCH_AND_ADD;
            wr.wr.atomic.remote_addr = raw.remote_addr;
            wr.wr.atomic.rkey = raw.rkey;
            wr.wr.atomic.compare_add = add;
        }
        RawOp::CompareSwap { compare, swap } => {
            wr.opcode = o::IBV_WR_ATOMIC_CMP_AND_SWP;
            wr.wr.atomic.remote_addr = raw.remote_addr;
            wr.wr.atomic.rkey = raw.rkey;
            wr.wr.atomic.compare_add = compare;
            wr.wr.atomic.swap = swap;
        }
    }
}

/// Applies the path options of `opts` (service level, GRH traffic class, flow label and hop
/// limit, P_Key index) to `attr`, the one place both the hand-built connection and the
/// rdma_cm path set them. `None` leaves what `attr` has: the hand-built path's defaults or
/// the values `rdma_init_qp_attr` took from the route. Returns the mask bits it touched.
pub(crate) fn apply_path_options(attr: &mut sys::ibv_qp_attr, opts: &ConnectOptions) -> u32 {
    use sys::ibv_qp_attr_mask as m;
    let mut mask = 0;
    if let Some(sl) = opts.service_level {
        attr.ah_attr.sl = sl;
        mask |= m::IBV_QP_AV.0;
    }
    if attr.ah_attr.is_global != 0 {
        if let Some(tc) = opts.traffic_class {
            attr.ah_attr.grh.traffic_class = tc;
            mask |= m::IBV_QP_AV.0;
        }
        if let Some(fl) = opts.flow_label {
            attr.ah_attr.grh.flow_label = fl;
            mask |= m::IBV_QP_AV.0;
        }
        if let Some(hl) = opts.hop_limit {
            attr.ah_attr.grh.hop_limit = hl;
            mask |= m::IBV_QP_AV.0;
        }
    }
    mask
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_negative_count_is_its_errno() {
        assert_eq!(count("ibv_poll_cq", 3).unwrap(), 3);
        assert_eq!(count("ibv_poll_cq", 0).unwrap(), 0);
        match count("ibv_poll_cq", -libc::EINVAL) {
            Err(Error::Os { call: "ibv_poll_cq", source }) => {
                assert_eq!(source.raw_os_error(), Some(libc::EINVAL))
            }
            other => panic!("expected EINVAL from ibv_poll_cq, got {other:?}"),
        }
        // The most negative value does not overflow.
        assert!(count("ibv_poll_cq", i32::MIN).is_err());
    }

    #[test]
    fn released_is_true_only_on_zero() {
        assert!(released("ibv_dealloc_pd", "test0", 0));
        assert!(!released("ibv_dealloc_pd", "test0", libc::EBUSY));
        assert!(!released("ibv_dealloc_pd", "test0", -1));
    }

    #[test]
    fn null_keeps_the_os_error() {
        // SAFETY: fcntl on a descriptor that is not open only sets errno (EBADF).
        unsafe { libc::fcntl(-1, libc::F_GETFL) };
        let e = nonnull_os(std::ptr::null_mut::<u8>()).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADF));
        let mut x = 0u8;
        assert!(nonnull_os(&mut x as *mut u8).is_ok());
    }
}
