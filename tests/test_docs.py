"""The documentation cannot rot: README.md and docs/ are checked against the code and the results files.

- Generated text (docs/configuration.md, docs/cli.md, every rendered table) equals what ``tools/docs.py`` (``make
  docs``) writes now, and the renderers turn a results file of each benchmark into a table.
- README.md stays under 200 lines; every relative link (and its #anchor) resolves; no link leaves the repository.
- Outside rendered blocks and docs/journal/, no page names a CPU by code name, a commit hash, a date or an issue.
- Every ``sh`` block is valid shell, and every command in it is checked: ``mtpipe`` command lines are parsed by the
  Typer app itself (an unknown command or option, or a bad value, fails), ``make`` targets, ``dvc`` stages and
  ``-S`` keys, pip extras and repository paths must exist. Blocks that need nothing beyond a small project run for
  real, in order, on a tiny corpus; a block with a ``# needs: ...`` comment (a GPU, the network, ...) or a hidden
  ``<!-- docs-test: flags: tests/test_x.py -->`` line before it (another test runs it) is only parsed.
- Every ``yaml`` block is a valid piece of params.yaml.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import REPO

spec = importlib.util.spec_from_file_location("mtpipe_docs", REPO / "tools" / "docs.py")
docs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docs)

PAGES = docs.pages(REPO)
CHECKED = [*PAGES, REPO / "bench" / "README.md", REPO / "BENCHMARKS.md"]  # user-facing: the prose rules apply
LINKED = [*CHECKED, *sorted((REPO / "docs" / "journal").glob("*.md"))]
FENCE = re.compile(r"(?:<!-- docs-test: flags: (?P<covered>\S+) -->\n)?^```(?P<lang>\w*)\n(?P<body>.*?)^```$", re.S | re.M)
CODE_NAMES = re.compile(r"\b(Zen ?\d?|EPYC|Xeon|Ryzen|Threadripper|Sapphire Rapids|Emerald Rapids|Granite Rapids|"
                        r"Ice Lake|Cascade Lake|Cooper Lake|Skylake|Milan|Genoa|Turin|Bergamo|Hopper|Ampere)\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
ISSUE = re.compile(r"(?<![\w&/#])#\d+\b|\b[Ii]ssue \d+")
SHELL_OK = {"git", "cd", "cp", "mv", "sed", "echo", "curl", "cat", "head", "tail", "source", ".", "export", "set",
            "sbatch", "scontrol", "mkdir", "ls", "printf", "true", "sort"}
WRAPPERS = {"srun", "exec", "env", "nohup", "time"}
REPO_DIRS = ("recipes/", "stages/", "bench/", "tools/", "docs/", "tests/", "mtpipe/")


def blocks(lang: str = "sh") -> list[tuple[str, str, str | None]]:
    """(page:line, body, covering test) of every fenced block of ``lang`` in the user-facing pages."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m["lang"] == lang:
                found.append((f"{page.relative_to(REPO)}:{text[:m.start('body')].count(chr(10))}", m["body"],
                              m["covered"]))
    return found


def without_rendered(text: str) -> str:
    return docs.BLOCK.sub("", text)


# --------------------------------------------------------------------------------------------------------------------
# Generated pages and rendered tables
# --------------------------------------------------------------------------------------------------------------------


def test_generated_pages_and_tables_are_current() -> None:
    stale = [str(p.relative_to(REPO)) for p, text in docs.expected(REPO).items()
             if not p.exists() or p.read_text(encoding="utf-8") != text]
    assert not stale, f"run `make docs`: these pages differ from what tools/docs.py writes: {stale}"


def test_every_params_key_and_command_is_documented() -> None:
    from mtpipe.config import SECTIONS

    configuration = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    cli = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    for name, cls in SECTIONS.items():
        assert f"## {name}\n" in configuration
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in configuration, f"{name}.{f.name}"
    for name in docs.cli_group().commands:
        assert f"## mtpipe {name}\n" in cli


def write_result(directory: Path, name: str, figures: dict, stamp: str = "20261201T000000Z", **machine) -> None:
    doc = {"name": name, "command": f"python bench/{name}.py", "commit": "abc1234", "date": "2026-12-01T00:00:00+00:00",
           "machine": {"cpu": {"model": "Some CPU", "cpus": 4}, "torch": "2.13.0", "native_bf16": False, "gpu": False,
                       "environment": {}, **machine}, "figures": figures}
    (directory / f"{name}-{stamp}.json").write_text(json.dumps(doc), encoding="utf-8")


def test_results_files_render_as_tables_and_no_file_as_not_measured(tmp_path: Path) -> None:
    for name in docs.RENDERERS:
        if name != "code-map":
            assert "Not measured" in docs.RENDERERS[name](tmp_path), name
    write_result(tmp_path, "quickstart", {"isa": "native", "runs": [
        {"test_bleu": 39.5, "pipeline_min": 37.4, "updates": 9000}, {"test_bleu": 39.9, "pipeline_min": 37.3,
                                                                      "updates": 9100}]}, native_bf16=True)
    write_result(tmp_path, "serve", {"settings": {"clients": 8, "sentences": 500}, "ratio_median": 0.5,
                                     "target": ">= 0.70x", "verdict": "MISSED"})
    write_result(tmp_path, "anchors", {"smoke": False, "summary": [
        {"group": "train small", "system": "mtpipe fp32", "unit": "src+tgt tok/s", "median": 5000.0, "min": 4800.0,
         "max": 5100.0, "ratios": {"fairseq": [1.2, 1.25, 1.3]}, "target": 1.5, "pass": False}]})
    table = docs.render_quickstart(tmp_path)
    assert "| AVX-512 bf16 CPU | 39.50 / 39.90 | 37.4 / 37.3 | 9,000 / 9,100 |" in table
    assert "| AVX2 CPU | not measured |" in table and "4-core AVX-512 bf16 CPU" in table
    assert "Some CPU" not in table and "abc1234" not in table  # machines by capability; no commit
    served = docs.render_serve(tmp_path)
    assert "| 8 | 500 | params.yaml's | 0.50x (0.50-0.50) | not run | – / – | >= 0.70x | MISSED |" in served
    # a second serving run of the same commit (other server settings) is a row of its own, with its rounds' spread
    write_result(tmp_path, "serve", {"settings": {"clients": 8, "sentences": 500, "serve_args": "--workers 2"},
                                     "ratio_median": 0.6, "target": ">= 0.70x", "verdict": "MISSED", "rounds": [
        {"ratio": r, "p50_ms": p, "p99_ms": 2 * p, "ceiling_ratio": r + 0.1} for r, p in ((0.5, 40.0), (0.6, 50.0),
                                                                                       (0.7, 60.0))]},
                 stamp="20261201T010000Z")
    served = docs.render_serve(tmp_path)
    assert "| 8 | 500 | params.yaml's | 0.50x" in served
    assert "| `--workers 2` | 0.60x (0.50-0.70) | 0.70x | 50 / 100 |" in served
    assert "1.25x fairseq" in docs._anchors("train")(tmp_path)
    # training against the plain loop: the spread, the share of the run's own matmul peak, the target's verdict
    ratio = {"min": 1.1, "median": 1.25, "max": 1.4}
    write_result(tmp_path, "train_throughput", {"peaks_gflops": {"fp32": [90.0, 110.0], "bf16": []}, "rows": [
        {"config": "base", "system": "mtpipe fp32", "tgt_tokens_per_s": 400.0, "gflops": 80.0,
         "ratio_to_reference": ratio, "target": 1.3}]})
    assert "| base | mtpipe fp32 | 400 | 1.25x (1.10-1.40) | 80 % | >= 1.3x: MISSED |" in docs.render_train_throughput(
        tmp_path)
    assert "Not measured" in docs._anchors("decode")(tmp_path)
    # quality at an equal budget: each side's choice on valid, its test BLEU, the difference against the target
    side = {"updates": 3000, "model": "average", "alpha": 1.0, "length_penalty": "|Y|^alpha",
            "valid_bleu": {"average alpha=1": 38.0, "last alpha=1": 37.0}, "bleu": 37.5}
    write_result(tmp_path, "anchors-quality", {"quality": {"minutes": 37.0, "fairseq": side, "mtpipe": {
        **side, "bleu": 38.0}, "delta_bleu": 0.5, "pass": False}})
    quality = docs.render_quality(tmp_path)
    assert "| mtpipe | 3,000 | average, 1 (\\|Y\\|^alpha) | 38.00 | 38.00 |" in quality  # a cell's bars escaped
    assert "mtpipe - fairseq: +0.50 BLEU (target >= +1: MISSED)" in quality
    # decoding: each row's per-round ratios as a spread; the model's folder on the measuring machine shortened
    write_result(tmp_path, "decode_speed", {"model": "/scratch/run/average (step 10)", "sentences": 100, "beam": 4,
                                            "rows": [{"row": "naive", "precision": "fp32", "batches": "8,000",
                                                      "sentences_per_s": {"median": 50.0},
                                                      "mtpipe_over_row_per_round": [4.4, 4.0, 4.2],
                                                      "same_as_mtpipe": 1.0, "bleu": 30.0}]})
    speed = docs.render_decode_speed(tmp_path)
    assert speed.startswith("…/average (step 10), 100 sentences")
    assert "| 50.0 | 4.20x (4.00-4.40) | 100.0 % |" in speed
    # a later run of one part (--only decode) renders that part and leaves the other part's newest run in place
    write_result(tmp_path, "anchors", {"smoke": False, "summary": [
        {"group": "decode quickstart", "system": "mtpipe fp32", "unit": "sentences/s", "median": 200.0, "min": 190.0,
         "max": 210.0, "ratios": {"ctranslate2 fp32": [0.9, 0.8, 1.0]}, "target": 1.0, "pass": False}]},
                 stamp="20261201T020000Z")
    assert "| 190.0 / 200.0 / 210.0 | 0.90x ctranslate2 fp32 (0.80-1.00) | >= 1.0x: MISSED |" in docs._anchors(
        "decode")(tmp_path)
    assert "| 4,800.0 / 5,000.0 / 5,100.0 | 1.25x fairseq (1.20-1.30) | >= 1.5x: MISSED |" in docs._anchors(
        "train")(tmp_path)
    # a corpus in chunks: each size's peak RSS, the ratio of the largest to the smallest, the resume in words
    runs = [{"lines": n, "chunk_lines": c, "reading": "chunks" if c < n or n == 10 ** 6 else "one chunk",
             "corpus_mb": n / 1e4, "seconds": n / 1e3, "lines_per_s": 1e3, "peak_rss_mb": rss}
            for n, c, rss in ((500_000, 50_000, 700.0), (500_000, 500_000, 1300.0), (10 ** 6, 50_000, 714.0))]
    write_result(tmp_path, "decode_corpus", {"model": "tiny", "decode": "--beam 1", "threads": 1, "runs": runs,
                                             "peak_rss_mb_largest_over_smallest": 1.02, "resume": {
        "lines": 500_000, "seconds_into_unfinished_chunk": 22.2, "finished_chunks_at_kill": 3, "lines_resumed": 150_000,
        "lines_translated_by_rerun": 350_000, "lines_lost_estimate": 25_000, "seconds_lost": 118.0,
        "identical_to_uninterrupted": True}})
    corpus = docs.render_decode_corpus(tmp_path)
    assert "| 500,000 | one chunk (the whole file) | 50 | 500 | 1,000 | 1,300 |" in corpus
    assert "| 1,000,000 | chunks of 50,000 | 100 | 1,000 | 1,000 | 714 |" in corpus
    assert "Peak RSS at 1,000,000 lines is 1.02x that at 500,000" in corpus
    assert "the rerun resumed 150,000 lines and translated 350,000" in corpus and "byte-identical" in corpus
    assert "Not measured" in docs.render_fairseq_ensemble(tmp_path)
    write_result(tmp_path, "fairseq_ensemble", {"updates": 150, "search": "--beam 4", "cases": {
        "model 1": {"sentences": 200, "identical": 200, "identical_share": 1.0},
        "ensemble of both": {"sentences": 200, "identical": 199, "identical_share": 0.995}}})
    ensemble = docs.render_fairseq_ensemble(tmp_path)
    assert "| model 1 | 200 of 200 | 100.0 % |" in ensemble and "| ensemble of both | 199 of 200 | 99.5 % |" in ensemble


# --------------------------------------------------------------------------------------------------------------------
# Prose rules
# --------------------------------------------------------------------------------------------------------------------


def test_readme_is_a_short_guide() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < 200, f"README.md has {lines} lines: move detail into docs/"


def test_reproduce_states_each_recipes_kept_checkpoints_as_computed() -> None:
    """reproduce.md's disk for the checkpoints each recipe keeps: its model's parameters (counted on the meta
    device: nothing allocated) x 12 bytes (fp32 weights, Adam's two moments) x its train.keep_last."""
    import torch

    from mtpipe.config import ModelConfig
    from mtpipe.model.transformer import Transformer

    cells = []
    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        params = yaml.safe_load(recipe.read_text(encoding="utf-8"))
        with torch.device("meta"):
            n = sum(p.numel() for p in Transformer(ModelConfig(**params["model"]),
                                                   params["bpe"]["vocab_size"]).parameters())
        keep, one = params["train"]["keep_last"], n * 12 / 1e9
        cells.append(f"{keep} x {one:.2f} GB = ~{keep * one:.0f} GB ({n / 1e6:.1f}M parameters)")
    row = "| kept checkpoints (`train.keep_last` x 12 bytes a parameter) | " + " | ".join(cells) + " |"
    assert row in (REPO / "docs" / "reproduce.md").read_text(encoding="utf-8").splitlines()


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve_inside_the_repository(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        assert not re.match(r"[a-z]+:", target) and not target.startswith("/"), f"{page.name}: {target} leaves the repo"
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.relative_to(REPO)}: link to a missing file: {target}"
        assert resolved.is_relative_to(REPO), f"{page.relative_to(REPO)}: {target} leaves the repository"
        if anchor and resolved.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", resolved.read_text(encoding="utf-8"), re.M)
            assert anchor in {slug(h) for h in headings}, f"{page.relative_to(REPO)}: no heading for {target}"


@pytest.mark.parametrize("page", CHECKED, ids=lambda p: str(p.relative_to(REPO)))
def test_no_code_names_commits_dates_or_issue_numbers(page: Path) -> None:
    text = without_rendered(page.read_text(encoding="utf-8"))
    for rule, pattern in (("a CPU code name", CODE_NAMES), ("a commit hash", COMMIT), ("a date", DATE),
                          ("an issue number", ISSUE)):
        hits = pattern.findall(text)
        assert not hits, f"{page.relative_to(REPO)} names {rule}: {hits[:5]} (dated notes go to docs/journal/)"


@pytest.mark.parametrize("where,body", [(w, b) for w, b, _ in blocks("yaml")])
def test_yaml_blocks_are_valid_params(where: str, body: str) -> None:
    from mtpipe.config import SECTIONS

    for name, values in yaml.safe_load(body).items():
        assert name in SECTIONS, f"{where}: no params section '{name}'"
        SECTIONS[name](**values)  # unknown keys and broken rules raise


# --------------------------------------------------------------------------------------------------------------------
# Shell blocks: parsed
# --------------------------------------------------------------------------------------------------------------------


def logical_lines(body: str) -> list[str]:
    return [line for line in body.replace("\\\n", " ").splitlines() if line.strip()]


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line: split at pipes, lists and subshells, comments and redirections
    dropped."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split, lex.commenters = True, "#"
    commands, current, tokens = [], [], list(lex)
    skip = False
    for tok in tokens:
        if skip:
            skip = False
        elif tok in ("|", "||", "&&", ";", "&", "(", ")"):
            commands.append(current)
            current = []
        elif tok in (">", ">>", "<", "2>"):
            skip = True
        else:
            current.append(tok)
    return [c for c in [*commands, current] if c]


def check_mtpipe(args: list[str]) -> None:
    group = docs.cli_group()
    assert args and args[0] in group.commands, f"mtpipe: no command {args[:1]}"
    if {"--help", "-h"} & set(args):
        return
    ctx = group.make_context("mtpipe", [], resilient_parsing=True)
    group.commands[args[0]].make_context(args[0], list(args[1:]), parent=ctx)  # raises on a bad option or value


def check_python(args: list[str]) -> None:
    if args[:1] == ["stages/train.py"]:
        return check_mtpipe(["train", *args[1:]])
    if args[:1] == ["-m"]:
        module = args[1]
        assert module in ("pytest", "mtpipe") or (REPO / (module.replace(".", "/") + ".py")).exists() or (
            REPO / module.replace(".", "/") / "__main__.py").exists(), f"python -m {module}: no such module"
    elif args and args[0] != "-c":
        assert (REPO / args[0]).exists(), f"python {args[0]}: no such file"


def check_dvc(args: list[str]) -> None:
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    sub = {"exp": {"run", "show", "apply", "diff", "list", "remove"}, "metrics": {"show", "diff"},
           "plots": {"show", "diff"}}
    assert args[0] in {"repro", "commit", "status", "dag", "init", "pull", "push", "params", *sub}, f"dvc {args[0]}"
    if args[0] in sub:
        assert args[1] in sub[args[0]], f"dvc {args[0]} {args[1]}"
    if args[0] in ("repro", "commit"):
        for word in (a for a in args[1:] if not a.startswith("-")):
            assert word in stages, f"dvc {args[0]}: no stage {word}"
    from mtpipe.config import SECTIONS

    for setting in (b for a, b in zip(args, args[1:]) if a == "-S"):
        section, key = setting.split("=")[0].split(".")
        assert key in {f.name for f in dataclasses.fields(SECTIONS[section])}, f"dvc -S {setting}: no such key"


def check_command(words: list[str]) -> None:
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        words = words[1:]  # VAR=value before a command
    if not words:
        return
    name, args = Path(words[0]).name if words[0].startswith(".venv/bin/") else words[0], words[1:]
    for word in args:
        if word.startswith(REPO_DIRS):
            assert (REPO / word.split(":")[0]).exists(), f"{name}: no such path {word}"
    if name in WRAPPERS:
        while args and args[0].startswith("-"):
            args = args[1:]  # the wrapper's own options
        return check_command(args)
    if name == "bash" and args[:1] == ["-c"]:
        for line in logical_lines(args[1]):
            for command in simple_commands(line):
                check_command(command)
        return
    if name == "mtpipe":
        return check_mtpipe(args)
    if name in ("python", "python3"):
        return check_python(args)
    if name == "dvc":
        return check_dvc(args)
    if name == "make":
        targets = set(re.findall(r"^([\w.-]+):", (REPO / "Makefile").read_text(encoding="utf-8"), re.M))
        for word in (a for a in args if "=" not in a):
            assert word in targets, f"make: no target {word}"
        return
    if name == "pip":
        import tomllib

        extras = set(tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"][
            "optional-dependencies"])
        for word in args:
            if m := re.fullmatch(r"(?:\.|mtpipe)\[([\w,-]+)\]", word):
                assert set(m[1].split(",")) <= extras, f"pip: no extra in {word} (extras: {sorted(extras)})"
        return
    if name == "pytest":
        return
    assert name in SHELL_OK, f"unknown command {name!r}: a typo, or add it to SHELL_OK"


SH_BLOCKS = blocks("sh")


@pytest.mark.parametrize("where,body,covered", SH_BLOCKS, ids=[w for w, _, _ in SH_BLOCKS])
def test_shell_blocks_parse_and_name_real_commands_and_options(where: str, body: str, covered: str | None) -> None:
    syntax = subprocess.run(["bash", "-n"], input=body, text=True, capture_output=True)
    assert syntax.returncode == 0, f"{where}: {syntax.stderr}"
    if covered:
        assert (REPO / covered).is_file(), f"{where}: the covering test {covered} does not exist"
    for line in logical_lines(body):
        for command in simple_commands(line):
            try:
                check_command(command)
            except AssertionError:
                raise
            except Exception as e:  # the CLI's own parse errors
                raise AssertionError(f"{where}: {' '.join(command)}: {getattr(e, 'format_message', e.__str__)()}")


# --------------------------------------------------------------------------------------------------------------------
# Shell blocks: run
# --------------------------------------------------------------------------------------------------------------------


def runnable() -> list[tuple[str, str]]:
    """The blocks that run for real, each once (README.md and docs/ share some)."""
    seen, out = set(), []
    for where, body, covered in SH_BLOCKS:
        key = "\n".join(" ".join(shlex.split(line, comments=True)) for line in logical_lines(body))
        if covered is None and "# needs:" not in body and key not in seen:
            seen.add(key)
            out.append((where, body))
    return out


BUILD = textwrap.dedent("""
    import sys
    from typer.testing import CliRunner
    from mtpipe.cli import app
    for args in (["fetch", "--out", "artifacts/fetch"], ["bpe", "--corpus", "artifacts/fetch", "--out", "artifacts/bpe"],
                 ["bucket", "--tokens", "artifacts/bpe", "--out", "artifacts/bucket"],
                 ["train", "--tokens", "artifacts/bpe", "--batches", "artifacts/bucket", "--out", "artifacts/train"],
                 ["average", "--out", "artifacts/average"], ["decode", "--out", "artifacts/decode"]):
        r = CliRunner().invoke(app, args)
        if r.exit_code:
            sys.exit(f"mtpipe {args[0]} exited {r.exit_code}: {r.output[-2000:]}")
""")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A project as the quickstart leaves it (artifacts/fetch ... artifacts/decode), on a tiny made-up corpus with
    the committed params.yaml shrunk as tests/test_pipeline.py shrinks it; built in one process of its own."""
    from conftest import synthetic_pairs, write_corpus
    from test_pipeline import environment, tiny_params

    root = tmp_path_factory.mktemp("docs_project")
    params = tiny_params(write_corpus(root / "corpus", {"train": 300, "val": 20, "test_2016_flickr": 20}))
    params["bpe"]["vocab_size"] = 200
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    for name in ("my.en", "test.en"):
        (root / name).write_text("".join(src + "\n" for src, _ in synthetic_pairs(3, 7)), encoding="utf-8")
    env = environment()
    build = subprocess.run([sys.executable, "-c", BUILD], cwd=root, env=env, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    return root, env


@pytest.mark.parametrize("where,body", runnable(), ids=[w for w, _ in runnable()])
def test_shell_blocks_run(where: str, body: str, project: tuple[Path, dict[str, str]]) -> None:
    root, env = project
    run = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", body], cwd=root, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, f"{where} exited {run.returncode}:\n{body}\n{run.stderr[-3000:]}"
    assert "Traceback" not in run.stderr, f"{where}:\n{run.stderr[-3000:]}"


def test_the_checks_catch_a_wrong_option_and_an_unknown_command() -> None:
    with pytest.raises(Exception, match="--no-such-flag"):
        check_mtpipe(["decode", "--no-such-flag"])
    with pytest.raises(AssertionError, match="unknown command"):
        check_command(["mtpip", "decode"])
    with pytest.raises(AssertionError, match="no target"):
        check_command(["make", "pipelin"])


def test_the_decoding_tricks_in_the_code_follow_their_measured_verdicts():
    """A decoding trick whose every measured spread (bench/results/decode_speed-*.json, each CPU class) includes
    1.00x is deleted, and then bench/decode_speed.py has no row for it; a trick that pays somewhere is kept, and its
    row is still there to measure it again."""
    text = (REPO / "bench" / "decode_speed.py").read_text(encoding="utf-8")
    plain = re.search(r"^PLAIN = \{(.*?)^\}", text, re.S | re.M).group(1)
    rows = set(re.findall(r'^    "([a-z0-9-]+)": \(', plain, re.M))
    verdicts = docs.trick_verdicts()
    assert verdicts, "no decode_speed results file with a trick switched off"
    wrong = [f"{t}: {v}, but {'no' if v == 'kept' else 'a'} row in bench/decode_speed.py's PLAIN"
             for t, v in verdicts.items() if t not in docs.PART_OF and v.startswith("kept") != (t in rows)]
    assert not wrong, "\n".join(wrong)


def test_a_trick_pays_only_where_its_slowest_round_gains(tmp_path: Path):
    """The verdict's rule on made-up rounds: a minimum of 1.004x (1.00x at two decimals) is no gain, 1.02x is."""
    def doc(trick: str, off: list[float]) -> dict:
        on = [10.0, 10.0, 10.0]
        return {"model": "m", "sentences": 10, "beam": 4, "rows": [
            {"row": "mtpipe", "precision": "fp32", "batches": "b", "seconds": on, "same_as_mtpipe": 1.0},
            {"row": f"mtpipe, plain {trick}", "precision": "fp32", "batches": "b", "seconds": off,
             "same_as_mtpipe": 1.0}]}
    write_result(tmp_path, "decode_speed", doc("a", [10.04, 11.0, 12.0]), stamp="20261201T010000Z")
    write_result(tmp_path, "decode_speed", doc("b", [10.2, 10.5, 11.0]), stamp="20261201T020000Z")
    assert docs.trick_verdicts(tmp_path) == {"a": "deleted", "b": "kept"}
    # a part of a trick (packing: the layout of onednn-packed's projection copy) follows the whole, whatever it pays
    write_result(tmp_path, "decode_speed", doc("packing", [11.0, 11.5, 12.0]), stamp="20261201T030000Z")
    write_result(tmp_path, "decode_speed", doc("onednn-packed", [10.0, 9.9, 10.3]), stamp="20261201T040000Z")
    assert docs.trick_verdicts(tmp_path)["packing"] == "deleted with onednn-packed"
    write_result(tmp_path, "decode_speed", doc("onednn-packed", [14.0, 13.5, 14.3]), stamp="20261201T050000Z")
    assert docs.trick_verdicts(tmp_path)["packing"] == "kept in onednn-packed"
    assert "| b | AVX2 CPU | fp32 | b | 1.05x (1.02-1.10) | yes | 100.0 % | kept |" in docs.render_decode_tricks(tmp_path)


def test_a_build_saving_trick_is_kept_where_the_engine_is_ready_sooner(tmp_path: Path):
    """twice and package save graph builds, not step time: their verdict follows the seconds to ready that
    bench/decode_speed.py records (with the trick, and without), unless their steps pay anyway."""
    def doc(ready: dict[str, float], off: list[float]) -> dict:
        rows = [{"row": "compiled", "precision": "fp32", "batches": "1sent", "seconds": [10.0] * 3,
                 "same_as_mtpipe": 1.0},
                {"row": "compiled, plain twice", "precision": "fp32", "batches": "1sent", "seconds": off,
                 "same_as_mtpipe": 1.0}]
        return {"model": "m", "sentences": 10, "beam": 4, "rows": rows,
                "warmup_seconds": [{"row": r, "precision": "fp32", "seconds": v} for r, v in ready.items()]}
    slower_steps = [9.0, 9.5, 9.8]
    write_result(tmp_path, "decode_speed", doc({"compiled": 80.0, "compiled, plain twice": 40.0,
                                                "compiled, package on disk": 3.0, "compiled, plain package": 100.0},
                                               slower_steps), stamp="20261201T010000Z")
    verdicts = docs.trick_verdicts(tmp_path)
    assert verdicts["twice"].startswith("kept") and verdicts["package"].startswith("kept")
    assert "| package | AVX2 CPU | fp32 | 3.0 | 100.0 | kept: " in docs.render_decode_tricks(tmp_path)
    write_result(tmp_path, "decode_speed", doc({"compiled, package on disk": 3.0, "compiled, plain twice": 2.9},
                                               slower_steps), stamp="20261201T020000Z")
    assert docs.trick_verdicts(tmp_path)["twice"] == "deleted"
    write_result(tmp_path, "decode_speed", doc({"compiled, package on disk": 3.0, "compiled, plain twice": 2.9},
                                               [11.0, 11.5, 12.0]), stamp="20261201T030000Z")
    assert docs.trick_verdicts(tmp_path)["twice"] == "kept"


def test_decode_corpus_renders_the_caches_comparison_per_size(tmp_path: Path) -> None:
    """bench/decode_corpus.py's bounded and default kernel caches: the table holds each size's first round; the
    comparison sentence gives min / median / max over the rounds of a size, and one figure for a size run once."""
    from tools import docs

    def run(lines: int, reading: str, k: int, rss: float, speed: float) -> dict:
        return {"lines": lines, "chunk_lines": 100, "reading": reading, "round": k, "seconds": lines / speed,
                "lines_per_s": speed, "corpus_mb": 1.0, "peak_rss_mb": rss, "exit": 0}

    runs = [run(1000, "chunks", 0, 100, 50), run(1000, "chunks, default caches", 0, 150, 50),
            run(1000, "chunks, default caches", 1, 160, 40), run(1000, "chunks", 1, 110, 48),
            run(1000, "chunks", 2, 105, 45), run(1000, "chunks, default caches", 2, 155, 50),
            run(1000, "one chunk", 0, 300, 60), run(4000, "chunks", 0, 120, 50),
            run(4000, "chunks, default caches", 0, 240, 50)]
    write_result(tmp_path, "decode_corpus", {"chunk_lines": 100, "threads": 1, "decode": "--beam 1", "model": "tiny",
                                              "runs": runs, "peak_rss_mb_largest_over_smallest": 1.2})
    text = docs.render_decode_corpus(tmp_path)
    assert text.count("| 1,000 | chunks of 100 |") == 1
    assert "| 1,000 | chunks of 100, oneDNN's default kernel caches |" in text
    assert "with oneDNN's default kernel caches 1.60x" in text
    assert ("at 1,000 lines (3 rounds) peak RSS 100 / 105 / 110 MB against 150 / 155 / 160 MB, speed 0.90 / "
            "1.00 / 1.20x; at 4,000 lines (1 round) peak RSS 120 MB against 240 MB.") in text
