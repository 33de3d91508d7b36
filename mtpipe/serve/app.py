"""``mtpipe serve``: translations over HTTP, concurrent requests decoded together in dynamic batches.

Endpoints (FastAPI on uvicorn, ``pip install 'mtpipe[serve]'``):

* ``POST /translate`` ``{"text": ["...", ...], "beam": 4, "alpha": 0.6, "nbest": 1}`` (beam, alpha and nbest
  optional: ``decode``'s values by default, within ``serve.max_beam`` / ``max_alpha`` / ``max_nbest``) answers
  ``{"translations": [...], "scores": [...], "model": <manifest hash of the checkpoint>, "batch": {...}}`` (with
  ``nbest`` / ``nbest_scores`` lists when nbest > 1). ``batch`` says which worker decoded the request, the most
  requests and sentences decoded together with it (itself included), and how long it waited and took.
* ``GET /health``: ``{"status": "ok", ...}``; ``GET /info``: the model, the engine, the settings, the counters.

The search is :func:`mtpipe.engine.search.beam_search` under the ``decode`` section's rules (paper section 6.1), through the
same engines as ``mtpipe decode`` (:class:`mtpipe.stages.decode.MtpipeEngine`, or :class:`mtpipe.engine.ct2.Ct2Engine` with
``decode.engine=ctranslate2``). Text is cleaned as ``mtpipe decode --input`` cleans a line (NFC, stripped) and
detokenised the same way, so a sentence translates exactly as ``mtpipe decode`` translates it: beam search is per
sentence, and the padding of a mixed batch is masked (the tests compare with ``mtpipe decode``).

Dynamic batching (:class:`Batcher`): the event loop only parses, encodes and queues a request; a worker takes
requests from the queue into its :class:`Lane`, which runs the model, in the process's main thread while uvicorn's
event loop runs in a second one: torch's CPU thread pool (OpenMP) parallelises the small operations of a decoding step
well only from the main thread (from any other thread a 2-thread decode of 8 sentences ran 3x slower on a 2-core CPU).
With ``serve.workers`` N > 1, N worker processes (:class:`mtpipe.engine.workers.WorkerProcess`) each run a copy of the
model in their own main thread with 1/N of the CPU threads, and each decodes its own requests: a server's batches are
small, and the small matrix products of a few sentences use several cores poorly, where separate batches use them
fully.

An idle worker takes the oldest waiting request, waits until it has waited ``serve.batch_wait_ms`` (counted from the
later of its arrival and the end of the worker's last work), or until the waiting requests fill ``serve.batch_tokens``
source tokens, and takes every waiting request that fits the budget, oldest first. Then, by ``serve.batching``:

* ``batch`` (:class:`BatchLane`): the requests are decoded to the end as one batch, a group per distinct settings (one
  call of the engine, itself split into ``decode.max_tokens`` batches sorted by length), the group of least work
  first, each answered when it ends; the worker takes no more until it is done.
* ``continuous`` (:class:`StreamLane`, mtpipe's engine; :mod:`mtpipe.engine.streaming`): a busy worker goes on taking
  waiting requests (while it holds fewer tokens than the budget, and no more than the least busy other worker), whose
  sentences join its running beam search at the next decoder step; a request is answered the step its last sentence
  ends. Requests with other settings decode in a stream of their own, the streams taking turns step by step in
  proportion to their requests.

Fair scheduling: a worker takes a request a chunk at a time, about ``serve.chunk_work`` of work (source tokens x
beam) and at least one sentence, the least served waiting request first, one chunk of a request at a time (two in a
continuous lane); the request is answered when its last chunk is. A request of 64 long sentences at beam 8 and a
one-sentence one sent after it take turns, so the short one waits for a chunk, not for the large one, in both
batching modes and with any number of workers. A request whose client goes away before its answer is cancelled: its
chunks not yet taken leave the queue, and a lane drops what it holds of it at its next step (a continuous lane lets
the sentences already in its search end).

Every phase of a request is bounded, so that no client can hold the server:

* reading it: ``serve.read_timeout_s`` for its headers and body from its first byte (a connection that sends nothing
  is closed after as long; 408 to one that sent part of a request), ``serve.keep_alive_s`` between requests, at most
  ``serve.max_connections`` connections (one more: 503, closed at once), checked against the open-file limit at
  start-up (:class:`ConnectionGuard`, a small layer on uvicorn's h11 protocol, which times only the wait between
  requests);
* decoding it: ``serve.max_request_work`` (source tokens with EOS x beam, summed over the sentences; more: 413
  naming the key) besides ``serve.max_sentences`` / ``max_chars`` / ``max_beam``, and ``serve.max_output_tokens``
  per sentence (:class:`mtpipe.engine.streaming.ServedRules`);
* waiting: at most ``serve.max_queue`` requests wait (being gathered counts as waiting); one more gets 503 with
  Retry-After.

Bad input gets a 4xx and one line of JSON ``{"error": "..."}``: 400 for a body that is not UTF-8 JSON (also JSON
nested too deeply to parse), 413 for too many sentences, characters or work, 422 for valid JSON with wrong fields or
values. A client that leaves mid-body or before its answer is one line in the log, not a traceback. ``/info``'s
``counters`` count all of these.

SIGTERM (or Ctrl-C): uvicorn stops accepting connections and waits for the requests in flight (the worker goes on
decoding them); the worker then decodes whatever is still queued and stops; the process exits 0. ``serve.drain_s``
after the signal (or at a second one) whatever is left is dropped: requests not yet answered get 503, connections
still sending a request are closed, the workers stop after the chunk in hand, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import signal
import socket
import sys
import threading
import time
import typing
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from mtpipe.config import DecodeConfig, ServeConfig, to_dict
from mtpipe.errors import MtpipeError
from mtpipe.engine.workers import WorkerProcess, first_line, worker_threads

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


def _brief(value: Any) -> str:
    """A value as the start of its JSON, for an error line (a value nested too deeply to write: its type)."""
    try:
        return json.dumps(value)[:40]
    except (RecursionError, ValueError):
        return type(value).__name__


def _int_field(data: dict[str, Any], key: str, default: int, limit: int, limit_name: str) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(422, f"{key}: must be an integer, got {_brief(value)}")
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
    except RecursionError:  # arrays or objects nested thousands deep: the parser's recursion gives up
        raise RequestError(400, "body: JSON nested too deeply (a request is an object of a list of strings)") \
            from None
    except Exception as e:  # noqa: BLE001 - whatever else the parser meets is the body's fault: 400, one line
        raise RequestError(400, f"body: cannot be parsed as JSON ({first_line(e)})") from None
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
            raise RequestError(422, f"text[{i}]: must be a string, got {_brief(item)}")
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
        raise RequestError(422, f"alpha: must be a number, got {_brief(alpha)}")
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
    if cfg.batching == "continuous" and defaults.engine != "mtpipe":
        raise MtpipeError(f"serve.batching=continuous needs decode.engine=mtpipe ({defaults.engine} decodes batch by "
                          "batch)")


# --------------------------------------------------------------------------------------------------------------------
# The model: the engines of mtpipe decode, opened once
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class ServedModel:
    """What the server decodes with: ``lane()`` makes a :class:`Lane` over the engine (the model already in its
    decoding precision), the SentencePiece model, and what ``/info`` shows."""

    lane: Callable[[], "Lane"]
    sp: Any  # sentencepiece.SentencePieceProcessor
    max_positions: int
    info: dict[str, Any]

    def detok(self, tokens: list[list[int]]) -> list[str]:
        """Pieces -> text as ``mtpipe decode`` writes it: one line per hypothesis whatever the model emits."""
        return [s.replace("\r", " ").replace("\n", " ") for s in self.sp.decode(tokens)]

    def description(self) -> dict[str, Any]:
        """What a server process needs of a model that its worker processes run: the vocabulary (the SentencePiece
        model's bytes), the positions, the ``/info`` facts (:meth:`described` rebuilds it)."""
        return {"spm": self.sp.serialized_model_proto(), "max_positions": self.max_positions, "info": self.info}

    @classmethod
    def described(cls, description: dict[str, Any]) -> "ServedModel":
        """The model as :meth:`description` describes it, without its weights: encoding and detokenising only
        (with ``serve.workers`` > 1 the weights live in the worker processes alone)."""
        import sentencepiece as spm

        def no_lane() -> "Lane":
            raise MtpipeError("this process holds no copy of the model (serve.workers > 1)")

        return cls(no_lane, spm.SentencePieceProcessor(model_proto=description["spm"]),
                   int(description["max_positions"]), dict(description["info"]))

    def warm_up(self, rules: Any, beams: Sequence[int] = ()) -> None:
        """Decode one sentence, then three together, with ``rules`` and again at each of ``beams``
        (:func:`warm_beams`); a continuous lane then also lets three sentences join one that is decoding. The first
        decoding of a process pays for kernel selection, and with ``decode.compile`` for building the compiled step,
        whose graphs differ by the number of sentences, by the beam (greedy search, and beams past 8) and, in a
        continuous batch, by the masks of rows that joined later: measured, a first request at beam 1 or 16 after a
        warm-up at beam 4 waited 1-11 s for its graphs, and the first continuous batch with a joining request 3-13 s.
        No request should."""
        from mtpipe.stages.decode import WARM_UP_TEXTS

        lane = self.lane()
        texts = [self.sp.encode(t, out_type=int)[: self.max_positions - 1] for t in WARM_UP_TEXTS]
        one, several = texts[:1], texts[1:]
        keys = itertools.count()

        def poll() -> None:
            for _, result in lane.poll():
                if isinstance(result, Exception):
                    raise result

        with lane.decoding():
            for beam in dict.fromkeys((rules.beam, *beams)):  # the default first, each beam once
                at_beam = dataclasses.replace(rules, beam=beam, nbest=min(rules.nbest, beam))
                for group in (one, several):
                    lane.add(next(keys), group, at_beam)
                    while lane.busy():
                        poll()
                if lane.continuous:
                    lane.add(next(keys), [max(several, key=len)], at_beam)  # still decoding when the others join
                    for _ in range(2):  # past the two eager steps: the next are compiled ...
                        poll()
                    lane.add(next(keys), several, at_beam)  # ... and now with joined rows, earlier slots masked
                    while lane.busy():
                        poll()


def warm_beams(cfg: ServeConfig, defaults: DecodeConfig) -> tuple[int, ...]:
    """The beams the warm-up decodes with besides ``decode.beam``: greedy search and the largest beam a request may
    ask for (``serve.max_beam``), the sizes a compiled step builds new graphs for."""
    return tuple(sorted({1, defaults.beam, cfg.max_beam}))


def open_model(cfg: DecodeConfig, checkpoint: Path, tokens: Path | None, batching: str = "batch") -> ServedModel:
    """The checkpoint (or, with ``decode.engine=ctranslate2``, also a CTranslate2 export) and its vocabulary (that of
    ``tokens``, None: the model's own), checked and opened as ``mtpipe decode`` opens them
    (:func:`mtpipe.stages.decode.open_model`); its lanes decode by ``serve.batching`` (CTranslate2: batch by batch)."""
    from mtpipe import artifacts

    checkpoint = Path(checkpoint)
    tokens = Path(tokens) if tokens is not None else None
    info: dict[str, Any] = {"checkpoint": str(checkpoint), "model": artifacts.manifest_hash(checkpoint)
                            if (checkpoint / artifacts.MANIFEST).is_file() else None}
    if cfg.engine == "ctranslate2":
        from mtpipe.engine import ct2 as engine_ct2

        manifest = engine_ct2.decode_source(checkpoint)
        sp, step, tokens = engine_ct2.source_vocab(checkpoint, manifest, tokens)
        engine: Any = engine_ct2.Ct2Engine.open(checkpoint, manifest, tokens, cfg)
        translate = engine.translate
        lane: Callable[[], Lane] = lambda: BatchLane(translate)  # noqa: E731
        model_config = manifest.extra.get("model_config")
        precision = f"CTranslate2 compute type {cfg.ct2_compute_type}"
    else:
        from mtpipe.stages.decode import MtpipeEngine
        from mtpipe.engine.loading import load_model_and_vocab

        if (checkpoint / artifacts.MANIFEST).is_file() and artifacts.read_manifest(checkpoint).kind == "export":
            raise MtpipeError(f"{checkpoint}: is an `mtpipe export` model; serve it with --engine ctranslate2 (or "
                              "give the checkpoint it was exported from)")
        loaded = load_model_and_vocab(checkpoint, tokens)
        sp, step = loaded.sp, loaded.ck.step
        # requests often come one sentence at a time: with decode.compile a lone sentence gets a graph of its own,
        # built in the warm-up (its steps ~1.09x as fast as run as two sentences, MtpipeEngine.lone_graph)
        engine = MtpipeEngine.open(loaded.model, cfg, lone_graph=True)
        prepared = _decoding_model(engine)
        if batching == "continuous":
            lane = lambda: StreamLane(prepared, engine)  # noqa: E731
        else:
            lane = lambda: BatchLane(engine.translate)  # noqa: E731 - mtpipe decode's batches, on the prepared model
        model_config = to_dict(engine.model.cfg)  # after decode.prune, the model that runs
        precision = cfg.precision
    from mtpipe.stages.decode import validate

    rules = validate(cfg)  # decode's rules: how the engine searches under them (a DecodePool logs these words)
    info.update({"step": step, "engine": cfg.engine, "device": engine.describe(), "precision": precision,
                 "search": engine.settings(rules), "vocab_size": sp.get_piece_size(),
                 "max_positions": engine.max_positions, "model_config": model_config})
    note = engine.note(rules)
    if note:
        info["note"] = note
    return ServedModel(lane, sp, engine.max_positions, info)


def _decoding_model(engine: Any) -> Any:
    """mtpipe's engine's model in its decoding precision, made at start-up, once (:meth:`MtpipeEngine.prepared`;
    with ``decode.compile`` its graphs are built by :meth:`ServedModel.warm_up`, before the first request), and the
    process's CPU threads set: the continuous lane drives this model itself, the batch lane through
    :meth:`MtpipeEngine.translate`, which uses the same prepared model."""
    import torch

    if engine.threads > 0:
        torch.set_num_threads(engine.threads)
    return engine.prepared()


# --------------------------------------------------------------------------------------------------------------------
# Lanes: where a worker's requests are decoded (continuously in this process, batch by batch, or in a process)
# --------------------------------------------------------------------------------------------------------------------

class Lane(typing.Protocol):
    """What a :class:`Batcher` worker drives: requests in (:meth:`add`), finished requests out (:meth:`poll`).
    ``continuous``: it takes new requests while it decodes (else only when it is idle)."""

    continuous: bool

    def add(self, key: int, sources: list[list[int]], rules: Any) -> None:
        """Take request ``key``: its sources (token ids, no EOS), decoded under ``rules``."""
        ...

    def busy(self) -> bool:
        """Whether requests are still being decoded."""
        ...

    def cancel(self, keys: Sequence[int]) -> None:
        """Forget requests ``keys`` (their clients have gone): what is not yet decoded of them is dropped, and they
        are never reported by :meth:`poll`."""
        ...

    def poll(self) -> list[tuple[int, Any]]:
        """Work a little (a decoder step, a batch, or a few milliseconds' wait): the requests finished meanwhile,
        each ``(key, result)``."""
        ...

    def decoding(self) -> contextlib.AbstractContextManager:
        """What the thread that drives the lane enters once around its polls (``decode.compile``'s settings:
        :meth:`mtpipe.model.transformer.Transformer.compile_settings`), rather than every poll entering it again."""
        ...


class StreamLane:
    """mtpipe's engine with continuous batching (:class:`mtpipe.engine.streaming.StreamDecoder`): a request's sentences
    join the running search at the next decoder step and it is answered the step its last one ends. One stream per
    distinct rules (requests asking for another beam, alpha or nbest are decoded side by side), one decoder step per
    :meth:`poll`, the streams sharing the decoding time in proportion to the requests in them: one request alone at
    beam 8, whose steps cost more, must not halve the pace of many at beam 4 (each stream's clock advances by a
    step's seconds / its requests; the stream whose clock is behind steps next)."""

    continuous = True

    def __init__(self, model: Any, engine: Any) -> None:
        self.model, self.device, self.precision, self.max_tokens = model, engine.device, engine.precision, \
            engine.max_tokens
        self.streams: dict[Any, Any] = {}  # rules -> StreamDecoder
        self.pending: dict[int, list[Any]] = {}  # key -> per sentence its hypotheses (None until done)
        self.members: dict[Any, set[int]] = {}  # rules -> keys with sentences in that stream
        self.clock: dict[Any, float] = {}  # rules -> that stream's decoding seconds, each / its requests then

    def add(self, key: int, sources: list[list[int]], rules: Any) -> None:
        from mtpipe.engine.streaming import StreamDecoder

        stream = self.streams.get(rules)
        if stream is None:
            stream = self.streams[rules] = StreamDecoder(self.model, rules, self.max_tokens, self.device)
            self.members[rules] = set()
            self.clock[rules] = min(self.clock.values(), default=0.0)  # takes its turns from now on, no backlog
        self.pending[key] = [None] * len(sources)
        self.members[rules].add(key)
        for i, source in enumerate(sources):
            stream.add((key, i), source)

    def busy(self) -> bool:
        return bool(self.pending)

    def cancel(self, keys: Sequence[int]) -> None:
        gone = {k for k in keys if self.pending.pop(k, None) is not None}
        if not gone:
            return
        for rules, stream in self.streams.items():
            self.members[rules] -= gone
            stream.drop(lambda item: item[0] in gone)  # the waiting sentences; those in the search end as usual

    def decoding(self) -> contextlib.AbstractContextManager:
        return self.model.compile_settings()

    def poll(self) -> list[tuple[int, Any]]:
        import torch

        from mtpipe.stages.decode import decoding_context

        finished: list[tuple[int, Any]] = []
        for rules, stream in list(self.streams.items()):
            if not len(stream):
                del self.streams[rules], self.members[rules], self.clock[rules]
        if not self.streams:
            return finished
        rules = min(self.streams, key=self.clock.__getitem__)  # the stream whose turn it is
        stream = self.streams[rules]
        start = time.perf_counter()
        try:
            # bf16: the autocast translate_batches enters for precision bf16, around the ready bf16 copy.
            with torch.inference_mode(), decoding_context(self.device, self.precision):
                done = stream.step()
        except Exception as e:  # noqa: BLE001 - the stream's requests fail (500); the server goes on
            error = RuntimeError(f"decoding failed: {first_line(e)}")
            finished += [(key, error) for key in self.members.pop(rules) if self.pending.pop(key, None)]
            del self.streams[rules], self.clock[rules]
            return finished
        self.clock[rules] += (time.perf_counter() - start) / max(1, len(self.members[rules]))
        for (key, i), hyps in done:
            sentences = self.pending.get(key)
            if sentences is None:  # cancelled while in the search
                continue
            sentences[i] = hyps
            if all(h is not None for h in sentences):
                del self.pending[key]
                self.members[rules].discard(key)
                finished.append((key, sentences))
        return finished


class BatchLane:
    """An engine's ``translate(sources, rules)`` (CTranslate2's, or a test's), batch by batch: the requests added
    since the lane was last idle are decoded a group per distinct rules, one group a :meth:`poll`, the least work
    first (source tokens x beam), so that the short requests of a batch are answered before a large request's group
    is decoded rather than after it."""

    continuous = False

    def __init__(self, translate: Callable[[list[list[int]], Any], list[list[Any]]]) -> None:
        self.translate = translate
        self.waiting: list[tuple[int, list[list[int]], Any]] = []

    def add(self, key: int, sources: list[list[int]], rules: Any) -> None:
        self.waiting.append((key, sources, rules))

    def busy(self) -> bool:
        return bool(self.waiting)

    def cancel(self, keys: Sequence[int]) -> None:
        gone = set(keys)
        self.waiting = [item for item in self.waiting if item[0] not in gone]

    def decoding(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # translate() enters its own, per call

    def poll(self) -> list[tuple[int, Any]]:
        if not self.waiting:
            return []
        groups: dict[Any, list[tuple[int, list[list[int]]]]] = {}
        for key, sources, rules in self.waiting:
            groups.setdefault(rules, []).append((key, sources))

        def work(rules: Any) -> int:
            return sum(len(s) + 1 for _, sources in groups[rules] for s in sources) * getattr(rules, "beam", 1)

        rules = min(groups, key=work)
        group = groups[rules]
        self.waiting = [item for item in self.waiting if item[2] != rules]
        try:
            results = self.translate([s for _, sources in group for s in sources], rules)
        except Exception as e:  # noqa: BLE001 - the group's requests fail (500); the server goes on
            return [(key, RuntimeError(f"decoding failed: {first_line(e)}")) for key, _ in group]
        finished: list[tuple[int, Any]] = []
        pos = 0
        for key, sources in group:
            finished.append((key, results[pos : pos + len(sources)]))
            pos += len(sources)
        return finished


# --------------------------------------------------------------------------------------------------------------------
# Dynamic batching: the queue, and the workers that feed their lanes from it
# --------------------------------------------------------------------------------------------------------------------


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


class Batcher:
    """Requests in, answers out: the queue, and the workers that take requests from it into their :class:`Lane`
    (:meth:`submit` from the event loop; see the module docstring for how requests are gathered).

    Fair scheduling: a worker takes a request a chunk at a time (at most ``chunk_work`` of work, at least one
    sentence), the least served waiting request first, and no more than one chunk of a request at once (two in a
    continuous lane, so that the next is ready when one ends): a request of a thousand sentences and one of a single
    sentence take turns, and the short one waits for a chunk, not for the large one. ``chunk_work`` None: a request
    is one chunk."""

    def __init__(self, detok: Callable[[list[list[int]]], list[str]], *, max_queue: int, wait_s: float,
                 batch_tokens: int, chunk_work: int | None = None) -> None:
        self._detok = detok
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
        :func:`serve_model`)."""
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

    def _take(self, worker: int, held: int, last_end: float, continuous: bool = True) -> list[Piece] | None:
        """Chunks of requests for ``worker``'s lane, which decodes ``held`` source tokens. An idle lane waits for a
        request, then until the oldest has waited ``wait_s`` (from the later of its arrival and ``last_end``, the end
        of the lane's last work) or the waiting requests fill ``batch_tokens``, and takes at least one chunk, and no
        more than its share of what waits when other lanes are idle too; a busy lane takes, without waiting, the
        chunks that fit, while it holds no more than the least busy of the other lanes (so that with several workers
        the load is shared, not taken by whichever asks first). None once closed and drained, or abandoned. A lane
        that is not ``continuous`` takes nothing while it is busy."""
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

    def _serve(self, lane: Lane, worker: int) -> None:
        held: dict[int, Piece] = {}  # lane key -> the chunk it decodes
        last_end = 0.0
        while True:
            gone = [key for key, piece in held.items() if piece.job.done]  # cancelled, failed or abandoned
            if gone:
                with self._cond:
                    for key in gone:
                        held.pop(key).job.in_lanes[worker] -= 1
                lane.cancel(gone)
            pieces = self._take(worker, sum(p.tokens for p in held.values()), last_end, lane.continuous)
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
        _settle(job, Answer(hypotheses, batch))


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


class ClientGone(Exception):
    """The client closed its connection before sending the whole body (``received`` bytes of it)."""

    def __init__(self, received: int) -> None:
        super().__init__(f"after {received} bytes of the body")
        self.received = received


async def read_body(request: Any, limit: int) -> bytes:
    """The request body, refused (413) as soon as it grows past ``limit`` bytes, so a huge body is never held;
    :class:`ClientGone` when the client leaves before its end."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"body: {int(declared)} bytes, more than any valid request needs ({limit})")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"body: more than {limit} bytes, more than any valid request needs")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone(size) from None
    return b"".join(chunks)


def _plain_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with ``{"error": message}``, written straight to a connection the server then
    closes (it is answered outside any request's ASGI cycle)."""
    body = json.dumps({"error": message}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


CLOSED_BY_SERVER = "mtpipe.closed"  # scope key: why the server itself closed a request's connection (no log line)


class ConnectionGuard:
    """What bounds a server's connections beyond uvicorn's own settings, and what it did (``counters``, in ``/info``).

    uvicorn times a connection only while it is idle between requests (``timeout_keep_alive``): a client that
    connects and sends nothing, or half a request, holds its connection, a file descriptor and (mid-body) a request
    handler for as long as it likes; enough of them use up the process's open files and nothing is served. Hence:

    * ``read_timeout_s``: a request must arrive whole, headers and body, within this of its first byte (of the
      connection's opening, for its first request); else the connection is closed, with a 408 if part of a request
      came. A whole deadline, not an idle timer, so that a client trickling a byte a second is bounded too.
    * ``max_connections``: one more connection is answered 503 and closed before anything is read from it. Refusing
      at once, rather than queueing, keeps the process's open files below its limit and tells a client to go
      elsewhere while it can.
    * :meth:`drop_stalled`: the end of the drain after SIGTERM (``serve.drain_s``): the connections still sending a
      request are closed, so that a client can no longer hold a stopping server.

    :meth:`protocol` makes the uvicorn protocol class that applies these (``uvicorn.Config(http=...)``)."""

    LOG_EVERY_S = 10.0  # refusals can come by the thousand: one line per this many seconds says how many

    def __init__(self, read_timeout_s: float, max_connections: int) -> None:
        import logging

        self.read_timeout_s, self.max_connections = read_timeout_s, max_connections
        self.log = logging.getLogger("uvicorn.error")  # uvicorn's log: its format, its level
        self.open: set[Any] = set()  # the connections served (event loop thread only)
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop, once it runs
        self.counters = {"refused_connections": 0, "read_timeouts": 0, "client_disconnects": 0}
        self._logged_refusals = (0.0, 0)  # when a refusal was last logged, and the count then
        self.busy = _plain_response(503, "Service Unavailable", f"busy: {max_connections} connections already open "
                                    "(serve.max_connections); retry later")
        self.timeout = _plain_response(408, "Request Timeout", f"request not received whole within "
                                       f"{read_timeout_s:g} s (serve.read_timeout_s)")

    def refuse(self, transport: Any) -> None:
        self.counters["refused_connections"] += 1
        transport.write(self.busy)
        transport.close()
        now, count = time.monotonic(), self.counters["refused_connections"]
        if now - self._logged_refusals[0] >= self.LOG_EVERY_S:
            self.log.warning("refusing connections: %d open (serve.max_connections); %d refused since the last "
                             "line", self.max_connections, count - self._logged_refusals[1])
            self._logged_refusals = (now, count)

    def drop_stalled(self) -> int:
        """Close the connections still sending a request or stuck writing an answer (in the event loop's thread);
        those whose request is in and not yet answered are left to their answer (503 after
        :meth:`Batcher.abandon`). The number closed."""
        import h11

        dropped = 0
        for proto in list(self.open):
            cycle = proto.cycle
            answering = (cycle is not None and proto.conn.their_state in (h11.DONE, h11.MUST_CLOSE)
                         and not cycle.response_started)
            if answering or proto.transport.is_closing():
                continue
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the handler's answer goes nowhere; its receive() is a disconnect
                proto.scope[CLOSED_BY_SERVER] = "drain"
            proto.transport.abort()
            dropped += 1
        return dropped

    def protocol(self) -> type:
        """uvicorn's h11 protocol with these bounds (``uvicorn.Config(http=guard.protocol())``)."""
        return _guarded_h11(self)


def _guarded_h11(guard: ConnectionGuard) -> type:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        """uvicorn's h11 protocol, plus a read deadline per request and a cap on open connections
        (:class:`ConnectionGuard`). uvicorn's own keep-alive timer still closes idle connections between
        requests."""

        refused = False
        read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            if len(guard.open) >= guard.max_connections:
                self.refused = True
                guard.refuse(transport)
                return
            super().connection_made(transport)
            guard.open.add(self)
            self._arm()  # the first request must come within the read timeout of the connection's opening

        def connection_lost(self, exc: Exception | None) -> None:
            if self.refused:
                return
            guard.open.discard(self)
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.refused:
                return
            if self.read_timer is None and self.conn.their_state is h11.IDLE:
                self._arm()  # a request starts: its headers and body must be in within the read timeout
            super().data_received(data)
            if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
                self._disarm()  # the request is in (or the connection failed): the handler's time, not the client's

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.SEND_BODY and self.read_timer is None:
                self._arm()  # a pipelined request whose body is still coming: uvicorn's keep-alive timer is off

        def _arm(self) -> None:
            self._disarm()
            self.read_timer = self.loop.call_later(guard.read_timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self.read_timer is not None:
                self.read_timer.cancel()
                self.read_timer = None

        def _timed_out(self) -> None:
            self.read_timer = None
            if self.transport.is_closing():
                return
            guard.counters["read_timeouts"] += 1
            partial = self.conn.their_state is h11.SEND_BODY or bool(self.conn.trailing_data[0])
            if partial:
                cycle = self.cycle if self.conn.their_state is h11.SEND_BODY else None
                if cycle is None or not cycle.response_started:
                    self.transport.write(guard.timeout)
                if cycle is not None and not cycle.response_complete:
                    cycle.disconnected = True  # the handler reading the body sees a disconnect; its answer is dropped
                    self.scope[CLOSED_BY_SERVER] = "read timeout"
                client = "%s:%d" % self.client if self.client else "a client"
                guard.log.info("%s: request not received whole within %g s (serve.read_timeout_s): connection "
                               "closed", client, guard.read_timeout_s)
            self.transport.close()  # a connection that sent nothing is closed without a word

    return GuardedH11Protocol


def build_app(model: ServedModel, batcher: Batcher, cfg: ServeConfig, defaults: DecodeConfig,
              guard: ConnectionGuard | None = None) -> Any:
    """The FastAPI application: ``/translate``, ``/health``, ``/info``; every error answered as ``{"error": ...}``.
    ``guard``: the connections' bounds, whose counters ``/info`` shows (None: a guard of ``cfg``'s, counting only)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    from mtpipe.engine.search import DecodeRules, LengthPenalty
    from mtpipe.engine.streaming import ServedRules

    if guard is None:
        guard = ConnectionGuard(cfg.read_timeout_s, cfg.max_connections)
    counters = guard.counters
    counters["rejected_work"] = 0
    limit = max_body_bytes(cfg)
    limit_src = model.max_positions - 1  # one position is the EOS (mtpipe.engine.search.max_source_len)
    decode_rules = DecodeRules.from_config(defaults)
    base_rules = ServedRules(**{f.name: getattr(decode_rules, f.name) for f in dataclasses.fields(decode_rules)},
                             max_output=cfg.max_output_tokens)

    def gone(request: Request, what: str) -> None:
        """One line for a client that left (none where the server closed the connection itself: it said why)."""
        if CLOSED_BY_SERVER in request.scope:
            return
        counters["client_disconnects"] += 1
        client = "%s:%d" % tuple(request.scope["client"][:2]) if request.scope.get("client") else "a client"
        guard.log.info("%s: POST /translate: the client went away %s", client, what)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        guard.loop = asyncio.get_running_loop()  # for the drain after SIGTERM (serve_model), from another thread
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
        except ClientGone as e:
            gone(request, f"before sending the whole body ({e.received} bytes of "
                          f"{request.headers.get('content-length', '?')})")
            return error(400, "body: incomplete")  # nobody reads it
        sources = model.sp.encode(req.sentences, out_type=int)
        truncated = sum(len(s) > limit_src for s in sources)
        sources = [s[:limit_src] for s in sources]  # as mtpipe decode cuts them to the model's positions
        # Work, not characters: what decoding a request costs grows with its tokens times its beam.
        work = sum(len(s) + 1 for s in sources) * req.beam
        if work > cfg.max_request_work:
            counters["rejected_work"] += 1
            return error(413, f"work: {work:,} (source tokens with EOS x beam, summed over the sentences) is more "
                              f"than the server's limit (serve.max_request_work = {cfg.max_request_work:,}); send "
                              "fewer or shorter sentences, or a smaller beam")
        # Every rule from the decode section (as `mtpipe decode` builds them), then what the request may change.
        rules = dataclasses.replace(base_rules, beam=req.beam, nbest=req.nbest,
                                    penalty=LengthPenalty(defaults.length_penalty, req.alpha))
        loop = asyncio.get_running_loop()
        job = Job(sources, rules, loop.create_future(), loop, time.monotonic())
        try:
            batcher.submit(job)
        except QueueFull:
            return error(503, f"busy: {batcher.max_queue} requests already waiting (serve.max_queue); retry later",
                         {"Retry-After": str(RETRY_AFTER_S)})
        # Wait for the answer, or for the client to go: after the body, uvicorn's receive() returns only then
        # (http.disconnect). A request whose client has gone is cancelled: what no worker has started is dropped.
        left = asyncio.ensure_future(request.receive())
        try:
            await asyncio.wait({job.future, left}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # uvicorn gave up on the request (its graceful shutdown's limit)
            batcher.cancel(job)
            raise
        finally:
            left.cancel()
        if not job.future.done():
            dropped = batcher.cancel(job)
            gone(request, f"before its answer: request cancelled, {dropped} of its {len(sources)} sentences not "
                          "decoded")
            return error(400, "cancelled")  # nobody reads it
        try:
            answer = job.future.result()
        except ServerStopping as e:
            return error(503, str(e), {"Retry-After": str(RETRY_AFTER_S)})
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
                             "counters": {**batcher.snapshot(), **counters, "open_connections": len(guard.open)}})

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


FILES_BESIDES_CONNECTIONS = 64  # the listening socket, the model's files, logs, pipes, torch's own: a margin


def check_open_files(cfg: ServeConfig) -> None:
    """``serve.max_connections`` connections (a file descriptor each) must fit the process's open-file limit, or the
    next accept fails and nothing is served: raise the soft limit as far as the hard one allows, else one line."""
    try:
        import resource
    except ImportError:  # not a Unix: nothing to check
        return
    need = cfg.max_connections + FILES_BESIDES_CONNECTIONS + 4 * cfg.workers
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard == resource.RLIM_INFINITY or hard >= need:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
            return
    raise MtpipeError(f"serve.max_connections = {cfg.max_connections} needs {need} open files, and this process may "
                      f"open {max(soft, hard) if hard != resource.RLIM_INFINITY else soft} (ulimit -n): lower "
                      "serve.max_connections or raise the limit")


def serve_model(cfg: ServeConfig, defaults: DecodeConfig, checkpoint: Path, tokens: Path | None) -> None:
    """Serve ``checkpoint`` until SIGTERM or Ctrl-C; the requests in flight are answered first, then exit 0."""
    _, uvicorn = require_serve()
    from mtpipe.console import info, table
    from mtpipe.stages.decode import validate

    check_defaults(cfg, defaults)
    check_open_files(cfg)
    default_rules = validate(defaults)  # decode's own cross-key rules (nbest <= beam, ctranslate2's limits)
    if defaults.processes > 1:  # set for the decode stage, say, in the params.yaml a server shares
        info(f"decode.processes={defaults.processes} applies to mtpipe decode; the server's decoding processes are "
             f"serve.workers ({cfg.workers})")
    sock = listen(cfg.host, cfg.port)
    workers: list[WorkerProcess] = []
    drained = threading.Event()  # set once the drain has run (serve.drain_s after SIGTERM)
    beams = warm_beams(cfg, defaults)
    if defaults.compile:
        info(f"warming up: building the compiled decoder step (decode.compile) at beams "
             f"{', '.join(map(str, beams))} before the first request (tens of seconds on a small "
             "CPU, less once torch has cached the generated code)")
    try:
        started = time.monotonic()
        if cfg.workers == 1:
            model = open_model(defaults, checkpoint, tokens, cfg.batching)
            model.warm_up(default_rules, beams)
        else:
            # The weights only in the workers: this process encodes, queues and detokenises with worker 0's vocabulary.
            threads = worker_threads(defaults, cfg.workers)
            info(f"starting {cfg.workers} decoding processes, {threads} CPU thread(s) each")
            worker_cfg = dataclasses.replace(defaults, threads=threads)
            for i in range(cfg.workers):
                workers.append(WorkerProcess(i, worker_cfg, checkpoint, tokens, cfg.batching, beams))
            descriptions = [w.ready() for w in workers]
            model = ServedModel.described(descriptions[0])
            model.info["workers"] = cfg.workers
            model.info["threads_per_worker"] = threads
        model.info["batching"] = cfg.batching
        batcher = Batcher(model.detok, max_queue=cfg.max_queue, wait_s=cfg.batch_wait_ms / 1000,
                          batch_tokens=cfg.batch_tokens, chunk_work=cfg.chunk_work)
        guard = ConnectionGuard(cfg.read_timeout_s, cfg.max_connections)
        app = build_app(model, batcher, cfg, defaults, guard)
        # uvicorn's graceful shutdown waits for every connection and task; the drain (below) ends them after
        # serve.drain_s, and uvicorn's own limit, a little later, is only a backstop.
        server = uvicorn.Server(uvicorn.Config(app, log_level="info", access_log=False, lifespan="on",
                                                timeout_keep_alive=cfg.keep_alive_s, http=guard.protocol(),
                                                timeout_graceful_shutdown=cfg.drain_s + 5))
        url = url_of(sock)
        table("serve", ["", "value"], [
            ["checkpoint", f"{checkpoint} (step {model.info['step']:,})"],
            ["model", model.info["model"]],
            ["engine", f"{defaults.engine} on {model.info['device']}, {model.info['precision']}"],
            ["decode", f"beam {defaults.beam}, {defaults.length_penalty} alpha {defaults.alpha:g}, nbest "
                       f"{defaults.nbest}, stop {defaults.stop}"],
            ["limits", f"{cfg.max_sentences} sentences x {cfg.max_chars} chars, beam <= {cfg.max_beam}, nbest <= "
                       f"{cfg.max_nbest}, alpha <= {cfg.max_alpha:g}"],
            ["batching", f"{model.info['batching']}, wait {cfg.batch_wait_ms:g} ms, {cfg.batch_tokens:,} tokens, "
                         f"queue {cfg.max_queue}, {cfg.workers} worker(s)"],
            ["connections", f"idle ones closed after {cfg.keep_alive_s:g} s (serve.keep_alive_s)"],
            ["requests", f"read within {cfg.read_timeout_s:g} s, {cfg.max_connections:,} connections at most, "
                         f"drained {cfg.drain_s:g} s after SIGTERM"],
            ["work", f"{cfg.max_request_work:,} per request (tokens x beam), chunks of {cfg.chunk_work:,}, "
                     f"{cfg.max_output_tokens} output tokens a sentence"],
            ["start-up", f"{time.monotonic() - started:.1f} s: loading, warm-up"
                         + (" and the compiled step's graphs (decode.compile)" if defaults.compile else "")],
        ])
        # One plain line (never wrapped) that scripts and the tests read the address from.
        sys.stderr.write(f"mtpipe serve: listening on {url} (POST /translate, GET /health, GET /info)\n")
        sys.stderr.flush()
        # The model runs here, in the main thread (see the module docstring), uvicorn in a second thread. Signals
        # reach the main thread only: SIGTERM / SIGINT ask uvicorn to stop (stop accepting, finish the requests in
        # flight, then the lifespan shutdown closes the batcher); serve.drain_s later, or at a second signal, what
        # is left is dropped (drain).
        def drain() -> None:
            if drained.is_set():
                return
            drained.set()
            abandoned = batcher.abandon()
            loop = guard.loop
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop has closed: nothing left to drop
                    loop.call_soon_threadsafe(guard.drop_stalled)
            info(f"drain (serve.drain_s = {cfg.drain_s:g} s after the signal, or a second signal): {abandoned} "
                 "request(s) not yet decoded answered 503, connections still sending a request closed")

        timer = threading.Timer(cfg.drain_s, drain)
        timer.daemon = True

        def stop(*_: Any) -> None:
            if server.should_exit:
                server.force_exit = True
                threading.Thread(target=drain, daemon=True).start()  # not in the handler: abandon takes a lock
            server.should_exit = True
            if not timer.is_alive() and not drained.is_set():
                with contextlib.suppress(RuntimeError):  # started already
                    timer.start()

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
                batcher.start(w, w.index)
            batcher.run(workers[0] if workers else model.lane())
            while thread.is_alive():
                thread.join(0.5)  # in slices, so that a second signal still reaches stop()
        finally:
            timer.cancel()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        sock.close()
        for w in workers:
            w.close(wait=1 if drained.is_set() else 30)  # drained: what the worker decodes now, nobody waits for
    if not server.started:
        raise MtpipeError(f"{url}: the server did not start (see uvicorn's log above)")
    counters = {**batcher.snapshot(), **guard.counters}
    info(f"stopped after {counters['requests']:,} requests")
    table("served", ["", "value"], [[k.replace("_", " "), v] for k, v in counters.items() if k != "queued"])


__all__ = ["Answer", "BatchLane", "Batcher", "ClientGone", "ConnectionGuard", "Job", "Lane", "Piece", "QueueFull",
           "RequestError", "ServedModel", "ServerStopping", "TranslateRequest", "build_app", "check_defaults",
           "check_open_files", "listen", "max_body_bytes", "open_model", "parse_request", "require_serve",
           "serve_model", "StreamLane", "warm_beams"]
