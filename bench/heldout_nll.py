#!/usr/bin/env python3
"""Teacher-forced NLL of trained checkpoints on the same sentences: how well each model fits, without a search.

BLEU mixes the model with the search, the length penalty and checkpoint selection. When two training runs differ in
BLEU, this says whether the models themselves differ: the mean negative log-likelihood (nats per target piece, EOS
included, no label smoothing, eval mode: no dropout) of the reference translations of valid, test_2016_flickr and a
fixed sample of the training pairs, each checkpoint encoding the text with its own SentencePiece model (so an
``mtpipe import``-ed fairseq checkpoint is measured on exactly the same pieces as the mtpipe run it is compared
with, when both use the same SentencePiece model). Lower is better; the train column against valid shows fitting
against generalising.

Target pieces that a model cannot produce at all (an imported fairseq model gives the pieces its dictionary lacks a
-inf-like score through its output bias) are left out of that model's mean and counted in the table.

    python bench/heldout_nll.py RUN_A/checkpoints/step_00002280 IMPORTED_FAIRSEQ_CKPT --threads 2

Data: ``--data`` or ``$MTPIPE_MULTI30K`` ({train,val,test_2016_flickr}.{en,de}.gz). Not a speed benchmark.
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
from pathlib import Path

CANNOT = 50.0  # nats: a target piece scored beyond this is one the model cannot produce (see the docstring)


def read(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def split_pairs(data: Path, split: str, sample: int) -> tuple[list[str], list[str]]:
    """The ``split``'s English and German lines; ``sample`` > 0: that many pairs drawn with a fixed seed."""
    en, de = read(data / f"{split}.en.gz"), read(data / f"{split}.de.gz")
    if sample:
        idx = random.Random(0).sample(range(len(en)), min(sample, len(en)))
        en, de = [en[i] for i in idx], [de[i] for i in idx]
    return en, de


def mean_nll(mv, en: list[str], de: list[str], batch: int) -> tuple[float, int]:
    """Mean NLL per target piece over the pairs, and how many pieces were left out (scored beyond ``CANNOT``)."""
    import torch

    from mtpipe.artifacts import EOS_ID, PAD_ID

    def pad(rows: list[list[int]]) -> torch.Tensor:
        width = max(map(len, rows))
        return torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows])  # [B, L]

    model, src, tgt = mv.model.eval(), mv.sp.encode(en), mv.sp.encode(de)
    order = sorted(range(len(src)), key=lambda i: len(src[i]))  # similar lengths together: little padding
    total, count, left_out = 0.0, 0, 0
    with torch.inference_mode():
        for lo in range(0, len(order), batch):
            rows = order[lo : lo + batch]
            s = pad([src[i] + [EOS_ID] for i in rows])  # [B, S]
            t_in = pad([[model.start_id] + tgt[i] for i in rows])  # [B, T]
            t_out = pad([tgt[i] + [EOS_ID] for i in rows])  # [B, T]
            lprobs = torch.log_softmax(model(s, t_in).float(), dim=-1)  # [B, T, V]
            nll = -lprobs.gather(-1, t_out.unsqueeze(-1)).squeeze(-1)  # [B, T, 1] -> [B, T]
            real = t_out != PAD_ID
            kept = real & (nll < CANNOT)
            total += float(nll[kept].sum())
            count += int(kept.sum())
            left_out += int((real & ~kept).sum())
    return total / max(count, 1), left_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", type=Path, help="mtpipe checkpoint directories (trained, averaged or "
                    "imported)")
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("MTPIPE_MULTI30K", "data/multi30k")))
    ap.add_argument("--train-sample", type=int, default=2000, help="training pairs drawn (fixed seed); 0 = none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=100, help="sentences per forward pass")
    args = ap.parse_args()
    if not (args.data / "val.en.gz").exists():
        raise SystemExit(f"{args.data}: no val.en.gz (set --data or $MTPIPE_MULTI30K to a Multi30k copy)")

    import torch
    from rich.console import Console
    from rich.table import Table

    from mtpipe.loading import load_model_and_vocab

    torch.set_num_threads(args.threads)
    splits = {"valid": ("val", 0), "test_2016_flickr": ("test_2016_flickr", 0)}
    if args.train_sample:
        splits[f"train ({args.train_sample:,} pairs)"] = ("train", args.train_sample)
    pairs = {name: split_pairs(args.data, split, n) for name, (split, n) in splits.items()}
    table = Table(title="teacher-forced NLL, nats per target piece (eval mode, no smoothing; lower is better)")
    table.add_column("checkpoint", overflow="fold")
    for name in pairs:
        table.add_column(name, justify="right", no_wrap=True)
    for ck in args.checkpoints:
        mv = load_model_and_vocab(ck)
        cells = []
        for en, de in pairs.values():
            nll, left_out = mean_nll(mv, en, de, args.batch)
            cells.append(f"{nll:.4f}" + (f" ({left_out} left out)" if left_out else ""))
        table.add_row(str(ck), *cells)
    Console(width=max(Console().width, 150)).print(table)  # whole checkpoint paths, one line each


if __name__ == "__main__":
    main()
