#!/usr/bin/env python3
"""Faults of a multi-node run, at the sizes the test suite cannot afford: gloo on CPU, "nodes" that are launchers
on this machine meeting through a localhost rendezvous, a tiny model (a few seconds of training per run; the time
goes into starting 8 processes). CI-runnable: exit status 1 when any scenario fails its checks.

* ``kill-ws8``: 8 processes on one node; rank 7 SIGKILLed after the checkpoint of step 3: one line; the same
  command again resumes, and the run equals the uninterrupted 8-process run bitwise.
* ``resume-8-to-4``: that uninterrupted run cut back to step 6, resumed on 4 processes: one warning, the same 2
  batches per update (shared by 4 processes in halves instead of by 8 in quarters), the same tokens, epoch position
  and loss curve.
* ``kill-2x2``: 2 nodes x 2 processes, rank 3 (node 1) SIGKILLed: one line per node, rank 0's node alone writes
  the report into the run directory; both commands again resume, bitwise equal to the uninterrupted 4-process run.
* ``dead-node-2x2``: 2 nodes x 2 processes, node 1 frozen (SIGSTOP of its launcher and workers: a node that lost
  power or its network): node 0 ends in one line naming ranks 2, 3 and their node within ``--timeout`` (the
  runs' ``train.dist_timeout``) and a few seconds.
* ``dead-head-2x2``: the same with rank 0's node frozen, whose torchrun hosts the workers' store: node 1's workers
  name the store.
* ``dead-rendezvous-2x2``: the same with the node frozen whose torchrun hosts the rendezvous (often rank 0's as
  well): node 1's launcher does not wait for its own torchrun agent, which blocks on that store for good.

The scenarios are the functions of :mod:`testkit.faults`, whose cheap sizes (2 nodes x 1 process, 2 -> 1) run in
the suite (``tests/test_faults.py``).

    python bench/faults.py                              # every scenario (~5 min on 2 cores)
    python bench/faults.py --only dead-node-2x2,kill-2x2 --timeout 10
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import machine  # noqa: E402
from testkit import faults as tf  # noqa: E402
from testkit.runs import make_artifacts  # noqa: E402

NAMES = ("kill-ws8", "resume-8-to-4", "kill-2x2", "dead-node-2x2", "dead-head-2x2", "dead-rendezvous-2x2")


def scenarios(data: tuple[Path, Path], root: Path, args: argparse.Namespace,
              outcomes: dict[str, Any]) -> dict[str, Callable[[Path], dict[str, Any]]]:
    """Each scenario as a function of its work directory, checked; the reference runs they compare with are made
    once, on first use, and timed in ``outcomes``."""
    refs: dict[int, Path] = {}

    def ref(world: int) -> Path:
        if world not in refs:
            where = root / f"ref{world}"
            where.mkdir(exist_ok=True)
            t0 = time.monotonic()
            refs[world] = tf.reference_run(data, where, world)
            outcomes[f"reference-ws{world}"] = {"ok": True, "seconds": round(time.monotonic() - t0, 1)}
        return refs[world]

    def dead(here: Path, victim: str, host_store: bool) -> dict[str, Any]:
        r = tf.dead_node(data, here, 2, 2, args.timeout, victim, host_store=host_store)
        tf.check_dead_node(r, args.timeout, args.margin)
        return r

    def elsewhere(here: Path) -> dict[str, Any]:
        r = tf.resume_elsewhere(data, here, ref(8), 8, 4)
        tf.check_resume_elsewhere(r, 8, 4)
        return r

    def killed(here: Path, nnodes: int, nproc: int) -> dict[str, Any]:
        r = tf.kill_and_resume(data, here, ref(nnodes * nproc), nnodes, nproc)
        tf.check_kill(r)
        return r

    return {
        "kill-ws8": lambda here: killed(here, 1, 8),
        "resume-8-to-4": elsewhere,
        "kill-2x2": lambda here: killed(here, 2, 2),
        "dead-node-2x2": lambda here: dead(here, "tail", host_store=True),
        "dead-head-2x2": lambda here: dead(here, "head", host_store=True),
        "dead-rendezvous-2x2": lambda here: dead(here, "rendezvous", host_store=False),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated scenarios (default: all): " + ", ".join(NAMES))
    ap.add_argument("--timeout", type=float, default=10.0, help="train.dist_timeout of the dead-node runs (s)")
    ap.add_argument("--margin", type=float, default=15.0, help="seconds past the timeout a survivor may take")
    ap.add_argument("--keep", type=Path, help="run in this directory and keep it (default: a temporary one)")
    ap.add_argument("--results", type=Path, help="the results file (default bench/results/faults-<UTC time>.json)")
    args = ap.parse_args()
    chosen = args.only.split(",") if args.only else list(NAMES)
    unknown = sorted(set(chosen) - set(NAMES))
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(unknown)}")

    outcomes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="mtpipe-faults-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        runs = scenarios(make_artifacts(root / "data"), root, args, outcomes)
        for name in chosen:
            here = root / name
            here.mkdir(exist_ok=True)
            t0 = time.monotonic()
            try:
                result, ok, error = runs[name](here), True, None
            except Exception as e:  # noqa: BLE001 -- a failed check is this scenario's outcome
                result, ok, error = None, False, "".join(traceback.format_exception_only(e)).strip()
                traceback.print_exc()
            outcomes[name] = {"ok": ok, "seconds": round(time.monotonic() - t0, 1), "result": result, "error": error}
            print(f"{name}: {'ok' if ok else 'FAILED'} ({outcomes[name]['seconds']} s)", file=sys.stderr)
    figures = {"dist_timeout": args.timeout, "margin": args.margin, "scenarios": outcomes,
               "all_ok": all(o["ok"] for o in outcomes.values())}
    machine.write_results("faults", figures, args.results)
    return 0 if figures["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
