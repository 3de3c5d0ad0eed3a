"""The one-way rule train → jaxpe → kernels, read from the source with `ast`; no citation a reader cannot open.

kernels/ imports nothing of jaxpe but jaxpe.kernels; jaxpe/ imports nothing of jaxpe.train or of the consumers above
the library (benchmarks/); nothing imports the benchmarks. A function-local import of any module says why in a comment
on its line. Sources cite papers (name, arXiv id), public repositories and the repository's own files, never private
notes or issue numbers.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {  # repository folder -> (import package, module prefixes it must not import)
    "kernels": ("jaxpe.kernels", ("jaxpe", "train", "benchmarks")),
    "jaxpe": ("jaxpe", ("jaxpe.train", "train", "benchmarks")),
    "train": ("jaxpe.train", ("benchmarks",)),
}
ALLOWED = {"kernels": ("jaxpe.kernels",), "jaxpe": (), "train": ()}


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
        for line, module in imported_modules(ast.parse(path.read_text()), package):
            if any(under(module, p) for p in forbidden) and not any(under(module, a) for a in ALLOWED[folder]):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "imports against train → jaxpe → kernels:\n" + "\n".join(bad)


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_function_local_imports_say_why(folder):
    bad = []
    for path in sources(folder):
        text = path.read_text()
        lines = text.splitlines()
        for func in ast.walk(ast.parse(text)):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and "#" not in lines[node.lineno - 1]:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not bad, "function-local imports without a reason on their line:\n" + "\n".join(bad)


# Citations that only the project's own notes or tracker resolve (the brackets keep this line from matching itself).
UNREADABLE_CITATION = re.compile(r"\bS[P]EC\b|S[T]YLE §|\bseed[s]/|\b[Ii]ssues? #?\d+|\.\./s[h]ared")
CITING = ("jaxpe", "kernels", "train", "benchmarks", "tools", "tests")


def unreadable_citations(text: str) -> list[str]:
    """The lines of `text` that cite something a reader of the repository cannot open."""
    return [line.strip() for line in text.splitlines() if UNREADABLE_CITATION.search(line)]


@pytest.mark.parametrize("folder", CITING)
def test_no_citation_a_reader_cannot_open(folder):
    bad = [f"{path.relative_to(ROOT)}: {line}" for path in sorted((ROOT / folder).rglob("*"))
           if path.suffix in (".py", ".md", ".sh", ".json") and "__pycache__" not in path.parts
           for line in unreadable_citations(path.read_text())]
    assert not bad, "citations of private notes or issue numbers:\n" + "\n".join(bad)


def test_unreadable_citations_are_seen():
    """The checker itself, on lines put together here (written out whole they would match this file)."""
    cited = [" ".join(words) for words in (("as", "in", "issue", "12"), ("(SP" + "EC", "§3)"), ("STYLE", "§15"))]
    cited += ["see " + "seeds" + "/amspe.md", "(" + "issue" + " #7)"]
    assert unreadable_citations("\n".join(cited)) == cited
    fine = ["PartitionSpec", "AMSPEConfig", "tissue 3", "seeds 0,1", "arXiv 2405.18719", "github org/repo issues"]
    assert unreadable_citations("\n".join(fine)) == []


def test_the_rule_is_checked_on_real_violations(tmp_path):
    """The checker itself: an upward import and a relative one are both seen."""
    tree = ast.parse("import jaxpe.cope\nfrom ..registry import pe_config\nfrom . import _common\n")
    modules = [m for _, m in imported_modules(tree, "jaxpe.kernels")]
    assert modules == ["jaxpe.cope", "jaxpe.registry", "jaxpe.kernels._common"]
