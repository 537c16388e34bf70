#!/usr/bin/env bash
# perftest and rdmakit-perf side by side on the same Soft-RoCE device (rxe0), in one run
# inside the rxe VM (scripts/rxe-vm.sh), with the ratios rdmakit/perftest.
#
#   scripts/perftest-compare.sh            build rdmakit-perf (release) and run everything
#   RDMAKIT_COMPARE_ITERS=5000 ...         iterations per test (default 2000)
#   RDMAKIT_COMPARE_RUNS=7 ...             runs per tool and test; the median is reported (default 5)
#   RDMAKIT_COMPARE_SWEEP="8 4096 65536"   message sizes of the size sweep (default 8 512 4096 65536;
#                                          empty: no sweep)
#   RDMAKIT_COMPARE_ROWS='rate|bandwidth 64'  only the rows whose name matches this
#                                          extended regular expression (default: all)
#   RDMAKIT_COMPARE_TMIN=0                 no t_min row under each latency row (default: 1)
#
# Tests: bandwidth of ib_write_bw, ib_read_bw, ib_send_bw against write-bw, read-bw, send-bw
# (64 KiB); message rate of ib_write_bw -s 8 against write-bw -s 8 (Mpps); latency of
# ib_write_lat, ib_read_lat, ib_send_lat against write-lat, read-lat, send-lat (8 B) and
# ib_atomic_lat against atomic-lat (fetch-and-add); then write bandwidth and write latency
# over the size sweep.
# Bandwidth ratio = rdmakit / perftest (goal >= 0.95); latency ratio = rdmakit / perftest
# on t_typical (goal <= 1.05). rxe under TCG emulation is slow in absolute terms: only the
# ratios, measured in the same run on the same device, mean something.
# Each row ends with the spread of each program's runs (fastest to slowest) and says when
# each median lies inside the other program's runs: in this VM the runs of one program and
# row can differ twofold (8-byte message rates of all three of perftest, rdmakit and a
# variant fell near 0.017 or near 0.031 Mpps from run to run), so such a ratio of medians
# is not a difference between the programs.
# Each latency row is followed by a t_min row (the medians of the runs' fastest iterations),
# a diagnosis without a goal: in this VM t_typical moves with where the scheduler puts the
# two processes and rxe's kernel work (the same ib_read_lat gave 31 and 57 us t_typical in
# two runs, and pinning the programs to vCPUs moved both programs between 31 and 67 us),
# and t_min, each run's fastest iteration, carries the least of that (it still moves: 21 to
# 35 us for rdmakit's 8-byte read in four runs of one evening).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The sweep's CSV and SVG go to target/perftest-compare/, shared read-write with the VM (the
# rest of the host is read-only there, and a guest's writes elsewhere are discarded).
results=target/perftest-compare

if [ "${RDMAKIT_IN_RXE_VM:-}" != 1 ]; then
    cd "$here"
    # The rdma-core provider must be in the binary: install what it builds with, and have
    # the build fail rather than quietly leave it out (rdmakit-perf would then only say,
    # inside the VM, that it is not built in).
    scripts/dev.sh deps rdma
    RDMAKIT_SYS_VERBS=require cargo build --release --quiet -p rdmakit-perf
    mkdir -p "$results"
    export RDMAKIT_RXE_RW_DIRS="${RDMAKIT_RXE_RW_DIRS:+$RDMAKIT_RXE_RW_DIRS:}$here/$results"
    exec scripts/rxe-vm.sh "$0" "$@"
fi

# ---- inside the VM ----
cd "$here"
perf="$here/target/release/rdmakit-perf"
dev=${RDMAKIT_RXE_DEV:-rxe0}
gid=${RDMAKIT_RXE_GID_INDEX:-1}
ip=${RDMAKIT_RXE_IP:?not inside the rxe VM}
iters=${RDMAKIT_COMPARE_ITERS:-2000}
runs=${RDMAKIT_COMPARE_RUNS:-5}
sweep=${RDMAKIT_COMPARE_SWEEP-8 512 4096 65536}
rows=${RDMAKIT_COMPARE_ROWS:-.}
tmin=${RDMAKIT_COMPARE_TMIN:-1}
port=7471

# perftest: prints the result line (the first all-numeric line after its header).
# A client that fails (its server not listening yet on a starved VM) is tried again; a
# server left waiting for a client that never came is stopped, so one bad run cannot hang
# the whole comparison.
perftest() { # perftest TOOL ARGS...
    local tool=$1; shift
    timeout 300 "$tool" -d "$dev" -x "$gid" -F "$@" >/dev/null 2>&1 &
    local srv=$! try line=""
    for try in 1 2 3; do
        sleep 1
        line=$(timeout 300 "$tool" -d "$dev" -x "$gid" -F "$@" "$ip" 2>/dev/null |
            awk '/^ *[0-9]+ +[0-9]+ +[0-9.]+/ {print; exit}') || true
        [ -n "$line" ] && break
        kill -0 "$srv" 2>/dev/null || break
    done
    [ -n "$line" ] && echo "$line"
    for try in $(seq 20); do kill -0 "$srv" 2>/dev/null || break; sleep 0.5; done
    kill "$srv" 2>/dev/null || true
    wait "$srv" 2>/dev/null || true
}

# rdmakit-perf over rdma_cm: prints the JSON result line.
rdmakit() { # rdmakit TEST ARGS...
    local test=$1; shift
    port=$((port + 1))
    local log
    log=$(mktemp)
    timeout 300 "$perf" "$test" --provider verbs --device "$dev" --gid-index "$gid" --server "$ip:$port" "$@" 2>"$log" &
    local srv=$! w
    # The client does not retry its connection: wait until the server says it listens (a
    # starved VM may take more than a second), rather than for a fixed time.
    for w in $(seq 150); do grep -q "serving on" "$log" && break; sleep 0.2; done
    rm -f "$log"
    timeout 300 "$perf" "$test" --provider verbs --device "$dev" --gid-index "$gid" --connect "$ip:$port" --json "$@" || true
    for w in $(seq 20); do kill -0 "$srv" 2>/dev/null || break; sleep 0.5; done
    kill "$srv" 2>/dev/null || true
    wait "$srv" 2>/dev/null || true
}

json() { # json KEY LINE
    sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p" <<<"$2"
}

spread() { # spread: "min-max" of the numbers on stdin (blank lines skipped), "-" if none
    sort -g | awk 'NF {v[++n] = $1} END {if (n == 0) print "-"; else printf "%s-%s\n", v[1], v[n]}'
}

median() { # median: of the numbers on stdin (blank lines, runs that gave nothing, skipped)
    sort -g | awk 'NF {v[++n] = $1} END {if (n == 0) print 0; else if (n % 2) print v[(n + 1) / 2]; else print (v[n / 2] + v[n / 2 + 1]) / 2}'
}

# measure KIND TEST-ARGS...: median over $runs of perftest's column and rdmakit's JSON key.
compare() { # compare NAME UNIT KIND PERFTEST-TOOL PERFTEST-COL RDMAKIT-TEST JSON-KEY -- ARGS...
    local name=$1 unit=$2 kind=$3 tool=$4 col=$5 test=$6 key=$7
    shift 8
    if ! grep -Eq -- "$rows" <<<"$name"; then
        last=("$tool" "$test" "" "")
        return
    fi
    # The two programs' runs alternate, so that the VM's speed drifting during the row (TCG
    # on a shared host: perftest's 8 B write latency went from 18 to 11 us between two rows
    # of one run) moves both medians alike instead of skewing the ratio.
    # A latency row also keeps each run's t_min (perftest's column 3) for its t_min row (see
    # the header).
    local p r i pl rl ps=() rs=() pmins=() rmins=()
    for i in $(seq "$runs"); do
        pl=$(perftest "$tool" "$@") || true
        rl=$(rdmakit "$test" "$@") || true
        ps+=("$(awk -v c="$col" '{print $c}' <<<"$pl")")
        rs+=("$(json "$key" "$rl")")
        if [ "$kind" = lat ]; then
            pmins+=("$(awk '{print $3}' <<<"$pl")")
            rmins+=("$(json t_min "$rl")")
        fi
    done
    p=$(printf '%s\n' "${ps[@]}" | median)
    r=$(printf '%s\n' "${rs[@]}" | median)
    row "$name" "$unit" "$p" "$r" "$kind" \
        "$(printf '%s\n' "${ps[@]}" | spread)" "$(printf '%s\n' "${rs[@]}" | spread)"
    last=("$tool" "$test" "$p" "$r")
    if [ "$kind" = lat ] && [ "$tmin" = 1 ]; then
        row "  t_min" "$unit" "$(printf '%s\n' "${pmins[@]}" | median)" "$(printf '%s\n' "${rmins[@]}" | median)" min \
            "$(printf '%s\n' "${pmins[@]}" | spread)" "$(printf '%s\n' "${rmins[@]}" | spread)"
    fi
}

row() { # row NAME UNIT PERFTEST RDMAKIT KIND(bw|lat|min) [PERFTEST-SPREAD RDMAKIT-SPREAD]
    # The spreads ("min-max" of each program's runs) follow the goal: rates and latencies in
    # this VM move between runs by more than the goals' margins (a program's runs of one
    # row can differ twofold), and a ratio of medians says little where each median lies
    # inside the other program's runs; the row then says so.
    awk -v n="$1" -v u="$2" -v p="$3" -v r="$4" -v k="$5" -v ps="${6:--}" -v rs="${7:--}" 'BEGIN {
        ratio = (p > 0) ? r / p : 0
        if (k == "bw") goal = ratio >= 0.95 ? "met (>= 0.95)" : "missed (>= 0.95)"
        else if (k == "lat") goal = ratio <= 1.05 ? "met (<= 1.05)" : "missed (<= 1.05)"
        else goal = "(no goal: diagnosis)"
        # Message rates on rxe under TCG are hundredths of a Mpps: print enough digits.
        f = (u == "Mpps") ? "%12.5f" : "%12.2f"
        g = (u == "Mpps") ? "%.5f" : "%.2f"
        runs = ""
        if (ps != "-" && rs != "-" && split(ps, a, "-") == 2 && split(rs, b, "-") == 2) {
            runs = sprintf("  runs: perftest " g "-" g ", rdmakit " g "-" g, a[1], a[2], b[1], b[2])
            if (r >= a[1] && r <= a[2] && p >= b[1] && p <= b[2]) runs = runs ", each median inside the other'"'"'s runs"
        }
        printf "%-26s %-8s " f " " f " %8.3f  %s%s\n", n, u, p, r, ratio, goal, runs
    }'
}

echo "perftest vs rdmakit-perf on $dev (GID $gid, $ip), $iters iterations, median of $runs runs each, same VM"
printf '%-26s %-8s %12s %12s %8s  %s\n' test unit perftest rdmakit ratio goal
compare "write bandwidth 64 KiB" MiB/s bw ib_write_bw 4 write-bw bw_average_mb_per_sec -- -s 65536 -n "$iters"
compare "read bandwidth 64 KiB" MiB/s bw ib_read_bw 4 read-bw bw_average_mb_per_sec -- -s 65536 -n "$iters"
compare "send bandwidth 64 KiB" MiB/s bw ib_send_bw 4 send-bw bw_average_mb_per_sec -- -s 65536 -n "$iters"
compare "write message rate 8 B" Mpps bw ib_write_bw 5 write-bw msg_rate_mpps -- -s 8 -n "$iters"
compare "send message rate 8 B" Mpps bw ib_send_bw 5 send-bw msg_rate_mpps -- -s 8 -n "$iters"
compare "write latency 8 B" usec lat ib_write_lat 5 write-lat t_typical -- -s 8 -n "$iters"
compare "read latency 8 B" usec lat ib_read_lat 5 read-lat t_typical -- -s 8 -n "$iters"
compare "send latency 8 B" usec lat ib_send_lat 5 send-lat t_typical -- -s 8 -n "$iters"
compare "fetch-and-add latency" usec lat ib_atomic_lat 5 atomic-lat t_typical -- -n "$iters"
# The sweep also goes to a CSV and an SVG plot (rdmakit-perf plot), named relative to the
# checkout so that the plot's report names no path of this machine.
csv="$results/perftest-compare.csv"
echo "# perftest vs rdmakit-perf on $dev, median of $runs runs, $(date -u +%Y-%m-%dT%H:%MZ)" >"$csv"
for size in $sweep; do
    for k in bw lat; do
        if [ "$k" = bw ]; then
            compare "write bandwidth $size B" MiB/s bw ib_write_bw 4 write-bw bw_average_mb_per_sec -- -s "$size" -n "$iters"
        else
            compare "write latency $size B" usec lat ib_write_lat 5 write-lat t_typical -- -s "$size" -n "$iters"
        fi
        [ -n "${last[2]}" ] || continue
        printf 'perftest %s,%s,%s,%s\nrdmakit %s,%s,%s,%s\n' \
            "${last[0]}" "$k" "$size" "${last[2]}" "${last[1]}" "$k" "$size" "${last[3]}" >>"$csv"
    done
done
[ "$(grep -vc '^#' "$csv")" -gt 0 ] || exit 0
"$perf" plot "$csv" --output "$results/perftest-compare.svg" \
    --title "perftest vs rdmakit-perf, Soft-RoCE ($dev) in a TCG-emulated VM"
