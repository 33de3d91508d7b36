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
"""

from __future__ import annotations

import argparse
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

from bench.machine import cpu_ticks, own_cpu  # noqa: E402
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


def load(url: str, sentences: list[str], clients: int, timeout: float) -> dict:
    """``clients`` concurrent clients, each on its own keep-alive connection, sending the sentences one per request:
    throughput, latencies, failures, answers.

    Why asyncio and hand-written HTTP/1.1 rather than an HTTP library in threads: the clients share the machine with
    the server, and 128 threads of httpx took ~26 % of this 2-core machine's CPU time (~7 ms per request), which the
    server then lacked. One event loop writing prepared requests and reading ``Content-Length`` bodies costs a small
    fraction of that; the table reports the clients' share either way."""
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

    async def run() -> None:
        await asyncio.gather(*(client() for _ in range(clients)))

    busy0, total0 = cpu_ticks()
    own0 = own_cpu()
    start = time.perf_counter()
    asyncio.run(run())
    wall = time.perf_counter() - start
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
    (:class:`mtpipe.workers.WorkerProcess`, the same model, settings, threads, warm-up and lane), each fed its
    ``clients / workers`` sentences at a time straight down its pipe, a new one as soon as one is answered, with no
    HTTP, queue, batching window or detokenising. What the server could reach at this load if serving cost nothing:
    the bound on the server's row from its decoding step alone."""

    def __init__(self, args: argparse.Namespace, url: str) -> None:
        import dataclasses

        import httpx

        from mtpipe.config import DecodeConfig
        from mtpipe.search import DecodeRules
        from mtpipe.serve import ServedModel
        from mtpipe.workers import WorkerProcess, worker_threads

        info = httpx.get(url + "/info", timeout=30).json()  # the settings the server really runs with
        decode, serve = DecodeConfig(**info["decode"]), info["serve"]
        self.rules = DecodeRules.from_config(decode)
        self.workers = serve["workers"]
        cfg = dataclasses.replace(decode, threads=worker_threads(decode, self.workers))
        self.procs = [WorkerProcess(i, cfg, args.checkpoint, args.tokens, serve["batching"])
                      for i in range(self.workers)]
        description = [w.ready() for w in self.procs][0]
        self.model = ServedModel.described(description)
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
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "serve", help="markdown table and logs")
    args = ap.parse_args()
    if args.rounds < 1 or args.clients < 1 or args.n < 1:
        sys.exit("error: --rounds, --clients and --n must be >= 1")

    args.out.mkdir(parents=True, exist_ok=True)
    sentences = read_sentences(args.sentences, args.n)
    infile = args.out / "sentences.txt"
    infile.write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
    console.print(f"{len(sentences):,} sentences, {args.clients} clients, {args.rounds} rounds")

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
    sys.exit(0 if code == 0 and all(row["failed"] == row["lost"] == 0 for row in rows) else 1)


if __name__ == "__main__":
    main()
