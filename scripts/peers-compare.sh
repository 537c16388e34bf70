#!/usr/bin/env bash
# rdmakit against the Rust RDMA crates a user would pick instead, on the same Soft-RoCE device
# (rxe0), in one run inside the rxe VM (scripts/rxe-vm.sh): the same tests, the same method.
#
#   scripts/peers-compare.sh              build rdmakit-perf and the peer programs (release), run
#   RDMAKIT_PEERS_ITERS=5000 ...          iterations per test (default 2000)
#   RDMAKIT_PEERS_RUNS=5 ...              runs per tool and test; the median is reported (default 3)
#   RDMAKIT_PEERS="ibverbs sideway"       which peer crates to build and measure
#                                         (default: ibverbs sideway async-rdma)
#   RDMAKIT_PEERS_LIBCLANG=DIR            libclang for async-rdma's bindgen 0.59 (default
#                                         /usr/lib/llvm-14/lib where it exists; empty: as found)
#
# rdmakit is measured by rdmakit-perf (its safe API, every check on: no unsafe escape hatch is
# used); each peer crate by a small program of ours in peers/ (its own workspace, outside the
# main one: peers/README.md), which runs the same ping-pong and streaming loops. A crate that
# does not build, or cannot do an operation (jonhoo's ibverbs has no RDMA write), shows "-" and
# the reason is printed under the table. The build of each peer is timed.
#
# Rows: write latency 8 B (t_typical = median, us), write bandwidth 64 KiB (MiB/s), write
# message rate 8 B (Mpps), and the same three with send/recv, which every crate can do.
# ratio = rdmakit / the best peer on that row (latency: <= 1 means rdmakit is at or ahead;
# bandwidth and rate: >= 1). rxe under TCG emulation is slow in absolute terms and the host is
# shared: only figures taken in the same run mean something, and runs are interleaved (rdmakit,
# then each peer, per run) so that drifting load hits them alike.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
peers=${RDMAKIT_PEERS:-ibverbs sideway async-rdma}
out="$here/target/peers-compare"

if [ "${RDMAKIT_IN_RXE_VM:-}" != 1 ]; then
    cd "$here"
    mkdir -p "$out"
    cargo build --release --quiet -p rdmakit-perf
    for p in $peers; do
        # async-rdma's rdma-sys runs bindgen 0.59, which panics on libclang 16+: point it at
        # libclang 14 where there is one (RDMAKIT_PEERS_LIBCLANG overrides; empty = as found).
        lc=
        if [ "$p" = async-rdma ]; then
            lc=${RDMAKIT_PEERS_LIBCLANG-/usr/lib/llvm-14/lib}
            [ -d "$lc" ] || lc=
        fi
        start=$(date +%s)
        if env ${lc:+LIBCLANG_PATH=$lc} \
            cargo build --release --manifest-path peers/Cargo.toml --features "$p" --bin "peer-$p" \
            >"$out/build-$p.log" 2>&1; then
            echo "ok $(($(date +%s) - start))" >"$out/build-$p.status"
        else
            echo "failed $(($(date +%s) - start))" >"$out/build-$p.status"
        fi
        echo "peers-compare: build of peer-$p: $(cat "$out/build-$p.status") s" >&2
    done
    export RDMAKIT_RXE_RW_DIRS="${RDMAKIT_RXE_RW_DIRS:+$RDMAKIT_RXE_RW_DIRS:}$out"
    exec scripts/rxe-vm.sh "$0" "$@"
fi

# ---- inside the VM ----
cd "$here"
perf="$here/target/release/rdmakit-perf"
bin="$here/peers/target/release"
dev=${RDMAKIT_RXE_DEV:-rxe0}
gid=${RDMAKIT_RXE_GID_INDEX:-1}
ip=${RDMAKIT_RXE_IP:?not inside the rxe VM}
iters=${RDMAKIT_PEERS_ITERS:-2000}
runs=${RDMAKIT_PEERS_RUNS:-3}
port=7600
declare -A why

# one TOOL TEST ARGS...: one client/server run; prints the client's JSON line (empty on failure).
one() {
    local tool=$1 test=$2; shift 2
    if [ "$tool" = ibverbs ] && [[ $test == write-* ]]; then
        why[$tool/$test]="ibverbs 0.9.2 posts sends and receives only: it has no RDMA write"
        return
    fi
    port=$((port + 1))
    local cmd
    if [ "$tool" = rdmakit ]; then
        cmd=("$perf" "$test" --provider verbs --device "$dev" --gid-index "$gid")
    else
        cmd=("$bin/peer-$tool" "$test" --device "$dev" --gid-index "$gid")
    fi
    timeout 300 "${cmd[@]}" --server "$ip:$port" "$@" >/dev/null 2>"$out/server.err" &
    local srv=$!
    sleep 1
    if ! timeout 300 "${cmd[@]}" --connect "$ip:$port" --json "$@" 2>"$out/client.err"; then
        why[$tool/$test]="$(tail -n 1 "$out/client.err")"
    fi
    # A server whose client failed would wait for it: give it a few seconds, then stop it.
    local i
    for i in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$srv" 2>/dev/null || break; sleep 0.5; done
    kill "$srv" 2>/dev/null || true
    wait "$srv" 2>/dev/null || true
}

json() { # json KEY LINE
    sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p" <<<"$2"
}

median() {
    sort -g | awk '{v[NR] = $1} END {if (NR == 0) print "-"; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2}'
}

tools=(rdmakit)
for p in $peers; do
    st=$(cut -d' ' -f1 "$out/build-$p.status" 2>/dev/null || echo missing)
    if [ "$st" = ok ]; then
        tools+=("$p")
    else
        why[$p/build]="did not build: $(grep -m 1 -E '^error|panicked' "$out/build-$p.log" 2>/dev/null) (target/peers-compare/build-$p.log)"
    fi
done

# measure NAME UNIT KIND TEST KEY ARGS...: one row.
declare -A cell
rows=()
measure() {
    local name=$1 unit=$2 kind=$3 test=$4 key=$5; shift 5
    rows+=("$name|$unit|$kind")
    local r t line
    declare -A vals
    for r in $(seq "$runs"); do
        for t in "${tools[@]}"; do
            line=$(one "$t" "$test" "$@" | tail -n 1)
            [ -n "$line" ] && vals[$t]+="$(json "$key" "$line")"$'\n'
        done
    done
    for t in "${tools[@]}"; do
        cell[$name/$t]=$(printf '%s' "${vals[$t]:-}" | grep . | median)
    done
}

measure "write latency 8 B" usec lat write-lat t_typical -s 8 -n "$iters"
measure "write bandwidth 64 KiB" MiB/s bw write-bw bw_average_mb_per_sec -s 65536 -n "$iters"
measure "write msg rate 8 B" Mpps bw write-bw msg_rate_mpps -s 8 -n "$iters"
measure "send latency 8 B" usec lat send-lat t_typical -s 8 -n "$iters"
measure "send bandwidth 64 KiB" MiB/s bw send-bw bw_average_mb_per_sec -s 65536 -n "$iters"
measure "send msg rate 8 B" Mpps bw send-bw msg_rate_mpps -s 8 -n "$iters"

label() { # the column title of a tool: crate and version
    case $1 in
    rdmakit) echo "rdmakit $(sed -n 's/^version = "\(.*\)"/\1/p' "$here/Cargo.toml" | head -n 1)" ;;
    ibverbs) echo "ibverbs 0.9.2" ;;
    sideway) echo "sideway 0.4.3" ;;
    async-rdma) echo "async-rdma 0.5.0" ;;
    esac
}

echo "rdmakit vs Rust RDMA crates on $dev (GID $gid, $ip), $iters iterations, median of $runs runs, same VM ($(date -u +%Y-%m-%dT%H:%MZ))"
printf '%-24s %-6s' row unit
for t in rdmakit $peers; do printf ' %17s' "$(label "$t")"; done
printf ' %8s  %s\n' ratio "vs best peer"
for row in "${rows[@]}"; do
    IFS='|' read -r name unit kind <<<"$row"
    printf '%-24s %-6s' "$name" "$unit"
    best=-
    for t in rdmakit $peers; do
        v=${cell[$name/$t]:--}
        printf ' %17s' "$v"
        if [ "$t" != rdmakit ] && [ "$v" != - ]; then
            best=$(awk -v b="$best" -v v="$v" -v k="$kind" 'BEGIN {
                if (b == "-") print v; else if (k == "lat") print (v < b ? v : b); else print (v > b ? v : b) }')
        fi
    done
    awk -v r="${cell[$name/rdmakit]:--}" -v b="$best" -v k="$kind" 'BEGIN {
        if (r == "-" || b == "-" || b == 0) { printf " %8s  %s\n", "-", "no peer measured"; exit }
        ratio = r / b
        ahead = (k == "lat") ? (ratio <= 1) : (ratio >= 1)
        printf " %8.3f  %s\n", ratio, ahead ? "rdmakit at or ahead" : "rdmakit behind"
    }'
done
if [ ${#why[@]} -gt 0 ]; then
    echo "not measured (\"-\"):"
    for k in "${!why[@]}"; do echo "  $k: ${why[$k]}"; done | sort
fi
