"""mtpipe's ensembles against fairseq 0.12.2's: two fairseq models imported with ``mtpipe import`` and decoded as
one ensemble by ``mtpipe decode --checkpoint A --checkpoint B`` give the outputs ``fairseq-generate --path a:b``
gives (both average the models' probabilities at each step: fairseq's ``EnsembleModel``, mtpipe's
:mod:`mtpipe.engine.ensemble`).

    python bench/fairseq_ensemble.py                                  # trains two fairseq models (seeds 1 and 2)
    python bench/fairseq_ensemble.py --fairseq-checkpoint a.pt --fairseq-checkpoint b.pt --sentences 1000

Needs the anchors' fairseq (``$ANCHORS``, default /tmp/anchors: ``venv-fs38`` with fairseq 0.12.2, Multi30k
binarised in ``data/fs-bin`` with the SentencePiece model ``data/spm/spm8k.model``), which the anchors' setup script
(``$MTPIPE_ANCHORS/setup_anchors.sh``) installs in about 45 minutes; without it the script stops in one line.

What it runs: unless given, two fairseq models of the anchors' protocol (``fs_train.sh``: 3+3 layers, d 256,
``--updates`` updates each, seeds 1 and 2); the first ``--sentences`` sentences of the test set; each model imported
(``mtpipe import``); then, for each model alone and for the ensemble of both, fairseq-generate (beam 4, lenpen 0.6,
min length 1, at most source + 50 pieces, one sentence a batch) and ``mtpipe decode`` under the same search
(``--length-penalty fairseq --stop finished --min-len 1``, fp32, CPU). The results file
(``bench/results/fairseq_ensemble-<UTC>.json``) holds per case the share of sentences whose output pieces are
identical and the first few that differ; the claim holds when the ensemble's share is that of the single models
(which checks the import and the search; float rounding in the two toolkits' kernels may flip a rare near tie).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.anchors.common import PY, SAME_FOR_ALL, SHARED_ANCHORS, lines_of, say, sh  # noqa: E402
from bench.anchors.decode import DecodeSetup  # noqa: E402
from bench.machine import write_results  # noqa: E402
from mtpipe import env as mtenv  # noqa: E402

# fairseq-generate's search as mtpipe names it (mtpipe's max_len_b counts without the source's EOS, fairseq's with it)
MTPIPE_SEARCH = ["--beam", "4", "--alpha", "0.6", "--length-penalty", "fairseq", "--stop", "finished", "--min-len",
                 "1", "--max-len-a", "1", "--max-len-b", "50", "--precision", "fp32", "--device", "cpu"]
FAIRSEQ_SEARCH = ["--beam", "4", "--lenpen", "0.6", "--min-len", "1", "--max-len-a", "1", "--max-len-b", "49"]


class Anchors:
    """The anchors' fairseq: its venv, binarised data and SentencePiece model, checked before any work."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.a = Path(args.anchors)
        self.fs_py, self.fs_bin = self.a / "venv-fs38" / "bin" / "python", self.a / "data" / "fs-bin"
        self.spm, self.raw = self.a / "data" / "spm" / "spm8k.model", self.a / "data" / "raw"
        need = [self.fs_py, self.fs_bin / "test.en-de.en.bin", self.spm, self.raw / "test_2016_flickr.en"]
        if missing := [str(p) for p in need if not p.exists()]:
            raise SystemExit(f"fairseq 0.12.2 is not set up: missing {', '.join(missing)} (run "
                             f"{SHARED_ANCHORS}/setup_anchors.sh, about 45 minutes)")
        self.threads, self.work = args.threads, Path(args.workdir)
        self.logs = self.work / "logs"
        self.env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
                    "ANCHORS": str(self.a), "COLUMNS": "120", "PYTHONUNBUFFERED": "1", **SAME_FOR_ALL}

    def script(self, name: str) -> Path:
        return self.a / name if (self.a / name).exists() else SHARED_ANCHORS / name


def fairseq_models(e: Anchors, args: argparse.Namespace) -> list[Path]:
    """The two fairseq checkpoints: those given, else ``fs_train.sh`` runs of seeds 1 and 2 (kept and reused)."""
    if args.fairseq_checkpoint:
        return [Path(p) for p in args.fairseq_checkpoint]
    found = []
    for seed in (1, 2):
        save = e.work / f"fs-seed{seed}-{args.updates}"
        if not (save / "checkpoint_last.pt").exists():
            say(f"fairseq-train (fs_train.sh), seed {seed}, {args.updates} updates -> {save}")
            sh(["bash", e.script("fs_train.sh"), args.updates, save, "--seed", seed],
               e.logs / f"fs_train_seed{seed}.log", e.env)
        found.append(save / "checkpoint_last.pt")
    return found


def import_model(e: Anchors, fs_ckpt: Path, name: str) -> Path:
    out = e.work / "imported" / name
    say(f"mtpipe import {fs_ckpt} -> {out}")
    sh([PY, "-m", "mtpipe", "import", "--checkpoint", fs_ckpt, "--dict", e.fs_bin, "--spm-model", e.spm, "--out", out,
        "--force"], e.logs / f"import_{name}.log", e.env)
    return out


def fairseq_generate(e: Anchors, data: Path, fs_ckpts: list[Path], name: str) -> list[str]:
    """``fairseq-generate --path a[:b]`` (through the anchors' launcher that keeps fairseq 0.12.2 off its fused
    encoder, which crashes under torch 1.13): each sentence's output pieces, in input order. One sentence a batch:
    fairseq's length limit is the batch's longest source + 50, mtpipe's each sentence's own source + 50, which an
    output that runs to the limit (a barely trained model's) would show."""
    log = e.logs / f"fairseq_{name}.log"
    say(f"fairseq-generate --path {':'.join(map(str, fs_ckpts))}")
    sh([e.fs_py, e.script("fs_generate_nobt.py"), data, "--path", ":".join(map(str, fs_ckpts)), "--gen-subset",
        "test", "--source-lang", "en", "--target-lang", "de", *FAIRSEQ_SEARCH, "--batch-size", 1, "--cpu",
        "--results-path", e.work / f"fairseq-{name}"], log, e.env)
    hyps = {}
    for line in (e.work / f"fairseq-{name}" / "generate-test.txt").read_text(encoding="utf-8").splitlines():
        if m := re.match(r"H-(\d+)\t[^\t]*\t(.*)$", line):  # H-id, score, pieces (the best hypothesis first)
            hyps.setdefault(int(m[1]), m[2])
    return [hyps[i] for i in range(len(hyps))]


def mtpipe_decode(e: Anchors, source: Path, checkpoints: list[Path], name: str, max_tokens: int) -> list[str]:
    """``mtpipe decode --checkpoint A [--checkpoint B] --input SOURCE`` under fairseq's search: each sentence's output
    pieces, in input order."""
    out = e.work / f"mtpipe-{name}"
    say(f"mtpipe decode {' '.join(f'--checkpoint {c}' for c in checkpoints)}")
    sh([PY, "-m", "mtpipe", "decode", *[x for c in checkpoints for x in ("--checkpoint", c)], "--input", source,
        *MTPIPE_SEARCH, "--max-tokens", max_tokens, "--threads", e.threads, "--out", out, "--force", "--no-stats"],
       e.logs / f"mtpipe_{name}.log", e.env, cwd=e.work)
    import pyarrow.parquet as pq
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(checkpoints[0] / "spm.model"))
    rows = pq.read_table(out / "input.parquet", columns=["tokens"]).column("tokens").to_pylist()
    return [" ".join(sp.id_to_piece(t) for t in tokens) for tokens in rows]


def compare(fairseq: list[str], mtpipe: list[str], sources: list[str]) -> dict[str, Any]:
    same = [a == b for a, b in zip(fairseq, mtpipe, strict=True)]
    differ = [{"line": i, "source": sources[i], "fairseq": a, "mtpipe": b}
              for i, (a, b, s) in enumerate(zip(fairseq, mtpipe, same)) if not s]
    return {"sentences": len(same), "identical": sum(same), "identical_share": round(sum(same) / len(same), 4),
            "first_differences": differ[:5]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--anchors", default=mtenv.get("ANCHORS") or "/tmp/anchors",
                    help="the anchors' directory (venv-fs38, data/) [default: $ANCHORS, else /tmp/anchors]")
    ap.add_argument("--workdir", default="/tmp/mtpipe-fairseq-ensemble", help="where models and outputs go (kept)")
    ap.add_argument("--fairseq-checkpoint", action="append", help="a fairseq checkpoint (give two); default: train two")
    ap.add_argument("--updates", type=int, default=300, help="fairseq-train updates per model when training them")
    ap.add_argument("--sentences", type=int, default=200, help="the first N sentences of the test set (at most 1000)")
    ap.add_argument("--max-tokens", type=int, default=4000, help="mtpipe's source tokens per batch")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results", type=Path, help="the results file (default bench/results/fairseq_ensemble-<UTC>.json)")
    args = ap.parse_args()
    if args.fairseq_checkpoint and len(args.fairseq_checkpoint) != 2:
        raise SystemExit("--fairseq-checkpoint: give it twice (the ensemble's two models) or not at all")
    e = Anchors(args)
    e.work.mkdir(parents=True, exist_ok=True)
    fs_ckpts = fairseq_models(e, args)
    ours = [import_model(e, c, f"model{i}") for i, c in enumerate(fs_ckpts, start=1)]
    # fairseq's binarised test set cut to the first N sentences (the anchors' decode part's own cut)
    data = DecodeSetup._fairseq_subset(SimpleNamespace(n=args.sentences), SimpleNamespace(
        a=e.a, fs_bin=e.fs_bin, logs=e.logs, env=e.env), e.work)
    source = e.work / f"test.{args.sentences}.en"
    source.write_text("".join(s + "\n" for s in lines_of(e.raw / "test_2016_flickr.en")[: args.sentences]),
                      encoding="utf-8")
    sources = lines_of(source)
    cases = {"model 1": ([0], [0]), "model 2": ([1], [1]), "ensemble of both": ([0, 1], [0, 1])}
    figures: dict[str, Any] = {"fairseq_checkpoints": [str(c) for c in fs_ckpts], "updates": args.updates
                               if not args.fairseq_checkpoint else None, "search": " ".join(FAIRSEQ_SEARCH),
                               "cases": {}}
    for case, (fs_idx, mt_idx) in cases.items():
        tag = case.replace(" ", "_")
        got_fs = fairseq_generate(e, data, [fs_ckpts[i] for i in fs_idx], tag)
        got_mt = mtpipe_decode(e, source, [ours[i] for i in mt_idx], tag, args.max_tokens)
        figures["cases"][case] = compare(got_fs, got_mt, sources)
        say(f"{case}: {figures['cases'][case]['identical']} of {len(sources)} outputs identical")
    ensemble = figures["cases"]["ensemble of both"]["identical_share"]
    figures["ensemble_matches_as_the_single_models_do"] = ensemble >= min(
        figures["cases"][c]["identical_share"] for c in ("model 1", "model 2"))
    print(json.dumps({k: v["identical_share"] for k, v in figures["cases"].items()}))
    write_results("fairseq_ensemble", figures, args.results)


if __name__ == "__main__":
    main()
