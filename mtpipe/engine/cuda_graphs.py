"""The decoding step as CUDA graphs over fixed shapes (``decode.cuda_graphs``).

Why: on a GPU a decoding step of a few sentences is bound by the host, not the device: the host launches ~200 kernels
a step and pays for dispatch around each operation, while the kernels themselves take a fraction of that. A CUDA graph
records those launches once and replays them with one call, so the decoder stack, the pre-softmax projection and the
log-softmax (section 3.4) of a step cost one launch instead of ~200.

A graph replays fixed shapes and fixed addresses, while a step's shapes change all the time: the rows shrink as
sentences finish, the self-attention cache grows by one position per step, and each batch has its own source length.
So each graph is built for a *bucket* -- sentences ``n``, beams per sentence, source positions ``S`` and cached
positions ``t``, each but the beams rounded up to a power of two -- over static buffers at that bucket's size:

* the rows past a step's real ones are padding whose outputs are never read (rows never interact: each attends only
  to its own cache slots and its own sentence's source);
* the cache is held at the bucket's capacity and the positions at or past ``t`` (and, in a continuous batch, before
  a row's start) are masked out of self-attention, which gives them weight exactly 0;
* the source is padded to the bucket's length and the padding masked, as any batch's padding is.

Before each replay the step's inputs are copied into the bucket's buffers (the new position's embedded input, the
cache prefix, the length; the encoder keys/values only when the sentences those buffers hold are not the step's);
the graph writes its outputs into output buffers, read by the beam search before the next step. Buckets of the same
sizes share their buffers (one graph replays at a time), so memory grows with the distinct sizes met rather than
with the number of graphs (the cache buffers, powers of two in rows and positions, add up to at most ~4x a cache of
the largest rows and positions met), and the graphs share one memory pool. A bucket's graph is recorded the first
time the bucket is met (a few milliseconds; ``mtpipe serve``'s warm-up meets the common ones). Where a bucket's
buffers or graph cannot be made (GPU memory, a driver or an operation that does not allow recording), decoding warns
once and takes the eager step from then on.

A graph reads the weights at the addresses they had when it was recorded: the graphs belong to the prepared variant
they were recorded for (:func:`mtpipe.engine.variants.prepare`), a snapshot; weights that move (``model.to(...)``) need
a new one. Batches of more than :data:`MAX_ROWS` rows, restricted self-attention (its window is the
*last* r cached positions, which padding would move) and compiled steps keep the eager step.

``capture=False`` runs the same padded computation without recording a graph: how the tests check on a CPU that
bucketing, padding and masking leave every hypothesis as the eager step finds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

# Rows (sentences x beams) above which the eager step runs: a full batch's step keeps a GPU busy on its own, and each
# bucket holds its cache at capacity (rows x positions x layers x d).
MAX_ROWS = 256
_LEAST_POSITIONS = 16  # the smallest cache bucket (a step's cached positions, rounded up to a power of two)
_LEAST_SOURCE = 32  # the smallest source bucket


def bucket(n: int, least: int = 1) -> int:
    """The smallest power of two that is at least ``n`` and ``least``."""
    return max(least, 1 << max(0, n - 1).bit_length())


@dataclass(eq=False)
class _Bucket:
    """One graph's static inputs and outputs (see the module docstring): views of :class:`GraphedStep`'s buffers,
    which buckets of the same sizes share (a graph reads and writes them only while it replays, and one graph replays
    at a time)."""

    x: Tensor  # [R', 1, D] the new position's embedded input
    keys: Tensor  # [T', layers, R', h, d_k] the self-attention cache at capacity
    values: Tensor  # [T', layers, R', h, d_v]
    start: Tensor  # [R', 1] each row's first cache slot (continuous batching; else 0)
    length: Tensor  # [1] the cached positions t of this step
    slots: Tensor  # [T'] 0 .. T'-1
    cross: list[tuple[Tensor, Tensor]]  # per layer [n', h, S', d]
    src_mask: Tensor  # [n', 1, 1, S']
    logp: Tensor  # [R', V] float32: the outputs, written by the graph
    k_new: Tensor  # [layers, R', h, d_k]
    v_new: Tensor  # [layers, R', h, d_v]
    sources_key: tuple  # the key of the cross / src_mask buffers (GraphedStep.loaded)
    start_key: tuple  # the key of the start buffer (GraphedStep.started)
    graph: Any = None  # torch.cuda.CUDAGraph once recorded


class GraphedStep:
    """The decoding step (:meth:`mtpipe.model.transformer.Transformer.step`), its projection ``project`` and the
    log-softmax replayed from CUDA graphs, one per bucket of shapes (module docstring). ``model`` is the decoding
    variant (the bf16 copy for bf16)."""

    def __init__(self, model: Any, project: Callable[[Tensor], Tensor], capture: bool = True,
                 max_rows: int | None = None):
        self.model, self.project, self.capture = model, project, capture
        self.max_rows = MAX_ROWS if max_rows is None else max_rows
        self.buckets: dict[tuple, _Bucket] = {}
        # Static buffers by what they hold and their sizes, shared by the buckets that need the same: memory grows
        # with the distinct sizes met, not with the number of graphs.
        self.buffers: dict[tuple, Any] = {}
        self.loaded: dict[tuple, Tensor] = {}  # cross / src_mask buffers -> the src_mask whose sentences they hold
        self.started: dict[tuple, bool] = {}  # start buffer -> whether it holds anything but zeros
        self.pool: Any = None  # the graphs' shared memory pool (one graph replays at a time)

    def _forget(self) -> None:
        self.buckets.clear()
        self.buffers.clear()
        self.loaded.clear()
        self.started.clear()
        self.pool = None

    def takes(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows runs from a graph."""
        return rows <= self.max_rows

    def __call__(self, x: Tensor, state: Any) -> tuple[Tensor, Tensor, Tensor] | None:
        """The step for the new position's input ``x`` ``[R, 1, D]`` and ``state``
        (:class:`mtpipe.engine.cache.DecoderState`): log-probabilities ``[R, V]`` (float32) and the new position's
        keys / values ``[layers, R, h, d]``, views of buffers that the next call overwrites; or None where a bucket's
        buffers or graph could not be made (GPU memory, a driver or an operation that does not allow recording): then
        a warning, and the eager step from now on."""
        rows, t = x.size(0), state.length
        n, source = state.src_mask.size(0), state.src_mask.size(-1)
        beams = rows // n
        kv_dtype = state.cache.keys.dtype if state.cache is not None else self._kv_dtype(x)
        key = (bucket(n), beams, bucket(source, _LEAST_SOURCE), bucket(t, _LEAST_POSITIONS), x.dtype, kv_dtype)
        b = self.buckets.get(key)
        fresh = b is None
        if b is None:
            try:
                b = self.buckets[key] = self._allocate(key, x)
            except (RuntimeError, AssertionError) as e:  # torch.OutOfMemoryError is a RuntimeError
                self._give_up(e)
                return None
        b.x[:rows].copy_(x)
        if t:
            keys, values = state.gathered()  # [t, layers, R, h, d], the rows' order
            b.keys[:t, :, :rows].copy_(keys)  # into [T', layers, R', h, d]
            b.values[:t, :, :rows].copy_(values)
        b.length.fill_(t)
        if state.start is not None:
            b.start[:rows, 0].copy_(state.start)
            self.started[b.start_key] = True
        elif self.started.get(b.start_key):
            b.start.zero_()
            self.started[b.start_key] = False
        if self.loaded.get(b.sources_key) is not state.src_mask:  # other sentences: their encoder keys/values, mask
            b.src_mask[:n, ..., :source].copy_(state.src_mask)
            b.src_mask[:n, ..., source:] = False
            for (k, v), (kb, vb) in zip(state.cross, b.cross):
                kb[:n, :, :source].copy_(k)
                vb[:n, :, :source].copy_(v)
            self.loaded[b.sources_key] = state.src_mask  # kept: its identity is the marker
        if not self.capture:
            self._body(b)
        elif fresh:
            try:
                self._record(b)
            except (RuntimeError, AssertionError) as e:  # what torch raises where a graph cannot be recorded
                self._give_up(e)
                return None
        else:
            b.graph.replay()
        return b.logp[:rows], b.k_new[:, :rows], b.v_new[:, :rows]

    def _give_up(self, error: BaseException) -> None:
        """A bucket's buffers or graph could not be made: say so once, free what the graphs held and take the eager
        step from now on, which gives the same translations."""
        from mtpipe.console import warn

        first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        warn(f"decode.cuda_graphs: a CUDA graph of the decoding step could not be made ({first}); decoding with "
             "the eager step (--no-cuda-graphs skips the attempt)")
        self.max_rows = -1  # takes() is False from now on
        self._forget()

    @staticmethod
    def _kv_dtype(x: Tensor) -> torch.dtype:
        """The cache's dtype before it exists: the keys' dtype, autocast's where it is on (bf16 decoding)."""
        device = x.device.type
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype

    def _buffer(self, key: tuple, make: Callable[[], Any]) -> Any:
        if key not in self.buffers:
            self.buffers[key] = make()
        return self.buffers[key]

    def _allocate(self, key: tuple, x: Tensor) -> _Bucket:
        n, beams, source, positions, dtype, kv_dtype = key
        cfg, device = self.model.cfg, x.device
        rows, layers, heads = n * beams, len(self.model.decoder), cfg.heads
        vocab = self.model.vocab_size

        # Zeros, not garbage: masked slots get weight 0, and 0 x NaN would be NaN.
        def zeros(*shape: int, dt: torch.dtype = kv_dtype) -> Tensor:
            return torch.zeros(shape, dtype=dt, device=device)

        def sources() -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
            cross = [(zeros(n, heads, source, cfg.d_k), zeros(n, heads, source, cfg.d_v)) for _ in range(layers)]
            # padding sentences may attend to their first position, so that none of their rows is all -inf
            return cross, torch.ones(n, 1, 1, source, dtype=torch.bool, device=device)

        sources_key, start_key = ("sources", n, source, kv_dtype), ("start", rows)
        cross, src_mask = self._buffer(sources_key, sources)
        keys, values = self._buffer(("cache", positions, rows, kv_dtype),
                                    lambda: (zeros(positions, layers, rows, heads, cfg.d_k),
                                             zeros(positions, layers, rows, heads, cfg.d_v)))
        logp, k_new, v_new = self._buffer(("out", rows, kv_dtype),
                                          lambda: (zeros(rows, vocab, dt=torch.float32),
                                                   zeros(layers, rows, heads, cfg.d_k),
                                                   zeros(layers, rows, heads, cfg.d_v)))
        return _Bucket(
            x=self._buffer(("x", rows, dtype), lambda: zeros(rows, 1, cfg.d_model, dt=dtype)),
            keys=keys, values=values,
            start=self._buffer(start_key, lambda: zeros(rows, 1, dt=torch.long)),
            length=self._buffer(("length",), lambda: zeros(1, dt=torch.long)),
            slots=self._buffer(("slots", positions), lambda: torch.arange(positions, device=device)),
            cross=cross, src_mask=src_mask, logp=logp, k_new=k_new, v_new=v_new,
            sources_key=sources_key, start_key=start_key,
        )

    def _body(self, b: _Bucket) -> None:
        """The step on the bucket's buffers, its results written into the output buffers: what a graph records."""
        m = self.model
        # [R', 1] vs [T'] -> [R', T'] -> [R', 1, 1, T']: a row attends to its own slots start .. t-1 (and itself)
        prev_mask = ((b.slots >= b.start) & (b.slots < b.length))[:, None, None, :]
        h, k_new, v_new = m.step(b.x, b.keys, b.values, prev_mask, b.cross, b.src_mask)
        torch.log_softmax(self.project(h), dim=-1, dtype=torch.float32, out=b.logp)  # [R', V]
        b.k_new.copy_(k_new)
        b.v_new.copy_(v_new)

    def _record(self, b: _Bucket) -> None:
        """Warm up on a side stream (kernel choice, cuBLAS's workspace), then record the bucket's graph and replay it
        once for this step."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._body(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._body(b)
        self.pool = graph.pool()
        b.graph = graph
        graph.replay()


__all__ = ["GraphedStep", "MAX_ROWS", "bucket"]
