"""The house rules a reader relies on (docs/layout.md), checked on the source: the
domain stays pure where import-linter cannot see (the standard library), assets stay
thin, functions stay short, and loading the code location stays cheap."""

from __future__ import annotations

import ast
import gc
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mm_assets"
NOT_IN_DOMAIN = {"subprocess", "asyncio", "fcntl", "threading", "socket", "multiprocessing"}
# What import-linter cannot name (the standard library, submodules of other packages):
# network clients, file-tree operations, process groups, and safetensors' writers.
NOT_IN_PURE_DOMAIN = ("urllib", "http", "shutil", "tempfile", "torch.distributed")
WRITERS = {"write_text", "write_bytes", "mkdir", "touch", "unlink", "rmdir", "save_file"}


def _modules(folder: Path) -> list[tuple[Path, ast.Module]]:
    """Parsed with the collector paused: on CPython 3.11 a finalizer that formats an
    exception (a file of an earlier test, closed by the collector, that fails to flush)
    parses source itself, re-entering `ast.parse` and failing it with "AST constructor
    recursion depth mismatch"."""
    gc.collect()
    gc.disable()
    try:
        return [(p, ast.parse(p.read_text())) for p in sorted(folder.rglob("*.py"))]
    finally:
        gc.enable()


def _functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    return [node for node in ast.walk(tree) if isinstance(node, kinds)]


def _body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of the body, without the docstring."""
    body = function.body
    first = body[0]
    has_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    start = (body[1] if has_docstring and len(body) > 1 else first).lineno
    return (function.end_lineno or start) - start + 1


def test_the_domain_starts_no_process_thread_or_event_loop() -> None:
    found = []
    for path, tree in _modules(PACKAGE / "domain"):
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in NOT_IN_DOMAIN]
    assert not found


def _imported(node: ast.AST) -> list[str]:
    """Modules, and `module.name` for each name taken from one."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module:
        return [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return []


def _writes(node: ast.AST) -> bool:
    """A call that writes a file: a writer method, `torch.save`, or `open` for writing."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr in WRITERS or (
            func.attr == "save" and isinstance(func.value, ast.Name) and func.value.id == "torch"
        )
    if isinstance(func, ast.Name) and func.id == "open":
        modes = [a for a in node.args[1:2] if isinstance(a, ast.Constant)]
        modes += [k.value for k in node.keywords if k.arg == "mode"]
        return any(isinstance(m, ast.Constant) and set(str(m.value)) & set("wax+") for m in modes)
    return False


def test_the_domain_writes_no_file_and_opens_no_connection_or_process_group() -> None:
    found = []
    for path, tree in _modules(PACKAGE / "domain"):
        for node in ast.walk(tree):
            names = _imported(node)
            found += [f"{path.name}: {n}" for n in names if n.startswith(NOT_IN_PURE_DOMAIN)]
            found += [f"{path.name}: {n}" for n in names if n == "safetensors.torch.save_file"]
            if _writes(node):
                found.append(f"{path.name}:{node.lineno} writes a file")
    assert not found


def test_asset_bodies_are_short_and_no_function_is_long() -> None:
    long_assets, long_functions = [], []
    for path, tree in _modules(PACKAGE):
        for function in _functions(tree):
            where = f"{path.relative_to(PACKAGE)}:{function.lineno} {function.name}"
            if path.parent.name == "assets" and _body_lines(function) > 40:
                long_assets.append(where)
            if (function.end_lineno or 0) - function.lineno + 1 > 60:
                long_functions.append(where)
    assert not long_assets and not long_functions


def test_no_function_takes_more_than_seven_parameters() -> None:
    """Seven at most (self and cls not counted): a longer list is an object to pass whole."""
    long = []
    for path, tree in _modules(PACKAGE):
        for owner in ast.walk(tree):
            body = getattr(owner, "body", [])
            for function in body if isinstance(body, list) else []:
                if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                a = function.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                count = len(names) - (names[:1] in (["self"], ["cls"]))
                prefix = f"{owner.name}." if isinstance(owner, ast.ClassDef) else ""
                where = f"{path.relative_to(PACKAGE)}:{prefix}{function.name}"
                if count > 7:
                    long.append(f"{where} ({count})")
    assert not long


def test_the_formatter_shapes_every_line() -> None:
    """No `# fmt: skip`: a call too long for the formatter's lines takes fewer arguments
    (an object passed whole), not a hand-kept shape."""
    skipped = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if line.rstrip().endswith("# fmt: skip")
    ]
    assert not skipped


def test_loading_the_code_location_imports_no_heavy_library() -> None:
    code = (
        "import json, sys, mm_assets.definitions\n"
        "print(json.dumps([m for m in ('torch', 'transformers', 'matplotlib', 'vllm') "
        "if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_no_module_is_long() -> None:
    long = [
        f"{path.relative_to(PACKAGE)}: {n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > 400
    ]
    assert not long


def test_the_readme_layout_names_every_module() -> None:
    """A newcomer's map of the house (docs/layout.md, linked from the README): every
    module, one line each, none gone stale."""
    assert "docs/layout.md" in (PACKAGE.parent / "README.md").read_text()
    page = (PACKAGE.parent / "docs" / "layout.md").read_text()
    layout = page[page.index("# Layout") :]
    block = layout[layout.index("```") + 3 : layout.index("```", layout.index("```") + 3)]
    listed = {line.split()[0] for line in block.splitlines() if line.strip()}
    modules = {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
    }
    assert listed == modules
