"""The checkpoint manifest's one schema (mtpipe.artifacts.CheckpointManifest): validated on read in one
line naming the file and the field, written through it with today's keys, and carried whole through an average,
a field added later included."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

from mtpipe import artifacts, params, writing
from mtpipe.artifacts import CheckpointManifest
from mtpipe.config import AverageConfig
from mtpipe.errors import MtpipeError
from mtpipe.stages.average import average_checkpoints

CONFIG = {"preset": "tiny", "d_model": 8, "heads": 2, "encoder_layers": 1, "decoder_layers": 1}
VOCAB = {"spm_sha256": "sha256:" + "ab" * 32, "size": 100}
# What the averaging sets itself; every other field of an average is its newest input's.
AVERAGING_OWN = {"step", "averaged", "spm_model", "spm_vocab"}


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randint(-8, 8, (3, 4), generator=g) / 8.0}


def write(out: Path, meta: CheckpointManifest) -> Path:
    writing.write_checkpoint(out, state_dict=weights(meta.step), meta=meta, params={"train": {"seed": 1}})
    return out


def a_value(name: str, tp: Any) -> Any:
    """A value of the annotated type ``tp`` that no code path makes up by itself (so a carried one is recognised)."""
    if name == "finetuned_from":
        return {"path": "parent", "sha256": "sha256:" + "cd" * 32, "step": 3}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, type(int | None)):
        return a_value(name, next(a for a in args if a is not type(None)))
    if origin is typing.Literal:
        return args[0]
    if origin is dict:
        return {f"{name}-key": 1.5 if args[1] is float else [1, name]}
    if origin is list:
        return [{"carried": name}]
    return {int: 11, float: 2.5, str: f"{name} carried"}[tp]


def every_field(step: int, cls: type = CheckpointManifest) -> CheckpointManifest:
    """A checkpoint manifest with every field set (but the SentencePiece files, which the writer sets by what it
    copies), and a key of a newer mtpipe."""
    hints = typing.get_type_hints(cls)
    values = {f.name: a_value(f.name, hints[f.name]) for f in dataclasses.fields(cls)
              if f.name not in ("spm_model", "spm_vocab", "others")}
    values.update(model_config=CONFIG, vocab=VOCAB, step=step)
    return cls(**values, others={"from_a_newer_mtpipe": {"kept": True}})


def test_an_average_carries_every_field_of_its_newest_input(tmp_path: Path) -> None:
    inputs = [write(tmp_path / f"ck{s}", every_field(s)) for s in (10, 20)]
    average_checkpoints(AverageConfig(last=2), tmp_path, inputs, tmp_path / "avg")
    newest, out = artifacts.checkpoint_fields(inputs[-1]), artifacts.checkpoint_fields(tmp_path / "avg")
    for f in dataclasses.fields(CheckpointManifest):
        if f.name in AVERAGING_OWN:
            continue
        if f.metadata.get("of_its_weights"):  # a validation of an input's weights is not the average's
            assert getattr(out, f.name) is None and getattr(newest, f.name) is not None, f.name
        else:
            assert getattr(out, f.name) == getattr(newest, f.name) is not None, f.name
    assert out.others == {"from_a_newer_mtpipe": {"kept": True}}
    assert out.step == 20 and [a["step"] for a in out.averaged] == [10, 20]


def test_a_field_added_to_the_schema_later_is_carried_by_average(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # A later mtpipe adds a field: average, which does not name it, carries it as a field (not as an unknown key).
    later = dataclasses.make_dataclass("Later", [("added_later", dict[str, int] | None, dataclasses.field(default=None))],
                                       bases=(CheckpointManifest,), frozen=True)
    monkeypatch.setattr(artifacts, "CheckpointManifest", later)
    inputs = [write(tmp_path / f"ck{s}", later(model_config=CONFIG, vocab=VOCAB, step=s, added_later={"n": s}))
              for s in (1, 2)]
    average_checkpoints(AverageConfig(last=2), tmp_path, inputs, tmp_path / "avg")
    out = artifacts.checkpoint_fields(tmp_path / "avg")
    assert isinstance(out, later) and out.added_later == {"n": 2} and out.others == {}
    assert json.loads((tmp_path / "avg" / artifacts.MANIFEST).read_text())["extra"]["added_later"] == {"n": 2}


def test_the_manifest_keeps_todays_keys_and_round_trips(tmp_path: Path) -> None:
    # What training writes (the keys a user's scripts read), byte for byte through the schema and back.
    extra = {"model_config": CONFIG, "vocab": VOCAB, "step": 7, "epoch": 1, "world_size": 2, "precision": "fp32",
             "valid": {"valid/loss": 2.5, "valid/ppl": 12.0}, "decode": {}, "train_batches": "",
             "finetuned_from": {"path": "p", "sha256": "sha256:" + "ef" * 32, "step": 4}}
    meta = CheckpointManifest.from_extra(extra, "m.json")
    assert meta.to_extra() == extra and meta.others == {}
    write(tmp_path / "ck", meta)
    on_disk = json.loads((tmp_path / "ck" / artifacts.MANIFEST).read_text())
    assert on_disk["format_version"] == 2 and on_disk["extra"] == extra
    assert artifacts.load_checkpoint(tmp_path / "ck").meta == meta


@pytest.mark.parametrize("change, says", [
    (lambda e: e.update(step="7"), "extra.step = '7', expected int"),
    (lambda e: e.update(step=True), "extra.step = True, expected int"),
    (lambda e: e.pop("model_config"), "lacks extra.model_config"),
    (lambda e: e.update(vocab={"size": "100"}), "extra.vocab.size = '100', expected int"),
    (lambda e: e.update(valid={"valid/ppl": "low"}), "extra.valid = {'valid/ppl': 'low'}, expected dict"),
    (lambda e: e.update(decode=["beam", 4]), "extra.decode = .*, expected dict"),
    (lambda e: e.update(spm_model="../x"), "extra.spm_model = '../x', expected Literal"),
    (lambda e: e.update(finetuned_from={"path": "p"}), "extra.finetuned_from = .* is not a lineage record"),
])
def test_a_wrong_or_missing_field_is_one_line_naming_the_file_and_the_field(tmp_path: Path, change, says) -> None:
    ck = write(tmp_path / "ck", CheckpointManifest(model_config=CONFIG, vocab=VOCAB, step=7))
    path = ck / artifacts.MANIFEST
    m = json.loads(path.read_text())
    change(m["extra"])
    path.write_text(json.dumps(m))
    for read in (artifacts.load_checkpoint, artifacts.read_manifest, artifacts.checkpoint_fields):
        with pytest.raises(MtpipeError, match=f"^{re.escape(str(path))}: .*{says}") as e:
            read(ck)
        assert "\n" not in str(e.value)
    assert params.checkpoint_decode({"checkpoint": str(ck)}) == {}  # the command's loading says why


def test_a_wrong_field_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(MtpipeError, match="extra.epoch = 'one', expected int"):
        write(tmp_path / "ck", CheckpointManifest(model_config=CONFIG, vocab=VOCAB, step=1, epoch="one"))
    assert not (tmp_path / "ck").exists()


def test_recorded_decode_settings_are_read_through_the_schema(tmp_path: Path) -> None:
    ck = write(tmp_path / "ck", CheckpointManifest(model_config=CONFIG, vocab=VOCAB, step=1,
                                                    decode={"beam": 2, "alpha": 1.5, "not_recorded": 1}))
    assert params.checkpoint_decode({"checkpoint": str(ck)}) == {
        "decode": ({"beam": 2, "alpha": 1.5}, str(ck / artifacts.MANIFEST))}
    # an export records its checkpoint's fields under checkpoint_step: the same schema reads them
    export = {"checkpoint_step": 5, "model_config": CONFIG, "vocab": VOCAB, "decode": {"beam": 3}, "format": "x"}
    meta = CheckpointManifest.of_artifact("export", export, "e.json")
    assert (meta.step, meta.vocab, meta.decode) == (5, VOCAB, {"beam": 3})
    with pytest.raises(MtpipeError, match="e.json: export manifest lacks extra.checkpoint_step"):
        CheckpointManifest.of_artifact("export", {"vocab": VOCAB}, "e.json")
