#!/usr/bin/env python3
"""What one beam-search step costs for a server's few sentences against offline decoding's full batches.

A server under N concurrent clients (one sentence per request) never decodes more than N sentences together, while
offline `mtpipe decode` fills 8,000-token batches (~600 Multi30k sentences). Its throughput relative to offline is
then about ``(small batch's sentences per step) / (full batch's) x (full step's time) / (small step's time)``: the
serving target (>= 70 % of offline at 8 clients) needs a few-sentence step that costs a small fraction of a full
one. This bench measures both steps on the same model, sentences and device, in interleaved rounds:

* ``full``: batches of ``--max-tokens`` source tokens (decode.max_tokens, default 8,000), as `mtpipe decode` runs;
* ``small``: batches of ``--small-tokens`` source tokens (default 130: ~8 Multi30k sentences, a server's batch at 8
  clients), the same sentences.

Reported per round: sentences/s, decoder steps, milliseconds per step and, with ``--profile``, a torch.profiler
table of the small batches (CPU and, on a GPU, CUDA time: how much of a step the device is busy). On a GPU this is
where a step's fixed cost shows: measured on an H200, an 8-sentence step took 5.35 ms (its kernels ~0.5 ms; the
rest launching ~200 kernels and the Python around them) against 1.75 ms on a 2-vCPU CPU (BENCHMARKS.md).
``--cuda-graphs both`` (GPU) adds each batching's row with ``decode.cuda_graphs`` (the step replayed from CUDA
graphs) to the same rounds, with the throughput ratio per round and how many translations agree. Each row decodes
through its own engine (:class:`mtpipe.decode.MtpipeEngine`, its model prepared once, as `mtpipe decode` and
`mtpipe serve` hold it).

    python bench/step_cost.py --checkpoint artifacts/average --tokens artifacts/bpe \\
        --sentences /data/multi30k/test_2016_flickr.en.gz
    python bench/step_cost.py ... --device cuda --cuda-graphs both --profile
"""

from __future__ import annotations

import argparse
import copy
import gzip
import statistics
import sys
import time
import unicodedata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mtpipe.console import console, fmt, table  # noqa: E402


def read_lines(path: Path, n: int) -> list[str]:
    """The first ``n`` non-blank lines (``.gz`` read as gzip), NFC-normalised and stripped as `mtpipe decode` does."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = [unicodedata.normalize("NFC", line).strip() for line in f]
    return [line for line in lines if line][:n]


def _tensors(x: object) -> list:
    """Every tensor in nested dicts, lists and tuples (decode.cuda_graphs' buffers)."""
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else []
    return [t for item in items for t in _tensors(item)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="a trained or averaged mtpipe checkpoint")
    ap.add_argument("--tokens", type=Path, required=True, help="its bpe artifact (spm.model)")
    ap.add_argument("--sentences", type=Path, required=True, help="source sentences, one a line (.gz read as gzip)")
    ap.add_argument("--n", type=int, default=1000, help="sentences decoded per round (the first N)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--max-tokens", type=int, default=8000, help="the full batches' source tokens")
    ap.add_argument("--small-tokens", type=int, default=130, help="the small batches' source tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="also profile the small batches (torch.profiler)")
    ap.add_argument("--graph-rows", type=int, default=0,
                    help="decode.cuda_graphs: the most rows a step replays from a graph (0: mtpipe's default)")
    ap.add_argument("--cuda-graphs", choices=["on", "off", "both"], default="on",
                    help="decode.cuda_graphs (GPU only): both = each batching with and without, as rows of the "
                         "same rounds, and how many translations the two give alike")
    args = ap.parse_args()

    import sentencepiece as spm
    import torch

    from mtpipe import artifacts
    from mtpipe.config import DecodeConfig
    from mtpipe import cuda_graphs
    from mtpipe.decode import MtpipeEngine
    from mtpipe.search import DecodeRules
    from mtpipe.model import Transformer, build_model

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ck = artifacts.load_checkpoint(args.checkpoint)
    model = build_model(ck.model_config, ck.vocab["size"])
    model.load_state_dict(ck.state_dict)
    model.eval().to(device)
    sp = spm.SentencePieceProcessor(model_file=str(artifacts.verify_file(args.tokens, "spm.model")))
    sources = [s[: model.cfg.max_positions - 1] for s in sp.encode(read_lines(args.sentences, args.n))]

    steps = [0]
    plain_step = Transformer.step

    def counted(self: Transformer, *a, **k):  # type: ignore[no-untyped-def]
        steps[0] += 1
        return plain_step(self, *a, **k)

    Transformer.step = counted  # type: ignore[method-assign]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    graphs = {"on": [True], "off": [False], "both": [False, True]}[args.cuda_graphs] if device.type == "cuda" \
        else [False]
    if args.graph_rows:
        cuda_graphs.MAX_ROWS = args.graph_rows
    cfgs = {f"{name}{', graphs' if g else ''}": DecodeConfig(
                beam=args.beam, alpha=args.alpha, precision=args.precision, max_tokens=tokens, cuda_graphs=g,
                device="cuda" if device.type == "cuda" else "cpu", threads=args.threads)
            for name, tokens in (("full", args.max_tokens), ("small", args.small_tokens)) for g in graphs}
    # One engine each, as `mtpipe decode` and `mtpipe serve` hold one: its model prepared once (the bf16 copy, the
    # graphs recorded as the buckets are met), each on its own copy of the weights.
    engines = {name: MtpipeEngine.open(copy.deepcopy(model), cfg) for name, cfg in cfgs.items()}
    rules = DecodeRules.from_config(next(iter(cfgs.values())))
    for engine in engines.values():  # warm-up: allocator, kernel caches, lazy initialisation, graphs' buckets
        engine.translate(sources[:64], rules)
        engine.translate(sources[:1], rules)
    sync()
    rows: dict[str, list[tuple[float, int]]] = {name: [] for name in cfgs}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for name in (list(cfgs) if r % 2 == 0 else list(cfgs)[::-1]):  # alternate who goes first
            steps[0] = 0
            t0 = time.perf_counter()
            hyps = engines[name].translate(sources, rules)
            sync()
            rows[name].append((time.perf_counter() - t0, steps[0]))
            outputs[name] = [h[0].tokens for h in hyps]
    for name, engine in engines.items():
        graphed = engine.prepared()._graphed
        if graphed is not None:
            held = sum(t.numel() * t.element_size() for t in _tensors(graphed.buffers))
            console.print(f"{name}: {len(graphed.buckets)} buckets recorded (rows <= {graphed.max_rows}), their "
                          f"buffers {held / 2**20:.1f} MiB")

    def spread(values: list[float]) -> str:
        return " / ".join(fmt(v) for v in (min(values), statistics.median(values), max(values)))

    out = []
    for name, runs in rows.items():
        out.append([f"{name} ({cfgs[name].max_tokens:,} tokens a batch)", spread([len(sources) / s for s, _ in runs]),
                    fmt(statistics.median(n for _, n in runs)), spread([1000 * s / n for s, n in runs])])
    table(f"{len(sources)} sentences, beam {args.beam}, {args.precision} on {device} "
                        f"({torch.get_num_threads()} CPU threads), {args.rounds} interleaved rounds: min / median / max",
                        ["batches", "sentences/s", "steps", "ms per step"], out)
    def rate(name: str) -> float:
        return statistics.median(len(sources) / s for s, _ in rows[name])

    for suffix in (", graphs" if g else "" for g in graphs):
        console.print(f"small / full throughput{suffix}: {rate('small' + suffix) / rate('full' + suffix):.2f}x")
    if len(graphs) == 2:
        for name in ("full", "small"):
            same = sum(a == b for a, b in zip(outputs[name], outputs[f"{name}, graphs"]))
            ratio = [a / b for (a, _), (b, _) in zip(rows[name], rows[f"{name}, graphs"])]  # per round
            console.print(f"{name}: graphs / eager throughput {spread(ratio)}x (min / median / max of rounds); "
                          f"the same translation for {same:,} / {len(sources):,} sentences")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        steps[0] = 0
        profiled = "small, graphs" if True in graphs else "small"
        with profile(activities=acts) as prof:
            engines[profiled].translate(sources[:48], rules)
            sync()
        console.print(f"profiled: 48 sentences, {profiled} batches, {steps[0]} steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=45))


if __name__ == "__main__":
    main()
