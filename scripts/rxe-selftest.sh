#!/usr/bin/env bash
# rxe-selftest.sh - quick end-to-end check of the Soft-RoCE VM tier (scripts/rxe-vm.sh).
#
# Boots one VM and checks, against rxe0:
#   - ibv_devinfo -d rxe0: port ACTIVE, GID[1] is the IPv4-mapped RDMAKIT_RXE_IP
#   - rdma_cm: rping server + client (-C 5 -v), and ucmatose
#   - perftest loopback: ib_write_bw, ib_atomic_lat (FETCH_AND_ADD)
# and on the host side that the guest's stdout and stderr came back separately.
# Prints "N passed, M failed". Exits 0 when everything passed, 1 when a check
# failed, or the harness's own status (124 timeout, 125 VM/harness failure).
#
# Usage: scripts/rxe-selftest.sh
# Without a VM (already inside one) it runs the in-VM checks directly.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STDERR_MARK="rxe-selftest: this line travels on stderr"

# ------------------------------------------------------------- inside the VM
in_vm() {
    local dev=${RDMAKIT_RXE_DEV:?} gid=${RDMAKIT_RXE_GID_INDEX:?} ip=${RDMAKIT_RXE_IP:?}
    local pass=0 fail=0 log
    log=$(mktemp -d)
    ok() { pass=$((pass + 1)); echo "PASS  $*"; }
    ko() { fail=$((fail + 1)); echo "FAIL  $*"; }
    show() { sed 's/^/      | /' "$@"; }

    # server/client pair: start the server, retry the client until the server
    # listens (rdma_cm listeners are not visible in /proc/net), then reap both.
    pair() { # name 'server cmd' 'client cmd' [grep pattern the client output must match]
        local name=$1 srv=$2 cli=$3 want=${4:-} spid crc=1 src try
        # shellcheck disable=SC2086
        timeout 90 $srv > "$log/srv" 2>&1 & spid=$!
        for try in 1 2 3 4 5 6 7 8 9 10; do
            sleep 0.5
            # shellcheck disable=SC2086
            if timeout 90 $cli > "$log/cli" 2>&1; then crc=0; break; else crc=$?; fi
            kill -0 "$spid" 2>/dev/null || break
        done
        src=0; wait "$spid" || src=$?
        if [ "$crc" = 0 ] && [ "$src" = 0 ] && { [ -z "$want" ] || grep -qE "$want" "$log/cli"; }; then
            ok "$name"
            if [ -n "$want" ]; then grep -E "$want" "$log/cli" | tail -n 2 | show; fi
        else
            ko "$name (client rc=$crc after $try tries, server rc=$src)"
            echo "      client:"; tail -n 8 "$log/cli" | show
            echo "      server:"; tail -n 8 "$log/srv" | show
        fi
    }

    echo "$STDERR_MARK" >&2
    echo "rxe-selftest: dev=$dev gid_index=$gid ip=$ip kernel=$(uname -r)"

    if ibv_devinfo -v -d "$dev" > "$log/devinfo" 2>&1 \
        && grep -q 'state:.*PORT_ACTIVE' "$log/devinfo" \
        && grep -qE "GID\[ *$gid\]:[[:space:]]*::ffff:$ip\b" "$log/devinfo"; then
        ok "ibv_devinfo -d $dev (PORT_ACTIVE, GID[$gid] = ::ffff:$ip)"
    else
        ko "ibv_devinfo -d $dev"; show "$log/devinfo"
    fi

    pair "rping (rdma_cm, 5 round trips)" \
        "rping -s -a $ip -C 5" "rping -c -a $ip -C 5 -v" '^ping data:'
    pair "ucmatose (rdma_cm)" \
        "ucmatose -b $ip" "ucmatose -s $ip" '^test complete'
    pair "ib_write_bw loopback" \
        "ib_write_bw -d $dev -x $gid -F -s 65536 -n 500" "ib_write_bw -d $dev -x $gid -F -s 65536 -n 500 $ip" \
        '^ *65536 +500 '
    pair "ib_atomic_lat FETCH_AND_ADD loopback" \
        "ib_atomic_lat -d $dev -x $gid -F -A FETCH_AND_ADD -n 1000" \
        "ib_atomic_lat -d $dev -x $gid -F -A FETCH_AND_ADD -n 1000 $ip" '^ *8 +1000 '

    rm -rf "$log"
    echo "in-vm: $pass passed, $fail failed"
    [ "$fail" = 0 ]
}

if [ "${1:-}" = --in-vm ] || [ "${RDMAKIT_IN_RXE_VM:-}" = 1 ]; then
    rc=0; in_vm || rc=$?
    [ "$rc" = 0 ] || exit 1
    exit 0
fi

# ------------------------------------------------------------------- host side
out=$(mktemp) err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT
t0=$(date +%s)
rc=0
RDMAKIT_RXE_TIMEOUT=${RDMAKIT_RXE_TIMEOUT:-600} \
    "$HERE/rxe-vm.sh" "$HERE/rxe-selftest.sh" --in-vm > >(tee "$out") 2> >(tee "$err" >&2) || rc=$?
wait   # let the tee processes flush
secs=$(( $(date +%s) - t0 ))

if [ "$rc" = 124 ] || [ "$rc" = 125 ]; then
    echo "rxe-selftest: the VM harness failed (exit $rc) after ${secs}s"
    exit "$rc"
fi
pass=0 fail=0
if line=$(grep -E '^in-vm: [0-9]+ passed, [0-9]+ failed$' "$out"); then
    read -r _ pass _ fail _ <<< "$line"
else
    echo "FAIL  in-VM suite printed no summary (exit $rc)"; fail=1
fi
if [ "$fail" = 0 ] && [ "$rc" != 0 ]; then
    echo "FAIL  in-VM suite exited $rc although it reported no failure"; fail=$((fail + 1))
fi
if grep -qxF "$STDERR_MARK" "$err" && ! grep -qF "$STDERR_MARK" "$out"; then
    echo "PASS  guest stderr came back on stderr only"; pass=$((pass + 1))
else
    echo "FAIL  guest stderr did not come back separately"; fail=$((fail + 1))
fi
echo "$pass passed, $fail failed (${secs}s)"
[ "$fail" = 0 ]
