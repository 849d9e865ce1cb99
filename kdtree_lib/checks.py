"""Argument checks shared by every entry point.

Each public function checks its inputs on the host before any work or kernel launch and raises a
ValueError that names the argument and says what was expected. The checks read only metadata
(shape, dtype, device) so they never force a device synchronisation; value checks (NaN, sorted
rows) are done where the data already lives on the host.
"""
from __future__ import annotations

import numpy as np


def framework(x) -> str:
    """'numpy', 'torch' or 'cupy' for an array-like; ValueError otherwise."""
    if isinstance(x, np.ndarray):
        return "numpy"
    module = type(x).__module__
    if module.startswith("torch"):
        return "torch"
    if module.startswith("cupy"):
        return "cupy"
    raise ValueError(f"expected a numpy array, torch tensor or cupy array, got {type(x).__name__}")


def dtype_name(x) -> str:
    """The dtype as a plain name ('float32', 'bfloat16', ...) for any framework."""
    return str(x.dtype).removeprefix("torch.")


def is_on_gpu(x) -> bool:
    kind = framework(x)
    return kind == "cupy" or (kind == "torch" and x.is_cuda)


def to_numpy(x) -> np.ndarray:
    """Host copy (or view) of any supported array; torch bf16 becomes float32."""
    kind = framework(x)
    if kind == "numpy":
        return x
    if kind == "cupy":
        return x.get()
    x = x.detach()
    if dtype_name(x) == "bfloat16":
        x = x.float()
    return x.cpu().numpy()


def as_torch(x):
    """The same data as a torch tensor: itself, a zero-copy view of a CuPy array on the current CUDA
    device, or a NumPy array (made contiguous)."""
    import torch
    kind = framework(x)
    if kind == "torch":
        return x
    if kind == "cupy":
        return torch.as_tensor(x, device="cuda")
    return torch.from_numpy(np.ascontiguousarray(x))


def check_array(name: str, x, *, dtypes: tuple[str, ...] | str | None = None,
                ndim: int | None = None, shape: tuple | None = None):
    """Check one argument's framework, dtype, rank and shape (None entries in `shape` are free)."""
    try:
        framework(x)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    if dtypes is not None:
        dtypes = (dtypes,) if isinstance(dtypes, str) else dtypes
        if dtype_name(x) not in dtypes:
            raise ValueError(f"{name}: expected dtype {' or '.join(dtypes)}, got {dtype_name(x)}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and len(x.shape) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, x.shape)):
            if want is not None and want != got:
                raise ValueError(f"{name}: expected shape {_shape_text(shape)}, got {tuple(x.shape)} "
                                 f"(axis {axis} should be {want})")
    return x


def check_same_device(**arrays) -> None:
    """All arrays on the host, or all on the same GPU."""
    places = {name: _place(x) for name, x in arrays.items()}
    if len(set(places.values())) > 1:
        listing = ", ".join(f"{name} on {place}" for name, place in places.items())
        raise ValueError(f"arguments must live on one device: {listing}")


def check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


def check_temperature(value) -> float:
    """A sampling temperature: a finite real number >= 0 (0 = greedy). A bool is no temperature, and
    inf would sample uniformly whatever the logits say."""
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating))
            or not 0 <= value < np.inf):
        raise ValueError(f"temperature: expected a finite number >= 0, got {value!r}")
    return float(value)


def check_token_ids(name: str, ids: np.ndarray, vocab: int | None) -> None:
    """Host token ids: >= 0, and < vocab when the vocabulary size is known."""
    if ids.size and int(ids.min()) < 0:
        raise ValueError(f"{name}: token ids must be >= 0, got {int(ids.min())}")
    if vocab is not None and ids.size and int(ids.max()) >= vocab:
        raise ValueError(f"{name}: token ids must be < vocab={vocab}, got {int(ids.max())}")


def check_finite(name: str, x: np.ndarray, *, allow_neg_inf: bool = False) -> None:
    """NaN (and +inf, and -inf unless allowed) is a bad input, not something to propagate."""
    if np.isnan(x).any():
        raise ValueError(f"{name}: contains NaN")
    bad = np.isposinf(x) if allow_neg_inf else np.isinf(x)
    if bad.any():
        raise ValueError(f"{name}: contains {'+inf' if allow_neg_inf else 'inf'}")


def _place(x) -> str:
    kind = framework(x)
    if kind == "numpy":
        return "cpu"
    if kind == "cupy":
        return f"cuda:{x.device.id}"
    return str(x.device) if x.is_cuda else "cpu"


def _shape_text(shape) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def read_json_object(path) -> dict:
    """The JSON object in file `path`; a ValueError naming the file when it is missing, not JSON or not
    an object (json's own errors name no file)."""
    import json
    from pathlib import Path
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value
