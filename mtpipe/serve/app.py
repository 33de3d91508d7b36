"""``mtpipe serve``: translations over HTTP, concurrent requests decoded together in dynamic batches.

Endpoints (FastAPI on uvicorn, ``pip install 'mtpipe[serve]'``):

* ``POST /translate`` ``{"text": ["...", ...], "beam": 4, "alpha": 0.6, "nbest": 1}`` (beam, alpha and nbest
  optional: ``decode``'s values by default, within ``serve.max_beam`` / ``max_alpha`` / ``max_nbest``) answers
  ``{"translations": [...], "scores": [...], "model": <manifest hash of the checkpoint>, "batch": {...}}`` (with
  ``nbest`` / ``nbest_scores`` lists when nbest > 1). ``batch`` says which worker decoded the request, the most
  requests and sentences decoded together with it (itself included), and how long it waited and took.
* ``GET /health/live`` (and ``/health``, its alias): 200 while the process answers; ``GET /health/ready``: 200 once
  the model is loaded and warm, while every decoding process is alive, the queue is below ``serve.max_queue`` and
  no SIGTERM has come, else 503 with the reason; ``GET /metrics``: Prometheus' text format
  (:mod:`mtpipe.serve.metrics`); ``GET /info``: the model, the engine, the settings, the counters.

The port listens, and ``/health/live`` answers, from the start: the model loads and warms up meanwhile, and until
it is warm ``/health/ready`` (and ``/translate``) answers 503, so that a load balancer or Kubernetes sends nothing to
a server still warming up, while its liveness probe sees a process that answers.

The search is :func:`mtpipe.engine.search.beam_search` under the ``decode`` section's rules (paper section 6.1), through
the same engines, opened the same way, as ``mtpipe decode`` (:func:`mtpipe.engine.opening.open_model`), so a sentence
translates exactly as ``mtpipe decode`` translates it: beam search is per sentence, and the padding of a mixed batch
is masked (the tests compare with ``mtpipe decode``). This package is the HTTP side only: requests
(:mod:`mtpipe.serve.requests`), the queue and its workers (:mod:`mtpipe.serve.batcher`), the connections' bounds
(:mod:`mtpipe.serve.guard`), the metrics (:mod:`mtpipe.serve.metrics`), the application (:mod:`mtpipe.serve.routes`),
and here the command.

The model runs in the process's main thread while uvicorn's event loop runs in a second one: torch's CPU thread pool
(OpenMP) parallelises the small operations of a decoding step well only from the main thread. With ``serve.workers``
N > 1, N worker processes (:class:`mtpipe.engine.workers.WorkerProcess`) each run a copy of the model in their own
main thread with 1/N of the CPU threads, and each decodes its own requests: a server's batches are small, and the
small matrix products of a few sentences use several cores poorly, where separate batches use them fully. A worker
process that dies is logged (its exit code), restarted at once, and logged again once warm; ``/health/ready`` is 503
meanwhile.

Every phase of a request is bounded, so that no client can hold the server: reading it (:mod:`mtpipe.serve.guard`),
decoding it (``serve.max_request_work``, ``max_sentences``, ``max_chars``, ``max_beam`` and
``serve.max_output_tokens`` per sentence: :class:`mtpipe.engine.streaming.ServedRules`), waiting for it
(``serve.max_queue``: one more gets 503 with Retry-After), answering it (``serve.request_timeout_s``: 504, and what
is left of its decoding is cancelled). A client that leaves mid-body or before its answer is one line in the log,
not a traceback. ``/info``'s ``counters`` count all of these.

SIGTERM: ``/health/ready`` answers 503 at once while requests are still accepted and served for
``serve.drain_grace_s``, so that a load balancer stops sending before the server stops accepting. Then (at once for
Ctrl-C) uvicorn stops accepting connections and waits for the requests in flight (the worker goes on decoding them);
the worker then decodes whatever is still queued and stops; the process exits 0. ``serve.drain_s`` after that (or at
a second signal) whatever is left is dropped: requests not yet answered get 503, connections still sending a request
are closed, the workers stop after the chunk in hand, and the process exits 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mtpipe.config import DecodeConfig, ServeConfig
from mtpipe.engine.opening import OpenModel, check_source, open_model
from mtpipe.engine.search import DecodeRules
from mtpipe.engine.workers import WorkerProcess, worker_threads
from mtpipe.errors import MtpipeError
from mtpipe.serve.batcher import Batcher
from mtpipe.serve.guard import ConnectionGuard
from mtpipe.serve.routes import Routes, build_app

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
                tokens: Path | None, workers: list[WorkerProcess], log: Any = None) -> OpenModel:
    """The model opened and warmed up at every beam a request may bring: in this process, or (``serve.workers`` >
    1) in worker processes, appended to ``workers``, this process keeping worker 0's vocabulary to encode, queue and
    detokenise with. ``log``: takes a line for each death and restart of a worker process."""
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
        workers.append(WorkerProcess(i, worker_cfg, checkpoint, tokens, cfg.batching, beams, log=log))
    descriptions = [w.ready() for w in workers]
    model = OpenModel.described(descriptions[0])
    model.info["workers"] = cfg.workers
    model.info["threads_per_worker"] = threads
    return model


def startup_table(cfg: ServeConfig, defaults: DecodeConfig, checkpoint: Path, model: OpenModel,
                  seconds: float, metrics: bool = True) -> None:
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
        ["requests", f"read within {cfg.read_timeout_s:g} s, answered within "
                     + (f"{cfg.request_timeout_s:g} s (else 504)" if cfg.request_timeout_s > 0 else "any time")
                     + f", {cfg.max_connections:,} connections at most"],
        ["stopping", f"SIGTERM: not ready but serving for {cfg.drain_grace_s:g} s, then drained within "
                     f"{cfg.drain_s:g} s"],
        ["observing", ("GET /metrics (Prometheus)" if metrics else "no GET /metrics (pip install prometheus_client)")
                      + f", access log {'on' if cfg.access_log else 'off'}"],
        ["work", f"{cfg.max_request_work:,} per request (tokens x beam), chunks of {cfg.chunk_work:,}, "
                 f"{cfg.max_output_tokens} output tokens a sentence"],
        ["start-up", f"{seconds:.1f} s: loading, warm-up"
                     + (" and the compiled step's graphs (decode.compile)"
                        if defaults.compile != "off" else "")],
    ])


class Stopper:
    """SIGTERM / SIGINT. The first SIGTERM makes ``/health/ready`` answer 503 while requests are still accepted and
    served for ``serve.drain_grace_s`` (a load balancer notices and sends no more); then (at once for SIGINT) uvicorn
    is asked to stop (stop accepting, finish the requests in flight, then the lifespan shutdown closes the batcher);
    ``serve.drain_s`` later, or at a second signal, what is left is dropped (:meth:`drain`)."""

    def __init__(self, server: Any, routes: Routes, guard: ConnectionGuard, cfg: ServeConfig) -> None:
        self.server, self.routes, self.guard = server, routes, guard
        self.drain_s, self.grace_s = cfg.drain_s, cfg.drain_grace_s
        self.drained = threading.Event()  # set once the drain has run
        self.grace_over = threading.Event()  # set by a second signal, or when the server stops
        self.timer = threading.Timer(self.drain_s, self.drain)
        self.timer.daemon = True

    def drain(self) -> None:
        from mtpipe.console import info

        if self.drained.is_set() or self.routes.batcher is None:
            return
        self.drained.set()
        abandoned = self.routes.batcher.abandon()
        loop = self.guard.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing left to drop
                loop.call_soon_threadsafe(self.guard.drop_stalled)
        info(f"drain (serve.drain_s = {self.drain_s:g} s after the signal, or a second signal): {abandoned} "
             "request(s) not yet decoded answered 503, connections still sending a request closed")

    def stop(self, signum: int | None = None, *_: Any) -> None:
        """The signal handler (the main thread's): nothing here that takes a lock another thread may hold."""
        if self.routes.stopping is None:  # the first signal: not ready from now on
            self.routes.stopping = signal.Signals(signum).name if signum else "stop"
            if signum == signal.SIGTERM and self.grace_s > 0:
                threading.Thread(target=self._grace, name="mtpipe-grace", daemon=True).start()
            else:
                self._exit()
            return
        # A second signal: no more grace; whatever is left is dropped now.
        self.grace_over.set()
        self.server.should_exit = True
        self.server.force_exit = True
        threading.Thread(target=self.drain, daemon=True).start()  # not in the handler: abandon takes a lock

    def _grace(self) -> None:
        self.guard.log.info("SIGTERM: /health/ready answers 503; requests are still served for %g s "
                            "(serve.drain_grace_s), then the drain", self.grace_s)
        if not self.grace_over.wait(self.grace_s):
            self._exit()

    def _exit(self) -> None:
        """Stop accepting, and start the drain's clock."""
        self.server.should_exit = True
        if not self.drained.is_set():
            with contextlib.suppress(RuntimeError):  # started already
                self.timer.start()

    def cancel(self) -> None:
        self.grace_over.set()
        self.timer.cancel()


def start_http(server: Any, sock: socket.socket, routes: Routes, url: str) -> threading.Thread:
    """uvicorn in a thread of its own, serving from now on (while the model loads, ``/health/live`` answers and
    ``/health/ready`` is 503); returns once it accepts, or raises with one line if it could not start."""

    def run_server() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            if routes.batcher is not None:
                routes.batcher.close()  # when the lifespan shutdown did not run (a failed start-up)

    thread = threading.Thread(target=run_server, name="mtpipe-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise MtpipeError(f"{url}: the server did not start (see uvicorn's log above)")
        time.sleep(0.01)
    return thread


def run_until_stopped(thread: threading.Thread, batcher: Batcher, stopper: Stopper, lanes: list[Any],
                      workers: list[WorkerProcess]) -> None:
    """The first lane's worker in this, the main thread (see the module docstring), the others' in threads of their
    own, uvicorn in ``thread``; until the server has stopped. Signals reach the main thread only."""
    previous = {sig: signal.signal(sig, stopper.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for w in workers[1:]:
            batcher.start(w, w.index)
        if not thread.is_alive():  # uvicorn stopped while the model loaded
            batcher.close()
        batcher.run(lanes[0])
        while thread.is_alive():
            thread.join(0.5)  # in slices, so that a second signal still reaches stop()
    finally:
        stopper.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_model(cfg: ServeConfig, defaults: DecodeConfig, checkpoint: Path, tokens: Path | None) -> None:
    """Serve ``checkpoint`` until SIGTERM or Ctrl-C; the requests in flight are answered first, then exit 0. The
    port opens before the model loads: ``/health/ready`` answers 503 until it is warm."""
    _, uvicorn = require_serve()
    from mtpipe.console import info, table

    check_open_files(cfg)  # decode's values within serve's limits: mtpipe.config.check_sections, at loading
    rules = DecodeRules.from_config(defaults)  # decode's rules across keys hold already (DecodeConfig.check)
    if defaults.processes > 1:  # set for the decode stage, say, in the params.yaml a server shares
        info(f"decode.processes={defaults.processes} applies to mtpipe decode; the server's decoding processes are "
             f"serve.workers ({cfg.workers})")
    check_source(defaults, checkpoint, "serve")  # the model is there and is what the engine reads
    sock = listen(cfg.host, cfg.port)
    url = url_of(sock)
    workers: list[WorkerProcess] = []
    guard = ConnectionGuard(cfg.read_timeout_s, cfg.max_connections)
    routes = Routes(cfg, defaults, guard, workers)
    # uvicorn's graceful shutdown waits for every connection and task; the drain ends them after serve.drain_s, and
    # uvicorn's own limit, a little later, is only a backstop.
    server = uvicorn.Server(uvicorn.Config(build_app(routes), log_level="info", access_log=False, lifespan="on",
                                            timeout_keep_alive=cfg.keep_alive_s, http=guard.protocol(),
                                            timeout_graceful_shutdown=cfg.drain_s + 5))
    thread: threading.Thread | None = None
    stopper = None
    try:
        thread = start_http(server, sock, routes, url)
        sys.stderr.write(f"mtpipe serve: loading the model; {url} answers GET /health/live, and GET /health/ready "
                         "with 503 until the model is warm\n")
        sys.stderr.flush()
        started = time.monotonic()
        model = open_served(cfg, defaults, rules, checkpoint, tokens, workers, log=guard.log.warning)
        model.info["batching"] = cfg.batching
        batcher = Batcher(model.detokenise, max_queue=cfg.max_queue, wait_s=cfg.batch_wait_ms / 1000,
                          batch_tokens=cfg.batch_tokens, chunk_work=cfg.chunk_work)
        routes.attach(model, batcher)
        startup_table(cfg, defaults, checkpoint, model, time.monotonic() - started, routes.metrics is not None)
        # One plain line (never wrapped) that scripts and the tests read the address from: ready from now on.
        sys.stderr.write(f"mtpipe serve: listening on {url} (POST /translate, GET /health/ready, /health/live, "
                         f"/metrics, /info)\n")
        sys.stderr.flush()
        stopper = Stopper(server, routes, guard, cfg)
        lanes = workers or [model.lane(cfg.batching == "continuous")]
        run_until_stopped(thread, batcher, stopper, lanes, workers)
    finally:
        if stopper is None and thread is not None and thread.is_alive():  # failed, or interrupted, while loading
            server.should_exit = True
            thread.join(10)
        sock.close()
        drained = stopper is not None and stopper.drained.is_set()
        for w in workers:
            w.close(wait=1 if drained else 30)  # drained: what the worker decodes now, nobody waits for
    counters = {k: v for k, v in routes.state().items() if k not in ("queued", "open_connections", "ready", "workers_down")}
    info(f"stopped after {counters['requests']:,} requests")
    table("served", ["", "value"], [[k.replace("_", " "), v] for k, v in counters.items()])


__all__ = ["Stopper", "check_open_files", "listen", "open_served", "require_serve", "serve_model",
           "start_http", "startup_table", "url_of", "warm_beams"]
