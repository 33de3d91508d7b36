"""Shared fixtures. Tests run offline, on CPU, in a few minutes on 2 cores."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MULTI30K = Path(os.environ.get("MTPIPE_MULTI30K", REPO.parent / "shared" / "data" / "multi30k"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


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


def have_multi30k() -> bool:
    return (MULTI30K / "train.en.gz").exists()


needs_multi30k = pytest.mark.skipif(not have_multi30k(), reason=f"Multi30k not found at {MULTI30K}")


@pytest.fixture
def multi30k_small(tmp_path: Path) -> Path:
    """A local {split}.{lang}.gz corpus: the first 2,000 train pairs, 100 val, 100 test of the real Multi30k."""
    if not have_multi30k():
        pytest.skip(f"Multi30k not found at {MULTI30K}")
    out = tmp_path / "corpus"
    out.mkdir()
    for split, n in (("train", 2000), ("val", 100), ("test_2016_flickr", 100)):
        for lang in ("en", "de"):
            with gzip.open(MULTI30K / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                lines = [next(f) for _ in range(n)]
            with gzip.open(out / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.writelines(lines)
    return out


def assert_steps_match_forward(model, src, tgt, reorder=None) -> None:
    """Incremental decoding (``encode`` / ``start`` / ``step`` with the self-attention cache) gives the full
    teacher-forced forward pass's log-probabilities at every target position; with ``reorder`` (a row index), one
    more step after ``state.select(reorder)`` gives the rows ``reorder`` of the same step without it (beam search
    reorders and drops rows). ``src`` ``[B, S]``, ``tgt`` ``[B, T]`` starting with BOS."""
    import torch

    with torch.no_grad():
        full = torch.log_softmax(model(src, tgt).float(), dim=-1)  # [B, T, V]
        state = model.start(*model.encode(src))
        for t in range(tgt.size(1)):
            logp, state = model.step(tgt[:, t], state)
            torch.testing.assert_close(logp, full[:, t], rtol=1e-4, atol=1e-4)
        if reorder is None:
            return
        nxt = torch.randint(4, full.size(-1), (src.size(0),))
        selected = state.select(reorder)  # before the step below: only the newest state may be selected from
        logp_all, _ = model.step(nxt, state)
        logp_sel, _ = model.step(nxt[reorder], selected)
    torch.testing.assert_close(logp_sel, logp_all[reorder], rtol=1e-4, atol=1e-4)


def memorise(src: list[list[int]], tgt: list[list[int]], vocab: int, max_positions: int, steps: int,
             stop_loss: float = 0.0):
    """A tiny Transformer (dropout 0, seed 0) trained by full-batch teacher forcing on the id sequences (EOS added,
    BOS before the target) for ``steps`` Adam updates, or until the loss is below ``stop_loss``; returned in eval
    mode. The decode, export and CTranslate2 tests decode what it memorised."""
    import torch
    import torch.nn.functional as F

    from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID
    from mtpipe.config import ModelConfig
    from mtpipe.model import Transformer

    def pad(seqs: list[list[int]]):
        return torch.nn.utils.rnn.pad_sequence([torch.tensor(x) for x in seqs], batch_first=True)

    torch.manual_seed(0)
    model = Transformer(ModelConfig(preset="tiny", dropout=0.0, max_positions=max_positions), vocab)
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
