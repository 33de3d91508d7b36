#!/usr/bin/env python3
"""DVC's train stage: ``python stages/train.py [any mtpipe train option]`` is ``mtpipe train [...]``.

``mtpipe train`` starts ``train.nproc`` processes itself (``auto``: one per visible CUDA GPU, else one CPU process;
a number: that many, gloo between CPU processes, NCCL between GPUs) through torchrun, or trains in this process when
one is enough: the same training code path either way (:mod:`mtpipe.training.launch`).

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
"""

import sys

from mtpipe.cli import app

if __name__ == "__main__":
    app(args=["train", *sys.argv[1:]], prog_name="mtpipe")
