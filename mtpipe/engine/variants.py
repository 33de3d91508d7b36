"""A model prepared to decode (:func:`prepare`): its variant for the decoding precision and device, and the step
runner, chosen once.

Variants: float32, the model itself (a copy of it for a compiled step), on CPU with its linear layers and projection
through oneDNN on packed copies of their weights (:mod:`mtpipe.engine.packed`); bf16, a copy with bf16 weights
(:func:`bf16_copy`); int8 (CPU), a copy with int8 linear layers (:func:`int8_copy`). Runners: the eager step, the
compiled one (``decode.compile``, :mod:`mtpipe.engine.runners`), or on a GPU the step replayed from CUDA graphs
(``decode.cuda_graphs``, :mod:`mtpipe.engine.cuda_graphs`).

A prepared model holds what it derived from the weights it was prepared from (a copy, bf16 or int8 weights, a compiled
step): weights changed afterwards (a training update, ``load_state_dict``, ``model.to(...)``) need a new
:func:`prepare`, and the old one is dropped with whatever it derived from them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from mtpipe import platform
from mtpipe.console import info
from mtpipe.engine.cache import DecoderState
from mtpipe.engine.runners import CompiledStep
from mtpipe.errors import MtpipeError
from mtpipe.model.ops import attention_kernels


@contextlib.contextmanager
def decoding_context(device: torch.device, precision: str) -> Iterator[None]:
    """What decoding steps run under: the precision's autocast (:func:`mtpipe.platform.autocast`: bf16 matmuls,
    softmax/log-softmax in fp32; nothing for fp32 and int8), and on a GPU the attention kernels that suit a step's
    ever-changing shapes (:func:`mtpipe.model.ops.attention_kernels`)."""
    with platform.autocast(device, precision), attention_kernels(device):
        yield


def bf16_copy(model: Any) -> Any:
    """A copy of ``model`` with bf16 weights for bf16 decoding. Autocast casts every float32 weight again at every
    matmul (it caches casts only for tensors that track gradients), a real share of a decode step whose matmuls are
    small. The positional encodings stay float32, as autocast would use them."""
    twin = copy.deepcopy(model).to(torch.bfloat16)
    twin.positions = model.positions
    if model.tgt_positions is not None:
        twin.tgt_positions = model.tgt_positions
    return twin


def _int8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """``x W^T + b`` with W in int8, one scale per output row (symmetric, max |w| -> 127), as a dynamically quantised
    linear layer: each call quantises its input per tensor to uint8 and runs an int8 GEMM (fbgemm on x86, AVX2 and
    up), accumulating in int32 and returning float32."""
    from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [out]
    qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(w.size(0), dtype=torch.long), 0, torch.qint8)
    layer = Int8Linear(w.size(1), w.size(0), dtype=torch.qint8)
    layer.set_weight_bias(qw, None if bias is None else bias.detach().float())
    return layer


def int8_copy(model: Any) -> Any:
    """A copy of ``model`` for ``decode.precision=int8`` (CPU): every linear layer (attention projections, W^O,
    feed-forward) and the pre-softmax projection (section 3.4's shared matrix, or the model's own) become
    :func:`_int8_linear` layers; embeddings, norms and attention itself stay float32. The projection is the
    largest matmul of a decoding step (V x d_model per hypothesis), so it is quantised too, as CTranslate2's int8
    mode does."""
    import warnings

    if platform.kernels().quantised == "none":
        raise MtpipeError("decode.precision=int8: this torch build has no quantised CPU engine (fbgemm, x86, "
                          "qnnpack, onednn); decode at fp32 or bf16")
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's notice that quantized tensors are being redesigned
        for module in list(twin.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(module, name, _int8_linear(child.weight, child.bias))
        projection = _int8_linear(model.output_embedding(), model.out_bias)
    # An instance attribute set past nn.Module's registry shadows the ``logits`` method for this copy only.
    object.__setattr__(twin, "logits", projection)
    return twin


COMPILE_MODES = ("off", "jit", "aot")


class Prepared:
    """A model as it decodes: its variant (``model``), the projection of a step's rows (``project``: the variant's
    :meth:`~mtpipe.model.transformer.Transformer.logits`, or its int8 form), and the step's runners, a
    compiled step (``compiled``) or CUDA graphs (``graphs``), each None when not used. What the beam search and the
    streaming decoder drive, inside ``torch.inference_mode`` and :func:`decoding_context`."""

    def __init__(self, model: Any, project: Callable[[Tensor], Tensor], compiled: CompiledStep | None = None,
                 graphs: Any = None) -> None:
        self.model, self.project, self.compiled, self.graphs = model, project, compiled, graphs
        self.cfg, self.start_id = model.cfg, model.start_id

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """The encoder stack: ``memory [B, S, D]`` and the source mask ``[B, 1, 1, S]``."""
        return self.model.encode(src)

    def start(self, memory: Tensor, src_mask: Tensor) -> DecoderState:
        """A fresh decoding state: every decoder layer's encoder-decoder keys/values projected once for the whole
        decode (one row per sentence; :meth:`DecoderState.select` widens to the beam)."""
        return DecoderState(src_mask=src_mask, cross=self.model.project_memory(memory))

    def step(self, tokens: Tensor, state: DecoderState, lazy: bool = False) -> tuple[Any, DecoderState]:
        """Log-probabilities ``[R, V]`` of the token after ``tokens [R]`` (the last decoded position of each row).

        Only the new position is computed; earlier positions' self-attention keys/values come from ``state``, and the
        new ones are written into it once the layers are done. ``lazy``: return instead a function
        ``log_probs(lo, hi)`` giving rows ``lo:hi`` only, so that beam search can project, normalise and rank a few
        hundred rows at a time while they are in the CPU's cache, rather than stream a ``[R, V]`` float32 matrix
        through memory four times.
        """
        # Each row's own position: the step count, less the cache slot it started at when it joined later.
        offset = state.length if state.start is None else state.length - state.start[:, None]  # int or [R, 1]
        x = self.model.embed_tokens(tokens[:, None], offset=offset, target=True)  # [R] -> [R, 1] -> [R, 1, D]
        graphed = None
        if self.graphs is not None and self.graphs.takes(x.size(0)):
            # decode.cuda_graphs: layers, projection and log-softmax replayed from a recorded graph
            graphed = self.graphs(x, state)  # [R, V], [layers, R, h, d] x 2; None: no graph (the eager step)
        if graphed is not None:
            logp, k_new, v_new = graphed

            def log_probs(lo: int, hi: int) -> Tensor:
                return logp[lo:hi]  # [hi-lo, V], a view of the graph's output
        else:
            h, k_new, v_new = self._layers(x, state)

            def log_probs(lo: int, hi: int) -> Tensor:
                # float32 straight from (bf16) logits: one pass, no separate cast of the logits
                return F.log_softmax(self.project(h[lo:hi]), dim=-1, dtype=torch.float32)  # [hi-lo, V]
        state.write(k_new, v_new)
        new_state = dataclasses.replace(state, length=state.length + 1)
        return (log_probs if lazy else log_probs(0, x.size(0))), new_state

    def _layers(self, x: Tensor, state: DecoderState) -> tuple[Tensor, Tensor, Tensor]:
        """The model's step on ``state``'s cache, compiled (``decode.compile``) from a batch's third step on."""
        cfg = self.cfg
        k_prev, v_prev, index, prev_mask = state.prefix(x, len(self.model.decoder), cfg.heads, cfg.d_k, cfg.d_v,
                                                        cfg.attention_window)
        if self.compiled is not None and state.length >= 2:
            return self.compiled(x, k_prev, v_prev, index, prev_mask, state)
        return self.model.step(x, k_prev, v_prev, prev_mask, state.cross, state.src_mask, index)

    def settings(self) -> contextlib.AbstractContextManager:
        """What a decode enters once around all its steps: ``decode.compile``'s torch settings
        (:meth:`CompiledStep.settings`); nothing for the other runners."""
        return self.compiled.settings() if self.compiled is not None else contextlib.nullcontext()


def compile_mode(value: Any) -> str:
    """``decode.compile`` as a mode: ``off``, ``jit`` or ``aot``; the booleans of older params files and checkpoint
    records, False and True, are ``off`` and ``aot`` (what they meant)."""
    if value is False or value is True:
        return "aot" if value else "off"
    if value not in COMPILE_MODES:
        raise MtpipeError(f"decode.compile = {value!r} is not one of {', '.join(COMPILE_MODES)}")
    return value


def prepare(model: Any, precision: str, device: torch.device, compile: str = "off", cuda_graphs: bool = False,
            lone_graph: bool = False, cache: Any = None) -> Prepared:
    """``model`` (on ``device``) prepared to decode at ``precision`` (fp32, bf16 or int8), in eval mode: its variant
    (module docstring) and its runner, ``compile`` (``decode.compile``: off, jit or aot; aot applies to float32 on
    CPU, elsewhere it is jit, with a note) or ``cuda_graphs`` (``decode.cuda_graphs``: on a GPU, not with
    ``compile`` nor with restricted self-attention, whose window is the last r cached positions, which the graphs'
    padded cache would move); ``lone_graph``: a compiled step's lone sentence in a graph of its own
    (:mod:`mtpipe.engine.runners`); ``cache``: where aot's packages are kept
    (:class:`mtpipe.engine.step_package.PackageCache`, None: the default). ``model`` itself is left as it was."""
    compile = compile_mode(compile)
    model.eval()
    platform.check_decoding_device(precision, device)  # (decode.compile with int8: refused by DecodeConfig)
    variant, project = _variant(model, precision, device, own_weights=compile != "off")
    variant.eval()
    compiled = graphs = None
    if compile != "off":
        if compile == "aot" and not (precision == "fp32" and device.type == "cpu"):
            info(f"decode.compile=aot: packaged ahead of time for float32 on CPU only; {precision} on {device.type} "
                 "compiles its step in this process (jit)")
        compiled = CompiledStep(variant, compile, lone_graph, cache)
    elif cuda_graphs and device.type == "cuda" and not variant.cfg.attention_window:
        from mtpipe.engine.cuda_graphs import GraphedStep

        graphs = GraphedStep(variant, project)
    return Prepared(variant, project, compiled, graphs)


def _variant(model: Any, precision: str, device: torch.device,
             own_weights: bool) -> tuple[Any, Callable[[Tensor], Tensor]]:
    """The module that decodes and its projection of a step's rows (the variant's own logits; int8: its quantised
    projection; float32 on CPU: oneDNN's, :mod:`mtpipe.engine.packed`), built from ``model``'s weights (module
    docstring); ``own_weights``: a copy of float32 weights rather than the model itself or new modules around its
    weights (a compiled step is keyed by the weights' identity, and must not meet weights that changed in place)."""
    if precision in ("bf16", "int8"):
        twin = bf16_copy(model) if precision == "bf16" else int8_copy(model)
        return twin, twin.logits
    if device.type == "cpu":
        from mtpipe.engine.packed import packed_copy

        return packed_copy(model, own_weights)
    twin = copy.deepcopy(model) if own_weights else model
    return twin, twin.logits
