"""The training part: source+target tokens/s of fairseq-train and of mtpipe's update, as fairseq measures ``wps``
(tokens over the wall time of each interval of updates, data loading included), the first interval skipped, the
median reported; fairseq's target tokens converted with the corpus's (source + target) / target ratio."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

from bench.anchors.common import DIMS, DROPOUTS, PY, Env, median, say, sh

FS_INTERVAL = re.compile(r"epoch (\d+):\s+(\d+) / (\d+) .*?wps=([\d.]+),.*?num_updates=(\d+)")


def fairseq_dims(dims: str, dropout: str) -> list[Any]:
    d, (p, pa, pr) = DIMS[dims], DROPOUTS[dropout]
    return [x for side in ("encoder", "decoder") for x in (
        f"--{side}-layers", d["layers"], f"--{side}-embed-dim", d["d_model"], f"--{side}-ffn-embed-dim", d["d_ff"],
        f"--{side}-attention-heads", d["heads"])] + ["--dropout", p, "--attention-dropout", pa,
                                                    "--activation-dropout", pr]


def corpus_ratio(e: Env) -> float:
    """(src + tgt) / tgt non-pad tokens of the spm train files, each sentence with its EOS."""
    def tokens(lang: str) -> int:
        with open(e.a / "data" / "spm" / f"train.{lang}", encoding="utf-8") as f:
            return sum(len(line.split()) + 1 for line in f)

    return (tokens("en") + tokens("de")) / tokens("de")


def fairseq_model_check(log: str, dims: str, dropout: str) -> dict[str, Any]:
    """The model fairseq built, read back from its log (fairseq's argparse keeps a flag's last value: this checks
    that the dims passed after fs_train.sh's own won)."""
    d, (_, pa, pr) = DIMS[dims], DROPOUTS[dropout]
    fc1 = re.findall(r"\(fc1\): Linear\(in_features=(\d+), out_features=(\d+)", log)
    emb = re.search(r"\(embed_tokens\): Embedding\((\d+), (\d+)", log)
    cfg = {k: (re.search(rf"['\"]?\b{k}['\"]?\s*[=:]\s*([\w.]+)", log) or [None, None])[1]
           for k in ("encoder_attention_heads", "attention_dropout", "activation_dropout")}
    found = {"d_model": int(emb[2]) if emb else None, "ffn_layers": len(fc1), "d_ff": sorted({int(o) for _, o in fc1}),
             **cfg}
    ok = (found["d_model"] == d["d_model"] and found["ffn_layers"] == 2 * d["layers"] and found["d_ff"] == [d["d_ff"]]
          and cfg["encoder_attention_heads"] == str(d["heads"]) and float(cfg["attention_dropout"] or -1) == pa
          and float(cfg["activation_dropout"] or -1) == pr)
    return {"ok": ok, **found}


def fairseq_train(e: Env, dims: str, updates: int, interval: int, dropout: str, log: Path,
                  ratio: float) -> dict[str, Any]:
    shutil.rmtree(e.work / "fs-tmp", ignore_errors=True)
    wall = sh(["bash", e.script("fs_train.sh"), updates, e.work / "fs-tmp", "--no-save", "--log-interval", interval,
               "--num-workers", 0, *fairseq_dims(dims, dropout)], log, e.env)
    text = log.read_text(encoding="utf-8", errors="replace")
    # the first interval (warm-up) and ones that span an epoch's end left out
    rates = [float(m[4]) for m in FS_INTERVAL.finditer(text) if int(m[5]) > interval and int(m[2]) >= interval]
    if not rates:
        raise SystemExit(f"{log}: no fairseq train intervals after the first (updates {updates}, interval {interval})")
    check = fairseq_model_check(text, dims, dropout)
    if not check["ok"]:
        say(f"WARNING: fairseq did not build the {dims} model asked for: {check} (log {log})")
    return {"value": median(rates) * ratio, "tgt_tok_s": median(rates), "intervals_tgt_tok_s": rates,
            "process_wall_s": wall, "model_check": check}


def mtpipe_train(e: Env, m30k: Path, dims: str, precision: str, updates: int, interval: int, dropout: str,
                 log: Path) -> dict[str, Any]:
    js = log.with_suffix(".json")
    sh(e.worker(PY, "_mtpipe-train", "--tokens", m30k / "bpe", "--batches", m30k / "bucket", "--dims", dims,
                "--precision", precision, "--updates", updates, "--interval", interval, "--dropout", dropout,
                "--threads", e.threads, "--json", js), log, e.env)
    res = json.loads(js.read_text())
    timed = res["intervals"][1:]  # the first interval is warm-up, as for fairseq
    return {"value": median([(x["src"] + x["tgt"]) / x["seconds"] for x in timed]),
            "tgt_tok_s": median([x["tgt"] / x["seconds"] for x in timed]), "params": res["params"]}


def worker_mtpipe_train(argv: list[str]) -> None:
    """One mtpipe measurement: ``make_train_step`` on ``mtpipe bucket``'s batches in ``mtpipe train``'s order, per
    ``--interval`` updates: seconds (collation included) and real tokens."""
    ap = argparse.ArgumentParser()
    for k in ("--tokens", "--batches", "--dims", "--precision", "--dropout", "--json"):
        ap.add_argument(k, required=True)
    for k in ("--updates", "--interval", "--threads"):
        ap.add_argument(k, type=int, required=True)
    a = ap.parse_args(argv)
    import torch

    from mtpipe import artifacts

    from mtpipe.engine import runtime
    from mtpipe.training import batches as mbatches
    from mtpipe.config import ModelConfig, TrainConfig
    from mtpipe.model.transformer import Transformer

    from bench.train_step import make_train_step

    torch.set_num_threads(a.threads)
    runtime.tune_cpu_allocator()  # as `mtpipe train` on CPU
    split = mbatches.load_split(Path(a.tokens), "train")
    table = mbatches.load_batches(Path(a.batches), "train", split)
    vocab = int(artifacts.read_manifest(a.tokens, "tokens").extra["vocab_size"])
    p, pa, pr = DROPOUTS[a.dropout]
    torch.manual_seed(1)
    model = Transformer(ModelConfig(preset=a.dims, dropout=p, attention_dropout=pa, relu_dropout=pr), vocab).train()
    step = make_train_step(model, TrainConfig(precision=a.precision, threads=a.threads, warmup=4000,
                                              label_smoothing=0.1, tokens_per_update=4096))
    order = mbatches.epoch_order(len(table), 1, 0)
    intervals, src_n, tgt_n = [], 0, 0
    t0 = time.perf_counter()
    for k in range(1, a.updates + 1):
        b = int(order[(k - 1) % len(order)])
        step(*mbatches.collate(split, table.batch(b)))
        src_n, tgt_n = src_n + int(table.src_tokens[b]), tgt_n + int(table.tgt_tokens[b])
        if k % a.interval == 0:
            now = time.perf_counter()
            intervals.append({"update": k, "seconds": now - t0, "src": src_n, "tgt": tgt_n})
            print(f"update {k}: {(src_n + tgt_n) / (now - t0):,.0f} src+tgt tok/s", flush=True)
            t0, src_n, tgt_n = now, 0, 0
    Path(a.json).write_text(json.dumps({"intervals": intervals, "params": sum(p.numel() for p in model.parameters()),
                                        "vocab": vocab}))


def train_round(e: Env, args: argparse.Namespace, m30k: Path, r: int, ratio: float) -> dict[str, Any]:
    """One round of the train part: every --train-dims, fairseq fp32 and mtpipe fp32 / bf16."""
    steps = {k: int(v) for k, v in (kv.split("=") for kv in args.train_updates.split(","))}
    res = {}
    for dims in args.train_dims.split(","):
        n, iv = steps[dims], max(1, steps[dims] // args.train_intervals)
        tag = e.logs / f"r{r}_train_{dims}"
        say(f"round {r}: train {dims}: fairseq fp32, {n} updates")
        row = {"fairseq fp32": fairseq_train(e, dims, n, iv, args.dropout, Path(f"{tag}_fairseq.log"), ratio)}
        for p in ("fp32", "bf16") if e.probe["native_bf16"] else ("fp32",):  # emulated bf16 is no mode
            say(f"round {r}: train {dims}: mtpipe {p}, {n} updates")
            row[f"mtpipe {p}"] = mtpipe_train(e, m30k, dims, p, n, iv, args.dropout, Path(f"{tag}_mtpipe_{p}.log"))
        res[f"train {dims}"] = row
    return res
