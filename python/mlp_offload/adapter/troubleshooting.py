"""Every error and warning a user can meet, with its cause and its fix: one registry.

Two kinds of entry. The adapter's refusals (and its warning about an option the table does not list)
are formatted from their entry (`Trouble.message`, `FORMATTED_HERE`), so a text and its page cannot
drift apart; `tests/test_troubleshooting.py` checks that every error the adapter raises at a user comes
from here. The others are texts of the core, the engine and the config's validation (a full disk, a
store in use, io_uring not permitted, ...; `MET_BY_TESTS`): a test that meets each for real matches the
entry's `pattern`, and the registry's test checks that every one has such a test. The option table's
refusals (`adapter.options`) are one entry, `OPTION`, and a table on the page. A third kind is what
`mlp-offload doctor` finds that no message of a job says (`FOUND_BY_DOCTOR`: a scalar update kernel,
two paths on one device, ...): the application's doctor formats each from its entry, and its test checks
that every one is said there; doctor links the entry of each row it warns of or fails, these or the
messages a job would meet.

`docs/troubleshooting.md` and the README's row of refusals are rendered from here (`make docs-pages`)
and checked by the registry's test. The option table renders its own parts of them
(`options.refusals_markdown`, `options.readme_keys`), which are handed in: the table's check raises
this registry's messages, so this module imports nothing of the table.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass

REFUSAL, FAULT, WARNING, FOUND = "refused at start", "an error", "a warning", "found by doctor"


@dataclass(frozen=True)
class Trouble:
    """One message: its name (how code and tests refer to it, and its anchor on the page), its title on
    the page, its text with `{field}`s where it names something, what it is (`REFUSAL`, `FAULT`,
    `WARNING` or `FOUND`), why it happens and what to do. `short`, for a refusal, is its phrase in the
    README's row of refusals."""

    name: str
    title: str
    says: str
    kind: str
    cause: str
    fix: str
    short: str = ""

    def message(self, **fields: object) -> str:
        """The text to raise or log, its fields filled in."""
        return self.says.format(**fields)

    @property
    def pattern(self) -> re.Pattern[str]:
        """What the message looks like: its literal parts in order, anything in place of a field."""
        parsed = string.Formatter().parse(self.says)
        parts = [re.escape(text) + ("" if field is None else ".+?") for text, field, _, _ in parsed]
        return re.compile("".join(parts), re.DOTALL)

    def shown(self) -> str:
        """The text as the page shows it: each field as `<field>`."""
        return re.sub(r"\{(\w+)[^}]*\}", r"<\1>", self.says.replace("{{", "{").replace("}}", "}"))


SERIES = Trouble(
    "deepspeed-series",
    "DeepSpeed of another series",
    "mlp-offload supports DeepSpeed {series}x (tested with {tested}); this is {version}",
    REFUSAL,
    "the engine overrides and calls DeepSpeed's ZeRO-3 code of one series; another series changes it",
    'install the tested series: `pip install "deepspeed>=0.19,<0.20"`',
    "DeepSpeed outside 0.19",
)
OPTION = Trouble(
    "option",
    "A DeepSpeed option it does not reproduce",
    "{key}: {value}: {what}; mlp_offload does not reproduce it; {instead}",
    REFUSAL,
    "a DeepSpeed option whose result mlp-offload does not reproduce bit for bit (the table below lists "
    "each, and `docs/options.md` every option)",
    "what the message says after the last `;`, or remove the `mlp_offload` section to run stock",
)
OPTIMIZER = Trouble(
    "optimizer",
    "An optimizer other than Adam or AdamW",
    "mlp_offload: the optimizer is {optimizer}; mlp-offload runs DeepSpeed's CPU Adam/AdamW or torch's "
    "Adam/AdamW (state: exp_avg, exp_avg_sq)",
    REFUSAL,
    "the store holds Adam's state: the master weights and two moments per element",
    '`"optimizer": {"type": "AdamW", ...}` in the config, `DeepSpeedCPUAdam`, or `torch.optim.AdamW`',
    "an optimizer other than Adam or AdamW (Muon, SGD, Lamb, ...)",
)
AMSGRAD = Trouble(
    "amsgrad",
    "AMSGrad",
    "mlp_offload: optimizer param 'amsgrad': true is not supported (it keeps a third moment)",
    REFUSAL,
    "AMSGrad keeps a third per-element tensor, which the store does not hold",
    "set `amsgrad` to false",
)
ANOTHER_ZERO_OPTIMIZER = Trouble(
    "another-zero-optimizer",
    "Another ZeRO-3 optimizer of DeepSpeed's",
    "mlp_offload: this config makes DeepSpeed build {optimizer}, whose optimizer state mlp_offload does "
    "not hold; remove what selects it or the 'mlp_offload' section",
    REFUSAL,
    "a setting makes DeepSpeed build another ZeRO-3 optimizer of its own (not one of the option table)",
    "remove the setting that selects that optimizer, or the `mlp_offload` section",
)
NO_SECTION = Trouble(
    "no-section",
    "No mlp_offload section",
    "mlp_offload: the DeepSpeed config has no 'mlp_offload' section",
    REFUSAL,
    "mlp-offload's ZeRO-3 optimizer was built directly, for a config without its section",
    'add `"mlp_offload": {}` (or its `paths`) to the DeepSpeed config',
)
OFFLOAD_DEVICE = Trouble(
    "offload-device",
    "The optimizer not offloaded",
    'zero_optimization.offload_optimizer.device: mlp-offload needs "cpu" (CPU Adam on host memory); it '
    'replaces the NVMe swapping itself. An "nvme" section is rewritten for it by mlp_offload.initialize, '
    "and by deepspeed.initialize after mlp_offload.install()",
    REFUSAL,
    "the optimizer was not offloaded, or offloaded to NVMe without `initialize` or `install()`",
    'set `offload_optimizer.device` to "cpu" or "nvme" and start through `mlp_offload.initialize` '
    "or after `mlp_offload.install()`",
)
STOCK_PARAM_SWAPPER = Trouble(
    "stock-param-swapper",
    "Parameters on NVMe written by DeepSpeed's own swapper",
    "zero_optimization.offload_param: the parameters on NVMe are in DeepSpeed's own swap files "
    "({swapper}), not mlp_offload's store: deepspeed.zero.Init ran before mlp_offload.install(); call "
    "mlp_offload.install() before building the model under deepspeed.zero.Init",
    REFUSAL,
    "`deepspeed.zero.Init` builds the parameters' swapper when the model is built; `mlp_offload.install()` "
    "(which `mlp_offload.initialize` calls) makes it ours for a config with our section, so a model built "
    "under `zero.Init` before it has its partitions in DeepSpeed's swap files, which our update cannot "
    "read and write",
    "call `mlp_offload.install()` before `deepspeed.zero.Init` (Hugging Face's `from_pretrained` under "
    "ZeRO-3 runs it too: install first)",
    "a model built under `deepspeed.zero.Init` before `mlp_offload.install()`, its parameters on NVMe",
)
ANOTHER_DEGREE = Trouble(
    "another-degree",
    "A checkpoint of another data-parallel degree",
    "mlp_offload: the checkpoint {folder} was saved at a data-parallel degree of {saved}; this job has "
    "{now}. Convert it to a universal checkpoint, which loads at any degree: `python -m "
    "deepspeed.checkpoint.ds_to_universal --input_folder {folder} --output_folder {folder}_universal`, "
    'then set "checkpoint": {{"load_universal": true}} in the DeepSpeed config and load tag {tag!r}',
    REFUSAL,
    "a ZeRO checkpoint holds each rank's partition; another number of ranks partitions differently "
    "(stock refuses it too)",
    "convert it with the command the message gives and load the universal tag",
    "a checkpoint of another data-parallel degree, unconverted",
)
CHECKPOINT_LAYOUT = Trouble(
    "checkpoint-layout",
    "A checkpoint of another layout",
    "checkpoint: {theirs}, this engine's {ours} (another model, sub_group_size or data-parallel degree)",
    REFUSAL,
    "the checkpoint's subgroups are not this engine's: another model, `sub_group_size` or degree",
    "load it with the model and `sub_group_size` it was saved with, or convert it to a universal checkpoint",
)
UNIVERSAL_MISSING = Trouble(
    "universal-missing",
    "A universal checkpoint's file missing",
    "universal checkpoint: no {what}",
    REFUSAL,
    "a file the converter writes is not in the folder (the OSError's filename names it): the conversion "
    "stopped early, or the tag is not a universal one",
    "convert the checkpoint again (`ds_to_universal`), and load the tag it wrote",
)
UNIVERSAL_SIZE = Trouble(
    "universal-size",
    "A universal checkpoint of another model",
    "universal checkpoint {folder}: parameter {name}'s {key} has {numel:,} elements, the model's "
    "{shape} has {model:,} (a checkpoint of another model?)",
    REFUSAL,
    "the universal checkpoint is of another model, or of another version of this one",
    "load it into the model it was saved from",
)
UNIVERSAL_EXPERT = Trouble(
    "universal-expert",
    "Expert-parallel universal state",
    "mlp_offload: {path}: expert-parallel universal state is not supported",
    REFUSAL,
    "a universal checkpoint of expert-parallel (MoE) parameters",
    "run mixture-of-experts models without the `mlp_offload` section",
)
UNLISTED_OPTION = Trouble(
    "unlisted-option",
    "An option the table does not list",
    "mlp_offload: {keys}: not in mlp-offload's option table (docs/options.md), so not checked against "
    "stock DeepSpeed; a DeepSpeed newer than the one it was tested with may have added them",
    WARNING,
    "the config sets an option of the table's sections that the table does not list",
    "check the option's steps against stock DeepSpeed, or leave it at its default",
)
SWAPPER_DTYPE = Trouble(
    "swapper-dtype",
    "The parameters' swapper given another dtype than the parameters'",
    "offload_param: DeepSpeed gave the parameters' swapper {given}, the parameters are {dtype} (its "
    "zero.Init gives bfloat16 where the accelerator lacks fp16); their partitions stay {dtype}",
    WARNING,
    "on an accelerator without fp16 (DeepSpeed's CPU accelerator on some CPUs) DeepSpeed's `zero.Init` "
    "hands its parameter swapper bfloat16 whatever the model's dtype (the precedence in "
    "`Init._set_dtype`); stock's swapper then keeps an fp32 model's partitions in bf16 buffers, and its "
    "first forward fails",
    "nothing: mlp-offload keeps the partitions in the parameters' own dtype, bit for bit",
)
HOST_MEMORY = Trouble(
    "host-memory",
    "host_memory too small",
    "mlp_offload.{problem} (host_memory {host_memory:,} for the state, {source}, holds {buffers} buffers of "
    "{buffer_bytes:,} bytes)",
    REFUSAL,
    "`host_memory` holds no chunk beside its gradient (after the buffers of the parameters on NVMe, "
    "where DeepSpeed keeps them there), or `cache_chunks` leaves no buffer to stream the other chunks "
    "through",
    'raise `host_memory` (or set it to "auto"), lower `update_chunk`, or lower `cache_chunks`',
)
RATIO = Trouble(
    "ratio",
    "offload_optimizer.ratio keeping subgroups on the accelerator, where they cannot be updated",
    "zero_optimization.offload_optimizer.ratio: {ratio} keeps the first {count} of this rank's {subgroups} "
    "subgroups on the {accelerator} accelerator, as stock does, where mlp-offload updates them with CPU "
    "Adam's own arithmetic (stock runs torch's AdamW there), but {why}. Leave ratio at 1.0, or at a value "
    "that keeps none there: above 1 - 1/{subgroups}",
    REFUSAL,
    "stock's `ratio` keeps its first `int((1 - ratio) x subgroups)` subgroups' state on the accelerator; "
    "mlp-offload keeps the same ones there and updates them with its Triton kernel, bit-equal to CPU "
    "Adam, which needs Triton (torch's CUDA wheels bring it), the fused pass (`update_kernel`) and a "
    "kernel there that gives the host pass's bits (checked at start-up)",
    'install Triton, or leave `update_kernel` at "auto" where the fused pass\'s check agrees; where the '
    "kernel's bits differ, report it with the GPU and the versions of torch and Triton; else leave "
    "`offload_optimizer.ratio` at 1.0: every subgroup through the store, bit-equal to `device: cpu`",
    "`offload_optimizer.ratio` below 1 without Triton or the fused pass, or with a kernel there whose bits "
    "differ",
)
ACCELERATOR_CHUNKS = Trouble(
    "accelerator-chunks",
    "accelerator_update_memory or accelerator_update_chunks set where chunks cannot stream there",
    "mlp_offload.{key}: chunks cannot stream to the accelerator here: {why}",
    REFUSAL,
    "chunks stream to the accelerator beside the host's pass on a GPU with DeepSpeed's "
    "`offload_optimizer.pin_memory: true` (or through Triton's interpreter on DeepSpeed's CPU "
    "accelerator), with Triton, the fused pass and no parameters on NVMe",
    'leave both keys at "auto" (on where it can be, the start-up record saying why not elsewhere), or '
    "set one to 0",
    "`accelerator_update_memory` or `accelerator_update_chunks` set where chunks cannot stream there",
)
# What the start-up check of the accelerator's kernel found (`accelerator_chunks.check_on_device`'s
# fields): said where chunks there go off for it, and where `ratio`'s subgroups are refused for it.
KERNEL_DIFFERS = (
    "the accelerator's kernel gave other bits than the host pass at start-up: {array}, {count} of {elements} "
    "elements, the first at {first} ({host!r} on the host, {there!r} there)"
)
ACCELERATOR_KERNEL_DIFFERS = Trouble(
    "accelerator-kernel-differs",
    "The accelerator's kernel gives other bits than the host pass",
    f"mlp_offload: {KERNEL_DIFFERS}; every chunk is the host's",
    WARNING,
    "before streaming chunks to the accelerator, the session runs the kernel there on a chunk of random "
    "and special values and compares it with the host pass: a GPU or Triton build that divides, takes "
    "square roots, fuses or converts otherwise than the kernel asks",
    "report it with the GPU and the versions of torch and Triton; training goes on bit-exact, every "
    "chunk on the host",
)
MASTER_IN_PARAMS = Trouble(
    "master-in-params",
    "master_in_params: true where the parameters do not hold the master weights",
    'mlp_offload.master_in_params: true, but {why}; use "auto" or false',
    REFUSAL,
    "the master weights are kept in the parameters only where DeepSpeed keeps them in the parameters' "
    "half precision (`bf16_master_weights_and_grads`, `fp16_master_weights_and_grads`), and not with "
    "`overlap_backward: true`",
    '`master_in_params: "auto"` keeps them in the parameters where it can, and says why not elsewhere',
    "`master_in_params: true` where it cannot be",
)
UPDATE_KERNEL = Trouble(
    "update-kernel",
    "update_kernel: the fused pass unusable where it is needed",
    "mlp_offload.update_kernel: {setting!r}, but the fused kernel cannot be used: {why}{needs}",
    REFUSAL,
    "the start-up check of the fused pass against DeepSpeed's CPU Adam on this CPU found no arithmetic "
    'that agrees bit for bit, and `update_kernel` is "fused", or the state is in half precision, which '
    "only the fused pass updates",
    'with fp32 state, `update_kernel: "auto"` falls back to DeepSpeed\'s passes; otherwise report the '
    "message's difference with the CPU and DeepSpeed build",
    '`update_kernel: "fused"` where the check fails',
)
UPDATE_KERNEL_HALF = Trouble(
    "update-kernel-half",
    'update_kernel: "deepspeed" with the state in half precision',
    'mlp_offload.update_kernel: "deepspeed" runs on fp32 state only, and the state is in half precision '
    '({dtypes}); use "auto" or "fused"',
    REFUSAL,
    "the engine runs DeepSpeed's own passes on fp32 state only; `bf16_master_weights_and_grads`, "
    "`fp16_master_weights_and_grads` or `bf16_optimizer_states` keep it in half precision",
    '`update_kernel: "auto"`',
    '`update_kernel: "deepspeed"` with half-precision state',
)
PARAMS_CHANGED = Trouble(
    "params-changed",
    "Parameters changed outside the optimizer",
    "mlp_offload: the parameters of subgroup {subgroup} (elements {first} to {last}) changed outside the "
    "optimizer since its last step; DeepSpeed's step would overwrite that change from its master weights, "
    "which master_in_params keeps in the parameters, so this step would differ from stock's. It was "
    "stopped part way: load the last checkpoint",
    FAULT,
    "with `master_in_params`, something wrote the half-precision parameters between two steps "
    "(`GatheredParameters` with a `modifier_rank`, a write to a parameter's `ds_tensor`); stock "
    "DeepSpeed's next step overwrites such a change from its master weights, which the engine keeps only "
    "in the parameters",
    "set the weights through DeepSpeed's `safe_set_full_fp32_param` (the master weights, as stock's next "
    "step reads them), or set `mlp_offload.master_in_params: false` to keep the master weights apart "
    "and have the change overwritten as stock does; then load the last checkpoint",
)

FORMATTED_HERE = (
    SERIES,
    OPTION,
    OPTIMIZER,
    AMSGRAD,
    ANOTHER_ZERO_OPTIMIZER,
    NO_SECTION,
    OFFLOAD_DEVICE,
    STOCK_PARAM_SWAPPER,
    SWAPPER_DTYPE,
    ANOTHER_DEGREE,
    UNLISTED_OPTION,
    CHECKPOINT_LAYOUT,
    UNIVERSAL_MISSING,
    UNIVERSAL_SIZE,
    UNIVERSAL_EXPERT,
    HOST_MEMORY,
    RATIO,
    ACCELERATOR_CHUNKS,
    ACCELERATOR_KERNEL_DIFFERS,
    MASTER_IN_PARAMS,
    UPDATE_KERNEL,
    UPDATE_KERNEL_HALF,
    PARAMS_CHANGED,
)

MET_BY_TESTS = (
    Trouble(
        "section-key",
        "A bad key or value in the section",
        "mlp_offload.{key}: {problem}",
        FAULT,
        "a key of the `mlp_offload` section that does not exist, or a value of the wrong type or range",
        "the key's type and range are in `docs/config.md`",
    ),
    Trouble(
        "missing-path",
        "A path that does not exist",
        "open storage directory {path}: No such file or directory (os error 2)",
        FAULT,
        "a path of `mlp_offload.paths` does not exist (the store creates `rank<N>` in it, not the path)",
        "create the directory, or fix the path",
    ),
    Trouble(
        "enospc",
        "No space left on a path (ENOSPC)",
        "{op} {path}: No space left on device (os error 28)",
        FAULT,
        "a path is full (OSError errno ENOSPC, its filename the object's file); the write fails, "
        "and every object written before stays as it was",
        "free space, add a path, or give the full one a lower weight (`weights`); the update during "
        "backward's second slots already stop short while each path keeps a tenth of its file system free",
    ),
    Trouble(
        "in-use",
        "A store in use by another process",
        "{path} is in use by {holder} (another store opened the same path and rank); close it, or give "
        "this one other paths or another rank",
        FAULT,
        "another store holds this rank's directory: a second job on the same paths and rank, or a "
        "process still running (BlockingIOError, errno EWOULDBLOCK; the holder's pid is named)",
        "stop the process named, or give this job other paths or another rank; a process that died "
        "released the lock with it",
    ),
    Trouble(
        "corrupt",
        "A stored object not as written",
        "object {key} in {path}: {reason}",
        FAULT,
        "a stored object is not what was written: a checksum mismatch, a truncated file or a torn "
        "write (CorruptObjectError, an OSError with errno EIO)",
        "check the device (`dmesg`); restore the state from the last checkpoint",
    ),
    Trouble(
        "io-uring-asked",
        "io_uring asked for and not permitted",
        'engine: "io_uring" was asked for but is unavailable here: {why}',
        FAULT,
        "`engine` is `io_uring` where the kernel or a seccomp filter (Docker's default profile, "
        "`kernel.io_uring_disabled`) refuses `io_uring_setup`",
        'leave `engine` at "auto" (the thread pool then), or allow io_uring in the container\'s '
        "seccomp profile",
    ),
    Trouble(
        "io-uring-fallback",
        "io_uring not permitted (a container's seccomp filter)",
        "io_uring is unavailable ({why}); using the pread/pwrite thread-pool engine",
        WARNING,
        '`engine` "auto" where io_uring is refused (seccomp, `kernel.io_uring_disabled`, an old kernel)',
        "nothing to do: the thread pool moves the same bytes, at more CPU; allow io_uring to use it",
    ),
    Trouble(
        "o-direct-refused",
        "A file system without O_DIRECT",
        "{path} refuses O_DIRECT ({why}); using buffered I/O on this path",
        WARNING,
        "the path's file system has no direct I/O (ramfs, some FUSE and network file systems)",
        "nothing to do, it works through the page cache; for direct I/O, use a file system that has it",
    ),
    Trouble(
        "huge-pages-short",
        "Fewer huge pages than asked for",
        "host buffers in huge pages ({source}): {got} of {total} GiB, {small} GiB in 4 KiB pages",
        WARNING,
        "in the start-up line: `host_pages` asked for huge pages, and the kernel gave fewer: no pages "
        "reserved (`vm.nr_hugepages`) and transparent ones off or memory too fragmented",
        "reserve them before the job (`sysctl vm.nr_hugepages=<host_memory / 2 MiB>`), or enable "
        "transparent huge pages (`/sys/kernel/mm/transparent_hugepage/enabled`: madvise)",
    ),
    Trouble(
        "mlock-refused",
        "Host buffers not locked in memory (RLIMIT_MEMLOCK)",
        "mlock of a {bytes}-byte host buffer failed ({why}); continuing with unlocked memory (raise "
        "RLIMIT_MEMLOCK to lock it)",
        WARNING,
        "DeepSpeed's `offload_optimizer.pin_memory` makes the store lock its host buffers (`host_memory`) "
        "in RAM with `mlock`, which the process's RLIMIT_MEMLOCK bounds unless it has CAP_IPC_LOCK (often "
        "64 KiB or 8 MiB by default); the buffers work unlocked, and the kernel may page them out",
        "raise the limit where the job starts: `ulimit -l unlimited`, `memlock` in "
        "`/etc/security/limits.conf`, Docker's `--ulimit memlock=-1`; `mlp-offload doctor` shows the limit "
        "against what `host_memory` needs",
    ),
    Trouble(
        "deepspeed-version",
        "A DeepSpeed release it was not tested with",
        "mlp-offload was tested with DeepSpeed {tested}; this is {version}{differences}. Check a few steps "
        "against stock DeepSpeed before relying on it.",
        WARNING,
        "a DeepSpeed release of the supported series that the engine was not tested with; the warning "
        "names each function of DeepSpeed the engine relies on that changed",
        "install the tested release, or compare a few steps with stock DeepSpeed on yours",
    ),
)

# What `mlp-offload doctor` (`app/doctor.py`) finds and no job's message says, formatted there from here.
DEEPSPEED_MISSING = Trouble(
    "deepspeed-missing",
    "DeepSpeed not installed",
    "not installed: the store, probe and plan work without it; training needs it",
    FOUND,
    "`mlp-offload doctor` found no DeepSpeed distribution in this environment",
    'install the tested series: `pip install "deepspeed>=0.19,<0.20"`',
)
UNSUPPORTED_VERSION = Trouble(
    "unsupported-version",
    "A Python or torch older than supported",
    "{version}: mlp-offload needs {name}{needs}",
    FOUND,
    "the installed Python or torch is outside what mlp-offload's package requires (installed with "
    "`--no-deps`, or changed since)",
    "install a supported one: the README's table of supported versions",
)
SCALAR_KERNEL = Trouble(
    "scalar-kernel",
    "The update kernel scalar on an x86-64 CPU",
    "scalar: this x86-64 CPU shows no AVX2 with FMA and F16C, so the fused update runs element by element, "
    "slower than with them",
    FOUND,
    "an old CPU, or a virtual machine whose CPU model hides the host's AVX2 (QEMU's default `qemu64`)",
    "in a virtual machine, pass the host's CPU model through (`-cpu host`, libvirt's `host-passthrough`); "
    "else a CPU with AVX2 or AVX-512",
)
SAME_DEVICE = Trouble(
    "same-device",
    "Two paths on one device",
    "{paths} are on one device ({device}): they share its bandwidth",
    FOUND,
    "paths are meant to add bandwidth, and two directories on one device add only its capacity: the "
    "model plans them as one device's bandwidth, and node-wide admission gives them one in-flight limit",
    "one path per device (another disk, another NVMe namespace, a parallel file system)",
)

NO_TRITON = Trouble(
    "no-triton",
    "A GPU without Triton",
    "{gpus} NVIDIA GPU(s) and no Triton: every chunk's update stays on the host, and "
    "offload_optimizer.ratio below 1 is refused",
    FOUND,
    "the update's pass on the accelerator (chunks streamed there beside the host's pass, "
    "`accelerator_update_memory`; the subgroups `offload_optimizer.ratio` keeps there) is a Triton kernel; "
    "torch's CUDA wheels bring Triton, a CPU-only torch does not",
    "install torch's CUDA wheel, which brings the Triton it was built with",
)

FOUND_BY_DOCTOR = (DEEPSPEED_MISSING, UNSUPPORTED_VERSION, SCALAR_KERNEL, SAME_DEVICE, NO_TRITON)

ENTRIES = (*FORMATTED_HERE, *MET_BY_TESTS, *FOUND_BY_DOCTOR)
BY_NAME = {trouble.name: trouble for trouble in ENTRIES}


def met(name: str, text: str) -> bool:
    """Whether `text` (an error's or the output's) says entry `name`'s message: for the tests that meet
    each fault for real."""
    return BY_NAME[name].pattern.search(text) is not None


def readme_row(option_keys: Sequence[str]) -> str:
    """The README's row of refusals: the named refusals and the option table's refused keys
    (`options.readme_keys()`)."""
    named = "; ".join(trouble.short for trouble in ENTRIES if trouble.short)
    keys = ", ".join(option_keys)
    return (
        f"{README_ROW} {named}; these DeepSpeed options "
        f"([why, and what instead](docs/troubleshooting.md)): {keys} |"
    )


README_ROW = "| refused at start, by name |"


def readme(text: str, option_keys: Sequence[str]) -> str:
    """The README's text with its row of refusals rendered from the registry and the option table's
    refused keys (`options.readme_keys()`)."""
    lines = text.splitlines(keepends=True)
    rows = [i for i, line in enumerate(lines) if line.startswith(README_ROW)]
    if len(rows) != 1:
        raise ValueError(f"README: {len(rows)} lines begin with {README_ROW!r}; it needs one")
    lines[rows[0]] = readme_row(option_keys) + "\n"
    return "".join(lines)


def _entry(trouble: Trouble) -> list[str]:
    return [
        f'<a id="{trouble.name}"></a>',
        "",
        f"### {trouble.title}",
        "",
        "```text",
        trouble.shown(),
        "```",
        "",
        f"**Why**: {trouble.cause}. **Fix**: {trouble.fix}.",
        "",
    ]


def _entries(kind: str) -> list[str]:
    return [line for trouble in ENTRIES if trouble.kind == kind for line in _entry(trouble)]


def markdown(option_refusals: Sequence[str]) -> str:
    """`docs/troubleshooting.md`, the option table's section of refusals (`options.refusals_markdown()`)
    after the named refusals."""
    lines = [
        "# Troubleshooting",
        "",
        "Every message mlp-offload gives a user, with its cause and its fix. Generated from "
        "`mlp_offload/adapter/troubleshooting.py` (`make docs-pages`); "
        "`tests/test_troubleshooting.py` checks this page, that every refusal comes from that registry, "
        "and that each fault is met for real by a test matching its text. `<name>` stands for what the "
        "message names.",
        "",
        "## Refused at start",
        "",
        "mlp-offload refuses at start what it does not reproduce bit for bit, before any state is "
        "written: the error names the key or the object, and what to use instead.",
        "",
        *_entries(REFUSAL),
        *option_refusals,
        "## Errors",
        "",
        *_entries(FAULT),
        "## Warnings",
        "",
        "Each is logged (the logger `mlp_offload`, or Python's `warnings`) and the job goes on.",
        "",
        *_entries(WARNING),
        "## Found by `mlp-offload doctor`",
        "",
        "[`mlp-offload doctor`](cli.md#mlp-offload-doctor) checks the machine and the paths before a job; "
        "each row it warns of or fails links its entry: one of the messages above, which a job would meet, "
        "or one of these, which only doctor says (its `found` column).",
        "",
        *_entries(FOUND),
    ]
    return "\n".join(lines).rstrip() + "\n"
