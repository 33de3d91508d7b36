#!/usr/bin/env python3
"""DVC's train stage: ``python stages/train.py [any mtpipe train option]``.

Runs ``mtpipe train`` with the given options on ``train.nproc`` processes (params.yaml, or ``--nproc N``):
``auto`` = one process per visible CUDA GPU, or one CPU process when there is none; a number = that many (gloo
between CPU processes, NCCL between GPUs). One process runs ``mtpipe train`` in this process; more run
``torchrun --standalone --nproc-per-node N -m mtpipe train ...``. Either way it is the same training code path.

Restarts: ``train.max_restarts`` (params.yaml, ``--max-restarts N`` or ``MTPIPE_MAX_RESTARTS``) becomes torchrun's
``--max-restarts``: when a worker dies, torchrun restarts the whole group, which resumes from the last checkpoint
in ``--out``.

Several nodes: run this same command on every node with
  MTPIPE_NNODES         number of nodes
  MTPIPE_NODE_RANK      this node's rank (0 .. NNODES-1; optional with the c10d rendezvous)
  MTPIPE_RDZV_ENDPOINT  host:port that every node reaches (usually node 0)
  MTPIPE_RDZV_ID        a job id shared by the nodes (default: mtpipe)
``--out`` must be on a filesystem every node sees (rank 0 writes checkpoints, every rank reads them on resume).
torchrun's own ``PET_*`` environment variables (e.g. ``PET_MASTER_PORT``) are honoured as well.

Everything importable lives in :mod:`mtpipe.distributed` (``launch``); this file is launch glue only.
"""

import sys

from mtpipe.distributed import launch

if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
