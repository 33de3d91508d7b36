"""``mtpipe train``: the Transformer trained as in the paper's section 5, on 1 process or N under torchrun.

* Data (5.1, :mod:`mtpipe.training.batches`): the bucket artifact's token-budget batches of the bpe artifact's sentences; an
  update takes the next ``world_size * accum`` batches of the epoch's order, rank r every world_size-th of them.
* Batch size (5.1, "approximately 25000 source tokens and 25000 target tokens"): ``train.tokens_per_update`` sets
  gradient accumulation ``accum = ceil(tokens_per_update / (world_size * bucket.max_tokens))``, so 1 GPU and 8 GPUs
  train the same global batch. DDP all-reduces gradients once per update (``no_sync`` on earlier micro-batches).
* Loss (5.4): label-smoothed cross-entropy (:mod:`mtpipe.training.loss`) summed over the real target tokens of the whole
  update (all micro-batches, all ranks) and divided by their count: the gradient equals the one-process gradient.
  Logits are computed only for non-pad positions (``model.features`` -> boolean select -> the shared embedding
  projection), a block of rows at a time inside the loss, which also makes their gradient there.
* Optimizer (5.3): Adam(beta1, beta2, eps) with ``lr = lr_scale * d_model^-0.5 * min(step^-0.5, step *
  warmup^-1.5)``, optional gradient-norm clipping. Precision: bf16 autocast (GPU, and CPUs with AMX/AVX512-BF16),
  fp16 autocast + grad scaler (GPU), fp32 (TF32 matmuls on GPU); optional ``torch.compile``.
* Regularisers beyond the paper (off by default): LayerDrop (``model.layerdrop``, drawn inside the model; DDP then
  expects unused parameters) and Scheduled DropHead (``train.drophead_start/_end``): the rate of
  :func:`drophead_rate` for each update is set on the model (:meth:`mtpipe.model.transformer.Transformer.set_drophead`).
* Checkpoints: ``OUT/checkpoints/step_{step:08d}`` (:func:`mtpipe.writing.write_checkpoint`, rank 0, atomic), the
  last ``train.keep_last`` kept. ``trainer.pt`` holds everything for an exact resume (:mod:`mtpipe.training.resume`). The
  same command on the same ``OUT`` continues from the latest checkpoint, and the loss curve from there equals the
  uninterrupted run's (bitwise on CPU).
* Metrics (:mod:`mtpipe.training.metrics`): dvclive under ``OUT/live`` (``plots/metrics/{train,valid}/*.tsv`` with ``step``
  as x, for ``dvc plots``), ``OUT/train.json`` (final summary), ``OUT/train.log`` (the same lines as plain text,
  appended across resumes), a rich progress bar (its time left and fill honour ``train.max_time``) and summary table.
* Validation (section 6.2's dev set): loss/perplexity every ``train.valid_every_steps``; BLEU of greedy translations
  of a fixed valid sample every ``train.valid_bleu_every_steps`` (:meth:`Trainer.valid_bleu`). Each validation of
  ``train.stop_metric`` that improves on the best writes that step's checkpoint, which ``keep_last`` never removes
  (``OUT/best.json``); ``train.patience`` such validations in a row without improvement stop training
  (:class:`mtpipe.training.resume.Best`, part of the trainer state, so a resume continues the count).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor, nn

from mtpipe import artifacts, writing

from mtpipe.training import distributed

from mtpipe.training import metrics

from mtpipe.training import resume

from mtpipe.engine import runtime
from mtpipe.artifacts import PAD_ID
from mtpipe.training.batches import (
    collate,
    epoch_order,
    load_train_data,
    rank_batches,
    to_device,
)
from mtpipe.config import ModelConfig, TrainConfig, to_dict
from mtpipe.console import console, info, progress, warn
from mtpipe.errors import MtpipeError
from mtpipe.model.kernels import attention_kernels, drop_decoding_copies
from mtpipe.training.loss import projected_label_smoothed_nll
from mtpipe.training.metrics import Metrics, TextLog, Throughput, Window
from mtpipe.training.resume import (
    TrainState,
    changed_trajectory_keys,
    check_resumable,
    list_checkpoints,
)

# The public API (check_resumable, changed_trajectory_keys, list_checkpoints live in mtpipe.training.resume).
__all__ = ["LossModule", "TrainState", "Trainer", "UpdateResult", "Updater", "changed_trajectory_keys",
           "check_resumable", "drophead_rate", "learning_rate", "list_checkpoints", "make_train_step", "train_model"]


# --------------------------------------------------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------------------------------------------------


def learning_rate(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """Section 5.3: ``lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)``, times ``scale``.

    ``step`` counts updates from 1: linear warm-up to the peak at ``step = warmup``, then inverse square root decay.
    """
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def linear_learning_rate(step: int, progress: float, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """Budgeted training (Li et al., ICLR 2020: at a fixed budget, linear decay to zero beats step and inverse
    square root schedules): the paper's warm-up line ``scale * d_model^-0.5 * step * warmup^-1.5`` and a straight
    line from the paper's peak (``step = warmup``) at ``progress = 0`` down to zero at ``progress = 1``, the end of
    the budget; the lower of the two. ``progress`` is the fraction of the budget spent (:meth:`Trainer.progress`),
    so the decay follows wall-clock time when ``train.max_time`` is the budget that runs out first. When the
    warm-up is a sizeable part of the budget the lines cross below the paper's peak, rather than jumping at
    ``warmup``."""
    peak = scale * d_model**-0.5 * warmup**-0.5
    return peak * max(0.0, min(step / warmup, 1.0 - progress))


def drophead_rate(step: int, warmup: int, total: int, p_start: float, p_end: float | None = None) -> float:
    """Scheduled DropHead's V-shaped rate (Zhou et al. 2020) for update ``step`` (counted from 1, as in
    :func:`learning_rate`): ``p_start`` at step 0, falling linearly to 0 at ``step = warmup`` (the learning rate's
    peak), then rising linearly to ``p_end`` (``None``: ``p_start``) at ``step = total``, the last update.

    ``total`` is ``train.max_steps``, or the updates ``train.max_epochs`` amount to; a run limited by
    ``train.max_time`` alone has no known end, and the trainer refuses DropHead for it rather than guess.
    """
    p_end = p_start if p_end is None else p_end
    if step < warmup:
        return p_start * (1.0 - step / warmup)
    return p_end * min(1.0, (step - warmup) / max(total - warmup, 1))


# --------------------------------------------------------------------------------------------------------------------
# The update
# --------------------------------------------------------------------------------------------------------------------


class LossModule(nn.Module):
    """Features -> non-pad selection -> shared-embedding projection and smoothed loss sums, as one module so that
    DDP's forward (which prepares the gradient all-reduce) sees the whole computation."""

    def __init__(self, model: nn.Module, label_smoothing: float, features: Callable | None = None):
        super().__init__()
        self.model = model
        self.eps = label_smoothing
        self._features = features

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> tuple[Tensor, Tensor]:
        h = (self._features or self.model.features)(src, tgt_in)  # [B, T, D]
        real = tgt_out != PAD_ID  # [B, T]
        # The output projection (3.4) on real positions only, [N, D] -> [N, V], a block of rows at a time inside
        # the loss (mtpipe.training.loss): the whole [N, V] logits are never made.
        return projected_label_smoothed_nll(h[real], self.model.output_embedding(), self.model.out_bias,
                                            tgt_out[real], self.eps)


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.OutOfMemoryError):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


class Updater:
    """One optimizer update from micro-batches: shared by ``mtpipe train`` and ``bench/`` (via
    :func:`make_train_step`), so the benchmark times exactly what training runs."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, device: torch.device, precision: str):
        self.model, self.cfg, self.device, self.precision = model, cfg, device, precision
        features = None
        if cfg.compile and getattr(getattr(model, "cfg", None), "layerdrop", 0.0) > 0:
            raise MtpipeError("train.compile: not supported with model.layerdrop > 0 (every draw of skipped layers "
                              "would be another graph to compile); set --no-compile")
        if cfg.compile:
            runtime.separate_compile_cache()
            features = torch.compile(model.features, dynamic=True)
        self.loss_module = LossModule(model, cfg.label_smoothing, features)
        # DDP at world size > 1. LayerDrop leaves some parameters without a gradient in a step (on some ranks or all):
        # DDP must then look for them after each forward (a small cost, paid only with LayerDrop).
        layerdrop = getattr(getattr(model, "cfg", None), "layerdrop", 0.0) > 0
        self.module = distributed.wrap(self.loss_module, find_unused_parameters=layerdrop)
        self.params = [p for p in model.parameters() if p.requires_grad]
        kw: dict[str, Any] = dict(lr=1.0, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
        try:  # one fused kernel for the whole update (CUDA, and CPU in recent torch); else the foreach kernels
            self.optimizer = torch.optim.Adam(self.params, fused=True, **kw)
        except (RuntimeError, TypeError, ValueError):
            self.optimizer = torch.optim.Adam(self.params, foreach=True, **kw)
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
        # DDP regroups the gradients' all-reduce buckets after each process's first backward, in the order that
        # backward made them; beyond 2 processes the sums depend on the grouping, so a resumed process would sum its
        # first update in another grouping than the uninterrupted run. One backward of a zero loss first (no update,
        # the RNG state put back: _prime) gives every update of every process the learnt grouping: exact resumes.
        self.primed = self.module is self.loss_module or layerdrop  # no DDP, or DDP that never regroups

    def _prime(self, batch: tuple[Tensor, Tensor, Tensor]) -> None:
        rng = resume.rng_state(self.device)
        self.primed = True
        self.backward(*batch, scale=0.0, sync=True)
        self.optimizer.zero_grad(set_to_none=True)
        resume.set_rng_state(rng, self.device)

    def backward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, scale: float, sync: bool) -> Tensor:
        """Forward and backward of one micro-batch, accumulating the gradient of ``loss_sum * scale``.

        ``sync=False`` skips DDP's gradient all-reduce (an earlier micro-batch of an accumulated update).
        Returns the detached ``[loss_sum, nll_sum]`` (float32, on the device; no host sync).
        """
        if not self.primed:
            self._prime((src, tgt_in, tgt_out))
        with distributed.no_sync(self.module, skip=not sync):
            with runtime.autocast(self.device, self.precision), attention_kernels(self.device):
                loss, nll = self.module(src, tgt_in, tgt_out)
            scaled = loss * scale
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return torch.stack([loss.detach(), nll.detach()])

    def finish(self, lr: float, skip: bool) -> tuple[float, str]:
        """Apply the accumulated gradients at learning rate ``lr`` (or drop them: ``skip``).

        Returns ``(grad_norm, status)``: ``ok``; ``skipped`` (``skip``, or a non-finite gradient norm); ``overflow``
        (fp16: the grad scaler found inf/nan gradients, skipped the step and lowered its scale, as designed).
        The norm is measured before clipping (and after unscaling).
        """
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.cfg.clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        norm_f = float(norm)
        if not skip and self.scaler is None and not math.isfinite(norm_f):
            skip = True
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler is not None:
                self.scaler.update()  # unscale_ was called: the scaler expects update() before the next unscale_
            return norm_f, "skipped"
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        status = "ok"
        if self.scaler is not None:
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scaler.get_scale() < before:
                status = "overflow"
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm_f, status


def make_train_step(model: nn.Module, cfg: TrainConfig) -> Callable[[Tensor, Tensor, Tensor], float]:
    """A one-process training update ``step(src, tgt_in, tgt_out) -> loss per target token`` with the schedule,
    precision and optimizer of ``cfg``: the same :class:`Updater` that ``mtpipe train`` runs (for benchmarks)."""
    device = next(model.parameters()).device
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    updater = Updater(model, cfg, device, runtime.resolve_precision(cfg.precision, device))
    d_model = model.cfg.d_model
    count = [0]

    def step(src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> float:
        ntok = int((tgt_out != PAD_ID).sum())
        sums = updater.backward(src, tgt_in, tgt_out, scale=1.0 / ntok, sync=True)
        count[0] += 1
        updater.finish(learning_rate(count[0], d_model, cfg.warmup, cfg.lr_scale), skip=False)
        return float(sums[0]) / ntok

    return step


# --------------------------------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------------------------------


# Steps between glibc heap trims on CPU (runtime.trim_cpu_memory): measured on the small preset, resident memory
# stays near 3 GB instead of creeping past 7 GB over a 30-minute run, at no measurable cost in tokens/s.
_TRIM_EVERY_STEPS = 100


@dataclass
class ValidBleu:
    """Validation BLEU's fixed sample of the valid split (:meth:`Trainer._bleu_setup`)."""

    sources: list[list[int]]  # source pieces without EOS, as the decoder takes them
    references: list[str]  # the target pieces detokenised by ``sp``
    sp: Any  # sentencepiece.SentencePieceProcessor of the bpe artifact


@dataclass
class UpdateResult:
    """One update as every rank sees it after the update's all-reduce (the same values on all ranks)."""

    loss: float  # label-smoothed loss summed over the update's target tokens, all ranks (section 5.4)
    nll: float  # the unsmoothed negative log-likelihood, summed likewise
    grad_norm: float  # before clipping
    status: str  # Updater.finish's: "ok" (applied), "skipped" (non-finite loss or gradient), "overflow" (fp16)
    tgt_tokens: int  # real target tokens of the update (all ranks)
    src_tokens: int
    # Control flags decided on rank 0's clock and summed into the update's all-reduce, so that every rank saves
    # and stops at the same update without a collective of their own.
    save_due: bool  # train.save_every_minutes elapsed since the last checkpoint
    time_up: bool  # train.max_time reached

    @property
    def applied(self) -> bool:
        return self.status == "ok"


def check_stopping(cfg: TrainConfig) -> None:
    """The train params' rules that span several keys (each key's own range is checked when the section is built,
    :mod:`mtpipe.config`): something must stop training, and DropHead's schedule needs a known last step."""
    if not (cfg.max_steps > 0 or cfg.max_epochs > 0 or cfg.max_time > 0):
        raise MtpipeError("train.max_steps/max_epochs/max_time: are all 0: set at least one stopping criterion")
    if _drophead_on(cfg) and not (cfg.max_steps > 0 or cfg.max_epochs > 0):
        raise MtpipeError("train.drophead_start/drophead_end: the schedule rises to drophead_end at the last step: "
                          "set train.max_steps or train.max_epochs")
    if cfg.stop_metric == "valid_bleu" and cfg.valid_bleu_every_steps == 0:
        raise MtpipeError("train.stop_metric=valid_bleu: needs validation BLEU: set train.valid_bleu_every_steps > 0 "
                          "(or use stop_metric valid_ppl)")
    if cfg.patience and cfg.stop_metric == "valid_ppl" and cfg.valid_every_steps == 0:
        raise MtpipeError("train.patience: counts validations of valid_ppl, which train.valid_every_steps=0 turns "
                          "off: set train.valid_every_steps > 0")


def _drophead_on(cfg: TrainConfig) -> bool:
    return cfg.drophead_start > 0 or (cfg.drophead_end or 0.0) > 0


class Trainer:
    """The training run of one process (rank) of a launch: each update reads update -> log -> maybe validate ->
    maybe save (:meth:`train_loop`)."""

    def __init__(self, model_cfg: ModelConfig, cfg: TrainConfig, tokens: Path, batches: Path, out: Path,
                 decode: dict[str, Any] | None = None):
        self.cfg, self.tokens, self.batches, self.out = cfg, Path(tokens), Path(batches), Path(out)
        self.decode = dict(decode or {})  # the decode settings each checkpoint records (RECORDED_DECODE)
        self.ctx = distributed.context()
        self.rank, self.world = self.ctx.rank, self.ctx.world_size
        self.device = self.ctx.device
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        if self.device.type == "cuda":
            # TF32 tensor-core matmuls for the fp32 work (fp32 runs, and the fp32 ops that autocast keeps).
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.precision = runtime.resolve_precision(cfg.precision, self.device)
        self.data = load_train_data(self.tokens, self.batches, cfg.tokens_per_update, self.world)
        self.spm_files = self._spm_files() if self.rank == 0 else (None, None)
        self.model = self._build_model(model_cfg)
        self.model_config = to_dict(self.model.cfg)
        # The update count DropHead's schedule ends at (and the progress bar's total): max_steps, else what
        # max_epochs amount to; 0 when only max_time limits the run.
        self.total_steps = cfg.max_steps or cfg.max_epochs * self.data.usable // self.data.per_update
        self.state = TrainState()  # overwritten by a resume
        self.resumed_from: Path | None = None
        self.last_saved_step = -1
        self.last_lr = 0.0  # the rate of the last applied update (logged as train/lr)
        self.last_progress = 0.0  # rank 0: the budget progress after the last update (save_every_progress)
        self.last_train: dict[str, float] = {}  # the last logged train/* values, for the summary
        self.metrics = Metrics()
        self.text_log = TextLog()
        self.best_due = False  # a scheduled validation improved on the best: checkpoint this step
        self.bleu = self._bleu_setup()  # (sources, references, SentencePiece) of validation BLEU, or None
        # This invocation's clocks (monotonic seconds), restarted when the loop starts.
        self.loop_start = self.last_save_time = time.monotonic()
        self.seconds_before = 0.0  # training seconds of the invocations before this one
        self.throughput = Throughput(self.loop_start)
        # The model keys the params set, as given (before the preset fills the rest and d_k/d_v are derived): a
        # resume refused for another model names the key the user changed, not one derived from it.
        given = {k: v for k, v in to_dict(model_cfg).items() if v is not None}
        ck = resume.find_resume(self.out, cfg, self.model_config, self.data.vocab, self.device, given=given)
        if ck is not None:
            self.model.load_state_dict(ck.state_dict)
        self.updater = Updater(self.model, cfg, self.device, self.precision)
        if ck is not None:
            self._restore(ck)

    def _build_model(self, model_cfg: ModelConfig) -> nn.Module:
        """Identical initialisation on every rank (one seed), then one dropout stream per rank."""
        torch.manual_seed(self.cfg.seed)
        from mtpipe.model.transformer import Transformer

        model = Transformer(model_cfg, self.data.vocab["size"])
        train, max_positions = self.data.train, model.cfg.max_positions
        widest = int(max(train.src_width.max(), train.tgt_width.max()))
        if widest > max_positions:
            raise MtpipeError(f"{self.batches}: batches hold sequences of {widest} positions but "
                              f"model.max_positions={max_positions}; lower bucket.max_len or raise "
                              "model.max_positions")
        self.data.drop_long_valid(max_positions, self.batches)
        model.to(self.device)
        torch.manual_seed(resume.seed_for_rank(self.cfg.seed, self.rank))
        return model

    # -- resume --------------------------------------------------------------------------------------------------

    def _restore(self, ck: artifacts.Checkpoint) -> None:
        u, cfg = self.updater, self.cfg
        # Another world size than the checkpoint's: the same global batch, by accumulation (resume warns).
        self.data = d = resume.same_global_batch(ck, self.data, self.world, cfg.tokens_per_update)
        self.total_steps = cfg.max_steps or cfg.max_epochs * d.usable // d.per_update
        st = self.state = resume.restore(ck, u.optimizer, u.scaler, accum=self.data.accum, seed=self.cfg.seed,
                                         device=self.device)
        if ck.manifest.upstream.get("batches") not in (None, artifacts.manifest_hash(self.batches)):
            warn(f"{self.batches}: the batches changed since {ck.path.name} was written: continuing at the same "
                 "epoch and position of the new batch order (not an exact resume)")
        if st.position + self.data.per_update > self.data.usable:  # another world size can end the epoch earlier
            st.epoch, st.position = st.epoch + 1, 0
        self.resumed_from = ck.path
        self.last_saved_step = st.step  # the checkpoint itself: no need to write it again

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def _spm_files(self) -> tuple[Path | None, Path | None]:
        """(spm.model, spm.vocab) of the bpe artifact, which every checkpoint carries so that it decodes without
        the artifact; (None, None) when its spm.model is not the model its manifest's spm_sha256 names (the bpe
        stage never writes such an artifact)."""
        from mtpipe.engine.loading import SPM_MODEL

        m = artifacts.read_manifest(self.tokens, "tokens")
        spm = artifacts.verify_file(self.tokens, SPM_MODEL, m)
        if artifacts.bare_sha(m.files[SPM_MODEL]) != artifacts.bare_sha(self.data.vocab["spm_sha256"]):
            warn(f"{spm}: is not the SentencePiece model its manifest's spm_sha256 names; the checkpoints will not "
                 "carry it (decode them with --tokens)")
            return None, None
        vocab_file = artifacts.CHECKPOINT_SPM_VOCAB
        return spm, artifacts.verify_file(self.tokens, vocab_file, m) if vocab_file in m.files else None

    def save(self) -> None:
        """Checkpoint at the current step (a collective: every rank contributes its RNG state; rank 0 writes)."""
        rngs = distributed.all_gather_object(resume.rng_state(self.device))
        if distributed.is_rank0():
            st, u = self.state, self.updater
            ts = resume.trainer_state(st, u.optimizer, u.scaler, rngs, self.world, self.data.accum, self.cfg.seed)
            resume.write(self.out, self.model, self.model_config, self.data.vocab, ts, self.cfg,
                         upstream={"tokens": self.tokens, "batches": self.batches},
                         extra={"epoch": st.epoch, "world_size": self.world, "precision": self.precision,
                                "valid": self._valid_at_step(), "decode": self.decode},
                         spm=self.spm_files, seconds=st.train_seconds)
        self.last_saved_step = self.state.step
        self.best_due = False

    def _valid_at_step(self) -> dict[str, float]:
        """The validation metrics measured at the current step (``{}``: none), recorded in its checkpoint's manifest
        so that ``mtpipe average --select best`` can rank checkpoints."""
        st, out = self.state, {}
        if st.last_valid_step == st.step:
            out.update(st.last_valid)
        if st.last_bleu_step == st.step and st.last_bleu is not None:
            out["valid/bleu"] = st.last_bleu
        return out

    # -- validation ----------------------------------------------------------------------------------------------

    def valid_loss(self) -> dict[str, float]:
        """Loss and perplexity on the valid batches; ranks split the batches and sum (section 6.2's dev set)."""
        valid, valid_tokens = self.data.valid, self.data.valid_tokens
        assert valid is not None and valid_tokens is not None
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss, nll]
        with torch.no_grad():
            for i in range(self.rank, len(valid), self.world):
                batch = to_device(self.device, collate(valid_tokens, valid.batch(i), self.model.start_id))
                with runtime.autocast(self.device, self.precision), attention_kernels(self.device):
                    loss, nll = self.updater.loss_module(*batch)
                sums += torch.stack([loss, nll]).double()
        distributed.all_reduce_sum(sums)
        self.model.train()
        loss, nll = (float(x) for x in sums.tolist())
        ntok = int(valid.tgt_tokens.sum())
        self.state.last_valid_step = self.state.step
        self.state.last_valid = {"valid/loss": loss / ntok, "valid/nll": nll / ntok,
                                 "valid/ppl": math.exp(min(nll / ntok, 700.0))}
        return self.state.last_valid

    def _bleu_setup(self) -> ValidBleu | None:
        """The fixed valid sample that validation BLEU decodes (``train.valid_bleu_sentences``, evenly spaced over
        the split so that it is the same at every validation and on every rank), its references detokenised from the
        bpe artifact's pieces, and the SentencePiece model; None when validation BLEU is off."""
        cfg = self.cfg
        if cfg.valid_bleu_every_steps == 0:
            return None
        vt = self.data.valid_tokens
        if vt is None:
            raise MtpipeError(f"{self.batches}: train.valid_bleu_every_steps={cfg.valid_bleu_every_steps} needs a "
                              "valid split and these batches have none that the model can take; set it to 0")
        from mtpipe.stages.bpe import load_spm
        from mtpipe.engine.loading import SPM_MODEL
        from mtpipe.engine.search import max_source_len

        sp = load_spm(artifacts.verify_file(self.tokens, SPM_MODEL, artifacts.read_manifest(self.tokens, "tokens")))
        limit = max_source_len(self.model.cfg.max_positions)
        n = len(vt.ids)
        want = min(cfg.valid_bleu_sentences or n, n)
        rows = np.unique(np.linspace(0, n - 1, want).round().astype(np.int64)) if n else np.zeros(0, np.int64)
        rows = [int(r) for r in rows if vt.src_len[r] <= limit]  # longer ones would not fit the positions table
        if not rows:
            raise MtpipeError(f"{self.tokens}: no valid sentence fits model.max_positions="
                              f"{self.model.cfg.max_positions} for train.valid_bleu_every_steps; set it to 0")
        sources = [vt.src[vt.src_off[r] : vt.src_off[r + 1]].tolist() for r in rows]
        refs = [sp.decode(vt.tgt[vt.tgt_off[r] : vt.tgt_off[r + 1]].tolist()) for r in rows]
        return ValidBleu(sources=sources, references=refs, sp=sp)

    def valid_bleu(self, bar: Any = None) -> float:
        """sacreBLEU (13a, mixed case) of the model's translations of the valid sample against its references, by
        :func:`mtpipe.stages.decode.translate_batches` (greedy search at ``train.valid_bleu_beam`` 1; the paper's rules of
        section 6.1 otherwise: length penalty alpha 0.6, at most input + 50 tokens). Ranks translate every
        world-size-th sentence and rank 0 scores them all (one number, handed to every rank, so early stopping
        decides alike everywhere). The bare model (not DDP's wrapper) decodes in eval mode and goes back to train
        mode; the RNG state is put back, so a run that validates stays the run it would have been (exact resume).
        ``bar``: a live progress bar to show the decoding on (else one of its own)."""
        from mtpipe.stages.decode import translate_batches
        from mtpipe.engine.search import DecodeRules

        v, cfg = self.bleu, self.cfg
        assert v is not None
        mine = list(range(self.rank, len(v.sources), self.world))
        rules = DecodeRules(beam=cfg.valid_bleu_beam)
        rng = resume.rng_state(self.device)
        try:
            with contextlib.ExitStack() as stack:
                if bar is None:
                    bar = stack.enter_context(progress())
                task = bar.add_task("valid BLEU", total=len(mine), stats="")
                results = translate_batches(self.model, [v.sources[i] for i in mine], rules,
                                            max_tokens=max(self.data.max_tokens // cfg.valid_bleu_beam, 1),
                                            device=self.device, on_done=lambda n: bar.advance(task, n))
                bar.remove_task(task)
        finally:
            drop_decoding_copies(self.model)
            self.model.train()
            resume.set_rng_state(rng, self.device)
        texts = v.sp.decode([r[0].tokens for r in results])
        gathered = distributed.all_gather_object(list(zip(mine, texts)))  # [world][(index, hypothesis)]
        score = None
        if distributed.is_rank0():
            from sacrebleu.metrics import BLEU

            hyps = dict(pair for part in gathered for pair in part)
            score = float(BLEU().corpus_score([hyps[i] for i in range(len(v.sources))], [v.references]).score)
        bleu = float(distributed.broadcast_object(score))
        self.state.last_bleu_step, self.state.last_bleu = self.state.step, bleu
        return bleu

    # -- one update ----------------------------------------------------------------------------------------------

    def _update(self, order: np.ndarray, save_due: bool, time_up: bool, progress: float) -> UpdateResult:
        """One update: this rank's micro-batches, the all-reduced loss and control flags, and the optimizer step."""
        st, d = self.state, self.data
        group = order[st.position : st.position + d.per_update]
        ntok, nsrc = int(d.train.tgt_tokens[group].sum()), int(d.train.src_tokens[group].sum())
        if _drophead_on(self.cfg):
            self.model.set_drophead(self._drophead(st.step + 1))
        # DDP averages gradients over ranks: scale each rank's sum by world/ntok for the global per-token gradient.
        sums = self._forward_backward(order, scale=self.world / ntok)  # [2]: this rank's loss and nll sums
        flags = torch.tensor([float(save_due), float(time_up), progress], dtype=torch.float64, device=self.device)
        # One all-reduce for the loss and rank 0's flags and budget progress (the others send zeros):
        # [loss, nll, save_due, time_up, progress], summed over ranks.
        loss, nll, save_n, time_n, progress = distributed.all_reduce_sum(torch.cat([sums.double(), flags])).tolist()
        lr = self.learning_rate(st.step + 1, progress)
        self.last_lr = lr
        norm, status = self.updater.finish(lr, skip=not math.isfinite(loss))
        return UpdateResult(loss=loss, nll=nll, grad_norm=norm, status=status, tgt_tokens=ntok, src_tokens=nsrc,
                            save_due=save_n > 0, time_up=time_n > 0)

    def _forward_backward(self, order: np.ndarray, scale: float) -> Tensor:
        """Forward and backward of this rank's micro-batches of the update; DDP all-reduces the gradient with the
        last one. Returns the float32 ``[loss_sum, nll_sum]`` of this rank."""
        d = self.data
        sums = torch.zeros(2, dtype=torch.float32, device=self.device)
        mine = [int(b) for b in rank_batches(order, self.state.position, self.world, d.accum, self.rank)]
        for i, b in enumerate(mine):
            batch = to_device(self.device, collate(d.train_tokens, d.train.batch(b), self.model.start_id))
            try:
                sums += self.updater.backward(*batch, scale=scale, sync=i == len(mine) - 1)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                if not _is_oom(e):
                    raise
                raise self._oom_error(b, batch) from None
        return sums

    def _oom_error(self, b: int, batch: tuple[Tensor, ...]) -> MtpipeError:
        src, _, tgt = batch  # [B, S], [B, T], [B, T]
        max_tokens = self.data.max_tokens
        return MtpipeError(
            f"out of memory on {self.device} in train batch {b} ({src.shape[0]} sentences, {src.shape[1]} "
            f"source x {tgt.shape[1]} target positions, {int(self.data.train.tgt_tokens[b])} target tokens): "
            f"rebuild the batches with a smaller bucket.max_tokens (these have {max_tokens}), e.g. "
            f"`mtpipe bucket --max-tokens {max(max_tokens // 2, 1)}`; train.tokens_per_update keeps the "
            "update size by accumulating more batches"
        )

    def _account(self, r: UpdateResult, order: np.ndarray) -> np.ndarray:
        """Book the update into the state (applied, skipped or fp16 overflow), move on in the epoch's batch order
        (the next epoch's order when too few batches are left for another update) and return that order."""
        st, d = self.state, self.data
        st.position += d.per_update
        if r.status == "skipped":
            st.bad_steps += 1
            warn(f"update {st.step + 1}: non-finite loss ({r.loss / r.tgt_tokens:.4g}) or gradient norm "
                 f"({r.grad_norm:.4g}): skipped ({st.bad_steps} in a row)")
            if st.bad_steps >= self.cfg.max_bad_steps:
                raise MtpipeError(
                    f"training diverged: {st.bad_steps} updates in a row had a non-finite loss or gradient "
                    f"(last at update {st.step + 1}, epoch {st.epoch + 1}); lower train.lr_scale, set "
                    "train.clip_norm, or use train.precision=fp32"
                )
        elif r.status == "overflow":
            st.overflows += 1
        else:
            st.bad_steps = 0
            st.step += 1
            st.tgt_seen, st.src_seen = st.tgt_seen + r.tgt_tokens, st.src_seen + r.src_tokens
            st.window.add(r.loss, r.nll, r.tgt_tokens, r.grad_norm)
            self.throughput.add(r.tgt_tokens, r.src_tokens)
        if st.position + d.per_update > d.usable:
            st.epoch, st.position = st.epoch + 1, 0
            order = epoch_order(len(d.train), self.cfg.seed, st.epoch)
        st.train_seconds = self.seconds_before + time.monotonic() - self.loop_start
        return order

    # -- the loop ------------------------------------------------------------------------------------------------

    def train_loop(self) -> str:
        """Run updates until a stopping criterion; returns the reason. Each update: update -> log -> maybe
        validate -> maybe save (a checkpoint is written after the metrics it covers, so a resume rewinds to it)."""
        reason = self._stop_reason(time_up=False)
        if reason:  # a finished run started again
            return reason
        self.loop_start = self.last_save_time = time.monotonic()
        self.seconds_before = self.state.train_seconds
        self.last_progress = self.progress(self.seconds_before)
        self.throughput.restart(self.loop_start)
        order = epoch_order(len(self.data.train), self.cfg.seed, self.state.epoch)
        from rich.progress import TextColumn

        start_step = self.state.step
        with progress(TextColumn("{task.fields[stats]}")) as bar:
            task = bar.add_task("train", total=self.total_steps or None, completed=self.state.step, stats="",
                                **self._bar_fields(start_step))
            while not reason:
                result = self._update(order, *self._rank0_clock())
                order = self._account(result, order)
                if result.applied:
                    self._maybe_log(bar, task)
                    self._maybe_validate(bar)
                reason = self._stop_reason(result.time_up)
                if result.applied and not reason:
                    self._maybe_save(result.save_due or self.best_due)
                bar.update(task, completed=self.state.step, **self._bar_fields(start_step))
        return reason

    def _bar_fields(self, start_step: int) -> dict[str, float | None]:
        """The progress bar's time left and fill. Time left (:func:`mtpipe.training.metrics.remaining_seconds`): the sooner
        of the step plan's end, at this invocation's pace so far, and train.max_time's (rich alone would ignore the
        time limit). Fill: the budget spent (:meth:`progress`), so that a run train.max_time ends fills its bar as its
        minutes pass rather than stopping at a fraction of its epoch cap's updates."""
        elapsed = time.monotonic() - self.loop_start
        eta = metrics.remaining_seconds(self.state.step, self.total_steps, self.state.step - start_step, elapsed,
                                        self.seconds_before + elapsed, self.cfg.max_time)
        return {"eta_seconds": eta, "fraction": self.progress(self.seconds_before + elapsed)}

    def _rank0_clock(self) -> tuple[bool, bool, float]:
        """``(save_due, time_up, progress)`` by rank 0's clock (others say False, False, 0): the update's all-reduce
        hands rank 0's decision to every rank, so that ranks whose clocks differ still save, stop and set the
        learning rate alike at the same update."""
        if self.rank != 0:
            return False, False, 0.0
        now, cfg = time.monotonic(), self.cfg
        seconds = self.seconds_before + now - self.loop_start
        progress = self.progress(seconds)  # before this update: its learning rate's
        save_due = cfg.save_every_minutes > 0 and now - self.last_save_time >= 60 * cfg.save_every_minutes
        if cfg.save_every_progress > 0:
            # A checkpoint once this update takes progress across a multiple of save_every_progress (counting the
            # update itself, so max_steps=100 and 0.05 save at steps 5, 10, ...).
            after, every = self.progress(seconds, self.state.step + 1), cfg.save_every_progress
            save_due = save_due or math.floor(after / every + 1e-9) > math.floor(self.last_progress / every + 1e-9)
            self.last_progress = after
        time_up = cfg.max_time > 0 and seconds >= 60 * cfg.max_time
        return save_due, time_up, progress

    def progress(self, seconds: float, step: int | None = None) -> float:
        """The fraction of the budget spent after ``seconds`` of training and ``step`` updates (default: those
        applied): the largest of the fractions of ``max_steps``, ``max_epochs`` and ``max_time`` used (whichever runs
        out first ends training), in [0, 1]."""
        cfg, st = self.cfg, self.state
        parts = [0.0]
        if cfg.max_steps:
            parts.append((st.step if step is None else step) / cfg.max_steps)
        if cfg.max_epochs:
            parts.append((st.epoch + st.position / self.data.usable) / cfg.max_epochs)
        if cfg.max_time:
            parts.append(seconds / (60 * cfg.max_time))
        return min(1.0, max(parts))

    def learning_rate(self, step: int, progress: float) -> float:
        """The rate of update ``step`` under ``train.schedule``, ``progress`` being the budget spent before it."""
        d_model, cfg = self.model.cfg.d_model, self.cfg
        if cfg.schedule == "linear":
            return linear_learning_rate(step, progress, d_model, cfg.warmup, cfg.lr_scale)
        return learning_rate(step, d_model, cfg.warmup, cfg.lr_scale)

    def _maybe_log(self, bar: Any, task: Any) -> None:
        """Log the window every ``train.log_every_steps`` (and trim the CPU heap every ``_TRIM_EVERY_STEPS``)."""
        st = self.state
        if st.step % self.cfg.log_every_steps == 0 and st.window.updates:
            now = time.monotonic()
            values = self._window_values(*self.throughput.rates(now))
            self.metrics.log(st.step, values)
            bar.update(task, stats=f"loss {values['train/loss']:.3f} | "
                                   f"{values['train/tgt_tokens_per_s']:,.0f} tgt tok/s")
            line = metrics.log_line(st.step, values)
            if not console.is_terminal:
                info(line)
            self.text_log.write(line)
            self.throughput.restart(now)
        if st.step % _TRIM_EVERY_STEPS == 0 and self.device.type == "cpu":
            runtime.trim_cpu_memory()

    def _maybe_validate(self, bar: Any = None) -> None:
        """The scheduled validations: loss/perplexity every ``train.valid_every_steps``, BLEU every
        ``train.valid_bleu_every_steps``. Each one of ``train.stop_metric`` is booked for early stopping
        (:class:`mtpipe.training.resume.Best`): an improvement makes this step's checkpoint the best one (written now if
        none is due); ``train.patience`` counts the others."""
        cfg, st = self.cfg, self.state
        vals: dict[str, float] = {}
        if cfg.valid_every_steps and st.step % cfg.valid_every_steps == 0 and self.data.valid is not None:
            vals.update(self.valid_loss())
        if self.bleu is not None and st.step % cfg.valid_bleu_every_steps == 0:
            vals["valid/bleu"] = self.valid_bleu(bar)
        if not vals:
            return
        self.metrics.log(st.step, vals)
        line = metrics.valid_line(st.step, vals)
        curve = resume.STOP_METRICS[cfg.stop_metric][0]
        if curve in vals:
            if st.best.update(cfg.stop_metric, vals[curve], st.step):
                self.best_due = True
                line += f" (best {cfg.stop_metric} so far)"
            else:
                line += (f" (no improvement on {st.best.value:.4g} at update {st.best.step:,}: {st.best.bad}"
                         + (f" of patience {cfg.patience})" if cfg.patience else ")"))
        info(line)
        self.text_log.write(line)

    def _stop_reason(self, time_up: bool) -> str:
        cfg, st = self.cfg, self.state
        if cfg.max_steps and st.step >= cfg.max_steps:
            return "max_steps"
        if cfg.max_epochs and st.epoch >= cfg.max_epochs:
            return "max_epochs"
        if cfg.patience and st.best.metric == cfg.stop_metric and st.best.bad >= cfg.patience:
            return "patience"
        return "max_time" if time_up else ""

    def _maybe_save(self, save_due: bool) -> None:
        every = self.cfg.save_every_steps
        if save_due or (every and self.state.step % every == 0):
            self.save()
            self.last_save_time = time.monotonic()

    def _drophead(self, step: int) -> float:
        return drophead_rate(step, self.cfg.warmup, self.total_steps, self.cfg.drophead_start, self.cfg.drophead_end)

    def _window_values(self, tgt_per_s: float, src_per_s: float) -> dict[str, float]:
        """The logged point of the window (then emptied)."""
        st = self.state
        values = st.window.values(self.last_lr, tgt_per_s, src_per_s, epoch=st.epoch + st.position / self.data.usable)
        if _drophead_on(self.cfg):
            values["train/drophead"] = self._drophead(st.step)
        self.last_train = values
        st.window = Window()
        return values

    # -- the run -------------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        st, d = self.state, self.data
        t0 = time.monotonic()
        self.text_log.open(self.out)
        if self.resumed_from is not None:
            self._say(f"resuming from {self.resumed_from} (step {st.step:,}, epoch {st.epoch + 1}, batch "
                      f"{st.position:,}/{d.usable:,})")
        self._say(f"training {sum(p.numel() for p in self.model.parameters()):,} parameters on {self.world} x "
                  f"{self.device.type} ({self.precision}), {d.accum} batch(es) of <= {d.max_tokens:,} tokens per "
                  f"process per update, {len(d.train):,} batches per epoch ({len(d.train) - d.usable} left out)")
        self.metrics.open(self.out, st.step if self.resumed_from is not None else None)
        start_step, start_tokens = st.step, st.tgt_seen
        try:
            reason = self.train_loop()
            # The last step's metrics, off the validation schedule: logged and recorded in the last checkpoint,
            # but not booked for early stopping (a longer run would not validate here; its count must not differ).
            final: dict[str, float] = {}
            if d.valid is not None and st.last_valid_step != st.step:
                final.update(self.valid_loss())
            if self.bleu is not None and st.last_bleu_step != st.step and st.step > 0:
                final["valid/bleu"] = self.valid_bleu()
            if final:
                self.metrics.log(st.step, final)
                self._say(metrics.valid_line(st.step, final))
            if st.step > 0 and self.last_saved_step != st.step:
                self.save()
            elif st.step == 0:
                warn("no update was made: no checkpoint written")
            seconds = time.monotonic() - t0
            summary = self._summary(reason, st.step - start_step, (st.tgt_seen - start_tokens) / max(seconds, 1e-9))
            metrics.report(self.out, summary, self.text_log)
        finally:
            self.metrics.close()
            self.text_log.close()
        return summary

    def _say(self, line: str) -> None:
        """A line for the console and ``OUT/train.log``."""
        info(line)
        self.text_log.write(line)

    def planned_updates(self) -> int:
        """The updates max_steps and max_epochs plan for (the sooner of the two; 0: neither is set)."""
        cfg, d = self.cfg, self.data
        plans = [n for n in (cfg.max_steps, cfg.max_epochs * d.usable // d.per_update) if n > 0]
        return min(plans) if plans else 0

    def _summary(self, reason: str, updates_now: int, tgt_per_s: float) -> dict[str, Any]:
        st, d = self.state, self.data
        found = list_checkpoints(self.out) if distributed.is_rank0() else []
        # Under the linear schedule max_time is part of the plan (the budget the rate decays over), not a guard:
        # a run it ends has done what was planned, whatever max_epochs would have allowed.
        budgeted = self.cfg.schedule == "linear" and self.cfg.max_time > 0
        planned = 0 if budgeted else self.planned_updates()
        summary = {
            "steps": st.step, "updates_this_run": updates_now, "stopped_by": reason,
            "epochs": round(st.epoch + st.position / d.usable, 4),
            "target_tokens": st.tgt_seen, "source_tokens": st.src_seen,
            "train_loss": self.last_train.get("train/loss"), "train_ppl": self.last_train.get("train/ppl"),
            "valid_loss": st.last_valid.get("valid/loss"), "valid_nll": st.last_valid.get("valid/nll"),
            "valid_ppl": st.last_valid.get("valid/ppl"),
            "train_minutes": round(st.train_seconds / 60, 3),
            "tgt_tokens_per_s": round(tgt_per_s, 1),  # this invocation, validation and checkpoints included
            "processes": self.world, "accumulation": d.accum, "batches_per_update": d.per_update,
            "max_tokens": d.max_tokens, "precision": self.precision, "device": self.device.type,
            "bad_steps_skipped": st.bad_steps, "fp16_overflows": st.overflows,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "checkpoints": [str(p) for _, p in found],
            "model": self.model_config, "vocab": d.vocab,
            "valid_bleu": st.last_bleu,
            # How far the plan got: a run the time guard (or early stopping) ended before max_steps/max_epochs.
            "planned_updates": planned, "plan_done": round(st.step / planned, 4) if planned else None,
            "max_time": self.cfg.max_time, "schedule": self.cfg.schedule, "patience": self.cfg.patience,
            "stopped_early": reason == "patience" or (reason == "max_time" and st.step < planned),
            "best": {**st.best.to_dict(),
                     "checkpoint": str(artifacts.checkpoint_path(self.out, st.best.step)) if st.best.step >= 0
                     else None},
        }
        summary["stop_note"] = metrics.stop_note(summary)  # the loud last line, when the plan was cut short
        return summary


def train_model(model_cfg: ModelConfig, cfg: TrainConfig, tokens: Path, batches: Path, out: Path, *,
        force: bool = False, decode: dict[str, Any] | None = None) -> dict[str, Any]:
    """``mtpipe train``: train (or resume training) into ``out``; returns the summary written to ``out/train.json``.
    ``out`` must be absent, empty or a run directory of `mtpipe train` (``force`` lifts the last rule). ``decode``:
    the decode settings every checkpoint records (:data:`mtpipe.config.RECORDED_DECODE`)."""
    check_stopping(cfg)
    writing.check_output_place(out, [tokens, batches])
    writing.check_run_dir(out, force=force)
    ctx = distributed.init(cfg.device, timeout=cfg.dist_timeout)
    if ctx.device.type == "cpu":
        runtime.tune_cpu_allocator()
    try:
        return Trainer(model_cfg, cfg, Path(tokens), Path(batches), Path(out), decode).run()
    finally:
        distributed.cleanup()
