"""`mtpipe serve` as operators run it, behind a load balancer or in Kubernetes: the real server (a subprocess on a
free loopback port, tests/test_serve.py's) with the tiny model that memorised a few sentences.

/health/live answers from the start and /health/ready only once the model is warm, and again once a killed decoding
process is restarted (its death and restart one log line each); SIGTERM makes ready 503 while requests are still
served for serve.drain_grace_s; /metrics' counters move by exactly the requests sent; a request past
serve.request_timeout_s gets 504 and its decoding is cancelled; serve.access_log writes one line per request and no
text; the HTTP parser's errors are one line of JSON; an output cut at serve.max_output_tokens is flagged; a sentence
without a letter or a digit is an empty translation in both `mtpipe serve` and `mtpipe decode`."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pytest
from test_serve import (  # noqa: F401 - model: the module's tiny model (a fixture)
    PAIRS,
    Server,
    _cmdline,
    _parent_pid,
    counters,
    decode,
    error_of,
    model,
    raw,
    read_all,
    until,
)

MAX_OUTPUT = 3  # the ops server's serve.max_output_tokens: most translations are cut
CAP = ("--max-len-a", "0", "--max-len-b", str(MAX_OUTPUT))  # `mtpipe decode` with the same limit
SHORT = [PAIRS[0][0], PAIRS[1][0], PAIRS[8][0]]


@pytest.fixture(scope="module")
def ops(model):
    """A server with the access log on and outputs cut at MAX_OUTPUT tokens."""
    s = Server(model, "--access-log", "--batch-wait-ms", "0", "--max-output-tokens", str(MAX_OUTPUT))
    yield s
    s.stop()


def scrape(s: Server) -> dict[str, float]:
    """``/metrics`` as ``{'name{labels}': value}``, through prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    r = s.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    values = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def test_live_ready_and_the_health_alias(ops, model):
    from mtpipe import artifacts

    for path in ("/health", "/health/live"):
        r = ops.client.get(path)
        assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["queued"] == 0
    ready = ops.client.get("/health/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert ready.json()["model"] == artifacts.manifest_hash(model["checkpoint"])
    assert scrape(ops)["mtpipe_ready"] == 1


def test_metrics_move_by_exactly_the_requests_sent(ops, model):
    """Three requests answered and two refused: the counters by status, the latency histogram, the queue wait (the
    three decoded), the source tokens and the best translations' tokens (`mtpipe decode`'s) move by exactly that."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model["root"] / "spm.model"))
    want = decode(model, SHORT, *CAP)
    before = scrape(ops)
    for src, row in zip(SHORT, want):
        r = ops.post({"text": [src]})
        assert r.status_code == 200 and r.json()["translations"] == [row["hypothesis"]], r.text
    assert ops.post({"text": []}).status_code == 422
    assert ops.post(b'{"text": [').status_code == 400
    got = moved(before, scrape(ops))
    assert got['mtpipe_requests_total{status="200"}'] == 3
    assert got['mtpipe_requests_total{status="422"}'] == 1 and got['mtpipe_requests_total{status="400"}'] == 1
    assert got["mtpipe_request_seconds_count"] == 5 and got["mtpipe_queue_wait_seconds_count"] == 3
    assert got["mtpipe_source_tokens_total"] == sum(len(sp.encode(src)) for src in SHORT)
    assert got["mtpipe_target_tokens_total"] == sum(len(row["tokens"]) for row in want)
    assert got["mtpipe_batch_sentences_count"] >= 3 and got["mtpipe_batch_sentences_sum"] >= 3
    assert not any(k.startswith(("mtpipe_cancelled", "mtpipe_failed", "mtpipe_timed_out")) for k in got), got
    assert scrape(ops)["mtpipe_queue_depth"] == 0


def test_an_output_cut_at_serve_max_output_tokens_is_flagged(ops, model):
    """``output_cut``: the sentences whose best translation stopped at serve.max_output_tokens (`mtpipe decode`'s
    translations with the same length limit, those of MAX_OUTPUT tokens); ``truncated`` counts sources cut at the
    model's positions (none here). A sentence with nothing to translate is never cut."""
    text = [PAIRS[4][0], "...", SHORT[0]]
    want = decode(model, text, *CAP)
    r = ops.post({"text": text})
    assert r.status_code == 200, r.text
    assert r.json()["translations"] == [row["hypothesis"] for row in want]
    cut = [i for i, row in enumerate(want) if len(row["tokens"]) == MAX_OUTPUT]
    assert r.json()["output_cut"] == cut and 0 in cut and 1 not in cut and r.json()["truncated"] == 0


def test_the_access_log_has_one_line_per_request_and_no_text(ops):
    secret = "the woman finds the ball near the garden ."
    seen = len(ops.log)
    assert ops.post({"text": [secret, SHORT[1], SHORT[2], SHORT[0]]}).status_code == 200
    assert ops.client.get("/health/ready").status_code == 200
    assert ops.client.get("/nowhere/access-log").status_code == 404
    until(lambda: any('"GET /nowhere/access-log" 404 ' in line for line in ops.log[seen:]), "the last access line")
    lines = ops.log[seen:]  # (a line for the previous test's last request may come after `seen`)
    posted = [line for line in lines if '"POST /translate" 200 ' in line and line.rstrip().endswith("ms 4 sentences")]
    assert len(posted) == 1 and posted[0].split()[1].startswith("127.0.0.1:"), lines
    assert any('"GET /health/ready" 200 ' in line for line in lines)
    assert sum('"GET /nowhere/access-log" 404 ' in line for line in lines) == 1
    assert "woman" not in "".join(ops.log) and "ball" not in "".join(ops.log)


@pytest.mark.parametrize("request_bytes", [
    b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: -1\r\n\r\n{}",
    b"NOT AN HTTP REQUEST\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
], ids=["negative content-length", "garbage request line", "header without colon"])
def test_the_http_parser_s_errors_are_one_line_of_json(ops, request_bytes):
    with raw(ops) as sock:
        sock.sendall(request_bytes)
        reply = read_all(sock)
    head = reply.split(b"\r\n\r\n", 1)[0].lower()
    assert reply.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head, reply
    reason = error_of(reply)
    assert reason.startswith("invalid HTTP request") and "\n" not in reason
    assert list(json.loads(reply.split(b"\r\n\r\n", 1)[1])) == ["error"]
    assert ops.client.get("/health/ready").status_code == 200  # serving on
    assert "Traceback" not in "".join(ops.log)


def test_a_sentence_without_letters_or_digits_is_an_empty_translation_in_serve_and_decode(ops, model):
    """NUL, zero-width and direction marks, an emoji, punctuation: nothing to translate (SentencePiece gives <unk>,
    from which the model would invent a sentence), so each is translated as a blank line is, empty with score 0, by
    `mtpipe decode` and by the server alike; the sentences beside them are translated as usual."""
    odd = ["\x00", "\u200b\u200f\u200e", "\U0001F600", "...", "\u202e!?"]
    text = [SHORT[0], *odd, SHORT[1]]
    want = decode(model, text, *CAP)
    assert [row["hypothesis"] for row in want][1:-1] == [""] * len(odd)
    assert want[0]["hypothesis"] and want[-1]["hypothesis"]
    assert [row["score"] for row in want][1:-1] == [0.0] * len(odd)
    r = ops.post({"text": text})
    assert r.status_code == 200, r.text
    assert r.json()["translations"] == [row["hypothesis"] for row in want]
    assert r.json()["scores"][1:-1] == [0.0] * len(odd)


# --------------------------------------------------------------------------------------------------------------------
# Servers of their own: the deadline, the warm-up and a killed worker, SIGTERM's grace
# --------------------------------------------------------------------------------------------------------------------


def test_a_request_past_serve_request_timeout_s_gets_504_and_its_decoding_is_cancelled(model):
    """serve.request_timeout_s (1 s) passes while a small request still waits for company (serve.batch_wait_ms, 3 s):
    504 with one line of JSON, the request cancelled (its sentences dropped, never decoded nor counted), one log
    line. A request that fills serve.batch_tokens (40) at once is decoded as usual meanwhile."""
    s = Server(model, "--batch-wait-ms", "3000", "--request-timeout-s", "1", "--batch-tokens", "40")
    try:
        before, metrics = counters(s), scrape(s)
        r = s.post({"text": SHORT})
        assert r.status_code == 504 and list(r.json()) == ["error"], r.text
        assert "serve.request_timeout_s" in r.json()["error"] and "\n" not in r.json()["error"]
        after = counters(s)
        assert after["timed_out"] == before["timed_out"] + 1 and after["cancelled"] == before["cancelled"] + 1
        assert after["dropped_sentences"] - before["dropped_sentences"] == len(SHORT) and after["queued"] == 0
        got = moved(metrics, scrape(s))
        assert got['mtpipe_requests_total{status="504"}'] == 1 and got["mtpipe_cancelled_requests_total"] == 1
        assert got["mtpipe_timed_out_requests_total"] == 1 and got["mtpipe_dropped_sentences_total"] == len(SHORT)
        assert sum("not answered within 1 s (serve.request_timeout_s): 504, cancelled, 3 of its 3 sentences not "
                   "decoded" in line for line in s.log) == 1
        ok = s.post({"text": [PAIRS[0][0]] * 8})  # 8 x (4 pieces + EOS) >= 40 tokens: not waiting
        assert ok.status_code == 200 and ok.json()["translations"] == [PAIRS[0][1]] * 8, ok.text
        assert counters(s)["sentences"] == before["sentences"] + 8  # the cancelled ones were never decoded
    finally:
        s.stop()


def test_ready_waits_for_the_warm_up_and_for_a_killed_worker_s_restart(model):
    """``--workers 2``: the port serves at once, /health/live 200 and /health/ready 503 (and /translate 503) while
    the processes load and warm up; then 200. A worker killed while idle makes ready 503 until it is restarted (one
    log line for its death with its exit code, one for its restart), then 200 again and answers as before."""
    s = Server(model, "--workers", "2", "--batch-wait-ms", "0", ready=False)
    try:
        ready = s.client.get("/health/ready")
        assert ready.status_code == 503 and "loading the model" in ready.json()["error"], ready.text
        assert int(ready.headers["Retry-After"]) >= 1
        assert s.client.get("/health/live").status_code == 200
        early = s.post({"text": [SHORT[0]]})
        assert early.status_code in (200, 503) and (early.status_code == 200 or "not ready" in early.json()["error"])
        until(lambda: s.client.get("/health/ready").status_code == 200, "ready after the warm-up", tries=1200)
        until(lambda: any("listening on " in line for line in s.log), "the line scripts wait for")

        children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and
                    _parent_pid(p) == s.proc.pid and b"resource_tracker" not in _cmdline(p)]
        assert len(children) == 2, children
        import os

        os.kill(children[0], signal.SIGKILL)
        down = until(lambda: (r := s.client.get("/health/ready")).status_code == 503 and r, "not ready")
        assert "decoding worker process" in down.json()["error"] and "down" in down.json()["error"]
        until(lambda: s.client.get("/health/ready").status_code == 200, "ready after the restart", tries=1200)
        deaths = [line for line in s.log if "exited (code -9)" in line]
        restarts = [line for line in s.log if "restarted (pid" in line]
        assert len(deaths) == 1 and len(restarts) == 1, "".join(s.log)
        assert f"(pid {children[0]})" in deaths[0]
        assert scrape(s)["mtpipe_worker_restarts_total"] == 1
        for _ in range(4):  # both workers answer
            r = s.post({"text": [PAIRS[1][0]]})
            assert r.status_code == 200 and r.json()["translations"] == [PAIRS[1][1]]
    finally:
        s.stop()


def test_sigterm_turns_ready_503_while_requests_are_still_served(model):
    """serve.drain_grace_s (3 s): after SIGTERM /health/ready answers 503 at once, the request in flight is
    answered, and a request sent during the grace is accepted and answered too; then the drain, and exit 0."""
    s = Server(model, "--batch-wait-ms", "1000", "--drain-grace-s", "3")
    try:
        answers: list = []
        in_flight = threading.Thread(target=lambda: answers.append(s.post({"text": [PAIRS[0][0]]})))
        in_flight.start()
        s.wait_queued(1)
        s.proc.send_signal(signal.SIGTERM)
        down = until(lambda: (r := s.client.get("/health/ready")).status_code == 503 and r, "not ready")
        assert "stopping (SIGTERM)" in down.json()["error"]
        late = s.post({"text": [PAIRS[1][0]]})  # after SIGTERM, within the grace
        assert late.status_code == 200 and late.json()["translations"] == [PAIRS[1][1]]
        in_flight.join(30)
        assert answers and answers[0].status_code == 200 and answers[0].json()["translations"] == [PAIRS[0][1]]
        assert s.proc.wait(30) == 0, "".join(s.log)
        assert any("requests are still served for 3 s (serve.drain_grace_s)" in line for line in s.log)
    finally:
        s.stop()
