"""The one exception type users see.

Every stage reports bad input by raising :class:`MtpipeError` with a message that names the file (or param) and the
problem in one line; the CLI prints it as ``error: ...`` and exits non-zero without a traceback.
An ``OSError`` (a full disk, no permission) reads the same way: :func:`os_reason` gives its meaning in a few words.
"""

from __future__ import annotations

import errno
import os


class MtpipeError(Exception):
    """A user-facing error: bad input, bad params, incompatible artifacts."""


def os_reason(e: OSError) -> str:
    """An OS error's meaning in a few words: ``No space left on device (ENOSPC)``."""
    if e.errno is None:
        return str(e)
    return f"{os.strerror(e.errno)} ({errno.errorcode.get(e.errno, e.errno)})"
