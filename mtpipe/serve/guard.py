"""What bounds a server's connections beyond uvicorn's own settings (:class:`ConnectionGuard`): every phase of reading
a request is bounded, so that no client can hold the server.

* reading it: ``serve.read_timeout_s`` for its headers and body from its first byte (a connection that sends nothing
  is closed after as long; 408 to one that sent part of a request), ``serve.keep_alive_s`` between requests (uvicorn's
  own timer), at most ``serve.max_connections`` connections (one more: 503, closed at once), checked against the
  open-file limit at start-up (:func:`mtpipe.serve.app.check_open_files`);
* the drain after SIGTERM: ``serve.drain_s`` later, the connections still sending a request are closed;
* a request the HTTP parser rejects (a malformed request line or header, a negative Content-Length, headers too
  large) is answered 400 with one line of JSON, as every other error, not uvicorn's plain text.

It is a small layer on uvicorn's h11 protocol (:meth:`ConnectionGuard.protocol`), which times only the wait between
requests.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any


def _plain_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with ``{"error": message}``, written straight to a connection the server then
    closes (it is answered outside any request's ASGI cycle)."""
    body = json.dumps({"error": message}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


CLOSED_BY_SERVER = "mtpipe.closed"  # scope key: why the server itself closed a request's connection (no log line)


class ConnectionGuard:
    """What bounds a server's connections beyond uvicorn's own settings, and what it did (``counters``, in ``/info``).

    uvicorn times a connection only while it is idle between requests (``timeout_keep_alive``): a client that
    connects and sends nothing, or half a request, holds its connection, a file descriptor and (mid-body) a request
    handler for as long as it likes; enough of them use up the process's open files and nothing is served. Hence:

    * ``read_timeout_s``: a request must arrive whole, headers and body, within this of its first byte (of the
      connection's opening, for its first request); else the connection is closed, with a 408 if part of a request
      came. A whole deadline, not an idle timer, so that a client trickling a byte a second is bounded too.
    * ``max_connections``: one more connection is answered 503 and closed before anything is read from it. Refusing
      at once, rather than queueing, keeps the process's open files below its limit and tells a client to go
      elsewhere while it can.
    * :meth:`drop_stalled`: the end of the drain after SIGTERM (``serve.drain_s``): the connections still sending a
      request are closed, so that a client can no longer hold a stopping server.

    :meth:`protocol` makes the uvicorn protocol class that applies these (``uvicorn.Config(http=...)``)."""

    LOG_EVERY_S = 10.0  # refusals can come by the thousand: one line per this many seconds says how many

    def __init__(self, read_timeout_s: float, max_connections: int) -> None:
        import logging

        self.read_timeout_s, self.max_connections = read_timeout_s, max_connections
        self.log = logging.getLogger("uvicorn.error")  # uvicorn's log: its format, its level
        self.open: set[Any] = set()  # the connections served (event loop thread only)
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop, once it runs
        self.counters = {"refused_connections": 0, "read_timeouts": 0, "client_disconnects": 0, "bad_requests": 0}
        self._logged_refusals = (0.0, 0)  # when a refusal was last logged, and the count then
        self.busy = _plain_response(503, "Service Unavailable", f"busy: {max_connections} connections already open "
                                    "(serve.max_connections); retry later")
        self.timeout = _plain_response(408, "Request Timeout", f"request not received whole within "
                                       f"{read_timeout_s:g} s (serve.read_timeout_s)")

    def refuse(self, transport: Any) -> None:
        self.counters["refused_connections"] += 1
        transport.write(self.busy)
        transport.close()
        now, count = time.monotonic(), self.counters["refused_connections"]
        if now - self._logged_refusals[0] >= self.LOG_EVERY_S:
            self.log.warning("refusing connections: %d open (serve.max_connections); %d refused since the last "
                             "line", self.max_connections, count - self._logged_refusals[1])
            self._logged_refusals = (now, count)

    def drop_stalled(self) -> int:
        """Close the connections still sending a request or stuck writing an answer (in the event loop's thread);
        those whose request is in and not yet answered are left to their answer (503 after
        :meth:`mtpipe.serve.batcher.Batcher.abandon`). The number closed."""
        import h11

        dropped = 0
        for proto in list(self.open):
            cycle = proto.cycle
            answering = (cycle is not None and proto.conn.their_state in (h11.DONE, h11.MUST_CLOSE)
                         and not cycle.response_started)
            if answering or proto.transport.is_closing():
                continue
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the handler's answer goes nowhere; its receive() is a disconnect
                proto.scope[CLOSED_BY_SERVER] = "drain"
            proto.transport.abort()
            dropped += 1
        return dropped

    def timed_out(self, proto: Any) -> None:
        """A connection whose request did not arrive whole within ``read_timeout_s`` (the protocol ``proto``'s
        timer): closed, with a 408 and a log line if part of a request came."""
        import h11

        self.counters["read_timeouts"] += 1
        conn = proto.conn
        if conn.their_state is h11.SEND_BODY or bool(conn.trailing_data[0]):
            cycle = proto.cycle if conn.their_state is h11.SEND_BODY else None
            if cycle is None or not cycle.response_started:
                proto.transport.write(self.timeout)
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the handler reading the body sees a disconnect; its answer is dropped
                proto.scope[CLOSED_BY_SERVER] = "read timeout"
            client = "%s:%d" % proto.client if proto.client else "a client"
            self.log.info("%s: request not received whole within %g s (serve.read_timeout_s): connection closed",
                          client, self.read_timeout_s)
        proto.transport.close()  # a connection that sent nothing is closed without a word

    def bad_request(self, proto: Any) -> None:
        """A request h11 cannot parse (uvicorn's protocol ``proto`` would answer it in plain text): 400 with one
        line of JSON naming h11's reason, and the connection closed."""
        self.counters["bad_requests"] += 1
        why = " ".join(getattr(proto, "parse_error", "").split())
        proto.transport.write(_plain_response(400, "Bad Request", f"invalid HTTP request: {why}" if why
                                              else "invalid HTTP request"))
        proto.transport.close()

    def protocol(self) -> type:
        """uvicorn's h11 protocol with these bounds (``uvicorn.Config(http=guard.protocol())``)."""
        return _guarded_h11(self)


def _keep_parse_errors(proto: Any) -> None:
    """Keep h11's reason for rejecting a request in ``proto.parse_error`` (uvicorn answers every one alike)."""
    import h11

    next_event = proto.conn.next_event

    def parsed() -> Any:
        try:
            return next_event()
        except h11.RemoteProtocolError as e:
            proto.parse_error = str(e)
            raise

    proto.conn.next_event = parsed


def _guarded_h11(guard: ConnectionGuard) -> type:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        """uvicorn's h11 protocol, plus a read deadline per request, a cap on open connections and the parser's 400
        in JSON (:class:`ConnectionGuard`). uvicorn's own keep-alive timer still closes idle connections."""

        refused = False
        read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            if len(guard.open) >= guard.max_connections:
                self.refused = True
                guard.refuse(transport)
                return
            super().connection_made(transport)
            _keep_parse_errors(self)
            guard.open.add(self)
            self._arm()  # the first request must come within the read timeout of the connection's opening

        def connection_lost(self, exc: Exception | None) -> None:
            if self.refused:
                return
            guard.open.discard(self)
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.refused:
                return
            if self.read_timer is None and self.conn.their_state is h11.IDLE:
                self._arm()  # a request starts: its headers and body must be in within the read timeout
            super().data_received(data)
            if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
                self._disarm()  # the request is in (or the connection failed): the handler's time, not the client's

        def send_400_response(self, msg: str) -> None:
            guard.bad_request(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.SEND_BODY and self.read_timer is None:
                self._arm()  # a pipelined request whose body is still coming: uvicorn's keep-alive timer is off

        def _arm(self) -> None:
            self._disarm()
            self.read_timer = self.loop.call_later(guard.read_timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self.read_timer is not None:
                self.read_timer.cancel()
                self.read_timer = None

        def _timed_out(self) -> None:
            self.read_timer = None
            if not self.transport.is_closing():
                guard.timed_out(self)

    return GuardedH11Protocol


__all__ = ["CLOSED_BY_SERVER", "ConnectionGuard"]
