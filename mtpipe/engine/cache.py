"""Incremental decoding's state (section 3.2.3's masked decoder self-attention, computed one position at a time):
every decoder layer's self-attention keys/values so far and each sentence's encoder keys/values.

:class:`DecoderState` is what :meth:`mtpipe.engine.variants.Prepared.step` reads and writes; its ``select`` reorders or
shrinks the batch in beam search, and its ``admit`` lets new sentences join a running batch (continuous batching,
:mod:`mtpipe.engine.streaming`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mtpipe.errors import MtpipeError




class SelfAttentionCache:
    """Every decoder layer's self-attention keys/values so far, stored time-major: ``keys``
    ``[capacity, layers, slots, h, d_k]`` and ``values`` likewise. Step p writes its rows' keys/values into slots
    ``0 .. R_p - 1`` of position p, once, and nothing moves them afterwards: which slot holds a row's position p is
    :class:`DecoderState`'s ``slots`` table.

    Why a table instead of reordering: in beam search a hypothesis continues another row's prefix, so the rows'
    cached prefixes change order at every step (and shrink as sentences finish). Gathering the whole cache into the
    new order each step copied ``t x layers x R x h x d`` values twice over (keys and values), a real share of a
    decode's CPU time in large batches; the table's reorder copies ``R x capacity`` integers, and attention reads each
    row's keys through the table (:meth:`DecoderState.prefix`). Growing (doubling the capacity, or more slots when
    the rows outgrow them) gathers the live rows' written prefix into a new cache, once.
    """

    def __init__(self, keys: Tensor, values: Tensor):
        self.keys, self.values = keys, values  # [capacity, layers, slots, h, d]

    @staticmethod
    def allocate(like: Tensor, shape: tuple[int, ...], d_k: int, d_v: int) -> SelfAttentionCache:
        """A cache of ``shape`` = (capacity, layers, slots, heads), in ``like``'s dtype and device."""
        return SelfAttentionCache(like.new_empty(*shape, d_k), like.new_empty(*shape, d_v))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.keys.shape[:4])

    def flat(self) -> tuple[Tensor, Tensor]:
        """Keys and values as ``[capacity * layers * slots, h * d]``: row ``(p * layers + l) * slots + s`` is layer
        l's key (value) of position p in slot s. The form :meth:`mtpipe.model.transformer.Transformer.step` gathers
        from."""
        return (self.keys.view(-1, self.keys.size(-2) * self.keys.size(-1)),
                self.values.view(-1, self.values.size(-2) * self.values.size(-1)))


@dataclass
class DecoderState:
    """What incremental decoding carries from step to step: R = n * ``beams`` rows, the beams of each of the n
    sentences in consecutive rows.

    Per sentence (shared by its beams): ``src_mask`` ``[n, 1, 1, S]`` and ``cross[l]``, layer l's encoder
    keys/values ``[n, h, S, d]`` (projected once, :meth:`mtpipe.engine.variants.Prepared.start`). Per row: the
    self-attention keys/values
    of the ``length`` positions decoded so far, in the :class:`SelfAttentionCache` (allocated at the first step) at
    the slots ``slots[r, p]`` (``[R, capacity]``; position p of row r).

    :meth:`select` reorders and shrinks the rows by reordering ``slots`` (never the cache); :meth:`write` adds a
    position in place. Contract: :meth:`mtpipe.engine.variants.Prepared.step` writes position ``length`` of this
    state's cache and
    returns a state that shares it, and states made by :meth:`select` share it too, so only the newest state may be
    stepped.
    """

    src_mask: Tensor
    cross: list[tuple[Tensor, Tensor]]
    cache: SelfAttentionCache | None = None
    slots: Tensor | None = None  # [R, capacity] int64: the cache slot of each row's position p (p < length)
    length: int = 0
    beams: int = 1  # rows per sentence: 1 until the first select widens the beam
    # Continuous batching (:meth:`admit`): each row's first cache slot ``[R]``, its position 0; None = all rows 0.
    start: Tensor | None = None

    def prefix(self, like: Tensor, layers: int, heads: int, d_k: int, d_v: int,
               window: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """What :meth:`mtpipe.model.transformer.Transformer.step` reads the earlier positions from: the cache's keys
        and values
        ``[N, h * d]`` (:meth:`SelfAttentionCache.flat`; empty, in ``like``'s dtype, before the first step), the rows
        of them holding each layer's positions ``[layers, w, R]`` (w = the ``length`` positions decoded so far, or
        the last ``window`` of them for restricted self-attention), and their mask ``[R, 1, 1, w]`` (False: the
        slots before a row's ``start``), or None when every row started at slot 0."""
        t, rows = self.length, like.size(0)
        w = min(t, window) if window else t
        if self.cache is None or t == 0:
            keys, values = like.new_empty(0, heads * d_k), like.new_empty(0, heads * d_v)
            index = torch.zeros(layers, 0, rows, dtype=torch.long, device=like.device)
        else:
            keys, values = self.cache.flat()
            index = self._flat_rows(t - w)  # [layers, w, R]
        mask = None
        if self.start is not None:
            slots = torch.arange(t - w, t, device=self.start.device)
            mask = (slots[None, :] >= self.start[:, None])[:, None, None, :]  # [R, w] -> [R, 1, 1, w]
        return keys, values, index, mask

    def _flat_rows(self, first: int) -> Tensor:
        """The rows of the flat cache (:meth:`SelfAttentionCache.flat`) that hold each layer's positions ``first`` ..
        ``length - 1`` of each row, ``[layers, t', R]``: row ``(p * layers + l) * slots + slots[r, p]``."""
        assert self.cache is not None and self.slots is not None
        layers, slots_per_position = self.cache.keys.shape[1:3]
        positions = torch.arange(first, self.length, device=self.slots.device)  # [t']
        layer = torch.arange(layers, device=self.slots.device)
        return ((positions[None, :, None] * layers + layer[:, None, None]) * slots_per_position
                + self.slots[:, first : self.length].t()[None])  # [R, t'] -> [t', R] -> [1, t', R]

    def gathered(self, first: int = 0, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """The cached keys and values of positions ``first`` .. ``length - 1`` in the rows' order,
        ``[length - first, layers, R, h, d]``: a copy, into ``out`` when given (contiguous tensors of that shape).
        The CUDA graphs' buffers take them in this form (:mod:`mtpipe.engine.cuda_graphs`), and :meth:`_compacted`."""
        index = self._flat_rows(first).transpose(0, 1)  # [layers, t', R] -> [t', layers, R]
        shape = index.shape
        index = index.reshape(-1)  # -> [t' * layers * R]
        assert self.cache is not None
        result = []
        for flat, store, into in zip(self.cache.flat(), (self.cache.keys, self.cache.values), out or (None, None)):
            got = (flat.index_select(0, index) if into is None  # [t' * layers * R, h * d]
                   else torch.index_select(flat, 0, index, out=into.view(-1, flat.size(1))))
            result.append(got.view(*shape, *store.shape[3:]))  # -> [t', layers, R, h, d]
        return result[0], result[1]

    def _compacted(self, first: int, capacity: int) -> tuple[SelfAttentionCache, Tensor]:
        """A new cache of ``capacity`` positions with a slot per row, holding this state's positions ``first`` ..
        ``length - 1`` gathered in the rows' order (one copy of the live rows; the slots of rows that left are not
        carried over), and its slots table."""
        assert self.cache is not None and self.slots is not None
        t, rows = self.length - first, self.slots.size(0)
        _, layers, _, heads = self.cache.shape
        new = SelfAttentionCache.allocate(self.cache.keys, (capacity, layers, rows, heads), self.cache.keys.size(-1),
                                          self.cache.values.size(-1))
        self.gathered(first, out=(new.keys[:t], new.values[:t]))  # [t, layers, R, h, d], contiguous prefixes
        table = torch.zeros(rows, capacity, dtype=torch.long, device=self.slots.device)
        table[:, :t] = torch.arange(rows, device=self.slots.device)[:, None]
        return new, table

    def write(self, k: Tensor, v: Tensor) -> None:
        """Write every layer's keys/values ``[layers, R, h, d]`` of position ``length`` into the cache (in place):
        row r into slot r."""
        t, rows = self.length, k.size(1)
        if self.cache is None or self.cache.keys.size(0) <= t or self.cache.keys.size(2) < rows:
            self._grow(k, v)
        assert self.cache is not None and self.slots is not None
        self.cache.keys[t, :, :rows] = k
        self.cache.values[t, :, :rows] = v
        self.slots[:, t] = torch.arange(rows, device=self.slots.device)

    def _grow(self, k: Tensor, v: Tensor) -> None:
        """Allocate the cache at the first step (16 positions, enough for most sentences, and a slot per row); when
        the positions are full (double them) or the rows outnumber the slots (after the first step's beam widening,
        or sentences that joined), a new cache with a slot per row, the written prefix gathered into it in the rows'
        order: one copy of the live rows (the slots of rows that left are not carried over)."""
        t, (layers, rows, heads) = self.length, k.shape[:3]
        old = self.cache
        if old is not None and t > 0:
            self.cache, self.slots = self._compacted(0, old.keys.size(0) * (2 if old.keys.size(0) <= t else 1))
            return
        # In the keys' own dtype (bf16 when decoding in bf16): with attention as two matmuls (mtpipe.model.ops) a bf16
        # cache is faster than a float32 one, which would cast every new key/value and every query.
        self.cache = SelfAttentionCache.allocate(k, (16, layers, rows, heads), k.size(-1), v.size(-1))
        self.slots = torch.zeros(rows, 16, dtype=torch.long, device=k.device)

    def select(self, index: Tensor, beams: int | None = None) -> DecoderState:
        """A state of rows ``index`` of this one (beam reordering, finished sentences leaving the batch), grouped
        ``beams`` consecutive rows per sentence (default: as now). Each group's sentence is that of its first row;
        the per-sentence tensors are copied only when the sentences change; the cache is not copied (the rows'
        ``slots`` are), except in a continuous batch when the oldest positions are no one's any more."""
        beams = self.beams if beams is None else beams
        n_new = index.numel() // beams
        sentences = index.view(n_new, beams)[:, 0] // self.beams  # [n'*beams] -> [n', beams] -> [n']
        src_mask, cross = self.src_mask, self.cross
        if n_new != src_mask.size(0) or not torch.equal(sentences, torch.arange(n_new, device=index.device)):
            src_mask = src_mask.index_select(0, sentences)
            cross = [(k.index_select(0, sentences), v.index_select(0, sentences)) for k, v in cross]
        t = self.length
        start, first = self.start, 0
        if start is not None:
            # Continuous batching: the slots before every kept row's start belonged to rows that have left; the copy
            # below drops them, so a batch that never empties keeps its cache (and attention span) bounded.
            start = start.index_select(0, index)
            first = int(start.min())
            start = start - first if bool((start != first).any()) else None  # None: every row starts at slot 0
        if self.cache is None or t == 0:
            return DecoderState(src_mask, cross, length=t, beams=beams, start=start)
        assert self.slots is not None
        slots = self.slots.index_select(0, index)  # [R', capacity]
        if first == 0:
            return DecoderState(src_mask, cross, self.cache, slots, t, beams, start)
        # The positions before `first` are dropped: the kept rows' positions first..t-1 gathered into a new cache.
        new, table = DecoderState(src_mask, cross, self.cache, slots, t, beams)._compacted(first, self.cache.shape[0])
        return DecoderState(src_mask, cross, new, table, t - first, beams, start)

    def admit(self, fresh: DecoderState) -> DecoderState:
        """Continuous batching: this state's rows, then ``fresh``'s sentences
        (:meth:`mtpipe.engine.variants.Prepared.start`: one row
        each, nothing decoded yet) with ``beams`` rows each, joining at position ``length`` of the cache.

        The per-sentence encoder tensors are padded to the longer source (padding masked in ``src_mask``); the new
        rows' positions before ``length`` are hidden by their key mask, and their positions count from their
        ``start`` (:meth:`mtpipe.engine.variants.Prepared.step`), so a sentence decodes as it would alone."""
        if fresh.length != 0 or fresh.cache is not None or fresh.beams != 1:
            raise MtpipeError("DecoderState.admit: the joining sentences must be fresh (Prepared.start)")
        beams, t = self.beams, self.length
        width = max(self.src_mask.size(-1), fresh.src_mask.size(-1))

        def pad(x: Tensor, dim: int, value: float | bool) -> Tensor:  # along the source positions, to `width`
            extra = width - x.size(dim)
            if extra == 0:
                return x
            shape = list(x.shape)
            shape[dim] = extra
            return torch.cat([x, x.new_full(shape, value)], dim=dim)

        src_mask = torch.cat([pad(self.src_mask, -1, False), pad(fresh.src_mask, -1, False)])  # [n+m, 1, 1, S]
        cross = [(torch.cat([pad(k, 2, 0.0), pad(k2, 2, 0.0)]), torch.cat([pad(v, 2, 0.0), pad(v2, 2, 0.0)]))
                 for (k, v), (k2, v2) in zip(self.cross, fresh.cross)]  # each [n+m, h, S, d]
        old_rows = self.src_mask.size(0) * beams
        rows = old_rows + fresh.src_mask.size(0) * beams
        device = self.src_mask.device
        start = torch.cat([self.start if self.start is not None else torch.zeros(old_rows, dtype=torch.long,
                                                                                 device=device),
                           torch.full((rows - old_rows,), t, dtype=torch.long, device=device)])  # [R + m*beams]
        if self.cache is None or t == 0:
            return DecoderState(src_mask, cross, length=t, beams=beams, start=start)
        assert self.slots is not None
        # The joining rows' positions before `length` are hidden by the key mask; their slots point at slot 0, which
        # every position has written (finite values: a masked weight is exactly 0, and 0 * NaN would be NaN). Their
        # own positions get slots when the next step writes more rows than the cache has (DecoderState.write).
        slots = torch.cat([self.slots, self.slots.new_zeros(rows - old_rows, self.slots.size(1))])  # [R + m*beams, T]
        return DecoderState(src_mask, cross, self.cache, slots, t, beams, start)

