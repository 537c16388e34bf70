//! Build script for `rdmakit-sys`: rdma-core's C API as Rust, generated here with bindgen.
//!
//! What it does, in order:
//!
//! 1. **Decides whether rdma-core is available.** It needs the development files of
//!    `libibverbs`, `librdmacm` and `libmlx5` (found with pkg-config) and libclang (loaded the
//!    way bindgen loads it, so `LIBCLANG_PATH` is honoured). `RDMAKIT_SYS_VERBS` chooses what
//!    happens when something is missing:
//!    * unset or `auto`: build without bindings, print a cargo warning naming the packages
//!      to install, and tell dependents (`DEP_RDMAKIT_RDMA_CORE_VERBS=0`, with the reason in
//!      `DEP_RDMAKIT_RDMA_CORE_MISSING`). rdmakit then builds with its software NIC only and
//!      says so at run time. This is what makes `cargo run` work on a machine with only Rust.
//!    * `require`: fail the build with the same message (CI and packagers use this, so a
//!      missing package is loud);
//!    * `off`: never look; build without bindings.
//! 2. **Runs bindgen twice** over `wrapper.h` (`<infiniband/verbs.h>`, `<rdma/rdma_cma.h>`,
//!    `<infiniband/mlx5dv.h>`):
//!    * `verbs.rs`: every `ibv_*` / `rdma_*` function, type and constant of libibverbs and
//!      librdmacm, including the header's `static inline` functions (`ibv_post_send`,
//!      `ibv_poll_cq`, `ibv_query_port`'s `___ibv_query_port`, `ibv_alloc_dm`, ...);
//!    * `mlx5dv.rs`: the mlx5 direct-verbs API, reusing the first run's libibverbs types
//!      (`use super::*`), so the whole project has one `ibv_context`, `ibv_qp`, ....
//!
//!    These bindings replace the `rdma-sys` crate, whose pinned bindgen 0.59 cannot parse
//!    rdma-core's headers under libclang 16 or newer (anonymous unions are named
//!    `..._(anonymous_at_...)`, which is not an identifier). bindgen 0.72 handles libclang 9
//!    through 22.
//! 3. **Compiles the `static inline` wrappers.** Static inline functions have no symbol to
//!    link against, so bindgen's `wrap_static_fns` writes a C file with an exported
//!    `<name>__extern` wrapper for each; this file and `src/layout.c` (a table of C struct
//!    sizes/offsets for the unit tests, computed by the C compiler, independently of
//!    libclang) are compiled into one static archive with `cc`.
//! 4. **Emits link lines** in the order GNU ld needs with `--as-needed`: the archive (printed
//!    by `cc` itself), then `libmlx5`, `librdmacm`, `libibverbs`.

use std::env;
use std::path::{Path, PathBuf};

/// Debian/Ubuntu packages needed to build the rdma-core bindings.
const DEBIAN_PACKAGES: &str = "libibverbs-dev librdmacm-dev ibverbs-providers pkg-config libclang-dev";
/// The same for Fedora/RHEL.
const RPM_PACKAGES: &str = "rdma-core-devel pkgconf-pkg-config clang-devel";

/// Enumerations whose values are used as values (states, statuses, opcodes): generated as a
/// module of constants (`ibv_qp_state::IBV_QPS_RTS`), typed like the C enum, so a value that a
/// newer library returns is not undefined behaviour (as a Rust `enum` would make it).
const CONST_MODULE_ENUMS: &[&str] = &[
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

/// Enumerations of bit flags: generated as newtypes over the integer
/// (`ibv_access_flags(pub c_uint)`) with `|`, `&` and associated constants.
const BITFIELD_ENUMS: &[&str] = &[
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

/// Types the mlx5dv run must take from the verbs run (`use super::*`) instead of generating
/// them again (regexes, anchored by bindgen). The tag-matching layouts `ibv_tmh`,
/// `ibv_tmh_op` and `ibv_rvh` come from `<infiniband/tm_types.h>`, which only mlx5dv.h uses:
/// the mlx5dv run generates them (the regex engine has no look-ahead, hence the spelled-out
/// complement).
const VERBS_RUN_TYPES: &[&str] = &[
    "ibv_(|[^rt].*|r|r[^v].*|rv|rv[^h].*|rvh.+|t|t[^m].*|tm|tm[^h].*|tmh[^_].*|tmh_|tmh_[^o].*|tmh_o|tmh_o[^p].*|tmh_op.+)",
    "_ibv_.*",
    "_compat_ibv_.*",
    "verbs_.*",
    "rdma_.*",
    "ib_uverbs_.*",
    "pthread_.*",
    "__pthread_.*",
    "__atomic_wide_counter.*",
    "__u(8|16|32|64)",
    "__s(8|16|32|64)",
    "__be(16|32|64)",
    "__le(16|32|64)",
    "__kernel_.*",
    "__(u)?int(8|16|32|64)_t",
    "__time_t",
    "__syscall_slong_t",
];

/// What the build found: include directories for bindgen and the C compiler.
struct RdmaCore {
    include_paths: Vec<PathBuf>,
    /// libclang's own version string and the file it was loaded from, for the build log.
    libclang: String,
}

/// The loaded libclang's version string (`clang_getClangVersion`) and path.
fn libclang_version() -> String {
    let path = clang_sys::get_library().map(|l| l.path().display().to_string()).unwrap_or_default();
    // SAFETY: libclang was loaded by the caller (clang_sys::load succeeded); the CXString it
    // returns is read while alive and disposed of exactly once.
    let version = unsafe {
        let s = clang_sys::clang_getClangVersion();
        let text = std::ffi::CStr::from_ptr(clang_sys::clang_getCString(s)).to_string_lossy().into_owned();
        clang_sys::clang_disposeString(s);
        text
    };
    format!("{version} ({path})")
}

/// Finds rdma-core's development files and libclang, or says (for a person) what is missing.
fn find_rdma_core() -> Result<RdmaCore, String> {
    let mut include_paths: Vec<PathBuf> = Vec::new();
    let mut missing = Vec::new();
    let pkg_config = env::var_os("PKG_CONFIG").unwrap_or_else(|| "pkg-config".into());
    let have_pkg_config = std::process::Command::new(&pkg_config)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let libs: &[&str] = if have_pkg_config {
        &["libibverbs", "librdmacm", "libmlx5"]
    } else {
        missing.push(
            "pkg-config (not installed, so libibverbs, librdmacm and libmlx5 cannot be looked up)".into(),
        );
        &[]
    };
    for &lib in libs {
        match pkg_config::Config::new().cargo_metadata(false).env_metadata(false).probe(lib) {
            Ok(found) => {
                for path in found.include_paths {
                    if !include_paths.contains(&path) {
                        include_paths.push(path);
                    }
                }
            }
            Err(err) => {
                let err = err.to_string();
                let why = if err.contains("was not found in the pkg-config search path") {
                    "no .pc file: its -dev package is not installed"
                } else {
                    first_line(&err)
                };
                missing.push(format!("{lib} ({why})"));
            }
        }
    }
    let mut libclang = String::new();
    if let Err(err) = clang_sys::load() {
        let why = if err.contains("couldn't find any valid shared libraries") {
            "not found; set LIBCLANG_PATH if it is installed somewhere unusual".to_string()
        } else {
            first_line(&err).to_string()
        };
        missing.push(format!("libclang, which bindgen loads ({why})"));
    } else {
        libclang = libclang_version();
        // bindgen loads its own copy; this one was only a probe.
        let _ = clang_sys::unload();
    }
    if missing.is_empty() {
        Ok(RdmaCore { include_paths, libclang })
    } else {
        Err(format!(
            "rdma-core's development files are not usable: missing {}. Install them \
             (Debian/Ubuntu: `apt-get install {DEBIAN_PACKAGES}`; Fedora/RHEL: `dnf install \
             {RPM_PACKAGES}`)",
            missing.join(", ")
        ))
    }
}

/// Where installing what is missing shows: the directories pkg-config searches for `.pc`
/// files, and the usual library directories (libclang, pkg-config's own binary's libraries).
/// A directory's time stamp changes when a file is added to it, so watching those that exist
/// reruns this script after an install, where otherwise a plain rebuild would keep the
/// build without rdma-core it made first. Paths that do not exist are left out: cargo would
/// rerun the script, and rebuild everything above it, on every build.
fn install_dirs() -> Vec<PathBuf> {
    let pkg_config = env::var_os("PKG_CONFIG").unwrap_or_else(|| "pkg-config".into());
    let default_path = std::process::Command::new(&pkg_config)
        .args(["--variable", "pc_path", "pkg-config"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let from_env = ["PKG_CONFIG_PATH", "PKG_CONFIG_LIBDIR"].map(|v| env::var(v).unwrap_or_default());
    let mut dirs: Vec<PathBuf> = Vec::new();
    let listed = default_path.split(':').chain(from_env.iter().flat_map(|v| v.split(':')));
    let usual =
        ["/usr/lib", "/usr/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/bin"];
    for d in listed.chain(usual) {
        let d = PathBuf::from(d);
        if !d.as_os_str().is_empty() && d.is_dir() && !dirs.contains(&d) {
            dirs.push(d);
        }
    }
    dirs
}

fn first_line(s: &str) -> &str {
    s.lines().find(|l| !l.trim().is_empty()).unwrap_or(s).trim()
}

/// A bindgen builder with the settings shared by both runs.
/// `static_fns`: where `wrap_static_fns` writes its C file (`.c` is added).
fn base_builder(header: &Path, include_paths: &[PathBuf], static_fns: &Path) -> bindgen::Builder {
    let mut builder = bindgen::Builder::default()
        .header(header.to_str().expect("non-UTF-8 path to wrapper.h"))
        .clang_args(include_paths.iter().map(|p| format!("-I{}", p.display())))
        .rust_target(bindgen::RustTarget::stable(85, 0).expect("valid Rust target"))
        .rust_edition(bindgen::RustEdition::Edition2024)
        .formatter(bindgen::Formatter::Prettyplease)
        // C library types are libc's, so callers can pass `libc::sockaddr` and friends.
        .raw_line("#[allow(unused_imports)]")
        .raw_line(
            "use libc::{FILE, in_addr, in_port_t, in6_addr, sa_family_t, sockaddr, sockaddr_in, \
             sockaddr_in6, sockaddr_storage, socklen_t, timespec};",
        )
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .wrap_unsafe_ops(true)
        .prepend_enum_name(false)
        .size_t_is_usize(true)
        .derive_default(true)
        .derive_debug(true)
        .layout_tests(true)
        .wrap_static_fns(true)
        .wrap_static_fns_path(static_fns)
        .blocklist_type("FILE|_IO_.*|timespec|socklen_t|sa_family_t|in_port_t")
        .blocklist_type("sockaddr|sockaddr_in|sockaddr_in6|sockaddr_storage|in_addr|in6_addr");
    for e in CONST_MODULE_ENUMS {
        builder = builder.constified_enum_module(format!("{e}$"));
    }
    for e in BITFIELD_ENUMS {
        builder = builder.bitfield_enum(format!("{e}$"));
    }
    builder.rustified_enum("ibv_event_type")
}

fn generate(builder: bindgen::Builder, out: &Path) {
    builder
        .generate()
        .unwrap_or_else(|err| {
            panic!(
                "rdmakit-sys: bindgen failed on rdma-core's headers ({err}); it needs libclang and \
                 the rdma-core headers: apt-get install {DEBIAN_PACKAGES}"
            )
        })
        .write_to_file(out)
        .unwrap_or_else(|err| panic!("rdmakit-sys: cannot write {}: {err}", out.display()));
}

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let header = manifest_dir.join("wrapper.h");
    println!("cargo::rustc-check-cfg=cfg(rdmakit_sys_bound)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed={}", header.display());
    println!("cargo::rerun-if-changed=src/layout.c");
    for var in ["RDMAKIT_SYS_VERBS", "LIBCLANG_PATH", "PKG_CONFIG_PATH", "PKG_CONFIG_LIBDIR", "PKG_CONFIG"] {
        println!("cargo::rerun-if-env-changed={var}");
    }

    // 1. Is rdma-core there, and is it wanted?
    let mode = env::var("RDMAKIT_SYS_VERBS").unwrap_or_else(|_| "auto".into());
    let found = match mode.as_str() {
        "off" => Err("rdma-core was turned off at build time (RDMAKIT_SYS_VERBS=off)".to_string()),
        "auto" | "" | "require" => find_rdma_core(),
        other => panic!("rdmakit-sys: RDMAKIT_SYS_VERBS={other:?}: expected `auto`, `require` or `off`"),
    };
    let rdma_core = match found {
        Ok(found) => found,
        Err(why) if mode == "require" => panic!("rdmakit-sys: {why} (RDMAKIT_SYS_VERBS=require)"),
        Err(why) => {
            if mode != "off" {
                println!(
                    "cargo::warning=rdmakit-sys: {why}; building without the rdma-core provider \
                     (the software NIC still works); rebuild after installing them"
                );
                for d in install_dirs() {
                    println!("cargo::rerun-if-changed={}", d.display());
                }
            }
            println!("cargo::metadata=verbs=0");
            println!("cargo::metadata=missing={why}");
            println!("cargo::rustc-env=RDMAKIT_SYS_MISSING={why}");
            println!("cargo::rustc-env=RDMAKIT_SYS_LIBCLANG=");
            return;
        }
    };
    // Shown by `cargo build -vv`; CI greps it to say which libclang generated the bindings.
    println!("rdmakit-sys: bindings generated with libclang {}", rdma_core.libclang);
    println!("cargo::rustc-env=RDMAKIT_SYS_LIBCLANG={}", rdma_core.libclang);
    println!("cargo::rustc-cfg=rdmakit_sys_bound");
    println!("cargo::metadata=verbs=1");
    println!("cargo::rustc-env=RDMAKIT_SYS_MISSING=");
    let include_paths = rdma_core.include_paths;

    // 2a. libibverbs and librdmacm.
    let verbs_static = out_dir.join("verbs_static_fns");
    let builder = base_builder(&header, &include_paths, &verbs_static)
        .allowlist_function("_*ibv_.*")
        .allowlist_function("rdma_.*")
        .allowlist_type("_*ibv_.*")
        .allowlist_type("_compat_ibv_.*")
        .allowlist_type("verbs_.*")
        .allowlist_type("rdma_.*")
        // The kernel's fixed-width integer names, shared with the mlx5dv run.
        .allowlist_type("__(u|s)(8|16|32|64)|__(be|le)(16|32|64)")
        .allowlist_var("IBV_.*")
        .allowlist_var("RDMA_.*")
        .allowlist_var("IB_(ROCE_UDP_ENCAP_VALID_PORT_.*|GRH_FLOWLABEL_MASK|DEVICE_NAME_MAX)")
        // Not libibverbs: tm_types.h and mlx5dv.h items belong to the mlx5dv run.
        .blocklist_type("ibv_(tmh|tmh_op|rvh)")
        .blocklist_function("ibv_(tmh|rvh).*")
        // Let clang evaluate the macros cexpr cannot (`~`, enum operands).
        .clang_macro_fallback()
        .clang_macro_fallback_build_dir(&out_dir);
    generate(builder, &out_dir.join("verbs.rs"));

    // 2b. mlx5 direct verbs, over the verbs run's types.
    let mlx5_static = out_dir.join("mlx5dv_static_fns");
    let mut builder = base_builder(&header, &include_paths, &mlx5_static)
        .raw_line("#[allow(unused_imports)]")
        .raw_line("use super::*;")
        .allowlist_function("_?mlx5dv_.*")
        .allowlist_type("_?mlx5dv_.*")
        .allowlist_type("mlx5_.*")
        .allowlist_type("ibv_(tmh|tmh_op|rvh)")
        .allowlist_var("MLX5DV_.*")
        .allowlist_var("MLX5_.*")
        // `__packed__` + `__aligned__(4)` cannot be expressed by one Rust struct (bindgen's
        // `packed(4)` output is 20 bytes, not 16); lib.rs defines it by hand.
        .blocklist_type("mlx5_wqe_ctrl_seg");
    for ty in VERBS_RUN_TYPES {
        builder = builder.blocklist_type(ty);
    }
    generate(builder, &out_dir.join("mlx5dv.rs"));

    // 3. The static-inline wrappers and the layout table, in one archive. `cc` prints its
    //    link line, which must come before the shared libraries.
    cc::Build::new()
        .file(verbs_static.with_extension("c"))
        .file(mlx5_static.with_extension("c"))
        .file(manifest_dir.join("src/layout.c"))
        .include(&manifest_dir)
        .includes(&include_paths)
        // The wrappers call deprecated inlines too (they wrap every one of them).
        .flag_if_supported("-Wno-deprecated-declarations")
        .compile("rdmakit_sys_static_fns");

    // 4. Link lines, in dependency order for GNU ld --as-needed.
    for lib in ["libmlx5", "librdmacm", "libibverbs"] {
        pkg_config::Config::new()
            .probe(lib)
            .unwrap_or_else(|err| panic!("rdmakit-sys: pkg-config found {lib} a moment ago: {err}"));
    }
}
