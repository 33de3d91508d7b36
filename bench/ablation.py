#!/usr/bin/env python3
"""Variant ablation: one ``dvc exp run`` per Transformer variant, the same step budget each.

Runs in a DVC repository of this project (a clone; the data stages run once and are shared by every experiment,
since their params do not change). Every experiment sets ``train.max_steps`` to ``--steps`` (epochs and time limits
off) on top of the repository's ``params.yaml``, so the paper's model and each variant see the same updates and
batches; average, decode and score are the pipeline's own (tuned on valid for the quickstart). Reported per
experiment: the last validation perplexity (``artifacts/train/live/metrics.json``), test sacreBLEU
(``metrics/score.json``), and the train minutes.

Variants (``--variants``, comma list; default all):

* ``paper``: post-norm, LayerNorm, sinusoidal positions: the committed params with ``model.norm_position=post``
  (the quickstart itself is pre-norm); every variant below is this plus its own overrides;
* ``prenorm``: ``model.norm_position=pre`` (Nguyen & Salazar 2019);
* ``scalenorm_fixnorm``: pre-norm + ScaleNorm + FixNorm ("Transformers without Tears"' combination);
* ``learned_positions``: ``model.positions=learned`` (Table 3 row E);
* ``drophead``: scheduled DropHead, ``train.drophead_start=0.1`` (V-shaped, back to 0.1 at the end);
* ``layerdrop``: ``model.layerdrop=0.2``, decoded at full depth;
* ``layerdrop_pruned``: the ``layerdrop`` experiment's model (not retrained: DVC re-runs only decode and score)
  decoded with ``decode.prune=every_other:0.5`` (half depth, no fine-tuning);
* ``half_depth_scratch``: a model with the pruned model's layer counts, trained from scratch with the same budget;
* ``window4``, ``window8``: restricted self-attention (section 4), ``model.attention_window`` r = 4 and 8.

    python bench/ablation.py --repo /tmp/ablation --steps 1330          # 10 epochs of the quickstart each
    python bench/ablation.py --repo /tmp/ablation --steps 400 --variants paper,prenorm

``--repo`` must be a git + DVC checkout of this project with the quickstart's data reachable (e.g. ``fetch.source``
pointed at a Multi30k copy (``$MTPIPE_MULTI30K``)) and the mtpipe venv's ``bin`` on PATH. Writes ``ablation.md`` and
``ablation.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# The paper's model on top of the committed params (the quickstart is pre-norm): every variant starts from it.
PAPER = {"model.norm_position": "post"}

VARIANTS: dict[str, list[str]] = {
    "paper": [],
    "prenorm": ["model.norm_position=pre"],
    "scalenorm_fixnorm": ["model.norm_position=pre", "model.norm=scale", "model.fixnorm=true"],
    "learned_positions": ["model.positions=learned"],
    "drophead": ["train.drophead_start=0.1"],
    "layerdrop": ["model.layerdrop=0.2"],
    "layerdrop_pruned": ["decode.prune=every_other:0.5"],  # on top of the layerdrop experiment: decode + score only
    "half_depth_scratch": [],  # layer counts filled in from the pruning plan
    "window4": ["model.attention_window=4"],  # restricted self-attention (section 4), r = 4
    "window8": ["model.attention_window=8"],
}


def sh(cmd: list[str], cwd: Path) -> str:
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return p.stdout


def hydra_key(repo: Path, override: str) -> str:
    """``dvc exp run -S`` uses Hydra's override grammar: a key not yet in params.yaml needs a leading ``+``."""
    import yaml

    key = override.split("=", 1)[0]
    node = yaml.safe_load((repo / "params.yaml").read_text(encoding="utf-8")) or {}
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return "+" + override
        node = node[part]
    return override


def forget_model_stages(lock: Path) -> None:
    """Drop the train stage and those after it from ``dvc.lock``, keeping the data stages' entries (not re-run)."""
    import yaml

    if not lock.exists():
        return
    data = yaml.safe_load(lock.read_text(encoding="utf-8")) or {}
    for stage in ("train", "average", "decode", "score"):
        data.get("stages", {}).pop(stage, None)
    lock.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


def pruned_layers(repo: Path) -> tuple[int, int]:
    """Layer counts of the half-depth pruned model, from the repository's model params."""
    sys.path.insert(0, str(repo))
    from mtpipe.config import ModelConfig, load_params, resolve
    from mtpipe.pruning import every_other

    cfg = resolve(ModelConfig, load_params(repo / "params.yaml")).resolved()
    return len(every_other(cfg.encoder_layers, 0.5)), len(every_other(cfg.decoder_layers, 0.5))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", required=True, type=Path)
    ap.add_argument("--steps", type=int, required=True, help="train.max_steps of every experiment")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", type=Path, default=Path("bench/out/ablation"))
    args = ap.parse_args()
    repo = args.repo.resolve()
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    if bad := [n for n in names if n not in VARIANTS]:
        ap.error(f"unknown variants {bad}; known: {', '.join(VARIANTS)}")
    if "layerdrop_pruned" in names and (names.index("layerdrop_pruned") == 0 or
                                        names[names.index("layerdrop_pruned") - 1] != "layerdrop"):
        ap.error("layerdrop_pruned must come right after layerdrop (it decodes that run's model)")
    enc, dec = pruned_layers(repo)
    stamp = datetime.datetime.now().strftime("%H%M%S")
    # Checkpoints every 5 % of the budget, so averaging the last 5 spans its last quarter as in the quickstart
    # (2,600 updates, a checkpoint every 133): with a fixed interval a short budget would average early weights.
    budget = [f"train.max_steps={args.steps}", "train.max_epochs=0", "train.max_time=0",
              f"train.save_every_steps={max(1, args.steps // 20)}"]
    rows = []
    for name in names:
        sets = VARIANTS[name] or ([f"model.encoder_layers={enc}", f"model.decoder_layers={dec}"]
                                  if name == "half_depth_scratch" else [])
        if name != "layerdrop_pruned":
            # Every experiment starts from the committed params (dvc exp run builds on the workspace, which holds
            # the previous experiment's); layerdrop_pruned builds on layerdrop's on purpose, so DVC re-runs only
            # decode and score.
            tracked = sh(["git", "ls-tree", "--name-only", "HEAD", "params.yaml", "dvc.lock"], repo).split()
            sh(["git", "checkout", "HEAD", "--", *tracked], repo)
            # The train stage's checkpoints persist (a re-run resumes them, and mtpipe refuses to continue a run of
            # another model): move the previous experiment's run aside so that this one starts fresh.
            # DVC would check the lock file's checkpoints out again, so the lock forgets the stages from train on.
            previous = repo / "artifacts" / "train"
            if previous.exists():
                aside = repo / "ablation-runs" / f"before-{name}-{stamp}"
                aside.parent.mkdir(exist_ok=True)
                previous.rename(aside)
            forget_model_stages(repo / "dvc.lock")
        if name != "layerdrop_pruned":  # the paper's model, then the variant's own overrides (which win)
            sets = [f"{k}={v}" for k, v in {**PAPER, **dict(kv.split("=", 1) for kv in sets)}.items()]
        sets = [hydra_key(repo, kv) for kv in sets]
        cmd = ["dvc", "exp", "run", "-n", f"abl-{name}-{args.steps}-{stamp}",
               *[a for s in budget + sets for a in ("-S", s)]]
        print(f"[{datetime.datetime.now():%H:%M:%S}] {name}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        sh(cmd, repo)
        wall = time.perf_counter() - t0
        live = json.loads((repo / "artifacts/train/live/metrics.json").read_text())
        score = json.loads((repo / "metrics/score.json").read_text())
        train = json.loads((repo / "artifacts/train/train.json").read_text())
        # the pruned model's training run is the full-depth one: its logged valid ppl is not the pruned model's
        ppl = None if name == "layerdrop_pruned" else live.get("valid", {}).get("ppl")
        rows.append({"variant": name, "overrides": sets, "valid_ppl": ppl,
                     "test_bleu": score["bleu"], "chrf": score["chrf"], "steps": train["steps"],
                     "train_minutes": train["train_minutes"], "exp_wall_s": wall})
        print(f"  valid ppl {ppl}, test BLEU {score['bleu']:.2f}", flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                platform.processor())
    head = (f"# Variant ablation, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n\n"
            f"{cpu}, {os.cpu_count()} CPUs; {args.steps} updates each on top of the repository's params.yaml; "
            f"half depth = {enc}+{dec} layers.\n\n"
            "| variant | overrides | valid ppl | test_2016_flickr sacreBLEU | chrF2 | train min |\n"
            "|---|---|---|---|---|---|\n")
    md = head + "".join(f"| {r['variant']} | {' '.join(r['overrides']) or '(paper)'} | "
                        f"{'n/a' if r['valid_ppl'] is None else format(r['valid_ppl'], '.2f')} | "
                        f"{r['test_bleu']:.2f} | {r['chrf']:.1f} | {r['train_minutes']:.1f} |\n"
                        for r in rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ablation.md").write_text(md, encoding="utf-8")
    (args.out / "ablation.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
