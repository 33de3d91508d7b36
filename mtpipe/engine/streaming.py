"""Continuous batching: mtpipe's engine decoding a stream of sentences, new ones joining between decoder steps.

A batch decoded to its end (:func:`mtpipe.engine.translate.translate_batches`) is right for a file: sorted by length, its
sentences finish together. A server's sentences arrive one by one with any length; decoded batch by batch, a short
sentence waits for the longest of its batch, and the batch shrinks to a few rows (slow steps) before the next one
can start. Here (iteration-level batching, Yu et al. 2022, "Orca: A Distributed Serving System for
Transformer-Based Generative Models") a sentence joins the running beam search at the next step and leaves it the
step it is done (:class:`mtpipe.engine.search.BeamSearch`), so the batch stays as full as the load allows and each sentence
is answered as soon as its own search ends.

A sentence's translation does not depend on its batch: beam search is per sentence, the encoder runs on the joining
sentences alone, and a row that joined later sees only its own positions
(:meth:`mtpipe.engine.cache.DecoderState.admit`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Hashable, Sequence

import torch

from mtpipe.artifacts import EOS_ID, PAD_ID
from mtpipe.engine.protocol import empty_output
from mtpipe.engine.search import BeamSearch, DecodeRules, Hypothesis


# Most decoder steps a waiting sentence waits for company before it joins the running batch alone.
ADMIT_EVERY = 4


@dataclasses.dataclass(frozen=True)
class ServedRules(DecodeRules):
    """The server's rules: the ``decode`` section's, with each sentence's output capped at ``max_output``
    (``serve.max_output_tokens``; 0: no cap of its own). ``max_len_a x S + max_len_b`` grows with the source and
    the model's positions may be many (1,024): a server bounds the decoder steps any one sentence may cost, whatever
    the decode section allows. Every engine asks :meth:`max_output_len`, so the cap reaches them all."""

    max_output: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_output < 0:
            raise ValueError(f"serve.max_output_tokens: {self.max_output} is not >= 0")

    def max_output_len(self, src_len: int, max_positions: int) -> int:
        longest = super().max_output_len(src_len, max_positions)
        return min(longest, self.max_output) if self.max_output else longest


class StreamDecoder:
    """One stream of sentences decoded under one set of :class:`~mtpipe.engine.search.DecodeRules` by ``model`` (a
    :class:`mtpipe.engine.variants.Prepared` model, already in its decoding precision; the caller enters the precision
    context and ``torch.inference_mode``).

    :meth:`add` queues a sentence under a key; :meth:`step` lets queued sentences in while the batch holds fewer than
    ``max_tokens`` source tokens (at least one sentence), runs one decoder step, and returns the sentences that are
    done with their ``nbest`` hypotheses.
    """

    def __init__(self, model: Any, rules: DecodeRules, max_tokens: int, device: torch.device | str = "cpu") -> None:
        self.model, self.rules, self.max_tokens, self.device = model, rules, max_tokens, torch.device(device)
        self.search = BeamSearch(lambda tokens, state: model.step(tokens, state, lazy=True), rules.beam,
                                 rules.penalty, rules.nbest, self.device, rules.stop_after, start_id=model.start_id,
                                 min_len=rules.min_len)
        self.waiting: collections.deque[tuple[Hashable, list[int]]] = collections.deque()
        self.tokens: dict[Hashable, int] = {}  # source tokens (with EOS) of each sentence in the batch
        self.ready: list[tuple[Hashable, list[Hypothesis]]] = []  # empty sources: answered at the next step
        self.since_admit = 0  # decoder steps since sentences last joined

    def add(self, key: Hashable, source: Sequence[int]) -> None:
        """Queue ``source`` (token ids without EOS, at most ``max_positions - 1``) under ``key``. An empty source
        translates to the empty output with score 0, as in ``mtpipe decode``."""
        if not source:
            self.ready.append((key, empty_output()))
        else:
            self.waiting.append((key, list(source)))

    def __len__(self) -> int:
        """Sentences queued or decoding."""
        return len(self.waiting) + len(self.tokens) + len(self.ready)

    def drop(self, unwanted: Callable[[Hashable], bool]) -> int:
        """Forget the queued sentences whose key is ``unwanted`` (a request whose client has gone): the number
        dropped. Sentences already in the running search decode to their end and come out of :meth:`step` as
        usual (the caller ignores them): rows cannot leave a beam search mid-way. The server hands a lane a request
        a chunk at a time (``serve.chunk_work``), so little of a large request is ever in the search."""
        before = len(self.waiting) + len(self.ready)
        self.waiting = collections.deque(item for item in self.waiting if not unwanted(item[0]))
        self.ready = [item for item in self.ready if not unwanted(item[0])]
        return before - len(self.waiting) - len(self.ready)

    def step(self) -> list[tuple[Hashable, list[Hypothesis]]]:
        """Admit what fits, run one decoder step; the sentences done, each with its hypotheses, best first."""
        done, self.ready = self.ready, []
        self._admit()
        if len(self.search):
            for key, hyps in self.search.advance():
                del self.tokens[key]
                done.append((key, hyps))
        return done

    def _admit(self) -> None:
        # Sentences join a running batch in groups: each joining costs an encoder pass and a copy of the whole
        # self-attention cache, so they join once a group of them is waiting (an eighth of the batch), or after
        # ADMIT_EVERY steps, at most a few milliseconds late.
        self.since_admit += 1
        live = len(self.tokens)
        if live and len(self.waiting) * 8 < live and self.since_admit < ADMIT_EVERY:
            return
        budget = self.max_tokens - sum(self.tokens.values())
        joining: list[tuple[Hashable, list[int]]] = []
        while self.waiting and (len(self.waiting[0][1]) + 1 <= budget or not (self.tokens or joining)):
            key, source = self.waiting.popleft()
            budget -= len(source) + 1
            joining.append((key, source))
        if not joining:
            return
        self.since_admit = 0
        width = max(len(s) for _, s in joining) + 1
        src = torch.full((len(joining), width), PAD_ID, dtype=torch.long)  # [m, S] right-padded
        for row, (_, source) in enumerate(joining):
            src[row, : len(source) + 1] = torch.tensor([*source, EOS_ID], dtype=torch.long)
        memory, src_mask = self.model.encode(src.to(self.device))  # the joining sentences only
        positions = self.model.cfg.max_positions
        self.search.admit([key for key, _ in joining], self.model.start(memory, src_mask),
                          [self.rules.max_output_len(len(s), positions) for _, s in joining])
        for key, source in joining:
            self.tokens[key] = len(source) + 1


__all__ = ["ServedRules", "StreamDecoder"]
