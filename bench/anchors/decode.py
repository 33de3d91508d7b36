"""The decoding part: fairseq, mtpipe and CTranslate2 on the same weights, search and batches, each timed after a
warm-up: sentences/s, target tokens/s (pieces without EOS), sacreBLEU (equal outputs prove the same search)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

from bench.anchors.common import DATA, DROPOUTS, PY, Env, bleu, latest_checkpoint, lines_of, read_raw, say, sh

@dataclasses.dataclass
class DecodeModel:
    """One set of weights for every system: an mtpipe checkpoint, its bpe, its CTranslate2 export, fairseq's own."""

    key: str  # "fairseq-model" / "mtpipe-model"
    ckpt: Path
    tokens: Path
    export: Path
    fs_ckpt: Path | None = None


def warmup_count(n: int) -> int:
    """Sentences decoded untimed first (allocator, kernel caches): 48 of 1000, fewer for a smoke run's handful."""
    return min(48, max(4, n // 20), n)


class DecodeSetup:
    """The models and inputs every decoding measurement needs, made once per run."""

    def __init__(self, e: Env, args: argparse.Namespace, m30k: Path | None):
        self.n, self.max_tokens = args.decode_sentences, args.decode_max_tokens
        d = e.work / "decode"
        d.mkdir(parents=True, exist_ok=True)
        self.refs = read_raw(DATA / "test_2016_flickr.de.gz", self.n)
        self.src_raw = d / f"test.{self.n}.en"
        self.src_raw.write_text("".join(s + "\n" for s in read_raw(DATA / "test_2016_flickr.en.gz", self.n)),
                                encoding="utf-8")
        self.fs_ckpt = self.fs_bin = None
        if "fairseq" in args.decode_systems:
            self.fs_ckpt = Path(args.fs_checkpoint) if args.fs_checkpoint else self._fairseq_checkpoint(e, args.smoke)
            self.fs_bin = self._fairseq_subset(e, d)
        if args.checkpoint:
            self.ckpt, self.tokens = Path(args.checkpoint), Path(args.tokens)
        else:  # a short `mtpipe train` run (small dims)
            minutes = args.train_minutes if args.train_minutes is not None else (0.5 if args.smoke else 10.0)
            out = e.work / f"mt-ckpt-{minutes:g}min"
            if latest_checkpoint(out) is None:
                say(f"decode: no --checkpoint: mtpipe train (small) for {minutes:g} min -> {out}")
                p, pa, pr = DROPOUTS[args.dropout]  # the anchors' schedule: warm-up 400, peak lr 1e-3
                sh(e.mtpipe("train", "--tokens", m30k / "bpe", "--batches", m30k / "bucket", "--out", out, "--preset",
                            "small", "--dropout", p, "--attention-dropout", pa, "--relu-dropout", pr, "--max-time",
                            minutes, "--max-steps", 0, "--tokens-per-update", 4096, "--warmup", 400, "--lr-scale",
                            0.32, "--save-every-minutes", 0, "--valid-every-steps", 0, "--threads", e.threads,
                            "--seed", 1),
                   e.logs / "setup_mtpipe_train.log", e.env, m30k)
            self.ckpt, self.tokens = latest_checkpoint(out), m30k / "bpe"
        say(f"decode: mtpipe export of {self.ckpt} (CTranslate2, float32 weights)")
        sh(e.mtpipe("export", "--checkpoint", self.ckpt, "--tokens", self.tokens, "--out", e.work / "export-ct2",
                    "--force"), e.logs / "setup_export.log", e.env)
        ck = json.loads((self.ckpt / "manifest.json").read_text())["extra"]
        self.info = {"sentences": self.n, "max_tokens_per_batch": self.max_tokens, "fairseq_checkpoint":
                     str(self.fs_ckpt), "mtpipe_checkpoint": str(self.ckpt), "mtpipe_step": ck.get("step"),
                     "mtpipe_model": {k: ck["model_config"].get(k) for k in ("d_model", "d_ff", "heads",
                                                                             "encoder_layers", "decoder_layers")}}
        self.models = [self._import_fairseq(e)] if self.fs_ckpt is not None else []
        self.models.append(DecodeModel("mtpipe-model", self.ckpt, self.tokens, e.work / "export-ct2"))

    def _import_fairseq(self, e: Env) -> DecodeModel:
        """fairseq's checkpoint through ``mtpipe import`` and ``mtpipe export`` (each round's rows count the outputs
        equal to fairseq's: the import's end-to-end check)."""
        d = e.work / "import-fs"
        say(f"decode: mtpipe import of {self.fs_ckpt}, then export to CTranslate2")
        sh(e.mtpipe("import", "--checkpoint", self.fs_ckpt, "--dict", e.fs_bin, "--spm-model", e.spm, "--out",
                    d / "ck", "--tokens-out", d / "bpe", "--force"), e.logs / "setup_import.log", e.env)
        sh(e.mtpipe("export", "--checkpoint", d / "ck", "--tokens", d / "bpe", "--out", d / "ct2", "--force"),
           e.logs / "setup_import_export.log", e.env)
        return DecodeModel("fairseq-model", d / "ck", d / "bpe", d / "ct2", self.fs_ckpt)

    def _fairseq_checkpoint(self, e: Env, smoke: bool) -> Path:
        save, updates = (e.work / "fs-ckpt-smoke", 4) if smoke else (e.a / "fs-ckpt", 800)
        if not (save / "checkpoint_last.pt").exists():
            say(f"decode: no fairseq checkpoint in {save}: fs_train.sh {updates} (the anchors' protocol)")
            sh(["bash", e.script("fs_train.sh"), updates, save], e.logs / f"setup_fs_train_{updates}.log", e.env)
        return save / "checkpoint_last.pt"

    def _fairseq_subset(self, e: Env, d: Path) -> Path:
        """fairseq's binarised test set, cut to the first n sentences (its dictionaries kept)."""
        if self.n >= 1000:
            return e.fs_bin
        out = d / f"fs-bin-{self.n}"
        if not (out / "test.en-de.en.idx").exists():
            for lang in ("en", "de"):
                text = (e.a / "data" / "spm" / f"test_2016_flickr.{lang}").read_text(encoding="utf-8").splitlines()
                (d / f"fs-test-{self.n}.{lang}").write_text("\n".join(text[: self.n]) + "\n", encoding="utf-8")
            sh([e.a / "venv-fs38" / "bin" / "fairseq-preprocess", "--source-lang", "en", "--target-lang", "de",
                "--testpref", d / f"fs-test-{self.n}", "--destdir", out, "--srcdict", e.fs_bin / "dict.en.txt",
                "--tgtdict", e.fs_bin / "dict.de.txt", "--workers", 1], e.logs / "setup_fs_bin_subset.log", e.env)
        return out


def fairseq_decode(e: Env, ckpt: Path, log: Path, data: Path, max_tokens: int = 8000, n: int = 1000,
                   alpha: float = 0.6, subset: str = "test") -> dict[str, Any]:
    """fairseq's SequenceGenerator through ``fairseq_decode.py`` (in venv-fs38): its own batches of the same token
    budget, a warm-up, |Y|^alpha, max length source + 50, min length 1 (fairseq-generate's)."""
    js, txt, pcs = log.with_suffix(".json"), log.with_suffix(".txt"), log.with_suffix(".pieces")
    sh([e.fs_py, Path(__file__).with_name("fairseq_decode.py"), "--checkpoint", ckpt, "--data", data, "--subset",
        subset, "--max-tokens", max_tokens, "--beam", 4, "--alpha", alpha, "--warmup", warmup_count(n),
        "--threads", e.threads, "--json", js, "--hyps", txt, "--pieces", pcs], log, e.env)
    return {**json.loads(js.read_text()), "hyps": lines_of(txt), "pieces": lines_of(pcs)}


def mtpipe_decode(e: Env, s: DecodeSetup, dm: DecodeModel, precision: str, log: Path, compile: bool = False,
                  processes: int = 1) -> dict[str, Any]:
    js, txt, pcs = log.with_suffix(".json"), log.with_suffix(".txt"), log.with_suffix(".pieces")
    sh(e.worker(PY, "_mtpipe-decode", "--checkpoint", dm.ckpt, "--spm", dm.tokens / "spm.model", "--src", s.src_raw,
                "--precision", precision, "--threads", e.threads, "--json", js, "--hyps", txt, "--pieces", pcs,
                "--max-tokens", s.max_tokens, "--processes", processes,
                *(["--compile"] if compile else [])), log, e.env)
    return {**json.loads(js.read_text()), "hyps": lines_of(txt), "pieces": lines_of(pcs)}


def worker_mtpipe_decode(argv: list[str]) -> None:
    """One mtpipe measurement: an ``MtpipeEngine`` as ``mtpipe decode`` holds it, or with ``--processes N`` a
    ``DecodePool`` (``decode.processes``, started untimed), after a warm-up."""
    ap = argparse.ArgumentParser()
    for k in ("--checkpoint", "--spm", "--src", "--precision", "--json", "--hyps", "--pieces"):
        ap.add_argument(k, required=True)
    for k in ("--threads", "--max-tokens", "--processes"):
        ap.add_argument(k, type=int, required=True)
    ap.add_argument("--compile", action="store_true", help="decode.compile (built in the warm-up)")
    a = ap.parse_args(argv)
    import sentencepiece as spm
    import torch

    from mtpipe import artifacts
    from mtpipe.config import DecodeConfig
    from mtpipe.engine.translate import MtpipeEngine
    from mtpipe.model.transformer import build_model
    from mtpipe.engine.search import DecodeRules
    from mtpipe.engine.workers import DecodePool

    torch.set_num_threads(a.threads)
    ck = artifacts.load_checkpoint(a.checkpoint)
    model = build_model(ck.model_config, int(ck.vocab["size"]))
    model.load_state_dict(ck.state_dict)
    model.eval()
    sp = spm.SentencePieceProcessor(model_file=a.spm)
    sources = [s[: model.cfg.max_positions - 1] for s in sp.encode(read_raw(Path(a.src)))]
    # min_len 1: fairseq-generate's --min-len and CTranslate2's min_decoding_length default (never an empty output)
    cfg = DecodeConfig(beam=4, alpha=0.6, length_penalty="fairseq", max_len_a=1.0, max_len_b=50, device="cpu",
                       precision=a.precision, stop="finished", max_tokens=a.max_tokens, min_len=1, compile=a.compile,
                       threads=a.threads)
    rules = DecodeRules.from_config(cfg)
    if a.processes > 1:
        pool = engine = DecodePool(dataclasses.replace(cfg, processes=a.processes, threads=max(
            1, a.threads // a.processes)), Path(a.checkpoint), None, a.processes)
    else:  # allocator tuned, the model prepared once (its bf16 / int8 copy, its compiled step)
        pool, engine = None, MtpipeEngine.open(model, cfg)
    run = lambda x: engine.translate(x, rules)  # noqa: E731
    try:
        run(sources[: warmup_count(len(sources))])
        run(sources[:1])  # a lone sentence too (decode.compile: run as two), which the warm-up may not meet
        t0 = time.perf_counter()
        hyps = [r[0].tokens for r in run(sources)]
        secs = time.perf_counter() - t0
    finally:
        if pool is not None:
            pool.close()
    Path(a.hyps).write_text("".join(line + "\n" for line in sp.decode(hyps)), encoding="utf-8")
    Path(a.pieces).write_text("".join(" ".join(sp.id_to_piece(h)) + "\n" for h in hyps), encoding="utf-8")
    Path(a.json).write_text(json.dumps({"seconds": secs, "sentences": len(hyps), "hyp_tokens": sum(map(len, hyps))}))


def ct2_decode(e: Env, s: DecodeSetup, dm: DecodeModel, compute_type: str, log: Path, replicas: int = 1
               ) -> dict[str, Any]:
    js, txt = log.with_suffix(".json"), log.with_suffix(".txt")
    sh(e.worker(e.ct2_py, "_ct2-decode", "--model", dm.export, "--spm", dm.tokens / "spm.model", "--src", s.src_raw,
                "--compute-type", compute_type, "--batch", s.max_tokens, "--threads", e.threads,
                "--replicas", replicas, "--json", js, "--hyps", txt), log, {**e.env, "CT2_VERBOSE": "1"})
    isa = re.search(r"ISA:?\s*([\w-]+)", log.read_text(errors="replace"))  # CTranslate2 logs the ISA it dispatches
    return {**json.loads(js.read_text()), "isa": isa[1] if isa else "?", "hyps": lines_of(txt)}


def worker_ct2_decode(argv: list[str]) -> None:
    """One CTranslate2 measurement (in venv-ct2: ctranslate2 and sentencepiece only): ``translate_batch``, beam 4,
    length_penalty 0.6, ``--batch`` source tokens a batch; its length limit is one per call, the longest source + 50
    (its normal use). ``--replicas``: its inter_threads, --threads split among them."""
    ap = argparse.ArgumentParser()
    for k in ("--model", "--spm", "--src", "--compute-type", "--json", "--hyps"):
        ap.add_argument(k, required=True)
    for k in ("--batch", "--threads", "--replicas"):
        ap.add_argument(k, type=int, required=True)
    a = ap.parse_args(argv)
    import ctranslate2
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=a.spm)
    pieces = sp.encode(read_raw(Path(a.src)), out_type=str)
    tr = ctranslate2.Translator(a.model, device="cpu", compute_type=a.compute_type, inter_threads=a.replicas,
                                intra_threads=max(1, a.threads // a.replicas))

    def run(batch: list[list[str]]) -> list[list[str]]:
        return [r.hypotheses[0] for r in tr.translate_batch(
            batch, beam_size=4, length_penalty=0.6, max_batch_size=a.batch, batch_type="tokens",
            max_decoding_length=max(map(len, batch)) + 50)]

    run(pieces[: warmup_count(len(pieces))])
    t0 = time.perf_counter()
    hyps = run(pieces)
    secs = time.perf_counter() - t0
    Path(a.hyps).write_text("".join(sp.decode_pieces(h) + "\n" for h in hyps), encoding="utf-8")
    Path(a.json).write_text(json.dumps({"seconds": secs, "sentences": len(pieces), "ctranslate2":
                                        ctranslate2.__version__, "hyp_tokens": sum(map(len, hyps))}))


def decode_round(e: Env, s: DecodeSetup, args: argparse.Namespace, r: int) -> dict[str, Any]:
    """One round of the decode part: per model, fairseq, mtpipe's precisions (compiled, N processes) and CTranslate2
    (float32, int8, N replicas)."""
    res = {}
    compiled = [p for p in ("fp32", "bf16") if args.decode_compile and (p == "fp32" or e.probe["native_bf16"])]
    n = args.decode_processes
    for dm in s.models:
        row, tag, fairseq_pieces = {}, f"r{r}_decode_{dm.key}", []

        def add(name: str, run: Any) -> None:
            say(f"round {r}: decode {dm.key}, {s.n} sentences: {name}")
            out = run(e.logs / f"{tag}_{re.sub(r'[^a-z0-9]+', '_', name.lower())}.log")
            hyps, pieces = out.pop("hyps"), out.pop("pieces", None)
            fairseq_pieces.extend(pieces if name == "fairseq fp32" else [])
            row[name] = {**out, "value": out["sentences"] / out["seconds"], "sent_s": out["sentences"] / out[
                "seconds"], "tgt_tok_s": out["hyp_tokens"] / out["seconds"], "bleu": bleu(hyps, s.refs),
                **({"same_as_fairseq": sum(map(str.__eq__, pieces, fairseq_pieces)) / s.n}
                   if pieces and fairseq_pieces and name != "fairseq fp32" else {})}

        if dm.fs_ckpt is not None:
            add("fairseq fp32", lambda log: fairseq_decode(e, dm.fs_ckpt, log, s.fs_bin, s.max_tokens, s.n))
        for p in ("fp32", "bf16", "int8") if e.probe["native_bf16"] else ("fp32", "int8"):  # not emulated bf16
            add(f"mtpipe {p}", lambda log: mtpipe_decode(e, s, dm, p, log))
        for p in compiled:
            add(f"mtpipe {p} compiled", lambda log: mtpipe_decode(e, s, dm, p, log, compile=True))
        for ct in ("float32", "int8"):
            add(f"CTranslate2 {ct}", lambda log: ct2_decode(e, s, dm, ct, log))
        for p, ct in (("fp32", "float32"), ("int8", "int8")) if n > 1 else ():  # side by side, --threads split
            add(f"mtpipe {p}, {n} processes", lambda log: mtpipe_decode(e, s, dm, p, log, processes=n))
            for cp in compiled if p == "fp32" else ():
                add(f"mtpipe {cp} compiled, {n} processes",
                    lambda log: mtpipe_decode(e, s, dm, cp, log, compile=True, processes=n))
            add(f"CTranslate2 {ct}, {n} replicas", lambda log: ct2_decode(e, s, dm, ct, log, n))
        res[f"decode {dm.key}"] = row
    return res
