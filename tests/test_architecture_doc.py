"""Every path docs/ARCHITECTURE.md names exists in the repository this test runs in.

Path-like tokens: anything that starts with a top-level folder of the project and a slash
(``pipeline/removal.py``, ``jobs/exactly_once.py``, ``cluster/`` for a folder, ``pipeline/methods/*``
or ``configs/methods/<name>.yaml`` as patterns, ``pipeline/curvature/{pcg,solve}.py`` expanded), and
backticked dotted names that start with a top-level package (``pipeline.curvature.pcg`` is the module
file; ``pipeline.methods.base.run_removal`` is a module and a name defined in it)."""
from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = Path("docs") / "ARCHITECTURE.md"
TOP = ("pipeline", "cluster", "jobs", "bench", "tests", "configs", "docs", "scripts")
PACKAGES = ("pipeline", "cluster", "jobs", "bench", "tests")
PATH_RE = re.compile(r"(?<![\w./-])((?:%s)/[\w./*<>{},-]*)" % "|".join(TOP))
DOTTED_RE = re.compile(r"`((?:%s)(?:\.\w+)+)" % "|".join(PACKAGES))


def _expand(token: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py`` (every brace group)."""
    parts = re.split(r"\{([^{}]*)\}", token)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def doc_paths(text: str) -> list[str]:
    """The slash paths the text names, braces expanded, trailing punctuation dropped."""
    out: list[str] = []
    for match in PATH_RE.finditer(text):
        token = match.group(1).rstrip(".,:;")
        token = token[:-2] if token.endswith("**") else token  # markdown bold, not a pattern
        if token.count("{") != token.count("}"):
            continue
        out += [t for t in _expand(token) if t not in out]
    return out


def doc_modules(text: str) -> list[str]:
    return sorted({m.group(1).rstrip(".") for m in DOTTED_RE.finditer(text)})


def path_missing(root: Path, token: str) -> bool:
    pattern = re.sub(r"<[^<>]*>", "*", token)
    if "*" in pattern:
        return not any(root.glob(pattern.rstrip("/")))
    target = root / token
    return not (target.is_dir() if token.endswith("/") else target.exists())


def module_missing(root: Path, dotted: str) -> bool:
    """True unless a prefix of ``dotted`` is a module (file or package) of ``root`` and the first
    name after it, if any, is defined or imported in that module's source."""
    parts = dotted.split(".")
    for k in range(len(parts), 1, -1):
        base = root.joinpath(*parts[:k])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            if k == len(parts):
                return False
            return re.search(rf"\b{re.escape(parts[k])}\b", source.read_text()) is None
    return True


def missing(root: Path, text: str) -> list[str]:
    return [p for p in doc_paths(text) if path_missing(root, p)] + \
           [m for m in doc_modules(text) if module_missing(root, m)]


def test_every_path_in_the_architecture_doc_exists() -> None:
    text = (ROOT / DOC).read_text()
    assert len(doc_paths(text)) >= 30 and len(doc_modules(text)) >= 10, "the extraction found too little"
    assert missing(ROOT, text) == [], f"{DOC} names paths that do not exist in {ROOT}"


def test_the_extraction() -> None:
    text = ("see `pipeline/removal.py`, **cluster/** and pipeline/curvature/{pcg,solve}.py; configs/methods/<name>.yaml "
            "and `pipeline.methods.base.run_removal` (not a/pipeline/x.py)")
    assert doc_paths(text) == ["pipeline/removal.py", "cluster/", "pipeline/curvature/pcg.py",
                               "pipeline/curvature/solve.py", "configs/methods/<name>.yaml"]
    assert doc_modules(text) == ["pipeline.methods.base.run_removal"]
    assert not path_missing(ROOT, "configs/methods/<name>.yaml")
    assert path_missing(ROOT, "pipeline/no_such_module.py") and path_missing(ROOT, "nowhere/")
    assert module_missing(ROOT, "pipeline.no_such_module") and module_missing(ROOT, "pipeline.removal.no_such_name")
    assert not module_missing(ROOT, "pipeline.removal.remove")
