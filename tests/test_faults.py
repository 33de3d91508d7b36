"""Faults of a multi-process, multi-node `mtpipe train` (gloo on CPU, "nodes" that are launchers on this machine
meeting through a localhost rendezvous): a dead or frozen node, a killed rank, a resume on another world size.

The scenarios are functions of their sizes: the suite runs the cheap ones (2 nodes x 1 process, 2 -> 1 processes);
``bench/faults.py`` runs the same functions at world size 8, across 2 nodes x 2 processes and 8 -> 4, and writes
their outcomes to a results file.
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

import pytest
from test_train import (
    REPO,
    RESUME_TRAIN,
    TINY,
    _assert_same_run,
    _descendants,
    _env,
    _kill_tree,
    _wait_for,
    make_artifacts,
    needs_proc,
    tsv,
    write_params,
)

from mtpipe import artifacts

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
        for pid in _descendants(self.proc.pid):
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
        env = {**_env(), "MTPIPE_NNODES": str(nnodes), "MTPIPE_NODE_RANK": str(n),
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
    pids = _descendants(node.proc.pid)
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
        _kill_tree(n.proc, out)


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

# One run's settings for the scenarios: dropout 0 and tokens_per_update = one batch of the tiny artifacts' 48-token
# batches, so that a resume on fewer processes must accumulate to keep the global batch (train.tokens_per_update
# alone would give 1 batch per process).
FAULT_TRAIN = dict(tokens_per_update=48, max_steps=12, save_every_steps=3, valid_every_steps=4, dist_timeout=20)


def reference_run(data: tuple[Path, Path], where: Path, world: int) -> Path:
    """An uninterrupted run of ``world`` processes on one node (``FAULT_TRAIN``); returns its run directory."""
    out = where / f"ref-ws{world}"
    params = params_for(where, world, **FAULT_TRAIN)
    r = subprocess.run(train_command(params, data, out), capture_output=True, text=True, env=_env(), cwd=where)
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
        _wait_for(out / "checkpoints" / "step_00000003", nodes[0].proc, nodes[0].stderr)
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
        _wait_for(out / "checkpoints" / "step_00000003", nodes[0].proc, nodes[0].stderr)
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
        r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=where)
        assert r.returncode == 0, r.stderr[-3000:]
        resumed = r.stderr + r.stdout
    else:
        again = run_nodes(cmd, nnodes, where, f"rerun-{nnodes}x{nproc}")
        resumed = "".join(n.stderr.read_text() + n.stdout.read_text() for n in again)
    rerun_seconds = time.monotonic() - t0
    _assert_same_run(ref, out, FAULT_TRAIN["max_steps"])
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
    r = subprocess.run(train_command(params, data, out), capture_output=True, text=True, env=_env(), cwd=where)
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
    per_update = r["batches_per_update"][0]
    assert r["processes"] == [world_from, world_to] and r["batches_per_update"] == [per_update, per_update]
    assert r["accumulation"][1] * world_to == per_update
    assert len(r["warnings"]) == 1, r["warnings"]
    assert re.fullmatch(rf"warning: resuming step_{at:08d} on {world_to} process\(es\) x {per_update // world_to} "
                        rf"accumulation \(it was written by {world_from} x {per_update // world_from}\): the same "
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


# ---------------------------------------------------------------------------------------------------------------------
# The suite's sizes
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fdata(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_artifacts(tmp_path_factory.mktemp("fault-data"))


@pytest.fixture(scope="module")
def ws2_fault_ref(fdata: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return reference_run(fdata, tmp_path_factory.mktemp("fault-ref"), 2)


@pytest.mark.slow
@needs_proc
def test_a_frozen_node_ends_the_others_in_one_line_within_dist_timeout(fdata: tuple[Path, Path],
                                                                       tmp_path: Path) -> None:
    """2 nodes x 1 process; node 1 freezes (SIGSTOP of its launcher and worker: nothing closes, nothing answers,
    as a node that lost power or its network). Without a bound rank 0 would wait in its all-reduce for gloo's
    30-minute default; with train.dist_timeout = 6 its heartbeat watch names rank 1 and its node, and the launcher
    ends within the timeout and a few seconds, with one line that says how to resume."""
    r = dead_node(fdata, tmp_path, 2, 1, 6.0, "tail", host_store=True)
    check_dead_node(r, 6.0, margin=8)
    (survivor,) = r["survivors"].values()
    assert survivor["errors"][0].startswith("error: training failed: rank 1 on node ")


@pytest.mark.slow
@needs_proc
def test_a_killed_rank_across_two_nodes_resumes_bitwise(fdata: tuple[Path, Path], ws2_fault_ref: Path,
                                                       tmp_path: Path) -> None:
    """2 nodes x 1 process; the rank of node 1 is SIGKILLed. Each launcher ends in one line: node 1's names its
    killed rank, node 0's the peer that is gone; only rank 0's node writes torchrun's report into the run
    directory (the other's goes to a temporary file). The same two commands again resume from the last checkpoint
    and end bitwise where the uninterrupted run on one node ends."""
    r = kill_and_resume(fdata, tmp_path, ws2_fault_ref, 2, 1, host_store=True)
    check_kill(r)
    other = r["first_run"][1 - r["victim_node"]]["errors"][0]
    assert re.match(r"error: training failed: rank 1 on node \d \([^)]+\) is gone \(its connection closed\): its "
                    r"process or node died; last checkpoint: ", other), other


@pytest.mark.slow
@needs_proc
def test_a_resume_on_fewer_processes_keeps_the_global_batch(fdata: tuple[Path, Path], ws2_fault_ref: Path,
                                                            tmp_path: Path) -> None:
    """A 2-process run (1 batch each per update) cut back to step 6 and resumed on 1 process: 2 batches of
    accumulation (train.tokens_per_update alone would give 1), one warning line, and the run ends on the same
    tokens, epoch position and loss curve as the uninterrupted one."""
    r = resume_elsewhere(fdata, tmp_path, ws2_fault_ref, 2, 1)
    check_resume_elsewhere(r, 2, 1)


def test_the_global_batch_rule_on_another_world_size() -> None:
    """8 x 1 -> 4 x 2 (and 8 x 1 -> 3 x 3: the nearest multiple above); a changed tokens_per_update is followed."""
    from types import SimpleNamespace

    from mtpipe.training.batches import TrainData
    from mtpipe.training.resume import same_global_batch

    def data(world: int, accum: int, n: int = 100) -> TrainData:
        return TrainData(vocab={}, max_tokens=4096, train_tokens=None, train=[0] * n, valid_tokens=None,  # type: ignore
                         valid=None, accum=accum, per_update=world * accum, usable=n // (world * accum) * world * accum)

    ck = SimpleNamespace(trainer_state={"world_size": 8, "accum": 1})
    assert (d := same_global_batch(ck, data(4, 1), 4, 4096)).accum == 2 and d.per_update == 8 and d.usable == 96
    assert (d := same_global_batch(ck, data(3, 1), 3, 4096)).accum == 3 and d.per_update == 9 and d.usable == 99
    assert same_global_batch(ck, data(8, 1), 8, 4096).accum == 1  # the same world size: as the params say
    assert same_global_batch(ck, data(4, 3), 4, 40000).accum == 3  # another tokens_per_update: as asked
    assert same_global_batch(ck, data(16, 1), 16, 4096).per_update == 16  # 16 processes take at least one each


def test_dist_timeout_reaches_torchrun_and_the_workers() -> None:
    """train.dist_timeout: a flag of the workers, and the rendezvous' join and store timeouts of several nodes."""
    from mtpipe.config import ModelConfig, TrainConfig
    from mtpipe.training.distributed import group_timeout, heartbeat_interval
    from mtpipe.training.launch import launch_command

    paths = {"tokens": Path("t"), "batches": Path("b"), "out": Path("x")}
    env = {"MTPIPE_NNODES": "2", "MTPIPE_RDZV_ENDPOINT": "node0:29400"}
    cmd = launch_command(ModelConfig(), TrainConfig(nproc="2", dist_timeout=90), paths, env=env)
    assert cmd is not None and cmd[cmd.index("--rdzv-conf") + 1] == "join_timeout=90,read_timeout=90"
    worker = cmd[cmd.index("mtpipe") + 1:]
    assert float(worker[worker.index("--dist-timeout") + 1]) == 90
    assert "--rdzv-conf" not in launch_command(ModelConfig(), TrainConfig(nproc="2"), paths, env={})
    assert heartbeat_interval(600) == 5 and heartbeat_interval(6) == 0.3 and heartbeat_interval(1) == 0.2
    assert 600 < group_timeout(600) <= 620  # a dead peer is named by the watch before a collective gives up


def test_the_watch_names_silent_ranks_by_node() -> None:
    """What the heartbeat watch says, from the counts it read (no store needed)."""
    from mtpipe.training.distributed import _LEFT, Watch

    w = Watch(0, 4, 30.0, ("node0", 29500), "p/")
    w.who = {0: ("0", "a"), 1: ("0", "a"), 2: ("1", "b"), 3: ("1", "b")}
    w._saw([b"5", b"5", b"5", b"5"])
    assert w.verdict(30) is None
    w.moved = {r: t - 40 for r, t in w.moved.items()}  # 40 s without a new count from anyone...
    w._saw([b"6", b"6", b"5", b"5"])  # ... but rank 1's moved now
    assert w.verdict(30) == ("ranks 2, 3 on node 1 (b) stopped answering for 40 s (train.dist_timeout = 30 s): their "
                             "processes or node died, froze or lost the network")
    w._saw([b"7", b"7", str(5 + _LEFT).encode(), b"5"])  # rank 2 left the group (done): nobody waits for it
    assert w.verdict(30).startswith("rank 3 on node 1 (b) stopped answering for 40 s")
    w.left.clear()
    w.moved[2] -= 5  # silent for 5 s when rank 3's 40 s end the run: it stopped with it (3 heartbeats of 1.5 s)
    assert w.verdict(30).startswith("ranks 2, 3 on node 1 (b) stopped answering for 40 s")
    w.moved[2] += 4
    assert w.verdict(30).startswith("rank 3 on node 1 (b) stopped answering for 40 s")
    w.last_ok -= 31
    assert w.verdict(30).startswith("torchrun's store at node0:29500 stopped answering for 31 s (train.dist_timeout = "
                                    "30 s): node 0, whose torchrun hosts it, died, froze or lost the network")


def test_the_several_nodes_workflow_of_the_readme_runs_what_dvc_records() -> None:
    """README's "Several nodes": DVC runs on one node only, before (`dvc repro bucket`) and after (`dvc commit -f
    train`, then `dvc repro`) the train command that every node runs; that command is the train stage's own, word
    for word (so the commit records what ran), its flags are `mtpipe train`'s, its variables the launcher's, and the
    SLURM example uses SLURM's own variables."""
    import yaml
    from typer.main import get_command

    from mtpipe.cli import app

    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index("**Several nodes.**"):text.index("### Training to a budget")]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert len(blocks) == 2  # by hand (torchrun per node) and SLURM
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    train_options = {o for p in get_command(app).commands["train"].params for o in [*p.opts, *p.secondary_opts]}
    assert "--dist-timeout" in train_options
    launcher = (REPO / "mtpipe" / "launch.py").read_text(encoding="utf-8")
    slurm = {"SLURM_SUBMIT_DIR", "SLURM_NNODES", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODEID"}
    for block in blocks:
        code = block.replace("\\\n", " ")
        trains = [" ".join(t.split()) for t in re.findall(r"python stages/train\.py[^'\n]*", code)]
        assert len(trains) == 1 and trains[0] == stages["train"]["cmd"], trains
        assert set(re.findall(r"--[a-z-]+", trains[0])) <= train_options
        assert {v for v in re.findall(r"MTPIPE_[A-Z_]+", code) if f'"{v}"' not in launcher} == set()
        assert set(re.findall(r"\$\{?(SLURM_[A-Z_]+)", code)) <= slurm
        lines = [ln.split("#")[0].strip() for ln in code.splitlines()]
        dvc = [ln for ln in lines if ln.startswith("dvc ")]
        assert dvc == ["dvc repro bucket", "dvc commit -f train && dvc repro"], dvc
        at = {ln: i for i, ln in enumerate(lines)}
        train_line = next(i for i, ln in enumerate(lines) if "stages/train.py" in ln)
        assert at["dvc repro bucket"] < train_line < at["dvc commit -f train && dvc repro"]
    assert {"fetch", "bpe", "bucket"} <= set(stages) and "bucket" in stages["train"]["cmd"]
