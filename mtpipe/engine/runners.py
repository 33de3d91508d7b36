"""``decode.compile``: the model's decoding step (:meth:`mtpipe.model.transformer.Transformer.step`) run compiled, from
the third step of a batch on (the first two, with 0 and 1 cached positions, would each need a graph of their own).

Modes, chosen once when a variant is prepared (:func:`mtpipe.engine.variants.prepare`):

* ``jit`` -- ``torch.compile``: a step for a few sentences is ~35 small operations per layer whose fixed cost of
  dispatch dominates; compiled, the element-wise ones are fused into a few generated kernels. Dimensions are marked
  dynamic (rows, cached positions, sentences, source length), so one graph serves every batch; a new one is built
  only for the few shapes torch specialises (greedy search, beams past 8, a continuous batch's masked rows, a lone
  sentence with ``lone_graph``). On CPU the weights are frozen into the graph (inductor's ``freezing``: constants
  packed once for oneDNN) and the graph's wrapper is generated C++ (inductor's ``cpp_wrapper``), whose per-kernel
  cost is lower than Python's for a small batch.
* ``aot`` -- in float32 on CPU, the same step exported and compiled ahead of time into a package kept on disk
  (:mod:`mtpipe.engine.step_package`): building a frozen graph takes tens of seconds on a small CPU in every process,
  and torch's on-disk caches skip frozen graphs (their packed oneDNN weights do not pickle); a package is built by
  the first process and loaded in seconds by the next, ``torch.compile``'s graph serving only the shapes it refuses.

A lone sentence (a batch's tail, a single request): torch specialises a dimension of size 1, so it would need a graph
of its own. By default it runs as two copies of itself in the graph built for several sentences (:func:`_twice`):
one graph fewer to build in every process, for somewhat slower steps than in its own graph. ``lone_graph``: build its
own graph instead, for long-lived processes that translate one sentence at a time (``mtpipe serve``, stdin), which
build it once in their warm-up.

A frozen graph holds the weights it was built with: the prepared variant is a snapshot of them, built again when
they change (a new :func:`~mtpipe.engine.variants.prepare`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from mtpipe.engine.cache import DecoderState
from mtpipe.engine.runtime import separate_compile_cache
from mtpipe.errors import MtpipeError

# The compiled step gathers the cached keys/values itself (fused into attention's pass over them, no copy of the
# cache) when a position's keys of one layer take at least this many bytes; shorter rows are gathered before the
# graph, in one copy, which measured as fast or faster for them (results files: bench/results).
_GATHER_IN_GRAPH_BYTES = 1024


@contextlib.contextmanager
def gather_in_graph_from(nbytes: int) -> Iterator[None]:
    """Inside the block, the compiled step gathers the cache in its graph from rows of ``nbytes`` (0: at every width;
    more than any row: never, always before the graph) instead of :data:`_GATHER_IN_GRAPH_BYTES`: how
    ``bench/decode_speed.py`` times that threshold's worth (``--plain gather``). Read at every step, outside the
    graph."""
    global _GATHER_IN_GRAPH_BYTES
    before, _GATHER_IN_GRAPH_BYTES = _GATHER_IN_GRAPH_BYTES, nbytes
    try:
        yield
    finally:
        _GATHER_IN_GRAPH_BYTES = before

# Which compile settings (frozen or not) this thread has entered around a whole decode (CompiledStep.settings).
_entered = threading.local()


def _settings(frozen: bool) -> contextlib.ExitStack:
    """The settings ``decode.compile`` traces its graphs under (torch keeps them per thread):

    - inductor's ``freezing`` when ``frozen`` (:class:`CompiledStep`). Not ``torch.compile``'s ``options``: those
      reach inductor only, after the tracer has already taken the weights for inputs, so nothing would be frozen.
    - dynamo's ``specialize_float``: the step's Python floats (the norms' eps) are constants. Else dynamo traces them
      as symbols under ``dynamic=True``, then starts again once inductor has to make them constants: a second trace."""
    import torch._dynamo.config
    import torch._inductor.config

    stack = contextlib.ExitStack()
    stack.enter_context(torch._dynamo.config.patch(specialize_float=True))
    if frozen:
        stack.enter_context(torch._inductor.config.patch(freezing=True))
    return stack


def _twice(x: Tensor, k_prev: Tensor, v_prev: Tensor, index: Tensor | None,
           prev_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """The step's per-row inputs for one sentence (R rows) as for two copies of it (2R rows; its per-sentence inputs
    are doubled once per sentence, :meth:`CompiledStep._as_two`): torch specialises a dimension of size 1, so a lone
    sentence would need a graph of its own; as two sentences it runs in the graph built for several, for the cost of
    computing R more rows."""
    def two(t: Tensor, dim: int) -> Tensor:
        return torch.cat([t, t], dim)

    x = two(x, 0)  # [R, 1, D] -> [2R, 1, D]
    if index is None:  # gathered [w, layers, R, h, d] -> [w, layers, 2R, h, d]
        k_prev, v_prev = two(k_prev, 2), two(v_prev, 2)
    else:  # the rows to gather [layers, w, R] -> [layers, R, w] -> [layers, 2R, w] -> [layers, w, 2R]: each row twice,
        # laid out as DecoderState.prefix lays them out (w contiguous), which the graph's guards check
        index = two(index.transpose(1, 2), 1).transpose(1, 2)
    prev_mask = None if prev_mask is None else two(prev_mask, 0)  # [R, 1, 1, w] -> [2R, 1, 1, w]
    return x, k_prev, v_prev, index, prev_mask


def mark_step_dynamic(x: Tensor, k_prev: Tensor, v_prev: Tensor, index: Tensor | None, prev_mask: Tensor | None,
                      cross: list[tuple[Tensor, Tensor]], src_mask: Tensor) -> None:
    """Tell ``torch.compile`` which dimensions of the step's inputs vary from call to call (:func:`step_dynamic_dims`),
    so that it builds one graph for all of them rather than one per shape."""
    for tensor, dim, _ in step_dynamic_dims(x, k_prev, v_prev, index, prev_mask, cross, src_mask):
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


def step_dynamic_dims(x: Tensor, k_prev: Tensor, v_prev: Tensor, index: Tensor | None, prev_mask: Tensor | None,
                      cross: list[tuple[Tensor, Tensor]], src_mask: Tensor) -> list[tuple[Tensor, int, str]]:
    """The ``(tensor, dim, size)`` of the step's inputs that vary from call to call, ``size`` naming which: ``rows``
    R, ``cache`` (the flat cache's size), ``positions`` w (cached), ``sentences`` n, ``source`` S (the rest are the
    model's sizes)."""
    dims = [(x, 0, "rows"), (src_mask, 0, "sentences"), (src_mask, 3, "source")]
    if index is not None:  # the flat cache [N, h * d] and the rows to gather [layers, w, R]
        dims += [(k_prev, 0, "cache"), (v_prev, 0, "cache"), (index, 1, "positions"), (index, 2, "rows")]
    else:  # gathered [w, layers, R, h, d]
        dims += [(k_prev, 0, "positions"), (k_prev, 2, "rows"), (v_prev, 0, "positions"), (v_prev, 2, "rows")]
    dims += [(kv, d, size) for pair in cross for kv in pair for d, size in ((0, "sentences"), (2, "source"))]
    if prev_mask is not None:
        dims += [(prev_mask, 0, "rows"), (prev_mask, 3, "positions")]  # [R, 1, 1, w]
    return dims


class CompiledStep:
    """``model``'s step compiled (``mode`` ``jit``, or ``aot``: packaged ahead of time, float32 on CPU only; the
    module docstring), for :meth:`mtpipe.engine.variants.Prepared.step`."""

    def __init__(self, model: Any, mode: str, lone_graph: bool = False, cache: Any = None) -> None:
        from mtpipe.engine.step_package import PackageCache, PackagedStep

        weight = next(model.parameters())
        on_cpu = weight.device.type == "cpu"
        separate_compile_cache()
        compiled = torch.compile(model.step, dynamic=True, options={"cpp_wrapper": True} if on_cpu else None)
        self.frozen = on_cpu and weight.dtype == torch.float32
        if self.frozen and mode == "aot":
            # built once and kept on disk; torch.compile's step only where the package does not apply
            compiled = PackagedStep(model, compiled, step_dynamic_dims, cache or PackageCache())
        self.fn: Callable[..., tuple[Tensor, Tensor, Tensor]] = compiled
        self.lone_graph = lone_graph
        # a lone sentence's encoder keys/values and source mask, doubled for the step that runs it as two
        self._lone_twin: tuple[list, list[tuple[Tensor, Tensor]], Tensor] | None = None

    def __call__(self, x: Tensor, k_prev: Tensor, v_prev: Tensor, index: Tensor | None, prev_mask: Tensor | None,
                 state: DecoderState) -> tuple[Tensor, Tensor, Tensor]:
        """The step on the newest position ``x`` ``[R, 1, D]`` and the cache as :meth:`DecoderState.prefix` gives it:
        the top of the stack ``[R, D]`` and the new keys/values ``[layers, R, h, d]``."""
        if k_prev.size(1) * k_prev.element_size() < _GATHER_IN_GRAPH_BYTES:
            # Short rows (a position's keys of one layer): gathered here, in one copy, before the graph.
            k_prev, v_prev = state.gathered(state.length - index.size(1))  # [w, layers, R, h, d]
            index = None
        rows, cross, src_mask = x.size(0), state.cross, state.src_mask
        lone = src_mask.size(0) == 1 and not self.lone_graph
        if lone:
            x, k_prev, v_prev, index, prev_mask = _twice(x, k_prev, v_prev, index, prev_mask)
            cross, src_mask = self._as_two(cross, src_mask)
        mark_step_dynamic(x, k_prev, v_prev, index, prev_mask, cross, src_mask)
        try:
            # The settings are read while a graph is traced, which happens inside the call: entered here only when
            # the caller has not entered them around the whole decode (settings)
            with contextlib.nullcontext() if getattr(_entered, "frozen", None) is self.frozen else \
                    _settings(self.frozen):
                h, k_new, v_new = self.fn(x, k_prev, v_prev, prev_mask, cross, src_mask, index)
        except torch._dynamo.exc.TorchDynamoException as e:  # building the graph failed (e.g. no C++ compiler)
            first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
            raise MtpipeError(f"decode.compile: torch.compile could not build the decoder step ({first.strip()}); "
                              "decode without --compile") from e
        # a lone sentence ran as two copies of itself: the first copy's rows
        return (h[:rows], k_new[:, :rows], v_new[:, :rows]) if lone else (h, k_new, v_new)

    def _as_two(self, cross: list[tuple[Tensor, Tensor]],
                src_mask: Tensor) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
        """A lone sentence's encoder keys/values ``[1, h, S, d] -> [2, h, S, d]`` and source mask ``[1, 1, 1, S] ->
        [2, 1, 1, S]``, copied once per sentence (views with stride 0 would fail the graph's guards on strides and
        build another graph)."""
        twin = self._lone_twin  # read once: another thread's decode may replace it
        if twin is None or twin[0] is not cross:
            twin = (cross, [(k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1)) for k, v in cross],
                    src_mask.repeat(2, 1, 1, 1))
            self._lone_twin = twin
        return twin[1], twin[2]

    @contextlib.contextmanager
    def settings(self) -> Iterator[None]:
        """The torch settings (:func:`_settings`) for the graphs traced inside the block, in this thread: entered once
        around a whole decode (a file's batches, a server's decoding loop) rather than by every step, since entering
        torch's config patches costs more than a server's step of a few sentences can spare."""
        outer = getattr(_entered, "frozen", None)
        with _settings(self.frozen):
            _entered.frozen = self.frozen
            try:
                yield
            finally:
                _entered.frozen = outer


__all__ = ["CompiledStep", "mark_step_dynamic", "step_dynamic_dims"]
