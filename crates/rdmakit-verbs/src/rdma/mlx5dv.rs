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
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdmakit_sys as sys;
use rdmakit_sys::mlx5dv as dv;

use super::conv::nonnull;
use super::{Cq, Device, PdShared, Qp};
use crate::error::{Error, Result, WcStatus};
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
}

// SAFETY: posting is serialised by the safe layer's `UmrQueue` (one `&self` call at a time
// through a mutex); the QP and CQ are thread-safe verbs objects.
unsafe impl Send for UmrQp {}
// SAFETY: as above.
unsafe impl Sync for UmrQp {}

impl UmrQp {
    fn create(ctx: &super::Context, pd: &Arc<PdShared>, max_entries: u16) -> Result<UmrQp> {
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
        let me = qp.endpoint(&opts, 0)?;
        qp.modify_to_init(&opts)?;
        qp.modify_to_rtr(&me, &opts)?;
        qp.modify_to_rts(&opts, 0)?;
        let max_entries = (qp.caps.max_inline_data / KLM_ENTRY_BYTES) as usize;
        Ok(UmrQp { _qp: qp, max_entries, qpx, mqpx, cq })
    }

    /// Binds `mkey` to the (address, length, lkey) entries, zero-based, and waits.
    pub fn bind(&self, mkey: &Mkey, access: AccessFlags, entries: &[(u64, u32, u32)]) -> Result<()> {
        if entries.len() > self.max_entries {
            return Err(Error::Unsupported(format!(
                "a UMR carries at most {} entries inline on this QP ({} asked)",
                self.max_entries,
                entries.len()
            )));
        }
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

    /// A UMR queue on this PD, on `ctx`'s device, for keys of up to `max_entries` entries.
    pub(crate) fn create_umr_qp(&self, ctx: &super::Context, max_entries: u16) -> Result<UmrQp> {
        UmrQp::create(ctx, &self.inner, max_entries)
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

/// Opens `dev` with DEVX (`mlx5dv_open_device` with `MLX5DV_CONTEXT_FLAGS_DEVX`) if it is
/// an mlx5 device that allows it.
pub(crate) fn open_devx(dev: *mut sys::ibv_device) -> Option<NonNull<sys::ibv_context>> {
    // SAFETY: a device pointer from the live device list.
    if !unsafe { dv::mlx5dv_is_supported(dev) } {
        return None;
    }
    let mut attr = dv::mlx5dv_context_attr { flags: dv::MLX5DV_CONTEXT_FLAGS_DEVX, comp_mask: 0 };
    // SAFETY: as above; `attr` is initialised and only read.
    NonNull::new(unsafe { dv::mlx5dv_open_device(dev, &mut attr) })
}

fn put_be16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

fn put_be32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Checks a command's output header: `status` (byte 0) and `syndrome` (bytes 4..8).
fn cmd_status(what: &'static str, rc: i32, out: &[u8]) -> Result<()> {
    if rc != 0 || out[0] != 0 {
        return Err(Error::Unsupported(format!(
            "{what}: DEVX command failed (rc {rc}, status {:#x}, syndrome {:#x})",
            out[0],
            be32(out, 4)
        )));
    }
    Ok(())
}

fn general_cmd(dev: &Device, what: &'static str, input: &[u8], out: &mut [u8]) -> Result<()> {
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
    cmd_status(what, rc, out)
}

impl super::Context {
    /// The function's vHCA id: `QUERY_HCA_CAP` (general capabilities, current values),
    /// field `vhca_id` at bit 0x30 of `cmd_hca_cap`.
    pub(crate) fn vhca_id(&self) -> Result<u32> {
        supported(&self.dev)?;
        let mut input = [0u8; 16];
        put_be16(&mut input, 0, OP_QUERY_HCA_CAP);
        // op_mod: capability type GENERAL (0) << 1 | current values (1).
        put_be16(&mut input, 6, 1);
        // Output header (16 bytes), then the capability union (0x8000 bits).
        let mut out = vec![0u8; 16 + 4096];
        general_cmd(&self.dev, "QUERY_HCA_CAP", &input, &mut out)?;
        Ok(u32::from(u16::from_be_bytes([out[16 + 6], out[16 + 7]])))
    }
}

impl Mkey {
    /// `ALLOW_OTHER_VHCA_ACCESS` for this mkey with `access_key`.
    pub fn allow_other_vhca_access(&self, access_key: &[u8; 32]) -> Result<()> {
        let mut input = [0u8; 64];
        put_be16(&mut input, 0, OP_ALLOW_OTHER_VHCA_ACCESS);
        // object_type_to_be_accessed at bit 0x90, object_id_to_be_accessed at 0xa0 (the
        // mkey index: the key without its 8-bit variant), access_key at 0x100.
        put_be16(&mut input, 18, OBJ_TYPE_MKEY);
        put_be32(&mut input, 20, self.lkey() >> 8);
        input[32..64].copy_from_slice(access_key);
        let mut out = [0u8; 16];
        general_cmd(&self._pd.dev, "ALLOW_OTHER_VHCA_ACCESS", &input, &mut out)
    }
}

/// An mkey alias object (`CREATE_GENERAL_OBJECT` of type MKEY with `alias_object` set).
pub(crate) struct Alias {
    obj: NonNull<dv::mlx5dv_devx_obj>,
    key: u32,
    /// Set once `mlx5dv_devx_obj_destroy` succeeded.
    destroyed: AtomicBool,
    _pd: Arc<PdShared>,
}

// SAFETY: an immutable handle; destroyed once, from Drop.
unsafe impl Send for Alias {}
// SAFETY: as above.
unsafe impl Sync for Alias {}

impl Alias {
    /// The alias's key. The object id is the new mkey's index; the key is the index shifted
    /// over an 8-bit variant of 0, as UCX derives it.
    pub fn key(&self) -> u32 {
        self.key
    }
}

impl Alias {
    /// Destroys the alias object; false if the firmware refused (the alias may still
    /// reach the host's memory, so the caller leaks what it holds).
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

impl Drop for Alias {
    fn drop(&mut self) {
        if !self.destroy() {
            tracing::error!(key = self.key, "mlx5dv_devx_obj_destroy (mkey alias) failed");
        }
    }
}

impl super::Pd {
    /// An alias in this PD's function of `mkey` of vHCA `vhca_id`, presenting `access_key`.
    pub(crate) fn create_alias(&self, vhca_id: u32, mkey: u32, access_key: &[u8; 32]) -> Result<Alias> {
        let dev = &self.inner.dev;
        supported(dev)?;
        let vhca =
            u16::try_from(vhca_id).map_err(|_| Error::InvalidArgument("vHCA ids are 16-bit".into()))?;
        // general_obj_in_cmd_hdr (16 bytes) then alias_context (64 bytes).
        let mut input = [0u8; 80];
        put_be16(&mut input, 0, OP_CREATE_GENERAL_OBJECT);
        put_be16(&mut input, 6, OBJ_TYPE_MKEY);
        input[12] = 0x80; // alias_object, bit 0x60
        put_be16(&mut input, 16, vhca); // vhca_id_to_be_accessed
        put_be32(&mut input, 20, mkey >> 8); // object_id_to_be_accessed
        input[32..64].copy_from_slice(access_key); // access_key at bit 0x80 of the context
        let mut out = [0u8; 16];
        // SAFETY: an open context; `input` and `out` are valid for their lengths.
        let obj = unsafe {
            dv::mlx5dv_devx_obj_create(
                dev.ctx.as_ptr(),
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        let Some(obj) = NonNull::new(obj) else {
            return Err(Error::Unsupported(format!(
                "mkey alias: DEVX CREATE_GENERAL_OBJECT failed ({}, status {:#x}, syndrome {:#x})",
                std::io::Error::last_os_error(),
                out[0],
                be32(&out, 4)
            )));
        };
        let obj_id = be32(&out, 8);
        Ok(Alias { obj, key: obj_id << 8, destroyed: AtomicBool::new(false), _pd: self.inner.clone() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prm_fields_land_at_their_bit_offsets() {
        let mut b = [0u8; 64];
        put_be16(&mut b, 18, OBJ_TYPE_MKEY);
        put_be32(&mut b, 20, 0x0012_3456);
        // object_type_to_be_accessed at bit 0x90 = byte 18, big-endian.
        assert_eq!(&b[18..24], &[0xff, 0x01, 0x00, 0x12, 0x34, 0x56]);
        assert_eq!(be32(&b, 20), 0x0012_3456);
        let out = [0u8, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0];
        assert!(cmd_status("x", 0, &out).is_ok());
        let bad = [3u8, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0];
        assert!(matches!(cmd_status("x", 0, &bad), Err(Error::Unsupported(m)) if m.contains("syndrome 0x7")));
    }
}
