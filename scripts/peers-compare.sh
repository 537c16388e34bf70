#!/usr/bin/env bash
# rdmakit against the Rust RDMA crates a user would pick instead, on the same Soft-RoCE device
# (rxe0), in one run inside the rxe VM (scripts/rxe-vm.sh): the same tests, the same method.
#
#   scripts/peers-compare.sh              build rdmakit-perf and the peer programs (release), run
#   RDMAKIT_PEERS_ITERS=5000 ...          iterations per test (default 2000)
#   RDMAKIT_PEERS_RUNS=5 ...              runs per tool and test; the median is reported (default 3)
#   RDMAKIT_PEERS="ibverbs sideway"       which peer crates to build and measure
#                                         (default: ibverbs sideway async-rdma)
#   RDMAKIT_PEERS_NO_BUILD=1              measure the peer programs already built (no cargo run)
#   RDMAKIT_PEERS_LIBCLANG=DIR            libclang the peers' bindgen runs use (default
#                                         /usr/lib/llvm-14/lib where it exists; empty: as found)
#
# rdmakit is measured by rdmakit-perf (its safe API, every check on: no unsafe escape hatch is
# used); each peer crate by a small program of ours in peers/ (its own workspace, outside the
# main one: peers/README.md), which runs the same ping-pong and streaming loops. A crate that
# does not build, or cannot do an operation (jonhoo's ibverbs has no RDMA write), shows "-" and
# the reason is printed under the table. The build of each peer is timed.
#
# Rows: write latency 8 B (t_typical = median, us; and its t_min), write bandwidth 64 KiB
# (MiB/s), write message rate 8 B (Mpps), and the same three with send/recv, which every crate
# but async-rdma (here) can do. Each cell is the median over the runs.
# ratio = rdmakit / the best peer on that row (latency: <= 1 means rdmakit is at or ahead;
# bandwidth and rate: >= 1). rxe under TCG emulation is slow in absolute terms and the host is
# shared: only figures taken in the same run mean something, and runs are interleaved (every
# tool once per run, each run starting with the next tool) so that drifting load and the
# position in a round hit them alike.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
peers=${RDMAKIT_PEERS:-ibverbs sideway async-rdma}
out="$here/target/peers-compare"

if [ "${RDMAKIT_IN_RXE_VM:-}" != 1 ]; then
    cd "$here"
    mkdir -p "$out"
    # The rdma-core provider must be in the binary: install what it builds with, and have
    # the build fail rather than quietly leave it out (rdmakit-perf would then only say,
    # inside the VM, that it is not built in).
    scripts/dev.sh deps rdma
    RDMAKIT_SYS_VERBS=require cargo build --release --quiet -p rdmakit-perf
    for p in $peers; do
        # async-rdma's rdma-sys runs bindgen 0.59, which panics on libclang 16+, and ibverbs-sys
        # 0.3.2's bindgen 0.71 makes empty structs with libclang 22 (its build then fails on
        # layout checks): all peers are built against libclang 14 where there is one, the same
        # for each so that clang-sys is not rebuilt between them (RDMAKIT_PEERS_LIBCLANG=DIR
        # overrides; empty: whatever clang-sys finds).
        lc=${RDMAKIT_PEERS_LIBCLANG-/usr/lib/llvm-14/lib}
        [ -d "$lc" ] || lc=
        start=$(date +%s)
        if [ -n "${RDMAKIT_PEERS_NO_BUILD:-}" ]; then
            if [ -x "peers/target/release/peer-$p" ]; then echo "ok prebuilt"; else echo "failed (not built)"; fi \
                >"$out/build-$p.status"
        elif env ${lc:+LIBCLANG_PATH=$lc} \
            cargo build --release --manifest-path peers/Cargo.toml --features "$p" --bin "peer-$p" \
            >"$out/build-$p.log" 2>&1; then
            echo "ok $(($(date +%s) - start))s" >"$out/build-$p.status"
        else
            echo "failed $(($(date +%s) - start))s" >"$out/build-$p.status"
        fi
        echo "peers-compare: build of peer-$p: $(cat "$out/build-$p.status")" >&2
    done
    export RDMAKIT_RXE_RW_DIRS="${RDMAKIT_RXE_RW_DIRS:+$RDMAKIT_RXE_RW_DIRS:}$out"
    exec scripts/rxe-vm.sh "$0" "$@"
fi

# ---- inside the VM ----
cd "$here"
mkdir -p "$out"
: >"$out/runs.jsonl"
perf="$here/target/release/rdmakit-perf"
bin="$here/peers/target/release"
dev=${RDMAKIT_RXE_DEV:-rxe0}
gid=${RDMAKIT_RXE_GID_INDEX:-1}
ip=${RDMAKIT_RXE_IP:?not inside the rxe VM}
iters=${RDMAKIT_PEERS_ITERS:-2000}
runs=${RDMAKIT_PEERS_RUNS:-3}
port=7600
declare -A why=()

# one TOOL TEST ARGS...: one client/server run; the client's JSON line goes to $out/line (empty
# on failure, and the reason to why[]). Also kept in $out/runs.jsonl.
one() {
    : >"$out/line"
    local tool=$1 test=$2; shift 2
    if [ "$tool" = ibverbs ] && [[ $test == write-* ]]; then
        why[$tool/$test $*]="ibverbs 0.9.2 posts sends and receives only: it has no RDMA write"
        return
    fi
    if [ "$tool" = async-rdma ] && [[ $test == send-* ]]; then
        why[$tool/$test $*]="not measured: the async-rdma program runs the write rows only (peers/README.md)"
        return
    fi
    port=$((port + 1))
    local cmd
    if [ "$tool" = rdmakit ]; then
        cmd=("$perf" "$test" --provider verbs --device "$dev" --gid-index "$gid")
        # The peer programs ask for every completion; so does rdmakit here (its default is
        # perftest's, one in 100), so that the rows compare the same method.
        [[ $test == *-bw ]] && cmd+=(-Q 1)
    else
        cmd=("$bin/peer-$tool" "$test" --device "$dev" --gid-index "$gid")
    fi
    timeout 300 "${cmd[@]}" --server "$ip:$port" "$@" >/dev/null 2>"$out/server.err" &
    local srv=$!
    sleep 1
    # rdmakit-perf's client does not retry a connection (the peer programs retry for 60 s): on a
    # starved VM its server may need more than a second to listen, so wait for it to say so.
    local w
    if [ "$tool" = rdmakit ]; then
        for w in $(seq 100); do grep -q "serving on" "$out/server.err" && break; sleep 0.2; done
    fi
    if ! timeout 300 "${cmd[@]}" --connect "$ip:$port" --json "$@" >"$out/line" 2>"$out/client.err"; then
        why[$tool/$test $*]="$(tail -n 1 "$out/client.err")"
    fi
    # A server whose client failed would wait for it: give it a few seconds, then stop it.
    local i
    for i in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$srv" 2>/dev/null || break; sleep 0.5; done
    kill "$srv" 2>/dev/null || true
    wait "$srv" 2>/dev/null || true
    tail -n 1 "$out/line" | sed "s/^/{\"tool\":\"$tool\",\"row\":\"$test $*\"} /" >>"$out/runs.jsonl"
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

spread() { # "min-max" of the numbers on stdin, "-" if none
    sort -g | awk '{v[NR] = $1} END {if (NR == 0) print "-"; else printf "%s-%s\n", v[1], v[NR]}'
}

# measure NAME UNIT KIND TEST KEY ARGS...: one row.
declare -A cell spr
rows=()
measure() {
    local name=$1 unit=$2 kind=$3 test=$4 key=$5; shift 5
    rows+=("$name|$unit|$kind")
    # Latency rows also get a t_min row from the same runs: on a starved VM the median is
    # mostly scheduling, the minimum is what each stack costs when it gets the CPU.
    [ "$kind" = lat ] && rows+=("$name, t_min|$unit|$kind")
    local r t line
    declare -A vals mins got
    local k n=${#tools[@]}
    for r in $(seq "$runs"); do
        # Each run starts with the next tool: whichever goes first after a pause measured
        # lower on this VM (rdmakit-perf: 0.005 then 0.013 Mpps in two rounds of one run).
        for k in $(seq 0 $((n - 1))); do
            t=${tools[$(((k + r - 1) % n))]}
            one "$t" "$test" "$@"
            line=$(tail -n 1 "$out/line")
            if [ -n "$line" ]; then
                vals[$t]+="$(json "$key" "$line")"$'\n'
                got[$t]=$((${got[$t]:-0} + 1))
                mins[$t]+="$(json t_min "$line")"$'\n'
            fi
        done
    done
    for t in "${tools[@]}"; do
        if [ -n "${why[$t/$test $*]:-}" ] && [ "${got[$t]:-0}" -gt 0 ]; then
            why[$t/$test $*]="${got[$t]} of $runs runs gave a figure (the median is of those); a failed one: ${why[$t/$test $*]}"
        fi
        cell[$name/$t]=$(printf "%s" "${vals[$t]:-}" | { grep . || true; } | median)
        cell[$name, t_min/$t]=$(printf "%s" "${mins[$t]:-}" | { grep . || true; } | median)
        spr[$name/$t]=$(printf "%s" "${vals[$t]:-}" | { grep . || true; } | spread)
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
        if [ "$v" = - ]; then printf ' %17s' -; else awk -v v="$v" -v u="$unit" 'BEGIN {
            printf " %17s", sprintf(u == "Mpps" ? "%.5f" : (u == "usec" ? "%.1f" : "%.2f"), v) }'; fi
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
# Each tool's runs, fastest to slowest: in this VM one program's runs of a row can differ
# twofold, so a ratio of medians inside the others' spread is no difference between them.
echo "runs (min-max of each row's runs per crate):"
for row in "${rows[@]}"; do
    IFS='|' read -r name unit kind <<<"$row"
    [[ $name == *t_min ]] && continue
    line=""
    for t in rdmakit $peers; do
        v=${spr[$name/$t]:--}
        [ "$v" = - ] && continue
        line+=$(awk -v v="$v" -v u="$unit" -v t="$t" 'BEGIN { split(v, a, "-")
            g = (u == "Mpps") ? "%.5f" : (u == "usec" ? "%.1f" : "%.2f")
            printf "  %s " g "-" g, t, a[1], a[2] }')
    done
    printf '  %-24s%s\n' "$name" "$line"
done
if [ -n "${why[*]+x}" ]; then
    echo "not measured (\"-\"):"
    for k in "${!why[@]}"; do echo "  $k: ${why[$k]}"; done | sort
fi
