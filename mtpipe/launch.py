"""Starting training's processes: ``mtpipe train`` itself, or ``torchrun`` running N copies of it.

``mtpipe train`` (and ``stages/train.py``, DVC's launch glue) decides from the params Typer has already parsed:
``train.nproc`` processes (``auto``: one per visible CUDA GPU, else one CPU process), several nodes
(``MTPIPE_NNODES``), or ``train.max_restarts`` > 0 need torchrun, which then runs ``mtpipe train`` in every worker
with the same params; otherwise this process trains (world size 1, the very same code path). A process that torchrun
started (``LOCAL_RANK`` set) always trains itself.

The workers get every resolved params value as a flag, so they train exactly what the launcher resolved, whatever
their own view of params.yaml.
"""

from __future__ import annotations

import os
import sys
import typing
import dataclasses
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping

from mtpipe.errors import MtpipeError

# Flags that only the launcher reads: torchrun would take --nproc as an abbreviation of its own --nproc-per-node.
LAUNCHER_ONLY = ("nproc", "max_restarts")


def resolve_nproc(nproc: str) -> int:
    """``train.nproc``: ``auto`` = every visible CUDA GPU (1 CPU process when there is none), or a positive int."""
    if str(nproc).strip().lower() == "auto":
        import torch

        return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    try:
        n = int(nproc)
    except ValueError:
        raise MtpipeError(f"train.nproc: {nproc!r} is neither 'auto' nor a number of processes") from None
    if n < 1:
        raise MtpipeError(f"train.nproc: {n} must be >= 1")
    return n


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or taskset's limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def inside_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a worker that torchrun (or another launcher setting ``LOCAL_RANK``) started."""
    return "LOCAL_RANK" in (os.environ if env is None else env)


def section_flags(section: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """A params section's values as the command-line flags that set them (``None`` values are left out)."""
    import yaml

    from mtpipe.config import base_type, field_types

    types = field_types(type(section))
    args: list[str] = []
    for f in fields(section):
        value = getattr(section, f.name)
        if f.name in skip or value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        bt = base_type(types[f.name])
        if bt is bool:
            args.append(flag if value else "--no-" + f.name.replace("_", "-"))
        elif (typing.get_origin(bt) or bt) in (dict, list):
            args += [flag, yaml.safe_dump(value, default_flow_style=True).strip()]
        else:
            args += [flag, str(value)]
    return args


def torchrun_command(nproc: int, train_args: list[str], env: Mapping[str, str] | None = None,
                     max_restarts: int = 0) -> list[str]:
    """The ``torchrun`` command line that runs ``mtpipe train <train_args>`` in ``nproc`` processes per node.

    Single node: ``--standalone``. Several nodes: ``MTPIPE_NNODES``, ``MTPIPE_NODE_RANK``, ``MTPIPE_RDZV_ENDPOINT``
    (``host:port`` of a node every node reaches) and optionally ``MTPIPE_RDZV_ID`` (default ``mtpipe``) in ``env``
    give torchrun's ``--nnodes``, ``--node-rank`` and the c10d rendezvous.
    """
    env = os.environ if env is None else env
    nnodes = env.get("MTPIPE_NNODES", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if nnodes in ("", "1"):
        cmd.append("--standalone")
    else:
        endpoint = env.get("MTPIPE_RDZV_ENDPOINT")
        if not endpoint:
            raise MtpipeError(f"MTPIPE_NNODES={nnodes} needs MTPIPE_RDZV_ENDPOINT=host:port (a node every node "
                              "can reach)")
        cmd += ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                "--rdzv-id", env.get("MTPIPE_RDZV_ID", "mtpipe")]
        if env.get("MTPIPE_NODE_RANK"):
            cmd += ["--node-rank", env["MTPIPE_NODE_RANK"]]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    return cmd + ["-m", "mtpipe", "train", *train_args]


def launch_command(model: Any, train: Any, paths: Mapping[str, Path | None], force: bool = False,
                   env: Mapping[str, str] | None = None) -> list[str] | None:
    """The torchrun command for this ``mtpipe train`` (sections ``model`` and ``train``, the ``--tokens`` /
    ``--batches`` / ``--out`` paths), or None when this process should train itself."""
    env = os.environ if env is None else env
    if inside_torchrun(env):
        return None
    restarts = env.get("MTPIPE_MAX_RESTARTS")
    try:
        max_restarts = int(restarts) if restarts else train.max_restarts
    except ValueError:
        raise MtpipeError(f"MTPIPE_MAX_RESTARTS={restarts!r} is not an integer") from None
    nproc = resolve_nproc(train.nproc)
    if nproc == 1 and env.get("MTPIPE_NNODES", "1") in ("", "1") and max_restarts == 0:
        return None
    if train.threads == 0 and "OMP_NUM_THREADS" not in env:
        # torchrun gives every worker one thread (OMP_NUM_THREADS=1) unless told otherwise: share this machine's
        # cores among the workers instead, so nproc=2 on 8 cores runs 2 x 4 threads, not 2 x 1.
        train = dataclasses.replace(train, threads=max(1, available_cpus() // nproc))
    args = [arg for name, path in paths.items() if path is not None for arg in ("--" + name, str(path))]
    args += section_flags(model) + section_flags(train, skip=LAUNCHER_ONLY) + (["--force"] if force else [])
    return torchrun_command(nproc, args, env, max_restarts=max_restarts)
