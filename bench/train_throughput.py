#!/usr/bin/env python3
"""Training throughput: mtpipe's update against a plain ``torch.nn.Transformer`` loop, on the same batches.

The paper's base dims, the ``small`` preset (the anchors') and the quickstart's model (``--configs``), 2 threads:
mtpipe (``bench.train_step.make_train_step``, exactly ``mtpipe train``'s update) in fp32 and bf16, and with one CPU trick
switched off per ``--plain`` row (:data:`PLAIN`), against the reference (nn.Transformer, F.cross_entropy with label
smoothing, torch.optim.Adam) in fp32. Real Multi30k batches (a joint 8k BPE trained here, ``mtpipe.stages.bucket.pack`` at
4,096 tokens). After warm-up steps and an untimed pass over the timed batches (warm allocator and kernel caches),
every batch is trained by every system in rotating order (:func:`machine.interleaved`): the ratio to the reference
is taken batch by batch, median (min-max). Also tokens/s (non-pad, with EOS, as fairseq counts) and MFU against
matmul peaks measured in the run. Targets: mtpipe bf16 >= 3x and fp32 >= 1.3x the reference's fp32 tokens/s.

    python bench/train_throughput.py [--threads 1 --clock cpu]      # base + small, fp32 + bf16 [a busy machine]
    python bench/train_throughput.py --configs quickstart --precisions fp32 --plain dropout,attention,loss
    python bench/train_throughput.py --profile base:bf16 --steps 3  # torch.profiler table of mtpipe's step
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import machine  # noqa: E402

machine.isa_from_argv()  # before torch loads
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID  # noqa: E402
from mtpipe import env as mtenv  # noqa: E402
from mtpipe.config import ModelConfig  # noqa: E402
from mtpipe.console import console, table  # noqa: E402

DATA = Path(mtenv.get("MTPIPE_MULTI30K") or REPO / "data" / "multi30k")  # {split}.{en,de}.gz
DIMS = {
    "base": dict(layers=6, d_model=512, heads=8, d_ff=2048),
    "small": dict(layers=3, d_model=256, heads=4, d_ff=1024),
    # the quickstart's (params.yaml): its norm position and dropouts change what a step computes
    "quickstart": dict(layers=4, d_model=128, heads=4, d_ff=256,
                       model=dict(norm_position="pre", dropout=0.2, attention_dropout=0.1, relu_dropout=0.1)),
}
TARGETS = {"fp32": 1.3, "bf16": 3.0}  # mtpipe's tokens/s over the reference's in fp32
# CPU tricks of mtpipe.model.ops and mtpipe.training.loss that --plain switches off, a row each: what replaces each.
PLAIN = {
    "dropout": "F.dropout (torch's bernoulli masks) instead of mtpipe.model.ops.keep_mask "
               "(mtpipe.model.ops.fused_dropout)",
    "attention": "F.scaled_dot_product_attention instead of two matmuls (mtpipe.model.ops.fused_attention)",
    "loss": "the whole [N, V] logits, then the textbook loss through autograd, instead of mtpipe.training.loss's "
            "blocks (mtpipe.training.loss.whole_logits)",
}


@dataclass
class Batch:
    src: Tensor  # [B, S] pieces + EOS, right-padded
    tgt_in: Tensor  # [B, T] BOS + pieces
    tgt_out: Tensor  # [B, T] pieces + EOS
    src_lens: list[int]  # with EOS
    tgt_lens: list[int]


def load_batches(args: argparse.Namespace) -> tuple[list[Batch], int]:
    """Multi30k train through a joint SentencePiece BPE (mtpipe's special ids) and ``mtpipe.stages.bucket.pack``."""
    import numpy as np
    import sentencepiece as spm

    from mtpipe.stages.bucket import length_order, pack

    def lines(lang: str) -> list[str]:
        with gzip.open(Path(args.data) / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f]

    text = {lang: lines(lang) for lang in ("en", "de")}
    with tempfile.TemporaryDirectory() as tmp:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(text["en"] + text["de"]), model_prefix=f"{tmp}/spm",
                                       vocab_size=args.vocab_size, model_type="bpe", character_coverage=1.0,
                                       pad_id=PAD_ID, unk_id=1, bos_id=BOS_ID, eos_id=EOS_ID,
                                       num_threads=args.threads, minloglevel=2)
        sp = spm.SentencePieceProcessor(model_file=f"{tmp}/spm.model")
    src, tgt = sp.encode(text["en"]), sp.encode(text["de"])
    s_len, t_len = np.array([len(x) + 1 for x in src]), np.array([len(y) + 1 for y in tgt])
    order = length_order(s_len, t_len)
    bounds = pack(s_len[order], t_len[order], args.max_tokens, 8)
    ids = [order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    random.Random(args.seed).shuffle(ids)

    def collate(rows: list[int]) -> Batch:
        def pad(seqs: list[list[int]]) -> Tensor:
            return nn.utils.rnn.pad_sequence([torch.tensor(s) for s in seqs], batch_first=True, padding_value=PAD_ID)

        return Batch(pad([src[i] + [EOS_ID] for i in rows]), pad([[BOS_ID] + tgt[i] for i in rows]),
                     pad([tgt[i] + [EOS_ID] for i in rows]), [len(src[i]) + 1 for i in rows],
                     [len(tgt[i]) + 1 for i in rows])

    return [collate(b) for b in ids], sp.get_piece_size()


def train_flops(b: Batch, layers: int, d_model: int, d_ff: int, vocab: int, **_: object) -> float:
    """Model FLOPs of one update on the batch's real tokens: 3x the forward matmuls (every projection, attention's
    products per sentence, the decoder's causal half, the output projection); padding, softmax and norms excluded,
    so both systems are credited the same useful work."""
    d, n = d_model, layers
    per_src = n * (2 * 4 * d * d + 2 * 2 * d * d_ff) + n * 2 * 2 * d * d  # encoder layer + cross-attention K/V
    per_tgt = n * (2 * 4 * d * d + 2 * 2 * d * d + 2 * 2 * d * d_ff) + 2 * d * vocab
    attn = sum(n * 4 * d * (s * s + t * (t + 1) / 2 + t * s) for s, t in zip(b.src_lens, b.tgt_lens))
    return 3.0 * (per_src * sum(b.src_lens) + per_tgt * sum(b.tgt_lens) + attn)


def matmul_peak(dtype: torch.dtype, clock: Callable[[], float], n: int = 2048) -> float:
    """Square-matmul GFLOP/s at the current threads, the median of 7 (the MFU columns' roofline)."""
    a, b, c = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype), torch.empty(n, n, dtype=dtype)
    times = []
    for _ in range(8):  # the first: allocation and kernel choice
        t0 = clock()
        torch.mm(a, b, out=c)
        times.append(clock() - t0)
    return 2 * n**3 / 1e9 / statistics.median(times[1:])


class Reference(nn.Module):
    """nn.Transformer, post-norm, dropout 0.1, sinusoidal positions, one embedding for both inputs and the output,
    scaled by sqrt(d): the textbook way to write the paper's model."""

    def __init__(self, vocab: int, layers: int, d_model: int, heads: int, d_ff: int, **_: object):
        super().__init__()
        self.d = d_model
        self.emb = nn.Embedding(vocab, d_model, padding_idx=PAD_ID)
        nn.init.normal_(self.emb.weight, 0.0, d_model**-0.5)
        pos = torch.arange(1024.0)[:, None] * torch.exp(torch.arange(0, d_model, 2) * (-math.log(1e4) / d_model))
        self.register_buffer("pe", torch.stack([pos.sin(), pos.cos()], -1).flatten(1), persistent=False)
        self.drop = nn.Dropout(0.1)
        self.tf = nn.Transformer(d_model, heads, layers, layers, d_ff, 0.1, batch_first=True)

    def embed(self, x: Tensor) -> Tensor:
        return self.drop(self.emb(x) * math.sqrt(self.d) + self.pe[: x.size(1)])

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        causal = torch.triu(torch.ones(tgt_in.size(1), tgt_in.size(1), dtype=torch.bool), diagonal=1)
        pad = src.eq(PAD_ID)
        h = self.tf(self.embed(src), self.embed(tgt_in), tgt_mask=causal, src_key_padding_mask=pad,
                    tgt_key_padding_mask=tgt_in.eq(PAD_ID), memory_key_padding_mask=pad)
        return F.linear(h, self.emb.weight)


def reference_step(vocab: int, dims: dict, seed: int) -> Callable[[Batch], float]:
    torch.manual_seed(seed)
    model = Reference(vocab, **dims).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / 400, math.sqrt(400 / (s + 1))))

    def step(b: Batch) -> float:
        logits = model(b.src, b.tgt_in)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), b.tgt_out.view(-1), ignore_index=PAD_ID,
                               label_smoothing=0.1, reduction="sum") / sum(b.tgt_lens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        return loss.item()

    return step


@contextlib.contextmanager
def plain_kernels(tricks: frozenset[str]) -> Iterator[None]:
    """mtpipe's step with the named tricks (:data:`PLAIN`) switched off, for the length of one step: each by the
    context its module offers."""
    from mtpipe.model import ops
    from mtpipe.training import loss

    switches = {"dropout": ops.fused_dropout, "attention": ops.fused_attention, "loss": loss.whole_logits}
    with contextlib.ExitStack() as stack:
        for name in sorted(tricks):
            stack.enter_context(switches[name]())
        yield


def mtpipe_step(vocab: int, dims: dict, precision: str, compiled: bool, args: argparse.Namespace,
                plain: frozenset[str] = frozenset()) -> Callable[[Batch], float]:
    from mtpipe.config import TrainConfig
    from mtpipe.model.transformer import Transformer

    from bench.train_step import make_train_step

    cfg = ModelConfig(preset="base", encoder_layers=dims["layers"], decoder_layers=dims["layers"],
                      d_model=dims["d_model"], heads=dims["heads"], d_ff=dims["d_ff"], **dims.get("model", {}))
    torch.manual_seed(args.seed)
    run = make_train_step(Transformer(cfg, vocab).train(), TrainConfig(
        precision=precision, compile=compiled, threads=args.threads, warmup=4000, label_smoothing=0.1))

    def step(b: Batch) -> float:
        with plain_kernels(plain):
            return float(run(b.src, b.tgt_in, b.tgt_out))

    return step


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="small,base", help="comma list of: " + ", ".join(DIMS))
    ap.add_argument("--precisions", default="fp32,bf16", help="mtpipe's precisions (comma list: fp32, bf16)")
    ap.add_argument("--steps", default="small=16,base=6", help="timed batches per config ('small=16,base=6', or one "
                    "number for all; 16 for a config not named)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per system on the largest other batches")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu (with --threads 1): this thread's CPU time, which other processes barely affect")
    ap.add_argument("--compile", choices=["off", "on", "both"], default="off", help="mtpipe with train.compile")
    ap.add_argument("--plain", default="", help="comma list of mtpipe CPU tricks to time switched off, a row each: "
                    + "; ".join(f"{k}: {v}" for k, v in PLAIN.items()))
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--data", default=str(DATA), help="directory with train.{en,de}.gz")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", metavar="CONFIG:PRECISION", help="a torch.profiler table of mtpipe's step instead")
    machine.add_flags(ap, rounds=1)
    args = ap.parse_args()
    args.configs, args.precisions = args.configs.split(","), args.precisions.split(",")
    args.plain = [t for t in args.plain.split(",") if t]
    if bad := [x for x in args.configs if x not in DIMS] + [p for p in args.precisions if p not in ("fp32", "bf16")] + [
            t for t in args.plain if t not in PLAIN]:
        ap.error(f"unknown {bad}")
    args.steps = ({k: int(v) for k, v in (kv.split("=") for kv in args.steps.split(","))} if "=" in args.steps
                  else dict.fromkeys(DIMS, int(args.steps)))
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu needs --threads 1 (other threads' CPU time is not this thread's)")
    return args


def profile_step(args: argparse.Namespace, batches: list[Batch], vocab: int) -> None:
    """``--profile``: a torch.profiler table of mtpipe's step."""
    from torch.profiler import ProfilerActivity, profile

    config, precision = args.profile.split(":")
    step, n = mtpipe_step(vocab, DIMS[config], precision, args.compile == "on", args), args.steps.get(config, 4)
    for b in batches[: args.warmup + n]:
        step(b)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in batches[args.warmup: args.warmup + n]:
            step(b)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=50))


def systems_of(c: str, vocab: int, args: argparse.Namespace) -> dict[str, Callable[[Batch], float]]:
    """The reference and mtpipe's steps (precisions, compiled, --plain rows) of config ``c``."""
    systems = {"reference fp32": reference_step(vocab, DIMS[c], args.seed)}
    for compiled in {"off": [False], "on": [True], "both": [False, True]}[args.compile]:
        for p in args.precisions:
            systems[f"mtpipe {p}" + " compiled" * compiled] = mtpipe_step(vocab, DIMS[c], p, compiled, args)
            for t in args.plain if not compiled else []:
                systems[f"mtpipe {p} plain {t}"] = mtpipe_step(vocab, DIMS[c], p, False, args, frozenset([t]))
    return systems


def time_config(c: str, timed: list[Batch], rest: list[Batch], vocab: int, args: argparse.Namespace, clock: Callable,
                peaks: dict[str, list[float]], bf16_peak: bool) -> tuple[list[dict], list[list]]:
    """Config ``c``'s systems on the ``timed`` batches, after warm-up on the largest of ``rest``: its figures and
    table rows."""
    systems = systems_of(c, vocab, args)
    # warm-up: the largest other batches (the allocator's steady state), then an untimed pass over the timed ones
    for name, step in systems.items():
        with console.status(f"{c} {name}: warm-up"):
            for b in sorted(rest, key=lambda b: -b.tgt_in.numel())[: args.warmup] + timed:
                step(b)
    for p in ("fp32", "bf16") if bf16_peak else ("fp32",):
        peaks[p].append(matmul_peak(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[p]), clock))
    names = list(systems)
    with console.status(f"{c}: {len(timed)} batches x {len(names)} systems x {args.rounds} round(s)"):
        secs = machine.interleaved(names, timed, args.rounds, lambda s, b: systems[s](b), clock)
    src = args.rounds * sum(sum(b.src_lens) for b in timed)
    tgt = args.rounds * sum(sum(b.tgt_lens) for b in timed)
    flops = args.rounds * sum(train_flops(b, vocab=vocab, **DIMS[c]) for b in timed)
    ref = [t for rnd in secs["reference fp32"] for t in rnd]
    figures, rows = [], []
    for name in names:
        own_secs = [t for rnd in secs[name] for t in rnd]
        total, ratios = sum(own_secs), [r / t for r, t in zip(ref, own_secs)]  # same batch: time = speed ratio
        target, gflops = TARGETS.get(name.split()[1]) if name.startswith("mtpipe") else None, flops / total / 1e9
        figures.append({"config": c, "system": name, "tgt_tokens_per_s": tgt / total,
                        "src_tgt_tokens_per_s": (src + tgt) / total, "seconds_per_step": total / len(own_secs),
                        "gflops": gflops, "ratio_to_reference": machine.stats(ratios), "per_batch_ratios": ratios,
                        "target": target})
        verdict = target and f">= {target}x: " + ("pass" if statistics.median(ratios) >= target else "MISSED")
        mfu = [f"{100 * gflops / statistics.median(peaks[p]):.0f}%" if peaks[p] else "-" for p in ("fp32", "bf16")]
        rows.append([c, name, round(tgt / total), round((src + tgt) / total), round(total / len(own_secs), 3),
                     round(gflops), *mfu, machine.spread(ratios, "x"), verdict])
    return figures, rows


def main() -> int:
    args = parse_args()
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    from mtpipe import platform
    from mtpipe.engine.runtime import tune_cpu_allocator

    tune_cpu_allocator()  # process-wide, as `mtpipe train` on CPU: the reference gets it too
    batches, vocab = load_batches(args)
    if args.profile:
        profile_step(args, batches, vocab)
        return 0
    ticks, own = machine.cpu_ticks(), machine.own_cpu()
    bf16_peak = platform.cpu().native_bf16  # without native bf16 a 2048^3 bf16 product takes minutes: no bf16 MFU
    peaks: dict[str, list[float]] = {"fp32": [], "bf16": []}
    figures, rows, used = [], [], 0
    for c in args.configs:
        timed = batches[used: used + args.steps.get(c, 16)]
        used += len(timed)
        if len(timed) < args.steps.get(c, 16):
            raise SystemExit(f"not enough batches for {args.steps.get(c, 16)} timed steps of {c}")
        f, r = time_config(c, timed, batches[used:], vocab, args, clock, peaks, bf16_peak)
        figures += f
        rows += r
    others = machine.others_share(ticks, own)
    unit = "per CPU-second of the one thread" if args.clock == "cpu" else "per second"
    table(f"training throughput (tokens {unit}), {args.threads} thread(s), batch by batch interleaved; matmul peak "
          f"fp32 {statistics.median(peaks['fp32']):.0f}" + (f", bf16 {statistics.median(peaks['bf16']):.0f}"
                                                            if peaks["bf16"] else "") + " GFLOP/s",
          ["config", "system", "tgt tok/s", "src+tgt tok/s", "s / step", "GFLOP/s", "MFU fp32", "MFU bf16",
           "x reference fp32: median (min-max) of batches", "target"], rows)
    console.print(f"other processes used {100 * others:.0f} % of the machine's CPU time during the run")
    machine.write_results("train_throughput", {"clock": args.clock, "threads": args.threads, "peaks_gflops": peaks,
                                               "others_cpu_share": others, "rows": figures}, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
