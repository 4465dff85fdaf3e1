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


def test_first_nonfinite_names_the_tensor_and_ignores_an_overflowing_sum():
    from sparrow.finite import first_nonfinite

    big = torch.full((4096,), 60000.0, dtype=torch.float16)  # an fp16 sum would overflow; the fp32 one does not
    huge = torch.full((8,), 3.0e38, dtype=torch.float32)  # the sum overflows to inf; every value is finite
    tensors = {"a": torch.ones(3), "big": big, "huge": huge, "b": torch.zeros(2, 2)}
    assert first_nonfinite(tensors) is None
    tensors["c"] = torch.tensor([1.0, float("nan")])
    tensors["d"] = torch.tensor([float("inf")], dtype=torch.bfloat16)
    assert first_nonfinite(tensors) == "c" and first_nonfinite({}) is None
