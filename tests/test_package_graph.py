"""The package graph of docs/architecture.md §2, checked on the source: which
distribution may import which (every import, including those inside functions), what
each declares, that the rank's distributions build no decoder, and that no module
imports itself back through others."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
# folder -> (distribution, its packages under flare.)
DISTRIBUTIONS = {
    "wire": ("flare-wire", ("wire",)),
    "instrumentation": ("flare-instrumentation", ("instrumentation",)),
    "processors": ("flare-processors", ("processors",)),
    "exporters": ("flare-exporters", ("exporters", "importers")),
    "otel-collector": ("flare-collector", ("collector",)),
    "diagnostics": ("flare-diagnostics", ("diagnostics",)),
}
# distribution -> the distributions it may import (the arrows of the graph)
ALLOWED = {
    "flare-wire": set(),
    "flare-instrumentation": {"flare-wire"},
    "flare-processors": {"flare-wire"},
    "flare-exporters": {"flare-wire", "flare-processors"},
    "flare-collector": {"flare-wire", "flare-processors", "flare-exporters"},
    "flare-diagnostics": {"flare-wire", "flare-processors", "flare-exporters", "flare-collector"},
}
# `flare run` hosts the ranks: the one place the diagnosis imports the rank hooks
RANK_HOSTS = {"flare.diagnostics.run"}
PACKAGE_OF = {package: dist for dist, packages in DISTRIBUTIONS.values() for package in packages}


def modules() -> dict[str, Path]:
    found = {}
    for folder in DISTRIBUTIONS:
        for path in (REPO / folder / "src").rglob("*.py"):
            parts = path.relative_to(REPO / folder / "src").with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """The flare modules `path` imports (`from a import b` counts as a and a.b)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in out if name.startswith("flare.")}


def distribution(module: str) -> str | None:
    parts = module.split(".")
    return PACKAGE_OF.get(parts[1]) if len(parts) > 1 else None


def test_each_distribution_imports_only_down_the_graph():
    wrong = []
    for module, path in modules().items():
        mine = distribution(module)
        for target in imports(path):
            theirs = distribution(target)
            if theirs in (None, mine) or theirs in ALLOWED[mine]:
                continue
            if module in RANK_HOSTS and theirs == "flare-instrumentation":
                continue
            wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_each_distribution_declares_what_it_imports():
    missing = []
    for folder, (dist, _) in DISTRIBUTIONS.items():
        project = tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]
        assert project["name"] == dist
        declared = {d.split("[")[0].split(">")[0].split("=")[0].strip()
                    for d in project.get("dependencies", [])}
        used = set()
        for module, path in modules().items():
            if distribution(module) == dist:
                used |= {distribution(t) for t in imports(path)} - {None, dist}
        missing += [f"{dist} imports {other} without declaring it" for other in used - declared]
    assert not missing, "\n".join(missing)


def test_the_rank_installs_no_decoder():
    """A rank installs flare-wire and flare-instrumentation: the only C either builds is
    the attribute writer; the collector's readers are built by flare-processors."""
    built = {}
    for folder in DISTRIBUTIONS:
        tool = tomllib.loads((REPO / folder / "pyproject.toml").read_text()).get("tool", {})
        built[folder] = [ext["name"] for ext in tool.get("setuptools", {}).get("ext-modules", [])]
    assert built["instrumentation"] == []
    assert built["wire"] == ["flare.wire._otlp_write"]
    assert built["processors"] == ["flare.processors._otlp_read"]
    rank_dependencies = tomllib.loads((REPO / "instrumentation/pyproject.toml").read_text())
    assert not any(d.startswith(("flare-processors", "flare-exporters", "flare-collector"))
                   for d in rank_dependencies["project"]["dependencies"])


def test_no_module_imports_itself_back():
    """No import cycle among Flare's modules, imports inside functions included."""
    found = modules()
    graph = {m: {t for t in imports(p) if t in found and t != m} for m, p in found.items()}
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            # a package and the modules it re-exports are one unit, not a cycle
            packages = {m for m in component if found[m].name == "__init__.py"}
            rest = [m for m in component if m not in packages
                    and not any(m.startswith(p + ".") for p in packages)]
            if len(component) > 1 and rest:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, cycles


def test_a_source_distribution_carries_what_its_c_is_built_from(tmp_path):
    """An sdist takes the listed C sources by itself but not the header they include:
    without it a wheel built from the sdist has no C module (the extensions are
    optional, so the build would not even fail)."""
    import shutil
    import subprocess
    import tarfile

    for folder in ("wire", "processors"):
        # from a clean copy: an sdist also takes what an earlier build's egg-info listed
        source = tmp_path / "src" / folder
        shutil.copytree(REPO / folder, source, ignore=shutil.ignore_patterns(
            "*.egg-info", "build", "__pycache__", "*.so"))
        out = tmp_path / folder
        out.mkdir()
        subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                        "b.build_sdist(sys.argv[1])", str(out)], cwd=source, check=True,
                       capture_output=True)
        [sdist] = out.glob("*.tar.gz")
        with tarfile.open(sdist) as archive:
            shipped = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
        tool = tomllib.loads((REPO / folder / "pyproject.toml").read_text())["tool"]["setuptools"]
        for ext in tool["ext-modules"]:
            needed = list(ext["sources"])
            for directory in ext.get("include-dirs", []):
                needed += [str(p.relative_to(REPO / folder)) for p in (REPO / folder / directory).glob("*.h")]
            missing = [name for name in needed if name not in shipped]
            assert not missing, f"{folder}'s sdist lacks {missing}"


# The size a module and a class may grow to before they are split along their seams
# (issue #30's targets: one job per module).
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300


def test_no_module_or_class_outgrows_its_limit():
    too_big = []
    for name, path in modules().items():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            too_big.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_big.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_big, too_big
