"""``mtpipe decode``: translate a bpe split or raw text, as the paper decodes (section 6.1: beam 4, alpha 0.6, maximum
output length input + 50, early termination).

The rules -- the length penalty and its score, the maximum output length, when a sentence stops -- are
:class:`mtpipe.engine.search.DecodeRules`, and the beam search is :func:`mtpipe.engine.search.beam_search` (its docstring states the
search). This module is mtpipe's own :class:`~mtpipe.engine.search.Engine` (:class:`MtpipeEngine`, :func:`translate`) and
the stage (:func:`run`: resolve the inputs -> translate -> write).

Speed: sentences are sorted by length and packed into batches of at most ``max_tokens`` padded source tokens; the
encoder runs once per batch and its keys/values are projected once (:meth:`Transformer.start`) and kept once per
sentence, its beams attending to them together; each step computes the new position only (self-attention cache
written in place, :meth:`Transformer.step`); sentences that are done leave the batch at once (``state.select``);
``torch.inference_mode`` and optional bf16 autocast (CPU and GPU); ``decode.compile``: the decoder's step compiled
(:meth:`~mtpipe.model.transformer.Transformer.compile_step`; float32 on CPU packaged on disk, :mod:`mtpipe.engine.step_package`).
``decode.processes`` N > 1: a file or a split is shared out among N decoding processes, each with its own copy of
the model and 1/N of the CPU threads, each decoding its own batches (:class:`mtpipe.engine.workers.DecodePool`), as
CTranslate2's ``inter_threads`` does.

Text from stdin (``--input -``) is translated as it arrives (:func:`stream_batches`): a line, with whatever else is
already waiting, is translated and its output flushed before more input is read, so typed input and a program that
waits for each answer get it at once; a file or a split is translated in length-sorted batches.

Blank input lines are not decoded: they give blank output lines (so paragraph breaks survive). Sources longer than
the model's ``max_positions`` are truncated (with a warning naming how many and the first id):
one output line per input line matters more for scoring than failing the whole run.

``decode.prune`` runs a LayerDrop-trained model with fewer layers (:func:`mtpipe.engine.pruning.prune_plan`: ``every_other``,
``every_other:RATE`` or ``enc:0,2,4;dec:0,2,4``), pruned on the fly; ``mtpipe average --prune`` writes such a model
as a checkpoint instead, which decodes with no flag.

``decode.engine=ctranslate2`` decodes through CTranslate2 (:class:`mtpipe.engine.ct2.Ct2Engine`) with the same
inputs, outputs and settings: ``--checkpoint`` is a ``mtpipe export`` directory or a checkpoint (exported to a
temporary directory first). Greedy output is mtpipe's; at beam > 1 CTranslate2 stops a sentence once
``beam x patience`` hypotheses have finished (fairseq's rule, ``decode.stop=finished``) whatever ``decode.stop``
says, and its own length penalty is |Y|^alpha, so ``gnmt`` is applied by re-ranking the hypotheses it finished
(scores are mtpipe's).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from mtpipe import artifacts, writing
from mtpipe.artifacts import EOS_ID, PAD_ID
from mtpipe.config import DecodeConfig, to_dict
from mtpipe.errors import MtpipeError
from mtpipe.engine.search import (
    DecodeRules,
    Engine,
    Hypothesis,
    StepFn,
    beam_search,
    max_source_len,
)

INPUT_SPLIT = "input"  # file name ({INPUT_SPLIT}.parquet / .txt) of the output when translating --input text


# --------------------------------------------------------------------------------------------------------------------
# Step functions: incremental (the model's cache) and the no-cache reference
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class PrefixState:
    """Decoding state without a cache: the encoder output and the whole target prefix ``[N, t]``."""

    memory: Tensor
    src_mask: Tensor
    prefix: Tensor

    def select(self, index: Tensor, beams: int | None = None) -> "PrefixState":
        return PrefixState(self.memory.index_select(0, index), self.src_mask.index_select(0, index),
                           self.prefix.index_select(0, index))


def uncached_step(model: Any) -> StepFn:
    """A step function that re-runs the whole decoder over the prefix each step (cross-attention keys/values
    included): the naive reference that the tests check the incremental path against and that
    ``bench/decode_speed.py`` measures against."""

    def step(tokens: Tensor, state: PrefixState) -> tuple[Tensor, PrefixState]:
        prefix = torch.cat([state.prefix, tokens[:, None]], dim=1)  # [N, t] -> [N, t+1]
        x = model.decode(prefix, state.memory, state.src_mask)  # [N, t+1, D]
        logp = F.log_softmax(model.logits(x[:, -1]).float(), dim=-1)  # [N, t+1, D] -> [N, D] -> [N, V]
        return logp, PrefixState(state.memory, state.src_mask, prefix)

    return step


# --------------------------------------------------------------------------------------------------------------------
# mtpipe's engine: batching and translation
# --------------------------------------------------------------------------------------------------------------------


def batches_by_tokens(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped into batches of at most ``max_tokens`` padded tokens, longest sentences first (a longer
    sentence alone over the budget gets a batch of its own). Sorting by length keeps padding, and so wasted
    encoder and cross-attention work, small."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = lengths[cur[0]] if cur else lengths[i]  # sorted longest first: the first one sets the padded width
        if cur and (len(cur) + 1) * width > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


@contextlib.contextmanager
def decoding_context(device: torch.device, precision: str) -> Iterator[None]:
    """What decoding steps run under: bf16 autocast for precision bf16 (matmuls in bf16, softmax/log-softmax in
    fp32; nothing for fp32), and on a GPU the attention kernels that suit a step's ever-changing shapes
    (:func:`mtpipe.model.kernels.attention_kernels`)."""
    from mtpipe.model.kernels import attention_kernels

    autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    with autocast, attention_kernels(device):
        yield


def bf16_copy(model: Any) -> Any:
    """A copy of ``model`` with bf16 weights for bf16 decoding. Autocast casts every float32 weight again at every
    matmul (it caches casts only for tensors that track gradients): in a decode step, whose matmuls are small, that
    was ~10 % of the time. The positional encodings stay float32, as autocast would use them."""
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
    object.__setattr__(twin, "decoding_logits", projection)
    return twin


def decoding_device(spec: str, precision: str) -> torch.device:
    """``decode.device``: ``cpu``, ``cuda`` (an error when no GPU is visible) or ``auto``: the GPU when one is
    visible, except for int8 decoding, which runs on the CPU only (:func:`int8_copy`)."""
    if spec == "cuda":
        if not torch.cuda.is_available():
            raise MtpipeError("decode.device=cuda but no CUDA GPU is visible to this process")
        return torch.device("cuda")
    if spec == "auto" and precision != "int8" and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def decoding_model(model: Any, precision: str, device: torch.device, compile: bool = False,
                   cache: bool = True, cuda_graphs: bool = False, lone_graph: bool | None = None) -> Any:
    """``model`` as it decodes at ``precision``, in eval mode: its bf16 copy (:func:`bf16_copy`; not for the uncached
    step, which runs the float32 model under autocast), its int8 copy (:func:`int8_copy`, CPU only), or itself; with
    ``compile`` (``decode.compile``, the cached fp32 or bf16 step) its step set to run compiled (a lone sentence in a
    graph of its own with ``lone_graph``, None: as the model was set, :meth:`~mtpipe.model.transformer.Transformer.compile_step`),
    else with ``cuda_graphs`` on a GPU (``decode.cuda_graphs``) replayed from CUDA graphs."""
    model.eval()
    if precision == "int8" and device.type != "cpu":
        raise MtpipeError("decode.precision=int8 runs on CPU only; use bf16 on a GPU")
    if compile and (precision == "int8" or not cache):
        raise MtpipeError("decode.compile: applies to the cached fp32 and bf16 step, not to int8 decoding")
    if cache and precision == "bf16":
        model = bf16_copy(model)
    elif precision == "int8":
        model = int8_copy(model)
    if compile:
        model.compile_step(lone_graph)
    elif cuda_graphs and cache and device.type == "cuda":  # (int8 was refused above: it runs on CPU only)
        model.graph_step()
    return model.eval()


def translate(model: Any, sources: Sequence[Sequence[int]], cfg: DecodeConfig, device: torch.device | str = "cpu",
              cache: bool = True, on_done: Callable[[int], None] | None = None) -> list[list[Hypothesis]]:
    """Translate token-id sources (without EOS; at most ``max_positions - 1`` tokens) with beam search under the
    rules of ``cfg`` (:class:`~mtpipe.engine.search.DecodeRules`; the paper's section 6.1: beam 4, alpha 0.6, max length
    input + 50), in batches of ``cfg.max_tokens`` at ``cfg.precision``.

    Returns the ``cfg.nbest`` best hypotheses of every source, in input order. An empty source (a blank input line)
    is not decoded: its translation is empty, with score 0. ``cache=False`` re-decodes the whole prefix each step
    (:func:`uncached_step`; for tests and the benchmark).
    """
    return translate_batches(model, sources, DecodeRules.from_config(cfg), max_tokens=cfg.max_tokens,
                             precision=cfg.precision, device=device, cache=cache, on_done=on_done,
                             compile=cfg.compile, cuda_graphs=cfg.cuda_graphs)


def translate_batches(model: Any, sources: Sequence[Sequence[int]], rules: DecodeRules, *, max_tokens: int,
                      precision: str = "fp32", device: torch.device | str = "cpu", cache: bool = True,
                      on_done: Callable[[int], None] | None = None, compile: bool = False,
                      cuda_graphs: bool = False) -> list[list[Hypothesis]]:
    """:func:`translate` with the rules given as :class:`~mtpipe.engine.search.DecodeRules`; ``compile``: ``decode.compile``
    (:meth:`~mtpipe.model.transformer.Transformer.compile_step`), ``cuda_graphs``: ``decode.cuda_graphs``
    (:meth:`~mtpipe.model.transformer.Transformer.graph_step`)."""
    device = torch.device(device)
    max_positions = model.cfg.max_positions
    lengths = [len(s) + 1 for s in sources]  # + EOS
    results: list[list[Hypothesis]] = [[Hypothesis([], 0.0, 0.0)] if not s else [] for s in sources]
    todo = [i for i, s in enumerate(sources) if s]
    model = decoding_model(model, precision, device, compile, cache, cuda_graphs)
    step = (lambda tokens, state: model.step(tokens, state, lazy=True)) if cache else uncached_step(model)
    if on_done is not None and len(todo) < len(sources):
        on_done(len(sources) - len(todo))
    # decode.compile's settings entered once around the whole decode, not at every step; nothing for a model not
    # compiled (also where the caller compiled it: the engines pass their prepared model)
    settings = model.compile_settings() if cache else contextlib.nullcontext()
    with torch.inference_mode(), decoding_context(device, precision), settings:
        for sub in batches_by_tokens([lengths[i] for i in todo], max_tokens):
            batch = [todo[j] for j in sub]
            width = lengths[batch[0]]
            src = torch.full((len(batch), width), PAD_ID, dtype=torch.long)  # [B, S] right-padded
            for row, i in enumerate(batch):
                src[row, : lengths[i]] = torch.tensor([*sources[i], EOS_ID], dtype=torch.long)
            src = src.to(device)
            memory, src_mask = model.encode(src)  # once per batch; the beams share it
            if cache:
                state: Any = model.start(memory, src_mask)  # cross-attention keys/values projected once
            else:
                state = PrefixState(memory, src_mask, torch.zeros(len(batch), 0, dtype=torch.long, device=device))
            max_lens = [rules.max_output_len(lengths[i] - 1, max_positions) for i in batch]
            hyps = beam_search(step, state, max_lens, rules.beam, rules.penalty, rules.nbest, device, on_done,
                               rules.stop_after, start_id=model.start_id, min_len=rules.min_len)
            for i, h in zip(batch, hyps):
                results[i] = h
    return results


@dataclass
class MtpipeEngine:
    """mtpipe's beam search on a checkpoint's model, as an :class:`~mtpipe.engine.search.Engine`."""

    model: Any  # mtpipe.model.transformer.Transformer, on ``device``
    device: torch.device
    precision: str
    max_tokens: int
    threads: int = 0  # torch's CPU threads while translating (0: leave them)
    plan: Any = None  # the mtpipe.engine.pruning.PrunePlan applied (decode.prune), or None
    compile: bool = False  # decode.compile
    cuda_graphs: bool = False  # decode.cuda_graphs
    # decode.compile: a lone sentence in a graph of its own (Transformer.compile_step), for processes that translate
    # one sentence at a time for long (mtpipe serve, stdin) and build it once before the first; else it runs as two
    lone_graph: bool = False
    _prepared: Any = field(default=None, repr=False)  # :meth:`prepared`'s model, once made

    @classmethod
    def open(cls, model: Any, cfg: DecodeConfig, lone_graph: bool = False) -> "MtpipeEngine":
        """``model`` pruned by ``decode.prune`` and moved to the GPU when there is one; ``lone_graph``: see the
        field."""
        from mtpipe.engine import runtime
        from mtpipe.console import info
        from mtpipe.engine.pruning import prune, prune_plan

        plan = prune_plan(model.cfg, cfg.prune, where="decode.prune")
        if plan is not None:
            info(f"pruned (decode.prune={cfg.prune!r}): {plan.describe(model.cfg)}")
            model = prune(model, plan)
        device = decoding_device(cfg.device, cfg.precision)
        if device.type == "cpu":
            runtime.tune_cpu_allocator()
        return cls(model.to(device), device, cfg.precision, cfg.max_tokens, cfg.threads, plan, cfg.compile,
                   cfg.cuda_graphs, lone_graph)

    @property
    def max_positions(self) -> int:
        return self.model.cfg.max_positions

    def describe(self) -> str:
        return str(self.device)

    def settings(self, rules: DecodeRules) -> str:
        if rules.beam == 1:
            return self.precision  # greedy: no stopping rule to name
        return (f"{self.precision}, stop {rules.stop}"
                + (f" (patience {rules.patience:g})" if rules.stop == "finished" else ""))

    def note(self, rules: DecodeRules) -> str | None:
        return None

    def build(self, sources: Sequence[Sequence[int]], rules: DecodeRules) -> float:
        """``decode.compile``: build the compiled step's graph by decoding a few of ``sources`` (several sentences,
        then one alone, which runs in the same graph as two copies of itself) before the timed run (or, reading
        stdin, before the first line); the seconds it took."""
        if not self.compile or not sources:
            return 0.0
        start = time.perf_counter()
        self.translate(sources[:8], rules)
        self.translate(sources[:1], rules)
        return time.perf_counter() - start

    def prepared(self) -> Any:
        """The model as it decodes (:func:`decoding_model`: its bf16 or int8 copy or itself, with ``decode.compile``'s
        step), made on first use and kept. Once, not per call: stdin's lines and a server's requests are many calls,
        and each new copy would copy (or quantise) every weight again."""
        if self._prepared is None:
            self._prepared = decoding_model(self.model, self.precision, self.device, self.compile,
                                            cuda_graphs=self.cuda_graphs, lone_graph=self.lone_graph)
        return self._prepared

    def translate(self, sources: Sequence[Sequence[int]], rules: DecodeRules,
                  on_done: Callable[[int], None] | None = None) -> list[list[Hypothesis]]:
        threads_before = torch.get_num_threads()
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        try:
            # The prepared model is already in its precision: translate_batches only batches and searches, inside
            # the precision's autocast (bf16) entered here.
            with decoding_context(self.device, self.precision):
                return translate_batches(self.prepared(), sources, rules, max_tokens=self.max_tokens,
                                         precision="fp32", device=self.device, on_done=on_done)
        finally:
            torch.set_num_threads(threads_before)  # may be called in-process (tests, notebooks)


# --------------------------------------------------------------------------------------------------------------------
# The stage: resolve the inputs -> translate -> write
# --------------------------------------------------------------------------------------------------------------------


def validate(cfg: DecodeConfig) -> DecodeRules:
    """The decode params' rules that span several keys (each key's own range and choices are checked when the
    section is built, :mod:`mtpipe.config`); returns the decoding rules."""
    rules = DecodeRules.from_config(cfg)  # nbest <= beam
    if cfg.engine == "ctranslate2":
        if cfg.precision != "fp32":
            raise MtpipeError(f"decode.precision: {cfg.precision} applies to engine mtpipe; with engine ctranslate2 "
                              "set decode.ct2_compute_type (e.g. bfloat16, int8)")
        if cfg.prune:
            raise MtpipeError("decode.prune: not available with engine ctranslate2; write a pruned checkpoint with "
                              "`mtpipe average --prune` and decode (or export) that")
        if cfg.compile:
            raise MtpipeError("decode.compile: applies to engine mtpipe (CTranslate2 runs its own compiled code)")
    elif cfg.compile and cfg.precision == "int8":
        raise MtpipeError("decode.compile: applies to precision fp32 and bf16, not int8 (its quantised linear "
                          "layers are torch.ao modules that torch.compile does not fuse)")
    return rules


def text_lines(data: bytes, name: str, first: int = 1) -> list[str]:
    """Whole lines (``data`` without the newline that ends the last one) as text: UTF-8 (an error names the line,
    counting from ``first``), NFC-normalised and stripped as ``fetch`` cleans text (a trailing ``\\r`` included).

    Lines are split on ``\\n`` only, so the output has one line per input line.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first + data[: e.start].count(b"\n")
        raise MtpipeError(f"{name}: line {line} is not valid UTF-8") from None
    return [unicodedata.normalize("NFC", line).strip() for line in text.split("\n")]


def read_lines(path: Path) -> list[str]:
    """Raw text lines of a file or of stdin ('-') read to its end (:func:`text_lines`)."""
    name = "stdin" if str(path) == "-" else str(path)
    if str(path) == "-":
        stream = getattr(sys.stdin, "buffer", None)
        data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8")
    else:
        if not path.is_file():
            raise MtpipeError(f"{path}: input file not found")
        data = path.read_bytes()
    if not data:
        raise MtpipeError(f"{name}: empty input (no lines to translate)")
    return text_lines(data[:-1] if data.endswith(b"\n") else data, name)


STREAM_GATHER = 1 << 20  # bytes of input already waiting that one streaming batch takes at most
_READ = 1 << 16


def stdin_fd() -> int | None:
    """The file descriptor of stdin, or None when stdin is not a real file (a test runner's buffer)."""
    try:
        return sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def stream_batches(fd: int) -> Iterator[tuple[int, bytes]]:
    """``(number of the first line, whole lines)`` of ``fd`` as they arrive, for translating stdin line by line.

    Each batch blocks only for its first whole line (or the end of the input), then takes what else is already
    there without waiting (up to :data:`STREAM_GATHER` bytes): a line typed at a terminal, or written by a process
    that waits for its translation, is translated at once, while a pipe full of text is still translated in batches.
    """
    import select

    buf, line, eof = bytearray(), 1, False
    while not eof:
        found = b"\n" in buf
        while not eof and not found:
            chunk = os.read(fd, _READ)
            eof, found = not chunk, b"\n" in chunk
            buf += chunk
        while not eof and len(buf) < STREAM_GATHER and select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, _READ)
            eof = not chunk
            buf += chunk
        if eof:
            whole = bytes(buf[:-1] if buf.endswith(b"\n") else buf) if buf else None
            buf = bytearray()
        else:
            cut = buf.rindex(b"\n")
            whole, buf = bytes(buf[:cut]), buf[cut + 1 :]
        if whole is not None:
            yield line, whole
            line += whole.count(b"\n") + 1


@dataclass
class Inputs:
    """What a decode run translates, all checked before any work."""

    ids: list[int]  # the split's ids, or input line numbers
    sources: list[list[int]]  # token ids without EOS, cut to the model's positions
    split: str | None  # None: --input text
    desc: str  # where the sources come from (the log line and the manifest)
    sp: Any  # the SentencePiece model (sentencepiece.SentencePieceProcessor)
    step: int  # the checkpoint's training step
    upstream: dict[str, Path]  # the hypotheses manifest's lineage
    truncated: int  # sources cut to the model's positions
    pruned: dict[str, list[int]] | None  # decode.prune's kept layers


def read_sources(cfg: DecodeConfig, tokens: Path | None, input: Path | None,
                 sp: Any) -> tuple[list[int], list[list[int]], str | None, str]:
    """``(ids, sources, split, description)``: the split ``cfg.split`` of the bpe artifact, or the lines of
    ``input`` ('-' = stdin) encoded with ``sp``."""
    if input is None:
        assert tokens is not None, "a split is read from a bpe artifact"
        available = artifacts.splits_of(tokens, "tokens")
        if cfg.split not in available:
            raise MtpipeError(f"{tokens}: has no split '{cfg.split}' (decode.split; available: "
                              f"{', '.join(available)})")
        t = artifacts.read_table(tokens, f"{cfg.split}.parquet", "tokens", columns=["id", "src"])
        return t.column("id").to_pylist(), t.column("src").to_pylist(), cfg.split, f"{tokens}/{cfg.split}.parquet"
    lines = read_lines(input)
    return list(range(len(lines))), sp.encode(lines, out_type=int), None, "stdin" if str(input) == "-" else str(input)


@dataclass
class Model:
    """A checkpoint (or, with engine ctranslate2, an export) with its vocabulary checked; :meth:`open` starts the
    engine, the slow part, once the sources have been read and checked."""

    sp: Any  # the SentencePiece model (sentencepiece.SentencePieceProcessor)
    step: int  # the checkpoint's training step
    upstream: dict[str, Path]  # the hypotheses manifest's lineage
    open: Callable[[], tuple[Engine, dict[str, list[int]] | None]]  # -> (the engine, decode.prune's kept layers)


def open_model(cfg: DecodeConfig, checkpoint: Path, tokens: Path | None, processes: int = 1) -> Model:
    """The model and its SentencePiece model: that of ``tokens``, else the checkpoint's (or export's) own
    (:func:`mtpipe.engine.loading.vocab_source`), checked against the vocabulary it was trained with. ``processes`` > 1:
    the engine it opens is a :class:`~mtpipe.engine.workers.DecodePool` of that many processes (``decode.processes``)."""
    if cfg.engine == "ctranslate2":
        from mtpipe.engine import ct2 as engine_ct2

        manifest = engine_ct2.decode_source(checkpoint)  # a CTranslate2 export or a checkpoint, else one error line
        sp, step, used = engine_ct2.source_vocab(checkpoint, manifest, tokens)

        def open_ct2() -> tuple[Engine, dict[str, list[int]] | None]:
            return engine_ct2.Ct2Engine.open(checkpoint, manifest, used, cfg), None

        opener: Callable[[], tuple[Engine, dict[str, list[int]] | None]] = open_ct2
    else:
        loaded = _load_checkpoint(checkpoint, tokens)
        sp, step, used = loaded.sp, loaded.ck.step, loaded.tokens

        def open_mtpipe() -> tuple[Engine, dict[str, list[int]] | None]:
            engine = MtpipeEngine.open(loaded.model, cfg)
            return engine, _kept_layers(engine.plan)

        opener = open_mtpipe
    if processes > 1:
        def open_pool() -> tuple[Engine, dict[str, list[int]] | None]:
            from mtpipe.console import info
            from mtpipe.engine.pruning import prune_plan
            from mtpipe.engine.workers import DecodePool

            # the processes prune their copies by the same plan
            pruned = (_kept_layers(prune_plan(loaded.model.cfg, cfg.prune, where="decode.prune"))
                      if cfg.engine == "mtpipe" else None)
            info(f"starting {processes} decoding processes (decode.processes): each loads the model and warms up")
            return DecodePool(cfg, checkpoint, tokens, processes), pruned

        opener = open_pool
    upstream = {"checkpoint": checkpoint, **({"tokens": used} if used is not None else {})}
    return Model(sp, step, upstream, opener)


def _kept_layers(plan: Any) -> dict[str, list[int]] | None:
    """decode.prune's plan (:class:`mtpipe.engine.pruning.PrunePlan`, or None) as the hypotheses manifest records it."""
    return None if plan is None else {"encoder_kept": list(plan.encoder), "decoder_kept": list(plan.decoder)}


def fit_sources(sources: list[list[int]], max_positions: int,
                where: Callable[[int], str]) -> tuple[list[list[int]], int]:
    """``(sources cut to what the model takes with its EOS, how many were cut)``, with a warning naming the first
    (``where(row)``)."""
    from mtpipe.console import warn

    limit = max_source_len(max_positions)
    long_rows = [i for i, s in enumerate(sources) if len(s) > limit]
    if not long_rows:
        return sources, 0
    warn(f"{len(long_rows)} source(s) longer than the model's {limit} tokens (max_positions {max_positions} with "
         f"EOS) truncated, the first {where(long_rows[0])}")
    return [s[:limit] for s in sources], len(long_rows)


def resolve_inputs(cfg: DecodeConfig, checkpoint: Path, tokens: Path | None,
                   input: Path | None) -> tuple[Inputs, Engine]:
    """The model (a checkpoint, or with engine ctranslate2 also an export) and its vocabulary checked, the sources
    read (the split ``cfg.split`` of ``tokens``, by default the project's bpe artifact, or the lines of ``input``),
    the engine opened and the sources cut to its positions."""
    from mtpipe.config import PATHS

    if input is None and tokens is None:
        tokens = Path(PATHS["bpe"])
    model = open_model(cfg, checkpoint, tokens, processes=cfg.processes)
    ids, sources, split, desc = read_sources(cfg, tokens, input, model.sp)
    engine, pruned = model.open()
    sources, truncated = fit_sources(sources, engine.max_positions, lambda row: f"with id {ids[row]}")
    return Inputs(ids, sources, split, desc, model.sp, model.step, model.upstream, truncated, pruned), engine


def _load_checkpoint(checkpoint: Path, tokens: Path | None) -> Any:
    """:func:`mtpipe.engine.loading.load_model_and_vocab`, refusing an export first (it is CTranslate2's, not mtpipe's)."""
    from mtpipe.engine.loading import load_model_and_vocab

    if (Path(checkpoint) / artifacts.MANIFEST).is_file() and artifacts.read_manifest(checkpoint).kind == "export":
        raise MtpipeError(f"{checkpoint}: is an `mtpipe export` model; decode it with --engine ctranslate2 "
                          "(or give the checkpoint it was exported from)")
    return load_model_and_vocab(checkpoint, tokens)


def translate_sources(engine: Engine, sources: list[list[int]],
                      rules: DecodeRules) -> tuple[list[list[Hypothesis]], float]:
    """``(hypotheses, seconds)``: the engine's translations, with a progress bar and its sentences per second."""
    from rich.progress import TextColumn

    from mtpipe.console import progress

    start = time.perf_counter()
    with progress(TextColumn("{task.fields[rate]}")) as bar:
        task = bar.add_task("decode", total=len(sources), rate="")
        done = 0

        def on_done(n: int) -> None:
            nonlocal done
            done += n
            rate = done / max(time.perf_counter() - start, 1e-9)
            bar.update(task, advance=n, rate=f"{rate:,.1f} sent/s")

        results = engine.translate(sources, rules, on_done=on_done)
    return results, time.perf_counter() - start


def detokenise(sp: Any, hyp_tokens: list[list[int]]) -> list[str]:
    """Hypotheses as text, one line each no matter what the model emits."""
    return [s.replace("\r", " ").replace("\n", " ") for s in sp.decode(hyp_tokens)]


def hypothesis_rows(results: list[list[Hypothesis]], inputs: Inputs, nbest: int) -> dict[str, list[Any]]:
    """The hypotheses table (:data:`mtpipe.artifacts.HYPOTHESES_SCHEMA`), detokenised; n-best columns only when
    ``nbest`` > 1."""
    best = [r[0] for r in results]
    return {
        "id": inputs.ids,
        "hypothesis": detokenise(inputs.sp, [h.tokens for h in best]),
        "tokens": [h.tokens for h in best],
        "score": [h.score for h in best],
        "nbest": [detokenise(inputs.sp, [h.tokens for h in r]) if nbest > 1 else [] for r in results],
        "nbest_scores": [[h.score for h in r] if nbest > 1 else [] for r in results],
    }


def write_hypotheses(out: Path, rows: dict[str, list[Any]], inputs: Inputs, cfg: DecodeConfig, checkpoint: Path,
                     device: str, *, force: bool = False) -> None:
    """The ``hypotheses`` artifact: ``{split}.parquet`` and ``{split}.txt`` (``input.*`` for raw text)."""
    import pyarrow as pa

    name = inputs.split if inputs.split is not None else INPUT_SPLIT
    with writing.ArtifactWriter(out, "hypotheses", {"decode": to_dict(cfg)}, upstream=inputs.upstream,
                                  force=force) as w:
        w.write_table(f"{name}.parquet", pa.table(rows, schema=artifacts.HYPOTHESES_SCHEMA))
        w.path(f"{name}.txt").write_text("".join(s + "\n" for s in rows["hypothesis"]), encoding="utf-8")
        w.extra.update({
            "split": inputs.split,
            "input": None if inputs.split is not None else inputs.desc,
            "checkpoint": str(checkpoint),
            "checkpoint_step": inputs.step,
            "decode": to_dict(cfg),
            "device": device,
            "truncated_sources": inputs.truncated,
            "pruned": inputs.pruned,
        })


def _log_start(what: str, checkpoint: Path, step: int, engine: Engine, cfg: DecodeConfig, rules: DecodeRules) -> None:
    from mtpipe.console import info

    info(f"{what} with {checkpoint} (step {step:,}) on {engine.describe()}, beam {cfg.beam}, {cfg.length_penalty} "
         f"alpha {cfg.alpha}, {engine.settings(rules)}")
    if (note := engine.note(rules)) is not None:
        info(note)


@dataclass
class Totals:
    """What the summary table reports."""

    sentences: int = 0
    out_tokens: int = 0  # best hypotheses' tokens, with their EOS
    score: float = 0.0  # sum of the best hypotheses' scores
    seconds: float = 0.0

    def add(self, results: list[list[Hypothesis]], seconds: float) -> None:
        self.sentences += len(results)
        self.out_tokens += sum(len(r[0].tokens) + 1 for r in results)
        self.score += sum(r[0].score for r in results)
        self.seconds += seconds


# What a process decodes before its first real input (``mtpipe serve``'s warm-up, stdin with ``decode.compile``): one
# sentence, then several of different lengths; any vocabulary encodes them (SentencePiece falls back to pieces).
WARM_UP_TEXTS = ("Warm up.", "Warm up a batch.", "Of sentences of several lengths, together.", "One more.")


def translate_stream(cfg: DecodeConfig, rules: DecodeRules, checkpoint: Path, tokens: Path | None, fd: int,
                     keep: bool) -> tuple[Inputs, list[list[Hypothesis]], Totals, str]:
    """Translate the lines of ``fd`` (stdin) as they arrive (:func:`stream_batches`), each batch written to stdout
    and flushed before the next is read. Returns ``(inputs, hypotheses, totals, device)``; the sources and
    hypotheses only when ``keep`` (for ``--out``), else empty lists (a long session does not grow)."""
    model = open_model(cfg, checkpoint, tokens)
    engine, pruned = model.open()
    _log_start("translating stdin as lines arrive", checkpoint, model.step, engine, cfg, rules)
    from mtpipe.console import info

    if cfg.processes > 1:
        info(f"decode.processes={cfg.processes} applies to a file or a split: stdin is translated in this process")
    if cfg.compile and isinstance(engine, MtpipeEngine):  # built now, not while the first line waits for it
        engine.lone_graph = True  # lines come one at a time: a lone sentence's own graph (its steps ~1.09x as fast)
        warm = [model.sp.encode(t, out_type=int)[: engine.max_positions - 1] for t in WARM_UP_TEXTS]
        info(f"compiled step built in {engine.build(warm, rules):.0f} s (decode.compile); reading stdin")
    sources: list[list[int]] = []
    results: list[list[Hypothesis]] = []
    totals, truncated = Totals(), 0
    for first, data in stream_batches(fd):
        batch, cut = fit_sources(model.sp.encode(text_lines(data, "stdin", first), out_type=int),
                                 engine.max_positions, lambda row: f"on stdin line {first + row}")
        start = time.perf_counter()
        hyps = engine.translate(batch, rules)
        totals.add(hyps, time.perf_counter() - start)
        sys.stdout.write("".join(s + "\n" for s in detokenise(model.sp, [r[0].tokens for r in hyps])))
        sys.stdout.flush()
        truncated += cut
        if keep:
            sources += batch
            results += hyps
    if totals.sentences == 0:
        raise MtpipeError("stdin: empty input (no lines to translate)")
    inputs = Inputs(list(range(len(sources))), sources, None, "stdin", model.sp, model.step, model.upstream,
                    truncated, pruned)
    return inputs, results, totals, engine.describe()


@contextlib.contextmanager
def _closing(engine: Engine) -> Iterator[None]:
    """Close an engine that holds processes (:class:`~mtpipe.engine.workers.DecodePool`) when its work ends: at once when
    it ended in an error or an interrupt (a process may be mid-batch), else after the processes finish."""
    close = getattr(engine, "close", None)
    try:
        yield
    except BaseException:
        if close is not None:
            close(wait=0)
        raise
    if close is not None:
        close()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def translate_inputs(cfg: DecodeConfig, checkpoint: Path, tokens: Path | None = None, input: Path | None = None,
        out: Path | None = None, *, force: bool = False, stats: bool | None = None) -> None:
    """Translate a split of the bpe artifact (``cfg.split``) or raw text (``input``; '-' = stdin).

    The translations go to stdout, one line per sentence in id order; with ``out`` also a ``hypotheses`` artifact
    (``{split}.parquet`` / ``{split}.txt``, or ``input.*`` for raw text) is written there. All checks run before any
    output is written. Stdin is translated as its lines arrive (:func:`translate_stream`), a file or a split in
    length-sorted batches. ``stats``: print the summary table (None: unless the input is stdin or stdout a
    terminal, where it would interleave with the translations).
    """
    from mtpipe.console import table

    rules = validate(cfg)
    if out is not None:
        writing.prepare_output(out, "hypotheses", inputs=[checkpoint, tokens, input], force=force)
    from_stdin = input is not None and str(input) == "-"
    fd = stdin_fd() if from_stdin else None
    build = 0.0
    if fd is not None:
        inputs, results, totals, device = translate_stream(cfg, rules, checkpoint, tokens, fd, keep=out is not None)
        if out is not None:
            write_hypotheses(out, hypothesis_rows(results, inputs, cfg.nbest), inputs, cfg, checkpoint, device,
                             force=force)
    else:
        inputs, engine = resolve_inputs(cfg, checkpoint, tokens, input)
        with _closing(engine):  # decode.processes: the processes end with the decoding
            _log_start(f"decoding {len(inputs.sources):,} sentences of {inputs.desc}", checkpoint, inputs.step,
                       engine, cfg, rules)
            if isinstance(engine, MtpipeEngine):
                build = engine.build(inputs.sources, rules)  # decode.compile: not part of the decoding seconds
            results, seconds = translate_sources(engine, inputs.sources, rules)
        rows = hypothesis_rows(results, inputs, cfg.nbest)
        if out is not None:
            write_hypotheses(out, rows, inputs, cfg, checkpoint, engine.describe(), force=force)
        sys.stdout.write("".join(s + "\n" for s in rows["hypothesis"]))
        sys.stdout.flush()
        totals = Totals()
        totals.add(results, seconds)
    # The table would land between translations a user reads at a terminal, or after a stdin session ends.
    show = stats if stats is not None else not from_stdin and not _isatty(sys.stdout)
    if show:
        n, seconds = totals.sentences, totals.seconds
        table("decode", ["", "value"], [
            ["engine", cfg.engine],
            ["sentences", n],
            ["output tokens (with EOS)", totals.out_tokens],
            ["seconds", round(seconds, 2)],
            ["sentences/s", n / max(seconds, 1e-9)],
            ["tokens/s", totals.out_tokens / max(seconds, 1e-9)],
            ["mean score", totals.score / max(n, 1)],
            *([["processes x threads", f"{cfg.processes} x {engine.threads}"]]
              if not from_stdin and cfg.processes > 1 else []),
            ["written to", str(out) if out is not None else "stdout"],
            *([["compile seconds (before decoding)", round(build, 2)]] if build else []),
        ])


__all__ = ["INPUT_SPLIT", "Inputs", "Model", "MtpipeEngine", "PrefixState", "WARM_UP_TEXTS", "batches_by_tokens",
           "bf16_copy", "decoding_context", "decoding_model", "detokenise", "fit_sources", "open_model", "read_lines",
           "read_sources", "resolve_inputs", "stdin_fd", "stream_batches", "text_lines", "Totals", "translate",
           "translate_batches", "translate_inputs", "translate_sources", "translate_stream", "uncached_step",
           "validate", "write_hypotheses"]
