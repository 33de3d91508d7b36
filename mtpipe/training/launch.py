"""Starting training's processes: ``mtpipe train`` itself, or ``torchrun`` running N copies of it.

``mtpipe train`` (and ``stages/train.py``, DVC's launch glue) decides from the params Typer has already parsed:
``train.nproc`` processes (``auto``: one per visible CUDA GPU, else one CPU process), several nodes
(``MTPIPE_NNODES``), or ``train.max_restarts`` > 0 need torchrun, which then runs ``mtpipe train`` in every worker
with the same params; otherwise this process trains (world size 1, the very same code path). A process that torchrun
started (``LOCAL_RANK`` set) always trains itself.

The workers get every resolved params value as a flag, so they train exactly what the launcher resolved, whatever
their own view of params.yaml.

torchrun's agent runs inside ``mtpipe train`` (:func:`run_torchrun`). When a group fails for good, the user gets one
line (the rank that failed and how, the last checkpoint on disk, the command that resumes) instead of every rank's
traceback and torchrun's ChildFailedError report, which go to the run's ``train.log``: the workers record their
errors in torchrun's error files rather than print them (:func:`worker_errors`), and the launcher picks the cause
among them (:func:`root_failure`).

Several nodes: a rank or node that dies or freezes is named by the others' heartbeat watch within
``train.dist_timeout`` (:class:`mtpipe.training.distributed.Watch`; the line: ``rank 3 on node 1 (host) stopped answering for
600 s``); the rendezvous waits as long for the nodes to join (``--rdzv-conf``); an agent left blocked on the store
of a node that froze does not hold the launcher (:class:`_Supervisor`); and only rank 0's node writes its report into
the run directory.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import typing
import dataclasses
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

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
                     max_restarts: int = 0, dist_timeout: float | None = None) -> list[str]:
    """The ``torchrun`` command line that runs ``mtpipe train <train_args>`` in ``nproc`` processes per node.

    Single node: ``--standalone``. Several nodes: ``MTPIPE_NNODES``, ``MTPIPE_NODE_RANK``, ``MTPIPE_RDZV_ENDPOINT``
    (``host:port`` of a node every node reaches) and optionally ``MTPIPE_RDZV_ID`` (default ``mtpipe``) in ``env``
    give torchrun's ``--nnodes``, ``--node-rank`` and the c10d rendezvous, whose waits ``dist_timeout``
    (``train.dist_timeout``) bounds: for every node to join (at the start, and again after a restart) and for an
    answer of its store.
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
    return torchrun_command(nproc, args, env, max_restarts=max_restarts, dist_timeout=train.dist_timeout)


# --------------------------------------------------------------------------------------------------------------------
# When a worker dies: one line, not torchrun's report
# --------------------------------------------------------------------------------------------------------------------

# Set by :func:`run_torchrun` for its workers: a worker then records its error in torchrun's error file instead of
# printing it, and the launcher prints one line for the whole group (:func:`worker_errors`).
REPORTS_ENV = "MTPIPE_LAUNCHER_REPORTS"


@contextlib.contextmanager
def worker_errors(env: Mapping[str, str] | None = None) -> Iterator[None]:
    """Around a worker's training, when :func:`run_torchrun` started it: an error ends the process with its exit
    status and nothing on the console, recorded in torchrun's error file (``TORCHELASTIC_ERROR_FILE``, the JSON of
    torch's ``@record``, with mtpipe's one-line message and the exact time beside the traceback).

    Why: every rank of a group fails when one does (the others lose their peer in the next collective), and each
    would print its own traceback, the consequences burying the cause. The launcher reads the files, picks the cause
    (:func:`root_failure`) and prints one line; the tracebacks go to the run's ``train.log``. Anywhere else (one
    process, or a torchrun that is not mtpipe's launcher) errors are reported as usual."""
    env = os.environ if env is None else env
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
        _record_error(Path(path), kind, message, code)
        raise SystemExit(code) from None


def _describe(e: BaseException) -> tuple[str, str, int]:
    """``(kind, one-line message, exit status)`` of a worker's error: "mtpipe" (bad input: the message as one
    process prints it), "peer" (a rank or node that stopped answering, named by :func:`mtpipe.training.distributed.lost_peers`),
    "os" (a full disk ...), "interrupted", or "exception" (a bug)."""
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


def _record_error(path: Path, kind: str, message: str, code: int) -> None:
    """torch's error-file JSON (``ErrorHandler.record_exception``'s layout, which torchrun's ``ProcessFailure``
    reads), with mtpipe's own fields under ``extraInfo.mtpipe``."""
    import json
    import time
    import traceback

    now = time.time()
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": traceback.format_exc(), "timestamp": str(int(now)),
        "mtpipe": {"kind": kind, "message": message, "exit_code": code, "time": now}}}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data), encoding="utf-8")
    except OSError:
        pass  # torchrun then reports the exit status alone


def fail_now(kind: str, message: str, code: int, env: Mapping[str, str] | None = None, quiet: bool = False) -> None:
    """End this process at once with ``message``, from any thread (the heartbeat watch's verdict,
    :class:`mtpipe.training.distributed.Watch`, while the main thread may be blocked in a collective; the launcher's
    supervisor, while torchrun's agent is): recorded for the launcher like :func:`worker_errors` does, or printed as
    ``error: ...`` (``quiet``: not) outside mtpipe's launcher."""
    env = os.environ if env is None else env
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if path and env.get(REPORTS_ENV) == "1":
        _record_error(Path(path), kind, message, code)
    elif not quiet:
        sys.stderr.write(f"error: {message}\n")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _mine(failure: Any) -> dict[str, Any] | None:
    """What :func:`worker_errors` recorded for a torchrun ``ProcessFailure``, or None."""
    message = failure.message
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        if isinstance(extra, dict) and isinstance(extra.get("mtpipe"), dict):
            return extra["mtpipe"]
    return None


def root_failure(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """``(rank, ProcessFailure)`` that ended the group: a process killed by a signal torchrun does not send (SIGKILL
    from the OOM killer or a user, SIGSEGV ...), else the first error a worker recorded (by exact time: the others
    are its consequences, peers that lost it), else the earliest failure (torchrun's rule; its timestamps are whole
    seconds, so several failures of the same second tie there)."""
    import signal

    killed = [r for r, f in failures.items() if f.exitcode < 0 and -f.exitcode not in (signal.SIGTERM, signal.SIGINT)]
    if killed:
        rank = min(killed, key=lambda r: (failures[r].timestamp, r))
        return rank, failures[rank]
    recorded = [r for r, f in failures.items() if _mine(f) is not None]
    if recorded:
        rank = min(recorded, key=lambda r: (float(_mine(failures[r]).get("time", 0.0)), r))
        return rank, failures[rank]
    rank = min(failures, key=lambda r: (failures[r].timestamp, r))
    return rank, failures[rank]


def rerun_command(argv: list[str] | None = None) -> str:
    """The command line this process was started with, as a shell would take it back (what resumes a run: the same
    command on the same ``--out`` continues from its last checkpoint)."""
    import shlex

    argv = list(sys.argv if argv is None else argv)
    prog, rest = argv[0], argv[1:]
    if Path(prog).name == "__main__.py":  # python -m mtpipe
        head = [_program(sys.executable), "-m", "mtpipe"]
    elif prog.endswith(".py"):  # stages/train.py
        head = [_program(sys.executable), prog]
    else:  # the mtpipe console script
        head = [_program(prog)]
    return shlex.join(head + rest)


def _program(path: str) -> str:
    """``path``'s bare name when the shell finds that very file by it on PATH, else ``path`` itself."""
    import shutil

    name = Path(path).name
    found = shutil.which(name)
    try:
        if found and os.path.samefile(found, path):
            return name
    except OSError:
        pass
    return path


def last_checkpoint(out: Path) -> str:
    """The checkpoint a rerun resumes from, in words."""
    from mtpipe.artifacts import list_checkpoints

    try:
        found = list_checkpoints(out)
    except (MtpipeError, OSError):
        found = []
    if not found:
        return "none yet (a rerun starts from step 0)"
    step, path = found[-1]
    return f"{path} (step {step:,})"


def failure_summary(failures: Mapping[int, Any], out: Path, rerun: str, report: Path | None) -> tuple[str, int]:
    """``(one line, exit status)`` for a group that failed: which rank, how (exit status or signal, or the error it
    recorded), the last checkpoint, the command that resumes, and where torchrun's report went. An error a worker
    reported as bad input (:class:`MtpipeError`: a refused resume, bad data) is that error's line alone: rerunning
    would not help."""
    import signal

    rank, failure = root_failure(failures)
    mine = _mine(failure)
    if mine is not None and mine.get("kind") == "mtpipe":
        return str(mine.get("message")), int(mine.get("exit_code") or 1)
    if failure.exitcode < 0:
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = "?"
        what = f"rank {rank} was killed by signal {name} ({-failure.exitcode})"
    elif mine is not None and mine.get("kind") == "peer":  # what stopped answering, as rank `rank` saw it
        what = str(mine.get("message"))
    elif mine is not None:
        what = f"rank {rank} failed (exit status {failure.exitcode}): {mine.get('message')}"
    else:
        what = f"rank {rank} exited with status {failure.exitcode}"
    where = f"; torchrun's report and the tracebacks: {report}" if report is not None else ""
    return (f"training failed: {what}; last checkpoint: {last_checkpoint(out)}; to resume, run: {rerun}{where}",
            1)


class _Captured:
    """torchrun's own log records (torch.distributed's loggers print them to stderr), kept for the report instead;
    a worker failure that torchrun answers with a restart is announced on one line."""

    def __init__(self, max_restarts: int, nproc: str) -> None:
        import logging

        self.lines: list[str] = []
        self.failures = 0
        self.max_restarts, self.nproc = max_restarts, nproc
        self.saved: dict[str, list[Any]] = {}  # logger name -> [handlers, propagate]
        outer = self

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                try:
                    outer.lines.extend(self.format(record).splitlines())
                    outer.note(record)
                except Exception:  # noqa: BLE001 -- a logging handler never raises
                    self.handleError(record)

        self.handler = Handler()

    def note(self, record: Any) -> None:
        import logging

        if record.levelno >= logging.ERROR and "failed (exitcode" in record.getMessage():
            self.failures += 1
            if self.failures <= self.max_restarts:
                import typer

                typer.echo(f"warning: torchrun: {record.getMessage()}; restarting the {self.nproc} processes from "
                           f"the last checkpoint (restart {self.failures} of at most {self.max_restarts})", err=True)

    def __enter__(self) -> "_Captured":
        import logging

        for name in ("torch", "torch.distributed"):  # the loggers torch gives a stderr handler
            logger = logging.getLogger(name)
            self.saved[name] = [list(logger.handlers), logger.propagate]
            if logger.handlers and self.handler.formatter is None:
                self.handler.setFormatter(logger.handlers[0].formatter)
            for h in logger.handlers[:]:
                logger.removeHandler(h)
            logger.addHandler(self.handler)
            logger.propagate = False
        return self

    def __exit__(self, *exc: Any) -> None:
        import logging

        for name, (handlers, propagate) in self.saved.items():
            logger = logging.getLogger(name)
            logger.removeHandler(self.handler)
            for h in handlers:
                logger.addHandler(h)
            logger.propagate = propagate


def write_report(out: Path, lines: list[str], in_run_dir: bool = True) -> Path | None:
    """Append ``lines`` to the run's ``train.log`` (UTC times, as training writes it), or, when ``out`` does not
    exist (the group failed before writing anything) or is not this node's to write (``in_run_dir`` False: a node
    other than rank 0's, :class:`_Supervisor`), to a new file in the temporary directory; returns it. Where
    neither can be written (a full disk), the lines go to stderr instead, and None is returned: the report is never
    lost."""
    import tempfile
    import time

    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    text = "".join(f"{stamp}  {line}\n" for line in lines)
    try:
        if in_run_dir and Path(out).is_dir():
            path = Path(out) / "train.log"
            with open(path, "a", encoding="utf-8") as f:
                f.write(text)
            return path
        fd, name = tempfile.mkstemp(prefix="mtpipe-train-", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return Path(name)
    except OSError:
        sys.stderr.write("\n".join(lines) + "\n")
        return None


class _Supervisor:
    """This node's workers, as :func:`run_torchrun` sees them (its child processes, read from ``/proc``; several
    nodes only): which ranks this node runs (only rank 0's node writes into the run directory, as only rank 0
    writes checkpoints), their error files and exit statuses, and whether torchrun's agent outlives them.

    Why the last: when the node hosting torchrun's store freezes or drops off the network, the agents of the other
    nodes block in a store call that never returns (TCPStore cancels a wait that timed out, then waits for the
    cancellation's answer without a limit), long after their workers failed with one line each. Once no worker of
    this node has been alive for ``grace`` seconds and one of them failed, ``on_stuck`` ends the launcher with their
    line; when all of them succeeded, the agent is first given its exit barrier's 300 s (it waits there for the
    other nodes)."""

    def __init__(self, grace: float, on_stuck: Callable[[dict[int, Any]], None]) -> None:
        import threading

        self.grace, self.on_stuck = grace, on_stuck
        self.workers: dict[int, dict[str, str]] = {}  # pid -> the worker's RANK, GROUP_RANK, TORCHELASTIC_ERROR_FILE
        self.status: dict[int, int] = {}  # pid -> exit status (-signal), while it waits to be reaped
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mtpipe-supervisor", daemon=True)

    def start(self) -> _Supervisor:
        if Path("/proc/self/stat").exists():
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def writes_run_dir(self) -> bool | None:
        """Whether this node runs rank 0 (None: no worker seen)."""
        if not self.workers:
            return None
        return any(env.get("RANK") == "0" for env in self.workers.values())

    def failures(self) -> dict[int, Any]:
        """This node's failed workers by rank, as torchrun's ``ProcessFailure`` would give them: the exit status
        where known, what the worker recorded in its error file."""
        import json
        import time

        out: dict[int, Any] = {}
        for pid, env in list(self.workers.items()):
            try:
                record: Any = json.loads(Path(env.get("TORCHELASTIC_ERROR_FILE", "")).read_text(encoding="utf-8"))
                record = record["message"]
            except (OSError, ValueError, KeyError, TypeError):
                record = ""
            code = self.status.get(pid)
            if code == 0 or (code is None and not record):
                continue
            out[int(env.get("RANK", -1))] = _Failed(code if code is not None else 1, int(time.time()), record)
        return out

    def _run(self) -> None:
        import time

        me, gone_since = os.getpid(), None
        while not self._stop.wait(0.5):
            alive = set()
            for pid, (state, status) in _children_of(me).items():
                if pid not in self.workers:
                    env = _environ(pid)
                    if env is None or "LOCAL_RANK" not in env:
                        continue
                    self.workers[pid] = {k: env[k] for k in ("RANK", "GROUP_RANK", "TORCHELASTIC_ERROR_FILE")
                                         if k in env}
                if state == "Z":
                    self.status[pid] = status
                else:
                    alive.add(pid)
            if not self.workers or alive:
                gone_since = None
                continue
            now = time.monotonic()
            gone_since = now if gone_since is None else gone_since
            failed = self.failures()
            if now - gone_since > (self.grace if failed else 330.0):
                self.on_stuck(failed)
                return


class _Failed:
    """A worker's failure as :func:`failure_summary` reads it (the fields of torchrun's ``ProcessFailure``)."""

    def __init__(self, exitcode: int, timestamp: int, message: Any) -> None:
        self.exitcode, self.timestamp, self.message = exitcode, timestamp, message


def _children_of(parent: int) -> dict[int, tuple[str, int]]:
    """``pid -> (state, exit status)`` of ``parent``'s child processes, from ``/proc`` (the exit status, negative
    for a signal as torchrun gives it, means something for a zombie, state ``Z``, only)."""
    try:  # each thread's children (Linux >= 3.5); else every process's parent
        pids = {int(p) for f in Path(f"/proc/{parent}/task").glob("*/children") for p in f.read_text().split()}
        stats = [Path(f"/proc/{pid}/stat") for pid in pids]
    except OSError:
        stats = list(Path("/proc").glob("[0-9]*/stat"))
    out = {}
    for stat in stats:
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != parent:
                continue
        except (OSError, IndexError, ValueError):
            continue
        raw = int(fields[49]) if len(fields) > 49 else 0  # exit_code (Linux >= 3.5), in waitpid's layout
        out[int(stat.parent.name)] = (fields[0], -(raw & 0x7F) if raw & 0x7F else (raw >> 8) & 0xFF)
    return out


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _flag(cmd: list[str], name: str, default: str) -> str:
    """The value of option ``name`` in ``cmd`` (the last one given), or ``default``."""
    at = [i for i, word in enumerate(cmd[:-1]) if word == name]
    return cmd[at[-1] + 1] if at else default


def run_torchrun(cmd: list[str], out: Path, rerun: str | None = None) -> int:
    """Run :func:`torchrun_command`'s ``cmd`` (torch.distributed.run, in this process) and return its exit status.

    A group that fails ends in one line (:func:`failure_summary`), raised as :class:`MtpipeError` with the status:
    which rank, how, the last checkpoint on disk and the command that resumes. What torchrun would print instead
    (its log lines and the ~40-line ChildFailedError report, with each worker's traceback from its error file) is
    appended to ``out/train.log``. ``rerun``: the resuming command (default: this process's own,
    :func:`rerun_command`)."""
    prefix = [sys.executable, "-m", "torch.distributed.run"]
    if cmd[: len(prefix)] != prefix:
        raise ValueError(f"not a torchrun_command: {cmd[:3]}")  # programming error
    import signal

    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousError,
        RendezvousTimeoutError,
    )
    from torch.distributed.run import parse_args, run

    args = parse_args(cmd[len(prefix):])
    rerun = rerun_command() if rerun is None else rerun
    os.environ[REPORTS_ENV] = "1"  # the workers inherit it
    nproc = str(args.nproc_per_node)
    several = str(args.nnodes) not in ("1", "1:1")
    timeout = float(_flag(cmd, "--dist-timeout", "600"))
    with _Captured(int(args.max_restarts), nproc) as log:

        def ours() -> bool:  # whether this node writes into the run directory: rank 0's does
            known = supervisor.writes_run_dir()
            return not several if known is None else known

        def fail(failures: Mapping[int, Any], extra: list[str]) -> MtpipeError:
            report = None
            if (_mine(root_failure(failures)[1]) or {}).get("kind") != "mtpipe":
                header, _ = failure_summary(failures, out, rerun, report=None)
                report = write_report(out, [header, *log.lines, *extra], in_run_dir=ours())
            line, code = failure_summary(failures, out, rerun, report=report)
            error = MtpipeError(line)
            error.exit_code = code  # type: ignore[attr-defined]
            return error

        def stuck(failures: dict[int, Any]) -> None:  # the supervisor's thread: the agent hangs in a store call
            if not failures:
                sys.stderr.write("warning: torchrun's agent did not return after every worker finished (its store "
                                 "does not answer); the run itself is complete\n")
                fail_now("launcher", "", 0, env={}, quiet=True)
            error = fail(failures, ["torchrun's agent did not return after its workers ended (its store does not "
                                    "answer): the launcher ended it"])
            fail_now("launcher", str(error), int(getattr(error, "exit_code", 1)), env={})

        # Several nodes: a node that dies takes torchrun's store with it if it hosts it; the workers fail within
        # train.dist_timeout, and the launcher does not wait for an agent stuck on that store after them.
        grace = 5.0 + (timeout if int(args.max_restarts) > 0 else 0.0)  # a restart's rendezvous may take that long
        supervisor = _Supervisor(grace, stuck)
        if several:
            supervisor.start()
        try:
            run(args)
        except ChildFailedError as e:
            raise fail(e.failures, e.format_msg().splitlines()) from None
        except SignalException as e:
            if e.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None
            name = signal.Signals(e.sigval).name
            report = write_report(out, [f"training stopped by {name}", *log.lines], in_run_dir=ours())
            where = f"; torchrun's log: {report}" if report is not None else ""
            error = MtpipeError(f"training stopped by {name}; last checkpoint: {last_checkpoint(out)}; to resume, "
                                f"run: {rerun}{where}")
            error.exit_code = 128 + int(e.sigval)  # type: ignore[attr-defined]
            raise error from None
        except (RendezvousError, DistError, OSError) as e:
            # The agent itself failed: the rendezvous (a node missing past train.dist_timeout, its store gone).
            # What this node's workers recorded, if they failed first, says more.
            failures = supervisor.failures()
            if any(_mine(f) is not None for f in failures.values()):
                raise fail(failures, [f"torchrun's agent: {_one_line(e)}"]) from None
            cause = f" ({_one_line(e.__cause__)})" if e.__cause__ is not None else ""
            where = f"torchrun's rendezvous at {args.rdzv_endpoint or 'this node'}"
            if isinstance(e, RendezvousTimeoutError):
                what = f"not every node joined {where} within train.dist_timeout = {timeout:g} s"
            elif isinstance(e, RendezvousClosedError):
                what = f"{where} was closed: another node's group failed (its own line says how)"
            else:
                what = (f"lost {where}: the node that hosts it ended (its group failed: its own line says how), "
                        "died or lost the network")
            what = f"training failed: {what} ({_one_line(e)}{cause})"
            report = write_report(out, [what, *log.lines], in_run_dir=ours())
            where = f"; torchrun's log: {report}" if report is not None else ""
            line = f"{what}; last checkpoint: {last_checkpoint(out)}; to resume, run: {rerun}{where}"
            raise MtpipeError(line) from None
        finally:
            supervisor.stop()
        if log.failures:  # restarts that recovered: what torchrun said about them
            write_report(out, ["torchrun restarted the processes:", *log.lines], in_run_dir=ours())
    return 0


def _one_line(e: BaseException) -> str:
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__
