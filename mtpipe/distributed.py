"""One distributed code path: a torchrun launch of N processes, or a plain single process (N = 1).

``init()`` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``). When those are absent the world
size is 1, no process group is created, and every collective helper below is an identity: training code calls the
same functions either way and never branches on the world size itself.

* NCCL between GPUs (one process per GPU, ``cuda:LOCAL_RANK``), gloo between CPU processes.
* Side effects (checkpoint writes, dvclive, summary files) happen on rank 0 only, behind :func:`rank0_only`.
  (Terminal output is already rank-0 only: :mod:`mtpipe.console` stays silent when ``RANK`` is not 0.)
* Starting the N processes is :mod:`mtpipe.launch`'s job; CPU and precision settings are :mod:`mtpipe.runtime`'s.

torch is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

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
