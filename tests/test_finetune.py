"""Fine-tuning (``train.finetune_from``) and encoding with a checkpoint's vocabulary (``bpe.from_model``).

A fine-tune starts from its parent's weights (a training checkpoint, an average, an imported fairseq model) with a
fresh optimizer, schedule and step counter; it trains the parent's model and vocabulary or is refused in one line;
it records its parent in every manifest, and an average carries that on; a killed fine-tune resumes exactly, without
its parent. The domain-adaptation recipe of docs/training.md runs as written.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import write_corpus
from typer.testing import CliRunner

from mtpipe import artifacts
from mtpipe.cli import app
from mtpipe.config import AverageConfig, BpeConfig, ModelConfig, TrainConfig, to_dict
from mtpipe.errors import MtpipeError
from testkit.runs import REPO, TINY, assert_same_run, make_artifacts, tsv, write_params


def tcfg(**kw) -> TrainConfig:
    """fp32 on 1 thread (bitwise comparisons), checkpoints by steps."""
    base = dict(max_steps=4, warmup=10, lr_scale=2.0, precision="fp32", threads=1, save_every_minutes=0.0,
                save_every_steps=2, keep_last=20, valid_every_steps=0, log_every_steps=1, tokens_per_update=96)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_artifacts(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def parent(data: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run of 4 updates (checkpoints at 2 and 4): the parent of the fine-tunes below."""
    from mtpipe.training.train import train_model

    out = tmp_path_factory.mktemp("parent") / "run"
    train_model(ModelConfig(**TINY), tcfg(), *data, out)
    return out


def starting_trainer(parent_ck: Path, tokens: Path, batches: Path, out: Path, **train):
    """The trainer of a fine-tune of ``parent_ck`` (every model key at its default) before its first update."""
    from mtpipe.training.trainer import Trainer

    return Trainer(ModelConfig(), tcfg(finetune_from=str(parent_ck), **train), tokens, batches, out)


def assert_starts_from(trainer, parent_ck: Path) -> None:
    """Before the first update: the parent's model config and weights, exactly; Adam without any state; step 0."""
    ck = artifacts.load_checkpoint(parent_ck)
    assert trainer.model_config == ck.model_config
    own = trainer.model.state_dict()
    assert own.keys() == ck.state_dict.keys()
    assert all(torch.equal(own[k], ck.state_dict[k]) for k in own)
    assert not trainer.updater.optimizer.state and trainer.state.step == 0 and trainer.state.epoch == 0


# --------------------------------------------------------------------------------------------------------------------
# From a training checkpoint
# --------------------------------------------------------------------------------------------------------------------


def test_finetune_starts_from_the_parents_weights_with_a_fresh_optimizer_and_schedule(
        data: tuple[Path, Path], parent: Path, tmp_path: Path) -> None:
    """Every model key left at its default (ModelConfig()): the parent's tiny model is trained, from its weights (a
    run from scratch starts elsewhere); after 3 updates Adam has taken 3 steps (the parent's 4 not continued), the
    rate of update 1 is the warm-up's first, and every checkpoint and train.json name the parent."""
    from mtpipe.training.update import learning_rate

    ck_dir = artifacts.checkpoint_path(parent, 4)
    trainer = starting_trainer(ck_dir, *data, tmp_path / "ft", max_steps=3, save_every_steps=3)
    assert_starts_from(trainer, ck_dir)
    from mtpipe.training.trainer import Trainer

    scratch = Trainer(ModelConfig(**TINY), tcfg(), *data, tmp_path / "scratch").model.state_dict()
    assert any(not torch.equal(scratch[k], v) for k, v in trainer.model.state_dict().items())

    summary = trainer.run()
    lineage = {"path": str(ck_dir), "sha256": artifacts.manifest_hash(ck_dir), "step": 4}
    assert summary["steps"] == 3 and summary["finetuned_from"] == lineage
    d_model = trainer.model_config["d_model"]
    assert [(s, float(v)) for s, v in tsv(tmp_path / "ft", "train/lr")] == [
        (s, pytest.approx(learning_rate(s, d_model, 10, 2.0), rel=1e-9)) for s in (1, 2, 3)]
    ft_ck = artifacts.load_checkpoint(artifacts.checkpoint_path(tmp_path / "ft", 3), trainer_state=True)
    parent_ts = artifacts.load_checkpoint(ck_dir, trainer_state=True).trainer_state
    steps = {float(s["step"]) for s in ft_ck.trainer_state["optimizer"]["state"].values()}
    assert steps == {3.0} and {float(s["step"]) for s in parent_ts["optimizer"]["state"].values()} == {4.0}
    assert ft_ck.step == 3 and ft_ck.manifest.extra["finetuned_from"] == lineage
    assert ft_ck.manifest.params["train"]["finetune_from"] == str(ck_dir)


def test_model_keys_that_differ_from_the_parents_are_refused_in_one_line(data: tuple[Path, Path], parent: Path,
                                                                        tmp_path: Path) -> None:
    """From the command line: the params' model section (the parent's, TINY) agrees, so a fine-tune runs; a flag that
    changes a key is refused in one line naming the key and the parent's value, before anything is written."""
    ck_dir = artifacts.checkpoint_path(parent, 4)
    params = write_params(tmp_path / "params.yaml", TINY, {k: v for k, v in to_dict(tcfg()).items() if v is not None})
    tokens, batches = data

    def train(out: Path, *flags: str):
        return CliRunner().invoke(app, ["train", "--params", str(params), "--tokens", str(tokens), "--batches",
                                        str(batches), "--out", str(out), "--finetune-from", str(ck_dir), *flags])

    r = train(tmp_path / "bad", "--d-ff", "96", "--heads", "4")
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 1 and len(lines) == 1, r.output
    assert "model.d_ff=96 where the parent checkpoint has 64" in lines[0]
    assert "model.heads=4 where the parent checkpoint has 2" in lines[0] and str(ck_dir) in lines[0]
    assert not (tmp_path / "bad" / "checkpoints").exists()

    r = train(tmp_path / "ok", "--max-steps", "2")
    assert r.exit_code == 0, r.output
    m = artifacts.read_manifest(artifacts.checkpoint_path(tmp_path / "ok", 2), "checkpoint")
    assert m.extra["finetuned_from"]["path"] == str(ck_dir)

    r = train(parent, "--max-steps", "2")  # the run folder holding the parent: its pruning could delete it
    assert r.exit_code == 1 and "contains" in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_tokens_of_another_vocabulary_are_refused(parent: Path, tmp_path: Path) -> None:
    from mtpipe.training.train import train_model

    tokens, batches = make_artifacts(tmp_path / "other", spm="sha256:" + "cd" * 32)
    with pytest.raises(MtpipeError) as e:
        train_model(ModelConfig(), tcfg(finetune_from=str(artifacts.checkpoint_path(parent, 4))), tokens, batches,
                    tmp_path / "out")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(tokens / "spm.model")) and "--from-model" in msg
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_killed_finetune_resumes_exactly_without_its_parent(data: tuple[Path, Path], parent: Path,
                                                             tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A fine-tune killed after its checkpoint at 3 (its checkpoint at 6 never written), its parent moved away since:
    the same command resumes from 3 (not from the parent: resume comes first) and ends bitwise as the uninterrupted
    run, every checkpoint byte for byte, the lineage included; none is lost. A finished fine-tune run again without
    train.finetune_from, or with another parent, is still that fine-tune (its checkpoints say so) and does nothing
    more (another parent is warned about)."""
    from mtpipe.training.train import train_model

    own_parent = tmp_path / "parent"
    shutil.copytree(artifacts.checkpoint_path(parent, 4), own_parent)
    cfg = tcfg(finetune_from=str(own_parent), max_steps=6, save_every_steps=3, valid_every_steps=6)
    train_model(ModelConfig(), cfg, *data, tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(artifacts.checkpoint_path(tmp_path / "b", 6))
    own_parent.rename(tmp_path / "moved")
    s = train_model(ModelConfig(), cfg, *data, tmp_path / "b")
    assert s["resumed_from"].endswith("step_00000003") and s["updates_this_run"] == 3
    assert_same_run(tmp_path / "a", tmp_path / "b", 6)
    assert [step for step, _ in artifacts.list_checkpoints(tmp_path / "b")] == [3, 6]
    again = train_model(ModelConfig(), tcfg(max_steps=6, save_every_steps=3, valid_every_steps=6), *data,
                        tmp_path / "b")
    assert again["updates_this_run"] == 0 and again["finetuned_from"]["path"] == str(own_parent)
    capsys.readouterr()
    other = str(artifacts.checkpoint_path(parent, 2))
    again = train_model(ModelConfig(), dataclasses.replace(cfg, finetune_from=other), *data, tmp_path / "b")
    assert again["updates_this_run"] == 0 and again["finetuned_from"]["path"] == str(own_parent)
    assert f"train.finetune_from {other} applies to a fresh run only" in " ".join(capsys.readouterr().err.split())


# --------------------------------------------------------------------------------------------------------------------
# From an average; lineage through average
# --------------------------------------------------------------------------------------------------------------------


def test_finetune_from_an_average_and_its_lineage_through_average(data: tuple[Path, Path], parent: Path,
                                                                 tmp_path: Path) -> None:
    from mtpipe.stages.average import average_checkpoints
    from mtpipe.training.train import train_model

    avg = average_checkpoints(AverageConfig(last=2), parent, None, tmp_path / "avg")
    assert_starts_from(starting_trainer(avg, *data, tmp_path / "probe"), avg)
    train_model(ModelConfig(), tcfg(finetune_from=str(avg)), *data, tmp_path / "ft")
    lineage = {"path": str(avg), "sha256": artifacts.manifest_hash(avg), "step": 4}
    for _, d in artifacts.list_checkpoints(tmp_path / "ft"):
        assert artifacts.read_manifest(d, "checkpoint").extra["finetuned_from"] == lineage
    ft_avg = average_checkpoints(AverageConfig(last=2), tmp_path / "ft", None, tmp_path / "ft_avg")
    assert artifacts.checkpoint_fields(ft_avg).finetuned_from == lineage
    assert "finetuned_from" not in artifacts.read_manifest(avg, "checkpoint").extra  # a run from scratch has none
    # a fine-tune of the fine-tune's average: its own parent, whose manifest names the first one
    assert_starts_from(starting_trainer(ft_avg, *data, tmp_path / "probe2"), ft_avg)


def test_a_malformed_lineage_record_is_refused(parent: Path) -> None:
    ck = artifacts.checkpoint_path(parent, 4)
    m = artifacts.read_manifest(ck, "checkpoint")
    m.extra["finetuned_from"] = {"path": "x", "sha256": "not a hash"}
    with pytest.raises(MtpipeError, match="not a lineage record"):
        artifacts.checkpoint_fields(ck, m)


def test_from_model_needs_a_checkpoint_with_its_sentencepiece_model(parent: Path) -> None:
    from mtpipe.stages.bpe import checkpoint_spm_model

    ck_dir = artifacts.checkpoint_path(parent, 4)  # make_artifacts' spm.model is not a real one: not carried
    with pytest.raises(MtpipeError, match="carries no SentencePiece model"):
        checkpoint_spm_model(ck_dir, None)
    with pytest.raises(MtpipeError, match="give one SentencePiece model"):
        checkpoint_spm_model(ck_dir, Path("spm.model"))
    with pytest.raises(MtpipeError, match="empty path"):
        BpeConfig(from_model=" ")
    with pytest.raises(MtpipeError, match="empty path"):
        TrainConfig(finetune_from="")


# --------------------------------------------------------------------------------------------------------------------
# From an imported fairseq model: the recipe of docs/training.md, as written
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An `mtpipe import`ed fairseq model (built as tests/test_import.py builds one; it carries its SentencePiece
    model), whose dictionary has every piece: a model that can learn every target token."""
    import sentencepiece as spm
    from test_import import fairseq_options, fairseq_state, make_spm, run_import, save_checkpoint

    root = tmp_path_factory.mktemp("imported")
    spm_model = make_spm(root, default_ids=False)
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    symbols = ["<s>", "<pad>", "</s>", "<unk>", *(sp.id_to_piece(i) for i in range(sp.get_piece_size())
                                                   if not (sp.is_control(i) or sp.is_unknown(i)))]
    symbols += [f"madeupword{i:04d}" for i in range(-len(symbols) % 8)]  # fairseq pads its dictionary to 8
    (root / "fs-bin").mkdir()
    for lang in ("en", "de"):
        (root / "fs-bin" / f"dict.{lang}.txt").write_text(
            "".join(f"{s} {0 if s.startswith('madeupword') else 1}\n" for s in symbols[4:]), encoding="utf-8")
    state = fairseq_state(len(symbols), pre=False, shared=True, learned=False, seed=7)
    ck = save_checkpoint(root / "checkpoint.pt", state, fairseq_options(False, True, False))
    r = run_import(ck, root / "fs-bin", spm_model, root / "ck", root / "bpe")
    assert r.exit_code == 0, r.output
    return root / "ck"


def recipe() -> list[list[str]]:
    """The `mtpipe` command lines of the domain-adaptation recipe in docs/training.md."""
    text = (REPO / "docs" / "training.md").read_text(encoding="utf-8")
    section = text.split("## Fine-tuning / domain adaptation", 1)[1]
    block = re.search(r"<!-- docs-test: flags: tests/test_finetune.py -->\n```sh\n(.*?)^```", section, re.S | re.M)
    assert block, "docs/training.md: the recipe's block is gone"
    lines = [shlex.split(line) for line in block[1].replace("\\\n", " ").splitlines() if line.strip()]
    assert all(words[0] == "mtpipe" for words in lines)
    return [words[1:] for words in lines]


def test_the_domain_adaptation_recipe_runs_as_written(imported: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """In a project whose params.yaml is the committed one shrunk (tests/test_pipeline.py) with no model section, and
    whose artifacts/average is an imported model: every command of the recipe succeeds; the bpe artifact holds the
    parent's SentencePiece model byte for byte and names it; the fine-tune starts from the imported weights, its
    checkpoints and their average name the parent."""
    from test_pipeline import tiny_params

    root = tmp_path / "project"
    write_corpus(root / "domain", {"train": 150, "val": 20, "test_2016_flickr": 20}, seed=4)
    params = tiny_params(root / "corpus")
    del params["model"]  # an imported model: its own shape
    params["bucket"]["max_len"] = 60  # its positions table has 64 rows
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    shutil.copytree(imported, root / "artifacts" / "average")
    monkeypatch.chdir(root)
    for args in recipe():
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, f"mtpipe {' '.join(args)}:\n{r.output[-3000:]}"

    parent = Path("artifacts/average")
    bpe, run = Path("artifacts/domain/bpe"), Path("artifacts/domain/train")
    assert (bpe / "spm.model").read_bytes() == (parent / "spm.model").read_bytes()
    m = artifacts.read_manifest(bpe, "tokens")
    lineage = artifacts.lineage_record(parent, artifacts.read_manifest(parent, "checkpoint"))
    assert artifacts.check_lineage(bpe / artifacts.MANIFEST, "from_model", m.extra["from_model"]) == lineage
    assert m.upstream["checkpoint"] == lineage["sha256"]
    assert m.extra["spm_sha256"] == artifacts.load_checkpoint(parent).vocab["spm_sha256"]
    summary = json.loads((run / "train.json").read_text(encoding="utf-8"))
    assert summary["stopped_by"] == "max_epochs" and summary["epochs"] == 10 and summary["finetuned_from"] == lineage
    found = artifacts.list_checkpoints(run)
    assert len(found) >= 2 and all(
        artifacts.read_manifest(d, "checkpoint").extra["finetuned_from"] == lineage for _, d in found)
    avg = artifacts.read_manifest("artifacts/domain/average", "checkpoint")
    assert avg.extra["finetuned_from"] == lineage
    valid = [float(v) for _, v in tsv(run, "valid/nll")]
    assert valid[-1] < valid[0]  # it learned the domain
    assert len((Path("artifacts/domain/decode") / "test.txt").read_text(encoding="utf-8").splitlines()) == 20
    assert_starts_from(starting_trainer(parent, bpe, Path("artifacts/domain/bucket"), tmp_path / "probe"), parent)


def test_pieces_an_imported_parent_closed_are_warned_about(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`mtpipe import` closes the pieces the original dictionary lacked (output bias -1e9): the fine-tune starts
    from those weights as they are, and says that it cannot teach those pieces."""
    from mtpipe import writing
    from mtpipe.model.transformer import build_model
    from mtpipe.training import finetune

    cfg = to_dict(ModelConfig(**{**TINY, "output_bias": True}).resolved())
    model = build_model(cfg, 32)
    with torch.no_grad():
        model.out_bias[5:8] = -1e9
    ck = tmp_path / "ck"
    writing.write_checkpoint(ck, state_dict=model.state_dict(),
                             meta=artifacts.CheckpointManifest(model_config=cfg,
                                                               vocab={"spm_sha256": "sha256:" + "ab" * 32, "size": 32},
                                                               step=0))
    ft = finetune.FineTune(ModelConfig(**cfg), artifacts.lineage_record(ck, artifacts.read_manifest(ck)), ck)
    student = build_model(cfg, 32)
    finetune.load_parent(ft, student, "cpu")
    assert torch.equal(student.out_bias, model.out_bias)
    assert "3 pieces have an output bias of -1e9" in " ".join(capsys.readouterr().err.split())
