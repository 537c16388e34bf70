//! Copies into and out of memory that a NIC or a peer may access at the same time.
//!
//! Registered memory is shared with "someone else": a real HCA writing it by DMA, or the
//! soft NIC's engine writing it from another thread. Plain `memcpy` over such memory is a
//! data race in Rust's memory model if the other side is Rust code (the soft NIC), so every
//! access to registered bytes goes through this module, which performs a *byte-wise atomic*
//! copy (the semantics of C++ proposal P1478 `atomic_load_per_byte_memcpy`): each byte is
//! read or written as a relaxed atomic, so a racing access yields torn data, never undefined
//! behaviour.
//!
//! On x86-64 the bulk is done with `rep movsb` in inline assembly, which the hardware defines
//! as exactly that (byte-granular, each access atomic at its own size) and which runs at
//! `memcpy` speed on CPUs with ERMSB/FSRM. Elsewhere, and under Miri (which cannot run inline
//! assembly), an aligned `AtomicU64` loop with `AtomicU8` edges is used.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

/// Copies `len` bytes from `src` to `dst`, either or both of which may be concurrently
/// accessed by other threads (or a device) through atomic or byte-wise atomic accesses.
///
/// # Safety
/// `src` must be valid for reads and `dst` valid for writes of `len` bytes for the whole
/// call, and the two ranges must not overlap. Neither range may be concurrently accessed
/// through non-atomic Rust references (`&[u8]`/`&mut [u8]`) by other threads.
#[inline]
pub(crate) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    if len == 0 {
        return;
    }
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    {
        // SAFETY: the caller guarantees both ranges are valid for `len` bytes and disjoint.
        // `rep movsb` copies forward (DF is clear per the ABI) with byte-granular accesses
        // that the hardware performs atomically, which is the byte-wise atomic copy this
        // module promises. It touches only rdi/rsi/rcx, declared as clobbered/in-out.
        unsafe {
            std::arch::asm!(
                "rep movsb",
                inout("rcx") len => _,
                inout("rdi") dst => _,
                inout("rsi") src => _,
                options(nostack, preserves_flags)
            );
        }
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    {
        // SAFETY: forwarded contract.
        unsafe { copy_atomic_loop(src, dst, len) }
    }
}

/// Portable byte-wise atomic copy: `AtomicU64` for the 8-aligned middle when both sides
/// share an alignment, `AtomicU8` otherwise.
///
/// # Safety
/// As for [`copy`].
#[cfg_attr(all(target_arch = "x86_64", not(miri), not(test)), allow(dead_code))]
unsafe fn copy_atomic_loop(src: *const u8, dst: *mut u8, len: usize) {
    let mut i = 0usize;
    let same_phase = (src as usize) % 8 == (dst as usize) % 8;
    if same_phase {
        // Head: bytes until `src + i` is 8-aligned.
        while i < len && (src as usize + i) % 8 != 0 {
            // SAFETY: `i < len`, so both pointers are in range; byte atomics need no
            // alignment.
            unsafe { copy_byte(src.add(i), dst.add(i)) };
            i += 1;
        }
        while i + 8 <= len {
            // SAFETY: both addresses are 8-aligned (same phase, head consumed) and in range;
            // the memory is only accessed atomically by others per the contract.
            unsafe {
                let s = AtomicU64::from_ptr(src.add(i) as *mut u64);
                let d = AtomicU64::from_ptr(dst.add(i) as *mut u64);
                d.store(s.load(Ordering::Relaxed), Ordering::Relaxed);
            }
            i += 8;
        }
    }
    while i < len {
        // SAFETY: `i < len`; byte atomics need no alignment.
        unsafe { copy_byte(src.add(i), dst.add(i)) };
        i += 1;
    }
}

/// # Safety
/// Both pointers valid for one byte; accesses by others are atomic.
#[inline]
unsafe fn copy_byte(src: *const u8, dst: *mut u8) {
    // SAFETY: forwarded contract; `AtomicU8` has alignment 1.
    unsafe {
        let s = AtomicU8::from_ptr(src as *mut u8);
        let d = AtomicU8::from_ptr(dst);
        d.store(s.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// Fills `len` bytes at `dst` with `byte`, byte-wise atomically.
///
/// # Safety
/// `dst` valid for writes of `len` bytes; other accesses to it are atomic.
pub(crate) unsafe fn fill(dst: *mut u8, byte: u8, len: usize) {
    let chunk = [byte; 256];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(chunk.len());
        // SAFETY: `chunk` is a private stack array; `dst + done .. + n` is in range.
        unsafe { copy(chunk.as_ptr(), dst.add(done), n) };
        done += n;
    }
}

/// Returns the 64-bit atomic cell at `ptr`, for NIC atomics on shared memory.
///
/// # Safety
/// `ptr` must be 8-aligned and valid for reads and writes of 8 bytes for `'a`, and all
/// concurrent accesses to those bytes must be atomic.
pub(crate) unsafe fn atomic_u64<'a>(ptr: *mut u8) -> &'a AtomicU64 {
    debug_assert_eq!(ptr as usize % 8, 0);
    // SAFETY: forwarded contract.
    unsafe { AtomicU64::from_ptr(ptr as *mut u64) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(len: usize, soff: usize, doff: usize) {
        let src: Vec<u8> = (0..len + 16).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; len + 16];
        let mut dst2 = vec![0u8; len + 16];
        // SAFETY: private vectors, in range, disjoint.
        unsafe {
            copy(src.as_ptr().add(soff), dst.as_mut_ptr().add(doff), len);
            copy_atomic_loop(src.as_ptr().add(soff), dst2.as_mut_ptr().add(doff), len);
        }
        assert_eq!(&dst[doff..doff + len], &src[soff..soff + len]);
        assert_eq!(dst, dst2);
        assert!(dst[..doff].iter().all(|&b| b == 0));
        assert!(dst[doff + len..].iter().all(|&b| b == 0));
    }

    #[test]
    fn copies_every_alignment_and_length() {
        for len in [0, 1, 7, 8, 9, 63, 64, 65, 200] {
            for soff in 0..8 {
                for doff in 0..8 {
                    check(len, soff, doff);
                }
            }
        }
    }

    #[test]
    fn fill_sets_exactly_the_range() {
        let mut v = vec![1u8; 600];
        // SAFETY: private vector, in range.
        unsafe { fill(v.as_mut_ptr().add(3), 0xab, 590) };
        assert_eq!(v[2], 1);
        assert!(v[3..593].iter().all(|&b| b == 0xab));
        assert_eq!(v[593], 1);
    }

    #[test]
    fn concurrent_atomic_access_is_not_a_race() {
        // Under Miri this checks the claim of the module: a reader copying while a writer
        // stores atomically is race-free (it may observe torn data, never UB).
        let cells: Vec<AtomicU64> = (0..16).map(|_| AtomicU64::new(0)).collect();
        let base = cells.as_ptr() as usize;
        std::thread::scope(|s| {
            s.spawn(|| {
                for round in 1..20u64 {
                    for c in &cells {
                        c.store(round, Ordering::Relaxed);
                    }
                }
            });
            let mut out = [0u8; 128];
            for _ in 0..20 {
                // SAFETY: `cells` lives for the scope; other accesses are atomic.
                unsafe { copy(base as *const u8, out.as_mut_ptr(), 128) };
            }
        });
    }
}
