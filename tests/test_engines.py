"""The engine registry (mtpipe/registry.py) and the one opening path (mtpipe/engine/opening.py): the registry is the
only place that branches on an engine's name; decode.engine's choices are its names, an unknown one failing in one
line that names them; each entry opens through a ModelSource of the engine layer that only the opening path imports;
every command that opens a model (decode, serve, attention, export, CTranslate2's conversion) gets a checkpoint's
model through mtpipe.engine.loading.open_checkpoint; the warm-up is chosen in one place."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from conftest import synthetic_pairs, train_spm
from test_layering import closure, layer
from typer.testing import CliRunner

from mtpipe import artifacts, registry, writing
from mtpipe.cli import app
from mtpipe.config import DecodeConfig, ModelConfig, ServeConfig, check_sections, to_dict
from mtpipe.engine import loading, opening
from mtpipe.engine.protocol import ModelSource
from mtpipe.engine.search import DecodeRules
from mtpipe.errors import MtpipeError
from mtpipe.model.transformer import Transformer

REPO = Path(__file__).resolve().parents[1]
REGISTRY = REPO / "mtpipe" / "registry.py"

# --------------------------------------------------------------------------------------------------------------------
# Engine names are branched on in the registry alone
# --------------------------------------------------------------------------------------------------------------------

# "mtpipe" also names the package (error kinds, versions), and "ctranslate2" is also an export.format value: a
# constant is an engine's name where the other side of the comparison speaks of an engine, or, for the names that mean
# nothing else, anywhere but beside an export format.
ONLY_ENGINES = {name for name in registry.ENGINES if name != "mtpipe"}


ENGINE_WORD = re.compile(r"(?<![A-Za-z])engine(?![A-Za-z])")  # cfg.engine, engine_name; not torch's *_engines


def _strings(node: ast.AST) -> set[str]:
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def engine_branches(source: str) -> list[str]:
    """``line: code`` of each place in ``source`` that decides by an engine's name: a comparison of something named
    engine (``cfg.engine``, ``engine_name``...) with a string, or of a string naming only an engine
    (``"ctranslate2"``, ``"ensemble"``) with anything but a format; a ``match`` on an engine; a registry entry looked
    up by a literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            texts = [ast.unparse(p) for p in parts]
            strings = set().union(*(_strings(p) for p in parts))
            by_engine = any(ENGINE_WORD.search(t) for t in texts) and strings
            by_name = strings & ONLY_ENGINES and not any("format" in t for t in texts)
            if by_engine or by_name:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Match) and ENGINE_WORD.search(ast.unparse(node.subject)):
            found.append(f"{node.lineno}: match {ast.unparse(node.subject)}")
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("ENGINES") \
                and _strings(node.slice):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_the_detector_finds_each_kind_of_branch_on_an_engine_name():
    code = ("if cfg.engine == 'ctranslate2': pass\n"
            "if decode.engine != 'mtpipe': pass\n"
            "ok = self.engine in ('mtpipe', 'ctranslate2')\n"
            "if name == 'ensemble': pass\n"
            "match cfg.engine:\n    case 'mtpipe': pass\n"
            "entry = registry.ENGINES['ctranslate2']\n")
    assert [line.split(":")[0] for line in engine_branches(code)] == ["1", "2", "3", "4", "5", "7"]
    harmless = ("if self.engine is None: pass\n"
                "if m.extra.get('format') != 'ctranslate2': pass\n"
                "if kind == 'mtpipe': pass\n"
                "entry = registry.ENGINES[cfg.engine]\n"
                "ok = 'fbgemm' in torch.backends.quantized.supported_engines\n")
    assert engine_branches(harmless) == []


def test_the_registry_is_the_only_place_that_branches_on_an_engine_name():
    found = [f"{path.relative_to(REPO)}:{line}" for path in sorted((REPO / "mtpipe").rglob("*.py"))
             if path != REGISTRY for line in engine_branches(path.read_text(encoding="utf-8"))]
    assert not found, "decisions by an engine's name outside mtpipe/registry.py (give the entry a field or a " \
                      "check instead):\n" + "\n".join(found)


# --------------------------------------------------------------------------------------------------------------------
# decode.engine against the registry
# --------------------------------------------------------------------------------------------------------------------


def test_decode_engine_takes_the_registered_names_and_an_unknown_one_fails_in_one_line_naming_them(tmp_path):
    engine_field = {f.name: f for f in dataclasses.fields(DecodeConfig)}["engine"]
    assert engine_field.metadata["choices"] == registry.ENGINE_NAMES == ("mtpipe", "ctranslate2")
    for name in registry.ENGINE_NAMES:
        assert registry.named(DecodeConfig(engine=name)).name == name
    with pytest.raises(MtpipeError, match=r"decode\.engine = 'marian' is not one of mtpipe, ctranslate2$"):
        DecodeConfig(engine="marian")
    (tmp_path / "params.yaml").write_text("decode:\n  engine: marian\n", encoding="utf-8")
    for args in (["--engine", "onnx"], ["--params", str(tmp_path / "params.yaml")]):
        r = CliRunner().invoke(app, ["decode", *args, "--input", "-"], input="a line\n")
        lines = r.output.strip().splitlines()
        assert r.exit_code == 1 and len(lines) == 1, r.output
        assert lines[0].startswith("error: ") and "is not one of mtpipe, ctranslate2" in lines[0], r.output


def test_each_engine_s_config_check_comes_from_its_entry():
    """CTranslate2's refusals, an ensemble's, sampling and continuous batching by what the entries declare."""
    with pytest.raises(MtpipeError, match="decode.precision: bf16 applies to engine mtpipe"):
        DecodeConfig(engine="ctranslate2", precision="bf16")
    with pytest.raises(MtpipeError, match="an ensemble is decoded by engine mtpipe's eager step"):
        DecodeConfig(engine="ctranslate2", ensemble=["other"])
    with pytest.raises(MtpipeError, match="sampling is engine mtpipe's; engine ctranslate2 searches"):
        DecodeConfig(engine="ctranslate2", sampling_topk=5)
    with pytest.raises(MtpipeError, match="continuous needs decode.engine=mtpipe"):
        check_sections(serve=ServeConfig(batching="continuous"), decode=DecodeConfig(engine="ctranslate2"))
    assert DecodeConfig(ensemble=["other"], sampling_topk=3).ensemble == ["other"]  # the ensemble engine samples
    assert registry.chosen(DecodeConfig(ensemble=["other"])).name == "ensemble"
    assert registry.chosen(DecodeConfig()).name == "mtpipe"


# --------------------------------------------------------------------------------------------------------------------
# Each entry opens through a ModelSource that the opening path alone imports
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(registry.ENGINES))
def test_each_entry_opens_through_an_engine_layer_model_source_without_a_hidden_cycle(name):
    entry = registry.ENGINES[name]
    module, _, cls_name = entry.opens.partition(":")
    assert layer(module)[1] == "engine", f"{entry.opens}: a ModelSource belongs to the engine layer"
    cfg = DecodeConfig(**({entry.picked_by: ["other"]} if entry.picked_by != registry.BY_ENGINE else {"engine": name}))
    cls = opening.source_class(cfg)
    assert cls.__module__ == module and cls.__name__ == cls_name and issubclass(cls, ModelSource)
    for method in ("check", "locate", "open"):  # its own, or an engine's it builds on: never the protocol's
        assert getattr(cls, method).__qualname__.split(".")[0] != "ModelSource", f"{entry.opens} lacks {method}"
    # mtpipe.engine.opening imports the module by its name (an import the layering test does not see): the module
    # must not import opening back, lazily or not.
    assert "mtpipe.engine.opening" not in closure({module}), f"{module} imports mtpipe.engine.opening"


def test_only_the_opening_path_imports_what_an_entry_names():
    readers = [str(path.relative_to(REPO)) for path in sorted((REPO / "mtpipe").rglob("*.py"))
               if path != REGISTRY and re.search(r"\.opens\b", path.read_text(encoding="utf-8"))]
    assert readers == ["mtpipe/engine/opening.py"]


# --------------------------------------------------------------------------------------------------------------------
# Every command opens a checkpoint's model through one path
# --------------------------------------------------------------------------------------------------------------------

OPENERS = ("load_model_and_vocab", "build_checkpoint_model", "load_checkpoint", "build_model")


def test_no_command_that_opens_a_model_builds_one_its_own_way():
    """What decode, serve, attention, export and CTranslate2's conversion run (the engine layer, their stages, the
    server) rebuilds a checkpoint's model in mtpipe/engine/loading.py alone, which they reach through
    open_checkpoint."""
    scope = [p for p in sorted((REPO / "mtpipe").rglob("*.py")) if p.parent.name in ("engine", "serve")
             or p.name in ("decode.py", "decode_corpus.py", "attention.py", "export.py")]
    assert len(scope) > 20
    found = []
    for path in scope:
        if path.name == "loading.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if called in OPENERS:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {called}")
    assert not found, "models opened around mtpipe.engine.loading.open_checkpoint:\n" + "\n".join(found)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A bpe artifact and a random tiny checkpoint trained with its SentencePiece model, and an empty params file."""
    root = tmp_path_factory.mktemp("engines")
    sp = train_spm(root / "spm", [s for pair in synthetic_pairs(200, seed=3) for s in pair], vocab_size=120)
    tokens = root / "tokens"
    with writing.ArtifactWriter(tokens, "tokens") as w:
        w.write_table("test.parquet", pa.table({"id": [0, 1], "src": [sp.encode("ka lo"), sp.encode("mi su")],
                                                "tgt": [sp.encode("mi"), sp.encode("ka")]}))
        shutil.copy(root / "spm.model", w.path("spm.model"))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(preset="tiny", dropout=0.0, max_positions=16), sp.get_piece_size()).eval()
    checkpoint = root / "ckpt"
    writing.write_checkpoint(checkpoint, state_dict=model.state_dict(), meta=artifacts.CheckpointManifest(
        model_config=to_dict(model.cfg), step=3,
        vocab={"spm_sha256": artifacts.file_hash(root / "spm.model"), "size": sp.get_piece_size()}))
    (root / "params.yaml").write_text("", encoding="utf-8")
    return {"root": root, "tokens": tokens, "checkpoint": checkpoint}


@pytest.fixture
def opened(monkeypatch) -> list[tuple[Path, str]]:
    """``(checkpoint, the function that asked)`` of every checkpoint rebuilt as a model from now on."""
    calls: list[tuple[Path, str]] = []
    real = loading.load_model_and_vocab

    def recording(checkpoint, tokens=None):
        calls.append((Path(checkpoint), inspect.stack()[1].function))
        return real(checkpoint, tokens)

    monkeypatch.setattr(loading, "load_model_and_vocab", recording)
    return calls


def _command(world: dict, tmp_path: Path, command: str) -> None:
    ck, tok, params = str(world["checkpoint"]), str(world["tokens"]), str(world["root"] / "params.yaml")
    args = {
        "decode": ["decode", "--params", params, "--checkpoint", ck, "--tokens", tok, "--threads", "1"],
        "decode ctranslate2": ["decode", "--params", params, "--checkpoint", ck, "--tokens", tok, "--threads", "1",
                               "--engine", "ctranslate2"],
        "attention": ["attention", "--checkpoint", ck, "--tokens", tok, "--text", "ka lo", "--out",
                      str(tmp_path / "maps")],
        "export": ["export", "--params", params, "--checkpoint", ck, "--tokens", tok, "--out", str(tmp_path / "ct2")],
    }[command]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("command", ["decode", "decode ctranslate2", "attention", "export", "serve"])
def test_every_command_opens_the_checkpoint_through_open_checkpoint(world, tmp_path, opened, command):
    if "ctranslate2" in command or command == "export":
        pytest.importorskip("ctranslate2")
    if command == "serve":  # what mtpipe serve and its worker processes run to open the model
        opening.open_model(DecodeConfig(threads=1), world["checkpoint"], world["tokens"])
    else:
        _command(world, tmp_path, command)
    assert opened and all(ck == world["checkpoint"] for ck, _ in opened), opened
    assert {caller for _, caller in opened} == {"open_checkpoint"}, opened


def test_an_export_given_to_a_command_that_reads_checkpoints_is_refused_in_one_line(world, tmp_path):
    pytest.importorskip("ctranslate2")
    _command(world, tmp_path, "export")
    with pytest.raises(MtpipeError, match="is an `mtpipe export` model; decode it with --engine ctranslate2"):
        opening.locate(DecodeConfig(), tmp_path / "ct2", world["tokens"])
    with pytest.raises(MtpipeError, match="is an `mtpipe export` model; serve it with --engine ctranslate2"):
        opening.check_source(DecodeConfig(), tmp_path / "ct2", "serve")
    opening.check_source(DecodeConfig(engine="ctranslate2"), tmp_path / "ct2", "serve")  # CTranslate2 reads it


# --------------------------------------------------------------------------------------------------------------------
# The warm-up, chosen once
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Recorder:
    """An engine's warm-up as the opening path calls it: the groups' sizes, the beams, continuous or not."""

    compiled: bool
    max_positions: int = 16
    calls: list = dataclasses.field(default_factory=list)

    def warm_up(self, groups, rules, beams=(), continuous=False) -> float:
        self.calls.append(([len(g) for g in groups], tuple(beams), continuous))
        return 1.5


def test_the_warm_up_is_chosen_by_the_work_ahead(world):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(world["tokens"] / "spm.model"))
    rules = DecodeRules.from_config(DecodeConfig())
    for compiled in (False, True):
        engine = Recorder(compiled)
        assert opening.warm_up(engine, rules, opening.REQUESTS, sp=sp, beams=(1, 8), continuous=True) == 1.5
        lines = opening.warm_up(engine, rules, opening.LINES, sp=sp)
        batches = opening.warm_up(engine, rules, opening.BATCHES, sources=[[5]] * 10)
        assert opening.warm_up(engine, rules, opening.BATCHES, sources=[]) is None
        # a server always warms up; stdin and a file only build a compiled step, outside the timed decoding
        assert (lines, batches) == ((1.5, 1.5) if compiled else (None, None))
        assert engine.calls == [([1, 3], (1, 8), True)] + ([([4, 1], (), False), ([8, 1], (), False)] if compiled
                                                            else [])


def test_nothing_but_the_opening_path_chooses_what_an_engine_warms_up_on():
    found = []
    for path in sorted((REPO / "mtpipe").rglob("*.py")):
        if path.name == "opening.py":
            continue
        text = path.read_text(encoding="utf-8")
        found += [f"{path.relative_to(REPO)}: {m.group(0)}"
                  for m in re.finditer(r"\bWARM_UP_TEXTS\b|\bengine\.warm_up\(", text)]
    assert not found, "warm-ups chosen outside mtpipe/engine/opening.py:\n" + "\n".join(found)
