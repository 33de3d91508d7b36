#!/usr/bin/env python3
"""``decode.compile`` on one sentence at a time (a server's single request, a line of stdin): the lone sentence run
as two copies of itself in the graph built for several sentences (what mtpipe does), against the same sentence in a
graph of its own (``Transformer.compile_step(lone_graph=True)``, what ``mtpipe serve`` and stdin do), and against
the eager step.

Why: torch specialises a dimension of size 1, so a lone sentence would need a second graph, built once per process
(25-40 s on a small CPU). Run as two sentences it needs none, but computes twice its rows at every step. Measured:

* **build and a file**: in a fresh process, the seconds of the first decodes with ``decode.compile`` (8 sentences,
  then 1, as ``mtpipe decode`` builds before it decodes a file) and the graphs built, then the seconds to decode
  the first ``--file-sentences`` test sentences in ``mtpipe decode``'s batches (where a lone sentence is each
  batch's tail); each way in its own process, ``--rounds`` interleaved rounds after one unmeasured run of each (so
  both find inductor's on-disk kernel cache warm, as a second run of mtpipe does);
* **speed**: the first ``--sentences`` test sentences decoded one per call by each system in turn (the order rotating
  from sentence to sentence), ``--rounds`` rounds in one process, sentences/s per round (min / median / max), the
  ratio of the two compiled ways per round, and how many outputs equal the eager step's.

    python bench/lone_sentence.py --checkpoint artifacts/average --tokens artifacts/bpe
    python bench/lone_sentence.py --random-preset base --tokens artifacts/bpe --max-len-b 5
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import spread  # noqa: E402 (after the path it needs)

WAYS = {"as two": False, "own graph": True}  # the compiled ways: Transformer.compile_step's lone_graph


def load(args: argparse.Namespace, sentences: int):
    """The model, the first ``sentences`` test sentences as pieces and the checkpoint's path (a random model of
    ``args.random_preset``'s shape where that is set; bench/step_package.py has no such option)."""
    import sentencepiece as spm
    import torch

    from bench.decode_speed import random_model, read_gz
    from mtpipe import artifacts, runtime
    from mtpipe.model import build_model

    torch.set_num_threads(args.threads)
    runtime.tune_cpu_allocator()  # as `mtpipe decode` does on CPU
    preset = getattr(args, "random_preset", None)
    checkpoint = random_model(args.workdir, args.tokens, preset) if preset else args.checkpoint
    ck = artifacts.load_checkpoint(checkpoint)
    model = build_model(ck.model_config, ck.vocab["size"])
    model.load_state_dict(ck.state_dict)
    model.eval()
    sp = spm.SentencePieceProcessor(model_file=str(artifacts.verify_file(args.tokens, "spm.model")))
    lines = read_gz(args.source)[: max(sentences, 8)]
    return model, [s[: model.cfg.max_positions - 1] for s in sp.encode(lines)], checkpoint


def build_once(args: argparse.Namespace) -> None:
    """``--build-only WAY``: one fresh process's build and file, printed as one line of JSON."""
    from mtpipe.config import DecodeConfig
    from mtpipe.decode import translate
    from torch._dynamo.utils import counters

    model, sources, _ = load(args, args.file_sentences)
    cfg = DecodeConfig(beam=args.beam, alpha=args.alpha, max_len_b=args.max_len_b, compile=True)
    model.compile_step(lone_graph=WAYS[args.build_only])
    start = time.perf_counter()
    translate(model, sources[:8], cfg)
    translate(model, sources[:1], cfg)
    built = time.perf_counter()
    graphs = counters["stats"]["unique_graphs"]
    translate(model, sources[: args.file_sentences], cfg)
    print(json.dumps({"seconds": built - start, "graphs": graphs, "file": time.perf_counter() - built,
                      "graphs_after": counters["stats"]["unique_graphs"]}))


def builds(args: argparse.Namespace) -> dict[str, list[dict]]:
    """Each way's build in fresh processes: one unmeasured, then ``--rounds`` interleaved."""
    from mtpipe.console import progress

    argv = [sys.executable, __file__, "--tokens", str(args.tokens), "--threads", str(args.threads), "--beam",
            str(args.beam), "--alpha", str(args.alpha), "--max-len-b", str(args.max_len_b), "--source",
            str(args.source), "--workdir", str(args.workdir), "--file-sentences", str(args.file_sentences)]
    argv += ["--random-preset", args.random_preset] if args.random_preset else ["--checkpoint", str(args.checkpoint)]
    got: dict[str, list[dict]] = {way: [] for way in WAYS}
    ways = list(WAYS)
    with progress() as bar:
        task = bar.add_task("builds, fresh processes", total=(args.rounds + 1) * len(ways))
        for r in range(args.rounds + 1):
            for way in ways[r % 2:] + ways[: r % 2]:
                run = subprocess.run(argv + ["--build-only", way], capture_output=True, text=True, check=False)
                if run.returncode != 0:
                    sys.exit(f"lone_sentence.py: the {way!r} build failed: {run.stderr.strip().splitlines()[-1:]}")
                if r:  # the first round warms inductor's on-disk cache for both
                    got[way].append(json.loads(run.stdout.strip().splitlines()[-1]))
                bar.update(task, advance=1)
    return got


def speeds(args: argparse.Namespace) -> None:
    import torch

    from mtpipe.config import DecodeConfig
    from mtpipe.console import console, progress, table
    from mtpipe.decode import translate

    model, sources, checkpoint = load(args, args.sentences)
    sources = sources[: args.sentences]
    eager_cfg = DecodeConfig(beam=args.beam, alpha=args.alpha, max_len_b=args.max_len_b)
    compiled_cfg = dataclasses.replace(eager_cfg, compile=True)
    copies = {way: copy.deepcopy(model) for way in WAYS}
    for way, twin in copies.items():
        twin.compile_step(lone_graph=WAYS[way])

    def decode(name: str, batch: list[list[int]]):
        if name == "eager":
            return translate(model, batch, eager_cfg)
        return translate(copies[name], batch, compiled_cfg)

    names = ["eager", *WAYS]
    for name in names:  # warm-up: allocator, oneDNN kernels; the compiled ways' graphs
        decode(name, sources[:8])
        decode(name, sources[:1])
    seconds = {name: [0.0] * args.rounds for name in names}
    outputs: dict[str, list] = {name: [None] * len(sources) for name in names}
    with progress() as bar:
        task = bar.add_task("one sentence a call, interleaved", total=args.rounds * len(sources) * len(names))
        for r in range(args.rounds):
            for i, src in enumerate(sources):
                shift = (i + r) % len(names)
                for name in names[shift:] + names[:shift]:
                    start = time.perf_counter()
                    outputs[name][i] = decode(name, [src])[0][0].tokens
                    seconds[name][r] += time.perf_counter() - start
                    bar.update(task, advance=1)

    console.print(f"model {checkpoint} (d_model {model.cfg.d_model}, {model.cfg.encoder_layers}+"
                  f"{model.cfg.decoder_layers} layers); {len(sources)} sentences one per call; beam {args.beam}, "
                  f"alpha {args.alpha}; {args.threads} threads; torch {torch.__version__}, dispatch "
                  f"{torch.backends.cpu.get_cpu_capability()}")
    got = builds(args) if not args.no_builds else {}
    rows = []
    for name in names:
        per_second = [len(sources) / s for s in seconds[name]]
        vs_own = [o / s for s, o in zip(seconds[name], seconds["own graph"])]
        build = got.get(name, [])
        rows.append([name, spread(per_second), spread(vs_own),
                     sum(a == b for a, b in zip(outputs[name], outputs["eager"])),
                     spread([b["seconds"] for b in build]) if build else "-",
                     "/".join(sorted({f"{b['graphs']}, {b['graphs_after']}" for b in build})) if build else "-",
                     spread([b["file"] for b in build]) if build else "-",
                     spread([b["seconds"] + b["file"] for b in build]) if build else "-"])
    table(f"decode.compile, one sentence a call: {args.rounds} interleaved rounds, min-max in brackets",
          ["system", "sentences/s", "speed / own graph's, per round", f"outputs = eager's (of {len(sources)})",
           "build s (fresh process, 8 then 1 sentence)", "graphs built (then after the file)",
           f"file s ({args.file_sentences} sentences)", "build + file s"], rows)


def add_decoding_flags(ap: argparse.ArgumentParser, file_help: str) -> None:
    """The flags this script shares with bench/step_package.py: the test file, rounds, threads, the search, and the
    sentences a fresh process decodes as a file (``file_help``)."""
    from bench.decode_speed import DATA

    ap.add_argument("--source", type=Path, default=DATA / "test_2016_flickr.en.gz")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--max-len-b", type=int, default=50)
    ap.add_argument("--file-sentences", type=int, default=1000, help=file_help)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, help="a trained (or averaged) mtpipe checkpoint")
    ap.add_argument("--tokens", type=Path, required=True, help="the bpe artifact of the checkpoint (spm.model)")
    ap.add_argument("--random-preset", metavar="PRESET", help="random weights of this preset instead of --checkpoint")
    ap.add_argument("--workdir", type=Path, default=REPO / "bench" / "out" / "decode_speed")
    ap.add_argument("--sentences", type=int, default=100)
    add_decoding_flags(ap, "sentences each build process then decodes as a file")
    ap.add_argument("--no-builds", action="store_true", help="leave out the build and file timings (fresh processes)")
    ap.add_argument("--build-only", choices=list(WAYS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if (args.checkpoint is None) == (args.random_preset is None):
        ap.error("give --checkpoint or --random-preset")
    if args.build_only:
        build_once(args)
    else:
        speeds(args)


if __name__ == "__main__":
    main()
