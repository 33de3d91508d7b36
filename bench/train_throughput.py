#!/usr/bin/env python3
"""Training throughput: mtpipe's Transformer vs a plain ``torch.nn.Transformer`` loop, measured in the same run.

On CPU (2 threads by default), for the paper's base dimensions (d512, 6+6 layers, h8, ff2048)
and the ``small`` preset (d256, 3+3, h4, ff1024: the anchors' dimensions), mtpipe in fp32 and bf16 against the
reference in fp32:

* target tokens/s and source+target tokens/s: non-pad tokens incl. EOS, counted as fairseq and
  the anchors count them (src = pieces + EOS, tgt = pieces + EOS);
* model-FLOPs utilisation (MFU) against an fp32 and a bf16 square-matmul peak measured in this run;
* the ratio to the reference on the same batches. This machine's speed drifts by up to 40 % over minutes (anchors
  finding 1) and other processes come and go, so every batch is trained by every system back to back (rotating
  who goes first) and the ratio is the median of the per-batch ratios.

Batches are real Multi30k batches: a joint 8k SentencePiece BPE trained here on the train split (mtpipe's settings
and special ids), packed by ``mtpipe.bucket.pack`` (max_tokens 4096 per side, multiples of 8 sentences), shuffled.

The mtpipe side times ``mtpipe.train.make_train_step``: exactly the update ``mtpipe train`` runs (forward,
label-smoothed loss over the non-pad positions only, backward, grad norm, fused Adam, the paper's schedule,
precision and compile from TrainConfig). The reference is a plain loop: nn.Transformer, F.cross_entropy with
label smoothing over every position, torch.optim.Adam with its defaults.

    python bench/train_throughput.py                                   # both dims, 2 threads, ~3-8 minutes
    python bench/train_throughput.py --threads 1 --clock cpu           # robust to other processes on the machine
    python bench/train_throughput.py --profile small:bf16              # torch.profiler table of mtpipe's step
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_ticks, patched  # noqa: E402
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID  # noqa: E402
from mtpipe.config import ModelConfig  # noqa: E402
from mtpipe.console import console  # noqa: E402

DATA = Path(os.environ.get("MTPIPE_MULTI30K", REPO / "data" / "multi30k"))  # {split}.{en,de}.gz

# The paper's base model, the anchors' small one, and the quickstart's.
DIMS = {
    "base": dict(layers=6, d_model=512, heads=8, d_ff=2048),
    "small": dict(layers=3, d_model=256, heads=4, d_ff=1024),
    # The quickstart's model (params.yaml): its norm position and dropouts change what a step computes.
    "quickstart": dict(layers=4, d_model=128, heads=4, d_ff=256,
                       model=dict(norm_position="pre", dropout=0.2, attention_dropout=0.1, relu_dropout=0.1)),
}


# --------------------------------------------------------------------------------------------------------------------
# Data: Multi30k -> joint BPE -> token batches
# --------------------------------------------------------------------------------------------------------------------


def read_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def encode_corpus(data: Path, vocab_size: int, threads: int) -> tuple[list[list[int]], list[list[int]], int]:
    """Train a joint SentencePiece BPE (ids PAD/UNK/BOS/EOS = 0/1/2/3, as mtpipe's) on train; encode train."""
    import sentencepiece as spm

    src, tgt = read_lines(data / "train.en.gz"), read_lines(data / "train.de.gz")
    with tempfile.TemporaryDirectory() as tmp:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(src + tgt), model_prefix=f"{tmp}/spm", vocab_size=vocab_size, model_type="bpe",
            character_coverage=1.0, pad_id=PAD_ID, unk_id=1, bos_id=BOS_ID, eos_id=EOS_ID, num_threads=threads,
            minloglevel=2,
        )
        sp = spm.SentencePieceProcessor(model_file=f"{tmp}/spm.model")
    return sp.encode(src), sp.encode(tgt), sp.get_piece_size()


def make_batches(src: list[list[int]], tgt: list[list[int]], max_tokens: int, multiple: int = 8) -> list[list[int]]:
    """Length-sorted batches with ``len(batch) * max(positions) <= max_tokens`` (positions include EOS/BOS),
    trimmed to a multiple of ``multiple`` sentences where possible (the carried-over rest starts the next batch)."""
    size = [max(len(s), len(t)) + 1 for s, t in zip(src, tgt)]
    order = sorted(range(len(src)), key=lambda i: (len(tgt[i]), len(src[i])))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * max(size[i], max(size[j] for j in cur)) > max_tokens:
            keep = len(cur) if len(cur) < multiple else multiple * (len(cur) // multiple)
            batches.append(cur[:keep])
            cur = cur[keep:]
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


@dataclass
class Batch:
    src: Tensor  # [B, S]  tokens + EOS, right-padded
    tgt_in: Tensor  # [B, T]  BOS + tokens
    tgt_out: Tensor  # [B, T]  tokens + EOS
    n_src: int  # non-pad source tokens (incl. EOS)
    n_tgt: int  # non-pad target tokens (incl. EOS): the loss is over these
    src_lens: list[int] = field(default_factory=list)
    tgt_lens: list[int] = field(default_factory=list)


def collate(ids: list[int], src: list[list[int]], tgt: list[list[int]]) -> Batch:
    b = len(ids)
    s_len, t_len = max(len(src[i]) for i in ids) + 1, max(len(tgt[i]) for i in ids) + 1
    s = torch.full((b, s_len), PAD_ID, dtype=torch.long)
    ti = torch.full((b, t_len), PAD_ID, dtype=torch.long)
    to = torch.full((b, t_len), PAD_ID, dtype=torch.long)
    for r, i in enumerate(ids):
        x, y = src[i], tgt[i]
        s[r, : len(x) + 1] = torch.tensor(x + [EOS_ID])
        ti[r, : len(y) + 1] = torch.tensor([BOS_ID] + y)
        to[r, : len(y) + 1] = torch.tensor(y + [EOS_ID])
    sl, tl = [len(src[i]) + 1 for i in ids], [len(tgt[i]) + 1 for i in ids]
    return Batch(s, ti, to, sum(sl), sum(tl), sl, tl)


def load_batches(args: argparse.Namespace) -> tuple[list[Batch], int, str]:
    """Real Multi30k training batches, shuffled with the seed; returns (batches, vocab size, how they were made)."""
    src, tgt, vocab = encode_corpus(Path(args.data), args.vocab_size, args.threads)
    try:  # the batches `mtpipe bucket` would write (its packing, on positions = tokens + EOS)
        import numpy as np

        from mtpipe.bucket import length_order, pack

        s_len = np.array([len(x) + 1 for x in src], np.int64)
        t_len = np.array([len(y) + 1 for y in tgt], np.int64)
        order = length_order(s_len, t_len)
        bounds = pack(s_len[order], t_len[order], args.max_tokens, 8)
        ids = [order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
        packing = "mtpipe.bucket.pack"
    except ImportError:
        ids = make_batches(src, tgt, args.max_tokens)
        packing = "fairseq-style packing"
    random.Random(args.seed).shuffle(ids)
    how = (f"Multi30k train, joint SentencePiece BPE {vocab} (trained here), {packing}, max_tokens "
           f"{args.max_tokens}, shuffled (seed {args.seed})")
    return [collate(b, src, tgt) for b in ids], vocab, how


# --------------------------------------------------------------------------------------------------------------------
# Model FLOPs and matmul peaks
# --------------------------------------------------------------------------------------------------------------------


def train_flops(b: Batch, layers: int, d: int, d_ff: int, vocab: int) -> float:
    """Model FLOPs of one training update on the batch's real (non-pad) tokens: 3x the forward matmul FLOPs
    (backward = 2x forward), counting every projection, the attention score/value products per sentence
    (causal self-attention: half of the square) and the output projection. Padding, softmax, norms excluded,
    so both systems are credited the same useful work."""
    per_src = layers * (2 * (4 * d * d) + 2 * 2 * d * d_ff) + layers * 2 * (2 * d * d)  # enc layer + cross K/V
    per_tgt = layers * (2 * (4 * d * d) + 2 * (2 * d * d) + 2 * 2 * d * d_ff) + 2 * d * vocab  # dec + logits
    attn = 0.0
    for s, t in zip(b.src_lens, b.tgt_lens):
        attn += layers * 4 * d * s * s  # encoder self-attention: QK^T and AV, full square
        attn += layers * 4 * d * t * (t + 1) / 2  # decoder self-attention: causal half
        attn += layers * 4 * d * t * s  # cross-attention
    return 3.0 * (per_src * b.n_src + per_tgt * b.n_tgt + attn)


def matmul_peak(dtype: torch.dtype, clock: Callable[[], float] = time.perf_counter, n: int = 2048,
                seconds: float = 1.5) -> float:
    """Square-matmul GFLOP/s at the current thread count (the roofline the MFU columns divide by): the median of
    single ``n x n`` products timed with ``clock`` over about ``seconds``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    c = torch.empty(n, n, dtype=dtype)
    for _ in range(2):
        torch.mm(a, b, out=c)
    rates, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(rates) < 3:
        t0 = clock()
        torch.mm(a, b, out=c)
        rates.append(2 * n**3 / max(clock() - t0, 1e-9) / 1e9)
    return statistics.median(rates)


# --------------------------------------------------------------------------------------------------------------------
# The reference: a plain training loop on torch.nn.Transformer (as the anchors' ref_train.py measures)
# --------------------------------------------------------------------------------------------------------------------


def sinusoid_table(n: int, d: int) -> Tensor:
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * inv), torch.cos(pos * inv)
    return pe


class Reference(nn.Module):
    """nn.Transformer, post-norm, dropout 0.1, sinusoidal positions, one embedding shared by the encoder input,
    decoder input and output projection, embeddings scaled by sqrt(d): the textbook way to write the paper's model."""

    def __init__(self, vocab: int, layers: int, d_model: int, heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.d = d_model
        self.emb = nn.Embedding(vocab, d_model, padding_idx=PAD_ID)
        nn.init.normal_(self.emb.weight, 0.0, d_model**-0.5)
        self.register_buffer("pe", sinusoid_table(1024, d_model), persistent=False)
        self.drop = nn.Dropout(dropout)
        self.tf = nn.Transformer(d_model, heads, layers, layers, d_ff, dropout, batch_first=True, norm_first=False)

    def embed(self, x: Tensor) -> Tensor:
        return self.drop(self.emb(x) * math.sqrt(self.d) + self.pe[: x.size(1)])

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        t = tgt_in.size(1)
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        src_pad = src.eq(PAD_ID)
        h = self.tf(self.embed(src), self.embed(tgt_in), tgt_mask=causal, src_key_padding_mask=src_pad,
                    tgt_key_padding_mask=tgt_in.eq(PAD_ID), memory_key_padding_mask=src_pad)
        return F.linear(h, self.emb.weight)


def reference_step(vocab: int, dims: dict, precision: str, args: argparse.Namespace) -> Callable[[Batch], float]:
    torch.manual_seed(args.seed)
    model = Reference(vocab, **{k: v for k, v in dims.items() if k != "model"}).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / 400, math.sqrt(400 / (s + 1))))
    bf16 = precision == "bf16"

    def step(b: Batch) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(b.src, b.tgt_in)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), b.tgt_out.view(-1), ignore_index=PAD_ID,
                               label_smoothing=0.1, reduction="sum")
        opt.zero_grad(set_to_none=True)
        (loss / b.n_tgt).backward()
        opt.step()
        sched.step()
        return loss.item() / b.n_tgt

    return step


# --------------------------------------------------------------------------------------------------------------------
# mtpipe's training update
# --------------------------------------------------------------------------------------------------------------------


# CPU tricks of mtpipe.kernels and mtpipe.loss that --plain can switch off for one row: what each is replaced with.
PLAIN = {
    "dropout": "F.dropout (torch's bernoulli masks) instead of mtpipe.kernels.keep_mask",
    "attention": "F.scaled_dot_product_attention instead of two matmuls",
    "loss": "the whole [N, V] logits made, then the textbook loss differentiated by autograd, instead of "
            "mtpipe.loss's blocks",
    "onednn": "torch's own float32 products (MKL on x86) instead of oneDNN's (mtpipe.kernels.mm)",
}


@contextlib.contextmanager
def plain_kernels(tricks: frozenset[str]) -> Iterator[None]:
    """mtpipe's step with the named tricks of :mod:`mtpipe.kernels` and :mod:`mtpipe.loss` switched off (their plain
    torch formulation), for the length of one step."""
    from mtpipe import kernels, loss, model
    from mtpipe import train as mtrain

    def whole_logits(h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, eps: float):
        return loss.reference_label_smoothed_nll(F.linear(h, weight, bias), target, eps)

    switches = {
        "dropout": (kernels, "_fused_dropout_available", lambda x: True),
        "attention": (model, "prefer_explicit_attention", lambda q: False),
        "loss": (mtrain, "projected_label_smoothed_nll", whole_logits),  # the module global LossModule calls
        "onednn": (kernels, "ONEDNN_FP32", False),
    }
    with patched(*(switch for name, switch in switches.items() if name in tricks)):
        yield


def mtpipe_step(vocab: int, dims: dict, precision: str, compiled: bool, args: argparse.Namespace,
                plain: frozenset[str] = frozenset()) -> tuple[Callable[[Batch], float], str]:
    """mtpipe's update as ``mtpipe train`` runs it: ``mtpipe.train.make_train_step`` (forward, loss over the
    non-pad positions, backward, Adam, the paper's schedule, precision and compile settings from TrainConfig);
    ``plain``: with those CPU tricks switched off (:data:`PLAIN`)."""
    from mtpipe import train as mtrain
    from mtpipe.config import TrainConfig
    from mtpipe.model import Transformer

    cfg = ModelConfig(preset="base", encoder_layers=dims["layers"], decoder_layers=dims["layers"],
                      d_model=dims["d_model"], heads=dims["heads"], d_ff=dims["d_ff"], **dims.get("model", {}))
    tcfg = TrainConfig(precision=precision, compile=compiled, threads=args.threads, warmup=4000,
                       label_smoothing=0.1)
    torch.manual_seed(args.seed)
    model = Transformer(cfg, vocab).train()
    run = mtrain.make_train_step(model, tcfg)

    def step(b: Batch) -> float:
        with plain_kernels(plain):
            return float(run(b.src, b.tgt_in, b.tgt_out))

    how = "mtpipe.train.make_train_step" + "".join(f"; {PLAIN[t]}" for t in sorted(plain))
    return step, how


# --------------------------------------------------------------------------------------------------------------------
# glibc's allocator
# --------------------------------------------------------------------------------------------------------------------

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # <malloc.h>


def tune_allocator() -> bool:
    """Keep freed memory in the process for reuse; False where this is not glibc.

    glibc serves every allocation above its mmap threshold (at most 32 MB: logits, their gradients, big activations)
    with a fresh ``mmap`` and unmaps it on free, so every training step page-faults its big tensors in again
    (~170k minor faults per small-model step). ``M_MMAP_MAX = 0`` and a huge ``M_TRIM_THRESHOLD`` make freed blocks
    reusable: measured +18-24 % tokens/s for the reference and +46-56 % for mtpipe bf16 (small, 2 threads). It is
    process-wide, so here it speeds up the reference as well (the ratios measure the training code, not the
    allocator); ``mtpipe train`` should do the same on CPU (BENCHMARKS.md).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False


# --------------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class System:
    config: str  # base / small
    name: str  # e.g. "mtpipe bf16"
    precision: str
    mtpipe: bool
    step: Callable[[Batch], float]
    how: str = ""
    seconds: list[float] = field(default_factory=list)  # per timed batch
    src: list[int] = field(default_factory=list)
    tgt: list[int] = field(default_factory=list)
    flops: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def timed_step(s: System, b: Batch, vocab: int, clock: Callable[[], float]) -> None:
    dims = DIMS[s.config]
    t0 = clock()
    loss = s.step(b)
    s.seconds.append(clock() - t0)
    s.src.append(b.n_src)
    s.tgt.append(b.n_tgt)
    s.flops.append(train_flops(b, dims["layers"], dims["d_model"], dims["d_ff"], vocab))
    s.losses.append(loss)


def profile(spec: str, batches: list[Batch], vocab: int, args: argparse.Namespace) -> None:
    """torch.profiler table of mtpipe's step (``base:bf16``-style spec) over ``--steps`` steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    config, precision = spec.split(":")
    step, how = mtpipe_step(vocab, DIMS[config], precision, args.compile == "on", args)
    for b in batches[: args.warmup + args.steps]:  # the profiled batches once untimed too (warm kernel caches)
        step(b)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in batches[args.warmup : args.warmup + args.steps]:
            step(b)
    console.print(f"mtpipe {config} {precision} ({how}), {args.steps} steps, {torch.get_num_threads()} threads")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=50))


def wait_quiet(max_seconds: float, share: float = 0.15, window: float = 3.0) -> float:
    """Wait (at most ``max_seconds``) until other processes use under ``share`` of the machine's CPUs over
    ``window`` seconds; returns the last measured share."""
    t_end, last = time.time() + max_seconds, 1.0
    while True:
        busy0, total0 = cpu_ticks()
        time.sleep(window)
        busy1, total1 = cpu_ticks()
        last = (busy1 - busy0) / max(total1 - total0, 1e-9)
        if last < share or time.time() >= t_end:
            return last


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--configs", default="small,base", help="comma list of: " + ", ".join(DIMS))
    ap.add_argument("--precisions", default="fp32,bf16", help="mtpipe precisions to time (comma list: fp32, bf16)")
    ap.add_argument("--steps", default="small=16,base=6",
                    help="timed batches per config, e.g. 'small=16,base=6' or one number for all (16 for a config not "
                         "named); every system trains on each batch in turn (rotating order) before the next batch")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed steps per system first on the largest other batches (allocator steady state)")
    ap.add_argument("--no-warm-pass", action="store_true",
                    help="skip the untimed pass over the timed batches (time first-seen batch shapes instead)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="'cpu' (with --threads 1): time steps by this thread's CPU time, which other processes on a "
                         "busy machine barely affect; tok/s columns are then tokens per CPU-second")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="first wait up to this long for other processes to leave the CPUs (< 15 %% busy)")
    ap.add_argument("--compile", choices=["off", "on", "both"], default="off",
                    help="mtpipe with train.compile off, on, or both as separate rows")
    ap.add_argument("--plain", default="", help="comma list of mtpipe CPU tricks to time switched off, one row "
                    "each: " + ", ".join(PLAIN))
    ap.add_argument("--reference-bf16", action="store_true", help="also time the reference under bf16 autocast")
    ap.add_argument("--allocator", choices=["tuned", "default"], default="tuned",
                    help="glibc allocator: 'tuned' keeps freed memory (as mtpipe train should), process-wide")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--data", default=str(DATA), help="directory with train.{en,de}.gz")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--profile", default=None, metavar="CONFIG:PRECISION",
                    help="instead of the comparison, print a torch.profiler table of mtpipe's step")
    args = ap.parse_args(argv)
    plain_rows = [t for t in args.plain.split(",") if t]
    for t in plain_rows:
        if t not in PLAIN:
            ap.error(f"--plain: unknown {t!r} (choose from {', '.join(PLAIN)})")

    torch.set_num_threads(args.threads)
    configs = [c for c in args.configs.split(",") if c]
    precisions = [p for p in args.precisions.split(",") if p]
    for c in configs:
        if c not in DIMS:
            ap.error(f"--configs: unknown {c!r}")
    for p in precisions:
        if p not in ("fp32", "bf16"):
            ap.error(f"--precisions: unknown {p!r}")
    if "=" in args.steps:
        steps = {k: int(v) for k, v in (kv.split("=") for kv in args.steps.split(","))}
    else:
        steps = {c: int(args.steps) for c in DIMS}
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu needs --threads 1 (other threads' CPU time is not this thread's)")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    allocator = tune_allocator() if args.allocator == "tuned" else False
    t_start = time.time()
    batches, vocab, how = load_batches(args)
    if args.profile:
        args.steps = steps.get(args.profile.split(":")[0], 4)
        profile(args.profile, batches, vocab, args)
        return 0
    if args.wait_quiet > 0:
        console.print(f"waiting up to {args.wait_quiet:.0f} s for a quiet machine ...")
        console.print(f"  other processes' CPU share now {100 * wait_quiet(args.wait_quiet):.0f} %")
    load0 = os.getloadavg()[0]
    busy0, total0 = cpu_ticks()
    own0 = sum(os.times()[:4])
    console.print(f"[bold]train throughput[/bold]: {cpu_model()}, torch {torch.__version__}, "
                  f"{torch.get_num_threads()} threads, allocator {'tuned' if allocator else 'glibc default'}, "
                  f"load average {load0:.1f} at start")
    console.print(f"batches: {how}; {len(batches)} batches, vocab {vocab}")

    compiled = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    peaks: dict[str, list[float]] = {"fp32": [], "bf16": []}
    from mtpipe.runtime import cpu_supports_bf16

    # Without native bf16 (AVX2-only CPUs) a 2048^3 bf16 matmul takes minutes: no bf16 peak, its MFU column is nan.
    bf16_peak = cpu_supports_bf16() or torch.cuda.is_available()
    all_systems: list[System] = []
    next_batch = 0
    for c in configs:
        systems = [System(c, "reference fp32", "fp32", False, reference_step(vocab, DIMS[c], "fp32", args),
                          "torch.nn.Transformer, plain loop")]
        if args.reference_bf16:
            systems.append(System(c, "reference bf16", "bf16", False, reference_step(vocab, DIMS[c], "bf16", args),
                                  "torch.nn.Transformer, bf16 autocast"))
        for comp in compiled:
            for p in precisions:
                step, step_how = mtpipe_step(vocab, DIMS[c], p, comp, args)
                name = f"mtpipe {p}" + (" compiled" if comp else "")
                systems.append(System(c, name, p, True, step, step_how))
                for trick in plain_rows if not comp else []:
                    step, step_how = mtpipe_step(vocab, DIMS[c], p, False, args, frozenset([trick]))
                    systems.append(System(c, f"mtpipe {p} plain {trick}", p, True, step, step_how))
        n = steps.get(c, 16)  # a config --steps does not name: as many as the small dims
        timed = batches[next_batch : next_batch + n]
        next_batch += n
        if len(timed) < n:
            ap.error(f"not enough batches for --steps {n}")
        # Warm-up: the largest of the other batches (the allocator reaches its steady state), then, unless
        # --no-warm-pass, one untimed pass over the timed batches: a training run sees every batch shape again each
        # epoch, and shape-specialised kernel caches (oneDNN's, for bf16) are warm from the second epoch on.
        largest = sorted(batches[next_batch:], key=lambda b: -b.tgt_in.numel())[: args.warmup]
        warm = largest + ([] if args.no_warm_pass else timed)
        for s in systems:  # first-touch allocations, oneDNN primitive caches, compilation
            t0 = time.perf_counter()
            for b in warm:
                s.step(b)
            console.print(f"  {c} {s.name}: warm-up {len(warm)} steps {time.perf_counter() - t0:.1f} s ({s.how})")
        peaks["fp32"].append(matmul_peak(torch.float32, clock))
        if bf16_peak:
            peaks["bf16"].append(matmul_peak(torch.bfloat16, clock))
        for i, b in enumerate(timed):
            # Every system trains on this batch before the next one, starting with a different system each time:
            # this machine's speed drifts (and other processes come and go), so only neighbours are compared.
            for k in range(len(systems)):
                timed_step(systems[(i + k) % len(systems)], b, vocab, clock)
            if i == len(timed) // 2:
                peaks["fp32"].append(matmul_peak(torch.float32, clock))
                if bf16_peak:
                    peaks["bf16"].append(matmul_peak(torch.bfloat16, clock))
        console.print(f"  {c}: {len(timed)} batches x {len(systems)} systems done ({time.time() - t_start:.0f} s)")
        all_systems += systems

    peak32 = statistics.median(peaks["fp32"])
    peak16 = statistics.median(peaks["bf16"]) if peaks["bf16"] else float("nan")
    rows, results = [], []
    targets = {"fp32": 1.3, "bf16": 3.0}
    for s in all_systems:
        ref = next(x for x in all_systems if x.config == s.config and x.name == "reference fp32")
        per_batch = [r / t for r, t in zip(ref.seconds, s.seconds)]  # same batch: time ratio = throughput ratio
        q1, med, q3 = quartiles(per_batch)
        sec, src, tgt, fl = sum(s.seconds), sum(s.src), sum(s.tgt), sum(s.flops)
        overall = sum(ref.seconds) / sec
        target = targets[s.precision] if s.mtpipe else None
        res = dict(config=s.config, system=s.name, precision=s.precision, how=s.how, steps=len(s.losses),
                   seconds=sec, tgt_tok_s=tgt / sec, src_tgt_tok_s=(src + tgt) / sec, gflops=fl / sec / 1e9,
                   mfu_fp32_peak=fl / sec / 1e9 / peak32, mfu_bf16_peak=fl / sec / 1e9 / peak16,
                   ratio_median=med, ratio_quartiles=[q1, q3], ratio_totals=overall, per_batch_ratios=per_batch,
                   target=target, passed=None if target is None else med >= target, losses=s.losses)
        results.append(res)
        verdict = "" if target is None else (f">= {target}x " + ("[green]pass[/green]" if med >= target
                                                                  else "[red]FAIL[/red]"))
        rows.append([s.config, s.name, f"{tgt / sec:,.0f}", f"{(src + tgt) / sec:,.0f}", f"{sec / len(s.losses):.2f}",
                     f"{fl / sec / 1e9:.0f}", f"{100 * fl / sec / 1e9 / peak32:.0f}%",
                     f"{100 * fl / sec / 1e9 / peak16:.0f}%", f"{med:.2f}x ({q1:.2f}-{q3:.2f})", f"{overall:.2f}x",
                     verdict])
    load1 = os.getloadavg()[0]
    busy1, total1 = cpu_ticks()
    others = max(0.0, (busy1 - busy0) - (sum(os.times()[:4]) - own0)) / max(total1 - total0, 1e-9)

    from rich.console import Console
    from rich.table import Table

    out = Console(stderr=True, width=max(console.width, 160), highlight=False)
    unit = "per CPU-second of the one thread" if args.clock == "cpu" else "per second"
    t = Table(title=f"Training throughput (tokens {unit}), {args.threads} thread(s), per-batch interleaved "
                    f"(matmul peak fp32 {peak32:.0f}, bf16 {peak16:.0f} GFLOP/s)", title_justify="left")
    for i, col in enumerate(["config", "system", "tgt tok/s", "src+tgt tok/s", "s/step", "GFLOP/s", "MFU fp32",
                             "MFU bf16", "x ref fp32: median (IQR)", "x ref: totals", "target (median)"]):
        t.add_column(col, justify="left" if i < 2 else "right")
    for row in rows:
        t.add_row(*row)
    out.print(t)
    out.print(f"Per-batch ratios: each batch is trained by every system back to back. Other processes used "
              f"{100 * others:.0f} % of the machine's CPU time during the run (load average {load0:.1f} -> "
              f"{load1:.1f}): absolute numbers move with them, the interleaved ratios much less. "
              f"Total {time.time() - t_start:.0f} s.")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            cpu=cpu_model(), torch=torch.__version__, threads=args.threads, clock=args.clock, argv=sys.argv[1:],
            batches=how,
            allocator="tuned" if allocator else "default", peaks_gflops=peaks, load_average=[load0, load1],
            other_processes_cpu_share=others, results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
