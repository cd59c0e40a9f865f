#!/usr/bin/env bash
# The aarch64 (Grace Hopper, Grace Blackwell) wheel, built and checked on this x86-64 machine from
# Debian's packages alone. rustup cannot fetch another target's standard library here, and bookworm's
# rustc is too old, but Debian sid ships rustc with `libstd-rust-dev:arm64` of the same version. Two
# Debian roots are made with debootstrap under .cross/ (the host's apt sources stay as they are):
#   build-sid       amd64 sid: rustc, cargo, the arm64 standard library, maturin and zig (PyPI, pinned
#                   as requirements-dev.txt pins them). maturin cross-links the manylinux2014 wheel with
#                   zig, as `make dist` does for x86-64, and checks its tag.
#   arm64-bookworm  arm64 bookworm, run through qemu-user (binfmt_misc): Python 3.11 with torch's
#                   aarch64 wheel, where the wheel is installed and checked from outside the repository.
#
#   scripts/aarch64.sh wheel [DIR]    the aarch64 wheel into DIR (default dist/)
#   scripts/aarch64.sh test [WHEEL]   install it into the emulated Python and run tests/support/aarch64_check.py
#   scripts/aarch64.sh core-tests     the core crate's own tests, built for aarch64, run under qemu
#   scripts/aarch64.sh run CMD...     CMD in the emulated aarch64 root (python is its venv's)
#
# Each command sets up what it needs first (a few minutes and about 5 GB the first time, torch's
# aarch64 wheel and its CUDA libraries most of it) and is quick once done. Every command in a root runs
# in a mount namespace of its own, so the repository mounted into it can never outlive the command.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CROSS=${CROSS_DIR:-$ROOT/.cross}
BUILD=$CROSS/build-sid
ARM=$CROSS/arm64-bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# Bump to rebuild a root after changing what goes into it.
BUILD_SETUP=1
ARM_SETUP=2

say() { printf 'aarch64: %s\n' "$*" >&2; }
die() {
    say "$*"
    exit 1
}
pin() { sed -n "s/^$1==//p" requirements-dev.txt; }

host_packages() {
    [[ $(id -u) -eq 0 ]] || die "debootstrap and chroot need root"
    local missing=()
    command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
    [[ -x /usr/bin/qemu-aarch64-static ]] || missing+=(qemu-user-static)
    command -v update-binfmts >/dev/null 2>&1 || missing+=(binfmt-support)
    if ((${#missing[@]})); then
        say "installing Debian packages: ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    # qemu-user-static registers its interpreters with the F flag (opened at registration), so they
    # run inside a root that has no qemu of its own.
    if [[ ! -e /proc/sys/fs/binfmt_misc/register ]]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    fi
    if [[ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]]; then
        update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
    fi
    grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 2>/dev/null ||
        die "binfmt_misc has no qemu-aarch64 entry with the F flag (/proc/sys/fs/binfmt_misc/qemu-aarch64)"
}

# in_root ROOT [--src] COMMAND...: COMMAND inside ROOT with /proc, and with --src the repository
# read-only at /src (its target/ the root's own, writable), in a mount namespace that ends with the
# command. No /sys: it would describe the host's x86 CPUs, and torch's aarch64 oneDNN crashes reading it
# under qemu (without it, torch's cpuinfo only complains).
in_root() {
    local root=$1 src=0
    shift
    if [[ ${1:-} == --src ]]; then
        src=1
        shift
    fi
    unshare --mount --propagation private -- bash -c '
        set -e
        root=$1 src=$2 repo=$3
        shift 3
        mount -t proc proc "$root/proc"
        if ((src)); then
            mkdir -p "$root/src"
            mount --bind "$repo" "$root/src"
            mount -o remount,bind,ro "$root/src"
            # The core'"'"'s tests make their files under target/: the root'"'"'s own, writable.
            if [[ -d $repo/target ]]; then
                mkdir -p "$root/build/src-target"
                mount --bind "$root/build/src-target" "$root/src/target"
            fi
        fi
        exec chroot "$root" /usr/bin/env -i HOME=/root PATH=/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            PIP_DISABLE_PIP_VERSION_CHECK=1 LANG=C.UTF-8 "$@"
    ' in_root "$root" "$src" "$ROOT" "$@"
}

# new_root DIR ARCH SUITE: a minimal Debian root, with the host's CA bundle and name servers (a proxy's
# certificate authority included) and the snapshot archive's expired Release dates accepted.
new_root() {
    local dir=$1 arch=$2 suite=$3
    say "debootstrap $suite ($arch) into $dir"
    rm -rf --one-file-system "$dir"
    mkdir -p "$(dirname "$dir")"
    debootstrap --arch="$arch" --variant=minbase --include=ca-certificates "$suite" "$dir" "$MIRROR" \
        >"$dir.log" 2>&1 || die "debootstrap failed: see $dir.log"
    echo 'Acquire::Check-Valid-Until "false";' >"$dir/etc/apt/apt.conf.d/99mlp-offload"
    refresh_root "$dir"
}

refresh_root() {
    cp /etc/ssl/certs/ca-certificates.crt "$1/etc/ssl/certs/ca-certificates.crt"
    cp /etc/resolv.conf "$1/etc/resolv.conf"
}

build_root() {
    host_packages
    if [[ $(cat "$BUILD/.mlp-offload-setup" 2>/dev/null) == "$BUILD_SETUP" ]]; then
        refresh_root "$BUILD"
        return
    fi
    new_root "$BUILD" amd64 sid
    say "installing rustc, cargo and libstd-rust-dev:arm64 from sid, maturin and zig from PyPI"
    in_root "$BUILD" bash -c '
        set -e
        dpkg --add-architecture arm64
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            rustc cargo libstd-rust-dev:arm64 gcc libc6-dev python3-venv >/dev/null
        python3 -m venv /opt/venv
        /opt/venv/bin/pip install -q "maturin==$1" "ziglang==$2"
    ' build_root "$(pin maturin)" "$(pin ziglang)"
    echo "$BUILD_SETUP" >"$BUILD/.mlp-offload-setup"
    say "build root ready: $(in_root "$BUILD" rustc --version)"
}

arm_root() {
    host_packages
    if [[ $(cat "$ARM/.mlp-offload-setup" 2>/dev/null) == "$ARM_SETUP" ]]; then
        refresh_root "$ARM"
        return
    fi
    new_root "$ARM" arm64 bookworm
    local torch numpy
    torch=$(pin torch)
    numpy=$(pin numpy)
    say "installing Python 3.11, torch $torch (aarch64) and DeepSpeed under emulation: several minutes"
    # g++ and Python's headers: DeepSpeed builds its CPU ops (CPU Adam, its CPU collectives) at first use.
    in_root "$ARM" bash -c '
        set -e
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv \
            python3-dev g++ >/dev/null
        python3 -m venv /opt/venv
        /opt/venv/bin/pip install -q --progress-bar off "torch==$1" "numpy==$2" "pydantic>=2" psutil
        # DeepSpeed'"'"'s setup.py imports torch: built against the one just installed.
        /opt/venv/bin/pip install -q --progress-bar off --no-build-isolation "deepspeed==$3"
    ' arm_root "$torch" "$numpy" "$(pin deepspeed)"
    echo "$ARM_SETUP" >"$ARM/.mlp-offload-setup"
}

wheel() {
    local out=${1:-$ROOT/dist}
    build_root
    mkdir -p "$out"
    # The target directory stays in the build root: another rustc than the host's, so its own
    # artifacts, and incremental from one build to the next.
    in_root "$BUILD" --src bash -c '
        set -e
        cd /src
        rm -rf /build/wheels
        CARGO_TARGET_DIR=/build/target maturin build --release --locked --target aarch64-unknown-linux-gnu \
            --zig --compatibility manylinux2014 -o /build/wheels
    '
    local built
    built=$(ls "$BUILD"/build/wheels/mlp_offload-*-manylinux2014_aarch64*.whl)
    cp "$built" "$out/"
    say "built $out/$(basename "$built")"
}

test_wheel() {
    local wheel=${1:-}
    if [[ -z $wheel ]]; then
        wheel=$(ls -t "$ROOT"/dist/mlp_offload-*-manylinux2014_aarch64*.whl 2>/dev/null | head -1)
        [[ -n $wheel ]] || die "no aarch64 wheel in dist/: run scripts/aarch64.sh wheel (or make dist) first"
    fi
    [[ -f $wheel ]] || die "$wheel: no such wheel"
    arm_root
    rm -rf "$ARM/check"
    mkdir -p "$ARM/check/wheels" "$ARM/check/work"
    cp "$wheel" "$ARM/check/wheels/"
    cp "$ROOT/tests/support/aarch64_check.py" "$ARM/check/"
    # What the update kernel gives on this x86-64 machine (its widest SIMD path), for the emulated one to
    # match bit for bit.
    [[ -x $ROOT/.venv/bin/python ]] || die "no .venv: run make setup first"
    "$ROOT/.venv/bin/python" "$ROOT/tests/support/aarch64_check.py" --kernel-digests >"$ARM/check/x86_64-digests.json"
    say "installing $(basename "$wheel") and checking it under qemu-aarch64"
    # From /check/work: nothing of the repository is in the root, so the package is the wheel's.
    in_root "$ARM" bash -c '
        set -e
        pip install -q --no-deps --force-reinstall --no-index /check/wheels/*.whl
        cd /check/work
        python /check/aarch64_check.py --expect-digests /check/x86_64-digests.json
    '
}

core_tests() {
    build_root
    # zig links the test binaries (glibc 2.17, as the wheel's module) and compiles a test dependency's C
    # (alloca, for criterion); cc-rs passes a --target that zig does not parse, so the wrapper drops it.
    local zig
    zig=$(cd "$BUILD" && ls opt/venv/lib/python3*/site-packages/ziglang/zig)
    mkdir -p "$BUILD/build/bin"
    cat >"$BUILD/build/bin/aarch64-cc" <<EOF
#!/bin/sh
for arg; do
    shift
    case \$arg in --target=*) ;; *) set -- "\$@" "\$arg" ;; esac
done
exec /$zig cc -target aarch64-linux-gnu.2.17 "\$@"
EOF
    printf '#!/bin/sh\nexec /%s ar "$@"\n' "$zig" >"$BUILD/build/bin/aarch64-ar"
    chmod +x "$BUILD/build/bin/aarch64-cc" "$BUILD/build/bin/aarch64-ar"
    say "the core crate's tests for aarch64, run under qemu-aarch64"
    # cargo runs each test binary through binfmt_misc's qemu, with the root's arm64 libc.
    in_root "$BUILD" --src bash -c '
        set -e
        cd /src
        # Under qemu-user: statx reports no direct-I/O alignment (the tier test accepts that here only).
        export MLP_OFFLOAD_UNDER_EMULATION=1
        export CARGO_TARGET_DIR=/build/target CC_aarch64_unknown_linux_gnu=/build/bin/aarch64-cc \
            AR_aarch64_unknown_linux_gnu=/build/bin/aarch64-ar \
            CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=/build/bin/aarch64-cc
        cargo test --release --locked --no-fail-fast --target aarch64-unknown-linux-gnu -p mlp-offload-core "$@"
    ' core_tests "$@"
}

case ${1:-} in
wheel) wheel "${2:-}" ;;
test) test_wheel "${2:-}" ;;
core-tests)
    shift
    core_tests "$@"
    ;;
run)
    shift
    arm_root
    in_root "$ARM" "$@"
    ;;
*) die "usage: scripts/aarch64.sh wheel [DIR] | test [WHEEL] | core-tests [CARGO TEST ARGS] | run CMD..." ;;
esac
