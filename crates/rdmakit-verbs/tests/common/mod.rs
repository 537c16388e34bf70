//! Helpers shared by this crate's integration tests.

/// `len` bytes of fresh anonymous memory of our own (for `register_raw`), unmapped by the
/// caller.
pub fn anonymous(len: usize) -> *mut libc::c_void {
    // SAFETY: a plain anonymous mapping, no address asked for.
    let mem = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(mem, libc::MAP_FAILED);
    mem
}
