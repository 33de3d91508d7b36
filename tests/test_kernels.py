"""The float32 products of :mod:`mtpipe.model.ops` through oneDNN compute what torch's own products compute: values and
gradients equal ``F.linear`` / ``torch.mm`` up to float rounding in every operand layout, and the route is taken where
it should be (and only there: not in compiled code)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtpipe.engine import packed
from mtpipe.model import ops as kernels

pytestmark = pytest.mark.skipif(not kernels._ONEDNN_AVAILABLE, reason="this torch build has no oneDNN")


@pytest.fixture
def dnn_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Every oneDNN product from now on, by its input's shape; products of any size take the route."""
    calls: list[tuple[int, ...]] = []
    real = kernels._dnn

    def counted(x, weight, bias=None):
        calls.append(tuple(x.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(kernels, "_dnn", counted)
    monkeypatch.setattr(kernels, "_ONEDNN_MIN_MACS", 1)
    monkeypatch.setattr(kernels, "ONEDNN_FP32_TRAINING", True)  # on any CPU (by default AVX-512 only)
    return calls


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 7, 24), (40, 24)])
def test_linear_through_onednn_equals_f_linear_with_gradients(bias: bool, shape: tuple[int, ...],
                                                               dnn_calls: list) -> None:
    g = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(*shape, generator=g), torch.randn(40, 24, generator=g)  # a tall and a wide dW alike
    b0 = torch.randn(40, generator=g) if bias else None
    dy = torch.randn(*shape[:-1], 40, generator=g)
    results = []
    for route in (kernels.linear, F.linear):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        b = b0.clone().requires_grad_(True) if b0 is not None else None
        y = route(x, w, b)
        y.backward(dy)
        results.append((y.detach(), x.grad, w.grad, None if b is None else b.grad))
    assert len(dnn_calls) == 3  # the forward product and both backward ones
    for got, want in zip(*results):
        if want is None:
            assert got is None
        else:
            assert got.shape == want.shape
            _close(got, want)
    with torch.no_grad():
        _close(kernels.linear(x0, w0, b0), results[1][0])
    assert len(dnn_calls) == 4


@pytest.mark.parametrize("m,k,n", [(50, 8, 30), (30, 8, 50), (8, 50, 30)])
@pytest.mark.parametrize("layout", ["rows", "a transposed", "b transposed", "both transposed"])
def test_mm_equals_torch_mm_in_every_layout(m: int, k: int, n: int, layout: str, dnn_calls: list) -> None:
    # kernels.mm computes a tall product of a column-major a as (b^T a^T)^T: every layout must give a @ b.
    g = torch.Generator().manual_seed(1)
    a = torch.randn(k, m, generator=g).t() if "a" in layout or "both" in layout else torch.randn(m, k, generator=g)
    b = torch.randn(n, k, generator=g).t() if "b " in layout or "both" in layout else torch.randn(k, n, generator=g)
    out = kernels.mm(a, b)
    assert dnn_calls and out.shape == (m, n)
    _close(out, torch.mm(a, b))


def test_the_route_is_float32_on_cpu_outside_autocast_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = kernels._dnn
    monkeypatch.setattr(kernels, "_dnn", lambda *args: calls.append(1) or real(*args))
    w = torch.randn(16, 8)  # 128 multiply-adds a row
    rows = kernels._ONEDNN_MIN_MACS // 128  # just large enough
    kernels.linear(torch.randn(rows - 1, 8), w, None)  # too small: torch's product
    kernels.linear(torch.randn(rows, 8, dtype=torch.float64), w.double(), None)  # oneDNN has no float64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kernels.linear(torch.randn(rows, 8), w, None)  # autocast's bf16 product
    monkeypatch.setattr(kernels, "ONEDNN_FP32", False)
    kernels.linear(torch.randn(rows, 8), w, None)  # switched off (the benchmarks' --plain onednn)
    assert calls == []
    monkeypatch.setattr(kernels, "ONEDNN_FP32", True)
    kernels.linear(torch.randn(rows, 8), w, None)
    assert calls == [1]


def test_training_products_keep_torchs_route_where_the_route_is_closed_to_training(
        dnn_calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    # With AVX2 only (ONEDNN_FP32_TRAINING False) training's products, the layers' and the loss's, are torch's own;
    # products without gradients (decoding, validation) still take the route. Same values either way.
    from mtpipe.training.loss import projected_label_smoothed_nll

    monkeypatch.setattr(kernels, "ONEDNN_FP32_TRAINING", False)
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(30, 24, generator=g), torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = kernels.linear(xg, wg, b)
    y.sum().backward()
    target = torch.randint(0, 40, (30,), generator=g)
    loss_g = projected_label_smoothed_nll(xg, wg, b, target, 0.1)[0]
    loss_g.backward()
    assert dnn_calls == []
    with torch.no_grad():
        _close(kernels.linear(x, w, b), y.detach())
        _close(projected_label_smoothed_nll(x, w, b, target, 0.1)[0], loss_g.detach())
    assert len(dnn_calls) >= 2  # the layer's product and the loss's block


def test_compiled_code_keeps_the_compilers_own_products(dnn_calls: list) -> None:
    # inductor's oneDNN lowering asserts on weights that are not frozen constants, and an opaque op per product cost
    # more than it saved in a compiled decoding step of a few sentences: under torch.compile, linear is F.linear,
    # traced without a graph break (fullgraph), and computes the same.
    torch._dynamo.reset()
    w1, b1, w2 = torch.randn(32, 16), torch.randn(32), torch.randn(16, 32)

    def two_layers(x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(torch.relu(kernels.linear(x, w1, b1)), w2, None) + x

    compiled = torch.compile(two_layers, fullgraph=True, dynamic=True)
    x = torch.randn(5, 16)
    with torch.no_grad():
        got = compiled(x)
        assert dnn_calls == []
        want = two_layers(x)
        assert len(dnn_calls) == 2  # eagerly, both products took the route
    _close(got, want)
    torch._dynamo.reset()


def test_compiled_decoding_layers_keep_the_compilers_products_without_a_graph_break(dnn_calls: list,
                                                                                  monkeypatch) -> None:
    # A packed decoding layer in inference mode (a compiled decoding step) must trace to F.linear in one graph: a
    # check the compiler cannot trace (torch.is_inference_mode_enabled) before is_compiling broke the graph at every
    # layer.
    torch._dynamo.reset()
    monkeypatch.setattr(packed, "_PACKED_MIN_MACS", 1)
    first, second = packed.PackedLinear(kernels.Linear(16, 32)), packed.PackedLinear(kernels.Linear(32, 16))
    compiled = torch.compile(lambda x: second(torch.relu(first(x))) + x, fullgraph=True, dynamic=True)
    x = torch.randn(5, 16)
    with torch.inference_mode():
        got = compiled(x)
        assert dnn_calls == []  # neither oneDNN route (packed or not) inside the graph
        want = second(torch.relu(first(x))) + x
        assert len(dnn_calls) == 2  # eagerly, both took the packed route
    _close(got, want)
    torch._dynamo.reset()


def test_a_packed_decoding_layer_multiplies_by_the_copy_made_from_its_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    # In inference mode (decoding), a float32 CPU product of at least _PACKED_MIN_MACS multiply-adds runs on the
    # packed copy made once when the layer was made (a snapshot of the weight), never in training or under no_grad
    # alone (validation); smaller products and --plain layer-packing take the plain route, and an inference-tensor
    # weight gets no packed copy.
    weights = []  # the weight operand of every oneDNN product
    real = kernels._dnn
    monkeypatch.setattr(kernels, "_dnn", lambda x, w, b=None: weights.append(w) or real(x, w, b))
    plain = kernels.Linear(24, 40)
    layer = packed.PackedLinear(plain)
    assert layer.weight is plain.weight and layer.packed is not None  # packed once, from the layer's own weight
    rows = -(-max(packed._PACKED_MIN_MACS, kernels._ONEDNN_MIN_MACS) // (24 * 40))  # large enough for both routes
    x = torch.randn(2, rows, 24)
    with torch.inference_mode():
        _close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert weights[-1] is layer.packed  # the kept copy
    with torch.no_grad():
        layer(x)  # not inference mode: the plain route
        assert weights[-1] is layer.weight
    with torch.inference_mode():
        monkeypatch.setattr(packed, "PACK_DECODING_LINEARS", False)  # bench/decode_speed.py --plain layer-packing
        _close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert weights[-1] is layer.weight
        monkeypatch.setattr(packed, "PACK_DECODING_LINEARS", True)
        made_here = packed.PackedLinear(kernels.Linear(24, 40))  # inference tensors: no packed copy
    assert made_here.packed is None
