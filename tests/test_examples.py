"""The examples (examples/*/dvc.yaml): each one's `dvc repro` end to end on a tiny corpus, in a fresh git + DVC
repository holding a copy of the example, so that an example whose stages, params or paths no longer fit mtpipe
fails here. Only sizes are shrunk (the corpus, the vocabulary, the models, the updates); every stage runs."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, write_corpus
from mtpipe.artifacts import read_manifest, read_table
from test_pipeline import DVC, run

EXAMPLES = REPO / "examples"
TRAIN_PAIRS = 300


def shrink(params: dict) -> dict:
    """A params file's sections shrunk to run in seconds (the sections it does not have stay absent)."""
    tiny = {
        "bpe": dict(vocab_size=300, threads=1),
        "bucket": dict(max_tokens=512),
        "model": dict(preset="tiny", encoder_layers=1, decoder_layers=1, d_model=32, d_ff=64, heads=2),
        "train": dict(max_steps=4, max_epochs=0, max_time=0, warmup=2, tokens_per_update=512, threads=1,
                      save_every_steps=2, save_every_progress=0, valid_every_steps=4, nproc="1"),
        "average": dict(last=2),
        "decode": dict(threads=1, max_len_b=10, min_len=3),  # min_len: a few updates' model may say nothing
    }
    for section, values in tiny.items():
        if section in params:
            params[section].update(values)
    return params


def tiny_copy(name: str, tmp_path: Path, corpus: Path, variables: dict | None = None) -> Path:
    """examples/<name> in a fresh git + DVC repository, its corpus the tiny one, its sizes shrunk, its train
    slices scaled from Multi30k's 29,000 pairs to the tiny corpus's, and ``variables`` set in its dvc.yaml."""
    repo = tmp_path / name
    shutil.copytree(EXAMPLES / name, repo)
    if variables:
        pipeline = yaml.safe_load((repo / "dvc.yaml").read_text(encoding="utf-8"))
        for entry in pipeline["vars"]:
            entry.update({k: v for k, v in variables.items() if k in entry})
        (repo / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False), encoding="utf-8")
    for path in sorted(p for p in repo.rglob("*.yaml") if p.name != "dvc.yaml"):
        params = shrink(yaml.safe_load(path.read_text(encoding="utf-8")))
        fetch = params.get("fetch", {})
        if path.name == "params.yaml":
            fetch["source"] = str(corpus)
        if "train_slice" in fetch:
            fetch["train_slice"] = ":".join(str(int(x) * TRAIN_PAIRS // 29000) if x else ""
                                            for x in fetch["train_slice"].split(":"))
        path.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    run(repo, "git", "init", "-q")
    run(repo, *DVC, "init", "-q")
    run(repo, *DVC, "config", "core.analytics", "false")
    return repo


@pytest.fixture
def tiny_corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus", {"train": TRAIN_PAIRS, "val": 20, "test_2016_flickr": 20})


def stages_run(output: str) -> list[str]:
    return re.findall(r"Running stage '([\w@-]+)'", output)


def test_backtranslation_example(tmp_path: Path, tiny_corpus: Path) -> None:
    """Every stage of the example runs; of the five en->de runs, whose stages are one template (dvc.yaml's
    ``runs``), one is trained here (bt_tagged: the one that needs every other stage), while every corpus is built."""
    repo = tiny_copy("backtranslation", tmp_path, tiny_corpus, {"runs": ["bt_tagged"]})
    ran = stages_run(run(repo, *DVC, "repro"))
    assert {s.split("@")[0] for s in ran} == {s.split("@")[0] for s in yaml.safe_load(
        (EXAMPLES / "backtranslation" / "dvc.yaml").read_text(encoding="utf-8"))["stages"]}
    assert {"cut@a", "cut@full", "back_translate@bt_sample", "synthetic@bt_sample"} <= set(ran)
    tagged = read_table(repo / "data" / "bt_tagged", "train.parquet", "corpus").to_pydict()
    a = read_table(repo / "data" / "a", "train.parquet", "corpus").to_pydict()
    mono = read_table(repo / "data" / "mono", "train.parquet", "corpus").to_pydict()
    n = len(a["id"])
    assert tagged["src"][:n] == a["src"] and all(s.startswith("<BT> ") for s in tagged["src"][n:])
    assert tagged["tgt"][n:] and set(tagged["tgt"][n:]) <= set(mono["src"])  # B's German, as targets
    assert 0 <= json.loads((repo / "metrics" / "bt_tagged.json").read_text())["bleu"] <= 100
    assert stages_run(run(repo, *DVC, "repro")) == []


def test_distillation_example(tmp_path: Path, tiny_corpus: Path) -> None:
    repo = tiny_copy("distillation", tmp_path, tiny_corpus)
    ran = stages_run(run(repo, *DVC, "repro"))
    assert len(ran) == 33
    hyps = read_table(repo / "data" / "teacher_hyps", "train.parquet", "hypotheses").to_pydict()
    distilled = read_table(repo / "data" / "distilled", "train.parquet", "corpus").to_pydict()
    teacher = dict(zip(hyps["id"], hyps["hypothesis"]))
    assert distilled["tgt"] == [teacher[i] for i in distilled["id"]]  # where kept: empty outputs are cleaned away
    student = read_manifest(repo / "models" / "distilled_average", "checkpoint")
    assert student is not None
    for model in ("teacher", "reference", "distilled"):
        for search in ("beam", "paperbeam", "greedy"):
            assert 0 <= json.loads((repo / "metrics" / f"{model}_{search}.json").read_text())["bleu"] <= 100


def test_the_benchmarks_figures_render_in_the_docs(tmp_path: Path) -> None:
    """bench/backtranslation.py's and bench/distillation.py's figures (bench/example_runs.py's rows) as
    docs/examples.md shows them: a cell per seed, the mean and its difference from A alone's; a row trained once
    (the teacher) shows its one seed."""
    sys.path.insert(0, str(REPO))
    from tools import docs

    def model(bleu: float, ratio: float = 1.01) -> dict:
        return {"bleu": bleu, "chrf": 60.0, "ratio": ratio, "updates": 3000, "train_minutes": 37.0}

    def rows(runs: list[dict], names: list[str]) -> dict:  # the results file's rows, as bench/example_runs.py writes them
        out = {}
        for row in names:
            have = [r for r in runs if row in r["models"]]
            got = [r["models"][row] for r in have]
            out[row] = {"bleu": [g["bleu"] for g in got], "chrf": [g["chrf"] for g in got],
                        "bleu_mean": round(sum(g["bleu"] for g in got) / len(got), 2),
                        "chrf_mean": round(sum(g["chrf"] for g in got) / len(got), 2), "ratio": [g["ratio"] for g in got],
                        "updates": [g["updates"] for g in got], "train_minutes": [g["train_minutes"] for g in got],
                        "seeds": [r["seed"] for r in have]}
        return out

    def write(name: str, figures: dict) -> None:
        doc = {"name": name, "command": f"python bench/{name}.py --data /data/multi30k", "date": "2026-12-01",
               "machine": {"cpu": {"cpus": 2}, "torch": "2.9"}, "figures": figures}
        (tmp_path / f"{name}-20261201T000000Z.json").write_text(json.dumps(doc), encoding="utf-8")

    assert "Not measured" in docs.render_backtranslation(tmp_path) and "Not measured" in docs.render_distillation(
        tmp_path)
    runs = [{"seed": s, "models": {"a": model(30.0 + s), "bt_beam": model(31.5 + s), "bt_sample": model(31.3 - s)}}
            for s in (1, 2)]
    write("backtranslation", {"budget_minutes": 37, "pairs": "all", "rows": {"a": "A alone", "bt_beam": "A + BT"},
                              "results": rows(runs, ["a", "bt_beam", "bt_sample"]),
                              "added_to": "backtranslation-20261130T000000Z.json"})
    table = docs.render_backtranslation(tmp_path)
    assert "| A alone | 31.00 / 32.00 | 31.50 | 60.0 | 1.01 / 1.01 | 3,000 / 3,000 | 37.0 / 37.0 |" in table
    assert "| A + BT | 32.50 / 33.50 | 33.00 (+1.50) |" in table and "`python bench/backtranslation.py" in table
    assert "come from [`backtranslation-20261130T000000Z.json`](" in table
    assert "- A + BT against A alone: +1.50 BLEU (+1.50, +1.50 seed by seed: each seed the same way)." in table
    assert "- bt_sample against A alone: -1.70 BLEU (-0.70, -2.70 seed by seed: each seed the same way)." in table
    runs = [{"seed": 1, "models": {"teacher_beam": model(38.0), "distilled_beam": model(35.0, 1.25),
                                   "reference_beam": model(34.0)}},
            {"seed": 2, "models": {"distilled_beam": model(36.0, 1.3), "reference_beam": model(36.5)}}]
    speed = {m: {s: {"median": v} for s in ("beam", "greedy")} for m, v in (("teacher", 50.0), ("distilled", 200.0))}
    write("distillation", {"budget_minutes": 37, "pairs": 2000, "models": {"teacher": "teacher"},
                           "searches": {"beam": "beam 4"},
                           "results": rows(runs, ["teacher_beam", "distilled_beam", "reference_beam"]),
                           "speed_sentences_per_s": speed, "speed_threads": 2})
    table = docs.render_distillation(tmp_path)
    assert "| teacher | beam 4 | 38.00 | 38.00 |" in table
    assert "| distilled | beam 4 | 35.00 / 36.00 | 35.50 | 60.0 | 1.25 / 1.30 |" in table
    assert ("- beam 4: the student on the teacher's output against the student on the references, +0.25 BLEU (+1.00, "
            "-0.50 seed by seed: the seeds disagree).") in table
    assert "| distilled | 200.0; 4.00x | 200.0; 4.00x |" in table and "with 2 threads:" in table
    speed = {m: {s: {"median": v[1], "rounds": v} for s in ("beam", "greedy")}
             for m, v in (("teacher", [40.0, 50.0, 60.0]), ("distilled", [100.0, 200.0, 300.0]))}
    write("distillation", {"budget_minutes": 37, "pairs": 2000, "models": {"teacher": "teacher"},
                           "results": rows(runs, ["teacher_beam"]), "speed_sentences_per_s": speed,
                           "speed_threads": 1})
    table = docs.render_distillation(tmp_path)
    assert "| distilled | 200.0; 4.00x (2.50-5.00) |" in table and "with 1 thread:" in table
    assert "the first 2,000 pairs of Multi30k's training split" in table
