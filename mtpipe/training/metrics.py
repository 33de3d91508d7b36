"""What ``mtpipe train`` logs: dvclive curves under ``OUT/live``, the running window they are averaged over, the
log line and the final summary table.

* The global batch (:class:`GlobalBatch`): planned in the log's first lines, measured over the first updates.
* Curves: ``OUT/live/plots/metrics/{train,valid}/*.tsv`` with ``step`` as x (for ``dvc plots``, declared in
  dvc.yaml) and ``OUT/live/metrics.json`` with the latest values (for ``dvc metrics``), written by rank 0 only.
* Exact resume: the curve of a resumed run continues the checkpoint's as if the run had never stopped
  (:func:`_rewind_live` drops what a killed run logged after its last checkpoint), and :class:`Window`'s sums
  are part of the checkpoint's trainer state, so the first logged point after a resume is the uninterrupted one.
"""

from __future__ import annotations

import functools
import json
import math
import typing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mtpipe import writing
from mtpipe.console import fmt, info, table
from mtpipe.training.distributed import rank0_only

# --------------------------------------------------------------------------------------------------------------------
# The window: sums over the updates since the last logged point
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Window:
    """Sums over the updates since the last logged point; a logged train value is their per-token (loss, nll) or
    per-update (grad_norm) mean. Saved in trainer.pt (:meth:`to_dict`) for an exact resume."""

    loss: float = 0.0  # label-smoothed loss summed over target tokens (section 5.4)
    nll: float = 0.0  # the unsmoothed negative log-likelihood, summed likewise: perplexity's exponent
    tokens: int = 0  # real target tokens
    updates: int = 0
    grad_norm: float = 0.0  # sum of the updates' gradient norms (before clipping)

    def add(self, loss: float, nll: float, tokens: int, grad_norm: float) -> None:
        self.loss += loss
        self.nll += nll
        self.tokens += tokens
        self.updates += 1
        self.grad_norm += grad_norm

    def values(self, lr: float, tgt_per_s: float, src_per_s: float, epoch: float) -> dict[str, float]:
        """The ``train/*`` curves' points (and ``epoch``) for this window."""
        return {
            "train/loss": self.loss / self.tokens, "train/nll": self.nll / self.tokens,
            "train/ppl": math.exp(min(self.nll / self.tokens, 700.0)),  # capped: exp overflows a float past ~709
            "train/lr": lr, "train/grad_norm": self.grad_norm / self.updates,
            "train/tgt_tokens_per_s": tgt_per_s, "train/tokens_per_s": tgt_per_s + src_per_s,
            "epoch": epoch,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Window:
        return cls(**d)


@dataclass
class Throughput:
    """Tokens trained on since ``t0`` (monotonic seconds): the tokens/s of the next logged point. Wall-clock, so
    not saved in checkpoints (a resumed run measures its own)."""

    t0: float
    tgt: int = 0
    src: int = 0

    def add(self, tgt: int, src: int) -> None:
        self.tgt, self.src = self.tgt + tgt, self.src + src

    def rates(self, now: float) -> tuple[float, float]:
        """``(target, source)`` tokens per second since ``t0``."""
        dt = max(now - self.t0, 1e-9)
        return self.tgt / dt, self.src / dt

    def restart(self, now: float) -> None:
        self.t0, self.tgt, self.src = now, 0, 0


@dataclass
class GlobalBatch:
    """The global batch a run trains with (section 5.1: ~25000 source and 25000 target tokens per update,
    ``train.tokens_per_update``): what the batches promise (:meth:`plan_line`, the log's first lines) and the real
    tokens of the first :attr:`MEASURED` updates of this invocation (:meth:`add`; ``train.json``'s
    ``global_batch``), so that runs on different numbers of processes can be compared."""

    MEASURED: typing.ClassVar[int] = 10

    tokens_per_update: int  # train.tokens_per_update
    batches: int  # bucket batches per update
    max_tokens: int  # bucket.max_tokens: the padded tokens per side a batch holds at most
    updates: int = 0
    tgt: int = 0
    src: int = 0

    def plan_line(self, world: int, accum: int, split: bool) -> str:
        share = (f"the sentences of {self.batches / world:.3g} batches each, in <= {accum} part(s)" if split
                 else f"{accum} whole batch(es) each")
        return (f"global batch: {self.batches} batches of <= {self.max_tokens:,} tokens per update (<= "
                f"{self.batches * self.max_tokens:,} padded tokens per side; train.tokens_per_update "
                f"{self.tokens_per_update:,}), on {world} process(es): {share}")

    def add(self, tgt: int, src: int) -> str | None:
        """Count an applied update's real tokens; the measured line once the first :attr:`MEASURED` are in."""
        if self.updates >= self.MEASURED:
            return None
        self.updates, self.tgt, self.src = self.updates + 1, self.tgt + tgt, self.src + src
        return self.measured_line() if self.updates == self.MEASURED else None

    def measured_line(self) -> str:
        return (f"global batch: {self.tgt / self.updates:,.0f} target and {self.src / self.updates:,.0f} source tokens "
                f"per update (the mean of the first {self.updates} updates of this run; train.tokens_per_update "
                f"{self.tokens_per_update:,})")

    def to_dict(self) -> dict[str, Any]:
        n = max(self.updates, 1)
        return {"tokens_per_update": self.tokens_per_update, "batches_per_update": self.batches,
                "max_tokens_per_update": self.batches * self.max_tokens, "measured_updates": self.updates,
                "tgt_tokens_per_update": round(self.tgt / n, 1) if self.updates else None,
                "src_tokens_per_update": round(self.src / n, 1) if self.updates else None}


def log_line(step: int, v: dict[str, float]) -> str:
    """A log line for non-terminal output (DVC, CI, files), where no progress bar is drawn."""
    return (f"step {step:,}  epoch {v['epoch']:.2f}  loss {v['train/loss']:.3f}  ppl {v['train/ppl']:.1f}  "
            f"lr {v['train/lr']:.2e}  |g| {v['train/grad_norm']:.2f}  {v['train/tgt_tokens_per_s']:,.0f} tok/s")


def valid_line(step: int, v: dict[str, float]) -> str:
    """The log line of a validation (loss/perplexity, BLEU, or both)."""
    parts = []
    if "valid/loss" in v:
        parts.append(f"valid loss {v['valid/loss']:.4f}, ppl {v['valid/ppl']:.2f}")
    if "valid/bleu" in v:
        parts.append(f"valid BLEU {v['valid/bleu']:.2f}")
    return f"step {step:,}: " + ", ".join(parts)


# --------------------------------------------------------------------------------------------------------------------
# Time left and how a run ended
# --------------------------------------------------------------------------------------------------------------------


def remaining_seconds(steps_done: int, total_steps: int, steps_timed: int, seconds_timed: float,
                      trained_seconds: float, max_time_minutes: float) -> float | None:
    """The progress bar's estimate of the time left: the sooner of the step plan's end (``total_steps - steps_done``
    updates at the rate of the ``steps_timed`` updates in ``seconds_timed``) and ``train.max_time``'s (minutes,
    against the ``trained_seconds`` so far, every invocation counted), whichever ends training first. ``None`` when
    neither is known yet (no step plan, no time limit; or no update timed for a step plan alone)."""
    ends = []
    if total_steps > 0 and steps_timed > 0 and seconds_timed > 0:
        ends.append(max(total_steps - steps_done, 0) * seconds_timed / steps_timed)
    if max_time_minutes > 0:
        ends.append(max(60 * max_time_minutes - trained_seconds, 0.0))
    return min(ends) if ends else None


def stop_note(s: dict[str, Any]) -> str | None:
    """The loud last line of a run that stopped before its plan ended (``None`` otherwise), from its summary:
    ``stopped_by`` ``max_time`` with ``planned_updates`` (> ``steps``) of max_steps/max_epochs, or ``patience``
    with the best validation."""
    if s.get("stopped_by") == "max_time" and s.get("planned_updates") and s["steps"] < s["planned_updates"]:
        done, plan = s["steps"], s["planned_updates"]
        return (f"stopped by train.max_time={s['max_time']:g} min after {done:,} of {plan:,} planned updates "
                f"({100 * done / plan:.0f} %)")
    if s.get("stopped_by") == "patience":
        best = s.get("best") or {}
        return (f"stopped early by train.patience={s['patience']} at update {s['steps']:,}: {best.get('bad')} "
                f"validations of {best.get('metric')} without improvement on the best, {best.get('value'):.4g} at "
                f"update {best.get('step'):,} (checkpoint kept, named in best.json)")
    return None


# --------------------------------------------------------------------------------------------------------------------
# The plain-text log
# --------------------------------------------------------------------------------------------------------------------


class TextLog:
    """``OUT/train.log`` (rank 0 only): the step and validation lines, resumes and the final summary as plain text
    with UTC times, appended across invocations, so that a run read later (or on a machine without the terminal it
    ran in) keeps its story. Lines are flushed as written: a kill loses none that were printed."""

    NAME = "train.log"

    def __init__(self) -> None:
        self.f: Any = None

    @rank0_only
    def open(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.f = open(out / self.NAME, "a", encoding="utf-8", buffering=1)

    @rank0_only
    def write(self, line: str) -> None:
        if self.f is not None:
            import time

            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
            self.f.write("".join(f"{stamp}  {ln}\n" for ln in line.splitlines() or [""]))

    @rank0_only
    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


# --------------------------------------------------------------------------------------------------------------------
# dvclive files
# --------------------------------------------------------------------------------------------------------------------


def _tsv_step(line: str, col: int) -> int | None:
    """The step of one metrics TSV row, or None for a row a kill cut short (dvclive appends rows with plain
    writes)."""
    fields = line.rstrip("\r\n").split("\t")
    try:
        return int(fields[col]) if line.endswith("\n") else None
    except (IndexError, ValueError):
        return None


def _rewind_live(live_dir: Path, step: int) -> None:
    """Put ``OUT/live`` back to checkpoint ``step`` before a resume: drop metric rows logged after it (they came from
    a run killed after its last checkpoint) and rows a kill cut short, so the resumed curve continues the
    checkpoint's without duplicates; and rebuild ``metrics.json`` (dvclive rewrites it in place every step, so a kill
    can leave it empty or half-written, and dvclive's resume reads it) from the latest value of each curve.

    Why the files are rewritten here: dvclive's public API only appends (``log_metric``) or wipes everything
    (``resume=False``); it has no way to truncate a curve to a step or to read a half-written ``metrics.json``."""
    if not live_dir.exists():
        return
    for tmp in live_dir.rglob(".*.tmp-*"):  # an atomic write the kill interrupted
        tmp.unlink(missing_ok=True)
    summary: dict[str, Any] = {}
    root = live_dir / "plots" / "metrics"
    for path in sorted(root.rglob("*.tsv")):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        header = lines[0].rstrip("\r\n").split("\t") if lines else []
        if "step" not in header:
            continue
        col = header.index("step")
        keep = [lines[0]]
        for ln in lines[1:]:
            s = _tsv_step(ln, col)
            if s is not None and s <= step and len(ln.rstrip("\r\n").split("\t")) == len(header):
                keep.append(ln)
        if len(keep) != len(lines):
            writing.atomic_write_text(path, "".join(keep))
        if len(keep) > 1:  # the metrics.json entry: nested by the metric's path, as dvclive writes it
            node = summary
            *parents, name = path.relative_to(root).with_suffix("").parts
            for part in parents:
                node = node.setdefault(part, {})
            node[name] = float(keep[-1].rstrip("\r\n").split("\t")[-1])
    summary["step"] = step
    writing.atomic_write_text(live_dir / "metrics.json", json.dumps(summary, indent=4) + "\n")


@functools.cache
def _quiet_live() -> type:
    """dvclive's ``Live`` with two methods replaced (dvclive is imported on first use: it pulls in DVC).

    * ``_init_dvc`` (private, so this subclass is tied to dvclive 3.x): inside a git checkout that has no DVC
      repository, dvclive runs ``dvc init`` (and stages the files in git) whatever the constructor's arguments;
      ``save_dvc_exp=False, dvcyaml=None`` stop the experiment and the dvc.yaml but not that. No public switch
      exists (``DVCLIVE_TEST``, its test mode, writes into a temporary directory instead). We want no experiments,
      no dvc.yaml and no repository changes, only the metric files, which dvc.yaml declares as the stage's plots.
    * ``make_summary`` (public): atomically, since dvclive's own write truncates ``metrics.json`` first and a kill
      would leave it empty; ``end()`` calls it too, so overriding beats writing the file beside dvclive.
    """
    from dvclive import Live

    class QuietLive(Live):
        def _init_dvc(self) -> None:
            pass

        def make_summary(self) -> None:
            if self._step is not None:  # what dvclive's own make_summary does before writing
                self.summary["step"] = self.step
            writing.atomic_write_text(Path(self.metrics_file), json.dumps(self.summary, indent=4,
                                                                            default=float) + "\n")

    return QuietLive


class Metrics:
    """dvclive logs under ``OUT/live`` (rank 0 only): ``plots/metrics/<name>.tsv`` per metric with ``step`` as the
    x axis, and ``metrics.json`` with the latest values. No dvc.yaml and no DVC experiment are written, so it
    behaves the same inside and outside a git/DVC repository."""

    def __init__(self) -> None:
        self.live: Any = None

    @rank0_only
    def open(self, out: Path, resume_step: int | None) -> None:
        live_dir = out / "live"
        if resume_step is not None:
            _rewind_live(live_dir, resume_step)
        self.live = _quiet_live()(dir=str(live_dir), resume=resume_step is not None, save_dvc_exp=False,
                                  dvcyaml=None, report=None)

    @rank0_only
    def log(self, step: int, values: dict[str, float]) -> None:
        self.live.step = step  # the update count, not dvclive's own counter: the x axis survives resumes
        for k, v in values.items():
            self.live.log_metric(k, float(v))
        self.live.make_summary()

    @rank0_only
    def close(self) -> None:
        if self.live is not None:
            self.live.end()


# --------------------------------------------------------------------------------------------------------------------
# The final summary
# --------------------------------------------------------------------------------------------------------------------


@rank0_only
def report(out: Path, s: dict[str, Any], log: TextLog | None = None) -> None:
    """Write the run's summary to ``out/train.json``, print it as a table (and into ``log``), and end with the loud
    :func:`stop_note` of a run that stopped before its plan ended."""
    writing.atomic_write_text(out / "train.json", json.dumps(s, indent=2, sort_keys=True) + "\n")
    best = s.get("best") or {}
    rows = [
        ("steps", s["steps"]), ("epochs", s["epochs"]), ("stopped by", s["stopped_by"]),
        ("target tokens", s["target_tokens"]), ("train loss", s["train_loss"]), ("train ppl", s["train_ppl"]),
        ("valid loss", s["valid_loss"]), ("valid ppl", s["valid_ppl"]),
        *([("valid BLEU", s["valid_bleu"])] if s.get("valid_bleu") is not None else []),
        *([(f"best {best['metric']} (update)", f"{best['value']:.4g} ({best['step']:,})")]
          if best.get("step", -1) >= 0 else []),
        ("training time (min)", s["train_minutes"]), ("target tokens/s (this run)", s["tgt_tokens_per_s"]),
        ("processes x accumulation", f"{s['processes']} x {s['accumulation']}"),
        *([("target tokens per update", s["global_batch"]["tgt_tokens_per_update"])]
          if (s.get("global_batch") or {}).get("measured_updates") else []),
        ("precision / device", f"{s['precision']} / {s['device']}"),
        ("last checkpoint", s["checkpoints"][-1] if s["checkpoints"] else None),
        *([("fine-tuned from", f"{ft['path']} (step {ft['step']})")] if (ft := s.get("finetuned_from")) else []),
    ]
    table(f"train: {out}", ["", "value"], rows)
    note = stop_note(s)
    if log is not None:
        log.write("summary: " + "; ".join(f"{k} {fmt(v)}" for k, v in rows))
        if note:
            log.write(f"*** {note} ***")
    if note:  # last, in bold, so that a run cut short is not mistaken for a finished one
        info(f"[bold red]*** {note} ***[/bold red]")
