"""A checkpoint converted to a CTranslate2 model: what ``mtpipe export`` writes and what
``decode.engine=ctranslate2`` converts on the fly (:func:`mtpipe.engine.ct2.open_for_decode`), so the engine
converts without importing the export stage; the export stage (:mod:`mtpipe.stages.export`) adds the Hugging Face
formats on the shared helpers here (:class:`ExportSource`, :class:`Weights`).

CTranslate2 (``pip install 'mtpipe[ctranslate2]'``) serves this architecture natively: its ``TransformerSpec`` is the
post-norm Transformer of the paper (section 3) with ReLU feed-forward layers, scaled embeddings and an explicit
position table. :func:`export_ctranslate2` fills that spec through CTranslate2's own Python API
(``ctranslate2.specs``), the way its fairseq/OpenNMT converters do, from the checkpoint's *parameter names*: every
``state_dict`` entry must be consumed by exactly one spec variable, so a renamed, added or reshaped parameter in
:mod:`mtpipe.model.transformer` fails the export with its name instead of producing a silently wrong model.

The mapping (paper section -> CTranslate2 variable):

* 3.4 ``embed.weight`` -> ``encoder/embeddings_0``, ``decoder/embeddings`` and ``decoder/projection`` (three-way
  tying; CTranslate2 stores the array once and aliases the rest); the sqrt(d_model) factor is ``scale_embeddings``.
  ``share_embeddings=decoder``: ``embed_tgt.weight`` -> ``decoder/embeddings`` and ``decoder/projection``;
  ``none``: ``embed_tgt.weight`` -> ``decoder/embeddings``, ``out_proj`` -> ``decoder/projection``.
  ``output_bias``: ``out_bias`` -> ``decoder/projection/bias``.
* 3.5 the model's own sinusoid table (``Transformer.positions``: positions from 0, sines in the first half, paper
  frequencies 10000^(2i/d_model)) -> ``position_encodings/encodings``. CTranslate2's built-in sinusoids use
  tensor2tensor's frequencies ``10000^(i/(d/2-1))``, which differ, so the table is always written explicitly.
* 3.2 self-attention ``qkv`` (one ``[h(2d_k+d_v), d]`` matrix, q|k|v) -> ``self_attention/linear_0`` (CTranslate2
  splits it the same way), ``out`` -> ``linear_1``; cross-attention ``q`` -> ``attention/linear_0``, ``kv`` (k|v)
  -> ``linear_1``, ``out`` -> ``linear_2``. CTranslate2 has one head size, so d_k must equal d_v (``head_dim`` is
  written when ``h * d_k != d_model``).
* 3.1 post-norm: ``pre_norm=False``; ``norm1/2/3`` -> the ``layer_norm`` of the self-attention, cross-attention and
  feed-forward sub-layers (CTranslate2 applies them after the residual add), epsilon from the model's LayerNorms.
  A pre-norm model (``model.norm_position=pre``) maps the same norms with ``pre_norm=True`` (applied to each
  sub-layer's input) and ``encoder_norm``/``decoder_norm`` -> the stacks' final ``layer_norm``.
* Variants: learned positions are written as the position table like the sinusoids (``learned-per-stack``:
  ``positions`` -> the encoder's, ``tgt_positions`` -> the decoder's); LayerDrop changes nothing at
  inference (a pruned checkpoint is just a shallower model). ScaleNorm and FixNorm have no CTranslate2 (nor Hugging
  Face) counterpart: their export fails with one line naming the param.
* 3.3 ``ffn.w1``/``ffn.w2`` -> ``ffn/linear_0``/``linear_1`` with ReLU.
* Tokens: the vocabulary is the SentencePiece model's pieces in id order (``<pad>`` 0, ``<unk>`` 1, ``<s>`` 2,
  ``</s>`` 3); the decoder starts from ``<s>`` (BOS; ``</s>`` with ``decoder_start=eos``: the
  ``decoder_start_token``) and stops at ``</s>``; ``add_source_eos`` appends ``</s>`` to every source, as mtpipe's
  batches do.

The output directory is an mtpipe artifact (kind ``export``): CTranslate2's ``model.bin``, ``config.json`` and
``shared_vocabulary.json``, the ``spm.model`` beside them, and a ``manifest.json`` whose ``upstream`` holds the
hashes of the checkpoint and tokens manifests (the checkpoint's alone when its own SentencePiece model was used, no
``--tokens``) and whose ``extra["decode"]`` keeps the decode settings the checkpoint records; it is written to a
temporary directory and renamed into place.

Decoding an export (``mtpipe decode --engine ctranslate2``, :func:`mtpipe.engine.ct2.translate_under_rules`) is
:mod:`mtpipe.engine.ct2`; the checkpoint and its SentencePiece model are opened and cross-checked by
:func:`mtpipe.engine.loading.open_checkpoint`, as ``mtpipe decode`` opens them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpipe import artifacts, writing
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from mtpipe.config import ExportConfig
from mtpipe.engine.loading import open_checkpoint
from mtpipe.errors import MtpipeError

SPECIAL_PIECES = {PAD_ID: "<pad>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}
INSTALL_CT2 = "pip install 'mtpipe[ctranslate2]'"


# --------------------------------------------------------------------------------------------------------------------
# Shared input checks
# --------------------------------------------------------------------------------------------------------------------


def require_ctranslate2() -> Any:
    """The ``ctranslate2`` module, or one line naming the extra that installs it."""
    try:
        import ctranslate2
    except ImportError:
        raise MtpipeError(f"ctranslate2 is not installed: {INSTALL_CT2}") from None
    return ctranslate2


@dataclass
class ExportSource:
    """A checkpoint rebuilt as a model, with the SentencePiece model it was trained with."""

    checkpoint: Path
    tokens: Path | None  # the bpe artifact whose SentencePiece model was used; None: the checkpoint's own
    ck: Any  # artifacts.Checkpoint
    model: Any  # mtpipe.model.transformer.Transformer (eval mode)
    spm_path: Path
    pieces: list[str]


def load_source(checkpoint: Path, tokens: Path | None) -> ExportSource:
    """The checkpoint and the tokens artifact, opened as every command opens a checkpoint
    (:func:`mtpipe.engine.loading.open_checkpoint`: cross-checked), and the vocabulary's pieces, which become the
    export's token list: mtpipe's special ids must hold their pieces and every piece must have one id. Every failure
    is one MtpipeError line."""
    loaded = open_checkpoint(checkpoint, tokens)
    sp, spm_path = loaded.sp, loaded.spm_path
    size = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(size)]
    for i, name in SPECIAL_PIECES.items():
        if i >= size or pieces[i] != name:
            raise MtpipeError(f"{spm_path}: id {i} is {pieces[i] if i < size else 'missing'!r}, expected {name!r} "
                              "(mtpipe's special ids: <pad>=0 <unk>=1 <s>=2 </s>=3)")
    if len(set(pieces)) != size:
        raise MtpipeError(f"{spm_path}: duplicate pieces; a token vocabulary needs one id per piece")
    return ExportSource(Path(checkpoint), loaded.tokens, loaded.ck, loaded.model, spm_path, pieces)


def export_upstream(src: ExportSource) -> dict[str, Path]:
    return {"checkpoint": src.checkpoint, **({"tokens": src.tokens} if src.tokens is not None else {})}


class Weights:
    """The checkpoint's parameters by name; each must be taken exactly once (so a model change breaks loudly)."""

    def __init__(self, model: Any, where: Path):
        self.where = where
        self.left = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}

    def take(self, name: str, shape: tuple[int, ...]) -> Any:
        if name not in self.left:
            raise MtpipeError(f"{self.where}: the model has no parameter '{name}' that the export maps (mtpipe.model.transformer "
                              "changed; update mtpipe/engine/ct2_convert.py)")
        t = self.left.pop(name)
        if tuple(t.shape) != shape:
            raise MtpipeError(f"{self.where}: parameter '{name}' has shape {tuple(t.shape)}, the export expects "
                              f"{shape} (mtpipe.model.transformer changed; update mtpipe/engine/ct2_convert.py)")
        return t.numpy()

    def done(self) -> None:
        if self.left:
            names = ", ".join(sorted(self.left)[:5])
            raise MtpipeError(f"{self.where}: {len(self.left)} parameter(s) the export does not map ({names}); "
                              "mtpipe.model.transformer changed: update mtpipe/engine/ct2_convert.py")


def layer_norm_eps(model: Any, where: Path) -> float:
    from torch import nn

    eps = {float(m.eps) for m in model.modules() if isinstance(m, nn.LayerNorm)}
    if len(eps) != 1:
        raise MtpipeError(f"{where}: the model's LayerNorms use different epsilons {sorted(eps)}; one is needed")
    return eps.pop()


def unsupported(cfg: Any) -> str | None:
    """The model param no exported format can represent (None when there is none)."""
    if getattr(cfg, "norm", "layer") != "layer":
        return f"model.norm={cfg.norm} (ScaleNorm): the exported Transformers have LayerNorm only"
    if getattr(cfg, "fixnorm", False):
        return "model.fixnorm=true (FixNorm): the exported Transformers scale embeddings by a constant, unnormalised"
    if r := getattr(cfg, "attention_window", 0):
        return (f"model.attention_window={r} (restricted self-attention): the exported Transformers' self-attention "
                "sees every position and has no neighbourhood limit")
    return None


def position_table(model: Any, where: Path, name: str = "positions") -> Any:
    """The position table ``name`` the model adds (``[max_positions, d_model]``: the sinusoids, or a learned
    table; ``tgt_positions``: the decoder's own), read from the model itself."""
    tensors = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    if name not in tensors:
        raise MtpipeError(f"{where}: the model has no '{name}' table (mtpipe.model.transformer changed; update "
                          "mtpipe/stages/export.py)")
    table = tensors[name].detach().float().cpu().contiguous()
    cfg = model.cfg
    if tuple(table.shape) != (cfg.max_positions, cfg.d_model):
        raise MtpipeError(f"{where}: {name} table {tuple(table.shape)} is not [max_positions, d_model]")
    return table


def start_id(model: Any) -> int:
    """The decoder's first input token: BOS, or EOS for ``model.decoder_start=eos``."""
    return int(getattr(model, "start_id", BOS_ID))


def quantization_type(quantization: str | None) -> str | None:
    """CTranslate2's weight type for ``quantization`` (None / "none": keep float32). The choices are
    ``export.quantization``'s (:class:`mtpipe.config.ExportConfig`): a section built from the value checks it, so a
    call from code fails as the params would ("params: export.quantization = ... is not one of ...")."""
    q = "none" if quantization in (None, "") else str(quantization)
    ExportConfig(quantization=q)
    return None if q == "none" else q


# --------------------------------------------------------------------------------------------------------------------
# CTranslate2
# --------------------------------------------------------------------------------------------------------------------


def build_ct2_spec(src: ExportSource) -> Any:
    """A validated ``ctranslate2.specs.TransformerSpec`` holding the model's weights and vocabulary."""
    require_ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    cfg, where = src.model.cfg, src.checkpoint
    if why := unsupported(cfg):
        raise MtpipeError(f"{where}: cannot be exported to CTranslate2: {why}")
    if cfg.d_k != cfg.d_v:
        raise MtpipeError(f"{where}: d_k={cfg.d_k} != d_v={cfg.d_v}; CTranslate2 attention has one head size")
    pre_norm = getattr(cfg, "norm_position", "post") == "pre"
    # head_dim only when it is not CTranslate2's default d_model / heads.
    head_dim = None if cfg.d_k * cfg.heads == cfg.d_model else cfg.d_k
    relu = common_spec.Activation.RELU
    encoder = transformer_spec.TransformerEncoderSpec(cfg.encoder_layers, cfg.heads, pre_norm=pre_norm,
                                                      activation=relu, head_dim=head_dim)
    decoder = transformer_spec.TransformerDecoderSpec(cfg.decoder_layers, cfg.heads, pre_norm=pre_norm,
                                                      activation=relu, head_dim=head_dim)
    spec = transformer_spec.TransformerSpec(encoder, decoder)
    _fill_ct2_weights(encoder, decoder, src, pre_norm)

    config = spec.config
    config.unk_token = src.pieces[UNK_ID]
    config.bos_token = src.pieces[BOS_ID]
    config.eos_token = src.pieces[EOS_ID]
    config.decoder_start_token = src.pieces[start_id(src.model)]  # tgt_in = [BOS] + tgt (or [EOS] + tgt)
    config.add_source_bos = False
    config.add_source_eos = True  # src = tokens + [EOS]
    config.layer_norm_epsilon = layer_norm_eps(src.model, where)
    spec.register_source_vocabulary(list(src.pieces))
    spec.register_target_vocabulary(list(src.pieces))
    try:
        spec.validate()
    except ValueError as e:
        raise MtpipeError(f"{where}: CTranslate2 rejected the converted model ({str(e).splitlines()[0]})") from None
    return spec


def _fill_ct2_weights(encoder: Any, decoder: Any, src: ExportSource, pre_norm: bool) -> None:
    """Every parameter of the model into its CTranslate2 variable (the mapping in the module docstring)."""
    model, cfg = src.model, src.model.cfg
    d, h, dk, dv, ff = cfg.d_model, cfg.heads, cfg.d_k, cfg.d_v, cfg.d_ff
    w = Weights(model, src.checkpoint)
    vocab, share = len(src.pieces), getattr(cfg, "share_embeddings", "all")
    embed = w.take("embed.weight", (vocab, d))  # tied matrices are taken once and written to each variable
    embed_tgt = w.take("embed_tgt.weight", (vocab, d)) if share != "all" else embed
    projection = w.take("out_proj", (vocab, d)) if share == "none" else embed_tgt
    positions = getattr(cfg, "positions", "sinusoidal")
    table = position_table(model, src.checkpoint).numpy()
    if positions != "sinusoidal":
        w.take("positions", (cfg.max_positions, d))  # the table above
    tgt_table = w.take("tgt_positions", (cfg.max_positions, d)) if positions == "learned-per-stack" else table
    scale = float(getattr(model, "scale", math.sqrt(d)))

    def linear(ls: Any, name: str, out_features: int, in_features: int) -> None:
        ls.weight = w.take(f"{name}.weight", (out_features, in_features))
        ls.bias = w.take(f"{name}.bias", (out_features,))

    def norm(ns: Any, name: str) -> None:
        ns.gamma = w.take(f"{name}.weight", (d,))
        ns.beta = w.take(f"{name}.bias", (d,))

    def ffn(fs: Any, prefix: str, norm_name: str) -> None:
        linear(fs.linear_0, f"{prefix}.ffn.w1", ff, d)
        linear(fs.linear_1, f"{prefix}.ffn.w2", d, ff)
        norm(fs.layer_norm, f"{prefix}.{norm_name}")

    def self_attention(a: Any, prefix: str) -> None:
        linear(a.linear[0], f"{prefix}.self_attn.qkv", h * (2 * dk + dv), d)  # q|k|v, as CTranslate2 splits it
        linear(a.linear[1], f"{prefix}.self_attn.out", d, h * dv)
        norm(a.layer_norm, f"{prefix}.norm1")

    encoder.scale_embeddings = decoder.scale_embeddings = scale
    encoder.position_encodings.encodings = table
    decoder.position_encodings.encodings = tgt_table
    encoder.embeddings[0].weight = embed
    decoder.embeddings.weight = embed_tgt
    decoder.projection.weight = projection  # 3.4: the embedding matrix itself unless untied
    if getattr(cfg, "output_bias", False):
        decoder.projection.bias = w.take("out_bias", (vocab,))

    for i, layer in enumerate(encoder.layer):
        self_attention(layer.self_attention, f"encoder.{i}")
        ffn(layer.ffn, f"encoder.{i}", "norm2")
    for i, layer in enumerate(decoder.layer):
        p = f"decoder.{i}"
        self_attention(layer.self_attention, p)
        linear(layer.attention.linear[0], f"{p}.cross_attn.q", h * dk, d)
        linear(layer.attention.linear[1], f"{p}.cross_attn.kv", h * (dk + dv), d)  # k|v
        linear(layer.attention.linear[2], f"{p}.cross_attn.out", d, h * dv)
        norm(layer.attention.layer_norm, f"{p}.norm2")
        ffn(layer.ffn, p, "norm3")
    if pre_norm:  # the final norm of each stack
        norm(encoder.layer_norm, "encoder_norm")
        norm(decoder.layer_norm, "decoder_norm")
    w.done()


def export_ctranslate2(checkpoint: Path, tokens: Path | None, out: Path, quantization: str | None = None,
                       params: dict[str, Any] | None = None, summary: bool = True, *,
                       force: bool = False) -> dict[str, Any]:
    """Export ``checkpoint`` (trained or averaged) with the SentencePiece model of ``tokens`` (None: the
    checkpoint's own) to a CTranslate2 model
    directory ``out`` (atomically). ``quantization``: None/"none" keeps float32 weights, else a CTranslate2 weight
    type (int8, int8_float32, int16, float16, ...). ``summary``: print the summary table. Returns the manifest's
    ``extra``."""
    q = quantization_type(quantization)
    ct2 = require_ctranslate2()
    src = load_source(checkpoint, tokens)
    spec = build_ct2_spec(src)
    spec.optimize(quantization=q)  # aliases the three tied embedding copies, then quantizes
    cfg = src.model.cfg
    with writing.ArtifactWriter(out, "export", params, upstream=export_upstream(src),
                                  force=force) as w:
        assert w.tmp is not None
        spec.save(str(w.tmp))
        w.path("spm.model").write_bytes(src.spm_path.read_bytes())
        w.extra.update(export_extra(src, "ctranslate2", q))
        w.extra["ctranslate2_version"] = ct2.__version__
        w.extra["vocabulary"] = "shared_vocabulary.json"
    from mtpipe import console

    if not summary:
        return artifacts.read_manifest(out, "export").extra
    console.table(f"export: {checkpoint} -> {out} (CTranslate2)", ["", "value"], [
        ["step", src.ck.step],
        ["layers (enc + dec)", f"{cfg.encoder_layers} + {cfg.decoder_layers}"],
        ["d_model / heads / d_ff", f"{cfg.d_model} / {cfg.heads} / {cfg.d_ff}"],
        ["vocabulary", len(src.pieces)],
        ["weights", q or "float32"],
        ["model.bin MB", round((Path(out) / "model.bin").stat().st_size / 2**20, 2)],
    ])
    return artifacts.read_manifest(out, "export").extra


def export_extra(src: ExportSource, fmt: str, quantization: str | None) -> dict[str, Any]:
    return {
        "format": fmt,
        "quantization": quantization or "none",
        "checkpoint": str(src.checkpoint),
        "checkpoint_manifest_sha256": artifacts.manifest_hash(src.checkpoint),
        "checkpoint_step": src.ck.step,
        "model_config": src.ck.model_config,
        "vocab": src.ck.vocab,
        "spm_model": "spm.model",
        "max_positions": src.model.cfg.max_positions,
        "decode": src.ck.meta.decode or {},
        "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
    }


# --------------------------------------------------------------------------------------------------------------------


__all__ = ["ExportSource", "INSTALL_CT2", "SPECIAL_PIECES", "Weights", "build_ct2_spec", "export_ctranslate2", "export_extra", "export_upstream", "layer_norm_eps", "load_source", "position_table", "quantization_type", "require_ctranslate2", "start_id", "unsupported"]
