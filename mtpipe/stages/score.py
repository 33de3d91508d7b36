"""``mtpipe score``: sacreBLEU BLEU, chrF2 and TER with their signatures, and the CI regression gate.

The paper (section 6.1, Table 2) reports BLEU on newstest2014 as computed by tensor2tensor's ``get_ende_bleu.sh``:
tokenised text, hyphenated compounds split, ``multi-bleu.perl``. Those numbers depend on the tokeniser and are not
comparable across papers, which is why the headline metric here is sacreBLEU (Post, 2018): detokenised hypotheses
against untouched references, 13a tokenisation, mixed case, reported with its signature. The paper-style number is
offered with ``--paper-bleu`` and is always labelled as not comparable to sacreBLEU.

Inputs:

* hypotheses: a text file (one per line, ``.gz`` allowed), or decode's output directory (a ``hypotheses`` artifact,
  see the contract in :mod:`mtpipe.artifacts`);
* references: a text file, or the fetch artifact (``corpus``: ``{split}.parquet``, column ``tgt``). A hypotheses
  artifact of a corpus split is paired with the references **by id**, so row order never matters; otherwise the
  i-th hypothesis (in id order for an artifact) goes with the i-th reference (in id order for an artifact).

Text files are read as sacreBLEU's command line reads them (lines split on ``\\n`` only, trailing whitespace
removed), so ``mtpipe score`` and ``sacrebleu REF -i HYP`` agree on the same files.

Output: a metrics JSON (written atomically) that DVC reads as metrics: ``bleu``, ``chrf``, ``ter``, BLEU's ``bp``,
``ratio``, ``hyp_len``, ``ref_len``, ``p1``..``p4``, the number of segments ``n``, ``signatures``, the ``inputs``,
the ``gate`` outcome, and ``paper_bleu`` when asked for.

Gates (:data:`GATES`): a floor or ceiling on BLEU, chrF2 and TER (``--min-bleu``, ``--min-chrf``, ``--max-ter``),
and against a ``--baseline`` metrics JSON how far each may get worse (``--max-drop`` for BLEU, ``--max-drop-chrf``,
``--max-rise-ter``). Exit status: 0 when scored (and every gate passed); 1 on bad input, a baseline gate without a
baseline (unless ``score.require_baseline`` is false) or a baseline without a gate (nothing is written); 3 when a
gate fails. On a gate failure the metrics JSON **is still written**, so CI keeps the numbers that failed; the error
message says so.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, NamedTuple

from mtpipe import artifacts, writing
from mtpipe.config import ScoreConfig
from mtpipe.console import info, table, warn
from mtpipe.errors import MtpipeError

GATE_EXIT_CODE = 3

# tensor2tensor's get_ende_bleu.sh splits hyphenated compounds with perl's s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g;
# Python's re.sub scans non-overlapping matches left to right exactly like perl's /g, so "a-b-c" becomes
# "a ##AT##-##AT## b-c" here as there.
_COMPOUND = re.compile(r"(\S)-(\S)")
PAPER_BLEU_NAME = "paper BLEU (not sacreBLEU)"
PAPER_BLEU_NOTE = ("13a-tokenised, compound-split (##AT##-##AT##), multi-bleu.perl-style BLEU, the kind of number the "
                   "paper reports (27.3 base / 28.4 big on newstest2014); NOT comparable to sacreBLEU scores")


class GateFailed(MtpipeError):
    """A regression gate failed. The CLI exits with :data:`GATE_EXIT_CODE`, not 1, so CI can tell a worse model
    from a broken run."""

    exit_code = GATE_EXIT_CODE


# --------------------------------------------------------------------------------------------------------------------
# Reading hypotheses and references
# --------------------------------------------------------------------------------------------------------------------


def read_lines(path: Path, what: str) -> list[str]:
    """Lines of a UTF-8 text file (``.gz`` allowed) or of stdin ('-'), split on ``\\n`` only (a stray ``\\r`` or
    U+2028 inside a sentence must not split it; sacreBLEU reads the same way) and right-stripped."""
    name = "stdin" if str(path) == "-" else str(path)
    if str(path) == "-":
        data = sys.stdin.buffer.read()
    elif not path.exists():
        raise MtpipeError(f"{path}: {what} file not found")
    else:
        try:
            with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
                data = f.read()
        except (OSError, EOFError) as e:
            raise MtpipeError(f"{path}: cannot read {what} file ({e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MtpipeError(f"{name}: {what} file is not UTF-8 text ({e.reason} at byte {e.start})") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    return [line.rstrip() for line in lines]


def _read_hypotheses(hyp: Path) -> tuple[dict[int, str] | list[str], str | None]:
    """Hypotheses as ``{id: text}`` (an artifact of a corpus split) or a list (a text file / raw-text decode),
    plus the artifact's corpus split (None for a list)."""
    if str(hyp) != "-" and not hyp.exists():
        raise MtpipeError(f"{hyp}: hypotheses not found (a text file, '-' for stdin, or decode's output directory: "
                          f"`mtpipe decode --out {hyp}` writes one; without --out it only prints)")
    if str(hyp) == "-" or not hyp.is_dir():
        return read_lines(hyp, "hypotheses"), None
    m = artifacts.read_manifest(hyp, "hypotheses")
    split = m.extra.get("split")
    if split is not None:
        name = f"{split}.parquet"
    else:
        parquets = sorted(n for n in m.files if n.endswith(".parquet"))
        if len(parquets) != 1:
            raise MtpipeError(f"{hyp}: manifest has no extra.split and {len(parquets)} Parquet files; cannot tell "
                              "which one holds the hypotheses")
        name = parquets[0]
    t = artifacts.read_table(hyp, name, "hypotheses", columns=["id", "hypothesis"])
    ids = t.column("id").to_pylist()
    texts = [(h or "").rstrip() for h in t.column("hypothesis").to_pylist()]
    by_id = dict(zip(ids, texts))
    if len(by_id) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise MtpipeError(f"{hyp / name}: hypothesis id {dup} occurs more than once")
    if split is None:
        return [by_id[i] for i in sorted(by_id)], None
    return by_id, str(split)


def _read_reference_split(ref: Path, split: str) -> dict[int, str]:
    """``{id: tgt}`` of one split of the fetch artifact."""
    have = artifacts.splits_of(ref, "corpus")
    if split not in have:
        raise MtpipeError(f"{ref}: no split '{split}' in the reference artifact (it has: {', '.join(have) or 'none'})")
    t = artifacts.read_table(ref, f"{split}.parquet", "corpus", columns=["id", "tgt"])
    return {i: (s or "").rstrip() for i, s in zip(t.column("id").to_pylist(), t.column("tgt").to_pylist())}


def load_pairs(cfg: ScoreConfig, hyp: Path, ref: Path) -> tuple[list[str], list[str], str | None]:
    """Aligned (hypotheses, references, reference split) after every input check."""
    hyps, hyp_split = _read_hypotheses(hyp)
    if not hyps:
        raise MtpipeError(f"{hyp}: no hypotheses (empty{' file' if not hyp.is_dir() else ''})")
    if hyp_split is not None and cfg.split is not None and cfg.split != hyp_split:
        raise MtpipeError(f"score.split: '{cfg.split}' given, but {hyp} holds hypotheses of split '{hyp_split}'")
    split = hyp_split or cfg.split or "test"

    if not ref.exists():
        raise MtpipeError(f"{ref}: references not found (a text file, or the fetch artifact directory)")
    if not ref.is_dir():
        refs = read_lines(ref, "reference")
        ref_desc, split = str(ref), None
        if isinstance(hyps, dict):  # pair in id order: the corpus order the reference file was made from
            hyps = [hyps[i] for i in sorted(hyps)]
    else:
        by_id = _read_reference_split(ref, split)
        ref_desc = f"{ref} (split '{split}')"
        if isinstance(hyps, dict):
            missing = [i for i in hyps if i not in by_id]
            if missing:
                raise MtpipeError(f"{hyp}: {len(missing)} hypothesis ids are not in the references {ref_desc} "
                                  f"(first: {sorted(missing)[0]}); were they decoded from another corpus?")
            if len(hyps) != len(by_id):
                raise MtpipeError(f"{hyp} has {len(hyps)} hypotheses but {ref_desc} has {len(by_id)} references")
            order = sorted(hyps)
            return [hyps[i] for i in order], [by_id[i] for i in order], split
        refs = [by_id[i] for i in sorted(by_id)]
    if len(hyps) != len(refs):
        raise MtpipeError(f"{hyp} has {len(hyps)} hypotheses but {ref_desc} has {len(refs)} references")
    return list(hyps), refs, split


# --------------------------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------------------------


def compound_split(text: str) -> str:
    """Split hyphenated compounds as tensor2tensor's get_ende_bleu.sh: ``a-b`` -> ``a ##AT##-##AT## b``."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", text)


def paper_bleu(hyps: list[str], refs: list[str]) -> tuple[float, str]:
    """The paper's kind of BLEU (section 6.1): tokenise both sides (sacreBLEU's 13a tokeniser stands in for Moses'
    tokenizer.perl: both keep word-internal hyphens), split compounds, then corpus BLEU on whitespace tokens with no
    smoothing and case kept, as multi-bleu.perl computes it. Returns (score, signature)."""
    import sacrebleu
    from sacrebleu.metrics import BLEU
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    tok = Tokenizer13a()
    h = [compound_split(tok(x)) for x in hyps]
    r = [compound_split(tok(x)) for x in refs]
    score = BLEU(tokenize="none", smooth_method="none").corpus_score(h, [r]).score
    sig = f"nrefs:1|case:mixed|tok:13a+compound-split|smooth:none|version:{sacrebleu.__version__}|NOT-sacreBLEU"
    return float(score), sig


def compute(cfg: ScoreConfig, hyps: list[str], refs: list[str]) -> dict[str, Any]:
    """BLEU (cfg.tokenize, cfg.lowercase), chrF2 and TER (sacreBLEU defaults) and, if asked, the paper's BLEU."""
    from sacrebleu.metrics import BLEU, CHRF, TER

    if cfg.tokenize not in BLEU.TOKENIZERS:
        raise MtpipeError(f"score.tokenize: unknown sacreBLEU tokenizer '{cfg.tokenize}' "
                          f"(choose from {', '.join(BLEU.TOKENIZERS)})")
    try:
        bleu_metric = BLEU(tokenize=cfg.tokenize, lowercase=cfg.lowercase)
    except (ImportError, OSError, RuntimeError) as e:  # e.g. ja-mecab without its package, spm offline
        raise MtpipeError(f"score.tokenize: sacreBLEU tokenizer '{cfg.tokenize}' is unavailable ({e})") from None
    chrf_metric, ter_metric = CHRF(), TER()
    info(f"scoring {len(hyps):,} segments")
    bleu = bleu_metric.corpus_score(hyps, [refs])
    chrf = chrf_metric.corpus_score(hyps, [refs])
    ter = ter_metric.corpus_score(hyps, [refs])
    metrics: dict[str, Any] = {
        "bleu": float(bleu.score),
        "chrf": float(chrf.score),
        "ter": float(ter.score),
        "n": len(hyps),
        "bp": float(bleu.bp),
        "ratio": float(bleu.ratio),
        "hyp_len": int(bleu.sys_len),
        "ref_len": int(bleu.ref_len),
        **{f"p{i + 1}": float(p) for i, p in enumerate(bleu.precisions)},
        "signatures": {
            "bleu": str(bleu_metric.get_signature()),
            "chrf": str(chrf_metric.get_signature()),
            "ter": str(ter_metric.get_signature()),
        },
    }
    if cfg.paper_bleu:
        metrics["paper_bleu"], metrics["signatures"]["paper_bleu"] = paper_bleu(hyps, refs)
    return metrics


# --------------------------------------------------------------------------------------------------------------------
# Gate
# --------------------------------------------------------------------------------------------------------------------


class Gate(NamedTuple):
    """One metric's gates: its bound (``limit``, a ScoreConfig key) and how far it may get worse than the baseline
    (``worse``, a ScoreConfig key); ``higher``: higher is better (BLEU, chrF2; not TER)."""

    key: str  # the metrics JSON's key
    name: str
    higher: bool
    limit: str
    worse: str


GATES = (Gate("bleu", "BLEU", True, "min_bleu", "max_drop"), Gate("chrf", "chrF2", True, "min_chrf", "max_drop_chrf"),
         Gate("ter", "TER", False, "max_ter", "max_rise_ter"))


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def baseline_gates(cfg: ScoreConfig) -> list[Gate]:
    """The metrics gated against the baseline."""
    return [g for g in GATES if getattr(cfg, g.worse) is not None]


def read_baseline(path: Path, gates: list[Gate]) -> dict[str, Any]:
    """A previous metrics JSON with a number for each metric of ``gates``."""
    if not path.exists():
        raise MtpipeError(f"{path}: baseline metrics file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MtpipeError(f"{path}: baseline is not a metrics JSON ({e})") from None
    for g in gates:
        value = data.get(g.key) if isinstance(data, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise MtpipeError(f"{path}: baseline has no numeric '{g.key}' (is it an `mtpipe score` metrics JSON?)")
    return data


def _strip_version(sig: str) -> str:
    return "|".join(p for p in sig.split("|") if not p.startswith("version:"))


def _worse_by(g: Gate, value: float, base: float) -> float:
    return base - value if g.higher else value - base


def check_gates(cfg: ScoreConfig, metrics: dict[str, Any], baseline: Path | None,
                base: dict[str, Any] | None) -> tuple[dict[str, Any], list[str], list[str]]:
    """(the ``gate`` entry of the metrics JSON, the failure messages, the checks passed)."""
    failures, passed = [], []
    gate: dict[str, Any] = {"baseline": str(baseline) if baseline is not None else None}
    for g in GATES:
        value, limit, worse = metrics[g.key], getattr(cfg, g.limit), getattr(cfg, g.worse)
        gate[g.limit] = limit
        if limit is not None:
            if value < limit if g.higher else value > limit:
                failures.append(f"{g.name} {value:.2f} is {'below' if g.higher else 'above'} {_flag(g.limit)} "
                                f"{limit:.2f}")
            else:
                passed.append(f"{g.name} {value:.2f} {'>=' if g.higher else '<='} {_flag(g.limit)} {limit:.2f}")
        on_base = base is not None and worse is not None
        gate[f"baseline_{g.key}"] = float(base[g.key]) if on_base else None
        gate[g.worse] = worse if on_base else None
        if not on_base:
            continue
        was = float(base[g.key])
        base_sig = (base.get("signatures") or {}).get(g.key)
        if isinstance(base_sig, str) and _strip_version(base_sig) != _strip_version(metrics["signatures"][g.key]):
            warn(f"baseline {baseline} was scored with {g.name} signature {base_sig}, this run with "
                 f"{metrics['signatures'][g.key]}: the comparison may be meaningless")
        bound = was - worse if g.higher else was + worse
        if _worse_by(g, value, was) > worse:
            failures.append(f"{g.name} {value:.2f} is {abs(value - was):.2f} {'below' if g.higher else 'above'} the "
                            f"baseline {was:.2f} of {baseline} ({_flag(g.worse)} {worse:.2f}, so "
                            f"{'at least' if g.higher else 'at most'} {bound:.2f} is needed)")
        else:
            passed.append(f"{g.name} {value:.2f} {'>=' if g.higher else '<='} baseline {was:.2f} "
                          f"{'-' if g.higher else '+'} {_flag(g.worse)} {worse:.2f}")
    gate["passed"] = not failures
    return gate, failures, passed


def check_gate_inputs(cfg: ScoreConfig, baseline: Path | None) -> list[Gate]:
    """The baseline gates this run applies; a baseline without one, or one without a baseline (unless
    ``score.require_baseline`` is false), is bad input: a CI gate that silently checks nothing is worse than none."""
    gates = baseline_gates(cfg)
    flags = ", ".join(_flag(g.worse) for g in GATES)
    if baseline is not None and not gates:
        raise MtpipeError(f"--baseline {baseline}: also give {flags} (how far below it fails)")
    if gates and baseline is None:
        given = ", ".join(f"score.{g.worse}" for g in gates)
        if cfg.require_baseline:
            raise MtpipeError(f"{given} set but no --baseline given: pass the metrics JSON to compare with, or "
                              "--no-require-baseline to skip the baseline gates")
        warn(f"{given} set but no --baseline given (score.require_baseline is false): the baseline gates are skipped")
    return gates


# --------------------------------------------------------------------------------------------------------------------
# Stage
# --------------------------------------------------------------------------------------------------------------------


def score_hypotheses(cfg: ScoreConfig, hyp: Path, ref: Path, baseline: Path | None, out: Path | None = None, *,
        force: bool = False) -> dict[str, Any]:
    """Score ``hyp`` against ``ref``, print the metrics and, with ``out``, write them as JSON; apply the gates.

    Raises :class:`MtpipeError` (exit 1, nothing written) on bad input, :class:`GateFailed` (exit 3, metrics JSON
    written) when a gate fails. Returns the metrics.
    """
    hyp, ref = Path(hyp), Path(ref)
    out = Path(out) if out is not None else None
    # Bad input must fail before anything is written, so every check (baseline included) comes first.
    gates = check_gate_inputs(cfg, baseline)
    if out is not None:
        writing.check_output_place(out, [hyp, ref, baseline])
        writing.check_replaceable_metrics(out, force=force)
    base = read_baseline(Path(baseline), gates) if baseline is not None else None

    hyps, refs, split = load_pairs(cfg, hyp, ref)
    metrics = compute(cfg, hyps, refs)
    metrics["inputs"] = {"hyp": str(hyp), "ref": str(ref), "split": split}
    metrics["gate"], failures, passed = check_gates(cfg, metrics, baseline, base)

    if out is not None:
        writing.atomic_write_text(out, json.dumps(metrics, indent=2) + "\n")

    # Signatures go on their own lines: in a table a narrow terminal would truncate them, and they are meant to be
    # copied into papers verbatim.
    rows = [("BLEU", f"{metrics['bleu']:.2f}"), ("chrF2", f"{metrics['chrf']:.2f}"), ("TER", f"{metrics['ter']:.2f}")]
    if "paper_bleu" in metrics:
        rows.append((PAPER_BLEU_NAME, f"{metrics['paper_bleu']:.2f}"))
    table(f"sacreBLEU, {metrics['n']:,} segments", ["metric", "score"], rows)
    info(f"BLEU {' / '.join(f'{metrics[k]:.1f}' for k in ('p1', 'p2', 'p3', 'p4'))} (BP = {metrics['bp']:.3f}, "
         f"ratio = {metrics['ratio']:.3f}, hyp_len = {metrics['hyp_len']:,}, ref_len = {metrics['ref_len']:,})")
    for name, key in (("BLEU", "bleu"), ("chrF2", "chrf"), ("TER", "ter"), (PAPER_BLEU_NAME, "paper_bleu")):
        if key in metrics["signatures"]:
            info(f"{name} signature: {metrics['signatures'][key]}", whole=True)
    if "paper_bleu" in metrics:
        info(f"{PAPER_BLEU_NAME}: {PAPER_BLEU_NOTE}")
    if out is not None:
        info(f"metrics written to {out}")

    if failures:
        raise GateFailed("gate failed: " + "; ".join(failures)
                         + (f" (metrics still written to {out})" if out is not None else ""))
    if passed:
        info(f"[green]gate passed[/green]: {'; '.join(passed)}")
    return metrics
