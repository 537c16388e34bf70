#!/usr/bin/env bash
# rxe-vm.sh - run one command inside a throwaway QEMU guest that has a Soft-RoCE
# (rdma_rxe) verbs device "rxe0", so rdmakit's tests exercise real rdma-core
# (libibverbs, librdmacm) on machines without RDMA hardware.
#
# Why a VM: the kernels of our dev/CI machines are built without InfiniBand
# (CONFIG_INFINIBAND unset), so on the host ibv_get_device_list() fails with
# ENOSYS and rdma_rxe cannot be loaded. The guest boots Debian's stock kernel,
# which has rdma_rxe. The package is fetched with `apt-get download` and
# unpacked with `dpkg-deb -x`; it is never installed, so the host's /boot and
# /lib/modules stay untouched.
#
# Why TCG: on these machines /dev/kvm is PVM (kvm_pvm, no vmx/svm in
# /proc/cpuinfo). A stock kernel cannot use it: QEMU aborts with -cpu host, and
# with other CPU models the guest stalls or crawls. Under software emulation
# (TCG) the kernel reaches /init in about 2 s. KVM is used only where the CPU shows vmx/svm and /dev/kvm
# is usable (that path is untested).
#
# How: the initramfs holds a static busybox, the 9p/overlay/virtio modules and
# rdma_rxe with its dependencies. It mounts the host's / read-only over virtio-9p
# under a tmpfs overlay, so host-built binaries run unchanged and every write
# goes to guest RAM. Then it creates dummy0 with an IP, switches root and runs
# stage 2 with the host's bash. Stage 2 adds rxe0 on dummy0 (rdma_cm does not
# resolve routes on an rxe device over lo), restores the caller's cwd and
# environment, and runs the command. The command's stdout and stderr go back
# over two virtio-serial ports. Its exit status comes back through a per-run 9p
# job directory. The VM has no NIC (-nodefaults), so no packet leaves it.
#
# Usage:
#   scripts/rxe-vm.sh [--] CMD [ARGS...]  run CMD in a fresh VM (runs setup first if needed)
#   scripts/rxe-vm.sh --setup             install host packages if missing (root: apt), download
#                                         and unpack kernel + busybox, build the initramfs
#   scripts/rxe-vm.sh --check             one line: can this machine run the rxe tier? exit 0/1
#   scripts/rxe-vm.sh --help
#   As a cargo runner (each test binary gets its own VM; doctests stay on the host):
#   CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER=/abs/path/scripts/rxe-vm.sh cargo test
#
# Inside the VM: stdin is /dev/null, cwd and exported environment are the
# caller's, `ulimit -l unlimited`, and
#   RDMAKIT_IN_RXE_VM=1  RDMAKIT_RXE_DEV=rxe0  RDMAKIT_RXE_GID_INDEX=1 (RoCE v2, IPv4)
#   RDMAKIT_RXE_IP=10.77.0.1 (on dummy0, MTU 9000; exists only inside the VM)
# Host paths under /run are hidden (the guest has its own /run). If this script
# is called inside the VM, it just runs CMD.
#
# Environment (host side):
#   RDMAKIT_RXE_TIMEOUT  wall-clock limit for the whole VM in seconds (default 1800, 0 = none)
#   RDMAKIT_RXE_RW_DIRS  colon-separated host directories shared READ-WRITE at the same
#                        path (created if missing), e.g. a cargo target dir or results dir;
#                        everything else is read-only, and guest writes elsewhere are discarded
#   RDMAKIT_RXE_CACHE    cache directory (default /var/cache/rdmakit-rxe-vm)
#   RDMAKIT_RXE_MEM      guest RAM in MiB (default 2048)
#   RDMAKIT_RXE_CPUS     guest vCPUs (default: host CPUs, at most 4)
#   RDMAKIT_RXE_ACCEL    auto (default) | tcg | kvm
#   RDMAKIT_RXE_KERNEL_PKG  kernel package to use (default: what linux-image-amd64 depends on)
#   RDMAKIT_RXE_VERBOSE  1 = boot timings and the guest console log on stderr
#
# Exit status: the command's own, or
#   124  RDMAKIT_RXE_TIMEOUT expired (the VM was killed)
#   125  the harness or VM failed (console log tail printed to stderr)
#   141  our stdout was closed early (e.g. `| head`); the VM was stopped
#   2    usage error
set -euo pipefail

readonly PROG=rxe-vm
readonly CACHE=${RDMAKIT_RXE_CACHE:-/var/cache/rdmakit-rxe-vm}
readonly GUEST_IP=10.77.0.1
readonly GUEST_NET=24
readonly GUEST_MTU=9000
# Loaded from the initramfs (with dependencies) before the host fs is mounted.
readonly INITRD_MODULES="virtio_pci virtio_console 9pnet_virtio 9p overlay dummy rdma_rxe ib_uverbs rdma_ucm"
# marker (command, file, or librxe) : Debian package providing it.
# Needed to boot the VM and use rxe0 at all:
readonly HOST_NEEDS="
qemu-system-x86_64:qemu-system-x86
depmod:kmod
modprobe:kmod
ip:iproute2
rdma:iproute2
xz:xz-utils
librxe:ibverbs-providers
"
# Needed to build rdmakit and for scripts/rxe-selftest.sh (installed by --setup
# as root; a non-root caller only gets a warning):
readonly HOST_WANTS="
ibv_devinfo:ibverbs-utils
rping:rdmacm-utils
ib_write_bw:perftest
/usr/include/infiniband/verbs.h:libibverbs-dev
/usr/include/rdma/rdma_cma.h:librdmacm-dev
"

verbose=${RDMAKIT_RXE_VERBOSE:-0}
say() { echo "$PROG: $*" >&2; }
note() { if [ "$verbose" = 1 ]; then say "$@"; fi; }
fail() { say "$*"; exit 125; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

usage() {
    # the header comment, from line 2 up to `set -euo pipefail`
    awk 'NR == 1 { next } /^set -euo pipefail/ { exit } { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"
}

# ====================================================================== host setup

# missing_packages LIST: prints the packages of LIST whose marker is missing.
missing_packages() {
    local line what pkg out=""
    for line in $1; do
        what=${line%%:*} pkg=${line#*:}
        case $what in
            librxe) compgen -G '/usr/lib/*/libibverbs/librxe-rdmav*.so' >/dev/null && continue ;;
            /*) [ -e "$what" ] && continue ;;
            *) command -v "$what" >/dev/null 2>&1 && continue ;;
        esac
        case " $out " in *" $pkg "*) ;; *) out="$out $pkg" ;; esac
    done
    echo "${out# }"
}

apt_update_done=0
apt_update() {
    if [ "$apt_update_done" = 0 ]; then
        say "apt-get update"
        timeout 600 apt-get update -qq >&2 || fail "apt-get update failed"
        apt_update_done=1
    fi
}

install_packages() {
    local need want log
    need=$(missing_packages "$HOST_NEEDS") want=$(missing_packages "$HOST_WANTS")
    [ -n "$need$want" ] || return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        if [ -n "$need" ]; then
            fail "missing packages: $need (as root: apt-get install --no-install-recommends $need $want)"
        fi
        say "warning: $want not installed (needed to build rdmakit and for rxe-selftest.sh)"
        return 0
    fi
    apt_update
    say "installing: $need $want"
    log=$(mktemp "${TMPDIR:-/tmp}/rdmakit-rxe-apt.XXXXXX")
    # shellcheck disable=SC2086
    if ! DEBIAN_FRONTEND=noninteractive timeout 1200 apt-get install -y -q --no-install-recommends $need $want > "$log" 2>&1; then
        tail -n 30 "$log" >&2
        fail "apt-get install failed (full log: $log)"
    fi
    rm -f "$log"
    need=$(missing_packages "$HOST_NEEDS$HOST_WANTS")
    [ -z "$need" ] || fail "still missing after install: $need"
}

# fetch_deb PACKAGE DIR: download PACKAGE's .deb (no install) and unpack it to $CACHE/DIR.
fetch_deb() {
    local pkg=$1 dest=$CACHE/$2 tmp
    tmp=$(mktemp -d "$CACHE/.fetch.XXXXXX")
    chown _apt "$tmp" 2>/dev/null || true   # lets apt download sandboxed
    if ! (cd "$tmp" && timeout 600 apt-get download -qq "$pkg" >&2 2>/dev/null); then
        apt_update
        (cd "$tmp" && timeout 600 apt-get download -qq "$pkg" >&2) || { rm -rf "$tmp"; fail "apt-get download $pkg failed"; }
    fi
    mkdir "$tmp/root"
    dpkg-deb -x "$tmp"/*.deb "$tmp/root" || { rm -rf "$tmp"; fail "dpkg-deb -x $pkg failed"; }
    basename "$tmp"/*.deb > "$tmp/root/.deb"
    rm -rf "$dest"
    mv "$tmp/root" "$dest"
    rm -rf "$tmp"
}

kernel_package() {
    if [ -n "${RDMAKIT_RXE_KERNEL_PKG:-}" ]; then echo "$RDMAKIT_RXE_KERNEL_PKG"; return; fi
    local p
    p=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }')
    if [ -z "$p" ]; then
        apt_update
        p=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }')
    fi
    [ -n "$p" ] || fail "cannot tell which kernel package linux-image-amd64 points to"
    echo "$p"
}

# Uncompressed ELF kernel from the bzImage: QEMU boots it through its PVH entry
# point, which saves the in-guest xz decompression (~2 s under TCG).
extract_vmlinux() { # bzImage out
    local off
    off=$(LC_ALL=C grep -obUaP '\xFD7zXZ\x00' "$1" | head -n1 | cut -d: -f1) || true
    [ -n "$off" ] || return 1
    # xz complains about the data after the stream; the ELF check below decides.
    tail -c +"$((off + 1))" "$1" | xz -dcq > "$2.tmp" 2>/dev/null || true
    if [ "$(head -c 4 "$2.tmp" | od -An -tx1 | tr -d ' \n')" = 7f454c46 ]; then
        mv "$2.tmp" "$2"
    else
        rm -f "$2.tmp"
        return 1
    fi
}

# ---------------------------------------------------------------- guest scripts
# Both go into the initramfs; their text is part of the initramfs cache key.

guest_init() {
    cat <<'INIT'
#!/bin/busybox sh
# PID 1 from the initramfs: host / (9p, ro) + tmpfs overlay, lo + dummy0, then
# switch_root into stage 2 (run by the host's bash).
/bin/busybox mkdir -p /dev /proc /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1
/bin/busybox --install -s /bin
export PATH=/bin
abort() { echo "rxe-vm init: $*"; echo o > /proc/sysrq-trigger; sleep 30; }
mount -t proc proc /proc
mount -t sysfs sysfs /sys
while read -r m; do insmod "/modules/$m" || echo "rxe-vm init: insmod $m failed"; done < /modules/order
P9=trans=virtio,version=9p2000.L,msize=512000
mkdir -p /lower /upper /newroot
mount -t 9p -o "$P9,ro,cache=loose" rdmakit-root /lower || abort "cannot mount the host root (9p)"
mount -t tmpfs -o mode=0755 tmpfs /upper
mkdir -p /upper/data /upper/work
mount -t overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work overlay /newroot || abort "overlay mount failed"
mount -t tmpfs -o mode=0755 tmpfs /newroot/run
J=/newroot/run/rdmakit-rxe
mkdir -p $J
mount -t 9p -o "$P9,cache=none" rdmakit-job $J || abort "cannot mount the job directory"
. $J/settings
# modprobe inside the guest finds the unpacked kernel package in the host cache
mkdir -p "/newroot/lib/modules/$(uname -r)"
mount -o bind "/newroot$MODDIR" "/newroot/lib/modules/$(uname -r)" || abort "cannot bind $MODDIR"
while read -r tag dir; do
    [ -n "$tag" ] || continue
    mkdir -p "/newroot$dir" && mount -t 9p -o "$P9,cache=mmap" "$tag" "/newroot$dir" || abort "cannot mount $dir read-write"
done < $J/rwdirs
hostname rdmakit-rxe
ip link set lo up || abort "lo up failed"
ip link show dummy0 >/dev/null 2>&1 || ip link add dummy0 type dummy || abort "cannot create dummy0"
ip link set dummy0 mtu "$MTU" up && ip addr add "$IP/$NET" dev dummy0 || abort "dummy0 setup failed"
cp /stage2 /newroot/run/rdmakit-rxe-stage2
for fs in dev proc sys; do mount --move /$fs /newroot/$fs; done
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o mode=620,ptmxmode=666 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
ln -sfn /proc/self/fd /newroot/dev/fd
ln -sfn fd/0 /newroot/dev/stdin
ln -sfn fd/1 /newroot/dev/stdout
ln -sfn fd/2 /newroot/dev/stderr
exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    switch_root /newroot /bin/bash /run/rdmakit-rxe-stage2
INIT
}

guest_stage2() {
    cat <<'STAGE2'
#!/bin/bash
# Stage 2, PID 1 on the overlay root. Bash builtins only where possible: under
# TCG every exec of a host binary through 9p costs tens of milliseconds.
J=/run/rdmakit-rxe
. $J/settings
exec {nap}<> <(:)   # read -t on this fd is a sleep without exec
nap() { read -r -t "$1" -u "$nap" _ || :; }
trace() {
    if [ "$VERBOSE" = 1 ]; then local up; read -r up _ < /proc/uptime; echo "[$up] $*" >> $J/trace; fi
}
finish() {
    if [ -s $J/rwdirs ]; then sync; fi
    echo "$1" > $J/status
    echo o > /proc/sysrq-trigger
    nap 30
}
trace "stage2 started"
out= err=
for ((i = 0; i < 400; i++)); do
    for p in /sys/class/virtio-ports/*; do
        [ -r "$p/name" ] || continue
        read -r n < "$p/name"
        case $n in rdmakit.stdout) out=/dev/${p##*/} ;; rdmakit.stderr) err=/dev/${p##*/} ;; esac
    done
    [ -c "$out" ] && [ -c "$err" ] && break
    nap 0.02
done
if [ -c "$out" ] && [ -c "$err" ]; then
    exec >"$out" 2>"$err"
else
    echo "rxe-vm: virtio-serial ports missing"; finish 125
fi
trace "output ports open"
rdma link add rxe0 type rxe netdev dummy0 || { echo "rxe-vm: rdma link add rxe0 failed" >&2; finish 125; }
# ready = port ACTIVE, GID 1 is our IPv4-mapped address, char devices present
port=/sys/class/infiniband/rxe0/ports/1
ready=0
for ((i = 0; i < 500; i++)); do
    st= gid=
    read -r st < $port/state 2>/dev/null
    read -r gid < $port/gids/1 2>/dev/null
    if [[ $st == *ACTIVE* && $gid == 0000:0000:0000:0000:0000:ffff:* && -c /dev/infiniband/uverbs0 && -c /dev/infiniband/rdma_cm ]]; then
        ready=1; break
    fi
    nap 0.02
done
[ "$ready" = 1 ] || { echo "rxe-vm: rxe0 did not become ready (state '$st', gid1 '$gid')" >&2; finish 125; }
trace "rxe0 ready"
. $J/env
export RDMAKIT_IN_RXE_VM=1 RDMAKIT_RXE_DEV=rxe0 RDMAKIT_RXE_GID_INDEX=1 RDMAKIT_RXE_IP=$IP
ulimit -l unlimited
read -r cwd < $J/cwd
cd -- "$cwd" || { echo "rxe-vm: cannot enter $cwd in the VM (paths under /run are hidden)" >&2; finish 125; }
. $J/cmd
trace "command starts"
# in a subshell, so not even a builtin like `exit` can end PID 1 early
( exec "${CMD[@]}" ) </dev/null
rc=$?
trace "command ended ($rc)"
finish $rc
STAGE2
}

build_initramfs() { # out
    local out=$1 d m n=0 deps
    # modprobe lists each module after its dependencies ("builtin X" for built-ins)
    # shellcheck disable=SC2086
    deps=$(modprobe -d "$KROOT" -S "$KVER" --show-depends -a $INITRD_MODULES) \
        || fail "kernel $KVER lacks one of: $INITRD_MODULES"
    d=$(mktemp -d "$CACHE/.initramfs.XXXXXX")
    mkdir -p "$d/bin" "$d/modules"
    cp "$BUSYBOX" "$d/bin/busybox"
    guest_init > "$d/init"
    guest_stage2 > "$d/stage2"
    chmod 755 "$d/init" "$d/stage2"
    : > "$d/modules/order"
    while read -r m; do
        local base=${m##*/}
        base=${base%.xz} base=${base%.zst} base=${base%.gz}
        if grep -qxF "$base" "$d/modules/order"; then continue; fi
        case $m in
            *.ko) cp "$m" "$d/modules/$base" ;;
            *.ko.xz) xz -dc "$m" > "$d/modules/$base" ;;
            *.ko.zst) zstd -qdc "$m" > "$d/modules/$base" ;;
            *.ko.gz) gzip -dc "$m" > "$d/modules/$base" ;;
            *) rm -rf "$d"; fail "unexpected module file $m" ;;
        esac
        echo "$base" >> "$d/modules/order"
        n=$((n + 1))
    done < <(awk '$1 == "insmod" { print $2 }' <<< "$deps")
    grep -qx 'rdma_rxe.ko' "$d/modules/order" || { rm -rf "$d"; fail "kernel $KVER: rdma_rxe module not found"; }
    (cd "$d" && find . | "$BUSYBOX" cpio -o -H newc 2>/dev/null) > "$out.tmp" \
        || { rm -rf "$d" "$out.tmp"; fail "cpio failed"; }
    mv "$out.tmp" "$out"
    rm -rf "$d"
    note "initramfs: $n modules, $(du -h "$out" | cut -f1)"
}

# Sets KROOT KVER MODDIR KIMG BUSYBOX INITRD from the cache (does not create anything).
# Returns 1 when something is missing.
load_cache_state() {
    KROOT=$CACHE/kernel
    [ -d "$KROOT" ] || return 1
    local mods
    for mods in "$KROOT/lib/modules" "$KROOT/usr/lib/modules" ""; do
        [ -n "$mods" ] || return 1
        [ -d "$mods" ] && break
    done
    KVER=$(find "$mods" -mindepth 1 -maxdepth 1 -type d -printf '%f\n' | sort -V | tail -n 1)
    [ -n "$KVER" ] || return 1
    MODDIR=$mods/$KVER
    BUSYBOX=$CACHE/busybox/bin/busybox
    KIMG=$CACHE/vmlinux-$KVER
    [ -s "$KIMG" ] || KIMG=$KROOT/boot/vmlinuz-$KVER
    local key
    key=$({ echo "$KVER $INITRD_MODULES"; cat "$CACHE/busybox/.deb" 2>/dev/null; guest_init; guest_stage2; } | sha256sum | cut -c1-16)
    INITRD=$CACHE/initramfs-$key.cpio
    [ -s "$MODDIR/modules.dep" ] && [ -f "$KIMG" ] && [ -x "$BUSYBOX" ] && [ -s "$INITRD" ]
}

setup() {
    local t0 lockfd kpkg
    t0=$(now)
    install_packages
    if load_cache_state; then
        note "cache ready (kernel $KVER)"
        return 0
    fi
    if ! { mkdir -p "$CACHE" 2>/dev/null && [ -w "$CACHE" ]; }; then
        fail "cannot write $CACHE (run --setup as root or set RDMAKIT_RXE_CACHE)"
    fi
    exec {lockfd}>"$CACHE/.lock"
    flock "$lockfd"
    if ! load_cache_state; then
        if [ ! -d "$CACHE/kernel" ] || [ -z "${KVER:-}" ]; then
            kpkg=$(kernel_package)
            say "downloading and unpacking $kpkg (not installing it)"
            fetch_deb "$kpkg" kernel
            load_cache_state || true
            [ -n "${KVER:-}" ] || fail "$kpkg contains no modules directory"
        fi
        [ -f "$KROOT/boot/vmlinuz-$KVER" ] || fail "the kernel package has no /boot/vmlinuz-$KVER"
        if [ ! -s "$MODDIR/modules.dep" ]; then
            depmod -b "$KROOT" "$KVER" || fail "depmod failed"
        fi
        if [ ! -s "$CACHE/vmlinux-$KVER" ] && grep -q '^CONFIG_PVH=y' "$KROOT/boot/config-$KVER" 2>/dev/null; then
            extract_vmlinux "$KROOT/boot/vmlinuz-$KVER" "$CACHE/vmlinux-$KVER" \
                || say "note: could not extract vmlinux, booting the compressed kernel (slower)"
        fi
        if [ ! -x "$CACHE/busybox/bin/busybox" ]; then
            say "downloading and unpacking busybox-static (not installing it)"
            fetch_deb busybox-static busybox
        fi
        load_cache_state || true
        if [ ! -s "$INITRD" ]; then
            rm -f "$CACHE"/initramfs-*.cpio
            build_initramfs "$INITRD"
        fi
        load_cache_state || fail "cache still incomplete in $CACHE"
    fi
    exec {lockfd}>&-
    note "setup took $(since "$t0") s"
}

# ========================================================================== checks

pick_accel() {
    local want=${RDMAKIT_RXE_ACCEL:-auto}
    case $want in
        tcg|kvm) echo "$want" ;;
        auto)
            if [ -r /dev/kvm ] && [ -w /dev/kvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo; then echo kvm; else echo tcg; fi ;;
        *) say "RDMAKIT_RXE_ACCEL must be auto, tcg or kvm"; exit 2 ;;
    esac
}

accel_reason() {
    if [ "$1" = kvm ]; then echo "kvm"; return; fi
    if [ ! -e /dev/kvm ]; then echo "tcg (no /dev/kvm)"
    elif ! grep -qwE 'vmx|svm' /proc/cpuinfo; then echo "tcg (/dev/kvm without vmx/svm, e.g. PVM: unusable for a stock kernel)"
    elif ! [ -r /dev/kvm ] || ! [ -w /dev/kvm ]; then echo "tcg (/dev/kvm not accessible)"
    else echo "tcg (forced)"; fi
}

check() {
    if [ "${RDMAKIT_IN_RXE_VM:-}" = 1 ]; then echo "$PROG: ok: already inside the rxe VM"; return 0; fi
    local arch pkgs how accel mem avail
    arch=$(uname -m)
    if [ "$arch" != x86_64 ]; then echo "$PROG: no: host is $arch, only x86_64 is supported"; return 1; fi
    pkgs=$(missing_packages "$HOST_NEEDS")
    if [ -z "$pkgs" ]; then
        how="qemu $(qemu-system-x86_64 --version | awk 'NR == 1 { print $4 }') present"
    elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        how="installable: $pkgs"
    else
        echo "$PROG: no: missing $pkgs and cannot install (not root or no apt-get)"; return 1
    fi
    if load_cache_state 2>/dev/null; then
        how="$how; kernel $KVER cached"
    elif ! { mkdir -p "$CACHE" 2>/dev/null && [ -w "$CACHE" ]; }; then
        echo "$PROG: no: $CACHE is not set up and not writable (run --setup as root or set RDMAKIT_RXE_CACHE)"; return 1
    elif ! command -v apt-get >/dev/null; then
        echo "$PROG: no: $CACHE is not set up and there is no apt-get to download the kernel"; return 1
    else
        how="$how; kernel to be downloaded"
    fi
    mem=${RDMAKIT_RXE_MEM:-2048}
    avail=$(awk '/^MemAvailable:/ { print int($2 / 1024) }' /proc/meminfo)
    if [ "$avail" -lt "$((mem + 256))" ]; then
        echo "$PROG: no: only $avail MiB available, the VM needs ${mem} MiB + overhead"; return 1
    fi
    accel=$(pick_accel)
    if [ "$accel" = kvm ] && ! { [ -r /dev/kvm ] && [ -w /dev/kvm ]; }; then
        echo "$PROG: no: RDMAKIT_RXE_ACCEL=kvm but /dev/kvm is not usable"; return 1
    fi
    echo "$PROG: ok: $how; accel $(accel_reason "$accel")"
}

# ============================================================================= run

run_vm() {
    local accel machine cpu cpus mem timeout_s t0 job
    accel=$(pick_accel)
    case $accel in
        kvm) machine=q35,accel=kvm cpu=host ;;
        tcg) machine=q35,accel=tcg cpu=max ;;
    esac
    cpus=${RDMAKIT_RXE_CPUS:-$(nproc)}
    if [ -z "${RDMAKIT_RXE_CPUS:-}" ] && [ "$cpus" -gt 4 ]; then cpus=4; fi
    mem=${RDMAKIT_RXE_MEM:-2048}
    # (with 64 MiB the guest hangs silently before printing anything)
    if ! [[ $mem =~ ^[0-9]+$ ]] || [ "$mem" -lt 256 ]; then say "RDMAKIT_RXE_MEM must be at least 256 (MiB)"; exit 2; fi
    [[ $cpus =~ ^[1-9][0-9]*$ ]] || { say "RDMAKIT_RXE_CPUS must be a positive number"; exit 2; }
    timeout_s=${RDMAKIT_RXE_TIMEOUT:-1800}
    [[ $timeout_s =~ ^[0-9]+$ ]] || { say "RDMAKIT_RXE_TIMEOUT must be a number of seconds"; exit 2; }

    t0=$(now)
    job=$(mktemp -d "${TMPDIR:-/tmp}/rdmakit-rxe.XXXXXX")
    JOB=$job QEMU_PID='' OUT_PID='' ERR_PID=
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    trap 'exit 129' HUP

    # --- job directory: what stage 2 needs
    {
        printf 'MODDIR=%q\nIP=%q\nNET=%q\nMTU=%q\nVERBOSE=%q\n' "$MODDIR" "$GUEST_IP" "$GUEST_NET" "$GUEST_MTU" "$verbose"
    } > "$job/settings"
    local cwd=$PWD
    [[ $cwd != *$'\n'* ]] || fail "the working directory contains a newline"
    printf '%s\n' "$cwd" > "$job/cwd"
    { printf 'CMD=('; printf '%q ' "$@"; printf ')\n'; } > "$job/cmd"
    # The exported environment, minus what bash owns and what the guest sets itself.
    export -p | grep -vE '^declare -[a-zA-Z-]*r[a-zA-Z]* |^declare -[a-zA-Z-]+ (BASH[A-Z_]*|BASHOPTS|SHELLOPTS|SHLVL|PWD|OLDPWD|_|PPID|UID|EUID|GROUPS|HOSTNAME|RDMAKIT_IN_RXE_VM|RDMAKIT_RXE_DEV|RDMAKIT_RXE_GID_INDEX|RDMAKIT_RXE_IP)(=|$)' \
        > "$job/env" || true

    local rw_args=() dir i=0
    : > "$job/rwdirs"
    if [ -n "${RDMAKIT_RXE_RW_DIRS:-}" ]; then
        local dirs
        IFS=: read -r -a dirs <<< "$RDMAKIT_RXE_RW_DIRS"
        for dir in "${dirs[@]}"; do
            [ -n "$dir" ] || continue
            mkdir -p -- "$dir" || fail "RDMAKIT_RXE_RW_DIRS: cannot create $dir"
            dir=$(cd -- "$dir" && pwd -P) || fail "RDMAKIT_RXE_RW_DIRS: cannot enter $dir"
            [[ $dir != *$'\n'* && $dir != *,* ]] || fail "RDMAKIT_RXE_RW_DIRS: unsupported character in $dir"
            rw_args+=(-fsdev "local,id=rw$i,path=$dir,security_model=none"
                      -device "virtio-9p-pci,fsdev=rw$i,mount_tag=rdmakit-rw$i")
            printf 'rdmakit-rw%d %s\n' "$i" "$dir" >> "$job/rwdirs"
            i=$((i + 1))
        done
    fi
    [[ $job != *,* && $CACHE != *,* ]] || fail "paths with commas are not supported by qemu options: $job $CACHE"

    # --- output channels: qemu writes into FIFOs, cat copies them to our stdout/stderr
    mkfifo "$job/stdout" "$job/stderr"
    cat "$job/stdout" & OUT_PID=$!
    cat "$job/stderr" >&2 & ERR_PID=$!

    local loglevel=1
    if [ "$verbose" = 1 ]; then loglevel=7; fi
    # shellcheck disable=SC2054  # the commas belong to qemu's option syntax
    local qemu=(qemu-system-x86_64 -nodefaults -no-user-config -display none -no-reboot
        -machine "$machine" -cpu "$cpu" -smp "$cpus" -m "$mem"
        -kernel "$KIMG" -initrd "$INITRD"
        -append "console=ttyS0 loglevel=$loglevel panic=-1 mitigations=off tsc=reliable no_timer_check 8250.nr_uarts=1 rdinit=/init"
        -serial "file:$job/console.log"
        -fsdev "local,id=root,path=/,security_model=none,readonly=on,multidevs=remap"
        -device "virtio-9p-pci,fsdev=root,mount_tag=rdmakit-root"
        -fsdev "local,id=job,path=$job,security_model=none"
        -device "virtio-9p-pci,fsdev=job,mount_tag=rdmakit-job"
        "${rw_args[@]}"
        -device virtio-serial-pci,id=vser
        -chardev "file,id=cout,path=$job/stdout" -device "virtserialport,bus=vser.0,chardev=cout,name=rdmakit.stdout"
        -chardev "file,id=cerr,path=$job/stderr" -device "virtserialport,bus=vser.0,chardev=cerr,name=rdmakit.stderr")
    note "accel $(accel_reason "$accel"), $cpus vCPUs, $mem MiB, kernel $KVER, timeout ${timeout_s}s"
    if [ "$timeout_s" != 0 ]; then
        timeout --kill-after=10 "$timeout_s" "${qemu[@]}" </dev/null & QEMU_PID=$!
    else
        "${qemu[@]}" </dev/null & QEMU_PID=$!
    fi

    # --- wait for qemu; if the stdout copier dies of SIGPIPE, stop the VM like a
    # host process that writes to a closed pipe.
    local done_pid qrc=0 st
    while :; do
        st=0 done_pid=
        wait -n -p done_pid "$QEMU_PID" ${OUT_PID:+"$OUT_PID"} || st=$?
        if [ "$done_pid" = "$QEMU_PID" ] || [ -z "$done_pid" ]; then qrc=$st; QEMU_PID=; break; fi
        OUT_PID=
        if [ "$st" -gt 128 ]; then exit 141; fi   # cleanup stops qemu
    done
    # qemu closed the FIFOs: the copiers drain and end. If qemu never opened them,
    # the copiers still block in open(); stop them after a grace period.
    local p alive
    for ((i = 0; i < 60; i++)); do
        alive=0
        for p in ${OUT_PID:-} $ERR_PID; do if kill -0 "$p" 2>/dev/null; then alive=1; fi; done
        if [ "$alive" = 0 ]; then break; fi
        sleep 0.05
    done
    kill ${OUT_PID:+"$OUT_PID"} "$ERR_PID" 2>/dev/null || true
    wait ${OUT_PID:+"$OUT_PID"} "$ERR_PID" 2>/dev/null || true
    OUT_PID='' ERR_PID=''

    if [ "$verbose" = 1 ]; then
        say "VM wall time $(since "$t0") s (qemu exit $qrc)"
        if [ -f "$job/trace" ]; then sed "s/^/$PROG: guest /" "$job/trace" >&2; fi
        { echo "----- guest console -----"; cat "$job/console.log"; echo "-------------------------"; } >&2 2>/dev/null || true
    fi
    local rc
    if [ -s "$job/status" ] && read -r rc < "$job/status" && [[ $rc =~ ^[0-9]+$ ]]; then
        exit "$rc"
    fi
    if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
        say "timed out after ${timeout_s}s (RDMAKIT_RXE_TIMEOUT); VM killed"
        exit 124
    fi
    say "the VM stopped without an exit status (qemu exit $qrc); guest console tail:"
    tail -n 40 "$job/console.log" >&2 2>/dev/null || true
    exit 125
}

# shellcheck disable=SC2317  # called from the EXIT trap
cleanup() {
    local p
    for p in ${QEMU_PID:-} ${OUT_PID:-} ${ERR_PID:-}; do kill "$p" 2>/dev/null || true; done
    if [ -n "${QEMU_PID:-}" ]; then wait "$QEMU_PID" 2>/dev/null || true; fi
    if [ -n "${JOB:-}" ]; then rm -rf "$JOB"; fi
}

# ============================================================================ main

case ${1:-} in
    -h|--help) usage; exit 0 ;;
    --check) check; exit $? ;;
    --setup)
        if [ "${RDMAKIT_IN_RXE_VM:-}" = 1 ]; then say "inside the rxe VM: nothing to set up"; exit 0; fi
        t0=$(now); setup
        echo "$PROG: ready: kernel $KVER, accel $(accel_reason "$(pick_accel)"), cache $CACHE ($(since "$t0") s)"
        exit 0 ;;
    --) shift ;;
    -*) say "unknown option $1 (see --help)"; exit 2 ;;
esac
[ $# -gt 0 ] || { usage >&2; exit 2; }

if [ "${RDMAKIT_IN_RXE_VM:-}" = 1 ]; then exec "$@"; fi
[ "$(uname -m)" = x86_64 ] || fail "only x86_64 hosts are supported"
setup
run_vm "$@"
