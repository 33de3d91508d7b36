"""The Transformer variants: pre-norm, ScaleNorm, FixNorm, learned positions, restricted self-attention, LayerDrop
with pruning and scheduled DropHead. Each: shapes, gradients reaching its new parameters, deterministic eval,
incremental decoding equal to the full forward pass, and its defining property; then a tiny model trained with the
variants through ``mtpipe.training.train.train_model`` resumes bitwise and decodes (pruned or not) through the CLI with
no extra flag."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_steps_match_forward, train_spm
from testkit.decoding import translate
from typer.testing import CliRunner

from mtpipe import artifacts, writing
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID
from mtpipe.cli import app
from mtpipe.config import (
    BucketConfig,
    DecodeConfig,
    ModelConfig,
    TrainConfig,
    to_dict,
    with_model_defaults,
)
from mtpipe.errors import MtpipeError
from mtpipe.model.attention import drop_heads
from mtpipe.model.layers import ScaleNorm
from mtpipe.model.transformer import Transformer, build_model
from mtpipe.engine.pruning import PrunePlan, every_other, prune, prune_plan, prune_state_dict
from mtpipe.training.update import drophead_rate

V = 50
BASE = dict(preset="tiny", encoder_layers=2, decoder_layers=2, d_model=32, d_ff=64, heads=4, max_positions=64)
VARIANTS = {
    "pre": dict(norm_position="pre"),
    "scale": dict(norm="scale"),
    "fixnorm": dict(fixnorm=True),
    "pre_scale_fixnorm": dict(norm_position="pre", norm="scale", fixnorm=True),  # "Transformers without Tears"
    "learned": dict(positions="learned"),
    "layerdrop": dict(layerdrop=0.3),
    "learned_per_stack": dict(positions="learned-per-stack"),
    "untied_decoder": dict(share_embeddings="decoder"),
    "untied_bias_eos_start": dict(share_embeddings="none", output_bias=True, decoder_start="eos"),
    "window": dict(attention_window=2),
}
# The parameters each variant adds to the paper's model (by state-dict name).
NEW_PARAMS = {
    "pre": {"encoder_norm.weight", "encoder_norm.bias", "decoder_norm.weight", "decoder_norm.bias"},
    "scale": {"encoder.0.norm1.g", "decoder.1.norm3.g"},  # a sample: every norm is a ScaleNorm
    "fixnorm": {"embed_g"},
    "pre_scale_fixnorm": {"encoder_norm.g", "decoder_norm.g", "embed_g"},
    "learned": {"positions"},
    "layerdrop": set(),
    "learned_per_stack": {"positions", "tgt_positions"},
    "untied_decoder": {"embed_tgt.weight"},
    "untied_bias_eos_start": {"embed_tgt.weight", "out_proj", "out_bias"},
    "window": set(),
}


def cfg(**kw) -> ModelConfig:
    return ModelConfig(**{**BASE, **kw})


def make(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(cfg(**kw), V)
    with torch.no_grad():  # non-trivial norm gains and biases, so no property holds by accident of the init
        for name, p in m.named_parameters():
            if name.endswith(".bias") or ("norm" in name and name.endswith(".weight")):
                p.add_(0.1 * torch.randn_like(p))
    return m


def batch(b: int = 3, s: int = 7, t: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, V, (b, s), generator=g)
    src[:, -1] = EOS_ID
    src[-1, s - 2 :] = PAD_ID  # a shorter sentence in the batch
    tgt = torch.randint(4, V, (b, t), generator=g)
    tgt[:, 0] = BOS_ID
    return src, tgt


# --------------------------------------------------------------------------------------------------------------------
# Every variant: shapes, gradients, eval determinism, incremental decoding
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_shapes_gradients_and_deterministic_eval(name: str) -> None:
    m = make(**VARIANTS[name]).train()
    state = m.state_dict()
    assert NEW_PARAMS[name] <= set(state), f"{name}: missing {NEW_PARAMS[name] - set(state)}"
    assert not NEW_PARAMS[name] & set(make().state_dict())  # the paper's model has none of them
    src, tgt = batch()
    out = m(src, tgt)
    assert out.shape == (3, 6, V) and torch.isfinite(out).all()
    out.logsumexp(-1).sum().backward()
    grads = dict(m.named_parameters())
    for p in NEW_PARAMS[name]:
        assert grads[p].grad is not None and grads[p].grad.abs().sum() > 0, f"{name}: no gradient reaches {p}"
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(src, tgt), m(src, tgt), rtol=0, atol=0)


@pytest.mark.parametrize("name", [*VARIANTS, "pruned"])
def test_incremental_decoding_equals_full_forward(name: str) -> None:
    """encode/start/step (per-layer caches, positions at offset t, final norms, FixNorm logits) give the full
    teacher-forced log-probabilities at every position, also after reordering rows with ``state.select``."""
    if name == "pruned":
        m = prune(make(layerdrop=0.5, encoder_layers=4, decoder_layers=4), PrunePlan((0, 2), (1, 3)))
    else:
        m = make(**VARIANTS[name])
    m.eval()
    src, tgt = batch()
    assert_steps_match_forward(m, src, tgt, reorder=torch.tensor([2, 0]))


# --------------------------------------------------------------------------------------------------------------------
# Pre-norm, ScaleNorm, FixNorm, learned positions
# --------------------------------------------------------------------------------------------------------------------


def test_pre_norm_differs_from_post_norm_for_the_same_weights() -> None:
    post, pre = make().eval(), make(norm_position="pre").eval()
    missing, unexpected = pre.load_state_dict(post.state_dict(), strict=False)
    assert set(missing) == NEW_PARAMS["pre"] and not unexpected  # every shared weight is post's
    src, tgt = batch()
    with torch.no_grad():
        a, b = post(src, tgt), pre(src, tgt)
    assert (a - b).abs().max() > 1e-2
    # Post-norm: the decoder output is a LayerNorm output (per-row mean = the last norm's mean bias, ...);
    # pre-norm: it is the final decoder norm's output, so changing that norm changes every logit.
    with torch.no_grad():
        pre.decoder_norm.weight.mul_(2.0)
        assert (pre(src, tgt) - b).abs().max() > 1e-2


def test_scalenorm_outputs_have_length_g() -> None:
    norm = ScaleNorm(16)
    assert norm.g.item() == pytest.approx(4.0)  # initialised to sqrt(d_model)
    with torch.no_grad():
        norm.g.fill_(2.5)
    x = torch.randn(5, 7, 16) * torch.logspace(-3, 3, 7)[None, :, None]  # lengths over six orders of magnitude
    y = norm(x)
    torch.testing.assert_close(torch.linalg.vector_norm(y, dim=-1), torch.full((5, 7), 2.5), rtol=1e-5, atol=1e-5)
    assert torch.equal(norm(torch.zeros(2, 16)), torch.zeros(2, 16))  # eps-guarded: no NaN
    assert norm(x.to(torch.bfloat16)).dtype == torch.bfloat16  # keeps the activations' dtype, like LayerNorm
    # In a pre-norm ScaleNorm model the encoder output is the final ScaleNorm's: every row has length g.
    m = make(norm_position="pre", norm="scale").eval()
    with torch.no_grad():
        m.encoder_norm.g.fill_(3.0)
        memory, _ = m.encode(batch()[0])
    torch.testing.assert_close(torch.linalg.vector_norm(memory, dim=-1), torch.full(memory.shape[:2], 3.0))


def test_fixnorm_unit_embeddings_scaled_by_g_and_the_same_rows_in_the_output_layer() -> None:
    m = make(fixnorm=True).eval()
    assert m.embed_g.item() == pytest.approx(32**0.5)
    with torch.no_grad():
        m.embed_g.fill_(1.7)
        m.embed.weight.mul_(torch.rand(V, 1) * 5)  # rows of very different lengths
        tokens = torch.tensor([[5, 9, PAD_ID]])
        e = m.embed_tokens(tokens) - m.positions[:3]  # [1, 3, D] (eval: no dropout)
    torch.testing.assert_close(torch.linalg.vector_norm(e, dim=-1), torch.tensor([[1.7, 1.7, 0.0]]))
    w = m.output_embedding()
    lengths = torch.linalg.vector_norm(w, dim=-1)
    torch.testing.assert_close(lengths[PAD_ID + 1 :], torch.ones(V - 1))
    assert lengths[PAD_ID] == 0
    h = torch.randn(4, 32)
    with torch.no_grad():
        logits = m.logits(h)  # [4, V]: h . unit-length rows (no g on the output side)
    torch.testing.assert_close(logits[:, PAD_ID + 1 :], h @ F.normalize(m.embed.weight, dim=-1)[PAD_ID + 1 :].T)
    assert torch.equal(logits[:, PAD_ID], torch.zeros(4))
    # The row lengths of E no longer matter: scaling a row leaves every output unchanged.
    src, tgt = batch()
    with torch.no_grad():
        before = m(src, tgt)
        m.embed.weight[7].mul_(9.0)
        torch.testing.assert_close(m(src, tgt), before, rtol=1e-5, atol=1e-5)
    # PAD's row gets no gradient from the output layer (nor from the inputs: padding_idx).
    m.train()
    m(src, tgt).sum().backward()
    assert m.embed.weight.grad[PAD_ID].abs().sum() == 0


def test_learned_positions_are_a_parameter_and_too_long_inputs_fail_clearly() -> None:
    m = make(positions="learned").eval()
    assert m.state_dict()["positions"].shape == (64, 32)
    assert "positions" not in make().state_dict()  # the sinusoids are rebuilt from the config, not saved
    src, tgt = batch()
    with torch.no_grad():
        before = m(src, tgt)
        m.positions[3].add_(1.0)  # a target position (< 6) and a source position
        assert (m(src, tgt) - before).abs().max() > 1e-3
    with pytest.raises(MtpipeError, match="max_positions=64"):
        m.encode(torch.full((1, 65), 5))
    from mtpipe.engine.variants import prepare

    prepared = prepare(m, "fp32", torch.device("cpu"))
    state = prepared.start(*prepared.encode(src))
    state.length = 64  # the 65th target position
    with pytest.raises(MtpipeError, match="max_positions=64"):
        prepared.step(torch.tensor([5, 5, 5]), state)


def test_untied_embeddings_each_matrix_plays_only_its_role() -> None:
    """share_embeddings=none: the source matrix feeds only the encoder, the target matrix only the decoder's
    input, ``out_proj`` only the projection; the output bias shifts logits, and a -1e9 entry takes a token out of
    the softmax (the other tokens' probabilities renormalise exactly as if it did not exist)."""
    m = make(share_embeddings="none", output_bias=True).eval()
    src, tgt = batch()
    with torch.no_grad():
        memory, _ = m.encode(src)
        base = m(src, tgt)
        m.embed_tgt.weight[5].add_(1.0)
        torch.testing.assert_close(m.encode(src)[0], memory, rtol=0, atol=0)  # the encoder does not read it
        m.embed_tgt.weight[5].sub_(1.0)
        m.out_proj[7].add_(1.0)
        torch.testing.assert_close(m.encode(src)[0], memory, rtol=0, atol=0)
        moved = m(src, tgt)
        assert (moved[..., 7] - base[..., 7]).abs().max() > 1e-3
        torch.testing.assert_close(moved[..., :7], base[..., :7], rtol=0, atol=1e-5)  # only token 7's logit moved
        m.out_proj[7].sub_(1.0)
        m.out_bias[9] = -1e9
        logp = F.log_softmax(m(src, tgt), -1)
        assert logp[..., 9].max() < -1e8
        keep = [i for i in range(V) if i != 9]
        torch.testing.assert_close(logp[..., keep], F.log_softmax(base[..., keep], -1), rtol=1e-5, atol=1e-5)
    tied = make(share_embeddings="decoder")
    assert tied.output_embedding() is tied.embed_tgt.weight and tied.out_proj is None


def test_decoder_start_eos_is_the_first_decoder_input_in_training_and_decoding() -> None:
    from mtpipe.training.batches import collate
    from mtpipe.engine.search import LengthPenalty, beam_search

    m = make(decoder_start="eos").eval()
    assert m.start_id == EOS_ID and make().start_id == BOS_ID

    class Split:  # two target sentences [5, 6] and [7]
        src, src_off = torch.tensor([4, 4, 4]).numpy(), torch.tensor([0, 2, 3]).numpy()
        tgt, tgt_off = torch.tensor([5, 6, 7]).numpy(), torch.tensor([0, 2, 3]).numpy()

    _, tgt_in, _ = collate(Split, torch.tensor([0, 1]).numpy(), m.start_id)
    assert tgt_in[:, 0].tolist() == [EOS_ID, EOS_ID] and tgt_in[0, 1:].tolist() == [5, 6]
    firsts = []

    def step(tokens, state):
        if not firsts:
            firsts.append(tokens.tolist())
        return torch.log_softmax(torch.randn(len(tokens), V), -1), state

    class State:
        def select(self, rows, beams):
            return self

    beam_search(step, State(), [3], 2, LengthPenalty("gnmt", 0.6), start_id=m.start_id)
    assert firsts == [[EOS_ID]]


def test_bad_variant_values_are_one_line_errors() -> None:
    for kw, pattern in [(dict(norm="rms"), "model.norm = 'rms' is not one of layer, scale"),
                        (dict(norm_position="sandwich"), "model.norm_position"),
                        (dict(positions="rotary"), "model.positions"),
                        (dict(share_embeddings="some"), "model.share_embeddings"),
                        (dict(decoder_start="pad"), "model.decoder_start = 'pad' is not one of bos, eos"),
                        (dict(layerdrop=1.0), "model.layerdrop = 1.0 must be >= 0 and < 1")]:
        with pytest.raises(MtpipeError, match=pattern):
            cfg(**kw).resolved()


def test_checkpoint_configs_from_before_the_variants_compare_equal() -> None:
    """A checkpoint written before these fields existed is the paper's model: resume and average accept it."""
    new = to_dict(cfg().resolved())
    old = {k: v for k, v in new.items() if k not in ("norm_position", "norm", "fixnorm", "positions", "layerdrop",
                                                         "share_embeddings", "output_bias", "decoder_start", "init")}
    assert with_model_defaults(old) == new
    assert build_model(old, V).cfg == cfg().resolved()


# --------------------------------------------------------------------------------------------------------------------
# LayerDrop and pruning
# --------------------------------------------------------------------------------------------------------------------


def test_layerdrop_0_is_the_plain_model_and_eval_never_drops() -> None:
    src, tgt = batch()
    plain, ld0 = make(dropout=0.3), make(dropout=0.3, layerdrop=0.0)
    torch.manual_seed(5)
    a = plain.train()(src, tgt)
    torch.manual_seed(5)
    b = ld0.train()(src, tgt)
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # same dropout masks: p = 0 draws nothing extra
    ld = make(dropout=0.3, layerdrop=0.5)
    ld.load_state_dict(plain.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(ld.eval()(src, tgt), plain.eval()(src, tgt), rtol=0, atol=0)


def test_layerdrop_skips_layers_in_training() -> None:
    m = make(layerdrop=0.5, encoder_layers=4, decoder_layers=4).train()
    calls = {"n": 0}
    for layer in [*m.encoder, *m.decoder]:
        layer.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    src, tgt = batch()
    runs = 40
    skipped_and_no_grad = False
    for _ in range(runs):
        before = calls["n"]
        m.zero_grad(set_to_none=True)
        m(src, tgt).sum().backward()
        ran = calls["n"] - before
        no_grad = [i for i, layer in enumerate(m.encoder) if layer.ffn.w1.weight.grad is None]
        skipped_and_no_grad |= bool(no_grad) and ran < 8
    frac = 1 - calls["n"] / (8 * runs)
    assert 0.3 < frac < 0.7, f"skipped {frac:.2f} of the layers, expected about 0.5"
    assert skipped_and_no_grad  # a skipped layer is not run at all: its parameters get no gradient
    # Same seed, same skips (the draws come from torch's generator, whose state a checkpoint saves).
    torch.manual_seed(3)
    a = m(src, tgt)
    torch.manual_seed(3)
    torch.testing.assert_close(m(src, tgt), a, rtol=0, atol=0)


def test_every_other_and_keep_lists() -> None:
    assert every_other(6, 0.5) == (0, 2, 4)  # depths 2, 4, 6 dropped
    assert every_other(6, 0.2) == (0, 1, 2, 3, 5)  # floor(1/0.2) = 5: depth 5 dropped
    assert every_other(6, 1 / 3) == (0, 1, 3, 4)
    c6 = cfg(encoder_layers=6, decoder_layers=6, layerdrop=0.2)
    assert prune_plan(c6, "every_other") == PrunePlan((0, 1, 2, 3, 5), (0, 1, 2, 3, 5))  # the model's own p
    assert prune_plan(c6, "every_other:0.5") == PrunePlan((0, 2, 4), (0, 2, 4))
    assert prune_plan(c6, "enc:4,0,2;dec:1") == PrunePlan((0, 2, 4), (1,))
    assert prune_plan(c6, "decoder:0,5") == PrunePlan(tuple(range(6)), (0, 5))
    assert prune_plan(c6, "") is None
    for spec, pattern in [("every_other:0.7", "leaves the encoder without layers"), ("enc:0,6", "layer 6"),
                          ("enc:1,1", "repeats"), ("enc:a", "indexes"), ("middle:1", "not 'every_other'"),
                          ("every_other:x", "not a number"), ("dec:", "decoder without layers")]:
        with pytest.raises(MtpipeError, match=pattern):
            prune_plan(c6, spec, where="decode.prune")
    with pytest.raises(MtpipeError, match="trained with model.layerdrop=0"):
        prune_plan(cfg(), "every_other")


def test_pruned_model_is_the_kept_layers_of_the_original() -> None:
    m = make(layerdrop=0.2, encoder_layers=4, decoder_layers=3).eval()
    plan = PrunePlan((0, 3), (1,))
    p = prune(m, plan)
    assert (p.cfg.encoder_layers, p.cfg.decoder_layers, p.cfg.layerdrop) == (2, 1, 0.2)
    assert len(m.encoder) == 4 and m.cfg.encoder_layers == 4  # the original is untouched
    assert p.state_dict().keys() == prune_state_dict(m.state_dict(), plan).keys()
    for k, v in prune_state_dict(m.state_dict(), plan).items():
        assert torch.equal(p.state_dict()[k], v)
    assert "encoder.1.ffn.w1.weight" in p.state_dict() and "encoder.2.ffn.w1.weight" not in p.state_dict()
    torch.testing.assert_close(p.state_dict()["encoder.1.ffn.w1.weight"], m.state_dict()["encoder.3.ffn.w1.weight"])
    # A checkpoint of the pruned model rebuilds from its config alone.
    rebuilt = build_model(to_dict(p.cfg), V).eval()
    rebuilt.load_state_dict(p.state_dict())
    src, tgt = batch()
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(src, tgt), p(src, tgt), rtol=0, atol=0)
        # = running the original with only those layers
        m.encoder, m.decoder = torch.nn.ModuleList([m.encoder[0], m.encoder[3]]), torch.nn.ModuleList([m.decoder[1]])
        torch.testing.assert_close(m(src, tgt), p(src, tgt), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------------------------
# DropHead
# --------------------------------------------------------------------------------------------------------------------


def test_drophead_schedule_is_v_shaped() -> None:
    w, total = 100, 1000
    assert drophead_rate(0, w, total, 0.2) == 0.2  # p_start
    assert drophead_rate(50, w, total, 0.2) == pytest.approx(0.1)  # linear fall
    assert drophead_rate(w, w, total, 0.2) == 0.0  # 0 at the end of warmup
    assert drophead_rate(550, w, total, 0.2) == pytest.approx(0.1)  # linear rise
    assert drophead_rate(total, w, total, 0.2) == pytest.approx(0.2)  # p_end = p_start by default
    assert drophead_rate(total, w, total, 0.2, 0.3) == pytest.approx(0.3)
    assert drophead_rate(total + 10, w, total, 0.2, 0.3) == pytest.approx(0.3)  # held after the last step
    assert drophead_rate(w, w, w, 0.2) == 0.0 and drophead_rate(0, w, 10, 0.0, 0.0) == 0.0


def test_drop_heads_drops_whole_heads_and_renormalises() -> None:
    torch.manual_seed(0)
    b, h = 4000, 4
    o = torch.ones(b, h, 3, 2)
    out = drop_heads(o, torch.tensor(0.3))
    per_head = out.view(b, h, -1)
    assert torch.equal(per_head.amin(-1), per_head.amax(-1))  # a head is kept or dropped as a whole
    kept = (per_head[..., 0] > 0).sum(1)  # [B]
    torch.testing.assert_close(per_head[..., 0].sum(1)[kept > 0], torch.full((int((kept > 0).sum()),), float(h)))
    assert abs(1 - kept.float().mean().item() / h - 0.3) < 0.02  # dropped with probability p


def test_drophead_only_in_training_and_p0_changes_nothing() -> None:
    m = make(dropout=0.0)
    src, tgt = batch()
    plain = m.train()(src, tgt)
    m.set_drophead(0.0)
    torch.testing.assert_close(m(src, tgt), plain, rtol=0, atol=0)  # every head kept, scale 1
    m.set_drophead(0.5)
    dropped = m(src, tgt)
    assert (dropped - plain).abs().max() > 1e-3
    dropped.sum().backward()  # differentiable
    with torch.no_grad():
        torch.testing.assert_close(m.eval()(src, tgt), plain, rtol=1e-6, atol=1e-6)  # eval: off
    m.set_drophead(None)
    assert all(mod.drophead is None for mod in m.modules() if hasattr(mod, "drophead"))
    assert not [k for k in m.state_dict() if "drophead" in k]  # never saved


# --------------------------------------------------------------------------------------------------------------------
# End to end: train with every variant at once, resume bitwise, decode and average (pruned) through the CLI
# --------------------------------------------------------------------------------------------------------------------

SUBJECTS = [("the dog", "der hund"), ("the cat", "die katze"), ("a man", "ein mann"), ("a woman", "eine frau"),
            ("the child", "das kind")]
VERBS = [("sees", "sieht"), ("likes", "mag"), ("eats", "isst"), ("finds", "findet")]
OBJECTS = [("an apple", "einen apfel"), ("a ball", "einen ball"), ("the house", "das haus"), ("a book", "ein buch")]
TRAINED = dict(preset="tiny", encoder_layers=4, decoder_layers=4, d_model=32, d_ff=64, heads=4, max_positions=48,
               norm_position="pre", norm="scale", fixnorm=True, positions="learned", layerdrop=0.25,
               attention_window=2, init="fairseq")


def tcfg(**kw) -> TrainConfig:
    base = dict(max_steps=8, warmup=4, lr_scale=2.0, precision="fp32", threads=1, save_every_minutes=0.0,
                save_every_steps=4, valid_every_steps=4, log_every_steps=1, tokens_per_update=200,
                drophead_start=0.2, drophead_end=0.1)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """A bpe artifact with a real SentencePiece model, its bucket artifact, and a short training run of a model with
    every variant (pre-norm + ScaleNorm + FixNorm + learned positions + LayerDrop + restricted self-attention r = 2,
    fairseq's initialisation, DropHead in training)."""
    from mtpipe.stages import bucket
    from mtpipe.training import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("variants")
    pairs = [(f"{s} {v} {o} .", f"{sd} {vd} {od} .") for (s, sd), (v, vd), (o, od)
             in itertools.product(SUBJECTS, VERBS, OBJECTS)]
    sp = train_spm(root / "spm", [x for pair in pairs for x in pair], 90)
    tokens = root / "bpe"
    splits = {"train": pairs, "valid": pairs[1::8], "test": pairs[::8]}
    with writing.ArtifactWriter(tokens, "tokens") as w:
        for split, ps in splits.items():
            w.write_table(f"{split}.parquet", pa.table({"id": list(range(len(ps))),
                                                        "src": [sp.encode(s) for s, _ in ps],
                                                        "tgt": [sp.encode(t) for _, t in ps]}))
        shutil.copy(root / "spm.model", w.path("spm.model"))
        w.extra.update({"spm_sha256": artifacts.file_hash(w.path("spm.model")), "vocab_size": sp.get_piece_size()})
    batches = root / "bucket"
    bucket.bucket_tokens(BucketConfig(max_tokens=100, max_len=40, multiple_of=1), tokens, batches)
    out = root / "train"
    summary = train.train_model(ModelConfig(**TRAINED), tcfg(), tokens, batches, out)
    yield {"root": root, "tokens": tokens, "batches": batches, "out": out, "summary": summary,
           "n_test": len(splits["test"])}
    torch.set_num_threads(threads)


def cli(root: Path, *args: str):
    params = root / "empty_params.yaml"
    params.write_text("", encoding="utf-8")
    return CliRunner().invoke(app, [args[0], "--params", str(params), *args[1:]])


def test_variant_training_resumes_bitwise_and_logs_the_drophead_schedule(run) -> None:
    from mtpipe.training import train

    out = run["out"]
    assert run["summary"]["steps"] == 8
    ck = artifacts.load_checkpoint(out / "checkpoints" / "step_00000008")
    keys = ("norm_position", "norm", "fixnorm", "positions", "layerdrop", "init")
    assert {k: ck.model_config[k] for k in keys} == {"norm_position": "pre", "norm": "scale", "fixnorm": True,
                                                    "positions": "learned", "layerdrop": 0.25, "init": "fairseq"}
    rates = dict((int(a), float(b)) for a, b in (ln.split("\t") for ln in (
        out / "live" / "plots" / "metrics" / "train" / "drophead.tsv").read_text().splitlines()[1:]))
    assert rates[1] == pytest.approx(0.15) and rates[4] == 0.0 and rates[8] == pytest.approx(0.1)
    # Drop the last checkpoint and run again: the resumed run (LayerDrop skips and DropHead masks drawn from the
    # restored RNG state, DropHead's rate from the restored step) ends with the very same weights.
    resumed = run["root"] / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000008")
    s = train.train_model(ModelConfig(**TRAINED), tcfg(), run["tokens"], run["batches"], resumed)
    assert s["resumed_from"].endswith("step_00000004") and s["updates_this_run"] == 4
    again = artifacts.load_checkpoint(resumed / "checkpoints" / "step_00000008").state_dict
    assert again.keys() == ck.state_dict.keys()
    for k, v in ck.state_dict.items():
        assert torch.equal(again[k], v), k


def test_layerdrop_and_drophead_train_at_world_size_2(run) -> None:
    """Two processes (torchrun, gloo) with accumulation: each rank skips its own layers, so in the synced backward a
    layer may have no gradient on one rank or on all; DDP is told to expect that, and the run completes."""
    import os
    import subprocess
    import sys

    import yaml

    root = run["root"]
    params = root / "ws2_params.yaml"
    params.write_text(yaml.safe_dump({"model": {**TRAINED, "layerdrop": 0.5},
                                      "train": {**to_dict(tcfg(max_steps=3, save_every_steps=0, valid_every_steps=0)),
                                                "nproc": "2", "tokens_per_update": 400}}), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    out = root / "ws2"
    cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "stages" / "train.py"), "--params", str(params),
           "--tokens", str(run["tokens"]), "--batches", str(run["batches"]), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    summary = json.loads((out / "train.json").read_text())
    assert (summary["processes"], summary["accumulation"], summary["steps"]) == (2, 2, 3)


def test_variant_checkpoint_decodes_with_no_extra_flag(run) -> None:
    root, ck = run["root"], run["out"] / "checkpoints" / "step_00000008"
    out = root / "dec_plain"
    r = cli(root, "decode", "--checkpoint", str(ck), "--tokens", str(run["tokens"]), "--out", str(out),
            "--beam", "2", "--max-len-b", "8")
    assert r.exit_code == 0, r.output
    rows = artifacts.read_table(out, "test.parquet", "hypotheses").to_pylist()
    assert len(rows) == run["n_test"]
    # The same hypotheses as the model rebuilt from the checkpoint by hand.
    c = artifacts.load_checkpoint(ck)
    model = build_model(c.model_config, c.vocab["size"])
    model.load_state_dict(c.state_dict)
    src = artifacts.read_table(run["tokens"], "test.parquet", "tokens").column("src").to_pylist()
    want = [h[0].tokens for h in translate(model, src, DecodeConfig(beam=2, max_len_b=8))]
    assert [row["tokens"] for row in rows] == want
    # Learned positions end at max_positions (48) like the sinusoids: decode truncates a longer source with a warning
    # (one output line per input line), as it does for the paper's model; the model itself raises MtpipeError.
    infile = root / "long.en"
    infile.write_text(" ".join(["the dog sees a ball ."] * 12) + "\nthe cat eats a book .\n", encoding="utf-8")
    r = cli(root, "decode", "--checkpoint", str(ck), "--tokens", str(run["tokens"]), "--input", str(infile),
            "--beam", "2", "--max-len-b", "8")
    assert r.exit_code == 0, r.output
    assert "truncated" in r.stderr and len(r.stdout.splitlines()) == 2


def test_average_prune_writes_a_smaller_checkpoint_that_decodes_like_pruning_on_the_fly(run) -> None:
    root = run["root"]
    avg, pruned = root / "avg", root / "avg_pruned"
    for out, extra in ((avg, []), (pruned, ["--prune", "every_other"])):
        r = cli(root, "average", "--run", str(run["out"]), "--last", "2", "--out", str(out), *extra)
        assert r.exit_code == 0, r.output
    ck = artifacts.load_checkpoint(pruned)
    # layerdrop 0.25: floor(1/0.25) = 4, depth 4 of 4 dropped on both sides.
    assert (ck.model_config["encoder_layers"], ck.model_config["decoder_layers"]) == (3, 3)
    assert ck.model_config["layerdrop"] == 0.25
    assert ck.manifest.extra["pruned"]["encoder_kept"] == [0, 1, 2]
    assert not [k for k in ck.state_dict if k.startswith(("encoder.3.", "decoder.3."))]
    outs = {}
    for name, ckpt, extra in (("file", pruned, []), ("fly", avg, ["--prune", "every_other"]),
                              ("list", avg, ["--prune", "enc:0,2;dec:1"])):
        out = root / f"dec_{name}"
        r = cli(root, "decode", "--checkpoint", str(ckpt), "--tokens", str(run["tokens"]), "--out", str(out),
                "--beam", "2", "--max-len-b", "8", *extra)
        assert r.exit_code == 0, r.output
        outs[name] = artifacts.read_table(out, "test.parquet", "hypotheses").to_pylist()
    assert [r["tokens"] for r in outs["file"]] == [r["tokens"] for r in outs["fly"]]
    assert [r["score"] for r in outs["file"]] == pytest.approx([r["score"] for r in outs["fly"]], abs=1e-5)
    assert artifacts.read_manifest(root / "dec_list", "hypotheses").extra["pruned"] == {
        "encoder_kept": [0, 2], "decoder_kept": [1]}


def test_prune_errors_are_one_line_and_write_nothing(run) -> None:
    root = run["root"]
    torch.manual_seed(0)
    plain = Transformer(ModelConfig(**{**TRAINED, "layerdrop": 0.0}), 90)
    ck0 = root / "ck_no_layerdrop"
    vocab = {"spm_sha256": artifacts.file_hash(run["tokens"] / "spm.model"), "size": 90}
    writing.write_checkpoint(ck0, state_dict=plain.state_dict(),
                             meta=artifacts.CheckpointManifest(model_config=to_dict(plain.cfg), vocab=vocab, step=1))
    for args, pattern in [(["decode", "--checkpoint", str(ck0), "--prune", "every_other"], "layerdrop=0"),
                          (["decode", "--checkpoint", str(ck0), "--prune", "enc:7"], "encoder layer 7"),
                          (["average", "--checkpoint", str(ck0), "--prune", "every_other"], "average.prune")]:
        out = root / "bad_out"
        extra = ["--tokens", str(run["tokens"])] if args[0] == "decode" else []
        r = cli(root, *args, *extra, "--out", str(out))
        assert r.exit_code == 1, r.output
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and pattern in errors[0], r.stderr
        assert not out.exists()


def test_drophead_needs_a_known_last_step_and_compile_refuses_layerdrop(run, tmp_path) -> None:
    from mtpipe.training import train, update

    with pytest.raises(MtpipeError, match="drophead"):
        train.train_model(ModelConfig(**TRAINED), tcfg(max_steps=0, max_time=1.0), run["tokens"], run["batches"],
                          tmp_path)
    with pytest.raises(MtpipeError, match="train.drophead_start = 1.5 must be >= 0 and < 1"):
        train.train_model(ModelConfig(**TRAINED), tcfg(drophead_start=1.5), run["tokens"], run["batches"], tmp_path)
    with pytest.raises(MtpipeError, match="train.compile"):
        update.Updater(make(layerdrop=0.1), tcfg(compile=True), torch.device("cpu"), "fp32")


def test_export_maps_pre_norm_and_learned_positions_and_refuses_scalenorm(run, tmp_path) -> None:
    pytest.importorskip("ctranslate2")
    import sentencepiece as spm

    from mtpipe.engine.ct2 import load_ct2
    from mtpipe.engine.ct2_convert import export_ctranslate2
    from mtpipe.stages.export import export_huggingface

    sp = spm.SentencePieceProcessor(model_file=str(run["tokens"] / "spm.model"))
    vocab = {"spm_sha256": artifacts.file_hash(run["tokens"] / "spm.model"), "size": 90}

    def save(model: Transformer, name: str) -> Path:
        writing.write_checkpoint(tmp_path / name, state_dict=model.state_dict(), meta=artifacts.CheckpointManifest(
            model_config=to_dict(model.cfg), step=1, vocab=vocab))
        return tmp_path / name

    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TRAINED, "norm": "layer", "fixnorm": False, "dropout": 0.0,
                                       "attention_window": 0}), 90).eval()
    with torch.no_grad():
        model.embed.weight.mul_(4.0)  # peaked distributions
        model.decoder_norm.bias.add_(0.3)
    ck = save(model, "pre_learned")
    export_ctranslate2(ck, run["tokens"], tmp_path / "ct2")
    ct2 = load_ct2(tmp_path / "ct2", threads=1)
    s, t = "the dog sees a ball .", "der hund sieht einen ball ."
    r = ct2.translator.score_batch([sp.encode(s, out_type=str)], [sp.encode(t, out_type=str)])[0]
    si, ti = sp.encode(s), sp.encode(t)
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([si + [EOS_ID]]), torch.tensor([[BOS_ID] + ti]))[0], -1)
    ref = [float(logp[j, y]) for j, y in enumerate(ti + [EOS_ID])]
    assert max(abs(a - b) for a, b in zip(ref, r.log_probs)) < 1e-4
    with pytest.raises(MtpipeError, match="MarianMTModel is post-norm only"):
        export_huggingface(ck, run["tokens"], tmp_path / "marian", "marian")
    scaled = save(Transformer(ModelConfig(**TRAINED), 90), "scale")
    with pytest.raises(MtpipeError, match="model.norm=scale"):
        export_ctranslate2(scaled, run["tokens"], tmp_path / "ct2_scale")
    assert not (tmp_path / "ct2_scale").exists()
