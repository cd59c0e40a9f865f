# `make` lists the targets. `make run` and `make test` each do all the set-up first.
.DEFAULT_GOAL := help
SHELL := /bin/bash

VENV := .venv
# pytest workers (`pytest -n`): one per core of the 2-core machines this is made on and tested by.
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
export PYO3_PYTHON := $(abspath $(PY))
# The main job's default tiers: local directories on the work disk.
TIERS ?= $(CURDIR)/.mlp-offload/tier0
TESTBED := scripts/testbed.sh
# bench-scale's contenders: (a) DeepSpeed's pipelined NVMe offload, (b) ours at its pinned memory, (c) ours
# with half the state's bytes, (d) ours as the README configures it; CONTENDERS=... replaces them.
CONTENDERS ?= ds-nvme-pipelined,mlp-offload,mlp-offload-half,mlp-offload-default
# bench-node's: DeepSpeed's NVMe offload, ours with node-wide admission and without, on the work disk plus
# the test bed and on the test bed alone; NODE_CONTENDERS=... replaces them.
NODE_CONTENDERS ?= ds-nvme-pipelined,mlp-offload-2path,mlp-offload-2path-noadmit,mlp-offload-capped,mlp-offload-capped-noadmit

.PHONY: help
help: ## list the targets
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-18s %s\n", $$1, $$2}'

.PHONY: setup
setup: ## install what is missing: Debian packages, .venv, Python packages, the native module
	@bash scripts/bootstrap.sh

.PHONY: build-dev
build-dev: ## build the native module into .venv (editable; release, linked with zig as `make dist`'s wheel is, so the wheel's build reuses every crate)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH VIRTUAL_ENV=$(abspath $(VENV)) \
	  MATURIN_PEP517_ARGS="--zig --compatibility manylinux2014" \
	  $(PY) -m pip install -q --no-deps --no-build-isolation -e .

.PHONY: dist
dist: setup dist-aarch64 ## the portable wheels (abi3, manylinux2014 x86_64 and aarch64: glibc 2.17 on, linked with zig; maturin checks the tags) and the sdist, into dist/
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/maturin build --release --zig --compatibility manylinux2014 \
	  -i $(abspath $(PY)) -o dist
	$(VENV)/bin/maturin sdist -o dist

.PHONY: dist-aarch64
dist-aarch64: setup ## the aarch64 wheel alone, cross-built in a Debian sid root of .cross/ (root; set-up a few minutes the first time)
	bash scripts/aarch64.sh wheel dist

.PHONY: test-aarch64
test-aarch64: dist-aarch64 ## the aarch64 wheel installed and checked under qemu (import, store on both engines, probe, kernel bit-equal to x86-64's), and the core's tests built for aarch64 run under qemu
	bash scripts/aarch64.sh test
	bash scripts/aarch64.sh core-tests

.PHONY: gpu-pack
gpu-pack: setup ## pack into .gpu/ what the lent GPU machine lacks (wheels, libaio, DeepSpeed's tests), to carry there
	bash scripts/gpu_pack.sh

.PHONY: gpu-report
gpu-report: ## every GPU check and measurement, part by part (PARTS="bitexact e2e-1B" for some; on the GPU machine after `source .gpu/setup.sh`; without CUDA each part says it skipped)
	$(if $(wildcard $(PY)),$(PY),python3) benches/gpu_report.py $(PARTS)

.PHONY: format
format: ## format Rust and Python sources
	cargo fmt --all
	$(VENV)/bin/ruff format python tests benches scripts
	$(VENV)/bin/ruff check --fix -q python tests benches scripts

.PHONY: lint
lint: ## check formatting, clippy -D warnings, ruff, mypy and the .pyi against the module (both halves at once)
	@$(MAKE) --no-print-directory -j2 --output-sync=target lint-rust lint-python

.PHONY: lint-rust
lint-rust: ## lint's Rust half: formatting and clippy -D warnings
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -q -- -D warnings

.PHONY: lint-python
lint-python: ## lint's Python half: ruff, mypy (single-threaded: clippy runs beside it) and the .pyi
	$(VENV)/bin/ruff format --check -q python tests benches scripts
	$(VENV)/bin/ruff check -q python tests benches scripts
	$(VENV)/bin/mypy python/mlp_offload tests benches scripts
	$(VENV)/bin/python -m mypy.stubtest mlp_offload._core

.PHONY: test-rust
test-rust: ## cargo test (the core crate, both engines)
	cargo test -q

.PHONY: test-python
test-python: ## pytest (the bindings and the CLI, both engines), TEST_WORKERS at once, the 20 slowest listed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=20

.PHONY: test-python-quick
test-python-quick: ## the Python tests that start no DeepSpeed (pytest -m "not deepspeed")
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not deepspeed"

.PHONY: soak
soak: setup ## 500 steps of the main job, its memory, open files and threads sampled each step (about 13 minutes)
	MLP_OFFLOAD_SOAK=1 $(PY) -m pytest -q -s tests/test_train.py -k 500_steps

.PHONY: deepspeed-aio
deepspeed-aio: setup ## build DeepSpeed's async I/O op, which stock's NVMe offload (the tests' other side) runs on: about 2.5 minutes of two cores, once, under target/
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(CURDIR)/target/torch_extensions \
	  $(PY) -c "from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load(verbose=False)"

.PHONY: docs-pages
docs-pages: ## write the pages generated from the code (config, telemetry, options, troubleshooting, the README's refusals)
	$(PY) scripts/docs_pages.py

.PHONY: test-deepspeed
test-deepspeed: ## DeepSpeed's own ZeRO-3 offload tests, stock and with our engine swapped in (DEEPSPEED_TESTS=checkout or tests dir; else ../shared/deepspeed-tests; skips, saying so, when neither is there)
	$(PY) tests/deepspeed_suite/run.py

.PHONY: docs
docs: ## build the docs site into target/site (mkdocs-material; --strict: a broken link, anchor or page fails)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

.PHONY: test
test: ## everything CI runs: set-up, lint, the docs site, Rust tests, DeepSpeed's async I/O op, Python tests, DeepSpeed's own tests with our engine; each stage's time
	@bash scripts/stages.sh setup lint docs test-rust deepspeed-aio test-python test-deepspeed

.PHONY: test-quick
test-quick: ## the inner loop, within 5 minutes: lint, the docs site, cargo test, the Python tests that start no DeepSpeed
	@bash scripts/stages.sh setup lint docs test-rust test-python-quick

.PHONY: run
run: setup ## the main job: train a small LLaMA-style model, state on the default tiers (TIERS=dir1:dir2, STEPS=100)
	@mkdir -p $(subst :, ,$(TIERS))
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/mlp-offload train --paths $(subst :, ,$(TIERS)) \
	  --steps $(or $(STEPS),100)

.PHONY: bench
bench: setup ## cargo bench: store throughput per path, and the ratio to fio (MLP_OFFLOAD_BENCH_PATHS)
	cargo bench --bench io_throughput

.PHONY: bench-two-paths
bench-two-paths: setup ## the fio comparison on the work disk plus the 500 MiB/s test bed (root), torn down after
	@$(TESTBED) up --size 8G --bps 500M >/dev/null
	@trap '$(TESTBED) down' EXIT; mkdir -p /mnt/mlp-offload-testbed/bench && \
	  MLP_OFFLOAD_BENCH_QUICK=1 MLP_OFFLOAD_BENCH_PATHS=$(CURDIR)/target/bench-data:/mnt/mlp-offload-testbed/bench \
	  $(TESTBED) run -- cargo bench --bench io_throughput

.PHONY: bench-model
bench-model: setup ## the model on the work disk plus the test bed: prediction, splits, adaptation (root; CAP_LOCAL=1000M caps the work disk too, figures in docs/data/bench-model-local-1000M.json)
	@$(TESTBED) up --size 8G --bps 500M >/dev/null
	@trap '$(TESTBED) down' EXIT; mkdir -p $(CURDIR)/target/bench-model /mnt/mlp-offload-testbed/model && \
	  $(TESTBED) run -- $(VENV)/bin/python benches/update_model.py \
	    --paths $(CURDIR)/target/bench-model /mnt/mlp-offload-testbed/model \
	    --testbed $(TESTBED) --cap-from 500M --cap-to 150M \
	    $(if $(CAP_LOCAL),--cap-local $(CAP_LOCAL) --out docs/data/bench-model-local-$(CAP_LOCAL).json,--out docs/data/bench-model.json)

.PHONY: bench-e2e
bench-e2e: setup ## end to end, 130M LLaMA (SIZE=...): DeepSpeed NVMe offload vs mlp-offload on 1 and 2 paths vs DRAM
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH TORCH_EXTENSIONS_DIR=$(CURDIR)/target/torch_extensions \
	  $(VENV)/bin/python benches/e2e.py --size $(or $(SIZE),130M) --out docs/data/bench-e2e.json

.PHONY: bench-scale
bench-scale: setup ## the update at scale, 1B parameters of cheap compute (SIZE=...; STATE=bf16 or bf16-weights: DeepSpeed's state in half precision for every contender): DeepSpeed NVMe vs ours at its memory, half the state, the README's config; fio floor (figures in docs/data/bench-scale.json, or bench-scale-$(STATE)-state.json)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH TORCH_EXTENSIONS_DIR=$(CURDIR)/target/torch_extensions \
	  $(VENV)/bin/python benches/e2e.py --model wide --size $(or $(SIZE),1B) --warmup 1 --steps 3 \
	    --contenders $(CONTENDERS) --state $(or $(STATE),fp32) \
	    --out docs/data/bench-scale$(if $(STATE),-$(STATE)-state).json

.PHONY: bench-kernel
bench-kernel: setup ## the per-chunk update, fused pass vs DeepSpeed's passes (with and without checksums), bytes touched per element (docs/data/bench-kernel.json)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH TORCH_EXTENSIONS_DIR=$(CURDIR)/target/torch_extensions \
	  $(VENV)/bin/python benches/update_kernel.py --out docs/data/bench-kernel.json

.PHONY: bench-node
bench-node: setup ## many ranks on one node (RANKS=4, SIZE=270M, sub_group_size 1e7): ours with node-wide admission and without, on the work disk plus the 500 MiB/s test bed and on the test bed alone, against DeepSpeed's NVMe offload; fio floor (root; docs/data/bench-node.json)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH TORCH_EXTENSIONS_DIR=$(CURDIR)/target/torch_extensions \
	  $(VENV)/bin/python benches/e2e.py --model wide --size $(or $(SIZE),270M) --ranks $(or $(RANKS),4) \
	    --sub-group-size 10000000 --warmup 1 --steps 3 \
	    --contenders $(NODE_CONTENDERS) \
	    --out docs/data/bench-node.json

.PHONY: bench-cluster
bench-cluster: setup ## a shared tier's share per node: the probe across two nodes against the update on both at once, on a GlusterFS volume (root; docs/data/bench-cluster.json)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH TORCH_EXTENSIONS_DIR=$(CURDIR)/target/torch_extensions \
	  $(VENV)/bin/python benches/cluster_share.py --out docs/data/bench-cluster.json

.PHONY: testbed-up
testbed-up: ## build the bandwidth-capped second storage path (root)
	$(TESTBED) up

.PHONY: testbed-down
testbed-down: ## tear the test bed down
	$(TESTBED) down

.PHONY: clean
clean: ## remove build outputs (keeps .venv)
	cargo clean
	rm -rf dist .mlp-offload
