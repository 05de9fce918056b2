"""The layout's limits (issue 40), read from the sources: no library file over
1,000 lines, no C function over 120 lines, no Python function over 100 lines
of code (its docstring, the API's text, not counted), and no circle in the
#include graph of csrc/.  A longer function says why in a comment naming
LONG_FUNCTION_OK on the line above it."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
C_SUFFIXES = (".c", ".h", ".cu")


def library_files():
    return sorted([*ROOT.joinpath("hkt").rglob("*.py"),
                   *(p for p in ROOT.joinpath("csrc").rglob("*") if p.suffix in C_SUFFIXES)])


def c_functions(text):
    """(name, first line, lines) of each function defined at the top level of
    C or CUDA source: a line at column 0 that opens a parameter list, whose
    body's braces are then matched (comments and strings are not parsed: the
    sources keep braces out of them at the top level)."""
    lines = text.split("\n")
    found, i = [], 0
    head = re.compile(r"^(?!#|typedef|struct|enum|union|static_assert|extern \"C\"|//|/\*| )[^;=]*?\b(\w+)\s*\(")
    while i < len(lines):
        m = head.match(re.sub(r"__launch_bounds__\([^)]*\)|__attribute__\(\([^)]*\)\)", "", lines[i]))
        if not m:
            i += 1
            continue
        j = i
        while j < len(lines) and "{" not in lines[j] and ";" not in lines[j]:
            j += 1
        if j == len(lines) or ";" in lines[j].split("{")[0]:  # a declaration
            i = j + 1
            continue
        depth, k = 0, j
        while k < len(lines):
            depth += lines[k].count("{") - lines[k].count("}")
            if depth == 0:
                break
            k += 1
        allowed = i > 0 and "LONG_FUNCTION_OK" in lines[i - 1]
        found.append((m.group(1), i + 1, k - i + 1, allowed))
        i = k + 1
    return found


def python_functions(text, path):
    """(name, first line, lines of code) of each function, its docstring left out."""
    out = []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            doc = node.body[0] if node.body and isinstance(node.body[0], ast.Expr) and \
                isinstance(getattr(node.body[0], "value", None), ast.Constant) and \
                isinstance(node.body[0].value.value, str) else None
            if doc is not None:
                n -= doc.end_lineno - doc.lineno + 1
            out.append((node.name, node.lineno, n))
    return out


def test_the_readers_see_what_is_there():
    """Else the limits below would pass on nothing."""
    fake_c = "static int f(int a,\n          int b) {\n" + "    a++;\n" * 130 + "}\nint g(void);\n"
    assert c_functions(fake_c) == [("f", 1, 133, False)]
    assert c_functions("/* LONG_FUNCTION_OK: why */\n" + fake_c)[0][3]
    fake_py = 'def f():\n    """doc\n    more"""\n' + "    x = 1\n" * 5
    assert python_functions(fake_py, "x.py") == [("f", 1, 6)]
    names = {name for p in library_files() if p.suffix in C_SUFFIXES for name, *_ in c_functions(p.read_text())}
    assert {"tc_forward_kernel", "softmax_update", "py_window"} <= names


@pytest.mark.parametrize("path", library_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_file_and_function_limits(path):
    text = path.read_text()
    assert text.count("\n") <= 1000, f"{path.name}: {text.count(chr(10))} lines (at most 1,000)"
    if path.suffix in C_SUFFIXES:
        long = [(n, at, size) for n, at, size, ok in c_functions(text) if size > 120 and not ok]
        assert not long, f"C functions over 120 lines: {long}"
    else:
        long = [f for f in python_functions(text, path) if f[2] > 100]
        assert not long, f"Python functions over 100 lines of code: {long}"


def test_the_integrations_files_are_short():
    """A package per integration, a file per concern (issue 57): none over 400 lines."""
    files = sorted(ROOT.joinpath("hkt", "integrations").rglob("*.py"))
    assert len(files) > 2
    long = {str(p.relative_to(ROOT)): n for p in files if (n := p.read_text().count("\n")) > 400}
    assert not long, long


def _includes():
    """Each C source's quoted includes, found as the compilers find them: beside
    the source, else in csrc/ (the one -I of every build)."""
    csrc, graph = ROOT.joinpath("csrc").resolve(), {}
    for p in csrc.rglob("*"):
        if p.suffix in C_SUFFIXES:
            names = re.findall(r'^\s*#\s*include\s+"([^"]+)"', p.read_text(), re.M)
            graph[p] = {(p.parent / n if (p.parent / n).is_file() else csrc / n).resolve() for n in names}
    return graph


def test_includes_follow_the_layering():
    """csrc/'s root holds the public headers and what CPU and CUDA share; each
    folder (cpu/, cuda/, binding/) includes the root's headers and its own,
    never another folder's; the root includes only the root."""
    csrc = ROOT.joinpath("csrc").resolve()
    graph = _includes()
    assert {p.parent.name for p in graph} >= {"cpu", "cuda", "binding"}
    for src, targets in graph.items():
        for t in targets:
            assert t.is_file(), f"{src.relative_to(csrc)} includes {t.name}, which is not in its folder nor csrc/"
            assert t.parent in (csrc, src.parent), f"{src.relative_to(csrc)} includes {t.relative_to(csrc)}"


def test_no_include_circle_in_csrc():
    graph = _includes()
    assert any(graph.values())  # the includes are read
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                pytest.fail("include circle: " + " -> ".join(p.name for p in path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"
    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
