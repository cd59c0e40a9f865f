#!/usr/bin/env bash
# Everything a fresh machine needs, idempotent and quick when already done:
#   1. Debian packages, when missing: fio (the benchmark's ceiling), e2fsprogs and util-linux (the
#      two-path test bed and the tests' tmpfs mounts), libaio-dev (DeepSpeed's own NVMe offload, the
#      baseline of the end-to-end benchmark), fuse3 (the fault tests' failing path), iproute2 and
#      glusterfs-server with its client (two nodes on one machine sharing a network file system);
#   2. the Rust toolchain's clippy and rustfmt (checked, they ship with the toolchain);
#   3. a virtual environment at .venv with requirements-dev.txt;
#   4. the native module, built in release mode into .venv (`make build-dev`: editable, linked with zig).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'bootstrap: %s\n' "$*" >&2; }

missing=()
command -v fio >/dev/null 2>&1 || missing+=(fio)
command -v mkfs.ext4 >/dev/null 2>&1 || missing+=(e2fsprogs)
command -v losetup >/dev/null 2>&1 || missing+=(util-linux)
[[ -e /usr/include/libaio.h ]] || missing+=(libaio-dev)
# libfuse 3 and fusermount3: the fault tests' failing storage path (tests/support/faultfs.py).
command -v fusermount3 >/dev/null 2>&1 || missing+=(fuse3)
# Network namespaces, a GlusterFS server and its FUSE client: the two-node tests (tests/support/cluster.py).
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v glusterd >/dev/null 2>&1 || missing+=(glusterfs-server)
command -v mount.glusterfs >/dev/null 2>&1 || [[ -x /sbin/mount.glusterfs ]] || missing+=(glusterfs-client)
if ((${#missing[@]})); then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        say "installing Debian packages: ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
        say "missing ${missing[*]} and cannot apt-get install them (not root or no apt): the fio ceiling," \
            "the two-path test bed and the DeepSpeed NVMe baseline will be unavailable"
    fi
fi

for tool in cargo rustc; do
    command -v "$tool" >/dev/null 2>&1 || { say "$tool not found: install the Rust toolchain (rustup)"; exit 1; }
done
for component in clippy rustfmt; do
    if ! cargo "${component/rustfmt/fmt}" --version >/dev/null 2>&1; then
        say "installing the $component component"
        rustup component add "$component"
    fi
done

python=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    say "creating .venv with $($python --version)"
    "$python" -m venv .venv
fi
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements-dev.txt | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    say "installing Python packages (torch is large: about a minute)"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -r requirements-dev.txt
    echo "$want" >"$stamp"
fi

say "building the native module (release, linked with zig as the wheel is)"
# Built as `make dist` builds the wheel (the same crates, flags, linker and PYO3_PYTHON), so the wheel's
# build (its test, `make dist`) reuses every crate instead of building them all again beside the tests:
# 190-225 s of both cores in CI before.
make --no-print-directory build-dev

# DeepSpeed builds its CPU ops on first use (minutes on two cores). Built here, once, they cost no test its
# time limit: in CI the first run of a worker's harness waited out both builds, 4 minutes of its 5.
extensions=${TORCH_EXTENSIONS_DIR:-$PWD/target/torch_extensions}
say "building DeepSpeed's CPU Adam and shared-memory collectives into $extensions (once: a few minutes)"
# ninja, which the builds run, is in .venv/bin.
PATH="$PWD/.venv/bin:$PATH" DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$extensions .venv/bin/python - <<'PY'
from deepspeed.accelerator import get_accelerator

for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
    builder = get_accelerator().create_op_builder(name)
    if builder is not None:
        builder.load(verbose=False)
PY
