"""The one exception type users see.

Every stage reports bad input by raising :class:`MtpipeError` with a message that names the file (or param) and the
problem in one line; the CLI prints it as ``error: ...`` and exits non-zero without a traceback.
"""


class MtpipeError(Exception):
    """A user-facing error: bad input, bad params, incompatible artifacts."""
