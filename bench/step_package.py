#!/usr/bin/env python3
"""``decode.compile`` in float32 on CPU: the decoder step packaged ahead of time and kept on disk
(``mtpipe.step_package``, what mtpipe does) against the same frozen step built by torch.compile in every process
(``MTPIPE_STEP_PACKAGE=0``, what it did before), and the eager step. Measured:

* **start-up**: in a fresh process, the seconds of the first decodes with ``decode.compile`` (8 sentences, then 1,
  as ``mtpipe decode`` builds before it decodes a file), then the seconds to decode the first ``--file-sentences``
  test sentences in ``mtpipe decode``'s batches. Three ways: the package built into an empty cache ("package,
  cold"), loaded from the cache ("package, on disk"), torch.compile (inductor's own on-disk kernel cache warm, as a
  second run of mtpipe finds it). One unmeasured run of each first, then ``--rounds`` interleaved rounds.
* **speed**: in one process, the first ``--sentences`` test sentences decoded by each system in turn, in batches of
  ``--batch-sentences`` (a server's few sentences) and in ``mtpipe decode``'s batches of ``--max-tokens`` tokens;
  ``--rounds`` rounds, the order rotating from batch to batch; sentences/s per round (min / median / max), the ratio
  to torch.compile's step per round, and how many outputs equal the eager step's. ``--sizes-against JSON``: also a
  package exported on other example sizes (``mtpipe.step_package._SIZES``, e.g. ``'{"sentences": 3, "positions":
  5, "source": 7, "cache": 37}'``; the package key covers them).

    python bench/step_package.py --checkpoint artifacts/average --tokens artifacts/bpe
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import spread  # noqa: E402 (after the path it needs)

STARTS = ("package, cold", "package, on disk", "torch.compile")


def load(args: argparse.Namespace, sentences: int):
    """The model and the first ``sentences`` test sentences as pieces (bench/lone_sentence.py's loading)."""
    from bench.lone_sentence import load as load_model

    model, sources, _ = load_model(args, sentences)
    return model, sources


def start_once(args: argparse.Namespace) -> None:
    """``--start-only``: one fresh process's build and file, printed as one line of JSON (the way is set by the
    environment its parent gives it)."""
    from mtpipe.config import DecodeConfig
    from mtpipe.decode import translate

    model, sources = load(args, args.file_sentences)
    cfg = DecodeConfig(beam=args.beam, alpha=args.alpha, max_len_b=args.max_len_b, max_tokens=args.max_tokens,
                       compile=True, precision="fp32")
    start = time.perf_counter()
    model.compile_step()
    translate(model, sources[:8], cfg)
    translate(model, sources[:1], cfg)
    built = time.perf_counter()
    out = translate(model, sources[: args.file_sentences], cfg)
    print(json.dumps({"seconds": built - start, "file": time.perf_counter() - built,
                      "tokens": sum(len(h[0].tokens) for h in out),
                      "packaged": type(model._compiled_step).__name__ == "PackagedStep"}))


def starts(args: argparse.Namespace, cache: Path) -> dict[str, list[dict]]:
    """Each way's start-up in fresh processes: one unmeasured round, then ``--rounds`` interleaved."""
    from mtpipe.console import progress

    argv = [sys.executable, __file__, "--checkpoint", str(args.checkpoint), "--tokens", str(args.tokens),
            "--threads", str(args.threads), "--beam", str(args.beam), "--alpha", str(args.alpha), "--max-len-b",
            str(args.max_len_b), "--max-tokens", str(args.max_tokens), "--source", str(args.source),
            "--file-sentences", str(args.file_sentences), "--start-only"]
    got: dict[str, list[dict]] = {way: [] for way in STARTS}
    with progress() as bar:
        task = bar.add_task("start-ups, fresh processes", total=(args.rounds + 1) * len(STARTS))
        for r in range(args.rounds + 1):
            for way in STARTS[r % 3:] + STARTS[: r % 3]:
                with tempfile.TemporaryDirectory(prefix="cold-", dir=cache.parent) as cold:
                    env = dict(os.environ, MTPIPE_CACHE_DIR=str(cold if way == "package, cold" else cache))
                    if way == "torch.compile":
                        env["MTPIPE_STEP_PACKAGE"] = "0"
                    run = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
                if run.returncode != 0:
                    sys.exit(f"step_package.py: the {way!r} start failed: {run.stderr.strip().splitlines()[-1:]}")
                if r:  # the first round fills the cache and inductor's kernel cache
                    got[way].append(json.loads(run.stdout.strip().splitlines()[-1]))
                bar.update(task, advance=1)
    return got


def speeds(args: argparse.Namespace) -> None:
    import torch

    from mtpipe import step_package
    from mtpipe.config import DecodeConfig
    from mtpipe.console import console, progress, table
    from mtpipe.decode import translate
    from mtpipe.step_package import PackagedStep

    (REPO / "bench" / "out").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="step-package-", dir=REPO / "bench" / "out"))
    cache = work / "cache"
    os.environ["MTPIPE_CACHE_DIR"] = str(cache)
    model, sources = load(args, args.sentences)
    sources = sources[: args.sentences]
    eager_cfg = DecodeConfig(beam=args.beam, alpha=args.alpha, max_len_b=args.max_len_b, max_tokens=args.max_tokens,
                             precision="fp32")
    compiled_cfg = dataclasses.replace(eager_cfg, compile=True)
    systems = {"eager": model, "torch.compile": copy.deepcopy(model), "package": copy.deepcopy(model)}
    other = f"package, sizes {args.sizes_against}" if args.sizes_against else None
    if other:
        systems[other] = copy.deepcopy(model)
    os.environ["MTPIPE_STEP_PACKAGE"] = "0"
    systems["torch.compile"].compile_step()
    os.environ["MTPIPE_STEP_PACKAGE"] = "1"
    for name in systems:
        if name.startswith("package"):
            systems[name].compile_step()
            assert isinstance(systems[name]._compiled_step, PackagedStep)
    assert not isinstance(systems["torch.compile"]._compiled_step, PackagedStep)
    names = list(systems)

    @contextlib.contextmanager
    def sized(name: str):
        """The other example sizes around a system's calls: its packages (keyed by them) are built or loaded in the
        warm-up's first calls."""
        if name != other:
            yield
            return
        saved = step_package._SIZES
        step_package._SIZES = json.loads(args.sizes_against)
        try:
            yield
        finally:
            step_package._SIZES = saved

    def decode(name: str, batch: list[list[int]]):
        with sized(name):
            return translate(systems[name], batch, eager_cfg if name == "eager" else compiled_cfg)

    for name in names:  # warm-up: allocator, oneDNN kernels; the compiled steps' graphs and packages
        decode(name, sources[:8])
        decode(name, sources[:1])
    shapes = {f"{args.batch_sentences} sentences a call": [sources[i: i + args.batch_sentences]
                                                           for i in range(0, len(sources), args.batch_sentences)],
              f"{args.max_tokens:,}-token batches": [sources]}
    seconds = {(shape, name): [0.0] * args.rounds for shape in shapes for name in names}
    outputs = {(shape, name): [] for shape in shapes for name in names}
    with progress() as bar:
        task = bar.add_task("decoding, interleaved", total=args.rounds * sum(len(b) for b in shapes.values())
                            * len(names))
        for r in range(args.rounds):
            for shape, batches in shapes.items():
                for i, batch in enumerate(batches):
                    shift = (i + r) % len(names)
                    for name in names[shift:] + names[:shift]:
                        start = time.perf_counter()
                        got = decode(name, batch)
                        seconds[shape, name][r] += time.perf_counter() - start
                        if r == 0:
                            outputs[shape, name] += [h[0].tokens for h in got]
                        bar.update(task, advance=1)

    console.print(f"model {args.checkpoint} (d_model {model.cfg.d_model}, {model.cfg.encoder_layers}+"
                  f"{model.cfg.decoder_layers} layers, vocabulary {model.embed.weight.size(0):,}); fp32; beam "
                  f"{args.beam}, alpha {args.alpha}; {args.threads} threads; torch {torch.__version__}, dispatch "
                  f"{torch.backends.cpu.get_cpu_capability()}")
    rows = []
    for shape in shapes:
        for name in names:
            per_second = [len(sources) / s for s in seconds[shape, name]]
            ratio = [c / s for s, c in zip(seconds[shape, name], seconds[shape, "torch.compile"])]
            same = sum(a == b for a, b in zip(outputs[shape, name], outputs[shape, "eager"]))
            rows.append([shape, name, spread(per_second), spread(ratio), f"{same} / {len(sources)}"])
    table(f"decoding {len(sources)} sentences: {args.rounds} interleaved rounds, min-max in brackets",
          ["batches", "step", "sentences/s", "speed / torch.compile's, per round", "outputs = eager's"], rows)

    if args.skip_starts:
        return
    got = starts(args, cache)
    rows = []
    for way in STARTS:
        runs = got[way]
        rows.append([way, spread([b["seconds"] for b in runs]), spread([b["file"] for b in runs]),
                     spread([b["seconds"] + b["file"] for b in runs]), "/".join(sorted({str(b["tokens"]) for b in runs})),
                     "yes" if all(b["packaged"] for b in runs) else "no"])
    table(f"decode.compile's start-up in fresh processes: {args.rounds} interleaved rounds, min-max in brackets",
          ["way", "build or load s (8 then 1 sentence)", f"file s ({args.file_sentences} sentences)",
           "start + file s", "output pieces", "packaged"], rows)


def main() -> None:
    from bench.lone_sentence import add_decoding_flags

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="a trained (or averaged) mtpipe checkpoint")
    ap.add_argument("--tokens", type=Path, required=True, help="the bpe artifact of the checkpoint (spm.model)")
    ap.add_argument("--sentences", type=int, default=400, help="sentences each system decodes per round")
    ap.add_argument("--batch-sentences", type=int, default=8, help="sentences a call in the few-sentences rows")
    ap.add_argument("--max-tokens", type=int, default=8000)
    ap.add_argument("--sizes-against", help="also time a package exported on these example sizes (JSON, "
                    "mtpipe.step_package._SIZES' keys)")
    ap.add_argument("--skip-starts", action="store_true", help="time the steps only, not the start-ups")
    add_decoding_flags(ap, "sentences each start-up process then decodes as a file")
    ap.add_argument("--start-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.start_only:
        start_once(args)
    else:
        speeds(args)


if __name__ == "__main__":
    main()
