"""Fine-tuning (``train.finetune_from``): a run that starts from another checkpoint's weights, for domain adaptation.

A fine-tune is a fresh run in every respect but its first weights: Adam's moments, the schedule (warm-up from step 1
with ``train.warmup`` and ``train.lr_scale``), the step counter, the epoch and the early-stopping record start
afresh; only the parent's parameters are copied into the model before the first update. The parent may be a
training checkpoint, an ``mtpipe average`` output or an ``mtpipe import``ed model: any checkpoint artifact.

* The model is the parent's (:func:`model_for`): each ``model`` key left at its built-in default is taken from the
  parent's config, and a key set to anything else must equal the parent's value, else the run is refused in one line
  naming every such key. (Dropout included: a fine-tune trains the parent's model as it was.)
* The vocabulary is the parent's (:func:`check_vocabulary`): the bpe artifact must have been encoded with the
  parent's SentencePiece model (``mtpipe bpe --from-model PARENT``), compared by the model's sha256, which the bpe
  artifact's manifest and the parent's ``vocab`` record both hold.
* Lineage: every checkpoint of the run records its parent (``extra["finetuned_from"]``: path, manifest sha256, step;
  :func:`mtpipe.artifacts.check_lineage`), and so does ``train.json``.
* Resume takes precedence: a run directory that already holds checkpoints continues from its latest one, exactly as
  any run resumes (:mod:`mtpipe.training.resume`), with the model and lineage that checkpoint records; the parent is
  not read again (it may have moved). The same holds for a run of a parent given no longer: its checkpoints say it
  is a fine-tune.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpipe import artifacts
from mtpipe.config import ModelConfig, to_dict, with_model_defaults
from mtpipe.console import info, warn
from mtpipe.errors import MtpipeError

# An output bias at or below this closes a piece (``mtpipe import`` gives the pieces its original dictionary lacked
# -1e9): exp(bias + logit) is 0 in float32, and Adam's steps of about the learning rate never reopen it.
CLOSED_BIAS = -1e8


@dataclass
class FineTune:
    """How a run of a fine-tune starts: the model it trains, where its first weights come from, its lineage."""

    model_cfg: ModelConfig  # the parent's model (the run's own, when it resumes)
    lineage: dict[str, Any]  # what every checkpoint records as its parent
    parent: Path | None  # the checkpoint whose weights the first update starts from; None: the run resumes


def model_for(model_cfg: ModelConfig, reference: dict[str, Any], where: Path, what: str) -> ModelConfig:
    """The model a fine-tune trains: ``reference`` (a checkpoint's model config), after checking that every key of
    ``model_cfg`` set to other than its built-in default agrees with it (one line naming each key that does not).
    ``where``/``what``: the checkpoint and how to call it in the message."""
    ref = with_model_defaults(dict(reference))
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    differ = [(k, v) for k, v in to_dict(model_cfg).items() if v != defaults[k] and ref.get(k) != v]
    if differ:
        raise MtpipeError(
            f"{where}: the params give " + ", ".join(f"model.{k}={v!r} where {what} has {ref.get(k)!r}"
                                                     for k, v in differ)
            + "; a fine-tune trains the parent's model: leave these keys at their defaults (then the parent's "
            "values are taken) or set the parent's values")
    try:
        return ModelConfig(**ref)
    except (TypeError, MtpipeError) as e:
        raise MtpipeError(f"{where}: checkpoint model config does not fit this mtpipe ({e})") from None


def plan(out: Path, finetune_from: str | None, model_cfg: ModelConfig, vocab: dict[str, Any],
         tokens: Path) -> FineTune | None:
    """The fine-tune this run is, or None for a run from scratch.

    A run directory with checkpoints resumes (the module docstring): when its latest checkpoint records a parent,
    the run is that fine-tune, whatever ``train.finetune_from`` says now (a different one is warned about). Else
    ``finetune_from`` names the parent: its manifest is read here, its model and vocabulary (``vocab``, of the bpe
    artifact ``tokens``) checked; :func:`load_parent` loads its weights."""
    found = artifacts.list_checkpoints(out)
    if found:
        step, latest = found[-1]
        meta = artifacts.checkpoint_fields(latest)
        recorded = meta.finetuned_from
        if recorded is not None:
            if finetune_from is not None and not same_parent(recorded, Path(finetune_from)):
                warn(f"{out}: a fine-tune of {recorded['path']} resumes from its step {step:,}; train.finetune_from "
                     f"{finetune_from} applies to a fresh run only")
            return FineTune(model_for(model_cfg, meta.model_config, latest, "the run's checkpoint"),
                            recorded, None)
        if finetune_from is not None:
            warn(f"{out}: holds checkpoints of a run not started from {finetune_from}; it resumes from step "
                 f"{step:,} and train.finetune_from applies to a fresh run only (train into another --out)")
        return None
    if finetune_from is None:
        return None
    parent = Path(finetune_from)
    m = artifacts.read_manifest(parent, "checkpoint")
    meta = artifacts.checkpoint_fields(parent, m)
    check_vocabulary(parent, meta.vocab, vocab, tokens)
    return FineTune(model_for(model_cfg, meta.model_config, parent, "the parent checkpoint"),
                    artifacts.lineage_record(parent, m), parent)


def same_parent(recorded: dict[str, Any], parent: Path) -> bool:
    """Whether ``parent`` is the checkpoint a lineage record names: by manifest hash when it can be read, else by
    path."""
    try:
        return artifacts.manifest_hash(parent) == recorded["sha256"]
    except OSError:
        return str(parent) == recorded["path"]


def check_vocabulary(parent: Path, parent_vocab: dict[str, Any], vocab: dict[str, Any], tokens: Path) -> None:
    """Refuse a bpe artifact encoded with another SentencePiece model than the parent's (its sha256 or size), in one
    line naming its SentencePiece model and how to encode the corpus with the parent's."""
    mine, theirs = artifacts.bare_sha(vocab.get("spm_sha256")), artifacts.bare_sha(parent_vocab.get("spm_sha256"))
    if mine != theirs or int(vocab.get("size", -1)) != int(parent_vocab.get("size", -2)):
        raise MtpipeError(
            f"{Path(tokens) / 'spm.model'}: the tokens were encoded with another SentencePiece model (sha256 "
            f"{mine[:12]}..., {vocab.get('size')} pieces) than the parent checkpoint {parent} was trained with "
            f"({theirs[:12]}..., {parent_vocab.get('size')} pieces); encode the corpus with `mtpipe bpe "
            f"--from-model {parent}`")


def load_parent(ft: FineTune, model: Any, device: Any) -> None:
    """Copy the parent's weights into ``model``, after checking that its manifest is still the one :func:`plan`
    read (and recorded in the lineage)."""
    assert ft.parent is not None
    ck = artifacts.load_checkpoint(ft.parent, device=str(device))
    if artifacts.manifest_hash(ft.parent) != ft.lineage["sha256"]:
        raise MtpipeError(f"{ft.parent}: changed while training started; start again")
    try:
        model.load_state_dict(ck.state_dict)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MtpipeError(f"{ft.parent}: weights do not fit the checkpoint's model config ({first})") from None
    info(f"fine-tuning from {ft.parent} (step {ck.step:,}): its weights, a fresh optimizer and schedule")
    bias = ck.state_dict.get("out_bias")
    closed = int((bias <= CLOSED_BIAS).sum()) if bias is not None else 0
    if closed:
        warn(f"{ft.parent}: {closed} pieces have an output bias of -1e9 (`mtpipe import`: pieces the original "
             "model's dictionary lacked): they keep no probability, so each such target token costs about 1e9 in "
             "the loss and the validation perplexity, and fine-tuning cannot teach them")
