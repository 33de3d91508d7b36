"""Quality at an equal budget against an existing ``mtpipe train`` run (``--quality-run DIR``, e.g. the quickstart's
``artifacts/train``): fairseq trains for the run's own minutes (``train.json``) on the same pieces (the run's spm
model, ``--spm-model``) with ``--quality-fairseq`` settings (:func:`fairseq_settings`), a checkpoint every ~5 % of its
expected updates. Both sides pick the model (the average of the last ``--quality-average`` checkpoints, or the last)
and the length-penalty alpha (``--quality-alphas``, each its own formula) on valid, then decode test_2016_flickr with
beam 4: sacreBLEU of both."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

from bench.anchors.common import DATA, Env, bleu, latest_checkpoint, lines_of, read_raw, say, sh
from bench.anchors.decode import fairseq_decode

FS_BUDGET = Path(__file__).with_name("fs_budget")  # fairseq --user-dir: mtpipe's linear schedule, "budget_linear"
FS_AVERAGE = """
import sys, torch
paths, out = sys.argv[1:-1], sys.argv[-1]
states = [torch.load(p, map_location="cpu") for p in paths]
states[0]["model"] = {k: sum(s["model"][k].double() for s in states).div(len(states)).to(v.dtype)
                      for k, v in states[0]["model"].items()}
torch.save(states[0], out)
"""


def fairseq_settings(which: str, mc: dict[str, Any], tc: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """fairseq-train flags (after ``fs_train.sh``'s own: its argparse keeps the last value) and their summary.
    ``run``: the mtpipe run's model and schedule as fairseq expresses them (dims, dropouts, label smoothing, norm
    position, warm-up, peak rate; a ``linear`` schedule through :mod:`.fs_budget`'s ``budget_linear``, whose decay
    follows the share of fairseq's own budget spent, so it reaches 0 as the budget runs out at whatever speed).
    ``anchors``: ``fs_train.sh``'s settings (d256, 3+3 layers, dropout 0.1, lr 1e-3, warm-up 400, inverse sqrt)."""
    if which == "anchors":
        return {"settings": "fairseq's anchor settings (fs_train.sh)", "schedule": "inverse_sqrt"}, []
    peak = tc["lr_scale"] * mc["d_model"] ** -0.5 * tc["warmup"] ** -0.5
    schedule = tc.get("schedule", "inverse_sqrt")
    if schedule not in ("linear", "inverse_sqrt"):
        raise SystemExit(f"--quality-run: schedule {schedule!r} has no fairseq counterpart here")
    flags: list[Any] = [x for side in ("encoder", "decoder") for x in (
        f"--{side}-layers", mc[f"{side}_layers"], f"--{side}-embed-dim", mc["d_model"], f"--{side}-ffn-embed-dim",
        mc["d_ff"], f"--{side}-attention-heads", mc["heads"])]
    flags += ["--dropout", mc["dropout"], "--attention-dropout", mc["attention_dropout"], "--activation-dropout",
              mc["relu_dropout"], "--label-smoothing", tc["label_smoothing"], "--lr", f"{peak:.6g}",
              "--warmup-updates", tc["warmup"]]
    flags += ["--encoder-normalize-before", "--decoder-normalize-before"] if mc.get("norm_position") == "pre" else []
    flags += ["--user-dir", FS_BUDGET, "--lr-scheduler", "budget_linear"] if schedule == "linear" else []
    return {"settings": "the mtpipe run's", "d_model": mc["d_model"], "layers": f"{mc['encoder_layers']}+"
            f"{mc['decoder_layers']}", "norm_position": mc.get("norm_position"), "dropout": mc["dropout"],
            "peak_lr": peak, "warmup": tc["warmup"], "schedule": schedule}, flags


def fs_train_script(e: Env, flags: list[Any]) -> Path:
    """``fs_train.sh``, or, for another scheduler, a copy without its inverse-square-root options."""
    script = e.script("fs_train.sh")
    if "--lr-scheduler" not in flags:
        return script
    text = script.read_text()
    for opt in ("--lr-scheduler inverse_sqrt ", "--warmup-init-lr 1e-7 "):
        if opt not in text:
            raise SystemExit(f"{script}: expected '{opt.strip()}' in it, to replace the scheduler")
        text = text.replace(opt, "")
    out = e.work / "fs_train_scheduler.sh"
    out.write_text(text)
    return out


def fairseq_rate_probe(e: Env, flags: list[Any], updates: int = 200) -> float:
    """fairseq's updates per second with ``flags`` (a short run, its first logged interval excluded): it only spaces
    fairseq's checkpoints."""
    log = e.logs / "quality_fairseq_rate_probe.log"
    sh(["bash", fs_train_script(e, flags), updates, e.work / "fs-rate-probe", *flags, "--max-update", updates,
        "--no-save", "--log-interval", 25], log, e.env)
    points = [(int(u), float(w)) for u, w in re.findall(r"num_updates=(\d+),.*?\bwall=([\d.]+)", log.read_text())]
    if len(points) < 3:
        raise SystemExit(f"{log}: too few logged intervals to measure fairseq's rate")
    return (points[-1][0] - points[1][0]) / max(points[-1][1] - points[1][1], 1e-9)


def run_quality(e: Env, args: argparse.Namespace) -> dict[str, Any]:
    run, tokens = Path(args.quality_run), Path(args.tokens)
    info = json.loads((run / "train.json").read_text())
    ck = latest_checkpoint(run)
    assert ck is not None, f"no checkpoint under {run}"
    params = json.loads((ck / "manifest.json").read_text())["params"]
    mc, tc = params["model"], params["train"]
    minutes, expected, keep = float(info["train_minutes"]), args.quality_fs_updates, args.quality_average
    settings, fs_flags = fairseq_settings(args.quality_fairseq, mc, tc)
    if not expected:
        expected = int(fairseq_rate_probe(e, fs_flags + ["--seed", tc["seed"]]) * minutes * 60)
        say(f"quality: fairseq's expected updates in {minutes:.1f} min: {expected}")
    every = max(1, round(expected / 20))  # as the quickstart saves every 5 % of its budget
    settings.update(expected_updates=expected, save_every_updates=every)
    fs_flags += ["--seed", tc["seed"], "--save-interval-updates", every, "--keep-interval-updates", keep,
                 "--log-interval", 50, "--stop-time-hours", minutes / 60]
    fs_flags += ["--budget-hours", minutes / 60] if "budget_linear" in fs_flags else []
    q = e.work / f"quality-run-{minutes:.1f}min-{args.quality_fairseq}-seed{tc['seed']}"
    fs_log, done = e.logs / "quality_fairseq_train.log", q / "fs" / "trained.json"
    record = json.loads(done.read_text()) if done.exists() else None
    if record is None or record.get("flags") != [str(f) for f in fs_flags]:  # reused only with these very flags
        say(f"quality: fairseq-train for {minutes:.1f} min, {settings}")
        shutil.rmtree(q, ignore_errors=True)
        q.mkdir(parents=True)
        wall = sh(["bash", fs_train_script(e, fs_flags), 10**9, q / "fs", *fs_flags], fs_log, e.env)
        record = {"wall": wall, "updates": re.findall(r"num_updates[=: ]+(\d+)", fs_log.read_text(errors="replace")),
                  "flags": [str(f) for f in fs_flags]}
        done.write_text(json.dumps(record))
    fs_ckpts = sorted(q.joinpath("fs").glob("checkpoint_*_*.pt"), key=lambda p: int(p.stem.split("_")[-1]))[-keep:]
    sh([e.fs_py, "-c", FS_AVERAGE, *fs_ckpts, q / "fs" / "averaged.pt"], e.logs / "quality_fairseq_average.log",
       e.env)
    sh(e.mtpipe("average", "--run", run, "--last", keep, "--out", q / "mt-average"),
       e.logs / "quality_mtpipe_average.log", e.env)
    refs = {"valid": read_raw(DATA / "val.de.gz"), "test": read_raw(DATA / "test_2016_flickr.de.gz")}
    # candidates per system, chosen on valid with alpha: a short run's average can be worse than its last checkpoint
    models = {"fairseq": {"average": q / "fs" / "averaged.pt", "last": q / "fs" / "checkpoint_last.pt"},
              "mtpipe": {"average": q / "mt-average", "last": ck}}

    def fairseq_bleu(split: str, which: str, alpha: float) -> float:
        r = fairseq_decode(e, models["fairseq"][which], e.logs / f"quality_fairseq_{split}_{which}_{alpha:g}.log",
                           e.fs_bin, alpha=alpha, subset=split)
        return bleu(r["hyps"], refs[split])

    def mtpipe_bleu(split: str, which: str, alpha: float) -> float:
        out = q / f"mt-decode-{split}-{which}-{alpha:g}"
        sh(e.mtpipe("decode", "--checkpoint", models["mtpipe"][which], "--tokens", tokens, "--split", split,
                    "--out", out, "--beam", 4, "--alpha", alpha, "--threads", e.threads),
           e.logs / f"quality_mtpipe_{split}_{which}_{alpha:g}.log", e.env)
        return bleu(lines_of(out / f"{split}.txt"), refs[split])

    res: dict[str, Any] = {"minutes": minutes, "average": keep, "fairseq_settings": settings,
                           "mtpipe_settings": {"model": mc, "train": tc}}
    for name, score, penalty in (("fairseq", fairseq_bleu, "|Y|^alpha"), ("mtpipe", mtpipe_bleu, "((5+|Y|)/6)^alpha")):
        valid = {(which, a): score("valid", which, a) for which in ("average", "last") for a in args.quality_alphas}
        which, alpha = max(valid, key=lambda c: valid[c])
        say(f"quality: {name} valid BLEU {valid} -> {which}, alpha {alpha:g}")
        res[name] = {"valid_bleu": {f"{w} alpha={a:g}": b for (w, a), b in valid.items()}, "model": which,
                     "alpha": alpha, "length_penalty": penalty, "bleu": score("test", which, alpha)}
    lrs = re.findall(r"num_updates=(\d+),.*?\blr=([\d.e+-]+)", fs_log.read_text(errors="replace")) if \
        fs_log.exists() else []  # where fairseq's schedule stood at the end (budget_linear: near 0)
    res["fairseq"].update(updates=int(record["updates"][-1]) if record["updates"] else None,
                          process_wall_s=record["wall"], checkpoints=[str(p) for p in fs_ckpts],
                          last_logged_lr={"update": int(lrs[-1][0]), "lr": float(lrs[-1][1])} if lrs else None)
    res["mtpipe"].update(updates=info["steps"], process_wall_s=minutes * 60, run=str(run))
    res["delta_bleu"] = res["mtpipe"]["bleu"] - res["fairseq"]["bleu"]
    res["pass"] = res["delta_bleu"] >= 1.0
    from mtpipe.console import table

    table(f"quality at an equal budget: {minutes:.1f} min of training each", ["system", "updates", "process wall s",
                                                                            "model, alpha (on valid)", "sacreBLEU"],
          [[s, res[s]["updates"], round(res[s]["process_wall_s"]), f"{res[s]['model']}, {res[s]['alpha']:g}",
            res[s]["bleu"]] for s in ("fairseq", "mtpipe")])
    say(f"mtpipe - fairseq = {res['delta_bleu']:+.2f} BLEU (target >= +1): {'pass' if res['pass'] else 'MISSED'}")
    return res
