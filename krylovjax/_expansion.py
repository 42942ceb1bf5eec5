r"""$f(A)\,b$ by Chebyshev expansion: `funm_action(..., method="chebyshev")`.

On an interval $[\mathrm{lo}, \mathrm{hi}]$ that holds the spectrum of a symmetric
$A$, $f$ is replaced by its Chebyshev interpolant of degree $d - 1$,

$$f(\lambda) \approx \sum_{k=0}^{d-1} c_k\, T_k(t), \qquad
  t = \frac{2\lambda - \mathrm{hi} - \mathrm{lo}}{\mathrm{hi} - \mathrm{lo}},
  \qquad c_k = \frac{2 - [k = 0]}{d} \sum_{j=0}^{d-1} f(\lambda_j) \cos(k\theta_j),$$

with $\theta_j = \pi (j + 1/2) / d$ and $\lambda_j$ the Chebyshev nodes
$t_j = \cos\theta_j$ mapped to the interval (the discrete cosine transform of $f$ at
the nodes), and then $f(A)\,b \approx \sum_k c_k T_k(A)\, b$: the vectors
$T_k(A)\, b$ from the three-term recurrence (`krylov(basis=Chebyshev(lo, hi))`, no
inner products), contracted with $c$. Everything is JAX, so the derivatives reach
$A$, $b$, the interval (through the nodes and the basis) and the arrays $f$ closes
over, in forward and reverse mode, with the recurrence's own rule for the vectors.

For $f$ analytic in a Bernstein ellipse around the interval with parameter
$\rho > 1$, the error of the interpolant falls like $\rho^{-d}$ (Trefethen,
*Approximation Theory and Approximation Practice*, ch. 8), uniformly on the
interval; Lanczos adapts to the spectrum (and to $b$) and never does worse than
twice the best polynomial of its degree, but needs inner products at each step.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._bases import Chebyshev, real_scalar
from ._checks import standard_result_type
from ._krylov import krylov
from ._operator import closure_convert


def chebyshev_coefficients(
    f: Callable, lo: Array, hi: Array, d: int, dtype: Any, arg: str
) -> Array:
    """$c_0, \\dots, c_{d-1}$ of $f$'s interpolant at the `d` Chebyshev nodes of
    the interval (see the module docstring), computed in the real `dtype`."""
    theta = jnp.pi * (jnp.arange(d, dtype=dtype) + 0.5) / d
    nodes = (hi - lo) / 2 * jnp.cos(theta) + (hi + lo) / 2
    fn = closure_convert(f, nodes)
    out = jax.eval_shape(fn, nodes)
    if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != (d,):
        got = getattr(out, "shape", type(out).__name__)
        msg = (
            f"`{arg}` must be a scalar function, applied elementwise: called on the "
            f"({d},) Chebyshev nodes of the interval it must return ({d},) values; "
            f"got {got}."
        )
        raise ValueError(msg)
    values = fn(nodes)
    k = jnp.arange(d, dtype=dtype)
    weights = jnp.where(k == 0, 1.0, 2.0).astype(dtype) / d
    cosines = jnp.cos(k[:, None] * theta[None, :])
    return weights.astype(values.dtype) * (cosines.astype(values.dtype) @ values)


def chebyshev_action(
    f: Callable, A: Any, b: Array, d: Any, interval: Any, adjoint: Any
) -> Array:
    """$\\sum_k c_k T_k(A)\\, b$ (see the module docstring)."""
    if not isinstance(interval, tuple | list) or len(interval) != 2:
        msg = (
            "`funm_action(interval=...)` must be a pair (lo, hi) that holds the "
            "spectrum of `A` (see `krylovjax.spectrum_interval`); got "
            f"{interval!r}."
        )
        raise TypeError(msg)
    lo = real_scalar(interval[0], "funm_action(interval=...)")
    hi = real_scalar(interval[1], "funm_action(interval=...)")
    basis = Chebyshev(lo, hi)
    X = krylov(A, b, d, basis=basis, adjoint=adjoint)
    d = X.shape[1]  # checked by `krylov`
    real = jnp.finfo(X.dtype).dtype
    if real.itemsize < 4:
        real = jnp.dtype(jnp.float32)
    c = chebyshev_coefficients(
        f, lo.astype(real), hi.astype(real), d, real, "funm_action(f=...)"
    )
    dtype = standard_result_type(X.dtype, c.dtype)
    return X.astype(dtype) @ c.astype(dtype)
