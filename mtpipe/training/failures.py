"""When a worker of a torchrun launch fails: its error recorded where the launcher reads it, and one line for the
whole group instead of every rank's traceback and torchrun's ChildFailedError report.

Every rank of a group fails when one does (the others lose their peer in the next collective), and each would print
its own traceback, the consequences burying the cause. The workers record their errors in torchrun's error files
(:func:`record_error`, from :func:`mtpipe.training.launch.worker_errors` or :func:`fail_now`); the launcher
(:mod:`mtpipe.training.torchrun`) picks the cause among them (:func:`root_failure`), prints one line
(:func:`failure_summary`: the rank that failed and how, the last checkpoint on disk, the command that resumes) and
appends what torchrun said to the run's ``train.log`` (:func:`write_report`).

This module imports nothing of training's but the environment table, so that the heartbeat watch
(:mod:`mtpipe.training.distributed`) can end its process through :func:`fail_now` without a cycle.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Mapping

from mtpipe import env as mtenv
from mtpipe.errors import MtpipeError

# Set by :func:`mtpipe.training.torchrun.run_torchrun` for its workers: a worker then records its error in
# torchrun's error file instead of printing it (:func:`mtpipe.training.launch.worker_errors`), and the launcher
# prints one line for the whole group.
REPORTS_ENV = "MTPIPE_LAUNCHER_REPORTS"


def record_error(path: Path, kind: str, message: str, code: int) -> None:
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
    supervisor, while torchrun's agent is): recorded for the launcher like
    :func:`mtpipe.training.launch.worker_errors` does, or printed as
    ``error: ...`` (``quiet``: not) outside mtpipe's launcher."""
    env = mtenv.environ() if env is None else env
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if path and env.get(REPORTS_ENV) == "1":
        record_error(Path(path), kind, message, code)
    elif not quiet:
        sys.stderr.write(f"error: {message}\n")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def recorded_error(failure: Any) -> dict[str, Any] | None:
    """What :func:`mtpipe.training.launch.worker_errors` recorded for a torchrun ``ProcessFailure``, or None."""
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
    recorded = [r for r, f in failures.items() if recorded_error(f) is not None]
    if recorded:
        rank = min(recorded, key=lambda r: (float(recorded_error(failures[r]).get("time", 0.0)), r))
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
    mine = recorded_error(failure)
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


def write_report(out: Path, lines: list[str], in_run_dir: bool = True) -> Path | None:
    """Append ``lines`` to the run's ``train.log`` (UTC times, as training writes it), or, when ``out`` does not
    exist (the group failed before writing anything) or is not this node's to write (``in_run_dir`` False: a node
    other than rank 0's, :class:`mtpipe.training.torchrun._Supervisor`), to a new file in the temporary directory;
    returns it. Where neither can be written (a full disk), the lines go to stderr instead, and None is returned:
    the report is never lost."""
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


def one_line(e: BaseException) -> str:
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__
