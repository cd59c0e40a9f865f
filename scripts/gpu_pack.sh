#!/usr/bin/env bash
# Packs into .gpu/ what the lent GPU machine lacks (../shared/gpu/README.md: Python 3.12, torch, no
# network, 64 MiB carried per call), for `carry: [".gpu"]`; there, `source .gpu/setup.sh` installs it and
# `make gpu-report` runs the report (benches/gpu_report.py). Run from the checkout, after `make setup`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
say() { printf 'gpu-pack: %s\n' "$*" >&2; }

grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
rm -rf .gpu/whl .gpu/deb .gpu/deepspeed-tests
mkdir -p .gpu/whl .gpu/deb .gpu/deepspeed-tests
cp scripts/gpu_setup.sh .gpu/setup.sh

say "our wheel (manylinux2014, as make dist builds it)"
PATH=$PWD/.venv/bin:$PATH .venv/bin/maturin build --release --zig --compatibility manylinux2014 \
    -i "$PWD/$PY" -o .gpu/whl >/dev/null

pin() { sed -n "s/^$1==//p" requirements-dev.txt; }
say "DeepSpeed $(pin deepspeed) (pure Python; built from its sdist once, then kept in pip's cache)"
ds=$(find ~/.cache/pip/wheels -name "deepspeed-$(pin deepspeed)-*.whl" 2>/dev/null | head -1)
if [[ -n $ds ]]; then
    cp "$ds" .gpu/whl/
else
    "$PY" -m pip wheel -q --no-deps "deepspeed==$(pin deepspeed)" -w .gpu/whl
fi

say "the Python packages the machine lacks, for its CPython 3.12"
# The versions installed here, so the GPU runs what the tests here ran.
versions=$("$PY" -m pip list --format=freeze 2>/dev/null)
want() { grep -i "^$1==" <<<"$versions"; }
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl \
    "$(want pydantic)" "$(want pydantic_core)" "$(want annotated-types)" "$(want typing-inspection)" \
    "$(want hjson)" "$(want pytest-timeout)" "$(want typing_extensions)" "$(want pytest-xdist)" \
    "$(want execnet)" "$(want psutil)" "$(want lightning)" "$(want lightning-utilities)" \
    "$(want pytorch-lightning)" "$(want torchmetrics)"

say "libaio (DeepSpeed's async_io op, the NVMe baseline)"
(cd .gpu/deb && apt-get download libaio1 libaio-dev >/dev/null 2>&1) ||
    say "apt-get download libaio1 libaio-dev failed: DeepSpeed's NVMe baseline will not build there"

for t in ../shared/deepspeed-tests/*.tar.gz; do
    [[ -f $t ]] && cp "$t" .gpu/deepspeed-tests/
done

size=$(du -sb .gpu | cut -f1)
say ".gpu/: $((size / 1024 / 1024)) MiB of the 64 MiB a call carries"
((size < 64 * 1024 * 1024)) || { say "too large to carry"; exit 1; }
