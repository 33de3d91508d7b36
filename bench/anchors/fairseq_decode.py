#!/usr/bin/env python3
"""fairseq 0.12.2 decoding for the anchors' decode and quality parts, timed as they time mtpipe and CTranslate2 (a
script for the anchors' venv-fs38, Python 3.8 + torch 1.13.1: imports nothing of bench).

fairseq-generate's loop through its Python API, so that fairseq too gets a warm-up: the model and the data set loaded
as fairseq-generate loads them, fairseq's batches (``--max-tokens``, sorted by length), its ``SequenceGenerator``
(|Y|^alpha with EOS counted, stop once ``beam`` finished, at most ``max_len_a * src_len + max_len_b`` with the
source's EOS in src_len). The first ``--warmup`` sentences untimed; the timer covers generation only. fairseq
0.12.2's fused encoder path crashes under torch 1.13: encoder layers are marked ``ever_training`` (its own switch).
"""

import argparse
import json
import time

from fairseq.modules import transformer_layer as tl

_init = tl.TransformerEncoderLayerBase.__init__


def _init_no_fused(self, *a, **k):
    _init(self, *a, **k)
    self.ever_training = True


tl.TransformerEncoderLayerBase.__init__ = _init_no_fused


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--subset", default="test")
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--max-len-a", type=float, default=1.0)
    ap.add_argument("--max-len-b", type=int, default=49)  # + the source's EOS in src_len = mtpipe's source + 50
    ap.add_argument("--min-len", type=int, default=1)  # fairseq-generate's: never EOS at the first step
    ap.add_argument("--warmup", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", required=True)
    ap.add_argument("--hyps", required=True)
    ap.add_argument("--pieces", required=True)
    a = ap.parse_args()
    import torch
    from fairseq import checkpoint_utils, utils
    from fairseq.sequence_generator import SequenceGenerator

    torch.set_num_threads(a.threads)
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([a.checkpoint],
                                                                       arg_overrides={"data": a.data})
    model = models[0].eval()
    task.load_dataset(a.subset)
    ds = task.dataset(a.subset)
    tgt = task.target_dictionary
    gen = SequenceGenerator([model], tgt, beam_size=a.beam, len_penalty=a.alpha, max_len_a=a.max_len_a,
                            max_len_b=a.max_len_b, min_len=a.min_len)
    itr = task.get_batch_iterator(
        dataset=ds, max_tokens=a.max_tokens,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=False, required_batch_size_multiple=1, num_workers=0,
    ).next_epoch_itr(shuffle=False)
    batches = list(itr)
    with torch.no_grad():
        warm = ds.collater([ds[i] for i in range(min(a.warmup, len(ds)))])
        task.inference_step(gen, [model], warm)
        out = {}
        t0 = time.perf_counter()
        for sample in batches:
            hypos = task.inference_step(gen, [model], sample)
            for sid, h in zip(sample["id"].tolist(), hypos):
                out[sid] = h[0]["tokens"]
        secs = time.perf_counter() - t0
    n = len(ds)
    pieces = [tgt.string(out[i][:-1] if len(out[i]) and out[i][-1] == tgt.eos() else out[i]) for i in range(n)]
    detok = [p.replace(" ", "").replace("\u2581", " ").strip() for p in pieces]
    with open(a.hyps, "w", encoding="utf-8") as f:
        f.write("".join(t + "\n" for t in detok))
    with open(a.pieces, "w", encoding="utf-8") as f:
        f.write("".join(p + "\n" for p in pieces))
    with open(a.json, "w") as f:
        json.dump({"seconds": secs, "sentences": n, "hyp_tokens": sum(len(p.split()) for p in pieces),
                   "batches": len(batches), "torch": torch.__version__}, f)


if __name__ == "__main__":
    main()
