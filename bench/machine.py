"""The benchmarks' shared harness: the machine probe, interleaved rounds, spread, results files, CPU counters.

    python bench/machine.py [--speed]    # the probe as one line of JSON (--speed: matmul and int8 rates too)
    python bench/machine.py --preflight cuda   # what the GPU checks need and lack: one line each (preflight)

Speeds drift by up to 40 % over minutes on these shared machines: :func:`interleaved` times every system on every
item in rotating order, round after round, and figures are ratios to a baseline of the same round, min / median /
max. :func:`write_results` writes the results file every benchmark leaves (command, commit, machine probe, date,
figures). ``--isa avx2`` (:func:`isa_from_argv`) restricts torch, oneDNN and fbgemm to AVX2; :func:`probe` records
it. Importing this module loads no torch (the anchors' venvs import it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from mtpipe import env as mtenv

REPO = Path(__file__).resolve().parents[1]
# What an AVX2-only CPU offers, on a CPU with more: torch's dispatch level, oneDNN's, and fbgemm's (mtpipe's int8
# products; it heeds neither of the first two). Read when torch loads: see isa_from_argv.
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"}
ISA_VARIABLES = (*AVX2_ONLY, "CT2_FORCE_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS")


def isa_from_argv() -> None:
    """``--isa avx2`` on the command line: this process run again with :data:`AVX2_ONLY` in its environment (unless
    it already has them). Call it before importing torch, which reads them as it loads."""
    avx2 = "--isa=avx2" in sys.argv or ("--isa", "avx2") in zip(sys.argv, sys.argv[1:])
    if avx2 and any(mtenv.get(k) != v for k, v in AVX2_ONLY.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ONLY})


def add_flags(ap: argparse.ArgumentParser, rounds: int = 3) -> None:
    """The flags every speed benchmark shares: ``--rounds``, ``--isa``, ``--results``."""
    ap.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds (default {rounds})")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native", help="avx2: restrict torch, oneDNN and "
                    "fbgemm to AVX2 (" + " ".join(f"{k}={v}" for k, v in AVX2_ONLY.items()) + ")")
    ap.add_argument("--results", type=Path, help="the results file (default bench/results/<name>-<UTC time>.json)")


def cpu_info() -> dict[str, Any]:
    """CPU model, family and the AVX / AMX / FMA flags of /proc/cpuinfo, and the CPUs this process may use."""
    text = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").exists() else ""
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()[:40]) if v}
    flags = sorted({f for f in field.get("flags", "").split() if f.startswith(("avx", "amx", "fma"))})
    from mtpipe import platform as mtplatform  # loads no torch

    cpus = mtplatform.cpu_count()
    return {"model": field.get("model name", platform.processor() or "unknown"), "family": field.get("cpu family"),
            "flags": flags, "cpus": cpus}


def rates(native_bf16: bool) -> dict[str, float]:
    """G(FL)OP/s, the best of a few: n^3 matmuls in float32 (torch's route, MKL's on x86, which mtpipe's layers
    take), in bf16 (far below fp32 without native bf16), and mtpipe's int8 decoding layer (fbgemm's)."""
    import warnings

    import torch

    from mtpipe.engine.variants import _int8_linear

    def best(run: Callable[[], Any], ops: float, reps: int = 5) -> float:
        run()  # allocation and kernel choice
        return round(ops / min(interleaved([0], range(reps), 1, lambda k, i: run())[0][0]) / 1e9, 1)

    n, m = 1024, 1024 if native_bf16 else 256  # emulated bf16 is slow: a smaller product
    a, b, c, d = torch.randn(n, n), torch.randn(n, n), torch.randn(m, m).bfloat16(), torch.randn(m, m).bfloat16()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        layer, x = _int8_linear(torch.randn(8000, 512), None), torch.randn(64, 512)
        return {"fp32_gflops": best(lambda: a @ b, 2 * n**3), "bf16_gflops": best(lambda: c @ d, 2 * m**3),
                "int8_gops": best(lambda: layer(x), 2 * 64 * 512 * 8000, 20)}


def probe(speed: bool = False) -> dict[str, Any]:
    """What this process runs on: CPU, torch's dispatched capability and threads, native bf16 (what ``precision:
    auto`` sees) and the kernel libraries (:mod:`mtpipe.platform`), the ISA variables set (a restriction), versions, GPU; ``speed``: :func:`rates` too."""
    out: dict[str, Any] = {"cpu": cpu_info(), "python": sys.version.split()[0],
                           "environment": {k: mtenv.get(k) for k in ISA_VARIABLES if mtenv.get(k) is not None}}
    import torch

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from mtpipe import platform as mtplatform

    gpu, cpu = torch.cuda.is_available(), mtplatform.cpu()
    out.update(torch=torch.__version__, torch_capability=cpu.capability, threads=torch.get_num_threads(),
               native_bf16=cpu.native_bf16, kernels=dataclasses.asdict(mtplatform.kernels()),
               gpu=gpu and {"name": torch.cuda.get_device_name(), "bf16": torch.cuda.is_bf16_supported(),
                            "cuda": torch.version.cuda})
    return {**out, **(rates(out["native_bf16"]) if speed else {})}


# The oldest torch mtpipe runs on (pyproject.toml's torch>=2.4)
TORCH_MIN = (2, 4)


@dataclass(frozen=True)
class Need:
    """One thing a GPU check needs beyond what imports mtpipe: ``key`` (what :func:`preflight`'s callers test),
    whether it was found, what it is, how it was looked for, and the parts that go without it."""

    key: str
    found: bool
    what: str
    detail: str
    needed_by: str

    def line(self) -> str:
        """One line for what is missing (and what that skips)."""
        return f"preflight: missing {self.what} ({self.detail})" + (f"; skipped: {self.needed_by}" if self.needed_by
                                                                     else "")


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a package that fails to import, or one blocked
        return False


def preflight(device: str = "cuda") -> list[Need]:
    """What the GPU checks (bench/gpu_check.sh, bench/gpu_paper.py) need and a bare image may lack, looked for
    without running any of it: a compiler and Python's headers (torch.compile builds its launchers and kernels:
    Triton a C one on a GPU, inductor C++ on a CPU), Triton (GPU), safetensors (every checkpoint), xxhash (only
    decode.compile=aot's packaged steps), fastapi and uvicorn (bench/serve.py), a torch new enough, and its
    profiler's event kinds (:mod:`bench.gpu_paper` classifies events by device and name without them)."""
    import shutil
    import sysconfig

    import torch

    gpu = device == "cuda"
    compiled = "torch.compile (gpu_paper's compiled training, gpu_check.sh's --compile run)"
    names = ("cc", "gcc", "clang") if gpu else ("g++", "c++", "clang++")
    compiler = next((found for found in map(shutil.which, names) if found), None)
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    kineto = getattr(getattr(torch._C, "_autograd", None), "_KinetoEvent", None)
    needs = [
        Need("compiler", compiler is not None, "a C compiler" if gpu else "a C++ compiler",
             compiler or f"none of {', '.join(names)} on PATH", compiled),
        Need("headers", headers.is_file(), "Python's headers", str(headers), compiled),
        Need("torch", version >= TORCH_MIN, f"torch >= {'.'.join(map(str, TORCH_MIN))}",
             f"this is torch {torch.__version__}, CUDA {torch.version.cuda}: parts may fail, each recorded", ""),
        Need("profiler", kineto is not None and hasattr(kineto, "activity_type"), "the profiler's event kinds",
             f"torch {torch.__version__}'s _KinetoEvent has no activity_type: events are classified by device and "
             "name instead", ""),
        Need("safetensors", _importable("safetensors"), "safetensors", "not importable",
             "checkpoints (gpu_paper's checkpoint and resume parts, every `mtpipe train` run)"),
        Need("xxhash", _importable("xxhash"), "xxhash", "not importable: only decode.compile=aot's packaged steps "
             "use it, and compile in process without it; nothing here is skipped", ""),
    ]
    if gpu:
        needs.insert(2, Need("triton", _importable("triton"), "Triton", "not importable", compiled))
        needs += [Need(k, _importable(k), k, "not importable", "bench/serve.py (gpu_check.sh's serve rows)")
                  for k in ("fastapi", "uvicorn")]
    return needs


def missing(needs: list[Need], *keys: str) -> str | None:
    """Why a part that needs ``keys`` cannot run (the first of them missing, in words), or None: it can."""
    lost = [n for n in needs if n.key in keys and not n.found]
    return f"needs {lost[0].what} ({lost[0].detail}; see the preflight)" if lost else None


def probe_under(env: dict[str, str], prefix: Sequence[str] = ()) -> dict[str, Any]:
    """:func:`probe` with ``speed`` in a fresh process under ``env`` (``prefix``: e.g. ``taskset -c 0``)."""
    run = subprocess.run([*prefix, sys.executable, __file__, "--speed"], env={**env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def commit() -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()
        except OSError:  # no git on this machine (a copy of the checkout sent to a GPU machine, say)
            return ""

    return (git("rev-parse", "--short", "HEAD") or "?") + ("+dirty" if git("status", "--porcelain", "-uno") else "")


def write_results(name: str, figures: Any, path: Path | None = None, machine: dict[str, Any] | None = None,
                  command: str | None = None) -> Path:
    """The results file, ``{name, command, commit, date, machine, figures}`` as JSON at ``path`` (default
    ``bench/results/<name>-<UTC time>.json``); ``machine``: a probe (default: :func:`probe` of this process)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    path = Path(path or REPO / "bench" / "results" / f"{name}-{now:%Y%m%dT%H%M%SZ}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    # paths inside the repository as relative ones: the docs render a command the same wherever a checkout lies
    argv = [os.path.relpath(a, REPO) if a.startswith("/") and Path(a).is_relative_to(REPO) else a
            for a in sys.argv]
    doc = {"name": name, "command": command or "python " + " ".join(argv), "commit": commit(),
           "date": now.isoformat(timespec="seconds"), "machine": machine or probe(), "figures": figures}
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
    print(f"results: {path}", file=sys.stderr)
    return path


def interleaved(keys: Sequence[Any], items: Sequence[Any], rounds: int, run: Callable[[Any, Any], Any],
                clock: Callable[[], float] = time.perf_counter) -> dict[Any, list[list[float]]]:
    """``run(key, item)`` for every item by every key in turn, the order rotating from item to item and round to
    round, so drift and other processes fall on every key alike; the seconds of each, ``[key][round][item]``."""
    seconds: dict[Any, list[list[float]]] = {k: [[0.0] * len(items) for _ in range(rounds)] for k in keys}
    for r in range(rounds):
        for i, item in enumerate(items):
            shift = (i + r) % len(keys)
            for key in [*keys[shift:], *keys[:shift]]:
                start = clock()
                run(key, item)
                seconds[key][r][i] = clock() - start
    return seconds


def stats(values: Sequence[float]) -> dict[str, float]:  # for the results file
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def spread(values: Sequence[float], unit: str = "") -> str:
    """Rounds as "median (min-max)", two decimals."""
    return f"{statistics.median(values):.2f}{unit} ({min(values):.2f}-{max(values):.2f})"


def cpu_ticks() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, all cores (/proc/stat; 0, 0 where unavailable)."""
    try:
        values = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    idle = values[3] + (values[4] if len(values) > 4 else 0.0)  # idle + iowait
    return (sum(values) - idle) / hz, sum(values) / hz


def own_cpu() -> float:
    """CPU seconds this process has used (user + system, all its threads)."""
    return os.times().user + os.times().system


def others_share(since: tuple[float, float], own_since: float) -> float:
    """The share of the machine's CPU time other processes used since ``cpu_ticks()`` and ``own_cpu()`` were taken."""
    busy, total = cpu_ticks()
    return max(0.0, busy - since[0] - (own_cpu() - own_since)) / max(total - since[1], 1e-9)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--speed", action="store_true", help="also fp32 / bf16 matmul and int8 layer rates")
    ap.add_argument("--preflight", choices=["cuda", "cpu"], help="instead: what the GPU checks need and lack on "
                    "this device, one line each on stderr; the missing keys on stdout (bench/gpu_check.sh reads them)")
    args = ap.parse_args()
    if args.preflight:
        found = preflight(args.preflight)
        for need in found:
            if not need.found:
                print(need.line(), file=sys.stderr)
        print(" ".join(n.key for n in found if not n.found))
    else:
        print(json.dumps(probe(args.speed)))
