"""The HTTP application of ``mtpipe serve`` (:func:`build_app`): the handlers of ``/translate``, ``/health/live``,
``/health/ready``, ``/metrics`` and ``/info`` (:class:`Routes`) and the access log (:class:`AccessLog`); every
error one line of JSON. :mod:`mtpipe.serve.app` runs it (see there for the endpoints and the threads)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

from mtpipe.config import DecodeConfig, ServeConfig, to_dict
from mtpipe.engine.opening import OpenModel, encode_lines
from mtpipe.engine.search import DecodeRules, LengthPenalty
from mtpipe.engine.streaming import ServedRules
from mtpipe.engine.workers import WorkerProcess
from mtpipe.serve.batcher import Batcher, Job, QueueFull, ServerStopping
from mtpipe.serve.guard import CLOSED_BY_SERVER, ConnectionGuard
from mtpipe.serve.requests import (
    RETRY_AFTER_S,
    ClientGone,
    RequestError,
    TranslateRequest,
    max_body_bytes,
    parse_request,
    read_body,
)


SENTENCES = "mtpipe.sentences"  # scope key: the sentences of a /translate request, for the access log


def error(status: int, reason: str, headers: dict[str, str] | None = None) -> Any:
    """An error answer: one line of JSON, ``{"error": reason}``."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": reason}, status_code=status, headers=headers)


def not_ready(reason: str) -> Any:
    return error(503, f"not ready: {reason}", {"Retry-After": str(RETRY_AFTER_S)})


class Routes:
    """The handlers of ``/translate``, ``/health/live``, ``/health/ready``, ``/metrics`` and ``/info`` on one set of
    bounds. The model and its batcher come once loaded and warm (:meth:`attach`); until then ``/health/ready`` and
    ``/translate`` answer 503. ``workers``: the decoding processes (``serve.workers`` > 1), whose deaths make the
    server not ready until they are restarted."""

    def __init__(self, cfg: ServeConfig, defaults: DecodeConfig, guard: ConnectionGuard,
                 workers: list[WorkerProcess] | None = None) -> None:
        from mtpipe.serve import metrics

        self.cfg, self.defaults, self.guard = cfg, defaults, guard
        self.workers = workers if workers is not None else []
        self.model: OpenModel | None = None
        self.batcher: Batcher | None = None
        self.stopping: str | None = None  # the signal that stops the server (ready answers 503 from then on)
        self.counters = guard.counters
        self.counters.update({"rejected_work": 0, "timed_out": 0})
        self.limit = max_body_bytes(cfg)
        self.metrics = metrics.Metrics(self.state) if metrics.available() else None

    def attach(self, model: OpenModel, batcher: Batcher) -> None:
        """The model, loaded and warm, and the batcher that feeds it: the server is ready from now on."""
        self.limit_src = model.max_positions - 1  # one position is the EOS (mtpipe.engine.search.max_source_len)
        decode_rules = DecodeRules.from_config(self.defaults)
        self.base_rules = ServedRules(**{f.name: getattr(decode_rules, f.name)
                                         for f in dataclasses.fields(decode_rules)},
                                      max_output=self.cfg.max_output_tokens)
        if self.metrics is not None:
            batcher.on_batch = self.metrics.batch
        self.model, self.batcher = model, batcher

    def unready(self) -> str | None:
        """Why the server should get no new requests (``/health/ready``'s 503), or None."""
        if self.stopping is not None:
            return f"stopping ({self.stopping})"
        if self.model is None or self.batcher is None:
            return "loading the model and warming up"
        down = [str(w.index) for w in self.workers if w.down]
        if down:
            return f"decoding worker process {', '.join(down)} down (restarting)"
        queued = self.batcher.snapshot()["queued"]
        if queued >= self.batcher.max_queue:
            return f"queue full ({queued} requests waiting, serve.max_queue)"
        return None

    def state(self) -> dict[str, int]:
        """The counters and gauges ``/info`` and ``/metrics`` show."""
        batcher = self.batcher.snapshot() if self.batcher is not None else {}
        return {**batcher, **self.counters, "open_connections": len(self.guard.open),
                "worker_restarts": sum(w.restarts for w in self.workers),
                "workers_down": sum(w.down for w in self.workers), "ready": int(self.unready() is None)}

    def gone(self, request: Any, what: str) -> None:
        """One line for a client that left (none where the server closed the connection itself: it said why)."""
        if CLOSED_BY_SERVER in request.scope:
            return
        self.counters["client_disconnects"] += 1
        self.guard.log.info("%s: POST /translate: the client went away %s", client_of(request.scope), what)

    async def translate(self, request: Any) -> Any:
        """``POST /translate``: answered (:meth:`_translate`), counted by status and timed for ``/metrics``."""
        start = time.monotonic()
        response = await self._translate(request, start)
        if self.metrics is not None:
            self.metrics.answered(response.status_code, time.monotonic() - start)
        return response

    async def _translate(self, request: Any, start: float) -> Any:
        """Read and check the body (every bad input its own status and line), queue the job, wait for its answer,
        for the client to go, or for ``serve.request_timeout_s``."""
        if self.model is None or self.batcher is None:
            return not_ready("loading the model and warming up")
        try:
            req = parse_request(await read_body(request, self.limit), self.cfg, self.defaults)
        except RequestError as e:
            return error(e.status, e.reason)
        except ClientGone as e:
            self.gone(request, f"before sending the whole body ({e.received} bytes of "
                               f"{request.headers.get('content-length', '?')})")
            return error(400, "body: incomplete")  # nobody reads it
        request.scope[SENTENCES] = len(req.sentences)
        # A sentence without a letter or a digit is the empty source: not decoded, an empty translation.
        sources = encode_lines(self.model.sp, req.sentences)
        truncated = sum(len(s) > self.limit_src for s in sources)
        sources = [s[: self.limit_src] for s in sources]  # as mtpipe decode cuts them to the model's positions
        # Work, not characters: what decoding a request costs grows with its tokens times its beam.
        work = sum(len(s) + 1 for s in sources) * req.beam
        if work > self.cfg.max_request_work:
            self.counters["rejected_work"] += 1
            return error(413, f"work: {work:,} (source tokens with EOS x beam, summed over the sentences) is more "
                              f"than the server's limit (serve.max_request_work = {self.cfg.max_request_work:,}); "
                              "send fewer or shorter sentences, or a smaller beam")
        # Every rule from the decode section (as `mtpipe decode` builds them), then what the request may change.
        rules = dataclasses.replace(self.base_rules, beam=req.beam, nbest=req.nbest,
                                    penalty=LengthPenalty(self.defaults.length_penalty, req.alpha))
        loop = asyncio.get_running_loop()
        job = Job(sources, rules, loop.create_future(), loop, time.monotonic())
        try:
            self.batcher.submit(job)
        except QueueFull:
            return error(503, f"busy: {self.batcher.max_queue} requests already waiting (serve.max_queue); retry "
                              "later", {"Retry-After": str(RETRY_AFTER_S)})
        deadline = start + self.cfg.request_timeout_s if self.cfg.request_timeout_s > 0 else None
        return await self.answer(request, req, job, truncated, deadline)

    async def answer(self, request: Any, req: TranslateRequest, job: Job, truncated: int,
                     deadline: float | None = None) -> Any:
        """Wait for ``job``'s answer, for the client to go (after the body, uvicorn's receive() returns only then:
        http.disconnect), or until ``deadline``. A request whose client has gone, or whose deadline has passed, is
        cancelled: what no worker has started is dropped, and the workers drop the rest at their next step."""
        from fastapi.responses import JSONResponse

        batcher = self.batcher
        assert batcher is not None
        left = asyncio.ensure_future(request.receive())
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait({job.future, left}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # uvicorn gave up on the request (its graceful shutdown's limit)
            batcher.cancel(job)
            raise
        finally:
            left.cancel()
        if not job.future.done() and not left.done():  # the deadline
            dropped = batcher.cancel(job)
            self.counters["timed_out"] += 1
            self.guard.log.info("%s: POST /translate: not answered within %g s (serve.request_timeout_s): 504, "
                                "cancelled, %d of its %d sentences not decoded", client_of(request.scope),
                                self.cfg.request_timeout_s, dropped, len(job.sources))
            return error(504, f"not answered within {self.cfg.request_timeout_s:g} s (serve.request_timeout_s); its "
                              "decoding was cancelled")
        if not job.future.done():
            dropped = batcher.cancel(job)
            self.gone(request, f"before its answer: request cancelled, {dropped} of its {len(job.sources)} "
                               "sentences not decoded")
            return error(400, "cancelled")  # nobody reads it
        try:
            answer = job.future.result()
        except ServerStopping as e:
            return error(503, str(e), {"Retry-After": str(RETRY_AFTER_S)})
        except RuntimeError as e:
            return error(500, str(e))
        if self.metrics is not None:
            self.metrics.decoded(answer.batch["queue_ms"] / 1000, sum(map(len, job.sources)), sum(answer.lengths))
        out: dict[str, Any] = {
            "translations": [hyps[0][0] for hyps in answer.hypotheses],
            "scores": [hyps[0][1] for hyps in answer.hypotheses],
        }
        if req.nbest > 1:
            out["nbest"] = [[text for text, _ in hyps] for hyps in answer.hypotheses]
            out["nbest_scores"] = [[score for _, score in hyps] for hyps in answer.hypotheses]
        # A best translation as long as serve.max_output_tokens was cut there (ServedRules.max_output_len).
        cut = [i for i, n in enumerate(answer.lengths) if n >= self.cfg.max_output_tokens]
        out.update({"model": self.model.info["model"] if self.model else None,
                    "settings": {"beam": req.beam, "alpha": req.alpha, "nbest": req.nbest},
                    "truncated": truncated, "output_cut": cut, "batch": answer.batch})
        return JSONResponse(out)

    async def live(self, request: Any) -> Any:
        """``GET /health/live`` and ``/health``: the process answers (also while it loads and warms up)."""
        from fastapi.responses import JSONResponse

        return JSONResponse({"status": "ok", "model": self.model.info["model"] if self.model else None,
                             "queued": self.batcher.snapshot()["queued"] if self.batcher else 0})

    async def ready(self, request: Any) -> Any:
        """``GET /health/ready``: 200 while the server should get requests, else 503 with the reason."""
        from fastapi.responses import JSONResponse

        reason = self.unready()
        if reason is not None:
            return not_ready(reason)
        assert self.model is not None and self.batcher is not None
        return JSONResponse({"status": "ready", "model": self.model.info["model"],
                             "queued": self.batcher.snapshot()["queued"]})

    async def metrics_text(self, request: Any) -> Any:
        """``GET /metrics``: Prometheus' text format (501 without ``prometheus_client``)."""
        from fastapi.responses import Response

        if self.metrics is None:
            return error(501, "metrics need prometheus_client: pip install 'mtpipe[serve]'")
        body, kind = self.metrics.render()
        return Response(body, media_type=kind)

    async def info(self, request: Any) -> Any:
        from fastapi.responses import JSONResponse

        if self.model is None:
            return not_ready("loading the model and warming up")
        return JSONResponse({**self.model.info, "decode": to_dict(self.defaults), "serve": to_dict(self.cfg),
                             "counters": self.state()})


def client_of(scope: dict[str, Any]) -> str:
    client = scope.get("client")
    return "%s:%d" % tuple(client[:2]) if client else "a client"


class AccessLog:
    """``serve.access_log``: one line per HTTP request once it is answered (client, method, path, status,
    milliseconds, and for ``/translate`` its number of sentences), never the text of a request."""

    def __init__(self, app: Any, log: Any) -> None:
        self.app, self.log = app, log

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), ["-"]

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            path = "".join(c if c.isprintable() else "?" for c in scope.get("path", ""))[:200]
            sentences = f" {scope[SENTENCES]} sentences" if SENTENCES in scope else ""
            self.log.info('%s "%s %s" %s %.1f ms%s', client_of(scope), scope.get("method", "?"), path, status[0],
                          1000 * (time.monotonic() - start), sentences)


def build_app(routes: Routes) -> Any:
    """The FastAPI application of ``routes``; every error answered as one line of JSON, ``{"error": ...}``."""
    from fastapi import FastAPI, Request
    from starlette.exceptions import HTTPException

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        routes.guard.loop = asyncio.get_running_loop()  # for the drain after SIGTERM (serve_model), from another thread
        yield  # the batcher runs already, or will once the model is warm (serve_model: in the main thread)
        # uvicorn has let the requests in flight finish; the worker drains what is left, off the event loop.
        if routes.batcher is not None:
            routes.batcher.close()
            await asyncio.to_thread(routes.batcher.join)

    app = FastAPI(title="mtpipe", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Any:  # 404, 405: one line of JSON too
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Any:  # a bug: JSON too (uvicorn logs the traceback)
        from mtpipe.engine.lanes import first_line

        return error(500, f"internal error: {first_line(exc)}")

    # Plain routes: the body is parsed by the handler (parse_request), so that every bad input gets its own status.
    app.add_route("/translate", routes.translate, methods=["POST"])
    app.add_route("/health", routes.live, methods=["GET"])
    app.add_route("/health/live", routes.live, methods=["GET"])
    app.add_route("/health/ready", routes.ready, methods=["GET"])
    app.add_route("/metrics", routes.metrics_text, methods=["GET"])
    app.add_route("/info", routes.info, methods=["GET"])
    if routes.cfg.access_log:
        app.add_middleware(AccessLog, log=routes.guard.log)
    return app


__all__ = ["AccessLog", "Routes", "build_app", "client_of", "error", "not_ready"]
