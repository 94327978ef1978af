"""Flare's C modules compile without warnings and survives the fuzzer under ASan + UBSan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import sanitized  # a sibling module, shared with benchmarks/fuzz_otlp.py


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    if sanitized.compiler() is None or sanitized.asan_runtime(sanitized.compiler()) is None:
        pytest.skip("no C compiler with an AddressSanitizer runtime here")
    directory = tmp_path_factory.mktemp("sanitized")
    try:
        sanitized.build(directory)
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"Flare's C modules do not build with -Werror and the sanitizers:\n{exc.stderr}")
    return directory


def test_fuzzed_c_readers_have_no_sanitizer_finding(build_dir):
    # 800 mutations reach every reader (the counts below); the long run is
    # benchmarks/fuzz_otlp.py's part 3 (5,000 by default)
    result = sanitized.run(build_dir, seed=7, count=800, timeout_s=240)
    report = result.stderr[-4000:]
    assert result.returncode == 0, f"sanitizer run failed ({result.returncode}):\n{report}"
    assert "ERROR: AddressSanitizer" not in result.stderr and "runtime error" not in result.stderr
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    assert stats["mutations"] == 800 and stats["lost_spans"] == 0
    assert stats["encoded_attribute_maps"] > 100
    assert stats["rank_link_sets"] >= 100


def test_the_sanitizers_do_catch_a_bad_read(build_dir, tmp_path):
    """The harness would see a finding: an out-of-bounds read in a module built the
    same way aborts the process with ASan's report."""
    source = tmp_path / "oob.c"
    source.write_text(
        "#include <Python.h>\n"
        "static PyObject *f(PyObject *s, PyObject *a) { char *p = PyMem_Malloc(8);\n"
        "  volatile char c = p[8]; PyMem_Free(p); return PyLong_FromLong(c); }\n"
        "static PyMethodDef m[] = {{\"f\", f, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};\n"
        "static struct PyModuleDef d = {PyModuleDef_HEAD_INIT, .m_name = \"oob\", .m_size = -1,"
        " .m_methods = m};\n"
        "PyMODINIT_FUNC PyInit_oob(void) { return PyModule_Create(&d); }\n")
    import importlib.machinery
    import os
    import sysconfig
    cc = sanitized.compiler()
    target = tmp_path / ("oob" + importlib.machinery.EXTENSION_SUFFIXES[0])
    subprocess.run([cc, "-shared", "-fPIC", *sanitized.CFLAGS, "-Wno-error",
                    f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(target)],
                   check=True, capture_output=True)
    env = {**os.environ, **sanitized.ENV, "LD_PRELOAD": sanitized.asan_runtime(cc),
           "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", "import oob; oob.f()"], capture_output=True,
                            text=True, env=env, timeout=60)
    assert result.returncode != 0
    assert "AddressSanitizer: heap-buffer-overflow" in result.stderr
