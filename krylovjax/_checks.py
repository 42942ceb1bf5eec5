"""Trace-time validation of the arguments shared by the public functions.

Every check raises a `TypeError` or `ValueError` whose message names the argument in
call syntax, says what was expected and what was received. The public functions and
the layers of `krylovjax.nn` share them.
"""

import math
import operator
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.experimental import sparse
from jaxtyping import Array


def check_size(value: Any, arg: str, *, what: str = "a size", minimum: int = 1) -> int:
    """Return `value` as a Python int, or raise unless it is a static integer.

    Any integer type is accepted (`int`, `np.int64`, a concrete 0-d integer array),
    through `operator.index`; `bool`, floats and traced values are rejected, and so
    is an integer below `minimum`.
    """
    if isinstance(value, Tracer):
        msg = (
            f"`{arg}` must be a static Python int >= {minimum} ({what}); got a traced "
            f"value. It fixes an array shape, so it cannot depend on traced data: "
            f"mark it static, e.g. `jax.jit(f, static_argnums=...)`."
        )
        raise TypeError(msg)
    try:
        if isinstance(value, bool | np.bool_) or getattr(value, "shape", ()) != ():
            raise TypeError
        index = operator.index(value)
    except TypeError:
        kind = type(value).__name__
        msg = (
            f"`{arg}` must be a Python int >= {minimum} ({what}); got {value!r} of "
            f"type {kind}."
        )
        raise TypeError(msg) from None
    if index < minimum:
        msg = f"`{arg}` must be an int >= {minimum} ({what}); got {index}."
        raise ValueError(msg)
    return index


def check_depth(d: Any, fn_name: str) -> int:
    """Return `d` as a Python int, or raise unless it is a static integer >= 1."""
    return check_size(d, f"{fn_name}(d=...)", what="the number of vectors")


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
    if not isinstance(x, jax.Array | Tracer):
        if not hasattr(x, "__array__"):
            kind = type(x).__name__
            msg = f"`{name}` must be an array; got an object of type {kind}."
            raise TypeError(msg)
        x = np.asarray(x)
    check_inexact(x, name)
    return jnp.asarray(x)


# The largest byte count XLA's static shape arithmetic (int64) can represent.
_MAX_BYTES = 2**63 - 1


def check_output_size(
    d: int,
    leaves: Sequence[Any],
    fn_name: str,
    *,
    arg: str | None = None,
    what: str = "`x0`",
) -> None:
    """Raise a `ValueError` unless an output of `d` stacked `leaves` can be built.

    Two limits, checked before anything is traced or allocated: the `d - 1` steps of
    `lax.scan` are counted in JAX's default integer type (int32 unless x64 is
    enabled), and the output, `d` times the bytes of `leaves`, must fit in the memory
    of the default backend's devices (all of them together, since the output may be
    sharded; the host's physical memory where a device does not report its own). A
    larger `d` would otherwise overflow an index, abort the process in XLA's shape
    arithmetic, or exhaust memory. The message names `arg` (default
    `fn_name(d=...)`; a layer names its own argument) and calls the stacked
    `leaves` `what`.
    """
    arg = arg or f"{fn_name}(d=...)"
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
            f"`{arg}` is too large: {d} stacked copies of {what} ({per_step} bytes "
            f"each) take {nbytes} bytes ({_human(nbytes)}), more than the {limit} "
            f"bytes ({_human(limit)}) {where}; got d = {d}."
        )
        raise ValueError(msg)


def check_allocation(
    shape: tuple[int, ...], dtype: Any, arg: str, what: str, hint: str = ""
) -> None:
    """Raise a `ValueError` naming `arg` unless an array `what` of `shape` and
    `dtype` fits in memory (the limit of `check_output_size`), before it is
    allocated: JAX allocates asynchronously, so a layer's parameters that are too
    large would fail only when first used. `hint`, a sentence, ends the message."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    limit, where = _memory_limit()
    if nbytes > limit:
        msg = (
            f"`{arg}` is too large: {what} of shape {shape} takes {nbytes} bytes "
            f"({_human(nbytes)}), more than the {limit} bytes ({_human(limit)}) "
            f"{where}.{' ' + hint if hint else ''}"
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


def default_float_dtype() -> np.dtype:
    """JAX's default floating dtype: float64 in 64-bit mode, float32 otherwise.

    The default of the layers' `dtype=None`, as in `equinox.nn.Linear`.
    """
    x64 = jax.config.read("jax_enable_x64")
    return np.dtype(np.float64 if x64 else np.float32)


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


def standard_result_type(*args: Any) -> np.dtype:
    """`jnp.result_type(*args)` under JAX's standard promotion rules, weak types
    included.

    The promotions that krylovjax documents (a matrix `A` with `x0` in `krylov`, a
    layer's input with the layer's dtype) are part of its API and are made
    explicitly, by these rules, whatever `jax_numpy_dtype_promotion` is set to: under
    `"strict"`, which forbids implicit promotions, they still happen. krylovjax makes
    no implicit promotion of its own.
    """
    with jax.numpy_dtype_promotion("standard"):
        return jnp.result_type(*args)


def as_input(x: Any, arg: str, dtype: Any | None) -> Array:
    """Convert a layer's array-like input to a JAX array promoted with `dtype`.

    `dtype` is the layer's parameter dtype. The result has dtype
    `jnp.promote_types(x.dtype, dtype)`, JAX's standard promotion (also under
    `jax_numpy_dtype_promotion="strict"`, see `standard_result_type`), the same as
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
    if dtype is not None:
        return x.astype(standard_result_type(x.dtype, dtype))
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return x.astype(default_float_dtype())


def check_shape(x: Array, expected: tuple[int, ...], arg: str, why: str = "") -> None:
    """Raise a `ValueError` unless `x.shape == expected`."""
    if tuple(x.shape) != tuple(expected):
        why = f" {why}" if why else ""
        msg = (
            f"`{arg}` must have shape {tuple(expected)}{why}; got shape "
            f"{tuple(x.shape)}."
        )
        raise ValueError(msg)


def check_bcoo_matrix(A: Any, arg: str) -> None:
    """Raise a `ValueError` unless the BCOO `A` is a plain matrix (no batch or dense
    dimensions)."""
    if A.n_batch != 0 or A.n_dense != 0:
        msg = (
            f"`{arg}` must be a BCOO matrix with n_batch=0 and n_dense=0; got "
            f"n_batch={A.n_batch} and n_dense={A.n_dense}."
        )
        raise ValueError(msg)


def describe(x: Any) -> str:
    kind = f"an object of type {type(x).__name__}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{kind} with shape {tuple(x.shape)} and dtype {x.dtype}"
    return kind


def check_operator_type(A: Any, arg: str) -> None:
    """Raise a `TypeError` naming `arg` unless `A` is a dense array, a BCOO matrix or
    a callable; for a sparse or masked type that is not taken, say how to convert
    it."""
    hint = _unsupported(A)
    if hint is None and (
        isinstance(A, sparse.BCOO | jax.Array) or is_numpy_array(A) or callable(A)
    ):
        return
    got = hint if hint is not None else f"{describe(A)}."
    msg = (
        f"`{arg}` must be a square array, a `jax.experimental.sparse.BCOO` matrix or "
        f"a callable; got {got}"
    )
    raise TypeError(msg)


def _unsupported(A: Any) -> str | None:
    """Describe a matrix type that `krylov` does not take, and how to convert it."""
    kind = type(A).__name__
    if type(A).__module__.startswith("scipy.sparse"):
        return (
            f"a SciPy sparse matrix of type {kind}. Convert it with "
            f"`jax.experimental.sparse.BCOO.from_scipy_sparse(A)`."
        )
    if isinstance(A, sparse.BCSR):
        return "a `jax.experimental.sparse.BCSR` matrix. Convert it with `A.to_bcoo()`."
    if isinstance(A, sparse.JAXSparse) and not isinstance(A, sparse.BCOO):
        return (
            f"a `jax.experimental.sparse` matrix of type {kind}. Convert it with "
            f"`jax.experimental.sparse.BCOO.fromdense(A.todense())`."
        )
    if isinstance(A, np.ma.MaskedArray):
        return (
            "a NumPy masked array, whose masked entries have no value to use. Fill "
            "them explicitly, e.g. `np.ma.filled(A, 0)` for a matrix that is zero "
            "there."
        )
    return None


def is_numpy_array(A: Any) -> bool:
    return type(A).__module__ == "numpy" and hasattr(A, "shape")


def check_matrix_shape(
    shape: tuple[int, ...], x0: Array, fn_name: str, vector: str
) -> None:
    if len(shape) != 2 or shape[0] != shape[1]:
        msg = f"`{fn_name}(A=...)` must be a square matrix; got shape {tuple(shape)}."
        raise ValueError(msg)
    if x0.ndim not in (1, 2):
        msg = (
            f"`{fn_name}({vector}=...)` must have shape (n,) or (n, b) when `A` is a "
            f"matrix; got shape {x0.shape}."
        )
        raise ValueError(msg)
    if x0.shape[0] != shape[0]:
        msg = (
            f"`{fn_name}({vector}=...)` must have first axis of length {shape[0]} to "
            f"match `A` of shape {tuple(shape)}; got shape {x0.shape}."
        )
        raise ValueError(msg)


def check_key(key: Any, arg: str) -> None:
    """Raise a `TypeError` naming `arg` unless `key` is one JAX PRNG key: a typed
    key of shape `()`, or a raw `uint32` key of shape `(2,)` or `(4,)`."""
    typed = isinstance(key, jax.Array) and jnp.issubdtype(
        key.dtype, jax.dtypes.prng_key
    )
    raw = (
        isinstance(key, jax.Array)
        and key.dtype == jnp.uint32
        and key.shape in ((2,), (4,))
    )
    if not (typed and key.shape == ()) and not raw:
        what = getattr(key, "dtype", type(key).__name__)
        shape = getattr(key, "shape", None)
        msg = (
            f"`{arg}` must be one JAX PRNG key, e.g. `jax.random.key(0)`; got "
            f"{what}" + ("" if shape is None else f" of shape {shape}") + "."
        )
        raise TypeError(msg)
