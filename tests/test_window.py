"""Restricted self-attention (the paper's section 4, ``model.attention_window`` r): a query's output depends on the
keys within r of it only, r >= n is full attention, the banded computation equals the masked one (values and
gradients), cached decoding equals the full forward pass, the window survives the checkpoint, and export refuses it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_steps_match_forward

from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID
from mtpipe.config import ModelConfig, to_dict
from mtpipe.errors import MtpipeError
from mtpipe.model.ops import banded_attention, banded_min_length, explicit_attention, window_mask
from mtpipe.model.attention import MultiHeadAttention
from mtpipe.model.transformer import Transformer, build_model
from mtpipe.stages.attention import observe_attention

V = 40
BASE = dict(preset="tiny", encoder_layers=2, decoder_layers=2, d_model=32, d_ff=64, heads=4, max_positions=512,
            dropout=0.0)


def make(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{**BASE, **kw}), V).eval()


def tokens(b: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, V, (b, n), generator=g)


def attention_layer(window: int, seed: int = 0) -> MultiHeadAttention:
    torch.manual_seed(seed)
    return MultiHeadAttention(32, 4, 8, 8, 0.0, True, window).eval()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [12, 300])  # 300: past banded_min_length(3), so the banded computation runs
def test_a_query_does_not_see_keys_outside_its_window(causal: bool, n: int) -> None:
    r = 3
    layer = attention_layer(r)
    x = torch.randn(2, n, 32)
    i = n // 2
    near = [j for j in range(n) if (i - r <= j <= i if causal else abs(i - j) <= r)]
    far = [j for j in range(n) if j not in near]
    y = x.clone()
    y[:, far] = torch.randn(2, len(far), 32) * 5  # every key outside query i's window changes
    with torch.no_grad():
        a = layer.self_attend(x, causal=causal)
        b = layer.self_attend(y, causal=causal)
        torch.testing.assert_close(a[:, i], b[:, i], rtol=1e-5, atol=1e-5)
        z = x.clone()
        z[:, near[0]] += 1.0  # ... but one inside it does change the output
        assert (layer.self_attend(z, causal=causal)[:, i] - a[:, i]).abs().max() > 1e-4


def test_the_encoder_output_depends_on_positions_within_layers_times_r_only() -> None:
    """Receptive field of N restricted layers: N * r positions each side; the decoder's likewise, only backwards."""
    m = make(attention_window=2)
    src, tgt = tokens(1, 30, 1), tokens(1, 30, 2)
    src[0, -1], tgt[0, 0] = EOS_ID, BOS_ID
    with torch.no_grad():
        memory, mask = m.encode(src)
        changed = src.clone()
        changed[0, 20:] = tokens(1, 10, 3)  # position 20 onwards: more than 2 * 2 away from position 15
        memory2, _ = m.encode(changed)
        torch.testing.assert_close(memory[0, :16], memory2[0, :16], rtol=1e-5, atol=1e-5)
        assert (memory[0, 16:] - memory2[0, 16:]).abs().max() > 1e-4
        # the decoder: position 10 sees 10 - 2 * 2 = 6 onwards (and the whole source through cross-attention)
        h = m.decode(tgt, memory, mask)
        tgt2 = tgt.clone()
        tgt2[0, 1:6] = tokens(1, 5, 4)
        torch.testing.assert_close(h[0, 10:], m.decode(tgt2, memory, mask)[0, 10:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [9, 200])
def test_a_window_as_wide_as_the_input_is_full_attention(n: int) -> None:
    """r >= n - 1: every pair is within the window, so the model is the paper's, exactly (the same code runs)."""
    src, tgt = tokens(2, n, 5), tokens(2, n, 6)
    src[:, -1], tgt[:, 0] = EOS_ID, BOS_ID
    src[1, n - 3 :] = PAD_ID  # padding: real positions agree exactly, padded ones are never used
    full, windowed = make(), make(attention_window=n)
    windowed.load_state_dict(full.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(windowed(src, tgt), full(src, tgt), rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("r", [1, 4, 40])
def test_banded_attention_equals_the_masked_full_matrix_values_and_gradients(causal: bool, r: int) -> None:
    torch.manual_seed(0)
    b, h, n, d = 2, 3, 131, 8  # n not a multiple of the block size
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    key_mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
    key_mask[1, ..., 100:] = False  # a shorter sentence
    band = window_mask(n, r, causal, q.device)
    mask = band if causal else (band & key_mask) | torch.eye(n, dtype=torch.bool)
    want = explicit_attention(q, k, v, mask, False, 0.0)
    got = banded_attention(q, k, v, None if causal else key_mask, r, causal, 0.0)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(want)
    grads_want = torch.autograd.grad((want * g).sum(), (q, k, v))
    grads_got = torch.autograd.grad((got * g).sum(), (q, k, v))
    for a, e in zip(grads_got, grads_want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_the_model_takes_the_banded_path_on_long_inputs_with_the_same_result(monkeypatch) -> None:
    """From banded_min_length(r) on the model computes the band only; forced off, the masked full matrix gives the
    same outputs."""
    import mtpipe.model.attention as model_module

    r = 2
    n = banded_min_length(r) + 5
    m = make(attention_window=r)
    src, tgt = tokens(2, n, 7), tokens(2, n, 8)
    src[:, -1], tgt[:, 0] = EOS_ID, BOS_ID
    src[1, n - 9 :] = PAD_ID
    calls = []
    real = model_module.banded_attention
    monkeypatch.setattr(model_module, "banded_attention", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        banded = m(src, tgt)
    assert len(calls) == 4  # two encoder and two decoder self-attention layers
    monkeypatch.setattr(model_module, "banded_min_length", lambda r: 10**9)
    with torch.no_grad():
        masked = m(src, tgt)
    keep = (tgt != PAD_ID)[..., None]
    torch.testing.assert_close(banded * keep, masked * keep, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("r", [1, 3])
def test_cached_decoding_with_a_window_equals_the_full_forward_pass(r: int) -> None:
    """The incremental cache serves the last r + 1 positions only; step-by-step log-probs equal teacher forcing."""
    m = make(attention_window=r)
    src, tgt = tokens(3, 11, 9), tokens(3, 12, 10)
    src[:, -1], tgt[:, 0] = EOS_ID, BOS_ID
    src[2, 8:] = PAD_ID
    assert_steps_match_forward(m, src, tgt, reorder=torch.tensor([2, 0, 0]))


def test_recorded_weights_are_zero_outside_the_window() -> None:
    m = make(attention_window=2)
    src, tgt = tokens(1, 10, 11), tokens(1, 9, 12)
    src[0, -1], tgt[0, 0] = EOS_ID, BOS_ID
    with torch.no_grad(), observe_attention(m) as kept:
        m(src, tgt)
    enc, dec = kept["encoder"][0][0][0], kept["decoder"][0][0][0]  # [h, L, L]
    torch.testing.assert_close(enc.sum(-1), torch.ones(4, 10))
    assert (enc[:, ~window_mask(10, 2, False, enc.device)] == 0).all()
    assert (dec[:, ~window_mask(9, 2, True, dec.device)] == 0).all()
    assert (kept["cross"][0][0][0] > 0).all()  # encoder-decoder attention stays full


def test_window_is_saved_in_the_config_and_bad_values_fail() -> None:
    m = make(attention_window=3)
    rebuilt = build_model(to_dict(m.cfg), V)
    assert rebuilt.cfg.attention_window == 3
    assert all(layer.self_attn.window == 3 for layer in [*rebuilt.encoder, *rebuilt.decoder])
    assert all(layer.cross_attn.window == 0 for layer in rebuilt.decoder)
    with pytest.raises(MtpipeError, match="attention_window"):
        ModelConfig(preset="tiny", attention_window=-1)


def test_export_refuses_a_window_with_the_reason(tmp_path) -> None:
    from mtpipe.engine.ct2_convert import unsupported
    from mtpipe.stages.export import marian_mismatch

    cfg = ModelConfig(**{**BASE, "attention_window": 4}).resolved()
    assert "restricted self-attention" in unsupported(cfg)
    assert "attention_window=4" in marian_mismatch(cfg)
    assert unsupported(ModelConfig(**BASE).resolved()) is None
