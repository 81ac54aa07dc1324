"""docs/architecture.md matches the code: every file, name and section it is cited by exists.

Read with `ast`, never imported: the check needs no torch and takes milliseconds.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"

# pyproject's package-dir: dotted package -> folder, longest first.
PACKAGES = (
    ("parc.compiler.passes", "compiler/passes"),
    ("parc.compiler.planner", "compiler/planner"),
    ("parc.compiler", "compiler"),
    ("parc.runtime", "runtime"),
    ("parc.dsl", "dsl"),
    ("parc.examples", "examples"),
    ("parc", "parc"),
)
SKIP_DIRS = {".venv", ".git", "parc.egg-info", "__pycache__", ".pytest_cache", ".mypy_cache"}
PATH = re.compile(r"(?<![\w/.<*-])((?:[\w-]+/)+[\w-]+\.(?:py|md|lark|par|json|toml))(?![\w*])")
BACKTICKED = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"parc(?:\.[A-Za-z_]\w*)+")
META_KEY = re.compile(r"\bparc_[a-z_]+\b")
CITATION = "docs/architecture.md, "


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def _headings() -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^#{2,3} (.+)$", _doc(), re.M)]


def _repo_files(suffixes: tuple[str, ...]) -> list[Path]:
    out = []
    for top in ROOT.iterdir():
        if top.name in SKIP_DIRS:
            continue
        if top.is_file() and top.suffix in suffixes:
            out.append(top)
        elif top.is_dir():
            out += [
                p
                for p in top.rglob("*")
                if p.suffix in suffixes and not SKIP_DIRS.intersection(p.parts)
            ]
    return out


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _defined(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """Names a module or class body defines: functions, classes, assignments, imports."""
    names: dict[str, ast.stmt] = {}
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[stmt.name] = stmt
        elif isinstance(stmt, ast.Assign | ast.AnnAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                for node in ast.walk(target):
                    if isinstance(node, ast.Name):
                        names[node.id] = stmt
        elif isinstance(stmt, ast.ImportFrom):  # a re-export is importable from here
            for alias in stmt.names:
                names[alias.asname or alias.name] = stmt
    return names


def _module_file(dotted: list[str]) -> tuple[Path, list[str]] | None:
    """The file of the longest module prefix of `dotted`, and the names after it."""
    for cut in range(len(dotted), 0, -1):
        module = ".".join(dotted[:cut])
        for package, folder in PACKAGES:
            if module == package or module.startswith(package + "."):
                rest = module[len(package) :].lstrip(".").replace(".", "/")
                base = ROOT / folder / rest if rest else ROOT / folder
                for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                    if rest and candidate == base / "__init__.py" and not base.is_dir():
                        continue
                    if candidate.is_file():
                        return candidate, dotted[cut:]
                break
    return None


def _resolves(ref: str) -> bool:
    found = _module_file(ref.split("."))
    if found is None:
        return False
    path, names = found
    body: list[ast.stmt] = _tree(path).body
    for name in names:
        stmt = _defined(body).get(name)
        if stmt is None:
            return False
        body = stmt.body if isinstance(stmt, ast.ClassDef) else []
    return True


def test_every_file_the_architecture_page_names_exists() -> None:
    paths = sorted(set(PATH.findall(_doc())))
    assert len(paths) > 50, "the path pattern no longer finds the page's paths"
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_every_folder_the_architecture_page_names_exists() -> None:
    folders = {t for t in BACKTICKED.findall(_doc()) if re.fullmatch(r"[\w-]+(/[\w-]+)*/", t)}
    missing = sorted(f for f in folders if not (ROOT / f).is_dir())
    assert not missing, f"docs/architecture.md names folders that do not exist: {missing}"


def test_every_dotted_name_the_architecture_page_names_is_defined() -> None:
    refs = {r for t in BACKTICKED.findall(_doc()) for r in DOTTED.findall(t) if "." in r}
    refs = {r for r in refs if r not in {p for p, _ in PACKAGES}}
    assert len(refs) > 40, "the name pattern no longer finds the page's names"
    undefined = sorted(r for r in refs if not _resolves(r))
    assert not undefined, f"docs/architecture.md names what the code does not define: {undefined}"


def test_the_resolver_refuses_names_that_do_not_exist() -> None:
    # The checks above are only as good as this resolver: it must say no.
    assert _resolves("parc.runtime.program.Program.step")
    assert _resolves("parc.runtime.tolerances.PARAM_ATOL")  # a tuple assignment
    assert _resolves("parc.runtime.equivalence.PARAM_ATOL")  # a re-export
    assert not _resolves("parc.runtime.program.Program.no_such_method")
    assert not _resolves("parc.compiler.no_such_module.thing")
    assert not _resolves("parc.runtime.assemble.no_such_function")


def test_every_meta_key_the_architecture_page_names_is_in_the_code() -> None:
    keys = set(META_KEY.findall(_doc()))
    code = "\n".join(
        p.read_text(encoding="utf-8")
        for folder in ("compiler", "runtime", "parc")
        for p in (ROOT / folder).rglob("*.py")
    )
    missing = sorted(k for k in keys if f'"{k}"' not in code)
    assert not missing, (
        f"docs/architecture.md names node.meta keys the code no longer has: {missing}"
    )


def test_every_citation_of_the_architecture_page_names_one_of_its_sections() -> None:
    headings = sorted(_headings(), key=len, reverse=True)
    bad = []
    for path in _repo_files((".py", ".md")):
        if path.resolve() == Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            at = line.find(CITATION)
            while at >= 0:
                rest = line[at + len(CITATION) :]
                if not any(re.match(re.escape(h) + r"(\W|$)", rest) for h in headings):
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {rest[:40]!r}")
                at = line.find(CITATION, at + 1)
    assert not bad, f"citations of docs/architecture.md name no section of it: {bad}"


def test_nothing_in_the_repository_points_to_the_old_design_contract() -> None:
    # DESIGN.md was never in the repository; docs/architecture.md replaces it.
    mine = {DOC, Path(__file__).resolve()}
    stale = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in _repo_files((".py", ".md"))
        if p.resolve() not in mine
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if "DESIGN.md" in line
    ]
    assert not stale, f"references to DESIGN.md (point them to docs/architecture.md): {stale}"
