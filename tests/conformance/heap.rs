//! Conformance cases for remote heaps (rmalloc/rfree) carried over a connected QP pair.

use crate::cases::Case;

/// The heap cases, run on both providers by `main`.
pub const CASES: &[Case] = &[];
