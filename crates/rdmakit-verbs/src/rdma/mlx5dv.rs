//! mlx5 direct verbs for `crate::mlx5` on the verbs provider: indirect mkeys
//! (`mlx5dv_create_mkey`) and a UMR queue (an RC QP created with `mlx5dv_create_qp`, the
//! `MLX5DV_QP_EX_WITH_MR_LIST` and `IBV_QP_EX_WITH_LOCAL_INV` send operations, connected to
//! itself) that binds them with `mlx5dv_wr_mr_list` and invalidates them with
//! `ibv_wr_local_inv`.
//!
//! **Untested on hardware**: no mlx5 device here, and rxe has no mlx5dv (every call below
//! returns `Unsupported` there, from `mlx5dv_is_supported`). It is compiled and linked
//! against rdma-core's `infiniband/mlx5dv.h` and `verbs.h` through `rdmakit-sys`, whose
//! bindgen output carries compile-time size and offset checks of every struct used here
//! (`mlx5dv_mkey_init_attr`, `mlx5dv_mkey`, `mlx5dv_qp_init_attr`, `ibv_qp_init_attr_ex`,
//! `ibv_qp_ex`); the call sequence follows the man pages `mlx5dv_create_mkey(3)`,
//! `mlx5dv_wr_post(3)` (`mlx5dv_wr_mr_list`) and `ibv_wr_post(3)`. The DEVX parts of the
//! design (KSM mkeys created by firmware command, `ALLOW_OTHER_VHCA_ACCESS`, mkey alias
//! objects, `QUERY_HCA_CAP` for the vHCA id) need PRM command layouts that are not in the
//! installed headers; they are not implemented and report `Unsupported`.

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmakit_sys as sys;
use rdmakit_sys::mlx5dv as dv;

use super::conv::nonnull;
use super::{Cq, Device, PdShared, Qp};
use crate::error::{Error, Result, WcStatus};
use crate::types::{AccessFlags, ConnectOptions, QpCaps};
use crate::wc::WorkCompletion;

/// How long a UMR or LOCAL_INV may take before it is reported stuck.
const UMR_TIMEOUT: Duration = Duration::from_secs(5);

fn supported(dev: &Device) -> Result<()> {
    // SAFETY: the context is open; `device` is set by ibv_open_device and lives with it.
    let device = unsafe { (*dev.ctx.as_ptr()).device };
    // SAFETY: a valid device pointer.
    if unsafe { dv::mlx5dv_is_supported(device) } {
        Ok(())
    } else {
        Err(Error::Unsupported(format!("{} is not an mlx5 device (mlx5dv_is_supported is false)", dev.name)))
    }
}

/// An indirect mkey (`mlx5dv_create_mkey` with `MLX5DV_MKEY_INIT_ATTR_FLAGS_INDIRECT`).
pub(crate) struct Mkey {
    mkey: NonNull<dv::mlx5dv_mkey>,
    _pd: Arc<PdShared>,
}

// SAFETY: an mkey handle is immutable after creation; UMR and destruction go through
// thread-safe verbs calls, destruction only from Drop.
unsafe impl Send for Mkey {}
// SAFETY: as above.
unsafe impl Sync for Mkey {}

impl Mkey {
    fn create(pd: &Arc<PdShared>, max_entries: u16) -> Result<Mkey> {
        supported(&pd.dev)?;
        let mut attr = dv::mlx5dv_mkey_init_attr {
            pd: pd.pd.as_ptr(),
            create_flags: dv::MLX5DV_MKEY_INIT_ATTR_FLAGS_INDIRECT,
            max_entries: max_entries.max(1),
        };
        // SAFETY: a valid PD; `attr` is initialised and read during the call only.
        let mkey = nonnull("mlx5dv_create_mkey", unsafe { dv::mlx5dv_create_mkey(&mut attr) })?;
        Ok(Mkey { mkey, _pd: pd.clone() })
    }

    pub fn lkey(&self) -> u32 {
        // SAFETY: valid until destroyed in Drop.
        unsafe { (*self.mkey.as_ptr()).lkey }
    }
}

impl Drop for Mkey {
    fn drop(&mut self) {
        // SAFETY: created by mlx5dv_create_mkey, destroyed once.
        if unsafe { dv::mlx5dv_destroy_mkey(self.mkey.as_ptr()) } != 0 {
            tracing::error!(lkey = self.lkey(), "mlx5dv_destroy_mkey failed");
        }
    }
}

/// A dedicated RC QP for UMR work requests, connected to itself, with its own CQ.
pub(crate) struct UmrQp {
    /// Destroyed (first: fields drop in order) before its CQ.
    _qp: Qp,
    qpx: NonNull<sys::ibv_qp_ex>,
    mqpx: NonNull<dv::mlx5dv_qp_ex>,
    cq: Cq,
}

// SAFETY: posting is serialised by the safe layer's `UmrQueue` (one `&self` call at a time
// through a mutex); the QP and CQ are thread-safe verbs objects.
unsafe impl Send for UmrQp {}
// SAFETY: as above.
unsafe impl Sync for UmrQp {}

impl UmrQp {
    fn create(ctx: &super::Context, pd: &Arc<PdShared>) -> Result<UmrQp> {
        supported(&pd.dev)?;
        let cq = ctx.create_cq(64)?;
        // SAFETY: all-zero is a valid ibv_qp_init_attr_ex (null pointers, no comp_mask bits).
        let mut init: sys::ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
        init.send_cq = cq.cq.as_ptr();
        init.recv_cq = cq.cq.as_ptr();
        init.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        init.cap = sys::ibv_qp_cap {
            max_send_wr: 16,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        };
        init.pd = pd.pd.as_ptr();
        init.comp_mask = sys::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0
            | sys::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS.0;
        init.send_ops_flags = u64::from(sys::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_LOCAL_INV.0);
        // SAFETY: all-zero is a valid mlx5dv_qp_init_attr.
        let mut dv_init: dv::mlx5dv_qp_init_attr = unsafe { std::mem::zeroed() };
        dv_init.comp_mask = u64::from(dv::MLX5DV_QP_INIT_ATTR_MASK_SEND_OPS_FLAGS);
        dv_init.send_ops_flags = u64::from(dv::MLX5DV_QP_EX_WITH_MR_LIST);
        // SAFETY: an open context; both attribute structs are initialised and only read.
        let raw = unsafe { dv::mlx5dv_create_qp(ctx.dev.ctx.as_ptr(), &mut init, &mut dv_init) };
        let raw = nonnull("mlx5dv_create_qp", raw)?;
        let qp = Qp {
            qp: raw,
            caps: QpCaps {
                max_send_wr: init.cap.max_send_wr,
                max_recv_wr: init.cap.max_recv_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: init.cap.max_inline_data,
            },
            destroyed: std::sync::atomic::AtomicBool::new(false),
            _pd: pd.clone(),
            _cqs: (cq.dev.clone(), cq.dev.clone()),
        };
        // SAFETY: the QP was created with send_ops_flags, so it has an extended form.
        let qpx = nonnull("ibv_qp_to_qp_ex", unsafe { sys::ibv_qp_to_qp_ex(raw.as_ptr()) })?;
        // SAFETY: a QP created by mlx5dv_create_qp with mlx5 send ops.
        let mqpx =
            nonnull("mlx5dv_qp_ex_from_ibv_qp_ex", unsafe { dv::mlx5dv_qp_ex_from_ibv_qp_ex(qpx.as_ptr()) })?;
        // Connected to itself: UMR and LOCAL_INV are local operations of an RTS QP.
        let opts = ConnectOptions::default();
        let me = qp.endpoint(&opts, 0)?;
        qp.modify_to_init(&opts)?;
        qp.modify_to_rtr(&me, &opts)?;
        qp.modify_to_rts(&opts, 0)?;
        Ok(UmrQp { _qp: qp, qpx, mqpx, cq })
    }

    /// Binds `mkey` to the (address, length, lkey) entries, zero-based, and waits.
    pub fn bind(&self, mkey: &Mkey, access: AccessFlags, entries: &[(u64, u32, u32)]) -> Result<()> {
        let mut sges: Vec<sys::ibv_sge> =
            entries.iter().map(|&(addr, length, lkey)| sys::ibv_sge { addr, length, lkey }).collect();
        let n =
            u16::try_from(sges.len()).map_err(|_| Error::InvalidArgument("too many UMR entries".into()))?;
        let qpx = self.qpx.as_ptr();
        // SAFETY: an RTS QP with MR_LIST send ops; `sges` lives across the post (the UMR
        // WQE copies the list, inline); the mkey is valid. wr_start/wr_complete bracket one
        // work request as ibv_wr_post(3) describes.
        let rc = unsafe {
            let start = (*qpx).wr_start.ok_or_else(|| Error::Unsupported("no wr_start".into()))?;
            let complete = (*qpx).wr_complete.ok_or_else(|| Error::Unsupported("no wr_complete".into()))?;
            start(qpx);
            (*qpx).wr_id = 1;
            (*qpx).wr_flags =
                sys::ibv_send_flags::IBV_SEND_SIGNALED.0 | sys::ibv_send_flags::IBV_SEND_INLINE.0;
            dv::mlx5dv_wr_mr_list(
                self.mqpx.as_ptr(),
                mkey.mkey.as_ptr(),
                access.bits(),
                n,
                sges.as_mut_ptr(),
            );
            complete(qpx)
        };
        super::conv::errno_ret("mlx5dv_wr_mr_list", rc)?;
        self.wait("UMR")
    }

    /// Invalidates `mkey` (`IBV_WR_LOCAL_INV`) and waits.
    pub fn invalidate(&self, mkey: &Mkey) -> Result<()> {
        let qpx = self.qpx.as_ptr();
        // SAFETY: an RTS QP created with LOCAL_INV send ops; the mkey is valid.
        let rc = unsafe {
            let start = (*qpx).wr_start.ok_or_else(|| Error::Unsupported("no wr_start".into()))?;
            let inv = (*qpx).wr_local_inv.ok_or_else(|| Error::Unsupported("no wr_local_inv".into()))?;
            let complete = (*qpx).wr_complete.ok_or_else(|| Error::Unsupported("no wr_complete".into()))?;
            start(qpx);
            (*qpx).wr_id = 2;
            (*qpx).wr_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
            inv(qpx, mkey.lkey());
            complete(qpx)
        };
        super::conv::errno_ret("ibv_wr_local_inv", rc)?;
        self.wait("LOCAL_INV")
    }

    fn wait(&self, what: &'static str) -> Result<()> {
        let start = Instant::now();
        let mut wc = [WorkCompletion::default(); 1];
        loop {
            if self.cq.poll(&mut wc)? == 1 {
                return if wc[0].status == WcStatus::SUCCESS {
                    Ok(())
                } else {
                    Err(Error::Completion { status: wc[0].status, wr_id: wc[0].wr_id, opcode: wc[0].opcode })
                };
            }
            if start.elapsed() > UMR_TIMEOUT {
                tracing::error!(what, "UMR queue: no completion");
                return Err(Error::Timeout(UMR_TIMEOUT));
            }
            std::hint::spin_loop();
        }
    }
}

impl super::Pd {
    /// A free indirect mkey of this PD with room for `max_entries` UMR entries.
    pub(crate) fn create_indirect_mkey(&self, max_entries: u16) -> Result<Mkey> {
        Mkey::create(&self.inner, max_entries)
    }

    /// A UMR queue on this PD, on `ctx`'s device.
    pub(crate) fn create_umr_qp(&self, ctx: &super::Context) -> Result<UmrQp> {
        UmrQp::create(ctx, &self.inner)
    }
}
