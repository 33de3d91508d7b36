"""Same numbers before and after a refactoring: fingerprints of what mtpipe computes, through its commands only.

A change that moves code (a redesign of the modules, say) must not change a single output. This records, for the
checkout it runs in, fingerprints that any later checkout can be compared with:

* training: the weights after 200 updates (dropout on) at world size 1 and at world size 2 (gloo), each checkpoint's
  tensors hashed (safetensors' bytes are not compared: only the values are the claim);
* exact resume: with ``--resume-from`` a run directory that an earlier checkout wrote (``--keep``), its step-100
  checkpoint is continued to 200 updates by this checkout, whose weights must equal that earlier run's own step 200;
* decoding: ``mtpipe decode`` of the test split in 30-odd configurations (precision fp32 / bf16 / int8, beams,
  length penalties, stopping rules, n-best, batch sizes, threads, processes, the compiled step, raw text input, and
  CTranslate2 on an export of the same checkpoint), each output's hypotheses, tokens and scores hashed.

Everything goes through the CLI (``python -m mtpipe ...``), so the script works on checkouts whose modules differ.
The corpus is synthetic (a word-for-word "language" with local reordering: a small model learns it in 200 updates),
made in the work directory; nothing outside the repository is needed.

    python bench/equivalence.py record --results before.json --keep /tmp/eq-before     # on the old checkout
    python bench/equivalence.py record --results after.json --resume-from /tmp/eq-before
    python bench/equivalence.py compare before.json after.json                          # exit 1 on any difference
    python bench/equivalence.py record --results after.json --decode-with /tmp/eq-before  # decoding alone

``--decode-with`` trains nothing and decodes the earlier checkout's trained model (where training changed on purpose,
decoding can still be compared) and records, per configuration, how many output rows equal that checkout's own.

The results file (bench/machine.py's harness: command, commit, machine, date) holds the fingerprints under
``figures``; ``compare`` prints a table of the entries that differ or are missing on one side.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import write_results  # noqa: E402 (after the path it needs)

UPDATES = 200
# Flags of `mtpipe decode` per configuration (added to the defaults below); the names are the fingerprints' keys.
DECODE_CONFIGS: dict[str, list[str]] = {
    "fp32 greedy": ["--beam", "1"],
    "fp32 beam4": [],
    "fp32 beam5 alpha0": ["--beam", "5", "--alpha", "0"],
    "fp32 beam4 alpha0.6": ["--alpha", "0.6"],
    "fp32 beam4 alpha1.5": ["--alpha", "1.5"],
    "fp32 beam4 fairseq-penalty": ["--length-penalty", "fairseq"],
    "fp32 beam4 stop-finished": ["--stop", "finished"],
    "fp32 beam4 stop-bound": ["--stop", "bound"],
    "fp32 beam8 nbest8": ["--beam", "8", "--nbest", "8"],
    "fp32 beam4 nbest2": ["--nbest", "2"],
    "fp32 beam4 min-len3": ["--min-len", "3"],
    "fp32 beam4 max-len-b5": ["--max-len-b", "5"],
    "fp32 beam4 batches-64-tokens": ["--max-tokens", "64"],
    "fp32 beam4 batches-100000-tokens": ["--max-tokens", "100000"],
    "fp32 beam4 1-thread": ["--threads", "1"],
    "fp32 greedy 1-thread": ["--beam", "1", "--threads", "1"],
    "fp32 beam4 2-processes": ["--processes", "2"],
    "fp32 beam4 input-text": ["--input", "{test_text}"],
    "bf16 greedy": ["--precision", "bf16", "--beam", "1"],
    "bf16 beam4": ["--precision", "bf16"],
    "bf16 beam4 nbest4": ["--precision", "bf16", "--nbest", "4"],
    "int8 greedy": ["--precision", "int8", "--beam", "1"],
    "int8 beam4": ["--precision", "int8"],
    "int8 beam4 stop-finished": ["--precision", "int8", "--stop", "finished"],
    "fp32 greedy compiled": ["--beam", "1", "--compile"],
    "fp32 beam4 compiled": ["--compile"],
    "bf16 beam4 compiled": ["--precision", "bf16", "--compile"],
    "ct2 fp32 greedy": ["--engine", "ctranslate2", "--checkpoint", "{export}", "--beam", "1"],
    "ct2 fp32 beam4": ["--engine", "ctranslate2", "--checkpoint", "{export}"],
    "ct2 int8 beam4": ["--engine", "ctranslate2", "--checkpoint", "{export}", "--ct2-compute-type", "int8"],
    "ct2 fp32 beam4 nbest2": ["--engine", "ctranslate2", "--checkpoint", "{export}", "--nbest", "2"],
    "ct2 fp32 beam4 2-processes": ["--engine", "ctranslate2", "--checkpoint", "{export}", "--processes", "2"],
}
TRAIN_FLAGS = ["--preset", "tiny", "--dropout", "0.1", "--max-steps", str(UPDATES), "--max-epochs", "0",
               "--max-time", "0", "--schedule", "inverse_sqrt", "--warmup", "50", "--save-every-steps", "100",
               "--save-every-minutes", "0", "--save-every-progress", "0", "--valid-every-steps", "100",
               "--keep-last", "5", "--tokens-per-update", "1024", "--seed", "1", "--precision", "fp32"]


def mtpipe(work: Path, *args: str, log: Path) -> None:
    """``python -m mtpipe ARGS`` in ``work`` (its params.yaml), output appended to ``log``; a failure stops the run."""
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ mtpipe {' '.join(args)}\n")
        f.flush()
        env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "150"}
        code = subprocess.call([sys.executable, "-m", "mtpipe", *args], cwd=work, stdout=f, stderr=f, env=env)
    if code:
        raise SystemExit(f"mtpipe {' '.join(args)}: exit {code} (see {log})")


def corpus(data: Path, seed: int = 7) -> None:
    """A word-for-word "language": 400 source words, each with its own target word, adjacent pairs swapped."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def word() -> str:
        return "".join(rng.choice(letters) for _ in range(rng.randint(2, 7)))

    lexicon = {word(): word() for _ in range(400)}
    words = list(lexicon)
    data.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 6000), ("valid", 100), ("test", 120)):
        src = [[rng.choice(words) for _ in range(rng.randint(2, 16))] for _ in range(n)]
        tgt = []
        for s in src:
            t = [lexicon[w] for w in s]
            for i in range(0, len(t) - 1, 2):
                t[i], t[i + 1] = t[i + 1], t[i]
            tgt.append(t)
        for lang, rows in (("en", src), ("de", tgt)):
            with gzip.open(data / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("".join(" ".join(r).capitalize() + ".\n" for r in rows))


def weights_hash(checkpoint: Path) -> str:
    """sha256 over the checkpoint's tensors by name (dtype, shape and bytes): the values, not the file's layout."""
    import torch
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for name, t in sorted(load_file(str(checkpoint / "model.safetensors")).items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def output_hash(out: Path) -> dict[str, Any]:
    """sha256 over a decode output's rows (every column: hypotheses, tokens, scores, n-best), its row count, and a
    short hash per row (how many rows two outputs share)."""
    import pyarrow.parquet as pq

    [table] = [pq.read_table(p) for p in sorted(out.glob("*.parquet"))]
    rows = table.to_pylist()
    return {"rows": len(rows), "sha256": hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest(),
            "first": rows[0].get("hypothesis") if rows else None,
            "row_sha": [hashlib.sha256(json.dumps(r, sort_keys=True).encode()).hexdigest()[:10] for r in rows]}


def record(args: argparse.Namespace) -> None:
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="mtpipe-equivalence-"))
    if work.exists() and any(work.iterdir()):
        raise SystemExit(f"{work}: not empty (the work directory must be new)")
    work.mkdir(parents=True, exist_ok=True)
    log = work / "equivalence.log"
    shutil.copy(REPO / "params.yaml", work / "params.yaml")
    figures: dict[str, Any] = {"train": {}, "decode": {}, "seconds": {}}
    start = time.monotonic()
    try:
        corpus(work / "data")
        mtpipe(work, "fetch", "--source", str(work / "data"), "--out", "fetch", log=log)
        mtpipe(work, "bpe", "--corpus", "fetch", "--vocab-size", "600", "--out", "bpe", log=log)
        mtpipe(work, "bucket", "--tokens", "bpe", "--max-tokens", "512", "--out", "bucket", log=log)
        figures["seconds"]["data"] = round(time.monotonic() - start, 1)
        runs = {"ws1": ["--nproc", "1"], "ws2": ["--nproc", "2"]}
        for name, extra in runs.items() if not args.decode_with else ():  # decoding alone: no training
            t0 = time.monotonic()
            mtpipe(work, "train", "--tokens", "bpe", "--batches", "bucket", "--out", f"train-{name}", *TRAIN_FLAGS,
                   *extra, log=log)
            figures["train"][name] = {str(s): weights_hash(work / f"train-{name}" / "checkpoints" / f"step_{s:08d}")
                                      for s in (100, UPDATES)}
            figures["seconds"][f"train {name}"] = round(time.monotonic() - t0, 1)
        if args.resume_from:
            before = Path(args.resume_from) / "train-ws1" / "checkpoints" / "step_00000100"
            run = work / "train-resumed"
            (run / "checkpoints").mkdir(parents=True)
            shutil.copytree(before, run / "checkpoints" / before.name)
            clock = before.parent.parent / "clock.json"
            if clock.exists():
                shutil.copy(clock, run / "clock.json")
            mtpipe(work, "train", "--tokens", "bpe", "--batches", "bucket", "--out", str(run), *TRAIN_FLAGS,
                   "--nproc", "1", log=log)
            figures["train"]["resumed from before"] = {str(UPDATES): weights_hash(
                run / "checkpoints" / f"step_{UPDATES:08d}")}
        # --decode-with: an earlier checkout's model and bpe, so that decoding is compared alone where training changed
        earlier = Path(args.decode_with).resolve() if args.decode_with else None
        model = (earlier or work) / "train-ws1" / "checkpoints" / f"step_{UPDATES:08d}"
        tokens = str(earlier / "bpe") if earlier else "bpe"
        if earlier:
            figures["decoded_with"] = str(earlier)
        export = work / "export"
        mtpipe(work, "export", "--checkpoint", str(model), "--format", "ctranslate2", "--out", str(export), log=log)
        test_text = work / "test.en"
        with gzip.open(work / "data" / "test.en.gz", "rt", encoding="utf-8") as f:
            test_text.write_text(f.read(), encoding="utf-8")
        only = set(args.only.split(",")) if args.only else None
        for key, flags in DECODE_CONFIGS.items():
            if only is not None and key not in only:
                continue
            flags = [f.format(export=export, test_text=test_text) for f in flags]
            if "--checkpoint" not in flags:
                flags = ["--checkpoint", str(model), *flags]
            out = work / "decode" / key.replace(" ", "_")
            t0 = time.monotonic()
            mtpipe(work, "decode", "--tokens", tokens, "--split", "test", "--threads", "2", *flags, "--out", str(out),
                   log=log)
            figures["decode"][key] = output_hash(out)
            theirs = earlier / "decode" / key.replace(" ", "_") if earlier else None
            if theirs is not None and theirs.exists():  # the earlier checkout's own output of the same model
                mine, old = figures["decode"][key]["row_sha"], output_hash(theirs)["row_sha"]
                figures["decode"][key]["same_rows_as_earlier"] = [sum(a == b for a, b in zip(mine, old)), len(old)]
            figures["seconds"][f"decode {key}"] = round(time.monotonic() - t0, 1)
            print(f"{key}: {figures['decode'][key]['sha256'][:12]} ({figures['seconds'][f'decode {key}']} s)",
                  file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    figures["seconds"]["total"] = round(time.monotonic() - start, 1)
    if "resumed from before" in figures["train"]:
        ok = figures["train"]["resumed from before"][str(UPDATES)] == figures["train"]["ws1"][str(UPDATES)]
        figures["train"]["resume equals this checkout's own run"] = ok
    write_results("equivalence", figures, args.results)


def compare(args: argparse.Namespace) -> None:
    """The fingerprints both files hold, compared; those one side lacks are listed (an error with ``--all``)."""
    a, b = (json.loads(Path(p).read_text(encoding="utf-8")) for p in (args.a, args.b))
    own = ("resumed from before", "resume equals this checkout's own run")  # a record's own resume, checked below
    differ, missing = [], []
    for part in ("train", "decode"):
        fa, fb = a["figures"][part], b["figures"][part]
        for key in sorted((set(fa) | set(fb)) - set(own)):
            va, vb = fa.get(key), fb.get(key)
            if va is None or vb is None:
                missing.append(f"{part} {key} (only in {args.a if vb is None else args.b})")
                continue
            share = ""
            if isinstance(va, dict) and "row_sha" in va and "row_sha" in vb:
                same = sum(x == y for x, y in zip(va["row_sha"], vb["row_sha"]))
                share = f" ({same} of {len(va['row_sha'])} rows the same)"
            if isinstance(va, dict) and "sha256" in va:
                va, vb = va["sha256"], vb.get("sha256")
            if va != vb:
                differ.append(f"{part} {key}: {str(va)[:40]} vs {str(vb)[:40]}{share}")
    for x, y, name in ((a, b, args.b), (b, a, args.a)):  # a record that resumed the other's checkpoint
        resumed = y["figures"]["train"].get("resumed from before")
        if resumed is not None and resumed.get(str(UPDATES)) != x["figures"]["train"]["ws1"].get(str(UPDATES)):
            differ.append(f"train: {name}'s resume of the other's step-100 checkpoint does not end at its weights")
    print(f"{args.a} ({a['commit']}) vs {args.b} ({b['commit']})")
    for line in missing:
        print(f"MISSING {line}")
    for line in differ:
        print(f"DIFFERS {line}")
    failed = differ + (missing if args.all else [])
    print("identical" if not failed else f"{len(failed)} difference(s)")
    sys.exit(1 if failed else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("record", help="train and decode with this checkout; write the fingerprints")
    r.add_argument("--results", type=Path, help="the results file (default bench/results/equivalence-<time>.json)")
    r.add_argument("--keep", type=Path, help="work directory to create and keep (for a later --resume-from)")
    r.add_argument("--resume-from", type=Path, help="an earlier checkout's kept work directory: resume its step-100 "
                   "checkpoint to the end with this checkout")
    r.add_argument("--decode-with", type=Path, help="an earlier checkout's kept work directory: decode its "
                   "trained model with its bpe, no training (decoding compared alone, where training changed); each "
                   "output's rows compared with that checkout's own output of the same configuration")
    r.add_argument("--only", help="comma-separated decode configurations (default: all)")
    c = sub.add_parser("compare", help="compare two results files; exit 1 on any difference")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--all", action="store_true", help="a fingerprint only one side has is a difference too")
    args = ap.parse_args()
    record(args) if args.what == "record" else compare(args)


if __name__ == "__main__":
    main()
