"""mtpipe's two decoders called the way tests call them: with a ``decode`` section (:func:`translate`) or with
keywords (:func:`ct2_translate`). No command needs these shortcuts, so they are not part of mtpipe; each is a few lines
around mtpipe's own functions (nothing here searches or scores), so what a test checks is what the commands run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from mtpipe.config import DecodeConfig
from mtpipe.engine.ct2 import Ct2Hypothesis, Ct2Model, load_ct2, translate_under_rules
from mtpipe.engine.search import DecodeRules, Hypothesis, LengthPenalty
from mtpipe.engine.translate import translate_batches


def translate(model: Any, sources: Sequence[Sequence[int]], cfg: DecodeConfig, device: torch.device | str = "cpu",
              on_done: Callable[[int], None] | None = None) -> list[list[Hypothesis]]:
    """:func:`mtpipe.engine.translate.translate_batches` under the rules and settings of a ``decode`` section
    (batches of ``cfg.max_tokens`` at ``cfg.precision``, ``cfg.compile``, ``cfg.cuda_graphs``): ``model`` prepared
    for this one call, as training's validation BLEU decodes."""
    return translate_batches(model, sources, DecodeRules.from_config(cfg), max_tokens=cfg.max_tokens,
                             precision=cfg.precision, device=device, on_done=on_done, compile=cfg.compile,
                             cuda_graphs=cfg.cuda_graphs)


def ct2_translate(model: Ct2Model | Path, sources: Sequence[Sequence[str | int]], *, beam: int = 4,
                  alpha: float = 0.6, length_penalty: str = "gnmt", max_len_a: float = 1.0, max_len_b: int = 50,
                  nbest: int = 1, patience: float = 1.0, max_tokens: int = 8000,
                  threads: int = 0) -> list[list[Ct2Hypothesis]]:
    """:func:`mtpipe.engine.ct2.translate_under_rules` with the decode settings as keywords (CTranslate2's stopping
    rule: ``stop="finished"``). The rules are checked before the model is loaded, so a bad setting fails at once;
    ``threads`` is only used when ``model`` is a path (a loaded :class:`~mtpipe.engine.ct2.Ct2Model` keeps its
    own)."""
    rules = DecodeRules(beam=beam, nbest=nbest, penalty=LengthPenalty(length_penalty, alpha), max_len_a=max_len_a,
                        max_len_b=max_len_b, stop="finished", patience=patience)
    m = model if isinstance(model, Ct2Model) else load_ct2(Path(model), threads=threads)
    return translate_under_rules(m, sources, rules, max_tokens)
