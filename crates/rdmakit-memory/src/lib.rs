//! rdmakit-memory: NIC memory management on top of `rdmakit-verbs`.
//!
//! **Status: not built yet.** This crate will hold MEMIC regions (NIC on-chip memory mapped
//! through an indirect key), the cross-GVMI UMR mkey pool with its alias map, and
//! asymmetric remote heaps (rmalloc/rfree). It exists now so the workspace layout shows the
//! architecture; it exports nothing until that work lands.
