"""Lanes: where a server's worker has its requests decoded (:class:`~mtpipe.engine.protocol.Lane`), and the one
warm-up every engine runs through them (:func:`warm_lane`).

* :class:`BatchLane`: an engine's ``translate``, batch by batch: what ``mtpipe decode`` does with a file, on a
  server's requests.
* :class:`StreamLane`: mtpipe's engine with continuous batching (:class:`mtpipe.engine.streaming.StreamDecoder`):
  a request's sentences join the running search at the next decoder step (iteration-level batching, Yu et al.
  2022, "Orca"), so a short sentence is answered when its own search ends rather than when its batch's longest does.
* :class:`mtpipe.engine.workers.WorkerProcess`: either of these in a process of its own.

A sentence translates the same in every lane: beam search is per sentence and a batch's padding is masked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from typing import Any, Callable, Sequence

from mtpipe.engine.protocol import Lane


def first_line(e: BaseException) -> str:
    """An exception's first line of text (its type's name when it has none): what a failed request is answered
    with, and what travels between processes."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def failure(e: BaseException) -> RuntimeError:
    """A request's failure: one line for its client, the engine's own exception kept as the cause (which
    :func:`warm_lane` raises, so that a warm-up fails as the engine failed)."""
    error = RuntimeError(f"decoding failed: {first_line(e)}")
    error.__cause__ = e
    return error


class BatchLane:
    """An engine's ``translate(sources, rules)`` (CTranslate2's, mtpipe's, or a test's), batch by batch: the
    requests added since the lane was last idle are decoded a group per distinct rules, one group a :meth:`poll`, the
    least work first (source tokens x beam), so that the short requests of a batch are answered before a large
    request's group is decoded rather than after it."""

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
            error = failure(e)
            return [(key, error) for key, _ in group]
        finished: list[tuple[int, Any]] = []
        pos = 0
        for key, sources in group:
            finished.append((key, results[pos : pos + len(sources)]))
            pos += len(sources)
        return finished


class StreamLane:
    """mtpipe's engine with continuous batching (:class:`mtpipe.engine.streaming.StreamDecoder`) on its prepared
    model: a request's sentences join the running search at the next decoder step and it is answered the step its
    last one ends. One stream per distinct rules (requests asking for another beam, alpha or nbest are decoded side
    by side), one decoder step per :meth:`poll`, the streams sharing the decoding time in proportion to the requests
    in them: one request alone at beam 8, whose steps cost more, must not halve the pace of many at beam 4 (each
    stream's clock advances by a step's seconds / its requests; the stream whose clock is behind steps next)."""

    continuous = True

    def __init__(self, model: Any, device: Any, precision: str, max_tokens: int) -> None:
        self.model, self.device, self.precision, self.max_tokens = model, device, precision, max_tokens
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
        return self.model.settings()

    def poll(self) -> list[tuple[int, Any]]:
        import torch

        from mtpipe.engine.variants import decoding_context

        for rules, stream in list(self.streams.items()):
            if not len(stream):
                del self.streams[rules], self.members[rules], self.clock[rules]
        if not self.streams:
            return []
        rules = min(self.streams, key=self.clock.__getitem__)  # the stream whose turn it is
        start = time.perf_counter()
        try:
            # bf16: the autocast that mtpipe's engine enters for precision bf16, around the ready bf16 copy.
            with torch.inference_mode(), decoding_context(self.device, self.precision):
                done = self.streams[rules].step()
        except Exception as e:  # noqa: BLE001 - the stream's requests fail (500); the server goes on
            error = failure(e)
            finished = [(key, error) for key in self.members.pop(rules) if self.pending.pop(key, None)]
            del self.streams[rules], self.clock[rules]
            return finished
        self.clock[rules] += (time.perf_counter() - start) / max(1, len(self.members[rules]))
        return self._finished(rules, done)

    def _finished(self, rules: Any, done: list[tuple[Any, Any]]) -> list[tuple[int, Any]]:
        """The requests whose last sentence is among ``done``."""
        finished: list[tuple[int, Any]] = []
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


def warm_lane(lane: Lane, groups: Sequence[list[list[int]]], rules: Any, beams: Sequence[int] = ()) -> float:
    """Decode each of ``groups`` through ``lane``, at ``rules.beam`` and then at each of ``beams`` (each beam once;
    ``nbest`` capped at the beam), a group at a time; a continuous lane then also lets the last group join a
    sentence that is still decoding (past its first steps, so that rows that joined later are masked). The seconds
    it took; a failure raises the engine's own error. See :meth:`mtpipe.engine.protocol.Engine.warm_up` for why."""
    keys = itertools.count()
    start = time.perf_counter()

    def poll() -> None:
        for _, result in lane.poll():
            if isinstance(result, Exception):
                raise result.__cause__ if isinstance(result.__cause__, Exception) else result

    def drain() -> None:
        while lane.busy():
            poll()

    with lane.decoding():
        for beam in dict.fromkeys((rules.beam, *beams)):  # the default first, each beam once
            at_beam = dataclasses.replace(rules, beam=beam, nbest=min(rules.nbest, beam))
            for group in groups:
                lane.add(next(keys), group, at_beam)
                drain()
            if lane.continuous:
                several = groups[-1]
                lane.add(next(keys), [max(several, key=len)], at_beam)  # still decoding when the others join
                for _ in range(2):  # past the two eager steps: the next are compiled ...
                    poll()
                lane.add(next(keys), several, at_beam)  # ... and now with joined rows, earlier slots masked
                drain()
    return time.perf_counter() - start


__all__ = ["BatchLane", "StreamLane", "failure", "first_line", "warm_lane"]
