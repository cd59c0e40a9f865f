#!/usr/bin/env bash
# testbed.sh - a second, independent, bandwidth-capped storage path on one
# machine, for measuring multi-path I/O gains in mlp-offload.
#
# The path is: RAM-backed file on /dev/shm -> loop device -> ext4 -> mount
# point, with a cgroup v1 blkio throttle rule (read and write bytes/s) naming
# only that loop device. Processes started with `testbed.sh run -- CMD` are
# placed in the throttled cgroup, so their I/O to the loop device is capped,
# while their I/O to any other disk is not.
#
# Run `scripts/testbed.sh --help` for usage.

set -euo pipefail

PROG=$(basename "$0")
NAME=${MLP_TESTBED_NAME:-mlp-offload-testbed}
IMG=${MLP_TESTBED_IMG:-/dev/shm/${NAME}.img}
MNT=${MLP_TESTBED_MNT:-/mnt/${NAME}}
STATE=${MLP_TESTBED_STATE:-/run/${NAME}.env}
DEFAULT_SIZE=4G
DEFAULT_BPS=500M

usage() {
    cat <<EOF
Usage: $PROG <command> [options]

Builds (and tears down) a second, bandwidth-capped storage path:
  $IMG (RAM-backed, on /dev/shm)
    -> loop device -> ext4 -> $MNT
  with a cgroup v1 blkio group '$NAME' that throttles reads and writes to
  that loop device only. All commands except 'check' and '--help' need root.

Commands:
  check
      Exit 0 if this machine can host the test bed: running as root, losetup
      and mkfs.ext4 installed, loop devices available, cgroup v1 blkio
      controller mounted with blkio.throttle.* files, /dev/shm has room for
      the image (default size $DEFAULT_SIZE, or --size). Otherwise print WHY
      not, and exit 1.

  up [--size SIZE] [--bps BPS]
      Run 'check', then create the backing file, attach a loop device, make
      an ext4 file system on it, mount it at $MNT, create the blkio cgroup and
      write "MAJ:MIN BPS" into blkio.throttle.{read,write}_bps_device.
      Defaults: --size $DEFAULT_SIZE, --bps $DEFAULT_BPS.
      Idempotent: if already up, says so (re-applying --bps if given) and
      succeeds. The mount point is printed on stdout as the LAST line, all
      other messages go to stderr:   dir=\$($PROG up | tail -1)
      State is saved in $STATE.

  run [--] CMD [ARGS...]
      Move this shell into the throttled cgroup and exec CMD, so that all I/O
      CMD (and its children) issue to the loop device is capped. I/O to other
      disks is unaffected. Needs the test bed to be up.
      NOTE: only I/O submitted by the process itself is throttled: O_DIRECT
      I/O and reads are; buffered writes are flushed later by kernel
      writeback threads (outside the cgroup under cgroup v1) and are NOT.

  cap DIR BPS
      Also throttle the disk holding DIR (read and write, BPS bytes/s; 0
      removes the rule) for processes in the test bed's cgroup, e.g. to
      take a noisy shared work disk's swings out of a measurement. The rule
      goes with the cgroup at 'down'. Needs the test bed to be up.

  down
      Unmount, detach the loop device, move leftover processes back to the
      root blkio cgroup, remove the cgroup, the backing file and the state
      file. Does whatever it can if the test bed is only partly up; always
      exits 0 (warnings on stderr). Idempotent.

  status
      Print the saved state and whether each piece is present.

  -h, --help
      Show this help.

Sizes (SIZE, BPS): a plain number is bytes; K, M, G, T (or KiB, MiB, ...)
are powers of 1024; KB, MB, GB, TB are powers of 1000. So --bps 500M is
500 MiB/s (524288000 bytes/s), the same unit fio reports as MiB/s.

Environment overrides: MLP_TESTBED_NAME, MLP_TESTBED_IMG, MLP_TESTBED_MNT,
MLP_TESTBED_STATE.
EOF
}

msg()  { printf '%s: %s\n' "$PROG" "$*" >&2; }
warn() { printf '%s: warning: %s\n' "$PROG" "$*" >&2; }
die()  { printf '%s: error: %s\n' "$PROG" "$*" >&2; exit 1; }

# to_bytes SIZE -> prints the size in bytes, or fails.
to_bytes() {
    local s=$1 num unit mult
    if [[ ! $s =~ ^([0-9]+)([KkMmGgTt]?)(i?[Bb]?)$ ]]; then
        return 1
    fi
    num=${BASH_REMATCH[1]}
    unit=${BASH_REMATCH[2]^^}
    local base=1024
    if [[ -n $unit && ${BASH_REMATCH[3]} =~ ^[Bb]$ ]]; then
        base=1000
    elif [[ -z $unit && -n ${BASH_REMATCH[3]} && ${BASH_REMATCH[3]} != [Bb] ]]; then
        return 1
    fi
    case $unit in
        "") mult=1 ;;
        K) mult=$base ;;
        M) mult=$((base ** 2)) ;;
        G) mult=$((base ** 3)) ;;
        T) mult=$((base ** 4)) ;;
    esac
    echo $((10#$num * mult))
}

# Mount point of the cgroup v1 hierarchy that has the blkio controller.
blkio_root() {
    local mnt type opts rest
    while read -r _ mnt type opts rest; do
        if [[ $type == cgroup && ,$opts, == *,blkio,* ]]; then
            printf '%s\n' "$mnt"
            return 0
        fi
    done </proc/mounts
    return 1
}

# Prints the reasons (one a line) why the test bed is unavailable; returns 1
# if there are any. $1 = bytes needed on /dev/shm (0: skip the room check).
find_problems() {
    local need=$1 problems=() tool pkg missing=()

    if [[ $(id -u) -ne 0 ]]; then
        problems+=("not running as root (uid $(id -u)); losetup, mount and cgroup writes need root")
    fi

    for tool in losetup:mount mkfs.ext4:e2fsprogs mount:mount umount:mount \
                mountpoint:util-linux findmnt:util-linux truncate:coreutils df:coreutils; do
        pkg=${tool#*:}
        tool=${tool%%:*}
        if ! command -v "$tool" >/dev/null 2>&1; then
            missing+=("$tool (Debian package: $pkg)")
        fi
    done
    if ((${#missing[@]})); then
        problems+=("missing tools: ${missing[*]}")
    fi

    if command -v losetup >/dev/null 2>&1; then
        if [[ ! -e /dev/loop-control && ! -d /sys/module/loop ]]; then
            problems+=("loop device driver not available (no /dev/loop-control, no /sys/module/loop; try 'modprobe loop')")
        elif ! losetup --find >/dev/null 2>&1; then
            problems+=("no free loop device ('losetup --find' failed: $(losetup --find 2>&1 | head -1))")
        fi
    fi

    local root
    if ! root=$(blkio_root); then
        if grep -q ' cgroup2 ' /proc/mounts; then
            problems+=("cgroup v1 blkio controller is not mounted (only cgroup v2 is; this script needs the v1 blkio.throttle.* interface)")
        else
            problems+=("cgroup v1 blkio controller is not mounted (expected e.g. /sys/fs/cgroup/blkio)")
        fi
    else
        local f
        for f in blkio.throttle.read_bps_device blkio.throttle.write_bps_device cgroup.procs; do
            if [[ ! -e $root/$f ]]; then
                problems+=("blkio controller at $root has no $f (kernel built without CONFIG_BLK_DEV_THROTTLING?)")
            fi
        done
        if [[ ! -w $root ]]; then
            problems+=("blkio cgroup hierarchy $root is not writable (read-only mount or not root)")
        fi
    fi

    if ! mountpoint -q /dev/shm 2>/dev/null && [[ ! -d /dev/shm ]]; then
        problems+=("/dev/shm does not exist")
    elif ((need > 0)); then
        local avail
        avail=$(df --output=avail -B1 /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
        if [[ -z $avail || ! $avail =~ ^[0-9]+$ ]]; then
            problems+=("cannot read free space of /dev/shm")
        elif ((avail < need)); then
            problems+=("/dev/shm has only $((avail / 1048576)) MiB free, the image needs $((need / 1048576)) MiB (use a smaller --size)")
        fi
    fi

    if ((${#problems[@]})); then
        printf '%s\n' "${problems[@]}"
        return 1
    fi
    return 0
}

# check_or_die NEED_BYTES: prints why not available and exits 1.
check_or_die() {
    local out
    if ! out=$(find_problems "$1"); then
        printf '%s: test bed NOT available on this machine:\n' "$PROG" >&2
        printf '%s\n' "$out" | sed 's/^/  - /' >&2
        exit 1
    fi
}

load_state() {
    LOOP='' MOUNT='' CGROUP='' BACKING='' BPS='' SIZE=''
    if [[ -f $STATE ]]; then
        local k v
        while IFS='=' read -r k v; do
            case $k in
                LOOP) LOOP=$v ;; MOUNT) MOUNT=$v ;; CGROUP) CGROUP=$v ;;
                BACKING) BACKING=$v ;; BPS) BPS=$v ;; SIZE) SIZE=$v ;;
            esac
        done <"$STATE"
        return 0
    fi
    return 1
}

save_state() {
    local tmp=$STATE.tmp.$$
    cat >"$tmp" <<EOF
LOOP=$LOOP
MOUNT=$MOUNT
CGROUP=$CGROUP
BACKING=$BACKING
BPS=$BPS
SIZE=$SIZE
EOF
    mv -f "$tmp" "$STATE"
}

# True if the saved state describes a test bed that is fully up.
is_up() {
    load_state || return 1
    [[ -n $LOOP && -b $LOOP && -n $MOUNT && -n $CGROUP && -n $BACKING ]] || return 1
    [[ -f $BACKING && -d $CGROUP ]] || return 1
    mountpoint -q "$MOUNT" 2>/dev/null || return 1
    # Is the loop device still backed by our image, and mounted at MOUNT?
    losetup -j "$BACKING" 2>/dev/null | grep -q "^$LOOP:" || return 1
    [[ $(findmnt -n -o SOURCE --mountpoint "$MOUNT" 2>/dev/null) == "$LOOP" ]] || return 1
    return 0
}

set_throttle() { # CGROUP LOOP BPS
    local cg=$1 loop=$2 bps=$3 devno
    devno=$(cat "/sys/class/block/$(basename "$loop")/dev")
    echo "$devno $bps" >"$cg/blkio.throttle.read_bps_device"
    echo "$devno $bps" >"$cg/blkio.throttle.write_bps_device"
    msg "throttle: $devno ($loop) read+write capped at $bps bytes/s ($((bps / 1048576)) MiB/s) in $cg"
}

cmd_check() {
    local size=$DEFAULT_SIZE need
    while (($#)); do
        case $1 in
            --size) size=${2:?--size needs a value}; shift 2 ;;
            --size=*) size=${1#*=}; shift ;;
            -h|--help) usage; exit 0 ;;
            *) die "check: unknown argument '$1' (see --help)" ;;
        esac
    done
    need=$(to_bytes "$size") || die "bad --size '$size'"
    check_or_die "$need"
    msg "OK: test bed is supported here (root, losetup, loop devices, blkio throttle at $(blkio_root), /dev/shm room for $size)"
}

on_up_exit() {
    local rc=$1
    if ((rc)); then
        warn "up failed (exit $rc); rolling back"
        cmd_down || true
    fi
    exit "$rc"
}

cmd_up() {
    local size=$DEFAULT_SIZE bps_arg='' size_b bps_b
    while (($#)); do
        case $1 in
            --size) size=${2:?--size needs a value}; shift 2 ;;
            --size=*) size=${1#*=}; shift ;;
            --bps) bps_arg=${2:?--bps needs a value}; shift 2 ;;
            --bps=*) bps_arg=${1#*=}; shift ;;
            -h|--help) usage; exit 0 ;;
            *) die "up: unknown argument '$1' (see --help)" ;;
        esac
    done
    size_b=$(to_bytes "$size") || die "bad --size '$size' (e.g. 4G, 512M)"
    bps_b=$(to_bytes "${bps_arg:-$DEFAULT_BPS}") || die "bad --bps '$bps_arg' (e.g. 500M, 1G)"
    ((size_b >= 64 * 1048576)) || die "--size must be at least 64M"
    ((bps_b > 0)) || die "--bps must be > 0"

    if is_up; then
        check_or_die 0
        msg "already up: $LOOP on $MOUNT, cgroup $CGROUP (backing $BACKING)"
        if [[ -n $bps_arg && $bps_b != "$BPS" ]]; then
            set_throttle "$CGROUP" "$LOOP" "$bps_b"
            BPS=$bps_b
            save_state
        fi
        printf '%s\n' "$MOUNT"
        return 0
    fi

    # Partly up (state file or leftovers present): clean up first.
    if [[ -f $STATE || -e $IMG ]] || mountpoint -q "$MNT" 2>/dev/null; then
        check_or_die 0
        msg "test bed is partly up; tearing the leftovers down first"
        cmd_down
    fi

    check_or_die "$size_b"

    local root
    root=$(blkio_root)
    BACKING=$IMG MOUNT=$MNT CGROUP=$root/$NAME BPS=$bps_b SIZE=$size_b LOOP=

    # From here on, undo everything on failure.
    trap 'on_up_exit $?' EXIT

    msg "creating $size backing file $BACKING"
    truncate -s "$size_b" "$BACKING"
    save_state # so that 'down' can clean up even if we fail below

    LOOP=$(losetup --find --show "$BACKING")
    save_state
    msg "attached $BACKING to $LOOP"

    msg "making ext4 on $LOOP"
    mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 \
        -L "${NAME:0:16}" "$LOOP"

    mkdir -p "$MOUNT"
    mount -t ext4 -o noatime "$LOOP" "$MOUNT"
    chmod 1777 "$MOUNT"
    msg "mounted $LOOP on $MOUNT"

    mkdir -p "$CGROUP"
    set_throttle "$CGROUP" "$LOOP" "$BPS"
    save_state

    trap - EXIT
    msg "up: run throttled commands with: $PROG run -- CMD ARGS..."
    printf '%s\n' "$MOUNT"
}

cmd_run() {
    [[ ${1:-} == -- ]] && shift
    (($#)) || die "run: no command given (usage: $PROG run -- CMD ARGS...)"
    [[ $(id -u) -eq 0 ]] || die "run: must be root to join the blkio cgroup"
    load_state || die "run: test bed is not up (no $STATE); run '$PROG up' first"
    [[ -n $CGROUP && -d $CGROUP ]] || die "run: cgroup '$CGROUP' is missing; run '$PROG down' then '$PROG up'"
    [[ -n $LOOP && -b $LOOP ]] || die "run: loop device '$LOOP' is missing; run '$PROG down' then '$PROG up'"
    echo $$ >"$CGROUP/cgroup.procs" || die "run: cannot move process $$ into $CGROUP"
    exec "$@"
}

# The whole disk holding DIR, as MAJ:MIN (blkio throttles whole disks, not partitions).
disk_of() {
    local dir=$1 src name
    src=$(findmnt -n -o SOURCE --target "$dir") || return 1
    name=$(basename "$(readlink -f "$src")")
    [[ -e /sys/class/block/$name ]] || return 1
    if [[ -e /sys/class/block/$name/partition ]]; then
        name=$(basename "$(readlink -f "/sys/class/block/$name/..")")
    fi
    cat "/sys/class/block/$name/dev"
}

cmd_cap() {
    (($# == 2)) || die "cap: usage: $PROG cap DIR BPS"
    local dir=$1 bps devno
    [[ -d $dir ]] || die "cap: $dir is not a directory"
    bps=$(to_bytes "$2") || die "cap: bad BPS '$2' (e.g. 1200M, 0 to remove)"
    is_up || die "cap: test bed is not up; run '$PROG up' first"
    devno=$(disk_of "$dir") || die "cap: cannot find the block device holding $dir"
    echo "$devno $bps" >"$CGROUP/blkio.throttle.read_bps_device"
    echo "$devno $bps" >"$CGROUP/blkio.throttle.write_bps_device"
    if ((bps)); then
        msg "throttle: $devno (holding $dir) read+write capped at $bps bytes/s ($((bps / 1048576)) MiB/s) in $CGROUP"
    else
        msg "throttle: rule for $devno (holding $dir) removed"
    fi
}

cmd_down() {
    local root loops=() l
    load_state || true
    : "${BACKING:=$IMG}" "${MOUNT:=$MNT}"
    if [[ -z ${CGROUP:-} ]] && root=$(blkio_root); then
        CGROUP=$root/$NAME
    fi

    # 1. Unmount (possibly several stacked mounts).
    local tries=0
    while mountpoint -q "$MOUNT" 2>/dev/null && ((tries < 8)); do
        tries=$((tries + 1))
        if umount "$MOUNT" 2>/dev/null; then
            msg "unmounted $MOUNT"
        else
            warn "umount $MOUNT failed (busy?); doing a lazy unmount"
            if command -v fuser >/dev/null 2>&1; then
                { fuser -vm "$MOUNT" 2>&1 | grep -v '^Cannot stat' >&2; } || true
            fi
            umount -l "$MOUNT" 2>/dev/null || { warn "lazy umount of $MOUNT failed too"; break; }
        fi
    done
    if [[ -d $MOUNT ]] && ! mountpoint -q "$MOUNT" 2>/dev/null; then
        rmdir "$MOUNT" 2>/dev/null || warn "left $MOUNT in place (not empty)"
    fi

    # 2. Detach loop devices (the saved one, and any backed by our image).
    [[ -n ${LOOP:-} ]] && loops+=("$LOOP")
    if [[ -e $BACKING ]] && command -v losetup >/dev/null 2>&1; then
        while IFS=: read -r l _; do
            if [[ -n $l ]]; then loops+=("$l"); fi
        done < <(losetup -j "$BACKING" 2>/dev/null)
    fi
    for l in $(printf '%s\n' "${loops[@]+"${loops[@]}"}" | sort -u); do
        if losetup "$l" >/dev/null 2>&1; then
            if losetup -d "$l" 2>/dev/null; then
                msg "detached $l"
            else
                warn "losetup -d $l failed (still in use?); it will auto-clear when released"
            fi
        fi
    done

    # 3. Remove the cgroup, moving leftover processes to the root cgroup.
    if [[ -n ${CGROUP:-} && -d $CGROUP ]]; then
        root=$(dirname "$CGROUP")
        local pid moved=0
        for tries in 1 2 3; do
            while read -r pid; do
                [[ -n $pid ]] || continue
                if echo "$pid" >"$root/cgroup.procs" 2>/dev/null; then
                    moved=$((moved + 1))
                fi
            done <"$CGROUP/cgroup.procs"
            [[ -s $CGROUP/cgroup.procs ]] || break
        done
        ((moved == 0)) || msg "moved $moved leftover process(es) from $CGROUP to $root"
        if rmdir "$CGROUP" 2>/dev/null; then
            msg "removed cgroup $CGROUP"
        else
            warn "could not remove cgroup $CGROUP"
        fi
    fi

    # 4. Remove the backing file and the state file.
    if [[ -e $BACKING ]]; then
        if rm -f "$BACKING"; then msg "removed $BACKING"; else warn "could not remove $BACKING"; fi
    fi
    rm -f "$STATE" "$STATE".tmp.* 2>/dev/null || warn "could not remove $STATE"
    msg "down"
    return 0
}

cmd_status() {
    if ! load_state; then
        msg "not up (no $STATE)"
        return 0
    fi
    cat "$STATE"
    local cg_ok=no mnt_ok=no loop_ok=no
    [[ -d $CGROUP ]] && cg_ok=yes
    mountpoint -q "$MOUNT" 2>/dev/null && mnt_ok=yes
    losetup "$LOOP" >/dev/null 2>&1 && loop_ok=yes
    echo "loop attached: $loop_ok; mounted: $mnt_ok; cgroup present: $cg_ok"
    if [[ $cg_ok == yes ]]; then
        echo "read_bps:  $(tr '\n' ' ' <"$CGROUP/blkio.throttle.read_bps_device")"
        echo "write_bps: $(tr '\n' ' ' <"$CGROUP/blkio.throttle.write_bps_device")"
    fi
    if is_up; then echo "state: up"; else echo "state: partly up (run '$PROG down')"; fi
}

main() {
    local cmd=${1:-}
    (($#)) && shift
    case $cmd in
        check) cmd_check "$@" ;;
        up) cmd_up "$@" ;;
        run) cmd_run "$@" ;;
        cap) cmd_cap "$@" ;;
        down)
            (($#)) && die "down takes no arguments"
            cmd_down ;;
        status) cmd_status ;;
        -h|--help|help) usage ;;
        "") usage >&2; exit 2 ;;
        *) printf '%s: unknown command %s\n\n' "$PROG" "'$cmd'" >&2; usage >&2; exit 2 ;;
    esac
}

main "$@"
