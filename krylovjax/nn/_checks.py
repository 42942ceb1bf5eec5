"""Construction-time and call-time validation shared by the layers of `krylovjax.nn`.

Every check raises with a message that names the argument in call syntax, says what
was expected and what was received.
"""

import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array


def check_size(value: Any, arg: str, *, what: str = "a size", minimum: int = 1) -> int:
    """Return `value` as a Python int, or raise unless it is a static integer.

    Any integer type is accepted (`int`, `np.int64`, a concrete 0-d integer array),
    through `operator.index`; `bool`, floats and traced values are rejected, and so
    is an integer below `minimum`.
    """
    if isinstance(value, jax.core.Tracer):
        msg = (
            f"`{arg}` must be a static integer >= {minimum} ({what}); got a traced "
            f"value. It fixes an array shape, so it cannot depend on traced data."
        )
        raise TypeError(msg)
    try:
        if isinstance(value, bool | np.bool_):
            raise TypeError
        index = operator.index(value)
    except TypeError:
        kind = type(value).__name__
        msg = (
            f"`{arg}` must be an integer >= {minimum} ({what}), such as a Python "
            f"int; got {value!r} of type {kind}."
        )
        raise TypeError(msg) from None
    if index < minimum:
        msg = f"`{arg}` must be an int >= {minimum} ({what}); got {index}."
        raise ValueError(msg)
    return index


def default_float_dtype() -> np.dtype:
    """JAX's default floating dtype: float64 in 64-bit mode, float32 otherwise.

    The default of the layers' `dtype=None`, as in `equinox.nn.Linear`.
    """
    return np.dtype(np.float64 if jax.config.jax_enable_x64 else np.float32)


def check_dtype(dtype: Any, arg: str, *, allow_complex: bool = True) -> np.dtype:
    """Resolve a layer's `dtype=` argument: `None` is JAX's default floating dtype.

    Raise a `TypeError` unless the dtype is floating point (or complex, when
    `allow_complex`).
    """
    if dtype is None:
        return default_float_dtype()
    if allow_complex:
        expected, kind = "a floating-point or complex dtype", jnp.inexact
    else:
        expected, kind = "a real floating-point dtype", jnp.floating
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        msg = f"`{arg}` must be {expected} or None; got {dtype!r}."
        raise TypeError(msg) from None
    if not jnp.issubdtype(resolved, kind):
        msg = f"`{arg}` must be {expected} or None; got dtype {resolved}."
        raise TypeError(msg)
    return resolved


def as_input(x: Any, arg: str, dtype: Any | None) -> Array:
    """Convert a layer's array-like input to a JAX array promoted with `dtype`.

    `dtype` is the layer's parameter dtype. The result has dtype
    `jnp.promote_types(x.dtype, dtype)`, JAX's usual promotion, the same as
    `equinox.nn.Linear` applies through its matrix product: integer and boolean
    inputs become the layer's dtype (so they give the same output as the float
    input), and a wider floating or complex input keeps its width. With
    `dtype=None`, a floating or complex input is returned as it is and an integer or
    boolean one becomes JAX's default floating dtype. Anything that is not an array
    of numbers raises a `TypeError` naming `arg`.
    """
    try:
        x = jnp.asarray(x)
    except (TypeError, ValueError):
        msg = (
            f"`{arg}` must be an array of numbers (a JAX or NumPy array, or nested "
            f"lists of numbers); got an object of type {type(x).__name__}."
        )
        raise TypeError(msg) from None
    if not (jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.bool_)):
        msg = f"`{arg}` must have a numeric or boolean dtype; got dtype {x.dtype}."
        raise TypeError(msg)
    if dtype is None:
        inexact = jnp.issubdtype(x.dtype, jnp.inexact)
        dtype = x.dtype if inexact else default_float_dtype()
    return x.astype(jnp.promote_types(x.dtype, dtype))


def check_shape(x: Array, expected: tuple[int, ...], arg: str, why: str = "") -> None:
    """Raise a `ValueError` unless `x.shape == expected`."""
    if tuple(x.shape) != tuple(expected):
        why = f" {why}" if why else ""
        msg = (
            f"`{arg}` must have shape {tuple(expected)}{why}; got shape "
            f"{tuple(x.shape)}."
        )
        raise ValueError(msg)
