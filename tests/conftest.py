import logging
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings

# A fixed, derandomised budget keeps CI time bounded and failures reproducible.
settings.register_profile(
    "attnkit",
    deadline=None,
    max_examples=int(os.environ.get("ATTNKIT_HYPOTHESIS_EXAMPLES", "25")),
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("attnkit")

# Threads per test process: ATTNKIT_TEST_THREADS when set (run the suite once with 1 and once with 2);
# else one per pytest-xdist worker (the README's command runs one worker per core) and at most two
# in a single process. Tests about threading set their own count.
_threads = os.environ.get("ATTNKIT_TEST_THREADS")
if _threads is not None:
    torch.set_num_threads(int(_threads))
elif os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
else:
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture
def said(caplog):
    """``said()``: what attnkit has said since the test began, as text: its log records (INFO and up) and its
    warnings, one a line (attnkit prints nothing on stdout or stderr)."""
    caplog.set_level(logging.INFO, logger="attnkit")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield lambda: "\n".join([r.getMessage() for r in caplog.records if r.name.startswith("attnkit")]
                                + [str(w.message) for w in caught])


@pytest.fixture
def one_thread():
    """The test's torch ops on one thread (``attnkit._cpu.one_thread``): for files whose shapes are so small that
    every thread hand-off costs more than the work."""
    from attnkit._cpu import one_thread as on_one_thread

    with on_one_thread():
        yield
