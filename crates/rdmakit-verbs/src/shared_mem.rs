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
//! On x86-64 the copy is `rep movsb` in inline assembly, which the hardware defines as
//! exactly that (byte-granular, each access atomic) and which runs at `memcpy` speed on CPUs
//! with ERMSB/FSRM. Elsewhere (aarch64 DPUs) and under Miri, which cannot run assembly, every
//! access to shared memory is an aligned `AtomicU64` operation (partial words merged by
//! compare-exchange), so copies never race mixed-size with the NIC's 8-byte atomics.
//!
//! What the x86-64 path relies on is the hardware's definition, not Rust's: Rust's model
//! calls an atomic access racing another atomic access *of a different size* undefined
//! (even where the hardware does not), and a byte-wise copy can race the soft NIC's 8-byte
//! atomics (a peer's fetch-and-add on a word the application writes at the same time, or
//! a sequence word loaded while a write lands). On x86-64 that race is defined: each byte
//! access is atomic and an aligned 8-byte locked operation is atomic as a whole, so the
//! outcome is a torn or an untorn value, as on a NIC. A target without that guarantee uses
//! the word path, which has no mixed-size race at all.
//!
//! **Order.** A copy into shared memory stores the *last aligned word* it touches last,
//! with release ordering, after the rest (the bulk) is stored. Protocols that poll a
//! sequence word placed at the end of a write (a pipe's flag-mode mailbox, a put handle's
//! sequence word) load it with acquire ordering (`MemoryRegion::load_u64_acquire`): once the
//! reader sees the word, every other byte of that write is visible to it. Nothing in the
//! order of the bulk itself is promised: a build with `--cfg rdmakit_reverse_copy` copies
//! the bulk back to front to prove that nothing relies on it.
//!
//! That needs the *padding invariant*: registered memory lies in an allocation that starts
//! 8-byte aligned and whose size is a multiple of 8, so every aligned word touching a
//! region is inside its allocation. `mr::HostBuffer` and `soft::dm::DmPool` ensure it.

use std::sync::atomic::{AtomicU64, Ordering};

/// The source of a copy: registered memory that others may access concurrently, or the
/// caller's own bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Src {
    /// Registered memory (see the module's padding invariant).
    Shared(*const u8),
    /// Memory only this thread accesses during the copy (a `&[u8]`, a stack buffer).
    Private(*const u8),
}

/// The destination of a copy; see [`Src`].
#[derive(Clone, Copy, Debug)]
pub(crate) enum Dst {
    /// Registered memory (see the module's padding invariant).
    Shared(*mut u8),
    /// Memory only this thread accesses during the copy.
    Private(*mut u8),
}

impl Src {
    /// The address, whichever kind.
    pub(crate) fn ptr(self) -> *const u8 {
        match self {
            Src::Shared(p) | Src::Private(p) => p,
        }
    }

    /// The same kind of memory `n` bytes further.
    pub(crate) fn add(self, n: usize) -> Src {
        match self {
            Src::Shared(p) => Src::Shared(p.wrapping_add(n)),
            Src::Private(p) => Src::Private(p.wrapping_add(n)),
        }
    }
}

impl Dst {
    fn ptr(self) -> *mut u8 {
        match self {
            Dst::Shared(p) | Dst::Private(p) => p,
        }
    }

    #[cfg_attr(not(any(rdmakit_reverse_copy, test)), allow(dead_code))]
    fn add(self, n: usize) -> Dst {
        match self {
            Dst::Shared(p) => Dst::Shared(p.wrapping_add(n)),
            Dst::Private(p) => Dst::Private(p.wrapping_add(n)),
        }
    }
}

/// Copies `len` bytes from `src` to `dst`.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `len` bytes for the whole call.
/// The ranges may overlap only when both are `Shared` (a loopback write within one region:
/// every byte is then read and written atomically, and what an overlapped byte ends up
/// holding is unspecified, as on a NIC); a `Private` range must not overlap the other.
/// `Private` memory must not be accessed by anyone else during the call. `Shared` memory
/// must satisfy the padding invariant: it lies in an allocation that starts 8-byte aligned
/// and whose size is a multiple of 8, and others access it only atomically (through this
/// module or [`atomic_u64`]).
#[inline]
pub(crate) unsafe fn copy(src: Src, dst: Dst, len: usize) {
    // SAFETY: forwarded contract.
    unsafe { copy_with(src, dst, len, false) }
}

/// [`copy`] for memory whose lines another core touched last (a ring shared with another
/// process): vector loads and stores instead of `rep movsb`, which was measured at a third
/// of their speed there (a two-thread ring of 64 KiB messages in C on the development
/// machine: glibc `memcpy` 17 GB/s, `rep movsb` 13; the soft NIC's same-host rings went
/// from 2.5-4.7 to 5.3-5.8 GB/s with vectors).
///
/// # Safety
/// As for [`copy`].
#[inline]
pub(crate) unsafe fn copy_across_cores(src: Src, dst: Dst, len: usize) {
    // SAFETY: forwarded contract.
    unsafe { copy_with(src, dst, len, true) }
}

/// Receives up to `len` bytes from socket `fd` (`recv(2)`, `MSG_DONTWAIT`) straight into
/// shared memory at `dst`: the kernel writes them as a NIC's DMA does, from outside the
/// program, in no promised order and without [`copy`]'s last-word release (a caller that
/// needs it holds the last word back and lands it with [`copy`] afterwards). `Ok(0)`: the
/// peer closed the stream.
///
/// # Safety
/// `dst` must be valid for writes of `len` bytes for the whole call and satisfy the
/// padding invariant (see [`copy`]).
pub(crate) unsafe fn recv(fd: std::os::fd::RawFd, dst: *mut u8, len: usize) -> std::io::Result<usize> {
    // SAFETY: the caller vouches for `dst`; the kernel writes at most `len` bytes there.
    let n = unsafe { libc::recv(fd, dst.cast(), len, libc::MSG_DONTWAIT) };
    if n < 0 { Err(std::io::Error::last_os_error()) } else { Ok(n as usize) }
}

#[inline]
unsafe fn copy_with(src: Src, dst: Dst, len: usize, vectors: bool) {
    if len == 0 {
        return;
    }
    match dst {
        Dst::Private(_) => {
            // SAFETY: forwarded contract.
            unsafe { bulk(src, dst, len, vectors) }
        }
        Dst::Shared(d) => {
            // The bytes in the last aligned word the copy touches go last, with release.
            let end = (d as usize).wrapping_add(len);
            let tail = (end - 1) & !7;
            let head = tail.saturating_sub(d as usize).min(len);
            // SAFETY: `head <= len`: the first `head` bytes of both ranges (caller's contract).
            unsafe { bulk(src, dst, head, vectors) };
            // SAFETY: the remaining `len - head` (1..=8) bytes lie in the one aligned word at
            // `d + head - (d + head) % 8`, inside the shared allocation (padding invariant).
            unsafe { store_last_word(src.add(head), d.wrapping_add(head), len - head) };
        }
    }
}

/// Stores `n` bytes (all within one aligned word) from `src` into shared memory at `d`,
/// as one atomic read-modify-write (or store) with release ordering.
///
/// # Safety
/// As for [`copy`] with a `Shared` destination, for `n` bytes that share an aligned word.
unsafe fn store_last_word(src: Src, d: *mut u8, n: usize) {
    let off = d as usize % 8;
    debug_assert!(n >= 1 && off + n <= 8);
    let mut word = [0u8; 8];
    // SAFETY: `n` bytes of `src` are in range (caller).
    unsafe { gather(src, &mut word[off..off + n]) };
    // SAFETY: the aligned word holding `d` lies inside the shared allocation (padding
    // invariant) and every other access to it is atomic.
    let cell = unsafe { atomic_u64(d.wrapping_sub(off)) };
    if n == 8 {
        cell.store(u64::from_ne_bytes(word), Ordering::Release);
    } else {
        let _ = cell.fetch_update(Ordering::Release, Ordering::Relaxed, |cur| {
            let mut w = cur.to_ne_bytes();
            w[off..off + n].copy_from_slice(&word[off..off + n]);
            Some(u64::from_ne_bytes(w))
        });
    }
}

/// The bulk of a copy, in no promised order.
///
/// # Safety
/// As for [`copy`].
#[inline]
unsafe fn bulk(src: Src, dst: Dst, len: usize, vectors: bool) {
    // Only x86-64 has the two strategies.
    let _ = vectors;
    if len == 0 {
        return;
    }
    #[cfg(rdmakit_reverse_copy)]
    {
        // SAFETY: forwarded contract.
        unsafe { copy_backwards(src, dst, len) }
    }
    #[cfg(all(target_arch = "x86_64", not(miri), not(rdmakit_reverse_copy)))]
    {
        if len >= VECTOR_MIN && (vectors || aliases_4k(src.ptr(), dst.ptr())) {
            // SAFETY: forwarded contract.
            unsafe { copy_vectors(src.ptr(), dst.ptr(), len) };
            return;
        }
        // SAFETY: both ranges are valid for `len` bytes and disjoint (caller); `rep movsb` copies
        // forward (DF clear per the ABI), each byte access atomic in hardware — the byte-wise
        // atomic copy promised — touching only rdi/rsi/rcx, declared in-out.
        unsafe {
            std::arch::asm!(
                "rep movsb",
                inout("rcx") len => _,
                inout("rdi") dst.ptr() => _,
                inout("rsi") src.ptr() => _,
                options(nostack, preserves_flags)
            );
        }
    }
    #[cfg(all(not(all(target_arch = "x86_64", not(miri))), not(rdmakit_reverse_copy)))]
    {
        // SAFETY: forwarded contract.
        unsafe { copy_words(src, dst, len) }
    }
}

/// Copies at least this long go through [`copy_vectors`] when [`aliases_4k`] (or asked to).
#[cfg(all(target_arch = "x86_64", not(miri)))]
const VECTOR_MIN: usize = 256;

/// Whether the destination lies just above the source modulo 4 KiB (by 1 to 63 bytes):
/// there `rep movsb` runs an order of magnitude slower (each store's address aliases a load
/// just ahead of it). Measured on the development machine (AMD EPYC), 64 KiB copies from a
/// page-aligned source: 34-40 GB/s at destination offsets 0 and 37-4095, 2.7 GB/s at 1-16.
/// A byte stream with frame headers (the same-host rings, a read buffer) lands payloads at
/// every offset, so this case comes up all the time there.
#[cfg(all(target_arch = "x86_64", not(miri)))]
#[inline]
fn aliases_4k(src: *const u8, dst: *const u8) -> bool {
    let d = (dst as usize).wrapping_sub(src as usize) & 4095;
    d != 0 && d < 64
}

/// A forward copy with 16-byte vector loads and stores, 64 bytes per turn, then `rep
/// movsb` for the rest: the same byte-granular accesses (each byte read and written once,
/// by one instruction), without `rep movsb`'s aliasing stall.
///
/// # Safety
/// As for [`copy`], and `len >= 64`.
#[cfg(all(target_arch = "x86_64", not(miri)))]
unsafe fn copy_vectors(src: *const u8, dst: *mut u8, len: usize) {
    debug_assert!(len >= 64);
    // SAFETY: both ranges are valid for `len` bytes and disjoint (caller); the loop reads
    // and writes `64 * (len / 64)` bytes forward, `rep movsb` the remaining `len % 64`;
    // only the declared registers are touched.
    unsafe {
        std::arch::asm!(
            "2:",
            "movdqu xmm0, xmmword ptr [rsi]",
            "movdqu xmm1, xmmword ptr [rsi + 16]",
            "movdqu xmm2, xmmword ptr [rsi + 32]",
            "movdqu xmm3, xmmword ptr [rsi + 48]",
            "movdqu xmmword ptr [rdi], xmm0",
            "movdqu xmmword ptr [rdi + 16], xmm1",
            "movdqu xmmword ptr [rdi + 32], xmm2",
            "movdqu xmmword ptr [rdi + 48], xmm3",
            "add rsi, 64",
            "add rdi, 64",
            "dec rdx",
            "jnz 2b",
            "rep movsb",
            inout("rdx") len / 64 => _,
            inout("rcx") len % 64 => _,
            inout("rdi") dst => _,
            inout("rsi") src => _,
            out("xmm0") _,
            out("xmm1") _,
            out("xmm2") _,
            out("xmm3") _,
            options(nostack)
        );
    }
}

/// The bulk copied back to front, one aligned word (or part of one) at a time: a test
/// build's proof that no protocol relies on the bulk's order.
///
/// # Safety
/// As for [`copy`].
#[cfg(any(rdmakit_reverse_copy, test))]
unsafe fn copy_backwards(src: Src, dst: Dst, len: usize) {
    let mut end = len;
    while end > 0 {
        let at = (dst.ptr() as usize).wrapping_add(end - 1);
        let n = (at % 8 + 1).min(end);
        // SAFETY: `end - n .. end` is within the `len` bytes of both ranges.
        unsafe { copy_words(src.add(end - n), dst.add(end - n), n) };
        end -= n;
    }
}

/// Portable copy in which every access to shared memory is an aligned `AtomicU64`
/// operation, so it never races mixed-size with the NIC's 8-byte atomics.
///
/// # Safety
/// As for [`copy`].
#[cfg_attr(all(target_arch = "x86_64", not(miri), not(test), not(rdmakit_reverse_copy)), allow(dead_code))]
unsafe fn copy_words(src: Src, dst: Dst, len: usize) {
    let mut i = 0;
    while i < len {
        let d = dst.ptr().wrapping_add(i);
        let off = d as usize % 8;
        let n = (8 - off).min(len - i);
        let mut word = [0u8; 8];
        // SAFETY: `i + n <= len`, so the source bytes are in range.
        unsafe { gather(src.add(i), &mut word[off..off + n]) };
        match dst {
            Dst::Private(_) => {
                // SAFETY: `d .. d + n` is in range and private to this call.
                unsafe { std::ptr::copy_nonoverlapping(word.as_ptr().add(off), d, n) }
            }
            Dst::Shared(_) => {
                let base = d.wrapping_sub(off);
                // SAFETY: `base` is the 8-aligned word holding `d`; by the padding invariant it
                // lies inside the shared allocation; all other accesses are atomic.
                let cell = unsafe { atomic_u64(base) };
                if n == 8 {
                    cell.store(u64::from_ne_bytes(word), Ordering::Relaxed);
                } else {
                    // Merge our bytes into the word, keeping the others' bytes.
                    let _ = cell.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |cur| {
                        let mut w = cur.to_ne_bytes();
                        w[off..off + n].copy_from_slice(&word[off..off + n]);
                        Some(u64::from_ne_bytes(w))
                    });
                }
            }
        }
        i += n;
    }
}

/// Reads `out.len()` (at most 8) bytes starting at `src`.
///
/// # Safety
/// As for [`copy`], for `out.len()` bytes of `src`.
unsafe fn gather(src: Src, out: &mut [u8]) {
    match src {
        // SAFETY: in range and private (caller's contract); `out` is a separate local.
        Src::Private(p) => unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) },
        Src::Shared(p) => {
            let off = p as usize % 8;
            let base = p.wrapping_sub(off);
            // The bytes span at most two aligned words.
            let mut two = [0u8; 16];
            let words = if off + out.len() > 8 { 2 } else { 1 };
            for w in 0..words {
                // SAFETY: each word overlaps the requested range, so by the padding invariant
                // it lies inside the shared allocation; accesses to it are atomic.
                let v = unsafe { atomic_u64(base.wrapping_add(8 * w) as *mut u8) }.load(Ordering::Relaxed);
                two[8 * w..8 * w + 8].copy_from_slice(&v.to_ne_bytes());
            }
            out.copy_from_slice(&two[off..off + out.len()]);
        }
    }
}

/// Fills `len` bytes of shared memory at `dst` with `byte`.
///
/// # Safety
/// As for [`copy`] with a `Shared` destination.
pub(crate) unsafe fn fill(dst: *mut u8, byte: u8, len: usize) {
    let chunk = [byte; 256];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(chunk.len());
        // SAFETY: `chunk` is a private stack array; `dst + done .. + n` is in range.
        unsafe { copy(Src::Private(chunk.as_ptr()), Dst::Shared(dst.add(done)), n) };
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
    unsafe { AtomicU64::from_ptr(ptr.cast::<u64>()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    // The vector path is x86-64 native code; under Miri this is the word path, tested above.
    #[cfg_attr(miri, ignore)]
    fn copies_where_the_destination_aliases_the_source_are_exact() {
        // Destinations 0..80 bytes above the source modulo 4 KiB (1..63 take the vector
        // path), lengths around the 64-byte turns and the vector threshold.
        let src: Vec<u8> = (0..12_288u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; 12_288 + 8192];
        let base = src.as_ptr() as usize % 4096;
        for rel in 0..80usize {
            for len in [255usize, 256, 257, 319, 320, 1000, 4096, 8191] {
                dst.fill(0);
                let at = (base + rel) % 4096 + 4096 - dst.as_ptr() as usize % 4096;
                // SAFETY: `src` and `dst[at..at + len]` are valid, private, disjoint.
                unsafe { copy(Src::Private(src.as_ptr()), Dst::Private(dst.as_mut_ptr().add(at)), len) };
                assert_eq!(&dst[at..at + len], &src[..len], "rel {rel} len {len}");
                assert!(
                    dst[..at].iter().chain(&dst[at + len..]).all(|&b| b == 0),
                    "rel {rel} len {len}: outside"
                );
            }
        }
    }

    /// An 8-aligned, 8-padded buffer standing in for registered memory.
    fn shared(len: usize) -> Vec<AtomicU64> {
        (0..len.div_ceil(8) + 2).map(|_| AtomicU64::new(0)).collect()
    }

    fn bytes(words: &[AtomicU64]) -> Vec<u8> {
        words.iter().flat_map(|w| w.load(Ordering::Relaxed).to_ne_bytes()).collect()
    }

    fn check(len: usize, soff: usize, doff: usize) {
        let data: Vec<u8> = (0..len + 16).map(|i| (i * 7 + 3) as u8).collect();
        // private -> shared, with both implementations
        let (a, b) = (shared(len + 16), shared(len + 16));
        let ap = a.as_ptr().cast::<u8>() as *mut u8;
        let bp = b.as_ptr().cast::<u8>() as *mut u8;
        // SAFETY: in range; `a`/`b` are only accessed atomically; `data` is private.
        unsafe {
            copy(Src::Private(data.as_ptr().add(soff)), Dst::Shared(ap.add(doff)), len);
            copy_words(Src::Private(data.as_ptr().add(soff)), Dst::Shared(bp.add(doff)), len);
        }
        let (ga, gb) = (bytes(&a), bytes(&b));
        assert_eq!(ga, gb);
        // The back-to-front bulk (the `rdmakit_reverse_copy` build) copies the same bytes.
        let r = shared(len + 16);
        let rp = r.as_ptr().cast::<u8>() as *mut u8;
        // SAFETY: `data` holds `soff + len` bytes; `r` was allocated with `len + 16` bytes, so
        // `rp + doff` has room for `len` (doff <= 16); no one else touches `r`.
        unsafe { copy_backwards(Src::Private(data.as_ptr().add(soff)), Dst::Shared(rp.add(doff)), len) };
        assert_eq!(bytes(&r), ga);
        assert_eq!(&ga[doff..doff + len], &data[soff..soff + len]);
        assert!(ga[..doff].iter().chain(&ga[doff + len..]).all(|&x| x == 0));
        // shared -> shared (different phases) and shared -> private
        let c = shared(len + 16);
        let cp = c.as_ptr().cast::<u8>() as *mut u8;
        let mut out = vec![0u8; len + 16];
        // SAFETY: `a` and `c` were allocated with `len + 16` bytes and `out` has `len + 16`,
        // so each `+ offset` (at most 16) leaves room for `len`; only this thread uses them.
        unsafe {
            copy_words(Src::Shared(ap.add(doff)), Dst::Shared(cp.add(soff)), len);
            copy_words(Src::Shared(cp.add(soff)), Dst::Private(out.as_mut_ptr().add(doff)), len);
        }
        assert_eq!(&bytes(&c)[soff..soff + len], &data[soff..soff + len]);
        assert_eq!(&out[doff..doff + len], &data[soff..soff + len]);
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
        let v = shared(600);
        let p = v.as_ptr().cast::<u8>() as *mut u8;
        // SAFETY: in range; only atomic accesses.
        unsafe { fill(p.add(3), 0xab, 590) };
        let b = bytes(&v);
        assert_eq!(b[2], 0);
        assert!(b[3..593].iter().all(|&x| x == 0xab));
        assert_eq!(b[593], 0);
    }

    #[test]
    fn concurrent_atomics_and_copies_do_not_race() {
        // Under Miri this checks the module's claim: copies of shared memory running while
        // another thread does 8-byte atomics on it (as the NIC does) are race-free, also
        // at unaligned offsets.
        let cells = shared(128);
        std::thread::scope(|s| {
            s.spawn(|| {
                for round in 1..20u64 {
                    for c in &cells {
                        c.fetch_add(round, Ordering::Relaxed);
                    }
                }
            });
            let mut out = [0u8; 64];
            let p = cells.as_ptr().cast::<u8>() as *mut u8;
            for i in 0..20 {
                // SAFETY: `cells` outlives the scope; all shared accesses are atomic.
                unsafe {
                    copy(Src::Shared(p.add(i % 8)), Dst::Private(out.as_mut_ptr()), 60);
                    copy(Src::Private(out.as_ptr()), Dst::Shared(p.add(64 + i % 5)), 50);
                }
            }
        });
    }
}
