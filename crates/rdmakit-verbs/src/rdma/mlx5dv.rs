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
//! `mlx5dv_wr_post(3)` (`mlx5dv_wr_mr_list`) and `ibv_wr_post(3)`.
//!
//! DEVX (firmware commands through `mlx5dv_devx_general_cmd` / `mlx5dv_devx_obj_create`):
//! `QUERY_HCA_CAP` for the vHCA id, `ALLOW_OTHER_VHCA_ACCESS`, and mkey alias objects
//! (`CREATE_GENERAL_OBJECT` of type MKEY). Their PRM layouts are not in rdma-core's headers;
//! they are written by hand below from the kernel's `include/linux/mlx5/mlx5_ifc.h`, and,
//! like the rest of this file, have never run on an mlx5 device. A key or alias whose
//! destruction fails is never released: the regions it maps stay registered and allocated
//! (see `MrInner::leak_memory`).

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdmakit_sys as sys;
use rdmakit_sys::mlx5dv as dv;

use super::conv::nonnull;
use super::{Cq, Device, PdShared, Qp};
use crate::error::{Error, Result, WcStatus};
use crate::raw::RawKsm;
use crate::types::{AccessFlags, ConnectOptions, QpCaps};
use crate::wc::WorkCompletion;

/// Bytes of one entry of a UMR's inline KLM list (`struct mlx5_wqe_data_seg`).
const KLM_ENTRY_BYTES: u32 = std::mem::size_of::<dv::mlx5_wqe_data_seg>() as u32;

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
    /// Set once `mlx5dv_destroy_mkey` succeeded.
    destroyed: AtomicBool,
    _pd: Arc<PdShared>,
}

// SAFETY: an mkey handle is immutable after creation; UMR and destruction go through
// thread-safe verbs calls, destruction only from Drop.
unsafe impl Send for Mkey {}
// SAFETY: `&Mkey` reads the immutable key numbers, and destroy is guarded by the atomic
// `destroyed` flag.
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
        Ok(Mkey { mkey, destroyed: AtomicBool::new(false), _pd: pd.clone() })
    }

    pub fn lkey(&self) -> u32 {
        // SAFETY: valid until destroyed in Drop.
        unsafe { (*self.mkey.as_ptr()).lkey }
    }
}

impl Mkey {
    /// Destroys the key; false if the library refused, in which case the key may still be
    /// live in the NIC and the caller must keep every region it maps alive (leak them).
    pub fn destroy(&self) -> bool {
        if self.destroyed.load(Ordering::Acquire) {
            return true;
        }
        // SAFETY: created by mlx5dv_create_mkey; `destroyed` makes a second call a no-op, and
        // only the owning region's Drop (one thread) calls this.
        let ok = unsafe { dv::mlx5dv_destroy_mkey(self.mkey.as_ptr()) } == 0;
        self.destroyed.store(ok, Ordering::Release);
        ok
    }
}

impl Drop for Mkey {
    fn drop(&mut self) {
        // A failure was reported (and the memory leaked) by whoever called destroy first.
        if !self.destroy() {
            tracing::error!(lkey = self.lkey(), "mlx5dv_destroy_mkey failed");
        }
    }
}

/// A dedicated RC QP for UMR work requests, connected to itself, with its own CQ.
pub(crate) struct UmrQp {
    /// Destroyed (first: fields drop in order) before its CQ.
    _qp: Qp,
    /// Most entries one UMR can carry: its KLM list goes inline in the WQE, 16 bytes an
    /// entry, within the QP's `max_inline_data`.
    max_entries: usize,
    qpx: NonNull<sys::ibv_qp_ex>,
    mqpx: NonNull<dv::mlx5dv_qp_ex>,
    cq: Cq,
    /// The `wr_id` of the next request: a completion is matched to its own request, so a
    /// late one (of a request that timed out) is never taken for the next request's.
    next_id: std::cell::Cell<u64>,
    /// Why the queue takes no more work: a request timed out (it may still execute, so
    /// whether a key is bound is unknown) or failed (the QP is in the error state).
    broken: std::cell::Cell<Option<&'static str>>,
}

// SAFETY: the QP and CQ are thread-safe verbs objects, and the raw pointers are views of the
// QP; `UmrQp` is not `Sync` (its cells), so one thread at a time uses it (the safe layer
// keeps it in a `Mutex`).
unsafe impl Send for UmrQp {}

impl UmrQp {
    fn create(ctx: &super::Context, pd: &Arc<PdShared>, max_entries: u16) -> Result<UmrQp> {
        supported(&pd.dev)?;
        let cq = Cq::create(ctx, 64)?;
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
            // The entry list of `mlx5dv_wr_mr_list` is copied inline (IBV_SEND_INLINE).
            max_inline_data: u32::from(max_entries) * KLM_ENTRY_BYTES,
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
        let me = qp.address(&opts, 0)?;
        qp.modify_to_init(&opts)?;
        qp.modify_to_rtr(&me, &opts)?;
        qp.modify_to_rts(&opts, 0)?;
        let max_entries = (qp.caps.max_inline_data / KLM_ENTRY_BYTES) as usize;
        Ok(UmrQp {
            _qp: qp,
            max_entries,
            qpx,
            mqpx,
            cq,
            next_id: std::cell::Cell::new(1),
            broken: std::cell::Cell::new(None),
        })
    }

    /// Refuses work once the queue is broken; otherwise the next request's `wr_id`.
    fn next_request(&self) -> Result<u64> {
        if let Some(why) = self.broken.get() {
            return Err(Error::Unsupported(format!("the PD's UMR queue is out of service: {why}")));
        }
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        Ok(id)
    }

    /// Binds `mkey` to the entries, zero-based, and waits. On [`Error::Timeout`] the UMR may
    /// still execute: the caller must keep the entries' regions (and the key's current
    /// ones) registered for good.
    pub fn bind(&self, mkey: &Mkey, access: AccessFlags, entries: &[RawKsm]) -> Result<()> {
        let mut sges = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            let length = u32::try_from(e.len)
                .map_err(|_| Error::InvalidArgument(format!("KSM entry {i}: over 4 GiB")))?;
            sges.push(sys::ibv_sge { addr: e.addr, length, lkey: e.key });
        }
        if entries.len() > self.max_entries {
            return Err(Error::Unsupported(format!(
                "a UMR carries at most {} entries inline on this QP ({} asked)",
                self.max_entries,
                entries.len()
            )));
        }
        let n =
            u16::try_from(sges.len()).map_err(|_| Error::InvalidArgument("too many UMR entries".into()))?;
        let id = self.next_request()?;
        let qpx = self.qpx.as_ptr();
        // SAFETY: an RTS QP with MR_LIST send ops; `sges` lives across the post (the UMR
        // WQE copies the list, inline); the mkey is valid. wr_start/wr_complete bracket one
        // work request as ibv_wr_post(3) describes.
        let rc = unsafe {
            let start = (*qpx).wr_start.ok_or_else(|| Error::Unsupported("no wr_start".into()))?;
            let complete = (*qpx).wr_complete.ok_or_else(|| Error::Unsupported("no wr_complete".into()))?;
            start(qpx);
            (*qpx).wr_id = id;
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
        self.wait("UMR", id)
    }

    /// Invalidates `mkey` (`IBV_WR_LOCAL_INV`) and waits. On [`Error::Timeout`] the key may
    /// still map its regions: the caller keeps them registered for good.
    pub fn invalidate(&self, mkey: &Mkey) -> Result<()> {
        let id = self.next_request()?;
        let qpx = self.qpx.as_ptr();
        // SAFETY: an RTS QP created with LOCAL_INV send ops; the mkey is valid.
        let rc = unsafe {
            let start = (*qpx).wr_start.ok_or_else(|| Error::Unsupported("no wr_start".into()))?;
            let inv = (*qpx).wr_local_inv.ok_or_else(|| Error::Unsupported("no wr_local_inv".into()))?;
            let complete = (*qpx).wr_complete.ok_or_else(|| Error::Unsupported("no wr_complete".into()))?;
            start(qpx);
            (*qpx).wr_id = id;
            (*qpx).wr_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
            inv(qpx, mkey.lkey());
            complete(qpx)
        };
        super::conv::errno_ret("ibv_wr_local_inv", rc)?;
        self.wait("LOCAL_INV", id)
    }

    /// Waits for request `id`'s completion. Completions of earlier requests (late ones, of
    /// requests that timed out: the queue is broken then, so none should come) are skipped.
    fn wait(&self, what: &'static str, id: u64) -> Result<()> {
        let start = Instant::now();
        let mut wc = [WorkCompletion::default(); 1];
        loop {
            if self.cq.poll(&mut wc)? == 1 {
                if wc[0].wr_id != id {
                    tracing::warn!(
                        what,
                        wr_id = wc[0].wr_id,
                        id,
                        "UMR queue: a completion of another request"
                    );
                    continue;
                }
                if wc[0].status == WcStatus::SUCCESS {
                    return Ok(());
                }
                // An RC error moves the self-connected QP to the error state for good.
                self.broken.set(Some("a UMR or LOCAL_INV request failed"));
                return Err(Error::Completion {
                    status: wc[0].status,
                    wr_id: wc[0].wr_id,
                    opcode: wc[0].opcode,
                });
            }
            if start.elapsed() > UMR_TIMEOUT {
                tracing::error!(what, "UMR queue: no completion; the queue takes no more work");
                self.broken.set(Some("a UMR or LOCAL_INV request timed out"));
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

    /// The PD's UMR queue, on `ctx`'s device, for keys of up to `max_entries` entries: made
    /// on first use and shared by every key of the PD.
    pub(crate) fn umr_qp(&self, ctx: &super::Context, max_entries: u16) -> Result<Arc<Mutex<UmrQp>>> {
        let mut shared = self.umr.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(umr) = &*shared {
            return Ok(umr.clone());
        }
        let umr = Arc::new(Mutex::new(UmrQp::create(ctx, &self.inner, max_entries)?));
        *shared = Some(umr.clone());
        Ok(umr)
    }
}

// ---- DEVX: firmware commands in PRM layout ----
//
// Layouts and numbers from the Linux kernel's `include/linux/mlx5/mlx5_ifc.h` (the PRM
// structures rdma-core's `providers/mlx5/mlx5_ifc.h` mirrors): every field is big-endian at
// the bit offset its `reserved_at_*` neighbours give. Reviewed, not run: there is no mlx5
// device here.

/// `MLX5_CMD_OP_QUERY_HCA_CAP`.
const OP_QUERY_HCA_CAP: u16 = 0x100;
/// `MLX5_CMD_OP_CREATE_GENERAL_OBJECT`.
const OP_CREATE_GENERAL_OBJECT: u16 = 0xa00;
/// `MLX5_CMD_OP_ALLOW_OTHER_VHCA_ACCESS`.
const OP_ALLOW_OTHER_VHCA_ACCESS: u16 = 0xb16;
/// `MLX5_OBJ_TYPE_MKEY` (general object type of memory keys).
const OBJ_TYPE_MKEY: u16 = 0xff01;
/// `MLX5_CMD_OP_CREATE_MKEY`.
const OP_CREATE_MKEY: u16 = 0x200;
/// `MLX5_MKC_ACCESS_MODE_KSM`: the key maps fixed-size entities onto other keys.
const ACCESS_MODE_KSM: u64 = 0x3;
/// `op_mod` of QUERY_HCA_CAP: `MLX5_SET_HCA_CAP_OP_MOD_GENERAL_DEVICE << 1 | HCA_CAP_OPMOD_GET_CUR`.
const OP_MOD_GENERAL_CURRENT: u16 = 1;

/// One field of a firmware command, where rdmakit reads or writes it: the PRM layout it
/// belongs to (`mlx5_ifc_<layout>_bits` in the kernel's `mlx5_ifc.h`), its path there
/// (`.`-separated; members of anonymous unions are named directly), and the bit offset and
/// width rdmakit uses. A test compares every one of them with the kernel header.
#[derive(Clone, Copy, Debug)]
struct PrmField {
    layout: &'static str,
    path: &'static str,
    bit: usize,
    width: usize,
}

const fn prm(layout: &'static str, path: &'static str, bit: usize, width: usize) -> PrmField {
    PrmField { layout, path, bit, width }
}

// QUERY_HCA_CAP, general capabilities: 16 bytes in, 16-byte header + 4096 bytes out.
const HCA_CAP_IN_BYTES: usize = 16;
const HCA_CAP_OUT_BYTES: usize = 16 + 4096;
const HCA_CAP_OPCODE: PrmField = prm("query_hca_cap_in", "opcode", 0x0, 0x10);
const HCA_CAP_OP_MOD: PrmField = prm("query_hca_cap_in", "op_mod", 0x30, 0x10);
const HCA_CAP_STATUS: PrmField = prm("query_hca_cap_out", "status", 0x0, 0x8);
const HCA_CAP_SYNDROME: PrmField = prm("query_hca_cap_out", "syndrome", 0x20, 0x20);
const HCA_CAP_VHCA_ID: PrmField = prm("query_hca_cap_out", "capability.cmd_hca_cap.vhca_id", 0xb0, 0x10);

// ALLOW_OTHER_VHCA_ACCESS: 64 bytes in, 16 out.
const ALLOW_IN_BYTES: usize = 64;
const ALLOW_OPCODE: PrmField = prm("allow_other_vhca_access_in", "opcode", 0x0, 0x10);
const ALLOW_OBJ_TYPE: PrmField = prm("allow_other_vhca_access_in", "object_type_to_be_accessed", 0x90, 0x10);
const ALLOW_OBJ_ID: PrmField = prm("allow_other_vhca_access_in", "object_id_to_be_accessed", 0xa0, 0x20);
const ALLOW_ACCESS_KEY: PrmField = prm("allow_other_vhca_access_in", "access_key_raw", 0x100, 0x100);
const ALLOW_OUT_STATUS: PrmField = prm("allow_other_vhca_access_out", "status", 0x0, 0x8);
const ALLOW_OUT_SYNDROME: PrmField = prm("allow_other_vhca_access_out", "syndrome", 0x20, 0x20);

// CREATE_GENERAL_OBJECT of an mkey alias: header (16 bytes) + alias context (64 bytes) in,
// 16 bytes out.
const ALIAS_IN_BYTES: usize = 80;
const ALIAS_OPCODE: PrmField = prm("create_alias_obj_in", "hdr.opcode", 0x0, 0x10);
const ALIAS_OBJ_TYPE: PrmField = prm("create_alias_obj_in", "hdr.obj_type", 0x30, 0x10);
const ALIAS_FLAG: PrmField = prm("create_alias_obj_in", "hdr.op_param.create.alias_object", 0x60, 0x1);
const ALIAS_VHCA: PrmField = prm("create_alias_obj_in", "alias_ctx.vhca_id_to_be_accessed", 0x80, 0x10);
const ALIAS_OBJ_ID: PrmField = prm("create_alias_obj_in", "alias_ctx.object_id_to_be_accessed", 0xa0, 0x20);
const ALIAS_ACCESS_KEY: PrmField = prm("create_alias_obj_in", "alias_ctx.access_key_raw", 0x100, 0x100);
const OBJ_OUT_STATUS: PrmField = prm("general_obj_out_cmd_hdr", "status", 0x0, 0x8);
const OBJ_OUT_SYNDROME: PrmField = prm("general_obj_out_cmd_hdr", "syndrome", 0x20, 0x20);
const OBJ_OUT_ID: PrmField = prm("general_obj_out_cmd_hdr", "obj_id", 0x40, 0x20);

// CREATE_MKEY of a KSM key: the command (272 bytes) then one 16-byte KSM entry per
// translation (`struct mlx5_ksm {reserved, key, va}`), 16 bytes out.
const CREATE_MKEY_IN_BYTES: usize = 0x880 / 8;
const KSM_ENTRY_BYTES: usize = 16;
const CM_OPCODE: PrmField = prm("create_mkey_in", "opcode", 0x0, 0x10);
const CM_ACCESS_A: PrmField = prm("create_mkey_in", "memory_key_mkey_entry.a", 0x91, 0x1);
const CM_ACCESS_RW: PrmField = prm("create_mkey_in", "memory_key_mkey_entry.rw", 0x92, 0x1);
const CM_ACCESS_RR: PrmField = prm("create_mkey_in", "memory_key_mkey_entry.rr", 0x93, 0x1);
const CM_ACCESS_LW: PrmField = prm("create_mkey_in", "memory_key_mkey_entry.lw", 0x94, 0x1);
const CM_ACCESS_LR: PrmField = prm("create_mkey_in", "memory_key_mkey_entry.lr", 0x95, 0x1);
const CM_ACCESS_MODE_1_0: PrmField =
    prm("create_mkey_in", "memory_key_mkey_entry.access_mode_1_0", 0x96, 0x2);
const CM_QPN: PrmField = prm("create_mkey_in", "memory_key_mkey_entry.qpn", 0xa0, 0x18);
const CM_MKEY_7_0: PrmField = prm("create_mkey_in", "memory_key_mkey_entry.mkey_7_0", 0xb8, 0x8);
const CM_PD: PrmField = prm("create_mkey_in", "memory_key_mkey_entry.pd", 0xe8, 0x18);
const CM_START_ADDR: PrmField = prm("create_mkey_in", "memory_key_mkey_entry.start_addr", 0x100, 0x40);
const CM_LEN: PrmField = prm("create_mkey_in", "memory_key_mkey_entry.len", 0x140, 0x40);
const CM_TRANSLATIONS: PrmField =
    prm("create_mkey_in", "memory_key_mkey_entry.translations_octword_size", 0x220, 0x20);
const CM_LOG_ENTITY: PrmField = prm("create_mkey_in", "memory_key_mkey_entry.log_page_size", 0x25a, 0x6);
const CM_TRANSLATIONS_ACTUAL: PrmField =
    prm("create_mkey_in", "translations_octword_actual_size", 0x300, 0x20);
const CM_KSM_LIST: PrmField = prm("create_mkey_in", "klm_pas_mtt", 0x880, 0);
const CM_OUT_STATUS: PrmField = prm("create_mkey_out", "status", 0x0, 0x8);
const CM_OUT_SYNDROME: PrmField = prm("create_mkey_out", "syndrome", 0x20, 0x20);
const CM_OUT_INDEX: PrmField = prm("create_mkey_out", "mkey_index", 0x48, 0x18);

/// Every field above with the command buffer size it lives in, for the layout test.
#[cfg(test)]
const PRM_FIELDS: &[(PrmField, usize)] = &[
    (HCA_CAP_OPCODE, HCA_CAP_IN_BYTES),
    (HCA_CAP_OP_MOD, HCA_CAP_IN_BYTES),
    (HCA_CAP_STATUS, HCA_CAP_OUT_BYTES),
    (HCA_CAP_SYNDROME, HCA_CAP_OUT_BYTES),
    (HCA_CAP_VHCA_ID, HCA_CAP_OUT_BYTES),
    (ALLOW_OPCODE, ALLOW_IN_BYTES),
    (ALLOW_OBJ_TYPE, ALLOW_IN_BYTES),
    (ALLOW_OBJ_ID, ALLOW_IN_BYTES),
    (ALLOW_ACCESS_KEY, ALLOW_IN_BYTES),
    (ALLOW_OUT_STATUS, 16),
    (ALLOW_OUT_SYNDROME, 16),
    (ALIAS_OPCODE, ALIAS_IN_BYTES),
    (ALIAS_OBJ_TYPE, ALIAS_IN_BYTES),
    (ALIAS_FLAG, ALIAS_IN_BYTES),
    (ALIAS_VHCA, ALIAS_IN_BYTES),
    (ALIAS_OBJ_ID, ALIAS_IN_BYTES),
    (ALIAS_ACCESS_KEY, ALIAS_IN_BYTES),
    (OBJ_OUT_STATUS, 16),
    (OBJ_OUT_SYNDROME, 16),
    (OBJ_OUT_ID, 16),
    (CM_OPCODE, CREATE_MKEY_IN_BYTES),
    (CM_ACCESS_A, CREATE_MKEY_IN_BYTES),
    (CM_ACCESS_RW, CREATE_MKEY_IN_BYTES),
    (CM_ACCESS_RR, CREATE_MKEY_IN_BYTES),
    (CM_ACCESS_LW, CREATE_MKEY_IN_BYTES),
    (CM_ACCESS_LR, CREATE_MKEY_IN_BYTES),
    (CM_ACCESS_MODE_1_0, CREATE_MKEY_IN_BYTES),
    (CM_QPN, CREATE_MKEY_IN_BYTES),
    (CM_MKEY_7_0, CREATE_MKEY_IN_BYTES),
    (CM_PD, CREATE_MKEY_IN_BYTES),
    (CM_START_ADDR, CREATE_MKEY_IN_BYTES),
    (CM_LEN, CREATE_MKEY_IN_BYTES),
    (CM_TRANSLATIONS, CREATE_MKEY_IN_BYTES),
    (CM_LOG_ENTITY, CREATE_MKEY_IN_BYTES),
    (CM_TRANSLATIONS_ACTUAL, CREATE_MKEY_IN_BYTES),
    (CM_KSM_LIST, CREATE_MKEY_IN_BYTES),
    (CM_OUT_STATUS, 16),
    (CM_OUT_SYNDROME, 16),
    (CM_OUT_INDEX, 16),
];

/// Writes `v` into `f` of `b`, big-endian, bit 0 being the most significant bit of byte 0
/// (the PRM's numbering). Fields are at most 64 bits wide.
fn put(b: &mut [u8], f: PrmField, v: u64) {
    debug_assert!(
        f.width <= 64 && (f.width == 64 || v >> f.width == 0),
        "{}.{} ({} bits) cannot hold {v:#x}",
        f.layout,
        f.path,
        f.width
    );
    for i in 0..f.width {
        let bit = f.bit + i;
        let set = (v >> (f.width - 1 - i)) & 1 == 1;
        let mask = 0x80u8 >> (bit % 8);
        if set {
            b[bit / 8] |= mask;
        } else {
            b[bit / 8] &= !mask;
        }
    }
}

/// Reads field `f` of `b` (see [`put`]).
fn get(b: &[u8], f: PrmField) -> u64 {
    (0..f.width).fold(0u64, |v, i| {
        let bit = f.bit + i;
        (v << 1) | u64::from((b[bit / 8] >> (7 - bit % 8)) & 1)
    })
}

/// Copies `bytes` into a byte-aligned field exactly its size (the 32-byte access keys).
fn put_bytes(b: &mut [u8], f: PrmField, bytes: &[u8]) {
    assert!(
        f.bit.is_multiple_of(8) && f.width == bytes.len() * 8,
        "{f:?} is not {} whole bytes",
        bytes.len()
    );
    b[f.bit / 8..f.bit / 8 + bytes.len()].copy_from_slice(bytes);
}

/// Opens `dev` with DEVX (`mlx5dv_open_device` with `MLX5DV_CONTEXT_FLAGS_DEVX`) if it is
/// an mlx5 device that allows it.
pub(crate) fn open_devx(dev: *mut sys::ibv_device) -> Option<NonNull<sys::ibv_context>> {
    // SAFETY: a device pointer from the live device list.
    if !unsafe { dv::mlx5dv_is_supported(dev) } {
        return None;
    }
    let mut attr = dv::mlx5dv_context_attr { flags: dv::MLX5DV_CONTEXT_FLAGS_DEVX, comp_mask: 0 };
    // SAFETY: `dev` is a device pointer from the live device list; `attr` is initialised and
    // only read during the call.
    NonNull::new(unsafe { dv::mlx5dv_open_device(dev, &mut attr) })
}

/// Checks a command's output: its `status` and `syndrome` fields.
fn cmd_status(what: &'static str, rc: i32, out: &[u8], status: PrmField, syndrome: PrmField) -> Result<()> {
    let code = get(out, status);
    if rc != 0 || code != 0 {
        return Err(Error::Unsupported(format!(
            "{what}: DEVX command failed (rc {rc}, status {code:#x}, syndrome {:#x})",
            get(out, syndrome)
        )));
    }
    Ok(())
}

/// `mlx5dv_devx_general_cmd`; `status` and `syndrome` are the output layout's fields.
fn general_cmd(
    dev: &Device,
    what: &'static str,
    input: &[u8],
    out: &mut [u8],
    (status, syndrome): (PrmField, PrmField),
) -> Result<()> {
    // SAFETY: an open context; `input` and `out` are valid for their lengths during the call.
    let rc = unsafe {
        dv::mlx5dv_devx_general_cmd(
            dev.ctx.as_ptr(),
            input.as_ptr().cast(),
            input.len(),
            out.as_mut_ptr().cast(),
            out.len(),
        )
    };
    cmd_status(what, rc, out, status, syndrome)
}

impl super::Context {
    /// The function's vHCA id: `QUERY_HCA_CAP` (general capabilities, current values),
    /// field `vhca_id` at bit 0x30 of `cmd_hca_cap`.
    pub(crate) fn vhca_id(&self) -> Result<u32> {
        supported(&self.dev)?;
        let mut input = [0u8; HCA_CAP_IN_BYTES];
        put(&mut input, HCA_CAP_OPCODE, OP_QUERY_HCA_CAP.into());
        put(&mut input, HCA_CAP_OP_MOD, OP_MOD_GENERAL_CURRENT.into());
        let mut out = vec![0u8; HCA_CAP_OUT_BYTES];
        general_cmd(&self.dev, "QUERY_HCA_CAP", &input, &mut out, (HCA_CAP_STATUS, HCA_CAP_SYNDROME))?;
        Ok(get(&out, HCA_CAP_VHCA_ID) as u32)
    }
}

impl Mkey {
    /// `ALLOW_OTHER_VHCA_ACCESS` for this mkey with `access_key`.
    pub fn allow_other_vhca_access(&self, access_key: &[u8; 32]) -> Result<()> {
        let mut input = [0u8; ALLOW_IN_BYTES];
        put(&mut input, ALLOW_OPCODE, OP_ALLOW_OTHER_VHCA_ACCESS.into());
        put(&mut input, ALLOW_OBJ_TYPE, OBJ_TYPE_MKEY.into());
        // The mkey index: the key without its 8-bit variant.
        put(&mut input, ALLOW_OBJ_ID, (self.lkey() >> 8).into());
        put_bytes(&mut input, ALLOW_ACCESS_KEY, access_key);
        let mut out = [0u8; 16];
        general_cmd(
            &self._pd.dev,
            "ALLOW_OTHER_VHCA_ACCESS",
            &input,
            &mut out,
            (ALLOW_OUT_STATUS, ALLOW_OUT_SYNDROME),
        )
    }
}

/// A DEVX object (`mlx5dv_devx_obj_create`) that is a memory key: its key number, and a
/// destruction that reports failure instead of hiding it (a key the firmware still has may
/// still reach memory, so the region owning it leaks what it maps; see `MrInner::leak_memory`).
pub(crate) struct DevxKey {
    obj: NonNull<dv::mlx5dv_devx_obj>,
    key: u32,
    /// What it is, for the log.
    what: &'static str,
    /// Set once `mlx5dv_devx_obj_destroy` succeeded.
    destroyed: AtomicBool,
    _pd: Arc<PdShared>,
}

// SAFETY: an immutable handle; destruction is guarded by `destroyed` and done from the
// owning region's Drop (one thread).
unsafe impl Send for DevxKey {}
// SAFETY: shared references only read `key`; destruction is guarded as above.
unsafe impl Sync for DevxKey {}

impl DevxKey {
    /// Creates the object from `input` (a PRM command); `out`'s status and syndrome fields
    /// explain a refusal; `key` derives the key number from the output.
    fn create(
        pd: &Arc<PdShared>,
        what: &'static str,
        input: &[u8],
        (status, syndrome): (PrmField, PrmField),
        key: impl FnOnce(&[u8]) -> u32,
    ) -> Result<DevxKey> {
        let mut out = [0u8; 16];
        // SAFETY: an open (DEVX) context; `input` and `out` are valid for their lengths.
        let obj = unsafe {
            dv::mlx5dv_devx_obj_create(
                pd.dev.ctx.as_ptr(),
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        let obj = super::conv::nonnull_os(obj).map_err(|os| {
            Error::Unsupported(format!(
                "{what}: DEVX command failed ({os}, status {:#x}, syndrome {:#x})",
                get(&out, status),
                get(&out, syndrome)
            ))
        })?;
        Ok(DevxKey { obj, key: key(&out), what, destroyed: AtomicBool::new(false), _pd: pd.clone() })
    }

    /// The key (lkey and rkey).
    pub fn key(&self) -> u32 {
        self.key
    }

    /// Destroys the object; false if the firmware refused (the key may still reach memory,
    /// so the caller leaks what it holds).
    pub fn destroy(&self) -> bool {
        if self.destroyed.load(Ordering::Acquire) {
            return true;
        }
        // SAFETY: created by mlx5dv_devx_obj_create; `destroyed` makes a second call a no-op,
        // and only the owning region's Drop (one thread) calls this.
        let ok = unsafe { dv::mlx5dv_devx_obj_destroy(self.obj.as_ptr()) } == 0;
        self.destroyed.store(ok, Ordering::Release);
        ok
    }
}

impl Drop for DevxKey {
    fn drop(&mut self) {
        if !self.destroy() {
            tracing::error!(key = self.key, what = self.what, "mlx5dv_devx_obj_destroy failed");
        }
    }
}

/// An mkey alias object (`CREATE_GENERAL_OBJECT` of type MKEY with `alias_object` set). Its
/// key is the object id (the new mkey's index) over an 8-bit variant of 0, as UCX derives it.
pub(crate) type Alias = DevxKey;

/// A KSM mkey made by DEVX `CREATE_MKEY`: `len` bytes from a chosen start address, in equal
/// power-of-two entities, each mapped onto (key, address) of another key of the PD. This is
/// how a MEMIC region gets its unique host-like address: the start is a reserved
/// `PROT_NONE` range and the one entity is the device memory's zero-based registration. Its
/// key is the firmware's index over the 8-bit variant rdmakit chose.
pub(crate) type KsmKey = DevxKey;

/// The CREATE_MKEY command of a KSM key (see [`KsmKey`]); `entries` are (lkey, address)
/// pairs, each covering `1 << log_entity` bytes.
fn create_ksm_cmd(
    pdn: u32,
    start: u64,
    log_entity: u8,
    entries: &[(u32, u64)],
    access: AccessFlags,
    variant: u8,
) -> Result<Vec<u8>> {
    let n =
        u32::try_from(entries.len()).map_err(|_| Error::InvalidArgument("too many KSM entries".into()))?;
    let len = (entries.len() as u64)
        .checked_shl(u32::from(log_entity))
        .filter(|l| l >> log_entity == entries.len() as u64)
        .ok_or_else(|| Error::InvalidArgument("KSM key length overflows".into()))?;
    let mut input = vec![0u8; CREATE_MKEY_IN_BYTES + entries.len() * KSM_ENTRY_BYTES];
    put(&mut input, CM_OPCODE, OP_CREATE_MKEY.into());
    put(&mut input, CM_ACCESS_MODE_1_0, ACCESS_MODE_KSM);
    put(&mut input, CM_ACCESS_LR, 1);
    put(&mut input, CM_ACCESS_LW, u64::from(access.contains(AccessFlags::LOCAL_WRITE)));
    put(&mut input, CM_ACCESS_RR, u64::from(access.contains(AccessFlags::REMOTE_READ)));
    put(&mut input, CM_ACCESS_RW, u64::from(access.contains(AccessFlags::REMOTE_WRITE)));
    put(&mut input, CM_ACCESS_A, u64::from(access.contains(AccessFlags::REMOTE_ATOMIC)));
    // Not bound to a QP.
    put(&mut input, CM_QPN, 0xff_ffff);
    put(&mut input, CM_MKEY_7_0, variant.into());
    put(&mut input, CM_PD, pdn.into());
    put(&mut input, CM_START_ADDR, start);
    put(&mut input, CM_LEN, len);
    // A KSM entry is one octword (16 bytes).
    put(&mut input, CM_TRANSLATIONS, n.into());
    put(&mut input, CM_TRANSLATIONS_ACTUAL, n.into());
    put(&mut input, CM_LOG_ENTITY, log_entity.into());
    for (i, &(lkey, addr)) in entries.iter().enumerate() {
        let at = CM_KSM_LIST.bit / 8 + i * KSM_ENTRY_BYTES;
        // struct mlx5_ksm: reserved (4 bytes), key (big-endian), va (big-endian).
        input[at + 4..at + 8].copy_from_slice(&lkey.to_be_bytes());
        input[at + 8..at + 16].copy_from_slice(&addr.to_be_bytes());
    }
    Ok(input)
}

impl super::Pd {
    /// The PD's number in the firmware (`mlx5dv_init_obj` with `MLX5DV_OBJ_PD`).
    fn pdn(&self) -> Result<u32> {
        // SAFETY: all-zero is a valid mlx5dv_obj / mlx5dv_pd (null pointers, zero numbers).
        let mut out: dv::mlx5dv_pd = unsafe { std::mem::zeroed() };
        // SAFETY: mlx5dv_obj is plain C data (structs of pointers): all-zero (null) is valid.
        let mut obj: dv::mlx5dv_obj = unsafe { std::mem::zeroed() };
        obj.pd.in_ = self.inner.pd.as_ptr();
        obj.pd.out = &mut out;
        // SAFETY: a live PD of an mlx5 context; `out` is written during the call only.
        let rc = unsafe { dv::mlx5dv_init_obj(&mut obj, u64::from(dv::MLX5DV_OBJ_PD)) };
        super::conv::errno_ret("mlx5dv_init_obj(PD)", rc)?;
        Ok(out.pdn)
    }

    /// A KSM mkey through DEVX `CREATE_MKEY` (see [`KsmKey`]).
    pub(crate) fn create_ksm_key(
        &self,
        start: u64,
        log_entity: u8,
        entries: &[(u32, u64)],
        access: AccessFlags,
    ) -> Result<KsmKey> {
        let dev = &self.inner.dev;
        supported(dev)?;
        // A variant byte of our own (the key's low 8 bits), different for each key this process
        // makes, so a key number the firmware hands out again reads differently.
        static NEXT_VARIANT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(1);
        let variant = NEXT_VARIANT.fetch_add(1, Ordering::Relaxed);
        let input = create_ksm_cmd(self.pdn()?, start, log_entity, entries, access, variant)?;
        DevxKey::create(
            &self.inner,
            "KSM mkey (CREATE_MKEY)",
            &input,
            (CM_OUT_STATUS, CM_OUT_SYNDROME),
            |out| ((get(out, CM_OUT_INDEX) as u32) << 8) | u32::from(variant),
        )
    }

    /// An alias in this PD's function of `mkey` of vHCA `vhca_id`, presenting `access_key`.
    pub(crate) fn create_alias(&self, vhca_id: u32, mkey: u32, access_key: &[u8; 32]) -> Result<Alias> {
        let dev = &self.inner.dev;
        supported(dev)?;
        let vhca =
            u16::try_from(vhca_id).map_err(|_| Error::InvalidArgument("vHCA ids are 16-bit".into()))?;
        let mut input = [0u8; ALIAS_IN_BYTES];
        put(&mut input, ALIAS_OPCODE, OP_CREATE_GENERAL_OBJECT.into());
        put(&mut input, ALIAS_OBJ_TYPE, OBJ_TYPE_MKEY.into());
        put(&mut input, ALIAS_FLAG, 1);
        put(&mut input, ALIAS_VHCA, vhca.into());
        put(&mut input, ALIAS_OBJ_ID, (mkey >> 8).into());
        put_bytes(&mut input, ALIAS_ACCESS_KEY, access_key);
        DevxKey::create(
            &self.inner,
            "mkey alias (CREATE_GENERAL_OBJECT)",
            &input,
            (OBJ_OUT_STATUS, OBJ_OUT_SYNDROME),
            |out| (get(out, OBJ_OUT_ID) as u32) << 8,
        )
    }
}

#[cfg(test)]
mod tests;
