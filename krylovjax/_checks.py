"""Trace-time validation of the arguments shared by the public functions.

Every check raises a `TypeError` or `ValueError` whose message names the argument in
call syntax, says what was expected and what was received.
"""

import math
import operator
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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
    """Convert an array-like to a JAX array with an inexact dtype, or raise.

    The dtype is checked before the conversion, so that an error reports the dtype
    that came in (`jnp.asarray` turns int64 into int32 when x64 is disabled). A JAX
    array is returned as it is, weak type included, so that dtype promotion follows
    JAX's rules.
    """
    if isinstance(x, np.ma.MaskedArray):
        msg = (
            f"`{name}` must be an array; got a NumPy masked array, whose masked "
            f"entries have no value to use. Fill them explicitly, e.g. "
            f"`np.ma.filled(x, 0)`."
        )
        raise TypeError(msg)
    if not isinstance(x, jax.Array | jax.core.Tracer):
        if not hasattr(x, "__array__"):
            kind = type(x).__name__
            msg = f"`{name}` must be an array; got an object of type {kind}."
            raise TypeError(msg)
        x = np.asarray(x)
    check_inexact(x, name)
    return jnp.asarray(x)


# The largest byte count XLA's static shape arithmetic (int64) can represent.
_MAX_BYTES = 2**63 - 1


def check_output_size(d: int, leaves: Sequence[Any], fn_name: str) -> None:
    """Raise a `ValueError` unless an output of `d` stacked `leaves` can be built.

    Two limits, checked before anything is traced or allocated: the `d - 1` steps of
    `lax.scan` are counted in JAX's default integer type (int32 unless x64 is
    enabled), and the output, `d` times the bytes of `leaves`, must fit in the memory
    of the default backend's devices (all of them together, since the output may be
    sharded; the host's physical memory where a device does not report its own). A
    larger `d` would otherwise overflow an index, abort the process in XLA's shape
    arithmetic, or exhaust memory.
    """
    arg = f"{fn_name}(d=...)"
    counter = jax.dtypes.canonicalize_dtype(jnp.int64)
    max_d = int(jnp.iinfo(counter).max) + 1
    if d > max_d:
        msg = (
            f"`{arg}` must be at most {max_d}: the d - 1 steps are counted in "
            f"{counter} (set `jax_enable_x64` for a 64-bit counter); got {d}."
        )
        raise ValueError(msg)
    per_step = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)
    nbytes = d * per_step
    limit, where = _memory_limit()
    if nbytes > limit:
        msg = (
            f"`{arg}` is too large: {d} stacked copies of `x0` ({per_step} bytes "
            f"each) take {nbytes} bytes ({_human(nbytes)}), more than the {limit} "
            f"bytes ({_human(limit)}) {where}; got d = {d}."
        )
        raise ValueError(msg)


def _memory_limit() -> tuple[int, str]:
    devices = jax.devices()
    try:
        stats = [device.memory_stats() for device in devices]
    except Exception:  # a backend without memory statistics
        stats = []
    if stats and all(s and "bytes_limit" in s for s in stats):
        total = sum(int(s["bytes_limit"]) for s in stats)
        where = f"of memory on the {len(devices)} {devices[0].platform} device(s)"
        return min(total, _MAX_BYTES), where
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return _MAX_BYTES, "that XLA can address"
    return min(host, _MAX_BYTES), "of the host's physical memory"


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{value:.1f} {unit}"
