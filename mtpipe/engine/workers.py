"""Decoding processes: a copy of the model in a process of its own, driven through a pipe.

Two users: ``mtpipe serve`` with ``serve.workers`` > 1 (each worker process decodes the requests its server thread
hands it, :class:`WorkerProcess` as one of the server's lanes) and ``mtpipe decode`` with ``decode.processes`` > 1
(:class:`DecodePool`: a file or split shared out among N processes, each decoding its own batches).

Why processes and not threads: the small matrix products of a decoding step (one new position per row, d_model
128-1,024) use several cores poorly when split, while separate batches use them fully, and torch's CPU thread pool
serves the process's main thread best (a decode driven from another thread is much slower). Each process is spawned
(a fresh interpreter: no fork of a process that already runs torch's threads), opens the model as ``mtpipe decode``
opens it (:func:`mtpipe.engine.opening.open_model`), decodes a few sentences to warm up, and then decodes what comes
down its pipe with ``decode.threads`` threads, or this process's CPUs split evenly.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from mtpipe import platform
from mtpipe.config import DecodeConfig
from mtpipe.engine.lanes import first_line
from mtpipe.engine.protocol import Lane, blank_results
from mtpipe.engine.search import DecodeRules, Hypothesis
from mtpipe.errors import MtpipeError


def _worker_main(conn: Any, index: int, cfg: DecodeConfig, checkpoint: str, tokens: str | None, batching: str,
                 beams: tuple[int, ...] = ()) -> None:
    """Worker process ``index``: on a machine with several GPUs, pick its own (:func:`worker_gpu`); open the model as
    the server does, warm it up (also at ``beams``: :meth:`mtpipe.engine.opening.OpenModel.warm_up`), then run a
    lane: lists of ``(key, sources, rules)`` in (what the server took at once; a ``(key,)`` alone cancels
    that key: its client has gone), lists of ``(key, result)`` out (what one poll of the lane finished; an exception
    travels as its one-line reason), until the server closes the pipe."""
    # The server drains and stops on SIGTERM / Ctrl-C (which a terminal sends to the whole process group): a worker
    # must go on decoding what the server still hands it, and ends when the server closes its pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from mtpipe.engine.opening import open_model

    continuous = batching == "continuous"
    try:
        gpu = worker_gpu(index, cfg)
        if gpu is not None:
            import torch

            torch.cuda.set_device(gpu)  # "cuda" below means this GPU in this process
        model = open_model(cfg, Path(checkpoint), Path(tokens) if tokens is not None else None)
        # decode's rules, checked by the process that started this one
        model.warm_up(DecodeRules.from_config(cfg), beams, continuous)
    except Exception as e:  # noqa: BLE001 - reported to the server, which stops with it
        with contextlib.suppress(OSError):
            conn.send(("error", first_line(e)))
        return
    try:
        conn.send(("ready", model.description()))
    except OSError:
        return
    _run_lane(conn, model.lane(continuous))


def _run_lane(conn: Any, lane: Lane) -> None:
    """Drive ``lane`` from the pipe (:func:`_worker_main`) until the other end closes it."""
    with lane.decoding():
        while True:
            try:
                # Between decoder steps take whatever arrived; with nothing to decode, wait for it.
                while conn.poll(0 if lane.busy() else None):
                    for request in conn.recv():
                        if len(request) == 1:
                            lane.cancel(request)
                        else:
                            lane.add(*request)
            except (EOFError, OSError):
                return
            done = lane.poll()
            if done:  # one message: the answers of a batch arrive together, as they were decoded
                try:
                    conn.send([(key, ("error", first_line(result)) if isinstance(result, Exception)
                                else ("ok", result)) for key, result in done])
                except OSError:  # the other end has gone (e.g. decode interrupted): nobody waits for these answers
                    return


class WorkerProcess:
    """One decoding process (spawned: a fresh interpreter, its model in its own main thread, ``cfg.threads`` CPU
    threads), as a :class:`~mtpipe.engine.protocol.Lane`: requests go down its pipe as they are taken and come back as they
    finish. Driven by one thread. A worker that dies (e.g. killed for memory) fails the requests it held; with
    ``restart`` (a server's) a new one is started (:meth:`revive`, which the server's thread calls as soon as it sees
    the death, or the next request). ``role`` names the setting in error messages; ``log`` takes one line for each
    death and restart (with the exit code). ``down`` (readable from any thread) is True from a death until the new
    process is ready; ``restarts`` counts the new processes started."""

    def __init__(self, index: int, cfg: DecodeConfig, checkpoint: Path, tokens: Path | None,
                 batching: str = "batch", beams: tuple[int, ...] = (), *, role: str = "serve.workers",
                 restart: bool = True, log: Callable[[str], None] | None = None) -> None:
        self.index = index
        self.role, self.restart, self.log = role, restart, log
        self.continuous = batching == "continuous"
        self._args = (cfg, str(checkpoint), str(tokens) if tokens is not None else None, batching, tuple(beams))
        self._held: set[int] = set()
        self._outbox: list[tuple[int, list[list[int]], Any]] = []  # sent at the next poll, as one message
        self.down, self.restarts = False, 0
        self._start()

    def _start(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # no fork of a process with torch's threads and uvicorn's loop
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_main, name=f"mtpipe-decode-{self.index}", daemon=True,
                                 args=(child, self.index, *self._args))
        self._proc.start()
        child.close()
        self._dead = False

    def ready(self) -> dict[str, Any]:
        """Wait until the model is loaded and warm: its :meth:`~mtpipe.engine.opening.OpenModel.description`; its
        start-up error as a :class:`MtpipeError`."""
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError):
            status, payload = "error", f"exited (code {self._proc.exitcode})"
        if status != "ready":
            raise MtpipeError(f"{self.role}: worker process {self.index} could not open the model ({payload})")
        return payload

    def exited(self) -> bool:
        """Whether the process has died, without a word (:meth:`dead` logs it)."""
        return self._dead or not self._proc.is_alive()

    def dead(self) -> bool:
        """Whether the process has died; the first time, its death is logged with its exit code and :attr:`down`
        set. The server's thread asks before it takes work (:meth:`exited`, which says nothing, while it waits)."""
        if not self._dead and not self._proc.is_alive():
            self._dead = True
        if self._dead and not self.down:
            self.down = True
            self._proc.join(5)
            if self.log is not None:
                self.log(f"{self.role}: decoding worker process {self.index} (pid {self._proc.pid}) exited (code "
                         f"{self._proc.exitcode})" + ("; restarting it" if self.restart else ""))
        return self._dead

    def revive(self) -> None:
        """Start a new process in place of a dead one and wait until it is warm (one line in the log); a failed
        start raises :class:`MtpipeError` and leaves the worker dead."""
        import time

        self.dead()  # its death logged first
        self._conn.close()
        start = time.monotonic()
        self._start()
        try:
            self.ready()
        except MtpipeError as e:
            self._dead = True
            if self.log is not None:
                self.log(str(e))
            raise
        self.down = False
        self.restarts += 1
        if self.log is not None:
            self.log(f"{self.role}: decoding worker process {self.index} restarted (pid {self._proc.pid}), ready in "
                     f"{time.monotonic() - start:.1f} s")

    def add(self, key: int, sources: list[list[int]], rules: Any) -> None:
        self._held.add(key)
        if self._dead:
            try:
                self.revive()
            except MtpipeError:  # logged; the next poll fails the request, as the dead process's others
                return
        self._outbox.append((key, [list(s) for s in sources], rules))

    def busy(self) -> bool:
        return bool(self._held)

    def cancel(self, keys: Sequence[int]) -> None:
        """Forget ``keys`` (their clients have gone): the worker process drops what it has not decoded of them,
        at its next look at the pipe (between decoder steps, or after the batch in hand)."""
        keys = [k for k in keys if k in self._held]
        self._held.difference_update(keys)
        self._outbox = [item for item in self._outbox if item[0] not in keys]
        if keys and not self._dead:
            self._outbox += [(k,) for k in keys]  # sent with the next poll's message  # type: ignore[misc]

    def decoding(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the worker process enters its lane's own

    def poll(self) -> list[tuple[int, Any]]:
        finished: list[tuple[int, Any]] = []
        if self._outbox and not self._dead:
            try:
                self._conn.send(self._outbox)  # one message: a batch arrives whole
            except OSError:
                self._dead = True  # below: fail what it held
            self._outbox = []
        try:
            # Continuous: a short wait, since this thread also hands the worker new requests; batch by batch it
            # takes none while the worker decodes, so it sleeps until the answers come.
            if not self._dead and self._conn.poll(0.002 if self.continuous else 0.5):
                while True:
                    for key, (status, payload) in self._conn.recv():
                        if key not in self._held:  # cancelled meanwhile: nobody waits for it
                            continue
                        self._held.discard(key)
                        finished.append((key, payload if status == "ok" else RuntimeError(payload)))
                    if not self._conn.poll(0):
                        break
        except (EOFError, OSError):
            self._dead = True
        if self._dead and self._held:
            self.dead()  # logged
            error = RuntimeError(f"worker process {self.index} exited (code {self._proc.exitcode})"
                                 + ("; it is restarted for the next request" if self.restart else ""))
            finished += [(key, error) for key in self._held]
            self._held.clear()
            self._outbox = []
        return finished

    def close(self, wait: float = 30) -> None:
        """Close the pipe (the worker then exits once its work in hand is done) and wait up to ``wait`` seconds for
        the process, then end it (0: at once, e.g. when the command was interrupted). A worker ignores SIGTERM
        (see :func:`_worker_main`): one still alive after that is killed, else the interpreter's exit would wait
        for it."""
        self._conn.close()
        self._proc.join(wait)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(min(wait, 5))
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


def worker_gpu(index: int, cfg: DecodeConfig) -> int | None:
    """The GPU that worker process ``index`` decodes on when ``decode.device`` lets it use one and the machine has
    several: worker i on GPU i mod count, so N processes on N GPUs decode side by side; None (torch's current device,
    or the CPU) otherwise. Only asks torch when a GPU may be used, so that CPU workers never initialise CUDA."""
    if not platform.may_decode_on_gpu(cfg.device, cfg.precision):  # e.g. int8, which runs on the CPU only
        return None
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return index % count if count > 1 else None


def worker_threads(cfg: DecodeConfig, workers: int) -> int:
    """CPU threads per worker process: ``decode.threads`` when set, else this process's CPUs split evenly
    (:func:`mtpipe.platform.threads_per_process`)."""
    return platform.threads_per_process(cfg.threads, workers)


# --------------------------------------------------------------------------------------------------------------------
# decode.processes > 1: a file or split shared out among decoding processes
# --------------------------------------------------------------------------------------------------------------------


def deal(lengths: Sequence[int], max_tokens: int, processes: int) -> list[list[int]]:
    """Indices of ``lengths`` (source tokens, EOS included) in shares for ``processes`` processes, the longest
    first. The sentences, sorted by length, are grouped ``processes`` batches at a time (as many sentences as
    ``processes`` batches of ``max_tokens`` padded tokens hold at the group's longest length), and each group is
    dealt round-robin: a share is one batch of at most ``max_tokens`` padded tokens (a sentence longer than that
    alone), the shares of a group have the same lengths and take about the same time, so every process is busy
    until the end."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    shares: list[list[int]] = []
    pos = 0
    while pos < len(order):
        per_share = max(1, max_tokens // lengths[order[pos]])  # sentences of this width in one batch
        group = order[pos : pos + processes * per_share]
        pos += len(group)
        shares += [part for part in (group[k::processes] for k in range(processes)) if part]
    return shares


class DecodePool:
    """``decode.processes`` > 1: an :class:`~mtpipe.engine.protocol.Engine` whose translations are made by N
    :class:`WorkerProcess` es, each with its own copy of the model (the engine ``decode.engine`` names: mtpipe's or
    CTranslate2's) and ``threads`` CPU threads. The sources are dealt out in shares of about one batch each
    (:func:`deal`); one thread per process hands it the next share as soon as it returns one, so a slower process
    takes fewer. Each sentence is decoded as ``mtpipe decode`` in one process decodes it: beam search is per sentence
    and a batch's padding is masked.

    The processes start, load the model and warm up in the constructor (outside the timed decoding, as
    ``decode.compile``'s build is); :meth:`close` ends them."""

    def __init__(self, cfg: DecodeConfig, checkpoint: Path, tokens: Path | None, processes: int) -> None:
        self.processes, self.threads = processes, worker_threads(cfg, processes)
        self.max_tokens = cfg.max_tokens
        self.procs: list[WorkerProcess] = []
        try:
            worker_cfg = dataclasses.replace(cfg, threads=self.threads)
            for i in range(processes):  # started together: they load and warm up side by side
                self.procs.append(WorkerProcess(i, worker_cfg, checkpoint, tokens, role="decode.processes",
                                                restart=False))
            description = [w.ready() for w in self.procs][0]
        except BaseException:
            self.close(wait=0)
            raise
        self.info: dict[str, Any] = description["info"]
        self.max_positions = int(description["max_positions"])
        self.compiled = False  # the processes built their compiled steps when they warmed up

    def describe(self) -> str:
        return f"{self.info['device']}, {self.processes} processes x {self.threads} thread(s)"

    def settings(self, rules: Any) -> str:
        return str(self.info["search"])  # the processes' engine's own words, under decode's rules (as these are)

    def note(self, rules: Any) -> str | None:
        return self.info.get("note")

    def facts(self, rules: Any) -> dict[str, Any]:
        return {**self.info, "device": self.describe()}

    def lane(self, continuous: bool = False) -> Lane:
        raise MtpipeError("decode.processes: a pool shares out whole files; a server's lanes are serve.workers")

    def warm_up(self, groups: Sequence[list[list[int]]], rules: Any, beams: Sequence[int] = (),
                continuous: bool = False) -> float:
        """Nothing to do: each process warmed up when it started (outside the timed decoding)."""
        return 0.0

    def translate(self, sources: Sequence[Sequence[int]], rules: Any,
                  on_done: Callable[[int], None] | None = None) -> list[list[Hypothesis]]:
        results, todo = blank_results(sources, on_done)
        shares = collections.deque([todo[j] for j in share]
                                   for share in deal([len(sources[i]) + 1 for i in todo], self.max_tokens,
                                                     len(self.procs)))
        lock = threading.Lock()
        errors: list[str] = []

        def drive(w: WorkerProcess) -> None:
            for key in itertools.count():
                with lock:
                    if errors or not shares:
                        return
                    share = shares.popleft()
                w.add(key, [list(sources[i]) for i in share], rules)
                done: list[tuple[int, Any]] = []
                while not done:
                    done = w.poll()
                result = done[0][1]
                if isinstance(result, Exception):
                    with lock:
                        errors.append(f"worker process {w.index}: {result}" if "worker process" not in str(result)
                                      else str(result))
                    return
                for i, hyps in zip(share, result):
                    results[i] = hyps
                if on_done is not None:
                    with lock:
                        on_done(len(share))

        drivers = [threading.Thread(target=drive, args=(w,), name=f"mtpipe-pool-{w.index}", daemon=True)
                   for w in self.procs]
        for t in drivers:
            t.start()
        for t in drivers:
            t.join()
        if errors:
            raise MtpipeError(f"decode.processes: {errors[0]}")
        return results

    def close(self, wait: float = 30) -> None:
        """End the processes (``wait`` 0: at once)."""
        for w in self.procs:
            w.close(wait)
        self.procs = []


__all__ = ["DecodePool", "WorkerProcess", "deal", "first_line", "worker_gpu", "worker_threads"]
