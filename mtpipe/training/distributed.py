"""One distributed code path: a torchrun launch of N processes, or a plain single process (N = 1).

``init()`` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``). When those are absent the world
size is 1, no process group is created, and every collective helper below is an identity: training code calls the
same functions either way and never branches on the world size itself.

* NCCL between GPUs (one process per GPU, ``cuda:LOCAL_RANK``), gloo between CPU processes.
* Side effects (checkpoint writes, dvclive, summary files) happen on rank 0 only, behind :func:`rank0_only`.
  (Terminal output is already rank-0 only: :mod:`mtpipe.console` stays silent when ``RANK`` is not 0.)
* Starting the N processes is :mod:`mtpipe.training.launch`'s job (torchrun's agent: :mod:`mtpipe.training.torchrun`);
  CPU and precision settings are :mod:`mtpipe.engine.runtime`'s.
* Waiting for one another is bounded by ``train.dist_timeout`` (:func:`init`'s ``timeout``): every process watches
  the others' heartbeats in torchrun's store (:class:`Watch`), so a rank or node that dies, freezes or drops off the
  network ends the others within that time with one line naming it, instead of a hang (a gloo collective waits for
  its timeout when a peer is frozen or unreachable, immediately fails when the peer's process is gone; an NCCL one
  waits on the GPU). The process group's own timeout is a little longer, a backstop for a rank that is alive but
  stuck, and :func:`lost_peers` names the culprit when a collective fails first.

torch is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

from mtpipe import env, platform
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
_watch: Watch | None = None


def _env_int(name: str, default: int) -> int:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise MtpipeError(f"environment variable {name}={value!r} is not an integer") from None


def _attempt_store(rank: int, world: int, timeout: float) -> dist.Store | None:
    """The rendezvous store of this torchrun attempt, with keys private to the attempt.

    torchrun keeps one store (hosted by its agent) across ``--max-restarts`` restarts, and the process group's keys
    (each rank's gloo/NCCL address) are the same in every attempt: a restarted group could read its dead
    predecessors' addresses, connect to nothing and hang. A prefix per attempt (``TORCHELASTIC_RESTART_COUNT``)
    keeps attempts apart. ``None`` (plain ``env://`` rendezvous) outside torchrun.
    """
    attempt = env.get("TORCHELASTIC_RESTART_COUNT")
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if attempt is None or not addr or not port:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    agent_hosts = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 hosts it (as env:// does)
    store = dist.TCPStore(addr, int(port), world, is_master=not agent_hosts and rank == 0,
                          timeout=timedelta(seconds=timeout), multi_tenant=not agent_hosts)
    return dist.PrefixStore(f"mtpipe/attempt_{attempt}/", store)


DEFAULT_TIMEOUT = 600.0  # train.dist_timeout's default (seconds)


def heartbeat_interval(timeout: float) -> float:
    """Seconds between two heartbeats (and two looks at the others'): a twentieth of ``train.dist_timeout``,
    within 0.2 .. 5 s (5 s at the default 600: one tiny store write and read per process every 5 s)."""
    return min(5.0, max(0.2, timeout / 20))


def group_timeout(timeout: float) -> float:
    """The process group's (collectives') timeout for ``train.dist_timeout``: a few heartbeats longer, so that a
    dead or frozen peer is named by the heartbeat watch (:class:`Watch`) before a collective gives up without a
    name; a rank that is alive but stuck is the collective timeout's to catch."""
    return timeout + 3 * heartbeat_interval(timeout)


def init(device: str = "auto", timeout: float = DEFAULT_TIMEOUT) -> Context:
    """Join the launch described by torchrun's environment (or none: world size 1) and pick this process's device.

    ``device``: ``auto`` (``cuda:LOCAL_RANK`` when a GPU is visible, else ``cpu``), ``cpu`` or ``cuda``.
    ``timeout``: ``train.dist_timeout``, seconds: how long joining the group may take, how long a peer may stay
    silent (:class:`Watch`), and (:func:`group_timeout`) how long a collective waits.
    Idempotent: a second call returns the same context.
    """
    global _ctx, _owns_group, _watch
    if _ctx is not None:
        return _ctx
    import torch
    import torch.distributed as dist

    rank, world, local = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    if device not in ("auto", "cpu", "cuda"):
        raise MtpipeError(f"train.device: {device!r} is not one of auto, cpu, cuda")
    use_cuda = platform.use_gpu(device, "train.device")
    if use_cuda:
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
            from datetime import timedelta

            # device_id binds NCCL's communicator to this GPU eagerly (no guessing in the first collective).
            dist.init_process_group(backend, device_id=dev if use_cuda else None,
                                     store=_attempt_store(rank, world, timeout), rank=rank, world_size=world,
                                     timeout=timedelta(seconds=group_timeout(timeout)))
            _owns_group = True
            _watch = Watch.start(rank, world, timeout)
    _ctx = Context(rank=rank, world_size=world, local_rank=local, device=dev, backend=backend)
    return _ctx


def context() -> Context:
    """The current context (``init()`` with defaults if nobody called it yet)."""
    return _ctx if _ctx is not None else init()


def cleanup() -> None:
    """Leave the process group (if this module created it) and forget the context; safe to call twice. The
    heartbeat watch says this rank left (the others stop waiting for it: rank 0 may write the last checkpoint long
    after the others are done), unless an error is on its way out (called from a ``finally``): then the watch goes
    on until the process ends, for :func:`lost_peers` to name the peer a failed collective lost."""
    global _ctx, _owns_group, _watch
    import sys

    import torch.distributed as dist

    if _watch is not None and sys.exc_info()[1] is None:
        _watch.close()
        _watch = None
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


def wrap(module: torch.nn.Module, find_unused_parameters: bool = False, compress: bool = False) -> torch.nn.Module:
    """``DistributedDataParallel(module)`` when there are several processes, else ``module`` itself.
    ``find_unused_parameters``: some parameters may get no gradient in a step (LayerDrop). ``compress``: the
    gradients travel as bf16 (:func:`bf16_allreduce`)."""
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
    ddp = DDP(module, **kw)
    if compress:
        ddp.register_comm_hook(None, bf16_allreduce)
    return ddp


def bf16_allreduce(group, bucket):  # type: ignore[no-untyped-def]  # DDP refuses a bucket annotated as another type
    """A DDP communication hook: each gradient bucket averaged over the ranks in bf16, half the bytes of fp32 (the
    sum rounded to bf16's 8-bit mantissa, then written back into the fp32 gradients). torch's own
    ``bf16_compress_hook`` does the same on NCCL only; this one runs on gloo too, so CPU runs and tests take it."""
    import torch
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    buffer = bucket.buffer()  # fp32 [bucket size]
    half = buffer.to(torch.bfloat16).div_(group.size())
    fut = dist.all_reduce(half, group=group, async_op=True).get_future()

    def back(f: Any) -> torch.Tensor:
        buffer.copy_(f.value()[0])
        return buffer

    return fut.then(back)


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
# Heartbeats: who stopped answering
# --------------------------------------------------------------------------------------------------------------------

_LEFT = 1 << 40  # added to a rank's heartbeat count when it leaves the group (done, or failed on its own)
_GONE_MARKS = ("closed by peer", "reset by peer", "broken pipe", "connection refused", "connection closed")


class Watch:
    """This process's heartbeat, and its watch over the others', in torchrun's store (``MASTER_ADDR:MASTER_PORT``,
    hosted by the torchrun agent of node 0, keys ``mtpipe/watch/attempt_N/``, a connection of its own).

    One thread adds 1 to ``hb/RANK`` every :func:`heartbeat_interval` and reads every rank's count; another judges:
    a rank whose count has not moved for ``train.dist_timeout`` (its process is gone or frozen, its node died or
    dropped off the network), or a store that has not answered for that long (node 0 is gone),
    ends this process with one line naming it (:meth:`verdict`, recorded for the launcher,
    :func:`mtpipe.training.failures.fail_now`). The threads do not wait on the training: a rank busy for minutes (a
    checkpoint write, torch.compile) still beats; a rank that is alive but stuck is the collectives' timeout's to catch
    (:func:`group_timeout`). A rank that leaves (:func:`cleanup`) says so, and nobody waits for it any more.

    Ranks are named with their node (torchrun's ``GROUP_RANK``) and host, which each rank writes as ``who/RANK``."""

    def __init__(self, rank: int, world: int, timeout: float, address: tuple[str, int], prefix: str) -> None:
        import threading
        import time

        self.rank, self.world, self.timeout, self.address, self.prefix = rank, world, timeout, address, prefix
        self.interval = heartbeat_interval(timeout)
        now = time.monotonic()
        self.last_ok = now  # when the store last answered
        self.count: dict[int, int] = {}  # rank -> its heartbeat count, as last read
        self.moved = {r: now for r in range(world) if r != rank}  # rank -> when its count last moved
        self.left: set[int] = set()
        self.who: dict[int, tuple[str, str]] = {}  # rank -> (node, host)
        self.broken: str | None = None  # the store error that ended the heartbeats
        self.on_lost: Callable[[str], None] = _exit_lost
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._beats: Any = None

    @classmethod
    def start(cls, rank: int, world: int, timeout: float) -> Watch | None:
        """Start the threads (None: no store address in the environment, nothing to watch with)."""
        import threading

        addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if not addr or not port:
            return None
        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        w = cls(rank, world, timeout, (addr, int(port)), f"mtpipe/watch/attempt_{attempt}/")
        w._beats = threading.Thread(target=w._beat, name="mtpipe-heartbeat", daemon=True)
        w._beats.start()
        threading.Thread(target=w._judge, name="mtpipe-watch", daemon=True).start()
        return w

    def close(self) -> None:
        """Stop watching and tell the others this rank left (waits at most a second or two for the store)."""
        self._stop.set()
        if self._beats is not None:
            self._beats.join(timeout=min(2.0, self.timeout))

    def _beat(self) -> None:
        import json
        import socket
        from datetime import timedelta

        import torch.distributed as dist

        try:
            store = dist.PrefixStore(self.prefix, dist.TCPStore(
                self.address[0], self.address[1], is_master=False, timeout=timedelta(seconds=self.timeout),
                wait_for_workers=False))
            store.set(f"who/{self.rank}", json.dumps([env.get("GROUP_RANK", ""), socket.gethostname()]))
            beats = [f"hb/{r}" for r in range(self.world)]
            ready = False
            while True:
                leaving = self._stop.is_set()
                store.add(f"hb/{self.rank}", _LEFT if leaving else 1)
                if leaving:
                    return
                if not ready and store.check(beats):  # every rank has written who/ and hb/ (then get never waits)
                    ready = True
                    who = store.multi_get([f"who/{r}" for r in range(self.world)])
                    self.who = {r: tuple(json.loads(v)) for r, v in enumerate(who)}  # type: ignore[misc]
                self._saw(store.multi_get(beats) if ready else None)
                self._stop.wait(self.interval)
        except Exception as e:  # noqa: BLE001 -- the store is gone: the judge sees it go stale
            first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
            self.broken = f"{type(e).__name__}: {first[:200]}"

    def _saw(self, values: list[bytes] | None) -> None:
        import time

        now = time.monotonic()
        with self._lock:
            self.last_ok = now
            for r, v in enumerate(values or []):
                n = int(v)
                if r == self.rank:
                    continue
                if n >= _LEFT:
                    self.left.add(r)
                if self.count.get(r) != n:
                    self.count[r], self.moved[r] = n, now

    def _judge(self) -> None:
        while not self._stop.wait(self.interval):
            verdict = self.verdict(self.timeout)
            if verdict is not None:
                self.on_lost(verdict)
                return

    def store_silence(self) -> float:
        """Seconds since the store last answered."""
        import time

        with self._lock:
            return time.monotonic() - self.last_ok

    def silent(self, seconds: float) -> tuple[list[int], float]:
        """``(ranks, for how long)``: the ranks (not left) whose heartbeat has not moved for ``seconds``, and how
        long the most recent of them has been silent (what is known: while the store does not answer, nothing new
        is learnt about them)."""
        import time

        now = time.monotonic()
        with self._lock:
            quiet = {r: now - t for r, t in self.moved.items() if r not in self.left and now - t > seconds}
        return sorted(quiet), min(quiet.values(), default=0.0)

    def name(self, ranks: list[int]) -> str:
        """``rank 3 on node 1 (host)``, ``ranks 2, 3 on node 1 (host) and rank 5 on node 2 (host)``."""
        by_node: dict[tuple[str, str], list[int]] = {}
        for r in ranks:
            by_node.setdefault(self.who.get(r, ("", "")), []).append(r)
        parts = []
        for (node, host), rs in by_node.items():
            text = ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs[:8])) + (" ..." if rs[8:] else "")
            if node != "":
                text += f" on node {node}"
            if host:
                text += f" ({host})"
            parts.append(text)
        return " and ".join(parts)

    def verdict(self, seconds: float) -> str | None:
        """One line for what has been silent for ``seconds``: the store, else ranks (None: nothing)."""
        limit = f"(train.dist_timeout = {self.timeout:g} s)"
        store = self.store_silence()
        if store > seconds:
            why = f": {self.broken}" if self.broken else ""
            return (f"torchrun's store at {self.address[0]}:{self.address[1]} stopped answering for {store:.0f} s "
                    f"{limit}{why}: node 0, whose torchrun hosts it, died, froze or lost the network")
        ranks, quiet = self.silent(seconds)
        if not ranks:
            return None
        # The others that went silent with them (a node's ranks stop within a heartbeat of one another).
        ranks = self.silent(min(seconds, 3 * self.interval))[0]
        return (f"{self.name(ranks)} stopped answering for {quiet:.0f} s {limit}: {_died(ranks)}, froze or lost "
                "the network")


def _died(ranks: list[int]) -> str:
    return "its process or node died" if len(ranks) == 1 else "their processes or node died"


def _exit_lost(message: str) -> None:
    """The watch's verdict: record it for the launcher (or print it) and end this process now: the main thread may
    be blocked in a collective that would wait longer, or that has no timeout (NCCL's wait on the GPU)."""
    from mtpipe.training.failures import fail_now

    fail_now("peer", message, 1)


def lost_peers(error: BaseException) -> str | None:
    """For a collective (or store call) that failed in this process: one line naming the ranks that stopped
    answering, as the heartbeat watch sees them, or None when ``error`` is not such a failure or nobody is silent.

    A peer whose process is gone fails a gloo collective at once ("Connection closed by peer"), before its
    heartbeat is missed: the watch is given a few heartbeats to notice. A collective that timed out while every rank
    still beats names the timeout instead (a rank alive but stuck)."""
    import time

    w = _watch
    text = str(error).lower()
    gone = any(m in text for m in _GONE_MARKS)
    timed_out = "timed out" in text or "timeout" in text
    if w is None or not (gone or timed_out):
        return None
    deadline = time.monotonic() + 5 * w.interval
    while True:
        ranks, quiet = w.silent(3 * w.interval)
        store = w.broken is not None or w.store_silence() > 5 * w.interval
        if ranks or store or time.monotonic() > deadline:
            break
        time.sleep(w.interval / 4)
    limit = f"(train.dist_timeout = {w.timeout:g} s)"
    if store:
        why = f" ({w.broken})" if w.broken else f" for {w.store_silence():.0f} s"
        return (f"torchrun's store at {w.address[0]}:{w.address[1]} stopped answering{why}: node 0, whose torchrun "
                "hosts it, died, froze or lost the network")
    if ranks and gone:
        gone_ = "is gone (its connection closed)" if len(ranks) == 1 else "are gone (their connections closed)"
        return f"{w.name(ranks)} {gone_}: {_died(ranks)}"
    if ranks:
        return f"{w.name(ranks)} stopped answering for {quiet:.0f} s {limit}: {_died(ranks)}, froze or lost the network"
    if timed_out:
        return (f"a collective got no answer for {group_timeout(w.timeout):g} s {limit} though every rank still "
                "beats: one is stuck or far slower than the others (the first update's torch.compile? a checkpoint "
                "written to slow storage?); raise train.dist_timeout if that is expected")
    return None
