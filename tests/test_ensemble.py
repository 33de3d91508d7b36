"""Ensembles (decode.ensemble, `mtpipe decode --checkpoint A --checkpoint B`): the step averages the models'
probabilities (against an independent full-forward reference), a model with itself decodes exactly what it decodes
alone (every precision, greedy and beam, engine and command), one vocabulary required, and the combinations an
ensemble does not take refused in one line."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F
from conftest import synthetic_pairs, train_spm
from typer.testing import CliRunner

from mtpipe import artifacts, writing
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID
from mtpipe.cli import app
from mtpipe.config import DecodeConfig, ModelConfig, to_dict
from mtpipe.engine.ensemble import EnsembleEngine, average_log_probs
from mtpipe.engine.search import DecodeRules
from mtpipe.engine.translate import MtpipeEngine
from mtpipe.errors import MtpipeError
from mtpipe.model.transformer import Transformer

VOCAB = 40


def tiny(seed: int, **cfg) -> Transformer:
    """A random tiny model; distinct seeds give models whose greedy outputs differ."""
    torch.manual_seed(seed)
    return Transformer(ModelConfig(preset="tiny", dropout=0.0, max_positions=64, **cfg), VOCAB).eval()


def sources(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(1, 12, (n,), generator=g)]


def outputs(results) -> list[list[tuple[list[int], float]]]:
    return [[(h.tokens, h.score) for h in r] for r in results]


def test_average_log_probs_is_the_log_of_the_mean_probability():
    torch.manual_seed(0)
    logits = [torch.randn(5, 9) * 3 for _ in range(3)]
    logits[1][0, 2] = float("-inf")  # one model rules a token out: the others still give it probability
    for x in logits:
        x[1, 4] = float("-inf")  # every model rules it out
    members = [F.log_softmax(x, dim=-1) for x in logits]
    got = average_log_probs(members)
    fairseq = torch.logsumexp(torch.stack(members), dim=0) - math.log(3)  # fairseq's EnsembleModel
    torch.testing.assert_close(got, fairseq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.exp().sum(-1), torch.ones(5))  # still a distribution
    assert math.isfinite(got[0, 2]) and got[1, 4] == float("-inf")
    assert torch.equal(average_log_probs([members[0], members[0]]), members[0])  # exactly, not up to rounding


def reference_greedy(models: list[Transformer], src: list[int], max_len: int) -> list[int]:
    """Greedy search on the models' mean probability, independent of the engine: every model's full forward pass
    over the whole prefix at each step, no cache."""
    s = torch.tensor([src + [EOS_ID]])
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_len:
            tgt = torch.tensor([[BOS_ID] + out])
            probs = sum(F.softmax(m(s, tgt)[0, -1].float(), dim=-1) for m in models) / len(models)
            probs[[PAD_ID, BOS_ID]] = 0
            tok = int(probs.argmax())
            if tok == EOS_ID:
                break
            out.append(tok)
    return out


def test_the_ensemble_step_searches_the_models_mean_probability():
    models = [tiny(1), tiny(2, norm_position="pre")]  # shapes may differ: each keeps its own state
    srcs = sources(10, seed=4)
    cfg = DecodeConfig(beam=1, max_len_a=0, max_len_b=10, device="cpu", threads=1)
    got = EnsembleEngine.open_models(models, cfg).translate(srcs, DecodeRules.from_config(cfg))
    want = [reference_greedy(models, s, 10) for s in srcs]
    assert [r[0].tokens for r in got] == want
    alone = [MtpipeEngine.open(m, cfg).translate(srcs, DecodeRules.from_config(cfg)) for m in models]
    assert all(outputs(got) != outputs(a) for a in alone)  # the ensemble is neither model


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("beam", [1, 4])
def test_an_ensemble_of_a_model_with_itself_decodes_what_the_model_decodes(precision, beam):
    model, srcs = tiny(3), sources(12, seed=5)
    cfg = DecodeConfig(beam=beam, nbest=min(beam, 2), max_len_b=12, precision=precision, device="cpu", max_tokens=40,
                       threads=1)
    rules = DecodeRules.from_config(cfg)
    alone = MtpipeEngine.open(model, cfg).translate(srcs, rules)
    assert outputs(EnsembleEngine.open_models([model, model, model], cfg).translate(srcs, rules)) == outputs(alone)


def test_an_ensemble_refuses_what_it_does_not_take():
    for extra in ({"compile": "jit"}, {"prune": "encoder:0"}, {"engine": "ctranslate2"}):
        with pytest.raises(MtpipeError, match=r"^decode\.ensemble: .*not with decode\."):
            DecodeConfig(ensemble=["b"], **extra)
    with pytest.raises(MtpipeError, match="not a list of checkpoint paths"):
        DecodeConfig(ensemble=[3])
    with pytest.raises(MtpipeError, match="continuous"):
        EnsembleEngine.open_models([tiny(1), tiny(1)], DecodeConfig(device="cpu")).lane(continuous=True)


# --------------------------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------------------------


def write_tokens(root: Path, name: str, vocab_size: int) -> tuple[Path, object]:
    pairs = synthetic_pairs(150, seed=3)
    sp = train_spm(root / name, [line for pair in pairs for line in pair], vocab_size=vocab_size)
    src = [sp.encode(s) for s, _ in pairs[:12]]
    tokens = root / f"tokens-{name}"
    with writing.ArtifactWriter(tokens, "tokens") as w:
        w.write_table("test.parquet", pa.table({"id": list(range(len(src))), "src": src, "tgt": src}))
        shutil.copy(root / f"{name}.model", w.path("spm.model"))
        w.extra.update({"spm_sha256": artifacts.file_hash(w.path("spm.model")), "vocab_size": sp.get_piece_size()})
    return tokens, sp


def write_model(out: Path, spm: Path, vocab: int, seed: int) -> Path:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(preset="tiny", dropout=0.0, max_positions=64), vocab)
    writing.write_checkpoint(out, state_dict=model.state_dict(), meta=artifacts.CheckpointManifest(
        model_config=to_dict(model.cfg), step=seed, vocab={"spm_sha256": artifacts.file_hash(spm), "size": vocab}),
        spm=spm)
    return out


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ensemble")
    tokens, sp = write_tokens(root, "spm", 120)
    vocab = sp.get_piece_size()
    other_tokens, other_sp = write_tokens(root, "other", 100)
    (root / "params.yaml").write_text("", encoding="utf-8")
    return {"root": root, "tokens": tokens,
            "a": write_model(root / "a", root / "spm.model", vocab, 1),
            "b": write_model(root / "b", root / "spm.model", vocab, 2),
            "other": write_model(root / "other-ck", root / "other.model", other_sp.get_piece_size(), 3)}


def cli(project, *args: str):
    return CliRunner().invoke(app, [*args, "--params", str(project["root"] / "params.yaml")])


def decode(project, out: str, *checkpoints: Path, extra: tuple[str, ...] = ()):
    flags = [x for c in checkpoints for x in ("--checkpoint", str(c))]
    return cli(project, "decode", *flags, "--tokens", str(project["tokens"]), "--out", str(project["root"] / out),
               "--threads", "1", "--max-len-b", "8", "--no-stats", *extra)


def rows(project, out: str) -> list[dict]:
    return artifacts.read_table(project["root"] / out, "test.parquet", "hypotheses").to_pylist()


def test_cli_an_ensemble_of_a_checkpoint_with_itself_decodes_what_it_decodes(project):
    a = project["a"]
    assert decode(project, "alone", a).exit_code == 0
    r = decode(project, "self", a, a)
    assert r.exit_code == 0, r.output
    assert rows(project, "self") == rows(project, "alone")


def test_cli_ensemble_of_two_checkpoints_and_its_record(project):
    r = decode(project, "two", project["a"], project["b"])
    assert r.exit_code == 0, r.output
    m = artifacts.read_manifest(project["root"] / "two", "hypotheses")
    assert m.extra["decode"]["ensemble"] == [str(project["b"])]
    assert set(m.upstream) == {"checkpoint", "checkpoint_2", "tokens"}  # each model's hash in the lineage
    assert decode(project, "a-only", project["a"]).exit_code == 0
    assert rows(project, "two") != rows(project, "a-only")
    # the params key does what the repeated flag does (dvc.yaml passes paths; params.yaml may name the others)
    params = project["root"] / "ens.yaml"
    params.write_text(f"decode:\n  ensemble: [{project['b']}]\n", encoding="utf-8")
    r2 = CliRunner().invoke(app, ["decode", "--checkpoint", str(project["a"]), "--tokens", str(project["tokens"]),
                                  "--out", str(project["root"] / "two-params"), "--threads", "1", "--max-len-b", "8",
                                  "--no-stats", "--params", str(params)])
    assert r2.exit_code == 0, r2.output
    assert rows(project, "two-params") == rows(project, "two")


def test_cli_ensemble_refusals_are_one_line(project):
    text = project["root"] / "text.en"
    text.write_text("Kalo mi.\n", encoding="utf-8")
    r = cli(project, "decode", "--checkpoint", str(project["a"]), "--checkpoint", str(project["other"]), "--input",
            str(text), "--out", str(project["root"] / "mixed"))  # each with its own SentencePiece model
    assert r.exit_code == 1 and r.output.count("\n") == 1
    assert f"error: {project['other']}: trained with another vocabulary than {project['a']}" in r.output
    assert not (project["root"] / "mixed").exists()
    r = decode(project, "mixed", project["a"], project["other"])  # with --tokens: that one's
    assert r.exit_code == 1 and f"error: {project['other']}: trained with another SentencePiece model" in r.output
    r = decode(project, "compiled", project["a"], project["b"], extra=("--compile",))
    assert r.exit_code == 1 and "error: decode.ensemble:" in r.output and r.output.count("\n") == 1
    r = cli(project, "serve", "--checkpoint", str(project["a"]), "--checkpoint", str(project["b"]))
    assert r.exit_code == 1 and "serves one model" in r.output and r.output.count("\n") == 1
    r = cli(project, "serve", "--checkpoint", str(project["a"]), "--ensemble", f"[{project['b']}]")
    assert r.exit_code == 1 and "error: decode.ensemble: mtpipe serve serves one model" in r.output
    r = cli(project, "serve", "--checkpoint", str(project["a"]), "--shard", "0/2")  # a part of a file: decode's
    assert r.exit_code == 1 and "error: decode.shard = '0/2': mtpipe serve translates requests" in r.output
