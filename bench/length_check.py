#!/usr/bin/env python3
"""Outputs too short: the search's fault or the model's? One command, on the valid split.

For every sentence of a split the beam output ``H`` and the reference ``R`` are both scored by the model under the
search's own objective, ``log P(Y + EOS | X) / lp(|Y| + 1)`` (GNMT length penalty, ``--alphas``):

- **search error**: the reference scores higher than the output, so a better search would have found a longer (or
  at least different) translation the model prefers;
- **the model prefers it**: the output is shorter than the reference and scores at least as high: no search can fix
  that; only the model (training) or the objective (alpha) can.

Also printed: the output / reference length ratio in pieces and sacreBLEU with its brevity penalty, per alpha.

    python bench/length_check.py --checkpoint artifacts/average --tokens artifacts/bpe --alphas 0.6,1.0,1.5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=REPO / "artifacts" / "average")
    ap.add_argument("--tokens", type=Path, default=REPO / "artifacts" / "bpe", help="bpe artifact with the split")
    ap.add_argument("--split", default="valid")
    ap.add_argument("--alphas", default="0.6,1.0,1.5")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()

    import pyarrow.parquet as pq
    import sacrebleu
    import torch
    from rich.table import Table

    from mtpipe.artifacts import EOS_ID, PAD_ID
    from mtpipe.config import DecodeConfig
    from mtpipe.console import console
    from mtpipe.decode import translate
    from mtpipe.loading import load_model_and_vocab
    from mtpipe.search import LengthPenalty

    if args.threads:
        torch.set_num_threads(args.threads)
    mv = load_model_and_vocab(args.checkpoint, args.tokens)
    model = mv.model.eval()
    data = pq.read_table(args.tokens / f"{args.split}.parquet").to_pydict()
    srcs, refs = data["src"], data["tgt"]

    def logprobs(pairs: list[tuple[list[int], list[int]]]) -> list[float]:
        """log P(Y + EOS | X) of each (source, target) pair, teacher-forced, in batches of 64."""
        out = []
        for i in range(0, len(pairs), 64):
            chunk = pairs[i: i + 64]
            S, T = max(len(s) for s, _ in chunk) + 1, max(len(t) for _, t in chunk) + 1
            src = torch.full((len(chunk), S), PAD_ID)  # [B, S]
            tin = torch.full((len(chunk), T), PAD_ID)  # [B, T]: start token + Y
            tout = torch.full((len(chunk), T), PAD_ID)  # [B, T]: Y + EOS
            for r, (s, t) in enumerate(chunk):
                src[r, : len(s) + 1] = torch.tensor([*s, EOS_ID])
                tin[r, : len(t) + 1] = torch.tensor([model.start_id, *t])
                tout[r, : len(t) + 1] = torch.tensor([*t, EOS_ID])
            with torch.inference_mode():
                lp = torch.log_softmax(model(src, tin).float(), dim=-1)  # [B, T, V]
            tok = lp.gather(-1, tout.unsqueeze(-1)).squeeze(-1).masked_fill(tout == PAD_ID, 0.0)  # [B, T]
            out += tok.sum(-1).tolist()
        return out

    ref_lp = logprobs(list(zip(srcs, refs)))
    ref_text = [mv.sp.decode(t) for t in refs]
    table = Table(title=f"{args.split}: beam {args.beam} output against the reference, scored by the model")
    for col in ("alpha", "pieces out/ref", "BLEU", "BP", "search errors", "shorter and preferred by the model"):
        table.add_column(col, justify="right")
    for alpha in [float(a) for a in args.alphas.split(",")]:
        hyps = [h[0] for h in translate(model, srcs, DecodeConfig(beam=args.beam, alpha=alpha))]
        pen = LengthPenalty("gnmt", alpha)
        search_err = prefers_short = 0
        for h, r, rlp in zip(hyps, refs, ref_lp):
            ref_score, out_score = pen.score(rlp, len(r) + 1), pen.score(h.logprob, len(h.tokens) + 1)
            if ref_score > out_score + 1e-4:
                search_err += 1
            elif len(h.tokens) < len(r):
                prefers_short += 1
        b = sacrebleu.corpus_bleu([mv.sp.decode(h.tokens) for h in hyps], [ref_text])
        n = len(refs)
        table.add_row(f"{alpha:g}", f"{sum(len(h.tokens) for h in hyps) / sum(len(r) for r in refs):.3f}",
                      f"{b.score:.2f}", f"{b.bp:.3f}", f"{search_err} / {n}", f"{prefers_short} / {n}")
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
