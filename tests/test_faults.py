"""Faults of a multi-process, multi-node `mtpipe train` (gloo on CPU, "nodes" that are launchers on this machine
meeting through a localhost rendezvous): a dead or frozen node, a killed rank, a resume on another world size.

The scenarios are functions of their sizes (:mod:`testkit.faults`): the suite runs the cheap ones (2 nodes x 1
process, 2 -> 1 processes); ``bench/faults.py`` runs the same functions at world size 8, across 2 nodes x 2
processes and 8 -> 4, and writes their outcomes to a results file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_train import needs_proc
from testkit.faults import (
    check_dead_node,
    check_kill,
    check_resume_elsewhere,
    dead_node,
    kill_and_resume,
    reference_run,
    resume_elsewhere,
)
from testkit.runs import REPO, make_artifacts

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
    accumulation, one warning line, and the run ends on the same tokens, epoch position and loss curve as the
    uninterrupted one."""
    r = resume_elsewhere(fdata, tmp_path, ws2_fault_ref, 2, 1)
    check_resume_elsewhere(r, 2, 1)


def test_the_global_batch_rule_on_another_world_size() -> None:
    """8 x 1 -> 4 x 2 (and 8 -> 3 or 16 processes: they share the 8 batches' sentences); a changed
    tokens_per_update is followed."""
    from types import SimpleNamespace

    import numpy as np

    from mtpipe.training.batches import BatchTable, TrainData
    from mtpipe.training.resume import same_global_batch

    def data(world: int, accum: int, n: int = 100) -> TrainData:
        zeros = np.zeros(n, np.int64)
        train = BatchTable(rows=None, off=np.arange(n + 1) * 20, src_tokens=zeros, tgt_tokens=zeros, src_width=zeros,
                           tgt_width=zeros)  # 100 batches of 20 sentences
        return TrainData(vocab={}, max_tokens=4096, train_tokens=None, train=train, valid_tokens=None,  # type: ignore
                         valid=None, accum=accum, per_update=world * accum, usable=n // (world * accum) * world * accum)

    # A checkpoint of an older mtpipe (no batches_per_update): 8 processes took 8 batches of 4096 tokens per update.
    ck = SimpleNamespace(trainer_state={"world_size": 8, "accum": 1}, path="ck")
    assert (d := same_global_batch(ck, data(4, 1), 4, 4096)).accum == 2 and d.per_update == 8 and d.usable == 96
    assert not d.split
    assert (d := same_global_batch(ck, data(3, 1), 3, 4096)).split and d.per_update == 8 and d.usable == 96
    assert same_global_batch(ck, data(8, 1), 8, 4096).accum == 1  # the same world size: as the params say
    assert same_global_batch(ck, data(4, 3), 4, 40000).accum == 3  # another tokens_per_update: as asked
    assert (d := same_global_batch(ck, data(16, 1), 16, 4096)).per_update == 8 and d.split
    # This mtpipe's: 1 batch per update (tokens_per_update 4096) shared by 8 processes, resumed on 2.
    ck = SimpleNamespace(trainer_state={"world_size": 8, "accum": 1, "batches_per_update": 1}, path="ck")
    assert (d := same_global_batch(ck, data(2, 1), 2, 4096)).per_update == 1 and d.split


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
    """docs/training.md's "Several nodes": DVC runs on one node only, before (`dvc repro bucket`) and after (`dvc commit -f
    train`, then `dvc repro`) the train command that every node runs; that command is the train stage's own, word
    for word (so the commit records what ran), its flags are `mtpipe train`'s, its variables the launcher's, and the
    SLURM example uses SLURM's own variables."""
    import yaml
    from typer.main import get_command

    from mtpipe.cli import app

    text = (REPO / "docs" / "training.md").read_text(encoding="utf-8")
    section = text[text.index("## Several nodes"):text.index("## Training to a budget")]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert len(blocks) == 2  # by hand (torchrun per node) and SLURM
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    train_options = {o for p in get_command(app).commands["train"].params for o in [*p.opts, *p.secondary_opts]}
    assert "--dist-timeout" in train_options
    launcher = (REPO / "mtpipe" / "training" / "launch.py").read_text(encoding="utf-8")
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
