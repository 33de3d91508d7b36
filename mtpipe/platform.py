"""The machine a process runs on and what mtpipe makes of it: device, CPU, kernels, threads, precision, autocast.

Each is decided here once, from the settings and the machine: the device (:func:`use_gpu`, :func:`decoding_device`),
the CPU (:func:`cpu`: the kernels torch dispatches, the instruction sets, native bf16), the kernel libraries torch
has for it (:func:`kernels`: oneDNN, fbgemm), the CPUs this process may use and the threads each of N processes
takes (:func:`cpu_count`, :func:`threads_per_process`, :func:`torchrun_threads`, :func:`torch_threads`,
:func:`threads`), what ``train.precision: auto`` means (:func:`training_precision`), how float32 matmuls run on a GPU
(:func:`set_fp32_matmuls`), and the autocast context forward passes run under (:func:`autocast`). Every other module
asks here.

Why one place: these decisions used to be made where each was needed, and read the machine each its own way; a
benchmark that asked "what on an AVX2 CPU" had to flip globals in several modules. Here the machine is probed lazily,
on the first question, and remembered (importing this module costs nothing and loads no torch); nothing is a switch
to flip: a test or a benchmark asks through :func:`assume_cpu`, which changes what mtpipe decides for the CPU (not
what torch dispatches, which torch fixes when it loads).

The operators' own choices given a device (which attention kernel, which dropout) stay with the operators,
:mod:`mtpipe.model.ops`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from mtpipe import env
from mtpipe.errors import MtpipeError

if TYPE_CHECKING:
    import torch

# --------------------------------------------------------------------------------------------------------------------
# The CPU
# --------------------------------------------------------------------------------------------------------------------

# ONEDNN_MAX_CPU_ISA values below the first with bf16 instructions (AVX512_CORE_BF16): oneDNN then runs bf16
# matmuls through slow conversions, as on a CPU without native bf16.
_ISAS_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                                "AVX512_CORE_VNNI"})


@dataclasses.dataclass(frozen=True)
class CPU:
    """The CPU as torch and oneDNN see it in this process."""

    capability: str  # the kernels torch dispatches: DEFAULT, AVX2, AVX512, ... (ATEN_CPU_CAPABILITY can lower it)
    restriction: str  # ATEN_CPU_CAPABILITY as set, lower case ('': none): how an AVX2-only CPU is emulated
    isa_limit: str  # ONEDNN_MAX_CPU_ISA as set ('': none), oneDNN's instruction-set limit
    flags: frozenset[str]  # the CPU's instruction-set flags (/proc/cpuinfo's; none where there is no such file)

    @classmethod
    def probe(cls) -> CPU:
        """This process's CPU, read now (:func:`cpu` reads it once)."""
        import torch

        return cls(capability=torch.backends.cpu.get_cpu_capability(),
                   restriction=(env.get("ATEN_CPU_CAPABILITY") or "").strip().lower(),
                   isa_limit=env.get("ONEDNN_MAX_CPU_ISA", "") or "", flags=_cpuinfo_flags())

    @property
    def native_bf16(self) -> bool:
        """Whether this CPU has native bf16 matmuls (AMX-BF16 or AVX512-BF16) that torch may use; without them bf16
        autocast is slower than fp32 on CPU. A restriction of the instruction set (``ATEN_CPU_CAPABILITY=avx2``,
        ``ONEDNN_MAX_CPU_ISA=AVX2``: how an AVX2-only CPU is emulated, or a user's choice) counts as their
        absence."""
        capability = self.capability.upper()
        if "AMX" in capability:
            return True
        if "AVX512" not in capability or (self.isa_limit or "ALL").strip().upper() in _ISAS_WITHOUT_BF16:
            return False
        return bool({"amx_bf16", "avx512_bf16"} & self.flags)


def _cpuinfo_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[-1].split())
    return frozenset()


@functools.cache
def _probed_cpu() -> CPU:
    return CPU.probe()


_assumed: CPU | None = None  # set by assume_cpu only


def cpu() -> CPU:
    """This process's CPU (:class:`CPU`), probed on the first call; inside :func:`assume_cpu`, the CPU assumed."""
    return _assumed if _assumed is not None else _probed_cpu()


@contextlib.contextmanager
def assume_cpu(**facts: object) -> Iterator[CPU]:
    """Inside the block, mtpipe decides as on this CPU with ``facts`` changed (:class:`CPU`'s fields, e.g.
    ``capability="AVX2"``): how a test or a benchmark asks what mtpipe does elsewhere. torch's own kernels are
    unchanged (torch fixes them when it loads: a fresh process with ``ATEN_CPU_CAPABILITY`` set changes them)."""
    global _assumed
    before = _assumed
    _assumed = dataclasses.replace(cpu(), **facts)
    try:
        yield _assumed
    finally:
        _assumed = before


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The CPU kernel libraries this torch build has."""

    onednn: bool  # oneDNN: CPU autocast's bf16 products, torch.compile's frozen weights
    fbgemm: bool  # fbgemm: decode.precision=int8's quantised products on x86
    quantised: str  # torch's quantised engine, which int8 decoding's layers run on (x86, fbgemm, qnnpack, ...)


@functools.cache
def kernels() -> Kernels:
    """What this torch build offers (:class:`Kernels`), asked once."""
    import torch

    return Kernels(onednn=torch.backends.mkldnn.is_available(),
                   fbgemm="fbgemm" in torch.backends.quantized.supported_engines,
                   quantised=torch.backends.quantized.engine)


@dataclasses.dataclass(frozen=True)
class OneDNNLinear:
    """oneDNN's float32 linear kernel and its weight packer, as this torch build exposes them."""

    linear: Callable[..., Any]  # (x [..., in], weight [out, in] or packed, bias) -> x W^T + b
    pack: Callable[[Any], Any]  # weight [out, in] -> the same weight in oneDNN's pre-packed, blocked layout


# Entries of each of oneDNN's two caches of compiled kernels (its primitive cache, ONEDNN_PRIMITIVE_CACHE_CAPACITY,
# and the one torch's oneDNN bindings keep, LRU_CACHE_CAPACITY; 1024 each by default) in a process that decodes on
# oneDNN's float32 kernel: one kernel per product shape, and a corpus's batches bring new shapes for a long time.
KERNEL_CACHE = 64


@functools.cache
def onednn_linear() -> OneDNNLinear | None:
    """oneDNN's float32 linear kernel (:class:`OneDNNLinear`), or None where this torch build lacks it: asked once,
    on the first call, by one small product (x86 and aarch64 builds have it).

    Before that first product, oneDNN's kernel caches are bounded to :data:`KERNEL_CACHE` entries each (unless
    the variables are set): with their default 1024, a decode of a large corpus grew by hundreds of MB as batches of
    new shapes filled them (a kernel of a few hundred KB per shape), at no gain in speed over 64 entries
    (docs/decoding.md, "Memory"). oneDNN reads the variables when it first builds a kernel, so a process that ran
    oneDNN before keeps their earlier values."""
    import torch

    if not kernels().onednn:
        return None
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        env.put(name, str(KERNEL_CACHE), replace=False)
    ops = torch.ops.mkldnn
    try:
        if not bool(ops._linear_pointwise(torch.ones(2, 3), torch.ones(4, 3), None, "none", [], "").eq(3).all()):
            return None
    except (RuntimeError, AttributeError, NotImplementedError):  # an op this build lacks
        return None
    return OneDNNLinear(linear=lambda x, w, b: ops._linear_pointwise(x, w, b, "none", [], ""),
                        pack=lambda w: ops._reorder_linear_weight(w, 256))  # 256 rows: a hint for the blocking


# --------------------------------------------------------------------------------------------------------------------
# CPUs and threads
# --------------------------------------------------------------------------------------------------------------------


@functools.cache
def cpu_count() -> int:
    """The CPUs this process may run on: its affinity mask (a container's or taskset's limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_process(threads: int, processes: int = 1) -> int:
    """CPU threads for each of ``processes`` processes: ``threads`` when set (> 0), else this process's CPUs
    (:func:`cpu_count`) split evenly, at least one each."""
    return threads if threads > 0 else max(1, cpu_count() // processes)


def set_threads(threads: int) -> None:
    """torch's CPU threads from now on: ``threads`` when set (> 0); 0 leaves torch's own choice."""
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def torch_threads(threads: int = 0) -> int:
    """``threads`` when set (> 0), else the CPU threads torch runs with now (its own choice, which
    ``OMP_NUM_THREADS`` fixes, or what :func:`set_threads` set): what a library beside torch (CTranslate2) is told
    to use, so that it takes what torch would."""
    if threads > 0:
        return threads
    import torch

    return torch.get_num_threads()


def torchrun_threads(threads: int, processes: int, environ: Mapping[str, str]) -> int:
    """``train.threads`` for each of ``processes`` training processes that torchrun starts (``environ``: the
    environment they inherit): as set (> 0); 0 (torch's own choice) when ``OMP_NUM_THREADS`` is set, which then
    decides; else this machine's CPUs split evenly (:func:`threads_per_process`), since torchrun alone gives each
    process one thread (``OMP_NUM_THREADS=1``): ``train.nproc=2`` on 8 cores runs 2 x 4 threads, not 2 x 1."""
    if threads > 0 or "OMP_NUM_THREADS" in environ:
        return threads
    return threads_per_process(0, processes)


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's CPU threads ``n`` (> 0; 0 leaves them) inside the block, and as they were after it (a call made
    in-process: a test's, a notebook's)."""
    import torch

    before = torch.get_num_threads()
    set_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------------------------------------------------
# The device
# --------------------------------------------------------------------------------------------------------------------

# Precisions that run on the CPU only: int8's dynamically quantised linear layers are torch.ao modules with CPU
# kernels (fbgemm, qnnpack) only.
CPU_ONLY_PRECISIONS = ("int8",)


def use_gpu(spec: str, key: str) -> bool:
    """``train.device`` / ``decode.device`` (``key``) as a choice: ``auto`` uses the GPU when one is visible, ``cuda``
    does (an error when none is visible), ``cpu`` does not."""
    import torch

    if spec == "cuda" and not torch.cuda.is_available():
        raise MtpipeError(f"{key}=cuda but no CUDA GPU is visible to this process")
    return spec == "cuda" or (spec == "auto" and torch.cuda.is_available())


def may_decode_on_gpu(spec: str, precision: str) -> bool:
    """Whether ``decode.device`` = ``spec`` lets decoding at ``precision`` use a GPU at all, asked without torch (a
    CPU worker never initialises CUDA): not on ``cpu``, and ``auto`` keeps the CPU-only precisions (int8) on the
    CPU."""
    return spec != "cpu" and not (spec == "auto" and precision in CPU_ONLY_PRECISIONS)


def decoding_device(spec: str, precision: str) -> torch.device:
    """``decode.device``: ``cpu``, ``cuda`` (an error when no GPU is visible) or ``auto``: the GPU when one is
    visible, except for the precisions that run on the CPU only (int8)."""
    import torch

    gpu = may_decode_on_gpu(spec, precision) and use_gpu(spec, "decode.device")
    return torch.device("cuda" if gpu else "cpu")


def check_decoding_device(precision: str, device: torch.device) -> None:
    """An error when decoding at ``precision`` cannot run on ``device`` (int8 on a GPU)."""
    if precision in CPU_ONLY_PRECISIONS and device.type != "cpu":
        raise MtpipeError(f"decode.precision={precision} runs on CPU only; use bf16 on a GPU")


# --------------------------------------------------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------------------------------------------------


def training_precision(precision: str, device: torch.device) -> str:
    """``train.precision`` on ``device``: ``auto`` = bf16 where the hardware has it natively (else fp16 + grad scaler
    on older GPUs, fp32 on CPU: :attr:`CPU.native_bf16`); an explicit choice the device lacks is an error."""
    if device.type == "cuda":
        import torch

        # Native bf16 only (Ampere and newer): torch's default also counts emulation, which would train a P100 or
        # V100 in a bf16 many times slower than its fp16.
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        if precision == "auto":
            return "bf16" if bf16 else "fp16"
        if precision == "bf16" and not bf16:
            raise MtpipeError(f"train.precision=bf16: {torch.cuda.get_device_name(device)} has no bf16; use fp16")
        return precision
    if precision == "fp16":
        raise MtpipeError("train.precision=fp16 needs a CUDA GPU (its grad scaler is GPU-only); on CPU use bf16 or "
                          "fp32")
    if precision == "auto":
        return "bf16" if cpu().native_bf16 else "fp32"
    return precision


def set_fp32_matmuls(device: torch.device) -> None:
    """How float32 matmuls and convolutions run on ``device`` from now on (a training process's): on a CUDA GPU as
    TF32 on the tensor cores (the work of fp32 runs, and the float32 ops that bf16/fp16 autocast keeps), faster than
    full float32 where the GPU has them (Ampere and newer; elsewhere nothing changes); on the CPU as torch's
    default, full float32."""
    if device.type == "cuda":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """What a forward pass at ``precision`` runs under on ``device``: autocast to bf16 or fp16 (the matmuls in that
    dtype, softmax, norms and losses in float32), nothing for fp32 (or int8, whose layers choose their own
    arithmetic). Training's forward passes, validation's and decoding's steps all enter this one."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


__all__ = ["CPU", "CPU_ONLY_PRECISIONS", "Kernels", "OneDNNLinear", "assume_cpu", "autocast", "check_decoding_device",
           "cpu", "cpu_count", "onednn_linear", "decoding_device", "kernels", "may_decode_on_gpu", "set_fp32_matmuls", "set_threads",
           "threads", "threads_per_process", "torch_threads", "torchrun_threads", "training_precision", "use_gpu"]
