"""Unit tests here call the stand-ins' rules directly, outside :func:`attnkit.maskplan.row_intervals`: each test runs
inside a derivation of its own, as the rules do when a strategy calls them."""

import pytest

from attnkit.maskplan import stand_ins


@pytest.fixture(autouse=True)
def _inside_a_derivation():
    with stand_ins.deriving():
        yield
