//! rdmakit-channel: async one-sided transfers on top of `rdmakit-verbs`.
//!
//! Two seed designs: rpipe-style [`pipe`]s (`rwrite`/`rread` with notification flags, over
//! the remote heaps of `rdmakit-memory`) and CkDirect-style persistent [`put`] handles.

pub mod pipe;
pub mod put;
