//! Build script for `rdmakit-sys`.
//!
//! What it does, in order:
//!
//! 1. Finds rdma-core's `libibverbs`, `libmlx5` and `librdmacm` with
//!    pkg-config (panicking with the Debian package names if they are
//!    missing) to learn their include paths.
//! 2. Runs bindgen three times over `wrapper.h` (`<infiniband/verbs.h>` +
//!    `<infiniband/mlx5dv.h>`):
//!    * `mlx5dv.rs`: the mlx5 direct-verbs API (`mlx5dv_*` functions and
//!      types, `MLX5DV_*`/`MLX5_*` constants, the `mlx5_wqe_*` / `mlx5_cqe64`
//!      hardware layouts);
//!    * `verbs_inline.rs`: the static-inline libibverbs helpers that
//!      `rdma-sys` 0.3.0 does not re-implement in Rust;
//!    * `verbs_consts.rs`: verbs.h macros and anonymous-enum constants,
//!      which rdma-sys does not bind.
//!
//!    Every libibverbs/librdmacm type (`ibv_*`, `rdma_*`, `verbs_*`, ...) is
//!    blocklisted, and the generated code starts with `use rdma_sys::*;`, so
//!    the whole project shares rdma-sys's single definition of
//!    `ibv_context`, `ibv_qp`, `ibv_cq`, ...
//! 3. Static inline functions have no symbol to link against, so bindgen's
//!    `wrap_static_fns` writes a C file with an exported `<name>__extern`
//!    wrapper for each; these C files (plus `src/layout.c`, a table of C
//!    struct sizes/offsets used by the unit tests) are compiled into one
//!    static archive with `cc`. The Rust side keeps the original names
//!    (bindgen adds `#[link_name = "<name>__extern"]`).
//! 4. Emits link lines in the order GNU ld needs with `--as-needed`: the `cc`
//!    archive (emitted by `cc` itself) first, then `libmlx5`, then
//!    `libibverbs`. (`rdma-sys` emits its own `libibverbs`/`librdmacm` lines.)

use std::env;
use std::path::{Path, PathBuf};

use bindgen::callbacks::{DeriveTrait, ImplementsTrait, ParseCallbacks};

/// Debian/Ubuntu packages needed to build this crate.
const DEBIAN_PACKAGES: &str = "libibverbs-dev librdmacm-dev ibverbs-providers pkg-config clang libclang-dev";

/// Static-inline functions of `<infiniband/verbs.h>` (rdma-core 44) that
/// rdma-sys 0.3.0 does not re-implement. Everything else from verbs.h is
/// either a real export bound by rdma-sys, or re-implemented by it in Rust.
const MISSING_VERBS_INLINES: &[&str] =
    &["ibv_query_gid_ex", "ibv_query_gid_table", "ibv_wr_atomic_write", "ibv_flow_label_to_udp_sport"];

/// Type names that rdma-sys defines and that bindgen must therefore not
/// generate again (regexes, anchored by bindgen).
const RDMA_SYS_TYPES: &[&str] = &[
    // `ibv_.*` except `ibv_tmh`, `ibv_tmh_op` and `ibv_rvh`: those come from
    // <infiniband/tm_types.h>, which rdma-sys does not bind but mlx5dv.h
    // uses. (The regex engine has no look-ahead, hence the spelled-out
    // complement.)
    "ibv_(|[^rt].*|r|r[^v].*|rv|rv[^h].*|rvh.+|t|t[^m].*|tm|tm[^h].*|tmh[^_].*|tmh_|tmh_[^o].*|tmh_o|tmh_o[^p].*|tmh_op.+)",
    "_ibv_.*",
    "_compat_ibv_.*",
    "verbs_.*",
    "rdma_.*",
    "ib_uverbs_.*",
    "pthread_.*",
    "__pthread_.*",
    "__atomic_wide_counter.*",
    // Kernel integer aliases rdma-sys already defines (it has no `__u8`).
    "__u(16|32|64)",
    "__be(16|32|64)",
    // `FILE` (used by the `mlx5dv_dump_dr_*` functions) is `libc::FILE`.
    "FILE",
    "_IO_.*",
];

/// rdma-sys's hand-written (union-containing) types that are not `Copy`.
const RDMA_SYS_NOT_COPY: &[&str] = &[
    "ibv_wc",
    "ibv_send_wr",
    "ibv_async_event",
    "ibv_ops_wr",
    "ibv_flow_spec",
    "rdma_addr",
    "rdma_cm_event",
    "rdma_cm_id",
];

/// Enums that rdma-sys generates as a module of constants (`name::Type`).
/// Repeated here so that references to these blocklisted enums are spelled
/// the way rdma-sys defines them.
const RDMA_SYS_CONST_MODULE_ENUMS: &[&str] = &[
    "ibv_node_type",
    "ibv_transport_type",
    "ibv_atomic_cap",
    "ibv_mtu",
    "ibv_port_state",
    "ibv_wc_status",
    "ibv_wc_opcode",
    "ibv_mw_type",
    "ibv_rate",
    "ibv_srq_type",
    "ibv_wq_type",
    "ibv_wq_state",
    "ibv_qp_type",
    "ibv_qp_state",
    "ibv_mig_state",
    "ibv_wr_opcode",
    "ibv_ops_wr_opcode",
    "ibv_flow_attr_type",
    "ibv_flow_spec_type",
    "ibv_counter_description",
    "ibv_rereg_mr_err_code",
    "ib_uverbs_advise_mr_advice",
    "rdma_cm_event_type",
    "rdma_driver_id",
    "rdma_port_space",
];

/// Enums that rdma-sys generates as bitflag newtypes (`struct name(pub c_uint)`).
const RDMA_SYS_BITFIELD_ENUMS: &[&str] = &[
    "ibv_device_cap_flags",
    "ibv_odp_transport_cap_bits",
    "ibv_odp_general_caps",
    "ibv_rx_hash_function_flags",
    "ibv_rx_hash_fields",
    "ibv_raw_packet_caps",
    "ibv_tm_cap_flags",
    "ibv_pci_atomic_op_size",
    "ibv_port_cap_flags",
    "ibv_port_cap_flags2",
    "ibv_create_cq_wc_flags",
    "ibv_wc_flags",
    "ibv_access_flags",
    "ibv_xrcd_init_attr_mask",
    "ibv_rereg_mr_flags",
    "ibv_srq_attr_mask",
    "ibv_srq_init_attr_mask",
    "ibv_wq_init_attr_mask",
    "ibv_wq_flags",
    "ibv_wq_attr_mask",
    "ibv_ind_table_init_attr_mask",
    "ibv_qp_init_attr_mask",
    "ibv_qp_create_flags",
    "ibv_qp_create_send_ops_flags",
    "ibv_qp_open_attr_mask",
    "ibv_qp_attr_mask",
    "ibv_send_flags",
    "ibv_ops_flags",
    "ibv_cq_attr_mask",
    "ibv_flow_flags",
    "ibv_flow_action_esp_mask",
    "ibv_cq_init_attr_mask",
    "ibv_create_cq_attr_flags",
    "ibv_parent_domain_init_attr_mask",
    "ibv_read_counters_flags",
    "ibv_values_mask",
    "ib_uverbs_access_flags",
    "rdma_cm_join_mc_attr_mask",
    "rdma_cm_mc_join_flags",
];

/// Tells bindgen which traits rdma-sys's (blocklisted) types implement, so
/// that generated structs embedding them by value can still derive `Copy`.
/// rdma-sys derives `Copy`/`Clone` and nothing else (no `Debug`/`Default`).
#[derive(Debug)]
struct RdmaSysTraits;

impl ParseCallbacks for RdmaSysTraits {
    fn blocklisted_type_implements_trait(
        &self,
        name: &str,
        derive_trait: DeriveTrait,
    ) -> Option<ImplementsTrait> {
        let name =
            name.trim_start_matches("struct ").trim_start_matches("union ").trim_start_matches("enum ");
        Some(match derive_trait {
            DeriveTrait::Copy if !RDMA_SYS_NOT_COPY.contains(&name) => ImplementsTrait::Yes,
            _ => ImplementsTrait::No,
        })
    }
}

fn probe(lib: &str, emit_cargo_metadata: bool) -> pkg_config::Library {
    pkg_config::Config::new().cargo_metadata(emit_cargo_metadata).probe(lib).unwrap_or_else(|err| {
        panic!(
            "rdmakit-sys: pkg-config cannot find `{lib}` (rdma-core): {err}\n\
                 Install the rdma-core development packages, e.g. on Debian/Ubuntu:\n    \
                 apt-get install {DEBIAN_PACKAGES}"
        )
    })
}

/// A bindgen builder with the settings shared by all runs.
/// `static_fns`: where `wrap_static_fns` writes its C file (`.c` is added).
fn base_builder(header: &Path, include_paths: &[PathBuf], static_fns: Option<&Path>) -> bindgen::Builder {
    let mut builder = bindgen::Builder::default()
        .header(header.to_str().expect("non-UTF-8 path to wrapper.h"))
        .clang_args(include_paths.iter().map(|p| format!("-I{}", p.display())))
        .rust_target(bindgen::RustTarget::stable(85, 0).expect("valid Rust target"))
        .rust_edition(bindgen::RustEdition::Edition2024)
        .formatter(bindgen::Formatter::Prettyplease)
        .raw_line("#[allow(unused_imports)]")
        .raw_line("use rdma_sys::*;")
        .raw_line("#[allow(unused_imports)]")
        .raw_line("use libc::FILE;")
        .parse_callbacks(Box::new(RdmaSysTraits))
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .wrap_unsafe_ops(true)
        .prepend_enum_name(false)
        .size_t_is_usize(true)
        .derive_default(true)
        .derive_debug(true)
        .layout_tests(true);
    if let Some(path) = static_fns {
        builder = builder.wrap_static_fns(true).wrap_static_fns_path(path);
    }
    for ty in RDMA_SYS_TYPES {
        builder = builder.blocklist_type(ty);
    }
    for e in RDMA_SYS_CONST_MODULE_ENUMS {
        builder = builder.constified_enum_module(format!("{e}$"));
    }
    for e in RDMA_SYS_BITFIELD_ENUMS {
        builder = builder.bitfield_enum(format!("{e}$"));
    }
    builder.rustified_enum("ibv_event_type")
}

fn generate(builder: bindgen::Builder, out: &Path) {
    builder
        .generate()
        .unwrap_or_else(|err| {
            panic!(
                "rdmakit-sys: bindgen failed ({err}); it needs libclang and the rdma-core headers, \
                 e.g. on Debian/Ubuntu: apt-get install {DEBIAN_PACKAGES}"
            )
        })
        .write_to_file(out)
        .unwrap_or_else(|err| panic!("rdmakit-sys: cannot write {}: {err}", out.display()));
}

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let header = manifest_dir.join("wrapper.h");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={}", header.display());
    println!("cargo:rerun-if-changed=src/layout.c");

    // 1. Locate rdma-core (no link lines yet: see step 4 for the order).
    let mut include_paths: Vec<PathBuf> = Vec::new();
    for lib in ["libibverbs", "libmlx5", "librdmacm"] {
        for path in probe(lib, false).include_paths {
            if !include_paths.contains(&path) {
                include_paths.push(path);
            }
        }
    }

    // 2a. mlx5 direct verbs.
    let mlx5_static = out_dir.join("mlx5dv_static_fns");
    let builder = base_builder(&header, &include_paths, Some(&mlx5_static))
        .allowlist_function("_?mlx5dv_.*")
        .allowlist_type("_?mlx5dv_.*")
        .allowlist_type("mlx5_.*")
        // Tag-matching header layouts from <infiniband/tm_types.h>.
        .allowlist_type("ibv_(tmh|tmh_op|rvh)")
        .allowlist_var("MLX5DV_.*")
        .allowlist_var("MLX5_.*")
        // `__packed__` + `__aligned__(4)` cannot be expressed by one Rust
        // struct (bindgen's `packed(4)` output is 20 bytes, not 16); lib.rs
        // defines it by hand.
        .blocklist_type("mlx5_wqe_ctrl_seg");
    generate(builder, &out_dir.join("mlx5dv.rs"));

    // 2b. libibverbs static inlines that rdma-sys lacks.
    let verbs_static = out_dir.join("verbs_inline_static_fns");
    let mut builder = base_builder(&header, &include_paths, Some(&verbs_static));
    for f in MISSING_VERBS_INLINES {
        builder = builder.allowlist_function(f);
    }
    generate(builder, &out_dir.join("verbs_inline.rs"));

    // 2c. verbs.h constants rdma-sys lacks: it binds no macros and no
    //     anonymous-enum constants (`IBV_LINK_LAYER_*`, `IBV_SYSFS_*`, ...).
    //     Constants of named enums stay with rdma-sys (their enum types are
    //     blocklisted here, so they are not generated twice).
    let builder = base_builder(&header, &include_paths, None)
        // Let clang evaluate macros cexpr cannot (`~`, enum operands).
        .clang_macro_fallback()
        .clang_macro_fallback_build_dir(&out_dir)
        .allowlist_var("IBV_.*")
        .allowlist_var("IB_(ROCE_UDP_ENCAP_VALID_PORT_.*|GRH_FLOWLABEL_MASK|DEVICE_NAME_MAX)");
    generate(builder, &out_dir.join("verbs_consts.rs"));

    // 3. Compile the wrappers of static inline functions. `cc` prints the
    //    link line for this archive, which must come before libmlx5/libibverbs.
    let mut build = cc::Build::new();
    build
        .file(mlx5_static.with_extension("c"))
        .file(verbs_static.with_extension("c"))
        .file(manifest_dir.join("src/layout.c"))
        .include(&manifest_dir)
        .includes(&include_paths);
    build.compile("rdmakit_sys_static_fns");

    // 4. Link lines, in dependency order for GNU ld --as-needed.
    probe("libmlx5", true);
    probe("libibverbs", true);
}
