"""The GPU checks on a bare image, rehearsed on the CPU: ``bench/gpu_paper.py --device cpu --tiny`` (the same code as
on a GPU, at tiny shapes) and the preflight ``bench/gpu_check.sh`` reads (``bench/machine.py --preflight``), in a
process where ``datasets``, ``dvc`` and ``xxhash`` cannot be imported, the profiler's events have no
``activity_type`` (older torch builds) and no compiler is on PATH. A GPU is lent rarely and briefly: every part must
end in a figure or a skip that names what it lacks, never in a bare error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]

# Loaded by every Python started with this folder on PYTHONPATH (site imports sitecustomize)
BARE_IMAGE = '''
import sys

BLOCKED = ("datasets", "dvc", "xxhash")


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


sys.meta_path.insert(0, NotInstalled())
import torch  # noqa: E402

del torch._C._autograd._KinetoEvent.activity_type  # as in torch builds without it
'''


def bare_image(tmp_path: Path) -> dict[str, str]:
    """An environment that runs Python as on a bare GPU image (module docstring)."""
    shim, empty = tmp_path / "shim", tmp_path / "bin"
    shim.mkdir()
    empty.mkdir()
    (shim / "sitecustomize.py").write_text(BARE_IMAGE, encoding="utf-8")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(REPO)]), "PATH": str(empty)}


def results(figures: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every (path, value) of a results file's figures, nested dicts walked."""
    yield path, figures
    if isinstance(figures, dict):
        for k, v in figures.items():
            yield from results(v, f"{path}/{k}")


def test_the_bare_image_is_what_the_checks_run_on(tmp_path: Path) -> None:
    env = bare_image(tmp_path)
    code = ("import importlib, shutil, torch\n"
            "for name in ('datasets', 'dvc', 'xxhash'):\n"
            "    try:\n        importlib.import_module(name)\n        print('imported', name)\n"
            "    except ImportError:\n        pass\n"
            "print(hasattr(torch._C._autograd._KinetoEvent, 'activity_type'), shutil.which('g++'), shutil.which('cc'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["False", "None", "None"], out.stdout + out.stderr
    # bench/gpu_check.sh's preflight: one line for each thing missing, their keys on stdout
    pre = subprocess.run([sys.executable, str(REPO / "bench" / "machine.py"), "--preflight", "cpu"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert pre.returncode == 0, pre.stderr
    keys, lines = pre.stdout.split(), pre.stderr.strip().splitlines()
    assert {"compiler", "profiler", "xxhash"} <= set(keys) <= {"compiler", "profiler", "xxhash", "headers"}
    assert len(lines) == len(keys) and all(line.startswith("preflight: missing ") for line in lines)
    assert "C++ compiler (none of g++, c++, clang++ on PATH); skipped: torch.compile" in lines[0]


def test_gpu_paper_on_a_bare_image_gives_every_part_a_figure_or_a_named_skip(tmp_path: Path) -> None:
    out = tmp_path / "gpu_paper.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_paper.py"), "--device", "cpu", "--tiny",
                          "--tokens", "300", "--updates", "1", "--sentences", "16", "--budget-s", "900",
                          "--work", str(tmp_path / "work"), "--results", str(out)],
                         cwd=REPO, env=bare_image(tmp_path), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    f = json.loads(out.read_text(encoding="utf-8"))["figures"]
    assert not [p for p, v in results(f) if p.endswith("/error")], "a bare error:\n" + json.dumps(f, indent=1)

    # every part: its figure, or a skip that says why
    parts = {"train_eager": "ms_per_update", "train_compiled": "ms_per_update", "checkpoint": "mib",
             "resume": "bitwise_equal", "resume_default_algorithms": "bitwise_equal", "decode": "sentences_per_s"}
    for part, figure in parts.items():
        for name, r in f[part].items():
            if isinstance(r, dict):  # (decode's note and mean source length are not parts)
                r = r.get("300", r)  # training: by model, then by tokens an update
                assert figure in r or r.get("skipped"), (part, name, r)
    # what is missing is named once at the start, and only what needs it is skipped
    assert "preflight: missing xxhash" in run.stdout and "preflight: missing a C++ compiler" in run.stdout
    assert f["preflight"]["safetensors"] is True and "xxhash" in f["preflight"]["xxhash"]
    assert all("C++ compiler" in r["300"]["skipped"] for r in f["train_compiled"].values())
    for name in ("base", "big"):
        eager = f["train_eager"][name]["300"]
        assert eager["ms_per_update"] > 0 and f["checkpoint"][name]["mib"] > 0
        # the profile without activity_type: events classified by device and name, the updates' marks found
        assert eager["profile"]["event_kinds"].startswith("device and name") and eager["profile"]["updates"] == 2
    for precision in ("bf16", "fp32"):  # exact resume on the CPU, under deterministic algorithms and without
        assert f["resume"][precision]["bitwise_equal"] is True
        assert f["resume"][precision]["algorithms"].startswith("deterministic: torch.use_deterministic_algorithms")
        assert f["resume_default_algorithms"][precision]["uninterrupted_twice_equal"] is True
        decode = f["decode"][precision]  # (partial where its time cap ran out: a busy machine)
        assert 0 < decode["sentences"] <= 16 and decode["sentences_per_s"] > 0 and decode["beam"] == 4
