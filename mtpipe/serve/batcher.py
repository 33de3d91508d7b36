"""Dynamic batching: the queue of requests, and the workers that feed their lanes from it (:class:`Batcher`).

The event loop only parses, encodes and queues a request; a worker takes requests from the queue into its lane
(:class:`mtpipe.engine.protocol.Lane`), which runs the model. An idle worker takes the oldest waiting request, waits
until it has waited ``serve.batch_wait_ms`` (counted from the later of its arrival and the end of the worker's last
work), or until the waiting requests fill ``serve.batch_tokens`` source tokens, and takes every waiting request that
fits the budget, oldest first. Then, by ``serve.batching``:

* ``batch`` (:class:`mtpipe.engine.lanes.BatchLane`): the requests are decoded to the end as one batch, a group per
  distinct settings (one call of the engine, itself split into ``decode.max_tokens`` batches sorted by length), the
  group of least work first, each answered when it ends; the worker takes no more until it is done.
* ``continuous`` (:class:`mtpipe.engine.lanes.StreamLane`, mtpipe's engine): a busy worker goes on taking waiting
  requests (while it holds fewer tokens than the budget, and no more than the least busy other worker), whose
  sentences join its running beam search at the next decoder step; a request is answered the step its last sentence
  ends.

Fair scheduling: a worker takes a request a chunk at a time, about ``serve.chunk_work`` of work (source tokens x
beam) and at least one sentence, the least served waiting request first, one chunk of a request at a time (two in a
continuous lane); the request is answered when its last chunk is. A large request and a one-sentence one sent after
it take turns, so the short one waits for a chunk, not for the large one, in both batching modes and with any number
of workers. A request whose client goes away before its answer is cancelled: its chunks not yet taken leave the
queue, and a lane drops what it holds of it at its next step (a continuous lane lets the sentences already in its
search end). At most ``serve.max_queue`` requests wait (being gathered counts as waiting); one more is refused
(:class:`QueueFull`). A worker whose decoding process died (``serve.workers`` > 1) starts a new one before it takes
more work, also while it is idle (:meth:`mtpipe.engine.workers.WorkerProcess.revive`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mtpipe.engine.lanes import first_line
from mtpipe.engine.protocol import Lane


class QueueFull(Exception):
    """``serve.max_queue`` requests are already waiting (or the server is shutting down)."""


class ServerStopping(Exception):
    """The server stopped before the request was decoded (``serve.drain_s`` after SIGTERM, or a second signal)."""


@dataclass(eq=False)  # a job is itself: compared and hashed by identity
class Job:
    """One request in the queue: its sources (token ids, no EOS), rules, and the future its answer goes to. Workers
    take it a chunk (:class:`Piece`) at a time; it is answered when its last chunk is decoded."""

    sources: list[list[int]]
    rules: Any  # mtpipe.engine.search.DecodeRules: requests with equal rules are decoded together
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    queued_at: float
    tokens: int = 0  # source tokens with their EOS, as the encoder sees them: the job's share of a batch's budget
    beam: int = 1
    work: int = 0  # tokens x beam: what serve.max_request_work and serve.chunk_work count
    started_at: float = 0.0  # when a worker took its first chunk
    together: tuple[int, int] = (0, 0)  # the most requests / sentences decoding with it (itself included)
    taken: int = 0  # sentences handed to workers so far (always a prefix of the sources)
    left: int = 0  # source tokens not yet handed to a worker
    served: int = 0  # work handed to workers so far: the least served waiting job goes next
    decoded: int = 0  # sentences decoded
    results: list[Any] = field(default_factory=list)  # per sentence its hypotheses (None until decoded)
    in_lanes: dict[int, int] = field(default_factory=dict)  # worker -> chunks of this job in that worker's lane
    done: bool = False  # answered, failed, cancelled or abandoned: its chunks not yet decoded are dropped

    def __post_init__(self) -> None:
        self.beam = getattr(self.rules, "beam", 1)  # (a test's rules may be a bare label: one hypothesis)
        self.tokens = self.left = sum(len(s) + 1 for s in self.sources)
        self.work = self.tokens * self.beam
        self.results = [None] * len(self.sources)

    def next_chunk(self, most_work: int | None) -> tuple[int, int]:
        """``(end, tokens)`` of the chunk that starts at the first sentence not yet taken: sentences while their work
        stays within ``most_work`` (None: all), at least one."""
        end, tokens = self.taken, 0
        while end < len(self.sources):
            size = len(self.sources[end]) + 1
            if end > self.taken and most_work is not None and (tokens + size) * self.beam > most_work:
                break
            end, tokens = end + 1, tokens + size
        return end, tokens


@dataclass(eq=False)
class Piece:
    """Sentences ``start:end`` of a job, handed to a worker's lane as one request of its own."""

    job: Job
    start: int
    end: int
    tokens: int


@dataclass
class Answer:
    """A job's result: per sentence its n-best ``(text, score)`` list, best first, and how it was decoded."""

    hypotheses: list[list[tuple[str, float]]]
    batch: dict[str, Any]
    lengths: list[int] = field(default_factory=list)  # per sentence the best hypothesis's tokens (no EOS)


class Batcher:
    """Requests in, answers out: the queue, and the workers that take requests from it into their :class:`Lane`
    (:meth:`submit` from the event loop; see the module docstring for how requests are gathered).

    Fair scheduling: a worker takes a request a chunk at a time (at most ``chunk_work`` of work, at least one
    sentence), the least served waiting request first, and no more than one chunk of a request at once (two in a
    continuous lane, so that the next is ready when one ends): a request of a thousand sentences and one of a single
    sentence take turns, and the short one waits for a chunk, not for the large one. ``chunk_work`` None: a request
    is one chunk. ``on_batch(requests, sentences)``: told what a lane holds each time it takes requests."""

    REVIVE_EVERY_S = 5.0  # a decoding process that could not be restarted is tried again this much later

    def __init__(self, detok: Callable[[list[list[int]]], list[str]], *, max_queue: int, wait_s: float,
                 batch_tokens: int, chunk_work: int | None = None,
                 on_batch: Callable[[int, int], None] | None = None) -> None:
        self._detok = detok
        self.on_batch = on_batch
        self.max_queue, self.wait_s, self.batch_tokens, self.chunk_work = max_queue, wait_s, batch_tokens, chunk_work
        self._jobs: list[Job] = []  # jobs with sentences not yet taken, in arrival order (at most max_queue)
        self._live: set[Job] = set()  # jobs not yet done: queued, or decoding in a lane
        self._cond = threading.Condition()
        self._closing = False
        self._abandoned = False  # stop now: the jobs left were answered ServerStopping
        self._done = threading.Event()  # set when the last :meth:`run` returns
        self._running = 0  # :meth:`run` loops not yet returned (one per worker)
        self._keys = itertools.count(1)  # request keys for the lanes (next() is atomic: workers share it)
        self._held: dict[int, int] = {}  # worker -> source tokens it is decoding (under the lock)
        self.counters = {"requests": 0, "sentences": 0, "max_requests_together": 0, "rejected_queue_full": 0,
                         "failed": 0, "cancelled": 0, "dropped_sentences": 0, "abandoned": 0}

    # ---- the event loop's side

    def start(self, lane: Lane, worker: int = 0) -> None:
        """:meth:`run` in a thread of its own (the server runs worker 0 in the main thread instead: see
        :func:`mtpipe.serve.app.serve_model`)."""
        self._enter()
        threading.Thread(target=self._loop, args=(lane, worker), name=f"mtpipe-decode-{worker}", daemon=True).start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; :class:`QueueFull` when ``max_queue`` requests wait already or the server is stopping."""
        with self._cond:
            if self._closing or len(self._jobs) >= self.max_queue:
                self.counters["rejected_queue_full"] += 1
                raise QueueFull
            self._jobs.append(job)
            self._live.add(job)
            self._cond.notify()

    def cancel(self, job: Job) -> int:
        """Drop ``job``, whose client has gone: its chunks not yet taken leave the queue, the workers drop those
        they hold at their next step. The number of its sentences no worker had started (0: it was done)."""
        with self._cond:
            if job.done:
                return 0
            self._retire(job)
            dropped = len(job.sources) - job.taken
            self.counters["cancelled"] += 1
            self.counters["dropped_sentences"] += dropped
            return dropped

    def close(self) -> None:
        """No new jobs; the workers decode the queued ones without waiting for more, then stop."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def abandon(self) -> int:
        """Stop now (``serve.drain_s`` after SIGTERM): every job not yet answered is answered
        :class:`ServerStopping`, and the workers return after the step or chunk in hand. The number of jobs."""
        with self._cond:
            self._closing = self._abandoned = True
            jobs = list(self._live)
            for job in jobs:
                self._retire(job)
            self.counters["abandoned"] += len(jobs)
            self._cond.notify_all()
        for job in jobs:
            _settle(job, ServerStopping("the server stopped before this request was decoded (serve.drain_s after "
                                        "SIGTERM); retry on another server"))
        return len(jobs)

    def join(self, timeout: float | None = None) -> None:
        """Wait until every :meth:`run` has returned (after :meth:`close` and the queue drained), in whatever
        thread."""
        self._done.wait(timeout)

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            return {**self.counters, "queued": len(self._jobs)}

    # ---- the workers' side

    def _retire(self, job: Job) -> None:
        """``job`` is done (under the lock): out of the queue, its chunks not yet taken dropped."""
        job.done = True
        self._live.discard(job)
        with contextlib.suppress(ValueError):
            self._jobs.remove(job)

    def _cut(self, job: Job, worker: int, end: int, tokens: int, now: float) -> Piece:
        """Hand ``worker`` the next chunk of ``job`` (under the lock)."""
        piece = Piece(job, job.taken, end, tokens)
        job.taken, job.left, job.served = end, job.left - tokens, job.served + tokens * job.beam
        job.in_lanes[worker] = job.in_lanes.get(worker, 0) + 1
        job.started_at = job.started_at or now
        if job.taken == len(job.sources):
            self._jobs.remove(job)
        return piece

    def _pieces(self, worker: int, per_job: int, fits: Callable[[int, int, bool], bool]) -> list[Piece]:
        """Chunks for ``worker`` (under the lock), the least served waiting job first (ties: the oldest), no more
        than ``per_job`` of a job in the worker's lane, while ``fits(tokens so far, the next chunk's tokens, whether
        any was taken)``."""
        taken: list[Piece] = []
        tokens, now = 0, time.monotonic()
        while True:
            ready = [j for j in self._jobs if j.in_lanes.get(worker, 0) < per_job]
            if not ready:
                return taken
            job = min(ready, key=lambda j: j.served)  # the first of the least served: the oldest
            end, size = job.next_chunk(self.chunk_work)
            if not fits(tokens, size, bool(taken)):
                return taken
            taken.append(self._cut(job, worker, end, size, now))
            tokens += size

    def _take(self, worker: int, held: int, last_end: float, continuous: bool = True,
              exited: Callable[[], bool] | None = None) -> list[Piece] | None:
        """Chunks of requests for ``worker``'s lane, which decodes ``held`` source tokens. An idle lane waits for a
        request, then until the oldest has waited ``wait_s`` (from the later of its arrival and ``last_end``, the end
        of the lane's last work) or the waiting requests fill ``batch_tokens``, and takes at least one chunk, and no
        more than its share of what waits when other lanes are idle too; a busy lane takes, without waiting, the
        chunks that fit, while it holds no more than the least busy of the other lanes (so that with several workers
        the load is shared, not taken by whichever asks first). None once closed and drained, or abandoned. A lane
        that is not ``continuous`` takes nothing while it is busy. An idle lane whose ``exited()`` turns true (its
        decoding process died) gets nothing at once, so that its worker restarts it."""
        room = self.batch_tokens - held
        per_job = 2 if continuous else 1
        with self._cond:
            self._held[worker] = held
            if self._abandoned:
                return None
            if held:
                if not continuous:
                    return []
                others = [t for w, t in self._held.items() if w != worker]
                fair = min(others) if others else self.batch_tokens
                taken = self._pieces(worker, per_job, lambda tokens, size, _: tokens + size <= room
                                     and held + tokens <= fair)
                self._held[worker] = held + sum(p.tokens for p in taken)
                return taken
            while not self._jobs:
                if self._closing:
                    return None
                if exited is not None and exited():
                    return []
                self._cond.wait(0.5)  # in slices: in the main thread, signal handlers run between them
            # Under closed-loop load the clients just answered send their next requests within a millisecond or
            # two: without waiting from the end of the last work, the requests that queued meanwhile would leave at
            # once, alone.
            deadline = max(self._jobs[0].queued_at, last_end) + self.wait_s
            while not self._closing and self._jobs and sum(j.left for j in self._jobs) < room:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._abandoned:
                return None
            # Idle lanes share what is waiting: each takes its part of it, so that after a burst (closed-loop
            # clients answered together send again together) every worker decodes at once rather than one taking
            # the whole burst while the others wait for the next one.
            idle = 1 + sum(1 for w, t in self._held.items() if w != worker and t == 0)
            share = min(room, -(-sum(j.left for j in self._jobs) // idle))
            taken = self._pieces(worker, per_job, lambda tokens, size, some: not some or tokens + size <= share)
            self._held[worker] = sum(p.tokens for p in taken)
            return taken

    def run(self, lane: Lane, worker: int = 0) -> None:
        """A worker: feed ``lane`` requests and answer them as they finish, until closed and drained. Several
        workers may run at once, each in its own thread with its own lane."""
        self._enter()
        self._loop(lane, worker)

    def _enter(self) -> None:
        with self._cond:
            self._running += 1
            self._done.clear()

    def _loop(self, lane: Lane, worker: int) -> None:
        try:
            with lane.decoding():
                self._serve(lane, worker)
        finally:
            with self._cond:
                self._running -= 1
                if self._running == 0:
                    self._done.set()

    def _tend(self, lane: Lane) -> bool:
        """A lane whose decoding process died restarted (:meth:`mtpipe.engine.workers.WorkerProcess.revive`); False
        while it cannot be (tried again :data:`REVIVE_EVERY_S` later; its log says why). Other lanes: True."""
        dead = getattr(lane, "dead", None)
        if dead is None or self._closing or not dead():  # closing: a lane given work restarts when it is added
            return True
        try:
            lane.revive()  # type: ignore[attr-defined]
            return True
        except Exception:  # noqa: BLE001 - logged by the lane; the other workers serve meanwhile
            with self._cond:
                if not self._closing:
                    self._cond.wait(self.REVIVE_EVERY_S)
            return False

    def _serve(self, lane: Lane, worker: int) -> None:
        held: dict[int, Piece] = {}  # lane key -> the chunk it decodes
        last_end = 0.0
        exited = getattr(lane, "exited", None)  # a decoding process's: whether it died
        while True:
            if not held and not self._tend(lane):
                if self._closing:
                    return
                continue
            gone = [key for key, piece in held.items() if piece.job.done]  # cancelled, failed or abandoned
            if gone:
                with self._cond:
                    for key in gone:
                        held.pop(key).job.in_lanes[worker] -= 1
                lane.cancel(gone)
            pieces = self._take(worker, sum(p.tokens for p in held.values()), last_end, lane.continuous, exited)
            if pieces is None:
                return
            for piece in pieces:
                key = next(self._keys)
                held[key] = piece
                lane.add(key, piece.job.sources[piece.start : piece.end], piece.job.rules)
            if pieces:
                jobs = {id(p.job): p.job for p in held.values()}
                together = (len(jobs), sum(p.end - p.start for p in held.values()))
                for job in jobs.values():
                    job.together = (max(job.together[0], together[0]), max(job.together[1], together[1]))
                with self._cond:
                    self.counters["max_requests_together"] = max(self.counters["max_requests_together"], len(jobs))
                if self.on_batch is not None:
                    self.on_batch(*together)
            for key, result in lane.poll():
                piece = held.pop(key, None)
                if piece is not None:  # else cancelled meanwhile
                    self._finish(piece, result, worker)
            if not held:
                last_end = time.monotonic()

    def _finish(self, piece: Piece, result: Any, worker: int) -> None:
        """A chunk is decoded (``result``: its sentences' hypotheses, or an exception): the job is answered once its
        last chunk is; a failed chunk fails the job (its other chunks are dropped)."""
        job = piece.job
        with self._cond:
            job.in_lanes[worker] -= 1
            if job.done:
                return
            if isinstance(result, Exception):
                self._retire(job)
                self.counters["failed"] += 1
            else:
                job.results[piece.start : piece.end] = result
                job.decoded += piece.end - piece.start
                if job.decoded < len(job.sources):
                    return
                self._retire(job)
        if isinstance(result, Exception):
            _settle(job, result)
        else:
            self._answer(job, worker)

    def _answer(self, job: Job, worker: int) -> None:
        """Send ``job`` its answer: the texts of its sentences' hypotheses, or an error."""
        result: Any = job.results
        try:
            texts = self._detok([h.tokens for hyps in result for h in hyps])
        except Exception as e:  # noqa: BLE001 - answered (500), the server goes on
            with self._cond:
                self.counters["failed"] += 1
            _settle(job, RuntimeError(f"decoding failed: {first_line(e)}"))
            return
        hypotheses, pos = [], 0
        for hyps in result:
            hypotheses.append([(texts[pos + k], float(h.score)) for k, h in enumerate(hyps)])
            pos += len(hyps)
        now = time.monotonic()
        batch = {"worker": worker, "requests": job.together[0], "sentences": job.together[1],
                 "queue_ms": round(1000 * (job.started_at - job.queued_at), 2),
                 "decode_ms": round(1000 * (now - job.started_at), 2)}
        with self._cond:
            self.counters["requests"] += 1
            self.counters["sentences"] += len(job.sources)
        _settle(job, Answer(hypotheses, batch, [len(hyps[0].tokens) for hyps in result]))


def _settle(job: Job, result: Answer | Exception) -> None:
    """Hand ``result`` to the job's future on its event loop (from the worker thread)."""

    def settle() -> None:
        if job.future.done():  # the client went away and its handler was cancelled
            return
        if isinstance(result, Exception):
            job.future.set_exception(result)
        else:
            job.future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
        job.loop.call_soon_threadsafe(settle)


__all__ = ["Answer", "Batcher", "Job", "Piece", "QueueFull", "ServerStopping"]
