#!/usr/bin/env bash
# DeepSpeed's async I/O op (stock's NVMe offload, which the tests compare with) takes 2.5-4 minutes of two
# cores to build. `make test` builds it behind its lint and Rust tests, which leave a core idle much of the
# time: `start` builds it in the background, `wait` waits for that build and says how it ended (building it
# there when none was started, or the one started died), `build` builds it here.
set -uo pipefail
cd "$(dirname "$0")/.."
state=target/deepspeed-aio-behind

build() {
    PATH="$PWD/.venv/bin:$PATH" DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$PWD/target/torch_extensions" \
        .venv/bin/python -c "from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load(verbose=False)"
}

case "${1:-}" in
build)
    build
    ;;
start)
    mkdir -p target
    rm -f "$state".{log,status,pid}
    (
        build >"$state.log" 2>&1
        echo $? >"$state.status"
    ) </dev/null >/dev/null 2>&1 &
    echo $! >"$state.pid"
    echo "building DeepSpeed's async I/O op behind the next stages ($state.log)"
    ;;
wait)
    if [[ -e $state.pid ]]; then
        while [[ ! -e $state.status ]] && kill -0 "$(cat "$state.pid")" 2>/dev/null; do
            sleep 1
        done
    fi
    if [[ -e $state.status ]]; then
        cat "$state.log"
        status=$(cat "$state.status")
        rm -f "$state".{pid,status}
        exit "$status"
    fi
    build
    ;;
*)
    echo "usage: $0 build|start|wait" >&2
    exit 2
    ;;
esac
