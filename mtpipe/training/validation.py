"""Validation during training (the paper's section 6.2 dev set) and early stopping on it.

* Loss and perplexity on the valid batches every ``train.valid_every_steps`` (:meth:`Validator.loss`).
* BLEU of greedy translations of a fixed sample of the valid split every ``train.valid_bleu_every_steps``
  (:meth:`Validator.bleu`).
* Each scheduled validation of ``train.stop_metric`` is booked for early stopping (:func:`book`,
  :class:`mtpipe.training.state.Best`, part of the trainer state, so a resume continues the count): one that
  improves on the best makes that step's checkpoint the best one, which ``keep_last`` never removes; ``train.patience``
  such validations in a row without improvement stop training.

Validation leaves training as it was: the model goes back to train mode and the RNG state is put back, so a run that
validates stays the run it would have been (exact resume).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mtpipe import artifacts, platform
from mtpipe.config import TrainConfig
from mtpipe.console import progress
from mtpipe.errors import MtpipeError
from mtpipe.model.ops import attention_kernels
from mtpipe.training import distributed
from mtpipe.training.batches import TrainData
from mtpipe.training.plan import train_batch
from mtpipe.training.state import TrainState, rng_state, set_rng_state


@dataclass
class ValidBleu:
    """Validation BLEU's fixed sample of the valid split (:func:`bleu_sample`)."""

    sources: list[list[int]]  # source pieces without EOS, as the decoder takes them
    references: list[str]  # the target pieces detokenised by ``sp``
    sp: Any  # sentencepiece.SentencePieceProcessor of the bpe artifact


def bleu_sample(cfg: TrainConfig, data: TrainData, tokens: Path, batches: Path, max_positions: int) -> ValidBleu | None:
    """The fixed valid sample that validation BLEU decodes (``train.valid_bleu_sentences``, evenly spaced over the
    split so that it is the same at every validation and on every rank), its references detokenised from the bpe
    artifact's pieces, and the SentencePiece model; None when validation BLEU is off."""
    if cfg.valid_bleu_every_steps == 0:
        return None
    vt = data.valid_tokens
    if vt is None:
        raise MtpipeError(f"{batches}: train.valid_bleu_every_steps={cfg.valid_bleu_every_steps} needs a "
                          "valid split and these batches have none that the model can take; set it to 0")
    from mtpipe.engine.loading import SPM_MODEL
    from mtpipe.engine.search import max_source_len

    sp = artifacts.load_spm(artifacts.verify_file(tokens, SPM_MODEL, artifacts.read_manifest(tokens, "tokens")))
    limit = max_source_len(max_positions)
    n = len(vt.ids)
    want = min(cfg.valid_bleu_sentences or n, n)
    rows = np.unique(np.linspace(0, n - 1, want).round().astype(np.int64)) if n else np.zeros(0, np.int64)
    rows = [int(r) for r in rows if vt.src_len[r] <= limit]  # longer ones would not fit the positions table
    if not rows:
        raise MtpipeError(f"{tokens}: no valid sentence fits model.max_positions={max_positions} for "
                          "train.valid_bleu_every_steps; set it to 0")
    sources = [vt.src[vt.src_off[r] : vt.src_off[r + 1]].tolist() for r in rows]
    refs = [sp.decode(vt.tgt[vt.tgt_off[r] : vt.tgt_off[r + 1]].tolist()) for r in rows]
    return ValidBleu(sources=sources, references=refs, sp=sp)


class Validator:
    """The validations of one rank of a run: ranks split the work and every rank gets the same numbers."""

    def __init__(self, cfg: TrainConfig, data: TrainData, model: nn.Module, tokens: Path, batches: Path,
                 device: torch.device, precision: str, rank: int, world: int):
        self.cfg, self.data, self.model = cfg, data, model
        self.device, self.precision, self.rank, self.world = device, precision, rank, world
        self.sample = bleu_sample(cfg, data, tokens, batches, model.cfg.max_positions)  # None: BLEU off

    def scheduled(self, state: TrainState, loss_module: nn.Module, bar: Any = None) -> dict[str, float]:
        """The validations due at this step (``{}``: none): loss/perplexity every ``train.valid_every_steps``, BLEU
        every ``train.valid_bleu_every_steps``."""
        cfg, vals = self.cfg, {}
        if cfg.valid_every_steps and state.step % cfg.valid_every_steps == 0 and self.data.valid is not None:
            vals.update(self.loss(loss_module, state))
        if self.sample is not None and state.step % cfg.valid_bleu_every_steps == 0:
            vals["valid/bleu"] = self.bleu(state, bar)
        return vals

    def final(self, state: TrainState, loss_module: nn.Module) -> dict[str, float]:
        """The last step's metrics, off the validation schedule, where the schedule did not measure them."""
        vals: dict[str, float] = {}
        if self.data.valid is not None and state.last_valid_step != state.step:
            vals.update(self.loss(loss_module, state))
        if self.sample is not None and state.last_bleu_step != state.step and state.step > 0:
            vals["valid/bleu"] = self.bleu(state)
        return vals

    def loss(self, loss_module: nn.Module, state: TrainState) -> dict[str, float]:
        """Loss and perplexity on the valid batches; ranks split the batches and sum (section 6.2's dev set).
        ``loss_module``: the training loss (:class:`mtpipe.training.update.LossModule`), not DDP's wrapper. The
        RNG state is put back, as :meth:`bleu` does: training's dropout never depends on the validation schedule
        (the trainer validates after the next update has begun)."""
        valid, valid_tokens = self.data.valid, self.data.valid_tokens
        assert valid is not None and valid_tokens is not None
        rng = rng_state(self.device)
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss, nll]
        with torch.no_grad():
            for i in range(self.rank, len(valid), self.world):
                batch = train_batch(valid_tokens, valid.batch(i), self.model.start_id).to(self.device)
                with platform.autocast(self.device, self.precision), attention_kernels(self.device):
                    loss, nll = loss_module(*batch)
                sums += torch.stack([loss, nll]).double()
        distributed.all_reduce_sum(sums)
        self.model.train()
        set_rng_state(rng, self.device)
        loss, nll = (float(x) for x in sums.tolist())
        ntok = int(valid.tgt_tokens.sum())
        state.last_valid_step = state.step
        state.last_valid = {"valid/loss": loss / ntok, "valid/nll": nll / ntok,
                            "valid/ppl": math.exp(min(nll / ntok, 700.0))}
        return state.last_valid

    def bleu(self, state: TrainState, bar: Any = None) -> float:
        """sacreBLEU (13a, mixed case) of the model's translations of the valid sample against its references, by
        :func:`mtpipe.engine.translate.translate_batches` (greedy search at ``train.valid_bleu_beam`` 1; the paper's
        rules of section 6.1 otherwise: length penalty alpha 0.6, at most input + 50 tokens). Ranks translate every
        world-size-th sentence and rank 0 scores them all (one number, handed to every rank, so early stopping
        decides alike everywhere). The bare model (not DDP's wrapper) decodes in eval mode and goes back to train
        mode; the RNG state is put back. ``bar``: a live progress bar to show the decoding on (else one of its
        own)."""
        v = self.sample
        assert v is not None
        mine = list(range(self.rank, len(v.sources), self.world))
        texts = v.sp.decode([r[0].tokens for r in self._translate([v.sources[i] for i in mine], bar)])
        gathered = distributed.all_gather_object(list(zip(mine, texts)))  # [world][(index, hypothesis)]
        score = None
        if distributed.is_rank0():
            from sacrebleu.metrics import BLEU

            hyps = dict(pair for part in gathered for pair in part)
            score = float(BLEU().corpus_score([hyps[i] for i in range(len(v.sources))], [v.references]).score)
        bleu = float(distributed.broadcast_object(score))
        state.last_bleu_step, state.last_bleu = state.step, bleu
        return bleu

    def _translate(self, sources: list[list[int]], bar: Any) -> list[Any]:
        """This rank's share of the sample, translated in eval mode; train mode and the RNG state put back."""
        from mtpipe.engine.search import DecodeRules
        from mtpipe.engine.translate import translate_batches

        cfg = self.cfg
        rules = DecodeRules(beam=cfg.valid_bleu_beam)
        rng = rng_state(self.device)
        try:
            with contextlib.ExitStack() as stack:
                if bar is None:
                    bar = stack.enter_context(progress())
                task = bar.add_task("valid BLEU", total=len(sources), stats="")
                results = translate_batches(self.model, sources, rules,
                                            max_tokens=max(self.data.max_tokens // cfg.valid_bleu_beam, 1),
                                            device=self.device, on_done=lambda n: bar.advance(task, n))
                bar.remove_task(task)
        finally:
            self.model.train()
            set_rng_state(rng, self.device)
        return results


def book(state: TrainState, cfg: TrainConfig, vals: dict[str, float], line: str) -> tuple[str, bool]:
    """Book a scheduled validation's ``vals`` for early stopping (:meth:`mtpipe.training.state.Best.update`) when it
    measured ``train.stop_metric``; returns its log ``line`` with the verdict added, and whether it is the new
    best (its step's checkpoint is then written, and kept)."""
    curve = artifacts.STOP_METRICS[cfg.stop_metric][0]
    if curve not in vals:
        return line, False
    best = state.best
    if best.update(cfg.stop_metric, vals[curve], state.step):
        return line + f" (best {cfg.stop_metric} so far)", True
    return line + (f" (no improvement on {best.value:.4g} at update {best.step:,}: {best.bad}"
                   + (f" of patience {cfg.patience})" if cfg.patience else ")")), False
