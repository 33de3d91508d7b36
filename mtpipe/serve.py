"""``mtpipe serve``: translations over HTTP, concurrent requests decoded together in dynamic batches.

Endpoints (FastAPI on uvicorn, ``pip install 'mtpipe[serve]'``):

* ``POST /translate`` ``{"text": ["...", ...], "beam": 4, "alpha": 0.6, "nbest": 1}`` (beam, alpha and nbest
  optional: ``decode``'s values by default, within ``serve.max_beam`` / ``max_alpha`` / ``max_nbest``) answers
  ``{"translations": [...], "scores": [...], "model": <manifest hash of the checkpoint>, "batch": {...}}`` (with
  ``nbest`` / ``nbest_scores`` lists when nbest > 1). ``batch`` says how many requests and sentences shared the
  decoding batch, and how long the request waited for it and took in it.
* ``GET /health``: ``{"status": "ok", ...}``; ``GET /info``: the model, the engine, the settings, the counters.

The search is :func:`mtpipe.search.beam_search` under the ``decode`` section's rules (paper section 6.1), through the
same engines as ``mtpipe decode`` (:class:`mtpipe.decode.MtpipeEngine`, or :class:`mtpipe.engine_ct2.Ct2Engine` with
``decode.engine=ctranslate2``). Text is cleaned as ``mtpipe decode --input`` cleans a line (NFC, stripped) and
detokenised the same way, so a sentence translates exactly as ``mtpipe decode`` translates it: beam search is per
sentence, and the padding of a mixed batch is masked (the tests compare with ``mtpipe decode``).

Dynamic batching (:class:`Batcher`): the event loop only parses, encodes and queues a request; a worker runs the
model, in the process's main thread while uvicorn's event loop runs in a second one: torch's CPU thread pool
(OpenMP) parallelises the small operations of a decoding step well only from the main thread (from any other thread
a 2-thread decode of 8 sentences ran 3x slower on a 2-core CPU). With ``serve.workers`` N > 1, N worker processes
(:class:`WorkerProcess`) each run a copy of the model in their own main thread with 1/N of the CPU threads, and each
takes its own batches: a server's batches are small, and the small matrix products of a few sentences use several
cores poorly, where separate batches use them fully. A worker takes the oldest waiting request,
waits until it has waited ``serve.batch_wait_ms`` (counted from the later of its arrival and the end of the last
batch), or until the waiting requests fill ``serve.batch_tokens`` source tokens, and takes every waiting request
that fits the budget, oldest first. Requests that asked for the same settings are decoded as one group (one call of
the engine, itself split into ``decode.max_tokens`` batches sorted by length); each group's answers go back to the
event loop as soon as that group is done. At most ``serve.max_queue`` requests wait (being gathered counts as
waiting); one more gets 503 with Retry-After. Bad input gets a 4xx and one line of JSON ``{"error": "..."}``: 400 for
a body that is not UTF-8 JSON, 413 for too many sentences or characters, 422 for valid JSON with wrong fields or
values.

SIGTERM (or Ctrl-C): uvicorn stops accepting connections and waits for the requests in flight (the worker goes on
decoding them); the worker then decodes whatever is still queued and stops; the process exits 0.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import signal
import socket
import sys
import threading
import time
import typing
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from mtpipe.config import DecodeConfig, ServeConfig, to_dict
from mtpipe.errors import MtpipeError

REQUEST_FIELDS = ("text", "beam", "alpha", "nbest")
RETRY_AFTER_S = 1  # a full queue drains within a batch or two: ask clients to come back after a second


# --------------------------------------------------------------------------------------------------------------------
# Requests: parsing and checking (no model needed)
# --------------------------------------------------------------------------------------------------------------------


class RequestError(Exception):
    """A bad request: the HTTP ``status`` and a one-line ``reason`` (answered as ``{"error": reason}``)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class TranslateRequest:
    """A checked ``POST /translate`` body: sentences cleaned as ``mtpipe decode --input`` cleans lines."""

    sentences: list[str]
    beam: int
    alpha: float
    nbest: int


def max_body_bytes(cfg: ServeConfig) -> int:
    """The largest body a valid request can need: every sentence at ``max_chars`` characters written as JSON escapes
    (12 bytes for a character outside the BMP, a surrogate pair), plus quotes, commas and the other fields."""
    return cfg.max_sentences * (12 * cfg.max_chars + 4) + 4096


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _int_field(data: dict[str, Any], key: str, default: int, limit: int, limit_name: str) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(422, f"{key}: must be an integer, got {json.dumps(value)}")
    if value < 1:
        raise RequestError(422, f"{key}: {value} must be >= 1")
    if value > limit:
        raise RequestError(422, f"{key}: {value} is over the server's limit ({limit_name} = {limit})")
    return value


def parse_request(body: bytes, cfg: ServeConfig, defaults: DecodeConfig) -> TranslateRequest:
    """The sentences and settings of a ``/translate`` body, or :class:`RequestError` naming the first problem."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"body: not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise RequestError(400, f"body: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:  # NaN / Infinity
        raise RequestError(400, f"body: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise RequestError(422, 'body: must be a JSON object such as {"text": ["A sentence."]}')
    unknown = [k for k in data if k not in REQUEST_FIELDS]
    if unknown:
        raise RequestError(422, f"unknown field '{unknown[0]}' (known: {', '.join(REQUEST_FIELDS)})")
    if "text" not in data:
        raise RequestError(422, "text: missing (a list of sentences to translate)")
    items = data["text"]
    if not isinstance(items, list):
        raise RequestError(422, f"text: must be a list of strings, got {type(items).__name__}")
    if not items:
        raise RequestError(422, "text: empty list (nothing to translate)")
    if len(items) > cfg.max_sentences:
        raise RequestError(413, f"text: {len(items)} sentences, more than the server's limit (serve.max_sentences "
                                f"= {cfg.max_sentences})")
    sentences = []
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise RequestError(422, f"text[{i}]: must be a string, got {json.dumps(item)[:40]}")
        if len(item) > cfg.max_chars:
            raise RequestError(413, f"text[{i}]: {len(item)} characters, more than the server's limit "
                                    f"(serve.max_chars = {cfg.max_chars})")
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate escape such as "\ud800"
            raise RequestError(422, f"text[{i}]: not valid Unicode (a lone surrogate)") from None
        sentence = unicodedata.normalize("NFC", item).strip()  # as mtpipe decode --input cleans a line
        if not sentence:
            raise RequestError(422, f"text[{i}]: empty or whitespace only")
        sentences.append(sentence)

    beam = _int_field(data, "beam", defaults.beam, cfg.max_beam, "serve.max_beam")
    # decode.nbest is the default, but never above the beam this request asked for.
    nbest = _int_field(data, "nbest", min(defaults.nbest, beam), cfg.max_nbest, "serve.max_nbest")
    if nbest > beam:
        raise RequestError(422, f"nbest: {nbest} is more than beam ({beam})")
    alpha = data.get("alpha", defaults.alpha)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise RequestError(422, f"alpha: must be a number, got {json.dumps(alpha)}")
    if not 0 <= alpha <= cfg.max_alpha:
        raise RequestError(422, f"alpha: {alpha} must be between 0 and the server's limit (serve.max_alpha = "
                                f"{cfg.max_alpha:g})")
    return TranslateRequest(sentences, beam, float(alpha), nbest)


def check_defaults(cfg: ServeConfig, defaults: DecodeConfig) -> None:
    """The decode section's values are the requests' defaults: they must lie within the server's limits."""
    for key, value, limit in (("beam", defaults.beam, cfg.max_beam), ("nbest", defaults.nbest, cfg.max_nbest),
                              ("alpha", defaults.alpha, cfg.max_alpha)):
        if value > limit:
            raise MtpipeError(f"decode.{key} = {value:g} is over serve.max_{key} = {limit:g}: the default a request "
                              "gets must be one it may ask for")


# --------------------------------------------------------------------------------------------------------------------
# The model: the engines of mtpipe decode, opened once
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class ServedModel:
    """What the server decodes with: ``translate(sources, rules)`` (token ids without EOS -> each source's n-best
    :class:`~mtpipe.search.Hypothesis` list) and the SentencePiece model, plus what ``/info`` shows."""

    translate: Callable[[Sequence[Sequence[int]], Any], list[list[Any]]]
    sp: Any  # sentencepiece.SentencePieceProcessor
    max_positions: int
    info: dict[str, Any]

    def detok(self, tokens: list[list[int]]) -> list[str]:
        """Pieces -> text as ``mtpipe decode`` writes it: one line per hypothesis whatever the model emits."""
        return [s.replace("\r", " ").replace("\n", " ") for s in self.sp.decode(tokens)]


def open_model(cfg: DecodeConfig, checkpoint: Path, tokens: Path | None) -> ServedModel:
    """The checkpoint (or, with ``decode.engine=ctranslate2``, also a CTranslate2 export) and its vocabulary (that of
    ``tokens``, None: the model's own), checked and opened as ``mtpipe decode`` opens them
    (:func:`mtpipe.decode.open_model`)."""
    from mtpipe import artifacts

    checkpoint = Path(checkpoint)
    tokens = Path(tokens) if tokens is not None else None
    info: dict[str, Any] = {"checkpoint": str(checkpoint), "model": artifacts.manifest_hash(checkpoint)
                            if (checkpoint / artifacts.MANIFEST).is_file() else None}
    if cfg.engine == "ctranslate2":
        from mtpipe import engine_ct2

        manifest = engine_ct2.decode_source(checkpoint)
        sp, step, tokens = engine_ct2.source_vocab(checkpoint, manifest, tokens)
        engine: Any = engine_ct2.Ct2Engine.open(checkpoint, manifest, tokens, cfg)
        translate = engine.translate
        model_config = manifest.extra.get("model_config")
        precision = f"CTranslate2 compute type {cfg.ct2_compute_type}"
    else:
        from mtpipe.decode import MtpipeEngine
        from mtpipe.loading import load_model_and_vocab

        if (checkpoint / artifacts.MANIFEST).is_file() and artifacts.read_manifest(checkpoint).kind == "export":
            raise MtpipeError(f"{checkpoint}: is an `mtpipe export` model; serve it with --engine ctranslate2 (or "
                              "give the checkpoint it was exported from)")
        loaded = load_model_and_vocab(checkpoint, tokens)
        sp, step = loaded.sp, loaded.ck.step
        engine = MtpipeEngine.open(loaded.model, cfg)
        translate = _mtpipe_translate(engine)
        model_config = to_dict(engine.model.cfg)  # after decode.prune, the model that runs
        precision = cfg.precision
    info.update({"step": step, "engine": cfg.engine, "device": engine.describe(), "precision": precision,
                 "vocab_size": sp.get_piece_size(), "max_positions": engine.max_positions,
                 "model_config": model_config})
    return ServedModel(translate, sp, engine.max_positions, info)


def _mtpipe_translate(engine: Any) -> Callable[[Sequence[Sequence[int]], Any], list[list[Any]]]:
    """mtpipe's engine with its bf16 or int8 copy of the model made once, not once per batch as
    :func:`mtpipe.decode.translate_batches` makes it for a whole decode run: the same model, the same autocast, the
    same outputs, without a copy (or a quantisation) of the weights per request."""
    import torch

    from mtpipe.decode import bf16_copy, int8_copy, precision_context, translate_batches

    model, device, precision = engine.model, engine.device, engine.precision
    if precision == "int8" and device.type != "cpu":
        raise MtpipeError("decode.precision=int8 runs on CPU only; use bf16 on a GPU")
    if precision == "bf16":
        model = bf16_copy(model)
    elif precision == "int8":
        model = int8_copy(model)
    if engine.threads > 0:
        torch.set_num_threads(engine.threads)  # the process serves one model: set once, not around every batch

    def translate(sources: Sequence[Sequence[int]], rules: Any) -> list[list[Any]]:
        # bf16: the autocast translate_batches enters for precision bf16, around the ready bf16 copy.
        with precision_context(device, precision):
            return translate_batches(model, sources, rules, max_tokens=engine.max_tokens, precision="fp32",
                                     device=device)

    return translate


# --------------------------------------------------------------------------------------------------------------------
# Worker processes (serve.workers > 1)
# --------------------------------------------------------------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _worker_main(conn: Any, cfg: DecodeConfig, checkpoint: str, tokens: str | None) -> None:
    """A worker process: open the model as the server does, warm it up, then answer ``(sources, rules)`` messages
    with ``("ok", hypotheses)`` or ``("error", reason)`` until the server closes the pipe."""
    # The server drains and stops on SIGTERM / Ctrl-C (which a terminal sends to the whole process group): a worker
    # must go on decoding what the server still hands it, and ends when the server closes its pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from mtpipe.decode import validate

    try:
        model = open_model(cfg, Path(checkpoint), Path(tokens) if tokens is not None else None)
        model.translate([model.sp.encode("Warm up.", out_type=int)[: model.max_positions - 1]], validate(cfg))
    except Exception as e:  # noqa: BLE001 - reported to the server, which stops with it
        conn.send(("error", _first_line(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            sources, rules = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result: tuple[str, Any] = ("ok", model.translate(sources, rules))
        except Exception as e:  # noqa: BLE001 - answered (500) by the server, which goes on
            result = ("error", _first_line(e))
        conn.send(result)


class WorkerProcess:
    """One decoding process of ``serve.workers`` (spawned: a fresh interpreter, its model in its own main thread,
    ``cfg.threads`` CPU threads). :meth:`translate` is called by one server thread at a time. A worker that dies
    (e.g. killed for memory) fails the batch it held; the next batch starts a new one."""

    def __init__(self, index: int, cfg: DecodeConfig, checkpoint: Path, tokens: Path | None) -> None:
        self.index = index
        self._args = (cfg, str(checkpoint), str(tokens) if tokens is not None else None)
        self._start()

    def _start(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # no fork of a process with torch's threads and uvicorn's loop
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_main, name=f"mtpipe-decode-{self.index}", daemon=True,
                                 args=(child, *self._args))
        self._proc.start()
        child.close()
        self._dead = False

    def ready(self) -> None:
        """Wait until the model is loaded and warm; its start-up error as a :class:`MtpipeError`."""
        status, payload = self._receive()
        if status != "ready":
            raise MtpipeError(f"serve.workers: worker {self.index} could not open the model ({payload})")

    def translate(self, sources: Sequence[Sequence[int]], rules: Any) -> list[list[Any]]:
        if self._dead:
            self._conn.close()
            self._start()
            self.ready()
        try:
            self._conn.send((list(map(list, sources)), rules))
        except OSError:
            self._died()
        status, payload = self._receive()
        if status != "ok":
            raise RuntimeError(payload)
        return payload

    def _receive(self) -> tuple[str, Any]:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._died()

    def _died(self) -> typing.NoReturn:
        self._dead = True
        self._proc.join(5)
        raise RuntimeError(f"worker process {self.index} exited (code {self._proc.exitcode}); it is restarted for "
                           "the next batch")

    def close(self) -> None:
        """Close the pipe (the worker then exits) and wait for the process."""
        self._conn.close()
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)


def worker_threads(cfg: DecodeConfig, workers: int) -> int:
    """CPU threads per worker process: ``decode.threads`` when set, else this process's CPUs split evenly."""
    import os

    if cfg.threads > 0:
        return cfg.threads
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // workers)


# --------------------------------------------------------------------------------------------------------------------
# Dynamic batching: a worker runs the model (in this process, or one WorkerProcess each)
# --------------------------------------------------------------------------------------------------------------------


class QueueFull(Exception):
    """``serve.max_queue`` requests are already waiting (or the server is shutting down)."""


@dataclass
class Job:
    """One request in the queue: its sources (token ids, no EOS), rules, and the future its answer goes to."""

    sources: list[list[int]]
    rules: Any  # mtpipe.search.DecodeRules: requests with equal rules are decoded together
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    queued_at: float
    tokens: int = 0  # source tokens with their EOS, as the encoder sees them: the job's share of a batch's budget

    def __post_init__(self) -> None:
        self.tokens = sum(len(s) + 1 for s in self.sources)


@dataclass
class Answer:
    """A job's result: per sentence its n-best ``(text, score)`` list, best first, and what its batch was."""

    hypotheses: list[list[tuple[str, float]]]
    batch: dict[str, Any]


class Batcher:
    """Requests in, answers out, the model in one thread (:meth:`submit` from the event loop; see the module
    docstring for how a batch is gathered)."""

    def __init__(self, translate: Callable[[list[list[int]], Any], list[list[Any]]],
                 detok: Callable[[list[list[int]]], list[str]], *, max_queue: int, wait_s: float,
                 batch_tokens: int) -> None:
        self._translate, self._detok = translate, detok
        self.max_queue, self.wait_s, self.batch_tokens = max_queue, wait_s, batch_tokens
        self._jobs: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._done = threading.Event()  # set when the last :meth:`run` returns
        self._running = 0  # :meth:`run` loops not yet returned (one per worker)
        self._last_end = 0.0  # time.monotonic() at the end of the last batch
        self.counters = {"requests": 0, "sentences": 0, "batches": 0, "max_requests_per_batch": 0,
                         "rejected_queue_full": 0, "failed": 0}

    # ---- the event loop's side

    def start(self, translate: Callable[[list[list[int]], Any], list[list[Any]]] | None = None,
              worker: int = 0) -> None:
        """:meth:`run` in a thread of its own (the server runs worker 0 in the main thread instead: see
        :func:`serve_model`)."""
        self._enter()
        threading.Thread(target=self._loop, args=(translate, worker), name=f"mtpipe-decode-{worker}",
                         daemon=True).start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; :class:`QueueFull` when ``max_queue`` requests wait already or the server is stopping."""
        with self._cond:
            if self._closing or len(self._jobs) >= self.max_queue:
                self.counters["rejected_queue_full"] += 1
                raise QueueFull
            self._jobs.append(job)
            self._cond.notify()

    def close(self) -> None:
        """No new jobs; the worker decodes the queued ones without waiting for more, then stops."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> None:
        """Wait until every :meth:`run` has returned (after :meth:`close` and the queue drained), in whatever
        thread."""
        self._done.wait(timeout)

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            return {**self.counters, "queued": len(self._jobs)}

    # ---- the worker's side

    def _take(self) -> list[Job] | None:
        """The next batch: wait for a job, then until the oldest has waited ``wait_s`` or the waiting jobs fill the
        token budget; take the oldest jobs that fit (at least one). None once closed and drained."""
        with self._cond:
            while not self._jobs:
                if self._closing:
                    return None
                self._cond.wait(0.5)  # in slices: in the main thread, signal handlers run between them
            # Wait from the later of the oldest request's arrival and the last batch's end: under closed-loop load
            # the clients just answered send their next requests within a millisecond or two, and without this the
            # requests that queued during a batch would leave at once, alone, and the load split into two
            # alternating half-size batches.
            deadline = max(self._jobs[0].queued_at, self._last_end) + self.wait_s
            while not self._closing and sum(j.tokens for j in self._jobs) < self.batch_tokens:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch, tokens = [], 0
            while self._jobs and (not batch or tokens + self._jobs[0].tokens <= self.batch_tokens):
                job = self._jobs.popleft()
                batch.append(job)
                tokens += job.tokens
            return batch

    def run(self, translate: Callable[[list[list[int]], Any], list[list[Any]]] | None = None,
            worker: int = 0) -> None:
        """A worker: decode batch after batch with ``translate`` (default: the batcher's own) until closed and
        drained. Several workers may run at once, each in its own thread, each taking its own batches."""
        self._enter()
        self._loop(translate, worker)

    def _enter(self) -> None:
        with self._cond:
            self._running += 1
            self._done.clear()

    def _loop(self, translate: Callable[[list[list[int]], Any], list[list[Any]]] | None, worker: int) -> None:
        try:
            while (batch := self._take()) is not None:
                self._decode(batch, translate or self._translate, worker)
                self._last_end = time.monotonic()
        finally:
            with self._cond:
                self._running -= 1
                if self._running == 0:
                    self._done.set()

    def _decode(self, jobs: list[Job], translate: Callable[[list[list[int]], Any], list[list[Any]]],
                worker: int) -> None:
        """Decode one batch, a group per distinct rules, and send every job its answer (or the error)."""
        start = time.monotonic()
        with self._cond:
            self.counters["batches"] += 1
            batch_id = self.counters["batches"]
            self.counters["max_requests_per_batch"] = max(self.counters["max_requests_per_batch"], len(jobs))
        groups: dict[Any, list[Job]] = {}
        for job in jobs:
            groups.setdefault(job.rules, []).append(job)
        info = {"id": batch_id, "worker": worker, "requests": len(jobs),
                "sentences": sum(len(j.sources) for j in jobs), "groups": len(groups)}
        for rules, group in groups.items():
            group_start = time.monotonic()
            try:
                sources = [s for job in group for s in job.sources]
                results = translate(sources, rules)
                texts = self._detok([h.tokens for hyps in results for h in hyps])
            except Exception as e:  # noqa: BLE001 - any failure is answered (500) and the server goes on
                reason = _first_line(e)
                with self._cond:
                    self.counters["failed"] += len(group)
                for job in group:
                    _settle(job, RuntimeError(f"decoding failed: {reason}"))
                continue
            decode_ms = 1000 * (time.monotonic() - group_start)
            pos, text_pos = 0, 0
            for job in group:
                hyps_of_job = []
                for hyps in results[pos : pos + len(job.sources)]:
                    hyps_of_job.append([(texts[text_pos + k], float(h.score)) for k, h in enumerate(hyps)])
                    text_pos += len(hyps)
                pos += len(job.sources)
                batch = {**info, "group_requests": len(group), "group_sentences": len(sources),
                         "queue_ms": round(1000 * (start - job.queued_at), 2), "decode_ms": round(decode_ms, 2)}
                with self._cond:
                    self.counters["requests"] += 1
                    self.counters["sentences"] += len(job.sources)
                _settle(job, Answer(hyps_of_job, batch))


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


# --------------------------------------------------------------------------------------------------------------------
# The HTTP application
# --------------------------------------------------------------------------------------------------------------------


async def read_body(request: Any, limit: int) -> bytes:
    """The request body, refused (413) as soon as it grows past ``limit`` bytes, so a huge body is never held."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"body: {int(declared)} bytes, more than any valid request needs ({limit})")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"body: more than {limit} bytes, more than any valid request needs")
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(model: ServedModel, batcher: Batcher, cfg: ServeConfig, defaults: DecodeConfig) -> Any:
    """The FastAPI application: ``/translate``, ``/health``, ``/info``; every error answered as ``{"error": ...}``."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    from mtpipe.search import DecodeRules, LengthPenalty

    limit = max_body_bytes(cfg)
    limit_src = model.max_positions - 1  # one position is the EOS (mtpipe.search.max_source_len)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        yield  # the batcher runs already (serve_model: in the main thread)
        # uvicorn has let the requests in flight finish; the worker drains what is left, off the event loop.
        batcher.close()
        await asyncio.to_thread(batcher.join)

    app = FastAPI(title="mtpipe", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, reason: str, headers: dict[str, str] | None = None) -> Any:
        return JSONResponse({"error": reason}, status_code=status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Any:  # 404, 405: one line of JSON too
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", exc.headers)

    # Plain routes: the body is parsed here (parse_request), so that every bad input gets its own status and line.
    async def translate(request: Request) -> Any:
        try:
            req = parse_request(await read_body(request, limit), cfg, defaults)
        except RequestError as e:
            return error(e.status, e.reason)
        sources = model.sp.encode(req.sentences, out_type=int)
        truncated = sum(len(s) > limit_src for s in sources)
        sources = [s[:limit_src] for s in sources]  # as mtpipe decode cuts them to the model's positions
        rules = DecodeRules(beam=req.beam, nbest=req.nbest, penalty=LengthPenalty(defaults.length_penalty, req.alpha),
                            max_len_a=defaults.max_len_a, max_len_b=defaults.max_len_b, stop=defaults.stop,
                            patience=defaults.patience)
        loop = asyncio.get_running_loop()
        job = Job(sources, rules, loop.create_future(), loop, time.monotonic())
        try:
            batcher.submit(job)
        except QueueFull:
            return error(503, f"busy: {batcher.max_queue} requests already waiting (serve.max_queue); retry later",
                         {"Retry-After": str(RETRY_AFTER_S)})
        try:
            answer = await job.future
        except RuntimeError as e:
            return error(500, str(e))
        out: dict[str, Any] = {
            "translations": [hyps[0][0] for hyps in answer.hypotheses],
            "scores": [hyps[0][1] for hyps in answer.hypotheses],
        }
        if req.nbest > 1:
            out["nbest"] = [[text for text, _ in hyps] for hyps in answer.hypotheses]
            out["nbest_scores"] = [[score for _, score in hyps] for hyps in answer.hypotheses]
        out.update({"model": model.info["model"], "settings": {"beam": req.beam, "alpha": req.alpha,
                    "nbest": req.nbest}, "truncated": truncated, "batch": answer.batch})
        return JSONResponse(out)

    async def health(request: Request) -> Any:
        return JSONResponse({"status": "ok", "model": model.info["model"], "queued": batcher.snapshot()["queued"]})

    async def info(request: Request) -> Any:
        return JSONResponse({**model.info, "decode": to_dict(defaults), "serve": to_dict(cfg),
                             "counters": batcher.snapshot()})

    app.add_route("/translate", translate, methods=["POST"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/info", info, methods=["GET"])
    return app


# --------------------------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------------------------


def require_serve() -> tuple[Any, Any]:
    """``(fastapi, uvicorn)``, or one error line saying how to install them."""
    try:
        import fastapi
        import uvicorn
    except ImportError as e:
        raise MtpipeError(f"mtpipe serve needs {e.name or 'fastapi and uvicorn'}: install mtpipe[serve] "
                          "(pip install 'mtpipe[serve]')") from None
    return fastapi, uvicorn


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free one), bound before the model loads so that a taken port
    fails at once, with one line."""
    from mtpipe.errors import os_reason

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise MtpipeError(f"serve.host {host!r}: not an address this machine has ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise MtpipeError(f"serve.host/port {host}:{port}: cannot listen there ({os_reason(e)})") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def serve_model(cfg: ServeConfig, defaults: DecodeConfig, checkpoint: Path, tokens: Path | None) -> None:
    """Serve ``checkpoint`` until SIGTERM or Ctrl-C; the requests in flight are answered first, then exit 0."""
    _, uvicorn = require_serve()
    from mtpipe.console import info, table
    from mtpipe.decode import validate

    check_defaults(cfg, defaults)
    default_rules = validate(defaults)  # decode's own cross-key rules (nbest <= beam, ctranslate2's limits)
    sock = listen(cfg.host, cfg.port)
    workers: list[WorkerProcess] = []
    try:
        model = open_model(defaults, checkpoint, tokens)
        if cfg.workers == 1:
            # Warm-up: the first batch of a process pays for kernel selection; no request should.
            model.translate([model.sp.encode("Warm up.", out_type=int)[: model.max_positions - 1]], default_rules)
        else:
            threads = worker_threads(defaults, cfg.workers)
            info(f"starting {cfg.workers} decoding processes, {threads} CPU thread(s) each")
            worker_cfg = dataclasses.replace(defaults, threads=threads)
            for i in range(cfg.workers):
                workers.append(WorkerProcess(i, worker_cfg, checkpoint, tokens))
            for w in workers:
                w.ready()
            model.info["workers"] = cfg.workers
            model.info["threads_per_worker"] = threads
        batcher = Batcher(model.translate, model.detok, max_queue=cfg.max_queue, wait_s=cfg.batch_wait_ms / 1000,
                          batch_tokens=cfg.batch_tokens)
        app = build_app(model, batcher, cfg, defaults)
        server = uvicorn.Server(uvicorn.Config(app, log_level="info", access_log=False, lifespan="on"))
        url = url_of(sock)
        table("serve", ["", "value"], [
            ["checkpoint", f"{checkpoint} (step {model.info['step']:,})"],
            ["model", model.info["model"]],
            ["engine", f"{defaults.engine} on {model.info['device']}, {model.info['precision']}"],
            ["decode", f"beam {defaults.beam}, {defaults.length_penalty} alpha {defaults.alpha:g}, nbest "
                       f"{defaults.nbest}, stop {defaults.stop}"],
            ["limits", f"{cfg.max_sentences} sentences x {cfg.max_chars} chars, beam <= {cfg.max_beam}, nbest <= "
                       f"{cfg.max_nbest}, alpha <= {cfg.max_alpha:g}"],
            ["batching", f"wait {cfg.batch_wait_ms:g} ms, {cfg.batch_tokens:,} tokens, queue {cfg.max_queue}, "
                         f"{cfg.workers} worker(s)"],
        ])
        # One plain line (never wrapped) that scripts and the tests read the address from.
        sys.stderr.write(f"mtpipe serve: listening on {url} (POST /translate, GET /health, GET /info)\n")
        sys.stderr.flush()
        # The model runs here, in the main thread (see the module docstring), uvicorn in a second thread. Signals
        # reach the main thread only: SIGTERM / SIGINT ask uvicorn to stop (stop accepting, finish the requests in
        # flight, then the lifespan shutdown closes the batcher); a second one makes it stop at once.
        def stop(*_: Any) -> None:
            if server.should_exit:
                server.force_exit = True
            server.should_exit = True

        def run_server() -> None:
            try:
                server.run(sockets=[sock])
            finally:
                batcher.close()  # when the lifespan shutdown did not run (a failed start-up)

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        thread = threading.Thread(target=run_server, name="mtpipe-http", daemon=True)
        try:
            thread.start()
            for w in workers[1:]:
                batcher.start(w.translate, w.index)
            batcher.run(workers[0].translate if workers else None)
            while thread.is_alive():
                thread.join(0.5)  # in slices, so that a second signal still reaches stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        sock.close()
        for w in workers:
            w.close()
    if not server.started:
        raise MtpipeError(f"{url}: the server did not start (see uvicorn's log above)")
    counters = batcher.snapshot()
    info(f"stopped after {counters['requests']:,} requests")
    table("served", ["", "value"], [[k.replace("_", " "), v] for k, v in counters.items() if k != "queued"])


__all__ = ["Answer", "Batcher", "Job", "QueueFull", "RequestError", "ServedModel", "TranslateRequest", "WorkerProcess",
           "build_app", "check_defaults", "listen", "max_body_bytes", "open_model", "parse_request", "require_serve",
           "serve_model", "worker_threads"]
