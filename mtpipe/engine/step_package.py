"""``decode.compile`` on CPU in float32: the decoder's step compiled ahead of time and kept on disk.

``decode.compile=aot`` (:mod:`mtpipe.engine.runners`): ``torch.compile`` freezes the weights into the compiled step
(inductor's ``freezing``: constants packed once for oneDNN) and builds such a graph again in every process (tens of
seconds on a small CPU: tracing, lowering, the C++ wrapper), and its on-disk caches skip frozen graphs. Here the same
step is exported (``torch.export``, every per-call dimension dynamic) and compiled by AOTInductor into a package, one
file per model, step variant and environment, under :class:`PackageCache`; a later process loads it in seconds. The
packaged step also runs without torch.compile's guards and Python wrapper, a little faster than torch.compile's.

The package's key (:func:`package_key`) covers everything its code depends on: the weights' bytes, the input
variant (which optional inputs there are, their ranks and dtypes), the torch version, the CPU code torch
dispatches (an AVX2-restricted process never loads an AVX-512 package), the source of mtpipe's step and the example
sizes it is exported on (:data:`_SIZES`, every varying size distinct). Each package keeps beside it, in its json
record, the sizes it accepts and the hash of its bytes taken when it was built; a call outside those sizes runs the
``fallback`` (torch.compile's step), as does every call when the export or build fails (one warning, with the reason).

A package is native code and frozen weights that run unchecked, so it is never trusted for its name: every load
first hashes the file and compares the record (:func:`verify`). Bytes overwritten inside a package keep its size
and often still load, then decode wrongly or crash; a package that differs from its record, or has none (written by
an older mtpipe, or its record lost), is built again, with a one-line warning naming it.

The cache is bounded (:func:`prune`): after each build, the least recently used packages beyond
``$MTPIPE_CACHE_MAX_GB`` (default 5) are removed with their ranges and lock files, so that decoding checkpoint
after checkpoint does not fill the disk (a lock file is removed by a holder of its lock; :func:`_locked` makes a
process that waited on a removed one lock the file now at its path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from mtpipe import env as mtenv
from mtpipe import platform
from mtpipe.atomic import _umask
from mtpipe.console import info, warn
from mtpipe.errors import MtpipeError
from mtpipe.reading import cache_root


@dataclasses.dataclass(frozen=True)
class PackageCache:
    """Where packages are kept and how much they may take (``decode.package_cache``, ``decode.package_cache_gb``;
    the environment's ``MTPIPE_CACHE_DIR`` and ``MTPIPE_CACHE_MAX_GB`` override them). A package holds a copy of the
    model's weights: :func:`prune` keeps them under the limit; deleting the directory is safe."""

    directory: str = ""
    max_gb: float = 5.0

    def path(self) -> Path:
        """``decode-step/`` below the cache root (:func:`mtpipe.reading.cache_root`); mtpipe writes nothing else
        there."""
        return cache_root(self.directory) / "decode-step"

    def limit_bytes(self) -> int:
        raw = mtenv.get("MTPIPE_CACHE_MAX_GB", "").strip()
        try:
            gb = float(raw) if raw else float(self.max_gb)
        except ValueError:
            gb = -1.0
        if not gb >= 0:  # also NaN
            raise MtpipeError(f"MTPIPE_CACHE_MAX_GB: {raw!r} is not a size in GB (a number >= 0)")
        return int(gb * 1e9)


# The files mtpipe writes in the cache (:func:`package_key` names): a package, its ranges, its lock; and a build's
# temporary files (tempfile.mkstemp's names after the key). Nothing else there is touched.
_PACKAGE = re.compile(r"[0-9a-f]{32}\.pt2")
_LOCK = re.compile(r"[0-9a-f]{32}\.lock")
_PARTIAL = re.compile(r"[0-9a-f]{32}\.[^/]+\.partial(\.pt2)?")
# A build's temporary file older than this was left by a process that was killed (a build takes a minute or two)
_STALE_PARTIAL_S = 24 * 3600


def prune(directory: Path, keep: Path, limit: int) -> tuple[int, int]:
    """Remove the least recently used packages (a package's time is its file's, set when it is built or loaded) from
    ``directory`` until the rest take at most ``limit`` bytes, never ``keep`` (the package just built) nor one that
    a process is loading or building (its lock is held); with each, its ranges and its lock. Also a lock or ranges
    file whose package is gone (a failed build's) once no process holds that lock, and a killed build's temporary
    files older than a day. Only mtpipe's own file names are looked at. Returns the packages removed and their
    bytes."""
    now = time.time()
    found, orphans = [], []
    try:
        names = list(directory.iterdir())
    except OSError:  # an unreadable directory: the package just built still runs
        return 0, 0
    for p in names:
        with contextlib.suppress(OSError):  # another process may remove it meanwhile
            if _PACKAGE.fullmatch(p.name):
                st = p.stat()
                found.append((st.st_mtime, st.st_size, p))
            elif _LOCK.fullmatch(p.name) and not p.with_suffix(".pt2").exists():
                orphans.append(p.with_suffix(".pt2"))
            elif _PARTIAL.fullmatch(p.name) and now - p.stat().st_mtime > _STALE_PARTIAL_S:
                p.unlink()
    for p in orphans:  # a package that is not there and no process is building: its lock and ranges go
        with contextlib.suppress(OSError), _locked(p.with_suffix(".lock"), wait=False) as held:
            if held and not p.exists():
                _remove(p)
    total = sum(size for _, size, _ in found)
    removed = freed = 0
    for _, size, p in sorted(found, key=lambda f: f[0]):  # oldest use first
        if total <= limit:
            break
        if p == keep:
            continue
        with contextlib.suppress(OSError), _locked(p.with_suffix(".lock"), wait=False) as held:
            if not held:
                continue
            _remove(p)
            total, removed, freed = total - size, removed + 1, freed + size
    return removed, freed


def _remove(package: Path) -> None:
    """Remove ``package``, its ranges and its lock; the caller holds that lock (see :func:`_locked`)."""
    package.with_suffix(".json").unlink(missing_ok=True)
    package.unlink(missing_ok=True)
    package.with_suffix(".lock").unlink(missing_ok=True)  # last: whoever waits on it locks the next one there


@contextlib.contextmanager
def _locked(path: Path, wait: bool):
    """Take the lock file ``path`` (waiting for it if ``wait``) and yield whether it was taken; released on exit.
    Lock files are removed with their package (:func:`_remove`, by a holder of the lock), so a process that waited
    on one may hold a file no longer at ``path``: it then locks the file that is there now (creating it), so that
    two processes never both hold "the" lock of one package."""
    import fcntl

    while True:
        with open(path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                current = os.path.samestat(os.fstat(lock.fileno()), os.stat(path))
            except FileNotFoundError:
                current = False
            if current:
                yield True
                return


def weights_digest(module: torch.nn.Module) -> str:
    """sha256 of every parameter's and buffer's name, dtype, shape and bytes (~0.3 s for the base model's 60M)."""
    h = hashlib.sha256()
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    """Every source file of the model and engine packages (relative path and bytes), read once per process: code
    moved or edited anywhere the step could reach never loads a package built from other code."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(p for pkg in ("model", "engine") for p in (root / pkg).rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def package_key(weights: str, variant: tuple) -> str:
    """The package's file name: a digest of the weights, the input variant, the example sizes it is exported on
    (:data:`_SIZES`: they shape the generated code) and the environment its code was built for (torch's version and
    dispatched CPU code, oneDNN's ISA limit: :func:`mtpipe.platform.cpu`)."""
    cpu = platform.cpu()
    env = (torch.__version__, cpu.capability, cpu.isa_limit)
    return hashlib.sha256(repr((weights, variant, sorted(_SIZES.items()), env, _source_digest())).encode()
                          ).hexdigest()[:32]


# The example sizes a package is exported with (:meth:`PackagedStep._build`): distinct from each other and from
# any rows count (a multiple of the sentences), so that the export gives each a symbol of its own; and of a real
# batch's order, since inductor's C++ code generator reads them as the sizes to expect and splits a loop between
# threads only where that much work is worth it. Exported on a toy batch (a few sentences of a few source pieces),
# the encoder-decoder softmax ran on one thread while the other waited; these sizes give every loop of the step to
# both threads, which made the packaged step faster than torch.compile's in large batches and no slower in small ones
# (measured: docs/journal/2026-11-benchmarks.md, "Where the d-128 model's compiled fp32 decoding time goes").
_SIZES = {"sentences": 61, "positions": 17, "source": 23, "cache": 1031}


def _variant(flat: list[Tensor], has_mask: bool, has_index: bool, rows: int, sentences: int, layers: int) -> tuple:
    """What a package is built for besides the varying sizes: which optional inputs there are, greedy search (one
    row per sentence: rows and sentences are one size) or beams, a lone sentence (a size of 1, which the export
    fixes) or several, the layer count, every input's (``flat``, in call order) dtype and rank."""
    return (has_mask, has_index, rows == sentences, sentences == 1, layers, tuple((t.dtype, t.dim()) for t in flat))


class _Step(torch.nn.Module):
    """:meth:`~mtpipe.model.transformer.Transformer.step` with its optional inputs fixed by the variant, for
    export."""

    def __init__(self, model: torch.nn.Module, has_mask: bool, has_index: bool) -> None:
        super().__init__()
        self.model, self.has_mask, self.has_index = model, has_mask, has_index

    def forward(self, x: Tensor, k_prev: Tensor, v_prev: Tensor, cross: list[tuple[Tensor, Tensor]], src_mask: Tensor,
                extra: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        prev_mask = extra[0] if self.has_mask else None
        index = extra[-1] if self.has_index else None
        return self.model.step(x, k_prev, v_prev, prev_mask, cross, src_mask, index)


class PackagedStep:
    """A callable with :meth:`~mtpipe.model.transformer.Transformer.step`'s signature that runs each input variant's
    package (built on first use, or loaded from :class:`PackageCache`) and ``fallback`` where no package applies.
    ``dynamic_dims(x, k_prev, v_prev, index, prev_mask, cross, src_mask)`` lists the ``(tensor, dim, size)`` that
    vary from call to call, ``size`` naming which (:func:`mtpipe.engine.runners.step_dynamic_dims`)."""

    def __init__(self, model: torch.nn.Module, fallback: Callable[..., Any],
                 dynamic_dims: Callable[..., list[tuple[Tensor, int, str]]],
                 cache: PackageCache = PackageCache()) -> None:
        self.model, self.fallback, self.dynamic_dims, self.cache = model, fallback, dynamic_dims, cache
        self.weights = weights_digest(model)
        # variant -> (the loaded package, its input ranges), or None where it could not be built
        self.runners: dict[tuple, Any] = {}
        self.lock = threading.Lock()
        self.built = 0  # packages this object built (not loaded)

    def __call__(self, x: Tensor, k_prev: Tensor, v_prev: Tensor, prev_mask: Tensor | None,
                 cross: list[tuple[Tensor, Tensor]], src_mask: Tensor,
                 index: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        flat = [x, k_prev, v_prev, *(t for pair in cross for t in pair), src_mask,
                *(t for t in (prev_mask, index) if t is not None)]  # the package's inputs, in call order
        variant = _variant(flat, prev_mask is not None, index is not None, x.size(0), src_mask.size(0), len(cross))
        runner = self.runners.get(variant, False)
        if runner is False:
            with self.lock:  # one build per variant when threads decode with one model
                runner = self.runners.get(variant, False)
                if runner is False:
                    runner = self.runners[variant] = self._open(variant, x, k_prev, v_prev, prev_mask, cross,
                                                                src_mask, index)
        if runner is not None:
            package, ranges = runner
            # The shapes the export allowed (e.g. at least 2 sentences); others go to the fallback (the package's own
            # checks would refuse them too, with a line on stderr at every step)
            if all(lo <= flat[i].size(d) and (hi is None or flat[i].size(d) <= hi) for i, d, lo, hi in ranges):
                # The package's code assumes the layout it was exported with (contiguous): a no-op for the
                # decoder's inputs, which are contiguous
                extra = [t.contiguous() for t in (prev_mask, index) if t is not None]
                pairs = [(k.contiguous(), v.contiguous()) for k, v in cross]
                return tuple(package(x.contiguous(), k_prev.contiguous(), v_prev.contiguous(), pairs,
                                     src_mask.contiguous(), extra))
        return self.fallback(x, k_prev, v_prev, prev_mask, cross, src_mask, index)

    def _open(self, variant: tuple, x: Tensor, k_prev: Tensor, v_prev: Tensor, prev_mask: Tensor | None,
              cross: list[tuple[Tensor, Tensor]], src_mask: Tensor, index: Tensor | None) -> Any:
        """The variant's package, loaded from the cache or built into it (under a file lock, so that processes
        started together build it once); None, with a warning, if it cannot be built (or where there are no file
        locks: Windows)."""
        path = self.cache.path() / f"{package_key(self.weights, variant)}.pt2"
        limit = self.cache.limit_bytes()  # a bad setting is an error, not a reason to fall back
        try:
            # xxhash verifies every package (content_hash): imported here, where a package is used, so that only
            # decode.compile=aot needs it, and checked before the cache is touched (without it: compiled in process)
            import xxhash  # noqa: F401

            path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(path.with_suffix(".lock"), wait=True):
                # The package checks its inputs too (a call outside its shapes raises rather than computing
                # wrongly); the variable is read once, when the first package runs
                mtenv.put("AOTI_RUNTIME_CHECK_INPUTS", "1", replace=False)
                if path.is_file():
                    try:
                        return self._load(path)
                    except Unverified as e:  # modified, damaged or without a record: never run, built again
                        warn(f"decode.compile: {path}: {e}; building it again")
                    except Exception:  # noqa: BLE001 -- intact but unloadable (a changed C++ runtime): a package
                        # mtpipe wrote, so it is built again
                        pass
                    path.unlink()
                self._build(path, variant, x, k_prev, v_prev, prev_mask, cross, src_mask, index)
                self.built += 1
                runner = self._load(path)
                removed, freed = prune(path.parent, path, limit)
                if removed:
                    size = f"{freed / 1e9:.1f} GB" if freed >= 1e8 else f"{freed / 1e6:.0f} MB"
                    info(f"decode.compile: removed {removed} least recently used packaged step(s) ({size}) "
                         f"from {path.parent}, to keep it under MTPIPE_CACHE_MAX_GB")
                return runner
        except Exception as e:  # noqa: BLE001 -- any failure: the step still runs, through torch.compile
            first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
            warn(f"decode.compile: could not package the decoder step ahead of time ({first.strip()[:200]}); "
                 "compiling it in this process instead")
            return None

    @staticmethod
    def _load(path: Path) -> tuple[Any, list[tuple]]:
        """The package at ``path`` and its input ranges, after :func:`verify` (:class:`Unverified` if it fails)."""
        record = verify(path)
        ranges = [tuple(r) for r in record["ranges"]]
        package = torch._inductor.aoti_load_package(str(path))
        with contextlib.suppress(OSError):  # its time of last use, for prune (a read-only cache still loads)
            os.utime(path)
        return package, ranges

    def _build(self, path: Path, variant: tuple, x: Tensor, k_prev: Tensor, v_prev: Tensor,
               prev_mask: Tensor | None, cross: list[tuple[Tensor, Tensor]], src_mask: Tensor,
               index: Tensor | None) -> None:
        """Export the step on inputs shaped like these but with every varying size made distinct (:data:`_SIZES`),
        and compile it into ``path``. Why not on the call's own inputs: the export takes sizes that happen to be
        equal (2 cached positions for 2 sentences) for one size, and the package would then refuse or, worse,
        misread every call where they differ."""
        from torch.export import Dim

        has_mask, has_index, greedy, lone = variant[:4]
        sentences = 1 if lone else _SIZES["sentences"]
        sizes = dict(_SIZES, sentences=sentences, rows=sentences * (1 if greedy else 4))
        dims = self.dynamic_dims(x, k_prev, v_prev, index, prev_mask, cross, src_mask)
        resized: dict[int, list[int]] = {}
        for t, d, size in dims:
            resized.setdefault(id(t), list(t.shape))[d] = sizes[size]

        def example(t: Tensor) -> Tensor:  # the values do not matter: the export traces shapes
            return torch.zeros(resized.get(id(t), list(t.shape)), dtype=t.dtype, device=t.device)

        def spec(t: Tensor) -> dict[int, Any]:
            return {d: Dim.AUTO for u, d, _ in dims if u is t}

        optional = [t for t in (prev_mask, index) if t is not None]
        flat = [x, k_prev, v_prev, *(t for pair in cross for t in pair), src_mask, *optional]  # the call's order
        varying = {(next(i for i, u in enumerate(flat) if u is t), d) for t, d, _ in dims}
        args = (example(x), example(k_prev), example(v_prev), [(example(k), example(v)) for k, v in cross],
                example(src_mask), [example(t) for t in optional])
        shapes = (spec(x), spec(k_prev), spec(v_prev), [(spec(k), spec(v)) for k, v in cross], spec(src_mask),
                  [spec(t) for t in optional])
        with torch.no_grad():
            program = torch.export.export(_Step(self.model, has_mask, has_index).eval(), args,
                                          dynamic_shapes=shapes, strict=False)
            fd, tmp = tempfile.mkstemp(prefix=f"{path.stem}.", suffix=".partial.pt2", dir=path.parent)
            os.close(fd)
            try:
                torch._inductor.aoti_compile_and_package(program, package_path=tmp,
                                                         inductor_configs={"freezing": True})
                # the record (ranges and content hash) first, the package last: a package on disk always has its
                # record beside it
                _write(path.with_suffix(".json"), json.dumps({"ranges": _ranges(program, varying),
                                                              "content": content_hash(Path(tmp))}))
                os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600: the cache's files follow the umask
                os.replace(tmp, path)  # whole or absent: a build cut short leaves no package
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)


def _ranges(program: Any, varying: set[tuple[int, int]]) -> list[tuple[int, int, int, int | None]]:
    """``(input, dim, low, high)`` for each of the ``varying`` dimensions of the exported step's inputs (flattened in
    call order): the sizes the package was built for, ``high`` None where unbounded, ``low == high`` where the
    export fixed the size (a lone sentence's 1)."""
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    out = []
    for i, name in enumerate(program.graph_signature.user_inputs):
        for d, size in enumerate(nodes[name].meta["val"].shape):
            if (i, d) not in varying:
                continue
            if not isinstance(size, torch.SymInt):
                out.append((i, d, int(size), int(size)))
                continue
            bounds = program.range_constraints.get(size.node.expr)  # None: an expression of others' symbols
            if bounds is not None:
                out.append((i, d, int(bounds.lower), None if bool(bounds.upper > 2**62) else int(bounds.upper)))
    return out


class Unverified(Exception):
    """A package that does not match the record beside it, or has none: what is wrong, in a few words."""


def content_hash(path: Path, chunk: int = 1 << 22) -> str:
    """``xxh3_128:<hex>`` of a file's bytes. The record guards against damage, not an attacker (whoever can rewrite a
    package can rewrite its record too), so a fast non-cryptographic 128-bit hash does: it reads a package of hundreds
    of MB in a small fraction of the load it precedes, where sha256 would add a noticeable share."""
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return "xxh3_128:" + h.hexdigest()


def verify(path: Path) -> dict[str, Any]:
    """The record beside package ``path`` (its ``.json``: ``ranges`` and ``content``) once the package's bytes match
    its ``content`` hash; :class:`Unverified`, saying why, when the record is missing, unreadable or lacks the hash,
    or the bytes differ."""
    record_path = path.with_suffix(".json")
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise Unverified(f"no record ({record_path.name}) beside it") from None
    except (OSError, ValueError) as e:
        raise Unverified(f"its record {record_path.name} is unreadable ({e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("ranges"), list):
        raise Unverified(f"its record {record_path.name} is not a package record")
    if not isinstance(record.get("content"), str):
        raise Unverified(f"its record {record_path.name} holds no content hash (written by an older mtpipe)")
    if content_hash(path) != record["content"]:
        raise Unverified("its bytes do not match the content hash recorded when it was built (modified or damaged)")
    return record


def _write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f"{path.stem}.", suffix=".partial", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600: the cache's files follow the umask
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


__all__ = ["PackagedStep", "PackageCache", "package_key", "prune",
           "weights_digest"]
