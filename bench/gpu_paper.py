#!/usr/bin/env python3
"""mtpipe on one GPU at the paper's shapes, in one command that fits ~10 minutes of device time.

    python bench/gpu_paper.py [--device cuda] [--budget-s 540] [--only train,decode,resume,checkpoint] [--results PATH]
    python bench/gpu_paper.py --device cpu --tiny --results /tmp/gpu_paper_cpu.json   # the same code, tiny shapes

Why: ``bench/gpu_check.sh`` runs the GPU paths on a real corpus at its params.yaml's shapes; this says whether
mtpipe's training update and decoder use a modern GPU well at the shapes of the paper's section 5 (5.1: WMT 2014
en-de, a joint BPE vocabulary of ~37,000 pieces, ~25,000 source and target tokens a batch over 8 GPUs, ~3,125 a GPU;
5.2 and Table 3: base and big), with nothing to download: random weights, synthetic batches built on the CPU.

* Data: WMT14-like pair lengths in BPE pieces (log-normal, mean ~32, sigma 0.55, cut at 250; the target the source
  x a log-normal ratio), Zipf-distributed ids over 37,000 pieces, packed by the bucket stage's own ``pack`` (its cap
  raised until the batches average ``--tokens`` real target tokens: 3,200, and 10,000), visited in ``epoch_order``.
* ``train``: base and big in bf16, eager and ``train.compile``, through ``mtpipe train``'s own update
  (:meth:`Trainer.updates <mtpipe.training.trainer.Trainer.updates>`: pipelined as ``train_loop`` runs them, by a
  trainer built by ``Trainer.for_updates``: the model, the :class:`~mtpipe.training.update.Updater` with its loss,
  fused Adam, schedule and autocast; batches collated and copied as training does). Per shape: steady target
  tokens/s, ms an update (after warm-up updates, where a compiled model compiles), peak memory (from after the
  warm-up, the allocator's cache kept), MFU against the dense bf16 peak of the GPU by its exact name
  (:data:`PEAK_BF16_TFLOPS`; a name not there: MFU not computable), and over a few updates under ``torch.profiler``:
  GPU-busy time (the union of kernels and copies) over the unprofiled update, kernels, kernel launch calls, syncs
  and device-to-host copies an update (events classified by device and name where torch's have no activity type).
* ``checkpoint``: ``mtpipe train``'s checkpoint (weights, Adam, RNG, manifest hashes) of base and big: seconds, bytes,
  the load back. ``resume``: base, 2k updates against k, checkpoint, a new trainer resumed from it
  (``resume.restore``), k more: weights bitwise equal? (bf16 and fp32), under
  ``torch.use_deterministic_algorithms(True)`` with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (on a GPU, attention's
  backward and cuBLAS otherwise accumulate in an order that varies from run to run); the same with torch's default
  algorithms (what ``mtpipe train`` runs) last, as information.
* ``decode``: ``mtpipe decode``'s engine (:class:`~mtpipe.engine.translate.MtpipeEngine`, its defaults: 8,000-token
  batches, CUDA graphs), beam 4, alpha 0.6, 3,003 sources (newstest2014's count), fp32 and bf16: sentences/s, peak
  memory. Random weights rarely emit EOS, so every output runs to its maximum: the paper's source + 50 is capped at
  source + ``--max-len-b`` (default 10) to fit the budget.

Model FLOPs of an update (:func:`update_flops`; a [m, k] x [k, n] matmul is 2mkn; real tokens only, so padding counts
against MFU; s_i, t_i the positions of sentence i with EOS / BOS, S = sum s_i, T = sum t_i, d = d_model, f = d_ff,
V = vocabulary, N_e / N_d the layers; the causal self-attention counted in full, t_i^2, as PaLM counts it)::

    forward = N_e * (S * (8d^2 + 4df) + 4d * sum s_i^2)                           # Q,K,V,O; FFN; QK^T and AV
            + N_d * (T * (12d^2 + 4df) + S * 4d^2 + 4d * sum (t_i^2 + t_i s_i))   # + cross-attention Q,O / K,V
            + 2dV * T                                                           # the output projection (3.4)
    update  = 3 * forward (the backward: 2 x forward);  MFU = update FLOPs / (seconds an update x peak)

First a preflight (:func:`bench.machine.preflight`) names what the image lacks, one line each (a compiler and Python's
headers, Triton, safetensors, xxhash, a torch new enough), and only the parts that need it are skipped: compiled
training without the first three, checkpoint and resume without safetensors. Every part ends in figures, a skip
that says why, or its error: nothing stops the run.

Targets reported against, not asserted: MFU >= 40 % big, >= 35 % base; GPU busy >= 90 % of an update; big >= 164,000
target tokens/s a GPU (NVIDIA DeepLearningExamples' 82,059 on an A100, x 2 for an H100/H200); base >= 2.5 x big.
Each part checks the time left of ``--budget-s`` first (recorded as skipped when its estimate does not fit); loops stop
at the deadline (recorded as partial). Results: ``bench/results/gpu_paper-<UTC time>.json`` (or ``--results``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

STARTED = time.monotonic()  # the budget counts the imports too
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import machine  # noqa: E402
from mtpipe import env as mtenv  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity  # noqa: E402

from mtpipe import artifacts  # noqa: E402
from mtpipe.config import DecodeConfig, ModelConfig, TrainConfig, to_dict  # noqa: E402
from mtpipe.engine.search import DecodeRules  # noqa: E402
from mtpipe.engine.translate import MtpipeEngine  # noqa: E402
from mtpipe.model.transformer import Transformer  # noqa: E402
from mtpipe.stages.bucket import length_order, pack  # noqa: E402
from mtpipe.training import checkpoints, distributed, resume  # noqa: E402
from mtpipe.training.batches import BatchTable, TokenSplit, TrainData  # noqa: E402
from mtpipe.training.state import rng_state, trainer_state  # noqa: E402
from mtpipe.training.trainer import Trainer  # noqa: E402

# Dense bf16 tensor-core peak, TFLOP/s (vendor data sheets: half their "with sparsity" figure), by the exact name
# CUDA gives the device: the SXM, PCIe and NVL cards of one chip differ, so a name not here gets no MFU (not a
# neighbour's peak).
PEAK_BF16_TFLOPS = {
    "NVIDIA H100 80GB HBM3": 989.5,  # H100 SXM5
    "NVIDIA H100 PCIe": 756.5,
    "NVIDIA H100 NVL": 835.5,
    "NVIDIA H200": 989.5,  # H200 SXM
    "NVIDIA H200 NVL": 835.5,
    "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0, "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA L40S": 362.0,
}
# cuBLAS's workspace setting that torch.use_deterministic_algorithms needs on a GPU; cuBLAS reads it when its first
# handle is made, so it is set (unless given) before any CUDA work (main)
CUBLAS_DETERMINISTIC = ":4096:8"
TARGETS = {"mfu_big": 0.40, "mfu_base": 0.35, "gpu_busy": 0.90, "big_tgt_tokens_per_s": 164_000, "base_over_big": 2.5}
PARTS = ("train", "checkpoint", "resume", "decode")
UPDATE_MARK = "gpu_paper.update"
GPU_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize")


@dataclass(frozen=True)
class Scale:
    """The shapes of a run, the paper's (:data:`PAPER`) or ``--tiny`` (:data:`TINY`, for a CPU), its default budget,
    and the seconds each part is expected to take (what the budget checks before starting it)."""

    models: dict[str, dict[str, Any]]
    vocab: int
    tokens: tuple[int, ...]  # real target tokens an update (the mean of the batches)
    pairs: int  # synthetic training pairs per token budget
    sentences: int  # decoding sources
    warmup: int
    compile_warmup: int
    updates: int
    profile_updates: int
    resume_updates: int  # k: 2k in one go against k + resumed k
    budget_s: float
    estimate_s: dict[str, float]


PAPER = Scale(models={"base": {"preset": "base"}, "big": {"preset": "big"}}, vocab=37_000, tokens=(3200, 10000),
              pairs=60_000, sentences=3003, warmup=3, compile_warmup=6, updates=20, profile_updates=3,
              resume_updates=4, budget_s=540, estimate_s={"train": 15, "profile": 10, "compile": 150,
                                                          "checkpoint": 40, "resume": 25, "decode": 45})
TINY = Scale(models={"base": {"preset": "tiny", "d_model": 64, "d_ff": 256, "heads": 4},
                     "big": {"preset": "tiny", "d_model": 128, "d_ff": 512, "heads": 8}},
             vocab=2000, tokens=(300, 1000), pairs=3000, sentences=300, warmup=1, compile_warmup=2, updates=3,
             profile_updates=2, resume_updates=2, budget_s=100,
             estimate_s={"train": 4, "profile": 3, "compile": 100, "checkpoint": 3, "resume": 5, "decode": 10})


class Clock:
    """The run's time budget: every part goes through :meth:`guarded`; loops stop when :meth:`left` is <= 0."""

    def __init__(self, budget_s: float, reserve_s: float = 5.0):
        self.t0, self.budget, self.reserve = STARTED, budget_s, reserve_s  # reserve: writing the results

    def left(self) -> float:
        return self.budget - self.reserve - (time.monotonic() - self.t0)

    def say(self, line: str) -> None:
        print(f"[+{time.monotonic() - self.t0:5.0f}s] {line}", flush=True)

    def guarded(self, label: str, need: float, fn: Callable[[], dict[str, Any]], device: torch.device,
                show: bool = True) -> dict[str, Any]:
        """``fn()`` when ``need`` seconds fit the budget (else recorded as skipped), its error recorded, not
        raised (a GPU check reports what failed and goes on), GPU memory freed after it."""
        if self.left() < need:
            out = {"skipped": f"needs ~{need:.0f} s, {max(self.left(), 0):.0f} s of the budget left"}
        else:
            try:
                out = fn()
            except Exception as e:  # noqa: BLE001
                out = {"error": f"{type(e).__name__}: {e}"[:2000]}
            free_memory(device)
        if show or "skipped" in out or "error" in out:
            self.say(f"{label}: " + (brief(out) if "ms_per_update" in out else str(out)[:600]))
        return out


# ---- WMT-shaped synthetic data, built on the CPU ---------------------------------------------------------------------

def synthetic_split(seed: int, n: int, vocab: int) -> TokenSplit:
    """``n`` WMT14 en-de-like pairs as a :class:`TokenSplit` (the form ``mtpipe train`` collates batches from):
    lengths in BPE pieces without EOS log-normal, mean ~32, a long tail cut at 250, the target the source times a
    log-normal ratio (sigma 0.2); ids past the 4 specials, Zipf-distributed (p ~ 1 / rank)."""
    rng, sigma = np.random.default_rng(seed), 0.55
    src = rng.lognormal(np.log(32.0) - sigma**2 / 2, sigma, n)
    lens = [np.clip(np.rint(x), 1, 250).astype(np.int64) for x in (src, src * rng.lognormal(0.0, 0.2, n))]
    off = [np.concatenate([[0], np.cumsum(x)]).astype(np.int64) for x in lens]
    cdf = np.cumsum(1.0 / np.arange(1, vocab - 3))
    ids = [(np.searchsorted(cdf / cdf[-1], rng.random(int(o[-1]))) + 4).astype(np.int32) for o in off]
    return TokenSplit("train", ids[0], off[0], ids[1], off[1], np.arange(n, dtype=np.int64))


def batches_for(split: TokenSplit, tokens: int, vocab: int) -> TrainData:
    """The pairs in batches as ``mtpipe bucket`` packs them (sorted by length, :func:`~mtpipe.stages.bucket.pack`,
    padded tokens a side capped), the cap raised from ``tokens`` in ~5 % steps until the batches average ``tokens``
    real target tokens (length-sorted packing pads the target side by ~10-25 %); one batch an update (one GPU)."""
    src, tgt = split.src_len + 1, split.tgt_len + 1  # + EOS (and BOS on tgt_in)
    order = length_order(src, tgt)
    s, t, cap = src[order], tgt[order], tokens
    while True:
        bounds = pack(s, t, cap, 8)
        starts = bounds[:-1]
        if np.add.reduceat(t, starts).mean() >= tokens or cap > 4 * tokens:
            break
        cap = (cap * 21 // 20) // 8 * 8 + 8
    table = BatchTable(rows=order.astype(np.int64), off=bounds, src_tokens=np.add.reduceat(s, starts),
                       tgt_tokens=np.add.reduceat(t, starts), src_width=np.maximum.reduceat(s, starts),
                       tgt_width=np.maximum.reduceat(t, starts))
    return TrainData(vocab={"spm_sha256": "synthetic", "size": vocab}, max_tokens=cap, train_tokens=split,
                     train=table, valid_tokens=None, valid=None, accum=1, per_update=1, usable=len(table))


# ---- Training through mtpipe train's own update ----------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> dict[str, float] | None:
    gib = lambda n: round(n / 2**30, 2)  # noqa: E731
    return None if device.type != "cuda" else {"allocated_gib": gib(torch.cuda.max_memory_allocated(device)),
                                               "reserved_gib": gib(torch.cuda.max_memory_reserved(device))}


def reset_peak(device: torch.device) -> None:
    """The peak memory counters from here on; the allocator's cached blocks kept, so that what follows (the timed
    updates after the warm-up) allocates as it does in a run."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def free_memory(device: torch.device) -> None:
    """After a part: what it held (a model, its optimizer, the allocator's cached blocks) given back, peaks reset."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    reset_peak(device)


def model_config(scale: Scale, name: str) -> ModelConfig:
    return ModelConfig(**scale.models[name]).resolved()


def train_cfg(precision: str, compile: bool, device: torch.device) -> TrainConfig:
    return TrainConfig(precision=precision, compile=compile, device=device.type, seed=1, save_every_minutes=0)


def updates(t: Trainer, n: int, clock: Clock | None = None, mark: str | None = None) -> list[int]:
    """``n`` updates of ``mtpipe train``'s pipelined loop (:meth:`Trainer.updates`), stopped when ``clock`` runs out."""
    return t.updates(n, go_on=(lambda: clock.left() > 0) if clock is not None else lambda: True, mark=mark)


def update_flops(m: ModelConfig, vocab: int, s: np.ndarray, t: np.ndarray) -> float:
    """The model FLOPs of an update on sentences of ``s`` source and ``t`` target positions (module docstring)."""
    s, t = s.astype(np.float64), t.astype(np.float64)
    d, f, big_s, big_t = m.d_model, m.d_ff, s.sum(), t.sum()
    enc = m.encoder_layers * (big_s * (8 * d * d + 4 * d * f) + 4 * d * (s * s).sum())
    dec = m.decoder_layers * (big_t * (12 * d * d + 4 * d * f) + big_s * 4 * d * d + 4 * d * (t * t + t * s).sum())
    return 3.0 * (enc + dec + 2 * d * vocab * big_t)


def batches_flops(t: Trainer, batches: list[int]) -> float:
    split, table = t.data.train_tokens, t.data.train
    return sum(update_flops(t.model.cfg, t.data.vocab["size"], split.src_len[rows] + 1, split.tgt_len[rows] + 1)
               for rows in (table.batch(b) for b in batches))


def profile(t: Trainer, n: int) -> dict[str, Any]:
    """``n`` updates under ``torch.profiler``, each marked, and what they did on the GPU and to reach it."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if t.device.type == "cuda" else [])
    sync(t.device)
    with torch.profiler.profile(activities=acts) as prof:
        updates(t, n, mark=UPDATE_MARK)  # the read of the last update falls after the marks, as it would in a run
        sync(t.device)
    events = prof.profiler.kineto_results.events()
    try:
        figures = profile_figures(events, n)
    except AttributeError as e:  # a profiler whose events have neither activity_type nor device_type
        return {"skipped": f"torch {torch.__version__}'s profiler events cannot be classified ({e})"}
    if figures.get("event_kinds") == "activity_type":  # the fallback checked on this very trace
        again = profile_figures(events, n, by_name=True)
        figures["by_name_agrees"] = all(again.get(k) == v for k, v in figures.items() if k != "event_kinds")
    return figures


def kind_by_name(e: Any) -> str:
    """A profiler event's activity (``kernel``, ``gpu_memcpy``, ``cuda_runtime``, ``user_annotation`` ...) as
    ``activity_type()`` gives it, read from its device and name, for a torch whose events have no activity type
    (older builds): GPU-side, copies and fills by name, syncs and waits apart, the rest kernels; host-side, CUDA
    runtime ``cuda*`` and driver ``cu*`` calls."""
    name, on_gpu = e.name(), "CUDA" in str(e.device_type())
    if name == UPDATE_MARK:
        return "gpu_user_annotation" if on_gpu else "user_annotation"
    if on_gpu:
        if name.startswith(("Memcpy", "Memset")):
            return "gpu_memcpy" if name.startswith("Memcpy") else "gpu_memset"
        return "cuda_sync" if re.search(r"\b(Sync|Wait)\b", name) else "kernel"
    if re.match(r"cuda[A-Z]", name):
        return "cuda_runtime"
    return "cuda_driver" if re.match(r"cu[A-Z]", name) else "cpu_op"


def profile_figures(events: Any, n: int, by_name: bool = False) -> dict[str, Any]:
    """GPU-busy time (the union of kernels and copies from the first update's start), its share of the profiled
    window, and per update: kernels run, kernel launch calls (runtime and driver API, within the updates' marks),
    host syncs, device-to-host copies. ``event_kinds``: how events were classified: by their activity type, or
    (``by_name``, or where they have none) by :func:`kind_by_name`."""
    events = list(events)
    lacking = bool(events) and not hasattr(events[0], "activity_type")
    events = [(e, kind_by_name(e) if by_name or lacking else e.activity_type()) for e in events]
    by = "activity_type" if not (by_name or lacking) else "device and name" + (
        f" (torch {torch.__version__}'s profiler events have no activity_type)" if lacking else "")
    marks = sorted((e.start_ns(), e.end_ns()) for e, kind in events  # the host's ranges, not their GPU-side twins
                   if e.name() == UPDATE_MARK and kind == "user_annotation")
    if not marks:
        return {"skipped": "no update marks in the profile", "event_kinds": by}
    lo = marks[0][0]

    def inside(e: Any) -> bool:
        return any(a <= e.start_ns() <= b for a, b in marks)

    gpu = sorted((e.start_ns(), e.end_ns(), e.name(), kind) for e, kind in events
                 if kind in GPU_ACTIVITY and e.start_ns() >= lo)
    busy, end = 0, lo
    for a, b, *_ in gpu:  # the union of the intervals
        busy, end = busy + max(0, b - max(a, end)), max(end, b)
    window = max([b for _, b in marks] + [end]) - lo
    api = [e for e, kind in events if kind in ("cuda_runtime", "cuda_driver") and inside(e)]
    launches = Counter(e.name() for e in api if "LaunchKernel" in e.name() or "GraphLaunch" in e.name())
    syncs = Counter(e.name() for e in api if e.name() in SYNCS)
    per = lambda c: {k: round(v / n, 1) for k, v in sorted(c.items())}  # noqa: E731
    return {"updates": n, "gpu_busy_ms_per_update": round(busy / n / 1e6, 3),
            "busy_of_profiled_window": round(busy / window, 4) if window and gpu else None,
            "profiled_ms_per_update": round(window / n / 1e6, 3),
            "kernels_per_update": round(sum(1 for *_, kind in gpu if kind == "kernel") / n, 1),
            "kernel_launches_per_update": round(sum(launches.values()) / n, 1), "launch_calls": per(launches),
            "syncs_per_update": round(sum(syncs.values()) / n, 1), "sync_calls": per(syncs),
            "dtoh_copies_per_update": round(sum(1 for _, _, name, _ in gpu if "DtoH" in name) / n, 1),
            "event_kinds": by}


def measure(t: Trainer, scale: Scale, clock: Clock, peak: float | None, warmup: int) -> dict[str, Any]:
    """One shape: warm-up updates (timed: a compiled one compiles there), steady updates, peak memory, MFU, the
    profile."""
    t0 = time.perf_counter()
    updates(t, warmup)
    sync(t.device)
    warm_s = time.perf_counter() - t0
    reset_peak(t.device)
    t0 = time.perf_counter()
    done = updates(t, scale.updates, clock)
    sync(t.device)
    seconds = time.perf_counter() - t0
    if not done:
        return {"skipped": "the budget ran out during the warm-up", "warmup_s": round(warm_s, 1)}
    tgt, flops, n = int(t.data.train.tgt_tokens[done].sum()), batches_flops(t, done), len(done)
    ms = seconds / n * 1e3
    out = {"bucket_max_tokens": t.data.max_tokens, "warmup_updates": warmup, "warmup_s": round(warm_s, 2),
           "updates": n, "partial": n < scale.updates, "tgt_tokens_per_update": round(tgt / n),
           "src_tokens_per_update": round(int(t.data.train.src_tokens[done].sum()) / n),
           "tgt_tokens_per_s": round(tgt / seconds), "ms_per_update": round(ms, 2), "peak_memory": peak_gib(t.device),
           "model_tflop_per_update": round(flops / n / 1e12, 3), "achieved_tflop_s": round(flops / seconds / 1e12, 2),
           "mfu": round(flops / seconds / (peak * 1e12), 4) if peak else None}
    prof = clock.guarded("profile", scale.estimate_s["profile"], lambda: profile(t, scale.profile_updates), t.device,
                         show=False)
    if "gpu_busy_ms_per_update" in prof and t.device.type == "cuda":
        prof["gpu_busy_of_update"] = round(prof["gpu_busy_ms_per_update"] / ms, 4)
    return {**out, "profile": prof}


def train_model(name: str, compiled: bool, scale: Scale, splits: dict[int, TokenSplit], clock: Clock,
                device: torch.device, peak: float | None, lacks: str | None = None) -> dict[str, Any]:
    """Every ``--tokens`` shape of one model in one mode, on one model and optimizer (each shape's batches swapped
    in, its trainer state new): a compiled model compiles once. ``lacks``: why this mode cannot run here (the
    preflight's), each shape then recorded as skipped for it."""
    mode = "compiled" if compiled else "eager"
    if lacks:
        clock.say(f"train {name} {mode}: skipped: {lacks}")
        return {str(tokens): {"skipped": lacks} for tokens in scale.tokens}
    if compiled:
        torch._dynamo.reset()
    held: list[Trainer] = []

    def shape(tokens: int) -> dict[str, Any]:
        data = batches_for(splits[tokens], tokens, scale.vocab)
        if not held:
            held.append(Trainer.for_updates(model_config(scale, name), train_cfg("bf16", compiled, device), data,
                                            device))
        else:
            held[0].use_batches(data)  # a new run's state on these batches, the same model and optimizer
        return measure(held[0], scale, clock, peak, scale.compile_warmup if compiled else scale.warmup)

    out = {}
    for tokens in scale.tokens:
        need = scale.estimate_s["train"] + (scale.estimate_s["compile"] if compiled and not held else 0)
        r = out[str(tokens)] = clock.guarded(f"train {name} {mode} {tokens:,} tokens", need,
                                             lambda: shape(tokens), device)  # noqa: B023 (called at once)
        if compiled and "warmup_s" in r:  # the next model compiles about as long: this one's time and a margin
            scale.estimate_s["compile"] = max(scale.estimate_s["compile"], 1.3 * r["warmup_s"])
    for t in held:
        t.close_updates()
    held.clear()
    free_memory(device)
    return out


def brief(r: dict[str, Any]) -> str:
    p, pct = r.get("profile", {}), lambda v: "n/a" if v is None else f"{v:.1%}"
    return (f"{r['tgt_tokens_per_s']:,} tgt tok/s, {r['ms_per_update']} ms/update, MFU {pct(r.get('mfu'))}, GPU busy "
            f"{pct(p.get('gpu_busy_of_update'))}, kernels {p.get('kernels_per_update')}, syncs "
            f"{p.get('syncs_per_update')}, peak {(r['peak_memory'] or {}).get('allocated_gib')} GiB")


# ---- Checkpoints and exact resume ------------------------------------------------------------------------------------

def save(t: Trainer, out: Path) -> Path:
    """``mtpipe train``'s checkpoint of ``t`` (what ``Checkpointer.save`` writes on rank 0: weights, Adam state, RNG,
    the trainer state; no upstream artifacts to hash here) under run directory ``out``; returns its path."""
    ts = trainer_state(t.state, t.updater.optimizer, t.updater.scaler, [rng_state(t.device)], 1, t.data.accum,
                       t.cfg.seed)
    meta = artifacts.CheckpointManifest(model_config=to_dict(t.model.cfg), vocab=t.data.vocab, step=int(ts["step"]),
                                        epoch=t.state.epoch, world_size=1, precision=t.precision, valid={}, decode={})
    checkpoints.write(out, t.model, meta, ts, t.cfg, upstream={}, seconds=0.0)
    return artifacts.checkpoint_path(out, t.state.step)


def checkpoint_one(name: str, scale: Scale, device: torch.device, split: TokenSplit, work: Path) -> dict[str, Any]:
    """Two updates (so that Adam has its state), then the checkpoint written, its size, and read back."""
    t = Trainer.for_updates(model_config(scale, name), train_cfg("bf16", False, device),
                            batches_for(split, scale.tokens[0], scale.vocab), device)
    try:
        updates(t, 2)
    finally:
        t.close_updates()  # its batch producer (a thread with pinned batches, on a GPU)
    sync(device)
    t0 = time.perf_counter()
    path = save(t, work / f"ck-{name}")
    t1 = time.perf_counter()
    artifacts.load_checkpoint(path, trainer_state=True)
    write_s, load_s = t1 - t0, time.perf_counter() - t1
    files = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file()}
    shutil.rmtree(work / f"ck-{name}", ignore_errors=True)
    return {"write_s": round(write_s, 2), "load_s": round(load_s, 2), "mib": round(sum(files.values()) / 2**20, 1),
            "files": files, "parameters": sum(p.numel() for p in t.model.parameters()), "directory": str(work)}


def resume_run(scale: Scale, precision: str, device: torch.device, split: TokenSplit, work: Path) -> dict[str, Any]:
    """Base: 2k updates in one go (twice: is the run itself deterministic?) against k, checkpoint, a new trainer
    resumed from it (``resume.restore``, in ``Trainer.__init__``'s order), k more; the weights compared."""
    k, mcfg, cfg = scale.resume_updates, model_config(scale, "base"), train_cfg(precision, False, device)
    data = batches_for(split, scale.tokens[0], scale.vocab)  # read only: the trainers share it
    weights = lambda t: {n: p.detach().cpu().clone() for n, p in t.model.state_dict().items()}  # noqa: E731
    same = lambda a, b: all(torch.equal(a[n], b[n]) for n in a)  # noqa: E731
    straight = []

    def run(t: Trainer, steps: int) -> Trainer:
        try:
            updates(t, steps)
        finally:
            t.close_updates()
        return t

    for steps in (2 * k, 2 * k, k):  # the last: k updates, then its checkpoint
        t = run(Trainer.for_updates(mcfg, cfg, data, device), steps)
        straight.append(weights(t))
    ck = artifacts.load_checkpoint(save(t, work / f"resume-{precision}"), trainer_state=True)
    t = Trainer.for_updates(mcfg, cfg, data, device, state_dict=ck.state_dict)
    t.use_batches(data, resume.restore(ck, t.updater.optimizer, t.updater.scaler, accum=1, seed=cfg.seed,
                                       device=device))
    run(t, k)
    shutil.rmtree(work / f"resume-{precision}", ignore_errors=True)
    a, b = straight[0], weights(t)
    return {"updates": 2 * k, "resumed_at": k, "bitwise_equal": same(a, b), "uninterrupted_twice_equal":
            same(a, straight[1]), "max_abs_diff": max(float((a[n].float() - b[n].float()).abs().max()) for n in a)}


@contextlib.contextmanager
def algorithms(deterministic: bool) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(deterministic)`` for the block (not warn-only: an operation without a
    deterministic kernel raises rather than run one that is not), the previous mode put back."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def resume_check(scale: Scale, precision: str, device: torch.device, split: TokenSplit, work: Path,
                 deterministic: bool) -> dict[str, Any]:
    """:func:`resume_run` under deterministic algorithms (the check: on a GPU, the default flash / memory-efficient
    attention backward and cuBLAS's split reductions accumulate in an order that varies from run to run, so the
    default mode can differ without a resume bug) or torch's default ones (information: what ``mtpipe train`` runs).
    An operation without a deterministic kernel makes the check impossible: said so, by name."""
    mode = (f"deterministic: torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG="
            f"{mtenv.get('CUBLAS_WORKSPACE_CONFIG')}" if deterministic else "torch's default algorithms (information)")
    try:
        with algorithms(deterministic):
            return {"algorithms": mode, **resume_run(scale, precision, device, split, work)}
    except RuntimeError as e:
        if not deterministic or "deterministic" not in str(e):
            raise
        first = next((line for line in str(e).splitlines() if line.strip()), "")[:300]
        return {"algorithms": mode, "skipped": f"not checkable in deterministic mode: {first}"}


# ---- Decoding --------------------------------------------------------------------------------------------------------

def decode_one(model: Transformer, sources: list[list[int]], precision: str, max_len_b: int, clock: Clock,
               device: torch.device, cap_s: float) -> dict[str, Any]:
    """``mtpipe decode``'s engine on ``sources`` at ``precision``: a short warm-up, then all of them timed (stopped
    at the deadline or after ``cap_s`` through the engine's progress callback: then the rate of what was done)."""
    cfg = DecodeConfig(precision=precision, device=device.type, max_len_b=max_len_b)
    rules = DecodeRules.from_config(cfg)
    engine = MtpipeEngine.open(model, cfg)
    engine.translate(sources[:16], rules)
    reset_peak(device)
    done = [0]

    def on_done(n: int) -> None:  # n more sentences finished
        done[0] += n
        if clock.left() <= 0 or time.perf_counter() - t0 > cap_s:
            raise TimeoutError("the budget ran out")

    t0 = time.perf_counter()
    hyps = None
    with contextlib.suppress(TimeoutError):
        hyps = engine.translate(sources, rules, on_done=on_done)
    sync(device)
    seconds = time.perf_counter() - t0
    out = {"sentences": done[0], "partial": hyps is None, "seconds": round(seconds, 2),
           "sentences_per_s": round(done[0] / seconds, 1), "peak_memory": peak_gib(device),
           "max_len": f"source + {max_len_b}", "beam": cfg.beam, "max_tokens": cfg.max_tokens,
           "cuda_graphs": cfg.cuda_graphs and device.type == "cuda"}
    if hyps is not None:
        lens = [len(h[0].tokens) for h in hyps]
        out.update(output_tokens_per_s=round(sum(lens) / seconds), mean_output_len=round(float(np.mean(lens)), 1),
                   at_max_len=round(float(np.mean([n == len(s) + max_len_b for n, s in zip(lens, sources)])), 3))
    return out


def decode_part(scale: Scale, clock: Clock, device: torch.device, max_len_b: int) -> dict[str, Any]:
    """Base, random weights, beam 4 on ``scale.sentences`` WMT-length sources, fp32 then bf16."""
    out: dict[str, Any] = {"note": f"random weights: outputs run to the maximum length, capped at source + "
                                   f"{max_len_b} (the paper's source + 50) to fit the budget"}
    clock.say("decode: " + out["note"])
    split = synthetic_split(7, scale.sentences, scale.vocab)  # the sources (ids without EOS)
    sources = [split.src[a:b].tolist() for a, b in zip(split.src_off[:-1], split.src_off[1:])]
    out["source_tokens_mean"] = round(float(np.mean([len(s) for s in sources])), 1)
    torch.manual_seed(1)
    model = Transformer(model_config(scale, "base"), scale.vocab).to(device)
    for precision in ("fp32", "bf16"):
        est = scale.estimate_s["decode"]
        out[precision] = clock.guarded(f"decode base {precision}", est, lambda: decode_one(
            model, sources, precision, max_len_b, clock, device, 2 * est), device)  # noqa: B023 (called at once)
    return out


# ---- The machine, the targets, the run -------------------------------------------------------------------------------

def versions(device: torch.device) -> dict[str, Any]:
    """torch, CUDA, cuDNN, NCCL, the GPU and its driver, and the dense bf16 peak this run's MFU is measured against."""
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device),
                           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                           "cublas_workspace_config": mtenv.get("CUBLAS_WORKSPACE_CONFIG")}
    if device.type != "cuda":
        return {**out, "gpu": None, "peak_bf16_tflops": None}
    with contextlib.suppress(Exception):  # a build without NCCL
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    props = torch.cuda.get_device_properties(device)
    out["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
                  "memory_gib": round(props.total_memory / 2**30, 1)}
    with contextlib.suppress(Exception):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        out["gpu"]["driver"] = smi.stdout.strip().splitlines()[0]
    out["peak_bf16_tflops"] = PEAK_BF16_TFLOPS.get(props.name)
    if out["peak_bf16_tflops"] is None:
        out["mfu"] = f"not computable: no bf16 peak known for '{props.name}' (PEAK_BF16_TFLOPS, by exact name)"
    return out


def against_targets(train: dict[str, Any]) -> list[dict[str, Any]]:
    """Each measured shape against :data:`TARGETS`, printed and returned (figures only: nothing is asserted)."""
    rows, pct, T = [], (lambda v: "n/a" if v is None else f"{v:.1%}"), TARGETS  # noqa: E731
    print(f"\nagainst the targets (figures, not claims): MFU >= {T['mfu_base']:.0%} base / {T['mfu_big']:.0%} big, "
          f"GPU busy >= {T['gpu_busy']:.0%}, big >= {T['big_tgt_tokens_per_s']:,} tgt tok/s, base/big >= "
          f"{T['base_over_big']}")
    for mode, models in train.items():
        for tokens in sorted({k for m in models.values() for k in m}, key=int):
            got = {n: models.get(n, {}).get(tokens, {}) for n in ("base", "big")}
            rate = {n: g.get("tgt_tokens_per_s") for n, g in got.items()}
            for n, g in got.items():
                busy = (g.get("profile") or {}).get("gpu_busy_of_update")
                rows.append({"mode": mode, "tokens": int(tokens), "model": n, "mfu": g.get("mfu"), "gpu_busy": busy,
                             "tgt_tokens_per_s": rate[n]})
                print(f"  {mode:8} {int(tokens):>6,} tgt tokens/update {n:4} MFU {pct(g.get('mfu'))}, GPU busy "
                      f"{pct(busy)}, {'n/a' if rate[n] is None else f'{rate[n]:,}'} tgt tok/s")
            if rate["base"] and rate["big"]:
                ratio = round(rate["base"] / rate["big"], 2)
                rows.append({"mode": mode, "tokens": int(tokens), "base_over_big": ratio})
                print(f"  {mode:8} {int(tokens):>6,} tgt tokens/update base/big rate {ratio}")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--budget-s", type=float, help="the whole run's seconds (default 540; --tiny 100)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"parts, comma-separated (default {','.join(PARTS)})")
    ap.add_argument("--modes", default="eager,compiled", help="training modes (default eager,compiled)")
    ap.add_argument("--tokens", help="real target tokens an update (a batch's mean), comma-separated (default "
                    "3200,10000; --tiny 300,1000)")
    ap.add_argument("--updates", type=int, help="measured updates a shape (default 20; --tiny 3)")
    ap.add_argument("--max-len-b", type=int, default=10, help="decoding's max length: source + this (default 10)")
    ap.add_argument("--sentences", type=int, help="decoding sources (default 3003; --tiny 300)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (d 64 and 128, 2+2 layers), for a CPU")
    ap.add_argument("--work", type=Path, help="where checkpoints are written (default: a temporary directory)")
    ap.add_argument("--results", type=Path, help="the results file (default bench/results/gpu_paper-<UTC time>.json)")
    args = ap.parse_args(argv)
    bad = (set(args.only.split(",")) - set(PARTS)) | (set(args.modes.split(",")) - {"eager", "compiled"})
    if bad:
        ap.error(f"unknown part or mode: {', '.join(sorted(bad))}")
    scale = TINY if args.tiny else PAPER
    for key, value in (("tokens", args.tokens), ("updates", args.updates), ("sentences", args.sentences)):
        if value:
            scale = replace(scale, **{key: tuple(int(x) for x in value.split(",")) if key == "tokens" else value})
    args.scale, args.budget_s = scale, args.budget_s or scale.budget_s
    return args


def run(args: argparse.Namespace, clock: Clock, device: torch.device, work: Path) -> dict[str, Any]:
    """The preflight, then the parts cheapest first, so that the budget cuts the costliest: eager training,
    checkpoints, resume (deterministic algorithms), decoding, compiled training; last the resume with torch's default
    algorithms (information)."""
    scale, only, modes = args.scale, args.only.split(","), args.modes.split(",")
    needs = machine.preflight(device.type)  # what this image lacks: one line each, and only the parts needing it go
    for need in needs:
        if not need.found:
            clock.say(need.line())
    env = versions(device)
    clock.say(f"versions: {env}")
    figures: dict[str, Any] = {"versions": env, "scale": "tiny" if args.tiny else "paper", "budget_s": args.budget_s,
                               "preflight": {n.key: True if n.found else n.line() for n in needs},
                               "vocab": scale.vocab, "tokens": list(scale.tokens), "targets": TARGETS,
                               "models": {n: to_dict(model_config(scale, n)) for n in scale.models}}
    splits = {k: synthetic_split(k, scale.pairs, scale.vocab) for k in scale.tokens}
    split, peak, est = splits[scale.tokens[0]], env["peak_bf16_tflops"], scale.estimate_s
    no_checkpoints = machine.missing(needs, "safetensors")

    def part(label: str, need: float, fn: Callable[[], dict[str, Any]], lacks: str | None = None) -> dict[str, Any]:
        if lacks:
            clock.say(f"{label}: skipped: {lacks}")
            return {"skipped": lacks}
        return clock.guarded(label, need, fn, device)

    def resumes(deterministic: bool) -> dict[str, Any]:
        return {p: part(f"resume base {p}" + ("" if deterministic else " (default algorithms)"), est["resume"],
                        lambda: resume_check(scale, p, device, split, work, deterministic),  # noqa: B023
                        no_checkpoints) for p in ("bf16", "fp32")}

    if "train" in only and "eager" in modes:
        figures["train_eager"] = {n: train_model(n, False, scale, splits, clock, device, peak) for n in scale.models}
    if "checkpoint" in only:
        figures["checkpoint"] = {n: part(f"checkpoint {n}", est["checkpoint"], lambda: checkpoint_one(
            n, scale, device, split, work), no_checkpoints) for n in scale.models}  # noqa: B023 (called at once)
    if "resume" in only:
        figures["resume"] = resumes(deterministic=True)
    if "decode" in only:
        figures["decode"] = decode_part(scale, clock, device, args.max_len_b)
    if "train" in only and "compiled" in modes:
        lacks = machine.missing(needs, "compiler", "headers", "triton")
        figures["train_compiled"] = {n: train_model(n, True, scale, splits, clock, device, peak, lacks)
                                     for n in scale.models}
    if "resume" in only:  # last: information, what the budget may cut
        figures["resume_default_algorithms"] = resumes(deterministic=False)
    figures["seconds"] = round(time.monotonic() - clock.t0, 1)
    figures["against_targets"] = against_targets({k[6:]: v for k, v in figures.items() if k.startswith("train_")})
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mtenv.put("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC, replace=False)  # before any CUDA work: see its comment
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible: `--device cpu --tiny` runs the same code at tiny shapes", file=sys.stderr)
        return 2
    clock = Clock(args.budget_s)
    ctx = distributed.init(device=args.device)  # world size 1: the update's collectives are identities
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_paper-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        figures = run(args, clock, ctx.device, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    machine.write_results("gpu_paper", figures, args.results)
    print(f"done in {figures['seconds']} s of a {args.budget_s:.0f} s budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
