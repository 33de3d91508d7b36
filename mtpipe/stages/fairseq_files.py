"""fairseq's files as ``mtpipe import`` reads them: its dictionaries, its checkpoint (no pickled code runs) and the
model options it records, as an mtpipe model config; and fairseq's sinusoidal position table. The mapping of the
weights and the vocabulary is :mod:`mtpipe.stages.importer`'s.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpipe.errors import MtpipeError

FAIRSEQ_SPECIALS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}  # fairseq.data.Dictionary's fixed ids


# --------------------------------------------------------------------------------------------------------------------
# Reading fairseq's files
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class FairseqDictionary:
    """A fairseq dictionary: symbols by index (the four specials first, then ``dict.txt``'s lines)."""

    path: Path
    symbols: list[str]

    @property
    def index(self) -> dict[str, int]:
        return {s: i for i, s in enumerate(self.symbols)}


def read_dictionary(path: Path) -> FairseqDictionary:
    """``dict.txt``: one ``symbol count [#fairseq:overwrite]`` per line, after fairseq's four specials."""
    symbols = list(FAIRSEQ_SPECIALS)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise MtpipeError(f"{path}: not a UTF-8 fairseq dictionary") from None
    for n, line in enumerate(lines, 1):
        fields = line.rstrip().split(" ")
        overwrite = fields[-1] == "#fairseq:overwrite"
        if overwrite:
            fields = fields[:-1]
        if len(fields) < 2 or not fields[-1].isdigit():
            raise MtpipeError(f"{path}:{n}: not a fairseq dictionary line ('symbol count'): {line[:60]!r}")
        symbol = " ".join(fields[:-1])
        if symbol in FAIRSEQ_SPECIALS and overwrite:
            continue  # an explicit entry for a special: fairseq keeps the special's fixed id
        if symbol in symbols:
            raise MtpipeError(f"{path}:{n}: duplicate symbol {symbol!r}")
        symbols.append(symbol)
    return FairseqDictionary(path, symbols)


def find_dictionaries(where: Path, src_lang: str | None, tgt_lang: str | None) -> tuple[Path, Path]:
    """The source and target ``dict.{lang}.txt`` in the directory ``where`` (or ``where`` itself, a file, for both)."""
    if where.is_file():
        return where, where
    if not where.is_dir():
        raise MtpipeError(f"{where}: fairseq dictionary directory not found")
    if src_lang and tgt_lang:
        paths = where / f"dict.{src_lang}.txt", where / f"dict.{tgt_lang}.txt"
        for p in paths:
            if not p.is_file():
                raise MtpipeError(f"{p}: not found (the checkpoint's task is {src_lang}-{tgt_lang})")
        return paths
    found = sorted(where.glob("dict.*.txt"))
    if len(found) == 1:
        return found[0], found[0]
    raise MtpipeError(f"{where}: the checkpoint names no source/target languages and the directory holds "
                      f"{len(found)} dict.*.txt files; pass --dict FILE")


def load_fairseq_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(state_dict, model options, task options)`` of a fairseq checkpoint, loaded without running pickled code."""
    import torch

    if not path.is_file():
        raise MtpipeError(f"{path}: fairseq checkpoint not found")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- torch raises many types for a foreign or corrupt file
        text = str(e)
        m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        why = (f"it holds a pickled {m[1]}, which mtpipe does not load (only tensors, plain values and "
               "argparse.Namespace)" if m else (text.strip().splitlines() or [type(e).__name__])[0])
        raise MtpipeError(f"{path}: not a loadable fairseq checkpoint: {why}") from None
    if not isinstance(ck, dict) or not isinstance(ck.get("model"), dict):
        raise MtpipeError(f"{path}: not a fairseq checkpoint (no 'model' state dict)")

    def options(x: Any) -> dict[str, Any]:
        return vars(x) if isinstance(x, argparse.Namespace) else dict(x) if isinstance(x, dict) else {}

    cfg = ck.get("cfg") or {}
    model = options(cfg.get("model")) if isinstance(cfg, dict) else {}
    task = options(cfg.get("task")) if isinstance(cfg, dict) else {}
    if not model and ck.get("args") is not None:  # checkpoints from before fairseq's dataclass configs
        model = task = options(ck["args"])
    if not model:
        raise MtpipeError(f"{path}: the checkpoint records no model options (cfg.model or args)")
    return dict(ck["model"]), model, task


# --------------------------------------------------------------------------------------------------------------------
# Model options
# --------------------------------------------------------------------------------------------------------------------


def model_config(opts: dict[str, Any], state: dict[str, Any], where: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The mtpipe model config equivalent to fairseq's options, and facts the weight mapping needs."""

    def opt(name: str, default: Any = None) -> Any:
        return opts.get(name, default)

    arch = opt("arch") or opt("_name") or "transformer"
    if not str(arch).startswith("transformer"):
        raise MtpipeError(f"{where}: architecture {arch!r} is not a fairseq transformer")
    refuse = {
        "layernorm_embedding": "layernorm_embedding (mtpipe's embeddings have no LayerNorm)",
        "no_scale_embedding": "no_scale_embedding (mtpipe scales embeddings by sqrt(d_model), section 3.4)",
        "cross_self_attention": "cross_self_attention",
        "no_cross_attention": "no_cross_attention",
        "no_token_positional_embeddings": "no_token_positional_embeddings",
        "adaptive_softmax_cutoff": "an adaptive softmax",
        "adaptive_input": "adaptive input embeddings",
        "tie_adaptive_weights": "adaptive weights",
        "quant_noise_pq": "quant-noise",
    }
    for key, what in refuse.items():
        if opt(key):
            raise MtpipeError(f"{where}: uses {what}; mtpipe's Transformer has no such option")
    if (opt("activation_fn") or "relu") != "relu":
        raise MtpipeError(f"{where}: activation_fn={opt('activation_fn')}; mtpipe's feed-forward layers use ReLU "
                          "(section 3.3)")
    d, d_ff, heads = opt("encoder_embed_dim"), opt("encoder_ffn_embed_dim"), opt("encoder_attention_heads")
    for enc, dec in (("encoder_embed_dim", "decoder_embed_dim"), ("encoder_ffn_embed_dim", "decoder_ffn_embed_dim"),
                     ("encoder_attention_heads", "decoder_attention_heads"),
                     ("encoder_embed_dim", "decoder_output_dim"), ("encoder_embed_dim", "decoder_input_dim")):
        if opt(dec) is not None and opt(dec) != opt(enc):
            raise MtpipeError(f"{where}: {enc}={opt(enc)} but {dec}={opt(dec)}; mtpipe's encoder and decoder have "
                              "one d_model, d_ff and head count")
    if None in (d, d_ff, heads, opt("encoder_layers"), opt("decoder_layers")):
        raise MtpipeError(f"{where}: the model options lack the layer sizes (encoder_embed_dim, encoder_layers, ...)")
    if d % heads:
        raise MtpipeError(f"{where}: encoder_embed_dim={d} is not divisible by {heads} heads")
    pre_enc, pre_dec = bool(opt("encoder_normalize_before")), bool(opt("decoder_normalize_before"))
    if pre_enc != pre_dec:
        raise MtpipeError(f"{where}: encoder_normalize_before={pre_enc} but decoder_normalize_before={pre_dec}; "
                          "mtpipe's model.norm_position applies to both stacks")
    if pre_dec and "decoder.layer_norm.weight" not in state:
        raise MtpipeError(f"{where}: a pre-norm decoder without its final LayerNorm (no_decoder_final_norm)")
    learned = {s: f"{s}.embed_positions.weight" in state for s in ("encoder", "decoder")}
    max_src = int(opt("max_source_positions") or 1024)
    max_tgt = int(opt("max_target_positions") or 1024)
    share_all = bool(opt("share_all_embeddings"))
    share_dec = share_all or bool(opt("share_decoder_input_output_embed"))
    cfg = dict(
        preset="base", encoder_layers=int(opt("encoder_layers")), decoder_layers=int(opt("decoder_layers")),
        d_model=int(d), d_ff=int(d_ff), heads=int(heads), d_k=int(d) // int(heads), d_v=int(d) // int(heads),
        dropout=float(opt("dropout") or 0.0), attention_dropout=float(opt("attention_dropout") or 0.0),
        relu_dropout=float(opt("activation_dropout") or opt("relu_dropout") or 0.0),
        max_positions=min(max_src, max_tgt), norm_position="pre" if pre_enc else "post", norm="layer",
        fixnorm=False, positions="learned-per-stack" if any(learned.values()) else "learned", layerdrop=0.0,
        share_embeddings="all" if share_all else "decoder" if share_dec else "none",
        output_bias=False, decoder_start="eos",
    )
    return cfg, {"learned": learned, "padding_idx": FAIRSEQ_SPECIALS["<pad>"]}


def fairseq_sinusoids(rows: int, dim: int, padding_idx: int) -> Any:
    """fairseq's ``SinusoidalPositionalEmbedding.get_embedding``: ``[rows, dim]``, sines then cosines, frequencies
    ``exp(-i log(10000) / (dim/2 - 1))``, the padding row zero; float32 throughout, as fairseq computes it."""
    import torch

    half = dim // 2
    step = math.log(10000) / (half - 1)
    freq = torch.exp(torch.arange(half, dtype=torch.float) * -step)  # [half]
    angles = torch.arange(rows, dtype=torch.float).unsqueeze(1) * freq.unsqueeze(0)  # [rows, half]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).view(rows, -1)  # [rows, 2 * half]
    if dim % 2:
        table = torch.cat([table, torch.zeros(rows, 1)], dim=1)  # [rows, dim]
    table[padding_idx, :] = 0
    return table


__all__ = ["FAIRSEQ_SPECIALS", "FairseqDictionary", "fairseq_sinusoids", "find_dictionaries",
           "load_fairseq_checkpoint", "model_config", "read_dictionary"]
