"""``mtpipe train``: the Transformer trained as in the paper's section 5, on 1 process or N under torchrun.

* Data (5.1): the bucket artifact's token-budget batches of the bpe artifact's sentences. ``src = tokens + EOS``,
  ``tgt_in = BOS + tgt``, ``tgt_out = tgt + EOS``, right-padded. Each epoch the batch order is a permutation drawn
  from ``(train.seed, epoch)``; an update takes the next ``world_size * accum`` batches of that order and rank r
  takes every world_size-th of them, so ranks never share a batch and any world size walks the same batch sequence.
  The tail of an epoch too short for a whole update is left out of that epoch (a different tail every epoch).
* Batch size (5.1, "approximately 25000 source tokens and 25000 target tokens"): ``train.tokens_per_update`` sets
  gradient accumulation ``accum = ceil(tokens_per_update / (world_size * bucket.max_tokens))``, so 1 GPU and 8 GPUs
  train the same global batch. DDP all-reduces gradients once per update (``no_sync`` on earlier micro-batches).
* Loss (5.4): label-smoothed cross-entropy (:mod:`mtpipe.loss`) summed over the real target tokens of the whole
  update (all micro-batches, all ranks) and divided by their count: the gradient equals the one-process gradient.
  Logits are computed only for non-pad positions (``model.features`` -> boolean select -> ``model.logits``).
* Optimizer (5.3): Adam(beta1, beta2, eps) with ``lr = lr_scale * d_model^-0.5 * min(step^-0.5, step *
  warmup^-1.5)``, optional gradient-norm clipping. Precision: bf16 autocast (GPU, and CPUs with AMX/AVX512-BF16),
  fp16 autocast + grad scaler (GPU), fp32 (TF32 matmuls on GPU); optional ``torch.compile``.
* Regularisers beyond the paper (off by default): LayerDrop (``model.layerdrop``, drawn inside the model; DDP then
  expects unused parameters) and Scheduled DropHead (``train.drophead_start/_end``): the rate of
  :func:`drophead_rate` for each update is set on the model (:meth:`mtpipe.model.Transformer.set_drophead`).
* Checkpoints: ``OUT/checkpoints/step_{step:08d}`` (:func:`mtpipe.artifacts.write_checkpoint`, rank 0, atomic), the
  last ``train.keep_last`` kept. ``trainer.pt`` holds everything for an exact resume: optimizer (and so the
  schedule's step), grad scaler, every rank's torch CPU/CUDA RNG state, epoch and position in the epoch's batch
  order, the metrics window, elapsed time. The same command on the same ``OUT`` continues from the latest
  checkpoint, and the loss curve from there equals the uninterrupted run's (bitwise on CPU).
* Metrics: dvclive under ``OUT/live`` (``plots/metrics/{train,valid}/*.tsv`` with ``step`` as x, for ``dvc plots``),
  ``OUT/train.json`` (final summary), a rich progress bar and summary table.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import Tensor, nn

from mtpipe import artifacts, distributed, runtime
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID
from mtpipe.config import ModelConfig, TrainConfig, to_dict, with_model_defaults
from mtpipe.console import console, info, progress, table, warn
from mtpipe.distributed import rank0_only
from mtpipe.errors import MtpipeError
from mtpipe.loss import label_smoothed_nll

TRAINER_STATE_VERSION = 1


# --------------------------------------------------------------------------------------------------------------------
# Schedule and batch size
# --------------------------------------------------------------------------------------------------------------------


def learning_rate(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """Section 5.3: ``lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)``, times ``scale``.

    ``step`` counts updates from 1: linear warm-up to the peak at ``step = warmup``, then inverse square root decay.
    """
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


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


def accumulation(tokens_per_update: int, world_size: int, max_tokens: int) -> int:
    """Micro-batches per process per update so that ``world_size * accum`` batches of ``max_tokens`` cover
    ``tokens_per_update``: the same global batch on any number of processes."""
    return max(1, math.ceil(tokens_per_update / (world_size * max_tokens)))


def epoch_order(n_batches: int, seed: int, epoch: int) -> np.ndarray:
    """The batch order of an epoch: a permutation drawn from ``(seed, epoch)`` alone, so a resumed run (or any rank)
    recomputes it instead of storing it."""
    return np.random.default_rng([seed, epoch]).permutation(n_batches)


def rank_batches(order: np.ndarray, position: int, world_size: int, accum: int, rank: int) -> np.ndarray:
    """This rank's micro-batches of the update that starts at ``position`` of the epoch's ``order``: the update
    takes ``order[position : position + world_size * accum]`` and rank r every world_size-th from the r-th."""
    return order[position : position + world_size * accum][rank::world_size]


# --------------------------------------------------------------------------------------------------------------------
# Data: flat token arrays (no Python object per sentence) and batch collation
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class TokenSplit:
    """One split of the bpe artifact: every sentence's ids in one flat int32 array per side, with offsets."""

    name: str
    src: np.ndarray  # int32 [total source tokens]
    src_off: np.ndarray  # int64 [n + 1]
    tgt: np.ndarray
    tgt_off: np.ndarray
    ids: np.ndarray  # int64 [n]: the rows' ``id`` column

    @property
    def src_len(self) -> np.ndarray:
        return np.diff(self.src_off)

    @property
    def tgt_len(self) -> np.ndarray:
        return np.diff(self.tgt_off)

    def rows(self, ids: np.ndarray, where: str) -> np.ndarray:
        """Row positions of ``ids`` (values of the ``id`` column); an unknown id is an error naming ``where``."""
        n = len(self.ids)
        if n and self.ids[0] == 0 and self.ids[-1] == n - 1 and np.array_equal(self.ids, np.arange(n)):
            rows = ids
            bad = (ids < 0) | (ids >= n)
        else:
            order = np.argsort(self.ids, kind="stable")
            pos = np.searchsorted(self.ids, ids, sorter=order)
            pos = np.minimum(pos, max(n - 1, 0))
            rows = order[pos] if n else pos
            bad = (self.ids[rows] != ids) if n else np.ones(len(ids), bool)
        if bad.any():
            raise MtpipeError(f"{where}: references id {int(ids[bad.argmax()])}, which is not in the tokens artifact's "
                              f"{self.name} split (batches and tokens come from different runs: re-run "
                              "`mtpipe bucket`)")
        return rows.astype(np.int64)


def load_split(tokens: Path, split: str) -> TokenSplit:
    """Read ``{split}.parquet`` of the bpe artifact into flat arrays."""
    table_ = artifacts.read_table(tokens, f"{split}.parquet", "tokens")

    def flat(column: str) -> tuple[np.ndarray, np.ndarray]:
        arr = table_.column(column).combine_chunks()  # one ListArray; offsets index into arr.values
        offsets = artifacts.to_numpy(arr.offsets).astype(np.int64)
        values = np.asarray(artifacts.to_numpy(arr.values), dtype=np.int32)
        if offsets[0] != 0 or offsets[-1] != len(values):  # a sliced array: rebase so offsets start at 0
            values, offsets = values[offsets[0] : offsets[-1]], offsets - offsets[0]
        return values, offsets

    src, src_off = flat("src")
    tgt, tgt_off = flat("tgt")
    ids = artifacts.to_numpy(table_.column("id")).astype(np.int64)
    return TokenSplit(split, src, src_off, tgt, tgt_off, ids)


@dataclass
class BatchTable:
    """The bucket artifact's batches of one split as row positions into a :class:`TokenSplit`."""

    rows: np.ndarray  # int64 [sum of batch sizes]: every batch's sentence rows, batch after batch
    off: np.ndarray  # int64 [n_batches + 1]
    src_tokens: np.ndarray  # int64 [n_batches]: real source tokens incl. EOS
    tgt_tokens: np.ndarray  # int64 [n_batches]: real target tokens incl. EOS (= tokens the loss is computed on)
    src_width: np.ndarray  # int64 [n_batches]: padded source length (EOS included)
    tgt_width: np.ndarray  # int64 [n_batches]: padded target length (BOS / EOS included)

    def __len__(self) -> int:
        return len(self.off) - 1

    def batch(self, i: int) -> np.ndarray:
        return self.rows[self.off[i] : self.off[i + 1]]


def load_batches(batches: Path, split: str, tokens: TokenSplit) -> BatchTable:
    """Read ``{split}.parquet`` of the bucket artifact; token counts are recomputed from the sentences themselves."""
    name = f"{split}.parquet"
    t = artifacts.read_table(batches, name, "batches", columns=["batch", "ids"])
    arr = t.column("ids").combine_chunks()
    off = artifacts.to_numpy(arr.offsets).astype(np.int64)
    ids = artifacts.to_numpy(arr.values).astype(np.int64)[off[0] : off[-1]]
    off = off - off[0]
    if len(off) < 2:
        raise MtpipeError(f"{batches / name}: has no batches")
    sizes = np.diff(off)
    if (sizes == 0).any():
        raise MtpipeError(f"{batches / name}: batch {int(np.argmin(sizes))} is empty")
    rows = tokens.rows(ids, str(batches / name))
    src_len = tokens.src_len[rows] + 1  # + EOS
    tgt_len = tokens.tgt_len[rows] + 1  # + EOS (tgt_out) / + BOS (tgt_in)
    starts = off[:-1]
    return BatchTable(
        rows=rows, off=off,
        src_tokens=np.add.reduceat(src_len, starts), tgt_tokens=np.add.reduceat(tgt_len, starts),
        src_width=np.maximum.reduceat(src_len, starts), tgt_width=np.maximum.reduceat(tgt_len, starts),
    )


def _pad(values: np.ndarray, off: np.ndarray, rows: np.ndarray, bos: bool, eos: bool) -> np.ndarray:
    """Right-padded ``[B, max_len + 1]`` int64 matrix of the sentences ``rows``, with BOS in front or EOS after."""
    starts, lens = off[rows], off[rows + 1] - off[rows]  # [B], [B]
    b = len(rows)
    out = np.full((b, int(lens.max()) + 1), PAD_ID, dtype=np.int64)
    total = int(lens.sum())
    r = np.repeat(np.arange(b), lens)  # [total]: the batch row of every token
    c = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)  # [total]: its position in the sentence
    out[r, c + int(bos)] = values[np.repeat(starts, lens) + c]
    if bos:
        out[:, 0] = BOS_ID
    if eos:
        out[np.arange(b), lens] = EOS_ID
    return out


def collate(split: TokenSplit, rows: np.ndarray) -> tuple[Tensor, Tensor, Tensor]:
    """``src [B, S]`` = tokens + EOS, ``tgt_in [B, T]`` = BOS + tgt, ``tgt_out [B, T]`` = tgt + EOS; PAD on the
    right (section 3: the decoder input is the target shifted right by one position)."""
    src = _pad(split.src, split.src_off, rows, bos=False, eos=True)
    tgt_in = _pad(split.tgt, split.tgt_off, rows, bos=True, eos=False)
    tgt_out = _pad(split.tgt, split.tgt_off, rows, bos=False, eos=True)
    return torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out)


# --------------------------------------------------------------------------------------------------------------------
# The update
# --------------------------------------------------------------------------------------------------------------------


class LossModule(nn.Module):
    """Features -> non-pad selection -> shared-embedding logits -> smoothed loss sums, as one module so that DDP's
    forward (which prepares the gradient all-reduce) sees the whole computation."""

    def __init__(self, model: nn.Module, label_smoothing: float, features: Callable | None = None):
        super().__init__()
        self.model = model
        self.eps = label_smoothing
        self._features = features

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> tuple[Tensor, Tensor]:
        h = (self._features or self.model.features)(src, tgt_in)  # [B, T, D]
        real = tgt_out != PAD_ID  # [B, T]
        logits = self.model.logits(h[real])  # [N, D] -> [N, V]: the output projection on real positions only
        return label_smoothed_nll(logits, tgt_out[real], self.eps)


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
            compile_features = getattr(model, "compile_features", None)
            features = compile_features() if compile_features else torch.compile(model.features, dynamic=True)
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

    def backward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, scale: float, sync: bool) -> Tensor:
        """Forward and backward of one micro-batch, accumulating the gradient of ``loss_sum * scale``.

        ``sync=False`` skips DDP's gradient all-reduce (an earlier micro-batch of an accumulated update).
        Returns the detached ``[loss_sum, nll_sum]`` (float32, on the device; no host sync).
        """
        with distributed.no_sync(self.module, skip=not sync):
            with runtime.autocast(self.device, self.precision):
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
# Checkpoints
# --------------------------------------------------------------------------------------------------------------------


def list_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """``(step, dir)`` of the training checkpoints under ``out/checkpoints``, by step
    (:func:`mtpipe.artifacts.list_checkpoints`, the rule averaging uses too)."""
    return artifacts.list_checkpoints(out)


# Train keys whose change makes a resumed run differ from the run a fresh start with the new params would give.
# The others (when to stop, save, validate, log; threads, restarts) may change between invocations freely.
TRAJECTORY_KEYS = ("seed", "tokens_per_update", "lr_scale", "warmup", "adam_beta1", "adam_beta2", "adam_eps",
                   "clip_norm", "label_smoothing", "precision", "drophead_start", "drophead_end")


def changed_trajectory_keys(ck: artifacts.Checkpoint, cfg: TrainConfig) -> list[str]:
    """The :data:`TRAJECTORY_KEYS` whose value in ``cfg`` differs from the one the checkpoint was trained with."""
    before = (ck.manifest.params or {}).get("train") or {}
    now = to_dict(cfg)
    return [k for k in TRAJECTORY_KEYS if k in before and before[k] != now[k]]


def _first_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            return k
    return None


def check_resumable(ck: artifacts.Checkpoint, model_config: dict[str, Any], vocab: dict[str, Any]) -> None:
    """Refuse a checkpoint of another vocabulary or model shape, naming what differs."""
    if ck.vocab.get("spm_sha256") != vocab["spm_sha256"] or int(ck.vocab.get("size", -1)) != vocab["size"]:
        raise MtpipeError(
            f"{ck.path}: checkpoint was trained with another vocabulary (spm {str(ck.vocab.get('spm_sha256'))[:19]}, "
            f"size {ck.vocab.get('size')}) than --tokens gives (spm {vocab['spm_sha256'][:19]}, size {vocab['size']}); "
            f"use the bpe artifact it was trained on, train into another --out, or move {ck.path.parent} aside "
            "(mtpipe never deletes checkpoints)"
        )
    key = _first_difference(with_model_defaults(ck.model_config), with_model_defaults(model_config))
    if key is not None:
        raise MtpipeError(
            f"{ck.path}: checkpoint has model.{key}={ck.model_config.get(key)!r} but the params give "
            f"{model_config.get(key)!r}; a new model needs a fresh run: restore the model params, train into another "
            f"--out, or move {ck.path.parent} aside (mtpipe never deletes checkpoints)"
        )
    ts = ck.trainer_state
    if not isinstance(ts, dict) or ts.get("version") != TRAINER_STATE_VERSION:
        raise MtpipeError(f"{ck.path}: trainer.pt is not a resumable mtpipe trainer state (version "
                          f"{ts.get('version') if isinstance(ts, dict) else None}, expected {TRAINER_STATE_VERSION})")


def _rng_state(device: torch.device) -> dict[str, Any]:
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def _seed_for_rank(seed: int, rank: int) -> int:
    """A distinct dropout stream per rank, derived from the seed (same masks on every rank would be correlated)."""
    return int(np.random.SeedSequence([seed, rank, 0x6D74]).generate_state(1, np.uint64)[0] >> 1)


# --------------------------------------------------------------------------------------------------------------------
# Metrics (rank 0)
# --------------------------------------------------------------------------------------------------------------------


def _step_of(line: str, col: int) -> int | None:
    """The step of one TSV row, or None for a row a kill cut short (dvclive appends rows with plain writes)."""
    fields = line.rstrip("\r\n").split("\t")
    try:
        return int(fields[col]) if line.endswith("\n") else None
    except (IndexError, ValueError):
        return None


def _rewind_live(live_dir: Path, step: int) -> None:
    """Put ``OUT/live`` back to checkpoint ``step`` before a resume: drop metric rows logged after it (they came from
    a run killed after its last checkpoint) and rows a kill cut short, so the resumed curve continues the
    checkpoint's without duplicates; and rebuild ``metrics.json`` (dvclive rewrites it in place every step, so a kill
    can leave it empty or half-written, and dvclive's resume reads it) from the latest value of each curve."""
    if not live_dir.exists():
        return
    for tmp in live_dir.rglob(".*.tmp-*"):  # an atomic write the kill interrupted
        tmp.unlink(missing_ok=True)
    summary: dict[str, Any] = {}
    root = live_dir / "plots" / "metrics"
    for path in sorted(root.rglob("*.tsv")):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        header = lines[0].rstrip("\r\n").split("\t") if lines else []
        if "step" not in header:
            continue
        col = header.index("step")
        keep = [lines[0]]
        for ln in lines[1:]:
            s = _step_of(ln, col)
            if s is not None and s <= step and len(ln.rstrip("\r\n").split("\t")) == len(header):
                keep.append(ln)
        if len(keep) != len(lines):
            artifacts.atomic_write_text(path, "".join(keep))
        if len(keep) > 1:  # the metrics.json entry: nested by the metric's path, as dvclive writes it
            node = summary
            *parents, name = path.relative_to(root).with_suffix("").parts
            for part in parents:
                node = node.setdefault(part, {})
            node[name] = float(keep[-1].rstrip("\r\n").split("\t")[-1])
    summary["step"] = step
    artifacts.atomic_write_text(live_dir / "metrics.json", json.dumps(summary, indent=4) + "\n")


class Metrics:
    """dvclive logs under ``OUT/live`` (rank 0 only): ``plots/metrics/<name>.tsv`` per metric with ``step`` as the
    x axis, and ``metrics.json`` with the latest values. No dvc.yaml and no DVC experiment are written, so it
    behaves the same inside and outside a git/DVC repository."""

    def __init__(self) -> None:
        self.live: Any = None

    @rank0_only
    def open(self, out: Path, resume_step: int | None) -> None:
        from dvclive import Live

        class QuietLive(Live):
            """dvclive without its DVC-repository hook: inside a git checkout that has no DVC repository, dvclive
            3.x runs ``dvc init`` (and stages the files in git). We want no experiments, no dvc.yaml and no repo
            changes, only the metric files, which dvc.yaml declares as this stage's plots."""

            def _init_dvc(self) -> None:
                pass

            def make_summary(self) -> None:  # atomically: dvclive's own write truncates the file first
                if self._step is not None:
                    self.summary["step"] = self.step
                artifacts.atomic_write_text(Path(self.metrics_file), json.dumps(self.summary, indent=4,
                                                                                default=float) + "\n")

        live_dir = out / "live"
        if resume_step is not None:
            _rewind_live(live_dir, resume_step)
        self.live = QuietLive(dir=str(live_dir), resume=resume_step is not None, save_dvc_exp=False, dvcyaml=None,
                              report=None)

    @rank0_only
    def log(self, step: int, values: dict[str, float]) -> None:
        self.live.step = step
        for k, v in values.items():
            self.live.log_metric(k, float(v))
        self.live.make_summary()

    @rank0_only
    def close(self) -> None:
        if self.live is not None:
            self.live.end()


# --------------------------------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------------------------------


# Steps between glibc heap trims on CPU (runtime.trim_cpu_memory): measured on the small preset, resident memory
# stays near 3 GB instead of creeping past 7 GB over a 30-minute run, at no measurable cost in tokens/s.
_TRIM_EVERY_STEPS = 100


def _validate_config(cfg: TrainConfig) -> None:
    checks = [
        (cfg.tokens_per_update >= 1, "tokens_per_update", "must be >= 1"),
        (cfg.warmup >= 1, "warmup", "must be >= 1"),
        (cfg.lr_scale > 0, "lr_scale", "must be > 0"),
        (0.0 <= cfg.label_smoothing < 1.0, "label_smoothing", "must be in [0, 1)"),
        (cfg.max_steps >= 0 and cfg.max_epochs >= 0 and cfg.max_time >= 0, "max_steps/max_epochs/max_time",
         "must be >= 0"),
        (cfg.max_steps > 0 or cfg.max_epochs > 0 or cfg.max_time > 0, "max_steps/max_epochs/max_time",
         "are all 0: set at least one stopping criterion"),
        (cfg.keep_last >= 1, "keep_last", "must be >= 1"),
        (cfg.log_every_steps >= 1, "log_every_steps", "must be >= 1"),
        (cfg.max_bad_steps >= 1, "max_bad_steps", "must be >= 1"),
        (cfg.seed >= 0, "seed", "must be >= 0"),
        (cfg.clip_norm >= 0, "clip_norm", "must be >= 0"),
        (cfg.save_every_minutes >= 0 and cfg.save_every_steps >= 0 and cfg.valid_every_steps >= 0,
         "save_every_minutes/save_every_steps/valid_every_steps", "must be >= 0"),
        (0.0 <= cfg.drophead_start < 1.0, "drophead_start", "must be in [0, 1)"),
        (cfg.drophead_end is None or 0.0 <= cfg.drophead_end < 1.0, "drophead_end", "must be in [0, 1)"),
        (not _drophead_on(cfg) or cfg.max_steps > 0 or cfg.max_epochs > 0, "drophead_start/drophead_end",
         "the schedule rises to drophead_end at the last step: set train.max_steps or train.max_epochs"),
    ]
    for ok, key, problem in checks:
        if not ok:
            raise MtpipeError(f"train.{key}: {problem}")


def _drophead_on(cfg: TrainConfig) -> bool:
    return cfg.drophead_start > 0 or (cfg.drophead_end or 0.0) > 0


class Trainer:
    """The training run of one process (rank) of a launch."""

    def __init__(self, model_cfg: ModelConfig, cfg: TrainConfig, tokens: Path, batches: Path, out: Path):
        self.cfg, self.tokens, self.batches, self.out = cfg, Path(tokens), Path(batches), Path(out)
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
        self._load_data()

        # Model: identical initialisation on every rank (one seed), then one dropout stream per rank.
        torch.manual_seed(cfg.seed)
        from mtpipe.model import Transformer

        self.model = Transformer(model_cfg, self.vocab["size"])
        widest = int(max(self.train.src_width.max(), self.train.tgt_width.max()))
        if widest > self.model.cfg.max_positions:
            raise MtpipeError(f"{self.batches}: batches hold sequences of {widest} positions but "
                              f"model.max_positions={self.model.cfg.max_positions}; lower bucket.max_len or raise "
                              "model.max_positions")
        if self.valid is not None:
            self._drop_long_valid_batches(self.model.cfg.max_positions)
        self.model.to(self.device)
        # The update count DropHead's schedule ends at: max_steps, else what max_epochs amount to.
        self.total_steps = cfg.max_steps or cfg.max_epochs * self.usable // self.per_update
        torch.manual_seed(_seed_for_rank(cfg.seed, self.rank))
        self.model_config = to_dict(self.model.cfg)

        # Training position (overwritten by a resume).
        self.step, self.epoch, self.position = 0, 0, 0
        self.bad_steps, self.overflows = 0, 0
        self.train_seconds = 0.0
        self.tgt_seen, self.src_seen = 0, 0
        self.window = {"loss": 0.0, "nll": 0.0, "tokens": 0, "updates": 0, "grad_norm": 0.0}
        self.last_valid_step = -1
        self.last_valid: dict[str, float] = {}
        self.resumed_from: Path | None = None
        ck = self._find_resume()
        if ck is not None:
            self.model.load_state_dict(ck.state_dict)
        self.updater = Updater(self.model, cfg, self.device, self.precision)
        if ck is not None:
            self._restore(ck)
        self.metrics = Metrics()

    # -- data ----------------------------------------------------------------------------------------------------

    def _load_data(self) -> None:
        tm = artifacts.read_manifest(self.tokens, "tokens")
        spm, size = tm.extra.get("spm_sha256"), tm.extra.get("vocab_size")
        if not spm or not isinstance(size, int):
            raise MtpipeError(f"{self.tokens}: tokens manifest lacks extra.spm_sha256 / extra.vocab_size")
        self.vocab = {"spm_sha256": spm, "size": size}
        bm = artifacts.read_manifest(self.batches, "batches")
        try:
            self.max_tokens = int(bm.params["bucket"]["max_tokens"])
        except (KeyError, TypeError, ValueError):
            raise MtpipeError(f"{self.batches}: batches manifest lacks params.bucket.max_tokens") from None
        if bm.upstream and artifacts.manifest_hash(self.tokens) not in bm.upstream.values():
            raise MtpipeError(f"{self.batches}: these batches were made from another bpe artifact than {self.tokens} "
                              "(upstream hash differs): re-run `mtpipe bucket` on it")
        self.train_tokens = load_split(self.tokens, "train")
        self.train = load_batches(self.batches, "train", self.train_tokens)
        self.accum = accumulation(self.cfg.tokens_per_update, self.world, self.max_tokens)
        self.per_update = self.world * self.accum
        self.usable = (len(self.train) // self.per_update) * self.per_update
        if self.usable == 0:
            raise MtpipeError(f"{self.batches}: train has {len(self.train)} batches, fewer than one update needs "
                              f"({self.world} processes x {self.accum} accumulation): lower train.tokens_per_update "
                              "or bucket.max_tokens")
        self.valid_tokens = self.valid = None
        if "valid.parquet" in bm.files and "valid.parquet" in tm.files:
            self.valid_tokens = load_split(self.tokens, "valid")
            self.valid = load_batches(self.batches, "valid", self.valid_tokens)
        else:
            warn(f"{self.batches}: no valid split: validation is skipped")

    def _drop_long_valid_batches(self, max_positions: int) -> None:
        """The bucket stage never drops valid pairs, so an over-long one sits alone in its batch: leave such batches
        out of the validation loss (with a warning) instead of failing after hours of training."""
        v = self.valid
        assert v is not None
        ok = np.maximum(v.src_width, v.tgt_width) <= max_positions
        if ok.all():
            return
        warn(f"{self.batches}: {int((~ok).sum())} valid batch(es) hold sentences longer than "
             f"model.max_positions={max_positions}: left out of the validation loss")
        if not ok.any():
            self.valid = self.valid_tokens = None
            return
        keep = np.flatnonzero(ok)
        sizes = np.diff(v.off)[keep]
        rows = np.concatenate([v.batch(int(i)) for i in keep])
        self.valid = BatchTable(rows=rows, off=np.concatenate([[0], np.cumsum(sizes)]), src_tokens=v.src_tokens[keep],
                                tgt_tokens=v.tgt_tokens[keep], src_width=v.src_width[keep],
                                tgt_width=v.tgt_width[keep])

    def _to_device(self, tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        if self.device.type == "cuda":
            return tuple(t.pin_memory().to(self.device, non_blocking=True) for t in tensors)
        return tensors

    # -- resume --------------------------------------------------------------------------------------------------

    def _find_resume(self) -> artifacts.Checkpoint | None:
        """Rank 0 picks the latest complete checkpoint (and removes half-written ones a kill left behind); every
        rank loads that one (the output directory must be shared between nodes)."""
        latest = self._latest_checkpoint()
        latest = distributed.broadcast_object(latest)
        if latest is None:
            return None
        path = Path(latest)
        if not path.exists():
            raise MtpipeError(f"{path}: rank {self.rank} cannot see rank 0's checkpoint: --out must be on a "
                              "filesystem shared by every node")
        ck = artifacts.load_checkpoint(path, trainer_state=True, device=str(self.device))
        check_resumable(ck, self.model_config, self.vocab)
        changed = changed_trajectory_keys(ck, self.cfg)
        if changed:
            before = ck.manifest.params["train"]
            warn(f"resuming {ck.path} with changed "
                 + ", ".join(f"train.{k} ({before[k]!r} -> {getattr(self.cfg, k)!r})" for k in changed)
                 + ": training continues from its step with the new values, which is not the run a fresh start "
                 f"would give; for that, train into another --out or move {ck.path.parent} aside")
        return ck

    @rank0_only
    def _latest_checkpoint(self) -> str | None:
        ck_dir = self.out / "checkpoints"
        if ck_dir.is_dir():
            for d in ck_dir.iterdir():  # leftovers of a checkpoint write that was killed (see ArtifactWriter)
                if d.name.startswith(".step_") and (".tmp-" in d.name or ".old-" in d.name):
                    shutil.rmtree(d, ignore_errors=True)
        found = list_checkpoints(self.out)
        return str(found[-1][1]) if found else None

    def _restore(self, ck: artifacts.Checkpoint) -> None:
        ts = ck.trainer_state
        assert ts is not None
        self.updater.optimizer.load_state_dict(ts["optimizer"])
        if self.updater.scaler is not None and ts.get("scaler"):
            self.updater.scaler.load_state_dict(ts["scaler"])
        self.step, self.epoch, self.position = int(ts["step"]), int(ts["epoch"]), int(ts["position"])
        self.bad_steps, self.overflows = int(ts["bad_steps"]), int(ts["overflows"])
        self.train_seconds = float(ts["train_seconds"])
        self.tgt_seen, self.src_seen = int(ts["tgt_seen"]), int(ts["src_seen"])
        self.window = dict(ts["window"])
        self.last_valid_step, self.last_valid = int(ts["last_valid_step"]), dict(ts["last_valid"])
        rngs = ts["rng"]
        if len(rngs) == self.world and ts.get("accum") == self.accum:
            _set_rng_state(rngs[self.rank], self.device)
        else:
            warn(f"resuming {ck.path.name} with {self.world} process(es) x {self.accum} accumulation (it was written "
                 f"with {len(rngs)} x {ts.get('accum')}): training continues, but not bitwise like an uninterrupted "
                 "run")
            torch.manual_seed(_seed_for_rank(self.cfg.seed + self.step, self.rank))
        if ck.manifest.upstream.get("batches") not in (None, artifacts.manifest_hash(self.batches)):
            warn(f"{self.batches}: the batches changed since {ck.path.name} was written: continuing at the same "
                 "epoch and position of the new batch order (not an exact resume)")
        if self.position + self.per_update > self.usable:  # another world size can end the epoch earlier
            self.epoch, self.position = self.epoch + 1, 0
        self.resumed_from = ck.path

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def _trainer_state(self, rngs: list[dict[str, Any]]) -> dict[str, Any]:
        """Everything an exact resume needs; plain tensors/numbers/lists/dicts only (torch.load weights_only)."""
        scaler = self.updater.scaler
        return {
            "version": TRAINER_STATE_VERSION,
            "step": self.step, "epoch": self.epoch, "position": self.position,
            "world_size": self.world, "accum": self.accum,
            "optimizer": self.updater.optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else {},
            "rng": rngs,
            "bad_steps": self.bad_steps, "overflows": self.overflows,
            "train_seconds": self.train_seconds, "tgt_seen": self.tgt_seen, "src_seen": self.src_seen,
            "window": dict(self.window),
            "last_valid_step": self.last_valid_step, "last_valid": dict(self.last_valid),
            "seed": self.cfg.seed,
        }

    def save(self) -> None:
        """Checkpoint at the current step (a collective: every rank contributes its RNG state)."""
        rngs = distributed.all_gather_object(_rng_state(self.device))
        self._write(rngs)
        self.last_saved_step = self.step

    @rank0_only
    def _write(self, rngs: list[dict[str, Any]]) -> None:
        path = artifacts.checkpoint_path(self.out, self.step)
        artifacts.write_checkpoint(
            path, state_dict=self.model.state_dict(), model_config=self.model_config, vocab=self.vocab,
            step=self.step, trainer_state=self._trainer_state(rngs),
            params={"model": self.model_config, "train": to_dict(self.cfg)},
            upstream={"tokens": self.tokens, "batches": self.batches},
            extra={"epoch": self.epoch, "world_size": self.world, "precision": self.precision},
        )
        for _, old in list_checkpoints(self.out)[: -self.cfg.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # -- validation ----------------------------------------------------------------------------------------------

    def validate(self) -> dict[str, float]:
        """Loss and perplexity on the valid batches; ranks split the batches and sum (section 6.2's dev set)."""
        assert self.valid is not None and self.valid_tokens is not None
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for i in range(self.rank, len(self.valid), self.world):
                batch = self._to_device(collate(self.valid_tokens, self.valid.batch(i)))
                with runtime.autocast(self.device, self.precision):
                    loss, nll = self.updater.loss_module(*batch)
                sums += torch.stack([loss, nll]).double()
        distributed.all_reduce_sum(sums)
        self.model.train()
        loss, nll = (float(x) for x in sums.tolist())
        ntok = int(self.valid.tgt_tokens.sum())
        self.last_valid_step = self.step
        self.last_valid = {"valid/loss": loss / ntok, "valid/nll": nll / ntok,
                           "valid/ppl": math.exp(min(nll / ntok, 700.0))}
        return self.last_valid

    # -- the loop ------------------------------------------------------------------------------------------------

    def _micro_batches(self, order: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        for b in rank_batches(order, self.position, self.world, self.accum, self.rank):
            yield int(b), self.train.batch(int(b))

    def _update(self, order: np.ndarray, flags: list[float]) -> tuple[list[float], float, str, int, int]:
        """One update: this rank's micro-batches, the all-reduced loss and control flags, and the optimizer step.
        Returns ``(reduced [loss, nll, *flags], grad_norm, status, target tokens, source tokens)``."""
        group = order[self.position : self.position + self.per_update]
        ntok, nsrc = int(self.train.tgt_tokens[group].sum()), int(self.train.src_tokens[group].sum())
        # DDP averages gradients over ranks: scale each rank's sum by world/ntok for the global per-token gradient.
        scale = self.world / ntok
        if _drophead_on(self.cfg):
            self.model.set_drophead(self._drophead(self.step + 1))
        sums = torch.zeros(2, dtype=torch.float32, device=self.device)
        mine = list(self._micro_batches(order))
        for i, (b, rows) in enumerate(mine):
            batch = self._to_device(collate(self.train_tokens, rows))
            try:
                sums += self.updater.backward(*batch, scale=scale, sync=i == len(mine) - 1)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                if not _is_oom(e):
                    raise
                src, _, tgt = batch
                raise MtpipeError(
                    f"out of memory on {self.device} in train batch {b} ({src.shape[0]} sentences, {src.shape[1]} "
                    f"source x {tgt.shape[1]} target positions, {int(self.train.tgt_tokens[b])} target tokens): "
                    f"rebuild the batches with a smaller bucket.max_tokens (these have {self.max_tokens}), e.g. "
                    f"`mtpipe bucket --max-tokens {max(self.max_tokens // 2, 1)}`; train.tokens_per_update keeps the "
                    "update size by accumulating more batches"
                ) from None
        vec = torch.cat([sums.double(), torch.tensor(flags, dtype=torch.float64, device=self.device)])
        reduced = distributed.all_reduce_sum(vec).tolist()
        lr = learning_rate(self.step + 1, self.model.cfg.d_model, self.cfg.warmup, self.cfg.lr_scale)
        norm, status = self.updater.finish(lr, skip=not math.isfinite(reduced[0]))
        return reduced, norm, status, ntok, nsrc

    def train_loop(self) -> str:
        """Run updates until a stopping criterion; returns the reason."""
        cfg = self.cfg
        self.last_saved_step = self.step if self.resumed_from is not None else -1
        t_start = time.monotonic()
        seconds_before = self.train_seconds
        last_save = t_start
        win_t0, win_tok, win_src = t_start, 0, 0
        order = epoch_order(len(self.train), cfg.seed, self.epoch)
        total = cfg.max_steps or (cfg.max_epochs * self.usable // self.per_update if cfg.max_epochs else None)
        reason = ""
        if cfg.max_steps and self.step >= cfg.max_steps:
            return "max_steps"
        if cfg.max_epochs and self.epoch >= cfg.max_epochs:
            return "max_epochs"
        from rich.progress import TextColumn

        with progress(TextColumn("{task.fields[stats]}")) as bar:
            task = bar.add_task("train", total=total, completed=self.step, stats="")
            while not reason:
                now = time.monotonic()
                elapsed = seconds_before + now - t_start
                flags = [0.0, 0.0]
                if self.rank == 0:  # rank 0's clock decides; the flags travel in the update's all-reduce
                    flags[0] = float(cfg.save_every_minutes > 0 and now - last_save >= 60 * cfg.save_every_minutes)
                    flags[1] = float(cfg.max_time > 0 and elapsed >= 60 * cfg.max_time)
                reduced, norm, status, ntok, nsrc = self._update(order, flags)
                self.position += self.per_update
                save_due, time_up = reduced[2] > 0, reduced[3] > 0
                if status == "skipped":
                    self.bad_steps += 1
                    warn(f"update {self.step + 1}: non-finite loss ({reduced[0] / ntok:.4g}) or gradient norm "
                         f"({norm:.4g}): skipped ({self.bad_steps} in a row)")
                    if self.bad_steps >= cfg.max_bad_steps:
                        raise MtpipeError(
                            f"training diverged: {self.bad_steps} updates in a row had a non-finite loss or gradient "
                            f"(last at update {self.step + 1}, epoch {self.epoch + 1}); lower train.lr_scale, set "
                            "train.clip_norm, or use train.precision=fp32"
                        )
                elif status == "overflow":
                    self.overflows += 1
                else:
                    self.bad_steps = 0
                    self.step += 1
                    self.tgt_seen, self.src_seen = self.tgt_seen + ntok, self.src_seen + nsrc
                    w = self.window
                    w["loss"] += reduced[0]
                    w["nll"] += reduced[1]
                    w["tokens"] += ntok
                    w["updates"] += 1
                    w["grad_norm"] += norm
                    win_tok, win_src = win_tok + ntok, win_src + nsrc
                if self.position + self.per_update > self.usable:
                    self.epoch, self.position = self.epoch + 1, 0
                    order = epoch_order(len(self.train), cfg.seed, self.epoch)
                self.train_seconds = seconds_before + time.monotonic() - t_start
                advanced = status == "ok"
                if advanced and self.step % cfg.log_every_steps == 0 and self.window["updates"]:
                    now = time.monotonic()
                    values = self._window_values(win_tok / max(now - win_t0, 1e-9), win_src / max(now - win_t0, 1e-9))
                    self.metrics.log(self.step, values)
                    bar.update(task, stats=f"loss {values['train/loss']:.3f} | "
                                           f"{values['train/tgt_tokens_per_s']:,.0f} tgt tok/s")
                    if not console.is_terminal:
                        info(self._line(values))
                    win_t0, win_tok, win_src = now, 0, 0
                if advanced and self.step % _TRIM_EVERY_STEPS == 0 and self.device.type == "cpu":
                    runtime.trim_cpu_memory()
                valid_due = cfg.valid_every_steps and self.step % cfg.valid_every_steps == 0
                if advanced and valid_due and self.valid is not None:
                    vals = self.validate()
                    self.metrics.log(self.step, vals)
                    info(f"step {self.step:,}: valid loss {vals['valid/loss']:.4f}, ppl {vals['valid/ppl']:.2f}")
                if cfg.max_steps and self.step >= cfg.max_steps:
                    reason = "max_steps"
                elif cfg.max_epochs and self.epoch >= cfg.max_epochs:
                    reason = "max_epochs"
                elif time_up:
                    reason = "max_time"
                if advanced and not reason and (save_due or (cfg.save_every_steps and
                                                             self.step % cfg.save_every_steps == 0)):
                    self.save()
                    last_save = time.monotonic()
                bar.update(task, completed=self.step)
        return reason

    def _drophead(self, step: int) -> float:
        return drophead_rate(step, self.cfg.warmup, self.total_steps, self.cfg.drophead_start, self.cfg.drophead_end)

    def _window_values(self, tgt_per_s: float, src_per_s: float) -> dict[str, float]:
        w = self.window
        values = {
            "train/loss": w["loss"] / w["tokens"], "train/nll": w["nll"] / w["tokens"],
            "train/ppl": math.exp(min(w["nll"] / w["tokens"], 700.0)),
            "train/lr": learning_rate(self.step, self.model.cfg.d_model, self.cfg.warmup, self.cfg.lr_scale),
            "train/grad_norm": w["grad_norm"] / w["updates"],
            "train/tgt_tokens_per_s": tgt_per_s, "train/tokens_per_s": tgt_per_s + src_per_s,
            "epoch": self.epoch + self.position / self.usable,
        }
        if _drophead_on(self.cfg):
            values["train/drophead"] = self._drophead(self.step)
        self.last_train = values
        self.window = {"loss": 0.0, "nll": 0.0, "tokens": 0, "updates": 0, "grad_norm": 0.0}
        return values

    def _line(self, v: dict[str, float]) -> str:
        """A log line for non-terminal output (DVC, CI, files), where no progress bar is drawn."""
        return (f"step {self.step:,}  epoch {v['epoch']:.2f}  loss {v['train/loss']:.3f}  ppl {v['train/ppl']:.1f}  "
                f"lr {v['train/lr']:.2e}  |g| {v['train/grad_norm']:.2f}  {v['train/tgt_tokens_per_s']:,.0f} tok/s")

    def run(self) -> dict[str, Any]:
        self.last_train: dict[str, float] = {}
        t0 = time.monotonic()
        if self.resumed_from is not None:
            info(f"resuming from {self.resumed_from} (step {self.step:,}, epoch {self.epoch + 1}, batch "
                 f"{self.position:,}/{self.usable:,})")
        info(f"training {sum(p.numel() for p in self.model.parameters()):,} parameters on {self.world} x "
             f"{self.device.type} ({self.precision}), {self.accum} batch(es) of <= {self.max_tokens:,} tokens per "
             f"process per update, {len(self.train):,} batches per epoch ({len(self.train) - self.usable} left out)")
        self.metrics.open(self.out, self.step if self.resumed_from is not None else None)
        start_step, start_tokens = self.step, self.tgt_seen
        try:
            reason = self.train_loop()
            if self.valid is not None and self.last_valid_step != self.step:
                self.metrics.log(self.step, self.validate())
            if self.step > 0 and self.last_saved_step != self.step:
                self.save()
            elif self.step == 0:
                warn("no update was made: no checkpoint written")
        finally:
            self.metrics.close()
        seconds = time.monotonic() - t0
        summary = self._summary(reason, self.step - start_step, (self.tgt_seen - start_tokens) / max(seconds, 1e-9))
        self._report(summary)
        return summary

    def _summary(self, reason: str, updates_now: int, tgt_per_s: float) -> dict[str, Any]:
        found = list_checkpoints(self.out) if distributed.is_rank0() else []
        return {
            "steps": self.step, "updates_this_run": updates_now, "stopped_by": reason,
            "epochs": round(self.epoch + self.position / self.usable, 4),
            "target_tokens": self.tgt_seen, "source_tokens": self.src_seen,
            "train_loss": self.last_train.get("train/loss"), "train_ppl": self.last_train.get("train/ppl"),
            "valid_loss": self.last_valid.get("valid/loss"), "valid_nll": self.last_valid.get("valid/nll"),
            "valid_ppl": self.last_valid.get("valid/ppl"),
            "train_minutes": round(self.train_seconds / 60, 3),
            "tgt_tokens_per_s": round(tgt_per_s, 1),  # this invocation, validation and checkpoints included
            "processes": self.world, "accumulation": self.accum, "batches_per_update": self.per_update,
            "max_tokens": self.max_tokens, "precision": self.precision, "device": self.device.type,
            "bad_steps_skipped": self.bad_steps, "fp16_overflows": self.overflows,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "checkpoints": [str(p) for _, p in found],
            "model": self.model_config, "vocab": self.vocab,
        }

    @rank0_only
    def _report(self, s: dict[str, Any]) -> None:
        artifacts.atomic_write_text(self.out / "train.json", json.dumps(s, indent=2, sort_keys=True) + "\n")
        rows = [
            ("steps", s["steps"]), ("epochs", s["epochs"]), ("stopped by", s["stopped_by"]),
            ("target tokens", s["target_tokens"]), ("train loss", s["train_loss"]), ("train ppl", s["train_ppl"]),
            ("valid loss", s["valid_loss"]), ("valid ppl", s["valid_ppl"]),
            ("training time (min)", s["train_minutes"]), ("target tokens/s (this run)", s["tgt_tokens_per_s"]),
            ("processes x accumulation", f"{s['processes']} x {s['accumulation']}"),
            ("precision / device", f"{s['precision']} / {s['device']}"),
            ("last checkpoint", s["checkpoints"][-1] if s["checkpoints"] else None),
        ]
        table(f"train: {self.out}", ["", "value"], rows)


def run(model_cfg: ModelConfig, cfg: TrainConfig, tokens: Path, batches: Path, out: Path, *,
        force: bool = False) -> dict[str, Any]:
    """``mtpipe train``: train (or resume training) into ``out``; returns the summary written to ``out/train.json``.
    ``out`` must be absent, empty or a run directory of `mtpipe train` (``force`` lifts the last rule)."""
    _validate_config(cfg)
    artifacts.check_output_place(out, [tokens, batches])
    artifacts.check_run_dir(out, force=force)
    ctx = distributed.init(cfg.device)
    if ctx.device.type == "cpu":
        runtime.tune_cpu_allocator()
    try:
        return Trainer(model_cfg, cfg, Path(tokens), Path(batches), Path(out)).run()
    finally:
        distributed.cleanup()
