"""A corpus at scale: ``mtpipe decode --input FILE`` on millions of lines, in chunks (decode.chunk_lines): peak memory
against the corpus size, and what a kill costs a rerun that resumes.

    python bench/decode_corpus.py                                   # 500,000 and 5,000,000 lines
    python bench/decode_corpus.py --lines 500000,1000000 --resume-at 1000000

Made in ``--work`` (a new temporary directory unless given; removed at the end unless given): a SentencePiece model
(vocabulary 1,000) trained on synthetic sentences, a tiny model with random weights (``testkit.runs.TINY``: one
layer each side, d_model 32) saved as a checkpoint that carries it, and a corpus of each size, sentences of 3 to 25
words drawn from a Zipf-distributed vocabulary (about 4 to 40 pieces each, a blank line in 50). The weights do not
matter here: what is measured is how memory and time grow with the corpus; outputs are capped at 8 pieces (greedy,
``--max-len-a 0 --max-len-b 8``) so that the random model's translations cost what a trained model's short ones do.

For each size, one uninterrupted run (a fresh ``python -m mtpipe decode --out``; stdout to /dev/null): its wall
seconds, lines per second and peak RSS (``wait4``'s ``ru_maxrss``); at the smallest size also the whole file in one
chunk (``--chunk-lines`` = its lines: what decode did before it read in chunks); and, unless
``--no-default-caches``, the chunked run again with oneDNN's two kernel caches at their libraries' default of 1,024
entries each, where mtpipe bounds them (:data:`mtpipe.platform.KERNEL_CACHE`): at the smallest size ``--rounds``
interleaved rounds of the two, whose speeds are compared, at the others one run each. At ``--resume-at`` lines: a run
killed (SIGKILL) halfway through a chunk once ``--kill-after`` chunks are finished, then the same command again: the
lines the rerun translated, the lines the killed run had translated in its unfinished chunk and lost (its rate times
the seconds since its last finished chunk), the seconds lost against the uninterrupted run, and whether the
artifact is byte-identical to the uninterrupted run's.

Writes ``bench/results/decode_corpus-<UTC time>.json`` (or ``--results``); docs/decoding.md renders it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import write_results  # noqa: E402 (after the path it needs)

DECODE = ["--beam", "1", "--max-len-a", "0", "--max-len-b", "8"]
# oneDNN's two kernel caches at their libraries' default size (mtpipe bounds them: mtpipe.platform.KERNEL_CACHE)
DEFAULT_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"}


def words(seed: int = 0) -> tuple[list[str], list[float]]:
    """3,000 pseudo-words and their Zipf weights."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ten", "ra", "su", "ve", "dor", "pi", "an", "el", "ost", "ri", "ba", "nu", "gel"]
    vocab = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(6000)})[:3000]
    return vocab, [1.0 / (rank + 1) for rank in range(len(vocab))]


def write_corpus(path: Path, lines: int, seed: int = 1) -> None:
    """``lines`` synthetic sentences (3 to 25 words, a blank line in 50), written in blocks."""
    vocab, weights = words()
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, lines, 100_000):
            block = []
            for _ in range(min(100_000, lines - start)):
                n = rng.randint(3, 25)
                block.append("" if rng.random() < 0.02 else " ".join(rng.choices(vocab, weights, k=n)).capitalize()
                             + ".")
            f.write("\n".join(block) + "\n")


def make_model(work: Path) -> Path:
    """A SentencePiece model trained on 20,000 synthetic sentences, and a checkpoint of the tiny model (random
    weights, seed 0) that carries it."""
    import sentencepiece as spm
    import torch

    from mtpipe import artifacts, writing
    from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID, UNK_ID
    from mtpipe.config import ModelConfig, to_dict
    from mtpipe.model.transformer import Transformer
    from testkit.runs import TINY

    sample = work / "spm-sample.txt"
    write_corpus(sample, 20_000, seed=0)
    spm.SentencePieceTrainer.train(input=str(sample), model_prefix=str(work / "spm"), vocab_size=1000,
                                   model_type="bpe", pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                                   minloglevel=2)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, "dropout": 0.0}), 1000)
    checkpoint = work / "model"
    spm_model = work / "spm.model"
    writing.write_checkpoint(checkpoint, state_dict=model.state_dict(), meta=artifacts.CheckpointManifest(
        model_config=to_dict(model.cfg), step=0, vocab={"spm_sha256": artifacts.file_hash(spm_model), "size": 1000}),
        spm=spm_model)
    return checkpoint


def command(checkpoint: Path, corpus: Path, out: Path, chunk_lines: int, threads: int) -> list[str]:
    return [sys.executable, "-m", "mtpipe", "decode", "--params", os.devnull, "--checkpoint", str(checkpoint),
            "--input", str(corpus), "--out", str(out), "--chunk-lines", str(chunk_lines), "--threads", str(threads),
            "--stats", *DECODE]


def run(cmd: list[str], log: Path, kill: Any = None, extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` (stdout to /dev/null, stderr to ``log``; ``extra``: variables added to its environment); its wall
    seconds, peak RSS and exit status. ``kill``: called every 0.2 s with the process, returns True once it has been
    killed."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(extra or {})}
    start = time.perf_counter()
    with open(log, "a", encoding="utf-8") as err, open(os.devnull, "w") as null:
        err.write(f"$ {' '.join(cmd)}\n")
        err.flush()
        proc = subprocess.Popen(cmd, stdout=null, stderr=err, env=env, cwd=log.parent)
        while True:  # not proc.poll(): it would reap the process, whose resource usage wait4 reads
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG if kill is not None else 0)
            if pid:
                break
            if not kill(proc):
                time.sleep(0.2)
    code = os.waitstatus_to_exitcode(status)
    return {"seconds": round(time.perf_counter() - start, 1), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
            "exit": code}


def files_hash(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.iterdir()):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def resume(checkpoint: Path, corpus: Path, work: Path, lines: int, args: argparse.Namespace,
           whole: dict[str, Any], log: Path) -> dict[str, Any]:
    """Kill a run halfway through the chunk after ``--kill-after`` finished ones, rerun it, compare."""
    from mtpipe import artifacts

    out = work / f"out-resume-{lines}"
    progress = artifacts.partial_dir(out) / artifacts.PARTIAL_PROGRESS
    cmd = command(checkpoint, corpus, out, args.chunk_lines, args.threads)
    state: dict[str, Any] = {}

    def kill(proc: subprocess.Popen) -> bool:
        try:
            chunks = json.loads(progress.read_text(encoding="utf-8"))["chunks"]
            done_at = progress.stat().st_mtime
        except (OSError, ValueError, KeyError):
            return False
        seen = state.setdefault("seen", [])
        if not seen or seen[-1][0] != len(chunks):
            seen.append((len(chunks), done_at))
        if len(chunks) < args.kill_after or len(seen) < 2:
            return False
        (n0, t0), (n1, t1) = seen[-2], seen[-1]
        state["chunk_s"], state["done_at"], state["chunks"] = (t1 - t0) / (n1 - n0), t1, n1
        if time.time() - t1 < state["chunk_s"] / 2:  # halfway through the next chunk
            return False
        os.kill(proc.pid, signal.SIGKILL)  # not proc.send_signal: it polls, reaping the process
        state["killed_at"] = time.time()
        return True

    killed = run(cmd, log, kill)
    if "killed_at" not in state:
        raise SystemExit(f"the run of {lines:,} lines ended before the kill: give --kill-after fewer chunks")
    rate = args.chunk_lines / state["chunk_s"]
    lost = min(args.chunk_lines, round(rate * (state["killed_at"] - state["done_at"])))
    text = log.read_text(encoding="utf-8")
    rerun = run(cmd, log)
    m = re.findall(r"resuming after chunk ([\d,]+) of [\d,]+: ([\d,]+) lines", log.read_text(encoding="utf-8")[
        len(text):])
    resumed = int(m[-1][1].replace(",", "")) if m else 0
    return {"lines": lines, "killed_run": killed, "finished_chunks_at_kill": state["chunks"], "rerun": rerun,
            "lines_resumed": resumed, "lines_translated_by_rerun": lines - resumed,
            "seconds_into_unfinished_chunk": round(state["killed_at"] - state["done_at"], 1),
            "lines_lost_estimate": lost, "seconds_lost": round(killed["seconds"] + rerun["seconds"]
                                                             - whole["seconds"], 1),
            "identical_to_uninterrupted": files_hash(out) == whole["files_sha256"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", default="500000,5000000", help="corpus sizes, comma-separated")
    ap.add_argument("--chunk-lines", type=int, default=50_000, help="decode.chunk_lines")
    ap.add_argument("--threads", type=int, default=0, help="decode.threads (0: torch's default)")
    ap.add_argument("--resume-at", type=int, help="the corpus size of the kill and rerun (default: the smallest)")
    ap.add_argument("--kill-after", type=int, default=3, help="finished chunks before the kill (2 or more)")
    ap.add_argument("--no-whole", action="store_true", help="skip the one-chunk run at the smallest size")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the bounded and default caches' "
                    "runs at the smallest size (their speed is compared)")
    ap.add_argument("--no-default-caches", action="store_true", help="skip the runs with oneDNN's kernel caches at "
                    "their libraries' default size")
    ap.add_argument("--work", type=Path, help="work directory (kept); default a temporary one, removed")
    ap.add_argument("--results", type=Path, help="results file (default bench/results/decode_corpus-<time>.json)")
    args = ap.parse_args()
    sizes = sorted(int(x) for x in args.lines.split(","))
    work = args.work or Path(tempfile.mkdtemp(prefix="mtpipe-decode-corpus-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "decode_corpus.log"
    figures: dict[str, Any] = {"chunk_lines": args.chunk_lines, "threads": args.threads, "decode": " ".join(DECODE),
                               "model": "testkit.runs.TINY, random weights, vocabulary 1,000", "runs": []}
    try:
        checkpoint = make_model(work)
        for lines in sizes:
            corpus = work / f"corpus-{lines}.txt"
            write_corpus(corpus, lines)
            pair = [("chunks", args.chunk_lines, {})]
            if not args.no_default_caches:
                pair.append(("chunks, default caches", args.chunk_lines, DEFAULT_CACHES))
            rounds = args.rounds if lines == sizes[0] and len(pair) > 1 else 1
            variants = [(k, *v) for k in range(rounds) for v in (pair if k % 2 == 0 else pair[::-1])]
            if lines == sizes[0] and not args.no_whole and lines > args.chunk_lines:
                variants.append((0, "one chunk", lines, {}))
            for k, name, chunk, extra in variants:
                out = work / f"out-{lines}-{chunk}"
                r = run(command(checkpoint, corpus, out, chunk, args.threads), log, extra=extra)
                if r["exit"]:
                    raise SystemExit(f"decode of {corpus} exited {r['exit']} (see {log})")
                r.update(lines=lines, chunk_lines=chunk, reading=name, round=k,
                         lines_per_s=round(lines / r["seconds"], 1),
                         corpus_mb=round(corpus.stat().st_size / 2**20, 1), files_sha256=files_hash(out))
                figures["runs"].append(r)
                print(json.dumps(r), file=sys.stderr)
                shutil.rmtree(out)
            if lines == (args.resume_at or sizes[0]):
                whole = next(r for r in figures["runs"] if r["lines"] == lines and r["reading"] == "chunks")
                figures["resume"] = resume(checkpoint, corpus, work, lines, args, whole, log)
                print(json.dumps(figures["resume"]), file=sys.stderr)
            corpus.unlink()
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    chunked = [r for r in figures["runs"] if r["reading"] == "chunks" and r["round"] == 0]
    figures["peak_rss_mb_largest_over_smallest"] = round(chunked[-1]["peak_rss_mb"] / chunked[0]["peak_rss_mb"], 3)
    write_results("decode_corpus", figures, args.results)


if __name__ == "__main__":
    main()
