"""One optimizer update of ``mtpipe train``, and the schedules it follows (the paper's section 5).

* Loss (5.4): label-smoothed cross-entropy (:mod:`mtpipe.training.loss`) summed over the real target tokens of the
  whole update (all micro-batches, all ranks) and divided by their count: the gradient equals the one-process
  gradient. Logits are computed only for non-pad positions (``model.features`` -> the positions the host found ->
  the shared embedding projection), a block of rows at a time inside the loss, which also makes their gradient
  there (:class:`LossModule`).
* No host synchronisation inside an update: the loss sums, the gradient norm and the decision to skip a non-finite
  update stay on the device (:meth:`Updater.finish`); the trainer reads them one update later.
* Accumulation (5.1's ~25k-token batches on any number of processes): :meth:`Updater.backward` accumulates each
  micro-batch's gradient; DDP all-reduces gradients once per update (``no_sync`` on earlier micro-batches).
* Optimizer (5.3): Adam(beta1, beta2, eps) at the rate of :func:`learning_rate` (or :func:`linear_learning_rate`),
  optional gradient-norm clipping, fp16's grad scaler (:meth:`Updater.finish`). ``train.grad_allreduce: bf16``
  sends the gradients' all-reduce in bf16 (a DDP communication hook: distributed.bf16_allreduce).
* Scheduled DropHead (beyond the paper, off by default): the rate :func:`drophead_rate` gives each update.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from mtpipe import platform
from mtpipe.config import TrainConfig, check_sections
from mtpipe.engine import runtime
from mtpipe.model.ops import attention_kernels
from mtpipe.training import distributed
from mtpipe.training.loss import projected_label_smoothed_nll
from mtpipe.training.plan import TrainBatch
from mtpipe.training.state import rng_state, set_rng_state

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
    the budget; the lower of the two. ``progress`` is the fraction of the budget spent
    (:meth:`mtpipe.training.budget.Budget.progress`), so the decay follows wall-clock time when ``train.max_time``
    is the budget that runs out first. When the warm-up is a sizeable part of the budget the lines cross below the
    paper's peak, rather than jumping at ``warmup``."""
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


def drophead_on(cfg: TrainConfig) -> bool:
    """Whether ``train.drophead_start``/``drophead_end`` switch Scheduled DropHead on."""
    return cfg.drophead_start > 0 or (cfg.drophead_end or 0.0) > 0


# --------------------------------------------------------------------------------------------------------------------
# The update
# --------------------------------------------------------------------------------------------------------------------


class LossModule(nn.Module):
    """Features -> the real target positions -> shared-embedding projection and smoothed loss sums, as one module so
    that DDP's forward (which prepares the gradient all-reduce) sees the whole computation. The positions come from
    the host (:class:`mtpipe.training.plan.TrainBatch`): a boolean selection here would synchronise with the GPU."""

    def __init__(self, model: nn.Module, label_smoothing: float, features: Callable | None = None):
        super().__init__()
        self.model = model
        self.eps = label_smoothing
        self._features = features

    def forward(self, src: Tensor, tgt_in: Tensor, pos: Tensor, gold: Tensor) -> tuple[Tensor, Tensor]:
        h = (self._features or self.model.features)(src, tgt_in)  # [B, T, D]
        real = h.reshape(-1, h.size(-1)).index_select(0, pos)  # [B * T, D] -> [N, D]: the real target positions
        # The output projection (3.4) on real positions only, [N, D] -> [N, V], a block of rows at a time inside
        # the loss (mtpipe.training.loss): the whole [N, V] logits are never made.
        return projected_label_smoothed_nll(real, self.model.output_embedding(), self.model.out_bias, gold, self.eps)


# An update's status, as Updater.finish reports it on the device.
OK, SKIPPED, OVERFLOW = 0.0, 1.0, 2.0
STATUS = {OK: "ok", SKIPPED: "skipped", OVERFLOW: "overflow"}


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is an allocation failure (CUDA's, or a CPU allocator's RuntimeError)."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


class Updater:
    """One optimizer update from micro-batches: what ``mtpipe train`` runs for each update (and ``bench/`` times,
    so that the benchmark measures exactly what training runs)."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, device: torch.device, precision: str):
        self.model, self.cfg, self.device, self.precision = model, cfg, device, precision
        features = None
        check_sections(model=getattr(model, "cfg", None), train=cfg)  # train.compile needs model.layerdrop 0
        if cfg.compile:
            runtime.separate_compile_cache()
            features = torch.compile(model.features, dynamic=True)
        self.loss_module = LossModule(model, cfg.label_smoothing, features)
        # DDP at world size > 1. LayerDrop leaves some parameters without a gradient in a step (on some ranks or all):
        # DDP must then look for them after each forward (a small cost, paid only with LayerDrop).
        layerdrop = getattr(getattr(model, "cfg", None), "layerdrop", 0.0) > 0
        self.module = distributed.wrap(self.loss_module, find_unused_parameters=layerdrop,
                                       compress=cfg.grad_allreduce == "bf16")
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

    def _prime(self, batch: TrainBatch) -> None:
        rng = rng_state(self.device)
        self.primed = True
        self.backward(batch, scale=0.0, sync=True)
        self.optimizer.zero_grad(set_to_none=True)
        set_rng_state(rng, self.device)

    def backward(self, batch: TrainBatch, scale: float, sync: bool) -> Tensor:
        """Forward and backward of one micro-batch, accumulating the gradient of ``loss_sum * scale``.

        ``sync=False`` skips DDP's gradient all-reduce (an earlier micro-batch of an accumulated update).
        Returns the detached ``[loss_sum, nll_sum]`` (float32, on the device; no host sync).
        """
        if not self.primed:
            self._prime(batch)
        with distributed.no_sync(self.module, skip=not sync):
            with platform.autocast(self.device, self.precision), attention_kernels(self.device):
                loss, nll = self.module(*batch)
            scaled = loss * scale
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return torch.stack([loss.detach(), nll.detach()])

    def finish(self, lr: float, loss: Tensor) -> Tensor:
        """Apply the accumulated gradients at learning rate ``lr``, unless ``loss`` (the update's all-reduced loss
        sum, a device scalar) or the gradient norm is not finite; the gradients are then dropped.

        Returns the device tensor ``[grad_norm, status]`` (float64); status :data:`OK`, :data:`SKIPPED` (a non-finite
        loss or gradient norm) or :data:`OVERFLOW` (fp16: the grad scaler found inf/nan gradients, skipped the step
        and lowered its scale, as designed). The norm is measured before clipping (and after unscaling).

        Nothing here waits for the device: the skip is decided on the device, by the fused Adam kernel's
        ``found_inf`` (the step counts stay put, as GradScaler has it skip steps); the caller reads the status one
        update later (:meth:`mtpipe.training.trainer.Trainer._settle`). Adam without a fused kernel (older torch)
        reads the decision on the host.
        """
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.cfg.clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None], foreach=True)
        bad_loss, bad_norm = ~torch.isfinite(loss), ~torch.isfinite(norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.scaler is not None:  # it skips an inf/nan step itself, and lowers its scale
            status = torch.where(bad_loss, SKIPPED, torch.where(bad_norm, OVERFLOW, OK))
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            skip = (bad_loss | bad_norm).to(torch.float32)  # [] 1.0: skip
            status = skip * SKIPPED
            if self.optimizer.defaults.get("fused"):
                self.optimizer.found_inf, self.optimizer.grad_scale = skip, None  # read by Adam's fused step
                try:
                    self.optimizer.step()
                finally:
                    del self.optimizer.found_inf, self.optimizer.grad_scale
            elif not bool(skip):  # the foreach kernels cannot skip on the device: a host read
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return torch.stack([norm.double(), torch.as_tensor(status, dtype=torch.float64, device=norm.device)])

    def discard(self) -> None:
        """Drop the gradients accumulated so far (an update begun, then not made: training stopped)."""
        self.optimizer.zero_grad(set_to_none=True)
