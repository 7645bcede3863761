"""The Python package's modules import one another without a cycle (docs/DESIGN.md, "Python
package"): the graph of python/strata/*.py built from their `import` statements - every one,
those inside functions included, since a function-level import is how a cycle hides - has
no strongly connected component of more than one module, and no module imports itself.

Read from the sources (ast), never by importing them: torch, DeepSpeed and the extension are
not needed, and an import done lazily counts as much as one at the top."""

import ast
import os

PKG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "strata")


def _modules():
    """{module name: path} of the package's modules ("__init__" for the package; the C
    extension strata._strata, built from _strata*.c, with no path: it imports none)."""
    mods = {f[:-3]: os.path.join(PKG, f) for f in sorted(os.listdir(PKG)) if f.endswith(".py")}
    if os.path.exists(os.path.join(PKG, "_strata.c")):
        mods["_strata"] = None
    return mods


def _targets(node, mods):
    """The package's modules that one import statement names."""
    if isinstance(node, ast.Import):
        out = []
        for a in node.names:
            parts = a.name.split(".")
            if parts[0] == "strata":
                out.append(parts[1] if len(parts) > 1 and parts[1] in mods else "__init__")
        return out
    if node.level == 0:
        mod = node.module or ""
        if mod != "strata" and not mod.startswith("strata."):
            return []
        rest = mod.split(".")[1:]
    elif node.level == 1:
        rest = node.module.split(".") if node.module else []
    else:
        return []
    if rest:   # from strata.<mod> import ... / from .<mod> import ...
        return [rest[0]] if rest[0] in mods else []
    # from strata import a, b / from . import a: each a module of the package, or a name of
    # the package itself
    return [a.name if a.name in mods else "__init__" for a in node.names]


def import_graph():
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        if path is None:
            graph[name] = []
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_targets(node, mods))
        graph[name] = sorted(edges)
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan), and the modules
    that import themselves, each sorted: [[module, ...]]."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_cycles_finds_a_planted_cycle():
    """The check itself: a cycle through a function-level import is found."""
    g = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["d"], "e": []}
    assert cycles(g) == [["a", "b", "c"], ["d"]]
    src = ("import strata\nimport os\ndef f():\n    from strata.torch import save\n"
           "from . import _values, VERSION\nfrom ._strata import Error\n"
           "from strata._flush import plan\nimport strata.deepspeed as ds\n")
    mods = {"torch": "", "_values": "", "__init__": "", "_strata": None, "_flush": "",
            "deepspeed": ""}
    got = sorted(t for n in ast.walk(ast.parse(src))
                 if isinstance(n, (ast.Import, ast.ImportFrom)) for t in _targets(n, mods))
    assert got == ["__init__", "__init__", "_flush", "_strata", "_values", "deepspeed", "torch"]


def test_no_import_cycle():
    graph = import_graph()
    assert "torch" in graph and "_manager" in graph, "the package was not found at %s" % PKG
    found = cycles(graph)
    assert not found, "import cycles in python/strata: %s" % "; ".join(
        " <-> ".join(c) for c in found)
