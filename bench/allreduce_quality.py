#!/usr/bin/env python3
"""What ``train.grad_allreduce: bf16`` does to the model: the same runs with the gradients summed in fp32 and in bf16.

Why: the bf16 all-reduce halves the bytes sent between GPUs, and each process's gradient and the sum are rounded to
bf16's 8-bit mantissa. Whether that rounding costs quality is a question about a trained model, not one update, so
this trains the quickstart's model (params.yaml) on Multi30k to the end of a short linear schedule at world size
``--nproc`` (gloo on CPU processes: the hook is the one a GPU run uses), once per all-reduce per seed, and compares
the validation perplexity and greedy BLEU on the whole valid split. The seed-to-seed spread of the fp32 runs is the
yardstick: a bf16 difference inside it is not a measurable cost at this scale. Runs alternate between the two
all-reduces, seed by seed, so that a slower machine later on does not fall on one of them only.

    python bench/allreduce_quality.py [--data DIR] [--steps 400] [--seeds 1,2] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import machine  # noqa: E402
from mtpipe import env as mtenv  # noqa: E402

DATA = Path(mtenv.get("MTPIPE_MULTI30K") or REPO / "data" / "multi30k")  # {train,val,test_2016_flickr}.{en,de}.gz
MODES = ("fp32", "bf16")


def mtpipe(*args: str, log: Path) -> None:
    with log.open("w", encoding="utf-8") as f:
        cmd = [sys.executable, "-m", "mtpipe", *args]
        if subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"{' '.join(cmd)} failed; see {log}")


def prepare(data: Path, work: Path) -> None:
    """fetch, bpe and bucket with params.yaml's settings, from the local corpus."""
    mtpipe("fetch", "--source", str(data), "--out", str(work / "fetch"), log=work / "fetch.log")
    mtpipe("bpe", "--corpus", str(work / "fetch"), "--out", str(work / "bpe"), log=work / "bpe.log")
    mtpipe("bucket", "--tokens", str(work / "bpe"), "--out", str(work / "bucket"), log=work / "bucket.log")


def train(mode: str, seed: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One run to the end of the schedule; its summary's figures (valid BLEU: greedy, every valid sentence)."""
    out = work / f"{mode}-seed{seed}"
    t0 = time.monotonic()
    mtpipe("train", "--tokens", str(work / "bpe"), "--batches", str(work / "bucket"), "--out", str(out),
           "--device", "cpu", "--nproc", str(args.nproc), "--precision", "fp32", "--grad-allreduce", mode,
           "--seed", str(seed), "--max-steps", str(args.steps), "--max-epochs", "0", "--max-time", "0",
           "--warmup", str(args.steps * 2 // 5), "--valid-every-steps", "0",
           "--valid-bleu-every-steps", str(args.steps),
           "--valid-bleu-sentences", "0", "--save-every-progress", "0", "--log-every-steps", "50",
           log=work / f"{mode}-seed{seed}.log")
    s = json.loads((out / "train.json").read_text(encoding="utf-8"))
    return {"mode": mode, "seed": seed, "steps": s["steps"], "seconds": round(time.monotonic() - t0, 1),
            "train_loss": s["train_loss"], "valid_ppl": s["valid_ppl"], "valid_bleu": s["valid_bleu"]}


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per metric: bf16 - fp32 for each seed, and the fp32 runs' spread across seeds (max - min)."""
    by = {(r["mode"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    out = {}
    for k in ("valid_ppl", "valid_bleu", "train_loss"):
        fp32 = [by["fp32", s][k] for s in seeds]
        out[k] = {"bf16_minus_fp32": [round(by["bf16", s][k] - by["fp32", s][k], 3) for s in seeds],
                  "fp32_seed_spread": round(max(fp32) - min(fp32), 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DATA, help="local Multi30k ({split}.{en,de}.gz; or $MTPIPE_MULTI30K)")
    ap.add_argument("--steps", type=int, default=400, help="updates a run (the linear schedule ends there)")
    ap.add_argument("--seeds", default="1,2", help="train.seed values, comma-separated")
    ap.add_argument("--nproc", type=int, default=2, help="processes (world size) of each run")
    ap.add_argument("--results", type=Path,
                    help="the results file (default bench/results/allreduce_quality-<time>.json)")
    args = ap.parse_args()
    if not (args.data / "train.en.gz").exists():
        raise SystemExit(f"{args.data}: no train.en.gz (set --data or $MTPIPE_MULTI30K to a Multi30k copy)")
    runs = []
    with tempfile.TemporaryDirectory(prefix="allreduce-") as tmp:
        work = Path(tmp)
        prepare(args.data.resolve(), work)
        for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                runs.append(train(mode, seed, args, work))
                print(json.dumps(runs[-1]), flush=True)
    figures = {"model": "params.yaml (the quickstart's)", "corpus": "Multi30k en-de", "steps": args.steps,
               "nproc": args.nproc, "precision": "fp32", "runs": runs, "compare": compare(runs)}
    print(json.dumps(figures["compare"]), flush=True)
    print(f"results: {machine.write_results('allreduce_quality', figures, args.results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
