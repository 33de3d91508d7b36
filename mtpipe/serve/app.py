"""``mtpipe serve``: translations over HTTP, concurrent requests decoded together in dynamic batches.

Endpoints (FastAPI on uvicorn, ``pip install 'mtpipe[serve]'``):

* ``POST /translate`` ``{"text": ["...", ...], "beam": 4, "alpha": 0.6, "nbest": 1}`` (beam, alpha and nbest
  optional: ``decode``'s values by default, within ``serve.max_beam`` / ``max_alpha`` / ``max_nbest``) answers
  ``{"translations": [...], "scores": [...], "model": <manifest hash of the checkpoint>, "batch": {...}}`` (with
  ``nbest`` / ``nbest_scores`` lists when nbest > 1). ``batch`` says which worker decoded the request, the most
  requests and sentences decoded together with it (itself included), and how long it waited and took.
* ``GET /health``: ``{"status": "ok", ...}``; ``GET /info``: the model, the engine, the settings, the counters.

The search is :func:`mtpipe.engine.search.beam_search` under the ``decode`` section's rules (paper section 6.1), through
the same engines, opened the same way, as ``mtpipe decode`` (:func:`mtpipe.engine.opening.open_model`), so a sentence
translates exactly as ``mtpipe decode`` translates it: beam search is per sentence, and the padding of a mixed batch
is masked (the tests compare with ``mtpipe decode``). This package is the HTTP side only: requests
(:mod:`mtpipe.serve.requests`), the queue and its workers (:mod:`mtpipe.serve.batcher`), the connections' bounds
(:mod:`mtpipe.serve.guard`), and here the application and the command.

The model runs in the process's main thread while uvicorn's event loop runs in a second one: torch's CPU thread pool
(OpenMP) parallelises the small operations of a decoding step well only from the main thread. With ``serve.workers``
N > 1, N worker processes (:class:`mtpipe.engine.workers.WorkerProcess`) each run a copy of the model in their own
main thread with 1/N of the CPU threads, and each decodes its own requests: a server's batches are small, and the
small matrix products of a few sentences use several cores poorly, where separate batches use them fully.

Every phase of a request is bounded, so that no client can hold the server: reading it (:mod:`mtpipe.serve.guard`),
decoding it (``serve.max_request_work``, ``max_sentences``, ``max_chars``, ``max_beam`` and
``serve.max_output_tokens`` per sentence: :class:`mtpipe.engine.streaming.ServedRules`), waiting for it
(``serve.max_queue``: one more gets 503 with Retry-After). A client that leaves mid-body or before its answer is one
line in the log, not a traceback. ``/info``'s ``counters`` count all of these.

SIGTERM (or Ctrl-C): uvicorn stops accepting connections and waits for the requests in flight (the worker goes on
decoding them); the worker then decodes whatever is still queued and stops; the process exits 0. ``serve.drain_s``
after the signal (or at a second one) whatever is left is dropped: requests not yet answered get 503, connections
still sending a request are closed, the workers stop after the chunk in hand, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mtpipe.config import DecodeConfig, ServeConfig, to_dict
from mtpipe.engine.opening import OpenModel, open_model
from mtpipe.engine.search import DecodeRules, LengthPenalty
from mtpipe.engine.streaming import ServedRules
from mtpipe.engine.workers import WorkerProcess, worker_threads
from mtpipe.errors import MtpipeError
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

# --------------------------------------------------------------------------------------------------------------------
# The HTTP application
# --------------------------------------------------------------------------------------------------------------------


def error(status: int, reason: str, headers: dict[str, str] | None = None) -> Any:
    """An error answer: one line of JSON, ``{"error": reason}``."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": reason}, status_code=status, headers=headers)


class Routes:
    """The handlers of ``/translate``, ``/health`` and ``/info`` on one model, batcher and set of bounds."""

    def __init__(self, model: OpenModel, batcher: Batcher, cfg: ServeConfig, defaults: DecodeConfig,
                 guard: ConnectionGuard) -> None:
        self.model, self.batcher, self.cfg, self.defaults, self.guard = model, batcher, cfg, defaults, guard
        self.counters = guard.counters
        self.counters["rejected_work"] = 0
        self.limit = max_body_bytes(cfg)
        self.limit_src = model.max_positions - 1  # one position is the EOS (mtpipe.engine.search.max_source_len)
        decode_rules = DecodeRules.from_config(defaults)
        self.base_rules = ServedRules(**{f.name: getattr(decode_rules, f.name)
                                         for f in dataclasses.fields(decode_rules)},
                                      max_output=cfg.max_output_tokens)

    def gone(self, request: Any, what: str) -> None:
        """One line for a client that left (none where the server closed the connection itself: it said why)."""
        if CLOSED_BY_SERVER in request.scope:
            return
        self.counters["client_disconnects"] += 1
        client = "%s:%d" % tuple(request.scope["client"][:2]) if request.scope.get("client") else "a client"
        self.guard.log.info("%s: POST /translate: the client went away %s", client, what)

    async def translate(self, request: Any) -> Any:
        """``POST /translate``: read and check the body (every bad input its own status and line), queue the job,
        wait for its answer or for the client to go."""
        try:
            req = parse_request(await read_body(request, self.limit), self.cfg, self.defaults)
        except RequestError as e:
            return error(e.status, e.reason)
        except ClientGone as e:
            self.gone(request, f"before sending the whole body ({e.received} bytes of "
                               f"{request.headers.get('content-length', '?')})")
            return error(400, "body: incomplete")  # nobody reads it
        sources = self.model.sp.encode(req.sentences, out_type=int)
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
        return await self.answer(request, req, job, truncated)

    async def answer(self, request: Any, req: TranslateRequest, job: Job, truncated: int) -> Any:
        """Wait for ``job``'s answer, or for the client to go: after the body, uvicorn's receive() returns only then
        (http.disconnect). A request whose client has gone is cancelled: what no worker has started is dropped."""
        from fastapi.responses import JSONResponse

        left = asyncio.ensure_future(request.receive())
        try:
            await asyncio.wait({job.future, left}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # uvicorn gave up on the request (its graceful shutdown's limit)
            self.batcher.cancel(job)
            raise
        finally:
            left.cancel()
        if not job.future.done():
            dropped = self.batcher.cancel(job)
            self.gone(request, f"before its answer: request cancelled, {dropped} of its {len(job.sources)} "
                               "sentences not decoded")
            return error(400, "cancelled")  # nobody reads it
        try:
            answer = job.future.result()
        except ServerStopping as e:
            return error(503, str(e), {"Retry-After": str(RETRY_AFTER_S)})
        except RuntimeError as e:
            return error(500, str(e))
        out: dict[str, Any] = {
            "translations": [hyps[0][0] for hyps in answer.hypotheses],
            "scores": [hyps[0][1] for hyps in answer.hypotheses],
        }
        if req.nbest > 1:
            out["nbest"] = [[text for text, _ in hyps] for hyps in answer.hypotheses]
            out["nbest_scores"] = [[score for _, score in hyps] for hyps in answer.hypotheses]
        out.update({"model": self.model.info["model"], "settings": {"beam": req.beam, "alpha": req.alpha,
                    "nbest": req.nbest}, "truncated": truncated, "batch": answer.batch})
        return JSONResponse(out)

    async def health(self, request: Any) -> Any:
        from fastapi.responses import JSONResponse

        return JSONResponse({"status": "ok", "model": self.model.info["model"],
                             "queued": self.batcher.snapshot()["queued"]})

    async def info(self, request: Any) -> Any:
        from fastapi.responses import JSONResponse

        counters = {**self.batcher.snapshot(), **self.counters, "open_connections": len(self.guard.open)}
        return JSONResponse({**self.model.info, "decode": to_dict(self.defaults), "serve": to_dict(self.cfg),
                             "counters": counters})


def build_app(model: OpenModel, batcher: Batcher, cfg: ServeConfig, defaults: DecodeConfig,
              guard: ConnectionGuard | None = None) -> Any:
    """The FastAPI application: ``/translate``, ``/health``, ``/info``; every error answered as ``{"error": ...}``.
    ``guard``: the connections' bounds, whose counters ``/info`` shows (None: a guard of ``cfg``'s, counting only)."""
    from fastapi import FastAPI, Request
    from starlette.exceptions import HTTPException

    if guard is None:
        guard = ConnectionGuard(cfg.read_timeout_s, cfg.max_connections)
    routes = Routes(model, batcher, cfg, defaults, guard)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        guard.loop = asyncio.get_running_loop()  # for the drain after SIGTERM (serve_model), from another thread
        yield  # the batcher runs already (serve_model: in the main thread)
        # uvicorn has let the requests in flight finish; the worker drains what is left, off the event loop.
        batcher.close()
        await asyncio.to_thread(batcher.join)

    app = FastAPI(title="mtpipe", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Any:  # 404, 405: one line of JSON too
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", exc.headers)

    # Plain routes: the body is parsed by the handler (parse_request), so that every bad input gets its own status.
    app.add_route("/translate", routes.translate, methods=["POST"])
    app.add_route("/health", routes.health, methods=["GET"])
    app.add_route("/info", routes.info, methods=["GET"])
    return app


# --------------------------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------------------------


def require_serve() -> tuple[Any, Any]:
    """``(fastapi, uvicorn)``, or one error line saying how to install them."""
    try:
        import fastapi
        import uvicorn
    except ImportError as e:
        raise MtpipeError(f"mtpipe serve needs {e.name or 'fastapi and uvicorn'}: install mtpipe[serve] "
                          "(pip install 'mtpipe[serve]')") from None
    return fastapi, uvicorn


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free one), bound before the model loads so that a taken port
    fails at once, with one line."""
    from mtpipe.errors import os_reason

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise MtpipeError(f"serve.host {host!r}: not an address this machine has ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise MtpipeError(f"serve.host/port {host}:{port}: cannot listen there ({os_reason(e)})") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


FILES_BESIDES_CONNECTIONS = 64  # the listening socket, the model's files, logs, pipes, torch's own: a margin


def check_open_files(cfg: ServeConfig) -> None:
    """``serve.max_connections`` connections (a file descriptor each) must fit the process's open-file limit, or the
    next accept fails and nothing is served: raise the soft limit as far as the hard one allows, else one line."""
    try:
        import resource
    except ImportError:  # not a Unix: nothing to check
        return
    need = cfg.max_connections + FILES_BESIDES_CONNECTIONS + 4 * cfg.workers
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard == resource.RLIM_INFINITY or hard >= need:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
            return
    raise MtpipeError(f"serve.max_connections = {cfg.max_connections} needs {need} open files, and this process may "
                      f"open {max(soft, hard) if hard != resource.RLIM_INFINITY else soft} (ulimit -n): lower "
                      "serve.max_connections or raise the limit")


def warm_beams(cfg: ServeConfig, defaults: DecodeConfig) -> tuple[int, ...]:
    """The beams the warm-up decodes with besides ``decode.beam``: greedy search and the largest beam a request may
    ask for (``serve.max_beam``), the sizes a compiled step builds new graphs for."""
    return tuple(sorted({1, defaults.beam, cfg.max_beam}))


def open_served(cfg: ServeConfig, defaults: DecodeConfig, rules: DecodeRules, checkpoint: Path,
                tokens: Path | None, workers: list[WorkerProcess]) -> OpenModel:
    """The model opened and warmed up at every beam a request may bring: in this process, or (``serve.workers`` >
    1) in worker processes, appended to ``workers``, this process keeping worker 0's vocabulary to encode, queue and
    detokenise with."""
    from mtpipe.console import info

    beams = warm_beams(cfg, defaults)
    continuous = cfg.batching == "continuous"
    if defaults.compile != "off":
        info(f"warming up: building the compiled decoder step (decode.compile) at beams "
             f"{', '.join(map(str, beams))} before the first request")
    if cfg.workers == 1:
        model = open_model(defaults, checkpoint, tokens)
        model.warm_up(rules, beams, continuous)
        return model
    threads = worker_threads(defaults, cfg.workers)
    info(f"starting {cfg.workers} decoding processes, {threads} CPU thread(s) each")
    worker_cfg = dataclasses.replace(defaults, threads=threads)
    for i in range(cfg.workers):
        workers.append(WorkerProcess(i, worker_cfg, checkpoint, tokens, cfg.batching, beams))
    descriptions = [w.ready() for w in workers]
    model = OpenModel.described(descriptions[0])
    model.info["workers"] = cfg.workers
    model.info["threads_per_worker"] = threads
    return model


def startup_table(cfg: ServeConfig, defaults: DecodeConfig, checkpoint: Path, model: OpenModel,
                  seconds: float) -> None:
    """What the server runs with, before its address."""
    from mtpipe.console import table

    table("serve", ["", "value"], [
        ["checkpoint", f"{checkpoint} (step {model.info['step']:,})"],
        ["model", model.info["model"]],
        ["engine", f"{defaults.engine} on {model.info['device']}, {model.info['precision']}"],
        ["decode", f"beam {defaults.beam}, {defaults.length_penalty} alpha {defaults.alpha:g}, nbest "
                   f"{defaults.nbest}, stop {defaults.stop}"],
        ["limits", f"{cfg.max_sentences} sentences x {cfg.max_chars} chars, beam <= {cfg.max_beam}, nbest <= "
                   f"{cfg.max_nbest}, alpha <= {cfg.max_alpha:g}"],
        ["batching", f"{model.info['batching']}, wait {cfg.batch_wait_ms:g} ms, {cfg.batch_tokens:,} tokens, "
                     f"queue {cfg.max_queue}, {cfg.workers} worker(s)"],
        ["connections", f"idle ones closed after {cfg.keep_alive_s:g} s (serve.keep_alive_s)"],
        ["requests", f"read within {cfg.read_timeout_s:g} s, {cfg.max_connections:,} connections at most, "
                     f"drained {cfg.drain_s:g} s after SIGTERM"],
        ["work", f"{cfg.max_request_work:,} per request (tokens x beam), chunks of {cfg.chunk_work:,}, "
                 f"{cfg.max_output_tokens} output tokens a sentence"],
        ["start-up", f"{seconds:.1f} s: loading, warm-up"
                     + (" and the compiled step's graphs (decode.compile)"
                        if defaults.compile != "off" else "")],
    ])


class Stopper:
    """SIGTERM / SIGINT: the first asks uvicorn to stop (stop accepting, finish the requests in flight, then the
    lifespan shutdown closes the batcher); ``serve.drain_s`` later, or at a second signal, what is left is dropped
    (:meth:`drain`)."""

    def __init__(self, server: Any, batcher: Batcher, guard: ConnectionGuard, drain_s: float) -> None:
        self.server, self.batcher, self.guard, self.drain_s = server, batcher, guard, drain_s
        self.drained = threading.Event()  # set once the drain has run
        self.timer = threading.Timer(drain_s, self.drain)
        self.timer.daemon = True

    def drain(self) -> None:
        from mtpipe.console import info

        if self.drained.is_set():
            return
        self.drained.set()
        abandoned = self.batcher.abandon()
        loop = self.guard.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing left to drop
                loop.call_soon_threadsafe(self.guard.drop_stalled)
        info(f"drain (serve.drain_s = {self.drain_s:g} s after the signal, or a second signal): {abandoned} "
             "request(s) not yet decoded answered 503, connections still sending a request closed")

    def stop(self, *_: Any) -> None:
        if self.server.should_exit:
            self.server.force_exit = True
            threading.Thread(target=self.drain, daemon=True).start()  # not in the handler: abandon takes a lock
        self.server.should_exit = True
        if not self.timer.is_alive() and not self.drained.is_set():
            with contextlib.suppress(RuntimeError):  # started already
                self.timer.start()


def run_until_stopped(server: Any, sock: socket.socket, batcher: Batcher, stopper: Stopper, lanes: list[Any],
                      workers: list[WorkerProcess]) -> None:
    """uvicorn in a second thread, the first lane's worker in this, the main thread (see the module docstring),
    the others' in threads of their own; until the server has stopped. Signals reach the main thread only."""

    def run_server() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            batcher.close()  # when the lifespan shutdown did not run (a failed start-up)

    previous = {sig: signal.signal(sig, stopper.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    thread = threading.Thread(target=run_server, name="mtpipe-http", daemon=True)
    try:
        thread.start()
        for w in workers[1:]:
            batcher.start(w, w.index)
        batcher.run(lanes[0])
        while thread.is_alive():
            thread.join(0.5)  # in slices, so that a second signal still reaches stop()
    finally:
        stopper.timer.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_model(cfg: ServeConfig, defaults: DecodeConfig, checkpoint: Path, tokens: Path | None) -> None:
    """Serve ``checkpoint`` until SIGTERM or Ctrl-C; the requests in flight are answered first, then exit 0."""
    _, uvicorn = require_serve()
    from mtpipe.console import info, table

    check_open_files(cfg)  # decode's values within serve's limits: mtpipe.config.check_sections, at loading
    rules = DecodeRules.from_config(defaults)  # decode's rules across keys hold already (DecodeConfig.check)
    if defaults.processes > 1:  # set for the decode stage, say, in the params.yaml a server shares
        info(f"decode.processes={defaults.processes} applies to mtpipe decode; the server's decoding processes are "
             f"serve.workers ({cfg.workers})")
    sock = listen(cfg.host, cfg.port)
    workers: list[WorkerProcess] = []
    stopper = None
    try:
        started = time.monotonic()
        model = open_served(cfg, defaults, rules, checkpoint, tokens, workers)
        model.info["batching"] = cfg.batching
        batcher = Batcher(model.detokenise, max_queue=cfg.max_queue, wait_s=cfg.batch_wait_ms / 1000,
                          batch_tokens=cfg.batch_tokens, chunk_work=cfg.chunk_work)
        guard = ConnectionGuard(cfg.read_timeout_s, cfg.max_connections)
        # uvicorn's graceful shutdown waits for every connection and task; the drain ends them after serve.drain_s,
        # and uvicorn's own limit, a little later, is only a backstop.
        server = uvicorn.Server(uvicorn.Config(build_app(model, batcher, cfg, defaults, guard), log_level="info",
                                                access_log=False, lifespan="on", timeout_keep_alive=cfg.keep_alive_s,
                                                http=guard.protocol(), timeout_graceful_shutdown=cfg.drain_s + 5))
        url = url_of(sock)
        startup_table(cfg, defaults, checkpoint, model, time.monotonic() - started)
        # One plain line (never wrapped) that scripts and the tests read the address from.
        sys.stderr.write(f"mtpipe serve: listening on {url} (POST /translate, GET /health, GET /info)\n")
        sys.stderr.flush()
        stopper = Stopper(server, batcher, guard, cfg.drain_s)
        lanes = workers or [model.lane(cfg.batching == "continuous")]
        run_until_stopped(server, sock, batcher, stopper, lanes, workers)
    finally:
        sock.close()
        drained = stopper is not None and stopper.drained.is_set()
        for w in workers:
            w.close(wait=1 if drained else 30)  # drained: what the worker decodes now, nobody waits for
    if not server.started:
        raise MtpipeError(f"{url}: the server did not start (see uvicorn's log above)")
    counters = {**batcher.snapshot(), **guard.counters}
    info(f"stopped after {counters['requests']:,} requests")
    table("served", ["", "value"], [[k.replace("_", " "), v] for k, v in counters.items() if k != "queued"])


__all__ = ["Routes", "Stopper", "build_app", "check_open_files", "listen", "open_served", "require_serve",
           "serve_model", "startup_table", "url_of", "warm_beams"]
