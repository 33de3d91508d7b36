"""Shared fixtures. Tests run offline, on CPU, in a few minutes on 2 cores (two pytest-xdist workers: ``make test``)."""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# mtpipe's console wraps at COLUMNS when it is set, and tests read whole messages from it: a terminal's width
# (or pytest-xdist's workers, which are given COLUMNS=80 LINES=24) must not decide whether a message is split. Popped
# here, before any test imports mtpipe.console; subprocess tests that need a width pass their own.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)
# decode.compile's packaged steps (mtpipe.engine.step_package) go to a directory of this test run's, not the user's cache;
# subprocesses inherit it.
if "MTPIPE_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["MTPIPE_CACHE_DIR"] = tempfile.mkdtemp(prefix="mtpipe-test-cache-")
    atexit.register(shutil.rmtree, os.environ["MTPIPE_CACHE_DIR"], ignore_errors=True)


def train_spm(prefix: Path, lines: list[str], vocab_size: int):
    """A tiny BPE SentencePiece model ``prefix.model`` with mtpipe's special ids, trained on ``lines``; returns its
    processor."""
    import sentencepiece as spm

    from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID, UNK_ID

    text = prefix.with_suffix(".txt")
    text.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(prefix), vocab_size=vocab_size,
                                   model_type="bpe", pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                                   hard_vocab_limit=False, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model")


def synthetic_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` made-up English-like / German-like sentence pairs with a learnable translation, so that every test
    runs in a fresh clone without any corpus beside it: a Zipf-distributed vocabulary of 1,200 pseudo-words per
    side, each source word with one fixed target word, the target verb-final (the second word moves to the end),
    capitalised, with a full stop, and umlauts on the German side."""
    import random

    syllables = ["ka", "lo", "mi", "ten", "ra", "su", "ve", "dor", "pi", "an", "el", "ost", "ri", "ba", "nu", "gel"]
    umlaut = str.maketrans({"a": "ä", "o": "ö", "u": "ü", "s": "ß"})
    words = random.Random(0)
    src_vocab = sorted({"".join(words.choice(syllables) for _ in range(words.randint(1, 3))) for _ in range(3000)})
    src_vocab = src_vocab[:1200]
    tgt_vocab = ["".join(words.choice(syllables) for _ in range(words.randint(1, 3))) + "en" for _ in src_vocab]
    tgt_vocab = [w.translate(umlaut) if i % 7 == 0 else w for i, w in enumerate(tgt_vocab)]
    weights = [1.0 / (rank + 1) for rank in range(len(src_vocab))]
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        idx = rng.choices(range(len(src_vocab)), weights, k=rng.randint(3, 14))
        src = [src_vocab[i] for i in idx]
        tgt = [tgt_vocab[i] for i in idx]
        tgt = tgt[:1] + tgt[2:] + tgt[1:2]
        pairs.append((" ".join(src).capitalize() + ".", " ".join(tgt).capitalize() + "."))
    return pairs


def write_corpus(out: Path, sizes: dict[str, int], seed: int = 1) -> Path:
    """A local ``{split}.{en,de}.gz`` corpus of :func:`synthetic_pairs` (Multi30k's file layout)."""
    out.mkdir(parents=True, exist_ok=True)
    for i, (split, n) in enumerate(sizes.items()):
        pairs = synthetic_pairs(n, seed * 100 + i)
        for lang, side in (("en", 0), ("de", 1)):
            with gzip.open(out / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.writelines(p[side] + "\n" for p in pairs)
    return out


@pytest.fixture
def small_corpus(tmp_path: Path) -> Path:
    """A local corpus in Multi30k's layout (``train``, ``val``, ``test_2016_flickr`` x ``{en,de}.gz``): 2,000
    train pairs, 100 val, 100 test, made up by :func:`synthetic_pairs` (built here, so no data beside the
    checkout is needed)."""
    return write_corpus(tmp_path / "corpus", {"train": 2000, "val": 100, "test_2016_flickr": 100})


def assert_steps_match_forward(model, src, tgt, reorder=None) -> None:
    """Incremental decoding (the prepared model's ``encode`` / ``start`` / ``step`` with the self-attention cache,
    :func:`mtpipe.engine.variants.prepare`) gives the full teacher-forced forward pass's log-probabilities at every
    target position; with ``reorder`` (a row index), one more step after ``state.select(reorder)`` gives the rows
    ``reorder`` of the same step without it (beam search reorders and drops rows). ``src`` ``[B, S]``, ``tgt``
    ``[B, T]`` starting with BOS."""
    import torch

    from mtpipe.engine.variants import prepare

    with torch.no_grad():
        full = torch.log_softmax(model(src, tgt).float(), dim=-1)  # [B, T, V]
        prepared = prepare(model, "fp32", torch.device("cpu"))
        state = prepared.start(*prepared.encode(src))
        for t in range(tgt.size(1)):
            logp, state = prepared.step(tgt[:, t], state)
            torch.testing.assert_close(logp, full[:, t], rtol=1e-4, atol=1e-4)
        if reorder is None:
            return
        nxt = torch.randint(4, full.size(-1), (src.size(0),))
        selected = state.select(reorder)  # before the step below: only the newest state may be selected from
        logp_all, _ = prepared.step(nxt, state)
        logp_sel, _ = prepared.step(nxt[reorder], selected)
    torch.testing.assert_close(logp_sel, logp_all[reorder], rtol=1e-4, atol=1e-4)


def memorise(src: list[list[int]], tgt: list[list[int]], vocab: int, max_positions: int, steps: int,
             stop_loss: float = 0.0, **model: Any):
    """A tiny Transformer (dropout 0, seed 0; ``model``: other ModelConfig keys, e.g. ``norm_position="pre"``)
    trained by full-batch teacher forcing on the id sequences (EOS added, BOS before the target) for ``steps`` Adam
    updates, or until the loss is below ``stop_loss``; returned in eval mode. The decode, export and CTranslate2
    tests decode what it memorised."""
    import torch
    import torch.nn.functional as F

    from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID
    from mtpipe.config import ModelConfig
    from mtpipe.model.transformer import Transformer

    def pad(seqs: list[list[int]]):
        return torch.nn.utils.rnn.pad_sequence([torch.tensor(x) for x in seqs], batch_first=True)

    torch.manual_seed(0)
    model = Transformer(ModelConfig(preset="tiny", dropout=0.0, max_positions=max_positions, **model), vocab)
    s = pad([x + [EOS_ID] for x in src])  # [B, S]
    t_in, t_out = pad([[BOS_ID] + y for y in tgt]), pad([y + [EOS_ID] for y in tgt])  # [B, T]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = F.cross_entropy(model(s, t_in).view(-1, vocab), t_out.view(-1), ignore_index=PAD_ID)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < stop_loss:
            break
    return model.eval()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under ``make test`` (``MTPIPE_NO_SKIPS=1``) every core test must run: a skipped test fails the run, and ``-rs``
    prints each one's reason. Everything the suite needs is installed by ``make``, so a skip there means a broken
    environment; only a skip whose reason starts with "optional:" (e.g. mounting a tmpfs needs root) is allowed."""
    if os.environ.get("MTPIPE_NO_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    # A test that needs what a plain user may lack (root, for a tmpfs) says so with an "optional:" reason.
    skipped = [r for r in skipped if "optional:" not in str(getattr(r, "longrepr", ""))]
    if skipped and session.exitstatus == 0:
        reporter.write_line(f"error: {len(skipped)} test(s) skipped; `make test` runs every test (reasons above)",
                            red=True)
        session.exitstatus = 1
