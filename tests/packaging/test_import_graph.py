"""The import graph of hkt's own modules, read from the source with ast: no
circle (module-level and function-level imports both count: a circle closed
inside a function still ties the modules together), only hkt/_core/kernels.py
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
    assert {"hkt.functional", "hkt._core.kernels", "hkt.reference", "hkt.nn.modules"} <= set(g)
    assert "hkt._core.kernels" in g["hkt.functional"] and "hkt._C" in g["hkt._core.kernels"]
    assert "hkt.reference" in g["hkt"] and "hkt._core.maths" in g["hkt._core.checks"]


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_in_hkt():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_only_the_kernel_calls_import_the_extension():
    users = sorted(m for m, deps in _graph().items() if "hkt._C" in deps)
    assert users == ["hkt", "hkt._core.kernels"], users  # hkt: __init__'s loader


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


# ---- the layers: which package may import which (docs/layout.md's first table)

LAYOUT = PACKAGE.parent / "docs" / "layout.md"
ENTRIES = ("hkt.functional", "hkt.varlen", "hkt.kvcache", "hkt.downsample")
# each group, the groups it may import (besides itself), bottom row first; hkt._C is the extension
MAY_IMPORT = {
    "hkt._core": {"hkt._C"},
    "hkt.ops": {"hkt._core"},
    "entries": {"hkt._core", "hkt.ops"},
    "hkt.decoding": {"hkt._core", "hkt.ops", "entries"},
    "hkt.nn": {"hkt._core", "hkt.ops", "entries", "hkt.decoding"},
    "hkt.integrations": {"hkt", "hkt._core", "hkt.ops", "entries", "hkt.decoding", "hkt.nn"},
    "hkt.analysis": {"hkt._core", "hkt.ops", "entries", "hkt.decoding", "hkt.nn", "hkt.reference"},
    "hkt.modules": {"hkt.nn"},
    "hkt": {"hkt._C", "hkt._core", "hkt.ops", "entries", "hkt.decoding", "hkt.nn", "hkt.reference"},
    "hkt.reference": set(),
}
# the modules at hkt/'s root: the public entry points (and hkt.modules, 0.2.0's name of
# MultiheadHKT's module, which a module pickled whole with torch.save names)
ROOT_MODULES = {"hkt", "hkt.functional", "hkt.varlen", "hkt.kvcache", "hkt.downsample", "hkt.reference",
                "hkt.analysis", "hkt.modules"}


def _group(module):
    if module in ENTRIES:
        return "entries"
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or module in MAY_IMPORT else module


def test_every_module_has_a_layer():
    groups = {_group(m) for m in _graph()}
    assert groups <= set(MAY_IMPORT), sorted(groups - set(MAY_IMPORT))


def test_each_package_imports_only_the_layers_below_it():
    wrong = sorted(f"{m} imports {d}" for m, deps in _graph().items() for d in deps
                   if _group(d) != _group(m) and _group(d) not in MAY_IMPORT[_group(m)])
    assert wrong == []


def test_the_layer_rules_see_an_import_across_layers():
    g = _graph()
    assert "hkt._core.kernels" in g["hkt.ops.attention"] and "hkt.ops.attention" in g["hkt.nn._mha_levels"]
    assert _group("hkt.ops.window") == "hkt.ops" and _group("hkt.varlen") == "entries"


def test_at_most_eight_modules_at_the_root():
    root = {_module_name(p) for p in PACKAGE.glob("*.py")}
    assert root == ROOT_MODULES and len(root) <= 8, sorted(root)


def test_the_layout_page_gives_the_same_rules():
    """docs/layout.md's first table: a row per layer, its packages and what they may
    import, in the rules' words (`hkt.x` names; "the entry points" for ENTRIES)."""
    text = LAYOUT.read_text()
    rows = [line for line in text[text.index("\n|"):].split("\n\n")[0].splitlines()[2:]]
    read = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = lambda cell: {("entries" if n in ENTRIES else n) for n in _names(cell)}  # noqa: E731
        for group in names(cells[0]):
            read[group] = names(cells[-1])
    assert read == MAY_IMPORT


def _names(cell):
    import re
    found = set(re.findall(r"`(hkt(?:\.[\w]+)?)`", cell))
    if "the entry points" in cell:
        found.update(ENTRIES)
    return found
