"""tools/wheel_check.py's look at the wheel file itself (make wheel-check runs
it on the real one): an abi3 manylinux wheel with hkt/_C.abi3.so and no OpenMP
runtime of its own passes; each other wheel is refused, saying why."""
import os
import sys
import zipfile

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools")
pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(TOOLS, "wheel_check.py")),
                                reason="needs tools/wheel_check.py (the source tree)")

GOOD = "hkt-0.2.0-cp310-abi3-manylinux_2_34_x86_64.whl"
FILES = ["hkt/__init__.py", "hkt/_C.abi3.so", "hkt-0.2.0.dist-info/WHEEL"]


@pytest.fixture(scope="module")
def check_wheel_file():
    sys.path.insert(0, TOOLS)
    try:
        from wheel_check import check_wheel_file
    finally:
        sys.path.remove(TOOLS)
    return check_wheel_file


def _wheel(tmp_path, name, files):
    path = tmp_path / name
    with zipfile.ZipFile(path, "w") as z:
        for f in files:
            z.writestr(f, b"")
    return str(path)


def test_the_repaired_wheel_passes(tmp_path, check_wheel_file):
    check_wheel_file(_wheel(tmp_path, GOOD, FILES))


@pytest.mark.parametrize("name, files, why", [
    ("hkt-0.2.0-cp310-abi3-linux_x86_64.whl", FILES, "not a manylinux wheel"),
    ("hkt-0.2.0-cp311-cp311-manylinux_2_34_x86_64.whl", FILES, "not an abi3 wheel"),
    (GOOD, FILES + ["hkt.libs/libgomp-a34b3233.so.1"], "vendors an OpenMP runtime"),
    (GOOD, FILES + ["hkt.libs/libiomp5.so"], "vendors an OpenMP runtime"),
    (GOOD, FILES[:1], "no hkt/_C.abi3.so"),
])
def test_other_wheels_are_refused(tmp_path, check_wheel_file, name, files, why):
    with pytest.raises(SystemExit, match=why):
        check_wheel_file(_wheel(tmp_path, name, files))
