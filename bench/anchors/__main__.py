"""``python -m bench.anchors``: the comparison's command line (what it measures: the package's docstring).

    python -m bench.anchors --smoke --out /tmp/anchors-smoke      # every part once, tiny step counts
    python -m bench.anchors --rounds 3 [--only decode --decode-systems mtpipe,ct2 --checkpoint C --tokens T]
    python -m bench.anchors --quality-run artifacts/train --tokens artifacts/bpe   # quality at an equal budget
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import machine
from bench.anchors import data, decode, quality, report, train
from bench.anchors.common import DROPOUTS, REPO, Env, anchors_with_spm, m30k_artifacts, say
from mtpipe import env as mtenv

WORKERS = {"_mtpipe-train": train.worker_mtpipe_train, "_mtpipe-decode": decode.worker_mtpipe_decode,
           "_ct2-decode": decode.worker_ct2_decode}


def probe(e: Env) -> dict[str, Any]:
    """The machine probe under the run's environment, and CTranslate2's compute types (its ISA: each of its rows)."""
    found = machine.probe_under(e.env)
    ct2 = subprocess.run([str(e.ct2_py), "-c", "import ctranslate2; print(ctranslate2.get_supported_compute_types("
                          "'cpu'))"], capture_output=True, text=True, env=e.env)
    return {**found, "ctranslate2_compute_types": ct2.stdout.strip()}


def run_rounds(e: Env, args: argparse.Namespace, parts: list[str]) -> dict[str, Any]:
    """The parts interleaved in rounds, each round with a matmul rate (row ``machine``) to show the drift."""
    ratio = train.corpus_ratio(e) if e.fairseq else float("nan")
    m30k = m30k_artifacts(e) if "train" in parts or ("decode" in parts and not args.checkpoint) else None
    dec = decode.DecodeSetup(e, args, m30k) if "decode" in parts else None
    rounds = []
    for r in range(1, args.rounds + 1):
        res: dict[str, Any] = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "machine": {"matmul": {"value": machine.probe_under(e.env)["fp32_gflops"]}}}
        if "train" in parts:
            res.update(train.train_round(e, args, m30k, r, ratio))
        if dec is not None:
            res.update(decode.decode_round(e, dec, args, r))
        for pairs in (data.M30K_TRAIN, args.data_pairs) if "data" in parts else ():
            say(f"round {r}: data {pairs:,} pairs: fairseq-preprocess, mtpipe bpe + bucket")
            res[f"data {pairs}"] = data.data_round(e, pairs, r)
        rounds.append(res)
        say(f"round {r} done")
    return {"rounds": rounds, "setup": {"corpus_src_tgt_over_tgt": ratio, **({"decode": dec.info} if dec else {})}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in WORKERS:
        WORKERS[argv[0]](argv[1:])
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench.anchors", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    machine.add_flags(ap)
    ap.add_argument("--only", default="train,decode,data", help="comma list of parts: train, decode, data")
    ap.add_argument("--smoke", action="store_true", help="tiny step counts: checks that everything runs")
    ap.add_argument("--out", help="logs (default bench/out/anchors/<UTC time>)")
    ap.add_argument("--workdir", default=str(REPO / "bench" / "out" / "anchors" / "work"),
                    help="prepared corpora, artifacts and fallback models, reused across runs")
    ap.add_argument("--anchors", default=mtenv.get("ANCHORS", "/tmp/anchors"), help="setup_anchors.sh's dir")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spm-model", help="this SentencePiece model for every system (the data re-encoded once); "
                    "default with --quality-run: --tokens' spm.model")
    ap.add_argument("--dropout", choices=list(DROPOUTS), default="paper", help="paper: mtpipe's presets' (0.1, "
                    "0 on attention and ReLU) on both sides; anchors: 0.1 everywhere (fs_train.sh's)")
    ap.add_argument("--train-dims", default="small,base", help="comma list: small, base")
    ap.add_argument("--train-updates", help="updates per measurement (default small=60,base=30)")
    ap.add_argument("--train-intervals", type=int, help="intervals the updates are timed in, the first skipped (6)")
    ap.add_argument("--checkpoint", help="mtpipe checkpoint to decode (with --tokens; default: a short mtpipe train)")
    ap.add_argument("--tokens", help="the bpe artifact of --checkpoint or --quality-run")
    ap.add_argument("--fs-checkpoint", help="fairseq checkpoint to decode (default: fs_train.sh 800's)")
    ap.add_argument("--train-minutes", type=float, help="without --checkpoint: mtpipe's training minutes (10)")
    ap.add_argument("--decode-sentences", type=int, help="the first N test sentences (default 1000)")
    ap.add_argument("--decode-systems", default="fairseq,mtpipe,ct2", help="with --only decode: fairseq optional")
    ap.add_argument("--decode-max-tokens", type=int, default=8000, help="source tokens per batch, every system")
    ap.add_argument("--decode-processes", type=int, default=1, help="N > 1: also mtpipe fp32 / int8 (and compiled) "
                    "in N processes and CTranslate2 float32 / int8 with N replicas, --threads split among them")
    ap.add_argument("--decode-compile", action="store_true", help="also mtpipe fp32 and bf16 with decode.compile")
    ap.add_argument("--data-pairs", type=int, help="the large data run (default 4,500,000)")
    ap.add_argument("--quality-run", metavar="DIR", help="instead: quality against this `mtpipe train` run")
    ap.add_argument("--quality-fairseq", choices=("run", "anchors"), default="run", help="fairseq's settings")
    ap.add_argument("--quality-fs-updates", type=int, default=0, help="fairseq's expected updates (default: measured)")
    ap.add_argument("--quality-average", type=int, default=5, help="checkpoints averaged per side")
    ap.add_argument("--quality-alphas", default="0.6,1.0,1.5", help="alphas tried on valid")
    args = ap.parse_args(argv)
    smoke = {"rounds": 1, "train_updates": "small=6,base=2", "train_intervals": 2, "decode_sentences": 40,
             "data_pairs": 60_000} if args.smoke else {}
    for k, v in {"train_updates": "small=60,base=30", "train_intervals": 6, "decode_sentences": 1000,
                 "data_pairs": 4_500_000, **smoke}.items():
        if getattr(args, k) is None or (k == "rounds" and "--rounds" not in argv):
            setattr(args, k, v)
    parts = [p for p in args.only.split(",") if p]
    args.decode_systems = [x for x in args.decode_systems.split(",") if x]
    if bad := [p for p in parts if p not in ("train", "decode", "data")]:
        ap.error(f"--only: unknown part(s) {bad}")
    if not {"mtpipe", "ct2"} <= set(args.decode_systems) <= {"fairseq", "mtpipe", "ct2"}:
        ap.error("--decode-systems: mtpipe and ct2, optionally fairseq")
    if "fairseq" not in args.decode_systems and parts != ["decode"]:
        ap.error("--decode-systems without fairseq needs --only decode")
    args.quality_alphas = [float(a) for a in args.quality_alphas.split(",")]
    if args.quality_run:
        if not args.tokens:
            ap.error("--quality-run needs --tokens (the run's bpe artifact)")
        args.spm_model = args.spm_model or str(Path(args.tokens) / "spm.model")
    elif (args.checkpoint is None) != (args.tokens is None):
        ap.error("give --checkpoint and --tokens together")
    now = datetime.datetime.now(datetime.timezone.utc)
    args.out = args.out or str(REPO / "bench" / "out" / "anchors" / f"{now:%Y%m%dT%H%M%SZ}")
    if args.spm_model:
        anchors_with_spm(args, Path(args.spm_model))
    e = Env(args, fairseq="fairseq" in args.decode_systems)
    e.work.mkdir(parents=True, exist_ok=True)
    e.probe = probe(e)
    say(f"machine probe under the run's environment: {e.probe}")
    meta = {"smoke": args.smoke, "threads": args.threads, "isa": args.isa, "spm_model": str(e.spm), "out": str(e.out),
            "settings": vars(args)}
    t0 = time.perf_counter()
    if args.quality_run:
        figures = {**meta, "quality": quality.run_quality(e, args)}
    else:
        result = run_rounds(e, args, parts)
        title = (f"mtpipe vs the anchors, {e.probe['cpu']['model']}, {args.threads} threads"
                 + (", SMOKE (tiny step counts: not a measurement)" if args.smoke else ""))
        figures = {**meta, **result, "summary": report.print_rounds(title, result)}
    figures["seconds"] = time.perf_counter() - t0
    machine.write_results("anchors-quality" if args.quality_run else "anchors", figures, args.results, e.probe,
                          "python -m bench.anchors " + " ".join(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
