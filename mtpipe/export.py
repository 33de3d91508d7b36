"""``mtpipe export``: a checkpoint as a CTranslate2 model (and, when the shapes allow it, a Hugging Face Marian model).

CTranslate2 (``pip install 'mtpipe[ctranslate2]'``) serves this architecture natively: its ``TransformerSpec`` is the
post-norm Transformer of the paper (section 3) with ReLU feed-forward layers, scaled embeddings and an explicit
position table. :func:`export_ctranslate2` fills that spec through CTranslate2's own Python API
(``ctranslate2.specs``), the way its fairseq/OpenNMT converters do, from the checkpoint's *parameter names*: every
``state_dict`` entry must be consumed by exactly one spec variable, so a renamed, added or reshaped parameter in
:mod:`mtpipe.model` fails the export with its name instead of producing a silently wrong model.

The mapping (paper section -> CTranslate2 variable):

* 3.4 ``embed.weight`` -> ``encoder/embeddings_0``, ``decoder/embeddings`` and ``decoder/projection`` (three-way
  tying; CTranslate2 stores the array once and aliases the rest); the sqrt(d_model) factor is ``scale_embeddings``.
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
* Variants: learned positions are written as the position table like the sinusoids; LayerDrop changes nothing at
  inference (a pruned checkpoint is just a shallower model). ScaleNorm and FixNorm have no CTranslate2 (nor Marian)
  counterpart: their export fails with one line naming the param.
* 3.3 ``ffn.w1``/``ffn.w2`` -> ``ffn/linear_0``/``linear_1`` with ReLU.
* Tokens: the vocabulary is the SentencePiece model's pieces in id order (``<pad>`` 0, ``<unk>`` 1, ``<s>`` 2,
  ``</s>`` 3); the decoder starts from ``<s>`` (BOS) and stops at ``</s>``; ``add_source_eos`` appends ``</s>`` to
  every source, as mtpipe's batches do.

The output directory is an mtpipe artifact (kind ``export``): CTranslate2's ``model.bin``, ``config.json`` and
``shared_vocabulary.json``, the ``spm.model`` beside them, and a ``manifest.json`` whose ``upstream`` holds the
hashes of the checkpoint and tokens manifests; it is written to a temporary directory and renamed into place.

:func:`ct2_translate` decodes through ``ctranslate2.Translator`` with mtpipe's decode settings; its docstring states
exactly where CTranslate2's search and length penalty differ from :func:`mtpipe.decode.beam_search`.

Hugging Face Marian (:func:`export_marian`): ``MarianMTModel`` is the same post-norm Transformer (no
``layernorm_embedding``, no final encoder/decoder norm, positions from 0 with sines in the first half and the paper's
frequencies, ``scale_embedding``, ReLU, LayerNorm epsilon 1e-5, a zero ``final_logits_bias``, tied embeddings, and a
configurable ``decoder_start_token_id`` = our BOS). It maps exactly when d_k = d_v = d_model / h (Marian's attention
has no other head size) and d_model is even; otherwise the export fails naming the part that does not map.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from mtpipe import artifacts
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from mtpipe.errors import MtpipeError

FORMATS = ("ctranslate2", "marian")
# CTranslate2's weight types (ctranslate2.specs.model_spec.ACCEPTED_MODEL_TYPES), plus "none" = keep float32.
QUANTIZATIONS = ("none", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16",
                 "float32")
PENALTIES = ("gnmt", "fairseq")
SPECIAL_PIECES = {PAD_ID: "<pad>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}
INSTALL_CT2 = "pip install 'mtpipe[ctranslate2]'"
INSTALL_HF = "pip install 'mtpipe[marian]'"


# --------------------------------------------------------------------------------------------------------------------
# Shared input checks
# --------------------------------------------------------------------------------------------------------------------


def _require_ctranslate2() -> Any:
    try:
        import ctranslate2
    except ImportError:
        raise MtpipeError(f"ctranslate2 is not installed: {INSTALL_CT2}") from None
    return ctranslate2


def _bare_sha(value: Any) -> str:
    text = str(value).strip().lower()
    return text.split(":", 1)[1] if text.startswith("sha256:") else text


@dataclass
class _Source:
    """A checkpoint rebuilt as a model, with the SentencePiece model it was trained with."""

    checkpoint: Path
    tokens: Path
    ck: Any  # artifacts.Checkpoint
    model: Any  # mtpipe.model.Transformer (eval mode)
    spm_path: Path
    pieces: list[str]


def _load_source(checkpoint: Path, tokens: Path) -> _Source:
    """Load and cross-check the checkpoint and the tokens artifact; every failure is one MtpipeError line."""
    import sentencepiece as spm

    from mtpipe.model import build_model

    checkpoint, tokens = Path(checkpoint), Path(tokens)
    ck = artifacts.load_checkpoint(checkpoint)  # refuses anything that is not an mtpipe checkpoint artifact
    tm = artifacts.read_manifest(tokens, "tokens")
    spm_path = artifacts.verify_file(tokens, "spm.model", tm)
    want = _bare_sha(tm.extra.get("spm_sha256") or tm.files.get("spm.model", ""))
    got = _bare_sha(ck.vocab.get("spm_sha256"))
    if got != want:
        raise MtpipeError(f"{checkpoint}: trained with another SentencePiece model than {spm_path} "
                          f"(checkpoint vocab sha256 {got[:12]}..., tokens spm_sha256 {want[:12]}...)")
    sp = spm.SentencePieceProcessor(model_file=str(spm_path))
    size = sp.get_piece_size()
    if int(ck.vocab.get("size", -1)) != size:
        raise MtpipeError(f"{checkpoint}: vocabulary size {ck.vocab.get('size')} does not match {spm_path} "
                          f"({size} pieces)")
    pieces = [sp.id_to_piece(i) for i in range(size)]
    for i, name in SPECIAL_PIECES.items():
        if i >= size or pieces[i] != name:
            raise MtpipeError(f"{spm_path}: id {i} is {pieces[i] if i < size else 'missing'!r}, expected {name!r} "
                              "(mtpipe's special ids: <pad>=0 <unk>=1 <s>=2 </s>=3)")
    if len(set(pieces)) != size:
        raise MtpipeError(f"{spm_path}: duplicate pieces; a token vocabulary needs one id per piece")
    try:
        model = build_model(ck.model_config, size)
        model.load_state_dict(ck.state_dict)
    except (TypeError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MtpipeError(f"{checkpoint}: weights do not fit the checkpoint's model config ({first})") from None
    return _Source(checkpoint, tokens, ck, model.eval(), spm_path, pieces)


class _Weights:
    """The checkpoint's parameters by name; each must be taken exactly once (so a model change breaks loudly)."""

    def __init__(self, model: Any, where: Path):
        self.where = where
        self.left = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}

    def take(self, name: str, shape: tuple[int, ...]) -> Any:
        if name not in self.left:
            raise MtpipeError(f"{self.where}: the model has no parameter '{name}' that the export maps (mtpipe.model "
                              "changed; update mtpipe/export.py)")
        t = self.left.pop(name)
        if tuple(t.shape) != shape:
            raise MtpipeError(f"{self.where}: parameter '{name}' has shape {tuple(t.shape)}, the export expects "
                              f"{shape} (mtpipe.model changed; update mtpipe/export.py)")
        return t.numpy()

    def done(self) -> None:
        if self.left:
            names = ", ".join(sorted(self.left)[:5])
            raise MtpipeError(f"{self.where}: {len(self.left)} parameter(s) the export does not map ({names}); "
                              "mtpipe.model changed: update mtpipe/export.py")


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
    return None


def _positions(model: Any, where: Path) -> Any:
    """The position table the model adds (``[max_positions, d_model]``: the sinusoids, or the learned table),
    read from the model itself."""
    tensors = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    if "positions" not in tensors:
        raise MtpipeError(f"{where}: the model has no 'positions' table (mtpipe.model changed; update "
                          "mtpipe/export.py)")
    table = tensors["positions"].detach().float().cpu().contiguous()
    cfg = model.cfg
    if tuple(table.shape) != (cfg.max_positions, cfg.d_model):
        raise MtpipeError(f"{where}: positions table {tuple(table.shape)} is not [max_positions, d_model]")
    return table


def _check_quantization(quantization: str | None) -> str | None:
    q = "none" if quantization in (None, "") else str(quantization)
    if q not in QUANTIZATIONS:
        raise MtpipeError(f"export.quantization: unknown type {q!r} (choose from {', '.join(QUANTIZATIONS)})")
    return None if q == "none" else q


# --------------------------------------------------------------------------------------------------------------------
# CTranslate2
# --------------------------------------------------------------------------------------------------------------------


def build_ct2_spec(src: _Source) -> Any:
    """A validated ``ctranslate2.specs.TransformerSpec`` holding the model's weights and vocabulary."""
    _require_ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    model, cfg, where = src.model, src.model.cfg, src.checkpoint
    d, h, dk, dv, ff = cfg.d_model, cfg.heads, cfg.d_k, cfg.d_v, cfg.d_ff
    vocab = len(src.pieces)
    if why := _unsupported(cfg):
        raise MtpipeError(f"{where}: cannot be exported to CTranslate2: {why}")
    pre_norm = getattr(cfg, "norm_position", "post") == "pre"
    if dk != dv:
        raise MtpipeError(f"{where}: d_k={dk} != d_v={dv}; CTranslate2 attention has one head size")
    # head_dim only when it is not CTranslate2's default d_model / heads.
    head_dim = None if dk * h == d else dk
    relu = common_spec.Activation.RELU
    encoder = transformer_spec.TransformerEncoderSpec(cfg.encoder_layers, h, pre_norm=pre_norm, activation=relu,
                                                      head_dim=head_dim)
    decoder = transformer_spec.TransformerDecoderSpec(cfg.decoder_layers, h, pre_norm=pre_norm, activation=relu,
                                                      head_dim=head_dim)
    spec = transformer_spec.TransformerSpec(encoder, decoder)

    w = _Weights(model, where)
    embed = w.take("embed.weight", (vocab, d))
    table = _positions(model, where).numpy()
    if getattr(cfg, "positions", "sinusoidal") == "learned":
        w.take("positions", (cfg.max_positions, d))  # the table above
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

    for stack in (encoder, decoder):
        stack.scale_embeddings = scale
        stack.position_encodings.encodings = table
    encoder.embeddings[0].weight = embed
    decoder.embeddings.weight = embed
    decoder.projection.weight = embed  # 3.4: the pre-softmax projection is the embedding matrix (no bias)

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

    config = spec.config
    config.unk_token = src.pieces[UNK_ID]
    config.bos_token = src.pieces[BOS_ID]
    config.eos_token = src.pieces[EOS_ID]
    config.decoder_start_token = src.pieces[BOS_ID]  # tgt_in = [BOS] + tgt
    config.add_source_bos = False
    config.add_source_eos = True  # src = tokens + [EOS]
    config.layer_norm_epsilon = _layer_norm_eps(model, where)
    spec.register_source_vocabulary(list(src.pieces))
    spec.register_target_vocabulary(list(src.pieces))
    try:
        spec.validate()
    except ValueError as e:
        raise MtpipeError(f"{where}: CTranslate2 rejected the converted model ({str(e).splitlines()[0]})") from None
    return spec


def export_ctranslate2(checkpoint: Path, tokens: Path, out: Path, quantization: str | None = None,
                       params: dict[str, Any] | None = None, summary: bool = True, *,
                       force: bool = False) -> dict[str, Any]:
    """Export ``checkpoint`` (trained or averaged) with the SentencePiece model of ``tokens`` to a CTranslate2 model
    directory ``out`` (atomically). ``quantization``: None/"none" keeps float32 weights, else a CTranslate2 weight
    type (int8, int8_float32, int16, float16, ...). ``summary``: print the summary table. Returns the manifest's
    ``extra``."""
    q = _check_quantization(quantization)
    ct2 = _require_ctranslate2()
    src = _load_source(checkpoint, tokens)
    spec = build_ct2_spec(src)
    spec.optimize(quantization=q)  # aliases the three tied embedding copies, then quantizes
    cfg = src.model.cfg
    with artifacts.ArtifactWriter(out, "export", params, upstream={"checkpoint": checkpoint, "tokens": tokens},
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
        "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
    }


# --------------------------------------------------------------------------------------------------------------------
# Decoding through CTranslate2
# --------------------------------------------------------------------------------------------------------------------


class Ct2Hypothesis(NamedTuple):
    """A finished translation: SentencePiece ``pieces`` and their ``ids`` (no EOS), and mtpipe's score
    ``log P(Y + EOS | X) / lp(|Y| + 1)``."""

    pieces: list[str]
    ids: list[int]
    score: float


@dataclass
class Ct2Model:
    """A loaded exported model: the ``ctranslate2.Translator`` and what decoding needs from the manifest."""

    path: Path
    translator: Any
    pieces: list[str]  # the vocabulary, id order
    ids: dict[str, int]
    max_positions: int
    vocab: dict[str, Any]  # the checkpoint's {"spm_sha256", "size"}: check it against a tokens artifact


def load_ct2(model_dir: Path, *, device: str = "cpu", compute_type: str = "default", threads: int = 0) -> Ct2Model:
    """Open an exported model directory (``threads``: CTranslate2 intra-op threads, 0 = its default)."""
    ct2 = _require_ctranslate2()
    model_dir = Path(model_dir)
    m = artifacts.read_manifest(model_dir, "export")
    if m.extra.get("format") != "ctranslate2":
        raise MtpipeError(f"{model_dir}: is a '{m.extra.get('format')}' export, not a CTranslate2 model")
    vocab_path = model_dir / m.extra.get("vocabulary", "shared_vocabulary.json")
    try:
        pieces = json.loads(vocab_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise MtpipeError(f"{vocab_path}: unreadable CTranslate2 vocabulary ({e})") from None
    if threads < 0:
        raise MtpipeError(f"threads: {threads} is not >= 0")
    try:
        translator = ct2.Translator(str(model_dir), device=device, compute_type=compute_type, intra_threads=threads)
    except (RuntimeError, ValueError) as e:
        raise MtpipeError(f"{model_dir}: CTranslate2 cannot load it ({str(e).splitlines()[0]})") from None
    return Ct2Model(model_dir, translator, pieces, {p: i for i, p in enumerate(pieces)},
                    int(m.extra["max_positions"]), dict(m.extra.get("vocab", {})))


def _lp(kind: str, alpha: float, length: int) -> float:
    """mtpipe's length penalties (:class:`mtpipe.decode.LengthPenalty`), ``length`` counting EOS."""
    return ((5.0 + length) / 6.0) ** alpha if kind == "gnmt" else float(length) ** alpha


def ct2_translate(model: Ct2Model | Path, sources: Sequence[Sequence[str | int]], *, beam: int = 4,
                  alpha: float = 0.6, length_penalty: str = "gnmt", max_len_a: float = 1.0, max_len_b: int = 50,
                  nbest: int = 1, patience: float = 1.0, max_tokens: int = 8000,
                  threads: int = 0) -> list[list[Ct2Hypothesis]]:
    """Translate sources (SentencePiece pieces or ids, no EOS, any order) with CTranslate2's beam search.

    Returns each source's ``nbest`` hypotheses, best first, in input order, scored with mtpipe's formula
    ``log P(Y + EOS | X) / lp(|Y| + 1)``, ``gnmt`` lp(n) = ((5 + n) / 6)^alpha or ``fairseq`` lp(n) = n^alpha.

    How mtpipe's decode settings are honoured, and what differs (CTranslate2 4.x, ``src/decoding.cc``):

    * **Length penalty.** CTranslate2 has one formula: a finished hypothesis scores ``log P / n^length_penalty``
      (``log P`` including its EOS) where n counts the hypothesis' tokens *and* its EOS (checked on CTranslate2
      4.8.5: the score is the same with or without ``return_end_token``; this function sets it to see the EOS), so
      ``length_penalty = alpha`` is exactly mtpipe's ``fairseq`` penalty |Y|^alpha with |Y| counting EOS.
      mtpipe's default ``gnmt`` ((5 + |Y|) / 6)^alpha has no CTranslate2 equivalent; for it every finished
      hypothesis CTranslate2 returns (``beam`` of them) is re-scored with GNMT (log P = score * n^alpha) and
      re-ranked. The penalty only ranks *finished* hypotheses in both decoders, so the ranking is exact; what
      differs is the search below.
    * **Search.** CTranslate2 keeps ``beam`` live hypotheses, refilling from the top 2*beam candidates when some of
      the top ``beam`` end in EOS, and stops a sentence once ``round(beam * patience)`` hypotheses have finished
      (fairseq's rule; with alpha = 0, as soon as the best-scoring candidate is EOS). mtpipe lets finished
      hypotheses leave the beam and stops only when no live hypothesis can still beat the n-best finished score
      (tensor2tensor's bound). Greedy search (beam 1) is the same algorithm. At beam > 1, with ``patience`` 1 (the
      CTranslate2 and fairseq default), short low-probability hypotheses that end early can fill the quota before
      the best one finishes -- on very peaked models (e.g. a model that memorised its data) CTranslate2 then returns
      a worse translation than mtpipe; ``patience`` 2 waits for twice as many and closes that gap.
    * **Scores.** CTranslate2 masks PAD and BOS *before* its log-softmax, mtpipe *after* (so CTranslate2's token
      log-probabilities are renormalised over the other tokens): per token the two differ by
      ``-log(1 - P(PAD) - P(BOS))``, about 1e-5 for a trained model (PAD and BOS are never training targets). The
      rankings of tokens are the same.
    * **Max length.** mtpipe allows ``floor(max_len_a * S + max_len_b)`` tokens before EOS per sentence (S = source
      tokens without EOS, capped at max_positions - 1) and then forces EOS. CTranslate2 has one absolute
      ``max_decoding_length`` per call, so sentences are grouped by their limit L and each group decoded with
      ``max_decoding_length = L``: no output has more than L tokens, as in mtpipe. A hypothesis cut at L tokens
      without EOS is re-scored with CTranslate2's ``score_batch`` on Y + EOS (mtpipe's forced EOS), so its score is
      mtpipe's too; L = 0 gives the empty output scored log P(EOS | X). Sources longer than max_positions - 1 are
      truncated (``max_input_length``; EOS kept last), as mtpipe's decode truncates them.
    * PAD and BOS are never generated (``suppress_sequences``), as in mtpipe.
    * ``nbest`` <= ``beam``: CTranslate2 is asked for ``beam`` finished hypotheses, which are re-scored, sorted and
      cut to ``nbest``.

    ``threads`` is only used when ``model`` is a path (a loaded :class:`Ct2Model` keeps its own). ``max_tokens``
    caps the source tokens per CTranslate2 batch.
    """
    if beam < 1:
        raise MtpipeError(f"decode.beam: {beam} is not >= 1")
    if not 1 <= nbest <= beam:
        raise MtpipeError(f"decode.nbest: {nbest} is not between 1 and decode.beam ({beam})")
    if length_penalty not in PENALTIES:
        raise MtpipeError(f"decode.length_penalty: unknown penalty {length_penalty!r} "
                          f"(choose from {', '.join(PENALTIES)})")
    if not math.isfinite(alpha):
        raise MtpipeError(f"decode.alpha: {alpha} is not a finite number")
    if max_len_a < 0 or max_len_b < 0:
        raise MtpipeError(f"decode.max_len_a / max_len_b: {max_len_a} / {max_len_b} must be >= 0")
    if max_tokens < 1:
        raise MtpipeError(f"decode.max_tokens: {max_tokens} is not >= 1")
    if not (math.isfinite(patience) and patience >= 1):
        raise MtpipeError(f"patience: {patience} must be >= 1 (CTranslate2 waits for beam * patience hypotheses)")
    m = model if isinstance(model, Ct2Model) else load_ct2(Path(model), threads=threads)
    eos = m.pieces[EOS_ID]
    limit_in = m.max_positions - 1  # source tokens that fit with their EOS

    pieces: list[list[str]] = []
    for n, s in enumerate(sources):
        if any(isinstance(t, Integral) and not 0 <= t < len(m.pieces) for t in s):
            raise MtpipeError(f"source {n}: token id out of the vocabulary (0..{len(m.pieces) - 1})")
        row = [m.pieces[int(t)] if isinstance(t, Integral) else str(t) for t in s]
        pieces.append(row[:limit_in])
    limits = [max(0, min(int(math.floor(max_len_a * len(p) + max_len_b)), m.max_positions - 1)) for p in pieces]
    groups: dict[int, list[int]] = {}
    for i, lim in enumerate(limits):
        groups.setdefault(lim, []).append(i)

    results: list[list[Ct2Hypothesis]] = [[] for _ in pieces]
    raw: list[list[tuple[list[str], float | None]]] = [[] for _ in pieces]  # pieces, log P (None: rescore)
    rescore: list[tuple[int, int]] = []  # (source, index in raw[source]) of hypotheses needing log P(Y + EOS)
    common = dict(max_batch_size=max_tokens, batch_type="tokens", max_input_length=m.max_positions)
    for lim, idx in sorted(groups.items()):
        if lim == 0:
            for i in idx:  # nothing may precede EOS: the empty output
                rescore.append((i, len(raw[i])))
                raw[i].append(([], None))
            continue
        out = m.translator.translate_batch(
            [pieces[i] for i in idx], beam_size=beam, patience=patience, num_hypotheses=beam, length_penalty=alpha,
            max_decoding_length=lim, min_decoding_length=0, return_end_token=True, return_scores=True,
            suppress_sequences=[[m.pieces[PAD_ID]], [m.pieces[BOS_ID]]], **common)
        for i, r in zip(idx, out):
            for hyp, score in zip(r.hypotheses, r.scores):
                if hyp and hyp[-1] == eos:
                    # CTranslate2's score is log P / n^alpha with n = len(hyp) (EOS included).
                    raw[i].append((hyp[:-1], float(score) * float(len(hyp)) ** alpha))
                else:  # cut at the length limit: mtpipe would force EOS here
                    rescore.append((i, len(raw[i])))
                    raw[i].append((list(hyp), None))
    if rescore:
        # score_batch gives the log-probabilities of every target token and of the EOS it appends.
        scored = m.translator.score_batch([pieces[i] for i, _ in rescore], [raw[i][j][0] for i, j in rescore],
                                          **common)
        for (i, j), s in zip(rescore, scored):
            raw[i][j] = (raw[i][j][0], float(sum(s.log_probs)))
    for i, r in enumerate(raw):
        best: dict[tuple[str, ...], Ct2Hypothesis] = {}
        for hyp, lp in r:
            assert lp is not None
            h = Ct2Hypothesis(list(hyp), [m.ids.get(p, UNK_ID) for p in hyp], lp / _lp(length_penalty, alpha,
                                                                                       len(hyp) + 1))
            if tuple(hyp) not in best or h.score > best[tuple(hyp)].score:
                best[tuple(hyp)] = h
        results[i] = sorted(best.values(), key=lambda h: -h.score)[:nbest]
    return results


# CTranslate2's compute types (``ctranslate2.Translator(compute_type=...)``); "default" keeps the weights' type.
COMPUTE_TYPES = ("default", "auto", "float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16",
                 "float16", "bfloat16")
ENGINE_INPUTS = "a CTranslate2 export (`mtpipe export`) or an mtpipe checkpoint"


def decode_source(path: Path) -> artifacts.Manifest:
    """The manifest of what ``mtpipe decode --engine ctranslate2 --checkpoint PATH`` names: a CTranslate2 export
    (kind ``export``, format ``ctranslate2``) or an mtpipe checkpoint; anything else fails with one line."""
    path = Path(path)
    try:
        m = artifacts.read_manifest(path)
    except MtpipeError as e:
        raise MtpipeError(f"{e}; --engine ctranslate2 needs {ENGINE_INPUTS}") from None
    if m.kind == "export" and m.extra.get("format") != "ctranslate2":
        raise MtpipeError(f"{path}: is a '{m.extra.get('format')}' export, not a CTranslate2 model; --engine "
                          f"ctranslate2 needs {ENGINE_INPUTS}")
    if m.kind not in ("export", "checkpoint"):
        raise MtpipeError(f"{path}: is a '{m.kind}' artifact; --engine ctranslate2 needs {ENGINE_INPUTS}")
    for key in ("vocab", "checkpoint_step" if m.kind == "export" else "step"):
        if key not in m.extra:
            raise MtpipeError(f"{path}: {m.kind} manifest lacks '{key}'")
    return m


def open_for_decode(path: Path, manifest: artifacts.Manifest, tokens: Path | None, *, compute_type: str = "default",
                    threads: int = 0, device: str = "auto") -> Ct2Model:
    """A loaded CTranslate2 model for ``mtpipe decode --engine ctranslate2``: an export is opened as it is; a
    checkpoint (with the SentencePiece model of ``tokens``) is first exported with float32 weights to a temporary
    directory, which is removed once CTranslate2 has read it (the translator keeps its weights in memory), so nothing
    is left behind. ``compute_type`` may still quantise at load time (``int8``...). ``device`` "auto": the first
    GPU CTranslate2 sees, else the CPU."""
    import dataclasses
    import tempfile

    if device == "auto":
        device = "cuda" if _require_ctranslate2().get_cuda_device_count() > 0 else "cpu"
    if compute_type not in COMPUTE_TYPES:
        raise MtpipeError(f"decode.ct2_compute_type: unknown type {compute_type!r} (choose from "
                          f"{', '.join(COMPUTE_TYPES)})")
    path = Path(path)
    if manifest.kind == "export":
        return load_ct2(path, device=device, compute_type=compute_type, threads=threads)
    if tokens is None:
        raise MtpipeError(f"{path}: exporting a checkpoint to CTranslate2 needs --tokens (its bpe artifact)")
    with tempfile.TemporaryDirectory(prefix="mtpipe-ct2-") as tmp:
        export_ctranslate2(path, tokens, Path(tmp) / "model", summary=False)
        m = load_ct2(Path(tmp) / "model", device=device, compute_type=compute_type, threads=threads)
    return dataclasses.replace(m, path=path)


# --------------------------------------------------------------------------------------------------------------------
# Hugging Face Marian
# --------------------------------------------------------------------------------------------------------------------


def marian_mismatch(cfg: Any) -> str | None:
    """Why a model config does not map exactly onto ``MarianMTModel`` (None when it does)."""
    if why := _unsupported(cfg):
        return why
    if getattr(cfg, "norm_position", "post") != "post":
        return "model.norm_position=pre: MarianMTModel is post-norm only"
    if getattr(cfg, "positions", "sinusoidal") != "sinusoidal":
        return "model.positions=learned: MarianMTModel rebuilds sinusoidal positions on load"
    if cfg.d_k * cfg.heads != cfg.d_model or cfg.d_v * cfg.heads != cfg.d_model:
        return (f"d_k={cfg.d_k}, d_v={cfg.d_v} with heads={cfg.heads}: Marian's attention fixes the head size to "
                f"d_model / heads = {cfg.d_model / cfg.heads:g}")
    if cfg.d_model % 2:
        return f"d_model={cfg.d_model} is odd: Marian puts one more sine than cosine column, mtpipe one less"
    return None


def export_marian(checkpoint: Path, tokens: Path, out: Path, params: dict[str, Any] | None = None, *,
                  force: bool = False) -> dict[str, Any]:
    """Export to a Hugging Face ``MarianMTModel`` directory (``save_pretrained`` files, the SentencePiece model as
    ``source.spm``/``target.spm`` and ``vocab.json`` for ``MarianTokenizer``), atomically."""
    try:
        import transformers
        from transformers import GenerationConfig, MarianConfig, MarianMTModel
    except ImportError:
        raise MtpipeError(f"transformers is not installed: {INSTALL_HF}") from None
    import torch

    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" bars; mtpipe prints its own summary
    src = _load_source(checkpoint, tokens)
    model, cfg, where = src.model, src.model.cfg, src.checkpoint
    if why := marian_mismatch(cfg):
        raise MtpipeError(f"{where}: does not map exactly onto Hugging Face Marian: {why}")
    eps = _layer_norm_eps(model, where)
    if eps != 1e-5:
        raise MtpipeError(f"{where}: does not map exactly onto Hugging Face Marian: LayerNorm epsilon {eps:g} "
                          "(Marian uses 1e-5)")
    d, ff, vocab = cfg.d_model, cfg.d_ff, len(src.pieces)
    hf_cfg = MarianConfig(
        vocab_size=vocab, decoder_vocab_size=vocab, d_model=d, encoder_layers=cfg.encoder_layers,
        decoder_layers=cfg.decoder_layers, encoder_attention_heads=cfg.heads, decoder_attention_heads=cfg.heads,
        encoder_ffn_dim=ff, decoder_ffn_dim=ff, activation_function="relu", max_position_embeddings=cfg.max_positions,
        scale_embedding=True, dropout=cfg.dropout, attention_dropout=cfg.attention_dropout,
        activation_dropout=cfg.relu_dropout, pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID,
        decoder_start_token_id=BOS_ID, forced_eos_token_id=EOS_ID, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
    )
    hf = MarianMTModel(hf_cfg).eval()
    table = _positions(model, where)
    for pos in (hf.model.encoder.embed_positions, hf.model.decoder.embed_positions):
        # Marian rebuilds this table on load (it is not saved): it must be ours, up to float rounding.
        if pos.weight.shape != table.shape or not torch.allclose(pos.weight, table, atol=1e-5):
            raise MtpipeError(f"{where}: does not map exactly onto Hugging Face Marian: its sinusoid table differs")

    w = _Weights(model, where)
    hk = cfg.heads * cfg.d_k
    sd: dict[str, Any] = {}
    embed = torch.from_numpy(w.take("embed.weight", (vocab, d)))
    for name in ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                 "lm_head.weight"):
        sd[name] = embed
    sd["final_logits_bias"] = torch.zeros(1, vocab)  # mtpipe's output projection has no bias
    sd["model.encoder.embed_positions.weight"] = table
    sd["model.decoder.embed_positions.weight"] = table

    def t(name: str, shape: tuple[int, ...]) -> Any:
        return torch.from_numpy(w.take(name, shape))

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
    w.done()
    want = set(hf.state_dict())
    if set(sd) != want:
        extra, missing = sorted(set(sd) - want)[:3], sorted(want - set(sd))[:3]
        raise MtpipeError(f"{where}: the Marian mapping does not cover transformers {transformers.__version__}'s "
                          f"MarianMTModel (unexpected {extra}, missing {missing})")
    hf.load_state_dict({k: v.contiguous().clone() for k, v in sd.items()}, strict=True)
    hf.generation_config = GenerationConfig(decoder_start_token_id=BOS_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                            pad_token_id=PAD_ID, forced_eos_token_id=EOS_ID,
                                            bad_words_ids=[[PAD_ID], [BOS_ID]], max_length=cfg.max_positions,
                                            num_beams=4)

    with artifacts.ArtifactWriter(out, "export", params, upstream={"checkpoint": checkpoint, "tokens": tokens},
                                  force=force) as w2:
        assert w2.tmp is not None
        hf.save_pretrained(str(w2.tmp), safe_serialization=True)
        spm_bytes = src.spm_path.read_bytes()
        for name in ("spm.model", "source.spm", "target.spm"):
            w2.path(name).write_bytes(spm_bytes)
        w2.path("vocab.json").write_text(json.dumps({p: i for i, p in enumerate(src.pieces)}, ensure_ascii=False),
                                         encoding="utf-8")
        w2.path("tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "MarianTokenizer", "unk_token": src.pieces[UNK_ID], "eos_token": src.pieces[EOS_ID],
            "pad_token": src.pieces[PAD_ID], "model_max_length": cfg.max_positions, "separate_vocabs": False,
            "additional_special_tokens": [],
        }, indent=2), encoding="utf-8")
        w2.extra.update(_extra(src, "marian", None))
        w2.extra["transformers_version"] = transformers.__version__
    from mtpipe import console

    console.info(f"export: {checkpoint} -> {out} (Hugging Face MarianMTModel, transformers {transformers.__version__})")
    return artifacts.read_manifest(out, "export").extra


# --------------------------------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------------------------------


def run(cfg: Any, checkpoint: Path, tokens: Path, out: Path, *, force: bool = False) -> dict[str, Any]:
    """``mtpipe export``: ``cfg`` is an :class:`mtpipe.config.ExportConfig`."""
    from mtpipe.config import to_dict

    if cfg.format not in FORMATS:
        raise MtpipeError(f"export.format: unknown format {cfg.format!r} (choose from {', '.join(FORMATS)})")
    params = {"export": to_dict(cfg)}
    artifacts.prepare_output(out, "export", inputs=[checkpoint, tokens], force=force)
    if cfg.format == "marian":
        if _check_quantization(cfg.quantization) is not None:
            raise MtpipeError(f"export.quantization: {cfg.quantization!r} applies to CTranslate2 only; use 'none' "
                              "with format marian")
        return export_marian(checkpoint, tokens, out, params=params, force=force)
    return export_ctranslate2(checkpoint, tokens, out, cfg.quantization, params=params, force=force)


__all__ = ["Ct2Hypothesis", "Ct2Model", "build_ct2_spec", "ct2_translate", "decode_source", "export_ctranslate2",
           "export_marian", "load_ct2", "marian_mismatch", "open_for_decode", "run"]
