"""``mtpipe export``: a checkpoint as a CTranslate2 model, or as a Hugging Face model (Marian for a post-norm model,
Pegasus for a pre-norm one, when the shapes allow it).

CTranslate2 (``pip install 'mtpipe[ctranslate2]'``): the conversion, parameter by parameter (the paper's section
-> CTranslate2 variable), is :mod:`mtpipe.engine.ct2_convert`, which ``decode.engine=ctranslate2`` also uses to
convert a checkpoint on the fly; this stage writes it as an artifact (:func:`export_ctranslate2`).

Hugging Face (:func:`export_huggingface`; ``export.format`` ``marian``, ``pegasus``, or ``huggingface``: Marian for a
post-norm model, Pegasus for a pre-norm one). Both are BART-style encoder-decoders whose layers take mtpipe's
parameters the same way (:func:`_hf_state_dict`): ``qkv`` split into ``q_proj``/``k_proj``/``v_proj``, cross-attention
``q`` -> ``q_proj`` and ``kv`` -> ``k_proj``/``v_proj``, ``out`` -> ``out_proj``, ``norm1``/``norm2``/``norm3`` ->
``self_attn_layer_norm``/``encoder_attn_layer_norm``/``final_layer_norm`` (the encoder's ``norm2`` ->
``final_layer_norm``), ``ffn.w1``/``w2`` -> ``fc1``/``fc2`` with ``activation_function=relu``, ``scale_embedding``
(sqrt(d_model)), no ``layernorm_embedding``, positions from 0, LayerNorm epsilon 1e-5, ``final_logits_bias`` =
``out_bias`` or zeros, ``decoder_start_token_id`` = the model's start token. Their attention has one head size, so
d_k = d_v = d_model / h is needed.

* ``MarianMTModel`` (``export.format=marian``) is the post-norm Transformer: no final encoder/decoder norm; tied
  embeddings -- ``share_encoder_decoder_embeddings`` false for ``share_embeddings=decoder|none``,
  ``tie_word_embeddings`` false for ``none``. Marian does not save its sinusoid table (sines in the first half, the
  paper's frequencies) but rebuilds it on load, so the positions must be the sinusoids and d_model even.
* ``PegasusForConditionalGeneration`` (``export.format=pegasus``) is the pre-norm Transformer (fairseq's
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
from pathlib import Path
from typing import Any

from mtpipe import artifacts, writing
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from mtpipe.engine.ct2_convert import (
    ExportSource,
    Weights,
    export_ctranslate2,
    export_extra,
    export_upstream,
    layer_norm_eps,
    load_source,
    position_table,
    start_id,
    unsupported,
)
from mtpipe.errors import MtpipeError

INSTALL_HF = "pip install 'mtpipe[huggingface]'"


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
    if why := unsupported(cfg):
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
    if why := unsupported(cfg):
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
    src = load_source(checkpoint, tokens)
    arch = hf_architecture(src.model.cfg) if arch == "huggingface" else arch
    hf = _hf_model(src, arch)
    with writing.ArtifactWriter(out, "export", params, upstream=export_upstream(src),
                                  force=force) as w:
        assert w.tmp is not None
        hf.save_pretrained(str(w.tmp), safe_serialization=True)
        if arch == "pegasus":
            _check_saved_positions(w.tmp, hf, src)
        _write_hf_tokenizer(w, src)
        w.extra.update(export_extra(src, arch, None))
        w.extra["transformers_version"] = transformers.__version__
        w.extra["model_class"] = HF_CLASSES[arch]
        w.extra["tokenizer_class"] = "MarianTokenizer"
    from mtpipe import console

    console.info(f"export: {checkpoint} -> {out} (Hugging Face {HF_CLASSES[arch]}, transformers "
                 f"{transformers.__version__}; AutoTokenizer loads MarianTokenizer: spm.model + </s>)")
    return artifacts.read_manifest(out, "export").extra


def _write_hf_tokenizer(w: Any, src: ExportSource) -> None:
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


def _check_saved_positions(directory: Path, hf: Any, src: ExportSource) -> None:
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


def _hf_model(src: ExportSource, arch: str) -> Any:
    """The model as a ``MarianMTModel`` or ``PegasusForConditionalGeneration`` (eval mode) with its generation config,
    or one line naming what does not map exactly."""
    import torch
    import transformers
    from transformers import GenerationConfig

    model, cfg, where = src.model, src.model.cfg, src.checkpoint
    name, cls = f"Hugging Face {arch.capitalize()}", HF_CLASSES[arch]
    if why := {"marian": marian_mismatch, "pegasus": pegasus_mismatch}[arch](cfg):
        raise MtpipeError(f"{where}: does not map exactly onto {name}: {why}")
    eps = layer_norm_eps(model, where)
    if eps != 1e-5:
        raise MtpipeError(f"{where}: does not map exactly onto {name}: LayerNorm epsilon {eps:g} ({cls} uses 1e-5)")
    d, ff, vocab = cfg.d_model, cfg.d_ff, len(src.pieces)
    share, start = getattr(cfg, "share_embeddings", "all"), start_id(model)
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


def _hf_state_dict(src: ExportSource, arch: str) -> dict[str, Any]:
    """The model's parameters under ``MarianMTModel``'s / ``PegasusForConditionalGeneration``'s names (the same
    BART-style layers; Pegasus adds each stack's final ``layer_norm``)."""
    import torch

    model, cfg = src.model, src.model.cfg
    d, ff, vocab = cfg.d_model, cfg.d_ff, len(src.pieces)
    w, hk, share = Weights(model, src.checkpoint), cfg.heads * cfg.d_k, getattr(cfg, "share_embeddings", "all")
    sd: dict[str, Any] = {}

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
    table = position_table(model, src.checkpoint)
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

    # export.format and export.quantization are checked, alone and together, when the section is built (config).
    params = {"export": to_dict(cfg)}
    writing.prepare_output(out, "export", inputs=[checkpoint, tokens], force=force)
    if cfg.format in HF_FORMATS:  # export.quantization is none here (ExportConfig.check)
        return export_huggingface(checkpoint, tokens, out, cfg.format, params=params, force=force)
    return export_ctranslate2(checkpoint, tokens, out, cfg.quantization, params=params, force=force)


__all__ = ["export_huggingface", "export_model", "hf_architecture", "marian_mismatch", "pegasus_mismatch"]
