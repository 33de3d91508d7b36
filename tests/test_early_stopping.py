"""Validation BLEU, early stopping (train.patience), the best checkpoint, `average.select=best`, and the training log,
ETA and early-stop note.

Early stopping is driven by a scripted valid perplexity (a function of the step, so an interrupted run and an
uninterrupted one see the same values); BLEU and the log come from real tiny runs (:mod:`test_train`'s artifacts).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from conftest import synthetic_pairs, train_spm
from test_train import mcfg, tcfg
from testkit.runs import make_artifacts, pack_batches, tsv

from mtpipe import artifacts, writing
from mtpipe.config import AverageConfig, TrainConfig
from mtpipe.errors import MtpipeError


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_artifacts(tmp_path_factory.mktemp("data"))


def script_ppl(monkeypatch: pytest.MonkeyPatch, ppl_at: dict[int, float]) -> None:
    """Replace the validation loss by ``ppl_at[step]``: a known sequence of improvements and setbacks."""
    from mtpipe.training.state import TrainState
    from mtpipe.training.validation import Validator

    def valid_loss(self: Validator, loss_module: object, state: TrainState) -> dict[str, float]:
        ppl = ppl_at[state.step]
        state.last_valid_step = state.step
        state.last_valid = {"valid/loss": math.log(ppl), "valid/nll": math.log(ppl), "valid/ppl": ppl}
        return state.last_valid

    monkeypatch.setattr(Validator, "loss", valid_loss)


# Validation every 2 updates: the best is 9.0 at step 4, then nothing beats it.
PPL = {2: 10.0, 4: 9.0, 6: 9.0, 8: 9.5, 10: 9.2, 12: 8.0, 14: 7.0, 16: 6.0, 18: 5.0, 20: 4.0}
EARLY = dict(max_steps=20, valid_every_steps=2, save_every_steps=5, keep_last=1, patience=3)


def steps_of(out: Path) -> list[int]:
    from mtpipe.artifacts import list_checkpoints

    return [s for s, _ in list_checkpoints(out)]


def test_patience_stops_after_exactly_that_many_validations_and_keeps_the_best(
        data: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validations at 6 (a tie is no improvement), 8 and 10 do not beat step 4's 9.0: patience 3 stops at 10, before
    12's improvement. Step 4's checkpoint was written when it became the best (no save was due there) and survives
    keep_last=1 while 5 and 10 come after it."""
    from mtpipe.training.train import train_model

    script_ppl(monkeypatch, PPL)
    out = tmp_path / "out"
    s = train_model(mcfg(), tcfg(**EARLY), *data, out)
    assert (s["stopped_by"], s["steps"], s["stopped_early"]) == ("patience", 10, True)
    assert s["best"]["step"] == 4 and s["best"]["value"] == 9.0 and s["best"]["bad"] == 3
    assert steps_of(out) == [4, 10]  # keep_last=1, and the best
    best = json.loads((out / "best.json").read_text())
    assert best["step"] == 4 and best["metric"] == "valid_ppl" and (out / best["checkpoint"]).is_dir()
    assert "train.patience=3" in s["stop_note"] and "9 at update 4" in s["stop_note"]
    assert json.loads((out / "train.json").read_text())["stop_note"] == s["stop_note"]
    # Every checkpoint written at a validation records it, for average --select best.
    m = artifacts.read_manifest(out / "checkpoints" / "step_00000004", "checkpoint")
    assert m.extra["valid"]["valid/ppl"] == 9.0
    # A finished run started again stays stopped.
    again = train_model(mcfg(), tcfg(**EARLY), *data, out)
    assert again["updates_this_run"] == 0 and again["stopped_by"] == "patience"


def test_resume_in_the_middle_of_a_patience_count_stops_at_the_same_step(
        data: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped at step 8 with 2 validations without improvement, the run resumes from that checkpoint and stops at
    10, as the uninterrupted run does (were the count or the best lost, 10's 9.2 would be a new best and the run
    would go on to step 16 or beyond)."""
    from mtpipe.training.train import train_model

    script_ppl(monkeypatch, PPL)
    out = tmp_path / "out"
    first = train_model(mcfg(), tcfg(**{**EARLY, "max_steps": 8}), *data, out)
    assert first["stopped_by"] == "max_steps" and first["best"]["bad"] == 2
    ts = torch.load(out / "checkpoints" / "step_00000008" / "trainer.pt", weights_only=True)
    assert ts["best"] == {"metric": "valid_ppl", "value": 9.0, "step": 4, "bad": 2}
    s = train_model(mcfg(), tcfg(**EARLY), *data, out)
    assert s["resumed_from"].endswith("step_00000008")
    assert (s["stopped_by"], s["steps"], s["best"]["step"]) == ("patience", 10, 4)
    assert steps_of(out) == [4, 10]


def test_improving_runs_are_not_stopped_and_patience_0_is_off(data: tuple[Path, Path], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from mtpipe.training.train import train_model

    script_ppl(monkeypatch, {s: 100.0 / s for s in range(2, 21, 2)})
    s = train_model(mcfg(), tcfg(**{**EARLY, "max_steps": 12}), *data, tmp_path / "a")
    assert (s["stopped_by"], s["steps"], s["best"]["step"], s["stopped_early"]) == ("max_steps", 12, 12, False)
    assert s["stop_note"] is None
    script_ppl(monkeypatch, {s: 5.0 for s in range(2, 21, 2)})  # flat: never improves after the first
    s = train_model(mcfg(), tcfg(**{**EARLY, "max_steps": 12, "patience": 0}), *data, tmp_path / "b")
    assert s["stopped_by"] == "max_steps" and s["best"]["step"] == 2 and s["best"]["bad"] == 5


def test_best_record_and_pruning_rules() -> None:
    from mtpipe.training.checkpoints import prunable
    from mtpipe.training.state import Best, improves

    assert improves("valid_ppl", 4.0, 5.0) and not improves("valid_ppl", 5.0, 5.0)
    assert improves("valid_bleu", 20.0, 19.5) and not improves("valid_bleu", 19.0, 19.5)
    assert improves("valid_bleu", 0.0, None)
    b = Best()
    assert [b.update("valid_bleu", v, s) for s, v in ((1, 3.0), (2, 5.0), (3, 4.0), (4, 5.0))] == [
        True, True, False, False]
    assert (b.step, b.value, b.bad) == (2, 5.0, 2)
    assert Best.from_dict(b.to_dict()) == b
    assert b.update("valid_ppl", 50.0, 5) and (b.metric, b.step, b.bad) == ("valid_ppl", 5, 0)  # a new metric
    found = [(s, Path(f"step_{s}")) for s in (2, 4, 6, 8, 10)]
    assert [s for s, _ in prunable(found, 2, {4})] == [2, 6]
    assert [s for s, _ in prunable(found, 2, {10})] == [2, 4, 6]
    assert prunable(found, 9, {-1}) == []


@pytest.mark.parametrize("kw, match", [
    (dict(stop_metric="valid_bleu"), "valid_bleu_every_steps"),
    (dict(patience=2, valid_every_steps=0), "valid_every_steps"),
])
def test_settings_that_cannot_work_are_one_line_errors(data: tuple[Path, Path], tmp_path: Path, kw: dict,
                                                       match: str) -> None:
    from mtpipe.training.train import train_model

    with pytest.raises(MtpipeError, match=match) as e:
        train_model(mcfg(), tcfg(**kw), *data, tmp_path / "out")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out" / "checkpoints").exists()


# --------------------------------------------------------------------------------------------------------------------
# Validation BLEU on a real SentencePiece model
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spm_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """bpe and bucket artifacts of synthetic sentence pairs encoded with a real (tiny) SentencePiece model."""
    root = tmp_path_factory.mktemp("spm")
    pairs = {"train": synthetic_pairs(120, 1), "valid": synthetic_pairs(12, 2)}
    sp = train_spm(root / "spm", [t for ps in pairs.values() for p in ps for t in p], vocab_size=120)
    tokens, batches = root / "bpe", root / "bucket"
    enc = {split: ([sp.encode(s) for s, _ in ps], [sp.encode(t) for _, t in ps]) for split, ps in pairs.items()}
    with writing.ArtifactWriter(tokens, "tokens", {"bpe": {"vocab_size": 120}}) as w:
        for split, (src, tgt) in enc.items():
            w.write_table(f"{split}.parquet", pa.table({"id": list(range(len(src))), "src": src, "tgt": tgt}))
        w.path("spm.model").write_bytes((root / "spm.model").read_bytes())
        w.extra.update(spm_sha256=artifacts.file_hash(root / "spm.model"), vocab_size=sp.get_piece_size())
    with writing.ArtifactWriter(batches, "batches", {"bucket": {"max_tokens": 256}}, upstream={"tokens": tokens}) as w:
        for split, (src, tgt) in enc.items():
            bs = pack_batches(src, tgt, 256)
            w.write_table(f"{split}.parquet", pa.table({
                "batch": list(range(len(bs))), "ids": bs,
                "src_tokens": [sum(len(src[i]) + 1 for i in b) for b in bs],
                "tgt_tokens": [sum(len(tgt[i]) + 1 for i in b) for b in bs],
                "src_len": [max(len(src[i]) for i in b) + 1 for b in bs],
                "tgt_len": [max(len(tgt[i]) for i in b) + 1 for b in bs],
            }))
    return tokens, batches


BLEU_RUN = dict(max_steps=4, valid_every_steps=0, save_every_steps=2, tokens_per_update=256, valid_bleu_sentences=5,
                valid_bleu_every_steps=2)


def test_valid_bleu_is_logged_and_leaves_training_unchanged(spm_data: tuple[Path, Path], tmp_path: Path) -> None:
    """valid/bleu at steps 2 and 4 is a number in [0, 100] in the dvclive curve, the summary and the checkpoints'
    manifests; the run's losses equal, bitwise, those of the same run without it (dropout 0.1: the RNG state is
    untouched, so exact resume still holds); the model is back in train mode."""
    from mtpipe.training.train import train_model

    s = train_model(mcfg(max_positions=128), tcfg(**BLEU_RUN), *spm_data, tmp_path / "bleu")
    rows = tsv(tmp_path / "bleu", "valid/bleu")
    assert [st for st, _ in rows] == [2, 4]
    assert all(0.0 <= float(v) <= 100.0 for _, v in rows)
    assert s["valid_bleu"] == pytest.approx(float(rows[-1][1]))
    m = artifacts.read_manifest(tmp_path / "bleu" / "checkpoints" / "step_00000002", "checkpoint")
    assert m.extra["valid"]["valid/bleu"] == pytest.approx(float(rows[0][1]))
    plain = train_model(mcfg(max_positions=128), tcfg(**{**BLEU_RUN, "valid_bleu_every_steps": 0}), *spm_data,
                        tmp_path / "plain")
    assert plain["valid_bleu"] is None
    assert tsv(tmp_path / "bleu", "train/loss") == tsv(tmp_path / "plain", "train/loss")
    assert "valid BLEU" in (tmp_path / "bleu" / "train.log").read_text()


def test_valid_bleu_sample_is_fixed_and_references_are_detokenised(spm_data: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    from mtpipe.training.batches import load_split
    from mtpipe.training.trainer import Trainer

    tokens, batches = spm_data
    trainer = Trainer(mcfg(max_positions=128), tcfg(**BLEU_RUN), tokens, batches, tmp_path / "out")
    v = trainer.validator.sample
    assert v is not None and len(v.sources) == 5
    split = load_split(tokens, "valid")
    first, last = (split.src[split.src_off[r]:split.src_off[r + 1]].tolist() for r in (0, len(split.ids) - 1))
    assert v.sources[0] == first and v.sources[-1] == last  # evenly spaced over the split, ends included
    assert all(r.endswith(".") and " " in r and "\u2581" not in r for r in v.references)  # text, not pieces
    assert trainer.validator.bleu(trainer.state) == trainer.validator.bleu(trainer.state)  # deterministic
    assert trainer.model.training


def test_valid_bleu_needs_a_sentencepiece_model(data: tuple[Path, Path], tmp_path: Path) -> None:
    from mtpipe.training.train import train_model

    with pytest.raises(MtpipeError, match="spm.model") as e:  # test_train's artifacts carry a fake one
        train_model(mcfg(), tcfg(valid_bleu_every_steps=2), *data, tmp_path / "out")
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------------------------------
# average --select best
# --------------------------------------------------------------------------------------------------------------------


def _checkpoint(run: Path, step: int, metric: str, valid: dict[str, float]) -> None:
    g = torch.Generator().manual_seed(step)
    writing.write_checkpoint(run / "checkpoints" / f"step_{step:08d}",
                             state_dict={"w": torch.randint(-8, 8, (4, 4), generator=g) / 8.0},
                             meta=artifacts.CheckpointManifest(model_config={"preset": "tiny"},
                                                               vocab={"spm_sha256": "sha256:ab", "size": 10}, step=step,
                                                               valid=valid),
                             trainer_state=None, params={"train": {"stop_metric": metric}})


@pytest.mark.parametrize("metric, key, values, want", [
    ("valid_ppl", "valid/ppl", {10: 9.0, 20: 7.0, 30: 8.0, 40: 7.5, 50: None}, [20, 40]),
    ("valid_bleu", "valid/bleu", {10: 9.0, 20: 7.0, 30: 8.0, 40: 7.5, 50: None}, [10, 30]),
])
def test_average_select_best_picks_the_best_n(tmp_path: Path, metric: str, key: str, values: dict,
                                              want: list[int]) -> None:
    from mtpipe.stages.average import average_checkpoints, select

    run = tmp_path / "run"
    for step, v in values.items():
        _checkpoint(run, step, metric, {} if v is None else {key: v})
    picked = select(AverageConfig(last=2, select="best"), run, None)
    assert [s for s, _ in picked] == want  # step 50 has no value: left out, not ranked
    assert [s for s, _ in select(AverageConfig(last=2), run, None)] == [40, 50]  # select=last unchanged
    out = average_checkpoints(AverageConfig(last=2, select="best"), run, None, tmp_path / "avg")
    ck = artifacts.load_checkpoint(out)
    assert [a["step"] for a in ck.manifest.extra["averaged"]] == want
    mean = sum(artifacts.load_checkpoint(run / "checkpoints" / f"step_{s:08d}").state_dict["w"] for s in want) / 2
    assert torch.equal(ck.state_dict["w"], mean)


def test_average_select_best_without_recorded_metrics_is_a_one_line_error(tmp_path: Path) -> None:
    from mtpipe.stages.average import select

    run = tmp_path / "run"
    for step in (1, 2):
        _checkpoint(run, step, "valid_ppl", {})
    with pytest.raises(MtpipeError, match="no checkpoint has a recorded valid_ppl") as e:
        select(AverageConfig(last=1, select="best"), run, None)
    assert "\n" not in str(e.value)
    _checkpoint(run, 3, "valid_ppl", {"valid/ppl": 3.0})
    with pytest.raises(MtpipeError, match="only 1 have a recorded value"):
        select(AverageConfig(last=2, select="best"), run, None)
    assert [s for s, _ in select(AverageConfig(last=2, select="best", allow_fewer=True), run, None)] == [3]


def test_average_select_best_on_a_real_run(data: tuple[Path, Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer records each checkpoint's validation: the best two of a scripted run are averaged."""
    from mtpipe.stages.average import select
    from mtpipe.training.train import train_model

    script_ppl(monkeypatch, PPL)
    out = tmp_path / "out"
    train_model(mcfg(), tcfg(**{**EARLY, "patience": 0, "max_steps": 14, "keep_last": 20}), *data, out)
    # Checkpoints at 2 and 4 (bests), 5 and 15 (unvalidated) and 10, 12, 14: best ppl 7.0 (14), 8.0 (12).
    assert [s for s, _ in select(AverageConfig(last=2, select="best"), out, None)] == [12, 14]


# --------------------------------------------------------------------------------------------------------------------
# The training log, the ETA, the early-stop note
# --------------------------------------------------------------------------------------------------------------------


def test_train_log_has_the_step_lines_and_summary_appended_across_resumes(data: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    from mtpipe.training.train import train_model

    out = tmp_path / "out"
    train_model(mcfg(), tcfg(max_steps=4), *data, out)
    train_model(mcfg(), tcfg(max_steps=6), *data, out)
    text = (out / "train.log").read_text()
    steps = [int(ln.split("step ")[1].split()[0]) for ln in text.splitlines() if "  loss " in ln]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert "resuming from" in text and text.count("summary: steps") == 2 and "valid loss" in text
    from mtpipe.writing import check_run_dir

    check_run_dir(out)  # train.log and best.json are the run's own files: the run directory is still replaceable


def test_remaining_time_is_the_sooner_of_steps_and_max_time() -> None:
    from mtpipe.training.metrics import remaining_seconds

    # 100 of 1,000 updates in 60 s: 540 s left by steps; max_time 5 min with 60 s trained: 240 s left.
    assert remaining_seconds(100, 1000, 100, 60.0, 60.0, 5.0) == pytest.approx(240.0)
    assert remaining_seconds(100, 1000, 100, 60.0, 60.0, 0.0) == pytest.approx(540.0)  # no time limit
    assert remaining_seconds(100, 1000, 100, 60.0, 60.0, 60.0) == pytest.approx(540.0)  # steps end first
    assert remaining_seconds(5, 0, 5, 3.0, 30.0, 1.0) == pytest.approx(30.0)  # max_time alone
    assert remaining_seconds(0, 1000, 0, 0.0, 0.0, 0.0) is None  # nothing timed yet, no limit
    assert remaining_seconds(10, 0, 10, 1.0, 100.0, 1.0) == 0.0  # past the limit: never negative


def test_progress_bar_fills_with_the_budget_not_the_epoch_cap(data: tuple[Path, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that train.max_time ends fills its bar as its minutes pass: the bar's fill is the budget spent, which
    reaches 1 when time is up, while the update count stays a sliver of the 10,000-epoch cap's plan."""
    from rich.progress import BarColumn

    from mtpipe.console import progress
    from mtpipe.training.budget import Budget
    from mtpipe.training.train import train_model

    seen: list[dict] = []
    original = Budget.bar_fields

    def recorded(self: Budget, start_step: int) -> dict:
        fields = original(self, start_step)
        seen.append({**fields, "step": self.state.step, "total": self.total_steps})
        return fields

    monkeypatch.setattr(Budget, "bar_fields", recorded)
    train_model(mcfg(), tcfg(max_steps=0, max_epochs=10_000, max_time=0.01, save_every_steps=0, valid_every_steps=0),
                *data, tmp_path / "out")
    fills = [f["fraction"] for f in seen]
    assert fills == sorted(fills) and fills[-1] == 1.0
    assert seen[-1]["step"] / seen[-1]["total"] < 0.05  # what rich's own fill would have shown at the end

    with progress() as bar:  # the bar column draws the field when a task carries it, else completed / total
        by_field = bar.add_task("a", total=100, completed=10, fraction=0.5)
        plain = bar.add_task("b", total=100, completed=10)
        column = next(c for c in bar.columns if isinstance(c, BarColumn))
        drawn = [column.render(bar.tasks[i]) for i in (by_field, plain)]
    assert [d.completed / d.total for d in drawn] == [0.5, 0.1]


def test_stop_note_says_how_much_of_the_plan_was_done() -> None:
    from mtpipe.training.metrics import stop_note

    s = {"stopped_by": "max_time", "steps": 1377, "planned_updates": 2660, "max_time": 36.0}
    assert stop_note(s) == "stopped by train.max_time=36 min after 1,377 of 2,660 planned updates (52 %)"
    assert stop_note({**s, "steps": 2660}) is None  # the plan was done anyway
    assert stop_note({**s, "planned_updates": 0}) is None  # max_time was the plan
    assert stop_note({**s, "stopped_by": "max_steps"}) is None


def test_time_guard_stop_is_reported_in_the_summary_and_the_log(data: tuple[Path, Path], tmp_path: Path) -> None:
    from mtpipe.training.train import train_model

    out = tmp_path / "out"
    s = train_model(mcfg(), tcfg(max_steps=100_000, max_time=0.005, save_every_steps=0, valid_every_steps=0), *data,
                    out)
    assert s["stopped_by"] == "max_time" and s["stopped_early"] and s["planned_updates"] == 100_000
    # (a loaded machine may make only a few updates in 0.3 s: their share, rounded to 4 decimals, may be 0)
    assert 0 < s["steps"] < 100_000 and 0 <= s["plan_done"] < 1
    assert s["stop_note"].startswith("stopped by train.max_time=0.005 min after ")
    assert s["stop_note"] in (out / "train.log").read_text()
    assert s["plan_done"] == pytest.approx(s["steps"] / 100_000, abs=1e-4)  # rounded to 4 decimals


def test_config_keys_exist_and_are_checked() -> None:
    with pytest.raises(MtpipeError, match="stop_metric"):
        TrainConfig(stop_metric="bleu")
    with pytest.raises(MtpipeError, match="select"):
        AverageConfig(select="worst")
    assert TrainConfig().patience == 0 and TrainConfig().valid_bleu_every_steps == 0


@pytest.mark.slow
def test_valid_bleu_and_patience_at_world_size_2(spm_data: tuple[Path, Path], tmp_path: Path) -> None:
    """2 torchrun processes (gloo) split the BLEU sentences and gather them: the same valid/bleu points as 1 process
    with twice the accumulation (the same updates), and both ranks stop together (the launch exits cleanly)."""
    from test_train import _command, _run
    from testkit.runs import TINY, write_params

    from mtpipe.training.train import train_model

    train = {**tcfg(**BLEU_RUN, stop_metric="valid_bleu", patience=1).__dict__, "max_steps": 6,
             "tokens_per_update": 512}  # 2 batches per update: 1 x 2 and 2 x 1 make the same updates
    params = write_params(tmp_path / "params.yaml", {**TINY, "dropout": 0.0, "max_positions": 128},
                          {**train, "nproc": 2})
    _run(_command(params, spm_data, tmp_path / "ws2", launcher=True), tmp_path / "ws2.log")
    s1 = train_model(mcfg(dropout=0.0, max_positions=128), TrainConfig(**train), *spm_data, tmp_path / "ws1")
    s2 = json.loads((tmp_path / "ws2" / "train.json").read_text())
    assert (s1["processes"], s1["accumulation"], s2["processes"], s2["accumulation"]) == (1, 2, 2, 1)
    b1, b2 = tsv(tmp_path / "ws1", "valid/bleu"), tsv(tmp_path / "ws2", "valid/bleu")
    assert [s for s, _ in b1] == [s for s, _ in b2] and all(0 <= float(v) <= 100 for _, v in b2)
    for (_, a), (_, b) in zip(b1, b2):
        assert float(a) == pytest.approx(float(b), abs=1e-6)
    assert (s2["stopped_by"], s2["steps"]) == (s1["stopped_by"], s1["steps"])
    assert {k: v for k, v in s2["best"].items() if k != "checkpoint"} == {
        k: v for k, v in s1["best"].items() if k != "checkpoint"}
