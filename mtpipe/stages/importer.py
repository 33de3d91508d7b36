"""``mtpipe import --format fairseq``: a fairseq 0.12 ``transformer`` checkpoint as an mtpipe checkpoint plus the bpe
artifact that goes with it, so that ``mtpipe decode``, ``average`` and ``export`` run fairseq-trained weights.

What maps, and how (fairseq names on the left; the mtpipe model is :mod:`mtpipe.model.transformer`):

* Layers: ``self_attn.{q,k,v}_proj`` -> ``self_attn.qkv`` (one matrix, q|k|v); ``encoder_attn.q_proj`` ->
  ``cross_attn.q``, ``encoder_attn.{k,v}_proj`` -> ``cross_attn.kv``; ``*.out_proj`` -> ``*.out``; ``fc1``/``fc2``
  -> ``ffn.w1``/``ffn.w2``; ``self_attn_layer_norm``, ``encoder_attn_layer_norm``, ``final_layer_norm`` ->
  ``norm1``, ``norm2`` (decoder), ``norm2``/``norm3``; ``encoder.layer_norm``/``decoder.layer_norm`` (pre-norm) ->
  ``encoder_norm``/``decoder_norm``. fairseq scales queries by d_k^-0.5 after the projection, which is the paper's
  ``QK^T / sqrt(d_k)`` (section 3.2.1); its LayerNorm epsilon is torch's 1e-5, as mtpipe's.
* Positions: fairseq numbers a sentence's tokens from ``padding_idx + 1`` (= 2) and, for sinusoids, uses
  ``exp(-i log(10000) / (d/2 - 1))`` as frequencies, not the paper's ``10000^(-2i/d)``. Both tables are written
  as mtpipe's learned table(s) (``model.positions=learned``, or ``learned-per-stack`` when the stacks differ), rows
  ``2 .. 2 + max_positions`` of fairseq's, computed with fairseq's own float32 formula.
* Embeddings: ``--share-all-embeddings`` -> ``share_embeddings=all``; ``--share-decoder-input-output-embed`` ->
  ``decoder``; neither -> ``none`` (the projection is ``decoder.output_projection``). fairseq's decoder starts from
  ``</s>``: ``decoder_start=eos``.
* Vocabulary, remapped by piece string: row i of every mtpipe matrix is the fairseq row of SentencePiece piece i
  (``<pad>``, ``<unk>``, ``<s>``, ``</s>`` to fairseq's specials). Pieces the fairseq dictionary lacks (they never
  occurred in its training data) take fairseq's ``<unk>`` row as input, as fairseq-preprocess mapped them, and an
  output bias of -1e9 (``model.output_bias``), so that they take no probability mass, as in fairseq whose softmax
  never had them. Dictionary entries that are not SentencePiece pieces are fairseq's padding symbols
  (``madeupword0000``, ``--padding-factor``): they are appended to the SentencePiece model as UNUSED pieces
  (never produced by encoding) so that fairseq's softmax keeps every one of its terms. Any other such entry (a
  string SentencePiece would encode as ``<unk>`` while fairseq had a row for it) cannot be reproduced and is refused.
  A SentencePiece model whose special ids are not mtpipe's (pad 0, unk 1, bos 2, eos 3) is rewritten with its
  pieces reordered; segmentation depends on the pieces and their scores, not on their ids, so it is unchanged.

Refused with the reason (one line): options mtpipe's Transformer lacks (layernorm_embedding, no_scale_embedding,
adaptive softmax, other activations, different encoder/decoder widths or heads, extra parameters such as NormFormer
scales), a dictionary that does not fit the embedding matrix, and the vocabulary cases above.

The checkpoint is read with ``torch.load(weights_only=True)``, with ``argparse.Namespace`` (how fairseq stores its
model options) as the one allowed class: no other pickled object runs.
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpipe import console, writing
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID, UNK_ID, file_hash
from mtpipe.config import ModelConfig, to_dict
from mtpipe.errors import MtpipeError

FAIRSEQ_SPECIALS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}  # fairseq.data.Dictionary's fixed ids
# mtpipe's special id -> fairseq's: <s> is fairseq's unused bos, whose row stays in fairseq's softmax.
SPECIAL_ROWS = {PAD_ID: 1, UNK_ID: 3, BOS_ID: 0, EOS_ID: 2}
PADDING_SYMBOL = re.compile(r"madeupword\d+")  # fairseq's --padding-factor fillers
NEVER = -1e9  # the output bias of pieces fairseq's softmax did not have: exp(NEVER + logit) == 0 in float32
# fairseq 0.12.2's encoder layers carry copies of their weights for its fused inference path (filled on load).
_FUSED_COPIES = ("in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias", "fc1_weight", "fc1_bias",
                 "fc2_weight", "fc2_bias")

# SentencePiece piece types (sentencepiece_model.proto)
_NORMAL, _UNKNOWN, _CONTROL, _UNUSED = 1, 2, 3, 5


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


# --------------------------------------------------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Vocabulary:
    """mtpipe's vocabulary (the rewritten SentencePiece model) and, per mtpipe id, the fairseq rows."""

    spm_bytes: bytes
    pieces: list[str]  # by mtpipe id
    src_rows: list[int]  # source embedding row of each mtpipe id
    tgt_rows: list[int]  # target embedding / output projection row of each mtpipe id
    never: list[int]  # mtpipe ids fairseq's softmax did not have (output bias NEVER)
    appended: list[str]  # fairseq padding symbols appended as UNUSED pieces
    rewritten: bool  # whether the SentencePiece model was changed


def build_vocabulary(spm_model: Path, src: FairseqDictionary, tgt: FairseqDictionary) -> Vocabulary:
    """Map every SentencePiece piece to its fairseq rows (module docstring), rewriting the SentencePiece model when
    its special ids are not mtpipe's or fairseq padding symbols must be appended."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    try:
        raw = spm_model.read_bytes()
        proto.ParseFromString(raw)
    except FileNotFoundError:
        raise MtpipeError(f"{spm_model}: SentencePiece model not found") from None
    except Exception:  # noqa: BLE001 -- protobuf's DecodeError and friends
        raise MtpipeError(f"{spm_model}: not a SentencePiece model") from None
    if not proto.pieces:
        raise MtpipeError(f"{spm_model}: not a SentencePiece model (no pieces)")
    ts = proto.trainer_spec
    want = {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID}
    have = {"pad": ts.pad_id, "unk": ts.unk_id, "bos": ts.bos_id, "eos": ts.eos_id}
    default_piece = {"pad": "<pad>", "unk": "<unk>", "bos": "<s>", "eos": "</s>"}
    pieces_set = {p.piece for p in proto.pieces}
    for name, table in (("target", tgt), ("source", src)):
        foreign = [s for s in table.symbols[len(FAIRSEQ_SPECIALS):]
                   if s not in pieces_set and not PADDING_SYMBOL.fullmatch(s)]
        if foreign:
            raise MtpipeError(f"{table.path}: {len(foreign)} {name} dictionary entries are not pieces of {spm_model} "
                              f"(e.g. {', '.join(repr(s) for s in foreign[:3])}): mtpipe would encode them as <unk> "
                              "where fairseq had rows of their own; import with the SentencePiece model that "
                              "produced the dictionary")
    appended = [s for s in tgt.symbols[len(FAIRSEQ_SPECIALS):] if s not in pieces_set]
    rewritten = have != want or bool(appended)
    if rewritten:
        if ts.unk_id < 0 or ts.unk_id >= len(proto.pieces):
            raise MtpipeError(f"{spm_model}: has no <unk> piece")
        order = sorted(want, key=want.get)  # pad, unk, bos, eos
        specials = []
        for name in order:
            i = have[name]
            if 0 <= i < len(proto.pieces):
                specials.append(proto.pieces[i])
            else:
                if default_piece[name] in pieces_set:
                    raise MtpipeError(f"{spm_model}: has no {name} id but a piece named {default_piece[name]!r}")
                specials.append(pb.ModelProto.SentencePiece(piece=default_piece[name], score=0.0, type=_CONTROL))
        taken = {i for i in have.values() if i >= 0}
        rest = [p for i, p in enumerate(proto.pieces) if i not in taken]
        extra = [pb.ModelProto.SentencePiece(piece=s, score=0.0, type=_UNUSED) for s in appended]
        new = pb.ModelProto()
        new.CopyFrom(proto)
        del new.pieces[:]
        new.pieces.extend([*specials, *rest, *extra])
        new.trainer_spec.pad_id, new.trainer_spec.unk_id = PAD_ID, UNK_ID
        new.trainer_spec.bos_id, new.trainer_spec.eos_id = BOS_ID, EOS_ID
        for name in order:
            setattr(new.trainer_spec, f"{name}_piece", specials[want[name]].piece)
        new.trainer_spec.vocab_size = len(new.pieces)
        raw = new.SerializeToString()
        proto = new
    pieces = [p.piece for p in proto.pieces]
    si, ti = src.index, tgt.index
    src_rows, tgt_rows, never = [], [], []
    for i, piece in enumerate(pieces):
        if i in SPECIAL_ROWS:
            src_rows.append(SPECIAL_ROWS[i])
            tgt_rows.append(SPECIAL_ROWS[i])
            continue
        src_rows.append(si.get(piece, FAIRSEQ_SPECIALS["<unk>"]))
        if piece in ti:
            tgt_rows.append(ti[piece])
        else:
            tgt_rows.append(FAIRSEQ_SPECIALS["<unk>"])
            never.append(i)
    for name, rows, table in (("source", src_rows, src), ("target", tgt_rows, tgt)):
        missing = set(range(len(table.symbols))) - set(rows)
        lost = [table.symbols[r] for r in sorted(missing) if r != FAIRSEQ_SPECIALS["<unk>"]]
        if name == "target" and lost:  # cannot happen by construction; a guard on the mapping itself
            raise MtpipeError(f"{table.path}: target entries {lost[:3]} got no mtpipe id")
    return Vocabulary(raw, pieces, src_rows, tgt_rows, never, appended, rewritten)


# --------------------------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------------------------


class _Taker:
    """fairseq's state dict, each entry consumed once; what is left over at the end is refused by name."""

    def __init__(self, state: dict[str, Any], where: Path):
        self.state, self.where, self.used = state, where, set()

    def __call__(self, key: str) -> Any:
        if key not in self.state:
            raise MtpipeError(f"{self.where}: the checkpoint has no {key!r} (not a fairseq transformer of the "
                              "options it records)")
        self.used.add(key)
        return self.state[key].float()

    def ignore(self, key: str) -> None:
        self.used.add(key)

    def done(self) -> None:
        left = sorted(k for k in self.state if k not in self.used)
        if left:
            raise MtpipeError(f"{self.where}: fairseq parameter {left[0]!r} (and {len(left) - 1} more) has no "
                              "counterpart in mtpipe's Transformer" if len(left) > 1 else
                              f"{self.where}: fairseq parameter {left[0]!r} has no counterpart in mtpipe's "
                              "Transformer")


def convert_weights(state: dict[str, Any], cfg: dict[str, Any], facts: dict[str, Any], vocab: Vocabulary,
                    where: Path) -> dict[str, Any]:
    """mtpipe's state dict for the model ``cfg`` from fairseq's ``state`` (mapping in the module docstring)."""
    import torch

    take = _Taker(state, where)
    for key in state:
        if key.endswith(".version") or key.endswith("embed_positions._float_tensor"):
            take.ignore(key)
        if re.fullmatch(r"encoder\.layers\.\d+\.(" + "|".join(_FUSED_COPIES) + ")", key):
            take.ignore(key)
    out: dict[str, Any] = {}
    src_rows, tgt_rows = torch.tensor(vocab.src_rows), torch.tensor(vocab.tgt_rows)
    enc_e, dec_e = take("encoder.embed_tokens.weight"), take("decoder.embed_tokens.weight")
    d = cfg["d_model"]
    if enc_e.shape[1] != d:
        raise MtpipeError(f"{where}: embeddings are {enc_e.shape[1]}-dimensional, encoder_embed_dim says {d}")
    proj = state.get("decoder.output_projection.weight")
    if proj is not None:
        proj = take("decoder.output_projection.weight")
    share = cfg["share_embeddings"]
    if share == "all" and not (torch.equal(enc_e, dec_e) and vocab.src_rows == vocab.tgt_rows):
        share = cfg["share_embeddings"] = "none"  # tied in name only (or per-language dictionaries): keep all three
    if share in ("all", "decoder") and proj is not None and not torch.equal(proj, dec_e):
        share = cfg["share_embeddings"] = "none"
    if share == "none" and proj is None:
        raise MtpipeError(f"{where}: untied embeddings but no decoder.output_projection.weight")
    out["embed.weight"] = enc_e[src_rows]
    if share != "all":
        out["embed_tgt.weight"] = dec_e[tgt_rows]
    if share == "none":
        out["out_proj"] = proj[tgt_rows]
    if vocab.never:
        cfg["output_bias"] = True
        bias = torch.zeros(len(vocab.pieces))
        bias[vocab.never] = NEVER
        out["out_bias"] = bias
    pad, n_pos = facts["padding_idx"], cfg["max_positions"]
    tables = {}
    for stack in ("encoder", "decoder"):
        if facts["learned"][stack]:
            w = take(f"{stack}.embed_positions.weight")
            if w.shape[0] < pad + 1 + n_pos:
                raise MtpipeError(f"{where}: {stack}.embed_positions has {w.shape[0]} rows, fewer than "
                                  f"max positions {n_pos} + {pad + 1}")
            tables[stack] = w[pad + 1 : pad + 1 + n_pos]
        else:
            tables[stack] = fairseq_sinusoids(pad + 1 + n_pos, d, pad)[pad + 1 :]
    out["positions"] = tables["encoder"]
    if cfg["positions"] == "learned-per-stack":
        out["tgt_positions"] = tables["decoder"]

    def linear(dst: str, src: str) -> None:
        out[f"{dst}.weight"], out[f"{dst}.bias"] = take(f"{src}.weight"), take(f"{src}.bias")

    def fused(dst: str, srcs: list[str]) -> None:
        out[f"{dst}.weight"] = torch.cat([take(f"{s}.weight") for s in srcs], dim=0)
        out[f"{dst}.bias"] = torch.cat([take(f"{s}.bias") for s in srcs], dim=0)

    for i in range(cfg["encoder_layers"]):
        f, m = f"encoder.layers.{i}", f"encoder.{i}"
        fused(f"{m}.self_attn.qkv", [f"{f}.self_attn.{p}_proj" for p in "qkv"])
        linear(f"{m}.self_attn.out", f"{f}.self_attn.out_proj")
        linear(f"{m}.norm1", f"{f}.self_attn_layer_norm")
        linear(f"{m}.ffn.w1", f"{f}.fc1")
        linear(f"{m}.ffn.w2", f"{f}.fc2")
        linear(f"{m}.norm2", f"{f}.final_layer_norm")
    for i in range(cfg["decoder_layers"]):
        f, m = f"decoder.layers.{i}", f"decoder.{i}"
        fused(f"{m}.self_attn.qkv", [f"{f}.self_attn.{p}_proj" for p in "qkv"])
        linear(f"{m}.self_attn.out", f"{f}.self_attn.out_proj")
        linear(f"{m}.norm1", f"{f}.self_attn_layer_norm")
        linear(f"{m}.cross_attn.q", f"{f}.encoder_attn.q_proj")
        fused(f"{m}.cross_attn.kv", [f"{f}.encoder_attn.{p}_proj" for p in "kv"])
        linear(f"{m}.cross_attn.out", f"{f}.encoder_attn.out_proj")
        linear(f"{m}.norm2", f"{f}.encoder_attn_layer_norm")
        linear(f"{m}.ffn.w1", f"{f}.fc1")
        linear(f"{m}.ffn.w2", f"{f}.fc2")
        linear(f"{m}.norm3", f"{f}.final_layer_norm")
    if cfg["norm_position"] == "pre":
        linear("encoder_norm", "encoder.layer_norm")
        linear("decoder_norm", "decoder.layer_norm")
    take.done()
    return {k: v.contiguous() for k, v in out.items()}


# --------------------------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------------------------


def import_fairseq(checkpoint: Path, dictionary: Path, spm_model: Path, out: Path, tokens_out: Path | None, *,
                   force: bool = False) -> dict[str, Any]:
    """Convert a fairseq transformer checkpoint (``checkpoint.pt``, its ``dict.*.txt`` in ``dictionary``, the
    SentencePiece model that made its data) into the mtpipe checkpoint ``out`` (which carries the SentencePiece
    model, remapped to mtpipe's ids) and, when ``tokens_out`` is given, also a bpe artifact there. Returns a
    summary."""
    from mtpipe.stages.bpe import SPECIALS, write_vocab
    from mtpipe.model.transformer import build_model

    checkpoint, dictionary, spm_model = Path(checkpoint), Path(dictionary), Path(spm_model)
    out = Path(out)
    tokens_out = Path(tokens_out) if tokens_out is not None else None
    state, opts, task = load_fairseq_checkpoint(checkpoint)
    src_path, tgt_path = find_dictionaries(dictionary, task.get("source_lang"), task.get("target_lang"))
    src_dict, tgt_dict = read_dictionary(src_path), read_dictionary(tgt_path)
    cfg, facts = model_config(opts, state, checkpoint)
    for side, table in (("encoder", src_dict), ("decoder", tgt_dict)):
        rows = state.get(f"{side}.embed_tokens.weight")
        if rows is not None and rows.shape[0] != len(table.symbols):
            raise MtpipeError(f"{table.path}: {len(table.symbols)} symbols (with fairseq's 4 specials), but the "
                              f"checkpoint's {side} embeddings have {rows.shape[0]} rows: not the dictionary it was "
                              "trained with")
    vocab = build_vocabulary(spm_model, src_dict, tgt_dict)
    weights = convert_weights(state, cfg, facts, vocab, checkpoint)
    model_cfg = to_dict(ModelConfig(**cfg).resolved())
    model = build_model(model_cfg, len(vocab.pieces))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:  # a programming error in the mapping above, named rather than silently wrong
        raise MtpipeError(f"{checkpoint}: converted weights do not fit mtpipe's model (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")

    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=vocab.spm_bytes)
    if tokens_out is None:  # the checkpoint alone: its SentencePiece files are staged in a temporary directory
        with tempfile.TemporaryDirectory(prefix="mtpipe-import-") as tmp:
            Path(tmp, "spm.model").write_bytes(vocab.spm_bytes)
            write_vocab(sp, Path(tmp, "spm.vocab"))
            _write_imported(out, model, model_cfg, vocab, checkpoint, opts, Path(tmp), force=force)
    else:
        existed = tokens_out.exists()
        with writing.ArtifactWriter(tokens_out, "tokens", {"import": {"format": "fairseq"}}, force=force) as w:
            w.path("spm.model").write_bytes(vocab.spm_bytes)
            write_vocab(sp, w.path("spm.vocab"))
            w.extra.update({
                "vocab_size": len(vocab.pieces), "spm_sha256": file_hash(w.path("spm.model")),
                "special_ids": SPECIALS, "eos_stored": False, "spm_model_source": str(spm_model),
                "imported_from": {"format": "fairseq", "checkpoint": str(checkpoint), "dictionary": str(tgt_path)},
                "pairs": {}, "tokens": {},
            })
        try:
            _write_imported(out, model, model_cfg, vocab, checkpoint, opts, tokens_out, force=force)
        except BaseException:
            if not existed:  # the pair is one result: do not leave half of it
                shutil.rmtree(tokens_out, ignore_errors=True)
            raise
    summary = {
        "layers": f"{cfg['encoder_layers']} + {cfg['decoder_layers']}",
        "d_model / heads / d_ff": f"{cfg['d_model']} / {cfg['heads']} / {cfg['d_ff']}",
        "norm": cfg["norm_position"],
        "embeddings": cfg["share_embeddings"],
        "positions": ("fairseq's learned" if any(facts["learned"].values()) else "fairseq's sinusoids")
        + f", {cfg['max_positions']} rows",
        "vocabulary": f"{len(vocab.pieces):,} pieces",
        "pieces without a fairseq row (output bias -1e9)": len(vocab.never),
        "fairseq padding symbols appended": len(vocab.appended),
        "SentencePiece model": "rewritten (ids reordered or symbols appended)" if vocab.rewritten else "unchanged",
    }
    console.table(f"import: {checkpoint} -> {out}" + (f" (+ {tokens_out})" if tokens_out else ""), ["", "value"],
                  [[k, v] for k, v in summary.items()])
    return summary


def _write_imported(out: Path, model: Any, model_cfg: dict[str, Any], vocab: Any, checkpoint: Path,
                    opts: dict[str, Any], spm_dir: Path, *, force: bool) -> None:
    """Write the converted model as an mtpipe checkpoint carrying ``spm_dir``'s spm.model and spm.vocab."""
    writing.write_checkpoint(out, state_dict=model.state_dict(), model_config=model_cfg,
                             vocab={"spm_sha256": file_hash(spm_dir / "spm.model"), "size": len(vocab.pieces)},
                             step=0, params={"import": {"format": "fairseq"}},
                             extra={"imported_from": {"format": "fairseq", "checkpoint": str(checkpoint),
                                                      "fairseq_model": {k: opts[k] for k in sorted(opts)
                                                                        if _plain(opts[k])}}},
                             spm=spm_dir / "spm.model", spm_vocab=spm_dir / "spm.vocab", force=force)


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


__all__ = ["FairseqDictionary", "Vocabulary", "build_vocabulary", "convert_weights", "fairseq_sinusoids",
           "find_dictionaries", "import_fairseq", "load_fairseq_checkpoint", "model_config", "read_dictionary"]
