//! Deliberate bugs that prove the sanitizer tiers of `scripts/dev.sh` are alive: a data race
//! (ThreadSanitizer must report it) and a use after free and a leak (AddressSanitizer and
//! its leak checker must report them). A tier whose sanitizer did not fail on these would
//! pass over real bugs too, so each tier runs its canary and requires that it fails with
//! the sanitizer's report.
//!
//! They are `#[ignore]`d, and each also refuses to run unless `RDMAKIT_SANITIZER_CANARY=1`
//! is set (it panics instead): a plain `cargo test -- --ignored` must not execute undefined
//! behaviour in an uninstrumented build.

use std::sync::atomic::{AtomicBool, Ordering};

fn armed() {
    assert_eq!(
        std::env::var("RDMAKIT_SANITIZER_CANARY").as_deref(),
        Ok("1"),
        "a deliberate bug for the sanitizer tiers; set RDMAKIT_SANITIZER_CANARY=1 to run it"
    );
}

/// Two threads write the same plain `u64` with no synchronisation between them.
#[test]
#[ignore = "deliberate data race: the ThreadSanitizer tier runs it and requires its report"]
fn canary_data_race() {
    armed();
    let cell = Box::into_raw(Box::new(0u64)) as usize;
    let go = AtomicBool::new(false);
    std::thread::scope(|s| {
        for i in 0..2u64 {
            let go = &go;
            s.spawn(move || {
                // Relaxed: the flag only lines the threads up, it orders nothing.
                while !go.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
                // SAFETY: not sound, on purpose: both threads write the same location
                // without synchronisation (the bug the sanitizer must report).
                unsafe { std::ptr::write_volatile(cell as *mut u64, i) };
            });
        }
        go.store(true, Ordering::Relaxed);
    });
    // SAFETY: `cell` came from `Box::into_raw` and both writers have been joined.
    drop(unsafe { Box::from_raw(cell as *mut u64) });
}

/// Reads a heap value after it was freed.
#[test]
#[ignore = "deliberate use after free: the AddressSanitizer tier runs it and requires its report"]
fn canary_use_after_free() {
    armed();
    let p = Box::into_raw(Box::new(42u64));
    // SAFETY: `p` came from `Box::into_raw`; freed once here.
    drop(unsafe { Box::from_raw(p) });
    // SAFETY: not sound, on purpose: `p` was freed above (the bug the sanitizer must report).
    let v = unsafe { std::ptr::read_volatile(p) };
    println!("read {v} after free");
}

/// Loses the last pointer to a heap allocation (the leak checker reports it at exit).
#[test]
#[ignore = "deliberate leak: the AddressSanitizer tier runs it and requires the leak checker's report"]
fn canary_leak() {
    armed();
    let p = Box::into_raw(vec![7u8; 4096].into_boxed_slice());
    // Hide the pointer from the leak checker's scan: only a scrambled copy stays visible.
    std::hint::black_box((p as *mut u8 as usize) ^ usize::MAX);
}
