#!/usr/bin/env python3
"""Decoding speed: mtpipe's incremental beam search vs a naive beam search that re-decodes the whole prefix.

Beam 4, GNMT length penalty alpha 0.6, max length source + 50, on the 1,000 sentences of
Multi30k ``test_2016_flickr.en.gz``, CPU with 2 threads (default), fp32 and bf16 autocast:

* **mtpipe**: :func:`mtpipe.decode.translate` as ``mtpipe decode`` runs it (encoder once per batch, cross-attention
  keys/values projected once, per-layer self-attention cache, finished sentences leave the batch);
* **naive**: the same search (same batches, same hypotheses) with :func:`mtpipe.decode.uncached_step`, which re-runs
  the decoder over the whole prefix every step (no cache; cross-attention keys/values re-projected each step).

All four (decoder, precision) runs happen in the same process, interleaved batch by batch (every batch is decoded
by each in turn, in rotating order), since this machine's speed drifts by up to 40 % over minutes and other
processes may share its CPUs: only the same-run ratios mean anything. Reported: sentences/s and target
tokens/s (hypothesis pieces without EOS, as the anchors counts them), the speed-up over naive, and
how many outputs are identical between the two (the fp32 runs must agree; bf16 may differ in near ties).
Target: mtpipe >= 4x naive at fp32.

A trained model: pass ``--checkpoint DIR --tokens DIR`` (a checkpoint and the bpe artifact it was trained with).
Without them the bench makes its own, once, under ``--workdir`` (default ``bench/out/decode_speed``): a joint 8k
SentencePiece BPE on Multi30k train and a ``small``-preset model (d256, 3+3 layers, the anchors' size) trained for
``--train-minutes`` with a minimal loop (label smoothing 0.1, Adam, inverse-sqrt schedule, bf16 autocast).
Its BLEU is printed so the lengths of its outputs can be judged; a few minutes of CPU training gives a weak model.

    python bench/decode_speed.py --wait-quiet 900                 # trains 20 min once, then decodes (~10 min)
    python bench/decode_speed.py --threads 1 --clock cpu          # steadier while other processes share the CPUs
    python bench/decode_speed.py --checkpoint artifacts/average --tokens artifacts/bpe
    python bench/decode_speed.py --sentences 200 --markdown /tmp/table.md
    python bench/decode_speed.py --profile                        # torch.profiler table of mtpipe's decode
    python bench/decode_speed.py --checkpoint ... --tokens ... --no-naive --plain ranking,projection --precisions fp32
    python bench/decode_speed.py --random-preset base --tokens artifacts/bpe --max-len-b 5 --no-naive \
        --plain layer-packing

``--plain ranking,projection`` adds a row per decoding trick with that trick switched off (:data:`PLAIN`), decoded
in the same interleaved batches, with mtpipe's speed over that row's per round: each trick's worth on this CPU.
``--no-naive`` leaves the naive decoder out (it re-decodes every prefix, the slowest by far). ``--compiled`` adds a
row decoded with ``decode.compile`` (the step through ``torch.compile``, built during the warm-up, before the timed
rounds), on a copy of the same weights, in the same interleaved batches. ``--compiled-gather-before`` adds one more
compiled row (its own copy and graphs) that gathers the cache's keys/values before the graph whatever their width:
the baseline for gathering wide rows inside the graph (``mtpipe.model._GATHER_IN_GRAPH_BYTES``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import gzip
import math
import os
import platform
import random
import shutil
import sys
import time
import unicodedata
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_ticks, own_cpu, patched  # noqa: E402
from mtpipe import (
    artifacts,  # noqa: E402
    runtime,
    writing,
)
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID, UNK_ID  # noqa: E402
from mtpipe.config import DecodeConfig, ModelConfig, to_dict  # noqa: E402
from mtpipe.console import console, fmt, progress, table  # noqa: E402
from mtpipe.decode import batches_by_tokens, translate  # noqa: E402
from mtpipe.model import Transformer, build_model  # noqa: E402
from mtpipe.search import Hypothesis  # noqa: E402

COMPILED = "mtpipe, decode.compile"  # the --compiled row
# --compiled-gather-before: decode.compile with every row of the cache gathered before the graph (in one copy), whatever
# its width, on its own copy of the weights (its own graphs): the baseline of model._GATHER_IN_GRAPH_BYTES' choice
GATHER_BEFORE = "mtpipe, decode.compile, gathered before the graph"

# Decoding tricks --plain can switch off for one row each: what each is replaced with.
PLAIN = {
    "ranking": "one top-k over every sentence's k x V extensions instead of mtpipe.search.top_candidates' chunks",
    "projection": "F.linear on the [V, D] matrix instead of Transformer.decoding_logits' kept copy",
    "packing": "Transformer.decoding_logits' [D, V] copy and addmm instead of oneDNN's packed copy",
    "layer-packing": "the linear layers' products on their weights as they are (oneDNN packs them per call) instead of "
                     "kept packed copies (mtpipe.kernels.Linear)",
    "onednn": "torch's own float32 products (MKL on x86) in the linear layers instead of oneDNN's (mtpipe.kernels.mm)",
}


@contextlib.contextmanager
def plain_decoding(model: Transformer, tricks: frozenset[str]):
    """mtpipe's decoding with the named tricks (:data:`PLAIN`) switched off, for the length of one batch."""
    import mtpipe.kernels as kernels
    import mtpipe.search as search

    switches = {
        "ranking": (search, "_CHUNK", 1 << 40),  # no vocabulary has 4 chunks this wide: top_candidates takes one top-k
        "packing": (kernels, "PACK_DECODING_PROJECTION", False),  # the kept copy remade as [D, V] (packed again after)
        "layer-packing": (kernels, "PACK_DECODING_LINEARS", False),
        "onednn": (kernels, "ONEDNN_FP32", False),
    }
    with patched(*(switch for name, switch in switches.items() if name in tricks)):
        if "projection" in tricks:
            object.__setattr__(model, "decoding_logits", model.logits)  # shadows the method on this model only
        try:
            yield
        finally:
            model.__dict__.pop("decoding_logits", None)


DATA = Path(os.environ.get("MTPIPE_MULTI30K", REPO / "data" / "multi30k"))  # {split}.{en,de}.gz


def read_gz(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [unicodedata.normalize("NFC", line.rstrip("\n")).strip() for line in f]


def others_share(since: tuple[float, float], own_since: float) -> float:
    """Share of the machine's CPU time used by *other* processes since ``since`` (``cpu_ticks()``) and
    ``own_since`` (``own_cpu()``)."""
    busy, total = cpu_ticks()
    if total <= since[1]:
        return 0.0
    return max(0.0, (busy - since[0]) - (own_cpu() - own_since)) / (total - since[1])


def wait_quiet(max_seconds: float, share: float = 0.15, window: float = 3.0) -> float:
    """Wait up to ``max_seconds`` until other processes use less than ``share`` of the CPUs over ``window`` s."""
    deadline = time.time() + max_seconds
    while True:
        ticks, own = cpu_ticks(), own_cpu()
        time.sleep(window)
        now = others_share(ticks, own)
        if now < share or time.time() >= deadline:
            return now


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# --------------------------------------------------------------------------------------------------------------------
# Fallback: a tokens artifact and a small trained model, made once
# --------------------------------------------------------------------------------------------------------------------


def make_tokens(workdir: Path, vocab_size: int) -> Path:
    """A bpe-like artifact: joint SentencePiece BPE on Multi30k train, train and test splits encoded."""
    import pyarrow as pa
    import sentencepiece as spm

    out = workdir / "tokens"
    if (out / artifacts.MANIFEST).exists():
        return out
    src, tgt = read_gz(DATA / "train.en.gz"), read_gz(DATA / "train.de.gz")
    tmp = workdir / "spm"
    tmp.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(src + tgt), model_prefix=str(tmp / "spm"),
                                   vocab_size=vocab_size, model_type="bpe", character_coverage=1.0, pad_id=PAD_ID,
                                   unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp / "spm.model"))
    with writing.ArtifactWriter(out, "tokens") as w:
        for split, prefix in (("train", "train"), ("test", "test_2016_flickr")):
            s, t = read_gz(DATA / f"{prefix}.en.gz"), read_gz(DATA / f"{prefix}.de.gz")
            w.write_table(f"{split}.parquet", pa.table({"id": list(range(len(s))), "src": sp.encode(s),
                                                        "tgt": sp.encode(t)}))
        shutil.copy(tmp / "spm.model", w.path("spm.model"))
        w.extra.update({"spm_sha256": artifacts.file_hash(w.path("spm.model")), "vocab_size": sp.get_piece_size()})
    shutil.rmtree(tmp)
    return out


def train_small(workdir: Path, tokens: Path, minutes: float, threads: int, batch_tokens: int) -> Path:
    """The ``small`` preset trained for ``minutes`` on Multi30k train (fallback when no checkpoint is given)."""
    import sentencepiece as spm

    out = workdir / "checkpoint"
    if (out / artifacts.MANIFEST).exists():
        return out
    torch.manual_seed(1)
    random.seed(1)
    sp = spm.SentencePieceProcessor(model_file=str(tokens / "spm.model"))
    vocab = sp.get_piece_size()
    t = artifacts.read_table(tokens, "train.parquet", "tokens")
    pairs = [(s, g) for s, g in zip(t.column("src").to_pylist(), t.column("tgt").to_pylist()) if s and g]
    pairs.sort(key=lambda p: (len(p[0]), len(p[1])))
    batches, cur, width = [], [], 0
    for p in pairs:  # token budget on the padded longer side (+ EOS/BOS), sorted by length
        w = max(width, len(p[0]) + 1, len(p[1]) + 1)
        if cur and (len(cur) + 1) * w > batch_tokens:
            batches.append(cur)
            cur, w = [], max(len(p[0]), len(p[1])) + 1
        cur.append(p)
        width = w
    batches.append(cur)

    def pad(seqs: list[list[int]]) -> torch.Tensor:
        return torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in seqs], batch_first=True,
                                               padding_value=PAD_ID)

    model = Transformer(ModelConfig(preset="small"), vocab).train()
    opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    warmup, peak = 400, 1e-3  # the anchors' reference trainer: inverse-sqrt schedule peaking at 1e-3
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: peak * min((s + 1) / warmup, math.sqrt(warmup / (s + 1))))
    torch.set_num_threads(threads)
    deadline = time.monotonic() + minutes * 60
    step = 0
    with progress() as bar:
        task = bar.add_task(f"train small ({minutes:g} min)", total=int(minutes * 60))
        start = time.monotonic()
        while time.monotonic() < deadline:
            random.shuffle(batches)
            for b in batches:
                src = pad([s + [EOS_ID] for s, _ in b])  # [B, S]
                tgt_in, tgt_out = pad([[BOS_ID] + g for _, g in b]), pad([g + [EOS_ID] for _, g in b])  # [B, T]
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    h = model.features(src, tgt_in)  # [B, T, D]
                    real = tgt_out != PAD_ID
                    logits = model.logits(h[real]).float()  # [N, V] non-pad positions only
                loss = F.cross_entropy(logits, tgt_out[real], label_smoothing=0.1)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                step += 1
                bar.update(task, completed=int(time.monotonic() - start),
                           description=f"train small: step {step} loss {loss.item():.2f}")
                if time.monotonic() >= deadline:
                    break
    writing.write_checkpoint(out, state_dict=model.state_dict(), model_config=to_dict(model.cfg),
                               vocab={"spm_sha256": artifacts.file_hash(tokens / "spm.model"), "size": vocab},
                               step=step, params={"bench": {"train_minutes": minutes, "batch_tokens": batch_tokens}},
                               upstream={"tokens": tokens})
    return out


def random_model(workdir: Path, tokens: Path, preset: str) -> Path:
    """A checkpoint of the ``preset``'s dimensions with random weights (seed 0) and ``tokens``' vocabulary, made once:
    for timing larger models than this machine can train (``--random-preset``; its translations are noise, so give
    a small ``--max-len-b`` to keep their lengths near real ones)."""
    vocab = spm_size(tokens)
    out = workdir / f"random-{preset}-{vocab}"
    if (out / "manifest.json").exists():
        return out
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=preset), vocab)
    writing.write_checkpoint(out, state_dict=model.state_dict(), model_config=to_dict(model.cfg),
                             vocab={"spm_sha256": artifacts.file_hash(tokens / "spm.model"), "size": vocab},
                             step=0, params={"bench": {"random_preset": preset}}, upstream={"tokens": tokens})
    return out


def spm_size(tokens: Path) -> int:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(artifacts.verify_file(tokens, "spm.model"))).get_piece_size()


# --------------------------------------------------------------------------------------------------------------------
# Decoding runs
# --------------------------------------------------------------------------------------------------------------------


def interleaved(model: Transformer, sources: list[list[int]], cfgs: dict[str, DecodeConfig], rounds: int,
                clock: str, names: list[str], compiled: Transformer | None = None,
                gather_before: Transformer | None = None
                ) -> tuple[dict[tuple[str, str], list[float]], dict[tuple[str, str], list[list[Hypothesis]]]]:
    """Seconds per round and outputs of every (decoder, precision), interleaved batch by batch.

    ``clock``: ``wall`` (elapsed time) or ``cpu`` (this process's CPU time, all threads: less sensitive to other
    processes taking the CPUs, but it counts threads spinning at barriers).

    The batches are the ones ``translate`` makes (length-sorted, ``max_tokens``); each batch is decoded by every
    (decoder, precision) in turn, the order rotating from batch to batch, so load from other processes and speed
    drift fall on all of them alike instead of on whichever ran during a slow minute.
    """
    precisions = list(cfgs)
    keys = [(name, p) for p in precisions for name in names]
    max_tokens = cfgs[precisions[0]].max_tokens
    batches = batches_by_tokens([len(s) + 1 for s in sources], max_tokens)
    seconds = {key: [0.0] * rounds for key in keys}
    outputs: dict[tuple[str, str], list[list[Hypothesis]]] = {key: [[] for _ in sources] for key in keys}
    with progress() as bar:
        task = bar.add_task("decode, interleaved", total=rounds * len(batches) * len(keys))
        for r in range(rounds):
            for b, batch in enumerate(batches):
                shift = (b + r) % len(keys)
                for name, p in keys[shift:] + keys[:shift]:
                    sub = [sources[i] for i in batch]
                    now = time.perf_counter if clock == "wall" else own_cpu
                    start = now()
                    tricks = frozenset(t for t in PLAIN if name == f"mtpipe, plain {t}")
                    if name == COMPILED:
                        out = translate(compiled, sub, dataclasses.replace(cfgs[p], compile=True), "cpu")
                    elif name == GATHER_BEFORE:
                        with gathered_before():
                            out = translate(gather_before, sub, dataclasses.replace(cfgs[p], compile=True), "cpu")
                    else:
                        with plain_decoding(model, tricks):
                            out = translate(model, sub, cfgs[p], "cpu", cache=name != "naive")
                    seconds[(name, p)][r] += now() - start
                    for i, hyps in zip(batch, out):
                        outputs[(name, p)][i] = hyps
                    bar.update(task, advance=1)
            console.print("round " + str(r + 1) + ": " + ", ".join(
                f"{name} {p} {seconds[(name, p)][r]:.1f} s" for name, p in keys))
    return seconds, outputs


def gathered_before():
    """decode.compile's cached keys/values gathered before the graph for rows of every width (the
    --compiled-gather-before row), instead of inside it from model._GATHER_IN_GRAPH_BYTES up."""
    import mtpipe.model as model_module

    return patched((model_module, "_GATHER_IN_GRAPH_BYTES", 1 << 40))


def profile(model: Transformer, sources: list[list[int]], cfg: DecodeConfig) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    translate(model, sources[:48], cfg, "cpu")  # warm-up (with decode.compile: the graphs are built here)
    step = model._compiled_step
    if step is not None:
        # The compiled step's generated kernels are no torch operations: one labelled row shows their time (its
        # self time), else it would only be missing from the table.
        def labelled(*args: Any) -> Any:
            with torch.profiler.record_function("decoder step (compiled; generated kernels in self time)"):
                return step(*args)

        model._compiled_step = labelled
    try:
        start = time.perf_counter()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            translate(model, sources, cfg, "cpu")
        wall = time.perf_counter() - start
    finally:
        model._compiled_step = step
    events = prof.key_averages()
    console.print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    ops = sum(e.self_cpu_time_total for e in events) / 1e6
    console.print(f"wall {wall:.2f} s (profiled); in torch operations (this thread) {ops:.2f} s, "
                  f"{ops / wall:.0%}; the rest is Python and the profiler's own cost per operation")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, help="A trained (or averaged) mtpipe checkpoint.")
    ap.add_argument("--tokens", type=Path, help="The bpe artifact the checkpoint was trained with (spm.model).")
    ap.add_argument("--workdir", type=Path, default=REPO / "bench" / "out" / "decode_speed",
                    help="Where the fallback tokens artifact and model are made (once) when not given.")
    ap.add_argument("--train-minutes", type=float, default=20.0, help="Fallback model's training time.")
    ap.add_argument("--train-batch-tokens", type=int, default=2048,
                    help="Fallback model's batch size in padded tokens (small: more updates in the time).")
    ap.add_argument("--source", type=Path, default=DATA / "test_2016_flickr.en.gz")
    ap.add_argument("--reference", type=Path, default=DATA / "test_2016_flickr.de.gz")
    ap.add_argument("--sentences", type=int, default=1000, help="First N sentences of --source.")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--max-tokens", type=int, default=DecodeConfig().max_tokens)
    ap.add_argument("--max-len-b", type=int, default=DecodeConfig().max_len_b,
                    help="outputs may have source length + this many tokens (the paper's 50)")
    ap.add_argument("--random-preset", metavar="PRESET",
                    help="time a model of this preset's dimensions (e.g. base) with random weights instead of a "
                         "trained one (made once under --workdir; give --tokens for its vocabulary, and a small "
                         "--max-len-b)")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--rounds", type=int, default=2, help="Rounds over the sentences (reported: the mean).")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: elapsed time; cpu: this process's CPU time (steadier when other processes run).")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="First wait up to this long for other processes to leave the CPUs (< 15%% busy).")
    ap.add_argument("--markdown", type=Path, help="Also write the result table as Markdown here.")
    ap.add_argument("--profile", action="store_true",
                    help="Profile mtpipe's decode (the first --precisions; with --compiled, decode.compile's) instead "
                         "of benchmarking.")
    ap.add_argument("--plain", default="", help="comma list of decoding tricks to time switched off, one row each: "
                    + "; ".join(f"{k}: {v}" for k, v in PLAIN.items()))
    ap.add_argument("--no-naive", action="store_true", help="Leave the (slow) naive decoder out.")
    ap.add_argument("--compiled", action="store_true", help="Add a row decoded with decode.compile.")
    ap.add_argument("--compiled-gather-before", action="store_true",
                    help="Add a decode.compile row that gathers the cache before the graph for every row width (the "
                         "baseline of gathering wide rows inside the graph).")
    args = ap.parse_args()
    plain_rows = [t for t in args.plain.split(",") if t]
    for t in plain_rows:
        if t not in PLAIN:
            ap.error(f"--plain: unknown {t!r} (choose from {', '.join(PLAIN)})")
    names = ([] if args.no_naive else ["naive"]) + ["mtpipe"] + [f"mtpipe, plain {t}" for t in plain_rows]
    names += [COMPILED] if args.compiled else []
    names += [GATHER_BEFORE] if args.compiled_gather_before else []

    import sentencepiece as spm

    console.width = max(console.width, 150)  # the result table has 9 columns; logs are often not a terminal
    torch.set_num_threads(args.threads)
    if args.random_preset:
        if args.checkpoint is not None or args.tokens is None:
            ap.error("--random-preset takes --tokens (the vocabulary) and no --checkpoint")
        tokens, checkpoint = args.tokens, random_model(args.workdir, args.tokens, args.random_preset)
    elif (args.checkpoint is None) != (args.tokens is None):
        ap.error("give both --checkpoint and --tokens, or neither (the bench then trains its own model)")
    elif args.checkpoint is None:
        tokens = make_tokens(args.workdir, 8000)
        checkpoint = train_small(args.workdir, tokens, args.train_minutes, args.threads, args.train_batch_tokens)
    else:
        tokens, checkpoint = args.tokens, args.checkpoint
    torch.set_num_threads(args.threads)
    runtime.tune_cpu_allocator()  # as `mtpipe decode` does on CPU: every system timed here gets it
    ck = artifacts.load_checkpoint(checkpoint)
    model = build_model(ck.model_config, ck.vocab["size"])
    model.load_state_dict(ck.state_dict)
    model.eval()
    sp = spm.SentencePieceProcessor(model_file=str(artifacts.verify_file(tokens, "spm.model")))
    lines = read_gz(args.source)[: args.sentences]
    refs = read_gz(args.reference)[: args.sentences] if args.reference.exists() else None
    sources = [s[: model.cfg.max_positions - 1] for s in sp.encode(lines)]
    precisions = args.precisions.split(",")
    cfgs = {p: DecodeConfig(beam=args.beam, alpha=args.alpha, max_tokens=args.max_tokens, precision=p,
                            max_len_b=args.max_len_b)
            for p in precisions}
    console.print(f"model {checkpoint} (step {ck.step:,}, d_model {model.cfg.d_model}, "
                  f"{model.cfg.encoder_layers}+{model.cfg.decoder_layers} layers, vocab {ck.vocab['size']:,}); "
                  f"{len(sources):,} sentences, {sum(map(len, sources)):,} source pieces; {args.threads} threads; "
                  f"beam {args.beam}, alpha {args.alpha}")
    if args.profile:
        profile(model, sources, dataclasses.replace(cfgs[precisions[0]], compile=args.compiled))
        return

    if args.wait_quiet > 0:
        console.print(f"waiting up to {args.wait_quiet:.0f} s for other processes to leave the CPUs ...")
        console.print(f"other processes' CPU share now {100 * wait_quiet(args.wait_quiet):.0f} %")
    load_before = os.getloadavg()[0]
    ticks0, own0 = cpu_ticks(), own_cpu()
    compiled = copy.deepcopy(model) if args.compiled else None
    gather_before = copy.deepcopy(model) if args.compiled_gather_before else None
    for p in precisions:  # warm-up: allocator, oneDNN kernels, autocast; decode.compile's graphs
        translate(model, sources[:48], cfgs[p], "cpu")
        if compiled is not None:
            for n in (48, 1):  # several sentences, then one alone (run as two in the same graph: a batch's tail)
                translate(compiled, sources[:n], dataclasses.replace(cfgs[p], compile=True), "cpu")
        if gather_before is not None:
            with gathered_before():
                for n in (48, 1):
                    translate(gather_before, sources[:n], dataclasses.replace(cfgs[p], compile=True), "cpu")
    runs, outputs = interleaved(model, sources, cfgs, args.rounds, args.clock, names, compiled, gather_before)
    others = others_share(ticks0, own0)
    console.print(f"other processes used {100 * others:.0f} % of the machine's CPU time during the run")

    def best(key: tuple[str, str]) -> list[list[int]]:
        return [h[0].tokens for h in outputs[key]]

    rows, md_rows = [], []
    ref_tokens = best(("mtpipe", precisions[0]))
    for p in precisions:
        naive_s = sum(runs[("naive", p)]) / args.rounds if "naive" in names else None
        mtpipe_rounds = runs[("mtpipe", p)]
        for name in names:
            secs = sum(runs[(name, p)]) / args.rounds
            hyps = best((name, p))
            ntok = sum(len(h) for h in hyps)
            same_naive = (sum(a == b for a, b in zip(hyps, best(("naive", p)))) / len(hyps)
                          if naive_s is not None else None)
            same_ref = sum(a == b for a, b in zip(hyps, ref_tokens)) / len(hyps)
            # mtpipe's speed over this row's, per round (the rounds interleave, so each pair shares its minutes)
            per_round = sorted(o / m for m, o in zip(mtpipe_rounds, runs[(name, p)]))
            bleu = ""
            if refs is not None:
                import sacrebleu

                bleu = f"{sacrebleu.corpus_bleu(sp.decode(hyps), [refs]).score:.1f}"
            row = [name, p, round(secs, 1), len(hyps) / secs, ntok / secs,
                   f"{naive_s / secs:.2f}x" if naive_s is not None else "-",
                   f"{per_round[len(per_round) // 2]:.2f}x ({per_round[0]:.2f}-{per_round[-1]:.2f})",
                   f"{100 * same_naive:.1f}%" if same_naive is not None else "-", f"{100 * same_ref:.1f}%", bleu]
            rows.append(row)
            md_rows.append([fmt(v) for v in row])
    header = ["decoder", "precision", "seconds", "sentences/s", "tgt tokens/s", "vs naive",
              "mtpipe's speed / this row's, per round: median (min-max)", "same as naive",
              f"same as mtpipe {precisions[0]}", "BLEU"]
    table(f"decode speed: beam {args.beam}, alpha {args.alpha}, {len(sources):,} sentences, {args.threads} threads",
          header, rows)
    fp32 = [float(r[5][:-1]) for r in rows if r[0] == "mtpipe" and r[1] == "fp32" and r[5] != "-"]
    if fp32:
        verdict = "met" if fp32[0] >= 4.0 else "MISSED"
        console.print(f"target mtpipe >= 4x naive at fp32: {fp32[0]:.2f}x, {verdict}")
    if args.markdown:
        mean_len = sum(len(h) for h in ref_tokens) / max(len(ref_tokens), 1)
        text = [
            f"Decoding speed, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"`{' '.join(sys.argv[1:]) or '(defaults)'}`",
            "",
            f"CPU: {cpu_model()}, {args.threads} threads, torch {torch.__version__}. Model: {checkpoint} "
            f"(step {ck.step:,}, d_model {model.cfg.d_model}, {model.cfg.encoder_layers}+"
            f"{model.cfg.decoder_layers} layers, vocab {ck.vocab['size']:,}). {len(sources):,} sentences, "
            f"{sum(map(len, sources)):,} source pieces, mean output {mean_len:.1f} pieces. Beam {args.beam}, GNMT "
            f"alpha {args.alpha}, max length source + {args.max_len_b}, max_tokens {args.max_tokens}. Mean of "
            f"{args.rounds} round(s), interleaved batch by batch, {args.clock}-clock seconds; tokens = hypothesis "
            f"pieces without EOS. Other processes used {100 * others:.0f} % of the machine's CPU time during the run "
            f"(1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after).",
            "",
            "| " + " | ".join(header) + " |",
            "| " + " | ".join("---" for _ in header) + " |",
            *("| " + " | ".join(r) + " |" for r in md_rows),
            "",
        ]
        args.markdown.write_text("\n".join(text), encoding="utf-8")


if __name__ == "__main__":
    main()
