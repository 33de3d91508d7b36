"""Faults of a multi-process, multi-node `mtpipe train` (gloo on CPU, "nodes" that are launchers on this machine
meeting through a localhost rendezvous): a dead or frozen node, a killed rank, a resume on another world size.

The scenarios are functions of their sizes: ``tests/test_faults.py`` runs the cheap ones (2 nodes x 1 process,
2 -> 1 processes); ``bench/faults.py`` runs them at world size 8, across 2 nodes x 2 processes and 8 -> 4, and
writes their outcomes to a results file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpipe import artifacts
from testkit.runs import (
    RESUME_TRAIN,
    TINY,
    assert_same_run,
    descendants,
    kill_tree,
    run_env,
    tsv,
    wait_for,
    write_params,
)

# ---------------------------------------------------------------------------------------------------------------------
# Launching "nodes" on this machine
# ---------------------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def train_command(params: Path, data: tuple[Path, Path], out: Path, *extra: str) -> list[str]:
    """``python -m mtpipe train`` (the launcher: ``train.nproc`` processes per node from the params file)."""
    return [sys.executable, "-m", "mtpipe", "train", "--params", str(params), "--tokens", str(data[0]),
            "--batches", str(data[1]), "--out", str(out), *extra]


@dataclass
class Node:
    """One launcher (one "node") and where its console went."""

    index: int
    proc: subprocess.Popen
    stdout: Path
    stderr: Path
    started: float = field(default_factory=time.monotonic)

    def errors(self) -> list[str]:
        return [ln for ln in self.stderr.read_text().splitlines() if ln.startswith("error:")]

    def workers(self) -> dict[int, int]:
        """Global rank -> pid of this launcher's torchrun workers."""
        out = {}
        for pid in descendants(self.proc.pid):
            try:
                env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                           if b"=" in kv)
            except OSError:
                continue
            if b"LOCAL_RANK" in env and b"RANK" in env:
                out[int(env[b"RANK"])] = pid
        return out


def start_nodes(cmd: list[str], nnodes: int, port: int, where: Path, tag: str, host_first: bool = False) -> list[Node]:
    """``nnodes`` launchers of ``cmd`` meeting at the rendezvous ``127.0.0.1:port`` (``MTPIPE_*`` variables, as the
    README's torchrun example sets them on each node). ``host_first``: the others start once the first one's
    torchrun listens on the port (then it hosts the rendezvous; else whoever binds it first does)."""
    nodes = []
    for n in range(nnodes):
        if n == 1 and host_first:
            t0 = time.monotonic()
            while not listening(port):
                assert nodes[0].proc.poll() is None and time.monotonic() - t0 < 120, nodes[0].stderr.read_text()
                time.sleep(0.05)
        env = {**run_env(), "MTPIPE_NNODES": str(nnodes), "MTPIPE_NODE_RANK": str(n),
               "MTPIPE_RDZV_ENDPOINT": f"127.0.0.1:{port}", "MTPIPE_RDZV_ID": f"{tag}-{port}"}
        out, err = where / f"{tag}-node{n}.out", where / f"{tag}-node{n}.err"
        with open(out, "w") as o, open(err, "w") as e:
            proc = subprocess.Popen(cmd, stdout=o, stderr=e, env=env, cwd=where)
        nodes.append(Node(n, proc, out, err))
    return nodes


def host_rendezvous(port: int) -> Any:
    """The rendezvous' store, hosted by this process: no launcher hosts it then, so freezing one freezes only its
    ranks (and, for the node that runs rank 0, the workers' store its torchrun hosts)."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False,
                         timeout=timedelta(seconds=60))


def wait_workers(nodes: list[Node], world: int, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while sum(len(n.workers()) for n in nodes) < world:
        for n in nodes:
            assert n.proc.poll() is None, f"node {n.index} exited ({n.proc.returncode}):\n{n.stderr.read_text()}"
        assert time.monotonic() - t0 < timeout, "the workers did not start"
        time.sleep(0.05)


def signal_tree(node: Node, sig: int) -> list[int]:
    """Send ``sig`` to a launcher and every process under it (torchrun's workers live in their own sessions)."""
    pids = descendants(node.proc.pid)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def wait_exit(nodes: list[Node], timeout: float) -> dict[int, float]:
    """Node index -> seconds until its launcher exited (counted from now); raises when one outlives ``timeout``."""
    t0, done = time.monotonic(), {}
    while len(done) < len(nodes):
        for n in nodes:
            if n.index not in done and n.proc.poll() is not None:
                done[n.index] = time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            late = [n.index for n in nodes if n.index not in done]
            raise AssertionError(f"node(s) {late} still running after {timeout:.0f} s")
        time.sleep(0.02)
    return done


NOISE = ("Traceback", "ChildFailedError", "[rank", "FAILED", "Root Cause", "[W", "[E", "socket.cpp", "TCPStore")


def noise(stderr: str) -> list[str]:
    """What the console should not show besides training's own lines and the one error line."""
    return [m for m in NOISE if m in stderr]


def end_all(nodes: list[Node], out: Path) -> None:
    for n in nodes:
        kill_tree(n.proc, out)


def run_nodes(cmd: list[str], nnodes: int, where: Path, tag: str, timeout: float = 300) -> list[Node]:
    """Run ``cmd`` on ``nnodes`` nodes to the end; every launcher must succeed."""
    nodes = start_nodes(cmd, nnodes, free_port(), where, tag)
    try:
        wait_exit(nodes, timeout)
    finally:
        end_all(nodes, where / "none")
    for n in nodes:
        assert n.proc.returncode == 0, f"node {n.index}: {n.proc.returncode}\n{n.stderr.read_text()[-3000:]}"
    return nodes


def params_for(where: Path, nproc: int, **train: Any) -> Path:
    return write_params(where / f"params-{nproc}-{abs(hash(tuple(sorted(train.items())))) % 10**6}.yaml",
                        {**TINY, "dropout": 0.0}, {**RESUME_TRAIN, "nproc": nproc, **train})


# ---------------------------------------------------------------------------------------------------------------------
# The scenarios (sizes as parameters: the suite's and the benchmark's)
# ---------------------------------------------------------------------------------------------------------------------

# One run's settings for the scenarios: dropout 0 and tokens_per_update = two of the tiny artifacts' 48-token
# batches, so that a resume on fewer processes than 2 accumulates to keep the global batch, and one on more than 2
# (bench/faults.py's 8 -> 4) shares the batches' sentences.
FAULT_TRAIN = dict(tokens_per_update=96, max_steps=12, save_every_steps=3, valid_every_steps=4, dist_timeout=20)


def reference_run(data: tuple[Path, Path], where: Path, world: int) -> Path:
    """An uninterrupted run of ``world`` processes on one node (``FAULT_TRAIN``); returns its run directory."""
    out = where / f"ref-ws{world}"
    params = params_for(where, world, **FAULT_TRAIN)
    r = subprocess.run(train_command(params, data, out), capture_output=True, text=True, env=run_env(), cwd=where)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def dead_node(data: tuple[Path, Path], where: Path, nnodes: int, nproc: int, timeout: float, victim: str,
              *, host_store: bool) -> dict[str, Any]:
    """``nnodes`` x ``nproc`` processes; once the first checkpoint is on disk, a whole node freezes (SIGSTOP of
    its launcher and workers: a node that lost power or its network answers nothing, as a frozen one; a killed
    process's connections close at once, the easy case). ``victim``: "tail" (the last node, not rank 0's), "head"
    (rank 0's node, whose torchrun hosts the workers' store) or "rendezvous" (the first node, whose torchrun hosts
    the rendezvous: the others' torchrun agents block on it for good). ``host_store``: this process hosts the
    rendezvous (else the first launcher does). Returns the survivors' exit statuses, their lines and how long
    after the freeze each exited."""
    params = params_for(where, nproc, **{**FAULT_TRAIN, "max_steps": 100_000, "dist_timeout": timeout})
    out = where / f"dead-{victim}"
    port = free_port()
    store = host_rendezvous(port) if host_store else None
    nodes = start_nodes(train_command(params, data, out), nnodes, port, where, f"dead-{victim}",
                        host_first=not host_store)
    try:
        wait_workers(nodes, nnodes * nproc)
        wait_for(out / "checkpoints" / "step_00000003", nodes[0].proc, nodes[0].stderr)
        by_rank = {r: n for n in nodes for r in n.workers()}
        head = by_rank[0]
        frozen = {"head": head, "rendezvous": nodes[0]}.get(victim) or next(n for n in reversed(nodes)
                                                                          if n is not head)
        frozen_ranks = sorted(frozen.workers())
        signal_tree(frozen, signal.SIGSTOP)
        survivors = [n for n in nodes if n is not frozen]
        seconds = wait_exit(survivors, timeout + 120)
    finally:
        end_all(nodes, out)
        del store
    return {"frozen_node": frozen.index, "frozen_ranks": frozen_ranks, "head": head.index,
            "frozen_hosts_a_store": frozen is head or (not host_store and frozen is nodes[0]),
            "survivors": {n.index: {"exit_status": n.proc.returncode, "errors": n.errors(),
                                    "seconds_after_freeze": round(seconds[n.index], 1),
                                    "noise": noise(n.stderr.read_text()), "runs_rank0": n is head}
                          for n in survivors},
            "out": str(out)}


def kill_and_resume(data: tuple[Path, Path], where: Path, ref: Path, nnodes: int, nproc: int,
                    host_store: bool = False) -> dict[str, Any]:
    """``nnodes`` x ``nproc`` processes; after the checkpoint of step 3, the last rank is SIGKILLed: every launcher
    ends in one line; the same commands run again resume from the last checkpoint, and the run equals the
    uninterrupted one of the same world size on one node (``ref``), bitwise. ``host_store``: this process hosts the
    rendezvous (else a launcher does, and when it is the victim's, the others lose it with the victim's group).
    Returns the lines and timings."""
    world = nnodes * nproc
    params = params_for(where, nproc, **FAULT_TRAIN)
    out = where / f"killed-{nnodes}x{nproc}"
    cmd = train_command(params, data, out)
    port = free_port()
    store = host_rendezvous(port) if host_store and nnodes > 1 else None
    nodes = start_nodes(cmd, nnodes, port, where, f"kill-{nnodes}x{nproc}")
    try:
        wait_workers(nodes, world)
        wait_for(out / "checkpoints" / "step_00000003", nodes[0].proc, nodes[0].stderr)
        head = next(n for n in nodes if 0 in n.workers())
        victim = next(n for n in nodes if world - 1 in n.workers())
        os.kill(victim.workers()[world - 1], signal.SIGKILL)
        seconds = wait_exit(nodes, 180)
    finally:
        end_all(nodes, out)
        del store
    step, last = artifacts.list_checkpoints(out)[-1]
    first = {n.index: {"exit_status": n.proc.returncode, "errors": n.errors(), "seconds": round(seconds[n.index], 1),
                       "noise": noise(n.stderr.read_text()), "runs_rank0": n is head} for n in nodes}
    t0 = time.monotonic()
    if nnodes == 1:
        r = subprocess.run(cmd, capture_output=True, text=True, env=run_env(), cwd=where)
        assert r.returncode == 0, r.stderr[-3000:]
        resumed = r.stderr + r.stdout
    else:
        again = run_nodes(cmd, nnodes, where, f"rerun-{nnodes}x{nproc}")
        resumed = "".join(n.stderr.read_text() + n.stdout.read_text() for n in again)
    rerun_seconds = time.monotonic() - t0
    assert_same_run(ref, out, FAULT_TRAIN["max_steps"])
    return {"victim_rank": world - 1, "victim_node": victim.index, "last_checkpoint_step": step,
            "first_run": first, "resumed_from_last": f"resuming from {last}" in resumed,
            "rerun_seconds": round(rerun_seconds, 1), "bitwise_equal_to_uninterrupted": True, "out": str(out)}


def resume_elsewhere(data: tuple[Path, Path], where: Path, ref: Path, world_from: int, world_to: int,
                     at: int = 6) -> dict[str, Any]:
    """The uninterrupted run of ``world_from`` processes (``ref``) cut back to its checkpoint of step ``at`` (as a
    kill there leaves it), then resumed on ``world_to`` processes: one warning line; the same global batch (every
    update takes the same batches of the epoch's order, by more accumulation), so the tokens seen, the epoch
    position and (dropout 0) the loss curve end where the uninterrupted run's do."""
    out = where / f"resumed-{world_from}-to-{world_to}"
    shutil.copytree(ref, out)
    for step, path in artifacts.list_checkpoints(out):
        if step > at:
            shutil.rmtree(path)
    params = params_for(where, world_to, **FAULT_TRAIN)
    r = subprocess.run(train_command(params, data, out), capture_output=True, text=True, env=run_env(), cwd=where)
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:") and "spm_sha256" not in ln]
    a, b = (json.loads((d / "train.json").read_text()) for d in (ref, out))
    ref_loss, new_loss = tsv(ref, "train/loss"), tsv(out, "train/loss")
    worst = max(abs(float(x) - float(y)) / abs(float(x)) for (_, x), (_, y) in zip(ref_loss, new_loss))
    return {"warnings": warnings, "updates_this_run": b["updates_this_run"],
            "processes": [a["processes"], b["processes"]], "accumulation": [a["accumulation"], b["accumulation"]],
            "batches_per_update": [a["batches_per_update"], b["batches_per_update"]],
            "target_tokens": [a["target_tokens"], b["target_tokens"]], "epochs": [a["epochs"], b["epochs"]],
            "logged_steps": [s for s, _ in new_loss], "max_relative_loss_difference": worst, "out": str(out)}


def check_resume_elsewhere(r: dict[str, Any], world_from: int, world_to: int, at: int = 6) -> None:
    per_update, (accum_from, accum_to) = r["batches_per_update"][0], r["accumulation"]
    assert r["processes"] == [world_from, world_to] and r["batches_per_update"] == [per_update, per_update]
    assert per_update % world_to or accum_to * world_to == per_update  # whole batches where they divide evenly
    assert len(r["warnings"]) == 1, r["warnings"]
    assert re.fullmatch(rf"warning: resuming step_{at:08d} on {world_to} process\(es\) x {accum_to} "
                        rf"accumulation \(it was written by {world_from} x {accum_from}\): the same "
                        rf"global batch \({per_update} batches per update, train.tokens_per_update\), from batch "
                        r"[\d,]+ of epoch \d+; each rank's dropout stream starts afresh, so the run is not bitwise "
                        r"the uninterrupted one", r["warnings"][0]), r["warnings"][0]
    # Nothing skipped, nothing repeated: the same tokens and epoch position as the uninterrupted run, each step
    # logged once; dropout 0, so the same updates up to the summation order.
    assert r["updates_this_run"] == FAULT_TRAIN["max_steps"] - at
    assert r["target_tokens"][0] == r["target_tokens"][1] and r["epochs"][0] == r["epochs"][1]
    assert r["logged_steps"] == list(range(1, FAULT_TRAIN["max_steps"] + 1))
    assert r["max_relative_loss_difference"] < 1e-4


def check_dead_node(r: dict[str, Any], timeout: float, margin: float) -> None:
    """Every survivor ends with status 1 and one line, no traceback, within ``timeout + margin`` of the freeze; the
    line names the frozen ranks and their node, or (rank 0's node frozen) the store its torchrun hosted; a survivor
    that runs rank 0 reports into the run directory, the others into a temporary file."""
    ranks = r["frozen_ranks"]
    who = (f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))) + r" on node \d \([^)]+\)"
    store = r"torchrun's store at [^ ]+ stopped answering for \d+ s"
    for survivor in r["survivors"].values():
        assert survivor["exit_status"] == 1, survivor
        assert len(survivor["errors"]) == 1, survivor
        line = survivor["errors"][0]
        expect = rf"error: training failed: ({who} stopped answering for \d+ s|{store}) \(train.dist_timeout = "
        expect += rf"{timeout:g} s\): .*; last checkpoint: .*step_\d+ \(step \d+\); to resume, run: .* -m mtpipe train "
        expect += r".*; torchrun's report and the tracebacks: (?P<report>.*)"
        m = re.fullmatch(expect, line)
        assert m, line
        assert r["frozen_node"] == r["head"] or re.match(rf"error: training failed: {who}", line), line
        report = Path(m["report"])
        assert report.is_file() and report.is_relative_to(r["out"]) == survivor["runs_rank0"], (report, survivor)
        # c10d's own C++ warnings about a store's silent socket are printed by torch itself (a frozen store)
        allowed = {"[W", "socket.cpp", "TCPStore"} if r["frozen_hosts_a_store"] else set()
        assert set(survivor["noise"]) <= allowed, survivor
        assert survivor["seconds_after_freeze"] <= timeout + margin, survivor


def check_kill(r: dict[str, Any]) -> None:
    """Each launcher ends in one line: the victim's node names its killed rank, the others the peer that is gone;
    only rank 0's node writes torchrun's report into the run directory. Then the rerun resumed."""
    victim_rank, out = r["victim_rank"], Path(r["out"])
    for i, n in r["first_run"].items():
        assert n["exit_status"] == 1 and len(n["errors"]) == 1, n
        line = n["errors"][0]
        if i == r["victim_node"]:
            assert line.startswith(f"error: training failed: rank {victim_rank} was killed by signal SIGKILL (9); "
                                   "last checkpoint:"), line
        else:
            ranks = rf"(rank {victim_rank}|ranks [\d, ]*\b{victim_rank}\b[\d, ]*)"
            # (or, when the victim's node hosted the rendezvous, the rendezvous its torchrun took with it)
            assert re.match(rf"error: training failed: ({ranks} on node \d \([^)]+\) (is gone \(its connection "
                            r"closed\)|are gone \(their connections closed\)|stopped answering for)|lost torchrun's "
                            r"rendezvous at .*: the node that hosts it ended)", line), line
        report = Path(re.split(r"; torchrun's (?:report and the tracebacks|log): ", line)[-1])
        assert report.is_file() and report.is_relative_to(out) == n["runs_rank0"], (report, n)
        # c10d's C++ warnings about a store connection that closed are printed by torch itself
        assert set(n["noise"]) <= ({"[W", "TCPStore", "socket.cpp"} if "rendezvous" in line else set()), n
    assert r["resumed_from_last"]
