"""The ``mtpipe`` command line: one Typer command per pipeline stage.

Each command's options are generated from the params sections it reads (``mtpipe.config``), so every params.yaml
key is also a flag, and flags override params.yaml. Stage code (and torch) is imported inside the commands, which
keeps ``mtpipe --help`` instant.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional

import typer

from mtpipe import __version__
from mtpipe.config import (
    MAX_BEAM,
    RECORDED_DECODE,
    AverageConfig,
    BpeConfig,
    BucketConfig,
    DecodeConfig,
    ExportConfig,
    FetchConfig,
    ModelConfig,
    ScoreConfig,
    ServeConfig,
    TrainConfig,
    check_sections,
)
from mtpipe.errors import MtpipeError
from mtpipe.params import (
    PARAMS_FILE,
    PATHS,
    base_type,
    checkpoint_decode,
    field_types,
    flag_values,
    help_params,
    load_params,
    recorded_decode,
    resolve,
)

app = typer.Typer(
    help="mtpipe: the Transformer of 'Attention Is All You Need' as a machine-translation pipeline.\n\n"
    "Stages: fetch -> bpe -> bucket -> train -> average -> decode -> score. Each reads params.yaml "
    "(flags override it) and writes a versioned artifact; `dvc repro` chains them.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@dataclass(frozen=True)
class Opt:
    """A command option that is not a params key (artifact paths, input files).

    ``role`` "in" marks an input path (an output may not overlap it); "out" marks the output, written as an artifact
    of ``kind`` ("run" for a training run directory, "metrics" for score's JSON file, "" for none).
    """

    name: str
    type: Any
    default: Any
    help: str
    flags: tuple[str, ...] = ()
    role: str = ""
    kind: str = ""


def dvc_output_of(path: Path, dvc_file: Path = Path("dvc.yaml")) -> str | None:
    """The DVC stage of ``./dvc.yaml`` whose output is ``path``, lies inside it or contains it, or None."""
    if not dvc_file.is_file():
        return None
    import yaml

    try:
        stages = (yaml.safe_load(dvc_file.read_text(encoding="utf-8")) or {}).get("stages") or {}
    except (yaml.YAMLError, OSError, AttributeError):
        return None
    target = path.resolve()
    for stage, spec in stages.items():
        if not isinstance(spec, dict):
            continue
        for key in ("outs", "metrics", "plots"):
            for entry in spec.get(key) or []:
                name = next(iter(entry)) if isinstance(entry, dict) else entry
                tracked = (dvc_file.parent / str(name)).resolve()
                if target == tracked or target.is_relative_to(tracked) or tracked.is_relative_to(target):
                    return str(stage)
    return None


def resolve_output(opt: Opt, given: Path | None) -> Path | None:
    """The output path: ``--out`` when given; else the option's default, unless that default holds a DVC-tracked
    output of ``./dvc.yaml`` (a hand-run command must not silently replace what ``dvc repro`` made and tracks)."""
    if given is not None or opt.default is None:
        return given
    stage = dvc_output_of(Path(opt.default))
    if stage is not None:
        raise MtpipeError(f"{opt.default}: is the output of the DVC stage '{stage}' (dvc.yaml); a hand-run command "
                          f"does not replace it: pass --out DIR, or --out {opt.default} to replace it anyway, or run "
                          f"`dvc repro {stage}`")
    return Path(opt.default)


def check_output(opt: Opt, out: Path, inputs: list[Any], force: bool) -> None:
    """Every check on ``--out`` before any work starts (see :mod:`mtpipe.artifacts`)."""
    from mtpipe import writing

    paths: list[Path] = []
    for value in inputs:
        paths.extend(Path(v) for v in (value if isinstance(value, list) else [value]) if v is not None)
    if opt.kind == "run":
        writing.check_output_place(out, paths)
        writing.check_run_dir(out, force=force)
    elif opt.kind == "metrics":
        writing.check_output_place(out, paths)
        writing.check_replaceable_metrics(out, force=force)
    elif opt.kind:
        writing.prepare_output(out, opt.kind, inputs=paths, force=force)


HELP_PARAMS = help_params()  # ./params.yaml, read once at start-up


def _shown(value: Any) -> str:
    """A params value as help text shows it (YAML spelling; brackets escaped for rich markup)."""
    import json

    if isinstance(value, bool) or value is None:
        text = json.dumps(value)
    elif isinstance(value, (dict, list)):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, str):
        text = value if value else "''"
    else:
        text = str(value)
    return text.replace("[", "\\[")


def _default(section: type, name: str) -> Any:
    f = next(f for f in fields(section) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _param_help(section: type, name: str, recorded: bool) -> str:
    """Where a flag's value comes from when it is not given, with the value in effect: ``./params.yaml``'s, else (for
    the decode settings a checkpoint records) the checkpoint's, else the built-in default."""
    key = f"{section.SECTION}.{name}"
    mine = HELP_PARAMS.get(section.SECTION, {})
    if name in mine:
        return f"(params.yaml {key} = {_shown(mine[name])})"
    default = _shown(_default(section, name))
    if recorded:
        return f"(params.yaml {key}: not set; the checkpoint's recorded value, else {default})"
    return f"(params.yaml {key}: not set; default {default})"


def _param_option(section: type, name: str, tp: Any, recorded: bool = False) -> tuple[Any, Any]:
    """(annotation, typer.Option) for one params key; dict/list keys take a YAML string."""
    meta = next(f for f in fields(section) if f.name == name).metadata
    help_text = meta.get("help", "") + " " + _param_help(section, name, recorded)
    flag = "--" + name.replace("_", "-")
    bt = base_type(tp)
    if bt is bool or "booleans" in meta:  # (a key that was a boolean once keeps its flags: its values for them)
        return Optional[bool], typer.Option(None, f"{flag}/--no-{name.replace('_', '-')}", help=help_text,
                                            show_default=False)
    if (typing.get_origin(bt) or bt) in (dict, list):
        return Optional[str], typer.Option(None, flag, help=help_text + " (YAML)", show_default=False)
    return Optional[bt], typer.Option(None, flag, help=help_text, show_default=False)


def stage_command(name: str, sections: list[type], opts: list[Opt] = (), help: str = "",
                  config_inputs: Callable[[SimpleNamespace, dict[str, Any]], list[Any]] | None = None,
                  below: Callable[[dict[str, Any]], dict[str, tuple[dict[str, Any], str]]] | None = None) -> Callable:
    """Register ``impl(cfg, opts)`` as command ``name`` with one flag per key of ``sections``.

    ``cfg`` has one attribute per section (``cfg.train``), resolved defaults <- params.yaml <- flags; ``opts`` has
    the extra options, the output resolved and checked (:func:`resolve_output`, :func:`check_output`), ``force``
    when the command writes one, ``params_file`` (``--params``) and ``params`` (the file as read).
    ``config_inputs(cfg, options)`` names input paths that come from params or defaults rather than options
    (fetch's local source, decode's bpe artifact when no --tokens names it), so that the output is checked against
    them too. ``below(options)`` gives, per section, values that lie between the defaults and params.yaml and where
    they come from (decode: the settings its checkpoint records).
    """

    def register(impl: Callable) -> Callable:
        out_opts = [o for o in opts if o.role == "out"]

        def command(**kwargs: Any) -> None:
            with _one_line_errors():
                params_file = kwargs.pop("params_file", None)
                params = load_params(params_file or PARAMS_FILE, required=params_file is not None) if sections else {}
                where = str(params_file or PARAMS_FILE)
                lower = below(kwargs) if below is not None else {}
                overrides = {section.SECTION: flag_values(section, kwargs) for section in sections}
                cfg = SimpleNamespace(**{section.SECTION: resolve(section, params, overrides[section.SECTION],
                                                                  where=where, below=lower.get(section.SECTION))
                                         for section in sections})
                check_sections(**vars(cfg))
                kwargs.update(params_file=params_file, params=params)
                inputs = [kwargs[o.name] for o in opts if o.role == "in"]
                inputs += config_inputs(cfg, kwargs) if config_inputs else []
                for out_opt in out_opts:  # each output may overlap neither an input nor another output
                    kwargs[out_opt.name] = out = resolve_output(out_opt, kwargs[out_opt.name])
                    if out is not None:
                        others = [kwargs[o.name] for o in out_opts if o is not out_opt]
                        check_output(out_opt, out, inputs + others, kwargs["force"])
                _note_below(lower, params, overrides)
                impl(cfg, SimpleNamespace(**kwargs))

        recorded = {section.SECTION for section in sections} & ({"decode"} if below is not None else set())
        command.__signature__ = _signature(name, sections, opts, recorded)  # type: ignore[attr-defined]
        command.__doc__ = help or impl.__doc__
        command.__name__ = name
        app.command(name)(command)
        return impl

    return register


def _note_below(lower: dict[str, tuple[dict[str, Any], str]], params: dict[str, dict[str, Any]],
                overrides: dict[str, dict[str, Any]]) -> None:
    """Say which settings came from below params.yaml (a checkpoint's record): a value no file or flag shows."""
    for section, (values, origin) in lower.items():
        used = {k: v for k, v in values.items()
                if k not in params.get(section, {}) and overrides.get(section, {}).get(k) is None}
        if used:
            from mtpipe.console import info

            info(f"{section} settings recorded in {origin} (params.yaml and flags leave them unset): "
                 + ", ".join(f"{k} {v}" for k, v in used.items()))


def _signature(name: str, sections: list[type], opts: list[Opt], recorded: set[str] = frozenset()) -> inspect.Signature:
    """The command's parameters as Typer reads them: --params, the extra options (--force with an output), and one
    option per params key (named ``section__key``)."""
    kw = inspect.Parameter.KEYWORD_ONLY
    sig = [inspect.Parameter("params_file", kw, annotation=Optional[Path], default=typer.Option(
        None, "--params", show_default=False,
        help="params.yaml to read \\[default: ./params.yaml if it exists, else built-in defaults]."))]
    sig = sig if sections else []  # a command that reads no params section has no --params
    for o in opts:
        # An output's default is applied after parsing, so that a default path and an explicit one differ.
        default = None if o.role == "out" else o.default
        sig.append(inspect.Parameter(o.name, kw, annotation=o.type, default=typer.Option(
            default, *o.flags, help=o.help, show_default=o.role != "out")))
    if any(o.role == "out" for o in opts):
        sig.append(inspect.Parameter("force", kw, annotation=bool, default=typer.Option(
            False, "--force", help="Replace the output even when it is not an mtpipe output of this kind.")))
    taken = {o.name for o in opts}
    for section in sections:
        for key, tp in field_types(section).items():
            if key in taken:
                raise RuntimeError(f"option {key} of '{name}' is defined twice")  # programming error
            taken.add(key)
            from_record = section.SECTION in recorded and key in RECORDED_DECODE
            ann, option = _param_option(section, key, tp, recorded=from_record)
            sig.append(inspect.Parameter(f"{section.SECTION}__{key}", kw, annotation=ann, default=option))
    return inspect.Signature(sig)


@contextlib.contextmanager
def _one_line_errors() -> Iterator[None]:
    """What users see when a stage fails: ``error: <file or key>: <problem>`` on one line and an exit status, never a
    traceback (1 = bad input or an OS error such as a full disk; 3 = score's gate; 130 = interrupted)."""
    try:
        yield
    except MtpipeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(getattr(e, "exit_code", 1)) from None
    except OSError as e:
        from mtpipe.errors import os_reason

        where = f"{e.filename}: " if e.filename else ""
        typer.echo(f"error: {where}{os_reason(e)}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130) from None


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mtpipe {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """mtpipe: reproducible Transformer machine translation, from raw corpus to BLEU."""


# --------------------------------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------------------------------


def _out(kind: str, default: str | None, help: str) -> Opt:
    return Opt("out", Optional[Path], Path(default) if default else None, help, ("--out",), role="out", kind=kind)


def _in(name: str, default: str | None, help: str, flag: str, tp: Any = Path) -> Opt:
    return Opt(name, tp, Path(default) if default else None, help, (flag,), role="in")


# --tokens of the commands that load a checkpoint: optional, a checkpoint carries its SentencePiece model.
TOKENS_HELP = ("The bpe artifact whose SentencePiece model to use \\[default: the checkpoint's own copy; for a "
               f"checkpoint without one, {PATHS['bpe']}].")
CHECKPOINT_HELP = f"Checkpoint directory \\[default: {PATHS['average']}]; with --engine ctranslate2 also an export. "


@stage_command(
    "fetch",
    [FetchConfig],
    [_out("corpus", PATHS["fetch"], f"Output artifact directory \\[default: {PATHS['fetch']}].")],
    config_inputs=lambda cfg, options: [_local_source(cfg.fetch.source)],
)
def fetch(cfg: SimpleNamespace, opts: SimpleNamespace) -> None:
    """Read a parallel corpus (Hugging Face or local files), clean train, write {train,valid,test}.parquet."""
    from mtpipe.stages.fetch import fetch_corpus

    fetch_corpus(cfg.fetch, out=opts.out, force=opts.force)


def _local_source(source: str) -> Path | None:
    from mtpipe.stages.sources import local_source

    return local_source(source)


@stage_command(
    "bpe",
    [BpeConfig],
    [
        _in("corpus", PATHS["fetch"], "Input: the fetch artifact.", "--corpus"),
        _out("tokens", PATHS["bpe"], f"Output artifact directory \\[default: {PATHS['bpe']}]."),
        _in("spm_model", None, "Encode with this existing SentencePiece model instead of training one.", "--spm-model",
            Optional[Path]),
    ],
    config_inputs=lambda cfg, options: [cfg.bpe.from_model],  # a checkpoint whose SentencePiece model to take
)
def bpe(cfg: SimpleNamespace, opts: SimpleNamespace) -> None:
    """Train a joint SentencePiece BPE model on train (or use a checkpoint's: --from-model); encode every split."""
    from mtpipe.stages.bpe import tokenize_corpus

    tokenize_corpus(cfg.bpe, corpus=opts.corpus, out=opts.out, spm_model=opts.spm_model, force=opts.force)


@stage_command(
    "bucket",
    [BucketConfig],
    [
        _in("tokens", PATHS["bpe"], "Input: the bpe artifact.", "--tokens"),
        _out("batches", PATHS["bucket"], f"Output artifact directory \\[default: {PATHS['bucket']}]."),
    ],
)
def bucket(cfg: SimpleNamespace, opts: SimpleNamespace) -> None:
    """Pack token-budget batches (sorted by length) for train and valid."""
    from mtpipe.stages.bucket import bucket_tokens

    bucket_tokens(cfg.bucket, tokens=opts.tokens, out=opts.out, force=opts.force)


@stage_command(
    "train",
    [ModelConfig, TrainConfig],
    [
        _in("tokens", PATHS["bpe"], "Input: the bpe artifact.", "--tokens"),
        _in("batches", PATHS["bucket"], "Input: the bucket artifact.", "--batches"),
        _out("run", PATHS["train"], f"Run directory (checkpoints, logs) \\[default: {PATHS['train']}]; training "
             "resumes from its latest checkpoint."),
    ],
    config_inputs=lambda cfg, options: [cfg.train.finetune_from],  # the parent of a fine-tune
)
def train(cfg: SimpleNamespace, opts: SimpleNamespace) -> None:
    """Train the Transformer: in this process, or on train.nproc processes (torchrun) running this same command.
    Each checkpoint carries the SentencePiece model and the decode settings params.yaml sets."""
    from mtpipe.training.launch import launch_command

    # --params goes to the workers too: rank 0 records that file's decode settings in the checkpoints.
    cmd = launch_command(cfg.model, cfg.train, {"tokens": opts.tokens, "batches": opts.batches, "out": opts.out,
                                                "params": opts.params_file}, force=opts.force)
    if cmd is not None:
        # torchrun's agent runs in this process: a failed group ends in one line naming the rank, the last
        # checkpoint and the command that resumes; torchrun's report goes to the run's train.log.
        from mtpipe.training.torchrun import run_torchrun

        raise typer.Exit(run_torchrun(cmd, opts.out))
    from mtpipe.training.launch import worker_errors
    from mtpipe.training.train import train_model

    with worker_errors():  # a worker of run_torchrun's: its error recorded for the launcher's line
        train_model(cfg.model, cfg.train, tokens=opts.tokens, batches=opts.batches, out=opts.out, force=opts.force,
                    decode=recorded_decode(opts.params))


@stage_command(
    "average",
    [AverageConfig],
    [
        # Not an "in" path: an average may go into the run's checkpoints folder (training skips averaged ones);
        # average itself refuses an output that overlaps a checkpoint it averages.
        Opt("run", Path, Path(PATHS["train"]), "Input: the train run directory.", ("--run",)),
        _in("checkpoints", None, "Average exactly this checkpoint directory instead (repeat the option for each).",
            "--checkpoint", Optional[list[Path]]),
        _out("checkpoint", PATHS["average"], f"Output checkpoint directory \\[default: {PATHS['average']}]."),
    ],
)
def average(cfg: SimpleNamespace, opts: SimpleNamespace) -> None:
    """Average the parameters of the last N checkpoints (paper section 6.1)."""
    from mtpipe.stages.average import average_checkpoints

    average_checkpoints(cfg.average, run_dir=opts.run, checkpoints=opts.checkpoints, out=opts.out, force=opts.force)


@stage_command(
    "decode",
    [DecodeConfig],
    [
        _in("checkpoint", None, CHECKPOINT_HELP + "Given more than once: an ensemble, their output probabilities "
            "averaged at each step (the checkpoints after the first replace decode.ensemble).", "--checkpoint",
            Optional[list[Path]]),
        _in("tokens", None, "The bpe artifact: its SentencePiece model \\[default: the checkpoint's own copy, else "
            f"{PATHS['bpe']}'s] and, without --input, its encoded splits \\[default: {PATHS['bpe']}].", "--tokens",
            Optional[Path]),
        _in("input", None, "Translate raw text from this file ('-' = stdin, translated line by line as it arrives) "
            "instead of --split.", "--input", Optional[Path]),
        _out("hypotheses", None, "Also write the hypotheses (.txt and .parquet with scores and n-best) as an artifact "
             "in this directory. Translations always go to stdout."),
        Opt("stats", Optional[bool], None, "Print the summary table (speed, tokens, mean score) to stderr \\[default: "
            "yes, unless the input is stdin or stdout is a terminal].", ("--stats/--no-stats",)),
    ],
    below=lambda options: checkpoint_decode({"checkpoint": _checkpoints(options["checkpoint"])[0]}),
    # A split is read from the default bpe artifact when --tokens names none; decode.ensemble's models are inputs.
    config_inputs=lambda cfg, options: ([PATHS["bpe"]] if options["tokens"] is None and options["input"] is None
                                        else []) + _checkpoints(options["checkpoint"]) + cfg.decode.ensemble,
)
def decode(cfg: SimpleNamespace, opts: SimpleNamespace) -> None:
    """Translate with batched beam search (a bpe split, or raw text from --input FILE or '-' = stdin); --engine
    ctranslate2 decodes through CTranslate2 instead; --checkpoint given more than once decodes an ensemble.
    Settings params.yaml and flags leave unset come from the checkpoint's record, else the defaults."""
    from mtpipe.stages.decode import translate_inputs

    first, *others = _checkpoints(opts.checkpoint)
    translate_inputs(dataclasses.replace(cfg.decode, ensemble=[str(p) for p in others] or cfg.decode.ensemble),
                     checkpoint=first, tokens=opts.tokens, input=opts.input, out=opts.out, force=opts.force,
                     stats=opts.stats)


def _checkpoints(given: list[Path] | None, most: int = 0) -> list[Path]:
    """--checkpoint's values (at most ``most`` of them; 0: any), else the default checkpoint."""
    if most and given and len(given) > most:
        raise MtpipeError(f"--checkpoint: given {len(given)} times; mtpipe serve serves one model (decode ensembles)")
    return list(given) if given else [Path(PATHS["average"])]


@stage_command(
    "serve",
    [ServeConfig, DecodeConfig],
    [
        _in("checkpoint", None, CHECKPOINT_HELP + "One: a server serves one.", "--checkpoint", Optional[list[Path]]),
        _in("tokens", None, TOKENS_HELP, "--tokens", Optional[Path]),
    ],
    below=lambda options: checkpoint_decode({"checkpoint": _checkpoints(options["checkpoint"], most=1)[0]}),
)
def serve(cfg: SimpleNamespace, opts: SimpleNamespace) -> None:
    """Serve translations over HTTP (POST /translate, GET /health/ready, /metrics, /info), requests decoded together
    in dynamic batches; decoding settings from the decode section. Needs `pip install 'mtpipe\\[serve]'`."""
    from mtpipe.serve.app import serve_model

    serve_model(cfg.serve, cfg.decode, checkpoint=_checkpoints(opts.checkpoint, most=1)[0], tokens=opts.tokens)


@stage_command(
    "score",
    [ScoreConfig],
    [
        _in("hyp", PATHS["decode"], "Hypotheses: a text file ('-' = stdin), or decode's output directory.", "--hyp"),
        _in("ref", PATHS["fetch"], "References: a text file, or the fetch artifact.", "--ref"),
        _in("baseline", None, "metrics JSON the baseline gates compare with.", "--baseline", Optional[Path]),
        _out("metrics", None, "Also write the metrics JSON to this file (the pipeline's is metrics/score.json)."),
    ],
)
def score(cfg: SimpleNamespace, opts: SimpleNamespace) -> None:
    """BLEU, chrF2 and TER with sacreBLEU, and CI gates on them (exit statuses: docs/ci.md)."""
    from mtpipe.stages.score import score_hypotheses

    score_hypotheses(cfg.score, hyp=opts.hyp, ref=opts.ref, baseline=opts.baseline, out=opts.out, force=opts.force)


@stage_command(
    "export",
    [ExportConfig],
    [
        _in("checkpoint", PATHS["average"], "Checkpoint directory (trained or averaged).", "--checkpoint"),
        _in("tokens", None, TOKENS_HELP, "--tokens", Optional[Path]),
        _out("export", PATHS["export"], f"Output model directory \\[default: {PATHS['export']}], replaced atomically."),
    ],
)
def export(cfg: SimpleNamespace, opts: SimpleNamespace) -> None:
    """Export a checkpoint to a CTranslate2 model directory (or a Hugging Face Marian / Pegasus model) with its
    SentencePiece model beside it."""
    from mtpipe.stages.export import export_model

    export_model(cfg.export, checkpoint=opts.checkpoint, tokens=opts.tokens, out=opts.out, force=opts.force)


@stage_command(
    "import",
    [],
    [
        Opt("format", str, "fairseq", "The checkpoint's toolkit (fairseq 0.12 `transformer`; the only one so far).",
            ("--format",)),
        _in("checkpoint", None, "The fairseq checkpoint (checkpoint.pt).", "--checkpoint", Optional[Path]),
        _in("dictionary", None, "fairseq's dictionaries: the data-bin directory with dict.SRC.txt and dict.TGT.txt, "
            "or one dict.txt for both sides.", "--dict", Optional[Path]),
        _in("spm_model", None, "The SentencePiece model that produced the fairseq data.", "--spm-model",
            Optional[Path]),
        _out("checkpoint", None, "Output: the mtpipe checkpoint directory."),
        Opt("tokens_out", Optional[Path], None, "Output (optional): also a bpe artifact directory with the remapped "
            "SentencePiece model, e.g. for `mtpipe bpe --spm-model`; the checkpoint carries it either way.",
            ("--tokens-out",), role="out", kind="tokens"),
    ],
)
def import_(cfg: SimpleNamespace, opts: SimpleNamespace) -> None:
    """Convert a fairseq transformer checkpoint into an mtpipe checkpoint (vocabulary remapped by piece string; the
    checkpoint carries its SentencePiece model), for decode, average and export."""
    from mtpipe.stages.importer import import_fairseq

    if opts.format != "fairseq":
        raise MtpipeError(f"--format {opts.format}: unknown; the one format is fairseq")
    for name, value in (("--checkpoint", opts.checkpoint), ("--dict", opts.dictionary),
                        ("--spm-model", opts.spm_model), ("--out", opts.out)):
        if value is None:
            raise MtpipeError(f"{name}: required")
    import_fairseq(opts.checkpoint, opts.dictionary, opts.spm_model, opts.out, opts.tokens_out, force=opts.force)


# mtpipe.stages.attention imports no torch nor matplotlib at the top: start-up stays instant.
from mtpipe.stages.attention import MAX_PIECES as ATTENTION_MAX_PIECES  # noqa: E402


@stage_command(
    "attention",
    [],
    [
        _in("checkpoint", PATHS["average"], "Checkpoint directory (trained or averaged).", "--checkpoint"),
        _in("tokens", None, TOKENS_HELP, "--tokens", Optional[Path]),
        Opt("text", Optional[str], None, f"The sentence to translate and draw, at most {ATTENTION_MAX_PIECES} "
            "SentencePiece pieces (a longer one's heatmap cells are too small to read).", ("--text",)),
        Opt("layer", Optional[int], None, "Layer (1-based) drawn head by head \\[default: the last of each stack]; "
            "index.html shows every layer.", ("--layer",)),
        Opt("beam", int, 1, f"Beam size of the translation whose attention is drawn (1 = greedy; at most {MAX_BEAM}, "
            "as decode.beam).", ("--beam",)),
        Opt("alpha", Optional[float], None, "Length penalty alpha when --beam > 1 \\[default: the checkpoint's "
            "recorded decode.alpha, else 0.6], with the checkpoint's recorded length penalty (else gnmt).",
            ("--alpha",)),
        _out("attention", None, "Output directory: PNG heatmaps, index.html, attention.npz/.json."),
    ],
)
def attention(cfg: SimpleNamespace, opts: SimpleNamespace) -> None:
    """Draw one sentence's attention (encoder self-, decoder self- and encoder-decoder attention, every head) as
    heatmaps labelled with its pieces, and an offline index.html (the paper's Figures 3-5)."""
    from mtpipe.stages.attention import attention_command

    record = checkpoint_decode({"checkpoint": opts.checkpoint}).get("decode")
    recorded = record[0] if record else {}
    alpha = opts.alpha if opts.alpha is not None else recorded.get("alpha", 0.6)
    attention_command(opts.checkpoint, opts.tokens, opts.text, opts.out, opts.layer, opts.beam, alpha,
                      length_penalty=recorded.get("length_penalty", "gnmt"), force=opts.force)


@stage_command(
    "plots",
    [],
    [
        # Not an "in" path: the default output lies inside the run (the command checks it against live/ instead).
        Opt("run", Path, Path(PATHS["train"]), "Input: the train run directory (its live/ dvclive metrics).",
            ("--run",)),
        _out("plots", None, "Output directory \\[default: RUN/plots]: a PNG per chart and index.html."),
    ],
)
def plots(cfg: SimpleNamespace, opts: SimpleNamespace) -> None:
    """Draw a training run's curves (loss, perplexity, learning rate, valid BLEU, ...) as PNGs and an index.html
    that opens offline (`dvc plots show` needs a CDN)."""
    from mtpipe.stages.plots import plots_command

    plots_command(opts.run, opts.out, force=opts.force)
