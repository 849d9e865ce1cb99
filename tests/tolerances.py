"""Floating-point tolerances that follow from the dtype and the computation, never a fixed atol that one
CPU's BLAS happens to meet (CI runs on whatever CPU the submitting machine has).

Two kinds, as docs/DESIGN.md's testing section has them:
- eps x a bound (`kdtree_lib.precision`: rounding_bound, logit_bound);
- `assert_within_baseline`: the error against a float64 reference is at most `factor` times the error of a
  same-precision baseline (another implementation of the same function in the same dtype), plus one eps of
  the reference's magnitude for where the baseline happens to be exact (flash-attention's criterion).
"""
from __future__ import annotations

import numpy as np
import torch

from kdtree_lib import precision
from kdtree_lib.precision import eps, rounding_bound  # noqa: F401  (the tests import them from here)


def logit_bound(config, outputs) -> float:
    """precision.logit_bound at the largest |output| of `outputs` (float32 forwards)."""
    return precision.logit_bound(config, max_abs(outputs))


def max_abs(x) -> float:
    x = _as_double(x)
    return float(x.abs().max()) if x.numel() else 0.0


def assert_within_baseline(got, reference, baseline, *, factor: float = 4.0, what: str = "") -> None:
    """max |got - reference| <= factor x max |baseline - reference| + eps(got's dtype) x max |reference|;
    reference: the function in float64 (or as close to it as the test can get); baseline: another
    implementation in got's dtype."""
    error = max_abs(_as_double(got) - _as_double(reference))
    baseline_error = max_abs(_as_double(baseline) - _as_double(reference))
    bound = factor * baseline_error + eps(got.dtype) * max_abs(reference)
    assert error <= bound, (f"{what}: error {error:.3g} against float64 exceeds {factor} x the baseline's "
                            f"{baseline_error:.3g} + eps x {max_abs(reference):.3g} = {bound:.3g}")


def _as_double(x) -> torch.Tensor:
    return x.detach().double().cpu() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x, np.float64))
