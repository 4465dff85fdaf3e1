"""sparrow.finite.all_finite: the fast whole-tensor check that validates published weights."""

import pytest
import torch

from sparrow.finite import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_bad_value_anywhere_is_found(dtype, bad):
    t = torch.randn(4096, dtype=torch.float32).to(dtype)
    assert all_finite(t)
    t[1234] = bad
    assert not all_finite(t)


def test_a_sum_that_overflows_falls_back_to_the_exact_check():
    big = torch.full((1000,), 6.0e4, dtype=torch.float16)  # finite values whose fp16 sum is inf
    assert not bool(torch.isfinite(big.sum())) and all_finite(big)
    big[7] = float("nan")
    assert not all_finite(big)


def test_inf_and_minus_inf_together_are_not_finite():
    t = torch.zeros(8)
    t[0], t[1] = float("inf"), -float("inf")
    assert not all_finite(t) and all_finite(torch.empty(0))
