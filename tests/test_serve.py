"""`mtpipe serve`: the real server (a subprocess on a free loopback port) with a tiny model that memorised a few
sentences. Its answers equal `mtpipe decode`'s on the same sentences, also when requests of different lengths and
settings share a batch; bad input gets a 4xx with one line of JSON and the server keeps serving; a full queue gets
503 with Retry-After; concurrent requests are decoded together, a request joining the running batch; SIGTERM lets the request in flight finish and
exits 0. Every phase of a request is bounded: silent and half-sent requests are closed after serve.read_timeout_s,
connections past serve.max_connections refused, work past serve.max_request_work refused (413), a large request takes
turns with short ones chunk by chunk, a client that leaves is cancelled (one log line), and SIGTERM exits 0 within
serve.drain_s whatever the clients do."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pyarrow as pa
import pytest
from conftest import memorise, train_spm
from typer.testing import CliRunner

from mtpipe import artifacts, writing
from mtpipe.cli import app
from mtpipe.config import to_dict

# Sentences of 3 to 9 words, so that a batch of several requests holds padded rows.
PAIRS = [
    ("the dog runs .", "der hund rennt ."),
    ("a cat sleeps .", "eine katze schläft ."),
    ("the man sees a ball .", "der mann sieht einen ball ."),
    ("a woman likes the house .", "eine frau mag das haus ."),
    ("the child eats an apple in the garden .", "das kind isst einen apfel im garten ."),
    ("the big dog finds a small book near the house .", "der große hund findet ein kleines buch beim haus ."),
    ("a man and a woman see the child .", "ein mann und eine frau sehen das kind ."),
    ("the cat likes the garden .", "die katze mag den garten ."),
    ("a child runs .", "ein kind rennt ."),
    ("the woman finds the ball near the garden .", "die frau findet den ball beim garten ."),
]
LIMITS = ["--max-sentences", "12", "--max-chars", "80", "--max-beam", "6", "--max-nbest", "3", "--max-alpha", "2"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> dict:
    """A bpe-like tokens artifact (its SentencePiece model) and a checkpoint of a tiny model that memorised PAIRS."""
    root = tmp_path_factory.mktemp("serve")
    sp = train_spm(root / "spm", [line for pair in PAIRS for line in pair] * 3, vocab_size=160)  # ~ a piece a word
    src = [sp.encode(s) for s, _ in PAIRS]
    tgt = [sp.encode(t) for _, t in PAIRS]
    tokens = root / "tokens"
    with writing.ArtifactWriter(tokens, "tokens") as w:
        w.write_table("test.parquet", pa.table({"id": list(range(len(src))), "src": src, "tgt": tgt}))
        shutil.copy(root / "spm.model", w.path("spm.model"))
        w.extra.update({"spm_sha256": artifacts.file_hash(w.path("spm.model")), "vocab_size": sp.get_piece_size()})
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is as fast, and does not fight the server's for the cores
    try:
        net = memorise(src, tgt, sp.get_piece_size(), 40, steps=100, stop_loss=0.02)
    finally:
        torch.set_num_threads(threads)
    checkpoint = root / "ckpt"
    writing.write_checkpoint(checkpoint, state_dict=net.state_dict(), meta=artifacts.CheckpointManifest(
        model_config=to_dict(net.cfg), step=100,
        vocab={"spm_sha256": artifacts.file_hash(root / "spm.model"), "size": sp.get_piece_size()}))
    params = root / "params.yaml"
    params.write_text("", encoding="utf-8")  # built-in defaults, not the repository's params.yaml
    return {"root": root, "tokens": tokens, "checkpoint": checkpoint, "params": params}


class Server:
    """``python -m mtpipe serve`` on 127.0.0.1, port 0 (a free one, read back from its start-up line). ``ready``
    False: returned as soon as the port serves, while the model still loads (its first line)."""

    def __init__(self, model: dict, *flags: str, ready: bool = True) -> None:
        cmd = [sys.executable, "-m", "mtpipe", "serve", "--params", str(model["params"]), "--checkpoint",
               str(model["checkpoint"]), "--tokens", str(model["tokens"]), "--host", "127.0.0.1", "--port", "0",
               "--threads", "1", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "COLUMNS": "160"})
        self.log: list[str] = []
        found = threading.Event()
        self.url = ""

        def read() -> None:  # keep the pipe drained for as long as the server logs
            for line in self.proc.stderr:
                self.log.append(line)
                said = "listening on " if ready or "listening on " in line else "loading the model; "
                if said in line and not found.is_set():
                    self.url = line.split(said)[1].split()[0]
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        found.wait(120)
        assert self.url, f"server did not start: {''.join(self.log)}"
        # Idle connections are dropped after 1 s, before the server's keep-alive (uvicorn: 5 s) closes them: with
        # both at 5 s a request sent on a connection the server was closing at that moment was reset (seen when a
        # busy machine left a module's server idle for ~5 s between tests).
        self.client = httpx.Client(base_url=self.url, timeout=60, limits=httpx.Limits(keepalive_expiry=1.0))

    def post(self, body, **kw) -> httpx.Response:
        if isinstance(body, (bytes, str)):
            return self.client.post("/translate", content=body, headers={"content-type": "application/json"}, **kw)
        return self.client.post("/translate", json=body, **kw)

    def wait_queued(self, n: int) -> None:
        for _ in range(500):
            if self.client.get("/health").json()["queued"] == n:
                return
            time.sleep(0.01)
        raise AssertionError(f"never {n} queued requests")

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # as Ctrl-C: without SIGTERM's serve.drain_grace_s
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(model):
    """One server for the module: 200 ms to gather concurrent requests, small limits to test them against, idle
    connections closed after 2 s (the client drops its own after 1 s)."""
    s = Server(model, "--batch-wait-ms", "200", "--keep-alive-s", "2", *LIMITS)
    yield s
    s.stop()


def decode(model: dict, sentences: list[str], *flags: str) -> list[dict]:
    """`mtpipe decode --input FILE` (in this process) on ``sentences``: its hypotheses table rows."""
    root = model["root"]
    n = len(list(root.glob("in*.txt")))
    infile, out = root / f"in{n}.txt", root / f"out{n}"
    infile.write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
    r = CliRunner().invoke(app, ["decode", "--params", str(model["params"]), "--checkpoint", str(model["checkpoint"]),
                                 "--tokens", str(model["tokens"]), "--input", str(infile), "--out", str(out),
                                 "--threads", "1", *flags])
    assert r.exit_code == 0, r.output
    return artifacts.read_table(out, "input.parquet", "hypotheses").to_pylist()


def concurrently(fns: list) -> list:
    """Run the callables at once (threads released together); their results in order."""
    results: list = [None] * len(fns)
    barrier = threading.Barrier(len(fns))

    def run(i: int) -> None:
        barrier.wait()
        results[i] = fns[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


# --------------------------------------------------------------------------------------------------------------------
# Answers
# --------------------------------------------------------------------------------------------------------------------


def test_one_request_equals_mtpipe_decode(server, model):
    sentences = [s for s, _ in PAIRS]
    want = decode(model, sentences, "--nbest", "2")
    assert sum(row["hypothesis"] == t for row, (_, t) in zip(want, PAIRS)) >= 8  # the model memorised PAIRS

    r = server.post({"text": [f"  {s} " for s in sentences], "nbest": 2})  # stripped as decode strips a line
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["translations"] == [row["hypothesis"] for row in want]
    assert got["scores"] == pytest.approx([row["score"] for row in want], abs=1e-4)
    assert got["nbest"] == [row["nbest"] for row in want]
    for scores, row in zip(got["nbest_scores"], want):
        assert scores == pytest.approx(row["nbest_scores"], abs=1e-4)
    assert got["model"] == artifacts.manifest_hash(model["checkpoint"])
    assert got["settings"] == {"beam": 4, "alpha": 0.6, "nbest": 2} and got["truncated"] == 0
    assert got["batch"]["sentences"] >= len(sentences) and got["batch"]["requests"] >= 1


def test_mixed_batches_equal_mtpipe_decode(server, model):
    """One sentence per request, all sent at once, half at beam 1 and half at the default beam 4: sentences of
    different lengths and requests of different settings share batches (padded rows, one group per setting), and
    every answer is still `mtpipe decode`'s."""
    sentences = [s for s, _ in PAIRS]
    want = {4: decode(model, sentences), 1: decode(model, sentences, "--beam", "1")}
    beams = [1 if i % 2 else 4 for i in range(len(sentences))]
    answers = concurrently([lambda s=s, b=b: server.post({"text": [s], "beam": b}) for s, b in zip(sentences, beams)])
    for i, (r, beam) in enumerate(zip(answers, beams)):
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["translations"] == [want[beam][i]["hypothesis"]]
        assert got["scores"] == pytest.approx([want[beam][i]["score"]], abs=1e-4)
        assert "nbest" not in got  # nbest 1: no lists
    shared = [r.json()["batch"] for r in answers if r.json()["batch"]["requests"] > 1]
    assert shared, "no two requests were decoded together"
    assert any(b["sentences"] > 2 for b in shared)  # padded rows of several requests (both beams) at once


def test_every_decode_rule_reaches_the_server(model):
    """The search rules a request cannot set (stopping rule, patience, the fewest pieces before EOS, the length
    limit) come from the decode section as in `mtpipe decode`: with settings that change the outputs, the server's
    answers are still decode's."""
    sentences = [s for s, _ in PAIRS[:4]]
    rules = ["--stop", "finished", "--patience", "2", "--min-len", "12", "--max-len-b", "14"]
    want = decode(model, sentences, *rules)
    assert [row["hypothesis"] for row in want] != [row["hypothesis"] for row in decode(model, sentences)]
    assert all(len(row["hypothesis"].split()) >= 4 for row in want)  # min_len forced longer outputs
    s = Server(model, *rules)
    try:
        r = s.post({"text": sentences})
    finally:
        s.stop()
    assert r.status_code == 200, r.text
    assert r.json()["translations"] == [row["hypothesis"] for row in want]
    assert r.json()["scores"] == pytest.approx([row["score"] for row in want], abs=1e-4)


def test_concurrent_requests_are_batched_and_counted(server):
    before = server.client.get("/info").json()["counters"]
    answers = concurrently([lambda s=s: server.post({"text": [s]}) for s, _ in PAIRS[:8]])
    assert all(r.status_code == 200 for r in answers)
    batches = [r.json()["batch"] for r in answers]
    for b in batches:  # each answer says how many requests and sentences were decoded with it, itself included
        assert b["requests"] >= 1 and b["sentences"] >= b["requests"] and b["queue_ms"] >= 0 and b["decode_ms"] > 0
        assert b["worker"] == 0
    assert max(b["requests"] for b in batches) >= 2
    after = server.client.get("/info").json()["counters"]
    assert after["requests"] - before["requests"] == 8
    assert after["sentences"] - before["sentences"] == 8
    assert after["max_requests_together"] >= max(b["requests"] for b in batches)


def test_a_request_joins_the_running_batch_and_a_short_one_is_answered_first(model):
    """Continuous batching: a request that arrives while another decodes joins it at the next decoder step (no
    waiting for the batch to end, and answered as `mtpipe decode` answers it), and a short sentence is answered as
    soon as its own search ends, before the longer one it joined."""
    import asyncio

    from mtpipe.config import DecodeConfig
    from mtpipe.engine.search import DecodeRules, LengthPenalty
    from mtpipe.engine.opening import open_model
    from mtpipe.serve.batcher import Batcher, Job

    served = open_model(DecodeConfig(threads=1), model["checkpoint"], model["tokens"])
    lane = served.lane(continuous=True)
    steps: list[int] = []
    poll = lane.poll

    def counting_poll():  # the lane's decoder steps, and which requests were in the batch at each
        steps.append(len(lane.pending))
        return poll()

    lane.poll = counting_poll
    loop = asyncio.new_event_loop()
    batcher = Batcher(served.detokenise, max_queue=8, wait_s=0.0, batch_tokens=10_000)
    rules = DecodeRules(beam=4, penalty=LengthPenalty("gnmt", 0.6))
    long_text, short_text = PAIRS[5][0], PAIRS[0][0]
    order: list[str] = []

    def job(text: str) -> Job:
        future = loop.create_future()
        future.add_done_callback(lambda f: order.append(text))
        return Job([served.sp.encode(text, out_type=int)], rules, future, loop, time.monotonic())

    long_job, short_job = job(long_text), job(short_text)
    batcher.submit(long_job)
    batcher.start(lane)
    try:
        for _ in range(500):
            if steps:
                break
            time.sleep(0.002)
        batcher.submit(short_job)  # the long sentence is decoding
        for _ in range(1000):
            loop.run_until_complete(asyncio.sleep(0.005))
            if long_job.future.done() and short_job.future.done():
                break
        loop.run_until_complete(asyncio.sleep(0.005))  # run the done callbacks of the last future settled
    finally:
        batcher.close()
        batcher.join(10)
    want = {row["hypothesis"] for row in decode(model, [long_text, short_text])}
    answers = [long_job.future.result(), short_job.future.result()]
    assert {a.hypotheses[0][0][0] for a in answers} == want
    assert answers[1].batch["requests"] == 2 and answers[0].batch["requests"] == 2  # decoded together ...
    assert steps[0] == 1 and 2 in steps  # ... after the long one had started alone
    assert order == [short_text, long_text]  # the short one answered first
    loop.close()


def test_health_and_info(server, model):
    assert server.client.get("/health").json()["status"] == "ok"
    info = server.client.get("/info").json()
    assert info["model"] == artifacts.manifest_hash(model["checkpoint"]) and info["step"] == 100
    assert info["engine"] == "mtpipe" and info["precision"] == "fp32" and info["vocab_size"] > 10
    assert info["model_config"]["d_model"] == 64 and info["max_positions"] == 40
    assert info["decode"]["beam"] == 4 and info["serve"]["max_beam"] == 6 and info["serve"]["max_queue"] == 64
    assert {"requests", "max_requests_together", "queued"} <= set(info["counters"]) and info["batching"] == "batch"
    # The start-up table says how long loading and the warm-up took, and the connections' keep-alive.
    log = "".join(server.log)
    started = re.search(r"start-up\s*│\s*([0-9.]+) s: loading, warm-up", log)
    assert started and 0 < float(started.group(1)) < 120, log
    assert "idle ones closed after 2 s (serve.keep_alive_s)" in log


# --------------------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------------------

OK = '"text": ["the dog runs ."]'
BAD = {
    "malformed json": (b'{"text": ["the dog runs ."', 400, "not valid JSON"),
    "not utf-8": ('{"text": ["der Hund läuft"]}'.encode("latin-1"), 400, "not valid UTF-8"),
    "nan": ("{" + OK + ', "alpha": NaN}', 400, "NaN"),
    "not an object": ('["the dog runs ."]', 422, "JSON object"),
    "no text": ('{"beam": 2}', 422, "text: missing"),
    "unknown field": ("{" + OK + ', "bem": 2}', 422, "unknown field 'bem'"),
    "text a string": ('{"text": "the dog runs ."}', 422, "list of strings"),
    "text of numbers": ('{"text": ["the dog runs .", 3]}', 422, "text[1]: must be a string"),
    "text null": ('{"text": null}', 422, "list of strings"),
    "empty list": ('{"text": []}', 422, "empty list"),
    "empty string": ('{"text": ["the dog runs .", ""]}', 422, "text[1]: empty"),
    "whitespace only": ('{"text": [" \\t\\n "]}', 422, "text[0]: empty or whitespace"),
    "lone surrogate": ('{"text": ["a \\ud800 b"]}', 422, "lone surrogate"),
    "too many sentences": (json.dumps({"text": ["the dog runs ."] * 13}), 413, "serve.max_sentences"),
    "too many chars": (json.dumps({"text": ["the dog runs . " * 6]}), 413, "serve.max_chars"),
    "huge body": (b'{"text": ["' + b"a" * 2_000_000 + b'"]}', 413, "body"),
    "nested 5,000 deep": (b'{"text": ' + b"[" * 5_000 + b"]" * 5_000 + b"}", 400, "nested too deeply"),
    "beam a string": ("{" + OK + ', "beam": "4"}', 422, "beam: must be an integer"),
    "beam a float": ("{" + OK + ', "beam": 2.5}', 422, "beam: must be an integer"),
    "beam a bool": ("{" + OK + ', "beam": true}', 422, "beam: must be an integer"),
    "beam 0": ("{" + OK + ', "beam": 0}', 422, "beam: 0 must be >= 1"),
    "beam over limit": ("{" + OK + ', "beam": 7}', 422, "serve.max_beam"),
    "nbest over limit": ("{" + OK + ', "beam": 6, "nbest": 4}', 422, "serve.max_nbest"),
    "nbest over beam": ("{" + OK + ', "beam": 2, "nbest": 3}', 422, "more than beam"),
    "alpha a string": ("{" + OK + ', "alpha": "0.6"}', 422, "alpha: must be a number"),
    "alpha negative": ("{" + OK + ', "alpha": -0.5}', 422, "alpha: -0.5"),
    "alpha over limit": ("{" + OK + ', "alpha": 2.5}', 422, "serve.max_alpha"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_gets_a_4xx_line_and_the_server_keeps_serving(server, case):
    body, status, words = BAD[case]
    r = server.post(body)
    assert r.status_code == status, r.text
    reason = r.json()["error"]
    assert words in reason and "\n" not in reason and list(r.json()) == ["error"]
    ok = server.post({"text": ["the dog runs ."], "beam": 1})
    assert ok.status_code == 200 and ok.json()["translations"] == ["der hund rennt ."]


def test_idle_connections_are_closed_after_serve_keep_alive_s(server):
    """serve.keep_alive_s (2 s here, uvicorn's own is 5 s): an idle HTTP/1.1 connection stays open for the client's
    next request, then the server closes it."""
    import socket
    import urllib.parse

    url = urllib.parse.urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        for _ in range(2):  # a second request on the same connection: kept alive
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                reply += sock.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200")
        idle = time.monotonic()
        assert sock.recv(4096) == b""  # closed by the server ...
        waited = time.monotonic() - idle
    assert 1.5 < waited < 4.5, waited  # ... after its 2 s, not at once nor after uvicorn's 5 s


def test_wrong_method_and_path_get_json_errors(server):
    for r, status in ((server.client.get("/translate"), 405), (server.client.post("/nowhere", json={}), 404)):
        assert r.status_code == status and "error" in r.json()
    assert server.client.get("/health").status_code == 200


# --------------------------------------------------------------------------------------------------------------------
# Queue and shutdown (a server of their own, gathering slowly: 1.5 s)
# --------------------------------------------------------------------------------------------------------------------


def test_full_queue_gets_503_with_retry_after(model):
    s = Server(model, "--batch-wait-ms", "1500", "--max-queue", "1")
    try:
        first: list = []
        waiting = threading.Thread(target=lambda: first.append(s.post({"text": ["the dog runs ."]})))
        waiting.start()
        s.wait_queued(1)  # the first request waits for company: the queue is full
        r = s.post({"text": ["a cat sleeps ."]})
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert "serve.max_queue" in r.json()["error"]
        waiting.join(30)
        assert first[0].status_code == 200 and first[0].json()["translations"] == ["der hund rennt ."]
        again = s.post({"text": ["a cat sleeps ."]})  # the queue drained: served again
        assert again.status_code == 200 and again.json()["translations"] == ["eine katze schläft ."]
        assert s.client.get("/info").json()["counters"]["rejected_queue_full"] == 1
    finally:
        s.stop()


def test_sigterm_finishes_the_request_in_flight_and_exits_0(model):
    s = Server(model, "--batch-wait-ms", "1500")
    answer: list = []
    in_flight = threading.Thread(target=lambda: answer.append(s.post({"text": ["the man sees a ball ."]})))
    in_flight.start()
    s.wait_queued(1)
    s.proc.send_signal(signal.SIGTERM)
    in_flight.join(30)
    assert answer and answer[0].status_code == 200, s.log
    assert answer[0].json()["translations"] == ["der mann sieht einen ball ."]
    assert s.proc.wait(30) == 0, "".join(s.log)
    with pytest.raises(httpx.TransportError):  # it no longer accepts connections
        httpx.get(s.url + "/health", timeout=5)
    s.stop()


def _parent_pid(proc_dir: Path) -> int | None:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(proc_dir: Path) -> bytes:
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:
        return b""


def test_continuous_batching_answers_as_mtpipe_decode(model):
    """``--batching continuous`` through the real server: requests of different lengths and beams sent at once,
    decoded together as they arrive, each answered with `mtpipe decode`'s translation and score."""
    sentences = [s for s, _ in PAIRS]
    want = {4: decode(model, sentences), 1: decode(model, sentences, "--beam", "1")}
    beams = [1 if i % 3 == 0 else 4 for i in range(len(sentences))]
    s = Server(model, "--batching", "continuous", "--batch-wait-ms", "0")
    try:
        assert s.client.get("/info").json()["batching"] == "continuous"
        for _ in range(2):
            answers = concurrently([lambda t=t, b=b: s.post({"text": [t], "beam": b})
                                    for t, b in zip(sentences, beams)])
            for i, (r, beam) in enumerate(zip(answers, beams)):
                assert r.status_code == 200, r.text
                assert r.json()["translations"] == [want[beam][i]["hypothesis"]]
                assert r.json()["scores"] == pytest.approx([want[beam][i]["score"]], abs=1e-4)
        assert max(r.json()["batch"]["requests"] for r in answers) > 1
        two = s.post({"text": sentences[:2], "nbest": 2}).json()  # a request of several sentences
        assert two["translations"] == [row["hypothesis"] for row in want[4][:2]]
    finally:
        s.stop()


@pytest.mark.parametrize("batching", ["batch", "continuous"])
def test_worker_processes_share_the_load_and_answer_as_mtpipe_decode(model, batching):
    """``--workers 2``: two decoding processes, each taking its own requests (one at a time here: the token
    budget is below one sentence), every answer still `mtpipe decode`'s; a killed worker fails at most the requests
    it held; SIGTERM drains both and exits 0. decode.processes (mtpipe decode's) is not the server's: two
    processes, and a line saying so."""
    sentences = [s for s, _ in PAIRS]
    want = decode(model, sentences)
    s = Server(model, "--workers", "2", "--batch-wait-ms", "0", "--batch-tokens", "1", "--batching", batching,
               "--processes", "3")
    try:
        info = s.client.get("/info").json()
        assert info["workers"] == 2 and info["batching"] == batching and info["step"] == 100
        assert info["search"].startswith("fp32, stop ")  # how the workers' engine searches, in its own words
        assert any("decode.processes=3 applies to mtpipe decode" in line for line in s.log), "".join(s.log)
        assert info["model"] == artifacts.manifest_hash(model["checkpoint"]) and info["model_config"]["d_model"] == 64
        workers_seen: set[int] = set()
        for _ in range(3):  # concurrent requests: while one worker decodes, the other takes the next request
            answers = concurrently([lambda t=t: s.post({"text": [t]}) for t in sentences])
            for r, row in zip(answers, want):
                assert r.status_code == 200, r.text
                assert r.json()["translations"] == [row["hypothesis"]]
                assert r.json()["scores"] == pytest.approx([row["score"]], abs=1e-4)
            workers_seen |= {r.json()["batch"]["worker"] for r in answers}
            if workers_seen == {0, 1}:
                break
        assert workers_seen == {0, 1}

        # A worker that dies fails at most the request it held and is started again for the next one.
        children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and
                    _parent_pid(p) == s.proc.pid and b"resource_tracker" not in _cmdline(p)]
        assert len(children) == 2, children
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        codes = [s.post({"text": [sentences[0]]}).status_code for _ in range(6)]
        assert codes.count(500) <= 2 and codes[-2:] == [200, 200], codes
        answers = concurrently([lambda t=t: s.post({"text": [t]}) for t in sentences])
        assert [r.json()["translations"] for r in answers] == [[row["hypothesis"]] for row in want]
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0, "".join(s.log)
    finally:
        s.stop()


# --------------------------------------------------------------------------------------------------------------------
# Start-up errors: one line, exit 1
# --------------------------------------------------------------------------------------------------------------------


def test_startup_errors_are_one_line(model, tmp_path):
    base = ["serve", "--params", str(model["params"]), "--port", "0", "--tokens", str(model["tokens"])]
    r = CliRunner().invoke(app, [*base, "--checkpoint", str(tmp_path / "missing")])
    assert r.exit_code == 1 and r.output.startswith("error: ") and len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(app, [*base, "--checkpoint", str(model["checkpoint"]), "--beam", "9"])
    assert r.exit_code == 1 and "serve.max_beam" in r.output and len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(app, [*base, "--checkpoint", str(model["checkpoint"]), "--engine", "ctranslate2",
                                 "--batching", "continuous"])
    assert r.exit_code == 1 and "serve.batching=continuous needs decode.engine=mtpipe" in r.output
    assert len(r.output.strip().splitlines()) == 1

    # Without FastAPI / uvicorn installed: a hint, before anything is loaded.
    code = ("import sys; sys.modules['uvicorn'] = None\nfrom mtpipe.cli import app\n"
            f"app({[*base, '--checkpoint', str(model['checkpoint'])]!r})")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "install mtpipe[serve]" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_a_batch_waits_from_the_end_of_the_last_one():
    """Closed-loop clients: a request that queued while a batch decoded has waited long already when that batch
    ends; it still waits ``wait_s`` from the batch's end, so that the requests its clients send next join it (without
    this, the load splits into alternating half-size batches)."""
    import asyncio

    from mtpipe.engine.search import Hypothesis
    from mtpipe.engine.lanes import BatchLane
    from mtpipe.serve.batcher import Batcher, Job

    loop = asyncio.new_event_loop()
    first_started, release, sizes = threading.Event(), threading.Event(), []

    def translate(sources, rules):
        sizes.append(len(sources))
        if len(sizes) == 1:
            first_started.set()
            release.wait(10)
        return [[Hypothesis(list(s), 0.0, 0.0)] for s in sources]

    batcher = Batcher(lambda tokens: ["x"] * len(tokens), max_queue=8, wait_s=0.4, batch_tokens=10_000)
    batcher.start(BatchLane(translate))

    def submit() -> None:
        batcher.submit(Job([[5, 6]], "rules", loop.create_future(), loop, time.monotonic()))

    try:
        submit()
        assert first_started.wait(10)
        submit()  # queued while the first batch decodes ...
        time.sleep(0.6)  # ... and has waited longer than wait_s when it ends
        release.set()
        time.sleep(0.05)
        submit()  # a client just answered sends its next request
        time.sleep(0.8)
    finally:
        release.set()
        batcher.close()
        batcher.join(10)
        loop.close()
    assert sizes == [1, 2]


def test_idle_workers_share_a_burst_of_requests():
    """Several idle workers split a burst of requests (closed-loop clients answered together send again together)
    between them, rather than the first awake taking it all while the others wait for the next burst."""
    import asyncio

    from mtpipe.engine.search import Hypothesis
    from mtpipe.engine.lanes import BatchLane
    from mtpipe.serve.batcher import Batcher, Job

    loop = asyncio.new_event_loop()
    sizes: dict[int, list[int]] = {0: [], 1: []}

    def lane(worker: int) -> BatchLane:
        def translate(sources, rules):
            sizes[worker].append(len(sources))
            time.sleep(0.3)  # decoding takes a while: the other worker takes its share meanwhile
            return [[Hypothesis(list(s), 0.0, 0.0)] for s in sources]
        return BatchLane(translate)

    batcher = Batcher(lambda tokens: ["x"] * len(tokens), max_queue=8, wait_s=0.3, batch_tokens=10_000)
    batcher.start(lane(0), worker=0)
    batcher.start(lane(1), worker=1)
    try:
        time.sleep(0.2)  # both idle, waiting for requests
        for _ in range(4):
            batcher.submit(Job([[5, 6]], "rules", loop.create_future(), loop, time.monotonic()))
        time.sleep(1.0)
    finally:
        batcher.close()
        batcher.join(10)
        loop.close()
    assert sizes == {0: [2], 1: [2]}


def test_a_worker_enters_its_lanes_decoding_context_once_around_all_its_polls():
    """A lane's decoding context (decode.compile's settings, slow to enter) is entered once by the worker thread that
    drives the lane, around every poll of every request, and left when the worker stops: not at every poll."""
    import asyncio
    import contextlib

    from mtpipe.engine.search import Hypothesis
    from mtpipe.engine.lanes import BatchLane
    from mtpipe.serve.batcher import Batcher, Job

    events: list[str] = []
    inside = [False]

    class Lane(BatchLane):
        @contextlib.contextmanager
        def decoding(self):
            events.append(f"enter {threading.current_thread().name}")
            inside[0] = True
            try:
                yield
            finally:
                inside[0] = False
                events.append("exit")

    def translate(sources, rules):
        events.append("poll" if inside[0] else "poll outside")
        return [[Hypothesis(list(s), 0.0, 0.0)] for s in sources]

    loop = asyncio.new_event_loop()
    batcher = Batcher(lambda tokens: ["x"] * len(tokens), max_queue=8, wait_s=0.0, batch_tokens=10_000)
    batcher.start(Lane(translate), worker=0)
    try:
        for _ in range(3):
            future = loop.create_future()
            batcher.submit(Job([[5, 6]], "rules", future, loop, time.monotonic()))
            loop.run_until_complete(asyncio.wait_for(future, 10))
    finally:
        batcher.close()
        batcher.join(10)
        loop.close()
    assert events[0].startswith("enter ") and events[0] != f"enter {threading.current_thread().name}"
    assert events[1:] == ["poll"] * 3 + ["exit"]


def test_the_warm_up_decodes_at_every_beam_a_request_may_bring(model, monkeypatch):
    """With decode.compile a step's graphs differ by the beam (greedy search, beams past 8), by the number of
    sentences and, in a continuous batch, by the masks of rows that joined later: the warm-up decodes one sentence
    and three at the default beam, at beam 1 and at serve.max_beam, and a continuous lane also lets three join one
    that is decoding, so that no request waits for a graph to be built."""
    import mtpipe.engine.variants as variants
    from mtpipe.config import DecodeConfig, ServeConfig
    from mtpipe.engine.opening import open_model
    from mtpipe.engine.search import DecodeRules
    from mtpipe.serve.app import warm_beams

    cfg = DecodeConfig(threads=1, beam=4, nbest=2)
    beams = warm_beams(ServeConfig(max_beam=12), cfg)
    assert beams == (1, 4, 12)
    assert warm_beams(ServeConfig(max_beam=4), DecodeConfig(beam=4)) == (1, 4)
    lone: list[bool] = []
    prepare = variants.prepare

    def recording_prepare(*args, **kwargs):
        lone.append(kwargs.get("lone_graph"))
        return prepare(*args, **kwargs)

    monkeypatch.setattr(variants, "prepare", recording_prepare)

    def warm_up(continuous: bool) -> list[tuple[int, int, int, bool]]:
        """(sentences, beam, nbest, whether the lane was decoding already) of each group the warm-up added."""
        served = open_model(cfg, model["checkpoint"], model["tokens"])
        seen: list[tuple[int, int, int, bool]] = []
        real = served.engine.lane

        def recording(continuous: bool = False):
            lane = real(continuous)
            add = lane.add

            def record(key, sources, rules):
                seen.append((len(sources), rules.beam, rules.nbest, lane.busy()))
                add(key, sources, rules)

            lane.add = record
            return lane

        served.engine.lane = recording
        served.warm_up(DecodeRules.from_config(cfg), beams, continuous)
        return seen

    alone = [(1, 4, 2, False), (3, 4, 2, False), (1, 1, 1, False), (3, 1, 1, False), (1, 12, 2, False),
             (3, 12, 2, False)]
    assert warm_up(False) == alone
    # requests often come one sentence at a time: with decode.compile a lone sentence gets its own graph
    assert lone == [True]
    # Continuously: also three sentences joining one that is decoding (the joined rows' masks), at every beam.
    joined = [(1, 4, 2, False), (3, 4, 2, True), (1, 1, 1, False), (3, 1, 1, True), (1, 12, 2, False),
              (3, 12, 2, True)]
    got = warm_up(True)
    assert [g for i, g in enumerate(got) if i % 4 < 2] == alone
    assert [g for i, g in enumerate(got) if i % 4 >= 2] == joined


def test_a_server_with_worker_processes_holds_the_vocabulary_not_the_weights(model):
    """With serve.workers > 1 the server process rebuilds the model from worker 0's description: the same
    SentencePiece model and /info facts, and no lane (no weights) of its own."""
    from mtpipe.config import DecodeConfig
    from mtpipe.engine.opening import OpenModel, open_model

    served = open_model(DecodeConfig(threads=1), model["checkpoint"], model["tokens"])
    remote = OpenModel.described(served.description())
    text = PAIRS[6][0]
    assert remote.sp.encode(text) == served.sp.encode(text) and remote.max_positions == served.max_positions
    assert remote.info == served.info
    assert remote.detokenise([served.sp.encode(PAIRS[6][1])]) == [PAIRS[6][1]]
    with pytest.raises(Exception, match="holds no copy of the model"):
        remote.lane()


# --------------------------------------------------------------------------------------------------------------------
# Bounds: silent and slow clients, connections, work, fair turns, cancellation, drain
# --------------------------------------------------------------------------------------------------------------------

LONG = PAIRS[5][0]  # the longest sentence
HALF_BODY = (b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n"
             b'{"text":')


def raw(server: Server):
    """A plain socket connected to ``server`` (30 s timeout: every read below is bounded)."""
    import socket
    import urllib.parse

    url = urllib.parse.urlsplit(server.url)
    return socket.create_connection((url.hostname, url.port), timeout=30)


def read_all(sock) -> bytes:
    """What the server sends until it closes the connection (a reset counts as closed)."""
    data = b""
    for _ in range(1000):
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def error_of(response: bytes) -> str:
    """The ``error`` line of a raw HTTP response's JSON body."""
    return json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]


def post_raw(sock, body: dict) -> None:
    data = json.dumps(body).encode()
    sock.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))


def counters(server: Server) -> dict:
    return server.client.get("/info").json()["counters"]


def until(check, what: str, tries: int = 400, pause: float = 0.05):
    """``check()``'s first truthy value, tried at most ``tries`` times (errors count as not yet)."""
    for _ in range(tries):
        try:
            value = check()
        except (httpx.HTTPError, KeyError, ValueError):
            value = None
        if value:
            return value
        time.sleep(pause)
    raise AssertionError(f"never {what}")


def work_of(model: dict, text: str, beam: int) -> int:
    """serve.max_request_work's measure of one sentence: its tokens with EOS x the beam."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model["root"] / "spm.model"))
    return (len(sp.encode(text)) + 1) * beam


@pytest.fixture(scope="module")
def guarded(model):
    """A server with tight bounds: a request read within 1.5 s, 6 connections, a request taken a sentence at a time
    (chunk work 1), and a work budget that 48 long sentences at beam 8 fit and 64 do not."""
    budget = 48 * work_of(model, LONG, 8)
    s = Server(model, "--read-timeout-s", "1.5", "--max-connections", "6", "--chunk-work", "1", "--max-sentences",
               "64", "--max-request-work", str(budget), "--batch-wait-ms", "0")
    yield s
    s.stop()


def test_silent_and_half_sent_requests_are_closed_after_the_read_timeout(guarded):
    """serve.read_timeout_s (1.5 s): a connection that sends nothing is closed; one that sent part of its headers, or
    its headers and part of its body, gets a 408 line and is closed; the server serves on, and logs no traceback."""
    before = counters(guarded)
    socks = {"silent": raw(guarded), "headers": raw(guarded), "body": raw(guarded)}
    socks["headers"].sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Le")
    socks["body"].sendall(HALF_BODY)
    start = time.monotonic()
    try:
        got = {name: read_all(sock) for name, sock in socks.items()}
    finally:
        for sock in socks.values():
            sock.close()
    waited = time.monotonic() - start
    assert got["silent"] == b""
    for name in ("headers", "body"):
        assert got[name].startswith(b"HTTP/1.1 408"), got[name]
        assert "serve.read_timeout_s" in error_of(got[name])
    assert 1.0 < waited < 20, waited  # the timeout closed them: not at once, not never
    assert counters(guarded)["read_timeouts"] - before["read_timeouts"] >= 3
    ok = guarded.post({"text": ["the dog runs ."]})
    assert ok.status_code == 200 and ok.json()["translations"] == ["der hund rennt ."]
    log = "".join(guarded.log)
    assert log.count("request not received whole within 1.5 s") >= 2 and "Traceback" not in log


def test_connections_past_serve_max_connections_are_refused(guarded):
    """serve.max_connections (6): one more connection is answered 503 with one JSON line and closed at once; once
    connections close, the server takes new ones again."""
    until(lambda: counters(guarded)["open_connections"] == 1, "only this test's client connected")
    before = counters(guarded)["refused_connections"]
    socks = [raw(guarded) for _ in range(7)]  # this test's client holds one: the 6th or the 7th is one too many
    try:
        refused = read_all(socks[-1])
        assert refused.startswith(b"HTTP/1.1 503"), refused
        assert "serve.max_connections" in error_of(refused) and "\n" not in error_of(refused)
    finally:
        for sock in socks:
            sock.close()
    ok = until(lambda: guarded.post({"text": ["a cat sleeps ."]}).status_code == 200, "served again")
    assert ok and counters(guarded)["refused_connections"] > before


def test_a_client_leaving_mid_body_is_one_log_line(guarded):
    """A client that closes its connection halfway through its body: one line in the log, no ASGI traceback."""
    def lines() -> list[str]:
        return [line for line in guarded.log if "went away before sending the whole body" in line]

    seen = len(lines())
    sock = raw(guarded)
    sock.sendall(HALF_BODY)
    until(lambda: counters(guarded)["open_connections"] >= 2, "the connection accepted")
    sock.close()
    until(lambda: len(lines()) == seen + 1, "a line for the client that left")
    assert "(8 bytes of 5000)" in lines()[-1]
    log = "".join(guarded.log)
    assert "Traceback" not in log and "Exception in ASGI application" not in log


def test_json_nested_100000_deep_gets_400(guarded):
    r = guarded.post(b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert r.status_code == 400 and list(r.json()) == ["error"] and "nested too deeply" in r.json()["error"]
    assert "Traceback" not in "".join(guarded.log)


def test_work_over_serve_max_request_work_gets_413(guarded):
    """Work, not characters: 64 long sentences at beam 8 are over the budget (413 naming the key); the same sentences
    at beam 4, half the work, are decoded."""
    r = guarded.post({"text": [LONG] * 64, "beam": 8})
    assert r.status_code == 413 and list(r.json()) == ["error"], r.text
    assert "serve.max_request_work" in r.json()["error"] and "\n" not in r.json()["error"]
    ok = guarded.post({"text": [LONG] * 64, "beam": 4})
    assert ok.status_code == 200 and len(set(ok.json()["translations"])) == 1
    assert counters(guarded)["rejected_work"] >= 1


def check_turns_and_cancel(s: Server, model: dict) -> None:
    """A short request sent while a large one (48 long sentences at beam 8, taken a sentence at a time) decodes is
    answered before the large one ends, and both answers are `mtpipe decode`'s; a large request whose client leaves
    is cancelled: counted, its sentences no worker had started dropped, never answered, one log line."""
    want = decode(model, [LONG], "--beam", "8")[0]["hypothesis"]
    order: list[str] = []
    large: list = []

    def send_large() -> None:
        large.append(s.post({"text": [LONG] * 48, "beam": 8}))
        order.append("large")

    thread = threading.Thread(target=send_large)
    thread.start()
    try:
        s.wait_queued(1)  # the large request is in: it stays queued until its last chunk is taken
        short = s.post({"text": ["the dog runs ."], "beam": 1})
        order.append("short")
    finally:
        thread.join(120)
    assert short.status_code == 200 and short.json()["translations"] == ["der hund rennt ."]
    assert large and large[0].status_code == 200 and large[0].json()["translations"] == [want] * 48
    assert order == ["short", "large"]

    before = counters(s)
    said = sum("went away before its answer" in line for line in s.log)
    sock = raw(s)
    post_raw(sock, {"text": [LONG] * 48, "beam": 8})
    s.wait_queued(1)
    sock.close()
    after = until(lambda: (c := counters(s))["cancelled"] > before["cancelled"] and c, "the request cancelled")
    assert after["dropped_sentences"] > before["dropped_sentences"]
    assert after["requests"] == before["requests"]  # never answered
    until(lambda: counters(s)["queued"] == 0, "the queue emptied")
    assert s.post({"text": ["a cat sleeps ."]}).json()["translations"] == ["eine katze schläft ."]
    until(lambda: sum("went away before its answer" in line for line in s.log) == said + 1, "one line for it")
    assert "Traceback" not in "".join(s.log)


def test_a_short_request_overtakes_a_large_one_and_a_cancelled_one_is_dropped(guarded, model):
    check_turns_and_cancel(guarded, model)


@pytest.mark.parametrize("batching,workers", [("continuous", "1"), ("continuous", "2")])
def test_turns_and_cancelling_in_continuous_batching_and_worker_processes(model, batching, workers):
    s = Server(model, "--batching", batching, "--workers", workers, "--chunk-work", "1", "--max-sentences", "64",
               "--batch-wait-ms", "0")
    try:
        check_turns_and_cancel(s, model)
    finally:
        s.stop()


def test_sigterm_with_a_half_sent_body_exits_0_within_drain_s(model):
    """serve.drain_s (2 s; the read timeout is 60 s): a client that sent half its body holds a stopping server no
    longer than that, and the process exits 0. Also serve.max_output_tokens: 3 tokens, as `mtpipe decode` with a
    length limit of 3."""
    s = Server(model, "--drain-s", "2", "--read-timeout-s", "60", "--max-output-tokens", "3")
    sock = None
    try:
        text = PAIRS[4][0]
        want = decode(model, [text], "--max-len-a", "0", "--max-len-b", "3")[0]["hypothesis"]
        r = s.post({"text": [text]})
        assert r.status_code == 200 and r.json()["translations"] == [want]
        assert want != PAIRS[4][1] and 0 < len(want.split()) <= 3
        sock = raw(s)
        sock.sendall(HALF_BODY)
        until(lambda: counters(s)["open_connections"] >= 2, "the connection accepted")
        s.client.close()
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        code = s.proc.wait(60)
        took = time.monotonic() - start
        assert code == 0, "".join(s.log)
        assert took < 2 + 15, took  # the drain's 2 s and a generous margin: not the read timeout's 60 s
        assert read_all(sock) == b""  # dropped, no answer
        log = "".join(s.log)
        assert "drain (serve.drain_s = 2 s" in log and "Traceback" not in log, log
    finally:
        if sock is not None:
            sock.close()
        s.stop()


def test_a_large_request_takes_turns_with_a_short_one_chunk_by_chunk():
    """Batcher: a request is taken a chunk at a time (chunk_work: one sentence here), the least served first: a short
    request that arrives while a large one's first chunk decodes goes into the very next batch, and is answered
    before the large one, whose answer keeps its sentences' order."""
    import asyncio

    from mtpipe.engine.search import Hypothesis
    from mtpipe.engine.lanes import BatchLane
    from mtpipe.serve.batcher import Batcher, Job

    loop = asyncio.new_event_loop()
    first, release, batches = threading.Event(), threading.Event(), []

    def translate(sources, rules):
        batches.append([list(s) for s in sources])
        if len(batches) == 1:
            first.set()
            release.wait(10)
        return [[Hypothesis(list(s), 0.0, 0.0)] for s in sources]

    batcher = Batcher(lambda tokens: [" ".join(map(str, t)) for t in tokens], max_queue=8, wait_s=0.0,
                      batch_tokens=10_000, chunk_work=3)
    batcher.start(BatchLane(translate))
    done: list[str] = []

    def job(name: str, sources: list[list[int]]) -> Job:
        future = loop.create_future()
        future.add_done_callback(lambda f: done.append(name))
        return Job(sources, "rules", future, loop, time.monotonic())

    large = job("large", [[5, 6], [5, 7], [5, 8], [5, 9]])
    short = job("short", [[7]])
    try:
        batcher.submit(large)
        assert first.wait(10)
        batcher.submit(short)
        release.set()
        loop.run_until_complete(asyncio.wait_for(asyncio.gather(large.future, short.future), 10))
    finally:
        release.set()
        batcher.close()
        batcher.join(10)
        loop.close()
    assert batches == [[[5, 6]], [[7], [5, 7]], [[5, 8]], [[5, 9]]]
    assert done == ["short", "large"]
    assert [h[0][0] for h in large.future.result().hypotheses] == ["5 6", "5 7", "5 8", "5 9"]


def test_abandon_answers_every_request_left_and_stops_the_workers():
    """The drain's end (Batcher.abandon): the request decoding and the one queued are answered ServerStopping at
    once, and the worker stops after the batch in hand."""
    import asyncio

    from mtpipe.engine.search import Hypothesis
    from mtpipe.engine.lanes import BatchLane
    from mtpipe.serve.batcher import Batcher, Job, ServerStopping

    loop = asyncio.new_event_loop()
    started, release = threading.Event(), threading.Event()

    def translate(sources, rules):
        started.set()
        release.wait(10)
        return [[Hypothesis(list(s), 0.0, 0.0)] for s in sources]

    batcher = Batcher(lambda tokens: ["x"] * len(tokens), max_queue=8, wait_s=0.0, batch_tokens=10_000)
    batcher.start(BatchLane(translate))
    jobs = [Job([[5, 6]], "rules", loop.create_future(), loop, time.monotonic()) for _ in range(2)]
    try:
        batcher.submit(jobs[0])
        assert started.wait(10)
        batcher.submit(jobs[1])
        assert batcher.abandon() == 2
        loop.run_until_complete(asyncio.wait(
            [j.future for j in jobs], timeout=10))
        for j in jobs:
            assert isinstance(j.future.exception(), ServerStopping)
        release.set()
        batcher.join(10)
        assert batcher._done.is_set() and batcher.snapshot()["queued"] == 0
    finally:
        release.set()
        batcher.close()
        loop.close()


def test_bound_settings_are_checked_with_one_line(model):
    """The bounds are serve settings, checked like the others; serve.max_connections must fit the open-file limit."""
    from mtpipe.config import ServeConfig
    from mtpipe.errors import MtpipeError
    from mtpipe.serve.app import check_open_files

    base = ["serve", "--params", str(model["params"]), "--port", "0", "--checkpoint", str(model["checkpoint"]),
            "--tokens", str(model["tokens"])]
    for flag, value, key in (("--read-timeout-s", "0", "read_timeout_s"), ("--max-connections", "0", "max_connections"),
                             ("--drain-s", "-1", "drain_s"), ("--max-request-work", "0", "max_request_work"),
                             ("--chunk-work", "0", "chunk_work"), ("--max-output-tokens", "0", "max_output_tokens")):
        r = CliRunner().invoke(app, [*base, flag, value])
        assert r.exit_code == 1 and f"serve.{key}" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    with pytest.raises(MtpipeError, match=r"serve.max_connections = 1000000000 needs .* open files"):
        check_open_files(ServeConfig(max_connections=10**9))
    check_open_files(ServeConfig(max_connections=8))  # fits
