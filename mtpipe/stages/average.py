"""``mtpipe average``: checkpoint averaging (paper section 6.1).

"For the base models, we used a single model obtained by averaging the last 5 checkpoints, which were written at
10-minute intervals. For the big models, we averaged the last 20 checkpoints." Averaging the parameters of nearby
points of one training run smooths the optimiser's noise and gains BLEU at no decoding cost.

Which checkpoints (all are ``checkpoint`` artifacts, see :func:`mtpipe.writing.write_checkpoint`):

* by default the last ``average.last`` of ``RUN/checkpoints/*/`` ordered by the step in their manifests (never by
  directory name), optionally only those at or before ``average.up_to_step``;
* with ``average.select=best``, the ``average.last`` best of them by the run's ``train.stop_metric`` (valid
  perplexity, lower is better, or valid BLEU, higher is better), as recorded in the manifest of each checkpoint that
  was validated at its own step (:func:`checkpoint_metric`; training keeps the best one whatever ``keep_last``
  removes); checkpoints without a recorded value are left out, and too few is a one-line error;
* or exactly the directories given with ``--checkpoint`` (repeatable).

Previously averaged checkpoints found under ``RUN/checkpoints`` are skipped: averaging averages again would weight
the inputs unequally. Every input must have the same model config, vocabulary (SentencePiece hash and size), tensor
names, shapes and dtypes; the first mismatch is named. Floating-point tensors are summed in float64, whatever their
stored dtype (a bf16 running sum would lose the small differences that averaging is about), and the mean is cast
back to the stored dtype. Non-floating tensors (counters, masks) are not averaged: the newest input's value is kept.

Output: a weights-only checkpoint (no ``trainer.pt``: it cannot be resumed, only decoded or fine-tuned) at the
largest input step, whose manifest lists the inputs in ``extra["averaged"]`` (path, step, manifest hash) and their
manifest hashes under ``upstream``. Its manifest is the newest input's with the averaging's own fields set
(:meth:`mtpipe.artifacts.CheckpointManifest.for_average`): every other field is carried, whatever it is
and whenever it was added, but a validation measured on an input's weights (``extra["valid"]``). It carries the
SentencePiece model and the recorded decode settings of the newest input that has them (:func:`carried`), so that it
decodes on its own as its inputs do. An average of a fine-tune's checkpoints carries their lineage
(``extra["finetuned_from"]``, the parent they were fine-tuned from: :func:`carried_lineage`), so that a model made by
fine-tuning names its parent however it was averaged.

``average.prune`` (LayerDrop, Fan et al. 2019; :func:`mtpipe.engine.pruning.prune_plan`) then removes layers from the average:
the output's model config has the reduced layer counts (``layerdrop`` kept as a record), so ``mtpipe decode`` runs
the smaller model without any flag; ``extra["pruned"]`` lists the kept layers (0-based, of the inputs' stacks).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from mtpipe import artifacts, writing
from mtpipe.config import AverageConfig, ModelConfig, to_dict, with_model_defaults
from mtpipe.console import info, progress, table, warn
from mtpipe.errors import MtpipeError


def discover(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every training checkpoint under ``run_dir/checkpoints``, sorted by step
    (:func:`mtpipe.artifacts.list_checkpoints`: the same rule as training's)."""
    if not run_dir.exists():
        raise MtpipeError(f"{run_dir}: train output directory not found")
    if not (run_dir / artifacts.CHECKPOINTS).is_dir():
        raise MtpipeError(f"{run_dir}: has no checkpoints/ directory (is it a `mtpipe train` output directory?)")
    return artifacts.list_checkpoints(run_dir)


def select(cfg: AverageConfig, run_dir: Path, checkpoints: list[Path] | None) -> list[tuple[int, Path]]:
    """The ``(step, directory)`` inputs to average, sorted by step."""
    if checkpoints:
        chosen: dict[Path, tuple[int, Path]] = {}
        for d in map(Path, checkpoints):
            if d.resolve() in chosen:
                raise MtpipeError(f"--checkpoint {d}: given twice (each checkpoint would count double)")
            chosen[d.resolve()] = (artifacts.checkpoint_fields(d).step, d)
        return sorted(chosen.values(), key=lambda sd: sd[0])

    found = discover(run_dir)
    where = f"{run_dir / 'checkpoints'}"
    if cfg.up_to_step is not None:
        found = [(s, d) for s, d in found if s <= cfg.up_to_step]
        where += f" at or before step {cfg.up_to_step:,}"
    if not found:
        raise MtpipeError(f"{where}: no checkpoints to average")
    if cfg.select == "best":
        return _best(cfg, found, where)
    picked = found[-cfg.last:]
    if len(picked) < cfg.last:
        msg = f"{where}: asked to average the last {cfg.last} checkpoints but only {len(picked)} exist"
        if not cfg.allow_fewer:
            raise MtpipeError(msg + " (lower --last, or pass --allow-fewer)")
        warn(msg + "; averaging those (--allow-fewer)")
    return picked


def checkpoint_metric(d: Path, m: artifacts.Manifest) -> tuple[str, float | None]:
    """``(train.stop_metric, its value)`` of a training checkpoint: the run's metric from the manifest's train params,
    and the validation at the checkpoint's step that training recorded (``extra["valid"]``), or None when the
    checkpoint was written without one (or before mtpipe recorded them)."""
    metric = ((m.params or {}).get("train") or {}).get("stop_metric", "valid_ppl")
    if metric not in artifacts.STOP_METRICS:
        raise MtpipeError(f"{d}: checkpoint manifest names an unknown train.stop_metric {metric!r}")
    value = (artifacts.checkpoint_fields(d, m).valid or {}).get(artifacts.STOP_METRICS[metric][0])
    return metric, None if value is None else float(value)


def rank_best(measured: list[tuple[int, Path, float]], metric: str, n: int) -> list[tuple[int, Path]]:
    """The ``n`` best of ``(step, directory, value)`` by ``metric`` (ties: the newer first), sorted by step."""
    higher = artifacts.STOP_METRICS[metric][1]
    ranked = sorted(measured, key=lambda sdv: ((-sdv[2] if higher else sdv[2]), -sdv[0]))
    return sorted(((s, d) for s, d, _ in ranked[:n]), key=lambda sd: sd[0])


def _best(cfg: AverageConfig, found: list[tuple[int, Path]], where: str) -> list[tuple[int, Path]]:
    """``average.select=best``: the ``average.last`` checkpoints with the best validation of the run's
    ``train.stop_metric``. Only checkpoints validated at their own step have a value; the others are left out
    (named), and too few measured ones is an error, as too few checkpoints is for ``select=last``."""
    measured, unmeasured, metrics = [], [], set()
    for step, d in found:
        metric, value = checkpoint_metric(d, artifacts.read_manifest(d, "checkpoint"))
        metrics.add(metric)
        if value is None:
            unmeasured.append(d.name)
        else:
            measured.append((step, d, value))
    if len(metrics) > 1:
        raise MtpipeError(f"{where}: checkpoints were trained with different train.stop_metric values "
                          f"({', '.join(sorted(metrics))}); select the inputs with --checkpoint")
    metric = metrics.pop()
    if not measured:
        raise MtpipeError(f"{where}: no checkpoint has a recorded {metric} (none was validated at its own step): "
                          "use --select last, or train with validations at the checkpoint steps")
    if unmeasured:
        warn(f"{where}: {len(unmeasured)} checkpoint(s) without a recorded {metric} left out of --select best "
             f"(first: {unmeasured[0]})")
    if len(measured) < cfg.last:
        msg = (f"{where}: asked to average the best {cfg.last} checkpoints by {metric} but only {len(measured)} "
               "have a recorded value")
        if not cfg.allow_fewer:
            raise MtpipeError(msg + " (lower --last, or pass --allow-fewer)")
        warn(msg + "; averaging those (--allow-fewer)")
    picked = rank_best(measured, metric, cfg.last)
    steps = {s for s, _ in picked}
    info(f"averaging the best {len(picked)} by {metric}: "
         + ", ".join(f"step {s:,} ({v:.4g})" for s, _, v in measured if s in steps))
    return picked


def _check_same(what: str, a: dict[str, Any], b: dict[str, Any], ref_path: Path, path: Path) -> None:
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k, "<missing>"), b.get(k, "<missing>")
        if va != vb:
            raise MtpipeError(f"{path}: {what}.{k} = {vb!r} differs from {va!r} in {ref_path}; "
                              "cannot average different models")


def check_compatible(ref: artifacts.Checkpoint, other: artifacts.Checkpoint) -> None:
    """Fail, naming the first differing key, unless ``other`` has ``ref``'s config, vocabulary and tensors."""
    _check_same("model_config", with_model_defaults(ref.model_config), with_model_defaults(other.model_config),
                ref.path, other.path)
    _check_same("vocab", ref.vocab, other.vocab, ref.path, other.path)
    names_a, names_b = set(ref.state_dict), set(other.state_dict)
    for name in sorted(names_a | names_b):
        if name not in names_b:
            raise MtpipeError(f"{other.path}: has no parameter '{name}' (present in {ref.path})")
        if name not in names_a:
            raise MtpipeError(f"{other.path}: has parameter '{name}' that {ref.path} lacks")
        ta, tb = ref.state_dict[name], other.state_dict[name]
        if ta.shape != tb.shape:
            raise MtpipeError(f"{other.path}: parameter '{name}' has shape {tuple(tb.shape)}, "
                              f"{ref.path} has {tuple(ta.shape)}")
        if ta.dtype != tb.dtype:
            raise MtpipeError(f"{other.path}: parameter '{name}' is stored as {tb.dtype}, "
                              f"{ref.path} as {ta.dtype}")


def _check_manifests(inputs: list[tuple[int, Path]]) -> None:
    """Config and vocabulary checks from the manifests alone, before loading any weights."""
    first = artifacts.checkpoint_fields(inputs[0][1])
    for _, d in inputs[1:]:
        m = artifacts.checkpoint_fields(d)
        # checkpoints written before a variant field existed have its default
        _check_same("model_config", with_model_defaults(first.model_config), with_model_defaults(m.model_config),
                    inputs[0][1], d)
        _check_same("vocab", first.vocab, m.vocab, inputs[0][1], d)


def average_state_dicts(inputs: list[tuple[int, Path]]) -> tuple[artifacts.Checkpoint, dict[str, torch.Tensor]]:
    """(the first input's checkpoint, its tensors as meta tensors: for config, vocab, names, shapes and dtypes;
    the averaged state dict).

    Inputs are loaded one at a time into a float64 running sum, so memory is one checkpoint plus the sum, however
    many checkpoints are averaged (20 for the big model).
    """
    ref: artifacts.Checkpoint | None = None
    acc: dict[str, torch.Tensor] = {}
    kept: dict[str, torch.Tensor] = {}
    with progress() as bar:
        task = bar.add_task("averaging", total=len(inputs))
        for _, d in inputs:
            ck = artifacts.load_checkpoint(d)
            if ref is None:
                for name, t in ck.state_dict.items():
                    if t.is_floating_point():
                        acc[name] = t.to(torch.float64, copy=True)
                # Keep only names, shapes and dtypes of the reference (meta tensors): one real copy fewer in memory.
                meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in ck.state_dict.items()}
                ref = dataclasses.replace(ck, state_dict=meta)
            else:
                check_compatible(ref, ck)
                for name, t in ck.state_dict.items():
                    if t.is_floating_point():
                        acc[name] += t.to(torch.float64)
            # Inputs come sorted by step, so the last assignment is the newest value.
            kept.update({name: t for name, t in ck.state_dict.items() if not t.is_floating_point()})
            bar.advance(task)
    assert ref is not None
    n = len(inputs)
    out = {name: (s / n).to(ref.state_dict[name].dtype) for name, s in acc.items()}
    out.update(kept)
    return ref, {name: out[name] for name in ref.state_dict}  # the inputs' tensor order


def carried(inputs: list[tuple[int, Path]]) -> tuple[Path | None, Path | None, dict[str, Any] | None]:
    """``(spm.model, spm.vocab, decode settings)`` the average carries: those of the newest input that has each
    (every input has the same vocabulary, checked before)."""
    spm = spm_vocab = decode = None
    for _, d in reversed(inputs):
        m = artifacts.read_manifest(d, "checkpoint")
        meta = artifacts.checkpoint_fields(d, m)
        if spm is None and (own := artifacts.checkpoint_spm(d, m)) is not None:
            spm = own
            spm_vocab = artifacts.verify_file(d, meta.spm_vocab, m) if meta.spm_vocab is not None else None
        if decode is None:
            decode = meta.decode
    return spm, spm_vocab, decode


def carried_lineage(inputs: list[tuple[int, Path]]) -> dict[str, Any] | None:
    """The parent (``extra["finetuned_from"]``, a lineage record: :func:`mtpipe.artifacts.check_lineage`)
    the average records: that of the newest input that has one; inputs of different parents are warned about (each
    input's own manifest, listed in ``extra["averaged"]``, still names its parent)."""
    records = [r for _, d in inputs if (r := artifacts.checkpoint_fields(d).finetuned_from) is not None]
    if len({r["sha256"] for r in records}) > 1 or (records and len(records) < len(inputs)):
        warn(f"the inputs were not all fine-tuned from one parent: the average records {records[-1]['path']}, the "
             "newest input's")
    return records[-1] if records else None


def average_checkpoints(cfg: AverageConfig, run_dir: Path, checkpoints: list[Path] | None, out: Path, *,
                        force: bool = False) -> Path:
    """Average checkpoints of ``run_dir`` (or exactly ``checkpoints``) into the weights-only checkpoint ``out``."""
    run_dir, out = Path(run_dir), Path(out)
    inputs = select(cfg, run_dir, list(checkpoints) if checkpoints else None)
    writing.prepare_output(out, "checkpoint", inputs=[d for _, d in inputs], force=force)
    _check_manifests(inputs)
    plan, model_config = _prune_plan(cfg, inputs[0][1])
    hashes = [artifacts.manifest_hash(d) for _, d in inputs]
    ck_dir = run_dir / "checkpoints"
    table(f"averaging {len(inputs)} checkpoint{'s' if len(inputs) != 1 else ''}"
          + ("" if checkpoints else f" of {ck_dir}"),
          ["checkpoint", "step", "manifest sha256"],
          [(d.name if d.parent == ck_dir else str(d), step, h.removeprefix("sha256:")[:16])
           for (step, d), h in zip(inputs, hashes)])

    ref, state = average_state_dicts(inputs)
    # Loading re-verified every file hash, so the manifests hashed above still describe what was averaged.
    max_step = max(step for step, _ in inputs)
    averaged = [{"path": str(d), "step": step, "sha256": h} for (step, d), h in zip(inputs, hashes)]
    params = {**ref.manifest.params, "average": to_dict(cfg)}
    upstream = {f"checkpoint_{i}": d for i, (_, d) in enumerate(inputs)}  # explicit inputs may share a step
    spm, spm_vocab, decode = carried(inputs)
    # The newest input's fields, the averaging's own set: a field this code does not name is carried.
    own: dict[str, Any] = {"step": max_step, "averaged": averaged, "decode": decode,
                           "finetuned_from": carried_lineage(inputs)}
    if spm is None:
        warn("no input carries its SentencePiece model (checkpoints written by an older mtpipe): decode the average "
             "with --tokens")
    if plan is not None:
        from mtpipe.engine.pruning import prune_state_dict

        state = prune_state_dict(state, plan)
        own.update(model_config=model_config, pruned={"spec": cfg.prune, "encoder_kept": list(plan.encoder),
                                                      "decoder_kept": list(plan.decoder)})
    meta = artifacts.checkpoint_fields(inputs[-1][1]).for_average(**own)
    writing.write_checkpoint(out, state_dict=state, meta=meta, trainer_state=None, params=params, upstream=upstream,
                             spm=spm, spm_vocab=spm_vocab, force=force)
    n_params = sum(t.numel() for t in state.values())
    info(f"averaged {len(inputs)} checkpoints (steps {inputs[0][0]:,}..{max_step:,}, {n_params:,} values) "
         f"-> {out} (weights only, step {max_step:,}"
         + (f", pruned to {len(plan.encoder)} + {len(plan.decoder)} layers)" if plan is not None else ")"))
    return out


def _prune_plan(cfg: AverageConfig, first: Path) -> tuple[Any, dict[str, Any]]:
    """``(plan, pruned model config)`` for ``average.prune`` from the first input's manifest (every input has its
    config), before any weights are read; ``(None, {})`` without pruning."""
    if not cfg.prune.strip():
        return None, {}
    from mtpipe.engine.pruning import prune_plan, pruned_config

    try:
        model_cfg = ModelConfig(**artifacts.checkpoint_fields(first).model_config).resolved()
    except TypeError as e:
        raise MtpipeError(f"{first}: checkpoint model config does not fit this mtpipe ({e})") from None
    plan = prune_plan(model_cfg, cfg.prune, where="average.prune")
    assert plan is not None
    info(f"pruning (average.prune={cfg.prune!r}): {plan.describe(model_cfg)}")
    return plan, to_dict(pruned_config(model_cfg, plan))
