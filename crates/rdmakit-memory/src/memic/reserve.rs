//! A reserved, inaccessible range of virtual addresses (`mmap(PROT_NONE)`).
//!
//! A MEMIC region's RDMA address lies in such a range: no host mapping can take those
//! addresses while the region lives, so the address is unique in the process, and a stray
//! CPU access through it faults instead of touching something else.

use rdmakit_verbs::{Error, Result};

/// `len` bytes of address space, reserved with no access; unmapped on drop.
#[derive(Debug)]
pub(crate) struct Reservation {
    addr: usize,
    len: usize,
}

impl Reservation {
    pub(crate) fn new(len: u64) -> Result<Reservation> {
        let len = usize::try_from(len).map_err(|_| Error::InvalidArgument("reservation too large".into()))?;
        if len == 0 {
            return Err(Error::InvalidArgument("empty reservation".into()));
        }
        // SAFETY: a fresh anonymous mapping chosen by the kernel (no fixed address), with no
        // access: it cannot alias or change any memory of the program.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::Os { call: "mmap(PROT_NONE)", source: std::io::Error::last_os_error() });
        }
        Ok(Reservation { addr: p as usize, len })
    }

    pub(crate) fn addr(&self) -> u64 {
        self.addr as u64
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping `new` created, unmapped once; nothing dereferences it
        // (it is PROT_NONE), so no reference into it can outlive it.
        let rc = unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
        if rc != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "munmap of a MEMIC reservation failed");
        }
    }
}
