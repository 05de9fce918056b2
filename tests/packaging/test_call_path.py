"""The eager call path of hkt.hkt_attention stays short (issue 47, "One way
through"): a reader following q from hkt_attention to the kernel goes down
through the layers (the functional call, the dense family's op, the kernel
call, the binding) and does not come back up.  tools/call_path.py counts, per
path (the forward with gradients, its backward, the forward without), the
stays (entries into hkt's Python functions, comprehension frames included) and
the returns to a file already left; each path is held to at most 12 and 4, and
none goes through hkt/reference.py.  A helper added on the way fails this:
fold it into its caller, or raise the limit here on purpose."""
import importlib.util
import os

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools")
pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(TOOLS, "call_path.py")),
                                reason="needs tools/call_path.py (the source tree)")

MAX_STAYS, MAX_RETURNS = 12, 4
PATHS = ("forward, with gradients", "backward", "forward, no gradients")


@pytest.fixture(scope="module")
def paths():
    spec = importlib.util.spec_from_file_location("call_path", os.path.join(TOOLS, "call_path.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.measure()


@pytest.mark.parametrize("name", PATHS)
def test_the_path_is_short_and_goes_down(paths, name):
    r = paths[name]
    steps = "\n".join(r["path"])
    assert r["stays before the kernel"] is not None, f"{name}: never reached hkt._C\n{steps}"
    assert r["stays"] <= MAX_STAYS, f"{name}: {r['stays']} stays, at most {MAX_STAYS}:\n{steps}"
    assert r["returns"] <= MAX_RETURNS, f"{name}: {r['returns']} returns to a file already left, at most " \
                                        f"{MAX_RETURNS}:\n{steps}"
    assert not r["reference"], f"{name}: goes through hkt/reference.py:\n{steps}"
