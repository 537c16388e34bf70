#!/usr/bin/env bash
# rdmakit's developer entry point: the README's commands and CI's test run.
#
#   scripts/dev.sh demo     install what is missing, then run the first example on the soft NIC
#   scripts/dev.sh test     install what is missing, then run every check CI runs:
#                           fmt, clippy, the workspace tests (soft provider; verbs cases are
#                           reported as ignored on a host without RDMA), a soft-only build,
#                           docs, the conformance suite on real rdma-core inside a Soft-RoCE
#                           VM (scripts/rxe-vm.sh), and Miri on the soft NIC's core and the memory crate.
#   scripts/dev.sh deps     only install the system packages
#
# Each tier that cannot run here says so and why, loudly; a tier that runs and fails makes
# the whole command fail. Skips can be forced with RDMAKIT_SKIP_RXE=1, RDMAKIT_SKIP_MIRI=1.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"

# rdma-core headers and libraries (libibverbs, librdmacm, libmlx5) and libclang for bindgen;
# chromium for the web gauge's real-browser test.
PKGS=(libibverbs-dev librdmacm-dev ibverbs-providers rdma-core pkg-config clang libclang-dev chromium)

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

passed=0
failed=0
skipped=0
step() { # step NAME CMD...: run a check, count it, keep going so every failure is shown
    local name=$1; shift
    say "$name"
    if "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); warn "FAILED: $name"; fi
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
    RDMAKIT_PROVIDER=verbs RDMAKIT_GID_INDEX=1 scripts/rxe-vm.sh "$bin" verbs:: &&
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
    # The soft NIC's core and its end-to-end flows; -Zmiri-ignore-leaks because the soft
    # NIC's timer thread lives for the whole process by design.
    MIRIFLAGS="-Zmiri-strict-provenance -Zmiri-ignore-leaks" \
        cargo +nightly miri test -p rdmakit-verbs --no-default-features --lib --test soft_nic_miri &&
        # The memory crate's pure parts: the remote-heap allocator and the UMR pool, alias
        # cache and registration cache (on a device model and on the soft NIC).
        MIRIFLAGS="-Zmiri-strict-provenance -Zmiri-ignore-leaks" \
            cargo +nightly miri test -p rdmakit-memory --lib -- xgvmi:: heap::tests:: heap::free_space
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
    deps
    ;;
demo)
    deps
    cargo run --quiet --example soft_quickstart
    ;;
test)
    deps
    start=$(date +%s)
    step "cargo fmt --check" cargo fmt --all -- --check
    step "cargo clippy (all targets, -D warnings)" cargo clippy --workspace --all-targets -- -D warnings
    step "cargo test --workspace (soft provider; verbs where a device exists)" cargo test --workspace
    step "cross-process soft NIC across two network namespaces" netns_tier
    step "every example, run (each checks its own result)" examples_tier
    step "the web gauge in headless Chromium (screenshot in target/tmp)" \
        cargo test -p rdmakit-perf --test transfer -- --ignored --exact headless_chromium_sees_the_gauge_move
    step "soft-only build (no rdma-core), clippy -D warnings" cargo clippy -p rdmakit-verbs --no-default-features --all-targets -- -D warnings
    step "cargo doc (-D warnings)" env RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --no-deps --quiet
    step "conformance suite on rdma-core + Soft-RoCE (VM)" rxe_tier
    step "Miri on the soft NIC and the memory crate" miri_tier
    say "done in $(($(date +%s) - start)) s"
    echo "checks: $passed passed, $failed failed, $skipped skipped"
    [ "$failed" -eq 0 ]
    ;;
*)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
