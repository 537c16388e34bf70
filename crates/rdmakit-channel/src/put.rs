//! CkDirect-style persistent put handles (being built).
