"""The training run of one process (rank) of a launch: the loop of ``mtpipe train`` (:class:`Trainer`).

Each update reads update -> log -> maybe validate -> maybe save: :mod:`mtpipe.training.update` makes the update,
:mod:`mtpipe.training.metrics` logs it, :mod:`mtpipe.training.validation` validates, :mod:`mtpipe.training.checkpoints`
writes the checkpoints, :mod:`mtpipe.training.budget` says when to stop, and :mod:`mtpipe.training.resume` picks up a
run where its last checkpoint left it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from mtpipe import artifacts, platform
from mtpipe.config import ModelConfig, TrainConfig, to_dict
from mtpipe.console import console, info, progress, warn
from mtpipe.engine import runtime
from mtpipe.errors import MtpipeError
from mtpipe.training import distributed, finetune, metrics, resume
from mtpipe.training.batches import TrainData, load_train_data
from mtpipe.training.budget import Budget
from mtpipe.training.checkpoints import Checkpointer, spm_files
from mtpipe.training.metrics import Metrics, TextLog, Throughput, Window
from mtpipe.training.plan import Planned, TrainBatch, UpdatePlan
from mtpipe.training.state import TrainState, rng_state, seed_for_rank, set_rng_state
from mtpipe.training.update import (STATUS, Updater, drophead_on, drophead_rate, is_oom, learning_rate,
                                   linear_learning_rate)
from mtpipe.training.validation import Validator, book

# Updates between glibc heap trims on CPU (runtime.trim_cpu_memory): often enough that resident memory stays flat
# over a long run instead of creeping up, rarely enough that the trims cost nothing measurable.
_TRIM_EVERY_STEPS = 100


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


@dataclass
class InFlight:
    """An ended update whose results the host has not read yet (:meth:`Trainer._settle` reads them)."""

    results: Tensor  # float64 [7]: loss, nll, save_due, time_up, rank 0's seconds, grad_norm, status (pinned on CUDA)
    ready: Any  # a torch.cuda.Event recorded after the copy to the host (None on CPU)
    tgt_tokens: int
    src_tokens: int
    rng: dict[str, Any]  # the RNG state as the update left it: what a checkpoint after it records


class Trainer:
    """The training run of one process (rank) of a launch: each update reads update -> log -> maybe validate ->
    maybe save (:meth:`train_loop`)."""

    def __init__(self, model_cfg: ModelConfig, cfg: TrainConfig, tokens: Path, batches: Path, out: Path,
                 decode: dict[str, Any] | None = None):
        self.cfg, self.tokens, self.batches, self.out = cfg, Path(tokens), Path(batches), Path(out)
        self.ctx = distributed.context()
        self.rank, self.world = self.ctx.rank, self.ctx.world_size
        self.device = self.ctx.device
        self._set_up_device()
        self.precision = platform.training_precision(cfg.precision, self.device)
        self.data = load_train_data(self.tokens, self.batches, cfg.tokens_per_update, self.world)
        # train.finetune_from: the parent's model, and its weights unless the run resumes (mtpipe.training.finetune)
        self.finetune = finetune.plan(self.out, cfg.finetune_from, model_cfg, self.data.vocab, self.tokens)
        if self.finetune is not None:
            model_cfg = self.finetune.model_cfg
        spm = spm_files(self.tokens, self.data.vocab) if self.rank == 0 else (None, None)
        self.model = self._build_model(model_cfg)
        self.model_config = to_dict(self.model.cfg)
        self._new_loop_state()  # the state is overwritten by a resume
        self.resumed_from: Path | None = None
        self.last_saved_step = -1
        self.last_train: dict[str, float] = {}  # the last logged train/* values, for the summary
        self.metrics = Metrics()
        self.text_log = TextLog()
        self.best_due = False  # a scheduled validation improved on the best: checkpoint this step
        self.validator = Validator(cfg, self.data, self.model, self.tokens, self.batches, self.device, self.precision,
                                   self.rank, self.world)
        self.checkpointer = Checkpointer(self.out, self.model, self.model_config, cfg, self.tokens, self.batches,
                                         self.world, self.precision, self.device, dict(decode or {}), spm,
                                         batches_id=self.data.batches_id)
        # The model keys the params set, as given (before the preset fills the rest and d_k/d_v are derived): a
        # resume refused for another model names the key the user changed, not one derived from it.
        given = {k: v for k, v in to_dict(model_cfg).items() if v is not None}
        ck = resume.find_resume(self.out, cfg, self.model_config, self.data.vocab, self.device, given=given)
        if ck is not None:
            self.model.load_state_dict(ck.state_dict)
        elif self.finetune is not None:
            finetune.load_parent(self.finetune, self.model, self.device)
        self.checkpointer.lineage = self.finetune.lineage if self.finetune is not None else None
        self.updater = Updater(self.model, cfg, self.device, self.precision)
        if ck is not None:
            self._restore(ck)
        self.budget = Budget(cfg, self.data, self.state, self.rank)
        self.global_batch = metrics.GlobalBatch(cfg.tokens_per_update, self.data.per_update, self.data.max_tokens)

    @classmethod
    def for_updates(cls, model_cfg: ModelConfig, cfg: TrainConfig, data: TrainData, device: torch.device,
                    state_dict: dict[str, Any] | None = None) -> Trainer:
        """A trainer of one process that only makes updates (:meth:`updates`): ``mtpipe train``'s model, initialisation,
        updater and update, on batches in memory (``state_dict``: its weights, e.g. a checkpoint's); no run
        directory, logging, validation, checkpoints or resume. What a benchmark of the update times
        (bench/gpu_paper.py), built here so that it cannot drift from the trainer it stands for."""
        t = cls.__new__(cls)
        t.cfg, t.device, t.rank, t.world, t.data = cfg, device, 0, 1, data
        t.batches = Path("<batches in memory>")
        t._set_up_device()
        t.precision = platform.training_precision(cfg.precision, device)
        t.model = t._build_model(model_cfg)
        if state_dict is not None:
            t.model.load_state_dict(state_dict)
        t.updater = Updater(t.model, cfg, device, t.precision)
        t.use_batches(data)
        return t

    def use_batches(self, data: TrainData, state: TrainState | None = None) -> None:
        """Updates from now on walk ``data`` from ``state`` (default: a new run's), the model and optimizer kept (a
        :meth:`for_updates` trainer; a benchmark's next batch shape)."""
        self.close_updates()
        self.data = data
        self._new_loop_state(state)
        self.budget = Budget(self.cfg, data, self.state, self.rank)

    def _new_loop_state(self, state: TrainState | None = None) -> None:
        self.state = state or TrainState()
        self.last_lr = 0.0  # the rate of the last applied update (logged as train/lr)
        self.rank0_seconds = 0.0  # rank 0's training seconds as of the last settled update (the schedule's clock)
        self.throughput = Throughput(time.monotonic())
        self._plan: UpdatePlan | None = None  # updates()'s walk of the batches
        # fp16 updates skipped for overflow since the last applied one (0 at every checkpoint: not saved)
        self.overflows_in_a_row = 0

    def _set_up_device(self) -> None:
        platform.set_threads(self.cfg.threads)
        platform.set_fp32_matmuls(self.device)  # TF32 on a GPU

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
        torch.manual_seed(seed_for_rank(self.cfg.seed, self.rank))
        return model

    def _restore(self, ck: artifacts.Checkpoint) -> None:
        u, cfg = self.updater, self.cfg
        # Another world size than the checkpoint's: the same global batch, accumulated or shared (resume warns).
        self.data = self.validator.data = resume.same_global_batch(ck, self.data, self.world, cfg.tokens_per_update)
        st = self.state = resume.restore(ck, u.optimizer, u.scaler, accum=self.data.accum,
                                         per_update=self.data.per_update, seed=self.cfg.seed, device=self.device)
        if resume.batches_changed(ck, self.data.batches_id, self.batches):
            warn(f"{self.batches}: the batches changed since {ck.path.name} was written: continuing at the same "
                 "epoch and position of the new batch order (not an exact resume)")
        if st.position + self.data.per_update > self.data.usable:  # another world size can end the epoch earlier
            st.epoch, st.position = st.epoch + 1, 0
        self.resumed_from = ck.path
        self.last_saved_step = st.step  # the checkpoint itself: no need to write it again

    def save(self, rng: dict[str, Any] | None = None) -> None:
        """Checkpoint at the current step (a collective: every rank contributes its RNG state, ``rng`` or the
        current one; rank 0 writes)."""
        u = self.updater
        self.checkpointer.save(self.state, u.optimizer, u.scaler, self.data.vocab, self.data.accum, rng=rng,
                               per_update=self.data.per_update)
        self.last_saved_step = self.state.step
        self.best_due = False

    # -- one update, in two halves -------------------------------------------------------------------------------
    # An update is begun (its forward and backward queued: _begin), ended (the all-reduce of its loss and of rank 0's
    # clock, the optimizer step, its results copied towards the host: _end) and settled (the results read and
    # booked, then logging, validation, checkpoints: _settle). train_loop settles update j after it has begun
    # update j + 1, so that the host reads a result the device finished while the device already has the next
    # update's work: no update waits for the host.

    def _begin(self, planned: Planned, ahead: bool) -> Tensor:
        """Forward and backward of this rank's micro-batches of ``planned``; DDP all-reduces the gradient with the
        last one. ``ahead``: the update before it is not settled yet. Returns this rank's float32
        ``[loss_sum, nll_sum]`` on the device."""
        if drophead_on(self.cfg):  # the step this update will be if the unsettled one is applied
            self.model.set_drophead(self._drophead(self.state.step + 1 + int(ahead)))
        # DDP averages gradients over ranks: scale each rank's sum by world/ntok for the global per-token gradient.
        scale = self.world / planned.tgt_tokens
        sums = torch.zeros(2, dtype=torch.float32, device=self.device)
        for i, (b, batch) in enumerate(planned.batches):
            batch = batch.to(self.device)
            try:
                sums += self.updater.backward(batch, scale=scale, sync=i == len(planned.batches) - 1)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                if not is_oom(e):
                    raise
                raise self._oom_error(b, batch) from None
        return sums

    def _end(self, planned: Planned, sums: Tensor) -> InFlight:
        """The update's all-reduce (this rank's loss sums and rank 0's clock), the optimizer step at the schedule's
        rate, and its results on their way to the host (not waited for)."""
        save_due, time_up, seconds = self.budget.rank0_clock()
        flags = torch.tensor([float(save_due), float(time_up), seconds], dtype=torch.float64)
        if self.device.type == "cuda":  # a plain copy to the GPU would wait for the GPU's queue to drain
            flags = flags.pin_memory().to(self.device, non_blocking=True)
        # One all-reduce for the loss and rank 0's flags and clock (the others send zeros):
        # [loss, nll, save_due, time_up, seconds], summed over ranks.
        reduced = distributed.all_reduce_sum(torch.cat([sums.double(), flags]))
        # The budget's progress by the last settled update's clock (rank 0's, the same on every rank).
        lr = self.learning_rate(self.state.step + 1, self.budget.progress(self.rank0_seconds))
        self.last_lr = lr
        out = torch.cat([reduced, self.updater.finish(lr, reduced[0])])  # [7]: ..., grad_norm, status
        host, ready = out, None
        if self.device.type == "cuda":
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return InFlight(host, ready, planned.tgt_tokens, planned.src_tokens, rng_state(self.device))

    def _read(self, f: InFlight) -> UpdateResult:
        """An ended update's results on the host (waits for the device to have finished that update)."""
        if f.ready is not None:
            f.ready.synchronize()
        loss, nll, save_n, time_n, seconds, norm, status = f.results.tolist()
        self.rank0_seconds = seconds
        return UpdateResult(loss=loss, nll=nll, grad_norm=norm, status=STATUS[status], tgt_tokens=f.tgt_tokens,
                            src_tokens=f.src_tokens, save_due=save_n > 0, time_up=time_n > 0)

    def _settle(self, f: InFlight, bar: Any, task: Any, start_step: int) -> str:
        """Book an ended update (read, accounted), then what follows it: log -> maybe validate -> maybe save (a
        checkpoint written after the metrics it covers, so a resume rewinds to it). Returns the stop reason."""
        result = self._read(f)
        self._account(result)
        budget = self.budget
        if result.applied:
            measured = self.global_batch.add(result.tgt_tokens, result.src_tokens)
            if measured:
                self._say(measured)
            self._maybe_log(bar, task)
            self._maybe_validate(bar)  # it leaves the RNG as it found it: the next update has already drawn from it
        reason = budget.stop_reason(result.time_up)
        if result.applied and not reason and budget.save_due(result.save_due or self.best_due):
            self.save(rng=f.rng)  # the RNG as this update left it, whatever the next update, begun, has drawn
            budget.last_save_time = time.monotonic()
        bar.update(task, completed=self.state.step, **budget.bar_fields(start_step))
        return reason

    def _ends_if_applied(self) -> bool:
        """Whether max_steps or max_epochs ends training once the unsettled update is applied: then it is settled
        before another update is begun (one that would be dropped)."""
        st, d, cfg = self.state, self.data, self.cfg
        if cfg.max_steps and st.step + 1 >= cfg.max_steps:
            return True
        epoch = st.epoch + int(st.position + 2 * d.per_update > d.usable)
        return bool(cfg.max_epochs and epoch >= cfg.max_epochs)

    def _oom_error(self, b: int, batch: TrainBatch) -> MtpipeError:
        src, tgt_in = batch.src, batch.tgt_in  # [B, S], [B, T]
        max_tokens = self.data.max_tokens
        return MtpipeError(
            f"out of memory on {self.device} in train batch {b} ({src.shape[0]} sentences, {src.shape[1]} "
            f"source x {tgt_in.shape[1]} target positions, {int(self.data.train.tgt_tokens[b])} target tokens): "
            f"rebuild the batches with a smaller bucket.max_tokens (these have {max_tokens}), e.g. "
            f"`mtpipe bucket --max-tokens {max(max_tokens // 2, 1)}`; train.tokens_per_update keeps the "
            "update size by accumulating more batches"
        )

    def _account(self, r: UpdateResult) -> None:
        """Book the update into the state (applied, skipped or fp16 overflow) and move on in the epoch's batch order
        (to the next epoch when too few batches are left for another update; the plan walks alike)."""
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
            self.overflows_in_a_row += 1
            if self.overflows_in_a_row >= self.cfg.max_overflow_steps:
                raise self._overflow_error()
        else:
            st.bad_steps = self.overflows_in_a_row = 0
            st.step += 1
            st.tgt_seen, st.src_seen = st.tgt_seen + r.tgt_tokens, st.src_seen + r.src_tokens
            st.window.add(r.loss, r.nll, r.tgt_tokens, r.grad_norm)
            self.throughput.add(r.tgt_tokens, r.src_tokens)
        if st.position + d.per_update > d.usable:
            st.epoch, st.position = st.epoch + 1, 0
        st.train_seconds = self.budget.seconds()

    def _overflow_error(self) -> MtpipeError:
        """fp16 whose grad scaler skipped ``train.max_overflow_steps`` updates in a row (inf/nan gradients with a
        finite loss, the loss scale halved at each): a run that no longer learns, ended in one line that names the
        loss scale and the checkpoint to go back to (nothing is written)."""
        from mtpipe.training.failures import last_checkpoint

        st, scaler = self.state, self.updater.scaler
        scale = f"{scaler.get_scale():.6g}" if scaler is not None else "?"
        ck = last_checkpoint(self.out) if hasattr(self, "out") else "none (updates without a run directory)"
        return MtpipeError(
            f"training stopped: {self.overflows_in_a_row} fp16 updates in a row had inf/nan gradients with a finite "
            f"loss (train.max_overflow_steps; last at update {st.step + 1}, epoch {st.epoch + 1}); the grad scaler "
            f"skipped each and its loss scale is now {scale}; last good checkpoint: {ck}; use train.precision=bf16 "
            "or fp32, or a lower train.lr_scale"
        )

    def learning_rate(self, step: int, progress: float) -> float:
        """The rate of update ``step`` under ``train.schedule``, ``progress`` being the budget spent before it."""
        d_model, cfg = self.model.cfg.d_model, self.cfg
        if cfg.schedule == "linear":
            return linear_learning_rate(step, progress, d_model, cfg.warmup, cfg.lr_scale)
        return learning_rate(step, d_model, cfg.warmup, cfg.lr_scale)

    # -- the loop ------------------------------------------------------------------------------------------------

    def train_loop(self) -> str:
        """Run updates until a stopping criterion; returns the reason. Update j + 1 is begun before update j is
        settled (the section above); an update begun when j turns out to end training is dropped, and the RNG put
        back as j left it, so the state is exactly the one after j."""
        budget = self.budget
        reason = budget.stop_reason(time_up=False)
        if reason:  # a finished run started again
            return reason
        self.throughput.restart(budget.start())
        self.rank0_seconds = budget.seconds_before
        from rich.progress import TextColumn

        start_step = self.state.step
        with self._walk() as plan, progress(TextColumn("{task.fields[stats]}")) as bar:
            task = bar.add_task("train", total=budget.total_steps or None, completed=self.state.step, stats="",
                                **budget.bar_fields(start_step))
            pending: InFlight | None = None
            while not reason:
                begun = None
                if pending is None or not self._ends_if_applied():
                    planned = next(plan)
                    begun = planned, self._begin(planned, ahead=pending is not None)
                if pending is not None:
                    reason = self._settle(pending, bar, task, start_step)
                    if reason and begun is not None:
                        self.updater.discard()
                        set_rng_state(pending.rng, self.device)
                pending = self._end(*begun) if begun is not None and not reason else None
        return reason

    def _walk(self) -> UpdatePlan:
        """The updates' batches from the state's epoch and position on (made ahead by a thread on a GPU)."""
        st, cuda = self.state, self.device.type == "cuda"
        return UpdatePlan(self.data, self.cfg.seed, st.epoch, st.position, self.rank, self.world, self.model.start_id,
                          prefetch=self.cfg.prefetch if cuda else 0, pin=cuda)

    def updates(self, n: int, go_on: Callable[[], bool] = lambda: True, mark: str | None = None) -> list[int]:
        """``n`` updates pipelined as :meth:`train_loop` makes them (update j + 1 begun before j is read and booked),
        without logging, validation or checkpoints; the last one read at the end, so the state is settled between
        calls. ``go_on``: asked before each update (False: stop early). ``mark``: each update inside a
        ``torch.profiler`` range of that name. Returns the batches of the updates made."""
        from torch.profiler import record_function

        if self._plan is None:
            self._plan = self._walk()
        done, pending = [], None
        for _ in range(n):
            if not go_on():
                break
            with record_function(mark) if mark else contextlib.nullcontext():
                planned = next(self._plan)
                done += [b for b, _ in planned.batches]
                sums = self._begin(planned, ahead=pending is not None)
                if pending is not None:
                    self._account(self._read(pending))
                pending = self._end(planned, sums)
        if pending is not None:
            self._account(self._read(pending))
        return done

    def close_updates(self) -> None:
        """Stop :meth:`updates`'s batch producer (a thread on a GPU)."""
        plan, self._plan = getattr(self, "_plan", None), None
        if plan is not None:
            plan.close()

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
        """The scheduled validations (:meth:`mtpipe.training.validation.Validator.scheduled`), each one of
        ``train.stop_metric`` booked for early stopping: an improvement makes this step's checkpoint the best one
        (written now if none is due); ``train.patience`` counts the others."""
        vals = self.validator.scheduled(self.state, self.updater.loss_module, bar)
        if not vals:
            return
        self.metrics.log(self.state.step, vals)
        line, best = book(self.state, self.cfg, vals, metrics.valid_line(self.state.step, vals))
        self.best_due = self.best_due or best
        self._say(line)

    def _drophead(self, step: int) -> float:
        cfg = self.cfg
        return drophead_rate(step, cfg.warmup, self.budget.total_steps, cfg.drophead_start, cfg.drophead_end)

    def _window_values(self, tgt_per_s: float, src_per_s: float) -> dict[str, float]:
        """The logged point of the window (then emptied)."""
        st = self.state
        values = st.window.values(self.last_lr, tgt_per_s, src_per_s, epoch=st.epoch + st.position / self.data.usable)
        if drophead_on(self.cfg):
            values["train/drophead"] = self._drophead(st.step)
        self.last_train = values
        st.window = Window()
        return values

    # -- the run -------------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train to a stopping criterion, validate and checkpoint the last step; returns the summary (also written
        to ``OUT/train.json``)."""
        st = self.state
        t0 = time.monotonic()
        self.text_log.open(self.out)
        self._announce()
        self.metrics.open(self.out, st.step if self.resumed_from is not None else None)
        start_step, start_tokens = st.step, st.tgt_seen
        try:
            reason = self.train_loop()
            # The last step's metrics, off the validation schedule: logged and recorded in the last checkpoint,
            # but not booked for early stopping (a longer run would not validate here; its count must not differ).
            final = self.validator.final(st, self.updater.loss_module)
            if 0 < self.global_batch.updates < self.global_batch.MEASURED:  # a run shorter than the measurement
                self._say(self.global_batch.measured_line())
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

    def _announce(self) -> None:
        st, d = self.state, self.data
        if self.resumed_from is not None:
            self._say(f"resuming from {self.resumed_from} (step {st.step:,}, epoch {st.epoch + 1}, batch "
                      f"{st.position:,}/{d.usable:,})")
        self._say(f"training {sum(p.numel() for p in self.model.parameters()):,} parameters on {self.world} x "
                  f"{self.device.type} ({self.precision}), {len(d.train):,} batches per epoch "
                  f"({len(d.train) - d.usable} left out)")
        self._say(self.global_batch.plan_line(self.world, d.accum, d.split))

    def _say(self, line: str) -> None:
        """A line for the console and ``OUT/train.log``."""
        info(line)
        self.text_log.write(line)

    def _summary(self, reason: str, updates_now: int, tgt_per_s: float) -> dict[str, Any]:
        st, d = self.state, self.data
        found = artifacts.list_checkpoints(self.out) if distributed.is_rank0() else []
        # Under the linear schedule max_time is part of the plan (the budget the rate decays over), not a guard:
        # a run it ends has done what was planned, whatever max_epochs would have allowed.
        budgeted = self.cfg.schedule == "linear" and self.cfg.max_time > 0
        planned = 0 if budgeted else self.budget.planned_updates()
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
            "global_batch": self.global_batch.to_dict(),
            "max_tokens": d.max_tokens, "precision": self.precision, "device": self.device.type,
            "bad_steps_skipped": st.bad_steps, "fp16_overflows": st.overflows,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "checkpoints": [str(p) for _, p in found],
            "model": self.model_config, "vocab": d.vocab,
            artifacts.FINETUNED_FROM: self.finetune.lineage if self.finetune is not None else None,
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
