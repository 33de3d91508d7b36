"""params.yaml and the flags: reading them into sections, in order of precedence.

Lowest first: a section's dataclass defaults (:mod:`mtpipe.config`), then what a checkpoint records of the decode
settings (``decode`` and ``serve``: :data:`mtpipe.config.RECORDED_DECODE`), then ``params.yaml``, then the
command-line flags. Each value is checked alone as it is read (its type, its field's rules, unknown keys named);
the section's rules across its keys when the section is built, so that params.yaml may hold one half of a pair
whose other half a flag gives.

Light like :mod:`mtpipe.config` (PyYAML only, imported when needed): the CLI uses it at start-up.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

from mtpipe.artifacts import MANIFEST, CheckpointManifest
from mtpipe.config import RECORDED_DECODE, SECTIONS, check_rules
from mtpipe.errors import MtpipeError

PARAMS_FILE = "params.yaml"

# Default artifact locations: what `mtpipe <stage>` uses with no arguments, and what dvc.yaml passes.
PATHS: dict[str, str] = {
    "fetch": "artifacts/fetch",
    "bpe": "artifacts/bpe",
    "bucket": "artifacts/bucket",
    "train": "artifacts/train",
    "average": "artifacts/average",
    "decode": "artifacts/decode",
    "score": "metrics/score.json",
    "export": "artifacts/export",
}


def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a section's fields (``from __future__ import annotations`` makes them strings)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def base_type(tp: Any) -> Any:
    """``Optional[int]`` -> ``int``; anything else unchanged."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union and len(args) == 1:
        return args[0]
    return tp


def _coerce(cls: type, key: str, value: Any, tp: Any, where: str) -> Any:
    """Check a params.yaml value against the field's type; ints are accepted for floats."""
    if value is None:
        if typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp):
            return None
        raise MtpipeError(f"{where}: {cls.SECTION}.{key} must not be null")
    bt = base_type(tp)
    origin = typing.get_origin(bt) or bt
    if bt is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if bt is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if origin in (dict, list) and isinstance(value, origin):
        return value
    if isinstance(bt, type) and isinstance(value, bt) and not (bt is int and isinstance(value, bool)):
        return value
    raise MtpipeError(f"{where}: {cls.SECTION}.{key} = {value!r} is not a {getattr(bt, '__name__', bt)}")


def make_section(cls: type, values: dict[str, Any], where: str = PARAMS_FILE,
                 origins: dict[str, str] | None = None) -> Any:
    """Build a section from a mapping, failing on unknown keys (named), wrong types, values outside their field's
    rules (:func:`checked_values`) and the section's rules across its keys (:meth:`mtpipe.config.Section.check`)."""
    return cls(**checked_values(cls, values, where, origins))


def checked_values(cls: type, values: dict[str, Any], where: str = PARAMS_FILE,
                   origins: dict[str, str] | None = None) -> dict[str, Any]:
    """``values`` of section ``cls`` coerced to their fields' types, each key checked alone: unknown keys (named),
    wrong types, values outside their field's rules; ``origins`` names where a key's value came from when not
    ``where`` (a command-line flag). A part of a section (params.yaml's, before flags) passes here."""
    if not isinstance(values, dict):
        raise MtpipeError(f"{where}: section '{cls.SECTION}' must be a mapping, got {type(values).__name__}")
    types = field_types(cls)
    unknown = [k for k in values if k not in types]
    if unknown:
        raise MtpipeError(
            f"{where}: unknown key '{cls.SECTION}.{unknown[0]}' (known: {', '.join(types)})"
        )
    metas = {f.name: f.metadata for f in dataclasses.fields(cls)}
    coerced = {}
    for k, v in values.items():
        origin = (origins or {}).get(k, where)
        if isinstance(v, bool) and "booleans" in metas[k]:  # a key that was a boolean once: its value for each
            v = metas[k]["booleans"][v]
        coerced[k] = _coerce(cls, k, v, types[k], origin)
        check_rules(cls, k, coerced[k], metas[k], origin)
    return coerced


def load_params(path: Path | str | None = PARAMS_FILE, *, required: bool = False) -> dict[str, dict[str, Any]]:
    """Read params.yaml into ``{section: {key: value}}``; unknown sections fail with their name.

    A missing file is fine unless ``required`` (then every value is the dataclass default).
    """
    import yaml

    path = Path(path) if path is not None else None
    if path is None or not path.exists():
        if required:
            raise MtpipeError(f"{path}: params file not found")
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else "invalid YAML"
        raise MtpipeError(f"{path}: not valid YAML ({first})") from None
    if not isinstance(data, dict):
        raise MtpipeError(f"{path}: top level must be a mapping of sections")
    unknown = [k for k in data if k not in SECTIONS]
    if unknown:
        raise MtpipeError(f"{path}: unknown section '{unknown[0]}' (known: {', '.join(SECTIONS)})")
    for name, values in data.items():
        checked_values(SECTIONS[name], values or {}, str(path))  # every section's keys, used or not
    return {k: (v or {}) for k, v in data.items()}


def resolve(cls: type, params: dict[str, dict[str, Any]], overrides: dict[str, Any] | None = None,
            where: str = PARAMS_FILE, below: tuple[dict[str, Any], str] | None = None) -> Any:
    """Section ``cls`` from defaults <- ``below`` <- params.yaml <- ``overrides`` (CLI flags; ``None`` means not
    given). ``below``: ``(values, where they come from)`` under params.yaml (a checkpoint's recorded decode
    settings); a bad value there is named by its origin."""
    values, origins = {}, {}
    if below is not None:
        values.update(below[0])
        origins.update({k: below[1] for k in below[0]})
    for k, v in params.get(cls.SECTION, {}).items():
        values[k] = v
        origins.pop(k, None)
    for k, v in (overrides or {}).items():
        if v is not None:
            values[k] = v
            origins[k] = "--" + k.replace("_", "-")
    return make_section(cls, values, where, origins)


def help_params(path: Path = Path(PARAMS_FILE)) -> dict[str, dict[str, Any]]:
    """``./params.yaml`` as ``--help`` shows it beside each flag, read once at start-up (PyYAML, no torch); any
    problem with it gives {} here: the command itself reports it."""
    if not path.is_file():
        return {}
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):  # UnicodeDecodeError is a ValueError
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)}


def flag_values(section: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The flags of ``section`` taken out of a command's ``kwargs`` (named ``section__key``; None = not given);
    dict and list values are YAML."""
    import yaml

    over = {}
    for key, tp in field_types(section).items():
        v = kwargs.pop(f"{section.SECTION}__{key}")
        if v is not None and (typing.get_origin(base_type(tp)) or base_type(tp)) in (dict, list):
            try:
                v = yaml.safe_load(v)
            except yaml.YAMLError:
                raise MtpipeError(f"--{key.replace('_', '-')}: not valid YAML: {v!r}") from None
        over[key] = v
    return over


def checkpoint_decode(options: dict[str, Any]) -> dict[str, tuple[dict[str, Any], str]]:
    """The decode settings that ``--checkpoint`` (a checkpoint or an export) records, to lie under params.yaml
    (:func:`resolve`'s ``below``, per section); {} when it records none or cannot be read (loading it says why)."""
    manifest = Path(options.get("checkpoint") or PATHS["average"]) / MANIFEST
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
        record = CheckpointManifest.of_artifact(data.get("kind"), data.get("extra"), manifest).decode
    except (OSError, ValueError, AttributeError, MtpipeError):
        return {}
    if record is None:
        return {}
    return {"decode": ({k: record[k] for k in RECORDED_DECODE if k in record}, str(manifest))}


def recorded_decode(params: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What a checkpoint records of the decode settings: the keys of :data:`RECORDED_DECODE` that params.yaml sets
    (the defaults are not recorded, so that they stay the defaults of whatever mtpipe decodes it)."""
    return {k: v for k, v in (params.get("decode") or {}).items() if k in RECORDED_DECODE}
