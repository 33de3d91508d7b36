"""``mtpipe plots``: a training run's curves as PNGs and a self-contained HTML page, offline.

``dvc plots show`` renders the same curves (dvc.yaml declares them), but its page loads the vega libraries from a CDN:
with no network it is blank. This reads the dvclive files :mod:`mtpipe.training.metrics` writes -- ``RUN/live/plots/metrics/
{train,valid}/<name>.tsv`` (columns ``step`` and the value; ``step`` is the update count) -- and draws them with
matplotlib: train and valid loss on one chart, perplexity, learning rate (the schedule of section 5.3), valid BLEU
when it was logged, and every other series found, each chart titled with what it shows. The page is ``<img>`` tags
of the PNGs beside it: no script, no network.

The output (default ``RUN/plots``) is an artifact of kind ``plots`` (a manifest), written atomically.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpipe.errors import MtpipeError

LIVE, METRICS_DIR, INDEX = "live", Path("plots") / "metrics", "index.html"


@dataclass(frozen=True)
class Chart:
    """One PNG: the series (``train/loss``, ...) it draws, found or not, and what it shows."""

    file: str
    title: str
    ylabel: str
    series: tuple[str, ...]
    log_y: bool = False


# The charts every run has (when their series were logged), in the page's order; any other series gets a chart of its
# own (series of the same name under train/ and valid/ share one).
CHARTS = (
    Chart("loss.png", "Loss per target token: train (label-smoothed, section 5.4) and valid", "loss",
          ("train/loss", "valid/loss")),
    Chart("nll.png", "Negative log-likelihood per target token (no smoothing): train and valid", "nll (nats)",
          ("train/nll", "valid/nll")),
    Chart("ppl.png", "Perplexity, exp(nll): train and valid", "perplexity (log scale)", ("train/ppl", "valid/ppl"),
          log_y=True),
    Chart("bleu.png", "Valid BLEU (greedy decode during training)", "BLEU", ("valid/bleu",)),
    Chart("lr.png", "Learning rate per update (train.schedule; the paper's is in section 5.3)", "learning rate",
          ("train/lr",)),
    Chart("grad_norm.png", "Gradient norm before clipping (mean over the logged updates)", "||g||",
          ("train/grad_norm",)),
    Chart("throughput.png", "Training throughput", "tokens/s",
          ("train/tgt_tokens_per_s", "train/tokens_per_s")),
    Chart("epoch.png", "Epochs of the training data seen", "epoch", ("epoch",)),
)
LABELS = {"train/tgt_tokens_per_s": "target tokens/s", "train/tokens_per_s": "source + target tokens/s"}


# --------------------------------------------------------------------------------------------------------------------
# Reading the dvclive files
# --------------------------------------------------------------------------------------------------------------------


def read_tsv(path: Path) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of one dvclive metric file (header ``step<TAB>name``; a ``timestamp`` column, if dvclive
    wrote one, is ignored; a row a kill cut short is skipped)."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    header = lines[0].split("\t") if lines else []
    if "step" not in header:
        raise MtpipeError(f"{path}: not a dvclive metrics file (no 'step' column in its header)")
    x = header.index("step")
    names = [i for i, h in enumerate(header) if h not in ("step", "timestamp")]
    if not names:
        raise MtpipeError(f"{path}: not a dvclive metrics file (no value column in its header)")
    y = header.index(path.stem) if path.stem in header else names[-1]
    steps, values = [], []
    for line in lines[1:]:
        fields = line.split("\t")
        try:
            step, value = int(fields[x]), float(fields[y])
        except (IndexError, ValueError):
            continue
        steps.append(step)
        values.append(value)
    return steps, values


def read_run(run: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every curve of a run directory (or of its ``live`` directory itself), by name (``train/loss``), in file
    order; an error naming the run when it has none."""
    run = Path(run)
    if not run.exists():
        raise MtpipeError(f"{run}: not found (--run: a `mtpipe train` run directory)")
    live = run if (run / METRICS_DIR).is_dir() and not (run / LIVE).is_dir() else run / LIVE
    root = live / METRICS_DIR
    files = sorted(root.rglob("*.tsv")) if root.is_dir() else []
    if not files:
        raise MtpipeError(f"{run}: no training metrics (no {LIVE}/{METRICS_DIR.as_posix()}/*.tsv); is it a "
                          "`mtpipe train` run directory?")
    series = {}
    for path in files:
        steps, values = read_tsv(path)
        if steps:
            series[path.relative_to(root).with_suffix("").as_posix()] = (steps, values)
    if not series:
        raise MtpipeError(f"{root}: the metrics files hold no logged points yet")
    return series


def charts_for(series: dict[str, Any]) -> list[Chart]:
    """The charts to draw: those of :data:`CHARTS` with a logged series, then one per other series name."""
    charts = [c for c in CHARTS if any(s in series for s in c.series)]
    known = {s for c in CHARTS for s in c.series}
    others: dict[str, list[str]] = {}
    for name in series:
        if name not in known:
            others.setdefault(name.rsplit("/", 1)[-1], []).append(name)
    for stem, names in others.items():
        title = f"{stem.replace('_', ' ')}: " + " and ".join(n.rsplit("/", 1)[0] if "/" in n else n for n in names)
        charts.append(Chart(f"other-{stem}.png", f"{title} by update", stem, tuple(names)))
    return charts


# --------------------------------------------------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------------------------------------------------


def draw_chart(path: Path, chart: Chart, series: dict[str, tuple[list[int], list[float]]]) -> None:
    """One chart as a PNG: its logged series against the update count, valid points marked (there are few)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for name in chart.series:
        if name not in series:
            continue
        steps, values = series[name]
        valid = name.startswith("valid/")
        ax.plot(steps, values, marker="o" if valid or len(steps) < 30 else None, markersize=4,
                linewidth=1.8 if valid else 1.2, label=LABELS.get(name, name))
    if chart.log_y and all(v > 0 for name in chart.series if name in series for v in series[name][1]):
        ax.set_yscale("log")
    ax.set_title(chart.title, fontsize=11)
    ax.set_xlabel("update (training step)")
    ax.set_ylabel(chart.ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=100)


def html_page(title: str, body: list[str]) -> str:
    """A self-contained HTML page: inline style, the given body fragments; no script and no external resource."""
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{html.escape(title)}</title>\n"
            "<style>body{font-family:sans-serif;margin:1.5em;max-width:1400px}"
            "img{max-width:100%;margin:0.4em;border:1px solid #ddd;vertical-align:top}"
            "img.wide{display:block}</style>\n</head>\n<body>\n"
            f"<h1>{html.escape(title)}</h1>\n" + "\n".join(body) + "\n</body>\n</html>\n")


def write_plots(out: Path, run: Path, series: dict[str, tuple[list[int], list[float]]], *,
                force: bool = False) -> list[Chart]:
    """The ``plots`` artifact: one PNG per chart and ``index.html``; returns the charts drawn."""
    from mtpipe import writing
    from mtpipe.console import progress

    charts = charts_for(series)
    with writing.ArtifactWriter(out, "plots", {}, force=force) as w:
        with progress() as bar:
            task = bar.add_task("draw", total=len(charts))
            for chart in charts:
                draw_chart(w.path(chart.file), chart, series)
                bar.advance(task)
        last = max(s[-1] for s, _ in series.values())
        body = [f"<p>run: {html.escape(str(run))}, last logged update {last:,}</p>"]
        body += [f'<img src="{c.file}" alt="{html.escape(c.title)}">' for c in charts]
        w.path(INDEX).write_text(html_page(f"Training curves: {run}", body), encoding="utf-8")
        w.extra.update({"run": str(run), "charts": [c.file for c in charts], "last_step": last})
    return charts


def plots_command(run: Path, out: Path | None, *, force: bool = False) -> None:
    """``mtpipe plots``: read the run's curves, draw them into ``out`` (default ``RUN/plots``), print a summary."""
    from mtpipe import writing
    from mtpipe.console import table

    run = Path(run)
    out = Path(out) if out is not None else run / "plots"
    series = read_run(run)
    # The output may lie inside the run (the default), never inside or over what it reads.
    writing.prepare_output(out, "plots", inputs=[run / LIVE, run / "checkpoints"], force=force)
    charts = write_plots(out, run, series, force=force)
    rows = [[c.file, ", ".join(s for s in c.series if s in series),
             max(len(series[s][0]) for s in c.series if s in series)] for c in charts]
    table(f"plots: {out}", ["chart", "series", "points"], rows + [["page", str(out / INDEX), ""]])


__all__ = ["CHARTS", "Chart", "charts_for", "draw_chart", "html_page", "plots_command", "read_run", "read_tsv",
           "write_plots"]
