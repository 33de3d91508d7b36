"""The train loader at scale: the bucket artifact's memory-mapped ``train.arrow`` against the Parquet loader it
replaces (``train.parquet`` of both artifacts read into every process, what an older bucket artifact still gets).

    python bench/train_data.py [--pairs 200000] [--workers 4]     # --pairs 36000000: WMT14 en-fr's size

Builds a synthetic tokens artifact of ``--pairs`` pairs (lengths about those of BPE-encoded WMT, ids from a 37k
vocabulary) and its bucket artifact with the real stage (``mtpipe.stages.bucket``; its wall time and peak RSS are reported),
and a copy of the bucket artifact without train.arrow (hard links) for the old loader. Then, each in fresh processes
(a process per measurement; the artifact files evicted from the page cache with ``posix_fadvise(DONTNEED)`` before
a "cold" one, nothing else on the machine touched):

* time to the first batch: ``load_train_data`` and the collation of rank 0's first batch, after the imports, for a
  fresh start (no verification record: train.arrow is hashed), a restart (the record matches: stat only), cold and
  warm, and the old loader's; and the process's peak RSS (``ru_maxrss``);
* ``--workers`` processes (ranks of one node) loading the data at once, each then touching every token id of the
  train split (the worst case: after a few epochs every rank has read every page): the sum of their PSS
  (``/proc/<pid>/smaps_rollup``), minus each one's PSS before loading (the interpreter and torch), against the size
  of one copy of the data (train.arrow's bytes).

Writes ``bench/results/train_data-<UTC time>.json`` (or ``--results``); the artifacts stay under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import machine  # noqa: E402

VOCAB = 37000


def smaps(pid: int | str = "self") -> dict[str, int]:
    """``/proc/<pid>/smaps_rollup`` in bytes (Rss, Pss, Pss_Anon, Pss_File, ...)."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        out[key] = int(rest.split()[0]) * 1024
    return out


def mapping_pss(pid: int, path: Path) -> int:
    """The PSS in bytes of process ``pid``'s mappings of the file ``path`` (``/proc/<pid>/smaps``)."""
    target, total, inside = str(path.resolve()), 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
            inside = len(head) == 6 and head[5] == target
        elif inside and line.startswith("Pss:"):
            total += int(line.split()[1]) * 1024
    return total


# --------------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------------


def make_tokens(out: Path, pairs: int, seed: int = 0) -> None:
    """A tokens artifact of ``pairs`` synthetic pairs, written in slices of 65536 (bounded memory)."""
    import numpy as np
    import pyarrow as pa

    from mtpipe.artifacts import TOKENS_SCHEMA
    from mtpipe.reading import from_numpy
    from mtpipe.writing import ArtifactWriter

    rng = np.random.default_rng(seed)

    def side(n: int, mean: float) -> pa.ListArray:
        lens = np.clip(np.rint(rng.lognormal(np.log(mean), 0.55, n)), 1, 300).astype(np.int32)
        off = np.zeros(n + 1, np.int32)
        np.cumsum(lens, out=off[1:])
        return pa.ListArray.from_arrays(from_numpy(off), from_numpy(rng.integers(4, VOCAB, int(off[-1]), np.int32)))

    with ArtifactWriter(out, "tokens", {"bpe": {"vocab_size": VOCAB}}) as w:
        for split, n in (("train", pairs), ("valid", 3000)):
            writer = w.parquet_writer(f"{split}.parquet")
            for start in range(0, n, 65536):
                k = min(65536, n - start)
                writer.write_batch(pa.RecordBatch.from_arrays(
                    [from_numpy(np.arange(start, start + k, dtype=np.int64)), side(k, 27.0), side(k, 30.0)],
                    schema=TOKENS_SCHEMA))
            writer.close()
            w.rows[f"{split}.parquet"] = n
        w.path("spm.model").write_bytes(b"synthetic: no SentencePiece model")
        w.extra.update(spm_sha256="sha256:" + "00" * 32, vocab_size=VOCAB)


def old_copy(batches: Path, out: Path) -> None:
    """The bucket artifact as an older mtpipe wrote it: no train.arrow (the Parquet files hard-linked)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    m = json.loads((batches / "manifest.json").read_text())
    for name in m["files"]:
        if name != "train.arrow":
            os.link(batches / name, out / name)
    m["files"].pop("train.arrow")
    m["rows"].pop("train.arrow", None)
    (out / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")


def evict(*dirs: Path) -> None:
    """Drop these artifacts' files from the page cache (their clean pages no process maps), nothing else."""
    for d in dirs:
        for p in d.iterdir():
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def timed_child(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, str]:
    """Run ``cmd``; its wall seconds, peak RSS in bytes (``wait4``), stdout."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}")
    return time.perf_counter() - start, usage.ru_maxrss * 1024, out


# --------------------------------------------------------------------------------------------------------------------
# A worker: one rank's start
# --------------------------------------------------------------------------------------------------------------------


def worker(a: argparse.Namespace) -> None:
    """Load the train data as rank ``a.rank`` of ``a.workers``, collate its first batch, optionally touch every token
    id; print one JSON line, then (``--hold``) wait for a line on stdin so that the parent can read its PSS."""
    import numpy as np

    from mtpipe.training.batches import MappedSplit, collate, epoch_order, load_train_data, rank_batches

    before = smaps()
    t0 = time.perf_counter()
    d = load_train_data(Path(a.tokens), Path(a.batches), 25000, a.workers)
    t_load = time.perf_counter() - t0
    order = epoch_order(len(d.train), 1, 0)
    first = int(rank_batches(order, 0, a.workers, d.accum, a.rank)[0])
    src, _, _ = collate(d.train_tokens, d.train.batch(first))
    t_first = time.perf_counter() - t0
    touched = 0
    if a.touch:
        splits = d.train_tokens.chunks if isinstance(d.train_tokens, MappedSplit) else [d.train_tokens]
        for s in splits:
            for arr in (s.src, s.tgt, s.src_off, s.tgt_off):
                touched += int(np.add.reduce(arr, dtype=np.int64) & 1)  # reads every page
    after = smaps()
    print(json.dumps({"mapped": isinstance(d.train_tokens, MappedSplit), "load_s": t_load, "first_batch_s": t_first,
                      "batch_shape": list(src.shape), "pss_before": before["Pss"], "pss_after": after["Pss"],
                      "anon_before": before["Pss_Anon"], "anon_after": after["Pss_Anon"], "rss_after": after["Rss"],
                      "batches": len(d.train)}), flush=True)
    if a.hold:
        sys.stdin.readline()


def start(a: argparse.Namespace, batches: Path, env: dict[str, str], rank: int = 0, touch: bool = False,
          hold: bool = False) -> list[str]:
    return [sys.executable, __file__, "--worker", "--tokens", str(a.out / "bpe"), "--batches", str(batches),
            "--workers", str(a.workers), "--rank", str(rank), *(["--touch"] if touch else []),
            *(["--hold"] if hold else [])]


def first_batch(a: argparse.Namespace, batches: Path, env: dict[str, str], cold: bool) -> dict[str, Any]:
    if cold:
        evict(a.out / "bpe", batches)
    wall, peak, out = timed_child(start(a, batches, env), env)
    rec = json.loads(out.strip().splitlines()[-1])
    return {"cold": cold, "process_s": round(wall, 3), "load_s": round(rec["load_s"], 3),
            "first_batch_s": round(rec["first_batch_s"], 3), "peak_rss_mb": round(peak / 2**20, 1),
            "mapped": rec["mapped"]}


def node(a: argparse.Namespace, batches: Path, env: dict[str, str]) -> dict[str, Any]:
    """``--workers`` ranks loading at once, each touching all of the data; their PSS read while all hold it."""
    procs = [subprocess.Popen(start(a, batches, env, rank, touch=True, hold=True), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=env, text=True) for rank in range(a.workers)]
    recs, pss = [], []
    for p in procs:
        assert p.stdout is not None
        recs.append(json.loads(p.stdout.readline()))
    arrow = batches / "train.arrow"
    mapped = []
    for p in procs:
        pss.append(smaps(p.pid))
        mapped.append(mapping_pss(p.pid, arrow) if arrow.exists() else 0)
    peaks = []
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.flush()
        _, status, usage = os.wait4(p.pid, 0)
        peaks.append(usage.ru_maxrss * 1024)
    # The train data's share of the node: the PSS of every mapping of train.arrow (one copy in the page cache,
    # split between the processes that map it) plus what loading added to each process's private memory.
    anon = sum(r["anon_after"] - r["anon_before"] for r in recs)
    data = sum(mapped) + anon
    copy = (a.out / "bucket" / "train.arrow").stat().st_size
    mb = lambda x: round(x / 2**20, 1)  # noqa: E731
    return {"workers": a.workers, "one_copy_mb": mb(copy), "data_pss_mb": mb(data),
            "data_pss_over_one_copy": round(data / copy, 3), "train_arrow_pss_mb": mb(sum(mapped)),
            "private_growth_mb": mb(anon), "per_worker_private_growth_mb": [mb(r["anon_after"] - r["anon_before"])
                                                                             for r in recs],
            "sum_pss_mb": mb(sum(s["Pss"] for s in pss)),
            "sum_pss_before_load_mb": mb(sum(r["pss_before"] for r in recs)),
            "per_worker_pss_mb": [mb(s["Pss"]) for s in pss], "per_worker_pss_file_mb": [mb(s.get("Pss_File", 0))
                                                                                       for s in pss],
            "per_worker_pss_anon_mb": [mb(s.get("Pss_Anon", 0)) for s in pss],
            "per_worker_peak_rss_mb": [mb(x) for x in peaks], "mapped": recs[0]["mapped"]}


# --------------------------------------------------------------------------------------------------------------------


def make_artifacts(a: argparse.Namespace, tokens: Path, batches: Path, old: Path) -> dict[str, Any]:
    """The tokens artifact of ``--pairs`` synthetic pairs, and the bucket stage run on it (timed, with its peak
    memory); returns those figures."""
    for d in (tokens, batches, old):
        shutil.rmtree(d, ignore_errors=True)
    t = time.perf_counter()
    make_tokens(tokens, a.pairs)
    figures: dict[str, Any] = {"make_tokens_s": round(time.perf_counter() - t, 1)}
    code = ("import sys; from pathlib import Path; from mtpipe.stages.bucket import bucket_tokens; "
            "from mtpipe.config import BucketConfig; bucket_tokens(BucketConfig(), Path(sys.argv[1]), "
            "Path(sys.argv[2]))")
    wall, peak, _ = timed_child([sys.executable, "-c", code, str(tokens), str(batches)],
                                {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "100"})
    figures["bucket_stage"] = {"seconds": round(wall, 1), "peak_rss_mb": round(peak / 2**20, 1)}
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pairs", type=int, default=200_000, help="train pairs of the synthetic corpus (default 200000)")
    ap.add_argument("--workers", type=int, default=4, help="processes of one node loading the data (default 4)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "train_data", help="where the artifacts go")
    ap.add_argument("--results", type=Path, help="the results file (default bench/results/train_data-<time>.json)")
    ap.add_argument("--keep", action="store_true", help="reuse the artifacts under --out when they have --pairs")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", help=argparse.SUPPRESS)
    ap.add_argument("--batches", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--touch", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)

    from mtpipe.artifacts import read_manifest

    a.out.mkdir(parents=True, exist_ok=True)
    tokens, batches, old = a.out / "bpe", a.out / "bucket", a.out / "bucket_old"
    figures: dict[str, Any] = {"pairs": a.pairs, "workers": a.workers}
    have = a.keep and batches.exists() and read_manifest(tokens).rows.get("train.parquet") == a.pairs
    if not have:
        figures.update(make_artifacts(a, tokens, batches, old))
    old_copy(batches, old)
    m = read_manifest(batches)
    sizes = {"tokens_train_parquet_mb": (tokens / "train.parquet").stat().st_size,
             "bucket_train_parquet_mb": (batches / "train.parquet").stat().st_size,
             "train_arrow_mb": (batches / "train.arrow").stat().st_size}
    figures["files"] = {k: round(v / 2**20, 1) for k, v in sizes.items()}
    figures["train_batches"] = m.rows["train.parquet"]
    figures["tokens"] = read_manifest(batches).extra.get("tokens", {}).get("train")

    cache = Path(tempfile.mkdtemp(prefix="mtpipe-bench-verified-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTPIPE_CACHE_DIR": str(cache)}
    try:
        # The verification record is written only for a file older than reading.RACY_NS (2 s).
        time.sleep(max(0.0, 2.5 - (time.time() - (batches / "train.arrow").stat().st_mtime)))
        runs = {
            "mapped_fresh_cold": first_batch(a, batches, env, cold=True),  # no record yet: hashes train.arrow
            "mapped_restart_cold": first_batch(a, batches, env, cold=True),
            "mapped_restart_warm": first_batch(a, batches, env, cold=False),
            "parquet_cold": first_batch(a, old, env, cold=True),
            "parquet_warm": first_batch(a, old, env, cold=False),
        }
        figures["first_batch"] = runs
        figures["node_mapped"] = node(a, batches, env)
        figures["node_parquet"] = node(a, old, env)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    figures["self_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(figures, indent=1))
    machine.write_results("train_data", figures, a.results)


if __name__ == "__main__":
    main()
