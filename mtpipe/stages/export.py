"""``mtpipe export``: a checkpoint as a CTranslate2 model, or as a Hugging Face model (Marian for a post-norm model,
Pegasus for a pre-norm one, when the shapes allow it).

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

Decoding an export (``mtpipe decode --engine ctranslate2``, :func:`mtpipe.engine.ct2.ct2_translate`) is
:mod:`mtpipe.engine.ct2`; the checkpoint and its SentencePiece model are loaded and cross-checked by
:func:`mtpipe.engine.loading.load_model_and_vocab`, as ``mtpipe decode`` loads them.

Hugging Face (:func:`export_huggingface`; ``export.format`` ``marian``, ``pegasus``, or ``huggingface``: Marian for a
post-norm model, Pegasus for a pre-norm one). Both are BART-style encoder-decoders whose layers take mtpipe's
parameters the same way (:func:`_hf_state_dict`): ``qkv`` split into ``q_proj``/``k_proj``/``v_proj``, cross-attention
``q`` -> ``q_proj`` and ``kv`` -> ``k_proj``/``v_proj``, ``out`` -> ``out_proj``, ``norm1``/``norm2``/``norm3`` ->
``self_attn_layer_norm``/``encoder_attn_layer_norm``/``final_layer_norm`` (the encoder's ``norm2`` ->
``final_layer_norm``), ``ffn.w1``/``w2`` -> ``fc1``/``fc2`` with ``activation_function=relu``, ``scale_embedding``
(sqrt(d_model)), no ``layernorm_embedding``, positions from 0, LayerNorm epsilon 1e-5, ``final_logits_bias`` =
``out_bias`` or zeros, ``decoder_start_token_id`` = the model's start token. Their attention has one head size, so
d_k = d_v = d_model / h is needed.

* ``MarianMTModel`` (:func:`export_marian`) is the post-norm Transformer: no final encoder/decoder norm; tied
  embeddings -- ``share_encoder_decoder_embeddings`` false for ``share_embeddings=decoder|none``,
  ``tie_word_embeddings`` false for ``none``. Marian does not save its sinusoid table (sines in the first half, the
  paper's frequencies) but rebuilds it on load, so the positions must be the sinusoids and d_model even.
* ``PegasusForConditionalGeneration`` (:func:`export_pegasus`) is the pre-norm Transformer (fairseq's
  ``normalize_before``: ``x + F(LayerNorm(x))``) with a final ``layer_norm`` on each stack: ``encoder_norm`` /
  ``decoder_norm``. transformers 5.24's ``PegasusSinusoidalPositionalEmbedding`` is Marian's (copied from it), but
  Pegasus saves the table with the weights (no ``_keys_to_ignore_on_save``) and from_pretrained keeps the loaded
  tensor (it is marked initialised, so ``_init_weights``' ``init.copy_`` of the rebuilt sinusoids skips it): the
  export writes mtpipe's own tables (``positions``; ``tgt_positions`` for ``learned-per-stack``) and checks that the
  saved file holds them, so learned and odd-sized tables map as well. Pegasus has no
  ``share_encoder_decoder_embeddings``: ``tie_word_embeddings`` true ties ``shared``, both stacks' embeddings and
  ``lm_head`` (``share_embeddings=all``); false (``decoder``, ``none``) unties all of them in transformers 5, and
  ``shared`` (the input embeddings) gets the source embedding.

The directory holds the ``save_pretrained`` files (``config.json``, ``generation_config.json`` with the start token,
``forced_eos_token_id``, PAD and BOS as bad words, beam 4; ``model.safetensors``) and the tokenizer files
(:func:`_write_hf_tokenizer`): ``AutoTokenizer`` loads ``MarianTokenizer``, which encodes with the SentencePiece model
itself and appends ``</s>`` (``PegasusTokenizer`` does not fit: it reserves 103 ids before the pieces). A mapping that
is not exact fails naming the part that does not map, and the format that holds it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpipe import artifacts, writing
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from mtpipe.config import ExportConfig
from mtpipe.errors import MtpipeError
from mtpipe.engine.loading import load_model_and_vocab

SPECIAL_PIECES = {PAD_ID: "<pad>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}
INSTALL_CT2 = "pip install 'mtpipe[ctranslate2]'"
INSTALL_HF = "pip install 'mtpipe[huggingface]'"


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
class _Source:
    """A checkpoint rebuilt as a model, with the SentencePiece model it was trained with."""

    checkpoint: Path
    tokens: Path | None  # the bpe artifact whose SentencePiece model was used; None: the checkpoint's own
    ck: Any  # artifacts.Checkpoint
    model: Any  # mtpipe.model.transformer.Transformer (eval mode)
    spm_path: Path
    pieces: list[str]


def _load_source(checkpoint: Path, tokens: Path | None) -> _Source:
    """The checkpoint and the tokens artifact, cross-checked (:func:`mtpipe.engine.loading.load_model_and_vocab`), and the
    vocabulary's pieces, which become the export's token list: mtpipe's special ids must hold their pieces and every
    piece must have one id. Every failure is one MtpipeError line."""
    loaded = load_model_and_vocab(checkpoint, tokens)
    sp, spm_path = loaded.sp, loaded.spm_path
    size = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(size)]
    for i, name in SPECIAL_PIECES.items():
        if i >= size or pieces[i] != name:
            raise MtpipeError(f"{spm_path}: id {i} is {pieces[i] if i < size else 'missing'!r}, expected {name!r} "
                              "(mtpipe's special ids: <pad>=0 <unk>=1 <s>=2 </s>=3)")
    if len(set(pieces)) != size:
        raise MtpipeError(f"{spm_path}: duplicate pieces; a token vocabulary needs one id per piece")
    return _Source(Path(checkpoint), loaded.tokens, loaded.ck, loaded.model, spm_path, pieces)


def _upstream(src: _Source) -> dict[str, Path]:
    return {"checkpoint": src.checkpoint, **({"tokens": src.tokens} if src.tokens is not None else {})}


class _Weights:
    """The checkpoint's parameters by name; each must be taken exactly once (so a model change breaks loudly)."""

    def __init__(self, model: Any, where: Path):
        self.where = where
        self.left = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}

    def take(self, name: str, shape: tuple[int, ...]) -> Any:
        if name not in self.left:
            raise MtpipeError(f"{self.where}: the model has no parameter '{name}' that the export maps (mtpipe.model.transformer "
                              "changed; update mtpipe/stages/export.py)")
        t = self.left.pop(name)
        if tuple(t.shape) != shape:
            raise MtpipeError(f"{self.where}: parameter '{name}' has shape {tuple(t.shape)}, the export expects "
                              f"{shape} (mtpipe.model.transformer changed; update mtpipe/stages/export.py)")
        return t.numpy()

    def done(self) -> None:
        if self.left:
            names = ", ".join(sorted(self.left)[:5])
            raise MtpipeError(f"{self.where}: {len(self.left)} parameter(s) the export does not map ({names}); "
                              "mtpipe.model.transformer changed: update mtpipe/stages/export.py")


def _layer_norm_eps(model: Any, where: Path) -> float:
    from torch import nn

    eps = {float(m.eps) for m in model.modules() if isinstance(m, nn.LayerNorm)}
    if len(eps) != 1:
        raise MtpipeError(f"{where}: the model's LayerNorms use different epsilons {sorted(eps)}; one is needed")
    return eps.pop()


def _unsupported(cfg: Any) -> str | None:
    """The model param no exported format can represent (None when there is none)."""
    if getattr(cfg, "norm", "layer") != "layer":
        return f"model.norm={cfg.norm} (ScaleNorm): the exported Transformers have LayerNorm only"
    if getattr(cfg, "fixnorm", False):
        return "model.fixnorm=true (FixNorm): the exported Transformers scale embeddings by a constant, unnormalised"
    if r := getattr(cfg, "attention_window", 0):
        return (f"model.attention_window={r} (restricted self-attention): the exported Transformers' self-attention "
                "sees every position and has no neighbourhood limit")
    return None


def _positions(model: Any, where: Path, name: str = "positions") -> Any:
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


def _start_id(model: Any) -> int:
    """The decoder's first input token: BOS, or EOS for ``model.decoder_start=eos``."""
    return int(getattr(model, "start_id", BOS_ID))


def _quantization(quantization: str | None) -> str | None:
    """CTranslate2's weight type for ``quantization`` (None / "none": keep float32). The choices are
    ``export.quantization``'s (:class:`mtpipe.config.ExportConfig`): a section built from the value checks it, so a
    call from code fails as the params would ("params: export.quantization = ... is not one of ...")."""
    q = "none" if quantization in (None, "") else str(quantization)
    ExportConfig(quantization=q)
    return None if q == "none" else q


# --------------------------------------------------------------------------------------------------------------------
# CTranslate2
# --------------------------------------------------------------------------------------------------------------------


def build_ct2_spec(src: _Source) -> Any:
    """A validated ``ctranslate2.specs.TransformerSpec`` holding the model's weights and vocabulary."""
    require_ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    cfg, where = src.model.cfg, src.checkpoint
    if why := _unsupported(cfg):
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
    config.decoder_start_token = src.pieces[_start_id(src.model)]  # tgt_in = [BOS] + tgt (or [EOS] + tgt)
    config.add_source_bos = False
    config.add_source_eos = True  # src = tokens + [EOS]
    config.layer_norm_epsilon = _layer_norm_eps(src.model, where)
    spec.register_source_vocabulary(list(src.pieces))
    spec.register_target_vocabulary(list(src.pieces))
    try:
        spec.validate()
    except ValueError as e:
        raise MtpipeError(f"{where}: CTranslate2 rejected the converted model ({str(e).splitlines()[0]})") from None
    return spec


def _fill_ct2_weights(encoder: Any, decoder: Any, src: _Source, pre_norm: bool) -> None:
    """Every parameter of the model into its CTranslate2 variable (the mapping in the module docstring)."""
    model, cfg = src.model, src.model.cfg
    d, h, dk, dv, ff = cfg.d_model, cfg.heads, cfg.d_k, cfg.d_v, cfg.d_ff
    w = _Weights(model, src.checkpoint)
    vocab, share = len(src.pieces), getattr(cfg, "share_embeddings", "all")
    embed = w.take("embed.weight", (vocab, d))  # tied matrices are taken once and written to each variable
    embed_tgt = w.take("embed_tgt.weight", (vocab, d)) if share != "all" else embed
    projection = w.take("out_proj", (vocab, d)) if share == "none" else embed_tgt
    positions = getattr(cfg, "positions", "sinusoidal")
    table = _positions(model, src.checkpoint).numpy()
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
    q = _quantization(quantization)
    ct2 = require_ctranslate2()
    src = _load_source(checkpoint, tokens)
    spec = build_ct2_spec(src)
    spec.optimize(quantization=q)  # aliases the three tied embedding copies, then quantizes
    cfg = src.model.cfg
    with writing.ArtifactWriter(out, "export", params, upstream=_upstream(src),
                                  force=force) as w:
        assert w.tmp is not None
        spec.save(str(w.tmp))
        w.path("spm.model").write_bytes(src.spm_path.read_bytes())
        w.extra.update(_extra(src, "ctranslate2", q))
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


def _extra(src: _Source, fmt: str, quantization: str | None) -> dict[str, Any]:
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
        "decode": src.ck.manifest.extra.get("decode") or {},
        "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
    }


# --------------------------------------------------------------------------------------------------------------------
# Hugging Face: Marian (post-norm) and Pegasus (pre-norm)
# --------------------------------------------------------------------------------------------------------------------

HF_CLASSES = {"marian": "MarianMTModel", "pegasus": "PegasusForConditionalGeneration"}
HF_FORMATS = ("marian", "pegasus", "huggingface")  # huggingface: marian for a post-norm model, pegasus for pre-norm


def _head_size_mismatch(cfg: Any, arch: str) -> str | None:
    if cfg.d_k * cfg.heads != cfg.d_model or cfg.d_v * cfg.heads != cfg.d_model:
        return (f"d_k={cfg.d_k}, d_v={cfg.d_v} with heads={cfg.heads}: {arch}'s attention fixes the head size to "
                f"d_model / heads = {cfg.d_model / cfg.heads:g}")
    return None


def marian_mismatch(cfg: Any) -> str | None:
    """Why a model config does not map exactly onto ``MarianMTModel`` (None when it does)."""
    if why := _unsupported(cfg):
        return why
    if getattr(cfg, "norm_position", "post") != "post":
        return ("model.norm_position=pre: MarianMTModel is post-norm only; export.format=pegasus (or huggingface) "
                "writes this model as a PegasusForConditionalGeneration")
    if (positions := getattr(cfg, "positions", "sinusoidal")) != "sinusoidal":
        return f"model.positions={positions}: MarianMTModel rebuilds sinusoidal positions on load"
    if why := _head_size_mismatch(cfg, "Marian"):
        return why
    if cfg.d_model % 2:
        return f"d_model={cfg.d_model} is odd: Marian puts one more sine than cosine column, mtpipe one less"
    return None


def pegasus_mismatch(cfg: Any) -> str | None:
    """Why a model config does not map exactly onto ``PegasusForConditionalGeneration`` (None when it does). Its
    position tables are saved with the weights and loaded as saved, so learned and odd-sized tables map too."""
    if why := _unsupported(cfg):
        return why
    if getattr(cfg, "norm_position", "post") != "pre":
        return ("model.norm_position=post: PegasusForConditionalGeneration is pre-norm only; export.format=marian "
                "(or huggingface) writes this model as a MarianMTModel")
    return _head_size_mismatch(cfg, "Pegasus")


def hf_architecture(cfg: Any) -> str:
    """The architecture ``export.format=huggingface`` writes: ``marian`` for a post-norm model, ``pegasus`` for a
    pre-norm one."""
    return "pegasus" if getattr(cfg, "norm_position", "post") == "pre" else "marian"


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise MtpipeError(f"transformers is not installed: {INSTALL_HF}") from None
    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" bars; mtpipe prints its own summary
    return transformers


def export_huggingface(checkpoint: Path, tokens: Path | None, out: Path, arch: str = "huggingface",
                       params: dict[str, Any] | None = None, *, force: bool = False) -> dict[str, Any]:
    """Export to a Hugging Face model directory (``save_pretrained`` files with the generation config, the
    SentencePiece model as ``spm.model``/``source.spm``/``target.spm`` and ``vocab.json`` + ``tokenizer_config.json``
    for ``MarianTokenizer``), atomically. ``arch``: ``marian`` (``MarianMTModel``, post-norm), ``pegasus``
    (``PegasusForConditionalGeneration``, pre-norm) or ``huggingface`` (whichever of the two the model is)."""
    if arch not in HF_FORMATS:
        raise MtpipeError(f"unknown Hugging Face architecture {arch!r}: one of {', '.join(HF_FORMATS)}")
    transformers = _require_transformers()
    src = _load_source(checkpoint, tokens)
    arch = hf_architecture(src.model.cfg) if arch == "huggingface" else arch
    hf = _hf_model(src, arch)
    with writing.ArtifactWriter(out, "export", params, upstream=_upstream(src),
                                  force=force) as w:
        assert w.tmp is not None
        hf.save_pretrained(str(w.tmp), safe_serialization=True)
        if arch == "pegasus":
            _check_saved_positions(w.tmp, hf, src)
        _write_hf_tokenizer(w, src)
        w.extra.update(_extra(src, arch, None))
        w.extra["transformers_version"] = transformers.__version__
        w.extra["model_class"] = HF_CLASSES[arch]
        w.extra["tokenizer_class"] = "MarianTokenizer"
    from mtpipe import console

    console.info(f"export: {checkpoint} -> {out} (Hugging Face {HF_CLASSES[arch]}, transformers "
                 f"{transformers.__version__}; AutoTokenizer loads MarianTokenizer: spm.model + </s>)")
    return artifacts.read_manifest(out, "export").extra


def export_marian(checkpoint: Path, tokens: Path | None, out: Path, params: dict[str, Any] | None = None, *,
                  force: bool = False) -> dict[str, Any]:
    """Export a post-norm model to a Hugging Face ``MarianMTModel`` directory (:func:`export_huggingface`)."""
    return export_huggingface(checkpoint, tokens, out, "marian", params, force=force)


def export_pegasus(checkpoint: Path, tokens: Path | None, out: Path, params: dict[str, Any] | None = None, *,
                   force: bool = False) -> dict[str, Any]:
    """Export a pre-norm model to a Hugging Face ``PegasusForConditionalGeneration`` directory
    (:func:`export_huggingface`)."""
    return export_huggingface(checkpoint, tokens, out, "pegasus", params, force=force)


def _write_hf_tokenizer(w: Any, src: _Source) -> None:
    """The tokenizer files of a Hugging Face export: the SentencePiece model three times (mtpipe's ``spm.model``,
    ``MarianTokenizer``'s ``source.spm``/``target.spm``), ``vocab.json`` (piece -> id, the model's ids) and a
    ``tokenizer_config.json`` naming ``MarianTokenizer``, which encodes with the SentencePiece model itself and appends
    ``</s>``, as mtpipe's batches do. ``PegasusTokenizer`` does not fit: it shifts the ids by 103 reserved tokens."""
    spm_bytes = src.spm_path.read_bytes()
    for name in ("spm.model", "source.spm", "target.spm"):
        w.path(name).write_bytes(spm_bytes)
    w.path("vocab.json").write_text(json.dumps({p: i for i, p in enumerate(src.pieces)}, ensure_ascii=False),
                                    encoding="utf-8")
    w.path("tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "MarianTokenizer", "unk_token": src.pieces[UNK_ID], "eos_token": src.pieces[EOS_ID],
        "pad_token": src.pieces[PAD_ID], "model_max_length": src.model.cfg.max_positions,
        "separate_vocabs": False, "additional_special_tokens": [],
    }, indent=2), encoding="utf-8")


def _check_saved_positions(directory: Path, hf: Any, src: _Source) -> None:
    """Pegasus saves its position tables with the weights and loads them as saved (transformers 5.24: no
    ``_keys_to_ignore_on_save``; loaded tensors are marked initialised, so ``_init_weights`` leaves them alone): the
    written files must hold the model's own tables, or a learned or odd-sized table would come back as sinusoids."""
    import torch
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    files = (json.loads(index.read_text(encoding="utf-8"))["weight_map"] if index.is_file() else None)
    for stack in ("encoder", "decoder"):
        key = f"model.{stack}.embed_positions.weight"
        path = directory / (files.get(key, "") if files is not None else "model.safetensors")
        saved = None
        if path.is_file():
            with safe_open(str(path), framework="pt") as f:
                saved = f.get_tensor(key) if key in f.keys() else None
        want = hf.state_dict()[key]
        if saved is None or not torch.equal(saved, want):
            raise MtpipeError(f"{src.checkpoint}: does not map exactly onto Hugging Face Pegasus: this transformers "
                              f"does not save the {stack}'s position table with the weights")


def _hf_model(src: _Source, arch: str) -> Any:
    """The model as a ``MarianMTModel`` or ``PegasusForConditionalGeneration`` (eval mode) with its generation config,
    or one line naming what does not map exactly."""
    import torch
    import transformers
    from transformers import GenerationConfig

    model, cfg, where = src.model, src.model.cfg, src.checkpoint
    name, cls = f"Hugging Face {arch.capitalize()}", HF_CLASSES[arch]
    if why := {"marian": marian_mismatch, "pegasus": pegasus_mismatch}[arch](cfg):
        raise MtpipeError(f"{where}: does not map exactly onto {name}: {why}")
    eps = _layer_norm_eps(model, where)
    if eps != 1e-5:
        raise MtpipeError(f"{where}: does not map exactly onto {name}: LayerNorm epsilon {eps:g} ({cls} uses 1e-5)")
    d, ff, vocab = cfg.d_model, cfg.d_ff, len(src.pieces)
    share, start = getattr(cfg, "share_embeddings", "all"), _start_id(model)
    common = dict(
        vocab_size=vocab, d_model=d, encoder_layers=cfg.encoder_layers, decoder_layers=cfg.decoder_layers,
        encoder_attention_heads=cfg.heads, decoder_attention_heads=cfg.heads, encoder_ffn_dim=ff, decoder_ffn_dim=ff,
        activation_function="relu", max_position_embeddings=cfg.max_positions, scale_embedding=True,
        dropout=cfg.dropout, attention_dropout=cfg.attention_dropout, activation_dropout=cfg.relu_dropout,
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID, decoder_start_token_id=start,
        forced_eos_token_id=EOS_ID,
    )
    if arch == "marian":
        hf = transformers.MarianMTModel(transformers.MarianConfig(
            **common, decoder_vocab_size=vocab, share_encoder_decoder_embeddings=share == "all",
            tie_word_embeddings=share != "none")).eval()
    else:
        # Pegasus has no share_encoder_decoder_embeddings: tie_word_embeddings ties (or unties) all three matrices.
        hf = transformers.PegasusForConditionalGeneration(transformers.PegasusConfig(
            **common, tie_word_embeddings=share == "all")).eval()
        m = hf.model
        if share != "all" and (m.encoder.embed_tokens.weight is m.decoder.embed_tokens.weight
                               or m.decoder.embed_tokens.weight is hf.lm_head.weight):
            raise MtpipeError(f"{where}: does not map exactly onto {name}: model.share_embeddings={share}: "
                              f"transformers {transformers.__version__}'s {cls} ties the embeddings it should keep "
                              "apart (transformers 5 unties them with tie_word_embeddings=false)")
    sd = _hf_state_dict(src, arch)
    if arch == "marian":
        for key in ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"):
            # Marian rebuilds this table on load (it is not saved): it must be ours, up to float rounding.
            pos = hf.state_dict()[key]
            if pos.shape != sd[key].shape or not torch.allclose(pos, sd[key], atol=1e-5):
                raise MtpipeError(f"{where}: does not map exactly onto {name}: its sinusoid table differs")
    want = set(hf.state_dict())
    if set(sd) != want:
        extra, missing = sorted(set(sd) - want)[:3], sorted(want - set(sd))[:3]
        raise MtpipeError(f"{where}: the {arch} mapping does not cover transformers {transformers.__version__}'s "
                          f"{cls} (unexpected {extra}, missing {missing})")
    hf.load_state_dict({k: v.contiguous().clone() for k, v in sd.items()}, strict=True)
    hf.generation_config = GenerationConfig(decoder_start_token_id=start, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                            pad_token_id=PAD_ID, forced_eos_token_id=EOS_ID,
                                            bad_words_ids=[[PAD_ID], [BOS_ID]], max_length=cfg.max_positions,
                                            num_beams=4)
    return hf


def _hf_state_dict(src: _Source, arch: str) -> dict[str, Any]:
    """The model's parameters under ``MarianMTModel``'s / ``PegasusForConditionalGeneration``'s names (the same
    BART-style layers; Pegasus adds each stack's final ``layer_norm``)."""
    import torch

    model, cfg = src.model, src.model.cfg
    d, ff, vocab = cfg.d_model, cfg.d_ff, len(src.pieces)
    w = _Weights(model, src.checkpoint)
    hk = cfg.heads * cfg.d_k
    sd: dict[str, Any] = {}
    share = getattr(cfg, "share_embeddings", "all")

    def t(name: str, shape: tuple[int, ...]) -> Any:
        return torch.from_numpy(w.take(name, shape))

    embed = t("embed.weight", (vocab, d))
    if share == "all" or arch == "pegasus":  # Pegasus keeps `shared` untied too: its input embeddings, the source's
        sd["model.shared.weight"] = embed
    embed_tgt = t("embed_tgt.weight", (vocab, d)) if share != "all" else embed
    sd["model.encoder.embed_tokens.weight"], sd["model.decoder.embed_tokens.weight"] = embed, embed_tgt
    sd["lm_head.weight"] = t("out_proj", (vocab, d)) if share == "none" else embed_tgt
    sd["final_logits_bias"] = (t("out_bias", (vocab,))[None] if getattr(cfg, "output_bias", False)
                               else torch.zeros(1, vocab))
    positions = getattr(cfg, "positions", "sinusoidal")
    table = _positions(model, src.checkpoint)
    if positions != "sinusoidal":
        w.take("positions", (cfg.max_positions, d))  # the table above
    sd["model.encoder.embed_positions.weight"] = table
    sd["model.decoder.embed_positions.weight"] = (t("tgt_positions", (cfg.max_positions, d))
                                                  if positions == "learned-per-stack" else table)

    def lin(dst: str, name: str, o: int, i: int) -> None:
        sd[f"{dst}.weight"], sd[f"{dst}.bias"] = t(f"{name}.weight", (o, i)), t(f"{name}.bias", (o,))

    def ln(dst: str, name: str) -> None:
        sd[f"{dst}.weight"], sd[f"{dst}.bias"] = t(f"{name}.weight", (d,)), t(f"{name}.bias", (d,))

    def split(dst: str, names: tuple[str, ...], src_name: str) -> None:
        wt, b = t(f"{src_name}.weight", (len(names) * hk, d)), t(f"{src_name}.bias", (len(names) * hk,))
        for j, n in enumerate(names):
            sd[f"{dst}.{n}.weight"], sd[f"{dst}.{n}.bias"] = wt[j * hk:(j + 1) * hk], b[j * hk:(j + 1) * hk]

    for side, n_layers in (("encoder", cfg.encoder_layers), ("decoder", cfg.decoder_layers)):
        for i in range(n_layers):
            p, q = f"{side}.{i}", f"model.{side}.layers.{i}"
            split(f"{q}.self_attn", ("q_proj", "k_proj", "v_proj"), f"{p}.self_attn.qkv")
            lin(f"{q}.self_attn.out_proj", f"{p}.self_attn.out", d, d)
            ln(f"{q}.self_attn_layer_norm", f"{p}.norm1")
            if side == "decoder":
                lin(f"{q}.encoder_attn.q_proj", f"{p}.cross_attn.q", d, d)
                split(f"{q}.encoder_attn", ("k_proj", "v_proj"), f"{p}.cross_attn.kv")
                lin(f"{q}.encoder_attn.out_proj", f"{p}.cross_attn.out", d, d)
                ln(f"{q}.encoder_attn_layer_norm", f"{p}.norm2")
            lin(f"{q}.fc1", f"{p}.ffn.w1", ff, d)
            lin(f"{q}.fc2", f"{p}.ffn.w2", d, ff)
            ln(f"{q}.final_layer_norm", f"{p}.norm3" if side == "decoder" else f"{p}.norm2")
    if arch == "pegasus":  # pre-norm: the final norm of each stack
        ln("model.encoder.layer_norm", "encoder_norm")
        ln("model.decoder.layer_norm", "decoder_norm")
    w.done()
    return sd


# --------------------------------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------------------------------


def export_model(cfg: Any, checkpoint: Path, tokens: Path | None, out: Path, *,
                 force: bool = False) -> dict[str, Any]:
    """``mtpipe export``: ``cfg`` is an :class:`mtpipe.config.ExportConfig`."""
    from mtpipe.config import to_dict

    # export.format and export.quantization are checked against their choices when the section is built (config).
    params = {"export": to_dict(cfg)}
    writing.prepare_output(out, "export", inputs=[checkpoint, tokens], force=force)
    if cfg.format in HF_FORMATS:
        if cfg.quantization != "none":
            raise MtpipeError(f"export.quantization: {cfg.quantization!r} applies to CTranslate2 only; use 'none' "
                              f"with format {cfg.format}")
        return export_huggingface(checkpoint, tokens, out, cfg.format, params=params, force=force)
    return export_ctranslate2(checkpoint, tokens, out, cfg.quantization, params=params, force=force)


__all__ = ["build_ct2_spec", "export_ctranslate2", "export_huggingface", "export_marian", "export_model",
           "export_pegasus", "hf_architecture", "marian_mismatch", "pegasus_mismatch", "require_ctranslate2"]
