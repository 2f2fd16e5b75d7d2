"""Import rules of the project's packages, checked on the source with `ast` (nothing is imported):

1. no import cycle among the project's modules (imports inside functions count);
2. `models` imports nothing from `rl` or `launch`;
3. `rl` imports nothing from `launch`;
4. only `rl.trainer` and `rl.build` import the Ray package `rl.ray` from the rest of `rl`, and
   `rl.ray` never imports `rl.trainer`;
5. no private name (`_x`, not a dunder) crosses modules: neither `from m import _x` nor `m._x`
   on a name bound to an imported project module;
and every import of a project module names a module that exists.

The checker is tested on synthetic package trees (it must catch each kind of violation)."""

from __future__ import annotations

import ast
import dataclasses
import os
import textwrap
from collections import defaultdict, deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("models", "rl", "launch")
RAY = "rl.ray"
RAY_IMPORTERS = ("rl.trainer", "rl.build")  # the modules of rl outside rl.ray that may import it

RULES = {
    "unresolved": "imports of project modules that do not exist",
    "cycle": "(1) import cycles",
    "models": "(2) models imports from rl or launch",
    "rl-launch": "(3) rl imports from launch",
    "ray": "(4) rl.ray is imported only by rl.trainer / rl.build and never imports rl.trainer",
    "private": "(5) private names across modules",
}


@dataclasses.dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    lazy: bool  # inside a function (or method) body

    def where(self) -> str:
        return f"line {self.line}{', lazy' if self.lazy else ''}"


def discover(root: Path, packages=PACKAGES) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is_package) of every .py file under the given top-level packages."""
    modules = {}
    for pkg in packages:
        for dirpath, dirnames, filenames in os.walk(root / pkg):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(filenames):
                if not f.endswith(".py"):
                    continue
                path = Path(dirpath) / f
                parts = list(path.relative_to(root).with_suffix("").parts)
                is_pkg = parts[-1] == "__init__"
                if is_pkg:
                    parts.pop()
                modules[".".join(parts)] = (path, is_pkg)
    return modules


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _under(module: str, pkg: str) -> bool:
    return module == pkg or module.startswith(pkg + ".")


class _Visitor(ast.NodeVisitor):
    """The project imports of one module, the names they bind to project modules, and the
    private names it takes from other modules."""

    def __init__(self, name: str, is_pkg: bool, modules, packages):
        self.name, self.is_pkg, self.modules, self.packages = name, is_pkg, modules, packages
        self.edges: list[Edge] = []
        self.bound: dict[str, str] = {}  # local name -> project module it was bound to
        self.unresolved: list[str] = []
        self.private: list[str] = []
        self.depth = 0  # function nesting

    def _project(self, module: str) -> bool:
        return module.split(".")[0] in self.packages

    def _edge(self, dst: str, node: ast.AST):
        self.edges.append(Edge(self.name, dst, node.lineno, self.depth > 0))

    def _visit_function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_Import(self, node: ast.Import):
        for alias in node.names:
            if not self._project(alias.name):
                continue
            if alias.name not in self.modules:
                self.unresolved.append(f"{self.name}:{node.lineno}: import {alias.name}")
                continue
            self._edge(alias.name, node)
            for part in alias.name.split(".")[1:]:
                if _is_private(part):
                    self.private.append(f"{self.name}:{node.lineno}: import {alias.name}")
            if alias.asname:
                self.bound[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.bound[top] = top

    def _base(self, node: ast.ImportFrom) -> str | None:
        if not node.level:
            return node.module
        package = self.name if self.is_pkg else self.name.rpartition(".")[0]
        parts = package.split(".")
        if node.level - 1 >= len(parts):
            return None
        base = ".".join(parts[: len(parts) - (node.level - 1)])
        return f"{base}.{node.module}" if node.module else base

    def visit_ImportFrom(self, node: ast.ImportFrom):
        base = self._base(node)
        stmt = f"from {'.' * node.level}{node.module or ''} import"
        resolved = f" (from {base})" if node.level and base else ""
        if base is None:
            self.unresolved.append(f"{self.name}:{node.lineno}: {stmt} (beyond the top package)")
            return
        if not self._project(base):
            return
        if base not in self.modules:
            self.unresolved.append(f"{self.name}:{node.lineno}: {stmt} ... ({base})")
            return
        for part in base.split(".")[1:]:
            if _is_private(part):
                self.private.append(f"{self.name}:{node.lineno}: {stmt} ... (module {base})")
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            local = alias.asname or alias.name
            if sub in self.modules:  # `from rl import config as C` imports module rl.config
                self._edge(sub, node)
                self.bound[local] = sub
            else:
                self._edge(base, node)
                self.bound.pop(local, None)
            if _is_private(alias.name) and sub != self.name:
                self.private.append(f"{self.name}:{node.lineno}: {stmt} {alias.name}{resolved}")

    def visit_Attribute(self, node: ast.Attribute):
        chain, base = [], node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in self.bound:
            module, expr = self.bound[base.id], base.id
            for attr in reversed(chain):
                expr += f".{attr}"
                if f"{module}.{attr}" in self.modules:
                    module = f"{module}.{attr}"
                    continue
                if _is_private(attr) and module != self.name:
                    msg = f"{self.name}:{node.lineno}: {expr} uses {module}.{attr}"
                    if msg not in self.private:
                        self.private.append(msg)
                break
        self.generic_visit(node)


def scan(root: Path, packages=PACKAGES):
    """(modules, edges, unresolved, private) of the packages under root."""
    modules = discover(root, packages)
    edges, unresolved, private = [], [], []
    for name, (path, is_pkg) in sorted(modules.items()):
        v = _Visitor(name, is_pkg, modules, packages)
        v.visit(ast.parse(path.read_text(), filename=str(path)))
        edges += v.edges
        unresolved += v.unresolved
        private += v.private
    return modules, edges, unresolved, private


def _sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(sorted(comp))
    return out


def _path(graph, src, dst, allowed) -> list[str]:
    """A shortest path src -> ... -> dst inside `allowed` (BFS)."""
    prev, queue = {src: None}, deque([src])
    while queue:
        v = queue.popleft()
        if v == dst:
            path = []
            while v is not None:
                path.append(v)
                v = prev[v]
            return path[::-1]
        for w in sorted(graph[v]):
            if w in allowed and w not in prev:
                prev[w] = v
                queue.append(w)
    raise AssertionError(f"no path {src} -> {dst}")


def cycles(edges: list[Edge]) -> list[str]:
    """One message per import cycle: for every edge inside a strongly connected component, the
    shortest cycle through it (deduplicated), as `a (line N) -> b (line M, lazy) -> a`: line N
    of module a imports b, line M of b (inside a function) imports a."""
    graph, first = defaultdict(set), {}
    for e in edges:
        graph[e.src].add(e.dst)
        graph[e.dst]
        first.setdefault((e.src, e.dst), e)
    out = []
    for comp in _sccs(graph):
        members = set(comp)
        if len(comp) == 1 and comp[0] not in graph[comp[0]]:
            continue
        seen = set()
        for u in comp:
            for v in sorted(graph[u] & members):
                cyc = [u] + _path(graph, v, u, members)  # u -> v -> ... -> u
                ring = cyc[:-1]
                k = ring.index(min(ring))
                ring = ring[k:] + ring[:k]
                if tuple(ring) in seen:
                    continue
                seen.add(tuple(ring))
                hops = [f"{a} ({first[a, b].where()})" for a, b in zip(ring, ring[1:] + ring[:1])]
                out.append(" -> ".join(hops + [ring[0]]))
    return out


def check(root: Path, packages=PACKAGES) -> dict[str, list[str]]:
    """Rule -> violations (see RULES) of the packages under root."""
    _, edges, unresolved, private = scan(root, packages)
    found = {rule: [] for rule in RULES}
    found["unresolved"] = unresolved
    found["cycle"] = cycles(edges)
    found["private"] = private
    for e in edges:
        edge = f"{e.src} imports {e.dst} ({e.where()})"
        if _under(e.src, "models") and (_under(e.dst, "rl") or _under(e.dst, "launch")):
            found["models"].append(edge)
        if _under(e.src, "rl") and _under(e.dst, "launch"):
            found["rl-launch"].append(edge)
        if (
            _under(e.dst, RAY)
            and _under(e.src, "rl")
            and not _under(e.src, RAY)
            and e.src not in RAY_IMPORTERS
        ):
            found["ray"].append(edge)
        if _under(e.src, RAY) and e.dst == "rl.trainer":
            found["ray"].append(edge)
    return found


def report(found: dict[str, list[str]]) -> str:
    lines = []
    for rule, violations in found.items():
        if violations:
            lines.append(f"{RULES[rule]}: {len(violations)}")
            lines += [f"    {v}" for v in violations]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def test_project_import_rules():
    found = check(ROOT)
    assert sum(len(v) for v in found.values()) == 0, "import rules violated:\n" + report(found)


def test_the_checker_sees_the_project():
    modules, edges, _, _ = scan(ROOT)
    assert {"models.transformer", "rl.trainer", "rl.config", "launch.train"} <= set(modules)
    assert any(e.src == "rl.trainer" and e.dst == "rl.config" for e in edges)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


CLEAN = {
    "models/__init__.py": "from models.core import Model\n",
    "models/core.py": "import os\n\nclass Model:\n    pass\n",
    "rl/__init__.py": "",
    "rl/config.py": "from models import Model\n\ndef _helper():\n    pass\n",
    "rl/trainer.py": "from rl import config as C\nfrom rl.ray import worker\n",
    "rl/build.py": "import rl.ray.worker\n",
    "rl/ray/__init__.py": "",
    "rl/ray/worker.py": "from .. import config\nfrom rl.config import __name__ as n\n",
    "launch/__init__.py": "",
    "launch/train.py": "from rl.trainer import C\nimport rl.ray\n",
}


def test_checker_passes_a_clean_tree(tmp_path):
    found = check(_tree(tmp_path, CLEAN))
    assert all(not v for v in found.values()), report(found)


def test_checker_catches_each_violation(tmp_path):
    files = dict(CLEAN)
    files.update(
        {
            # a cycle through a lazy import and a relative one: rl.a -> rl.b -> rl.a
            "rl/a.py": "from . import b\n",
            "rl/b.py": "def f():\n    from rl.a import thing\n",
            "models/core.py": "import rl.config\n",  # models -> rl (and a cycle via rl.config)
            "models/extra.py": "def f():\n    from launch import train\n",  # models -> launch
            "rl/c.py": "from launch.train import main\n",  # rl -> launch
            "rl/d.py": "import rl.ray.worker\n",  # rl outside rl.ray -> rl.ray
            "rl/ray/worker.py": "from rl.trainer import C\n",  # rl.ray -> rl.trainer (+ cycle)
            "rl/e.py": "from rl.config import _helper\n",  # private name
            "rl/f.py": "from rl import config as C\nimport rl.config\n"
            "x = C._helper\ny = rl.config._helper.__doc__\nz = C.__name__\n",
            "rl/g.py": "from rl.missing import x\n",
            "rl/h.py": "from .config import _helper\n",
        }
    )
    found = check(_tree(tmp_path, files))
    text = report(found)
    assert found["cycle"] == [
        "models (line 1) -> models.core (line 1) -> rl.config (line 1) -> models",
        "rl.ray.worker (line 1) -> rl.trainer (line 2) -> rl.ray.worker",
        "rl.a (line 1) -> rl.b (line 2, lazy) -> rl.a",  # lazy and relative imports count
    ], text
    assert found["models"] == [
        "models.core imports rl.config (line 1)",
        "models.extra imports launch.train (line 2, lazy)",
    ], text
    assert found["rl-launch"] == ["rl.c imports launch.train (line 1)"], text
    assert found["ray"] == [
        "rl.d imports rl.ray.worker (line 1)",
        "rl.ray.worker imports rl.trainer (line 1)",
    ], text
    assert found["private"] == [
        "rl.e:1: from rl.config import _helper",
        "rl.f:3: C._helper uses rl.config._helper",
        "rl.f:4: rl.config._helper uses rl.config._helper",  # once, not again for .__doc__
        "rl.h:1: from .config import _helper (from rl.config)",
    ], text
    assert found["unresolved"] == ["rl.g:1: from rl.missing import ... (rl.missing)"], text


def test_cycle_report_names_every_edge_of_a_component():
    e = [Edge("a", "b", 1, False), Edge("b", "c", 2, False), Edge("c", "a", 3, True)]
    e += [Edge("b", "a", 4, False), Edge("c", "d", 5, False)]
    assert cycles(e) == [
        "a (line 1) -> b (line 4) -> a",
        "a (line 1) -> b (line 2) -> c (line 3, lazy) -> a",
    ]
    assert cycles([Edge("a", "a", 1, False)]) == ["a (line 1) -> a"]
    assert cycles([Edge("a", "b", 1, False)]) == []
