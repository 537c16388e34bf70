#!/usr/bin/env bash
# rdmakit's developer entry point: the README's commands and CI's test run.
#
#   scripts/dev.sh demo     install what is missing, then run the first example on the soft NIC
#   scripts/dev.sh test     install what is missing, then run every check CI runs:
#                           fmt, clippy, the workspace tests (soft provider; verbs cases are
#                           reported as ignored on a host without RDMA), a soft-only build,
#                           docs, the conformance suite on real rdma-core inside a Soft-RoCE
#                           VM (scripts/rxe-vm.sh), ThreadSanitizer and AddressSanitizer tiers, and
#                           Miri on the soft NIC's core and the memory crate.
#   scripts/dev.sh deps     only install the system packages
#   scripts/dev.sh deps rdma  only those the rdma-core provider builds with (no browser): what
#                           the benchmark scripts install before they build rdmakit-perf
#   scripts/dev.sh sanitizers [thread|address]  only the sanitizer tiers (both, or the one named)
#
# Each tier that cannot run here says so and why, loudly; a tier that runs and fails makes
# the whole command fail. Skips can be forced with RDMAKIT_SKIP_RXE=1, RDMAKIT_SKIP_MIRI=1,
# RDMAKIT_SKIP_SANITIZERS=1.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"

# rdma-core headers and libraries (libibverbs, librdmacm, libmlx5) and libclang for bindgen;
# chromium for the web gauge's real-browser test.
RDMA_PKGS=(libibverbs-dev librdmacm-dev ibverbs-providers rdma-core pkg-config libclang-dev)
PKGS=("${RDMA_PKGS[@]}" chromium)

say() { printf '\n==> %s\n' "$*"; }
warn() { printf '\n!!! %s\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"
    elif command -v sudo >/dev/null; then sudo "$@"
    else return 1
    fi
}

deps() {
    command -v cargo >/dev/null || { warn "cargo not found: install Rust with rustup first (https://rustup.rs)"; exit 1; }
    local missing=()
    if command -v dpkg-query >/dev/null; then
        for p in "${PKGS[@]}"; do
            dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
        done
    elif ! pkg-config --exists libibverbs librdmacm 2>/dev/null; then
        warn "not a Debian/Ubuntu system and rdma-core's development files are not found;"
        warn "install rdma-core-devel (or your distribution's equivalent), pkg-config and clang"
        exit 1
    fi
    if [ ${#missing[@]} -gt 0 ]; then
        say "installing ${missing[*]}"
        if ! as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq ||
           ! as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
            warn "could not install: ${missing[*]} (need root or sudo)"
            exit 1
        fi
    fi
}

# The distribution's default libclang (what `libclang-dev` depends on) and the newest one it
# ships: the verbs provider is built with both, since bindgen output depends on libclang.
default_libclang_dir() {
    local v
    v=$(dpkg-query -W -f='${Depends}' libclang-dev 2>/dev/null | grep -o 'libclang-[0-9]*-dev' | head -n 1 | tr -dc 0-9)
    [ -n "$v" ] && [ -d "/usr/lib/llvm-$v/lib" ] && echo "/usr/lib/llvm-$v/lib"
}
newest_libclang_pkg() {
    apt-cache search --names-only '^libclang-[0-9]+-dev$' 2>/dev/null | awk '{print $1}' | sort -V | tail -n 1
}

libclang_tier() {
    # Builds rdmakit-sys and the verbs provider with the newest libclang the distribution has
    # (its own target directory), runs the layout checks, and prints which libclang made them.
    local pkg v dir log
    pkg=$(newest_libclang_pkg)
    [ -n "$pkg" ] || { skip "newest libclang: apt-cache finds no libclang-N-dev here"; return 0; }
    v=$(echo "$pkg" | tr -dc 0-9)
    dir=/usr/lib/llvm-$v/lib
    if [ ! -d "$dir" ]; then
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null ||
            { warn "could not install $pkg"; return 1; }
    fi
    log=$(mktemp)
    LIBCLANG_PATH=$dir RDMAKIT_SYS_VERBS=require cargo build -vv -p rdmakit-sys -p rdmakit-verbs \
        --target-dir target/libclang-newest >"$log" 2>&1 || { tail -n 30 "$log"; rm -f "$log"; return 1; }
    rm -f "$log"
    # The layout checks, and which libclang made the bindings (printed by the test, so it is
    # shown even when cargo did not need to re-run the build script).
    LIBCLANG_PATH=$dir RDMAKIT_SYS_VERBS=require cargo test -q -p rdmakit-sys --target-dir target/libclang-newest \
        -- --nocapture 2>&1 | grep -E 'bindings made with|test result|panicked|FAILED'
    return "${PIPESTATUS[0]}"
}

msrv_check() {
    # Cargo.toml's rust-version is what the checks below build with: rust-toolchain.toml's pin.
    local msrv pin
    msrv=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
    pin=$(sed -n 's/^channel = "\(.*\)"/\1/p' rust-toolchain.toml)
    echo "rust-version $msrv, toolchain $pin, rustc $(rustc --version)"
    case "$pin" in "$msrv" | "$msrv".*) return 0 ;; esac
    warn "Cargo.toml says rust-version $msrv but CI builds with $pin: the claim is untested"
    return 1
}

prm_tier() {
    # The hand-built mlx5 firmware commands against the kernel's own mlx5_ifc.h (Debian's
    # linux-headers-*-common ships it; no kernel is installed, only headers under /usr/src).
    if ! ls /usr/src/linux-headers-*/include/linux/mlx5/mlx5_ifc.h >/dev/null 2>&1; then
        local pkg
        pkg=$(apt-cache search --names-only '^linux-headers-[0-9.]+.*-common$' 2>/dev/null | awk '{print $1}' | sort -V | tail -n 1)
        if [ -z "$pkg" ] || ! as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null; then
            skip "mlx5 PRM layouts: no linux-headers-*-common package to read mlx5_ifc.h from"
            return 0
        fi
    fi
    cargo test -q -p rdmakit-verbs --lib prm_fields_match_the_kernel -- --ignored --nocapture 2>&1 | grep -E 'PRM check|panicked|test result'
    return "${PIPESTATUS[0]}"
}

passed=0
failed=0
skipped=0
step() { # step NAME CMD...: run a check, count it, keep going so every failure is shown
    # A check that calls `skip` (it could not run here) counts as skipped, once, not passed.
    local name=$1 before=$skipped; shift
    say "$name"
    if "$@"; then
        if [ "$skipped" -eq "$before" ]; then passed=$((passed + 1)); else skipped=$((before + 1)); fi
    else
        failed=$((failed + 1)); warn "FAILED: $name"
    fi
}
skip() { skipped=$((skipped + 1)); warn "SKIPPED: $1"; }

test_bin() { # test_bin NAME CARGO-ARGS...: the path of a test binary cargo just built
    local name=$1; shift
    cargo test "$@" --no-run --message-format=json 2>/dev/null |
        sed -n "s/.*\"executable\":\"\([^\"]*${name}[^\"]*\)\".*/\1/p" | tail -n 1
}

rxe_tier() {
    if [ "${RDMAKIT_SKIP_RXE:-0}" = 1 ]; then skip "rxe tier (RDMAKIT_SKIP_RXE=1)"; return; fi
    local why
    if ! why=$(scripts/rxe-vm.sh --setup >/tmp/rdmakit-rxe-setup.log 2>&1 && scripts/rxe-vm.sh --check 2>&1); then
        tail -n 5 /tmp/rdmakit-rxe-setup.log >&2 || true
        skip "rxe tier: the Soft-RoCE VM cannot run here: ${why:-setup failed}"
        return
    fi
    echo "$why"
    local bin lib
    bin=$(test_bin conformance --test conformance)
    lib=$(test_bin rdmakit_verbs -p rdmakit-verbs --lib)
    [ -n "$bin" ] && [ -n "$lib" ] || { warn "test binaries not found"; return 1; }
    # The suite's verbs cases on rdma-core against rxe0, inside the VM; then the rdma_cm
    # backend's own tests, which only print "skipped" outside it.
    # No RDMAKIT_GID_INDEX: the GID is chosen by type (RoCE v2), as users get it.
    RDMAKIT_PROVIDER=verbs scripts/rxe-vm.sh "$bin" verbs:: &&
        scripts/rxe-vm.sh "$lib" rdma::cm
}

miri_tier() {
    if [ "${RDMAKIT_SKIP_MIRI:-0}" = 1 ]; then skip "Miri (RDMAKIT_SKIP_MIRI=1)"; return; fi
    if ! cargo +nightly miri --version >/dev/null 2>&1; then
        rustup component add miri rust-src --toolchain nightly >/dev/null 2>&1 || true
    fi
    if ! cargo +nightly miri --version >/dev/null 2>&1; then
        skip "Miri: no nightly toolchain with the miri component here"
        return
    fi
    # Each run has a time limit, so that a test too slow under the interpreter fails this
    # tier by name instead of taking CI past its own limit (it did once: an arithmetic-only
    # test of tens of millions of steps).
    local limit=${RDMAKIT_MIRI_TIMEOUT:-900}
    # The soft NIC's core and its end-to-end flows (among them: as_slice_at beside concurrent
    # neighbour writes, a CPU copy racing a NIC atomic on the same word, odd-length
    # register); -Zmiri-ignore-leaks because the soft NIC's timer thread lives for the whole
    # process by design.
    MIRIFLAGS="-Zmiri-strict-provenance -Zmiri-ignore-leaks" \
        timeout "$limit" cargo +nightly miri test -p rdmakit-verbs --no-default-features --lib --test soft_nic_miri &&
        # A flag-mode pipe round trip on the in-process soft NIC (busy polling, a
        # current-thread runtime with its timer only: no epoll or eventfd).
        MIRIFLAGS="-Zmiri-strict-provenance -Zmiri-ignore-leaks" \
            timeout "$limit" cargo +nightly miri test -p rdmakit-channel --test pipe_miri &&
        # The memory crate's pure parts: the remote-heap allocator and the UMR pool, alias
        # cache and registration cache (on a device model and on the soft NIC).
        MIRIFLAGS="-Zmiri-strict-provenance -Zmiri-ignore-leaks" \
            timeout "$limit" cargo +nightly miri test -p rdmakit-memory --lib -- xgvmi:: heap::tests:: heap::free_space ||
        { warn "Miri: a run failed or took more than ${limit} s (RDMAKIT_MIRI_TIMEOUT)"; return 1; }
}

# The sanitizer tiers: ThreadSanitizer and AddressSanitizer (with its leak checker) over the
# soft NIC's conformance cases, the soft cross-process tests and the channel and memory
# crates' tests. Nightly (the -Z flags), std rebuilt instrumented (-Zbuild-std, which needs
# the rust-src component), each in its own target directory so that the main build's cache
# stays as it is. The soft provider only (RDMAKIT_SYS_VERBS=off): rdma-core's C libraries are
# not instrumented and have no device here. Doc tests are not run (cargo does not run them
# with -Zbuild-std); the unit and integration tests are.
#
# Left out, and why:
# - crates/rdmakit-channel/tests/soak.rs: a fixed 15 s of N processes x M pipes with kills,
#   built for an exact count and leak check in real time; instrumented 5-15x slower it
#   measures the sanitizer more than rdmakit, and its pipes, put handles and kill paths are
#   the ones the pipe, put and liveness tests run here already.
# - crates/rdmakit-channel/tests/liveness_cross_process.rs: each case must stay blocked
#   against an idle, instrumented peer process and fail within a bound, on a transport
#   budget of about 1.07 s. Instrumented, on a loaded machine, a peer now and then misses
#   that budget while alive, and the connection is (rightly, by its rules) declared broken
#   before the kill: once under TSan ("rread: should block while the peer is alive and
#   idle", 76 s instead of 10 s) and once under ASan (the heap owner's poll_messages got
#   RETRY_EXC_ERR during set-up). The same operations run under the sanitizers in process
#   (liveness.rs), and pipe_cross_process.rs runs pipes across processes.
# Shortened: the property tests run 32 cases instead of 256 (PROPTEST_CASES). They are
# single-threaded model checks of the allocators and the heap protocol (the plain test tier
# runs them in full); instrumented, the full count took minutes, and a few cases walk the
# same code for the sanitizers.
SAN_TARGET=x86_64-unknown-linux-gnu
SAN_PKGS=(-p rdmakit -p rdmakit-channel -p rdmakit-memory)

sanitizer_nightly() {
    # A nightly toolchain with rust-src, installed if missing (rustup).
    if ! rustc +nightly --version >/dev/null 2>&1 ||
       [ ! -d "$(rustc +nightly --print sysroot 2>/dev/null)/lib/rustlib/src/rust/library" ]; then
        rustup toolchain install nightly --profile minimal --component rust-src >/dev/null 2>&1 ||
            rustup component add rust-src --toolchain nightly >/dev/null 2>&1 || true
    fi
    rustc +nightly --version >/dev/null 2>&1 &&
        [ -d "$(rustc +nightly --print sysroot)/lib/rustlib/src/rust/library" ]
}

san_cargo() { # san_cargo thread|address CARGO-TEST-ARGS...: cargo test, instrumented
    local san=$1; shift
    env RUSTFLAGS="-Zsanitizer=$san" RUSTDOCFLAGS="-Zsanitizer=$san" RDMAKIT_SYS_VERBS=off PROPTEST_CASES=32 \
        TSAN_OPTIONS="suppressions=$here/scripts/sanitizers/tsan.supp" \
        ASAN_OPTIONS="detect_leaks=1" \
        cargo +nightly test -Zbuild-std --target "$SAN_TARGET" --target-dir "target/${san:0:1}san" \
        --no-default-features "$@"
}

san_tests() { # the cargo target selection of the sanitizer tiers (see above)
    local t
    echo --lib --test conformance --test soft_cross_process
    for t in crates/rdmakit-channel/tests/*.rs crates/rdmakit-memory/tests/*.rs; do
        t=$(basename "$t" .rs)
        case "$t" in soak | liveness_cross_process) ;; *) echo --test "$t" ;; esac
    done
}

san_canary() { # san_canary thread|address TEST PATTERN: the deliberate bug must be reported
    # The same packages and targets as the tier's run (so the same build), filtered to the
    # canary: the other binaries run nothing.
    local san=$1 test=$2 pattern=$3 log rc=0
    log=$(mktemp)
    # shellcheck disable=SC2046 # san_tests prints separate words on purpose
    RDMAKIT_SANITIZER_CANARY=1 san_cargo "$san" "${SAN_PKGS[@]}" $(san_tests) \
        -- --ignored --exact "$test" >"$log" 2>&1 || rc=$?
    if [ "$rc" -eq 0 ] || ! grep -q "$pattern" "$log"; then
        tail -n 30 "$log"
        rm -f "$log"
        warn "the $san sanitizer did not report the deliberate bug $test (exit $rc): the tier is not checking anything"
        return 1
    fi
    echo "canary $test: reported ($(grep -m 1 "$pattern" "$log" | sed 's/^[=0-9 ]*//'); exit $rc), as it must be"
    rm -f "$log"
}

sanitizer_tier() { # sanitizer_tier thread|address
    local san=$1 start=$SECONDS
    if [ "${RDMAKIT_SKIP_SANITIZERS:-0}" = 1 ]; then skip "$san sanitizer (RDMAKIT_SKIP_SANITIZERS=1)"; return; fi
    if ! sanitizer_nightly; then skip "$san sanitizer: no nightly toolchain with rust-src here"; return; fi
    # First the canaries: a tier whose sanitizer does not fail on a known bug proves nothing.
    if [ "$san" = thread ]; then
        san_canary thread canary_data_race "ThreadSanitizer: data race" || return 1
    else
        san_canary address canary_use_after_free "AddressSanitizer: heap-use-after-free" || return 1
        san_canary address canary_leak "LeakSanitizer: detected memory leaks" || return 1
    fi
    # Then everything, every binary run even after a failure. The conformance suite's verbs
    # cases and the canaries report themselves ignored.
    # shellcheck disable=SC2046 # san_tests prints separate words on purpose
    san_cargo "$san" "${SAN_PKGS[@]}" --no-fail-fast $(san_tests) || return 1
    echo "$san sanitizer tier: $((SECONDS - start)) s"
}

netns_tier() {
    # scripts/netns-test.sh exits 77 when namespaces cannot be made here (not root, no
    # iproute2, not permitted): a skip with its reason, not a failure.
    local log rc=0
    log=$(mktemp)
    scripts/netns-test.sh 2>&1 | tee "$log" || rc=$?
    if [ "$rc" -eq 77 ]; then
        skip "network namespaces: $(sed -n 's/.*SKIPPED: //p' "$log" | tail -n 1)"
        rc=0
    fi
    rm -f "$log"
    return "$rc"
}

examples_tier() {
    # Every example is run, not only built; each checks its own result and exits non-zero
    # on a wrong one.
    local f name rc=0
    for f in examples/*.rs; do
        name=$(basename "$f" .rs)
        say "example $name"
        timeout -k 10 600 cargo run --quiet --example "$name" || { warn "example $name failed"; rc=1; }
    done
    return "$rc"
}

case "${1:-}" in
deps)
    if [ "${2:-}" = rdma ]; then PKGS=("${RDMA_PKGS[@]}"); fi
    deps
    ;;
sanitizers)
    start=$(date +%s)
    if [ "${2:-thread}" = thread ]; then
        step "ThreadSanitizer: soft conformance, soft cross-process, channel and memory tests" sanitizer_tier thread
    fi
    if [ "${2:-address}" = address ]; then
        step "AddressSanitizer + leaks: soft conformance, soft cross-process, channel and memory tests" sanitizer_tier address
    fi
    say "done in $(($(date +%s) - start)) s"
    echo "checks: $passed passed, $failed failed, $skipped skipped"
    [ "$failed" -eq 0 ]
    ;;
demo)
    deps
    cargo run --quiet --example soft_quickstart
    ;;
test)
    deps
    start=$(date +%s)
    # The rdma-core provider must be built: a missing package fails the build, loudly, instead
    # of quietly building the soft NIC only (which is what a user's plain `cargo build` does).
    export RDMAKIT_SYS_VERBS=require
    if [ -z "${LIBCLANG_PATH:-}" ] && dir=$(default_libclang_dir); then export LIBCLANG_PATH=$dir; fi
    say "bindings: $(cargo build -vv -p rdmakit-sys 2>&1 | grep -o 'libclang .*' | head -n 1 || true)"
    step "rust-version is the toolchain CI tests with" msrv_check
    step "cargo fmt --check" cargo fmt --all -- --check
    step "cargo clippy (all targets, -D warnings)" cargo clippy --workspace --all-targets -- -D warnings
    step "cargo test --workspace (soft provider; verbs where a device exists)" cargo test --workspace
    step "cross-process soft NIC across two network namespaces" netns_tier
    step "every example, run (each checks its own result)" examples_tier
    step "the web gauge in headless Chromium (screenshot in target/tmp)" \
        cargo test -p rdmakit-perf --test transfer -- --ignored --exact headless_chromium_sees_the_gauge_move
    step "soft-only build (no rdma-core), clippy -D warnings" cargo clippy -p rdmakit-verbs --no-default-features --all-targets -- -D warnings
    step "build without rdma-core's files (RDMAKIT_SYS_VERBS=off: what a machine with only Rust gets)" \
        env RDMAKIT_SYS_VERBS=off cargo clippy --workspace --all-targets --target-dir target/no-rdma-core -- -D warnings
    step "verbs provider built with the newest libclang the distribution ships" libclang_tier
    step "mlx5 PRM command layouts against the kernel's mlx5_ifc.h" prm_tier
    # The soft NIC copies the bulk of every write back to front in this build: flag-mode
    # pipes and put handles must still see whole messages, since only the last word (the
    # sequence word) is ordered. Its own target directory keeps the main build's cache.
    step "flag-mode pipes and put handles with the NIC's bulk copy reversed (--cfg rdmakit_reverse_copy)" \
        env RUSTFLAGS="--cfg rdmakit_reverse_copy" CARGO_TARGET_DIR=target/reverse-copy \
        cargo test -p rdmakit-channel --test pipe --test put --test pipe_cross_process
    step "cargo doc (-D warnings)" env RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --no-deps --quiet
    # The full `cargo publish --workspace --dry-run` also rebuilds every crate from its package
    # (about 15 minutes here); packaging alone checks the metadata and the file lists.
    step "every crate packages for crates.io (cargo package --workspace --no-verify)" \
        cargo package --workspace --no-verify --quiet --allow-dirty
    step "conformance suite on rdma-core + Soft-RoCE (VM)" rxe_tier
    step "ThreadSanitizer: soft conformance, soft cross-process, channel and memory tests" sanitizer_tier thread
    step "AddressSanitizer + leaks: soft conformance, soft cross-process, channel and memory tests" sanitizer_tier address
    step "Miri on the soft NIC and the memory crate" miri_tier
    say "done in $(($(date +%s) - start)) s"
    echo "checks: $passed passed, $failed failed, $skipped skipped"
    [ "$failed" -eq 0 ]
    ;;
*)
    sed -n '2,17p' "$0"
    exit 2
    ;;
esac
