"""Starting training's processes: ``mtpipe train`` itself, or ``torchrun`` running N copies of it.

``mtpipe train`` (and ``stages/train.py``, DVC's launch glue) decides from the params Typer has already parsed:
``train.nproc`` processes (``auto``: one per visible CUDA GPU, else one CPU process), several nodes
(``MTPIPE_NNODES``), or ``train.max_restarts`` > 0 need torchrun, which then runs ``mtpipe train`` in every worker
with the same params; otherwise this process trains (world size 1, the very same code path). A process that torchrun
started (``LOCAL_RANK`` set) always trains itself.

The workers get every resolved params value as a flag, so they train exactly what the launcher resolved, whatever
their own view of params.yaml.

torchrun's agent runs inside ``mtpipe train`` (:func:`mtpipe.training.torchrun.run_torchrun`), which turns a group
that fails for good into one line (:mod:`mtpipe.training.failures`); a worker records its error for it rather than
print it (:func:`worker_errors`).

Several nodes: a rank or node that dies or freezes is named by the others' heartbeat watch within
``train.dist_timeout`` (:class:`mtpipe.training.distributed.Watch`; the line: ``rank 3 on node 1 (host) stopped
answering for 600 s``); the rendezvous waits as long for the nodes to join (``--rdzv-conf``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterator, Mapping

from mtpipe import env as mtenv
from mtpipe import platform
from mtpipe.errors import MtpipeError
from mtpipe.training.failures import REPORTS_ENV, record_error

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


def inside_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a worker that torchrun (or another launcher setting ``LOCAL_RANK``) started."""
    return "LOCAL_RANK" in (mtenv.environ() if env is None else env)


def section_flags(section: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """A params section's values as the command-line flags that set them (``None`` values are left out)."""
    import yaml

    from mtpipe.params import base_type, field_types

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
                     max_restarts: int = 0, dist_timeout: float | None = None) -> list[str]:
    """The ``torchrun`` command line that runs ``mtpipe train <train_args>`` in ``nproc`` processes per node.

    Single node: ``--standalone``. Several nodes: ``MTPIPE_NNODES``, ``MTPIPE_NODE_RANK``, ``MTPIPE_RDZV_ENDPOINT``
    (``host:port`` of a node every node reaches) and optionally ``MTPIPE_RDZV_ID`` (default ``mtpipe``) in ``env``
    give torchrun's ``--nnodes``, ``--node-rank`` and the c10d rendezvous, whose waits ``dist_timeout``
    (``train.dist_timeout``) bounds: for every node to join (at the start, and again after a restart) and for an
    answer of its store.
    """
    env = mtenv.environ() if env is None else env
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
        if dist_timeout is not None:
            seconds = max(1, math.ceil(dist_timeout))
            cmd += ["--rdzv-conf", f"join_timeout={seconds},read_timeout={seconds}"]
        if env.get("MTPIPE_NODE_RANK"):
            cmd += ["--node-rank", env["MTPIPE_NODE_RANK"]]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    return cmd + ["-m", "mtpipe", "train", *train_args]


def launch_command(model: Any, train: Any, paths: Mapping[str, Path | None], force: bool = False,
                   env: Mapping[str, str] | None = None) -> list[str] | None:
    """The torchrun command for this ``mtpipe train`` (sections ``model`` and ``train``, the ``--tokens`` /
    ``--batches`` / ``--out`` paths), or None when this process should train itself."""
    env = mtenv.environ() if env is None else env
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
    # torchrun gives every worker one thread unless told otherwise: the platform shares this machine's cores
    train = dataclasses.replace(train, threads=platform.torchrun_threads(train.threads, nproc, env))
    args = [arg for name, path in paths.items() if path is not None for arg in ("--" + name, str(path))]
    args += section_flags(model) + section_flags(train, skip=LAUNCHER_ONLY) + (["--force"] if force else [])
    return torchrun_command(nproc, args, env, max_restarts=max_restarts, dist_timeout=train.dist_timeout)


# --------------------------------------------------------------------------------------------------------------------
# A worker's error: recorded for the launcher (:mod:`mtpipe.training.failures`)
# --------------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def worker_errors(env: Mapping[str, str] | None = None) -> Iterator[None]:
    """Around a worker's training, when :func:`mtpipe.training.torchrun.run_torchrun` started it: an error ends the
    process with its exit status and nothing on the console, recorded in torchrun's error file
    (``TORCHELASTIC_ERROR_FILE``, the JSON of torch's ``@record``, with mtpipe's one-line message and the exact time
    beside the traceback).

    Why: every rank of a group fails when one does (the others lose their peer in the next collective), and each
    would print its own traceback, the consequences burying the cause. The launcher reads the files, picks the cause
    (:func:`mtpipe.training.failures.root_failure`) and prints one line; the tracebacks go to the run's
    ``train.log``. Anywhere else (one process, or a torchrun that is not mtpipe's launcher) errors are reported as
    usual."""
    env = mtenv.environ() if env is None else env
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not path or env.get(REPORTS_ENV) != "1":
        yield
        return
    try:
        yield
    except BaseException as e:  # noqa: BLE001 -- every error is recorded, then the process exits with its status
        if isinstance(e, (SystemExit, GeneratorExit)) or type(e).__name__ == "Exit":  # typer.Exit: a status only
            raise
        kind, message, code = _describe(e)
        record_error(Path(path), kind, message, code)
        raise SystemExit(code) from None


def _describe(e: BaseException) -> tuple[str, str, int]:
    """``(kind, one-line message, exit status)`` of a worker's error: "mtpipe" (bad input: the message as one
    process prints it), "peer" (a rank or node that stopped answering, named by
    :func:`mtpipe.training.distributed.lost_peers`), "os" (a full disk ...), "interrupted", or "exception" (a bug)."""
    if isinstance(e, MtpipeError):
        return "mtpipe", str(e), getattr(e, "exit_code", 1)
    if not isinstance(e, KeyboardInterrupt):
        from mtpipe.training.distributed import lost_peers

        lost = lost_peers(e)  # a collective that failed for a peer that is gone or silent: that peer, named
        if lost is not None:
            return "peer", lost, 1
    if isinstance(e, OSError):
        from mtpipe.errors import os_reason

        return "os", (f"{e.filename}: " if e.filename else "") + os_reason(e), 1
    if isinstance(e, KeyboardInterrupt):
        return "interrupted", "interrupted", 130
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return "exception", f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__, 1
