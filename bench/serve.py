#!/usr/bin/env python3
"""Serving throughput: `mtpipe serve` under N concurrent clients against offline `mtpipe decode` on the same sentences.

One command: starts `mtpipe serve` on loopback with the given checkpoint and bpe artifact, then runs ``--rounds``
interleaved rounds (the order alternates each round: this machine's speed drifts by up to 40 % over minutes, so only
same-round ratios mean anything). Each round:

* **offline**: `mtpipe decode --input FILE` over the sentences in its own process; its throughput is the sentences
  over the decoding seconds it reports itself (model loading and start-up excluded: that is the fair baseline for a
  server, which loads once);
* **server**: ``--clients`` concurrent clients (default 8; one asyncio event loop), each with its own keep-alive
  connection, sending the sentences one per request (``{"text": [sentence]}``) until all are translated; throughput is the sentences over the wall time,
  latency is each request's round trip. The clients run on the same machine as the server (loopback), so the table
also gives their share of the machine's CPU time during the load, which the offline decode does not pay;
* **ceiling** (``--ceiling``): the server's own worker processes fed ``clients / workers`` sentences each, straight
  down their pipes (:class:`Ceiling`): the server's decoding without any serving around it, which bounds what any
  batching or HTTP change can give at this load.

Reported (a rich table, and a markdown table under ``--out``, default ``bench/out/serve``): sentences/s of both, the
server's ratio to offline, p50 / p99 latency, failed (non-200) and lost (no answer: a connection error or timeout)
requests, answers that differ from the offline translation, and the most requests the server decoded together. min / median / max over the rounds. Target: server >= 70 % of offline throughput.

    python bench/serve.py --checkpoint artifacts/average --tokens artifacts/bpe \\
        --sentences /data/multi30k/test_2016_flickr.en.gz
    python bench/serve.py ... --n 100 --rounds 3 --clients 8 --decode-args "--beam 4 --threads 2" \\
        --serve-args "--batch-wait-ms 5"

``--case slow-clients``: what slow, silent and greedy clients cost everyone else. Each round runs the same short
requests (``--clients`` clients, one sentence per request, as above) twice, in alternating order: once on a quiet
server, and once while ``--idle`` connections are held open (half send nothing, half send headers and a few bytes
of a body; each reopened as soon as the server closes it, ``serve.read_timeout_s``) and one large request is always
in flight (the ``--large-n`` longest sentences at ``--large-beam``, resent as soon as it is answered; halved until
``serve.max_request_work`` accepts it). Reported: p50 / p99 latency of the short requests in both runs and the p99
ratio, failed / lost / differing answers, how many large requests were answered and how many idle connections the
server closed. Target: p99 with the hostile clients within 2x of the quiet run's. No offline decode is run.

    python bench/serve.py ... --case slow-clients --n 200 --rounds 3 --idle 100
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gzip
import itertools
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import unicodedata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_ticks, own_cpu, write_results  # noqa: E402
from mtpipe.console import console, fmt, table  # noqa: E402


def read_sentences(path: Path, n: int) -> list[str]:
    """The first ``n`` non-blank lines, cleaned as `mtpipe decode --input` cleans them (NFC, stripped)."""
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            line = unicodedata.normalize("NFC", line.rstrip("\n")).strip()
            if line:
                out.append(line)
            if len(out) == n:
                break
    if not out:
        sys.exit(f"error: {path}: no sentences")
    return out


def common_args(args: argparse.Namespace) -> list[str]:
    params = ["--params", str(args.params)] if args.params else []
    return [*params, "--checkpoint", str(args.checkpoint), "--tokens", str(args.tokens),
            *shlex.split(args.decode_args)]


class Server:
    """`mtpipe serve` in a subprocess on 127.0.0.1, a free port (read back from its start-up line)."""

    def __init__(self, args: argparse.Namespace, log: Path) -> None:
        cmd = [sys.executable, "-m", "mtpipe", "serve", *common_args(args), "--host", "127.0.0.1", "--port", "0",
               "--max-queue", str(max(64, 4 * args.clients)), *shlex.split(args.serve_args)]
        self.log = log.open("w", encoding="utf-8")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                     env={**os.environ, "COLUMNS": "160"})
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:
                self.log.write(line)
                self.log.flush()
                if "listening on " in line and not ready.is_set():
                    self.url = line.split("listening on ")[1].split()[0]
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(300)
        if not self.url:
            sys.exit(f"error: mtpipe serve did not start (log: {log})")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        finally:
            self.log.close()


def offline(args: argparse.Namespace, infile: Path, n: int) -> tuple[float, list[str]]:
    """``(sentences/s, translations)`` of `mtpipe decode --input` (decoding seconds as decode reports them)."""
    cmd = [sys.executable, "-m", "mtpipe", "decode", *common_args(args), "--input", str(infile)]
    start = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "COLUMNS": "160"})
    wall = time.perf_counter() - start
    if p.returncode != 0:
        sys.exit(f"error: mtpipe decode failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}")
    # decode's summary table: "│ seconds │ 12.34 │" (rich; the row's first number is the time spent translating)
    m = re.search(r"\bseconds\b\D*?([\d,]+(?:\.\d+)?)", p.stderr)
    seconds = float(m.group(1).replace(",", "")) if m else wall
    if not m:
        console.print("[yellow]warning:[/yellow] decode's seconds not found in its summary: using process wall time")
    return n / max(seconds, 1e-9), p.stdout.splitlines()


def load(url: str, sentences: list[str], clients: int, timeout: float, during: Any = None) -> dict:
    """``clients`` concurrent clients, each on its own keep-alive connection, sending the sentences one per request:
    throughput, latencies, failures, answers.

    Why asyncio and hand-written HTTP/1.1 rather than an HTTP library in threads: the clients share the machine with
    the server, and 128 threads of httpx took ~26 % of this 2-core machine's CPU time (~7 ms per request), which the
    server then lacked. One event loop writing prepared requests and reading ``Content-Length`` bodies costs a small
    fraction of that; the table reports the clients' share either way.

    ``during``: a coroutine function run alongside the clients (started half a second before them, cancelled when
    they are done): other clients of the server, such as :func:`hostile`'s."""
    import asyncio
    import json

    host, port = url.split("://", 1)[1].rstrip("/").rsplit(":", 1)
    answers: list[str | None] = [None] * len(sentences)
    latencies: list[float] = []
    failed, lost, batches, queue_ms, decode_ms = [0], [0], [], [], []
    todo = iter(range(len(sentences)))

    async def request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int) -> tuple[int, dict]:
        body = json.dumps({"text": [sentences[i]]}).encode()
        writer.write(b"POST /translate HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (f"{host}:{port}".encode(), len(body), body))
        head = await reader.readuntil(b"\r\n\r\n")  # status line and headers
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
        length = {k.strip().lower(): v.strip() for k, v in headers.items()}.get("content-length")
        if length is None:
            raise ConnectionError("response without Content-Length")
        return status, json.loads(await reader.readexactly(int(length)))

    async def client() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for i in todo:  # the shared iterator hands each sentence to one client
                t0 = time.perf_counter()
                try:
                    status, body = await asyncio.wait_for(request(reader, writer, i), timeout)
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
                    lost[0] += 1
                    writer.close()  # the connection's state is unknown: start a new one
                    reader, writer = await asyncio.open_connection(host, int(port))
                    continue
                if status != 200:
                    failed[0] += 1
                    continue
                latencies.append(time.perf_counter() - t0)
                answers[i] = body["translations"][0]
                batches.append(body["batch"]["requests"])
                queue_ms.append(body["batch"]["queue_ms"])
                decode_ms.append(body["batch"]["decode_ms"])
        finally:
            writer.close()

    timed = [0.0, 0.0]

    async def run() -> None:
        background = asyncio.ensure_future(during()) if during is not None else None
        if background is not None:
            await asyncio.sleep(0.5)  # its connections open and its requests in flight before the clients start
        timed[0] = time.perf_counter()
        try:
            await asyncio.gather(*(client() for _ in range(clients)))
        finally:
            timed[1] = time.perf_counter()
            if background is not None:
                background.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await background

    busy0, total0 = cpu_ticks()
    own0 = own_cpu()
    asyncio.run(run())
    wall = timed[1] - timed[0]
    busy, total = (a - b for a, b in zip(cpu_ticks(), (busy0, total0)))
    own = own_cpu() - own0
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")

    ok = sum(a is not None for a in answers)
    return {"sent_s": ok / wall, "p50_ms": 1000 * pct(0.50), "p99_ms": 1000 * pct(0.99), "failed": failed[0],
            "lost": lost[0], "answers": answers, "mean_batch": statistics.mean(batches) if batches else 0.0,
            # the server's split of a request's time: waiting to be taken (batching window included) and decoding
            "queue_ms": statistics.mean(queue_ms) if queue_ms else float("nan"),
            "decode_ms": statistics.mean(decode_ms) if decode_ms else float("nan"),
            # shares of the machine's CPU time during the load: the clients' (this process) and everyone else's
            "clients_cpu": own / total if total > 0 else float("nan"),
            "others_cpu": (busy - own) / total if total > 0 else float("nan")}


class Ceiling:
    """The server's decoding alone: ``serve.workers`` copies of the server's own worker process
    (:class:`mtpipe.engine.workers.WorkerProcess`, the same model, settings, threads, warm-up and lane), each fed its
    ``clients / workers`` sentences at a time straight down its pipe, a new one as soon as one is answered, with no
    HTTP, queue, batching window or detokenising. What the server could reach at this load if serving cost nothing:
    the bound on the server's row from its decoding step alone."""

    def __init__(self, args: argparse.Namespace, url: str) -> None:
        import dataclasses

        import httpx

        from mtpipe.config import DecodeConfig
        from mtpipe.engine.search import DecodeRules
        from mtpipe.engine.opening import OpenModel
        from mtpipe.engine.workers import WorkerProcess, worker_threads

        info = httpx.get(url + "/info", timeout=30).json()  # the settings the server really runs with
        decode, serve = DecodeConfig(**info["decode"]), info["serve"]
        self.rules = DecodeRules.from_config(decode)
        self.workers = serve["workers"]
        cfg = dataclasses.replace(decode, threads=worker_threads(decode, self.workers))
        self.procs = [WorkerProcess(i, cfg, args.checkpoint, args.tokens, serve["batching"])
                      for i in range(self.workers)]
        description = [w.ready() for w in self.procs][0]
        self.model = OpenModel.described(description)
        self.in_flight = max(1, -(-args.clients // self.workers))

    def run(self, sentences: list[str]) -> float:
        """Sentences per second over the wall time, every worker decoding its share at once."""
        limit = self.model.max_positions - 1
        sources = [s[:limit] for s in self.model.sp.encode(sentences, out_type=int)]
        shares = [list(range(i, len(sources), self.workers)) for i in range(self.workers)]

        errors: list[BaseException] = []

        def drive(w: Any, todo: list[int]) -> None:
            try:
                closed_loop(w, todo)
            except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
                errors.append(e)

        def closed_loop(w: Any, todo: list[int]) -> None:
            pending, held = iter(todo), 0
            for i in itertools.islice(pending, self.in_flight):
                w.add(i, [sources[i]], self.rules)
                held += 1
            while held:
                for _, result in w.poll():
                    if isinstance(result, Exception):
                        raise result
                    held -= 1
                    nxt = next(pending, None)
                    if nxt is not None:
                        w.add(nxt, [sources[nxt]], self.rules)
                        held += 1

        threads = [threading.Thread(target=drive, args=(w, share)) for w, share in zip(self.procs, shares)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return len(sources) / (time.perf_counter() - start)

    def close(self) -> None:
        for w in self.procs:
            w.close()


HALF_BODY = (b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n"
             b'{"text":')


def hostile(url: str, idle: int, large: dict, stats: dict) -> Any:
    """A coroutine function for :func:`load`'s ``during``: ``idle`` connections held open, half silent and half
    stuck in their body, each reopened when the server closes it, and one request ``large`` always in flight on its
    own connection. Counts in ``stats``: idle connections opened, closed by the server, refused (503 or no connect),
    large requests answered (by status)."""
    import asyncio
    import json

    host, port = url.split("://", 1)[1].rstrip("/").rsplit(":", 1)
    body = json.dumps(large).encode()
    request = (b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
               % len(body)) + body

    async def hold(i: int) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
            except OSError:
                stats["refused"] += 1
                await asyncio.sleep(0.5)
                continue
            stats["opened"] += 1
            try:
                if i % 2:
                    writer.write(HALF_BODY)
                answer = await reader.read()  # until the server closes it
                stats["refused" if answer.startswith(b"HTTP/1.1 503") else "closed"] += 1
            except OSError:
                stats["closed"] += 1
            finally:
                writer.close()

    async def greedy() -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
            except OSError:
                stats["large_lost"] += 1
                await asyncio.sleep(0.5)
                continue
            try:
                while True:
                    writer.write(request)
                    head = await reader.readuntil(b"\r\n\r\n")
                    lines = head.decode("latin-1").split("\r\n")
                    status = int(lines[0].split()[1])
                    length = next(int(v) for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)
                                  if k.strip().lower() == "content-length")
                    await reader.readexactly(length)
                    stats["large"][status] = stats["large"].get(status, 0) + 1
            except (OSError, asyncio.IncompleteReadError):
                stats["large_lost"] += 1
            finally:
                writer.close()

    async def run() -> None:
        await asyncio.gather(*(hold(i) for i in range(idle)), greedy())

    return run


def large_request(url: str, sentences: list[str], n: int, beam: int) -> tuple[dict, int]:
    """The ``n`` longest sentences at ``beam`` (within the server's serve.max_beam), halved until the server
    accepts the work (serve.max_request_work): the request, and its decoding seconds on the quiet server."""
    import httpx

    serve = httpx.get(url + "/info", timeout=30).json()["serve"]
    beam = min(beam, serve["max_beam"])
    longest = sorted(sentences, key=len, reverse=True)[: min(n, serve["max_sentences"])]
    while True:
        body = {"text": longest, "beam": beam}
        start = time.perf_counter()
        r = httpx.post(url + "/translate", json=body, timeout=600)
        if r.status_code == 200:
            return body, time.perf_counter() - start
        if r.status_code != 413 or len(longest) == 1:
            sys.exit(f"error: the large request got {r.status_code}: {r.text[:200]}")
        longest = longest[: len(longest) // 2]


def slow_clients(args: argparse.Namespace, sentences: list[str]) -> None:
    """``--case slow-clients`` (module docstring): short requests' latency on a quiet server and beside idle
    connections and a large request, round by round."""
    import httpx

    server = Server(args, args.out / "serve.log")
    rows = []
    try:
        load(server.url, sentences[: 4 * args.clients], args.clients, args.timeout)  # warm-up, not timed
        large, large_s = large_request(server.url, sentences, args.large_n, args.large_beam)
        console.print(f"large request: {len(large['text'])} sentences at beam {large['beam']}, {large_s:.1f} s alone")
        for r in range(args.rounds):
            row: dict = {"round": r + 1}
            stats: dict = {"opened": 0, "closed": 0, "refused": 0, "large": {}, "large_lost": 0}
            for part in (["quiet", "hostile"] if r % 2 == 0 else ["hostile", "quiet"]):
                during = hostile(server.url, args.idle, large, stats) if part == "hostile" else None
                row[part] = load(server.url, sentences, args.clients, args.timeout, during)
            row.update(stats)
            row["ratio"] = row["hostile"]["p99_ms"] / row["quiet"]["p99_ms"]
            row["differ"] = sum(a is not None and b is not None and a != b
                                for a, b in zip(row["quiet"]["answers"], row["hostile"]["answers"]))
            rows.append(row)
            console.print(f"round {r + 1}: p99 quiet {row['quiet']['p99_ms']:.0f} ms, with {args.idle} idle "
                          f"connections and a large request {row['hostile']['p99_ms']:.0f} ms ({row['ratio']:.2f}x); "
                          f"large answered {sum(stats['large'].values())}, idle closed by the server "
                          f"{stats['closed']}")
        counters = httpx.get(server.url + "/info", timeout=30).json()["counters"]
    finally:
        code = server.stop()

    def both(key: str) -> list[list[Any]]:
        return [[f"{key.split('_')[0]} latency (ms), {part}", *[row[part][key] for row in rows],
                 spread([row[part][key] for row in rows])] for part in ("quiet", "hostile")]

    header = ["", *[f"round {row['round']}" for row in rows], "min / median / max"]
    body = [*both("p50_ms"), *both("p99_ms"),
            ["p99 ratio, hostile / quiet", *[row["ratio"] for row in rows], spread([row["ratio"] for row in rows])]]
    for name, key in (("failed short requests", "failed"), ("lost short requests", "lost")):
        values = [row["quiet"][key] + row["hostile"][key] for row in rows]
        body.append([name, *values, spread(values)])
    for name, key in (("answers differing between the runs", "differ"), ("idle connections opened", "opened"),
                      ("idle connections closed by the server", "closed"), ("idle connections refused", "refused"),
                      ("large requests lost", "large_lost")):
        body.append([name, *[row[key] for row in rows], spread([row[key] for row in rows])])
    answered = [sum(row["large"].values()) for row in rows]
    body.append(["large requests answered (any status)", *answered, spread(answered)])
    table("mtpipe serve: short requests beside slow clients and a large request", header, body)
    ratio = statistics.median(row["ratio"] for row in rows)
    verdict = "pass" if ratio <= 2.0 else "missed"
    console.print(f"p99 with {args.idle} idle connections and a large request / quiet, median: {ratio:.2f}x (target "
                  f"<= 2x: {verdict}); server counters: read timeouts {counters.get('read_timeouts')}, refused "
                  f"connections {counters.get('refused_connections')}; exit status {code}")

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = [f"# mtpipe serve: short requests beside slow clients and a large request ({stamp})", "",
          f"{args.checkpoint}, {len(sentences):,} sentences of {args.sentences.name}, {args.clients} clients (one "
          f"sentence per request); {args.idle} idle connections (half silent, half mid-body) and one request of "
          f"{len(large['text'])} sentences at beam {large['beam']} in flight ({large_s:.1f} s alone); {args.rounds} "
          f"rounds, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs. decode args: "
          f"`{args.decode_args}`; serve args: `{args.serve_args}`.", "",
          "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    md += ["| " + " | ".join(str(c) if isinstance(c, str) else fmt(c) for c in line) + " |" for line in body]
    md += ["", f"Median p99 ratio {ratio:.2f}x (target <= 2x: {verdict}). Server exit status: {code}.", ""]
    out = args.out / "serve_slow_clients.md"
    out.write_text("\n".join(md), encoding="utf-8")
    console.print(f"written: {out}")
    write_results("serve_slow_clients", {
        "settings": {"sentences": len(sentences), "clients": args.clients, "idle": args.idle,
                     "large_sentences": len(large["text"]), "large_beam": large["beam"], "large_alone_s": large_s,
                     "decode_args": args.decode_args, "serve_args": args.serve_args},
        "rounds": [{k: v for k, v in row.items() if k not in ("quiet", "hostile")}
                   | {part: {k: v for k, v in row[part].items() if k != "answers"} for part in ("quiet", "hostile")}
                   for row in rows],
        "p99_ratio_median": ratio, "target": "<= 2x", "verdict": verdict, "server_exit": code,
        "server_counters": counters}, args.results)
    failed = sum(row["quiet"]["failed"] + row["quiet"]["lost"] + row["hostile"]["failed"] + row["hostile"]["lost"]
                 for row in rows)
    sys.exit(0 if code == 0 and failed == 0 else 1)


def spread(values: list[float]) -> str:
    return f"{fmt(min(values))} / {fmt(statistics.median(values))} / {fmt(max(values))}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, required=True, help="checkpoint (or CTranslate2 export) to serve")
    ap.add_argument("--tokens", type=Path, required=True, help="its bpe artifact")
    ap.add_argument("--sentences", type=Path, required=True, help="source sentences, one a line (.gz read as gzip)")
    ap.add_argument("--n", type=int, default=1000, help="sentences to translate (the first N non-blank lines)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients, one sentence per request")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 3 for min / median / max)")
    ap.add_argument("--params", type=Path, default=None, help="params file for both (default: ./params.yaml)")
    ap.add_argument("--decode-args", default="", help="decode flags for both, e.g. '--beam 4 --threads 2'")
    ap.add_argument("--serve-args", default="", help="serve flags, e.g. '--batch-wait-ms 5'")
    ap.add_argument("--ceiling", action="store_true",
                    help="also time the server's worker processes decoding the sentences alone, clients/workers "
                         "at a time straight down their pipes (no HTTP, queue or batching window): the bound the "
                         "decoding step sets on the server at this load")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a request may take before it counts lost")
    ap.add_argument("--case", choices=("throughput", "slow-clients"), default="throughput",
                    help="throughput: the server against offline decode; slow-clients: short requests' latency "
                         "beside idle connections and a large request, against a quiet server")
    ap.add_argument("--idle", type=int, default=100, help="slow-clients: idle connections held open")
    ap.add_argument("--large-n", type=int, default=64, help="slow-clients: sentences of the large request "
                    "(the longest ones; halved until serve.max_request_work accepts it)")
    ap.add_argument("--large-beam", type=int, default=8, help="slow-clients: beam of the large request")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "serve", help="markdown table and logs")
    ap.add_argument("--results", type=Path, help="the results file (default bench/results/serve[_slow_clients]-<UTC "
                    "time>.json)")
    args = ap.parse_args()
    if args.rounds < 1 or args.clients < 1 or args.n < 1:
        sys.exit("error: --rounds, --clients and --n must be >= 1")
    if args.idle < 0 or args.large_n < 1 or args.large_beam < 1:
        sys.exit("error: --idle must be >= 0, --large-n and --large-beam >= 1")

    args.out.mkdir(parents=True, exist_ok=True)
    sentences = read_sentences(args.sentences, args.n)
    infile = args.out / "sentences.txt"
    infile.write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
    console.print(f"{len(sentences):,} sentences, {args.clients} clients, {args.rounds} rounds")
    if args.case == "slow-clients":
        slow_clients(args, sentences)
        return

    server = Server(args, args.out / "serve.log")
    ceiling = None
    rows, reference = [], None
    try:
        load(server.url, sentences[: 4 * args.clients], args.clients, args.timeout)  # warm-up, not timed
        parts = ["offline", "server"]
        if args.ceiling:
            ceiling = Ceiling(args, server.url)
            ceiling.run(sentences[: 4 * args.clients])  # warm-up, not timed
            parts.append("ceiling")
        for r in range(args.rounds):
            order = parts[r % len(parts):] + parts[: r % len(parts)]  # each part first in turn
            row: dict = {"round": r + 1}
            for part in order:
                if part == "offline":
                    row["offline"], reference = offline(args, infile, len(sentences))
                elif part == "server":
                    row.update(load(server.url, sentences, args.clients, args.timeout))
                else:
                    assert ceiling is not None
                    row["ceiling"] = ceiling.run(sentences)
            row["ratio"] = row["sent_s"] / row["offline"]
            if ceiling is not None:
                row["ceiling_ratio"] = row["ceiling"] / row["offline"]
            row["differ"] = sum(a is not None and a != ref for a, ref in zip(row["answers"], reference))
            rows.append(row)
            console.print(f"round {r + 1}: offline {row['offline']:.1f} sent/s, server {row['sent_s']:.1f} sent/s "
                          f"({row['ratio']:.2f}x), p50 {row['p50_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms")
        import httpx

        counters = httpx.get(server.url + "/info", timeout=30).json()["counters"]
    finally:
        if ceiling is not None:
            ceiling.close()
        code = server.stop()

    keys = [("offline sentences/s", "offline"), ("server sentences/s", "sent_s"), ("server / offline", "ratio"),
            ("p50 latency (ms)", "p50_ms"), ("p99 latency (ms)", "p99_ms"), ("mean requests decoded together", "mean_batch"),
            ("mean ms a request waited in the server's queue", "queue_ms"),
            ("mean ms from its batch's start to its answer", "decode_ms"),
            ("failed requests", "failed"), ("lost requests", "lost"), ("answers differing from offline", "differ"),
            ("machine CPU share: the load generator's clients", "clients_cpu"),
            ("machine CPU share: the server and everything else", "others_cpu")]
    if args.ceiling:
        keys[3:3] = [("ceiling: the workers' decoding alone, sentences/s", "ceiling"),
                     ("ceiling / offline", "ceiling_ratio")]
    header = ["", *[f"round {row['round']}" for row in rows], "min / median / max"]
    body = [[name, *[row[k] for row in rows], spread([row[k] for row in rows])] for name, k in keys]
    table("mtpipe serve vs mtpipe decode", header, body)
    ratio = statistics.median(row["ratio"] for row in rows)
    verdict = "pass" if ratio >= 0.7 else "missed"
    console.print(f"server / offline throughput, median: {ratio:.2f}x (target >= 0.70x: {verdict}); most requests "
                  f"decoded together {counters['max_requests_together']}; server exit status {code}")

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = [f"# mtpipe serve vs mtpipe decode ({stamp})", "",
          f"{args.checkpoint}, {len(sentences):,} sentences of {args.sentences.name}, {args.clients} clients (one "
          f"sentence per request), {args.rounds} interleaved rounds, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs. decode args: `{args.decode_args}`; serve args: `{args.serve_args}`.", "",
          "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    md += ["| " + " | ".join(str(c) if isinstance(c, str) else fmt(c) for c in line) + " |" for line in body]
    md += ["", f"Median ratio {ratio:.2f}x (target >= 0.70x: {verdict}). Most requests decoded "
               f"together: {counters['max_requests_together']}. Server exit status: {code}.", ""]
    out = args.out / "serve.md"
    out.write_text("\n".join(md), encoding="utf-8")
    console.print(f"written: {out}")
    write_results("serve", {
        "settings": {"sentences": len(sentences), "clients": args.clients, "decode_args": args.decode_args,
                     "serve_args": args.serve_args},
        "rounds": [{k: v for k, v in row.items() if k not in ("answers",)} for row in rows],
        "ratio_median": ratio, "target": ">= 0.70x", "verdict": verdict, "server_exit": code,
        "max_requests_together": counters["max_requests_together"]}, args.results)
    sys.exit(0 if code == 0 and all(row["failed"] == row["lost"] == 0 for row in rows) else 1)


if __name__ == "__main__":
    main()
