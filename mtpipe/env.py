"""Every environment variable mtpipe reads or sets, in one table (:data:`VARIABLES`), and the one way to read them.

Why one table: settings that come from the environment are invisible in params.yaml, in ``--help`` and in a
checkpoint's manifest; listing them here keeps them few, named, documented (``docs/environment.md`` is rendered from
this table, ``python -m mtpipe.env --markdown``, and a test keeps the two equal) and greppable. Code reads them with
:func:`get` (or :func:`environ` where a function takes a whole environment as a parameter, as the launcher's do for
their tests), which refuses a name that is not in the table; ``tests/test_layering.py`` fails on any other read of
``os.environ``. Writes go through :func:`put`, called at run time by the one command that needs it, never at import.

This module is part of the foundation layer and imports nothing of mtpipe.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, the value that applies when it is unset (as the docs show it), what it
    means, who reads it and who sets it (paths relative to the repository)."""

    name: str
    default: str
    meaning: str
    read_by: tuple[str, ...]
    set_by: tuple[str, ...] = ()


_LAUNCH = "mtpipe/training/launch.py"
_DIST = "mtpipe/training/distributed.py"
_SOURCES = "mtpipe/stages/sources.py"
_PACKAGE = "mtpipe/engine/step_package.py"
_RUNTIME = "mtpipe/engine/runtime.py"
_PLATFORM = "mtpipe/platform.py"
_MACHINE = "bench/machine.py"

_TABLE = (
    # mtpipe's own
    Variable("MTPIPE_CACHE_DIR", "$XDG_CACHE_HOME/mtpipe (~/.cache/mtpipe)",
             "Where mtpipe keeps what it can rebuild: compiled decoder steps (decode.compile) and the records of "
             "bucket artifacts whose hash was checked; over decode.package_cache.", ("mtpipe/reading.py", _PACKAGE)),
    Variable("MTPIPE_CACHE_MAX_GB", "5", "Size in GB beyond which the least recently used compiled decoder steps "
             "are removed from the cache; over decode.package_cache_gb.", (_PACKAGE,)),
    Variable("MTPIPE_QUIET", "unset", "1: mtpipe's console prints nothing on stderr: no progress bars, tables, "
             "info lines or warnings (errors still print, as on the ranks other than 0).", ("mtpipe/console.py",)),
    Variable("MTPIPE_NNODES", "1", "Nodes of a multi-node `mtpipe train` (torchrun --nnodes).", (_LAUNCH,)),
    Variable("MTPIPE_NODE_RANK", "unset", "This node's rank, 0 .. MTPIPE_NNODES-1 (optional with the c10d "
             "rendezvous).", (_LAUNCH,)),
    Variable("MTPIPE_RDZV_ENDPOINT", "unset", "host:port that every node reaches (usually node 0); needed when "
             "MTPIPE_NNODES > 1.", (_LAUNCH,)),
    Variable("MTPIPE_RDZV_ID", "mtpipe", "Job id the nodes of one run share (torchrun --rdzv-id).", (_LAUNCH,)),
    Variable("MTPIPE_MAX_RESTARTS", "train.max_restarts", "torchrun --max-restarts: a crashed worker group resumes "
             "from the last checkpoint (overrides train.max_restarts).", (_LAUNCH,)),
    Variable("MTPIPE_LAUNCHER_REPORTS", "unset", "Set to 1 by mtpipe's launcher for its workers: a worker records "
             "its error in torchrun's error file and the launcher prints one line for the group. Not for users.",
             (_LAUNCH, "mtpipe/training/failures.py"), ("mtpipe/training/torchrun.py",)),
    # torchrun's, read by the workers it starts
    Variable("RANK", "0", "torchrun: this process's global rank; ranks other than 0 print nothing.",
             (_DIST, "mtpipe/console.py")),
    Variable("WORLD_SIZE", "1", "torchrun: the number of processes of the run.", (_DIST,)),
    Variable("LOCAL_RANK", "unset", "torchrun: this process's rank on its node (its GPU); set means the process "
             "is a worker and does not launch torchrun itself.", (_DIST, _LAUNCH)),
    Variable("GROUP_RANK", "unset", "torchrun: this node's rank, named when a node stops answering.", (_DIST,)),
    Variable("MASTER_ADDR", "unset", "torchrun: the rendezvous store's host (the heartbeat watch uses it).",
             (_DIST,)),
    Variable("MASTER_PORT", "unset", "torchrun: the rendezvous store's port.", (_DIST,)),
    Variable("TORCHELASTIC_RESTART_COUNT", "unset", "torchrun: which restart of the worker group this is (store "
             "keys are kept per attempt).", (_DIST,)),
    Variable("TORCHELASTIC_USE_AGENT_STORE", "unset", "torchrun: True when its agent hosts the store.", (_DIST,)),
    Variable("TORCHELASTIC_ERROR_FILE", "unset", "torchrun: where a worker records its error for the launcher.",
             (_LAUNCH,)),
    Variable("OMP_NUM_THREADS", "unset", "Threads per process; set, it is left alone; unset, `mtpipe train` on "
             "several processes shares the CPUs among them (train.threads 0).", (_PLATFORM, _MACHINE)),
    # Hugging Face and the network, read by `mtpipe fetch`
    Variable("HF_HUB_OFFLINE", "0", "1: the Hub libraries stay offline (a cached dataset still loads). Set by "
             "`mtpipe fetch` when the Hub is unreachable, so that it fails at once instead of retrying.",
             (_SOURCES,), (_SOURCES,)),
    Variable("HF_DATASETS_OFFLINE", "0", "As HF_HUB_OFFLINE, for the `datasets` library; set with it.", (),
             (_SOURCES,)),
    Variable("HF_ENDPOINT", "https://huggingface.co", "The Hub's address, probed before a download.", (_SOURCES,)),
    Variable("HTTPS_PROXY", "unset", "Set (or https_proxy, ALL_PROXY, all_proxy): the Hub is not probed directly.",
             (_SOURCES,)),
    Variable("https_proxy", "unset", "As HTTPS_PROXY.", (_SOURCES,)),
    Variable("ALL_PROXY", "unset", "As HTTPS_PROXY.", (_SOURCES,)),
    Variable("all_proxy", "unset", "As HTTPS_PROXY.", (_SOURCES,)),
    # torch's CPU code and compiler
    Variable("ATEN_CPU_CAPABILITY", "unset", "torch's CPU kernels' ISA (e.g. avx2); set, compiled code is cached "
             "apart from unrestricted runs' (TORCHINDUCTOR_CACHE_DIR).", (_PLATFORM, _MACHINE), (_MACHINE,)),
    Variable("ONEDNN_MAX_CPU_ISA", "ALL", "oneDNN's ISA limit; one without bf16 instructions makes bf16 on CPU "
             "unavailable, and it keys the compiled decoder step kept on disk.", (_PLATFORM, _MACHINE),
             (_MACHINE,)),
    Variable("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024 (oneDNN's)", "Compiled kernels oneDNN keeps; set, it is left "
             "alone; unset, decoding on oneDNN's float32 kernel sets 64 before oneDNN's first use (a corpus's many "
             "product shapes would fill the default with hundreds of MB).", (), (_PLATFORM, "bench/decode_corpus.py")),
    Variable("LRU_CACHE_CAPACITY", "1024 (torch's)", "As ONEDNN_PRIMITIVE_CACHE_CAPACITY, for the kernels torch's "
             "oneDNN bindings keep; set with it.", (), (_PLATFORM, "bench/decode_corpus.py")),
    Variable("TORCHINDUCTOR_CACHE_DIR", "torch's default", "Inductor's cache; set, it is left alone; unset with "
             "ATEN_CPU_CAPABILITY set, compiling sets it to a directory of that capability's own.", (_RUNTIME,),
             (_RUNTIME,)),
    Variable("AOTI_RUNTIME_CHECK_INPUTS", "unset", "Set to 1 (unless set) before a compiled decoder step is loaded "
             "from disk: its inputs' shapes are checked.", (), (_PACKAGE,)),
    # the terminal and the user's directories
    Variable("COLUMNS", "the terminal's width", "Width of stderr's tables and bars; unset and not a terminal: no "
             "wrapping.", ("mtpipe/console.py",)),
    Variable("XDG_CACHE_HOME", "~/.cache", "Parent of the default $MTPIPE_CACHE_DIR.",
             ("mtpipe/reading.py",)),
    Variable("MTPIPE_NO_SKIPS", "unset", "tests/: 1 (`make test`) turns a skipped core test into a failure.",
             ("tests/conftest.py",)),
    # bench/ only
    Variable("FBGEMM_ENABLE_INSTRUCTIONS", "unset", "bench/ --isa avx2: fbgemm's ISA (mtpipe's int8 products), set "
             "to AVX2 with ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA; recorded with the results.", (_MACHINE,),
             (_MACHINE,)),
    Variable("MKL_ENABLE_INSTRUCTIONS", "unset", "bench/: MKL's ISA limit, recorded with the results.", (_MACHINE,)),
    Variable("CT2_FORCE_CPU_ISA", "unset", "bench/: CTranslate2's ISA, recorded with the results.", (_MACHINE,)),
    Variable("CUBLAS_WORKSPACE_CONFIG", "unset", "cuBLAS's workspace; set, it is left alone; unset, the GPU checks "
             "set :4096:8 (what torch.use_deterministic_algorithms needs on a GPU) for their bitwise resume checks; "
             "recorded with the results.", ("bench/gpu_paper.py",), ("bench/gpu_paper.py", "bench/gpu_check.sh")),

    Variable("MTPIPE_MULTI30K", "data/multi30k", "bench/: the Multi30k files ({split}.{en,de}.gz) the benchmarks "
             "read.", ("bench/decode_speed.py", "bench/train_throughput.py", "bench/quickstart.py",
                       "bench/anchors/common.py")),
    Variable("MTPIPE_ANCHORS", "anchors", "bench/anchors: the other toolkits' install scripts.",
             ("bench/anchors/common.py",)),
    Variable("ANCHORS", "/tmp/anchors", "bench/anchors: setup_anchors.sh's directory (the --anchors default).",
             ("bench/anchors/__main__.py",)),
)

VARIABLES: dict[str, Variable] = {v.name: v for v in _TABLE}


class UnknownVariable(LookupError):
    """A name that is not in :data:`VARIABLES` (a programming error). Not a :class:`KeyError`, which
    ``Mapping.get`` would turn into its default."""


def _known(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:
        raise UnknownVariable(f"environment variable {name} is not in mtpipe.env.VARIABLES: add it there (and to "
                              "docs/environment.md, `python -m mtpipe.env --markdown`)") from None


def get(name: str, default: Optional[str] = None) -> Optional[str]:
    """``os.environ.get(name, default)`` for a variable of the table (:class:`UnknownVariable` for any other)."""
    _known(name)
    return os.environ.get(name, default)


def put(name: str, value: str, *, replace: bool = True) -> None:
    """Set a variable of the table for this process and the ones it starts (``replace=False``: only when unset).
    Called at run time by the command that needs it (the table's ``set_by``), never at import."""
    _known(name)
    if replace:
        os.environ[name] = value
    else:
        os.environ.setdefault(name, value)


class Environment(Mapping[str, str]):
    """This process's environment, as seen through the table: a read-only mapping whose lookups refuse names that
    are not in :data:`VARIABLES`. For functions that take a whole environment (a dict in their tests)."""

    def __getitem__(self, name: str) -> str:
        _known(name)
        return os.environ[name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _known(name) is not None and name in os.environ

    def __iter__(self) -> Iterator[str]:
        return iter([name for name in VARIABLES if name in os.environ])

    def __len__(self) -> int:
        return sum(name in os.environ for name in VARIABLES)


def environ() -> Environment:
    """The process environment as an :class:`Environment`."""
    return Environment()


def markdown() -> str:
    """``docs/environment.md``: the table as Markdown (a test keeps the committed file equal to this)."""
    lines = [
        "# Environment variables",
        "",
        "Every environment variable mtpipe reads or sets. params.yaml and the command-line flags hold every setting "
        "of a run; these are for where a process runs (its launcher, caches, network and CPU) and are few on "
        "purpose. Generated from `mtpipe/env.py` (`python -m mtpipe.env --markdown > docs/environment.md`); "
        "`tests/test_layering.py` checks that mtpipe reads no other.",
        "",
        "| Variable | Default | Meaning | Read by | Set by |",
        "|---|---|---|---|---|",
    ]
    for v in _TABLE:
        read = ", ".join(f"`{p}`" for p in v.read_by) or "-"
        wrote = ", ".join(f"`{p}`" for p in v.set_by) or "-"
        lines.append(f"| `{v.name}` | {v.default} | {v.meaning} | {read} | {wrote} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m mtpipe.env --markdown")
    sys.stdout.write(markdown())
