"""`mtpipe average`: exact means, selection by manifest step, fp64 accumulation, mismatch errors, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mtpipe import artifacts, writing
from mtpipe.stages.average import average_checkpoints
from mtpipe.cli import app
from mtpipe.config import AverageConfig
from mtpipe.errors import MtpipeError

CONFIG = {"preset": "tiny", "d_model": 8, "heads": 2, "encoder_layers": 1, "decoder_layers": 1}
VOCAB = {"spm_sha256": "sha256:abc", "size": 100}


def state(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Small tensors on a 1/8 grid: sums and halves of such values are exact in fp32 and fp64."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (torch.randint(-64, 64, (10, 8), generator=g) / 8).to(dtype),
        "layer.0.weight": (torch.randint(-64, 64, (8, 8), generator=g) / 8).to(dtype),
        "layer.0.bias": (torch.randint(-64, 64, (8,), generator=g) / 8).to(dtype),
    }


def save(run_dir: Path, step: int, sd: dict[str, torch.Tensor], *, name: str | None = None,
         config: dict | None = None, vocab: dict | None = None, trainer: bool = True) -> Path:
    """A training checkpoint as train writes it: run_dir/checkpoints/step_XXXXXXXX with a trainer.pt."""
    out = run_dir / "checkpoints" / (name or f"step_{step:08d}")
    writing.write_checkpoint(out, state_dict=sd,
                             meta=artifacts.CheckpointManifest(model_config=config or CONFIG, vocab=vocab or VOCAB,
                                                               step=step),
                             trainer_state={"step": torch.tensor(step)} if trainer else None,
                             params={"train": {"seed": 1}})
    return out


def cfg(**kw) -> AverageConfig:
    return AverageConfig(**kw)


def test_mean_of_two_is_exact_and_weights_only(tmp_path: Path) -> None:
    a, b = state(1), state(2)
    pa, pb = save(tmp_path, 100, a), save(tmp_path, 200, b)
    out = tmp_path / "avg"
    average_checkpoints(cfg(last=2), tmp_path, None, out)

    ck = artifacts.load_checkpoint(out)
    assert set(ck.state_dict) == set(a)
    for k in a:
        assert ck.state_dict[k].dtype == torch.float32
        assert torch.equal(ck.state_dict[k], (a[k] + b[k]) / 2), k
    assert ck.step == 200
    assert ck.model_config == CONFIG and ck.vocab == VOCAB
    assert not (out / "trainer.pt").exists()
    assert "trainer.pt" not in ck.manifest.files
    averaged = ck.manifest.extra["averaged"]
    assert [e["step"] for e in averaged] == [100, 200]
    assert [e["sha256"] for e in averaged] == [artifacts.manifest_hash(pa), artifacts.manifest_hash(pb)]
    assert sorted(ck.manifest.upstream.values()) == sorted(e["sha256"] for e in averaged)
    assert ck.manifest.params["average"]["last"] == 2


def test_last_n_by_manifest_step_not_name_and_up_to_step(tmp_path: Path) -> None:
    # Directory names sort in the opposite order to the steps: selection must follow the manifests.
    sds = {}
    for i, step in enumerate([500, 400, 300, 200, 100]):
        sds[step] = state(10 + i)
        save(tmp_path, step, sds[step], name=f"ckpt_{i}")

    def mean(steps: list[int]) -> torch.Tensor:
        return sum(sds[s]["embed.weight"].double() for s in steps) / len(steps)

    average_checkpoints(cfg(last=3), tmp_path, None, tmp_path / "a")
    ck = artifacts.load_checkpoint(tmp_path / "a")
    assert [e["step"] for e in ck.manifest.extra["averaged"]] == [300, 400, 500]
    assert ck.step == 500
    torch.testing.assert_close(ck.state_dict["embed.weight"].double(), mean([300, 400, 500]), rtol=0, atol=1e-6)

    average_checkpoints(cfg(last=2, up_to_step=350), tmp_path, None, tmp_path / "b")
    ck = artifacts.load_checkpoint(tmp_path / "b")
    assert [e["step"] for e in ck.manifest.extra["averaged"]] == [200, 300]
    assert ck.step == 300

    # An averaged checkpoint saved among the training checkpoints is not averaged again.
    average_checkpoints(cfg(last=2), tmp_path, None, tmp_path / "checkpoints" / "averaged")
    average_checkpoints(cfg(last=2), tmp_path, None, tmp_path / "c")
    assert [e["step"] for e in artifacts.load_checkpoint(tmp_path / "c").manifest.extra["averaged"]] == [400, 500]


def test_explicit_checkpoint_list(tmp_path: Path) -> None:
    sds = {s: state(s) for s in (1, 2, 3)}
    paths = {s: save(tmp_path, s, sd) for s, sd in sds.items()}
    average_checkpoints(cfg(last=5), tmp_path, [paths[3], paths[1]], tmp_path / "avg")
    ck = artifacts.load_checkpoint(tmp_path / "avg")
    assert [e["step"] for e in ck.manifest.extra["averaged"]] == [1, 3]
    assert torch.equal(ck.state_dict["layer.0.bias"], (sds[1]["layer.0.bias"] + sds[3]["layer.0.bias"]) / 2)
    with pytest.raises(MtpipeError, match="given twice"):
        average_checkpoints(cfg(), tmp_path, [paths[1], paths[1]], tmp_path / "avg2")


def test_bf16_inputs_accumulate_in_high_precision(tmp_path: Path) -> None:
    # bf16 keeps 8 significant bits: 256 + 1 rounds back to 256, so a bf16 running sum of 256, 1, 1, 1, 1 stays at
    # 256 (mean 51.2 -> 51.25 in bf16), while the exact mean 260 / 5 = 52 is representable in bf16.
    values = [256.0, 1.0, 1.0, 1.0, 1.0]
    naive = torch.tensor(0.0, dtype=torch.bfloat16)
    for v in values:
        naive = naive + torch.tensor(v, dtype=torch.bfloat16)
    assert (naive / 5).item() != 52.0  # the test would be vacuous otherwise
    for step, v in enumerate(values, start=1):
        save(tmp_path, step, {"w": torch.full((4, 3), v, dtype=torch.bfloat16)})
    average_checkpoints(cfg(last=5), tmp_path, None, tmp_path / "avg")
    w = artifacts.load_checkpoint(tmp_path / "avg").state_dict["w"]
    assert w.dtype == torch.bfloat16
    assert torch.all(w == 52.0)


def test_non_float_tensors_keep_the_newest_value(tmp_path: Path) -> None:
    for step in (1, 2):
        sd = state(step)
        sd["counter"] = torch.tensor([step * 10], dtype=torch.int64)
        save(tmp_path, step, sd)
    average_checkpoints(cfg(last=2), tmp_path, None, tmp_path / "avg")
    assert artifacts.load_checkpoint(tmp_path / "avg").state_dict["counter"].tolist() == [20]


@pytest.mark.parametrize(
    "change, pattern",
    [
        (dict(config={**CONFIG, "d_model": 16}), r"step_00000300: model_config\.d_model = 16 differs from 8"),
        (dict(vocab={**VOCAB, "spm_sha256": "sha256:other"}), r"step_00000300: vocab\.spm_sha256 = 'sha256:other'"),
        (dict(vocab={**VOCAB, "size": 99}), r"step_00000300: vocab\.size = 99 differs from 100"),
        (dict(rename=("layer.0.bias", "layer.0.bias_renamed")), r"step_00000300: has no parameter 'layer\.0\.bias'"),
        (dict(extra_param="zzz.extra"), r"step_00000300: has parameter 'zzz\.extra' that .*step_00000100 lacks"),
        (dict(reshape="layer.0.weight"), r"step_00000300: parameter 'layer\.0\.weight' has shape \(4, 16\)"),
    ],
)
def test_mismatch_names_the_first_difference(tmp_path: Path, change: dict, pattern: str) -> None:
    save(tmp_path, 100, state(1))
    save(tmp_path, 200, state(2))
    sd = state(3)
    if "rename" in change:
        old, new = change["rename"]
        sd[new] = sd.pop(old)
    if "extra_param" in change:
        sd[change["extra_param"]] = torch.zeros(2)
    if "reshape" in change:
        sd[change["reshape"]] = sd[change["reshape"]].reshape(4, 16)  # (8, 8) -> (4, 16)
    save(tmp_path, 300, sd, config=change.get("config"), vocab=change.get("vocab"))
    out = tmp_path / "avg"
    with pytest.raises(MtpipeError, match=pattern):
        average_checkpoints(cfg(last=3), tmp_path, None, out)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".avg")]  # no temporary left behind


def test_fewer_than_asked_error_or_warning(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    save(tmp_path, 1, state(1))
    save(tmp_path, 2, state(2))
    with pytest.raises(MtpipeError, match=r"last 5 checkpoints but only 2 exist.*--allow-fewer"):
        average_checkpoints(cfg(last=5), tmp_path, None, tmp_path / "avg")
    assert not (tmp_path / "avg").exists()
    with pytest.raises(MtpipeError, match=r"at or before step 0: no checkpoints"):
        average_checkpoints(cfg(last=1, up_to_step=0, allow_fewer=True), tmp_path, None, tmp_path / "avg")

    average_checkpoints(cfg(last=5, allow_fewer=True), tmp_path, None, tmp_path / "avg")
    assert "only 2 exist" in capsys.readouterr().err
    assert len(artifacts.load_checkpoint(tmp_path / "avg").manifest.extra["averaged"]) == 2


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(MtpipeError, match="train output directory not found"):
        average_checkpoints(cfg(), tmp_path / "nope", None, tmp_path / "avg")
    (tmp_path / "run").mkdir()
    with pytest.raises(MtpipeError, match="has no checkpoints/ directory"):
        average_checkpoints(cfg(), tmp_path / "run", None, tmp_path / "avg")
    (tmp_path / "run" / "checkpoints" / "junk").mkdir(parents=True)
    with pytest.raises(MtpipeError, match=r"junk: not an mtpipe checkpoint"):
        average_checkpoints(cfg(), tmp_path / "run", None, tmp_path / "avg")
    with pytest.raises(MtpipeError, match=r"not an mtpipe artifact"):
        average_checkpoints(cfg(), tmp_path, [tmp_path / "run" / "checkpoints" / "junk"], tmp_path / "avg")
    p = save(tmp_path / "two", 5, state(1))
    save(tmp_path / "two", 5, state(2), name="again")
    with pytest.raises(MtpipeError, match="two checkpoints at step 5"):
        average_checkpoints(cfg(last=1), tmp_path / "two", None, tmp_path / "avg")
    with pytest.raises(MtpipeError, match="is the input .*step_00000005; writing there would destroy it"):
        average_checkpoints(cfg(), tmp_path, [p], p)
    assert not (tmp_path / "avg").exists()


def test_cli_end_to_end(tmp_path: Path) -> None:
    sds = [state(s) for s in (1, 2, 3)]
    for step, sd in zip((10, 20, 30), sds):
        save(tmp_path / "run", step, sd)
    params = tmp_path / "params.yaml"
    params.write_text("average:\n  last: 5\n")
    runner = CliRunner()
    out = tmp_path / "avg"
    args = ["average", "--params", str(params), "--run", str(tmp_path / "run"), "--out", str(out)]

    res = runner.invoke(app, args)
    assert res.exit_code == 1, res.output
    assert "only 3 exist" in res.output and not out.exists()

    res = runner.invoke(app, args + ["--last", "2"])
    assert res.exit_code == 0, res.output
    ck = artifacts.load_checkpoint(out)
    assert [e["step"] for e in ck.manifest.extra["averaged"]] == [20, 30]
    assert torch.equal(ck.state_dict["embed.weight"], (sds[1]["embed.weight"] + sds[2]["embed.weight"]) / 2)
    assert json.loads((out / "manifest.json").read_text())["extra"]["step"] == 30

    explicit = ["--checkpoint", str(tmp_path / "run/checkpoints/step_00000010"),
                "--checkpoint", str(tmp_path / "run/checkpoints/step_00000030")]
    res = runner.invoke(app, args + explicit)
    assert res.exit_code == 0, res.output
    assert [e["step"] for e in artifacts.load_checkpoint(out).manifest.extra["averaged"]] == [10, 30]

    res = runner.invoke(app, args + ["--allow-fewer"])
    assert res.exit_code == 0, res.output
    assert len(artifacts.load_checkpoint(out).manifest.extra["averaged"]) == 3
