"""The import graph of hkt's own modules, read from the source with ast: no
circle (module-level and function-level imports both count: a circle closed
inside a function still ties the modules together), only hkt/_kernels.py
calls into the extension (hkt/__init__.py loads it), and hkt/reference.py, the
definition the kernels are tested against, imports nothing of hkt."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "hkt"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path):
    """The hkt modules that path imports anywhere in it, as dotted names
    ("hkt._C" for the extension)."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name == "hkt" or a.name.startswith("hkt."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod != "hkt" and not mod.startswith("hkt."):
                continue
            # `from . import x` and `from .pkg import x` may name modules: count those that are
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in _all_modules() or sub == "hkt._C" else mod)
    found.discard(here)
    return found


def _all_modules():
    return {_module_name(p) for p in PACKAGE.rglob("*.py")}


def _graph():
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _cycle(graph):
    """One import circle of graph as a list of modules (first == last), or None."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if n not in graph:
                continue
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n, path + [n])
                if found:
                    return found
        state[m] = "done"
        return None
    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_the_graph_is_read():
    """The reader sees the imports that are there (else the tests below pass on
    an empty graph)."""
    g = _graph()
    assert {"hkt.functional", "hkt._kernels", "hkt.reference", "hkt.modules"} <= set(g)
    assert "hkt._kernels" in g["hkt.functional"] and "hkt._C" in g["hkt._kernels"]
    assert "hkt.reference" in g["hkt"] and "hkt._maths" in g["hkt._checks"]


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_in_hkt():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_only_the_kernel_calls_import_the_extension():
    users = sorted(m for m, deps in _graph().items() if "hkt._C" in deps)
    assert users == ["hkt", "hkt._kernels"], users  # hkt: __init__'s loader


@pytest.mark.parametrize("module", ["hkt.reference"])
def test_the_reference_imports_nothing_of_hkt(module):
    assert _graph()[module] == set()


# the modules that may import the reference: the package exposes it, and the
# paper's analysis tools draw its score matrices as a user would
MAY_IMPORT_THE_REFERENCE = {"hkt", "hkt.analysis"}


def test_no_library_module_imports_the_reference():
    users = {m for m, deps in _graph().items() if "hkt.reference" in deps}
    assert "hkt" in users  # the scan sees an import that is there
    assert users <= MAY_IMPORT_THE_REFERENCE, sorted(users - MAY_IMPORT_THE_REFERENCE)
