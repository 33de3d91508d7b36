"""One file written atomically, with the permissions a plain ``open`` gives: below :mod:`mtpipe.reading` (whose
verification records use it) and :mod:`mtpipe.writing` (which writes whole artifacts), so neither imports the other
for it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mtpipe.errors import MtpipeError, os_reason


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def atomic_write_text(path: Path | str, text: str) -> None:
    """Write a single file atomically (temp file in the same directory, then rename), with the permissions a plain
    ``open`` would give; an OS error becomes one :class:`MtpipeError` line and leaves ``path`` as it was."""
    path = Path(path)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise MtpipeError(f"{path}: cannot write ({os_reason(e)})") from None
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
