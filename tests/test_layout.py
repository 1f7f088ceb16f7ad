"""The package's layout is its architecture: imports point down the layers, no module waits on itself through
others, and a trainer's client loads no engine, dataset or sandbox code."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nemo_gym_prorl"

# Lowest first. A module may import its own package's modules and those of any lower layer, never a higher one.
LAYERS = [
    {"contracts", "json_http", "child_lifetime"},
    {"sandbox", "tool_calls"},
    {"tools", "telemetry"},
    {"models"},
    {"envs"},
    {"agent"},
    {"harness"},
    {"service"},
    {"cluster", "gym", "viewer"},
    {"launch"},
    {"reverify"},
    {"train"},
    {"bench"},
    {"cli"},
]
# NeMo Gym's server folders: Gym starts them by path, nothing of ours imports them.
SERVER_FOLDERS = ("nemo_gym_prorl.gym.resources_servers", "nemo_gym_prorl.gym.responses_api_agents")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(module: str) -> set[str]:
    """Every module of ours `module` imports, at its top, in a function or for type checking alone."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {m for m in found if m in MODULES and m != module}


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(LAYERS) if top in names)


def ours(module: str) -> bool:
    return module != "nemo_gym_prorl" and not module.startswith(SERVER_FOLDERS) and ".tests" not in module


def test_every_top_level_module_has_a_layer():
    tops = {m.split(".")[1] for m in MODULES if ours(m)}
    assert tops <= set().union(*LAYERS), f"not in LAYERS: {sorted(tops - set().union(*LAYERS))}"


def test_no_import_points_up_or_sideways():
    wrong = []
    for module in filter(ours, MODULES):
        for target in filter(ours, imports(module)):
            same_package = module.split(".")[1] == target.split(".")[1]
            if not same_package and layer(target) >= layer(module):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_no_module_imports_itself_through_others():
    graph = {m: imports(m) for m in MODULES if ours(m)}
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("heavy", ["llama_cpp", "datasets", "numpy", "torch"])
def test_the_trainers_client_loads_contracts_and_http_only(heavy: str):
    probe = f"import sys, nemo_gym_prorl.service.client; print({heavy!r} in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "False", f"import nemo_gym_prorl.service.client loads {heavy}"


ROOT = PACKAGE.parent
DOCSTRING_MAX_LINES = 15  # what a module owns and why; essays and measurements live in docs/
README_MAX_LINES = 300  # a guide: what it is, the two commands, concepts, layout, one short section per use
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def test_no_module_docstring_is_over_15_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if docstring is not None and len(docstring.splitlines()) > DOCSTRING_MAX_LINES:
            long.append(f"{path.relative_to(ROOT)}: {len(docstring.splitlines())} lines")
    assert not long, f"module docstrings over {DOCSTRING_MAX_LINES} lines (detail goes to docs/):\n" + "\n".join(long)


def test_readme_is_at_most_300_lines():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}; the rest: docs/)"


def relative_links(markdown: str) -> list[str]:
    """The targets of a page's links and images that point into the repository: not URLs, not bare #anchors, and
    nothing inside fenced code blocks or code spans."""
    prose = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", markdown, flags=re.S | re.M)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return [target for target in MARKDOWN_LINK.findall(prose)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) and not target.startswith("#")]


def test_every_relative_link_in_readme_and_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [f"{page.relative_to(ROOT)}: {target}"
              for page in pages for target in relative_links(page.read_text())
              if not (page.parent / target.split("#", 1)[0]).exists()]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


TESTS = ROOT / "tests"


def test_the_tests_mirror_the_package():
    """A module's tests are found by its path: each folder under tests/ is a folder of the package (or recipes/),
    helpers live in tests/support/, and everything else there is a test module."""
    astray = []
    for path in sorted(TESTS.rglob("*")):
        relative = path.relative_to(TESTS)
        if "__pycache__" in relative.parts or relative.parts[0] == "support":
            continue
        if path.is_dir() and not ((PACKAGE / relative).is_dir() or (ROOT / relative).is_dir()):
            astray.append(f"tests/{relative}/ (no nemo_gym_prorl/{relative}/)")
        elif path.suffix == ".py" and not (path.name.startswith("test_") or path.name == "conftest.py"):
            astray.append(f"tests/{relative} (helpers go to tests/support/)")
    assert not astray, "tests that are not where the package says:\n" + "\n".join(astray)
