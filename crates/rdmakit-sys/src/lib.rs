//! Raw FFI bindings for rdmakit: the one place where the project talks to C.
//!
//! Everything here is `unsafe`, unvalidated and mirrors the C API 1:1; the safe wrappers live
//! in `rdmakit-verbs`.
//!
//! # Where the items come from
//!
//! The build script generates every binding with bindgen 0.72 from the rdma-core headers
//! installed on the build machine (it replaced the `rdma-sys` crate, which cannot build with
//! libclang 16 or newer):
//!
//! * **libibverbs / librdmacm**, at the crate root: every exported `ibv_*`/`rdma_*` function,
//!   every `ibv_*`/`rdma_*` type and constant (macros included), and the headers' `static
//!   inline` functions (`ibv_post_send`, `ibv_poll_cq`, `ibv_req_notify_cq`,
//!   `___ibv_query_port`, `ibv_alloc_dm`, `ibv_query_gid_ex`, ...). A static inline function
//!   has no symbol, so each one reaches its C body through a small exported C wrapper
//!   (`<name>__extern`) that the build script compiles: the behaviour is exactly the C one.
//!   Enumerations of values are modules of constants (`ibv_qp_state::IBV_QPS_RTS`), so a value
//!   a newer library returns is never undefined behaviour; enumerations of flags are newtypes
//!   (`ibv_access_flags(pub c_uint)`).
//! * **mlx5 direct verbs** (`<infiniband/mlx5dv.h>`, libmlx5): the `mlx5dv` module (present when the bindings are). Its functions take
//!   the root's types (`*mut rdmakit_sys::ibv_context`, ...), so the project has exactly one
//!   `ibv_context`, `ibv_qp`, ... type.
//!
//! # When rdma-core is missing
//!
//! Without the rdma-core development files or libclang the crate builds empty (the build
//! prints a warning naming the packages to install, unless `RDMAKIT_SYS_VERBS=off`), and
//! [`AVAILABLE`] is `false` with the reason in [`MISSING`]. `RDMAKIT_SYS_VERBS=require` makes
//! the build fail instead. Dependents learn the outcome from the build-script metadata
//! `DEP_RDMAKIT_RDMA_CORE_VERBS` (`1` or `0`).
//!
//! # Linking
//!
//! The build script links the static-inline wrappers, then `libmlx5`, `librdmacm` and
//! `libibverbs` (the order GNU ld needs with `--as-needed`). Building needs the rdma-core
//! development files and libclang (Debian: `libibverbs-dev librdmacm-dev ibverbs-providers
//! pkg-config libclang-dev`).
//!
//! # Example
//!
//! Whether this build has rdma-core, and, when not, what to install:
//!
//! ```
//! if rdmakit_sys::AVAILABLE {
//!     println!("rdma-core bindings generated with {}", rdmakit_sys::LIBCLANG);
//! } else {
//!     assert!(!rdmakit_sys::MISSING.is_empty(), "a build without rdma-core says why");
//!     println!("built without rdma-core: {}", rdmakit_sys::MISSING);
//! }
//! ```

/// Whether this build has the rdma-core bindings (see "When rdma-core is missing").
pub const AVAILABLE: bool = cfg!(rdmakit_sys_bound);

/// Why the bindings are missing, for a person (empty when [`AVAILABLE`]).
pub const MISSING: &str = env!("RDMAKIT_SYS_MISSING");

/// The libclang that generated the bindings: its version string and the file it was loaded
/// from (empty when not [`AVAILABLE`]).
pub const LIBCLANG: &str = env!("RDMAKIT_SYS_LIBCLANG");

#[cfg(rdmakit_sys_bound)]
pub use verbs::*;

/// libibverbs and librdmacm (bindgen output; re-exported at the crate root).
// Generated code: bindgen's C-style names, undocumented items, and unsafe blocks (zeroing
// `Default` impls, bitfield accessors) without SAFETY comments.
#[cfg(rdmakit_sys_bound)]
#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    missing_docs,
    unsafe_op_in_unsafe_fn,
    rustdoc::all,
    clippy::all,
    clippy::undocumented_unsafe_blocks
)]
mod verbs {
    include!(concat!(env!("OUT_DIR"), "/verbs.rs"));
}

/// mlx5 direct verbs: `<infiniband/mlx5dv.h>` and `<infiniband/tm_types.h>`,
/// implemented by `libmlx5` (bindgen output).
///
/// * Functions: every `mlx5dv_*` export (`mlx5dv_is_supported`,
///   `mlx5dv_open_device`, `mlx5dv_create_qp`, `mlx5dv_create_mkey`,
///   `mlx5dv_devx_obj_create`, `mlx5dv_devx_umem_reg`, ...) plus the
///   header's static-inline helpers (`mlx5dv_wr_mr_list`,
///   `mlx5dv_wr_mkey_configure`, `mlx5dv_set_ctrl_seg`,
///   `mlx5dv_set_data_seg`, `mlx5dv_get_cqe_opcode`, ...), reached through
///   exported C wrappers under the same Rust names.
/// * Types: `mlx5dv_*` structs, the `mlx5_wqe_*` / `mlx5_cqe64` hardware
///   layouts, `mlx5_ib_uapi_*`, and `ibv_tmh`/`ibv_rvh`. libibverbs types in
///   signatures and fields are the crate root's (`rdmakit_sys::ibv_context`, ...).
/// * Constants: `MLX5DV_*` / `MLX5_*`. Values of named enums are `u32`
///   constants whose type is the enum's alias (e.g.
///   `MLX5DV_CONTEXT_MASK_DEVX: mlx5dv_context_comp_mask`); values of
///   anonymous enums have an unstable `_bindgen_ty_N` integer alias type.
// Generated code: bindgen's C-style names, undocumented items, and
// unsafe blocks (zeroing `Default` impls, bitfield accessors) without
// SAFETY comments.
#[cfg(rdmakit_sys_bound)]
#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    missing_docs,
    unsafe_op_in_unsafe_fn,
    rustdoc::all,
    clippy::all,
    clippy::undocumented_unsafe_blocks
)]
pub mod mlx5dv {
    include!(concat!(env!("OUT_DIR"), "/mlx5dv.rs"));

    /// Control segment that starts every mlx5 send WQE (`struct
    /// mlx5_wqe_ctrl_seg`, 16 bytes, 4-byte aligned).
    ///
    /// Written by hand: the C struct is `__packed__` *and* `__aligned__(4)`,
    /// which no single Rust struct expresses, and bindgen's `packed(4)`
    /// rendering is 20 bytes. The unaligned big-endian 16-bit field at
    /// offset 9 is therefore kept as raw bytes; every other field has the
    /// C type and offset. Fill it with [`mlx5dv_set_ctrl_seg`].
    #[repr(C, align(4))]
    #[derive(Debug, Default, Copy, Clone, PartialEq, Eq)]
    pub struct mlx5_wqe_ctrl_seg {
        /// `opmod << 24 | wqe_index << 8 | opcode`, big endian.
        pub opmod_idx_opcode: __be32,
        /// `qp_num << 8 | ds` (size in 16-byte units), big endian.
        pub qpn_ds: __be32,
        /// WQE signature.
        pub signature: u8,
        /// `__be16 dci_stream_channel_id` as its two big-endian bytes
        /// (`u16::from_be_bytes` / `to_be_bytes`).
        pub dci_stream_channel_id: [u8; 2],
        /// Fence mode, completion-event and solicited-event bits.
        pub fm_ce_se: u8,
        /// Immediate data / invalidation key, as given to
        /// `mlx5dv_set_ctrl_seg`.
        pub imm: __be32,
    }

    const _: () = {
        assert!(::core::mem::size_of::<mlx5_wqe_ctrl_seg>() == 16);
        assert!(::core::mem::align_of::<mlx5_wqe_ctrl_seg>() == 4);
        assert!(::core::mem::offset_of!(mlx5_wqe_ctrl_seg, qpn_ds) == 4);
        assert!(::core::mem::offset_of!(mlx5_wqe_ctrl_seg, signature) == 8);
        assert!(::core::mem::offset_of!(mlx5_wqe_ctrl_seg, dci_stream_channel_id) == 9);
        assert!(::core::mem::offset_of!(mlx5_wqe_ctrl_seg, fm_ce_se) == 11);
        assert!(::core::mem::offset_of!(mlx5_wqe_ctrl_seg, imm) == 12);
    };
}

#[cfg(all(test, rdmakit_sys_bound))]
mod tests {
    use super::mlx5dv::*;
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Every symbol below must resolve at link time: the dynamic ones
    /// against libmlx5/libibverbs, the static-inline ones against the C
    /// wrapper archive. Taking the address (and black-boxing it) keeps the
    /// references alive through optimisation.
    #[test]
    fn links_mlx5dv_exports_and_static_inline_wrappers() {
        macro_rules! sym {
            ($f:ident) => {
                (stringify!($f), $f as *const ())
            };
        }
        let dynamic: [(&str, *const ()); 12] = [
            sym!(mlx5dv_is_supported),
            sym!(mlx5dv_open_device),
            sym!(mlx5dv_create_mkey),
            sym!(mlx5dv_destroy_mkey),
            sym!(mlx5dv_devx_obj_create),
            sym!(mlx5dv_devx_umem_reg),
            sym!(mlx5dv_qp_ex_from_ibv_qp_ex),
            sym!(mlx5dv_create_qp),
            sym!(mlx5dv_query_device),
            sym!(mlx5dv_init_obj),
            sym!(ibv_qp_to_qp_ex),
            sym!(ibv_reg_dmabuf_mr),
        ];
        let wrapped: [(&str, *const ()); 10] = [
            sym!(mlx5dv_wr_mr_list),
            sym!(mlx5dv_wr_mkey_configure),
            sym!(mlx5dv_wr_set_mkey_access_flags),
            sym!(mlx5dv_wr_set_mkey_layout_list),
            sym!(mlx5dv_wr_set_dc_addr),
            sym!(mlx5dv_mkey_check),
            sym!(mlx5dv_query_port),
            sym!(ibv_query_gid_ex),
            sym!(ibv_query_gid_table),
            sym!(ibv_wr_atomic_write),
        ];
        for (name, addr) in std::hint::black_box(dynamic) {
            assert!(!addr.is_null(), "{name} resolved to NULL");
            // SAFETY: `info` is a plain C struct for dladdr to fill in; `addr`
            // is only inspected, never called.
            let info = unsafe {
                let mut info: libc::Dl_info = std::mem::zeroed();
                assert_ne!(libc::dladdr(addr.cast(), &mut info), 0, "dladdr({name}) failed");
                info
            };
            assert!(!info.dli_fname.is_null(), "{name}: no object file");
            // SAFETY: dladdr returned a NUL-terminated path owned by the loader.
            let file = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) }.to_string_lossy();
            let want = if name.starts_with("ibv_") { "libibverbs.so" } else { "libmlx5.so" };
            assert!(file.contains(want), "{name} resolved into {file}, expected {want}");
        }
        for (name, addr) in std::hint::black_box(wrapped) {
            assert!(!addr.is_null(), "{name} resolved to NULL");
        }
    }

    /// mlx5dv takes the crate root's libibverbs types: one `ibv_context` for the whole
    /// project (this is a compile-time check).
    #[test]
    fn mlx5dv_uses_the_root_verbs_types() {
        let _: unsafe extern "C" fn(*mut crate::ibv_device) -> bool = mlx5dv_is_supported;
        let _: unsafe extern "C" fn(
            *mut crate::ibv_context,
            *mut crate::ibv_qp_init_attr_ex,
            *mut mlx5dv_qp_init_attr,
        ) -> *mut crate::ibv_qp = mlx5dv_create_qp;
        let _: unsafe extern "C" fn(*mut crate::ibv_qp_ex) -> *mut mlx5dv_qp_ex = mlx5dv_qp_ex_from_ibv_qp_ex;
        let _: unsafe extern "C" fn(
            *mut crate::ibv_context,
            u32,
            u32,
            *mut crate::ibv_gid_entry,
            u32,
        ) -> i32 = ibv_query_gid_ex;
    }

    /// Calls static-inline wrappers that need no device and checks they run
    /// the header's code.
    #[test]
    fn static_inline_wrappers_compute_like_c() {
        // C: fl_low = fl & 0x3fff; fl_low ^= (fl & 0xfc000) >> 14; return fl_low | 0xc000.
        for fl in [0u32, 1, 0x3fff, 0x4000, 0xfffff, 0x12345] {
            let expect = (((fl & 0x3fff) ^ ((fl & 0xfc000) >> 14)) | 0xc000) as u16;
            // SAFETY: pure arithmetic function.
            assert_eq!(unsafe { ibv_flow_label_to_udp_sport(fl) }, expect);
        }

        let mut data = mlx5_wqe_data_seg::default();
        // SAFETY: `data` is a valid, writable mlx5_wqe_data_seg.
        unsafe { mlx5dv_set_data_seg(&mut data, 0x1234, 0xabcd, 0x1122_3344_5566_7788) };
        assert_eq!(u32::from_be(data.byte_count), 0x1234);
        assert_eq!(u32::from_be(data.lkey), 0xabcd);
        assert_eq!(u64::from_be(data.addr), 0x1122_3344_5566_7788);

        let mut ctrl = mlx5_wqe_ctrl_seg::default();
        // SAFETY: `ctrl` is a valid, writable, 16-byte control segment.
        unsafe { mlx5dv_set_ctrl_seg(&mut ctrl, 0x0102, 0x0a, 0x03, 0x00_4567, 0x08, 4, 0x5a, 0xdead_beef) };
        assert_eq!(u32::from_be(ctrl.opmod_idx_opcode), 0x03 << 24 | 0x0102 << 8 | 0x0a);
        assert_eq!(u32::from_be(ctrl.qpn_ds), 0x4567 << 8 | 4);
        assert_eq!(ctrl.signature, 0x5a);
        assert_eq!(ctrl.fm_ce_se, 0x08);
        assert_eq!(ctrl.imm, 0xdead_beef);

        // op_own 0xd3: opcode 0xd, format 0, solicited event 1, owner 1.
        let mut cqe = mlx5_cqe64 { op_own: 0xd3, ..Default::default() };
        // SAFETY: `cqe` is a valid mlx5_cqe64 for the accessors to read.
        let (opcode, format, se, owner) = unsafe {
            (
                mlx5dv_get_cqe_opcode(&mut cqe),
                mlx5dv_get_cqe_format(&mut cqe),
                mlx5dv_get_cqe_se(&mut cqe),
                mlx5dv_get_cqe_owner(&mut cqe),
            )
        };
        assert_eq!((opcode, format, se, owner), (0xd, 0, 1, 1));
        // SAFETY: `cqe` is a valid, writable mlx5_cqe64; the setter only writes its `op_own` byte.
        unsafe { mlx5dv_set_cqe_owner(&mut cqe, 0) };
        assert_eq!(cqe.op_own, 0xd2);
    }

    /// `ibv_get_device_list` really runs: either a (possibly empty) list, or
    /// NULL with the errno libibverbs uses for "no RDMA subsystem/devices"
    /// (ENOSYS on kernels without uverbs, ENODEV).
    #[test]
    fn ibv_get_device_list_returns_list_or_enosys() {
        let mut num: i32 = -1;
        // SAFETY: `num` is a valid out-pointer; the list is freed below.
        let list = unsafe { ibv_get_device_list(&mut num) };
        if list.is_null() {
            let err = std::io::Error::last_os_error();
            let errno = err.raw_os_error();
            assert!(
                errno == Some(libc::ENOSYS) || errno == Some(libc::ENODEV),
                "ibv_get_device_list returned NULL with unexpected error {err}"
            );
            return;
        }
        assert!(num >= 0, "non-NULL list but num_devices = {num}");
        for i in 0..num as usize {
            // SAFETY: the list holds `num` valid device pointers (NULL-terminated).
            let dev = unsafe { *list.add(i) };
            assert!(!dev.is_null());
            // SAFETY: `dev` is a live device from the list.
            let name = unsafe { ibv_get_device_name(dev) };
            assert!(!name.is_null());
            // SAFETY: `dev` is a live device from the list, which is freed only below; mlx5dv_is_supported only inspects it.
            let _ = unsafe { mlx5dv_is_supported(dev) };
        }
        // SAFETY: the list has `num + 1` entries and ends with NULL.
        assert!(unsafe { *list.add(num as usize) }.is_null());
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { ibv_free_device_list(list) };
    }

    unsafe extern "C" {
        static rdmakit_sys_c_layout: [usize; C_LAYOUT_NAMES.len()];
        static rdmakit_sys_c_layout_len: usize;
    }

    /// Order of `rdmakit_sys_c_layout` in src/layout.c.
    const C_LAYOUT_NAMES: [&str; 47] = [
        "sizeof ibv_gid",
        "sizeof ibv_sge",
        "sizeof ibv_wc",
        "ibv_wc.status",
        "ibv_wc.opcode",
        "ibv_wc.byte_len",
        "ibv_wc.imm_data",
        "ibv_wc.qp_num",
        "ibv_wc.src_qp",
        "ibv_wc.wc_flags",
        "ibv_wc.pkey_index",
        "ibv_wc.slid",
        "ibv_wc.sl",
        "ibv_wc.dlid_path_bits",
        "sizeof ibv_send_wr",
        "ibv_send_wr.sg_list",
        "ibv_send_wr.num_sge",
        "ibv_send_wr.opcode",
        "ibv_send_wr.send_flags",
        "ibv_send_wr.imm_data",
        "ibv_send_wr.wr",
        "ibv_send_wr.wr.rdma.rkey",
        "ibv_send_wr.wr.atomic.compare_add",
        "ibv_send_wr.wr.atomic.swap",
        "ibv_send_wr.wr.atomic.rkey",
        "ibv_send_wr.wr.ud.remote_qpn",
        "ibv_send_wr.wr.ud.remote_qkey",
        "ibv_send_wr.qp_type",
        "ibv_send_wr.bind_mw",
        "ibv_send_wr.tso.mss",
        "sizeof ibv_recv_wr",
        "sizeof ibv_global_route",
        "sizeof ibv_ah_attr",
        "ibv_ah_attr.dlid",
        "ibv_ah_attr.port_num",
        "sizeof ibv_qp_attr",
        "ibv_qp_attr.ah_attr",
        "ibv_qp_attr.alt_ah_attr",
        "ibv_qp_attr.pkey_index",
        "ibv_qp_attr.rate_limit",
        "sizeof ibv_async_event",
        "ibv_async_event.event_type",
        "sizeof ibv_mw_bind_info",
        "sizeof rdma_cm_event",
        "rdma_cm_event.param",
        "sizeof rdma_addr",
        "rdma_addr.addr",
    ];

    /// Byte offset of a (possibly nested, possibly union) field, computed from a pointer to
    /// uninitialised storage: nothing is read.
    macro_rules! off {
        ($t:ty, $($field:tt)+) => {{
            let storage = std::mem::MaybeUninit::<$t>::uninit();
            let base = storage.as_ptr();
            // SAFETY: only a place is projected (no read, no reference to uninitialised
            // memory is made); `base` points to storage of the right type and size.
            let field = unsafe { &raw const (*base).$($field)+ };
            field as usize - base as usize
        }};
    }

    /// The verbs structs with anonymous unions and the ones whose layout the verbs provider
    /// relies on, as bindgen generated them (libclang's view), against the same offsets
    /// computed by the C compiler that builds the static-inline wrappers (src/layout.c). A
    /// header or libclang that lays a struct out differently fails here, not on a NIC.
    #[test]
    fn generated_verbs_layouts_match_the_c_compiler() {
        println!("bindings made with libclang {}", crate::LIBCLANG);
        let rust: [usize; 47] = [
            size_of::<ibv_gid>(),
            size_of::<ibv_sge>(),
            size_of::<ibv_wc>(),
            offset_of!(ibv_wc, status),
            offset_of!(ibv_wc, opcode),
            offset_of!(ibv_wc, byte_len),
            off!(ibv_wc, __bindgen_anon_1.imm_data),
            offset_of!(ibv_wc, qp_num),
            offset_of!(ibv_wc, src_qp),
            offset_of!(ibv_wc, wc_flags),
            offset_of!(ibv_wc, pkey_index),
            offset_of!(ibv_wc, slid),
            offset_of!(ibv_wc, sl),
            offset_of!(ibv_wc, dlid_path_bits),
            size_of::<ibv_send_wr>(),
            offset_of!(ibv_send_wr, sg_list),
            offset_of!(ibv_send_wr, num_sge),
            offset_of!(ibv_send_wr, opcode),
            offset_of!(ibv_send_wr, send_flags),
            off!(ibv_send_wr, __bindgen_anon_1.imm_data),
            offset_of!(ibv_send_wr, wr),
            off!(ibv_send_wr, wr.rdma.rkey),
            off!(ibv_send_wr, wr.atomic.compare_add),
            off!(ibv_send_wr, wr.atomic.swap),
            off!(ibv_send_wr, wr.atomic.rkey),
            off!(ibv_send_wr, wr.ud.remote_qpn),
            off!(ibv_send_wr, wr.ud.remote_qkey),
            offset_of!(ibv_send_wr, qp_type),
            off!(ibv_send_wr, __bindgen_anon_2.bind_mw),
            off!(ibv_send_wr, __bindgen_anon_2.tso.mss),
            size_of::<ibv_recv_wr>(),
            size_of::<ibv_global_route>(),
            size_of::<ibv_ah_attr>(),
            offset_of!(ibv_ah_attr, dlid),
            offset_of!(ibv_ah_attr, port_num),
            size_of::<ibv_qp_attr>(),
            offset_of!(ibv_qp_attr, ah_attr),
            offset_of!(ibv_qp_attr, alt_ah_attr),
            offset_of!(ibv_qp_attr, pkey_index),
            offset_of!(ibv_qp_attr, rate_limit),
            size_of::<ibv_async_event>(),
            offset_of!(ibv_async_event, event_type),
            size_of::<ibv_mw_bind_info>(),
            size_of::<rdma_cm_event>(),
            offset_of!(rdma_cm_event, param),
            size_of::<rdma_addr>(),
            offset_of!(rdma_addr, addr),
        ];
        // SAFETY: both statics are immutable C data of the declared types
        // (layout.c, compiled by build.rs).
        let (c, c_len) = unsafe { (rdmakit_sys_c_layout, rdmakit_sys_c_layout_len) };
        assert_eq!(c_len, C_LAYOUT_NAMES.len(), "src/layout.c and C_LAYOUT_NAMES disagree");
        for ((name, r), c) in C_LAYOUT_NAMES.iter().zip(rust).zip(c) {
            assert_eq!(r, c, "{name}: bindgen (Rust) = {r}, C compiler = {c}");
        }
    }
}
