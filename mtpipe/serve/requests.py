"""A ``POST /translate`` request read and checked before it reaches the queue: its body read within a byte limit
(:func:`read_body`), parsed and validated (:func:`parse_request`), every problem one line for the client.

Bad input gets a 4xx and one line of JSON ``{"error": "..."}``: 400 for a body that is not UTF-8 JSON (also JSON
nested too deeply to parse), 413 for too many sentences, characters or work, 422 for valid JSON with wrong fields or
values. Text is cleaned as ``mtpipe decode --input`` cleans a line (:func:`mtpipe.engine.opening.clean_line`), so a
sentence translates exactly as ``mtpipe decode`` translates it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from mtpipe.config import DecodeConfig, ServeConfig
from mtpipe.engine.lanes import first_line
from mtpipe.engine.opening import clean_line

REQUEST_FIELDS = ("text", "beam", "alpha", "nbest")
RETRY_AFTER_S = 1  # a full queue drains within a batch or two: ask clients to come back after a second


class RequestError(Exception):
    """A bad request: the HTTP ``status`` and a one-line ``reason`` (answered as ``{"error": reason}``)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class TranslateRequest:
    """A checked ``POST /translate`` body: sentences cleaned as ``mtpipe decode --input`` cleans lines."""

    sentences: list[str]
    beam: int
    alpha: float
    nbest: int


def max_body_bytes(cfg: ServeConfig) -> int:
    """The largest body a valid request can need: every sentence at ``max_chars`` characters written as JSON escapes
    (12 bytes for a character outside the BMP, a surrogate pair), plus quotes, commas and the other fields."""
    return cfg.max_sentences * (12 * cfg.max_chars + 4) + 4096


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _brief(value: Any) -> str:
    """A value as the start of its JSON, for an error line (a value nested too deeply to write: its type)."""
    try:
        return json.dumps(value)[:40]
    except (RecursionError, ValueError):
        return type(value).__name__


def _int_field(data: dict[str, Any], key: str, default: int, limit: int, limit_name: str) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(422, f"{key}: must be an integer, got {_brief(value)}")
    if value < 1:
        raise RequestError(422, f"{key}: {value} must be >= 1")
    if value > limit:
        raise RequestError(422, f"{key}: {value} is over the server's limit ({limit_name} = {limit})")
    return value


def parse_request(body: bytes, cfg: ServeConfig, defaults: DecodeConfig) -> TranslateRequest:
    """The sentences and settings of a ``/translate`` body, or :class:`RequestError` naming the first problem."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"body: not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise RequestError(400, f"body: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:  # NaN / Infinity
        raise RequestError(400, f"body: not valid JSON ({e})") from None
    except RecursionError:  # arrays or objects nested thousands deep: the parser's recursion gives up
        raise RequestError(400, "body: JSON nested too deeply (a request is an object of a list of strings)") \
            from None
    except Exception as e:  # noqa: BLE001 - whatever else the parser meets is the body's fault: 400, one line
        raise RequestError(400, f"body: cannot be parsed as JSON ({first_line(e)})") from None
    if not isinstance(data, dict):
        raise RequestError(422, 'body: must be a JSON object such as {"text": ["A sentence."]}')
    unknown = [k for k in data if k not in REQUEST_FIELDS]
    if unknown:
        raise RequestError(422, f"unknown field '{unknown[0]}' (known: {', '.join(REQUEST_FIELDS)})")
    if "text" not in data:
        raise RequestError(422, "text: missing (a list of sentences to translate)")
    items = data["text"]
    if not isinstance(items, list):
        raise RequestError(422, f"text: must be a list of strings, got {type(items).__name__}")
    if not items:
        raise RequestError(422, "text: empty list (nothing to translate)")
    if len(items) > cfg.max_sentences:
        raise RequestError(413, f"text: {len(items)} sentences, more than the server's limit (serve.max_sentences "
                                f"= {cfg.max_sentences})")
    sentences = []
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise RequestError(422, f"text[{i}]: must be a string, got {_brief(item)}")
        if len(item) > cfg.max_chars:
            raise RequestError(413, f"text[{i}]: {len(item)} characters, more than the server's limit "
                                    f"(serve.max_chars = {cfg.max_chars})")
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate escape such as "\ud800"
            raise RequestError(422, f"text[{i}]: not valid Unicode (a lone surrogate)") from None
        sentence = clean_line(item)  # as mtpipe decode --input cleans a line
        if not sentence:
            raise RequestError(422, f"text[{i}]: empty or whitespace only")
        sentences.append(sentence)

    beam = _int_field(data, "beam", defaults.beam, cfg.max_beam, "serve.max_beam")
    # decode.nbest is the default, but never above the beam this request asked for.
    nbest = _int_field(data, "nbest", min(defaults.nbest, beam), cfg.max_nbest, "serve.max_nbest")
    if nbest > beam:
        raise RequestError(422, f"nbest: {nbest} is more than beam ({beam})")
    alpha = data.get("alpha", defaults.alpha)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise RequestError(422, f"alpha: must be a number, got {_brief(alpha)}")
    if not 0 <= alpha <= cfg.max_alpha:
        raise RequestError(422, f"alpha: {alpha} must be between 0 and the server's limit (serve.max_alpha = "
                                f"{cfg.max_alpha:g})")
    return TranslateRequest(sentences, beam, float(alpha), nbest)


class ClientGone(Exception):
    """The client closed its connection before sending the whole body (``received`` bytes of it)."""

    def __init__(self, received: int) -> None:
        super().__init__(f"after {received} bytes of the body")
        self.received = received


async def read_body(request: Any, limit: int) -> bytes:
    """The request body, refused (413) as soon as it grows past ``limit`` bytes, so a huge body is never held;
    :class:`ClientGone` when the client leaves before its end."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"body: {int(declared)} bytes, more than any valid request needs ({limit})")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"body: more than {limit} bytes, more than any valid request needs")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone(size) from None
    return b"".join(chunks)


__all__ = ["ClientGone", "REQUEST_FIELDS", "RETRY_AFTER_S", "RequestError", "TranslateRequest",
           "max_body_bytes", "parse_request", "read_body"]
