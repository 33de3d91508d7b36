"""``mtpipe train``: the Transformer trained as in the paper's section 5, on 1 process or N under torchrun.

The entry point (:func:`train_model`); the loop is :class:`mtpipe.training.trainer.Trainer`'s. Where each part of
section 5 lives:

* Data (5.1, :mod:`mtpipe.training.batches`): the bucket artifact's token-budget batches of the bpe artifact's
  sentences; an update takes the next batches of the epoch's order, rank r every world_size-th of them or its share
  of their sentences.
* Batch size (5.1, "approximately 25000 source tokens and 25000 target tokens"): ``train.tokens_per_update`` sets
  the batches per update, ``ceil(tokens_per_update / bucket.max_tokens)`` on any number of processes (within 10 %:
  :func:`mtpipe.training.batches.update_layout`), accumulated or shared, so 1 GPU, 8 and 16 train the same global
  batch. DDP all-reduces gradients once per update (``no_sync`` on earlier micro-batches).
* Loss (5.4, :mod:`mtpipe.training.loss`) and optimizer (5.3, :mod:`mtpipe.training.update`): label-smoothed
  cross-entropy summed over the real target tokens of the whole update and divided by their count; Adam at
  ``lr = lr_scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)``, optional gradient-norm clipping.
  Precision: bf16 autocast (GPU, and CPUs with AMX/AVX512-BF16), fp16 autocast + grad scaler (GPU), fp32 (TF32
  matmuls on GPU); optional ``torch.compile``.
* Regularisers beyond the paper (off by default): LayerDrop (``model.layerdrop``, drawn inside the model; DDP then
  expects unused parameters) and Scheduled DropHead (``train.drophead_start/_end``): the rate of
  :func:`mtpipe.training.update.drophead_rate` for each update is set on the model.
* Checkpoints (:mod:`mtpipe.training.checkpoints`): ``OUT/checkpoints/step_{step:08d}`` (rank 0, atomic), the last
  ``train.keep_last`` kept. ``trainer.pt`` holds everything for an exact resume (:mod:`mtpipe.training.state`,
  :mod:`mtpipe.training.resume`): the same command on the same ``OUT`` continues from the latest checkpoint, and
  the loss curve from there equals the uninterrupted run's (bitwise on CPU).
* Fine-tuning (:mod:`mtpipe.training.finetune`): ``train.finetune_from`` starts a fresh run (optimizer, schedule,
  step counter) from another checkpoint's weights, its model and vocabulary; a run folder with checkpoints resumes.
* Metrics (:mod:`mtpipe.training.metrics`): dvclive under ``OUT/live`` (``plots/metrics/{train,valid}/*.tsv``
  with ``step`` as x, for ``dvc plots``), ``OUT/train.json`` (final summary), ``OUT/train.log`` (the same lines as
  plain text, appended across resumes), a rich progress bar (its time left and fill honour ``train.max_time``:
  :mod:`mtpipe.training.budget`) and summary table.
* Validation (section 6.2's dev set, :mod:`mtpipe.training.validation`): loss/perplexity every
  ``train.valid_every_steps``; BLEU of greedy translations of a fixed valid sample every
  ``train.valid_bleu_every_steps``. Each validation of ``train.stop_metric`` that improves on the best writes that
  step's checkpoint, which ``keep_last`` never removes (``OUT/best.json``); ``train.patience`` such validations in a
  row without improvement stop training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtpipe import writing
from mtpipe.config import ModelConfig, TrainConfig
from mtpipe.engine import runtime
from mtpipe.training import distributed
from mtpipe.training.trainer import Trainer


def train_model(model_cfg: ModelConfig, cfg: TrainConfig, tokens: Path, batches: Path, out: Path, *,
        force: bool = False, decode: dict[str, Any] | None = None) -> dict[str, Any]:
    """``mtpipe train``: train (or resume training) into ``out``; returns the summary written to ``out/train.json``.
    ``out`` must be absent, empty or a run directory of `mtpipe train` (``force`` lifts the last rule). ``decode``:
    the decode settings every checkpoint records (:data:`mtpipe.config.RECORDED_DECODE`)."""
    # train's rules across keys: TrainConfig.check
    writing.check_output_place(out, [tokens, batches, cfg.finetune_from])
    writing.check_run_dir(out, force=force)
    ctx = distributed.init(cfg.device, timeout=cfg.dist_timeout)
    if ctx.device.type == "cpu":
        runtime.tune_cpu_allocator()
    try:
        return Trainer(model_cfg, cfg, Path(tokens), Path(batches), Path(out), decode).run()
    finally:
        distributed.cleanup()
