"""Names that point at code still name it, and mtpipe holds only code that mtpipe runs.

- Every cross-reference in a docstring, a comment or a page (``:mod:`` / ``:class:`` / ``:func:`` / ``:meth:`` /
  ``:data:`` / ``:attr:`` / ``:exc:`` roles, and dotted names in backticks: ``mtpipe.engine.search.beam_search``,
  ``testkit.runs.TINY``, or ``engine.search`` without its ``mtpipe.``) in mtpipe/, testkit/, bench/ and the
  user-facing pages resolves, and so does every absolute one in tests/: its module imports and its attribute chain
  exists (a role's short name is looked up where it stands: its module, the classes of its module, the packages
  above it).
- Every public function, class and module-level name of mtpipe/ is used by mtpipe itself (the CLI, the stages,
  dvc.yaml, the packaging's entry point) -- code only tests or benchmarks call belongs in testkit/ or bench/.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import re
from pathlib import Path
from typing import Any, Iterator

from conftest import REPO

ROOTS = ("mtpipe", "testkit", "bench")  # the packages a dotted name may start with
ROLE = re.compile(r":(?:py:)?(?P<role>mod|class|func|meth|data|attr|exc|obj):`(?P<target>[^`<>]+?)`")
SPAN = re.compile(r"``(?P<a>[^`\n]+?)``|(?<!`)`(?P<b>[^`\n]+?)`(?!`)")
DOTTED = re.compile(rf"(?<![\w./-])(?:{'|'.join(ROOTS)})(?:\.\w+)+")
# ``engine.search.Engine``: a name inside mtpipe without its ``mtpipe.`` (read as one when the module exists)
PARTIAL = re.compile(r"(?<![\w./-])(?P<package>model|engine|training|stages|serve)\.(?P<module>\w+)(?:\.\w+)*")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
PAGES = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", REPO / "BENCHMARKS.md",
         *sorted((REPO / "bench").rglob("*.md"))]  # docs/journal/ is a record of its day: not checked


def sources() -> list[Path]:
    return [p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))]


def module_of(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# --------------------------------------------------------------------------------------------------------------------
# Resolving a dotted name
# --------------------------------------------------------------------------------------------------------------------


@functools.cache
def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _instance_attributes(cls: type) -> set[str]:
    """What a class's instances carry without it being a class attribute: dataclass and NamedTuple fields,
    annotations, ``self.x = ...`` in its methods, ``__slots__``."""
    import inspect

    names: set[str] = set()
    for klass in getattr(cls, "__mro__", (cls,)):
        names |= set(getattr(klass, "__dataclass_fields__", {})) | set(getattr(klass, "_fields", ()))
        names |= set(vars(klass).get("__annotations__", {})) | set(vars(klass).get("__slots__", ()))
        try:
            tree = ast.parse(inspect.getsource(klass).lstrip() if klass.__module__ != "builtins" else "")
        except (OSError, TypeError, SyntaxError):
            continue
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                  and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return names


def _walk(obj: Any, chain: list[str]) -> bool:
    for i, attr in enumerate(chain):
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif isinstance(obj, type) and attr in _instance_attributes(obj):
            return i == len(chain) - 1  # an instance's attribute: nothing to look into further
        else:
            return False
    return True


def resolves(dotted: str) -> bool:
    """``dotted`` is ``module[.attribute...]``: the longest importable module prefix, then the attributes."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        module = _import(".".join(parts[:k]))
        if module is not None:
            return _walk(module, parts[k:])
    return False


@functools.cache
def _module_classes(module: str) -> list[type]:
    m = _import(module)
    return [v for v in vars(m).values() if isinstance(v, type) and v.__module__ == module] if m else []


def resolves_from(target: str, module: str | None) -> bool:
    """A role's target where it stands: absolute, or short (in its module, in a class of its module, in the
    module's package or the packages above it: ``engine.search.Engine`` from mtpipe.stages.decode; in a page, in
    mtpipe), a builtin, another library's."""
    target = target.lstrip("~.").removesuffix("()")
    if target.split(".")[0] in ROOTS:
        return resolves(target)
    if target.split(".")[0] in dir(builtins):
        return _walk(builtins, target.split("."))
    packages = [module.rsplit(".", k)[0] for k in range(module.count(".") + 1)] if module else ["mtpipe"]
    if any(resolves(f"{p}.{target}") for p in packages):  # mtpipe.a.b, mtpipe.a, mtpipe
        return True
    if module and any(_walk(cls, target.split(".")) for cls in _module_classes(module)):
        return True
    return bool(_import(target.split(".")[0])) and resolves(target)  # another library's: torch.nn.Module


# --------------------------------------------------------------------------------------------------------------------
# Finding the references
# --------------------------------------------------------------------------------------------------------------------


def references(text: str) -> Iterator[tuple[int, str, str]]:
    """``(line, kind, target)``: the roles' targets, and the dotted mtpipe/testkit/bench names in backticks."""
    for m in ROLE.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m["role"], m["target"].strip()
    for m in SPAN.finditer(ROLE.sub("", text)):  # a role's own backticks are not a span
        span = m["a"] or m["b"]
        line = text.count("\n", 0, m.start()) + 1
        for d in DOTTED.finditer(span):
            if not re.match(r"[\w.]*\.(py|md|json|yaml|txt|sh)\b", span[d.start():]):  # a file, not a name
                yield line, "name", d.group(0).rstrip(".")
        for d in PARTIAL.finditer(span):
            if (REPO / "mtpipe" / d["package"] / f"{d['module']}.py").is_file():
                yield line, "name", d.group(0).rstrip(".")


def unresolved() -> list[str]:
    bad = []
    for path in sources():
        text = path.read_text(encoding="utf-8")
        module = module_of(path)
        bad += [f"{path.relative_to(REPO)}:{line}: {kind} {target}" for line, kind, target in references(text)
                if not resolves_from(target, module)]
    for page in PAGES:
        text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text(encoding="utf-8"))
        bad += [f"{page.relative_to(REPO)}:{line}: {kind} {target}" for line, kind, target in references(text)
                if not resolves_from(target, None)]
    # The tests' absolute names (a test's short names are its own business; this file's are examples).
    for path in sorted(set((REPO / "tests").glob("*.py")) - {Path(__file__).resolve()}):
        bad += [f"{path.relative_to(REPO)}:{line}: {kind} {target}"
                for line, kind, target in references(path.read_text(encoding="utf-8"))
                if target.lstrip("~").split(".")[0] in ROOTS and not resolves_from(target, None)]
    return bad


def test_every_reference_resolves():
    bad = unresolved()
    assert not bad, f"{len(bad)} reference(s) to nothing (renamed or moved?):\n" + "\n".join(bad)


def test_a_stale_reference_is_caught():
    """The resolver refuses what no longer exists, in each form it reads."""
    text = ("x :class:`~mtpipe.engine.search.Engine` y :meth:`mtpipe.engine.cache.DecoderState.admit`\n"
            "``mtpipe.model.transformer.DecoderState`` :func:`no_such_function` :class:`Hypothesis` "
            ":meth:`BeamSearch.admit` `engine.search.Engine`, ``model.transformer.Transformer``\n")
    found = {target: resolves_from(target, "mtpipe.engine.search") for _, _, target in references(text)}
    assert found == {"~mtpipe.engine.search.Engine": False, "mtpipe.engine.cache.DecoderState.admit": True,
                     "mtpipe.model.transformer.DecoderState": False, "no_such_function": False,
                     "Hypothesis": True, "BeamSearch.admit": True, "engine.search.Engine": False,
                     "model.transformer.Transformer": True}


# --------------------------------------------------------------------------------------------------------------------
# Product code: every public name of mtpipe/ is used by mtpipe
# --------------------------------------------------------------------------------------------------------------------

# Users: the package itself, the scripts dvc.yaml runs, the examples' pipelines, the docs generator, the recipes.
PRODUCT = ("mtpipe", "stages", "examples", "tools", "recipes")
# Files whose text names code (dvc.yaml's commands, the entry point ``mtpipe.cli:app``).
PRODUCT_TEXT = ("dvc.yaml", "pyproject.toml", "examples")
# A function a framework calls once registered by its decorator (a Typer command or callback, a route).
REGISTERING = {"command", "callback", "route", "get", "post"}
# Public names mtpipe keeps although only tests or benchmarks use them, each with its reason (keep this short).
ALLOWED: dict[tuple[str, str], str] = {
    ("mtpipe.platform", "assume_cpu"): "the context through which a test or a benchmark asks what mtpipe decides on "
                                       "another CPU (no module global is flipped from outside)",
    ("mtpipe.engine.search", "one_top_k"): "the context that switches the chunked ranking off for a block: how "
                                           "bench/decode_speed.py times it",
    ("mtpipe.engine.packed", "torch_products"): "the context that keeps torch's own float32 products for a block: how "
                                                "bench/decode_speed.py times the oneDNN variant",
    ("mtpipe.model.ops", "fused_attention"): "the context that switches the two-matmul attention off for a block: "
                                             "how bench/decode_speed.py and bench/train_throughput.py time it",
    ("mtpipe.model.ops", "fused_dropout"): "the context that switches keep_mask's cheap dropout masks off for a "
                                           "block: how bench/train_throughput.py times them",
    ("mtpipe.training.loss", "whole_logits"): "the context that switches the loss's blocks off for a block: how "
                                              "bench/train_throughput.py times them",
    ("mtpipe.engine.runners", "gather_in_graph_from"): "the context that moves the compiled step's gather threshold "
                                                       "for a block: how bench/decode_speed.py times it",
}


def _definitions(module: str, tree: ast.Module) -> dict[tuple[str, str], ast.AST]:
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[(module, node.name)] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    out[(module, target.id)] = node
    return {k: v for k, v in out.items() if not k[1].startswith("_")}


def _registered(node: ast.AST) -> bool:
    """Decorated by a registering call: ``@app.command(...)``, ``@stage_command(...)``, ``@app.callback()``."""
    calls = [d.func for d in getattr(node, "decorator_list", []) if isinstance(d, ast.Call)]
    names = [f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "") for f in calls]
    return any(name.rsplit("_", 1)[-1] in REGISTERING for name in names)


def _uses(path: Path, module: str, modules: set[str],
          defined: set[tuple[str, str]]) -> list[tuple[tuple[str, str], str | None]]:
    """``((module, name) used, the top-level definition of this file the use is in, or None)``: imports of the name,
    attribute access through an imported module, the module's own names, and strings naming ``mtpipe.a.b:name``
    (docstrings excluded: naming is not using)."""
    tree = _parsed(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update({a.asname or a.name.split(".")[0]: a.asname and a.name or a.name.split(".")[0]
                          for a in node.names})
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            bound.update({a.asname or a.name: f"{base}.{a.name}" for a in node.names})

    def name_of(dotted: str) -> tuple[str, str] | None:
        parts = dotted.split(".")
        for k in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:k]) in modules:
                return ".".join(parts[:k]), parts[k]
        return None

    out: list[tuple[tuple[str, str], str | None]] = []

    def visit(node: ast.AST, owner: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            mine = owner
            if node is tree and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                mine = child.name
            elif node is tree and isinstance(child, (ast.Assign, ast.AnnAssign)):
                target = child.targets[0] if isinstance(child, ast.Assign) else child.target
                if isinstance(target, ast.Name) and target.id == "__all__":
                    continue  # listing a name is not using it
                mine = target.id if isinstance(target, ast.Name) else None
            if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant):
                continue  # a docstring
            used: list[tuple[str, str] | None] = []
            if isinstance(child, ast.ImportFrom):
                used += [name_of(f"{_absolute(child, package)}.{a.name}") for a in child.names]
            elif isinstance(child, ast.Attribute):
                chain, base = [], child
                while isinstance(base, ast.Attribute):
                    chain.append(base.attr)
                    base = base.value
                if isinstance(base, ast.Name) and base.id in bound:
                    used.append(name_of(".".join([bound[base.id], *reversed(chain)])))
            elif isinstance(child, ast.Name) and child.id not in bound and (module, child.id) in defined:
                used.append((module, child.id))
            elif isinstance(child, ast.Constant) and isinstance(child.value, str):
                used += [name_of(m.replace(":", ".")) for m in re.findall(r"\bmtpipe(?:\.\w+)+(?::\w+)?", child.value)]
            out.extend((u, mine) for u in used if u is not None)
            visit(child, mine)

    visit(tree, None)
    return out


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join(up + ([node.module] if node.module else []))


def product_unused(root: Path) -> dict[tuple[str, str], list[str]]:
    """Public names of ``root``/mtpipe that nothing of the product uses, with the files outside it that use them.
    A use from inside a definition that is itself unused does not count (repeated until nothing changes)."""
    package = sorted((root / "mtpipe").rglob("*.py"))
    modules = {module_of_in(p, root): p for p in package}
    defined: dict[tuple[str, str], ast.AST] = {}
    for name, path in modules.items():
        defined.update(_definitions(name, _parsed(path)))
    uses: list[tuple[str, Path, tuple[str, str], tuple[str, str] | None]] = []
    for top in (*PRODUCT, "tests", "bench", "testkit"):
        for path in sorted((root / top).rglob("*.py")) if (root / top).is_dir() else []:
            module = module_of_in(path, root)
            for used, owner in _uses(path, module, set(modules), set(defined)):
                inside = (module, owner) if top == "mtpipe" and owner else None
                if used != inside:
                    uses.append((top, path, used, inside))
    text = "".join(p.read_text(encoding="utf-8") for name in PRODUCT_TEXT for p in
                   ([root / name] if (root / name).is_file() else sorted((root / name).rglob("*.y*ml"))))
    named = {tuple(m.rsplit(".", 1)) for m in re.findall(r"\bmtpipe(?:\.\w+)+", text.replace(":", "."))}
    users: dict[tuple[str, str], list[tuple[str, Path, tuple[str, str] | None]]] = {}
    for top, path, used, inside in uses:
        users.setdefault(used, []).append((top, path, inside))
    unused: set[tuple[str, str]] = set()
    while True:
        new = {key for key in defined if key not in unused and not _registered(defined[key])
               and key not in named
               and not any(top in PRODUCT and inside not in unused for top, _, inside in users.get(key, []))}
        if not new:
            break
        unused |= new
    return {key: sorted({str(p.relative_to(root)) for _, p, _ in users.get(key, [])}) for key in unused}


def module_of_in(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_mtpipe_holds_only_code_that_mtpipe_uses():
    found = product_unused(REPO)
    unused = {key: users for key, users in found.items() if key not in ALLOWED}
    lines = [f"{m}.{n}: used by {', '.join(users) or 'nothing'}" for (m, n), users in sorted(unused.items())]
    lines += [f"{m}.{n}: allowed, but mtpipe uses it now (or it is gone)" for m, n in ALLOWED if (m, n) not in found]
    assert not lines, ("public names of mtpipe/ that only tests or benchmarks use (move them to testkit/ or bench/, "
                        "or call mtpipe's own function there):\n" + "\n".join(lines))


def test_code_only_a_test_calls_is_caught(tmp_path: Path):
    (tmp_path / "mtpipe" / "engine").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "mtpipe" / "__init__.py").write_text("")
    (tmp_path / "mtpipe" / "engine" / "__init__.py").write_text("")
    (tmp_path / "mtpipe" / "engine" / "run.py").write_text(
        "def search(x):\n    return x\n\n\ndef shortcut(x):\n    '''search, for a test: uses search'''\n"
        "    return helper(search(x))\n\n\ndef helper(x):\n    return x\n\n\nLIMIT = 3\n")
    (tmp_path / "mtpipe" / "cli.py").write_text(
        "import typer\napp = typer.Typer()\n\n\n@app.command()\ndef go():\n    from mtpipe.engine import run\n"
        "    run.search(1)\n")
    (tmp_path / "tests" / "test_x.py").write_text("from mtpipe.engine.run import LIMIT, shortcut\nshortcut(LIMIT)\n")
    (tmp_path / "pyproject.toml").write_text('[project.scripts]\nx = "mtpipe.cli:app"\n')
    assert product_unused(tmp_path) == {("mtpipe.engine.run", "shortcut"): ["tests/test_x.py"],
                                        ("mtpipe.engine.run", "helper"): ["mtpipe/engine/run.py"],
                                        ("mtpipe.engine.run", "LIMIT"): ["tests/test_x.py"]}
