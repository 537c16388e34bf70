#!/usr/bin/env bash
# The soft NIC across two hosts, emulated with two network namespaces joined by a veth pair.
#
#   scripts/netns-test.sh        (as root)
#
# Creates namespaces rdmakit-a-<pid> and rdmakit-b-<pid>, a veth pair with one end in each
# (both ends are created inside the namespaces: nothing appears on the host side), and
# addresses <subnet>.1/24 (A) and <subnet>.2/24 (B); no default route, no NAT, so traffic
# stays inside the two namespaces. Then runs tests/soft_cross_process.rs in A, with its
# peer process in B (RDMAKIT_TEST_PEER_WRAP="ip netns exec <B>"), each soft device
# listening on its own veth address, and checks that the veth carried the traffic. The
# namespaces are always removed on exit.
#
# Environment: RDMAKIT_NETNS_SUBNET (default 10.213.47), RDMAKIT_NETNS_TIMEOUT (seconds for
# the test run, default 300), RDMAKIT_NETNS_TEST_BIN (a prebuilt soft_cross_process test
# binary to run instead of building one with cargo).
#
# Exit status: 0 passed; 77 skipped (prints "SKIPPED: <reason>": not root, no iproute2,
# namespaces or veth not permitted here); anything else failed.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"

say() { printf '==> %s\n' "$*"; }
skip() {
    printf '\n!!! SKIPPED: %s\n' "$*" >&2
    exit 77
}
die() {
    printf '\n!!! FAILED: %s\n' "$*" >&2
    exit 1
}

apt_install() { # apt_install PKG...: best effort, quiet
    command -v apt-get >/dev/null || return 1
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1
}

[ "$(id -u)" -eq 0 ] || skip "network namespaces need root (run scripts/netns-test.sh as root)"
if ! command -v ip >/dev/null; then
    say "installing iproute2"
    apt_install iproute2 || true
    command -v ip >/dev/null || skip "no 'ip' command (iproute2) and it could not be installed"
fi
command -v timeout >/dev/null || skip "no 'timeout' command (coreutils)"

subnet=${RDMAKIT_NETNS_SUBNET:-10.213.47}
ns_a=rdmakit-a-$$
ns_b=rdmakit-b-$$
veth_a=rka$$ # interface names: at most 15 characters
veth_b=rkb$$
ip_a=$subnet.1
ip_b=$subnet.2

made=()
cleanup() {
    local ns pid
    for ns in "${made[@]}"; do
        # Anything this run left behind in its own namespaces (a hung peer), then the
        # namespace itself; the veth pair goes with it.
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$ns" 2>/dev/null || true
    done
}
trap cleanup EXIT

for ns in "$ns_a" "$ns_b"; do
    if ! err=$(ip netns add "$ns" 2>&1); then
        skip "cannot create a network namespace here: ip netns add: ${err:-failed}"
    fi
    made+=("$ns")
done
if ! err=$(ip -n "$ns_a" link add "$veth_a" type veth peer name "$veth_b" netns "$ns_b" 2>&1); then
    skip "cannot create a veth pair here: ip link add type veth: ${err:-failed}"
fi
ip -n "$ns_a" addr add "$ip_a/24" dev "$veth_a"
ip -n "$ns_b" addr add "$ip_b/24" dev "$veth_b"
for ns in "$ns_a" "$ns_b"; do ip -n "$ns" link set lo up; done
ip -n "$ns_a" link set "$veth_a" up
ip -n "$ns_b" link set "$veth_b" up

say "namespace $ns_a: $veth_a $ip_a/24 (test process)"
say "namespace $ns_b: $veth_b $ip_b/24 (peer process)"
ip -n "$ns_a" route show | sed 's/^/    A route: /'
ip -n "$ns_b" route show | sed 's/^/    B route: /'

# Connectivity, A -> B (the link may take a moment to come up).
if ! command -v ping >/dev/null; then
    say "installing iputils-ping"
    apt_install iputils-ping || true
fi
if command -v ping >/dev/null; then
    ok=0
    for _ in 1 2 3 4 5; do
        if ip netns exec "$ns_a" ping -c1 -W1 "$ip_b" >/dev/null 2>&1; then ok=1; break; fi
        sleep 1
    done
    [ "$ok" = 1 ] || die "$ns_a cannot ping $ip_b over the veth pair"
    say "ping $ns_a -> $ip_b: ok"
else
    say "no ping here; the test run below checks connectivity itself"
fi

# Build on the host (the build needs no namespace), then run the binary inside A.
if [ -n "${RDMAKIT_NETNS_TEST_BIN:-}" ]; then
    bin=$RDMAKIT_NETNS_TEST_BIN
else
    say "building tests/soft_cross_process.rs"
    log=$(mktemp)
    if ! cargo test --test soft_cross_process --no-run --message-format=json >"$log.json" 2>"$log"; then
        cat "$log" >&2
        rm -f "$log" "$log.json"
        die "cargo test --test soft_cross_process --no-run"
    fi
    bin=$(sed -n 's/.*"executable":"\([^"]*soft_cross_process[^"]*\)".*/\1/p' "$log.json" | tail -n 1)
    rm -f "$log" "$log.json"
fi
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
    die "test binary for soft_cross_process not found (${bin:-none in the cargo output})"
fi
say "test binary: $bin"

rx_bytes() { ip netns exec "$ns_a" cat "/sys/class/net/$veth_a/statistics/rx_bytes"; }
tx_bytes() { ip netns exec "$ns_a" cat "/sys/class/net/$veth_a/statistics/tx_bytes"; }
rx0=$(rx_bytes)
tx0=$(tx_bytes)

say "running the cross-process cases: client in $ns_a ($ip_a), peer in $ns_b ($ip_b)"
rc=0
ip netns exec "$ns_a" env \
    RDMAKIT_PROVIDER=soft \
    RDMAKIT_SOFT_ADDR="$ip_a" \
    RDMAKIT_TEST_PEER_WRAP="ip netns exec $ns_b" \
    RDMAKIT_TEST_PEER_SOFT_ADDR="$ip_b" \
    timeout -k 10 "${RDMAKIT_NETNS_TIMEOUT:-300}" "$bin" --test-threads=1 || rc=$?
[ "$rc" -eq 0 ] || {
    [ "$rc" -eq 124 ] && die "the test run timed out after ${RDMAKIT_NETNS_TIMEOUT:-300} s"
    die "cross-process tests across namespaces (exit status $rc)"
}

# The peer lives only in B and listens on B's veth address, so every request and answer
# crossed the veth: its byte counters (seen from A) must show at least the 1 MiB read.
rx=$(($(rx_bytes) - rx0))
tx=$(($(tx_bytes) - tx0))
say "veth $veth_a ($ns_a) carried $rx bytes in, $tx bytes out during the run"
[ "$rx" -ge $((1 << 20)) ] || die "less than 1 MiB came over the veth: the traffic did not cross namespaces"
say "passed: soft NIC across network namespaces $ns_a <-> $ns_b"
