#!/usr/bin/env python3
"""Decoding speed: mtpipe's beam search against a naive one, and against itself with each trick switched off.

Beam 4, alpha 0.6, max length source + 50, the first ``--sentences`` of Multi30k test_2016_flickr, 2 threads. Rows,
each at every ``--precisions`` and ``--batches``, interleaved call by call in rotating order, ``--rounds`` rounds:
``mtpipe`` (:class:`mtpipe.engine.translate.MtpipeEngine` as ``mtpipe decode`` holds it: encoder once, cached keys/values,
finished sentences leave the batch); ``naive`` (unless ``--no-naive``: the decoder re-run over the whole prefix every
step; target: mtpipe >= 4x naive at fp32); a row per ``--plain`` trick switched off (:data:`PLAIN`: each trick's
worth); ``--compiled`` (``decode.compile``, built in the warm-up; the twice, package and gather tricks are its own).
``--batches 8000,130,1sent``: batches of that many source tokens, or sentences a call: 130 tokens is a server's ~8
sentences at 8 clients, 1sent a lone sentence (stdin, a single request). Reported: sentences/s, target tokens/s,
decoder steps and ms per step, mtpipe's speed over the row's per round (against mtpipe at the same precision and
batches; mtpipe's own rows against its first batches), outputs equal to mtpipe's, BLEU; and each row's seconds from
opening its engine to warmed up (graph builds: the twice and package tricks save builds, not step time; with
``--compiled`` also a second opening of the fp32 compiled row, which loads the package the first built, as every
later process does). ``--device cuda`` times a
GPU (``decode.cuda_graphs`` on; ``--plain cuda-graphs``: the eager step). ``--profile``: a torch.profiler table of
mtpipe's row (``--compiled``: the compiled one) instead, with CUDA time on a GPU.

    python bench/decode_speed.py --checkpoint artifacts/average --tokens artifacts/bpe
    python bench/decode_speed.py --checkpoint ... --tokens ... --no-naive --plain attention --precisions fp32
    python bench/decode_speed.py --checkpoint ... --tokens ... --no-naive --compiled --plain twice,package \\
        --batches 8000,8sent,1sent --precisions fp32 --sentences 200
    python bench/decode_speed.py --random-preset base --tokens artifacts/bpe --max-len-b 5 --no-naive
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gzip
import statistics
import sys
import tempfile
import time
import unicodedata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import machine  # noqa: E402

machine.isa_from_argv()  # before torch loads
import torch  # noqa: E402

from mtpipe import artifacts  # noqa: E402
from mtpipe import env as mtenv  # noqa: E402
from mtpipe.engine import translate as mdecode  # noqa: E402
from mtpipe.config import DecodeConfig, ModelConfig  # noqa: E402
from mtpipe.console import console, progress, table  # noqa: E402
from mtpipe.model.transformer import build_model  # noqa: E402
from testkit.oracles import search_uncached  # noqa: E402
from mtpipe.engine.search import DecodeRules  # noqa: E402

DATA = Path(mtenv.get("MTPIPE_MULTI30K") or REPO / "data" / "multi30k")  # {split}.{en,de}.gz

# Tricks --plain switches off, one row each: (whose trick: the eager step's or the compiled one's, what replaces it)
PLAIN = {
    "ranking": ("eager", "one top-k over every extension instead of mtpipe.engine.search.top_candidates' chunks"),
    "onednn-packed": ("eager", "torch's own float32 products (F.linear, the model's logits) instead of oneDNN's on "
                      "packed copies of the weights (mtpipe.engine.packed)"),
    "attention": ("eager", "torch's fused scaled_dot_product_attention for a decoding step's cross-attention and the "
                  "encoder instead of two matmuls (mtpipe.model.ops.prefer_explicit_attention)"),
    "cuda-graphs": ("engine", "the eager step on a GPU instead of decode.cuda_graphs' replayed graphs"),
    "twice": ("compiled", "a lone sentence in its own graph (serve's, stdin's) instead of as two (mtpipe decode's)"),
    "package": ("compiled", "torch.compile's step built in the process (decode.compile=jit) instead of the one "
                "packaged on disk (the compiled row's aot)"),
    "gather": ("compiled", "the cache gathered before the graph at every width, not in it (_GATHER_IN_GRAPH_BYTES)"),
}


def switched_off(trick: str | None) -> contextlib.AbstractContextManager:
    """One of :data:`PLAIN`'s tricks switched off (nothing for the tricks an engine's settings switch off: cuda-graphs,
    twice, package), around the opening of the row's engine, which prepares its variant, and around each of its calls
    (the warm-up's too: the compiled step is built then)."""
    from mtpipe.engine import packed, runners, search
    from mtpipe.model import ops

    switches = {"attention": ops.fused_attention, "ranking": search.one_top_k, "onednn-packed": packed.torch_products}
    if trick in switches:
        return switches[trick]()
    if trick == "gather":
        return runners.gather_in_graph_from(1 << 40)  # more bytes than any row: always before the graph
    return contextlib.nullcontext()


def read_text(path: Path, n: int) -> list[str]:
    """The first ``n`` lines, NFC-normalised and stripped as ``mtpipe decode`` reads them (``.gz``: gzip)."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
        return [unicodedata.normalize("NFC", line).strip() for line, _ in zip(f, range(n))]


def load_model(args: argparse.Namespace) -> tuple[Any, str]:
    """The trained checkpoint, or the ``--random-preset``'s dimensions with random weights (seed 0)."""
    import sentencepiece as spm

    if args.random_preset:
        vocab = spm.SentencePieceProcessor(model_file=str(args.spm)).get_piece_size()
        torch.manual_seed(0)
        return build_model(ModelConfig(preset=args.random_preset), vocab), f"random {args.random_preset}"
    ck = artifacts.load_checkpoint(args.checkpoint)
    model = build_model(ck.model_config, ck.vocab["size"])
    model.load_state_dict(ck.state_dict)
    return model, f"{args.checkpoint} (step {ck.step:,})"


def batchings(spec: str, sources: list[list[int]]) -> dict[str, tuple[int, list[list[int]]]]:
    """``--batches``: per entry, (max_tokens, the calls' sentence indices): token batches as ``mtpipe decode`` makes
    them (length-sorted), or ``Nsent``: N sentences a call in input order."""
    out = {}
    for entry in spec.split(","):
        n = int(entry.removesuffix("sent"))
        out[f"{n} sentence(s) a call" if entry.endswith("sent") else f"{n:,}-token batches"] = (
            (10**9, [list(range(i, min(i + n, len(sources)))) for i in range(0, len(sources), n)])
            if entry.endswith("sent") else (n, mdecode.batches_by_tokens([len(s) + 1 for s in sources], n)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, help="a trained (or averaged) mtpipe checkpoint")
    ap.add_argument("--tokens", type=Path, required=True, help="the bpe artifact of the checkpoint (spm.model)")
    ap.add_argument("--random-preset", metavar="PRESET", help="random weights of this preset's dimensions instead "
                    "of --checkpoint (outputs are noise and run to the length limit: give a small --max-len-b)")
    ap.add_argument("--source", type=Path, default=DATA / "test_2016_flickr.en.gz")
    ap.add_argument("--reference", type=Path, default=DATA / "test_2016_flickr.de.gz", help="for BLEU, if present")
    ap.add_argument("--sentences", type=int, default=1000, help="the first N sentences of --source")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--max-len-b", type=int, default=50, help="outputs may have source length + this many pieces")
    ap.add_argument("--precisions", default="fp32,bf16", help="comma list of fp32, bf16, int8")
    ap.add_argument("--batches", default="8000", help="comma list: N (source tokens a batch) or Nsent (sentences a "
                    "call); every row is decoded in each")
    ap.add_argument("--plain", default="", help="comma list of tricks to time switched off, a row each: "
                    + "; ".join(f"{k}: {v}" for k, (_, v) in PLAIN.items()))
    ap.add_argument("--no-naive", action="store_true", help="leave the (slow) naive decoder out")
    ap.add_argument("--compiled", action="store_true", help="add a row decoded with decode.compile")
    ap.add_argument("--profile", action="store_true", help="a torch.profiler table of mtpipe's row instead")
    machine.add_flags(ap)
    args = ap.parse_args()
    tricks = [t for t in args.plain.split(",") if t]
    if bad := [t for t in tricks if t not in PLAIN]:
        ap.error(f"--plain: unknown {bad} (choose from {', '.join(PLAIN)})")
    if any(PLAIN[t][0] == "compiled" for t in tricks) and not args.compiled:
        ap.error("--plain twice, package and gather are the compiled step's: give --compiled")
    if (args.checkpoint is None) == (args.random_preset is None):
        ap.error("give --checkpoint or --random-preset")
    import sentencepiece as spm

    args.spm = artifacts.verify_file(args.tokens, "spm.model")
    torch.set_num_threads(args.threads)
    model, described = load_model(args)
    model.eval()
    sp = spm.SentencePieceProcessor(model_file=str(args.spm))
    sources = [s[: model.cfg.max_positions - 1] for s in sp.encode(read_text(args.source, args.sentences))]
    refs = read_text(args.reference, args.sentences) if args.reference.exists() else None
    precisions = args.precisions.split(",")
    cfg = DecodeConfig(beam=args.beam, alpha=args.alpha, max_len_b=args.max_len_b, threads=args.threads,
                       device=args.device)
    rules = DecodeRules.from_config(cfg)

    # Rows: name -> (engine kind, trick). Engines per (kind, precision), each as mtpipe holds one, a prepared
    # snapshot: the eager one on the model itself, the others on copies; each trick's row has an engine of its own,
    # opened with the trick switched off (some switches act when the variant is prepared, others per call).
    rows: dict[str, tuple[str | None, str | None]] = {} if args.no_naive else {"naive": (None, None)}
    rows["mtpipe"] = ("eager", None)
    rows.update({f"mtpipe, plain {t}": (t, t) for t in tricks if PLAIN[t][0] != "compiled"})
    if args.compiled:
        rows["compiled"] = ("compiled", None)
        rows.update({f"compiled, plain {t}": (f"compiled {t}", t) for t in tricks if PLAIN[t][0] == "compiled"})
    engines, ready = {}, {}
    # compiled rows keep their packages in a fresh directory: the first opening builds, the timed second one loads
    packages = tempfile.TemporaryDirectory(prefix="decode-speed-packages-")
    cfg = dataclasses.replace(cfg, package_cache=packages.name)

    def open_engine(kind: str, trick: str | None, p: str) -> Any:
        # decode.compile: aot (the step packaged on disk, float32 on CPU; elsewhere jit), jit for plain package
        mode = "off" if not kind.startswith("compiled") else "jit" if trick == "package" else "aot"
        c = dataclasses.replace(cfg, precision=p, compile=mode, cuda_graphs=kind != "cuda-graphs")
        with switched_off(trick):
            return mdecode.MtpipeEngine.open(model if kind == "eager" else copy.deepcopy(model), c,
                                             lone_graph=kind == "compiled twice")

    for kind, trick in {(k, t) for k, t in rows.values() if k}:
        for p in precisions:
            start = time.perf_counter()
            engines[kind, p] = open_engine(kind, trick, p)
            ready[kind, p] = time.perf_counter() - start
    keys = [(name, p) for p in precisions for name in rows if not (name == "naive" and p == "int8")]
    steps = [0]
    search = mdecode.beam_search

    def counted(step: Any, *a: Any, **k: Any) -> Any:  # decoder steps, for ms per step
        def one(*x: Any) -> Any:
            steps[0] += 1
            return step(*x)

        return search(one, *a, **k)

    mdecode.beam_search = counted

    def decode(key: tuple[str, str], batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        (kind, trick), p = rows[key[0]], key[1]
        if kind is None:
            hyps = search_uncached(model, batch, rules, max_tokens, p, torch.device(args.device))
        else:
            engine = engines[kind, p]
            engine.max_tokens = max_tokens
            with switched_off(trick):
                hyps = engine.translate(batch, rules)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return [h[0].tokens for h in hyps]

    def warm_up(key: tuple[str, str]) -> float:
        """Seconds of the warm-up: allocator, kernel caches, the bf16 / int8 copies, compiled graphs (built or loaded
        here), CUDA graphs."""
        start = time.perf_counter()
        with console.status(f"warm-up: {key[0]} {key[1]}"):
            for n in (48, 8, 1):
                decode(key, sources[:n], cfg.max_tokens)
        return time.perf_counter() - start

    plans = batchings(args.batches, sources)
    # Seconds from opening an engine to its warmed-up state, per row: what graph builds cost every process (the
    # twice and package tricks save builds, not step time). The compiled row's package is built by its first
    # opening (in a fresh directory) and loaded by a second, timed as "compiled, package on disk": what every later
    # process pays. The rows of the compiled step's tricks, opened after it, load it too where their step is the same
    # (plain twice: and build a lone sentence's graph; plain package: builds torch.compile's instead).
    warmup: dict[tuple[str, str], float] = {}
    if args.compiled:  # torch.compile's once-per-process start-up (its imports, the C++ toolchain), before any row
        prime = dataclasses.replace(cfg, precision="fp32", compile="jit")
        primer = build_model(ModelConfig(preset="tiny", encoder_layers=1, decoder_layers=1, d_model=48, d_ff=96,
                                         heads=2), model.vocab_size)
        start = time.perf_counter()
        with console.status("warm-up: torch.compile's start-up, on a model of other dimensions"):
            mdecode.MtpipeEngine.open(primer.eval(), prime).translate([s[:20] for s in sources[:8]], rules)
        warmup["torch.compile's start-up (once a process)", "fp32"] = time.perf_counter() - start
    warmup.update({key: ready.get((rows[key[0]][0], key[1]), 0.0) + warm_up(key) for key in keys})
    if args.compiled:
        rows["compiled, package on disk"] = ("compiled again", None)  # warmed up below, not among the timed keys
        for p in [p for p in precisions if p == "fp32" and args.device == "cpu"]:  # where compile=aot packages
            start = time.perf_counter()
            engines["compiled again", p] = open_engine("compiled again", None, p)
            warmup["compiled, package on disk", p] = time.perf_counter() - start + warm_up(
                ("compiled, package on disk", p))
    console.print(f"model {described}: d_model {model.cfg.d_model}, {model.cfg.encoder_layers}+"
                  f"{model.cfg.decoder_layers} layers; {len(sources):,} sentences; beam {args.beam}, alpha "
                  f"{args.alpha}; {args.threads} threads on {args.device}")
    if args.profile:
        key = ("compiled" if args.compiled else "mtpipe", precisions[0])
        return profile(key, decode, sources, next(iter(plans.values()))[0], args.device)

    ticks, own = machine.cpu_ticks(), machine.own_cpu()
    items = [(b, [sources[i] for i in call], max_tokens, call) for b, (max_tokens, calls) in plans.items()
             for call in calls]
    outputs: dict[Any, list] = {(k, b): [None] * len(sources) for k in keys for b in plans}
    counts = {(k, b): 0 for k in keys for b in plans}
    with progress() as bar:
        task = bar.add_task("decoding, interleaved", total=args.rounds * len(items) * len(keys))

        def run(key: tuple[str, str], item: tuple) -> None:
            b, batch, max_tokens, call = item
            steps[0] = 0
            for i, hyp in zip(call, decode(key, batch, max_tokens)):
                outputs[key, b][i] = hyp
            counts[key, b] += steps[0]
            bar.update(task, advance=1)

        seconds = machine.interleaved(keys, items, args.rounds, run)
    others = machine.others_share(ticks, own)
    report(args, keys, plans, items, seconds, outputs, counts, others, described, sp, refs, warmup)


def report(args: argparse.Namespace, keys: list, plans: dict, items: list, seconds: dict, outputs: dict,
           counts: dict, others: float, described: str, sp: Any, refs: list[str] | None,
           warmup: dict) -> None:
    import sacrebleu

    first, figures = next(iter(plans)), []
    n = len(outputs[keys[0], first])
    per_round = {(k, b): [sum(s for item, s in zip(items, rnd) if item[0] == b) for rnd in seconds[k]]
                 for k in keys for b in plans}
    for b in plans:
        for name, p in keys:
            secs, hyps, steps = per_round[(name, p), b], outputs[(name, p), b], counts[(name, p), b] / args.rounds
            base = per_round[("mtpipe", p), first if name == "mtpipe" else b]  # mtpipe's own rows: its first batches
            figures.append({"row": name, "precision": p, "batches": b, "seconds": secs,
                            "sentences_per_s": machine.stats([n / s for s in secs]),
                            "tgt_tokens_per_s": statistics.median(sum(map(len, hyps)) / s for s in secs),
                            "steps": steps, "ms_per_step": 1000 * statistics.median(secs) / max(steps, 1),
                            "mtpipe_over_row_per_round": [s / m for s, m in zip(secs, base)],
                            "same_as_mtpipe": sum(a == c for a, c in zip(hyps, outputs[("mtpipe", p), first])) / n,
                            "bleu": refs and round(sacrebleu.corpus_bleu(sp.decode(hyps), [refs]).score, 2)})
    table(f"decoding speed: {described}, {n:,} sentences, beam {args.beam}, {args.rounds} interleaved rounds, "
          f"median (min-max)", ["row", "precision", "batches", "sentences/s", "tgt tokens/s", "steps", "ms / step",
                                "mtpipe's speed / the row's", "same as mtpipe", "BLEU"],
          [[f["row"], f["precision"], f["batches"], machine.spread([n / s for s in f["seconds"]]),
            round(f["tgt_tokens_per_s"]), int(f["steps"]), round(f["ms_per_step"], 2),
            machine.spread(f["mtpipe_over_row_per_round"], "x"), f"{100 * f['same_as_mtpipe']:.1f}%",
            f["bleu"] if refs else "-"] for f in figures])
    table("ready: seconds from opening the engine to its warmed-up state (graph builds, packages loaded)",
          ["row", "precision", "seconds"], [[name, p, round(w, 1)] for (name, p), w in warmup.items()])
    console.print(f"other processes used {100 * others:.0f} % of the machine's CPU time during the run")
    naive = [statistics.median(f["mtpipe_over_row_per_round"]) for f in figures
             if (f["row"], f["precision"], f["batches"]) == ("naive", "fp32", first)]
    if naive:
        console.print(f"target mtpipe >= 4x naive at fp32: {naive[0]:.2f}x, {'met' if naive[0] >= 4 else 'MISSED'}")
    machine.write_results("decode_speed", {"model": described, "sentences": n, "beam": args.beam, "alpha": args.alpha,
                                           "max_len_b": args.max_len_b, "device": args.device, "plain": args.plain,
                                           "others_cpu_share": others, "rows": figures,
                                           "warmup_seconds": [{"row": name, "precision": p, "seconds": round(w, 2)}
                                                              for (name, p), w in warmup.items()]}, args.results)


def profile(key: tuple[str, str], decode: Any, sources: list[list[int]], max_tokens: int, device: str) -> None:
    """torch.profiler's table of ``key``'s decoding of every source (CPU, and CUDA time on a GPU); the compiled step's
    generated kernels are no torch operations: one labelled row shows their time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile, record_function

    from mtpipe.engine.runners import CompiledStep

    step = CompiledStep.__call__

    def labelled(*a: Any, **k: Any) -> Any:
        with record_function("decoder step (compiled: generated kernels in self time)"):
            return step(*a, **k)

    CompiledStep.__call__ = labelled if key[0].startswith("compiled") else step
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    start = time.perf_counter()
    try:
        with torch_profile(activities=acts) as prof:
            decode(key, sources, max_tokens)
    finally:
        CompiledStep.__call__ = step
    wall = time.perf_counter() - start
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
    ops = sum(e.self_cpu_time_total for e in events) / 1e6
    console.print(f"{key[0]} {key[1]}: wall {wall:.2f} s (profiled); in torch operations {ops:.2f} s, {ops / wall:.0%}")


if __name__ == "__main__":
    main()
