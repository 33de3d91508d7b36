"""Tiny training artifacts and training runs in separate processes, for tests/ and bench/.

The artifacts are written directly with ``ArtifactWriter`` (the contract's schemas and manifest extras), so they
depend neither on SentencePiece nor on the bpe/bucket stages. The task is learnable: the target is the source
reversed with every id shifted, so a tiny model can overfit it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from mtpipe import artifacts, writing
from mtpipe.stages import bucket
from mtpipe.training import checkpoints

REPO = Path(__file__).resolve().parents[1]

VOCAB = 32
SPM = "sha256:" + "ab" * 32
# A tiny model: fast on 2 CPU cores, but every part of the architecture is there.
TINY = dict(preset="tiny", encoder_layers=1, decoder_layers=1, d_model=32, d_ff=64, heads=2, max_positions=64)


def pairs(rng: np.random.Generator, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """``n`` source/target id sequences of the learnable task (the target: the source reversed, ids shifted)."""
    src = [rng.integers(4, VOCAB, int(rng.integers(2, 9))).tolist() for _ in range(n)]
    tgt = [[(t - 4 + 3) % (VOCAB - 4) + 4 for t in s][::-1] for s in src]
    return src, tgt


def pack_batches(src: list[list[int]], tgt: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Length-sorted batches whose padded size per side (EOS/BOS included) stays within max_tokens."""
    order = sorted(range(len(src)), key=lambda i: (len(src[i]), len(tgt[i]), i))
    batches, cur, width = [], [], 0
    for i in order:
        w = max(width, len(src[i]) + 1, len(tgt[i]) + 1)
        if cur and (len(cur) + 1) * w > max_tokens:
            batches.append(cur)
            cur, w = [], max(len(src[i]), len(tgt[i])) + 1
        cur.append(i)
        width = w
    return batches + [cur]


def make_artifacts(root: Path, n_train: int = 96, n_valid: int = 16, max_tokens: int = 48, seed: int = 0,
                   spm: str = SPM, id_base: int = 0, long_valid: int = 0, arrow: bool = True) -> tuple[Path, Path]:
    """A bpe ("tokens") and a bucket ("batches") artifact of a synthetic corpus; ids start at ``id_base``;
    ``long_valid`` > 0 adds a valid pair of that many tokens (the bucket stage keeps such pairs in a batch alone);
    ``arrow``: the batches carry train.arrow, as the bucket stage writes them (else: as an older mtpipe did)."""
    rng = np.random.default_rng(seed)
    tokens, batches = root / "bpe", root / "bucket"
    data = {"train": pairs(rng, n_train), "valid": pairs(rng, n_valid)}
    if long_valid:
        data["valid"][0].append([5] * long_valid)
        data["valid"][1].append([6] * long_valid)
    with writing.ArtifactWriter(tokens, "tokens", {"bpe": {"vocab_size": VOCAB}}) as w:
        for split, (src, tgt) in data.items():
            w.write_table(f"{split}.parquet", pa.table({"id": [id_base + i for i in range(len(src))], "src": src,
                                                        "tgt": tgt}))
        w.path("spm.model").write_bytes(b"not a real sentencepiece model")
        w.extra.update(spm_sha256=spm, vocab_size=VOCAB)
    with writing.ArtifactWriter(batches, "batches", {"bucket": {"max_tokens": max_tokens}},
                                  upstream={"tokens": tokens}) as w:
        for split, (src, tgt) in data.items():
            bs = pack_batches(src, tgt, max_tokens)
            w.write_table(f"{split}.parquet", pa.table({
                "batch": list(range(len(bs))),
                "ids": [[id_base + i for i in b] for b in bs],
                "src_tokens": [sum(len(src[i]) + 1 for i in b) for b in bs],
                "tgt_tokens": [sum(len(tgt[i]) + 1 for i in b) for b in bs],
                "src_len": [max(len(src[i]) for i in b) + 1 for b in bs],
                "tgt_len": [max(len(tgt[i]) for i in b) + 1 for b in bs],
            }))
            if split == "train" and arrow:
                sides = [bucket.FlatSide.from_lengths(np.asarray([t for x in side for t in x], np.int32),
                                                      np.asarray([len(x) for x in side])) for side in (src, tgt)]
                w.rows[artifacts.TRAIN_ARROW] = bucket.write_batch_tokens(
                    w.path(artifacts.TRAIN_ARROW), id_base + np.arange(len(src)), np.concatenate(bs),
                    np.cumsum([0] + [len(b) for b in bs]), *sides)
    return tokens, batches


def write_params(path: Path, model: dict, train: dict) -> Path:
    """A params file with these ``model`` and ``train`` sections."""
    import yaml

    path.write_text(yaml.safe_dump({"model": model, "train": train}), encoding="utf-8")
    return path


def tsv(out: Path, name: str) -> list[tuple[int, str]]:
    """(step, value as written) rows of a dvclive metric: the exact text, for bitwise comparisons."""
    lines = (out / "live" / "plots" / "metrics" / f"{name}.tsv").read_text().splitlines()[1:]
    return [(int(a), b) for a, b in (ln.split("\t") for ln in lines)]


def weights(ck: Path) -> dict[str, torch.Tensor]:
    """The weights of checkpoint ``ck``."""
    return artifacts.load_checkpoint(ck).state_dict

# The train settings of the runs that are killed and resumed (fp32, 1 thread: bitwise comparisons).
RESUME_TRAIN = dict(max_steps=16, warmup=10, lr_scale=2.0, precision="fp32", threads=1, save_every_minutes=0,
                    save_every_steps=3, keep_last=20, valid_every_steps=5, log_every_steps=1, tokens_per_update=96)


def run_env() -> dict[str, str]:
    """The environment of an `mtpipe` subprocess: this one's, without a torchrun launch's variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONFAULTHANDLER"] = "1"  # a hung worker killed with SIGABRT prints where it was
    return env


def children() -> dict[int, list[int]]:
    """Every process's children, from ``/proc``."""
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return kids


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it, parents first."""
    kids, out, todo = children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Wait until ``path`` exists (``proc`` must stay alive meanwhile; ``log``: its output, shown on failure)."""
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, f"exited ({proc.returncode}) before {path.name}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() - t0 < timeout, f"{path} did not appear in {timeout} s"
        time.sleep(0.005)


def kill_tree(proc: subprocess.Popen, out: Path) -> None:
    """SIGKILL a launch and every process under it, parents first (torchrun's workers live in their own sessions),
    then any stray process of this test (its command line names the test's own ``out``)."""
    pids = descendants(proc.pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(out).encode() in cmdline.read_bytes():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def assert_same_run(a: Path, b: Path, last: int) -> None:
    """Bitwise: every logged train loss and valid loss, and the final weights."""
    for name in ("train/loss", "train/grad_norm", "valid/loss"):
        assert tsv(a, name) == tsv(b, name), name
    assert [s for s, _ in tsv(b, "train/loss")] == list(range(1, last + 1))  # no step logged twice
    wa, wb = weights(a / "checkpoints" / f"step_{last:08d}"), weights(b / "checkpoints" / f"step_{last:08d}")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    common = {s for s, _ in artifacts.list_checkpoints(a)} & {s for s, _ in artifacts.list_checkpoints(b)}
    assert last in common
    for step in sorted(common):
        assert_same_checkpoint_files(artifacts.checkpoint_path(a, step), artifacts.checkpoint_path(b, step))


def assert_same_checkpoint_files(a: Path, b: Path) -> None:
    """The same checkpoint written by an uninterrupted run and by a resumed one: every file byte for byte (weights
    with their safetensors header, trainer.pt: its training time is in the run's clock.json, not here), so their
    hashes agree wherever they are recorded; the manifests differ at most in the params of the launch (which may
    differ between the two runs), and are equal bytes when those are equal."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name != artifacts.MANIFEST:
            assert (a / name).read_bytes() == (b / name).read_bytes(), a / name
    ma, mb = artifacts.read_manifest(a), artifacts.read_manifest(b)
    assert ma.upstream == mb.upstream and ma.extra == mb.extra and ma.rows == mb.rows and ma.files == mb.files
    if ma.params == mb.params:
        assert (a / artifacts.MANIFEST).read_bytes() == (b / artifacts.MANIFEST).read_bytes()
    ta, tb = (torch.load(d / artifacts.TRAINER_STATE, weights_only=True) for d in (a, b))
    assert "train_seconds" not in ta
    assert_same_state(ta, tb, "trainer.pt")
    # each run's clock has the checkpoint's training time (wall time: not compared)
    assert a.name in {artifacts.checkpoint_path(".", s).name for s in checkpoints.read_clock_file(a.parent.parent)}


def assert_same_state(x: object, y: object, where: str) -> None:
    """``x`` and ``y`` (nested dicts, lists, tensors) equal exactly, key order included; ``where`` names them."""
    assert type(x) is type(y), where
    if isinstance(x, dict):
        assert list(x) == list(y), where  # the same keys in the same order: torch.save writes them in that order
        for k in x:
            assert_same_state(x[k], y[k], f"{where}[{k!r}]")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            assert_same_state(u, v, f"{where}[{i}]")
    elif isinstance(x, torch.Tensor):
        assert x.dtype == y.dtype and torch.equal(x, y), where
    else:
        assert x == y, where
