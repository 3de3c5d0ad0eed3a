"""The one-way rule train → jaxpe → kernels → jaxpe.base, read from the source with `ast`.

jaxpe/base.py (what every encoding, layer and kernel shares) imports nothing of jaxpe; kernels/ imports nothing of
jaxpe but jaxpe.kernels and jaxpe.base; jaxpe/ imports nothing of jaxpe.train or of the consumers above
the library (benchmarks/); nothing imports the benchmarks. A function-local import of any module says why in a comment
on its line.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {  # repository folder -> (import package, module prefixes it must not import)
    "kernels": ("jaxpe.kernels", ("jaxpe", "train", "benchmarks")),
    "jaxpe": ("jaxpe", ("jaxpe.train", "train", "benchmarks")),
    "train": ("jaxpe.train", ("benchmarks",)),
}
ALLOWED = {"kernels": ("jaxpe.kernels", "jaxpe.base"), "jaxpe": (), "train": ()}
BASE = ROOT / "jaxpe" / "base.py"  # below kernels/: imports nothing of jaxpe


def imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a module of `package`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found += [(node.lineno, f"{base}.{alias.name}" if node.module is None else base) for alias in node.names]
    return found


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def sources(folder: str) -> list[pathlib.Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_no_upward_imports(folder):
    package, forbidden = LAYERS[folder]
    bad = []
    for path in sources(folder):
        for line, module in imported_modules(ast.parse(path.read_text(encoding="utf-8")), package):
            if any(under(module, p) for p in forbidden) and not any(under(module, a) for a in ALLOWED[folder]):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "imports against train → jaxpe → kernels:\n" + "\n".join(bad)


def test_the_base_imports_nothing_of_jaxpe():
    """jaxpe/base.py sits below kernels/, which imports it: it may import no jaxpe module (nor train, benchmarks)."""
    found = [f"{BASE.relative_to(ROOT)}:{line} imports {module}"
             for line, module in imported_modules(ast.parse(BASE.read_text(encoding="utf-8")), "jaxpe")
             if any(under(module, p) for p in ("jaxpe", "train", "benchmarks"))]
    assert found == []


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_function_local_imports_say_why(folder):
    bad = []
    for path in sources(folder):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for func in ast.walk(ast.parse(text)):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and "#" not in lines[node.lineno - 1]:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not bad, "function-local imports without a reason on their line:\n" + "\n".join(bad)


def test_the_rule_is_checked_on_real_violations(tmp_path):
    """The checker itself: an upward import and a relative one are both seen."""
    tree = ast.parse("import jaxpe.cope\nfrom ..registry import pe_config\nfrom . import _common\n")
    modules = [m for _, m in imported_modules(tree, "jaxpe.kernels")]
    assert modules == ["jaxpe.cope", "jaxpe.registry", "jaxpe.kernels._common"]
