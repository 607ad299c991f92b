"""The layers' front doors and exception roots (docs/architecture.md, the folder map).

Every exception class a layer defines derives from that layer's one root, so a caller
writes one ``except``; what the README and the docs import comes only from a front door.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import dp
import fl
import secagg
import transport
from dp.errors import PrivacyError
from fl.errors import FLError
from secagg.errors import SecAggError
from transport.errors import TransportError

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"secagg": SecAggError, "transport": TransportError, "dp": PrivacyError,
          "fl": FLError}
# the front doors: a layer's package, and the Flower adapter's own (it needs the extra)
FRONT_DOORS = {"secagg", "transport", "dp", "fl", "fl.flower", "fl.nvflare"}


def _modules(package: str) -> list[str]:
    root = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        if info.name.endswith("__main__"):
            continue
        names.append(info.name)
    return names


def _have_nvflare() -> bool:
    try:  # nvflare.apis: with tests/ on sys.path, tests/nvflare/ is a namespace "nvflare"
        return importlib.util.find_spec("nvflare.apis") is not None
    except ImportError:
        return False


def _exceptions(package: str) -> list[type[BaseException]]:
    found = []
    for name in _modules(package):
        if name.startswith("fl.flower"):
            pytest.importorskip("flwr")
        if name.startswith("fl.nvflare") and not _have_nvflare():
            continue  # the optional extra; its errors are checked where it is installed
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == name:
                found.append(obj)
    return found


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_every_exception_of_a_layer_derives_from_its_root(layer: str) -> None:
    classes = _exceptions(layer)
    assert len(classes) >= 3, f"found only {classes} in {layer}"
    # errors only: an interrupt (a BaseException that is no Exception, as
    # fl.cli._common.Stopped for SIGTERM is a KeyboardInterrupt) must not be caught as one
    strays = [f"{c.__module__}.{c.__qualname__}" for c in classes
              if issubclass(c, Exception) and not issubclass(c, LAYERS[layer])]
    assert strays == [], f"{layer}: these do not derive from {LAYERS[layer].__name__}"


@pytest.mark.parametrize("package", [secagg, transport, dp, fl])
def test_a_front_door_exports_every_name_it_lists(package: object) -> None:
    names = getattr(package, "__all__", None)
    assert names, f"{package.__name__} declares no __all__"  # type: ignore[attr-defined]
    for name in names:
        assert getattr(package, name) is not None


# what fl may import from the layers below it: their front doors' ``__all__``
EXPORTED = {"transport": frozenset(transport.__all__), "dp": frozenset(dp.__all__)}


def _past_front_doors(folder: Path) -> list[str]:
    """Every import in ``folder`` (module level, in functions, under ``if TYPE_CHECKING:``)
    that reaches past transport's or dp's front door: an inner module (``from dp.ledger
    import Ledger``, ``import transport.link``), a name the front door does not export, or an
    attribute of ``import dp`` that it does not export."""
    import ast

    bad = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = path.relative_to(folder.parent)
        bound: dict[str, str] = {}  # a local name of ``import dp`` -> "dp"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                layer = node.module.split(".")[0]
                if layer not in EXPORTED:
                    continue
                names = [a.name for a in node.names]
                if node.module != layer:
                    bad.append(f"{where}:{node.lineno}: from {node.module} import "
                               f"{', '.join(names)}")
                else:
                    bad += [f"{where}:{node.lineno}: {layer}.{n} is not exported"
                            for n in names if n not in EXPORTED[layer]]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    layer = alias.name.split(".")[0]
                    if layer not in EXPORTED:
                        continue
                    if alias.name != layer:
                        bad.append(f"{where}:{node.lineno}: import {alias.name}")
                    bound[alias.asname or layer] = layer
        bad += [f"{where}:{node.lineno}: {bound[node.value.id]}.{node.attr} is not exported"
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and node.attr not in EXPORTED[bound[node.value.id]]]
    return bad


def test_fl_imports_transport_and_dp_only_through_their_front_doors() -> None:
    """The front doors are the contract between layers: fl imports what it needs from
    transport and dp by the names they export (``from dp import SitePolicy``), never from an
    inner module, so an inner module can move without touching fl."""
    assert _past_front_doors(ROOT / "fl") == []


def test_the_front_door_rule_sees_every_way_past_a_front_door(tmp_path: Path) -> None:
    """The rule above is only as good as what it sees: each way past a front door, in a
    function or under TYPE_CHECKING too, is reported; what the front doors export is not."""
    folder = tmp_path / "fl"
    (folder / "site").mkdir(parents=True)
    (folder / "site" / "bad.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import dp\n"
        "import transport.link\n"                                  # 3
        "from dp.ledger import Ledger\n"                           # 4
        "from transport import Link, fields\n"                     # ok
        "from dp import SitePolicy, DEFAULT_EPSILON\n"             # 6: not exported
        "if TYPE_CHECKING:\n"
        "    from transport.topics import Topics\n"                # 8
        "def f():\n"
        "    from dp.accounting import rdp_to_epsilon\n"           # 10
        "    return dp.accounting.ORDERS, dp.SitePolicy\n")        # 11: dp.accounting
    (folder / "good.py").write_text("from dp import mechanisms\nfrom transport import Topics\n")
    assert _past_front_doors(folder) == [
        "fl/site/bad.py:3: import transport.link",
        "fl/site/bad.py:4: from dp.ledger import Ledger",
        "fl/site/bad.py:6: dp.DEFAULT_EPSILON is not exported",
        "fl/site/bad.py:8: from transport.topics import Topics",
        "fl/site/bad.py:10: from dp.accounting import rdp_to_epsilon",
        "fl/site/bad.py:11: dp.accounting is not exported",
    ]


_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", re.MULTILINE)


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_the_readme_and_docs_import_only_from_front_doors() -> None:
    layers = tuple(LAYERS)
    bad = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in _python_blocks(path.read_text()):
            for match in _IMPORT.finditer(block):
                module = match.group(1) or match.group(2)
                if module.split(".")[0] in layers and module not in FRONT_DOORS:
                    bad.append(f"{path.name}: {module}")
    assert bad == [], "import these names from the layer's front door instead"


def _imports(module: str, path: Path, modules: set[str], *, annotations: bool = False
             ) -> set[str]:
    """The package modules ``module`` imports when it runs (module level and inside
    functions; ``if TYPE_CHECKING:`` blocks are annotations only and count only with
    ``annotations``)."""
    import ast

    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                    and not annotations):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([base] if base else [])])
                subs = {f"{base}.{a.name}" for a in node.names}
                found.update(subs & modules)
                if subs - modules and base in modules:
                    found.add(base)
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    visit(inner)

    visit(ast.parse(path.read_text()).body)
    return found - {module}


def _graph(layers: tuple[str, ...], *, annotations: bool = False, root: Path = ROOT
           ) -> tuple[dict[str, set[str]], dict[str, Path]]:
    """The import graph among the modules of ``layers`` under ``root`` and their paths."""
    paths = {}
    for layer in layers:
        for path in (root / layer).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            paths[name.removesuffix(".__init__")] = path
    graph = {m: _imports(m, p, set(paths), annotations=annotations) for m, p in paths.items()}
    return graph, paths


def _circles(layers: tuple[str, ...], *, annotations: bool = False, root: Path = ROOT
             ) -> list[str]:
    """Every import circle among the modules of ``layers`` (one per module on it)."""
    graph, _ = _graph(layers, annotations=annotations, root=root)
    circles = []
    for start in graph:  # a depth-first search back to the start, from each module
        stack, seen = [(start, (start,))], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(" -> ".join((*trail, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*trail, nxt)))
    return circles


def test_no_import_circles() -> None:
    """No module of the four layers imports, at run time, one that imports it back."""
    assert _circles(tuple(LAYERS)) == []


# The one circle left, by an annotation only: secagg.resume types its functions with the
# Client whose snapshot()/restore() call them (resume reads 14 of the client's private
# members; untying it means a Protocol of those and MaskedStream in a module of its own).
ANNOTATION_CIRCLES = {"secagg": {"secagg.client -> secagg.resume -> secagg.client",
                                 "secagg.resume -> secagg.client -> secagg.resume"}}


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_no_import_circles_even_through_annotations(layer: str) -> None:
    """Within each layer not even an ``if TYPE_CHECKING:`` import closes a circle: a circle
    hidden from the interpreter is still one a reader (and a refactor) must untangle. The
    known one is listed exactly, so a new circle fails and untying it updates the list."""
    assert set(_circles((layer,), annotations=True)) == ANNOTATION_CIRCLES.get(layer, set())


def test_the_circle_rule_sees_a_circle_closed_by_an_annotation(tmp_path: Path) -> None:
    """The rule above is only as good as what it sees: a circle closed by an ``if
    TYPE_CHECKING:`` import (or one in a function) is reported with annotations counted, and
    only the run-time one without them."""
    folder = tmp_path / "fl"
    (folder / "site").mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / "site" / "__init__.py").write_text("")
    (folder / "site" / "training.py").write_text("from fl.site.idp import SiteIdp\n")
    (folder / "site" / "idp.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from fl.coordinator import Coordinator\n")
    (folder / "coordinator.py").write_text(
        "def f():\n"
        "    from fl.site import training\n")
    (folder / "plain.py").write_text("from . import coordinator\n")
    assert set(_circles(("fl",), root=tmp_path)) == set()
    assert set(_circles(("fl",), annotations=True, root=tmp_path)) == {
        "fl.site.training -> fl.site.idp -> fl.coordinator -> fl.site.training",
        "fl.site.idp -> fl.coordinator -> fl.site.training -> fl.site.idp",
        "fl.coordinator -> fl.site.training -> fl.site.idp -> fl.coordinator"}
    (folder / "site" / "idp.py").write_text("from fl.coordinator import Coordinator\n")
    assert len(_circles(("fl",), root=tmp_path)) == 3  # now a run-time circle


#: The coordinator's modules outside fl/plan/; with fl/plan/'s modules other than
#: ``fl.plan.SHARED_WITH_SITES`` they are what no site module may reach.
COORDINATOR_MODULES = frozenset({"fl.coordinator", "fl.federation", "fl.remote.coordinator"})


def _site_reaches_coordinator(root: Path, shared: frozenset[str]) -> list[str]:
    """Every way a module under ``root``/fl/site/ reaches a coordinator-only module: the
    chain of imports from the site module to it. The chain follows every import of an fl
    module: at module level, in a function and under ``if TYPE_CHECKING:``; importing
    ``a.b.c`` also runs the packages ``a`` and ``a.b``, whose run-time imports are followed
    too (a package's own ``TYPE_CHECKING`` block annotates the package only)."""
    graph, _ = _graph(("fl",), annotations=True, root=root)
    runtime, _ = _graph(("fl",), root=root)
    forbidden = COORDINATOR_MODULES | {m for m in graph if m.startswith("fl.plan.")
                                       and m not in shared}

    def parents(module: str) -> set[str]:
        parts = module.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts))} & set(graph)

    found = []
    for start in sorted(m for m in graph if m == "fl.site" or m.startswith("fl.site.")):
        trail = {start: (start,)}
        imported = {start}  # reached by an import of the module itself: annotations count
        queue = [start]
        while queue:
            node = queue.pop(0)
            edges = {(m, True) for m in (graph if node in imported else runtime)[node]}
            edges |= {(p, False) for p in parents(node)}
            for nxt, as_module in sorted(edges):
                if nxt in imported or (nxt in trail and not as_module):
                    continue
                if nxt not in trail:
                    trail[nxt] = (*trail[node], nxt)
                    if nxt in forbidden:
                        found.append(" -> ".join(trail[nxt]))
                if as_module:
                    imported.add(nxt)
                if nxt not in forbidden:
                    queue.append(nxt)
    return found


def test_no_site_module_reaches_the_coordinator() -> None:
    """What a site runs never loads the coordinator's side, not even to annotate: no module
    under fl/site/ imports -- at module level, in a function, under ``if TYPE_CHECKING:``,
    or through any chain of fl modules (and the packages those imports run) -- the
    coordinator (``fl.coordinator``, ``fl.federation``, ``fl.remote.coordinator``) or a
    module of fl/plan/ other than ``fl.plan.SHARED_WITH_SITES`` (``fl.plan.privacy``, the
    plans the round's task reads). A site gets what it needs from the coordinator as data
    (the round's task) or through a narrow protocol of its own (``fl.site.idp.IdpTask``)."""
    import fl.plan

    assert _site_reaches_coordinator(ROOT, fl.plan.SHARED_WITH_SITES) == []


def test_the_site_rule_sees_every_way_to_the_coordinator(tmp_path: Path) -> None:
    """The rule above is only as good as what it sees: each way from a site module to the
    coordinator's side is reported (an annotation, a function-local import, a chain through
    a shared module, a package whose import runs the coordinator), and the shared plan and
    the site's own modules are not."""
    fl_dir = tmp_path / "fl"
    for package in ("", "site", "plan", "remote"):
        (fl_dir / package).mkdir(parents=True, exist_ok=True)
        (fl_dir / package / "__init__.py").write_text("")
    (fl_dir / "remote" / "__init__.py").write_text("from fl.remote import coordinator\n")
    for name in ("coordinator", "plan/privacy", "plan/scaler", "plan/idp", "remote/coordinator",
                 "remote/messages", "site/training"):
        (fl_dir / f"{name}.py").write_text("")
    (fl_dir / "contribution.py").write_text("from fl.plan.privacy import DistributedPlan\n"
                                            "from fl.site.training import Scaler\n")
    (fl_dir / "helper.py").write_text("from fl.plan import idp\n")
    (fl_dir / "site" / "ok.py").write_text("from fl.contribution import RoundTask\n"
                                           "from fl.plan.privacy import DistributedPlan\n")
    (fl_dir / "site" / "annotated.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from fl.coordinator import Coordinator\n")
    (fl_dir / "site" / "local.py").write_text("def f():\n    from fl.plan import scaler\n")
    (fl_dir / "site" / "chain.py").write_text("from fl import helper\n")
    (fl_dir / "site" / "package.py").write_text("from fl.remote.messages import Hello\n")
    assert sorted(_site_reaches_coordinator(tmp_path, frozenset({"fl.plan.privacy"}))) == [
        "fl.site.annotated -> fl.coordinator",
        "fl.site.chain -> fl.helper -> fl.plan.idp",
        "fl.site.local -> fl.plan.scaler",
        "fl.site.package -> fl.remote.messages -> fl.remote -> fl.remote.coordinator",
    ]
