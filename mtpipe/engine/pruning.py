"""LayerDrop pruning (Fan et al. 2019): a shallower sub-network of a LayerDrop-trained model at inference, without
fine-tuning.

:func:`prune_plan` parses a prune spec (``decode.prune`` / ``average.prune``) into a :class:`PrunePlan`, the layers
to keep; :func:`prune` applies it to a model, :func:`prune_state_dict` and :func:`pruned_config` to a checkpoint's
weights and config (so the pruned checkpoint rebuilds without any pruning flag).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor, nn

from mtpipe.config import ModelConfig
from mtpipe.errors import MtpipeError

if TYPE_CHECKING:
    from mtpipe.model.transformer import Transformer


@dataclass(frozen=True)
class PrunePlan:
    """The layers a pruned model keeps: 0-based indexes into the encoder and decoder stacks, in order."""

    encoder: tuple[int, ...]
    decoder: tuple[int, ...]

    def describe(self, cfg: ModelConfig) -> str:
        return (f"encoder layers {list(self.encoder)} of {cfg.encoder_layers}, "
                f"decoder layers {list(self.decoder)} of {cfg.decoder_layers}")


def every_other(n_layers: int, rate: float) -> tuple[int, ...]:
    """Fan et al.'s "every other" strategy at pruning rate ``rate``: drop the layers at depth d (1-based, d = 1 is
    the layer next to the embeddings) with ``d % floor(1/rate) == 0``; returns the 0-based indexes kept. Rate 0.5
    keeps the odd depths 1, 3, 5 (indexes 0, 2, 4) of six; rate 0.2 drops depth 5 only."""
    k = math.floor(1.0 / rate + 1e-9)  # the epsilon keeps 1/0.2 = 4.999... from flooring to 4
    return tuple(d - 1 for d in range(1, n_layers + 1) if d % k)


def prune_plan(cfg: ModelConfig, spec: str, where: str = "prune") -> PrunePlan | None:
    """Parse a prune spec (``decode.prune`` / ``average.prune``) for a model of config ``cfg``; None = no pruning.

    * ``every_other`` -- :func:`every_other` at the model's own ``layerdrop`` (an error for a model trained
      without LayerDrop, whose layers were never trained to be left out);
    * ``every_other:R`` -- the same at pruning rate R, e.g. 0.5 for half depth from a model trained with p = 0.2;
    * ``enc:0,2,4;dec:0,2,4`` -- the 0-based layer indexes to keep (``encoder``/``decoder`` spelled out also work);
      a side left out keeps all its layers.
    """
    spec = spec.strip()
    if not spec:
        return None
    cfg = cfg.resolved()
    if spec.split(":", 1)[0].strip() == "every_other":
        plan = _every_other_plan(cfg, spec, where)
    else:
        plan = _keep_list_plan(cfg, spec, where)
    for side, kept in (("encoder", plan.encoder), ("decoder", plan.decoder)):
        if not kept:
            raise MtpipeError(f"{where}: {spec!r} leaves the {side} without layers")
    return plan


def _every_other_plan(cfg: ModelConfig, spec: str, where: str) -> PrunePlan:
    """``every_other`` or ``every_other:RATE`` (see :func:`prune_plan`)."""
    rest = spec.split(":", 1)[1].strip() if ":" in spec else ""
    if rest:
        try:
            rate = float(rest)
        except ValueError:
            raise MtpipeError(f"{where}: {spec!r}: the rate after 'every_other:' is not a number") from None
    elif cfg.layerdrop == 0.0:
        raise MtpipeError(f"{where}: 'every_other' uses the model's LayerDrop rate, but it was trained with "
                          "model.layerdrop=0; give a rate ('every_other:0.5') or the layers to keep "
                          "('enc:0,2,4;dec:0,2,4')")
    else:
        rate = cfg.layerdrop
    if not 0.0 < rate < 1.0:
        raise MtpipeError(f"{where}: {spec!r}: the pruning rate {rate} is not in (0, 1)")
    return PrunePlan(every_other(cfg.encoder_layers, rate), every_other(cfg.decoder_layers, rate))


def _keep_list_plan(cfg: ModelConfig, spec: str, where: str) -> PrunePlan:
    """``enc:0,2,4;dec:0,2,4`` (see :func:`prune_plan`)."""
    sides = {"encoder": tuple(range(cfg.encoder_layers)), "decoder": tuple(range(cfg.decoder_layers))}
    given: set[str] = set()
    for part in filter(None, (x.strip() for x in spec.split(";"))):
        name, sep, items = part.partition(":")
        side = {"enc": "encoder", "dec": "decoder"}.get(name.strip(), name.strip())
        if not sep or side not in sides:
            raise MtpipeError(f"{where}: {spec!r} is not 'every_other', 'every_other:RATE' or a keep list like "
                              "'enc:0,2,4;dec:0,2,4'")
        if side in given:
            raise MtpipeError(f"{where}: {spec!r} names the {side} twice")
        given.add(side)
        n = len(sides[side])
        try:
            keep = [int(x) for x in items.split(",") if x.strip()]
        except ValueError:
            raise MtpipeError(f"{where}: {spec!r}: the {side} list is not comma-separated layer indexes") from None
        bad = [i for i in keep if not 0 <= i < n]
        if bad:
            raise MtpipeError(f"{where}: {spec!r}: {side} layer {bad[0]} does not exist (the model has {n}, "
                              f"indexed 0..{n - 1})")
        if len(set(keep)) != len(keep):
            raise MtpipeError(f"{where}: {spec!r}: the {side} list repeats a layer")
        sides[side] = tuple(sorted(keep))
    return PrunePlan(sides["encoder"], sides["decoder"])


def pruned_config(cfg: ModelConfig, plan: PrunePlan) -> ModelConfig:
    """The config of the pruned model: fewer layers; ``layerdrop`` kept as a record of how it was trained."""
    return dataclasses.replace(cfg.resolved(), encoder_layers=len(plan.encoder), decoder_layers=len(plan.decoder))


def prune_state_dict(state: dict[str, Tensor], plan: PrunePlan) -> dict[str, Tensor]:
    """A state dict without the pruned layers, the kept ones renumbered from 0 (``encoder.4.`` -> ``encoder.2.``);
    every other entry (embeddings, final norms) as is."""
    renumber = {"encoder": {old: new for new, old in enumerate(plan.encoder)},
                "decoder": {old: new for new, old in enumerate(plan.decoder)}}
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        side, _, rest = name.partition(".")
        if side in renumber and rest.split(".", 1)[0].isdigit():
            index, _, tail = rest.partition(".")
            if int(index) in renumber[side]:
                out[f"{side}.{renumber[side][int(index)]}.{tail}"] = t
        else:
            out[name] = t
    return out


def prune(model: Transformer, plan: PrunePlan) -> Transformer:
    """A copy of ``model`` with only the layers of ``plan`` (``model`` itself is unchanged); its ``cfg`` has the
    reduced layer counts, so its checkpoint rebuilds without any pruning flag."""
    out = copy.deepcopy(model)
    out.cfg = pruned_config(model.cfg, plan)
    out.encoder = nn.ModuleList(out.encoder[i] for i in plan.encoder)
    out.decoder = nn.ModuleList(out.decoder[i] for i in plan.decoder)
    return out
