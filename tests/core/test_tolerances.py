"""The float32 parity rows of tests/support/tolerances.py: an absolute tolerance in units of the result's size."""

import pytest
import torch

from tests.support.tolerances import MODEL_PARITY, close


def test_scaled_atol_is_relative_to_the_largest_expected_value():
    expected = torch.tensor([0.0, -20.0, 3.0])
    close(expected + torch.tensor([1.9e-3, 0.0, 0.0]), expected, scaled_atol=1e-4, rtol=0.0)  # 1e-4 * 20
    with pytest.raises(AssertionError):
        close(expected + torch.tensor([2.1e-3, 0.0, 0.0]), expected, scaled_atol=1e-4, rtol=0.0)


def test_scaled_atol_ignores_infinities_when_sizing_the_tolerance():
    expected = torch.tensor([float("-inf"), 1.0, 2.0])
    close(expected.clone(), expected, scaled_atol=1e-4, rtol=0.0)
    with pytest.raises(AssertionError):
        close(expected + torch.tensor([0.0, 1.0, 0.0]), expected, scaled_atol=1e-4, rtol=0.0)


def test_float64_parity_is_the_float64_row():
    x = torch.ones(3, dtype=torch.float64)
    with pytest.raises(AssertionError):
        close(x + 1e-8, x, **MODEL_PARITY[torch.float64])
