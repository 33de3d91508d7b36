"""`mtpipe export`: a small trained model exported to CTranslate2 decodes like mtpipe (same log-probabilities, same
greedy output, mtpipe's scores and length limits at beam 4), quantised and odd-shaped models export, the Hugging Face
Marian export (post-norm) computes the same logits, the Hugging Face Pegasus export of a pre-norm model (the
quickstart's) loads with transformers' Auto classes and generates mtpipe's output, and bad input fails with one line
and writes nothing."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

ctranslate2 = pytest.importorskip("ctranslate2")

from conftest import memorise, train_spm  # noqa: E402
from testkit.decoding import ct2_translate, translate  # noqa: E402

from mtpipe import artifacts, writing  # noqa: E402
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID  # noqa: E402
from mtpipe.cli import app  # noqa: E402
from mtpipe.config import DecodeConfig, ModelConfig, to_dict  # noqa: E402
from mtpipe.engine.ct2 import load_ct2  # noqa: E402
from mtpipe.errors import MtpipeError  # noqa: E402
from mtpipe.engine.ct2_convert import export_ctranslate2  # noqa: E402
from mtpipe.model.transformer import Transformer  # noqa: E402

ALPHA = 0.6

# --------------------------------------------------------------------------------------------------------------------
# A real SentencePiece model and a tiny Transformer trained on 20 of 80 sentence pairs
# --------------------------------------------------------------------------------------------------------------------

SUBJECTS = [("the dog", "der hund"), ("the cat", "die katze"), ("a man", "ein mann"), ("a woman", "eine frau"),
            ("the child", "das kind")]
VERBS = [("sees", "sieht"), ("likes", "mag"), ("eats", "isst"), ("finds", "findet")]
OBJECTS = [("an apple", "einen apfel"), ("a ball", "einen ball"), ("the house", "das haus"), ("a book", "ein buch")]
ODD = ["the the the dog", "zebra", ".", "a", "the dog sees the dog sees the dog sees a book and an apple ."]


def corpus() -> list[tuple[str, str]]:
    return [(f"{s} {v} {o} .", f"{sd} {vd} {od} .") for (s, sd), (v, vd), (o, od)
            in itertools.product(SUBJECTS, VERBS, OBJECTS)]


def make_spm(root: Path, name: str, vocab_size: int):
    return train_spm(root / name, [line for pair in corpus() for line in pair], vocab_size)


def make_tokens(root: Path, name: str, spm_file: Path, sp) -> Path:
    """A minimal bpe artifact: spm.model, its hash and size in the manifest, and a test split."""
    out = root / name
    pairs = corpus()
    with writing.ArtifactWriter(out, "tokens") as w:
        w.write_table("test.parquet", pa.table({"id": list(range(len(pairs))),
                                                "src": [sp.encode(s) for s, _ in pairs],
                                                "tgt": [sp.encode(t) for _, t in pairs]}))
        shutil.copy(spm_file, w.path("spm.model"))
        w.extra.update({"spm_sha256": artifacts.file_hash(w.path("spm.model")), "vocab_size": sp.get_piece_size()})
    return out


def save(model: Transformer, out: Path, spm_file: Path, step: int = 300) -> Path:
    writing.write_checkpoint(out, state_dict=model.state_dict(), meta=artifacts.CheckpointManifest(
        model_config=to_dict(model.cfg), step=step,
        vocab={"spm_sha256": artifacts.file_hash(spm_file), "size": model.vocab_size}))
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is faster, and the test shares 2 cores with others
    root = tmp_path_factory.mktemp("export")
    sp = make_spm(root, "spm", 90)
    tokens = make_tokens(root, "tokens", root / "spm.model", sp)
    pairs = corpus()
    train = pairs[::4]  # 20 pairs; the other 60 are new combinations of the same words
    src = [sp.encode(s) for s, _ in train]
    tgt = [sp.encode(t) for _, t in train]
    model = memorise(src, tgt, sp.get_piece_size(), 64, steps=300)
    ckpt = save(model, root / "ckpt", root / "spm.model")
    ct2_dir = root / "ct2"
    export_ctranslate2(ckpt, tokens, ct2_dir)
    sources = [sp.encode(a) for a, _ in pairs] + [sp.encode(x) for x in ODD]
    yield {"root": root, "sp": sp, "tokens": tokens, "checkpoint": ckpt, "model": model, "ct2_dir": ct2_dir,
           "ct2": load_ct2(ct2_dir, threads=1), "sources": sources, "train_ids": list(range(0, 80, 4))}
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------------------------
# Independent references computed with the mtpipe model
# --------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy(model: Transformer, src: list[int], max_len: int) -> list[int]:
    """Argmax decoding with the model's incremental API (its float32 eager step, prepared as mtpipe decodes); PAD and
    BOS are never chosen; at most max_len tokens."""
    from mtpipe.engine.variants import prepare

    model = prepare(model, "fp32", torch.device("cpu"))
    memory, mask = model.encode(torch.tensor([src + [EOS_ID]]))
    state = model.start(memory, mask)
    token, out = BOS_ID, []
    while len(out) < max_len:
        logp, state = model.step(torch.tensor([token]), state)
        logp[0, [PAD_ID, BOS_ID]] = float("-inf")
        token = int(logp[0].argmax())
        if token == EOS_ID:
            break
        out.append(token)
    return out


@torch.no_grad()
def logp_of(model: Transformer, src: list[int], hyp: list[int], renormalised: bool = False) -> float:
    """log P(hyp + EOS | src) by teacher forcing. ``renormalised``: PAD and BOS masked before the log-softmax (how
    CTranslate2 computes the log-probabilities of a search that suppresses them)."""
    logits = model(torch.tensor([src + [EOS_ID]]), torch.tensor([[BOS_ID] + hyp]))[0]  # [T, V]
    if renormalised:
        logits[:, [PAD_ID, BOS_ID]] = float("-inf")
    logp = F.log_softmax(logits.float(), dim=-1)
    return sum(float(logp[t, y]) for t, y in enumerate(hyp + [EOS_ID]))


def lp(kind: str, n: int) -> float:
    return ((5 + n) / 6) ** ALPHA if kind == "gnmt" else n**ALPHA


def limit(src: list[int], a: float, b: int, max_positions: int = 64) -> int:
    return max(0, min(math.floor(a * len(src) + b), max_positions - 1))


def expected_score(model: Transformer, src: list[int], hyp: list[int], kind: str, max_len: int) -> float:
    """The score :func:`mtpipe.engine.ct2.translate_under_rules` promises: mtpipe's formula; a hypothesis that
    ended with its own EOS carries CTranslate2's renormalised log-probabilities, one cut at the limit is re-scored
    exactly (forced EOS)."""
    cut = len(hyp) == max_len
    return logp_of(model, src, hyp, renormalised=not cut) / lp(kind, len(hyp) + 1)


# --------------------------------------------------------------------------------------------------------------------
# The exported directory
# --------------------------------------------------------------------------------------------------------------------


def test_export_is_a_ctranslate2_model_with_the_spm_model_and_lineage(world):
    d = world["ct2_dir"]
    m = artifacts.read_manifest(d, "export")
    for name in ("model.bin", "config.json", "shared_vocabulary.json", "spm.model"):
        assert (d / name).is_file() and name in m.files
    assert (d / "spm.model").read_bytes() == (world["tokens"] / "spm.model").read_bytes()
    assert m.upstream["checkpoint"] == artifacts.manifest_hash(world["checkpoint"])
    assert m.upstream["tokens"] == artifacts.manifest_hash(world["tokens"])
    assert m.extra["format"] == "ctranslate2" and m.extra["quantization"] == "none"
    assert m.extra["checkpoint_step"] == 300 and m.extra["max_positions"] == 64
    sp = world["sp"]
    vocab = json.loads((d / "shared_vocabulary.json").read_text(encoding="utf-8"))
    assert vocab == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    assert vocab[:4] == ["<pad>", "<unk>", "<s>", "</s>"]
    config = json.loads((d / "config.json").read_text(encoding="utf-8"))
    assert config["decoder_start_token"] == "<s>" and config["eos_token"] == "</s>"
    assert config["add_source_eos"] is True and config["add_source_bos"] is False
    assert config["layer_norm_epsilon"] == pytest.approx(1e-5)


def test_ctranslate2_log_probabilities_equal_mtpipe_teacher_forcing(world):
    """The whole mapping at once: every target token's log-probability under CTranslate2 is the model's."""
    sp, model = world["sp"], world["model"]
    pairs = corpus()
    src = [sp.encode(s, out_type=str) for s, _ in pairs]
    tgt = [sp.encode(t, out_type=str) for _, t in pairs]
    scored = world["ct2"].translator.score_batch(src, tgt)
    worst = 0.0
    for (s, t), r in zip(pairs, scored):
        si, ti = sp.encode(s), sp.encode(t)
        with torch.no_grad():
            logp = F.log_softmax(model(torch.tensor([si + [EOS_ID]]), torch.tensor([[BOS_ID] + ti]))[0], -1)
        ref = [float(logp[j, y]) for j, y in enumerate(ti + [EOS_ID])]
        assert len(r.log_probs) == len(ref)
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, r.log_probs)))
    assert worst < 1e-4


@pytest.mark.parametrize("kind", ["gnmt", "fairseq"])
def test_greedy_output_equals_mtpipe_greedy(world, kind):
    model, sources = world["model"], world["sources"]
    got = ct2_translate(world["ct2"], sources, beam=1, alpha=ALPHA, length_penalty=kind, max_len_a=1.0, max_len_b=5)
    for src, hyps in zip(sources, got):
        max_len = limit(src, 1.0, 5)
        ref = greedy(model, src, max_len)
        assert hyps[0].ids == ref
        assert hyps[0].pieces == [world["sp"].id_to_piece(t) for t in ref]
        assert hyps[0].score == pytest.approx(expected_score(model, src, ref, kind, max_len), abs=1e-4)
    # the test means something: new combinations are translated, some sources hit the length limit
    assert len({tuple(h[0].ids) for h in got}) > 10
    assert any(len(h[0].ids) == limit(s, 1.0, 5) for s, h in zip(sources, got))


@pytest.mark.parametrize("kind", ["gnmt", "fairseq"])
def test_beam_hypotheses_carry_mtpipe_scores_best_first(world, kind):
    model, sources = world["model"], world["sources"]
    got = ct2_translate(world["ct2"], sources, beam=4, nbest=4, alpha=ALPHA, length_penalty=kind, max_len_a=1.0,
                        max_len_b=5)
    for src, hyps in zip(sources, got):
        assert 1 <= len(hyps) <= 4
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert len({tuple(h.ids) for h in hyps}) == len(hyps)
        for h in hyps:
            assert len(h.ids) <= limit(src, 1.0, 5)
            assert h.score == pytest.approx(expected_score(model, src, h.ids, kind, limit(src, 1.0, 5)), abs=1e-4)


@pytest.mark.parametrize("kind", ["gnmt", "fairseq"])
def test_beam_4_with_patience_2_equals_mtpipe_decode(world, kind):
    """With patience 2 CTranslate2 waits for 8 finished hypotheses and finds mtpipe's best on every in-domain
    source (patience 1, fairseq's stopping rule, returns worse ones on this memorising model: see
    :func:`mtpipe.engine.ct2.translate_under_rules`)."""
    model, sources = world["model"], world["sources"][:80]
    cfg = DecodeConfig(beam=4, alpha=ALPHA, length_penalty=kind, max_len_a=1.0, max_len_b=5)
    ref = translate(model, sources, cfg)
    got = ct2_translate(world["ct2"], sources, beam=4, patience=2, alpha=ALPHA, length_penalty=kind,
                        max_len_a=1.0, max_len_b=5)
    for src, r, g in zip(sources, ref, got):
        assert g[0].ids == r[0].tokens
        # the same score up to CTranslate2's PAD/BOS renormalisation (~1e-5 per token here)
        assert g[0].score == pytest.approx(expected_score(model, src, g[0].ids, kind, limit(src, 1.0, 5)), abs=1e-4)
        assert g[0].score == pytest.approx(r[0].score, abs=1e-3)


def test_max_length_is_a_times_source_plus_b_per_sentence(world):
    model, sources = world["model"], world["sources"]
    cfg = DecodeConfig(beam=1, alpha=ALPHA, length_penalty="gnmt", max_len_a=0.5, max_len_b=1)
    ref = translate(model, sources, cfg)  # mtpipe forces EOS after floor(0.5 S + 1) tokens
    got = ct2_translate(world["ct2"], sources, beam=1, alpha=ALPHA, max_len_a=0.5, max_len_b=1)
    cut = 0
    for src, r, g in zip(sources, ref, got):
        assert len(g[0].ids) <= limit(src, 0.5, 1)
        assert g[0].ids == r[0].tokens
        if len(g[0].ids) == limit(src, 0.5, 1):
            cut += 1
            assert g[0].score == pytest.approx(r[0].score, abs=1e-4)  # re-scored with mtpipe's forced EOS
    assert cut > len(sources) // 2
    # limit 0: nothing may precede EOS, scored log P(EOS | X) / lp(1)
    empty = ct2_translate(world["ct2"], sources[:5], beam=4, alpha=ALPHA, max_len_a=0.0, max_len_b=0)
    for src, hyps in zip(sources[:5], empty):
        assert [h.ids for h in hyps] == [[]]
        assert hyps[0].score == pytest.approx(logp_of(model, src, []) / lp("gnmt", 1), abs=1e-5)


def test_sources_as_ids_or_pieces_in_any_order(world):
    sp, sources = world["sp"], world["sources"]
    order = list(range(len(sources)))
    random.Random(1).shuffle(order)
    by_ids = ct2_translate(world["ct2"], sources, beam=4, max_len_b=5)
    by_pieces = ct2_translate(world["ct2_dir"], [[sp.id_to_piece(t) for t in sources[i]] for i in order], beam=4,
                              max_len_b=5, threads=1)
    assert [by_ids[i] for i in order] == by_pieces


# --------------------------------------------------------------------------------------------------------------------
# Other shapes and weight types
# --------------------------------------------------------------------------------------------------------------------


def test_int8_export_is_smaller_and_translates_the_memorised_pairs(world, tmp_path):
    d = tmp_path / "int8"
    extra = export_ctranslate2(world["checkpoint"], world["tokens"], d, "int8")
    assert extra["quantization"] == "int8"
    assert (d / "model.bin").stat().st_size < 0.6 * (world["ct2_dir"] / "model.bin").stat().st_size
    train = [world["sources"][i] for i in world["train_ids"]]
    fp32 = ct2_translate(world["ct2"], train, beam=1, max_len_b=5)
    int8 = ct2_translate(load_ct2(d, threads=1), train, beam=1, max_len_b=5)
    assert [h[0].ids for h in int8] == [h[0].ids for h in fp32]


def test_head_size_other_than_d_model_over_heads_exports_exactly(world, tmp_path):
    sp = world["sp"]
    torch.manual_seed(3)
    model = Transformer(ModelConfig(preset="tiny", d_k=16, d_v=16, dropout=0.0, max_positions=64),
                        sp.get_piece_size()).eval()
    ckpt = save(model, tmp_path / "ckpt", world["root"] / "spm.model")
    export_ctranslate2(ckpt, world["tokens"], tmp_path / "ct2")
    m = load_ct2(tmp_path / "ct2", threads=1)
    pairs = corpus()[:10]
    scored = m.translator.score_batch([sp.encode(s, out_type=str) for s, _ in pairs],
                                      [sp.encode(t, out_type=str) for _, t in pairs])
    for (s, t), r in zip(pairs, scored):
        assert sum(r.log_probs) == pytest.approx(logp_of(model, sp.encode(s), sp.encode(t)), abs=1e-4)


UNTIED = {
    "none_bias_eos_per_stack": dict(share_embeddings="none", output_bias=True, decoder_start="eos",
                                    positions="learned-per-stack"),
    "decoder": dict(share_embeddings="decoder"),
}


def untied_model(world, seed: int, **variant) -> Transformer:
    """A random tiny model (d_model 32) with ``variant``; its bias (if any) random, with -1e9 on PAD, BOS and a few
    pieces the corpus never uses (so neither decoder can choose them and CTranslate2's PAD/BOS renormalisation is
    exact)."""
    sp = world["sp"]
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(preset="tiny", d_model=32, d_ff=64, heads=4, dropout=0.0, max_positions=64,
                                    **variant), sp.get_piece_size()).eval()
    with torch.no_grad():
        model.output_embedding().mul_(4.0)  # peaked distributions: no near-ties in greedy search
        if model.out_bias is not None:
            used = {i for s, t in corpus() for i in sp.encode(s) + sp.encode(t)}
            unused = [i for i in range(4, sp.get_piece_size()) if i not in used][:3]
            assert len(unused) == 3
            model.out_bias.normal_()
            model.out_bias[[PAD_ID, BOS_ID, *unused]] = -1e9
    return model


@pytest.mark.parametrize("case", list(UNTIED))
def test_untied_embeddings_output_bias_eos_start_and_per_stack_positions_export_exactly(world, tmp_path, case):
    from mtpipe.engine.ct2_convert import build_ct2_spec, load_source

    sp, variant = world["sp"], UNTIED[case]
    model = untied_model(world, 7, **variant)
    ckpt = save(model, tmp_path / "ckpt", world["root"] / "spm.model")
    export_ctranslate2(ckpt, world["tokens"], tmp_path / "ct2")
    config = json.loads((tmp_path / "ct2" / "config.json").read_text(encoding="utf-8"))
    assert config["decoder_start_token"] == ("</s>" if model.start_id == EOS_ID else "<s>")
    if case == "decoder":  # the target embedding and the projection are stored once
        spec = build_ct2_spec(load_source(ckpt, world["tokens"]))
        spec.optimize()
        assert spec.decoder.projection.weight == "decoder/embeddings/weight"
        assert not isinstance(spec.encoder.embeddings[0].weight, str)
    m = load_ct2(tmp_path / "ct2", threads=1)
    pairs = corpus()[:10]
    scored = m.translator.score_batch([sp.encode(s, out_type=str) for s, _ in pairs],
                                      [sp.encode(t, out_type=str) for _, t in pairs])
    worst = 0.0
    for (s, t), r in zip(pairs, scored):
        si, ti = sp.encode(s), sp.encode(t)
        with torch.no_grad():  # the decoder's first input is the model's start token
            logp = F.log_softmax(model(torch.tensor([si + [EOS_ID]]), torch.tensor([[model.start_id] + ti]))[0], -1)
        ref = [float(logp[j, y]) for j, y in enumerate(ti + [EOS_ID])]
        assert len(r.log_probs) == len(ref)
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, r.log_probs)))
    assert worst < 1e-4
    sources = world["sources"][:6] + world["sources"][-3:]
    ref = translate(model, sources, DecodeConfig(beam=1, alpha=ALPHA, max_len_a=1.0, max_len_b=5))
    got = ct2_translate(m, sources, beam=1, alpha=ALPHA, max_len_a=1.0, max_len_b=5)
    for r, g in zip(ref, got):
        assert g[0].ids == r[0].tokens
        if model.out_bias is not None:  # P(PAD) = P(BOS) = 0: the scores are the same too
            assert g[0].score == pytest.approx(r[0].score, abs=1e-4)
    assert len({tuple(h[0].ids) for h in got}) > 1


def test_unequal_d_k_and_d_v_fail_clearly(world, tmp_path):
    model = Transformer(ModelConfig(preset="tiny", d_k=16, d_v=32), world["sp"].get_piece_size())
    ckpt = save(model, tmp_path / "ckpt", world["root"] / "spm.model")
    with pytest.raises(MtpipeError, match="d_k=16 != d_v=32"):
        export_ctranslate2(ckpt, world["tokens"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------------------------
# CLI and bad input
# --------------------------------------------------------------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(app, ["export", "--params", os.devnull, *args])


def test_cli_exports_and_replaces_the_output_atomically(world, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    args = ["--checkpoint", str(world["checkpoint"]), "--tokens", str(world["tokens"]), "--out", str(out)]
    # A folder mtpipe did not write is never replaced without --force.
    r = invoke(*args)
    assert r.exit_code == 1 and f"--out {out}: exists and is not an mtpipe artifact" in r.output
    assert (out / "stale.txt").read_text() == "old"
    r = invoke(*args, "--force")
    assert r.exit_code == 0, r.output
    assert not (out / "stale.txt").exists()
    # An export is replaced by the next export without --force.
    r = invoke(*args, "--quantization", "int8_float32")
    assert r.exit_code == 0, r.output
    m = artifacts.read_manifest(out, "export")
    assert m.extra["quantization"] == "int8_float32" and m.params["export"]["format"] == "ctranslate2"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary directory left behind


@pytest.fixture(scope="module")
def other_tokens(world):
    """A bpe artifact with another SentencePiece model (the checkpoint was not trained with it)."""
    root = world["root"]
    sp = make_spm(root, "other", 70)
    return make_tokens(root, "other_tokens", root / "other.model", sp)


@pytest.mark.parametrize("case", ["not_a_checkpoint", "missing", "other_spm", "bad_quantization", "bad_format",
                                  "marian_quantized", "huggingface_quantized"])
def test_cli_bad_input_fails_with_one_line_and_writes_nothing(world, other_tokens, tmp_path, case):
    ck, tok = str(world["checkpoint"]), str(world["tokens"])
    args, want = {
        "not_a_checkpoint": (["--checkpoint", tok, "--tokens", tok], "is a 'tokens' artifact, expected 'checkpoint'"),
        "missing": (["--checkpoint", str(tmp_path / "nope"), "--tokens", tok], "artifact not found"),
        "other_spm": (["--checkpoint", ck, "--tokens", str(other_tokens)], "another SentencePiece model"),
        "bad_quantization": (["--checkpoint", ck, "--tokens", tok, "--quantization", "int3"],
                             "--quantization: export.quantization = 'int3' is not one of none, int8"),
        "bad_format": (["--checkpoint", ck, "--tokens", tok, "--format", "onnx"],
                       "--format: export.format = 'onnx' is not one of ctranslate2, marian, pegasus, huggingface"),
        "marian_quantized": (["--checkpoint", ck, "--tokens", tok, "--format", "marian", "--quantization", "int8"],
                             "applies to CTranslate2 only"),
        "huggingface_quantized": (["--checkpoint", ck, "--tokens", tok, "--format", "huggingface", "--quantization",
                                   "int8"], "applies to CTranslate2 only; use 'none' with format huggingface"),
    }[case]
    out = tmp_path / "out"
    r = invoke(*args, "--out", str(out))
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], r.output
    assert not out.exists()


def test_missing_ctranslate2_names_the_extra(world, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # makes `import ctranslate2` raise ImportError
    with pytest.raises(MtpipeError, match=r"pip install 'mtpipe\[ctranslate2\]'"):
        export_ctranslate2(world["checkpoint"], world["tokens"], tmp_path / "out")
    with pytest.raises(MtpipeError, match=r"pip install 'mtpipe\[ctranslate2\]'"):
        load_ct2(world["ct2_dir"])
    assert not (tmp_path / "out").exists()


def test_ct2_translate_rejects_bad_settings(world, tmp_path):
    for kwargs, want in [({"beam": 0}, "decode.beam"), ({"nbest": 5}, "decode.nbest"),
                         ({"length_penalty": "wu"}, "unknown penalty"), ({"max_len_a": -1.0}, "must be >= 0"),
                         ({"patience": 0.5}, "patience")]:
        with pytest.raises(MtpipeError, match=want):
            ct2_translate(world["ct2"], [[4, 5]], **kwargs)
    with pytest.raises(MtpipeError, match="token id out of the vocabulary"):
        ct2_translate(world["ct2"], [[4, 10_000]])
    with pytest.raises(MtpipeError, match="is a 'checkpoint' artifact"):
        load_ct2(world["checkpoint"])


# --------------------------------------------------------------------------------------------------------------------
# Hugging Face Marian
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
def test_marian_export_computes_mtpipe_logits_and_greedy_output(world, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "marian"
    r = invoke("--checkpoint", str(world["checkpoint"]), "--tokens", str(world["tokens"]), "--out", str(out),
               "--format", "marian")
    assert r.exit_code == 0, r.output
    assert artifacts.read_manifest(out, "export").extra["format"] == "marian"
    hf = transformers.MarianMTModel.from_pretrained(str(out)).eval()
    tok = transformers.MarianTokenizer.from_pretrained(str(out))
    sp, model = world["sp"], world["model"]
    for s, t in corpus()[:6]:
        src = sp.encode(s)
        assert tok([s]).input_ids[0] == src + [EOS_ID]  # MarianTokenizer = our SentencePiece model + EOS
        x, y = torch.tensor([src + [EOS_ID]]), torch.tensor([[BOS_ID] + sp.encode(t)])
        with torch.no_grad():
            assert torch.allclose(hf(input_ids=x, decoder_input_ids=y).logits, model(x, y), atol=1e-4)
            gen = hf.generate(x, num_beams=1, do_sample=False, max_new_tokens=limit(src, 1.0, 5) + 1)[0].tolist()
        assert gen[0] == BOS_ID  # decoder_start_token_id is our BOS
        assert [t for t in gen[1:] if t != EOS_ID] == greedy(model, src, limit(src, 1.0, 5))


def test_marian_refuses_shapes_it_cannot_hold(world, tmp_path):
    pytest.importorskip("transformers")
    from mtpipe.stages.export import export_huggingface

    model = Transformer(ModelConfig(preset="tiny", d_k=16, d_v=16), world["sp"].get_piece_size())
    ckpt = save(model, tmp_path / "ckpt", world["root"] / "spm.model")
    with pytest.raises(MtpipeError, match="does not map exactly onto Hugging Face Marian: d_k=16"):
        export_huggingface(ckpt, world["tokens"], tmp_path / "out", "marian")
    assert not (tmp_path / "out").exists()
    per_stack = save(untied_model(world, 1, positions="learned-per-stack"), tmp_path / "per_stack",
                     world["root"] / "spm.model")
    with pytest.raises(MtpipeError, match="Marian: model.positions=learned-per-stack: MarianMTModel rebuilds"):
        export_huggingface(per_stack, world["tokens"], tmp_path / "out", "marian")
    assert not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
@pytest.mark.parametrize("case", list(UNTIED))
def test_marian_export_of_untied_biased_eos_start_models(world, tmp_path, case):
    """Marian holds untied source/target/output matrices, ``final_logits_bias`` and the decoder start token (not
    learned positions: the sinusoids here)."""
    transformers = pytest.importorskip("transformers")
    from mtpipe.stages.export import export_huggingface

    sp = world["sp"]
    model = untied_model(world, 8, **{**UNTIED[case], "positions": "sinusoidal"})
    ckpt = save(model, tmp_path / "ckpt", world["root"] / "spm.model")
    export_huggingface(ckpt, world["tokens"], tmp_path / "marian", "marian")
    hf = transformers.MarianMTModel.from_pretrained(str(tmp_path / "marian")).eval()
    for s, t in corpus()[:4]:
        src = sp.encode(s)
        x, y = torch.tensor([src + [EOS_ID]]), torch.tensor([[model.start_id] + sp.encode(t)])
        with torch.no_grad():
            assert torch.allclose(hf(input_ids=x, decoder_input_ids=y).logits, model(x, y), atol=1e-4)
            gen = hf.generate(x, num_beams=1, do_sample=False, max_new_tokens=limit(src, 1.0, 5) + 1)[0].tolist()
        assert gen[0] == model.start_id
        ref = translate(model, [src], DecodeConfig(beam=1, max_len_a=1.0, max_len_b=5))[0][0].tokens
        assert [t for t in gen[1:] if t != EOS_ID] == ref


# --------------------------------------------------------------------------------------------------------------------
# Hugging Face Pegasus: the pre-norm model (the quickstart's model.norm_position=pre)
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pegasus(world):
    """The pre-norm model trained on the same 20 pairs, exported by the CLI with ``--format huggingface`` and loaded
    back with transformers' Auto classes (fresh objects, from the directory alone)."""
    transformers = pytest.importorskip("transformers")
    sp, root = world["sp"], world["root"]
    train = corpus()[::4]
    model = memorise([sp.encode(s) for s, _ in train], [sp.encode(t) for _, t in train], sp.get_piece_size(), 64,
                     steps=300, norm_position="pre")
    ckpt = save(model, root / "pre_ckpt", root / "spm.model")
    out = root / "pegasus"
    r = invoke("--checkpoint", str(ckpt), "--tokens", str(world["tokens"]), "--out", str(out), "--format",
               "huggingface")
    assert r.exit_code == 0, r.output
    assert "PegasusForConditionalGeneration" in r.output and "MarianTokenizer" in r.output
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Recommended. pip install sacremoses")
        tok = transformers.AutoTokenizer.from_pretrained(str(out))
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(out)).eval()
    return {"model": model, "checkpoint": ckpt, "out": out, "hf": hf, "tok": tok}


def test_pegasus_export_holds_the_pre_norm_model_and_its_tokenizer(world, pegasus):
    from safetensors.torch import load_file

    out, hf, tok, model, sp = pegasus["out"], pegasus["hf"], pegasus["tok"], pegasus["model"], world["sp"]
    m = artifacts.read_manifest(out, "export")
    assert m.params["export"]["format"] == "huggingface"
    assert m.extra["format"] == "pegasus" and m.extra["model_class"] == "PegasusForConditionalGeneration"
    assert m.upstream["checkpoint"] == artifacts.manifest_hash(pegasus["checkpoint"])
    for name in ("config.json", "generation_config.json", "model.safetensors", "spm.model", "source.spm",
                 "target.spm", "vocab.json", "tokenizer_config.json"):
        assert (out / name).is_file() and name in m.files
    assert type(hf).__name__ == "PegasusForConditionalGeneration" and type(tok).__name__ == "MarianTokenizer"
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "pegasus" and config["activation_function"] == "relu"
    assert config["scale_embedding"] is True and config["tie_word_embeddings"] is True
    gen = hf.generation_config
    assert (gen.decoder_start_token_id, gen.forced_eos_token_id, gen.eos_token_id, gen.pad_token_id) == (
        BOS_ID, EOS_ID, EOS_ID, PAD_ID)
    assert gen.bad_words_ids == [[PAD_ID], [BOS_ID]]
    # The position tables are saved with the weights and loaded as saved: mtpipe's sinusoids (sines first).
    saved = load_file(str(out / "model.safetensors"))
    for stack in ("encoder", "decoder"):
        assert torch.equal(saved[f"model.{stack}.embed_positions.weight"], model.positions)
        assert torch.equal(getattr(hf.model, stack).embed_positions.weight, model.positions)
    # three-way tying survives the round trip
    assert hf.lm_head.weight.data_ptr() == hf.model.encoder.embed_tokens.weight.data_ptr()
    for s, t in corpus()[:6]:
        src = sp.encode(s)
        assert tok([s]).input_ids[0] == src + [EOS_ID]  # MarianTokenizer = our SentencePiece model + EOS
        x, y = torch.tensor([src + [EOS_ID]]), torch.tensor([[BOS_ID] + sp.encode(t)])
        with torch.no_grad():
            assert torch.allclose(hf(input_ids=x, decoder_input_ids=y).logits, model(x, y), atol=1e-4)


def hf_generate(hf, tok, sentences: list[str], max_new_tokens: int, **kwargs) -> list[list[int]]:
    """``generate`` over a padded batch (the tokenizer's attention mask), as a transformers user would call it; the
    output ids after the decoder start token, up to EOS."""
    batch = tok(sentences, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = hf.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens, **kwargs)
    hyps = []
    for row in out.tolist():
        assert row[0] == BOS_ID  # the decoder starts from <s>
        ids = row[1:]
        hyps.append(ids[:ids.index(EOS_ID)] if EOS_ID in ids else ids)
    return hyps


def test_pegasus_greedy_generate_equals_mtpipe_decode(world, pegasus):
    """Greedy search (num_beams=1) in transformers gives mtpipe's output on every source: in-domain, new
    combinations and odd ones that run to the length limit (19 tokens, then EOS)."""
    sp, model = world["sp"], pegasus["model"]
    sentences = [s for s, _ in corpus()] + ODD
    sources = [sp.encode(x) for x in sentences]
    ref = translate(model, sources, DecodeConfig(beam=1, max_len_a=0.0, max_len_b=19))
    got = hf_generate(pegasus["hf"], pegasus["tok"], sentences, 20, num_beams=1)
    assert got == [r[0].tokens for r in ref]
    assert got == [greedy(model, src, 19) for src in sources]
    assert len({tuple(g) for g in got}) > 10 and any(len(g) == 19 for g in got)


def test_pegasus_beam_4_generate_equals_mtpipe_decode_with_fairseq_rules(world, pegasus):
    """transformers' beam search is fairseq's: with ``length_penalty=alpha`` (|Y|^alpha, EOS counted) and
    ``early_stopping=True`` (stop once 4 hypotheses have finished) it is mtpipe's ``decode.stop=finished``,
    ``length_penalty=fairseq``. The sources are the 80 in-domain ones: a hypothesis cut at the length limit is
    scored differently (transformers counts the forced EOS as log-probability 0, mtpipe re-scores it)."""
    sp, model = world["sp"], pegasus["model"]
    sentences = [s for s, _ in corpus()]
    sources = [sp.encode(x) for x in sentences]
    cfg = DecodeConfig(beam=4, alpha=ALPHA, length_penalty="fairseq", stop="finished", max_len_a=0.0, max_len_b=19)
    ref = translate(model, sources, cfg)
    got = hf_generate(pegasus["hf"], pegasus["tok"], sentences, 20, num_beams=4, length_penalty=ALPHA,
                      early_stopping=True)
    assert got == [r[0].tokens for r in ref]
    assert all(len(g) < 19 for g in got)  # every output ended with its own EOS


PEGASUS_VARIANTS = {
    "none_bias_eos_per_stack": UNTIED["none_bias_eos_per_stack"],  # learned-per-stack positions: two saved tables
    "decoder": UNTIED["decoder"],
    "learned": dict(positions="learned", output_bias=True),
}


@pytest.mark.parametrize("case", list(PEGASUS_VARIANTS))
def test_pegasus_export_of_untied_biased_eos_start_learned_position_models(world, tmp_path, case):
    """Pegasus holds untied source/target/output matrices (transformers 5: tie_word_embeddings=false unties all
    three), ``final_logits_bias``, the decoder start token and learned position tables (saved and loaded as
    saved)."""
    transformers = pytest.importorskip("transformers")
    from mtpipe.stages.export import export_huggingface

    sp = world["sp"]
    model = untied_model(world, 9, norm_position="pre", **PEGASUS_VARIANTS[case])
    ckpt = save(model, tmp_path / "ckpt", world["root"] / "spm.model")
    extra = export_huggingface(ckpt, world["tokens"], tmp_path / "pegasus", "pegasus")
    assert extra["format"] == "pegasus"
    hf = transformers.PegasusForConditionalGeneration.from_pretrained(str(tmp_path / "pegasus")).eval()
    if case != "learned":
        assert hf.model.encoder.embed_tokens.weight.data_ptr() != hf.model.decoder.embed_tokens.weight.data_ptr()
    for s, t in corpus()[:4]:
        src = sp.encode(s)
        x, y = torch.tensor([src + [EOS_ID]]), torch.tensor([[model.start_id] + sp.encode(t)])
        with torch.no_grad():
            assert torch.allclose(hf(input_ids=x, decoder_input_ids=y).logits, model(x, y), atol=1e-4)
    sources = world["sources"][:6] + world["sources"][-3:]
    ref = translate(model, sources, DecodeConfig(beam=1, max_len_a=0.0, max_len_b=12))
    for src, r in zip(sources, ref):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([src + [EOS_ID]]), num_beams=1, do_sample=False, max_new_tokens=13)
        gen = gen[0].tolist()
        assert gen[0] == model.start_id
        assert [t for t in gen[1:] if t != EOS_ID] == r[0].tokens


def test_hugging_face_refusals_name_what_does_not_map_and_the_format_that_works(world, tmp_path):
    pytest.importorskip("transformers")
    from mtpipe.stages.export import export_huggingface

    root, vocab = world["root"], world["sp"].get_piece_size()
    pre = save(Transformer(ModelConfig(preset="tiny", norm_position="pre"), vocab), tmp_path / "pre",
               root / "spm.model")
    cases = [
        ("marian", pre, "Hugging Face Marian: model.norm_position=pre: MarianMTModel is post-norm only; "
                        "export.format=pegasus (or huggingface)"),
        ("pegasus", world["checkpoint"], "Hugging Face Pegasus: model.norm_position=post: "
                                         "PegasusForConditionalGeneration is pre-norm only; export.format=marian"),
    ]
    heads = Transformer(ModelConfig(preset="tiny", norm_position="pre", d_k=16, d_v=16), vocab)
    cases.append(("pegasus", save(heads, tmp_path / "heads", root / "spm.model"),
                  "Hugging Face Pegasus: d_k=16, d_v=16 with heads=2: Pegasus's attention fixes the head size"))
    fixnorm = Transformer(ModelConfig(preset="tiny", norm_position="pre", fixnorm=True), vocab)
    cases.append(("huggingface", save(fixnorm, tmp_path / "fixnorm", root / "spm.model"),
                  "Hugging Face Pegasus: model.fixnorm=true"))
    for arch, ckpt, want in cases:
        with pytest.raises(MtpipeError, match=re.escape(want)):
            export_huggingface(ckpt, world["tokens"], tmp_path / "out", arch)
        assert not (tmp_path / "out").exists()
    r = invoke("--checkpoint", str(pre), "--tokens", str(world["tokens"]), "--out", str(tmp_path / "out"),
               "--format", "marian")
    assert r.exit_code == 1 and "export.format=pegasus" in r.output and not (tmp_path / "out").exists()
