//! rdmakit-channel: async one-sided transfers on top of `rdmakit-verbs`.
//!
//! **Status: not built yet.** This crate will hold rpipe-style `rwrite`/`rread` pipes with
//! notification flags and CkDirect-style persistent put handles. It exists now so the
//! workspace layout shows the architecture; it exports nothing until that work lands.
