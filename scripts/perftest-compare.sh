#!/usr/bin/env bash
# perftest and rdmakit-perf side by side on the same Soft-RoCE device (rxe0), in one run
# inside the rxe VM (scripts/rxe-vm.sh), with the ratios rdmakit/perftest.
#
#   scripts/perftest-compare.sh            build rdmakit-perf (release) and run everything
#   RDMAKIT_COMPARE_ITERS=5000 ...         iterations per test (default 2000)
#
# Tests: ib_write_bw vs write-bw (64 KiB), ib_write_lat vs write-lat (8 B),
# ib_read_lat vs read-lat (8 B), ib_atomic_lat vs atomic-lat (fetch-and-add).
# Bandwidth ratio = rdmakit / perftest (goal >= 0.95); latency ratio = rdmakit / perftest
# on t_typical (goal <= 1.05). rxe under TCG emulation is slow in absolute terms: only the
# ratios, measured in the same run on the same device, mean something.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if [ "${RDMAKIT_IN_RXE_VM:-}" != 1 ]; then
    cd "$here"
    cargo build --release --quiet -p rdmakit-perf
    exec scripts/rxe-vm.sh "$0" "$@"
fi

# ---- inside the VM ----
cd "$here"
perf="$here/target/release/rdmakit-perf"
dev=${RDMAKIT_RXE_DEV:-rxe0}
gid=${RDMAKIT_RXE_GID_INDEX:-1}
ip=${RDMAKIT_RXE_IP:?not inside the rxe VM}
iters=${RDMAKIT_COMPARE_ITERS:-2000}
port=7471

# perftest: prints the result line (the first all-numeric line after its header).
perftest() { # perftest TOOL ARGS...
    local tool=$1; shift
    "$tool" -d "$dev" -x "$gid" -F "$@" >/dev/null 2>&1 &
    local srv=$!
    sleep 1
    "$tool" -d "$dev" -x "$gid" -F "$@" "$ip" 2>/dev/null | awk '/^ *[0-9]+ +[0-9]+ +[0-9.]+/ {print; exit}'
    wait "$srv" 2>/dev/null || true
}

# rdmakit-perf over rdma_cm: prints the JSON result line.
rdmakit() { # rdmakit TEST ARGS...
    local test=$1; shift
    port=$((port + 1))
    "$perf" "$test" --provider verbs --device "$dev" --gid-index "$gid" --server "$ip:$port" "$@" 2>/dev/null &
    local srv=$!
    sleep 1
    "$perf" "$test" --provider verbs --device "$dev" --gid-index "$gid" --connect "$ip:$port" --json "$@"
    wait "$srv" 2>/dev/null || true
}

json() { # json KEY LINE
    sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p" <<<"$2"
}

row() { # row NAME UNIT PERFTEST RDMAKIT KIND(bw|lat)
    awk -v n="$1" -v u="$2" -v p="$3" -v r="$4" -v k="$5" 'BEGIN {
        ratio = (p > 0) ? r / p : 0
        goal = (k == "bw") ? (ratio >= 0.95 ? "met (>= 0.95)" : "missed (>= 0.95)") \
                           : (ratio <= 1.05 ? "met (<= 1.05)" : "missed (<= 1.05)")
        printf "%-26s %-8s %12.2f %12.2f %8.3f  %s\n", n, u, p, r, ratio, goal
    }'
}

echo "perftest vs rdmakit-perf on $dev (GID $gid, $ip), $iters iterations, same VM, same run"
printf '%-26s %-8s %12s %12s %8s  %s\n' test unit perftest rdmakit ratio goal

p=$(perftest ib_write_bw -s 65536 -n "$iters")
r=$(rdmakit write-bw -s 65536 -n "$iters" -w 16)
row "write bandwidth 64 KiB" "MB/s" "$(awk '{print $4}' <<<"$p")" "$(json bw_average_mb_per_sec "$r")" bw

p=$(perftest ib_write_lat -s 8 -n "$iters")
r=$(rdmakit write-lat -s 8 -n "$iters")
row "write latency 8 B" "usec" "$(awk '{print $5}' <<<"$p")" "$(json t_typical "$r")" lat

p=$(perftest ib_read_lat -s 8 -n "$iters")
r=$(rdmakit read-lat -s 8 -n "$iters")
row "read latency 8 B" "usec" "$(awk '{print $5}' <<<"$p")" "$(json t_typical "$r")" lat

p=$(perftest ib_atomic_lat -A FETCH_AND_ADD -n "$iters")
r=$(rdmakit atomic-lat -n "$iters")
row "fetch-and-add latency" "usec" "$(awk '{print $5}' <<<"$p")" "$(json t_typical "$r")" lat
