"""One distributed code path: a torchrun launch of N processes, or a plain single process (N = 1).

``init()`` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``). When those are absent the world
size is 1, no process group is created, and every collective helper below is an identity: training code calls the
same functions either way and never branches on the world size itself.

* NCCL between GPUs (one process per GPU, ``cuda:LOCAL_RANK``), gloo between CPU processes.
* Side effects (checkpoint writes, dvclive, summary files) happen on rank 0 only, behind :func:`rank0_only`.
  (Terminal output is already rank-0 only: :mod:`mtpipe.console` stays silent when ``RANK`` is not 0.)
* :func:`launch` is the process launcher behind ``stages/train.py``: it resolves the process count from
  ``train.nproc`` and runs ``torchrun`` (N > 1, multi-node, or restarts) or ``mtpipe train`` in-process (N = 1).

torch is imported inside the functions: the launcher (``stages/train.py``) starts torchrun without paying for it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

from mtpipe.errors import MtpipeError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class Context:
    """Where this process sits in the launch."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # "nccl" / "gloo", or None at world size 1 (no process group)


_ctx: Context | None = None
_owns_group = False


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise MtpipeError(f"environment variable {name}={value!r} is not an integer") from None


def _attempt_store(rank: int, world: int) -> dist.Store | None:
    """The rendezvous store of this torchrun attempt, with keys private to the attempt.

    torchrun keeps one store (hosted by its agent) across ``--max-restarts`` restarts, and the process group's keys
    (each rank's gloo/NCCL address) are the same in every attempt: a restarted group could read its dead
    predecessors' addresses, connect to nothing and hang. A prefix per attempt (``TORCHELASTIC_RESTART_COUNT``)
    keeps attempts apart. ``None`` (plain ``env://`` rendezvous) outside torchrun.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if attempt is None or not addr or not port:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 hosts it (as env:// does)
    store = dist.TCPStore(addr, int(port), world, is_master=not agent_hosts and rank == 0,
                          timeout=timedelta(minutes=30), multi_tenant=not agent_hosts)
    return dist.PrefixStore(f"mtpipe/attempt_{attempt}/", store)


def init(device: str = "auto") -> Context:
    """Join the launch described by torchrun's environment (or none: world size 1) and pick this process's device.

    ``device``: ``auto`` (``cuda:LOCAL_RANK`` when a GPU is visible, else ``cpu``), ``cpu`` or ``cuda``.
    Idempotent: a second call returns the same context.
    """
    global _ctx, _owns_group
    if _ctx is not None:
        return _ctx
    import torch
    import torch.distributed as dist

    rank, world, local = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    if device not in ("auto", "cpu", "cuda"):
        raise MtpipeError(f"train.device: {device!r} is not one of auto, cpu, cuda")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise MtpipeError("train.device=cuda but no CUDA GPU is visible to this process")
        n = torch.cuda.device_count()
        if local >= n:
            raise MtpipeError(f"LOCAL_RANK={local} but only {n} CUDA GPU(s) are visible: use at most {n} processes "
                              "per node (train.nproc)")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    backend = None
    if world > 1:
        backend = "nccl" if use_cuda else "gloo"
        if not dist.is_initialized():
            # device_id binds NCCL's communicator to this GPU eagerly (no guessing in the first collective).
            dist.init_process_group(backend, device_id=dev if use_cuda else None, store=_attempt_store(rank, world),
                                     rank=rank, world_size=world)
            _owns_group = True
    _ctx = Context(rank=rank, world_size=world, local_rank=local, device=dev, backend=backend)
    return _ctx


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters, <malloc.h>


@functools.cache
def tune_cpu_allocator() -> bool:
    """Keep freed memory in the process for reuse (glibc only; False elsewhere). Process-wide, called once.

    Why: glibc serves every allocation above its mmap threshold (at most 32 MB: logits, their gradients, large
    activations) with a fresh ``mmap`` and unmaps it on free, so a CPU training step page-faults its large tensors in
    again every time (~170k minor faults per step of the small model). With ``M_MMAP_MAX = 0`` and a huge
    ``M_TRIM_THRESHOLD`` freed blocks are reused: +46-56 % tokens/s for bf16 training of the small model on 2 threads
    (bench/train_throughput.py). GPU memory is not affected (CUDA has its own caching allocator).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def trim_cpu_memory() -> None:
    """Hand the free pages of the glibc heap back to the OS (``malloc_trim(0)``); a no-op unless
    ``tune_cpu_allocator()`` took effect.

    Why: with trimming off, blocks freed by one batch shape are reused only where the next shapes fit, and the heap's
    resident size creeps up over thousands of steps of varying batch shapes. Trimming every few hundred steps keeps
    the resident size near the live peak, while the per-step page faults stay gone.
    """
    if not tune_cpu_allocator.cache_info().currsize or not tune_cpu_allocator():
        return
    import ctypes
    import ctypes.util

    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def context() -> Context:
    """The current context (``init()`` with defaults if nobody called it yet)."""
    return _ctx if _ctx is not None else init()


def cleanup() -> None:
    """Leave the process group (if this module created it) and forget the context; safe to call twice."""
    global _ctx, _owns_group
    import torch.distributed as dist

    if _owns_group and dist.is_initialized():
        dist.destroy_process_group()
    _owns_group = False
    _ctx = None


def world_size() -> int:
    return _ctx.world_size if _ctx is not None else _env_int("WORLD_SIZE", 1)


def rank() -> int:
    return _ctx.rank if _ctx is not None else _env_int("RANK", 0)


def is_rank0() -> bool:
    return rank() == 0


def rank0_only(fn: Callable[..., T]) -> Callable[..., T | None]:
    """Decorator: run ``fn`` on rank 0 only (checkpoint writes, metrics, summaries); other ranks get ``None``.

    Never put a collective inside such a function: the other ranks would wait for it forever.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T | None:
        return fn(*args, **kwargs) if is_rank0() else None

    return wrapper


# --------------------------------------------------------------------------------------------------------------------
# Collectives (identities at world size 1)
# --------------------------------------------------------------------------------------------------------------------


def _active() -> bool:
    if world_size() <= 1:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if _active():
        import torch.distributed as dist

        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over all ranks, in place (on this rank's device); returns ``t``."""
    if _active():
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_object(obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order (``[obj]`` at world size 1)."""
    if not _active():
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: T) -> T:
    """Rank 0's ``obj`` on every rank."""
    if not _active():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wrap(module: torch.nn.Module, find_unused_parameters: bool = False) -> torch.nn.Module:
    """``DistributedDataParallel(module)`` when there are several processes, else ``module`` itself.
    ``find_unused_parameters``: some parameters may get no gradient in a step (LayerDrop)."""
    if not _active():
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    import inspect

    ctx = context()
    kw: dict[str, Any] = dict(device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                              gradient_as_bucket_view=True, find_unused_parameters=find_unused_parameters)
    # No buffer sync on every forward: the model's only buffer (the positional table) is a constant rebuilt from the
    # config. (Newer torch calls the flag forward_sync_buffers and deprecates broadcast_buffers.)
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        kw["forward_sync_buffers"] = False
    else:
        kw["broadcast_buffers"] = False
    return DDP(module, **kw)


@contextlib.contextmanager
def no_sync(module: torch.nn.Module, skip: bool) -> Iterator[None]:
    """Inside, a DDP ``module`` does not all-reduce gradients (``skip=True``: an accumulation micro-batch that is not
    the last of its update); a no-op for a plain module."""
    if skip and hasattr(module, "no_sync"):
        with module.no_sync():
            yield
    else:
        yield


# --------------------------------------------------------------------------------------------------------------------
# Launcher (stages/train.py)
# --------------------------------------------------------------------------------------------------------------------


def resolve_nproc(nproc: str) -> int:
    """``train.nproc``: ``auto`` = every visible CUDA GPU (1 CPU process when there is none), or a positive int."""
    if str(nproc).strip().lower() == "auto":
        import torch

        return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    try:
        n = int(nproc)
    except ValueError:
        raise MtpipeError(f"train.nproc: {nproc!r} is neither 'auto' nor a number of processes") from None
    if n < 1:
        raise MtpipeError(f"train.nproc: {n} must be >= 1")
    return n


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of ``--flag V`` or ``--flag=V`` in ``argv`` (the last one wins, as in the CLI)."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1 :]
    return value


def _without_flags(argv: Sequence[str], flags: set[str]) -> list[str]:
    """``argv`` minus ``--flag V`` / ``--flag=V`` for each of ``flags``."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not any(a.startswith(f + "=") for f in flags):
            out.append(a)
    return out


def torchrun_command(nproc: int, train_args: Sequence[str], env: dict[str, str] | None = None,
                     max_restarts: int = 0) -> list[str]:
    """The ``torchrun`` command line that runs ``mtpipe train <train_args>`` in ``nproc`` processes per node.

    Single node: ``--standalone``. Several nodes: ``MTPIPE_NNODES``, ``MTPIPE_NODE_RANK``, ``MTPIPE_RDZV_ENDPOINT``
    (``host:port`` of a node every node reaches) and optionally ``MTPIPE_RDZV_ID`` (default ``mtpipe``) in ``env``
    give torchrun's ``--nnodes``, ``--node-rank`` and the c10d rendezvous.
    """
    env = os.environ if env is None else env
    nnodes = env.get("MTPIPE_NNODES", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if nnodes in ("", "1"):
        cmd.append("--standalone")
    else:
        endpoint = env.get("MTPIPE_RDZV_ENDPOINT")
        if not endpoint:
            raise MtpipeError(f"MTPIPE_NNODES={nnodes} needs MTPIPE_RDZV_ENDPOINT=host:port (a node every node "
                              "can reach)")
        cmd += ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                "--rdzv-id", env.get("MTPIPE_RDZV_ID", "mtpipe")]
        if env.get("MTPIPE_NODE_RANK"):
            cmd += ["--node-rank", env["MTPIPE_NODE_RANK"]]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    # The launcher's own flags stay here: torchrun's parser would read --nproc as an ambiguous abbreviation of
    # --nproc-per-node, and the workers do not need them.
    return cmd + ["-m", "mtpipe", "train", *_without_flags(train_args, {"--nproc", "--max-restarts"})]


def launch(argv: Sequence[str]) -> int:
    """Run ``mtpipe train argv`` on ``train.nproc`` processes (``--nproc`` in argv overrides params.yaml).

    torchrun when there are several processes, several nodes, or restarts to supervise; otherwise ``mtpipe train``
    in this process (the very same code path, at world size 1). Returns the exit status.
    """
    from mtpipe.config import TrainConfig, load_params, resolve

    argv = list(argv)
    try:
        params_file = _flag_value(argv, "--params")
        params = load_params(params_file or "params.yaml", required=params_file is not None)
        over: dict[str, Any] = {"nproc": _flag_value(argv, "--nproc")}
        restarts = _flag_value(argv, "--max-restarts") or os.environ.get("MTPIPE_MAX_RESTARTS")
        if restarts is not None:
            try:
                over["max_restarts"] = int(restarts)
            except ValueError:
                raise MtpipeError(f"--max-restarts / MTPIPE_MAX_RESTARTS: {restarts!r} is not an integer") from None
        cfg = resolve(TrainConfig, params, over, where=params_file or "params.yaml")
        nproc = resolve_nproc(cfg.nproc)
        multi_node = os.environ.get("MTPIPE_NNODES", "1") not in ("", "1")
        if nproc > 1 or multi_node or cfg.max_restarts > 0:
            cmd = torchrun_command(nproc, argv, max_restarts=cfg.max_restarts)
        else:
            cmd = None
    except MtpipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if cmd is None:
        from mtpipe.cli import app

        try:
            app(args=["train", *argv], prog_name="mtpipe")
        except SystemExit as e:
            return int(e.code or 0) if not isinstance(e.code, str) else 1
        return 0
    return subprocess.call(cmd)
