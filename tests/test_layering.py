"""The package's shape, read from its source: layers, cycles, sizes, environment variables, dvc.yaml's deps.

The layering rule (docs/development.md): foundation (errors, env, console, writing, artifacts, config, params) <
model < engine < {training, stages, serve} < cli; a module imports from its own layer or lower ones only, training,
stages and serve never import each other, and no two modules import each other, lazily (inside a function) or not.
Every import counts: top-level, in functions, under ``TYPE_CHECKING`` and ``importlib.import_module("...")``.
Each test reports every breach it finds in one message.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "mtpipe"

FOUNDATION = {"mtpipe", "mtpipe.errors", "mtpipe.atomic", "mtpipe.env", "mtpipe.memory", "mtpipe.console",
              "mtpipe.writing", "mtpipe.artifacts", "mtpipe.reading", "mtpipe.sections", "mtpipe.registry",
              "mtpipe.config_inference", "mtpipe.config", "mtpipe.params", "mtpipe.platform"}
TOP = {"mtpipe.cli", "mtpipe.__main__"}
SIDE_BY_SIDE = ("training", "stages", "serve")  # one layer; never import each other

MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 60
# The beam search's step reads as the algorithm it is: one method on purpose (its class docstring says why).
LONG_FUNCTIONS = {("mtpipe/engine/search.py", "BeamSearch.advance")}
# torch's compiler and CUDA graph code: the engine's business (mtpipe/engine), never the model's.
COMPILER = re.compile(r"^torch\.(_dynamo|_inductor|cuda\.graphs?|cuda\.CUDAGraph)(\.|$)")


# --------------------------------------------------------------------------------------------------------------------
# Reading the source
# --------------------------------------------------------------------------------------------------------------------


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@functools.cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def imported_names(path: Path) -> list[tuple[str, int]]:
    """``(dotted name, line)`` of everything ``path`` imports, anywhere in it: ``import a.b`` gives a.b,
    ``from a import b`` gives a.b (a module or a name of a), ``import_module("a.b")`` gives a.b."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__"):
                out.append((node.args[0].value, node.lineno))
    return out


def resolve_module(dotted: str) -> str | None:
    """The mtpipe module that importing ``dotted`` runs (``mtpipe.config.DecodeConfig`` -> mtpipe.config)."""
    known = modules()
    while dotted:
        if dotted in known:
            return dotted
        dotted = dotted.rpartition(".")[0]
    return None


@functools.cache
def graph() -> dict[str, dict[str, int]]:
    """module -> {mtpipe module it imports: first line}."""
    edges: dict[str, dict[str, int]] = {}
    for name, path in modules().items():
        mine = edges.setdefault(name, {})
        for dotted, line in imported_names(path):
            target = resolve_module(dotted) if dotted.split(".")[0] == "mtpipe" else None
            if target is not None and target != name:
                mine.setdefault(target, line)
    return edges


def layer(name: str) -> tuple[int, str]:
    """(rank, group) of a module; rank -1: a module no layer claims."""
    if name in FOUNDATION:
        return 0, "foundation"
    if name in TOP:
        return 4, "cli"
    sub = name.split(".")[1] if name.count(".") >= 1 else ""
    if sub == "model":
        return 1, "model"
    if sub == "engine":
        return 2, "engine"
    if sub in SIDE_BY_SIDE:
        return 3, sub
    return -1, "?"


def where(name: str, line: int | None = None) -> str:
    rel = modules()[name].relative_to(REPO)
    return f"{rel}:{line}" if line else str(rel)


def closure(starts: set[str]) -> set[str]:
    seen, todo = set(), list(starts)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += graph().get(name, {})
    return seen


# --------------------------------------------------------------------------------------------------------------------
# Layers and cycles
# --------------------------------------------------------------------------------------------------------------------


def test_every_module_has_a_layer():
    lost = [where(name) for name in modules() if layer(name)[0] < 0]
    assert not lost, "modules outside every layer (put them in a layer's package, or in FOUNDATION):\n" + \
        "\n".join(lost)


def test_no_import_cycles():
    """Tarjan's strongly connected components of the import graph: any with two or more modules is a cycle."""
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # recursion depth: the longest import chain (a few dozen modules)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph()[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for v in graph():
        if v not in index:
            visit(v)
    lines = []
    for part in cycles:
        inside = [f"{where(a, line)} imports {b}" for a in part for b, line in graph()[a].items() if b in part]
        lines.append(" <-> ".join(part) + "\n    " + "\n    ".join(inside))
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(lines)


def test_layering_rule():
    breaches = []
    for a, targets in graph().items():
        (ra, ga), name_a = layer(a), a
        for b, line in targets.items():
            rb, gb = layer(b)
            if ra < 0 or rb < 0:
                continue  # test_every_module_has_a_layer
            if rb > ra:
                breaches.append(f"{where(name_a, line)}: {a} ({ga}) imports {b} ({gb}), a higher layer")
            elif ra == rb == 3 and ga != gb:
                breaches.append(f"{where(name_a, line)}: {a} ({ga}) imports {b} ({gb}); {' / '.join(SIDE_BY_SIDE)} "
                                "never import each other")
    assert not breaches, f"{len(breaches)} layer breach(es):\n" + "\n".join(breaches)


def _attribute_chain(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def test_model_has_no_compiler_or_cuda_graph_code():
    """mtpipe/model is the paper's model: weights and maths. Compiling and graph capture are the engine's."""
    found = []
    for name, path in modules().items():
        if layer(name)[1] != "model":
            continue
        for dotted, line in imported_names(path):
            if COMPILER.match(dotted):
                found.append(f"{where(name, line)}: imports {dotted}")
        for node in ast.walk(tree(path)):
            chain = _attribute_chain(node) if isinstance(node, ast.Attribute) else ""
            if chain and COMPILER.match(chain) and not isinstance(getattr(node, "ctx", None), ast.Del):
                found.append(f"{where(name, node.lineno)}: uses {chain}")
    assert not found, "compiler / CUDA graph code in mtpipe/model:\n" + "\n".join(sorted(set(found)))


def _functions(node: ast.AST, prefix: str = ""):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            qual = prefix + child.name
            yield qual, child
            yield from _functions(child, qual + ".")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, prefix + child.name + ".")
        else:
            yield from _functions(child, prefix)


def test_module_and_function_sizes():
    over = []
    for name, path in modules().items():
        rel = str(path.relative_to(REPO))
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            over.append(f"{rel}: {lines} lines (at most {MAX_MODULE_LINES})")
        for qual, fn in _functions(tree(path)):
            length = fn.end_lineno - fn.lineno + 1
            if length > MAX_FUNCTION_LINES and (rel, qual) not in LONG_FUNCTIONS:
                over.append(f"{rel}:{fn.lineno}: {qual} is {length} lines (at most {MAX_FUNCTION_LINES})")
    assert not over, f"{len(over)} over the size limits:\n" + "\n".join(over)


# --------------------------------------------------------------------------------------------------------------------
# Platform decisions: made in mtpipe/platform.py only
# --------------------------------------------------------------------------------------------------------------------

PLATFORM_MODULE = "mtpipe.platform"
# What reads the machine or decides from it (the CPU's features, the kernel libraries, the CPU count and threads,
# precision -- TF32 and float32 matmuls' precision included -- and autocast): dotted names used or imported, as
# prefixes.
PLATFORM_CALLS = re.compile(r"^(torch\.backends\.cpu\.get_cpu_capability|torch\.backends\.(mkldnn|quantized)"
                            r"|torch\.ops\.mkldnn|torch\.(amp\.|cpu\.amp\.|cuda\.amp\.)?autocast"
                            r"|torch\.(set|get)_num(_interop)?_threads|torch\.cuda\.is_bf16_supported"
                            r"|torch\.backends\.cuda\.matmul|torch\.backends\.cudnn\.allow_tf32"
                            r"|torch\.(set|get)_float32_matmul_precision"
                            r"|os\.(cpu_count|sched_getaffinity)|multiprocessing\.cpu_count)(\.|$)")
# The variables that restrict the CPU's instruction sets, read by platform alone (env.py's table names them all).
PLATFORM_VARIABLES = {"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS"}


def _docstrings(module: ast.Module) -> set[int]:
    """ids of the docstring nodes of a module and its classes and functions (prose, which may name anything)."""
    found = set()
    for node in ast.walk(module):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            found.add(id(node.body[0].value))
    return found


def platform_decisions(module: ast.Module) -> list[tuple[int, str]]:
    """``(line, what)`` of every platform decision in ``module``: a use or import of :data:`PLATFORM_CALLS`, a string
    naming /proc/cpuinfo, or one of :data:`PLATFORM_VARIABLES` as a value (docstrings aside)."""
    found, prose = [], _docstrings(module)
    for node in ast.walk(module):
        if isinstance(node, ast.Attribute) and PLATFORM_CALLS.match(_attribute_chain(node)):
            found.append((node.lineno, _attribute_chain(node)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names if node.module and not node.level]
            found += [(node.lineno, f"imports {n}") for n in names if PLATFORM_CALLS.match(n)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose \
                and ("cpuinfo" in node.value or node.value in PLATFORM_VARIABLES):
            found.append((node.lineno, repr(node.value)))
    # a chain's prefixes are attributes too (torch.backends.mkldnn.is_available -> torch.backends.mkldnn): once a line
    return sorted({line: what for line, what in sorted(found, key=lambda f: len(f[1]))}.items())


def test_platform_decisions_are_made_in_platform_only():
    """The CPU's features (/proc/cpuinfo, torch's dispatched capability, the ISA variables), the kernel libraries
    (oneDNN, fbgemm), the CPU count and threads (torch's included: set, or read to tell another library), precision
    (TF32, float32 matmuls' precision) and autocast are decided in mtpipe/platform.py; every other module of mtpipe
    asks it (env.py's table names the variables it reads)."""
    breaches = [f"{where(name, line)}: {what}" for name, path in modules().items()
                if name not in (PLATFORM_MODULE, "mtpipe.env") for line, what in platform_decisions(tree(path))]
    assert not breaches, "platform decisions outside mtpipe/platform.py (ask mtpipe.platform instead):\n" + \
        "\n".join(breaches)


def test_the_platform_check_sees_each_kind_of_decision():
    source = '''"""Reads /proc/cpuinfo, ATEN_CPU_CAPABILITY and calls os.cpu_count() (prose only)."""
import os
from os import sched_getaffinity
import torch
from torch import autocast
def f():
    """torch.autocast and "cpuinfo" in a docstring are prose."""
    open("/proc/cpuinfo")
    env.get("ONEDNN_MAX_CPU_ISA")
    torch.backends.cpu.get_cpu_capability()
    torch.backends.mkldnn.is_available()
    torch.backends.quantized.supported_engines
    torch.autocast("cpu", dtype=torch.bfloat16)
    torch.set_num_threads(2)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.benchmark = torch.cuda.is_available()
    n = torch.get_num_threads()
    return os.cpu_count(), n
'''
    found = platform_decisions(ast.parse(source))
    # line 18: cudnn.benchmark and cuda.is_available() are not platform decisions (an algorithm search, a device
    # query)
    assert [line for line, _ in found] == [3, 5, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 19, 20], found


# --------------------------------------------------------------------------------------------------------------------
# Environment variables: one table (mtpipe/env.py), documented in docs/environment.md
# --------------------------------------------------------------------------------------------------------------------


def _os_environ_uses(path: Path) -> list[tuple[int, str]]:
    """Lines of ``path`` that touch the process environment directly: ``os.environ``, ``os.getenv``,
    ``os.putenv``, ``os.unsetenv`` or ``from os import environ``/``getenv``."""
    found = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                and node.attr in ("environ", "getenv", "putenv", "unsetenv", "environb"):
            found.append((node.lineno, f"os.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and {a.name for a in node.names} & {"environ", "getenv", "putenv", "environb"}:
            found.append((node.lineno, "from os import environ/getenv"))
    return found


def _env_calls(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` of every variable named by a literal in a call of mtpipe.env's get / put (``env.get``,
    ``mtenv.get``, ...), or looked up in ``environ()``'s mapping through ``env.get`` / ``env[...]``."""
    found = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "put") \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in ("env", "mtenv") \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            found.append((node.lineno, node.args[0].value))
    return found


def test_environment_is_read_through_the_table_only():
    """No module of mtpipe reads or writes os.environ but mtpipe/env.py; bench/ copies the whole environment for
    the processes it starts (``{**os.environ, ...}``), and reads single variables through mtpipe.env too."""
    from mtpipe import env

    bad = []
    for name, path in modules().items():
        if name != "mtpipe.env":
            bad += [f"{path.relative_to(REPO)}:{line}: {what}" for line, what in _os_environ_uses(path)]
    for path in sorted((REPO / "bench").rglob("*.py")):
        for line, what in _os_environ_uses(path):
            text = path.read_text(encoding="utf-8").splitlines()[line - 1]
            if not re.search(r"\*\*os\.environ|os\.environ\.items\(\)|dict\(os\.environ", text):
                bad.append(f"{path.relative_to(REPO)}:{line}: {what} (read it with mtpipe.env.get)")
    for path in [*modules().values(), *sorted((REPO / "bench").rglob("*.py"))]:
        bad += [f"{path.relative_to(REPO)}:{line}: {var} is not in mtpipe.env's table"
                for line, var in _env_calls(path) if var not in env.VARIABLES]
    assert not bad, "environment read around mtpipe/env.py:\n" + "\n".join(bad)


def _name_constants() -> dict[str, set[str]]:
    """Module-level constants of mtpipe that hold a variable's name (``REPORTS_ENV = "MTPIPE_..."``): name ->
    the constants' identifiers."""
    out: dict[str, set[str]] = {}
    for path in modules().values():
        for node in tree(path).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str):
                out.setdefault(node.value.value, set()).update(t.id for t in node.targets if isinstance(t, ast.Name))
    return out


def test_environment_table_names_its_readers_truly():
    """Each variable's read_by / set_by files name it (or a constant holding its name); each name is read somewhere
    or set for a library."""
    from mtpipe import env

    constants, wrong = _name_constants(), []
    for var in env.VARIABLES.values():
        for rel in (*var.read_by, *var.set_by):
            path = REPO / rel
            text = path.read_text(encoding="utf-8") if path.is_file() else ""
            if not any(re.search(rf"\b{n}\b", text) for n in {var.name, *constants.get(var.name, ())}):
                wrong.append(f"{var.name}: {rel} does not name it")
        if not var.read_by and not var.set_by:
            wrong.append(f"{var.name}: neither read nor set by anything")
    assert not wrong, "mtpipe/env.py's table is out of date:\n" + "\n".join(wrong)


def test_environment_docs_are_the_table():
    from mtpipe import env

    page = (REPO / "docs" / "environment.md").read_text(encoding="utf-8")
    assert page == env.markdown(), "docs/environment.md differs from mtpipe/env.py's table: run " \
        "`python -m mtpipe.env --markdown > docs/environment.md`"


def test_environment_accessor_refuses_unknown_names(monkeypatch: pytest.MonkeyPatch):
    from mtpipe import env

    monkeypatch.setenv("MTPIPE_RDZV_ID", "run7")
    assert env.get("MTPIPE_RDZV_ID") == "run7" and env.environ()["MTPIPE_RDZV_ID"] == "run7"
    assert "MTPIPE_RDZV_ID" in env.environ() and env.get("MTPIPE_NNODES", "1") in ("1", env.get("MTPIPE_NNODES"))
    for look in (lambda: env.get("MTPIPE_NO_SUCH"), lambda: env.environ().get("MTPIPE_NO_SUCH"),
                 lambda: "MTPIPE_NO_SUCH" in env.environ(), lambda: env.put("MTPIPE_NO_SUCH", "1")):
        with pytest.raises(env.UnknownVariable, match="MTPIPE_NO_SUCH"):
            look()


def test_no_import_changes_the_environment():
    """Importing every module of mtpipe leaves os.environ as it was (a command's function may set a variable at run
    time, through mtpipe.env.put, never an import)."""
    import os
    import subprocess
    import sys

    code = ("import importlib, os, sys; before = dict(os.environ)\n"
            f"for name in {sorted(n for n in modules() if n != 'mtpipe.__main__')!r}:\n"
            "    try:\n        importlib.import_module(name)\n"
            "    except ImportError as e:\n        print('skipped', name, e, file=sys.stderr)\n"
            "after = dict(os.environ)\n"
            "changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))\n"
            "assert not changed, changed\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "HF_HUB_OFFLINE")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


# --------------------------------------------------------------------------------------------------------------------
# bench/ and tests/: tests never import bench, bench never imports tests
# --------------------------------------------------------------------------------------------------------------------


def _top_names(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module))
    return found


def test_tests_and_bench_stay_apart():
    test_modules = {p.stem for p in (REPO / "tests").glob("*.py")}
    bad = [f"{p.relative_to(REPO)}:{line}: imports {name}" for p in sorted((REPO / "tests").glob("*.py"))
           for line, name in _top_names(p) if name.split(".")[0] == "bench"]
    bad += [f"{p.relative_to(REPO)}:{line}: imports {name}" for p in sorted((REPO / "bench").rglob("*.py"))
            for line, name in _top_names(p) if name.split(".")[0] in test_modules | {"tests"}]
    assert not bad, "tests import bench or bench imports tests:\n" + "\n".join(bad)


# --------------------------------------------------------------------------------------------------------------------
# dvc.yaml: each stage depends on the mtpipe modules its command runs, and on nothing else of mtpipe
# --------------------------------------------------------------------------------------------------------------------

# A stage's command -> the `mtpipe` command it runs (stages/train.py is `mtpipe train`, its docstring says).
SCRIPTS = {"stages/train.py": "train"}


def command_modules(command: str) -> set[str]:
    """The mtpipe modules the CLI's ``command`` imports inside its function (the stage's own code)."""
    cli = modules()["mtpipe.cli"]
    for node in tree(cli).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        names = [d.args[0].value for d in node.decorator_list if isinstance(d, ast.Call) and d.args
                 and isinstance(d.args[0], ast.Constant) and getattr(d.func, "id", "") == "stage_command"]
        if names == [command]:
            got = {resolve_module(n) for n, _ in imported_names_of(node) if n.startswith("mtpipe.")}
            return {m for m in got if m is not None}
    raise AssertionError(f"dvc.yaml runs `mtpipe {command}`, which mtpipe/cli.py does not define")


def imported_names_of(node: ast.AST) -> list[tuple[str, int]]:
    out = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.ImportFrom) and sub.module:
            out += [(f"{sub.module}.{a.name}", sub.lineno) for a in sub.names]
        elif isinstance(sub, ast.Import):
            out += [(a.name, sub.lineno) for a in sub.names]
    return out


def stage_deps() -> dict[str, tuple[str, list[str]]]:
    import yaml

    stages = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    out = {}
    for name, spec in stages.items():
        words = spec["cmd"].split()
        command = words[1] if words[0] == "mtpipe" else SCRIPTS[words[1]]
        out[name] = (command, [str(d) for d in spec.get("deps", [])])
    return out


def _covers(dep: str, rel: str) -> bool:
    return rel == dep or rel.startswith(dep.rstrip("/") + "/")


def test_dvc_deps_follow_the_import_graph():
    """A stage's deps cover every mtpipe module its command's code imports, transitively (lazy imports included;
    mtpipe/__init__.py, the version string alone, aside), and name no mtpipe file or package it does not import."""
    wrong = []
    for stage, (command, deps) in stage_deps().items():
        used = {str(modules()[m].relative_to(REPO)) for m in closure(command_modules(command))}
        used.discard("mtpipe/__init__.py")
        missing = sorted(rel for rel in used if not any(_covers(d, rel) for d in deps))
        unused = sorted(d for d in deps if d.startswith("mtpipe") and not any(_covers(d, rel) for rel in used))
        wrong += [f"{stage}: runs {rel}, not in its deps" for rel in missing]
        wrong += [f"{stage}: depends on {d}, which `mtpipe {command}` does not import" for d in unused]
        wrong += [f"{stage}: depends on {d}, which does not exist" for d in deps if not (REPO / d).exists()
                  and not d.startswith(("artifacts/", "metrics/"))]
    assert not wrong, "dvc.yaml's deps disagree with the import graph:\n" + "\n".join(wrong)
