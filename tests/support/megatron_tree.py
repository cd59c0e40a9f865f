"""Megatron-DeepSpeed's tree, prepared and run as `tests/test_megatron.py` and
`benches/megatron_startup.py` run it: `../shared/megatron-deepspeed/`'s snapshot extracted, with the fixes
it needs here (`FIXES`, each said why) applied to that copy (the product does not patch Megatron), its
dataset helpers built, and a data set made from our shipped corpus, one byte a token, by Megatron's own
indexed-dataset builder; `pretrain_gpt.py` started as a user starts it (`torch.distributed.run`), through
`megatron_harness.py`."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import torch

from deepspeed_runs import RankServer, batch_timeout, free_port, harness_env

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = ROOT.parent / "shared" / "megatron-deepspeed" / "megatron-deepspeed-4efb479.tar.gz"
HARNESS = Path(__file__).with_name("megatron_harness.py")

FIXES = [
    (
        "megatron/training.py",
        "from deepspeed.compression.compress import init_compression, redundancy_clean\n",
        "init_compression = redundancy_clean = None\n",
        # DeepSpeed 0.19 has no `deepspeed.compression`: the import fails at start on any machine. The
        # two names are used only with a `compression_training` config, which no row sets.
        "DeepSpeed 0.19 has no deepspeed.compression",
    ),
    (
        "megatron/training.py",
        "from megatron.model.vision.knn_monitor import compute_feature_bank\n",
        "compute_feature_bank = None\n",
        # It imports torchvision, which we do not install; it is used only in DINO pre-training.
        "knn_monitor imports torchvision",
    ),
    (
        "megatron/model/transformer.py",
        "query_layer = query_layer.view(output_size[2],",
        "query_layer = query_layer.reshape(output_size[2],",
        # The fused QKV output's slices are strided: `.view` fails with a micro-batch over 1 (fixed
        # upstream after this commit, PR #469). The same values either way.
        "CoreAttention views strided slices",
    ),
    (
        "megatron/model/transformer.py",
        "key_layer = key_layer.view(output_size[3],",
        "key_layer = key_layer.reshape(output_size[3],",
        "CoreAttention views strided slices",
    ),
    (
        "megatron/model/transformer.py",
        "value_layer = value_layer.view(value_layer.size(0),",
        "value_layer = value_layer.reshape(value_layer.size(0),",
        "CoreAttention views strided slices",
    ),
    (
        "megatron/data/Makefile",
        "LIBEXT = $(shell python3-config --extension-suffix)",
        "LIBEXT = $(shell python3 -c \"import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))\")",
        # A virtual environment has no `python3-config`; the system's names another Python's suffix.
        "python3-config is not in a venv",
    ),
]

VOCAB = 256  # one token a byte; Megatron's NullTokenizer adds the end of document, 256

# A smaller model than the by-hand runs' (hidden 256, sequences of 128), for time: 0.5M parameters,
# sequences of 64, micro-batch 2.
MODEL = [
    "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
]  # fmt: skip
ITERATIONS = 8
# The artifact's style: rotary, SwiGLU, RMSNorm, no bias, untied head, activation checkpointing.
LLAMA = [
    "--use-rotary-position-embeddings", "--swiglu", "--normalization", "rmsnorm", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--checkpoint-activations", "--recompute-method", "uniform",
    "--deepspeed-activation-checkpointing",
]  # fmt: skip
GPT2: list[str] = []  # LayerNorm, GeLU, learned positions, tied head: Megatron's defaults
# What the CPU needs (`../shared/megatron-deepspeed/README.md`), and what keeps a run short.
ON_THE_CPU = [
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-pipeline-parallel",
    "--cpu-optimizer", "--distributed-backend", "gloo", "--num-workers", "0",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--split", "100,0,0",
    "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--seed", "1234",
    "--lr", "3e-3", "--lr-decay-style", "constant", "--train-iters", str(ITERATIONS),
]  # fmt: skip


def venv_first_path() -> str:
    """PATH with this Python's directory first: Megatron's helpers build with `python3` and pybind11."""
    return f"{Path(sys.executable).parent}:{os.environ['PATH']}"


def prepare(root: Path) -> dict[str, Path]:
    """Under `root`: the extracted tree with `FIXES` applied, its dataset helpers built, and the data
    set (`"tree"`, `"data"`: its prefix)."""
    with tarfile.open(SNAPSHOT) as tar:
        tar.extractall(root, filter="data")
    tree = root / "Megatron-DeepSpeed"
    for name, text, replacement, why in FIXES:
        path = tree / name
        source = path.read_text()
        assert source.count(text) == 1, f"{name}: the text to fix ({why}) is not there once"
        path.write_text(source.replace(text, replacement))
    env = {**os.environ, "PATH": venv_first_path()}
    subprocess.run(["make", "-C", str(tree / "megatron" / "data")], check=True, env=env, capture_output=True)
    prefix = root / "corpus_text_document"
    build = (
        "import sys, numpy as np, torch\n"
        "from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder\n"
        "text, prefix, eod = open(sys.argv[1], 'rb').read(), sys.argv[2], int(sys.argv[3])\n"
        "builder = MMapIndexedDatasetBuilder(prefix + '.bin', dtype=np.uint16)\n"
        "for doc in text.split(b'\\n\\n'):\n"
        "    if doc.strip():\n"
        "        builder.add_item(torch.tensor([*doc, eod], dtype=torch.int64))\n"
        "        builder.end_document()\n"
        "builder.finalize(prefix + '.idx')\n"
    )
    corpus = ROOT / "python" / "mlp_offload" / "app" / "data" / "corpus.txt"
    subprocess.run(
        [sys.executable, "-c", build, str(corpus), str(prefix), str(VOCAB)],
        check=True,
        cwd=tree,
        env={**env, "PYTHONPATH": str(tree)},
        capture_output=True,
    )
    return {"tree": tree, "data": prefix}


def ds_config(micro: int, accumulation: int, ranks: int, clip: float) -> dict[str, Any]:
    """DeepSpeed's config for Megatron's `--deepspeed_config`: ZeRO-3, the optimizer offloaded, bf16."""
    return {
        "train_batch_size": micro * accumulation * ranks,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": clip,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "sub_group_size": 500_000, "offload_optimizer": {"device": "cpu"}},
        "steps_per_print": 1000,
    }


def pretrain_args(args: list[str]) -> list[str]:
    """`pretrain_gpt.py`'s arguments for a row's `args`, but for its paths."""
    return [*MODEL, *ON_THE_CPU, *args, "--bf16", "--deepspeed", "--zero-stage", "3"]


_ranks: RankServer | None = None


def rank_client(forked: bool) -> list[str]:
    """What goes before the harness in torchrun's command line: with `forked`, `rank_client.py` and the
    address of this worker's rank server (`RankServer.client`). Megatron's own modules are not among
    what it preloads: `mlp_offload.install()` comes before them in a rank, as in a user's script."""
    global _ranks
    if not forked:
        return []
    if _ranks is None:
        _ranks = RankServer(f"mlpo-megatron-ranks-{os.getpid()}", harness_env(PATH=venv_first_path()))
        atexit.register(_ranks.close)
    return _ranks.client()


def run_megatron(
    megatron: dict[str, Path],
    run_dir: Path,
    args: list[str],
    config: dict[str, Any],
    ranks: int,
    ours: bool,
    records: bool = True,
    forked: bool = False,
) -> list[dict[str, Any]]:
    """`pretrain_gpt.py` on `ranks` ranks (`torch.distributed.run`, as a user starts it), each rank's
    record (`megatron_harness`); none where `records` is False (a run that Megatron's `--exit-interval`
    ends). `forked`: each rank forked from this worker's rank server (`rank_client`), as the tests run
    it on the CPU, else started from scratch, as a user's is (the start-up bench)."""
    run_dir.mkdir(parents=True)
    (run_dir / "ds_config.json").write_text(json.dumps(config))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
        "--master_port", str(free_port()), *rank_client(forked), str(HARNESS), *pretrain_args(args),
        "--data-path", str(megatron["data"]), "--data-cache-path", str(run_dir / "index-cache"),
        "--deepspeed_config", str(run_dir / "ds_config.json"),
    ]  # fmt: skip
    env = harness_env(
        MEGATRON_TREE=str(megatron["tree"]),
        MEGATRON_OUT=str(run_dir),
        MEGATRON_OURS="1" if ours else "0",
        # DeepSpeed's launcher sets it; Megatron's CPU path reads it.
        LOCAL_SIZE=str(ranks),
        PATH=venv_first_path(),
    )
    log = run_dir / "log.txt"
    launched_at = time.time()
    with log.open("w") as out:
        done = subprocess.run(
            cmd, cwd=megatron["tree"], env=env, stdout=out, stderr=subprocess.STDOUT,
            timeout=batch_timeout(600),
        )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"pretrain_gpt.py failed ({done.returncode}), {log}:\n{log.read_text()[-6000:]}")
    if not records:
        return []
    return [
        {**torch.load(run_dir / f"rank{r}.pt", weights_only=False), "launched_at": launched_at}
        for r in range(ranks)
    ]


def ours_config(config: dict[str, Any], how: str, paths: list[Path]) -> dict[str, Any]:
    """Stock's `config` as a user of ours has it: with the README's section (`"readme"`: `paths` only,
    weights probed), or as DeepSpeed's NVMe offload config with `"mlp_offload": {}` added (`"nvme"`, the
    one-line migration: our store on `nvme_path`)."""
    if how == "readme":
        return {**config, "mlp_offload": {"paths": [str(p) for p in paths]}}
    zero = config["zero_optimization"]
    offload = {"device": "nvme", "nvme_path": str(paths[0]), "pipeline_read": True, "pipeline_write": True}
    return {
        **config,
        "zero_optimization": {**zero, "offload_optimizer": offload},
        "aio": {"block_size": 1 << 20, "queue_depth": 16},
        "mlp_offload": {},
    }
