r"""`spectrum_interval`: an interval $[\mathrm{lo}, \mathrm{hi}]$ around the
spectrum of a symmetric or Hermitian matrix, for the bases of `_bases.py`.

**Gershgorin.** Each eigenvalue lies in a disc around some $a_{ii}$ of radius
$r_i = \sum_{j \ne i} |a_{ij}|$; for Hermitian $A$ they are real, so they lie in
$[\min_i (a_{ii} - r_i), \max_i (a_{ii} + r_i)]$: a guarantee, up to the rounding
of the sums.

**Lanczos.** After $d$ steps $A Q = Q T + r e_{d-1}^\top$, and an eigenpair
$(\theta_i, s_i)$ of $T$ has $\|A Q s_i - \theta_i Q s_i\| = \|r\|\, |s_{d-1,i}|$,
so $A$ has an eigenvalue that close to $\theta_i$. Ritz values lie inside the
spectrum and approach its ends from inside; the extreme ones widened by their
residual bounds are an estimate of the ends, not a guarantee.
"""

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer
from jax.experimental import sparse
from jaxtyping import Array, DTypeLike, PRNGKeyArray, Real

from ._bases import RealScalar, real_scalar
from ._checks import (
    as_array,
    check_bcoo_matrix,
    check_choice,
    check_depth,
    check_dtype,
    check_inexact,
    check_key,
    check_size,
)
from ._funm import eigh_one_at_a_time
from ._lanczos import lanczos
from ._sharding import gathered
from ._typing import OperatorLike, StaticInt

NAME = "spectrum_interval"


def spectrum_interval(
    A: OperatorLike,
    *,
    method: Literal["gershgorin", "lanczos"] = "gershgorin",
    key: PRNGKeyArray | None = None,
    d: StaticInt = 20,
    margin: RealScalar = 0.01,
    n: StaticInt | None = None,
    dtype: DTypeLike | None = None,
) -> tuple[Real[Array, ""], Real[Array, ""]]:
    r"""An interval $[\mathrm{lo}, \mathrm{hi}]$ containing the spectrum of a
    symmetric (or Hermitian) $A$, for `krylovjax.Chebyshev(*spectrum_interval(A))`.

    **Arguments:**

    - `A`: a symmetric or Hermitian matrix (not checked), dense or
        `jax.experimental.sparse.BCOO` (padding entries, with indices outside the
        matrix, count for nothing; duplicates are summed, as BCOO does); for
        `method="lanczos"` also a linear callable.
    - `method`: `"gershgorin"` (default): $[\min_i (a_{ii} - r_i), \max_i
        (a_{ii} + r_i)]$, $r_i = \sum_{j \ne i} |a_{ij}|$: guaranteed, but wide
        when rows are heavy. `"lanczos"`: the extreme Ritz values of `min(d, n)`
        steps of [`krylovjax.lanczos`][] from a random start vector, each widened
        by its residual bound $\|r\|\, |s_{d-1,i}|$. That bound puts an
        eigenvalue near each Ritz value but does not exclude one beyond it: a
        start vector nearly orthogonal to an extreme eigenvector misses it. A
        cheap, tight estimate, safe in practice for $d \ge 20$ on graph
        Laplacians; Gershgorin is the guarantee.
    - `key`: a `jax.random` key for the start vector (`method="lanczos"` only).
    - `d`: the number of Lanczos steps (default 20), a static int.
    - `margin`: both ends move out by `margin * (hi - lo)` (default 0.01, must
        be $\ge 0$, which is checked where it is concrete, not where it is
        traced); a zero-width interval by `margin * max(|lo|, |hi|)`, or by
        `margin` if both are 0, so that `margin > 0` always gives `lo < hi`.
    - `n`, `dtype`: the length and dtype of a callable `A`'s vectors, required
        for one (a matrix has its own: leave them `None`).

    **Returns:**

    `(lo, hi)`, 0-dimensional arrays in the real dtype of `A` (computed in
    float32 for bfloat16 and float16, and rounded outwards). No derivative
    (`lax.stop_gradient`): the interval is a hyperparameter. Jittable, with
    `method`, `d`, `n` and `dtype` static.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> import krylovjax
        >>> L = jnp.array([[1.0, -1.0, 0.0], [-1.0, 2.0, -1.0], [0.0, -1.0, 1.0]])
        >>> krylovjax.spectrum_interval(L, margin=0.0)  # eigenvalues 0, 1, 3
        (Array(0., dtype=float32), Array(4., dtype=float32))
        >>> # d = n: the Ritz values are the eigenvalues; then 1% of the width.
        >>> lo, hi = krylovjax.spectrum_interval(
        ...     L, method="lanczos", key=jax.random.key(0), d=3)
        >>> print(f"{lo:.2f} {hi:.2f}")
        -0.03 3.03

        ```
    """
    check_choice(method, ("gershgorin", "lanczos"), f"{NAME}(method=...)")
    margin = real_scalar(margin, f"{NAME}(margin=...)")
    value = None if isinstance(margin, Tracer) else np.asarray(margin)
    if value is not None and not (np.isfinite(value) and value >= 0):
        msg = f"`{NAME}(margin=...)` must be finite and >= 0; got {value}."
        raise ValueError(msg)
    if method == "gershgorin":
        for name, given in (("n", n), ("dtype", dtype)):
            if given is not None:
                msg = (
                    f'`{NAME}({name}=...)` is for `method="lanczos"` with a '
                    f"callable `A`; Gershgorin discs read a matrix, so it must be "
                    f"None; got {given!r}."
                )
                raise ValueError(msg)
        lo, hi, real = _gershgorin(A)
    else:
        lo, hi, real = _ritz(A, key, d, n, dtype)
    # No derivative: the interval is a hyperparameter (and `nextafter` has none).
    lo, hi = lax.stop_gradient(lo), lax.stop_gradient(hi)
    # A concrete margin is cast before it enters the program: as a float64 array
    # (a Python float in 64-bit mode) it would put float64, which TPUs do not
    # have, into a float32 program.
    margin = margin.astype(lo.dtype) if value is None else jnp.asarray(value, lo.dtype)
    margin = lax.stop_gradient(margin)
    size = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    scale = jnp.where(hi > lo, hi - lo, jnp.where(size > 0, size, 1))
    lo, hi = lo - margin * scale, hi + margin * scale
    return _outwards(lo, real, -1), _outwards(hi, real, 1)


def _outwards(x: Array, dtype: Any, sign: int) -> Array:
    """`x` rounded to `dtype`, then one step further out (towards `sign * inf`)
    where rounding to nearest moved it in."""
    y = x.astype(dtype)
    if y.dtype == x.dtype:
        return y
    inwards = (y.astype(x.dtype) - x) * sign < 0
    return jnp.where(inwards, jnp.nextafter(y, jnp.asarray(sign * jnp.inf, dtype)), y)


def _dtypes(dtype: Any) -> tuple[Any, Any]:
    """The real dtype of `dtype` and the one to compute in: `dtype`, or float32
    for a narrower one (bfloat16, float16)."""
    real = jnp.finfo(dtype).dtype
    return real, (np.dtype(dtype) if jnp.finfo(dtype).bits >= 32 else np.float32)


def _matrix(A: Any) -> tuple[Any, Any]:
    """`(A, dtype)` for a dense or BCOO `A`, checked; `(None, None)` for a
    callable."""
    arg = f"{NAME}(A=...)"
    if isinstance(A, sparse.BCOO):
        check_bcoo_matrix(A, arg)
        check_inexact(A.data, arg)
        dtype = A.data.dtype
    elif callable(A) and not hasattr(A, "__array__"):
        return None, None
    else:
        A = as_array(A, arg)
        dtype = A.dtype
    shape = tuple(A.shape)
    if len(shape) != 2 or shape[0] != shape[1] or shape[0] == 0:
        msg = f"`{arg}` must be a square (n, n) matrix with n >= 1; got shape {shape}."
        raise ValueError(msg)
    return A, dtype


def _gershgorin(A: Any) -> tuple[Array, Array, Any]:
    matrix, dtype = _matrix(A)
    if matrix is None:
        msg = (
            f'`{NAME}(A=...)` must be a dense or BCOO matrix for method="gershgorin",'
            f" which needs its entries; got a callable of type {type(A).__name__}. "
            f'Use method="lanczos" (with key=, n= and dtype=) for an operator given '
            f"as a function."
        )
        raise ValueError(msg)
    real, work = _dtypes(dtype)
    n = matrix.shape[0]
    if isinstance(matrix, sparse.BCOO):
        # Its entries gathered first where they are split over an explicit mesh:
        # `sum_duplicates` sorts them, along an axis that must not be split. As in
        # JAX's products, an index in [-n, 0) counts from the end (wrapped first,
        # so that it meets its duplicates); one outside [-n, n) is padding.
        indices = gathered(matrix.indices)
        indices = jnp.where(indices < 0, indices + n, indices)
        entries = (gathered(matrix.data), indices)
        summed = sparse.BCOO(entries, shape=matrix.shape).sum_duplicates(matrix.nse)
        rows, cols = summed.indices[:, 0], summed.indices[:, 1]
        inside = (rows >= 0) & (rows < n) & (cols >= 0) & (cols < n)
        data, rows = summed.data.astype(work), jnp.clip(rows, 0, n - 1)
        on = jnp.where(inside & (rows == cols), jnp.real(data), 0)
        off = jnp.where(inside & (rows != cols), jnp.abs(data), 0)
        centre = jax.ops.segment_sum(on, rows, num_segments=n)
        radius = jax.ops.segment_sum(off, rows, num_segments=n)
    else:
        # Masked row sums, not `jnp.diagonal`: a gather whose sharding JAX does
        # not resolve for a matrix split over an explicit mesh.
        dense, eye = matrix.astype(work), jnp.eye(n, dtype=bool)
        centre = jnp.sum(jnp.where(eye, jnp.real(dense), 0), 1)
        radius = jnp.sum(jnp.where(eye, 0, jnp.abs(dense)), 1)
    return jnp.min(centre - radius), jnp.max(centre + radius), real


def _ritz(A: Any, key: Any, d: Any, n: Any, dtype: Any) -> tuple[Array, Array, Any]:
    if key is None:
        msg = (
            f'`{NAME}(key=...)` must be a `jax.random` key for method="lanczos" '
            f"(it draws the start vector); got None."
        )
        raise ValueError(msg)
    check_key(key, f"{NAME}(key=...)")
    d = check_depth(d, NAME)
    matrix, own = _matrix(A)
    for name, value in (("n", n), ("dtype", dtype)):
        if matrix is None and value is None:
            msg = (
                f"`{NAME}({name}=...)` is required for a callable `A` (the length "
                f"and dtype of its vectors); got None."
            )
            raise ValueError(msg)
        if matrix is not None and value is not None:
            msg = (
                f"`{NAME}({name}=...)` is for a callable `A`; a matrix has its "
                f"own, so it must be None; got {value!r}."
            )
            raise ValueError(msg)
    if matrix is None:
        n = check_size(n, f"{NAME}(n=...)", what="the length of A's vectors")
        dtype = check_dtype(dtype, f"{NAME}(dtype=...)")
    else:
        A, n, dtype = matrix, matrix.shape[0], own
    real, work = _dtypes(dtype)
    dec = lanczos(A, jax.random.normal(key, (n,), dtype), min(d, n))
    work = jnp.finfo(work).dtype
    alpha, beta = dec.diagonal.astype(work), dec.off_diagonal.astype(work)
    # After a breakdown (an invariant space of k < d vectors) the trailing block
    # of T is zero, and its zero eigenvalues are not Ritz values: it becomes
    # alpha_0 I (inside the visible block's range), with a zero residual.
    # (`ones_like`, not fresh ones: under a `vmap` over keys split over an explicit
    # mesh, an array on no mesh does not join the decomposition's numbers.)
    nonzero = (beta != 0).astype(jnp.int32)
    steps = jnp.concatenate([jnp.ones_like(alpha[:1], jnp.int32), nonzero])
    alpha = jnp.where(jnp.cumprod(steps) == 1, alpha, alpha[0])
    T = jnp.diag(alpha) + jnp.diag(beta, 1) + jnp.diag(beta, -1)
    theta, S = eigh_one_at_a_time(T)
    bound = jnp.linalg.norm(dec.residual).astype(work) * jnp.abs(S[-1])
    return theta[0] - bound[0], theta[-1] + bound[-1], real
