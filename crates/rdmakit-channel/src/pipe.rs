//! rpipe-style pipes (being built).
