"""pytest configuration for tests/python.

- Marker `slow`: tests that start several processes (tests/python/_dist.py). They run by
  default; `-m "not slow"` leaves them out.
- Marker `gpu`: tests with CUDA tensors (test_torch_cuda.py); they skip without a CUDA
  device. `make test-gpu` runs them with `-m gpu` on a machine with one.
- Fixture `figures`: a test reports a figure (timings, sizes, error margins) with
  figures("name", "text"); the figures are printed at the end of the run, in a section of their
  own, whether or not output is captured (the resume test's figures are quoted in notes).
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

_FIGURES = []


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: starts several processes (torch.distributed, gloo); deselect with "
                   "-m 'not slow'")
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device (test_torch_cuda.py; make test-gpu runs them, "
                   "they skip without one)")
    # torch without numpy (this venv) warns once at import; nothing here needs numpy
    config.addinivalue_line("filterwarnings", "ignore:Failed to initialize NumPy")


@pytest.fixture
def figures(request):
    def report(name, text):
        line = "%s: %s" % (name, text)
        _FIGURES.append((request.node.nodeid, line))
        print(line)
    return report


def pytest_terminal_summary(terminalreporter):
    if not _FIGURES:
        return
    terminalreporter.section("strata.torch figures")
    for nodeid, line in _FIGURES:
        terminalreporter.write_line("%s  [%s]" % (line, nodeid.split("::")[-1]))
