"""The Transformer's properties (paper section 3): causality, padding invariance, tied embeddings, incremental
decoding, the presets' sizes. Properties only: no stored tensors to compare against."""

from __future__ import annotations


import pytest
import torch
from conftest import assert_steps_match_forward
from safetensors.torch import load, save

from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID
from mtpipe.config import ModelConfig
from mtpipe.errors import MtpipeError
from mtpipe.model.transformer import Transformer, build_model, sinusoids

V = 50
CFG = ModelConfig(preset="tiny", encoder_layers=2, decoder_layers=2, d_model=32, d_ff=64, heads=4, max_positions=64)


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    m = Transformer(CFG, V).eval()  # eval: dropout off, so outputs are functions of the inputs only
    # Non-zero biases and LayerNorm gains (they start at 0 / 1) so that no property holds by accident of the init.
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return m


def _batch(b: int = 3, s: int = 7, t: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, V, (b, s), generator=g)
    src[:, -1] = EOS_ID
    tgt = torch.randint(4, V, (b, t), generator=g)
    tgt[:, 0] = BOS_ID
    return src, tgt


def test_decoder_is_causal(model: Transformer) -> None:
    """Changing target token j changes no output at a position before j (section 3.2.3: the causal mask)."""
    src, tgt = _batch()
    with torch.no_grad():
        base = model(src, tgt)
        for j in range(1, tgt.size(1)):
            changed = tgt.clone()
            changed[:, j] = (changed[:, j] + 1 - 4) % (V - 4) + 4
            out = model(src, changed)
            torch.testing.assert_close(out[:, :j], base[:, :j], rtol=0, atol=1e-5)
            assert not torch.allclose(out[:, j:], base[:, j:], atol=1e-4), "a later output must see token j"


def test_extra_padding_changes_nothing(model: Transformer) -> None:
    """Right-padding source and target with extra PADs leaves every real position's output unchanged."""
    src, tgt = _batch(b=4, s=6, t=5)
    # Sentences of different lengths in one batch: pad some rows already.
    src[1, 3:], tgt[1, 3:] = PAD_ID, PAD_ID
    src[2, 5:] = PAD_ID
    with torch.no_grad():
        base = model(src, tgt)
        padded = model(torch.nn.functional.pad(src, (0, 5), value=PAD_ID),
                       torch.nn.functional.pad(tgt, (0, 3), value=PAD_ID))
    real = tgt != PAD_ID
    torch.testing.assert_close(padded[:, : tgt.size(1)][real], base[real], rtol=1e-5, atol=1e-5)
    # And a row's outputs do not depend on the other rows of the batch (its own padding only).
    with torch.no_grad():
        alone = model(src[1:2, :3], tgt[1:2, :3])
    torch.testing.assert_close(alone[0], base[1, :3], rtol=1e-5, atol=1e-5)


def test_source_padding_is_masked(model: Transformer) -> None:
    """Whatever sits under a source PAD position is invisible: only the mask decides, not the pad embedding."""
    src, tgt = _batch(b=2, s=8)
    src[:, 5:] = PAD_ID
    with torch.no_grad():
        base = model(src, tgt)
        model.embed.weight[PAD_ID] += 3.0  # would leak if pad keys were attended to
        try:
            out = model(src, tgt)
        finally:
            model.embed.weight[PAD_ID] -= 3.0
    # Every logit but PAD's own (the pad row is also PAD's output embedding) is unchanged.
    torch.testing.assert_close(out[..., PAD_ID + 1 :], base[..., PAD_ID + 1 :], rtol=1e-5, atol=1e-5)


def test_embeddings_are_one_tensor_shared_three_ways(model: Transformer) -> None:
    """Section 3.4: source embedding, target embedding and pre-softmax projection are one parameter."""
    big = [n for n, p in model.named_parameters() if p.shape == (V, CFG.d_model)]
    assert big == ["embed.weight"]
    assert [k for k in model.state_dict() if model.state_dict()[k].shape == (V, CFG.d_model)] == ["embed.weight"]
    # The output projection reads that very tensor: the logits equal h @ E^T.
    h = torch.randn(5, CFG.d_model)
    torch.testing.assert_close(model.logits(h), h @ model.embed.weight.T)
    # Gradient from all three uses lands in the one tensor: a token used only as source, one used only as target
    # input, and one used only as an output class all get a gradient row.
    m = build_model(CFG, V).train()
    src = torch.tensor([[10, 11, EOS_ID]])
    tgt_in = torch.tensor([[BOS_ID, 20]])
    h = m.features(src, tgt_in)  # [1, 2, D]
    m.logits(h)[..., 30].sum().backward()
    g = m.embed.weight.grad
    for token in (10, 20, 30):
        assert g[token].abs().sum() > 0, f"token {token} got no gradient"
    # No aliases: the state dict saves with safetensors as is (it refuses shared storage).
    restored = load(save(m.state_dict()))
    assert restored.keys() == m.state_dict().keys()


def test_incremental_decoding_equals_full_forward(model: Transformer) -> None:
    """encode/start/step with the key/value cache give the full forward's log-probabilities at every position,
    also after reordering the batch rows (beam search) with ``state.select``."""
    src, tgt = _batch(b=3, s=7, t=6)
    src[2, 4:] = PAD_ID
    assert_steps_match_forward(model, src, tgt, reorder=torch.tensor([2, 0]))


def test_sinusoids_match_section_3_5() -> None:
    pe = sinusoids(50, 16)
    assert pe.shape == (50, 16)
    pos, i = 7, 3  # PE(pos, 2i) = sin(pos / 10000^(2i/d)) and PE(pos, 2i+1) = cos(...), in a sin-half/cos-half layout
    angle = pos / 10000 ** (2 * i / 16)
    assert pe[pos, i].item() == pytest.approx(torch.sin(torch.tensor(angle, dtype=torch.float64)).item(), abs=1e-6)
    assert pe[pos, 8 + i].item() == pytest.approx(torch.cos(torch.tensor(angle, dtype=torch.float64)).item(), abs=1e-6)


@pytest.mark.parametrize("preset, n, d, ff, h, drop, params_m", [("base", 6, 512, 2048, 8, 0.1, 65),
                                                                  ("big", 6, 1024, 4096, 16, 0.3, 213)])
def test_presets_are_table_3(preset: str, n: int, d: int, ff: int, h: int, drop: float, params_m: int) -> None:
    """The presets are Table 3's base and big rows, and their parameter counts are the table's (65M / 213M with
    the en-de joint vocabulary of ~37000) to within a few percent (the paper's exact vocabulary is unknown)."""
    cfg = ModelConfig(preset=preset).resolved()
    assert (cfg.encoder_layers, cfg.decoder_layers, cfg.d_model, cfg.d_ff, cfg.heads) == (n, n, d, ff, h)
    assert (cfg.d_k, cfg.d_v, cfg.dropout) == (d // h, d // h, drop)
    with torch.device("meta"):  # shapes only: no memory, no init time
        m = Transformer(cfg, 37000)
    count = sum(p.numel() for p in m.parameters())
    assert abs(count / 1e6 - params_m) / params_m < 0.05


def test_too_long_input_is_a_clear_error(model: Transformer) -> None:
    src = torch.full((1, CFG.max_positions + 1), 5)
    with pytest.raises(MtpipeError, match="max_positions"):
        model.encode(src)


def test_training_mode_uses_dropout_and_eval_does_not() -> None:
    m = build_model(ModelConfig(**{**CFG.__dict__, "dropout": 0.3}), V)
    src, tgt = _batch()
    m.train()
    a, b = m(src, tgt), m(src, tgt)
    assert not torch.allclose(a, b)
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(src, tgt), m(src, tgt), rtol=0, atol=0)


def test_fairseq_init_draws_each_projection_as_fairseq_does() -> None:
    """``model.init=fairseq``: W^Q, W^K, W^V each within Xavier's bound with gain 1/sqrt(2) for its own [h d_k, D]
    shape (not the fused matrix's), filling it (uniform draws reach near the bound); their biases U(+-1/sqrt(D));
    the feed-forward layers nn.Linear's U(+-1/sqrt(fan_in)), which the default Xavier init exceeds."""
    torch.manual_seed(0)
    cfg = ModelConfig(preset="tiny", d_model=64, d_ff=256, heads=4)
    m = build_model(ModelConfig(**{**cfg.__dict__, "init": "fairseq"}), V)
    d = m.cfg.d_model
    qkv_bound = 2**-0.5 * (6 / (d + d)) ** 0.5  # Xavier, gain 1/sqrt(2), fan_in = fan_out = D
    for layer in list(m.encoder) + list(m.decoder):
        blocks = list(layer.self_attn.qkv.weight.split(d, 0))
        biases = [layer.self_attn.qkv.bias]
        if hasattr(layer, "cross_attn"):
            blocks += [layer.cross_attn.q.weight, *layer.cross_attn.kv.weight.split(d, 0)]
            biases += [layer.cross_attn.q.bias, layer.cross_attn.kv.bias]
        for w in blocks:
            assert 0.95 * qkv_bound < w.abs().max() <= qkv_bound
        for b in biases:
            assert 0.9 * d**-0.5 < b.abs().max() <= d**-0.5
        assert layer.self_attn.out.bias.abs().max() == 0
        for lin in (layer.ffn.w1, layer.ffn.w2):
            bound = lin.weight.size(1) ** -0.5
            assert 0.95 * bound < lin.weight.abs().max() <= bound and 0 < lin.bias.abs().max() <= bound
    default = build_model(cfg, V)
    assert default.encoder[0].ffn.w2.weight.abs().max() > 1.5 * 256**-0.5  # Xavier's bound is ~2x larger here
    assert default.encoder[0].self_attn.qkv.bias.abs().max() == 0


def test_fused_attention_switches_the_two_matmuls_off_for_its_block_only(model: Transformer,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.fused_attention (bench/ --plain attention): inside the block the encoder's attention is torch's fused
    kernel, computing what the two matmuls compute up to float rounding; before and after it, the two matmuls."""
    import torch.nn.functional as F

    from mtpipe.model import ops

    fused = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: fused.append(1) or real(*a, **k))
    src, _ = _batch()
    with torch.no_grad():
        explicit = model.encode(src)[0]
        assert fused == []
        with ops.fused_attention():
            assert not ops.prefer_explicit_attention(torch.zeros(1, 1, 1, 4))
            via_kernel = model.encode(src)[0]
        assert len(fused) == model.cfg.encoder_layers
        assert ops.prefer_explicit_attention(torch.zeros(1, 1, 1, 4))
        model.encode(src)
    assert len(fused) == model.cfg.encoder_layers
    torch.testing.assert_close(via_kernel, explicit, atol=1e-5, rtol=1e-5)
