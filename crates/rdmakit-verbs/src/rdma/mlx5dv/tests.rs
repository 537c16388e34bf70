//! The hand-built DEVX commands against the kernel's own definition of the PRM layouts.
//!
//! `prm_fields_match_the_kernel_mlx5_ifc_h` parses the `mlx5_ifc_*_bits` structs of the
//! kernel's `include/linux/mlx5/mlx5_ifc.h` (Debian: `linux-headers-*-common`, which
//! `scripts/dev.sh` installs), computes the bit offset and width of every field rdmakit
//! writes or reads, and compares them with the [`PrmField`]s the commands are built from. A
//! wrong offset in rdmakit, or a layout the kernel changed, fails it.

use std::collections::HashMap;
use std::path::PathBuf;

use super::*;

#[test]
fn fields_are_written_big_endian_at_their_bit() {
    let mut b = [0u8; 16];
    put(&mut b, prm("t", "a", 0x0, 0x10), 0xa00);
    put(&mut b, prm("t", "b", 0x30, 0x10), 0xff01);
    put(&mut b, prm("t", "c", 0x60, 0x1), 1);
    put(&mut b, prm("t", "d", 0x63, 0x5), 0x1f);
    assert_eq!(&b[..8], &[0x0a, 0x00, 0, 0, 0, 0, 0xff, 0x01]);
    assert_eq!(b[12], 0b1001_1111);
    assert_eq!(get(&b, prm("t", "b", 0x30, 0x10)), 0xff01);
    assert_eq!(get(&b, prm("t", "d", 0x63, 0x5)), 0x1f);
    put(&mut b, prm("t", "c", 0x60, 0x1), 0);
    assert_eq!(b[12], 0b0001_1111, "clearing one bit leaves its neighbours");
    let out = [0u8, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0];
    let fields = (OBJ_OUT_STATUS, OBJ_OUT_SYNDROME);
    assert!(cmd_status("x", 0, &out, fields.0, fields.1).is_ok());
    let bad = [3u8, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0];
    let err = cmd_status("x", 0, &bad, fields.0, fields.1);
    assert!(matches!(err, Err(Error::Unsupported(m)) if m.contains("status 0x3, syndrome 0x7")));
}

/// The kernel header to check against: `RDMAKIT_MLX5_IFC_H`, else the newest
/// `/usr/src/linux-headers-*/include/linux/mlx5/mlx5_ifc.h`.
fn kernel_header() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("RDMAKIT_MLX5_IFC_H") {
        return Some(PathBuf::from(p));
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/src")
        .ok()?
        .flatten()
        .map(|e| e.path().join("include/linux/mlx5/mlx5_ifc.h"))
        .filter(|p| p.is_file())
        .collect();
    found.sort_by_key(|p| version_key(&p.to_string_lossy()));
    found.pop()
}

/// Numbers in a path, for ordering `linux-headers-6.12.9` before `linux-headers-6.12.117`.
fn version_key(s: &str) -> Vec<u64> {
    s.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse().ok()).collect()
}

#[test]
#[ignore = "needs the kernel's mlx5_ifc.h (Debian: linux-headers-*-common); scripts/dev.sh installs it and runs this"]
fn prm_fields_match_the_kernel_mlx5_ifc_h() {
    let path =
        kernel_header().expect("no mlx5_ifc.h: install linux-headers-*-common or set RDMAKIT_MLX5_IFC_H");
    // mlx5_ifc.h uses layouts of its siblings (`mlx5_ifc_fpga.h`, ...): read them all.
    let mut text = std::fs::read_to_string(&path).expect("read mlx5_ifc.h");
    let dir = path.parent().expect("a directory");
    let mut siblings: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read the header directory")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p != &path && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("mlx5_ifc")))
        .collect();
    siblings.sort();
    for s in &siblings {
        text.push('\n');
        text.push_str(&std::fs::read_to_string(s).expect("read a sibling header"));
    }
    let defs = parse(&text);
    assert!(defs.len() > 500, "{}: only {} PRM structs parsed", path.display(), defs.len());
    let mut layouts = std::collections::BTreeSet::new();
    for (f, buffer) in PRM_FIELDS {
        let def = defs
            .get(f.layout)
            .unwrap_or_else(|| panic!("mlx5_ifc_{}_bits not in {}", f.layout, path.display()));
        let (bit, width) = locate(&defs, def, f.path, 0)
            .unwrap_or_else(|| panic!("{}.{} not found in mlx5_ifc_{}_bits", f.layout, f.path, f.layout));
        assert_eq!(
            (bit, width),
            (f.bit, f.width),
            "{}.{}: the kernel header has bit {bit:#x} width {width:#x}, rdmakit uses bit {:#x} width {:#x}",
            f.layout,
            f.path,
            f.bit,
            f.width
        );
        let size = size(&defs, def).unwrap_or_else(|| panic!("mlx5_ifc_{}_bits: size unknown", f.layout));
        assert!(
            size <= buffer * 8,
            "{}: the kernel's layout is {size:#x} bits, rdmakit's buffer {buffer} bytes",
            f.layout
        );
        layouts.insert(f.layout);
    }
    // The whole input of each command: rdmakit's buffer is exactly the layout.
    for (layout, bytes) in [
        ("query_hca_cap_in", HCA_CAP_IN_BYTES),
        ("allow_other_vhca_access_in", ALLOW_IN_BYTES),
        ("create_alias_obj_in", ALIAS_IN_BYTES),
    ] {
        assert_eq!(size(&defs, &defs[layout]), Some(bytes * 8), "{layout}: buffer size");
    }
    // The opcodes and the object type, from the header's enums.
    for (name, value) in [
        ("MLX5_CMD_OP_QUERY_HCA_CAP", u64::from(OP_QUERY_HCA_CAP)),
        ("MLX5_CMD_OP_CREATE_GENERAL_OBJECT", u64::from(OP_CREATE_GENERAL_OBJECT)),
        ("MLX5_CMD_OP_ALLOW_OTHER_VHCA_ACCESS", u64::from(OP_ALLOW_OTHER_VHCA_ACCESS)),
        ("MLX5_OBJ_TYPE_MKEY", u64::from(OBJ_TYPE_MKEY)),
        ("MLX5_CMD_OP_CREATE_MKEY", u64::from(OP_CREATE_MKEY)),
        ("MLX5_MKC_ACCESS_MODE_KSM", ACCESS_MODE_KSM),
    ] {
        assert_eq!(enum_value(&text, name), Some(value), "{name}");
    }
    println!(
        "PRM check: {} fields of {} layouts and 6 constants match {} ({} structs parsed)",
        PRM_FIELDS.len(),
        layouts.len(),
        path.display(),
        defs.len()
    );
}

// ---- a parser for the `mlx5_ifc_*_bits` dialect of C ----

/// A struct or union of `mlx5_ifc.h`: `u8 name[bits]` members, nested named types, and
/// anonymous inline structs/unions.
#[derive(Debug, Default)]
struct Def {
    union: bool,
    members: Vec<Member>,
}

#[derive(Debug)]
struct Member {
    /// `None` for an anonymous inline struct/union, whose members are reached directly.
    name: Option<String>,
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    /// `u8 name[a]` or `u8 name[a][b]`: `a` (times `b`) bits; `None` when a dimension is an
    /// expression this parser does not evaluate (the layout past it is then unknown).
    Bits(Option<usize>),
    /// `struct mlx5_ifc_T_bits name[n]` (n = 1 without brackets).
    Named(String, Option<usize>),
    Inline(Box<Def>),
}

fn tokens(text: &str) -> Vec<String> {
    // Comments and preprocessor lines out first.
    let mut clean = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("/*") {
        clean.push_str(&rest[..i]);
        rest = rest[i..].find("*/").map_or("", |j| &rest[i + j + 2..]);
    }
    clean.push_str(rest);
    let clean: String = clean
        .lines()
        .map(|l| if l.trim_start().starts_with('#') { "" } else { l.split("//").next().unwrap_or("") })
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    let mut cur = String::new();
    for c in clean.chars() {
        if c.is_ascii_alphanumeric() || c == '_' {
            cur.push(c);
        } else {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            if !c.is_whitespace() {
                out.push(c.to_string());
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// `[n]` at `t[i]` (`None` for an expression), or `[]` (a flexible array: 0 in the fixed
/// layout); the index past `]`.
fn dimension(t: &[String], i: usize) -> (Option<usize>, usize) {
    if t[i + 1] == "]" {
        return (Some(0), i + 2);
    }
    let close = i + t[i..].iter().position(|x| x == "]").expect("`[` closed");
    let n = if close == i + 2 { number(&t[i + 1]) } else { None };
    (n, close + 1)
}

thread_local! {
    /// The header's named constants, for the array dimensions of the header being parsed.
    static CONSTS: std::cell::RefCell<Consts> = std::cell::RefCell::default();
}

fn number(t: &str) -> Option<usize> {
    parse_number(t).or_else(|| CONSTS.with(|c| c.borrow().get(t).copied()))
}

/// Named constants an array dimension may use: enum values (`NAME = 0x7`) and plain
/// `#define NAME 0x7` lines.
type Consts = HashMap<String, usize>;

fn constants(text: &str, t: &[String]) -> Consts {
    let mut c = Consts::new();
    for w in t.windows(3) {
        if w[1] == "="
            && w[2].starts_with(|ch: char| ch.is_ascii_digit())
            && let Some(v) = parse_number(&w[2])
        {
            c.insert(w[0].clone(), v);
        }
    }
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if let (Some("#define"), Some(name), Some(v), None) =
            (words.next(), words.next(), words.next(), words.next())
            && let Some(v) = parse_number(v)
        {
            c.insert(name.to_string(), v);
        }
    }
    c
}

fn parse_number(t: &str) -> Option<usize> {
    match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => usize::from_str_radix(hex, 16).ok(),
        None => t.parse().ok(),
    }
}

/// Every top-level `struct|union mlx5_ifc_<name>_bits { ... };`, by `<name>`.
fn parse(text: &str) -> HashMap<String, Def> {
    let t = tokens(text);
    let consts = constants(text, &t);
    CONSTS.with(|c| *c.borrow_mut() = consts);
    let mut defs = HashMap::new();
    let mut i = 0;
    while i + 2 < t.len() {
        if (t[i] == "struct" || t[i] == "union") && t[i + 1].starts_with("mlx5_ifc_") && t[i + 2] == "{" {
            let name = t[i + 1].trim_start_matches("mlx5_ifc_").trim_end_matches("_bits").to_string();
            let (def, next) = body(&t, i + 3, t[i] == "union");
            defs.insert(name, def);
            i = next;
        } else {
            i += 1;
        }
    }
    defs
}

/// Parses members from `t[i]` (just after `{`) to the matching `}`; returns the index just
/// past that `}`.
fn body(t: &[String], mut i: usize, union: bool) -> (Def, usize) {
    let mut def = Def { union, members: Vec::new() };
    while t[i] != "}" {
        match t[i].as_str() {
            "u8" => {
                let name = t[i + 1].clone();
                let mut bits = Some(1);
                i += 2;
                while t[i] == "[" {
                    // `[]`: a flexible array at the end, no bits of the fixed layout.
                    let (n, next) = dimension(t, i);
                    bits = bits.zip(n).map(|(a, b)| a * b);
                    i = next;
                }
                def.members.push(Member { name: Some(name), kind: Kind::Bits(bits) });
            }
            "struct" | "union" if t[i + 1] == "{" => {
                let (inner, next) = body(t, i + 2, t[i] == "union");
                i = next;
                let name = (t[i] != ";").then(|| t[i].clone());
                if name.is_some() {
                    i += 1;
                }
                def.members.push(Member { name, kind: Kind::Inline(Box::new(inner)) });
            }
            "struct" | "union" => {
                let ty = t[i + 1].trim_start_matches("mlx5_ifc_").trim_end_matches("_bits").to_string();
                let name = t[i + 2].clone();
                i += 3;
                let mut count = Some(1);
                while t[i] == "[" {
                    let (n, next) = dimension(t, i);
                    count = count.zip(n).map(|(a, b)| a * b);
                    i = next;
                }
                def.members.push(Member { name: Some(name), kind: Kind::Named(ty, count) });
            }
            // `DECLARE_FLEX_ARRAY(type, name);`: a flexible array, no bits of the fixed layout.
            "DECLARE_FLEX_ARRAY" => {
                let close = i + t[i..].iter().position(|x| x == ")").expect("DECLARE_FLEX_ARRAY(...) closed");
                def.members.push(Member { name: Some(t[close - 1].clone()), kind: Kind::Bits(Some(0)) });
                i = close + 1;
            }
            other => panic!("unexpected token {other:?} in a PRM struct"),
        }
        assert_eq!(t[i], ";", "member not closed by ';'");
        i += 1;
    }
    // Past the `}`: what follows (`;`, or a member name for an inline body) is the caller's.
    (def, i + 1)
}

/// A member's width in bits; `None` when it depends on an expression the parser skipped.
fn member_bits(defs: &HashMap<String, Def>, m: &Member) -> Option<usize> {
    match &m.kind {
        Kind::Bits(b) => *b,
        Kind::Named(ty, n) => Some(size(defs, defs.get(ty)?)? * (*n)?),
        Kind::Inline(d) => size(defs, d),
    }
}

fn size(defs: &HashMap<String, Def>, d: &Def) -> Option<usize> {
    let mut sizes = d.members.iter().map(|m| member_bits(defs, m));
    if d.union { sizes.try_fold(0, |a, s| Some(a.max(s?))) } else { sizes.sum() }
}

/// Bit offset (from the start of `d`, plus `base`) and width of `path` in `d`.
fn locate(defs: &HashMap<String, Def>, d: &Def, path: &str, base: usize) -> Option<(usize, usize)> {
    let (first, rest) = match path.split_once('.') {
        Some((a, b)) => (a, Some(b)),
        None => (path, None),
    };
    let mut offset = base;
    for m in &d.members {
        let bits = member_bits(defs, m)?;
        match (&m.name, &m.kind) {
            (None, Kind::Inline(inner)) => {
                if let Some(found) = locate(defs, inner, path, offset) {
                    return Some(found);
                }
            }
            (Some(name), kind) if name == first => {
                return match (rest, kind) {
                    (None, _) => Some((offset, bits)),
                    (Some(rest), Kind::Named(ty, _)) => locate(defs, defs.get(ty)?, rest, offset),
                    (Some(rest), Kind::Inline(inner)) => locate(defs, inner, rest, offset),
                    (Some(_), Kind::Bits(_)) => None,
                };
            }
            _ => {}
        }
        if !d.union {
            offset += bits;
        }
    }
    None
}

/// `NAME = value` inside an enum of the header.
fn enum_value(text: &str, name: &str) -> Option<u64> {
    let t = tokens(text);
    let i = t.iter().position(|x| x == name)?;
    if t.get(i + 1)? != "=" {
        return None;
    }
    parse_number(t.get(i + 2)?).map(|v| v as u64)
}

#[test]
fn the_parser_reads_nesting_unions_and_arrays() {
    let h = "
        struct mlx5_ifc_inner_bits { u8 a[0x4]; u8 b[0xc]; };
        /* a comment */
        struct mlx5_ifc_outer_bits {
            u8 x[0x10];
            union { u8 raw[0x20]; u8 k[2][0x10]; };
            struct mlx5_ifc_inner_bits in[2];
            union { struct mlx5_ifc_inner_bits p; u8 q[0x8]; } u;
        };
        enum { MLX5_THING = 0x2a, };
    ";
    let defs = parse(h);
    let outer = &defs["outer"];
    assert_eq!(size(&defs, outer), Some(0x10 + 0x20 + 0x20 + 0x10));
    assert_eq!(locate(&defs, outer, "raw", 0), Some((0x10, 0x20)));
    assert_eq!(locate(&defs, outer, "k", 0), Some((0x10, 0x20)));
    assert_eq!(locate(&defs, outer, "in", 0), Some((0x30, 0x20)));
    assert_eq!(locate(&defs, outer, "in.b", 0), Some((0x34, 0xc)));
    assert_eq!(locate(&defs, outer, "u.p.b", 0), Some((0x54, 0xc)));
    assert_eq!(locate(&defs, outer, "nope", 0), None);
    assert_eq!(enum_value(h, "MLX5_THING"), Some(0x2a));
}

/// The KSM CREATE_MKEY command as MEMIC builds it: one entity (the whole zero-based DM
/// registration) at the reserved address, the access bits of the flags, the entry after the
/// fixed part of the command.
#[test]
fn ksm_create_mkey_command_carries_the_region() {
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
    let cmd = create_ksm_cmd(0x42, 0x7f00_dead_0000, 12, &[(0x1234_5601, 0)], access, 0x9a).unwrap();
    assert_eq!(cmd.len(), 272 + 16);
    assert_eq!(get(&cmd, CM_OPCODE), 0x200);
    assert_eq!(get(&cmd, CM_ACCESS_MODE_1_0), ACCESS_MODE_KSM);
    assert_eq!(
        [CM_ACCESS_LR, CM_ACCESS_LW, CM_ACCESS_RR, CM_ACCESS_RW, CM_ACCESS_A].map(|f| get(&cmd, f)),
        [1, 1, 1, 0, 1]
    );
    assert_eq!(get(&cmd, CM_PD), 0x42);
    assert_eq!(get(&cmd, CM_START_ADDR), 0x7f00_dead_0000);
    assert_eq!(get(&cmd, CM_LEN), 4096, "one entity of 2^12 bytes");
    assert_eq!((get(&cmd, CM_TRANSLATIONS), get(&cmd, CM_TRANSLATIONS_ACTUAL)), (1, 1));
    assert_eq!(get(&cmd, CM_LOG_ENTITY), 12);
    assert_eq!((get(&cmd, CM_QPN), get(&cmd, CM_MKEY_7_0)), (0xff_ffff, 0x9a));
    assert_eq!(&cmd[272..288], &[0, 0, 0, 0, 0x12, 0x34, 0x56, 0x01, 0, 0, 0, 0, 0, 0, 0, 0]);
    // A length that does not fit 64 bits is an error, not a wrapped key.
    assert!(create_ksm_cmd(1, 0, 63, &[(1, 0), (2, 0)], access, 0).is_err());
}
