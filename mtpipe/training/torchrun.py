"""torchrun's agent inside ``mtpipe train``: the launcher side of a multi-process run.

:func:`run_torchrun` runs :func:`mtpipe.training.launch.torchrun_command`'s command (torch.distributed.run, in this
process). torchrun's own log lines and its ChildFailedError report go to the run's ``train.log``; a group that fails
for good ends in one line (:mod:`mtpipe.training.failures`).

Several nodes: an agent left blocked on the store of a node that froze does not hold the launcher
(:class:`_Supervisor`), and only rank 0's node writes its report into the run directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from mtpipe import env as mtenv
from mtpipe.errors import MtpipeError
from mtpipe.training.failures import (
    REPORTS_ENV,
    fail_now,
    failure_summary,
    last_checkpoint,
    one_line,
    recorded_error,
    rerun_command,
    root_failure,
    write_report,
)


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
    """A worker's failure as :func:`mtpipe.training.failures.failure_summary` reads it (the fields of torchrun's
    ``ProcessFailure``)."""

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
    """Run :func:`mtpipe.training.launch.torchrun_command`'s ``cmd`` (torch.distributed.run, in this process) and
    return its exit status.

    A group that fails ends in one line (:func:`mtpipe.training.failures.failure_summary`), raised as
    :class:`MtpipeError` with the status: which rank, how, the last checkpoint on disk and the command that resumes.
    What torchrun would print instead (its log lines and the ~40-line ChildFailedError report, with each worker's
    traceback from its error file) is appended to ``out/train.log``. ``rerun``: the resuming command (default: this
    process's own, :func:`mtpipe.training.failures.rerun_command`)."""
    prefix = [sys.executable, "-m", "torch.distributed.run"]
    if cmd[: len(prefix)] != prefix:
        raise ValueError(f"not a torchrun_command: {cmd[:3]}")  # programming error
    from torch.distributed.run import parse_args

    args = parse_args(cmd[len(prefix):])
    rerun = rerun_command() if rerun is None else rerun
    mtenv.put(REPORTS_ENV, "1")  # the workers inherit it
    return _Group(args, out, rerun, float(_flag(cmd, "--dist-timeout", "600"))).run()


class _Group:
    """One torchrun launch of this node, from :func:`run_torchrun`: its agent run, and each way it can end turned
    into one line."""

    def __init__(self, args: Any, out: Path, rerun: str, timeout: float) -> None:
        self.args, self.out, self.rerun, self.timeout = args, out, rerun, timeout
        self.several = str(args.nnodes) not in ("1", "1:1")
        self.log: _Captured | None = None
        # Several nodes: a node that dies takes torchrun's store with it if it hosts it; the workers fail within
        # train.dist_timeout, and the launcher does not wait for an agent stuck on that store after them.
        grace = 5.0 + (timeout if int(args.max_restarts) > 0 else 0.0)  # a restart's rendezvous may take that long
        self.supervisor = _Supervisor(grace, self.stuck)

    def ours(self) -> bool:
        """Whether this node writes into the run directory: rank 0's does."""
        known = self.supervisor.writes_run_dir()
        return not self.several if known is None else known

    def lines(self) -> list[str]:
        return self.log.lines if self.log is not None else []

    def fail(self, failures: Mapping[int, Any], extra: list[str]) -> MtpipeError:
        report = None
        if (recorded_error(root_failure(failures)[1]) or {}).get("kind") != "mtpipe":
            header, _ = failure_summary(failures, self.out, self.rerun, report=None)
            report = write_report(self.out, [header, *self.lines(), *extra], in_run_dir=self.ours())
        line, code = failure_summary(failures, self.out, self.rerun, report=report)
        error = MtpipeError(line)
        error.exit_code = code  # type: ignore[attr-defined]
        return error

    def stuck(self, failures: dict[int, Any]) -> None:
        """The supervisor's thread: the agent hangs in a store call."""
        if not failures:
            sys.stderr.write("warning: torchrun's agent did not return after every worker finished (its store "
                             "does not answer); the run itself is complete\n")
            fail_now("launcher", "", 0, env={}, quiet=True)
        error = self.fail(failures, ["torchrun's agent did not return after its workers ended (its store does not "
                                     "answer): the launcher ended it"])
        fail_now("launcher", str(error), int(getattr(error, "exit_code", 1)), env={})

    def run(self) -> int:
        from torch.distributed import DistError
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous.api import RendezvousError
        from torch.distributed.run import run

        with _Captured(int(self.args.max_restarts), str(self.args.nproc_per_node)) as log:
            self.log = log
            if self.several:
                self.supervisor.start()
            try:
                run(self.args)
            except ChildFailedError as e:
                raise self.fail(e.failures, e.format_msg().splitlines()) from None
            except SignalException as e:
                raise self.signalled(e) from None
            except (RendezvousError, DistError, OSError) as e:
                raise self.agent_failed(e) from None
            finally:
                self.supervisor.stop()
            if log.failures:  # restarts that recovered: what torchrun said about them
                write_report(self.out, ["torchrun restarted the processes:", *log.lines], in_run_dir=self.ours())
        return 0

    def signalled(self, e: Any) -> BaseException:
        """torchrun's agent got a signal: SIGINT is the user's interrupt; another one ends training in one line."""
        import signal

        if e.sigval == signal.SIGINT:
            return KeyboardInterrupt()
        name = signal.Signals(e.sigval).name
        report = write_report(self.out, [f"training stopped by {name}", *self.lines()], in_run_dir=self.ours())
        where = f"; torchrun's log: {report}" if report is not None else ""
        error = MtpipeError(f"training stopped by {name}; last checkpoint: {last_checkpoint(self.out)}; to resume, "
                            f"run: {self.rerun}{where}")
        error.exit_code = 128 + int(e.sigval)  # type: ignore[attr-defined]
        return error

    def agent_failed(self, e: BaseException) -> MtpipeError:
        """The agent itself failed: the rendezvous (a node missing past train.dist_timeout, its store gone). What
        this node's workers recorded, if they failed first, says more."""
        from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

        failures = self.supervisor.failures()
        if any(recorded_error(f) is not None for f in failures.values()):
            return self.fail(failures, [f"torchrun's agent: {one_line(e)}"])
        cause = f" ({one_line(e.__cause__)})" if e.__cause__ is not None else ""
        where = f"torchrun's rendezvous at {self.args.rdzv_endpoint or 'this node'}"
        if isinstance(e, RendezvousTimeoutError):
            what = f"not every node joined {where} within train.dist_timeout = {self.timeout:g} s"
        elif isinstance(e, RendezvousClosedError):
            what = f"{where} was closed: another node's group failed (its own line says how)"
        else:
            what = (f"lost {where}: the node that hosts it ended (its group failed: its own line says how), "
                    "died or lost the network")
        what = f"training failed: {what} ({one_line(e)}{cause})"
        report = write_report(self.out, [what, *self.lines()], in_run_dir=self.ours())
        where = f"; torchrun's log: {report}" if report is not None else ""
        return MtpipeError(f"{what}; last checkpoint: {last_checkpoint(self.out)}; to resume, run: {self.rerun}{where}")
