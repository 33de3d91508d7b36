"""What bench/backtranslation.py and bench/distillation.py share: an example of examples/ run with `dvc repro` in a
fresh copy per seed, its corpus a local Multi30k, its training budget and seed set, and its results read back.

Each copy is a new git + DVC repository holding only the example's files (the mtpipe of the environment running the
bench runs its stages), so nothing of the checkout is touched and a run can be inspected afterwards (``--keep``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml

REPO = Path(__file__).resolve().parents[1]
MULTI30K_TRAIN = 29000  # the pairs of Multi30k's train split: the examples' train_slice values are written for it


def add_flags(ap: argparse.ArgumentParser, budget: float) -> None:
    ap.add_argument("--data", type=Path, required=True, help="local Multi30k: {train,val,test_2016_flickr}.{en,de}.gz")
    ap.add_argument("--seeds", default="1,2", help="comma list of train.seed values, one fresh copy each")
    ap.add_argument("--budget-minutes", type=float, default=budget, help="train.max_time of every model")
    ap.add_argument("--budget-updates", type=int, default=0, help="train.max_steps of every model instead of a time "
                    "budget (train.max_time 0): the same work for every row however loaded the machine is")
    ap.add_argument("--pairs", type=int, default=0, help="only the first N training pairs (the slices scaled); 0: all")
    ap.add_argument("--vocab-size", type=int, default=0, help="bpe.vocab_size (0: the example's; for a small --pairs)")
    ap.add_argument("--threads", type=int, default=0, help="train.threads and decode.threads (0: torch's default)")
    ap.add_argument("--out", type=Path, help="the copies and logs (default bench/out/<name>/<UTC time>)")
    ap.add_argument("--results", type=Path, help="the results file (default bench/results/<name>-<UTC time>.json)")
    ap.add_argument("--keep", action="store_true", help="keep each copy (default: only its logs and metrics)")


def earlier_runs(path: Path | None, name: str, settings: dict[str, Any], seeds: str) -> list[dict[str, Any]]:
    """The runs of an earlier results file of this benchmark (``--add-to``), to which this one's seeds are added:
    refused unless it was measured with the same ``settings`` (budget, pairs) and holds none of ``seeds``."""
    if path is None:
        return []
    doc = json.loads(path.read_text(encoding="utf-8"))
    figures = doc.get("figures", {})
    if doc.get("name") != name:
        raise SystemExit(f"{path}: not a results file of bench/{name}.py")
    differ = [k for k, v in settings.items() if figures.get(k) != v]
    if differ:
        raise SystemExit(f"{path}: measured with other {', '.join(differ)} "
                         f"({', '.join(f'{k} {figures.get(k)!r}' for k in differ)}): its runs cannot be added to")
    have = {r["seed"] for r in figures["runs"]}
    again = sorted(have & {int(x) for x in seeds.split(",")})
    if again:
        raise SystemExit(f"{path}: already has seed(s) {', '.join(map(str, again))}")
    return list(figures["runs"])


def _scaled(text: str, pairs: int) -> str:
    return ":".join(str(int(x) * pairs // MULTI30K_TRAIN) if x else "" for x in text.split(":"))


def configure(repo: Path, args: argparse.Namespace, seed: int) -> None:
    """Every params file of the copy: the corpus ``--data`` (``--pairs``: its first N training pairs, every
    train_slice scaled to them), ``train.seed``, ``train.max_time`` (or ``train.max_steps`` with ``--budget-updates``), and ``--vocab-size`` and ``--threads`` when
    given; nothing else."""
    for path in sorted(p for p in repo.rglob("*.yaml") if p.name != "dvc.yaml"):
        params = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        fetch = params.get("fetch", {})
        if path.name == "params.yaml" and path.parent == repo:
            fetch["source"] = str(args.data.resolve())
            if args.pairs:
                fetch["train_slice"] = f"0:{args.pairs}"
        elif args.pairs and "train_slice" in fetch:
            fetch["train_slice"] = _scaled(fetch["train_slice"], args.pairs)
        if "train" in params:
            budget = ({"max_steps": args.budget_updates, "max_time": 0} if args.budget_updates
                      else {"max_time": args.budget_minutes})
            params["train"].update(seed=seed, **budget, **({"threads": args.threads} if args.threads else {}))
        if "bpe" in params and args.vocab_size:
            params["bpe"]["vocab_size"] = args.vocab_size
        if "decode" in params and args.threads:
            params["decode"]["threads"] = args.threads
        path.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")


def environment() -> dict[str, str]:
    variables = dict(os.environ)
    variables["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{variables.get('PATH', '')}"  # this mtpipe
    variables.update(DVC_NO_ANALYTICS="1", HF_HUB_OFFLINE="1", GIT_AUTHOR_NAME="bench",
                     GIT_AUTHOR_EMAIL="bench@localhost", GIT_COMMITTER_NAME="bench",
                     GIT_COMMITTER_EMAIL="bench@localhost")
    return variables


def command(cmd: list[str], cwd: Path, log: Path) -> float:
    """Run ``cmd``, its output to ``log``; the seconds it took (a failure stops the bench, naming the log)."""
    start = time.monotonic()
    with log.open("a", encoding="utf-8") as f:
        if subprocess.run(cmd, cwd=cwd, env=environment(), stdout=f, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"{' '.join(cmd)} failed in {cwd}; see {log}")
    return time.monotonic() - start


def copy_example(example: str, args: argparse.Namespace, seed: int, work: Path) -> Path:
    """examples/<example> copied to ``work/seed<N>`` as a new git + DVC repository, configured."""
    repo = work / f"seed{seed}"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(REPO / "examples" / example, repo)
    configure(repo, args, seed)
    for cmd in (["git", "init", "-q"], [*DVC, "init", "-q"], [*DVC, "config", "core.analytics", "false"]):
        command(cmd, repo, work / "setup.log")
    return repo


def repro(repo: Path, log: Path) -> float:
    """`dvc repro` in ``repo``: its minutes."""
    print(f"dvc repro in {repo} (log: {log}) ...", flush=True)
    return round(command([*DVC, "repro"], repo, log) / 60, 2)


DVC = [sys.executable, "-m", "dvc"]


def training(repo: Path, run: str) -> dict[str, Any]:
    """A model's training (models/<run>/train.json): updates, minutes, what stopped it."""
    train = json.loads((repo / "models" / run / "train.json").read_text(encoding="utf-8"))
    return {"updates": train.get("steps"), "train_minutes": train.get("train_minutes"),
            "stopped_by": train.get("stopped_by")}


def model_row(repo: Path, metrics: str, run: str) -> dict[str, Any]:
    """A model's test2016 scores (metrics/<metrics>.json) and its training."""
    score = json.loads((repo / "metrics" / f"{metrics}.json").read_text(encoding="utf-8"))
    return {"bleu": round(score["bleu"], 2), "chrf": round(score["chrf"], 2), "ratio": round(score["ratio"], 3),
            **training(repo, run),
            "signature": score.get("signatures", {}).get("bleu")}


def run_seeds(name: str, example: str, args: argparse.Namespace, collect: Callable[[Path, int], dict[str, Any]],
              again: Callable[[Path, int], None] | None = None) -> list[dict[str, Any]]:
    """`dvc repro` of the example once per seed; ``collect(copy, seed)`` reads each copy's figures. ``again(copy,
    seed)``: later seeds reuse the first seed's copy, set up by it, so that DVC re-runs only what the seed changes."""
    import datetime

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    work = args.out or REPO / "bench" / "out" / name / stamp
    work.mkdir(parents=True, exist_ok=True)
    if not (args.data / "train.en.gz").exists():
        raise SystemExit(f"{args.data}: no train.en.gz (--data: a local Multi30k copy)")
    runs, repo = [], None
    for seed in [int(s) for s in args.seeds.split(",")]:
        if repo is not None and again is not None:
            again(repo, seed)
        else:
            if repo is not None and not args.keep:
                shutil.rmtree(repo)
            repo = copy_example(example, args, seed, work)
        minutes = repro(repo, work / f"seed{seed}.log")
        runs.append({"seed": seed, "pipeline_minutes": minutes, **collect(repo, seed)})
        print(json.dumps(runs[-1]), flush=True)
        shutil.copytree(repo / "metrics", work / f"seed{seed}-metrics", dirs_exist_ok=True)
    if repo is not None and not args.keep:
        shutil.rmtree(repo)
    return runs


def rows(runs: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, Any]]:
    """Per row: every seed's BLEU and chrF, their mean, updates and minutes (the figures docs/examples.md shows)."""
    import statistics

    out = {}
    for row in names:
        have = [r for r in runs if row in r["models"]]  # (a row trained once is in the first seed's run only)
        got = [r["models"][row] for r in have]
        out[row] = {"bleu": [g["bleu"] for g in got], "chrf": [g["chrf"] for g in got],
                    "bleu_mean": round(statistics.mean(g["bleu"] for g in got), 2),
                    "chrf_mean": round(statistics.mean(g["chrf"] for g in got), 2),
                    "ratio": [g.get("ratio") for g in got],  # hypothesis length over the references'
                    "updates": [g["updates"] for g in got], "train_minutes": [g["train_minutes"] for g in got],
                    "seeds": [r["seed"] for r in have]}
    return out
