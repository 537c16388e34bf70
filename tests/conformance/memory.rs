//! Conformance cases for the memory crate's device-memory features (MEMIC placement and its
//! host fallback on devices without device memory).

use crate::cases::Case;

/// The memory cases, run on both providers by `main`.
pub const CASES: &[Case] = &[];
