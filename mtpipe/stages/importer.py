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

import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpipe import console, writing
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID, SPECIALS, UNK_ID, CheckpointManifest, file_hash
from mtpipe.config import ModelConfig, to_dict
from mtpipe.errors import MtpipeError
from mtpipe.stages.fairseq_files import (
    FAIRSEQ_SPECIALS,
    FairseqDictionary,
    fairseq_sinusoids,
    find_dictionaries,
    load_fairseq_checkpoint,
    model_config,
    read_dictionary,
)

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
    proto, raw = _read_spm_proto(spm_model)
    ts = proto.trainer_spec
    have = {"pad": ts.pad_id, "unk": ts.unk_id, "bos": ts.bos_id, "eos": ts.eos_id}
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
    rewritten = have != SPECIALS or bool(appended)
    if rewritten:
        proto = _rewritten(proto, have, appended, spm_model)
        raw = proto.SerializeToString()
    pieces = [p.piece for p in proto.pieces]
    src_rows, tgt_rows, never = _rows(pieces, src, tgt)
    return Vocabulary(raw, pieces, src_rows, tgt_rows, never, appended, rewritten)


_DEFAULT_PIECE = {"pad": "<pad>", "unk": "<unk>", "bos": "<s>", "eos": "</s>"}


def _read_spm_proto(spm_model: Path) -> tuple[Any, bytes]:
    """The SentencePiece model's protobuf and its bytes; a missing or broken file is one error line."""
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
    return proto, raw


def _rewritten(proto: Any, have: dict[str, int], appended: list[str], spm_model: Path) -> Any:
    """``proto`` with mtpipe's special ids (pad, unk, bos, eos first) and the fairseq padding symbols ``appended``
    as UNUSED pieces at the end."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    if proto.trainer_spec.unk_id < 0 or proto.trainer_spec.unk_id >= len(proto.pieces):
        raise MtpipeError(f"{spm_model}: has no <unk> piece")
    pieces_set = {p.piece for p in proto.pieces}
    order = sorted(SPECIALS, key=SPECIALS.get)  # pad, unk, bos, eos
    specials = []
    for name in order:
        i = have[name]
        if 0 <= i < len(proto.pieces):
            specials.append(proto.pieces[i])
        else:
            if _DEFAULT_PIECE[name] in pieces_set:
                raise MtpipeError(f"{spm_model}: has no {name} id but a piece named {_DEFAULT_PIECE[name]!r}")
            specials.append(pb.ModelProto.SentencePiece(piece=_DEFAULT_PIECE[name], score=0.0, type=_CONTROL))
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
        setattr(new.trainer_spec, f"{name}_piece", specials[SPECIALS[name]].piece)
    new.trainer_spec.vocab_size = len(new.pieces)
    return new


def _rows(pieces: list[str], src: FairseqDictionary, tgt: FairseqDictionary) -> tuple[list[int], list[int], list[int]]:
    """Each mtpipe id's source and target fairseq rows, and the ids fairseq's softmax did not have."""
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
    return src_rows, tgt_rows, never


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
    take = _Taker(state, where)
    for key in state:
        if key.endswith(".version") or key.endswith("embed_positions._float_tensor"):
            take.ignore(key)
        if re.fullmatch(r"encoder\.layers\.\d+\.(" + "|".join(_FUSED_COPIES) + ")", key):
            take.ignore(key)
    out = _embeddings(take, state, cfg, vocab, where)
    out.update(_positions(take, cfg, facts, where))
    _layers(take, cfg, out)
    take.done()
    return {k: v.contiguous() for k, v in out.items()}


def _embeddings(take: _Taker, state: dict[str, Any], cfg: dict[str, Any], vocab: Vocabulary,
                where: Path) -> dict[str, Any]:
    """The embedding tables and the output projection, rows in mtpipe's id order, tied as far as fairseq's really
    are (``cfg``'s share_embeddings and output_bias set to match)."""
    import torch

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
    return out


def _positions(take: _Taker, cfg: dict[str, Any], facts: dict[str, Any], where: Path) -> dict[str, Any]:
    """The position tables: fairseq's learned rows or its sinusoids, past its padding offset."""
    out: dict[str, Any] = {}
    d, pad, n_pos = cfg["d_model"], facts["padding_idx"], cfg["max_positions"]
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
    return out


def _layers(take: _Taker, cfg: dict[str, Any], out: dict[str, Any]) -> None:
    """Every layer's projections and norms into ``out`` (fairseq's q, k, v fused as mtpipe's qkv)."""
    import torch

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


# --------------------------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------------------------


def import_fairseq(checkpoint: Path, dictionary: Path, spm_model: Path, out: Path, tokens_out: Path | None, *,
                   force: bool = False) -> dict[str, Any]:
    """Convert a fairseq transformer checkpoint (``checkpoint.pt``, its ``dict.*.txt`` in ``dictionary``, the
    SentencePiece model that made its data) into the mtpipe checkpoint ``out`` (which carries the SentencePiece
    model, remapped to mtpipe's ids) and, when ``tokens_out`` is given, also a bpe artifact there. Returns a
    summary."""
    from mtpipe.model.transformer import build_model

    checkpoint, dictionary, spm_model = Path(checkpoint), Path(dictionary), Path(spm_model)
    out = Path(out)
    tokens_out = Path(tokens_out) if tokens_out is not None else None
    state, opts, task = load_fairseq_checkpoint(checkpoint)
    src_path, tgt_path = find_dictionaries(dictionary, task.get("source_lang"), task.get("target_lang"))
    src_dict, tgt_dict = read_dictionary(src_path), read_dictionary(tgt_path)
    cfg, facts = model_config(opts, state, checkpoint)
    _check_dictionary_sizes(state, src_dict, tgt_dict)
    vocab = build_vocabulary(spm_model, src_dict, tgt_dict)
    weights = convert_weights(state, cfg, facts, vocab, checkpoint)
    model_cfg = to_dict(ModelConfig(**cfg).resolved())
    model = build_model(model_cfg, len(vocab.pieces))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:  # a programming error in the mapping above, named rather than silently wrong
        raise MtpipeError(f"{checkpoint}: converted weights do not fit mtpipe's model (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")
    imported = {"format": "fairseq", "checkpoint": str(checkpoint), "dictionary": str(tgt_path)}
    _write_outputs(out, tokens_out, model, model_cfg, vocab, opts, imported, spm_model, force=force)
    summary = _summary(cfg, facts, vocab)
    console.table(f"import: {checkpoint} -> {out}" + (f" (+ {tokens_out})" if tokens_out else ""), ["", "value"],
                  [[k, v] for k, v in summary.items()])
    return summary


def _check_dictionary_sizes(state: dict[str, Any], src: FairseqDictionary, tgt: FairseqDictionary) -> None:
    """Each dictionary has exactly as many symbols as its side's embedding rows: else it is not the one the
    checkpoint was trained with."""
    for side, table in (("encoder", src), ("decoder", tgt)):
        rows = state.get(f"{side}.embed_tokens.weight")
        if rows is not None and rows.shape[0] != len(table.symbols):
            raise MtpipeError(f"{table.path}: {len(table.symbols)} symbols (with fairseq's 4 specials), but the "
                              f"checkpoint's {side} embeddings have {rows.shape[0]} rows: not the dictionary it was "
                              "trained with")


def _write_outputs(out: Path, tokens_out: Path | None, model: Any, model_cfg: dict[str, Any], vocab: Vocabulary,
                   opts: dict[str, Any], imported: dict[str, str], spm_model: Path, *, force: bool) -> None:
    """The checkpoint ``out`` and, with ``tokens_out``, a bpe artifact there too: both or neither."""
    import sentencepiece as spm

    from mtpipe.stages.bpe import write_vocab

    checkpoint = Path(imported["checkpoint"])
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
                "imported_from": imported, "pairs": {}, "tokens": {},
            })
        try:
            _write_imported(out, model, model_cfg, vocab, checkpoint, opts, tokens_out, force=force)
        except BaseException:
            if not existed:  # the pair is one result: do not leave half of it
                shutil.rmtree(tokens_out, ignore_errors=True)
            raise


def _summary(cfg: dict[str, Any], facts: dict[str, Any], vocab: Vocabulary) -> dict[str, Any]:
    """What the import made, as the summary table shows it."""
    return {
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


def _write_imported(out: Path, model: Any, model_cfg: dict[str, Any], vocab: Any, checkpoint: Path,
                    opts: dict[str, Any], spm_dir: Path, *, force: bool) -> None:
    """Write the converted model as an mtpipe checkpoint carrying ``spm_dir``'s spm.model and spm.vocab."""
    meta = CheckpointManifest(
        model_config=model_cfg, vocab={"spm_sha256": file_hash(spm_dir / "spm.model"), "size": len(vocab.pieces)},
        step=0, imported_from={"format": "fairseq", "checkpoint": str(checkpoint),
                               "fairseq_model": {k: opts[k] for k in sorted(opts) if _plain(opts[k])}})
    writing.write_checkpoint(out, state_dict=model.state_dict(), meta=meta, params={"import": {"format": "fairseq"}},
                             spm=spm_dir / "spm.model", spm_vocab=spm_dir / "spm.vocab", force=force)


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


__all__ = ["Vocabulary", "build_vocabulary", "convert_weights", "import_fairseq"]
