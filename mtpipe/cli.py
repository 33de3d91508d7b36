"""The ``mtpipe`` command line: one Typer command per pipeline stage.

Each command's options are generated from the params sections it reads (``mtpipe.config``), so every params.yaml
key is also a flag, and flags override params.yaml. Stage code (and torch) is imported inside the commands, which
keeps ``mtpipe --help`` instant.
"""

from __future__ import annotations

import inspect
import sys
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import typer

from mtpipe import __version__
from mtpipe.config import (
    PATHS,
    AverageConfig,
    BpeConfig,
    BucketConfig,
    DecodeConfig,
    ExportConfig,
    FetchConfig,
    ModelConfig,
    ScoreConfig,
    TrainConfig,
    base_type,
    field_types,
    load_params,
    resolve,
)
from mtpipe.errors import MtpipeError

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
    """A command option that is not a params key (artifact paths, input files)."""

    name: str
    type: Any
    default: Any
    help: str
    flags: tuple[str, ...] = ()


def _param_option(section: type, name: str, tp: Any) -> tuple[Any, Any]:
    """(annotation, typer.Option) for one params key; dict/list keys take a YAML string."""
    meta = next(f for f in fields(section) if f.name == name).metadata
    help_text = meta.get("help", "") + f" (params.yaml: {section.SECTION}.{name})"
    flag = "--" + name.replace("_", "-")
    bt = base_type(tp)
    if bt is bool:
        return Optional[bool], typer.Option(None, f"{flag}/--no-{name.replace('_', '-')}", help=help_text,
                                            show_default=False)
    if (typing.get_origin(bt) or bt) in (dict, list):
        return Optional[str], typer.Option(None, flag, help=help_text + " (YAML)", show_default=False)
    return Optional[bt], typer.Option(None, flag, help=help_text, show_default=False)


def stage_command(name: str, sections: list[type], opts: list[Opt] = (), help: str = "") -> Callable:
    """Register ``impl(cfg, opts, params)`` as command ``name`` with one flag per key of ``sections``.

    ``cfg`` has one attribute per section (``cfg.train``), resolved defaults <- params.yaml <- flags; ``opts`` has
    the extra options; ``params`` is the raw params.yaml mapping (for manifests).
    """

    def register(impl: Callable) -> Callable:
        sig: list[inspect.Parameter] = [
            inspect.Parameter("params_file", inspect.Parameter.KEYWORD_ONLY, annotation=Path,
                              default=typer.Option(Path("params.yaml"), "--params",
                                                   help="params.yaml to read (missing file = built-in defaults)."))
        ]
        owner: dict[str, tuple[type, str]] = {}
        for o in opts:
            sig.append(inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, annotation=o.type,
                                         default=typer.Option(o.default, *o.flags, help=o.help)))
            owner[o.name] = (None, o.name)
        for section in sections:
            for key, tp in field_types(section).items():
                if key in owner:
                    raise RuntimeError(f"option {key} of '{name}' is defined twice")  # programming error
                ann, option = _param_option(section, key, tp)
                pname = f"{section.SECTION}__{key}"
                sig.append(inspect.Parameter(pname, inspect.Parameter.KEYWORD_ONLY, annotation=ann, default=option))
                owner[key] = (section, key)

        def command(**kwargs: Any) -> None:
            try:
                import yaml

                params_file = kwargs.pop("params_file")
                explicit = "--params" in sys.argv
                params = load_params(params_file, required=explicit)
                cfg = {}
                for section in sections:
                    over = {}
                    types = field_types(section)
                    for key in types:
                        v = kwargs.pop(f"{section.SECTION}__{key}")
                        if v is not None and (typing.get_origin(base_type(types[key])) or base_type(types[key])) in (
                            dict, list,
                        ):
                            try:
                                v = yaml.safe_load(v)
                            except yaml.YAMLError:
                                raise MtpipeError(f"--{key.replace('_', '-')}: not valid YAML: {v!r}") from None
                        over[key] = v
                    cfg[section.SECTION] = resolve(section, params, over, where=str(params_file))
                impl(SimpleNamespace(**cfg), SimpleNamespace(**kwargs), params)
            except MtpipeError as e:
                typer.echo(f"error: {e}", err=True)
                # 1 = bad input; a subclass may set another status (score's gate failure: 3).
                raise typer.Exit(getattr(e, "exit_code", 1)) from None
            except KeyboardInterrupt:
                typer.echo("interrupted", err=True)
                raise typer.Exit(130) from None

        command.__signature__ = inspect.Signature(sig)  # type: ignore[attr-defined]
        command.__doc__ = help or impl.__doc__
        command.__name__ = name
        app.command(name)(command)
        return impl

    return register


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


@stage_command(
    "fetch",
    [FetchConfig],
    [Opt("out", Path, Path(PATHS["fetch"]), "Output artifact directory.", ("--out",))],
)
def fetch(cfg: SimpleNamespace, opts: SimpleNamespace, params: dict) -> None:
    """Read a parallel corpus (Hugging Face or local files), clean train, write {train,valid,test}.parquet."""
    from mtpipe.fetch import run

    run(cfg.fetch, out=opts.out)


@stage_command(
    "bpe",
    [BpeConfig],
    [
        Opt("corpus", Path, Path(PATHS["fetch"]), "Input: the fetch artifact.", ("--corpus",)),
        Opt("out", Path, Path(PATHS["bpe"]), "Output artifact directory.", ("--out",)),
        Opt("spm_model", Optional[Path], None, "Encode with this existing SentencePiece model instead of training one.",
            ("--spm-model",)),
    ],
)
def bpe(cfg: SimpleNamespace, opts: SimpleNamespace, params: dict) -> None:
    """Train a joint SentencePiece BPE model on train and encode every split to token ids."""
    from mtpipe.bpe import run

    run(cfg.bpe, corpus=opts.corpus, out=opts.out, spm_model=opts.spm_model)


@stage_command(
    "bucket",
    [BucketConfig],
    [
        Opt("tokens", Path, Path(PATHS["bpe"]), "Input: the bpe artifact.", ("--tokens",)),
        Opt("out", Path, Path(PATHS["bucket"]), "Output artifact directory.", ("--out",)),
    ],
)
def bucket(cfg: SimpleNamespace, opts: SimpleNamespace, params: dict) -> None:
    """Pack token-budget batches (sorted by length) for train and valid."""
    from mtpipe.bucket import run

    run(cfg.bucket, tokens=opts.tokens, out=opts.out)


@stage_command(
    "train",
    [ModelConfig, TrainConfig],
    [
        Opt("tokens", Path, Path(PATHS["bpe"]), "Input: the bpe artifact.", ("--tokens",)),
        Opt("batches", Path, Path(PATHS["bucket"]), "Input: the bucket artifact.", ("--batches",)),
        Opt("out", Path, Path(PATHS["train"]), "Output directory (checkpoints, logs); resumed if it has checkpoints.",
            ("--out",)),
    ],
)
def train(cfg: SimpleNamespace, opts: SimpleNamespace, params: dict) -> None:
    """Train the Transformer (one process, or every process of a torchrun launch)."""
    from mtpipe.train import run

    run(cfg.model, cfg.train, tokens=opts.tokens, batches=opts.batches, out=opts.out)


@stage_command(
    "average",
    [AverageConfig],
    [
        Opt("run", Path, Path(PATHS["train"]), "Input: the train output directory.", ("--run",)),
        Opt("checkpoints", Optional[list[Path]], None,
            "Average exactly this checkpoint directory instead (repeat the option for each).", ("--checkpoint",)),
        Opt("out", Path, Path(PATHS["average"]), "Output checkpoint directory.", ("--out",)),
    ],
)
def average(cfg: SimpleNamespace, opts: SimpleNamespace, params: dict) -> None:
    """Average the parameters of the last N checkpoints (paper section 6.1)."""
    from mtpipe.average import run

    run(cfg.average, run_dir=opts.run, checkpoints=opts.checkpoints, out=opts.out)


@stage_command(
    "decode",
    [DecodeConfig],
    [
        Opt("checkpoint", Path, Path(PATHS["average"]), "Checkpoint directory (trained or averaged); with --engine "
            "ctranslate2 also a CTranslate2 export (`mtpipe export`).", ("--checkpoint",)),
        Opt("tokens", Path, Path(PATHS["bpe"]), "The bpe artifact (SentencePiece model and encoded splits).",
            ("--tokens",)),
        Opt("input", Optional[Path], None, "Translate raw text from this file ('-' = stdin) instead of --split.",
            ("--input",)),
        Opt("out", Optional[Path], None,
            f"Output directory (hypotheses .txt and .parquet). Default with --split: {PATHS['decode']}; with "
            "--input the translations go to stdout, and also to this directory when it is given.", ("--out",)),
    ],
)
def decode(cfg: SimpleNamespace, opts: SimpleNamespace, params: dict) -> None:
    """Translate with batched beam search (a bpe split, or raw text from --input FILE or '-' = stdin); --engine
    ctranslate2 decodes through CTranslate2 instead."""
    from mtpipe.decode import run

    run(cfg.decode, checkpoint=opts.checkpoint, tokens=opts.tokens, input=opts.input, out=opts.out)


@stage_command(
    "score",
    [ScoreConfig],
    [
        Opt("hyp", Path, Path(PATHS["decode"]), "Hypotheses: a text file, or decode's output directory.", ("--hyp",)),
        Opt("ref", Path, Path(PATHS["fetch"]), "References: a text file, or the fetch artifact.", ("--ref",)),
        Opt("baseline", Optional[Path], None, "metrics JSON to compare with (with --max-drop).", ("--baseline",)),
        Opt("out", Path, Path(PATHS["score"]), "Metrics JSON to write.", ("--out",)),
    ],
)
def score(cfg: SimpleNamespace, opts: SimpleNamespace, params: dict) -> None:
    """BLEU, chrF2 and TER with sacreBLEU. Exit status: 0 ok, 1 bad input, 3 gate failed (metrics still written)."""
    from mtpipe.score import run

    run(cfg.score, hyp=opts.hyp, ref=opts.ref, baseline=opts.baseline, out=opts.out)


@stage_command(
    "export",
    [ExportConfig],
    [
        Opt("checkpoint", Path, Path(PATHS["average"]), "Checkpoint directory (trained or averaged).",
            ("--checkpoint",)),
        Opt("tokens", Path, Path(PATHS["bpe"]), "The bpe artifact whose SentencePiece model the checkpoint uses.",
            ("--tokens",)),
        Opt("out", Path, Path(PATHS["export"]), "Output model directory (replaced atomically).", ("--out",)),
    ],
)
def export(cfg: SimpleNamespace, opts: SimpleNamespace, params: dict) -> None:
    """Export a checkpoint to a CTranslate2 model directory (or a Hugging Face Marian model) with its SentencePiece
    model beside it."""
    from mtpipe.export import run

    run(cfg.export, checkpoint=opts.checkpoint, tokens=opts.tokens, out=opts.out)
