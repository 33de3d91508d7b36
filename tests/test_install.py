"""`make install`: TORCH_INDEX takes torch alone from another index (the CPU-only builds), and nothing changes
without it. Checked with `make -n` (the commands, not run: no network)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def install_commands(tmp_path: Path, *args: str) -> list[list[str]]:
    """The pip commands `make install` would run into a fresh venv under ``tmp_path``."""
    out = subprocess.run(["make", "-n", "install", f"VENV={tmp_path / 'venv'}", *args], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    return [shlex.split(line) for line in out.splitlines() if " install " in line and "/pip " in f"{line} "]


@needs_make
def test_torch_index_applies_to_torch_alone(tmp_path: Path) -> None:
    index = "https://download.pytorch.org/whl/cpu"
    pip = install_commands(tmp_path, f"TORCH_INDEX={index}")
    torch_only = [c for c in pip if "--index-url" in c]
    assert len(torch_only) == 1 and torch_only[0][torch_only[0].index("--index-url") + 1] == index
    mtpipe = next(c for c in pip if "-e" in c)  # mtpipe and its dependencies, torch pinned as the Makefile says
    words = torch_only[0][torch_only[0].index("install") + 1:]
    assert [w for w in words if w not in ("-q", "--index-url", index)] == [w for w in mtpipe if w.startswith("torch")]
    assert pip.index(torch_only[0]) < pip.index(mtpipe)  # torch first: pip then finds it installed
    assert not [c for c in install_commands(tmp_path) if "--index-url" in c]  # PyPI alone by default
