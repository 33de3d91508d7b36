"""mtpipe's own engine: token-id sources translated in length-sorted batches by beam search
(:func:`mtpipe.engine.search.beam_search`) under :class:`~mtpipe.engine.search.DecodeRules` (the paper's section 6.1:
beam 4, alpha 0.6, maximum output length input + 50, early termination).

Speed: sentences are sorted by length and packed into batches of at most ``max_tokens`` padded source tokens
(:func:`batches_by_tokens`); the encoder runs once per batch and its keys/values are projected once
(``Prepared.start``) and kept once per sentence, its beams attending to them together; each step computes the new
position only (the self-attention cache written in place, ``Prepared.step``); sentences that are done leave the
batch at once (``state.select``); ``torch.inference_mode`` and optional bf16 autocast (CPU and GPU).

The model decodes as :func:`mtpipe.engine.variants.prepare` prepares it (its bf16 or int8 variant, the step runner
of ``decode.compile`` / ``decode.cuda_graphs``). :func:`translate_batches` prepares the model it is given for one
call (training's validation BLEU, the attention stage, the tests: the weights change between calls);
:class:`MtpipeEngine` prepares its model once, when it opens, and decodes every call with that snapshot (a file's
batches, stdin's lines, a server's requests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from mtpipe import platform
from mtpipe.artifacts import EOS_ID, PAD_ID
from mtpipe.config import DecodeConfig, to_dict
from mtpipe.engine.protocol import Lane, ModelSource, blank_results
from mtpipe.engine.sampling import sentence_key
from mtpipe.engine.search import DecodeRules, Hypothesis, beam_search


def batches_by_tokens(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped into batches of at most ``max_tokens`` padded tokens, longest sentences first (a longer
    sentence alone over the budget gets a batch of its own). Sorting by length keeps padding, and so wasted
    encoder and cross-attention work, small."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = lengths[cur[0]] if cur else lengths[i]  # sorted longest first: the first one sets the padded width
        if cur and (len(cur) + 1) * width > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def search_batches(model: Any, sources: Sequence[Sequence[int]], rules: DecodeRules, *, max_tokens: int,
                   device: torch.device, on_done: Callable[[int], None] | None = None,
                   step: Callable[..., Any] | None = None,
                   start: Callable[[Any, Any], Any] | None = None) -> list[list[Hypothesis]]:
    """The batches of ``sources`` searched on ``model`` (prepared, the caller inside its decoding context): each
    batch encoded once, its decoding state started (``start(memory, src_mask)``, by default the model's own:
    cross-attention keys/values projected once) and searched with ``step`` (by default the model's cached step,
    its log-probabilities made on demand). A reference step without a cache passes its own ``step`` and
    ``start``. Under ``rules.sampler`` each sentence is sampled, keyed by its own tokens
    (:func:`mtpipe.engine.sampling.sentence_key`: its sample does not depend on its batch)."""
    max_positions = model.cfg.max_positions
    lengths = [len(s) + 1 for s in sources]  # + EOS
    results, todo = blank_results(sources, on_done)
    step = step or (lambda tokens, state: model.step(tokens, state, lazy=True))
    start = start or model.start
    sampler = rules.sampler  # None: search
    for sub in batches_by_tokens([lengths[i] for i in todo], max_tokens):
        batch = [todo[j] for j in sub]
        width = lengths[batch[0]]
        src = torch.full((len(batch), width), PAD_ID, dtype=torch.long)  # [B, S] right-padded
        for row, i in enumerate(batch):
            src[row, : lengths[i]] = torch.tensor([*sources[i], EOS_ID], dtype=torch.long)
        src = src.to(device)
        memory, src_mask = model.encode(src)  # once per batch; the beams share it
        state = start(memory, src_mask)
        max_lens = [rules.max_output_len(lengths[i] - 1, max_positions) for i in batch]
        hyps = beam_search(step, state, max_lens, rules.beam, rules.penalty, rules.nbest, device, on_done,
                           rules.stop_after, start_id=model.start_id, min_len=rules.min_len, sampler=sampler,
                           sample_keys=None if sampler is None else [sentence_key(sources[i]) for i in batch])
        for i, h in zip(batch, hyps):
            results[i] = h
    return results


def search_prepared(prepared: Any, sources: Sequence[Sequence[int]], rules: DecodeRules, *, max_tokens: int,
                    precision: str, device: torch.device,
                    on_done: Callable[[int], None] | None = None) -> list[list[Hypothesis]]:
    """:func:`search_batches` on a prepared model, inside its decoding context: ``torch.inference_mode``, the
    precision's autocast (:func:`mtpipe.engine.variants.decoding_context`) and the step runner's settings, entered
    once around the whole decode, not at every step."""
    from mtpipe.engine.variants import decoding_context

    with torch.inference_mode(), decoding_context(device, precision), prepared.settings():
        return search_batches(prepared, sources, rules, max_tokens=max_tokens, device=device, on_done=on_done)


def translate_batches(model: Any, sources: Sequence[Sequence[int]], rules: DecodeRules, *, max_tokens: int,
                      precision: str = "fp32", device: torch.device | str = "cpu",
                      on_done: Callable[[int], None] | None = None, compile: str = "off",
                      cuda_graphs: bool = False) -> list[list[Hypothesis]]:
    """Translate token-id sources (without EOS; at most ``max_positions - 1`` tokens each) with ``model`` prepared
    for this call at ``precision`` (``compile``: ``decode.compile``, ``cuda_graphs``: ``decode.cuda_graphs``).

    Returns the ``rules.nbest`` best hypotheses of every source, in input order. An empty source (a blank input
    line) is not decoded: its translation is empty, with score 0."""
    from mtpipe.engine.variants import prepare

    device = torch.device(device)
    prepared = prepare(model, precision, device, compile=compile, cuda_graphs=cuda_graphs)
    return search_prepared(prepared, sources, rules, max_tokens=max_tokens, precision=precision, device=device,
                           on_done=on_done)


def open_device(cfg: DecodeConfig) -> torch.device:
    """Where an engine decodes (``decode.device``, :func:`mtpipe.platform.decoding_device`), the CPU's
    allocator tuned for decoding when it is the CPU."""
    from mtpipe.engine import runtime

    device = platform.decoding_device(cfg.device, cfg.precision)
    if device.type == "cpu":
        runtime.tune_cpu_allocator()
    return device


@dataclass
class MtpipeEngine:
    """mtpipe's beam search on a checkpoint's model, as an :class:`~mtpipe.engine.protocol.Engine`, holding the
    model prepared once (:func:`mtpipe.engine.variants.prepare`): stdin's lines and a server's requests are many
    calls, and each new variant would copy (or quantise) every weight again."""

    prepared: Any  # mtpipe.engine.variants.Prepared, on ``device``
    device: torch.device
    precision: str
    max_tokens: int
    threads: int = 0  # torch's CPU threads while translating (0: leave them)
    plan: Any = None  # the mtpipe.engine.pruning.PrunePlan applied (decode.prune), or None
    compiled: bool = False  # decode.compile

    @classmethod
    def open(cls, model: Any, cfg: DecodeConfig, lone_graph: bool = False) -> "MtpipeEngine":
        """``model`` pruned by ``decode.prune``, moved to the GPU when there is one, and prepared to decode.
        ``lone_graph`` (decode.compile): a lone sentence in a graph of its own, for processes that translate one
        sentence at a time for long (``mtpipe serve``, stdin) and build it in their warm-up; else it runs as two."""
        from mtpipe.console import info
        from mtpipe.engine.pruning import prune, prune_plan
        from mtpipe.engine.step_package import PackageCache
        from mtpipe.engine.variants import prepare

        plan = prune_plan(model.cfg, cfg.prune, where="decode.prune")
        if plan is not None:
            info(f"pruned (decode.prune={cfg.prune!r}): {plan.describe(model.cfg)}")
            model = prune(model, plan)
        device = open_device(cfg)
        prepared = prepare(model.to(device), cfg.precision, device, compile=cfg.compile,
                           cuda_graphs=cfg.cuda_graphs, lone_graph=lone_graph,
                           cache=PackageCache(cfg.package_cache, cfg.package_cache_gb))
        return cls(prepared, device, cfg.precision, cfg.max_tokens, cfg.threads, plan,
                   cfg.compile != "off")

    @property
    def max_positions(self) -> int:
        return self.prepared.cfg.max_positions

    def describe(self) -> str:
        return str(self.device)

    def settings(self, rules: DecodeRules) -> str:
        if rules.beam == 1:
            return self.precision  # greedy: no stopping rule to name
        return (f"{self.precision}, stop {rules.stop}"
                + (f" (patience {rules.patience:g})" if rules.stop == "finished" else ""))

    def note(self, rules: DecodeRules) -> str | None:
        return None

    def facts(self, rules: DecodeRules) -> dict[str, Any]:
        plan = self.plan
        return {"device": self.describe(), "precision": self.precision, "search": self.settings(rules),
                "max_positions": self.max_positions, "model_config": to_dict(self.prepared.cfg),
                "pruned": None if plan is None else {"encoder_kept": list(plan.encoder),
                                                     "decoder_kept": list(plan.decoder)}}

    def translate(self, sources: Sequence[Sequence[int]], rules: DecodeRules,
                  on_done: Callable[[int], None] | None = None) -> list[list[Hypothesis]]:
        with platform.threads(self.threads):  # as they were after (it may be called in-process: tests, notebooks)
            return search_prepared(self.prepared, sources, rules, max_tokens=self.max_tokens,
                                   precision=self.precision, device=self.device, on_done=on_done)

    def lane(self, continuous: bool = False) -> Lane:
        """Batch by batch (:meth:`translate`), or continuously on the prepared model
        (:class:`~mtpipe.engine.lanes.StreamLane`), which the lane then drives itself: the process's CPU threads are
        set here, for good."""
        from mtpipe.engine.lanes import BatchLane, StreamLane

        if not continuous:
            return BatchLane(self.translate)
        platform.set_threads(self.threads)
        return StreamLane(self.prepared, self.device, self.precision, self.max_tokens)

    def warm_up(self, groups: Sequence[list[list[int]]], rules: DecodeRules, beams: Sequence[int] = (),
                continuous: bool = False) -> float:
        from mtpipe.engine.lanes import warm_lane

        return warm_lane(self.lane(continuous), groups, rules, beams)

    def close(self, wait: float = 30) -> None:
        """Nothing to release: the prepared model goes with the engine."""


@dataclass
class MtpipeSource(ModelSource):
    """How mtpipe's engine opens (its entry in :mod:`mtpipe.registry`): a checkpoint, opened as every command opens
    one (:func:`mtpipe.engine.loading.open_checkpoint`; an export is refused in one line), then
    :meth:`MtpipeEngine.open` on its model."""

    loaded: Any = field(default=None, repr=False)  # the mtpipe.engine.loading.ModelAndVocab

    @classmethod
    def check(cls, cfg: DecodeConfig, checkpoint: Path, command: str) -> None:
        from mtpipe import artifacts
        from mtpipe.engine.loading import refuse_export

        refuse_export(checkpoint, command)
        artifacts.read_manifest(checkpoint, "checkpoint")

    @classmethod
    def locate(cls, cfg: DecodeConfig, checkpoint: Path, tokens: Path | None, command: str) -> "MtpipeSource":
        from mtpipe.engine.loading import open_checkpoint

        loaded = open_checkpoint(checkpoint, tokens, command)
        return cls(cfg, checkpoint, loaded.sp, loaded.ck.step, loaded.tokens, loaded=loaded)

    def open(self, lone_graph: bool = False) -> MtpipeEngine:
        return MtpipeEngine.open(self.loaded.model, self.cfg, lone_graph=lone_graph)


__all__ = ["MtpipeEngine", "MtpipeSource", "batches_by_tokens", "open_device", "search_batches", "search_prepared",
           "translate_batches"]
