# Sourced at the start of every call on the GPU machine, from the checkout root: installs what
# `make gpu-pack` put into .gpu/ (the machine has Python, torch, transformers, accelerate, nvcc and gcc,
# and no network), and sets the environment the tests and benches expect there.
export PYTHONUNBUFFERED=1
D=$(pwd)/.gpu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$D"/whl/*.whl || return 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
for f in "$D"/deb/*.deb; do dpkg -x "$f" /; done
ldconfig
PYBIN=$(dirname "$(python3 -c "import sys; print(sys.executable)")")
[ -e "$PYBIN/mlp-offload" ] || ln -s /tmp/site/bin/mlp-offload "$PYBIN/mlp-offload" 2>/dev/null || true
export DATA=/var/tmp/mlpo
mkdir -p "$DATA"
# DeepSpeed's just-in-time ops: built once per machine, or unpacked from a tarball a call left in $OUT.
export TORCH_EXTENSIONS_DIR=$DATA/tx
[ -f "$D/tx.tgz" ] && mkdir -p "$TORCH_EXTENSIONS_DIR" && tar xzf "$D/tx.tgz" -C "$DATA"
export MLP_OFFLOAD_TEST_DIR=$DATA/tests MLP_OFFLOAD_PROFILE_DIR=$DATA/profiles
# DeepSpeed's own tests, for the report's ds-suite part.
for t in "$D"/deepspeed-tests/*.tar.gz; do [ -f "$t" ] && export MLP_OFFLOAD_DS_TESTS=$t; done
export RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 CUBLAS_WORKSPACE_CONFIG=:4096:8
# DeepSpeed's JIT builder cannot parse the image's default "9.0a".
export TORCH_CUDA_ARCH_LIST=9.0
