r"""`trace_funm`: stochastic estimates of $\operatorname{tr} f(A)$, from Lanczos
quadrature.

$\operatorname{tr} f(A) \approx \frac1m \sum_i \|z_i\|^2\, e_0^\top f(T_i)\, e_0$:
Hutchinson probes $z_i$ with Lanczos quadrature, the probes batched by `jax.vmap`.
The quadrature and its derivative rule are those of `funm_action` (`_funm.py`).
"""

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax import lax
from jax.experimental import sparse
from jaxtyping import Array, Inexact, PRNGKeyArray

from ._checks import (
    as_array,
    check_allocation,
    check_choice,
    check_depth,
    check_inexact,
    check_operator_type,
    check_size,
    standard_result_type,
)
from ._funm import (
    _check_callable,
    _funm_e0,
    _result_dtype,
    _scalar_function,
    _working_dtype,
)
from ._lanczos import lanczos_in_working_dtype
from ._orthogonal import Adjoint, check_problem
from ._typing import OperatorLike, StaticInt

SAMPLERS = ("rademacher", "normal", "sphere")


def trace_funm(
    f: Callable[[Array], Array],
    A: OperatorLike,
    key: PRNGKeyArray,
    d: StaticInt,
    *,
    num_probes: StaticInt,
    sampler: Literal["rademacher", "normal", "sphere"] = "rademacher",
    like: Inexact[Array | np.ndarray, " n"] | jax.ShapeDtypeStruct | None = None,
    reorthogonalize: bool = True,
    adjoint: Adjoint = "custom_jvp",
) -> Inexact[Array, ""]:
    r"""A stochastic estimate of $\operatorname{tr} f(A)$ for symmetric or
    Hermitian $A$: Hutchinson probes with Lanczos quadrature.

    With $m$ probes $z_i$ drawn so that $\mathbb E[z z^\top] = I$, and $T_i$ the
    tridiagonal matrix of $d$ Lanczos steps from $z_i$,

    $$\operatorname{tr} f(A) = \mathbb E[z^\top f(A)\, z]
      \approx \frac1m \sum_{i=1}^m \|z_i\|^2\, e_0^\top f(T_i)\, e_0 .$$

    Each term is a $d$-point Gauss quadrature of $z_i^\top f(A)\, z_i$ (Ubaru, Chen
    and Saad, 2017). The $m$ Lanczos runs are one `jax.vmap`, so they cost $m$
    matrix-vector products per step in one batched call, and memory for $m$ bases
    of $n \times d$ (split a large $m$ over several calls with different keys and
    average).

    **Variance.** For fixed quadrature, the estimate is a mean of $m$ independent
    terms. With $M = f(A)$ real symmetric, one term's variance is
    $2 \sum_{i \ne j} M_{ij}^2 = 2(\|M\|_F^2 - \sum_i M_{ii}^2)$ for Rademacher
    probes, $2\|M\|_F^2$ for Gaussian probes, and
    $\frac{2n}{n+2}(\|M\|_F^2 - (\operatorname{tr} M)^2/n)$ for probes on the
    sphere of radius $\sqrt n$; divide by $m$ for the estimate's. (For complex
    Hermitian $A$ the probes are real, and $M$ is replaced by its real part.) The
    standard error thus falls like $1/\sqrt m$; it is small relative to the trace
    when $f(A)$ is dominated by its diagonal, and large when, say, $f(A)$ has a few
    large eigenvalues with delocalised eigenvectors.

    **Bias.** The Hutchinson estimate is unbiased; the quadrature is not. Each
    quadrature is exact for polynomials of degree $2d - 1$, so its error is at most
    $2\|z_i\|^2 \min_p \max_{\lambda} |f(\lambda) - p(\lambda)|$ over such $p$ on
    $[\lambda_{\min}, \lambda_{\max}]$ (exact arithmetic): for $\log$ of an SPD
    matrix with condition number $\kappa$ it falls like
    $((\sqrt\kappa - 1)/(\sqrt\kappa + 1))^{2d}$. It is exact when $d$ reaches the
    number of distinct eigenvalues. The gradient is the exact gradient of the
    estimate for the drawn probes, so its expectation is the gradient of
    $\operatorname{tr} f(A)$ plus the gradient of the quadrature bias: for training
    (`log det` of a kernel matrix, say) it is unbiased up to that, and its noise is
    that of a fresh key per step.

    **Arguments:**

    - `f`: a scalar function applied elementwise to eigenvalues, as with
        `funm_action(..., method="lanczos")`: called on the `(d,)` real eigenvalues
        of each $T_i$, it returns `(d,)` values. It may close over arrays.
    - `A`: a symmetric (real) or Hermitian (complex) operator of any kind
        [`krylovjax.krylov`][] accepts (not checked).
    - `key`: a JAX PRNG key. The probes are
        `jax.random.rademacher(key, (num_probes, n), dtype)` (`sampler="rademacher"`)
        or `jax.random.normal(key, (num_probes, n), dtype)` (`"normal"`, and
        `"sphere"`, which rescales each row to norm $\sqrt n$), with `dtype` the
        real dtype of the operator, so the same key gives the same probes.
    - `d`: the number of Lanczos steps per probe, a static Python int,
        `1 <= d <= n`.
    - `num_probes`: the number $m$ of probes, a static Python `int >= 1`. The $m$
        bases are built at once: a batch that does not fit in memory raises a
        `ValueError` naming `num_probes` before anything runs.
    - `sampler`: the probe distribution, `"rademacher"` (default; entries $\pm 1$,
        the smallest variance of the three for most $f(A)$), `"normal"` or
        `"sphere"` (normalised Gaussian).
    - `like`: an array or `jax.ShapeDtypeStruct` of shape `(n,)` whose dtype the
        probes are promoted with, as `x0` is in [`krylovjax.krylov`][]. Required
        when `A` is a callable (which does not say its size); for a matrix the
        default is its own dtype.
    - `reorthogonalize`, `adjoint`: passed on to [`krylovjax.lanczos`][].

    **Returns:**

    The estimate, a scalar of $f$'s dtype promoted with the real dtype of $A$:
    real for a real-valued $f$. For bfloat16 and float16 operators the quadratures
    are worked in float32 (`f` is called on float32 eigenvalues) and a real
    estimate is rounded to the operator's dtype at the end. Differentiable (forward
    and reverse mode) in the arrays `A` holds and those `f` closes over, also when
    a probe's Krylov space is invariant after fewer than $d$ vectors (see
    `funm_action`'s breakdown rule).

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> import krylovjax
        >>> A = jnp.diag(jnp.array([1.0, 2.0, 3.0, 4.0]))
        >>> key = jax.random.key(0)
        >>> def log_det(A):
        ...     return krylovjax.trace_funm(jnp.log, A, key, 4, num_probes=8)
        >>> est, grad = jax.jit(jax.value_and_grad(log_det))(A)
        >>> bool(jnp.allclose(est, jnp.log(24.0), rtol=1e-5))  # diagonal: exact
        True
        >>> jnp.round(jnp.diag(grad), 4)  # the diagonal of A^{-1}
        Array([1.    , 0.5   , 0.3333, 0.25  ], dtype=float32)

        ```
    """
    fn_name = "trace_funm"
    _check_callable(f, f"{fn_name}(f=...)")
    d = check_depth(d, fn_name)
    num_probes = check_size(
        num_probes, f"{fn_name}(num_probes=...)", what="the number of probes"
    )
    check_choice(sampler, SAMPLERS, f"{fn_name}(sampler=...)")
    _check_key(key, f"{fn_name}(key=...)")
    n, dtype = _probe_structure(A, like, fn_name)
    # A callable's output is compared with `like`, which gives the probes' shape (it
    # is required for a callable).
    probe = jnp.zeros((n,), dtype)
    check_problem(
        A, probe, d, reorthogonalize, adjoint, fn_name, "like", "the size of the probes"
    )
    # The m bases are built at once (one vmapped Lanczos run): checked before
    # anything is traced, so that too many probes name `num_probes` rather than
    # fail in XLA's allocator.
    check_allocation(
        (num_probes, n, d),
        _working_dtype(dtype),
        f"{fn_name}(num_probes=...)",
        f"the batch of {num_probes} Lanczos bases (one ({n}, {d}) basis per probe)",
    )
    real = jnp.finfo(dtype).dtype
    work = _working_dtype(real)
    probes = _draw(key, sampler, num_probes, n, real).astype(dtype)
    arg = f"{fn_name}(f=...)"

    def tridiagonal(z):
        dec = lanczos_in_working_dtype(
            A, z, d, reorthogonalize=reorthogonalize, adjoint=adjoint
        )
        return dec.diagonal, dec.off_diagonal, dec.norm

    def quadrature(run):
        diagonal, off_diagonal, norm = (x.astype(work) for x in run)
        fn = _scalar_function(f, jnp.zeros_like(diagonal), arg)
        c = _funm_e0(fn, diagonal, off_diagonal)[0]
        out = standard_result_type(c.dtype, work)
        return (norm * norm).astype(out) * c.astype(out)

    # The Lanczos runs are batched; the small eigendecompositions run one at a time.
    # jaxlib's batched `eigh` on CPU splits its batch over the thread pool that runs
    # it and waits there for the parts: two at once (a value and a derivative in one
    # program, on two cores) can wait on each other forever. One matrix runs inline.
    terms = lax.map(quadrature, jax.vmap(tridiagonal)(probes))
    return jnp.mean(terms).astype(_result_dtype(real, terms.dtype))


# --------------------------------------------------------------------- checks


def _check_key(key: Any, arg: str) -> None:
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


def _probe_structure(A: Any, like: Any, fn_name: str) -> tuple[int, Any]:
    """The size and dtype of the probes: a matrix's own, promoted with `like`'s."""
    check_operator_type(A, f"{fn_name}(A=...)")
    if like is not None:
        if not isinstance(like, jax.ShapeDtypeStruct):
            like = as_array(like, f"{fn_name}(like=...)")
        check_inexact(like, f"{fn_name}(like=...)")
        if len(like.shape) != 1:
            msg = (
                f"`{fn_name}(like=...)` must have shape (n,), that of one probe; got "
                f"shape {tuple(like.shape)}."
            )
            raise ValueError(msg)
    if isinstance(A, sparse.BCOO | jax.Array | np.ndarray):
        arg = f"{fn_name}(A=...)"
        check_inexact(A.data if isinstance(A, sparse.BCOO) else A, arg)
        if len(A.shape) != 2 or A.shape[0] != A.shape[1]:
            msg = f"`{arg}` must be a square matrix; got shape {tuple(A.shape)}."
            raise ValueError(msg)
        if like is None:
            return A.shape[0], A.dtype
        if tuple(like.shape) != (A.shape[0],):
            msg = (
                f"`{fn_name}(like=...)` must have shape ({A.shape[0]},) to match `A`; "
                f"got shape {tuple(like.shape)}."
            )
            raise ValueError(msg)
        return A.shape[0], standard_result_type(A.dtype, like.dtype)
    if like is None:
        msg = (
            f"`{fn_name}(like=...)` is required when `A` is a callable, which does not "
            f"say the size and dtype of its input: pass an array or "
            f"`jax.ShapeDtypeStruct((n,), dtype)`."
        )
        raise TypeError(msg)
    return like.shape[0], like.dtype


def _draw(key: Array, sampler: str, m: int, n: int, real: Any) -> Array:
    if sampler == "rademacher":
        return jr.rademacher(key, (m, n), real)
    z = jr.normal(key, (m, n), real)
    if sampler == "sphere":
        norms = jnp.linalg.norm(z, axis=1, keepdims=True)
        z = z * (jnp.sqrt(jnp.asarray(n, real)) / norms)
    return z
