"""How far floating-point results may be apart, from the dtype and the computation (docs/DESIGN.md, testing).

- `rounding_bound`: eps(dtype) x the rounded terms a value accumulates x their magnitude: the first-order
  bound on a float sum's rounding error whatever its order (Higham, Accuracy and Stability of Numerical
  Algorithms, 2nd ed., §3.1). Two evaluations of one function in different orders (batched vs one request,
  a cache vs a fresh pass, TP shards vs one rank) differ by at most twice it.
- `logit_bound`: that for a transformer forward's outputs (the tests' and notebooks' parity checks).
Never a fixed atol that one CPU's BLAS happens to meet: CI runs on whatever CPU the submitting machine has.
"""
from __future__ import annotations

import numpy as np


def eps(dtype) -> float:
    """Machine epsilon of a NumPy or torch floating dtype (the spacing of numbers just above 1)."""
    if type(dtype).__module__.startswith("torch"):
        import torch
        return float(torch.finfo(dtype).eps)
    return float(np.finfo(dtype).eps)


def rounding_bound(dtype, *, terms: int, magnitude: float) -> float:
    """eps(dtype) x terms x magnitude: how far a value built from `terms` rounded operations on numbers of
    size up to `magnitude` can be from the exact one."""
    return eps(dtype) * terms * float(magnitude)


def forward_terms(config) -> int:
    """The rounded terms behind one output of a transformer forward, to first order: the widest sum of a
    layer (hidden or MLP width) once per layer."""
    widths = [getattr(config, name, 0) or 0 for name in ("hidden_size", "intermediate_size", "moe_intermediate_size")]
    return max(widths) * config.num_hidden_layers


def logit_bound(config, magnitude: float, dtype="float32") -> float:
    """How far two forwards of one model in `dtype` (different batch shapes, paths, orders or TP shards)
    can put an output of size up to `magnitude` apart: twice the rounding bound of forward_terms."""
    return 2 * rounding_bound(np.dtype(dtype), terms=forward_terms(config), magnitude=magnitude)


def relative_error(result, reference) -> float:
    """||result - reference|| / ||reference|| in float64 (torch tensors or arrays)."""
    import numpy as np
    result, reference = (np.asarray(x.double().cpu() if hasattr(x, "double") else x, np.float64)
                         for x in (result, reference))
    return float(np.linalg.norm(result - reference) / np.linalg.norm(reference))
