"""Construction-time and call-time validation shared by the layers of `krylovjax.nn`.

Every check raises with a message that names the argument in call syntax, says what
was expected and what was received.
"""

import operator
from typing import Any

import jax
from jaxtyping import Array


def check_size(value: Any, arg: str, *, what: str = "a size") -> int:
    """Return `value` as a Python int, or raise unless it is a static integer >= 1."""
    if isinstance(value, jax.core.Tracer):
        msg = (
            f"`{arg}` must be a static Python int >= 1 ({what}); got a traced value. "
            f"It fixes an array shape, so it cannot depend on traced data."
        )
        raise TypeError(msg)
    try:
        if isinstance(value, bool):
            raise TypeError
        index = operator.index(value)
    except TypeError:
        kind = type(value).__name__
        msg = (
            f"`{arg}` must be a Python int >= 1 ({what}); got {value!r} of type {kind}."
        )
        raise TypeError(msg) from None
    if index < 1:
        msg = f"`{arg}` must be an int >= 1 ({what}); got {index}."
        raise ValueError(msg)
    return index


def check_shape(x: Array, expected: tuple[int, ...], arg: str, why: str = "") -> None:
    """Raise a `ValueError` unless `x.shape == expected`."""
    if tuple(x.shape) != tuple(expected):
        why = f" {why}" if why else ""
        msg = (
            f"`{arg}` must have shape {tuple(expected)}{why}; got shape "
            f"{tuple(x.shape)}."
        )
        raise ValueError(msg)
