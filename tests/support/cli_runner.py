"""Run the ``attnkit`` command in a fresh interpreter and report whether it got as far as importing torch."""

from __future__ import annotations

import subprocess
import sys

_RUNNER = """
import sys
from attnkit.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print("torch imported:", "torch" in sys.modules, "rc:", rc)
"""


def run_fresh(*argv: str) -> subprocess.CompletedProcess:
    """``attnkit ARGV`` in a new process; its stdout ends with ``torch imported: <bool> rc: <code>``."""
    return subprocess.run([sys.executable, "-c", _RUNNER, *argv], capture_output=True, text=True, timeout=60)
