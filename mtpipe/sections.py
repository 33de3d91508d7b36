"""What every params section is made of: a field with its help and rules (:func:`_h`), the :class:`Section` base
that checks them however a section is built, and the plain-data view of a section (:func:`to_dict`).

Below :mod:`mtpipe.config` and :mod:`mtpipe.config_inference` (the sections themselves), which both build on it.
Light (no torch, no pyarrow).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import field
from typing import Any

from mtpipe.errors import MtpipeError


def _h(text: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
       lt: float | None = None, choices: tuple[str, ...] | None = None, **kw: Any) -> Any:
    """A dataclass field with a help string (``mtpipe <stage> --help``) and the rules its value must follow when a
    section is built (:class:`Section`): a finite number ``>= ge``, ``> gt``, ``<= le``, ``< lt``; one of
    ``choices``. ``None`` (for optional fields) passes every rule."""
    rules = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices}
    return field(metadata={"help": text, **{k: v for k, v in rules.items() if v is not None}}, **kw)


class Section:
    """Base of every params section: the fields' rules, then :meth:`check`'s, hold however a section is built."""

    SECTION: typing.ClassVar[str]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            check_rules(type(self), f.name, getattr(self, f.name), f.metadata, "params")
        self.check()

    def check(self) -> None:
        """The rules across this section's keys (an :class:`MtpipeError` naming them); none here."""


def check_rules(cls: type, key: str, value: Any, meta: Any, where: str) -> None:
    """A value against its field's bounds and ``choices`` (see :func:`_h`); ``where`` names its origin."""
    if value is None:
        return
    name = f"{cls.SECTION}.{key}"
    bounds = [(op, meta[op]) for op in ("ge", "gt", "le", "lt") if op in meta]
    if bounds and not (math.isfinite(value) and all(_BOUND[op](value, b) for op, b in bounds)):
        want = " and ".join(f"{_SYMBOL[op]} {b:g}" for op, b in bounds)
        raise MtpipeError(f"{where}: {name} = {value!r} must be {want}")
    if "choices" in meta and value not in meta["choices"]:
        raise MtpipeError(f"{where}: {name} = {value!r} is not one of {', '.join(meta['choices'])}")


_BOUND = {"ge": lambda v, b: v >= b, "gt": lambda v, b: v > b, "le": lambda v, b: v <= b, "lt": lambda v, b: v < b}
_SYMBOL = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def to_dict(section: Any) -> dict[str, Any]:
    """A section as plain data (for manifests and checkpoints)."""
    return dataclasses.asdict(section)
