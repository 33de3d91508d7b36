"""Artifact manifests: validation on read, atomic writes, lineage."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from mtpipe import artifacts, writing
from mtpipe.errors import MtpipeError


def _corpus(n: int = 3) -> pa.Table:
    return pa.table({"id": list(range(n)), "src": ["a"] * n, "tgt": ["b"] * n})


def test_roundtrip_and_lineage(tmp_path: Path):
    up = tmp_path / "up"
    with writing.ArtifactWriter(up, "corpus", {"fetch": {"x": 1}}) as w:
        w.write_table("train.parquet", _corpus())
    with writing.ArtifactWriter(tmp_path / "down", "corpus", upstream={"corpus": up}) as w:
        w.write_table("train.parquet", _corpus(5))
    m = artifacts.read_manifest(tmp_path / "down", "corpus")
    assert m.rows == {"train.parquet": 5}
    assert m.upstream["corpus"] == artifacts.manifest_hash(up)
    assert artifacts.read_manifest(up).params == {"fetch": {"x": 1}}
    assert artifacts.read_table(up, "train.parquet", "corpus").num_rows == 3
    assert artifacts.splits_of(up, "corpus") == ["train"]


def test_failed_write_leaves_nothing_and_keeps_old(tmp_path: Path):
    out = tmp_path / "a"
    with writing.ArtifactWriter(out, "corpus") as w:
        w.write_table("train.parquet", _corpus())
    with pytest.raises(RuntimeError):
        with writing.ArtifactWriter(out, "corpus") as w:
            w.write_table("train.parquet", _corpus(10))
            raise RuntimeError("killed")
    assert artifacts.read_table(out, "train.parquet", "corpus").num_rows == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temp dirs left


def test_wrong_kind_version_schema_and_tamper_are_refused(tmp_path: Path):
    out = tmp_path / "a"
    with writing.ArtifactWriter(out, "corpus") as w:
        w.write_table("train.parquet", _corpus())
    with pytest.raises(MtpipeError, match="expected 'tokens'"):
        artifacts.read_manifest(out, "tokens")
    m = json.loads((out / "manifest.json").read_text())
    m["format_version"] = 0
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(MtpipeError, match="format version 0"):
        artifacts.read_manifest(out, "corpus")
    m["format_version"] = 1
    (out / "manifest.json").write_text(json.dumps(m))
    # A tokens-kind read of a corpus-schema file, relabelled: the schema check catches it.
    m["kind"] = "tokens"
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(MtpipeError, match="wrong schema"):
        artifacts.open_parquet(out, "train.parquet", "tokens")
    with open(out / "train.parquet", "ab") as f:
        f.write(b"x")
    with pytest.raises(MtpipeError, match="does not match"):
        artifacts.verify_file(out, "train.parquet")
    with pytest.raises(MtpipeError, match="not an mtpipe artifact"):
        artifacts.read_manifest(tmp_path)
    with pytest.raises(MtpipeError, match="not found"):
        artifacts.read_manifest(tmp_path / "nope")


def test_checkpoint_roundtrip_without_pickle(tmp_path: Path):
    import torch

    sd = {"w": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
    ts = {"step": 7, "rng": torch.get_rng_state(), "nested": {"a": [1, 2]}}
    writing.write_checkpoint(tmp_path / "ck", state_dict=sd,
                             meta=artifacts.CheckpointManifest(model_config={"d_model": 4}, vocab={"size": 10}, step=7),
                             trainer_state=ts)
    ck = artifacts.load_checkpoint(tmp_path / "ck", trainer_state=True)
    assert ck.step == 7 and ck.model_config == {"d_model": 4} and ck.vocab == {"size": 10}
    assert torch.equal(ck.state_dict["w"], sd["w"]) and ck.state_dict["b"].dtype == torch.bfloat16
    assert torch.equal(ck.trainer_state["rng"], ts["rng"]) and ck.trainer_state["nested"] == {"a": [1, 2]}


def test_atomic_write_text(tmp_path: Path):
    p = tmp_path / "m" / "x.json"
    writing.atomic_write_text(p, "{}")
    assert p.read_text() == "{}" and [q.name for q in p.parent.iterdir()] == ["x.json"]


def test_checkpoint_format_1_is_still_read_and_a_newer_one_refused(tmp_path: Path):
    import torch

    writing.write_checkpoint(tmp_path / "ck", state_dict={"w": torch.ones(2)},
                             meta=artifacts.CheckpointManifest(model_config={}, vocab={"size": 2}, step=3))
    path = tmp_path / "ck" / "manifest.json"
    m = json.loads(path.read_text())
    assert m["format_version"] == 2 and "spm_model" not in m["extra"]
    m["format_version"] = 1
    path.write_text(json.dumps(m))
    ck = artifacts.load_checkpoint(tmp_path / "ck")
    assert ck.step == 3 and ck.spm is None
    m["format_version"] = 3
    path.write_text(json.dumps(m))
    with pytest.raises(MtpipeError, match="format version 3, .* reads versions 1, 2"):
        artifacts.read_manifest(tmp_path / "ck")


def test_the_formats_load_no_pyarrow_until_a_schema_is_looked_up():
    # mtpipe.params reads a checkpoint's manifest (its CheckpointManifest) at every command's start-up: the module that
    # defines the formats costs no pyarrow until a schema is used, and then each schema is one object however reached.
    import subprocess
    import sys

    code = ("import sys\nfrom mtpipe import artifacts, params\n"
            "assert 'pyarrow' not in sys.modules, 'pyarrow imported with mtpipe.artifacts'\n"
            "from mtpipe.artifacts import TOKENS_SCHEMA\n"
            "assert 'pyarrow' in sys.modules and TOKENS_SCHEMA.names == ['id', 'src', 'tgt']\n"
            "assert artifacts.SCHEMAS['tokens'] is TOKENS_SCHEMA is artifacts.TOKENS_SCHEMA\n"
            "assert artifacts.BATCH_TOKENS_SCHEMA.names == ['batch', 'ids', 'src', 'tgt']\n"
            "assert not hasattr(artifacts, 'NO_SUCH_SCHEMA') and not hasattr(artifacts, 'NO_SUCH_NAME')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]


# --------------------------------------------------------------------------------------------------------------------
# The same content, the same bytes; the usual permissions
# --------------------------------------------------------------------------------------------------------------------

# Writes one checkpoint (weights, trainer state, a carried SentencePiece model) into argv[1]: the same content in every
# process, the metadata dicts built in the order argv[2] says (a resumed run reads them back from a manifest, sorted).
_WRITE_CHECKPOINT = """
import sys
from pathlib import Path

import torch

from mtpipe import writing
from mtpipe.artifacts import CheckpointManifest, file_hash
from mtpipe.config import ModelConfig, to_dict
from mtpipe.model.transformer import Transformer

out, flip = Path(sys.argv[1]), sys.argv[2] == "1"
order = (lambda d: dict(reversed(list(d.items())))) if flip else dict
torch.manual_seed(0)
model = Transformer(ModelConfig(preset="tiny", dropout=0.0, max_positions=32), 24)
opt = torch.optim.Adam(model.parameters())
model(torch.randint(4, 24, (2, 5)), torch.randint(4, 24, (2, 4))).sum().backward()
opt.step()
state = dict(model.state_dict(), extra_bf16=torch.arange(5).bfloat16(), extra_i64=torch.arange(3))
spm = out.parent / (out.name + ".spm")
spm.write_bytes(b"not really a SentencePiece model")
vocab = order({"size": 24, "spm_sha256": file_hash(spm)})
trainer_state = {"version": 1, "step": 7, "optimizer": opt.state_dict(), "rng": [{"cpu": torch.get_rng_state()}],
                 "window": {"loss": 1.25, "tokens": 9}}
meta = CheckpointManifest(model_config=order(to_dict(model.cfg)), vocab=vocab, step=7, epoch=1,
                          valid=order({"valid/loss": 2.5, "valid/bleu": 1.0}))
writing.write_checkpoint(out, state_dict=state, meta=meta, trainer_state=trainer_state,
                         params=order({"model": order(to_dict(model.cfg)), "b": 1}), spm=spm)
"""


def test_a_checkpoint_is_the_same_bytes_in_every_process(tmp_path: Path):
    # safetensors' save_file hands its metadata to Rust as a HashMap, iterated in an order seeded per process: the
    # same weights and metadata came out as other bytes, and so every hash of them (manifest, lineage, server, DVC).
    # Two processes with other hash seeds, the metadata dicts built in opposite orders: every file byte for byte.
    import os
    import struct
    import subprocess
    import sys

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    procs = []
    for i in (1, 2):
        env = dict(os.environ, PYTHONHASHSEED=str(i))
        procs.append(subprocess.Popen([sys.executable, "-c", _WRITE_CHECKPOINT, str(tmp_path / f"ck{i}"), str(i - 1)],
                                      env=env, stderr=subprocess.PIPE, text=True))
    for p in procs:
        assert p.wait() == 0, p.stderr.read()
    one, two = tmp_path / "ck1", tmp_path / "ck2"
    names = sorted(p.name for p in one.iterdir())
    assert names == ["manifest.json", "model.safetensors", "spm.model", "trainer.pt"]
    assert names == sorted(p.name for p in two.iterdir())
    for name in names:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert artifacts.manifest_hash(one) == artifacts.manifest_hash(two)
    # The header holds its metadata in sorted order whatever the process (not by luck: 1 in 24 above)
    raw = (one / artifacts.WEIGHTS).read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert list(header["__metadata__"]) == sorted(header["__metadata__"]) == ["format_version", "model_config",
                                                                             "step", "vocab"]
    # ... and the file is an ordinary safetensors file: safetensors reads the weights and the metadata back
    ck = artifacts.load_checkpoint(one, trainer_state=True)
    assert ck.step == 7 and ck.trainer_state["window"] == {"loss": 1.25, "tokens": 9}
    assert ck.state_dict["extra_bf16"].dtype == torch.bfloat16 and ck.state_dict["extra_i64"].tolist() == [0, 1, 2]
    assert set(load_file(str(one / artifacts.WEIGHTS))) == set(ck.state_dict)
    with safe_open(str(one / artifacts.WEIGHTS), "pt") as f:
        assert json.loads(f.metadata()["vocab"]) == ck.vocab and int(f.metadata()["step"]) == 7


def test_the_safetensors_writer_writes_what_safetensors_writes_but_for_the_metadata_order(tmp_path: Path):
    # With one metadata key (or none) safetensors' own order is fixed: the bytes must be its bytes, for every dtype,
    # a scalar, an empty tensor, a non-ASCII name and escaped metadata; what it refuses is refused.
    import torch
    from safetensors.torch import save

    g = torch.Generator().manual_seed(0)
    tensors = {"z.weight": torch.randn(3, 5, generator=g), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
               "bf16": torch.randn(7, generator=g).bfloat16(), "f16": torch.randn(3, generator=g).half(),
               "i64": torch.arange(5), "i32": torch.arange(3, dtype=torch.int32),
               "u8": torch.arange(3, dtype=torch.uint8), "mask": torch.rand(4, generator=g) > 0.5,
               "f64": torch.randn(2, 2, generator=g).double(),
               "\u00e9": torch.ones(1), "view": torch.randn(4, 4, generator=g).t()}  # not contiguous: written packed
    out = tmp_path / "w.safetensors"
    for metadata in ({"k": 'v\u00e9\n/\x01"'}, {}, None):
        writing.write_safetensors(tensors, out, metadata)
        assert out.read_bytes() == save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    base = torch.zeros(4)
    with pytest.raises(ValueError, match="share memory"):
        writing.write_safetensors({"a": base, "b": base[:2]}, out)
    with pytest.raises(ValueError, match="cannot hold"):
        writing.write_safetensors({"a": [1.0]}, out)


def _modes(root: Path) -> dict[str, int]:
    import stat

    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_every_file_of_an_artifact_gets_the_usual_permissions(tmp_path: Path):
    # safetensors writes through a temporary file (0600), as tempfile.mkstemp / mkdtemp do: when an artifact is
    # finalised every file gets what a plain open would give (0666 less the umask), every folder 0777 less the umask.
    import os
    import tempfile

    import torch

    spm = tmp_path / "x.model"
    spm.write_bytes(b"spm")
    old = os.umask(0o027)
    try:
        writing.write_checkpoint(tmp_path / "ck", state_dict={"w": torch.ones(2)}, meta=artifacts.CheckpointManifest(
            model_config={}, step=1, vocab={"size": 2, "spm_sha256": artifacts.file_hash(spm)}),
            trainer_state={"step": 1}, spm=spm, spm_vocab=spm)
        with writing.ArtifactWriter(tmp_path / "other", "plots") as w:
            fd, _ = tempfile.mkstemp(dir=w.path("sub/deeper/x").parent)
            os.close(fd)
            Path(tempfile.mkdtemp(dir=w.tmp)).joinpath("f").write_text("x")
            os.symlink("sub", w.path("link"))
    finally:
        os.umask(old)
    for root in (tmp_path / "ck", tmp_path / "other"):
        modes = _modes(root)
        assert {m for p, m in modes.items() if (root / p).is_file() and not (root / p).is_symlink()} == {0o640}, modes
        assert {m for p, m in modes.items() if (root / p).is_dir()} == {0o750}, modes
    assert len(_modes(tmp_path / "ck")) == 1 + 5  # the folder, weights, trainer.pt, spm.model, spm.vocab, manifest


@pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
@pytest.mark.parametrize("fmt", ["marian", "ctranslate2"])
def test_every_file_of_an_export_gets_the_usual_permissions(tmp_path: Path, fmt: str):
    # The Hugging Face export's files come from save_pretrained (safetensors: 0600), CTranslate2's from its converter;
    # all of them, and the checkpoint exported, have the one mode every other artifact file has.
    import os

    import torch
    from conftest import train_spm

    from mtpipe.stages import export
    from mtpipe.config import ModelConfig, to_dict
    from mtpipe.model.transformer import Transformer

    pytest.importorskip("transformers" if fmt == "marian" else "ctranslate2")
    sp = train_spm(tmp_path / "spm", [f"the {w} sees a {v} ." for w in "dog cat man child".split()
                                      for v in "ball book house apple".split()], 40)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(preset="tiny", dropout=0.0, max_positions=32), sp.get_piece_size())
    spm = tmp_path / "spm.model"
    writing.write_checkpoint(tmp_path / "ck", state_dict=model.state_dict(), meta=artifacts.CheckpointManifest(
        model_config=to_dict(model.cfg), step=1,
        vocab={"spm_sha256": artifacts.file_hash(spm), "size": sp.get_piece_size()}), spm=spm)
    out = tmp_path / "export"
    if fmt == "marian":
        export.export_huggingface(tmp_path / "ck", None, out, "marian")
    else:
        export.export_ctranslate2(tmp_path / "ck", None, out)
    umask = os.umask(0)
    os.umask(umask)
    for root in (tmp_path / "ck", out):
        modes = _modes(root)
        assert {m for p, m in modes.items() if (root / p).is_file()} == {0o666 & ~umask}, modes
        assert {m for p, m in modes.items() if (root / p).is_dir()} == {0o777 & ~umask}, modes
    assert fmt != "marian" or "model.safetensors" in _modes(out)
