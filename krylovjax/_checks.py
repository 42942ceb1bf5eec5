"""Trace-time validation of the arguments shared by the public functions.

Every check raises a `TypeError` or `ValueError` whose message names the argument in
call syntax, says what was expected and what was received.
"""

import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array


def check_depth(d: Any, fn_name: str) -> int:
    """Return `d` as a Python int, or raise unless it is a static integer >= 1."""
    arg = f"{fn_name}(d=...)"
    if isinstance(d, jax.core.Tracer):
        msg = (
            f"`{arg}` must be a static Python int >= 1; got a traced value. `d` fixes "
            f"the output shape, so mark it static, e.g. "
            f"`jax.jit(f, static_argnums=...)`."
        )
        raise TypeError(msg)
    if isinstance(d, bool) or not _is_integer(d):
        kind = type(d).__name__
        msg = f"`{arg}` must be a Python int >= 1; got {d!r} of type {kind}."
        raise TypeError(msg)
    d = operator.index(d)
    if d < 1:
        msg = f"`{arg}` must be an int >= 1 (the number of vectors); got {d}."
        raise ValueError(msg)
    return d


def _is_integer(d: Any) -> bool:
    try:
        operator.index(d)
    except TypeError:
        return False
    return not hasattr(d, "shape") or d.shape == ()


def check_choice(value: Any, choices: Sequence[str], arg: str) -> str:
    """Raise a `ValueError` unless `value` is one of `choices`."""
    if not isinstance(value, str) or value not in choices:
        expected = ", ".join(repr(c) for c in choices)
        msg = f"`{arg}` must be one of {expected}; got {value!r}."
        raise ValueError(msg)
    return value


def check_inexact(x: Any, name: str) -> None:
    """Raise a `TypeError` unless `x` has a floating-point or complex dtype."""
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        msg = (
            f"`{name}` must have a floating-point or complex dtype; got dtype "
            f"{x.dtype}. Integer and boolean arrays are not promoted silently: cast "
            f"first, e.g. `x.astype(jnp.float32)`."
        )
        raise TypeError(msg)


def as_array(x: Any, name: str) -> Array:
    """Convert an array-like to a JAX array with an inexact dtype, or raise."""
    if not (isinstance(x, jax.Array | jax.core.Tracer) or hasattr(x, "__array__")):
        msg = f"`{name}` must be an array; got an object of type {type(x).__name__}."
        raise TypeError(msg)
    x = jnp.asarray(x)
    check_inexact(x, name)
    return x
