r"""`trace_funm`: stochastic estimates of $\operatorname{tr} f(A)$, from Lanczos
quadrature, by three estimators.

- Hutchinson: $\frac1m \sum_i \|z_i\|^2\, e_0^\top f(T_i)\, e_0$, probes $z_i$
  with Lanczos quadrature, the probes batched by `jax.vmap` (with
  `probes_per_batch`, a `lax.map` over checkpointed batches: `_in_batches`).
- Hutch++ (Meyer, Musco, Musco and Woodruff, 2021) applied to $f(A)$: $Q$ an
  orthonormal basis of $f(A)\, S$ for a Gaussian sketch $S$ (Lanczos actions),
  $\operatorname{tr}(Q^\top f(A)\, Q)$ by one quadrature per column, and Hutchinson
  on the rest, $(I - QQ^\top) f(A) (I - QQ^\top)$.
- Krylov-aware (Chen and Hallman, 2023): $Q$ an orthonormal basis of the first
  blocks of the block Krylov space of $A$ itself from a Gaussian $\Omega$,
  $\operatorname{tr}(Q^\top f(A)\, Q) \approx \operatorname{tr}(E^\top f(\mathcal
  T)\, E)$ from the projection $\mathcal T$ of $A$ onto the whole space
  (`_head_trace`), and Hutchinson on the rest, with probes projected onto the
  complement of $Q$ (and by default rescaled onto its sphere, which removes the
  variance of a constant part of $f(A)$ there).

The quadratures and their derivative rule are those of `funm_action` (`_funm.py`).
The Krylov-aware estimator holds its sketch fixed in the derivatives and
differentiates each remainder quadrature $w^\top f(A)\, w$ by its first-order
term $(f'(A)\, w)^\top \dot A\, w$ instead of through its run (`_held_products`, a
tangent primitive: one VJP of the operator over all probes in reverse mode); why
is in `trace_funm`'s docstring.
Bases are orthonormalised one vector at a time (`_orthonormal_rows`): a vector of
which less than $\sqrt\varepsilon$ of its length remains is replaced by zero, with
zero derivative, so a rank-deficient sketch ($A = cI$, $n$ smaller than the
sketch) gives zero rows instead of the unbounded derivative of a QR factorisation
with a singular $R$. The small eigenproblem of $\mathcal T$ is differentiated by
the Daleckii--Krein formula, as `_funm_e0` is:

$$\mathrm{d} \operatorname{tr}(H f(\mathcal T)) = \sum_{ij} F_{ij}\,
  (V^\top \mathrm{d}\mathcal T\, V)_{ij}\, (V^\top H V)_{ij}
  + \sum_i \partial_\theta f(\lambda_i)\, (V^\top H V)_{ii},$$

with $\mathcal T = V \Lambda V^\top$, $H$ the diagonal 0/1 mask of the columns of
$Q$ and $F_{ij} = f[\lambda_i, \lambda_j]$ the divided differences, finite at
repeated eigenvalues.
"""

from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.experimental import sparse
from jaxtyping import Array, Inexact, Int, PRNGKeyArray, Real

from ._block import block_trace_terms
from ._checks import (
    as_array,
    check_allocation,
    check_choice,
    check_depth,
    check_inexact,
    check_key,
    check_operator_type,
    check_size,
    standard_result_type,
)
from ._funm import (
    _check_callable,
    _check_tol,
    _divided_differences,
    _funm_e0,
    _LanczosCoefficients,
    _result_dtype,
    _scalar_function,
    _working_dtype,
    block_sizes,
    eigh_one_at_a_time,
    function_tangent,
    tolerance,
)
from ._lanczos import lanczos_in_working_dtype, lanczos_with_stop
from ._operator import AbstractOperator
from ._orthogonal import (
    Adjoint,
    check_problem,
    last_step,
    operator_tangent,
    safe_norm,
)
from ._rules import cotangent_like, fold_batch, tangent_or_none
from ._sharding import auto_types, explicit_mesh, on_common_mesh
from ._tangent import is_tangent, like_tangent, nones, tangent_primitive
from ._typing import OperatorLike, StaticInt

SAMPLERS = ("rademacher", "normal", "sphere")
ESTIMATORS = ("hutchinson", "hutch++", "krylov-aware")


class TraceInfo(eqx.Module):
    r"""What [`krylovjax.trace_funm`][] returns beside its estimate with
    `return_info=True`.

    **Fields:**

    - `standard_error`: the estimated standard error of the estimate, from the
        drawn probes: $s / \sqrt{m'}$, with $s$ the sample standard deviation
        (divisor $m' - 1$) of the $m'$ independent quadratic forms the estimate
        averages, `inf` when $m' = 1$. For `"hutchinson"` these are all
        `num_probes` probes; for `"hutch++"` and `"krylov-aware"` the probes of
        the remainder, so it is the standard error given the sketch (the
        deflated trace $\operatorname{tr}(Q^\top f(A) Q)$ counts as fixed), which is
        what the probes can measure. It estimates the noise of the probes around
        the quadratures' expectation, not the quadrature bias, and carries no
        derivative (`jax.lax.stop_gradient`).
    - `rank`: the number of orthonormal directions deflated, an int array: 0 for
        `"hutchinson"`, the rank of the sketch's basis $Q$ otherwise (below the
        sketch's size when it is rank-deficient).
    - `num_products`: the products with $A$ the estimate used, a Python int:
        `num_probes * d` for every estimator (with `tol`, the most it may use).
    - `products_made`: with `tol`, the products the runs made before they
        stopped, an int array (the block Krylov space of `"krylov-aware"`
        counts `num_sketch * d`); `None` without `tol`.
    - `quadrature_error`: with `tol`, the estimated error of the quadratures
        in the estimate, an array without derivative: the sum of the error
        estimates of the deflated quadratures and the mean of the remainder's
        (each $\|z\|^2$ times the relative estimate of `funm_action`'s
        stop test); `None` without `tol`.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> import krylovjax
        >>> A = jnp.diag(jnp.arange(1.0, 5.0))
        >>> @jax.jit
        ... def log_det(A):
        ...     key = jax.random.key(0)
        ...     return krylovjax.trace_funm(
        ...         jnp.log, A, key, 4, num_probes=8, return_info=True
        ...     )
        >>> est, info = log_det(A)
        >>> info.num_products, int(info.rank)
        (32, 0)
        >>> bool(info.standard_error < 1e-5)  # diagonal A, signs: no variance
        True

        ```
    """

    standard_error: Real[Array, ""]
    rank: Int[Array, ""]
    num_products: int = eqx.field(static=True)
    products_made: Int[Array, ""] | None = None
    quadrature_error: Real[Array, ""] | None = None


def trace_funm(
    f: Callable[[Array], Array],
    A: OperatorLike,
    key: PRNGKeyArray,
    d: StaticInt,
    *,
    num_probes: StaticInt,
    estimator: Literal["hutchinson", "hutch++", "krylov-aware"] = "hutchinson",
    num_sketch: StaticInt | None = None,
    deflated_blocks: StaticInt | None = None,
    sampler: Literal["rademacher", "normal", "sphere"] | None = None,
    like: Inexact[Array | np.ndarray, " n"] | jax.ShapeDtypeStruct | None = None,
    reorthogonalize: bool = True,
    adjoint: Adjoint = "custom_jvp",
    tol: float | None = None,
    block_size: StaticInt | None = None,
    probes_per_batch: StaticInt | None = None,
    return_info: bool = False,
) -> Inexact[Array, ""] | tuple[Inexact[Array, ""], TraceInfo]:
    r"""A stochastic estimate of $\operatorname{tr} f(A)$ for symmetric or
    Hermitian $A$: random probes with Lanczos quadrature, optionally deflated.

    **Hutchinson** (`estimator="hutchinson"`, the default). With $m$ probes $z_i$
    drawn so that $\mathbb E[z z^\top] = I$, and $T_i$ the tridiagonal matrix of
    $d$ Lanczos steps from $z_i$,

    $$\operatorname{tr} f(A) = \mathbb E[z^\top f(A)\, z]
      \approx \frac1m \sum_{i=1}^m \|z_i\|^2\, e_0^\top f(T_i)\, e_0 .$$

    Each term is a $d$-point Gauss quadrature of $z_i^\top f(A)\, z_i$ (Ubaru, Chen
    and Saad, 2017). The $m$ Lanczos runs are one `jax.vmap`, so they cost $m$
    matrix-vector products per step in one batched call, and memory for $m$ bases
    of $n \times d$; `probes_per_batch` runs them a few at a time instead.

    **Hutch++** (`"hutch++"`; Meyer, Musco, Musco and Woodruff, 2021), applied to
    $f(A)$. The budget of $m$ actions is split as in the paper: $k$ =
    `num_sketch` (default $\lfloor m/3 \rfloor$) Gaussian vectors $S$, $Q$ an
    orthonormal basis of $f(A)\, S$ ($k$ Lanczos actions
    $f(A) s \approx \|s\| Q_s f(T_s) e_0$), $\operatorname{tr}(Q^\top f(A) Q)$ by
    one quadrature per column of $Q$ ($k$ more), and Hutchinson with the other
    $m - 2k$ probes, projected, $w = (I - QQ^\top) z$, on the remainder:

    $$\operatorname{tr} f(A) \approx \operatorname{tr}(Q^\top f(A)\, Q)
      + \frac{1}{m - 2k} \sum_i w_i^\top f(A)\, w_i .$$

    It wins when $f(A)$ itself has a few large eigenvalues.

    **Krylov-aware** (`"krylov-aware"`; Chen and Hallman, 2023). $Q$ spans the
    first $q$ = `deflated_blocks` (default $\lceil d/2 \rceil$) blocks of the
    block Krylov space
    $[\Omega, A\Omega, \dots, A^{d-1}\Omega]$ of $A$ itself, from $b$ =
    `num_sketch` (default $\lfloor m/2 \rfloor$) Gaussian columns $\Omega$; with
    $\mathcal T$ the projection of $A$ onto the whole space and $E$ the columns of
    $Q$ in it, $\operatorname{tr}(Q^\top f(A) Q) \approx \operatorname{tr}(E^\top
    f(\mathcal T)\, E)$ at no further products ($b d$ in all), and the other
    $m - b$ probes estimate the remainder, projected onto the complement of $Q$
    and by default (`sampler="sphere"`) rescaled to norm $\sqrt{n - r}$, $r$ the
    rank of $Q$: uniform on the sphere of that complement, so a part of $f(A)$
    that is constant there adds no variance (projected Rademacher probes would
    see $c(I - QQ^\top)$ with variance $\approx 2c^2 r$). This is the estimator
    for $\log\det(K + \sigma^2 I)$ with a kernel matrix $K$: the eigenvalues of
    $f(A)$ do not decay (the bulk sits at $\log\sigma^2$), so a sketch of $f(A)$
    (Hutch++) captures little, while the top eigenvectors of $A$, which a block
    Krylov space of $A$ finds, carry the variance of $\log(I + K/\sigma^2)$; what
    is left is nearly constant on the complement. The docs' page on bases and
    matrix functions has measured numbers.

    All three cost `num_probes * d` products with $A$.

    **Variance.** For fixed quadrature, the Hutchinson estimate is a mean of $m$
    independent terms. With $M = f(A)$ real symmetric, one term's variance is
    $2 \sum_{i \ne j} M_{ij}^2 = 2(\|M\|_F^2 - \sum_i M_{ii}^2)$ for Rademacher
    probes, $2\|M\|_F^2$ for Gaussian probes, and
    $\frac{2n}{n+2}(\|M\|_F^2 - (\operatorname{tr} M)^2/n)$ for probes on the
    sphere of radius $\sqrt n$; divide by $m$ for the estimate's. (For complex
    Hermitian $A$ the probes are real, and $M$ is replaced by its real part.) For
    the deflated estimators $M$ is replaced by $P M P$, $P = I - QQ^\top$, and the
    sphere is that of the range of $P$ (dimension $n - r$). With `return_info` the
    standard error is estimated from the drawn probes ([`krylovjax.TraceInfo`][]).

    **Bias.** Hutchinson's estimator is unbiased for the quadratures, and so are
    the remainders of the deflated ones given $Q$ (so the whole estimate, $Q$ being
    independent of their probes); the quadratures are not. Each quadrature is
    exact for polynomials of degree $2d - 1$, so its error is at most
    $2\|z_i\|^2 \min_p \max_{\lambda} |f(\lambda) - p(\lambda)|$ over such $p$ on
    $[\lambda_{\min}, \lambda_{\max}]$ (exact arithmetic): for $\log$ of an SPD
    matrix with condition number $\kappa$ it falls like
    $((\sqrt\kappa - 1)/(\sqrt\kappa + 1))^{2d}$. It is exact when $d$ reaches the
    number of distinct eigenvalues; the deflated trace of `"krylov-aware"` is exact
    when the block Krylov space is invariant (a low-rank-plus-identity $A$ with
    $b$ at least the rank, say).

    **Derivatives.** Those of `"hutchinson"` and `"hutch++"` are the exact
    derivatives of the estimate for the drawn key (for Hutch++, $Q$'s dependence
    on $A$ included), so their expectation is the derivative of
    $\operatorname{tr} f(A)$ plus that of the quadrature bias. `"krylov-aware"`
    holds its sketch fixed (the whole block Krylov basis, whose products with $A$
    still carry $\dot A$) and differentiates each remainder probe's quadrature by
    its first-order term,

    $$\mathrm{d}\,(w^\top f(A)\, w) = (f'(A)\, w)^\top \dot A\, w$$

    for symmetric $\dot A$ (the Daleckii--Krein formula), with
    $f'(A)\, w \approx \|w\| V f'(T) e_0$ from the same Lanczos run, rather
    than through the run. Given the sketch, the estimate is unbiased for
    $\operatorname{tr} f(A)$ at every $A$ (up to the quadratures), so this
    derivative is unbiased for that of $\operatorname{tr} f(A)$ up to the
    quadratures' error, and exact where the sketch spans everything. The exact
    derivative of the estimate adds the sketch's motion (terms of mean zero)
    and differentiates each run from a probe projected off the top eigenvectors,
    which is ill-conditioned: the probe keeps components of about $10^{-13}$ of
    its length along them, which the run amplifies, while $\dot A\, w$ has
    components there of full size. On the docs' kernel ($n = 2000$, one sketch
    column, all but the last of $d$ blocks deflated) one term's exact derivative
    at $d = 30$ was $2.5 \cdot 10^7$ against $-869$ for
    $w^\top A^{-1} \dot A w$, and at $d = 50$ the variance of the exact
    derivative over 60 keys was $5 \cdot 10^4$ times this one's. (On probes that
    are not deflated, as Hutch++'s, the first-order term converges like
    $f'(A)\, w$, more slowly than the quadrature: there it doubled Hutch++'s
    gradient variance, which is why Hutch++ keeps the exact derivative.) The
    derivative in what `f` closes over is the quadrature's. Differentiated
    again (`jax.hessian`), the rule differentiates $f'(A)\, w$ and $\dot A$ too,
    with the sketch still fixed: given the sketch, the second derivative's mean
    over the remainder's probes is the derivative of the first derivative's
    mean. For training (`log det` of a kernel matrix, say)
    the noise of any of them is that of a fresh key per step.

    **Arguments:**

    - `f`: a scalar function applied elementwise to eigenvalues, as with
        `funm_action(..., method="lanczos")`: called on the `(d,)` real eigenvalues
        of each $T_i$ (and for `"krylov-aware"` on the `(b d,)` ones of
        $\mathcal T$), it returns values of the same shape. It may close over
        arrays.
    - `A`: a symmetric (real) or Hermitian (complex) operator of any kind
        [`krylovjax.krylov`][] accepts (not checked). `"hutch++"` and
        `"krylov-aware"` take real float32 or float64 operators only.
    - `key`: a JAX PRNG key. The Hutchinson probes are
        `jax.random.rademacher(key, (num_probes, n), dtype)` (`sampler="rademacher"`)
        or `jax.random.normal(key, (num_probes, n), dtype)` (`"normal"`, and
        `"sphere"`, which rescales each row to norm $\sqrt n$), with `dtype` the
        real dtype of the operator, so the same key gives the same probes. (In
        64-bit mode, the Rademacher draw of an operator in float32 or less takes
        its uniform numbers in float32, as in the default 32-bit mode, rather
        than in float64.) The deflated estimators split the key in two, for the
        sketch and for the remainder.
    - `d`: the number of Lanczos steps per probe, a static Python int,
        `1 <= d <= n`; for `"krylov-aware"` also the number of blocks of the
        block Krylov space.
    - `num_probes`: the number $m$ of vectors, a static Python `int >= 1`
        (`>= 2` for `"krylov-aware"`): the estimate uses $m d$ products with $A$.
        The $m$ bases are built at once unless `probes_per_batch` says otherwise:
        a batch that does not fit in memory raises a `ValueError` naming
        `num_probes` (or `probes_per_batch`) before anything runs.
    - `estimator`: `"hutchinson"` (default), `"hutch++"` or `"krylov-aware"`,
        above.
    - `num_sketch`: the sketch's size, a static int: $k$ for `"hutch++"`
        (`0 <= k`, $m - 2k \ge 1$; default $\lfloor m/3 \rfloor$), $b$ for
        `"krylov-aware"` (`1 <= b < m`; default $\lfloor m/2 \rfloor$). Not
        accepted with `"hutchinson"`.
    - `deflated_blocks`: for `"krylov-aware"`, how many of the `d` blocks of the
        block Krylov space are deflated (Chen and Hallman's $q$), a static int,
        `1 <= q <= d`. The other $d - q$ blocks serve the quadrature of the
        deflated trace, which is exact for polynomials of degree about
        $2(d - q) + 1$ on the deflated space, and exact when the space is
        invariant. Default $\lceil d/2 \rceil$: about the degree of the
        remainder's quadratures. Deflating more captures more of the top of the
        spectrum with the same products, at the price of a quadrature bias from
        the last blocks: for a log-determinant of a kernel matrix, where the top
        of the spectrum carries the variance, `d - 1` is far better (measured in
        the docs' page on bases); where nothing decays it gains nothing. Not
        accepted with the other estimators.
    - `sampler`: the probe distribution, `"rademacher"` (entries $\pm 1$, the
        smallest variance of the three for most $f(A)$; the default of
        `"hutchinson"` and `"hutch++"`), `"normal"` or `"sphere"` (normalised
        Gaussian; the default of `"krylov-aware"`, where it is normalised after the
        projection).
    - `like`: an array or `jax.ShapeDtypeStruct` of shape `(n,)` whose dtype the
        probes are promoted with, as `x0` is in [`krylovjax.krylov`][]. Required
        when `A` is a callable (which does not say its size); for a matrix the
        default is its own dtype.
    - `reorthogonalize`, `adjoint`: passed on to [`krylovjax.lanczos`][].
        (`adjoint="autodiff"` differentiates the whole estimate by JAX's rules,
        the small eigenproblems by `_funm`'s rule still; the Krylov-aware
        remainder's runs are not differentiated, above.)
    - `tol`: a relative tolerance, a Python float in $(0, 1)$, for each probe's
        quadrature, with `d` now the largest depth: each Lanczos run stops at
        the first depth at which its quadrature meets the tolerance by
        [`krylovjax.funm_action`][]'s a-posteriori estimate (successive
        approximations, checked at every step up to 16 and then at widening
        intervals), inside the same compiled program with the static buffer of
        `d` steps; for `"hutch++"` the sketch's actions stop on $f(T) e_0$
        instead, and the block Krylov space of `"krylov-aware"` keeps its `d`
        blocks. The derivatives are exact for the depths used. It bounds the
        quadrature bias, not the probes' noise: choose `num_probes` for that
        (see the standard error). `None` (default): `d` steps for every probe.
    - `block_size`: with `"hutchinson"`, the probes in blocks of this many
        columns, each block's quadrature $\operatorname{tr}(Z^\top f(A) Z) / b$
        by block Gauss quadrature from [`krylovjax.block_lanczos`][] at depth
        `d` (`d` products with the `block_size` columns: the same $m d$ products
        with $A$; `d * block_size <= n`). The terms of the standard error are
        then the blocks'. `adjoint` is passed on to block Lanczos. Its small
        matrices are `(d b, d b)`, so its `eigh` costs $b^3$ times more than that
        of a single probe: see the docs' page on bases for when blocks pay. It
        takes no `tol`. `None` (default): one Lanczos run per probe.
    - `probes_per_batch`: how many probes' Lanczos runs are batched together, a
        static int, `1 <= probes_per_batch <= num_probes` (a multiple of
        `block_size` with blocks). The batches run one after another (a
        `lax.map`, the last one possibly smaller), and reverse mode recomputes
        each batch's runs from its probes (`jax.checkpoint`) instead of storing
        them, so memory in both modes is that of `probes_per_batch` bases, not
        `num_probes`, for about one more forward pass in reverse mode. The
        estimate is the same. It applies to every batch of runs: Hutchinson's
        probes, Hutch++'s sketch and remainder, and the Krylov-aware remainder
        (not its block Krylov sketch). For sparse operators on a CPU, batches of
        8 to 16 took 0.66 to 1.07 of the time of all at once (measured in the
        docs' page on bases); a dense matrix is read once per step for the whole
        batch, so there batches took up to twice as long. `None` (default): all
        probes at once.
    - `return_info`: also return a [`krylovjax.TraceInfo`][] (standard error,
        rank of the sketch, products used, and with `tol` the products made and
        the quadratures' error estimate).

    **Returns:**

    The estimate, a scalar of $f$'s dtype promoted with the real dtype of $A$:
    real for a real-valued $f$; with `return_info=True`, the pair
    `(estimate, info)`. For bfloat16 and float16 operators the quadratures
    are worked in float32 (`f` is called on float32 eigenvalues) and a real
    estimate is rounded to the operator's dtype at the end. Differentiable (forward
    and reverse mode) in the arrays `A` holds and those `f` closes over, also when
    a probe's Krylov space is invariant after fewer than $d$ vectors (see
    `funm_action`'s breakdown rule) and when a sketch is rank-deficient. At such a
    breakdown the first derivatives of a probe's term are exact, its second
    derivatives are not (they miss the couplings to the eigenvalues outside the
    invariant space; see `funm_action`'s breakdown paragraph).

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
        >>> @jax.jit
        ... def low_rank_plus_identity(key):
        ...     U = jax.random.normal(key, (30, 2))
        ...     B = jnp.eye(30) + U @ U.T
        ...     est, info = krylovjax.trace_funm(
        ...         jnp.log, B, key, 3, num_probes=4, estimator="krylov-aware",
        ...         return_info=True,
        ...     )
        ...     return est, jnp.linalg.slogdet(B)[1], info
        >>> est, exact, info = low_rank_plus_identity(key)
        >>> bool(jnp.allclose(est, exact, rtol=1e-4))
        True
        >>> info.num_products, int(info.rank)
        (12, 4)

        ```
    """
    fn_name = "trace_funm"
    _check_callable(f, f"{fn_name}(f=...)")
    d = check_depth(d, fn_name)
    num_probes = check_size(
        num_probes, f"{fn_name}(num_probes=...)", what="the number of probes"
    )
    check_choice(estimator, ESTIMATORS, f"{fn_name}(estimator=...)")
    if sampler is None:
        sampler = "sphere" if estimator == "krylov-aware" else "rademacher"
    check_choice(sampler, SAMPLERS, f"{fn_name}(sampler=...)")
    if tol is not None:
        tol = _check_tol(tol, f"{fn_name}(tol=...)")
    if not isinstance(return_info, bool | np.bool_):
        msg = (
            f"`{fn_name}(return_info=...)` must be a bool; got {return_info!r} of "
            f"type {type(return_info).__name__}."
        )
        raise TypeError(msg)
    if block_size is not None:
        block_size = _check_block_size(block_size, num_probes, estimator, tol, fn_name)
    if probes_per_batch is not None:
        probes_per_batch = _check_probes_per_batch(
            probes_per_batch, num_probes, block_size, fn_name
        )
    sketch = _sketch_size(estimator, num_sketch, num_probes, fn_name)
    deflated_blocks = _deflated_blocks(estimator, deflated_blocks, d, fn_name)
    check_key(key, f"{fn_name}(key=...)")
    n, dtype = _probe_structure(A, like, fn_name)
    if block_size is not None and d * block_size > n:
        msg = (
            f"`{fn_name}(block_size=...)` times `d` must be at most n = {n} (a "
            f"block Lanczos basis has d * block_size vectors); got block_size = "
            f"{block_size} and d = {d}."
        )
        raise ValueError(msg)
    if estimator != "hutchinson" and np.dtype(dtype) not in _DEFLATED_DTYPES:
        msg = (
            f"`{fn_name}(estimator={estimator!r})` takes real float32 or float64 "
            f"operators; got dtype {np.dtype(dtype)} (use "
            f'`estimator="hutchinson"`).'
        )
        raise TypeError(msg)
    # A callable's output is compared with `like`, which gives the probes' shape (it
    # is required for a callable). On the key's mesh, as the probes will be: under a
    # `vmap` over keys split over an explicit mesh, `A` is placed there too, and so
    # are the carries of its derivatives in the block Krylov scan.
    probe = on_common_mesh(explicit_mesh(key), jnp.zeros((n,), dtype))
    operator, _, _ = check_problem(
        A, probe, d, reorthogonalize, adjoint, fn_name, "like", "the size of the probes"
    )
    # The bases of a batch are built at once (one vmapped Lanczos run): checked
    # before anything is traced, so that too many probes name `num_probes` (or
    # `probes_per_batch`) rather than fail in XLA's allocator.
    batch, arg = num_probes, "num_probes"
    hint = "Run the probes in batches with `probes_per_batch`."
    if probes_per_batch is not None:
        batch, arg, hint = probes_per_batch, "probes_per_batch", "Use smaller batches."
    check_allocation(
        (batch, n, d),
        _working_dtype(dtype),
        f"{fn_name}({arg}=...)",
        f"the batch of {batch} Lanczos bases (one ({n}, {d}) basis per probe)",
        hint,
    )
    if estimator == "krylov-aware":
        check_allocation(
            ((d + 1) * sketch, n),
            dtype,
            f"{fn_name}(num_sketch=...)",
            f"the block Krylov basis of {d} blocks of {sketch} vectors",
        )
    real = jnp.finfo(dtype).dtype
    run = _Runs(
        f, A, d, reorthogonalize, adjoint, f"{fn_name}(f=...)", tol, probes_per_batch
    )
    if estimator == "hutchinson" and block_size is not None:
        probes = _draw(key, sampler, num_probes, n, real).astype(dtype)
        blocks = probes.reshape(num_probes // block_size, block_size, n)

        def block_terms(Z):
            return block_trace_terms(f, A, Z, d, reorthogonalize, adjoint, fn_name)

        per_batch = None if probes_per_batch is None else probes_per_batch // block_size
        terms = _in_batches(block_terms, jnp.swapaxes(blocks, 1, 2), per_batch)
        terms = terms / jnp.asarray(block_size, terms.dtype)
        deflated, rank = jnp.zeros((), terms.dtype), jnp.zeros((), jnp.int32)
        spent, error = jnp.asarray(num_probes * d), jnp.zeros((), real)
    elif estimator == "hutchinson":
        probes = _draw(key, sampler, num_probes, n, real).astype(dtype)
        terms, products, errors = run.quadratures(probes)
        deflated, rank = jnp.zeros((), terms.dtype), jnp.zeros((), jnp.int32)
        spent, error = jnp.sum(products), jnp.mean(errors)
    elif estimator == "hutch++":
        deflated, terms, rank, spent, error = _hutch_plus_plus(
            run, key, sampler, num_probes, sketch, n, dtype
        )
    else:
        deflated, terms, rank, spent, error = _krylov_aware(
            run,
            operator,
            key,
            sampler,
            num_probes,
            sketch,
            d,
            deflated_blocks,
            n,
            dtype,
        )
    both = standard_result_type(terms.dtype, deflated.dtype)
    mean = jnp.mean(terms).astype(both)
    estimate = (deflated.astype(both) + mean).astype(_result_dtype(real, both))
    if not return_info:
        return estimate
    info = TraceInfo(
        standard_error=_standard_error(terms),
        rank=rank,
        num_products=num_probes * d,
        products_made=None if tol is None else spent.astype(jnp.int32),
        quadrature_error=None if tol is None else lax.stop_gradient(error),
    )
    return estimate, info


_DEFLATED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class _Runs(eqx.Module):
    r"""Lanczos runs from a batch of vectors: quadratures $\|z\|^2 e_0^\top f(T)
    e_0$ of $z^\top f(A) z$, or actions $f(A) z \approx \|z\| Q f(T) e_0$.

    With `tol`, each run ends at the first depth at which its result (the
    quadrature, or $f(T) e_0$ for an action) meets `tol` by `funm_action`'s stop
    test (`_funm.Tolerance`), and every method also returns the products each run
    made and, for quadratures, each one's error estimate."""

    f: Callable
    A: Any
    d: int = eqx.field(static=True)
    reorthogonalize: bool = eqx.field(static=True)
    adjoint: str = eqx.field(static=True)
    arg: str = eqx.field(static=True)
    tol: float | None = eqx.field(static=True, default=None)
    batch: int | None = eqx.field(static=True, default=None)

    def _lanczos(self, vectors: Array, quadrature: bool):
        options = {
            "reorthogonalize": self.reorthogonalize,
            "adjoint": self.adjoint,
        }
        if self.tol is None:

            def one(z):
                dec = lanczos_in_working_dtype(self.A, z, self.d, **options)  # pyright: ignore[reportArgumentType]
                return dec, jnp.zeros((), jnp.finfo(dec.diagonal.dtype).dtype)

        else:
            stop = self._stop(vectors, quadrature)

            def one(z):
                return lanczos_with_stop(self.A, z, self.d, stop, **options)  # pyright: ignore[reportArgumentType]

        dec, estimate = jax.vmap(one)(vectors)
        return dec.basis, dec.diagonal, dec.off_diagonal, dec.norm, estimate

    def _stop(self, vectors: Array, quadrature: bool):
        """The stop test: on $e_0^\top f(T_j) e_0$ for a quadrature, on
        $f(T_j) e_0$ for an action."""
        assert self.tol is not None
        real = _working_dtype(jnp.finfo(vectors.dtype).dtype)
        d = self.d
        # Its functions run inside the decomposition, with a mesh's axes `Auto`.
        with auto_types(explicit_mesh(self.A, vectors)):
            fns = tuple(
                _scalar_function(self.f, jnp.zeros((int(n),), real), self.arg)
                for n in block_sizes(d)
            )
            small = (jnp.zeros((d,), real), jnp.zeros((d - 1,), real))
            coefficients = _LanczosCoefficients(fns, first=quadrature)
            return tolerance(coefficients, small, d, self.tol)

    def _small(self, diagonal: Array, off_diagonal: Array) -> Array:
        work = diagonal.dtype
        fn = _scalar_function(self.f, jnp.zeros_like(diagonal), self.arg)
        return _funm_e0(fn, diagonal, off_diagonal.astype(work))

    def _products(self, off_diagonal: Array) -> Array:
        """The steps each run made: all `d`, or up to the one that ended it."""
        if self.tol is None:
            return jnp.full(off_diagonal.shape[:1], self.d, jnp.int32)
        # A zero after the last, padded (a fresh array would be on no mesh, which
        # under a `vmap` over keys split over an explicit mesh does not join the
        # entries; and `off_diagonal[:, :1]` is empty at d = 1).
        betas = lax.stop_gradient(jnp.pad(off_diagonal, ((0, 0), (0, 1))))
        return (jax.vmap(last_step)(betas) + 1).astype(jnp.int32)

    def quadratures(
        self, vectors: Array, operator: AbstractOperator | None = None
    ) -> tuple[Array, Array, Array]:
        r"""The terms, the products of each run and each term's error estimate
        (zero without `tol`).

        With `operator` (the Krylov-aware remainder's probes, held fixed),
        the runs are not differentiated in $A$: each term's derivative in $A$ is
        its first-order term $(f'(A) w)^\top \dot A\, w$ (`_held_products`), with
        $f'(A) w \approx \|w\| Q f'(T) e_0$ from the same run; its derivative in
        what `f` closes over is the quadrature's."""

        def quadrature(run):
            _, diagonal, off_diagonal, norm, _ = run
            c = self._small(diagonal, off_diagonal)[0]
            out = standard_result_type(c.dtype, diagonal.dtype)
            return (norm * norm).astype(out) * c.astype(out)

        def derivative_action(run):
            basis, diagonal, off_diagonal, norm, _ = run
            fn = _scalar_function(self.f, jnp.zeros_like(diagonal), self.arg)
            derivative = jtu.Partial(_elementwise_derivative, fn)
            c = _funm_e0(derivative, diagonal, off_diagonal.astype(diagonal.dtype))
            return norm * (basis @ c.astype(basis.dtype))

        def batch(start):
            # The Lanczos runs are batched; the small eigendecompositions run one
            # at a time. jaxlib's batched `eigh` on CPU splits its batch over the
            # thread pool that runs it and waits there for the parts: two at once
            # (a value and a derivative in one program, on two cores) can wait on
            # each other forever. One matrix runs inline.
            runs = self._lanczos(start, quadrature=True)
            live = runs
            if operator is not None:
                runs = lax.stop_gradient(runs)
            terms = lax.map(quadrature, runs)
            products = self._products(runs[2])
            norm, estimate = lax.stop_gradient(runs[3]), runs[4]
            errors = norm * norm * estimate.astype(norm.dtype)
            if operator is None:
                return terms, products, errors
            # From the runs with their derivatives: those of the first-order term
            # are the second derivatives' (`_first_order`).
            actions = lax.map(derivative_action, live).astype(start.dtype)
            return terms, products, errors, actions

        # A zero vector (a dropped row of a basis, the remainder of a basis that
        # spans everything) has a zero term; its run starts from a vector of ones
        # instead, whose quadrature is finite where `f` is on the spectrum (that of
        # zero is `f(0) * 0`, `nan` for `log`), and is then discarded.
        square = lax.stop_gradient(jnp.sum(jnp.abs(vectors) ** 2, axis=1))
        empty = square == 0
        start = jnp.where(empty[:, None], jnp.ones_like(vectors), vectors)
        terms, products, errors, *actions = _in_batches(batch, start, self.batch)
        if operator is not None:
            # Over all rows at once, outside the batches: one VJP of the operator
            # in reverse mode.
            first = _first_order(actions[0], operator, lax.stop_gradient(start))
            terms = terms + first.astype(terms.dtype)
        terms = jnp.where(empty, jnp.zeros_like(terms), terms)
        products = jnp.where(empty, 0, products)
        errors = jnp.where(empty, 0, errors)
        return terms, products, errors

    def actions(self, vectors: Array) -> tuple[Array, Array]:
        """The actions, and the products of each run."""

        def action(run):
            basis, diagonal, off_diagonal, norm, _ = run
            c = self._small(diagonal, off_diagonal)
            return (norm * (basis @ c.astype(basis.dtype))).astype(vectors.dtype)

        def batch(vectors):
            runs = self._lanczos(vectors, quadrature=False)
            return lax.map(action, runs), self._products(runs[2])

        return _in_batches(batch, vectors, self.batch)


def _in_batches(fn: Callable, xs: Any, size: int | None) -> Any:
    """`fn(xs)` for a function `fn` of a batch (arrays with a leading batch axis
    in, and out), run `size` rows at a time: a `lax.map` over the full batches,
    then the rest. Each batch is `jax.checkpoint`ed, so reverse mode recomputes
    it from its rows instead of storing its intermediates: memory in both modes
    is that of `size` rows, not of all of them. `None`, or a size that covers
    every row: `fn(xs)`."""
    rows = jtu.tree_leaves(xs)[0].shape[0]
    if size is None or size >= rows:
        return fn(xs)
    full = rows - rows % size
    head = jtu.tree_map(lambda x: x[:full].reshape(-1, size, *x.shape[1:]), xs)
    # The arrays `fn` closes over are the loop's constants, whose cotangents the
    # reverse loop accumulates: those on no mesh are placed on that of `xs`, as
    # the cotangent of one under a `vmap` whose batch axis is split over the mesh
    # (per-key gradients, keys split over devices) must be typed there.
    converted, consts = jax.closure_convert(fn, jtu.tree_map(lambda x: x[0], head))
    consts = on_common_mesh(explicit_mesh(xs), consts)
    batch = jax.checkpoint(lambda x: converted(x, *consts))
    out = jtu.tree_map(lambda y: y.reshape(full, *y.shape[2:]), lax.map(batch, head))
    if full == rows:
        return out
    rest = jax.checkpoint(fn)(jtu.tree_map(lambda x: x[full:], xs))
    return jtu.tree_map(lambda a, b: jnp.concatenate([a, b]), out, rest)


# ----------------------------------------------------------------- estimators


def _hutch_plus_plus(
    run: _Runs, key: Array, sampler: str, m: int, k: int, n: int, dtype: Any
) -> tuple[Array, Array, Array, Array, Array]:
    """Hutch++ on $f(A)$: the deflated trace, the remainder's terms, the rank, the
    products made and the quadratures' error estimate."""
    key_sketch, key_rest = jr.split(key)
    sketch = jr.normal(key_sketch, (k, n), dtype)
    actions, sketched = run.actions(sketch)
    Q = _orthonormal_rows(actions, jnp.zeros((0, n), dtype))
    remainder = _remainder_probes(key_rest, sampler, m - 2 * k, Q)
    # The basis's quadratures and the remainder's in one batch of runs.
    terms, products, errors = run.quadratures(jnp.concatenate([Q, remainder]))
    spent = jnp.sum(sketched) + jnp.sum(products)
    error = jnp.sum(errors[:k]) + jnp.mean(errors[k:])
    return jnp.sum(terms[:k]), terms[k:], _rank(Q), spent, error


def _krylov_aware(
    run: _Runs,
    operator: AbstractOperator,
    key: Array,
    sampler: str,
    m: int,
    b: int,
    d: int,
    q: int,
    n: int,
    dtype: Any,
) -> tuple[Array, Array, Array, Array, Array]:
    """Chen and Hallman's estimator, deflating the first `q` of `d` blocks: the
    deflated trace, the remainder's terms, the rank, the products made and the
    remainder's quadrature error estimate."""
    key_sketch, key_rest = jr.split(key)
    omega = jr.normal(key_sketch, (b, n), dtype)
    basis, products = _block_krylov(operator, omega, d)
    T = basis @ products.T
    T = (T + T.T) / 2
    visible = lax.stop_gradient(jnp.sum(basis * basis, axis=1)) > 0.5
    head = visible & (jnp.arange(d * b) < q * b)
    deflated = _head_trace(run.f, T, visible, head, run.arg)
    Q = jnp.where(head[:, None], basis, jnp.zeros_like(basis))
    remainder = _remainder_probes(key_rest, sampler, m - b, Q)
    terms, products, errors = run.quadratures(remainder, operator)
    spent = b * d + jnp.sum(products)
    return deflated, terms, _rank(Q), spent, jnp.mean(errors)


def _block_krylov(
    operator: AbstractOperator, omega: Array, d: int
) -> tuple[Array, Array]:
    """An orthonormal basis of $[\\Omega, A\\Omega, \\dots, A^{d-1}\\Omega]$, as
    `(d b, n)` rows (zero rows for what was dropped), and $A$ times each row.

    The basis is held fixed in the derivatives: only the products carry a
    tangent, $\\dot A$ times each row (`_held_products`: in reverse mode one VJP
    of the operator with all rows, not one per step)."""
    fixed = _held(operator)
    b, n = omega.shape
    first = _orthonormal_rows(omega, jnp.zeros((0, n), omega.dtype))
    # Padded from `first`, so that the buffer has its layout (under `vmap` over
    # keys split over devices, a scatter into fresh zeros has no unambiguous one).
    buffer = jnp.pad(first, ((0, d * b), (0, 0)))

    def step(carry, k):
        buffer, block = carry
        product = fixed.mm(block).astype(block.dtype)
        block = _orthonormal_rows(product, buffer)
        buffer = lax.dynamic_update_slice(buffer, block, ((k + 1) * b, 0))
        return (buffer, block), product

    (buffer, _), products = lax.scan(step, (buffer, first), jnp.arange(d))
    basis = lax.stop_gradient(buffer[: d * b])
    products = lax.stop_gradient(products.reshape(d * b, n))
    return basis, products + _held_products(operator, basis)


def _orthonormal_rows(Y: Array, previous: Array) -> Array:
    r"""Orthonormal rows spanning those of `Y` against the orthonormal (or zero)
    rows of `previous`: block Gram--Schmidt twice against `previous`, then one row
    at a time (twice) against the rows done. A row of which no more than
    $\sqrt\varepsilon$ of its length remains is dropped (a zero row, with zero
    derivative)."""
    if Y.shape[0] == 0:
        # No rows (a Hutch++ sketch of size 0): the loop's body could not index.
        return Y
    eps = jnp.finfo(Y.dtype).eps
    # Each row scaled to a largest entry of 1 (a constant for the derivative),
    # which changes neither the rows made nor their derivatives: the squares of
    # entries above 1e19 (`exp` of eigenvalues near 45 in float32) overflowed,
    # and the row was dropped.
    top = lax.stop_gradient(jnp.max(jnp.abs(Y), axis=1, keepdims=True))
    Y = Y / jnp.where(top > 0, top, jnp.ones_like(top)).astype(Y.dtype)
    lengths = jnp.sum(lax.stop_gradient(Y) ** 2, axis=1)
    for _ in range(2):
        Y = Y - (Y @ previous.T) @ previous

    def step(done, j):
        y = Y[j]
        for _ in range(2):
            y = y - done.T @ (done @ y)
        square = jnp.sum(y * y)
        keep = lax.stop_gradient(square) > eps * lengths[j]
        safe = jnp.where(keep, square, jnp.ones_like(square))
        q = jnp.where(keep, y / jnp.sqrt(safe), jnp.zeros_like(y))
        return done.at[j].set(q), None

    done, _ = lax.scan(step, jnp.zeros_like(Y), jnp.arange(Y.shape[0]))
    return done


def _rank(Q: Array) -> Array:
    """The number of non-zero (unit) rows of `Q`."""
    norms = lax.stop_gradient(jnp.sum(Q * Q, axis=1))
    return jnp.sum(norms > 0.5).astype(jnp.int32)


def _remainder_probes(key: Array, sampler: str, m: int, Q: Array) -> Array:
    r"""Probes $w = (I - QQ^\top) z$ of the remainder, for $z$ from `sampler`;
    `"sphere"`: Gaussian, projected, then rescaled to norm $\sqrt{n - r}$, so
    uniform on the sphere of the complement ($r$ the rank of $Q$)."""
    n = Q.shape[1]
    z = _draw(key, "normal" if sampler == "sphere" else sampler, m, n, Q.dtype)
    for _ in range(2):
        z = z - (z @ Q.T) @ Q
    if sampler != "sphere":
        return z
    free = jnp.asarray(n, jnp.int32) - _rank(Q)
    square = jnp.sum(z * z, axis=1, keepdims=True)
    ok = (lax.stop_gradient(square) > 0) & (free > 0)
    scale = free.astype(Q.dtype) / jnp.where(ok, square, jnp.ones_like(square))
    return jnp.where(ok, z * jnp.sqrt(scale), jnp.zeros_like(z))


def _standard_error(terms: Array) -> Array:
    """The standard error of the mean of `terms`: `inf` for a single term."""
    terms = lax.stop_gradient(terms)
    real = jnp.finfo(terms.dtype).dtype
    (m,) = terms.shape
    if m < 2:
        return jnp.asarray(jnp.inf, real)
    deviation = jnp.abs(terms - jnp.mean(terms)).astype(real)
    # sqrt(sum of squares) scaled (`safe_norm`): the squares of terms above 1e19
    # overflowed in float32.
    return safe_norm(deviation) / jnp.sqrt(jnp.asarray(m * (m - 1), real))


# ------------------------------------------------- the deflated trace of f(T)


def _head_trace(f: Callable, T: Array, visible: Array, head: Array, arg: str) -> Array:
    r"""$\operatorname{tr}(H f(\mathcal T))$, $H$ the 0/1 diagonal of `head`.

    The rows and columns of dropped basis vectors (not `visible`) are zero in
    $\mathcal T$, where `f` may be infinite ($\log 0$); they are replaced by $c$ on
    the diagonal, the mean of the visible diagonal entries (Rayleigh quotients, in
    the numerical range of $A$, where `f` is evaluated anyway), decoupled from the
    rest and outside `head`: the value is unchanged."""
    both = visible[:, None] & visible[None, :]
    T = jnp.where(both, T, jnp.zeros_like(T))
    diagonal = jnp.diagonal(T)
    count = jnp.maximum(jnp.sum(visible), 1).astype(T.dtype)
    c = lax.stop_gradient(jnp.sum(jnp.where(visible, diagonal, 0)) / count)
    T = T + jnp.diag(jnp.where(visible, jnp.zeros_like(diagonal), c))
    fn = _scalar_function(f, jnp.zeros_like(diagonal), arg)
    return _weighted_trace(fn, T, head.astype(T.dtype))


@eqx.filter_custom_jvp
def _weighted_trace(fn: Callable, T: Array, head: Array) -> Array:
    lam, V = eigh_one_at_a_time(T)
    values = fn(lam)
    weights = (head @ (V * V)).astype(values.dtype)
    return jnp.sum(values * weights)


@_weighted_trace.def_jvp
def _weighted_trace_jvp(primals, tangents):
    fn, T, head = primals
    t_fn, t_T, _ = tangents
    lam, V = eigh_one_at_a_time(T)
    values, derivatives = jax.jvp(fn, (lam,), (jnp.ones_like(lam),))
    dtype = values.dtype
    W = (V.T @ (head[:, None] * V)).astype(dtype)
    weights = jnp.diagonal(W)
    out = jnp.sum(values * weights)
    tangent = jnp.zeros_like(out)
    if t_T is not None:
        E = (V.T @ t_T @ V).astype(dtype)
        F = _divided_differences(lam, values, derivatives)
        tangent = tangent + jnp.sum(F * E * W)
    dvalues = function_tangent(fn, t_fn, lam)
    if dvalues is not None:
        tangent = tangent + jnp.sum(dvalues.astype(dtype) * weights)
    return out, tangent


def _check_block_size(
    block_size: Any, m: int, estimator: str, tol: Any, fn_name: str
) -> int:
    arg = f"{fn_name}(block_size=...)"
    block_size = check_size(block_size, arg, what="the columns of a block of probes")
    if estimator != "hutchinson":
        msg = (
            f"`{arg}` is taken by `estimator='hutchinson'`; got "
            f"estimator={estimator!r}."
        )
        raise ValueError(msg)
    if tol is not None:
        msg = f"`{arg}` and `tol=...` do not go together; got tol={tol!r}."
        raise ValueError(msg)
    if m % block_size:
        msg = (
            f"`{arg}` must divide `num_probes` = {m} (the probes are split into "
            f"blocks of equal size); got {block_size}."
        )
        raise ValueError(msg)
    return block_size


def _check_probes_per_batch(
    size: Any, m: int, block_size: int | None, fn_name: str
) -> int:
    arg = f"{fn_name}(probes_per_batch=...)"
    size = check_size(size, arg, what="the probes run in one batch")
    if size > m:
        msg = (
            f"`{arg}` must be at most `num_probes` = {m}; got {size} (use `None` "
            f"to run all probes at once)."
        )
        raise ValueError(msg)
    if block_size is not None and size % block_size:
        msg = (
            f"`{arg}` must be a multiple of `block_size` = {block_size} (the "
            f"batches hold whole blocks); got {size}."
        )
        raise ValueError(msg)
    return size


def _sketch_size(estimator: str, num_sketch: Any, m: int, fn_name: str) -> int:
    """The sketch's size: checked, or the estimator's default."""
    arg = f"{fn_name}(num_sketch=...)"
    if estimator == "hutchinson":
        if num_sketch is not None:
            msg = (
                f"`{arg}` applies to `estimator='hutch++'` and "
                f"`estimator='krylov-aware'`; got {num_sketch!r} with "
                f"`estimator='hutchinson'`."
            )
            raise ValueError(msg)
        return 0
    if estimator == "hutch++":
        k = m // 3 if num_sketch is None else num_sketch
        k = check_size(k, arg, what="the number of sketch vectors", minimum=0)
        if m - 2 * k < 1:
            msg = (
                f"`{arg}` must leave at least one probe for the remainder, "
                f"`num_probes - 2 * num_sketch >= 1` with `estimator='hutch++'`; "
                f"got num_sketch={k} with num_probes={m}."
            )
            raise ValueError(msg)
        return k
    if m < 2:
        msg = (
            f"`{fn_name}(num_probes=...)` must be at least 2 with "
            f"`estimator='krylov-aware'` (a sketch and a probe of the remainder); "
            f"got {m}."
        )
        raise ValueError(msg)
    b = m // 2 if num_sketch is None else num_sketch
    b = check_size(b, arg, what="the number of sketch columns")
    if b >= m:
        msg = (
            f"`{arg}` must be below `num_probes` with `estimator='krylov-aware'` "
            f"(the rest are probes of the remainder); got num_sketch={b} with "
            f"num_probes={m}."
        )
        raise ValueError(msg)
    return b


def _deflated_blocks(estimator: str, q: Any, d: int, fn_name: str) -> int:
    r"""The number of deflated blocks of `"krylov-aware"`: checked, or its default
    $\lceil d/2 \rceil$ (Chen and Hallman's $q$; the other $d - q$ blocks, their
    $n$, serve the deflated trace's quadrature)."""
    arg = f"{fn_name}(deflated_blocks=...)"
    if estimator != "krylov-aware":
        if q is not None:
            msg = (
                f"`{arg}` applies to `estimator='krylov-aware'`; got {q!r} with "
                f"`estimator={estimator!r}`."
            )
            raise ValueError(msg)
        return 0
    if q is None:
        return d - d // 2
    q = check_size(q, arg, what="the number of deflated blocks")
    if q > d:
        msg = (
            f"`{arg}` must be at most `d` (the block Krylov space has d blocks); "
            f"got deflated_blocks={q} with d={d}."
        )
        raise ValueError(msg)
    return q


# --------------------------------------------------------------------- checks


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
        # `jax.random.rademacher`'s draw (`bernoulli`, uniform numbers below 0.5),
        # written out with its numbers typed: in float32 (float64 for a float64
        # operator) where it takes the default float type, float64 in 64-bit mode,
        # which TPUs do not have, in a float32 program.
        uniform = real if jnp.finfo(real).bits >= 32 else jnp.float32
        zero, one, half = (jnp.asarray(x, uniform) for x in (0.0, 1.0, 0.5))
        heads = jr.uniform(key, (m, n), uniform, minval=zero, maxval=one) < half
        return (2 * heads.astype(real) - 1).astype(real)
    z = jr.normal(key, (m, n), real)
    if sampler == "sphere":
        norms = jnp.linalg.norm(z, axis=1, keepdims=True)
        z = z * (jnp.sqrt(jnp.asarray(n, real)) / norms)
    return z


# ------------------------------------------ derivatives with held vectors


def _elementwise_derivative(fn: Callable, lam: Array) -> Array:
    """$f'$ at each eigenvalue, for an `f` applied elementwise."""
    return jax.jvp(fn, (lam,), (jnp.ones_like(lam),))[1]


def _held(operator: AbstractOperator) -> AbstractOperator:
    """The operator with its arrays held fixed (no derivative through it)."""
    return jtu.tree_map(
        lambda x: lax.stop_gradient(x) if eqx.is_inexact_array(x) else x, operator
    )


def _held_products_impl(operator, W, t_operator):
    r"""$\dot A\, w$ for every row $w$ of `W`, `(..., n)` (a batch of probes
    folded in front by `vmap`)."""

    def rows(W):
        tangents = operator_tangent(operator, t_operator, W)
        assert tangents is not None  # bound only with a tangent
        return tangents.astype(W.dtype)

    for _ in range(W.ndim - 2):
        rows = jax.vmap(rows)
    return rows(W)


def _held_products_transpose(inputs, ct):
    operator, W, t_operator = inputs
    ct_operator = nones(t_operator)
    if is_tangent(t_operator):
        n = W.shape[-1]
        ct = cotangent_like(ct, W)
        grad = operator.param_vjp(W.reshape(-1, n), ct.reshape(-1, n))
        ct_operator = like_tangent(t_operator, grad)
    return nones(operator), None, ct_operator


def _held_products_batch(bind, args, axes):
    """A batch of rows for one operator: one primitive over the whole batch (one
    VJP of the operator with all of its rows in reverse mode)."""
    operator, W, t_operator = args
    op_axes, W_axis, t_op_axes = axes
    if any(a is not None for a in jtu.tree_leaves((op_axes, t_op_axes))):
        return None
    (W,) = fold_batch((W,), (W_axis,), (0,))
    return bind(operator, W, t_operator), 0


_held_products_tangent = tangent_primitive(
    "trace_held_products_tangent",
    _held_products_impl,
    _held_products_transpose,
    1,
    _held_products_batch,
)


@eqx.filter_custom_jvp
def _held_products(operator: AbstractOperator, W: Array) -> Array:
    r"""Zeros like `W` whose derivative in the operator is $\dot A\, w$ for each
    row $w$ of `W` (held fixed).

    Added to products $A w$ computed without derivatives, it gives them theirs.
    Paired with $u \approx f'(A)\, w$, as $u^\top (\cdot)$, and added to a
    quadrature $q \approx w^\top f(A)\, w$ whose run is not differentiated, it
    gives $q$ the derivative of $w^\top f(A)\, w$ for symmetric $\dot A$,
    $\operatorname{tr}(f'(A)\, w w^\top \dot A) = u^\top \dot A\, w$ (the
    Daleckii--Krein formula). In reverse mode its transpose is one VJP of the
    operator's products with all rows (`param_vjp`)."""
    return jnp.zeros_like(W)


@_held_products.def_jvp
def _held_products_jvp(primals, tangents):
    operator, W = primals
    t_operator = tangent_or_none(tangents[0])
    # Itself, not zeros: under a second derivative its own derivative is needed.
    out = _held_products(operator, W)
    if t_operator is None:
        return out, jnp.zeros_like(out)
    return out, _held_products_tangent(operator, W, t_operator)


@eqx.filter_custom_jvp
def _first_order(U: Array, operator: AbstractOperator, W: Array) -> Array:
    r"""Zeros, one per row of `W`, whose derivative is $u^\top \dot A\, w$ for
    each row $w$ of `W` and $u$ of `U` (`_held_products`).

    Added to a quadrature $q \approx w^\top f(A)\, w$ whose run is not
    differentiated, with $u \approx f'(A)\, w$, it gives $q$ the first-order term
    of the Krylov-aware estimator's derivative. The derivatives of `U` (and `W`)
    are not taken at first order (in reverse mode nothing runs back through the
    Lanczos runs that made `U`), but they are at higher orders: the derivative
    of $u^\top \dot A\, w$ has $\dot u^\top \dot A\, w + u^\top \ddot A\, w$,
    whose mean over the probes is the second derivative of the trace."""
    # Like the rows of `W`, on its mesh (fresh zeros would be on none).
    return jnp.zeros_like(W[..., 0])


@_first_order.def_jvp
def _first_order_jvp(primals, tangents):
    U, operator, W = primals
    t_operator = tangent_or_none(tangents[1])
    out = _first_order(U, operator, W)
    if t_operator is None:
        return out, jnp.zeros_like(out)
    products = _held_products_tangent(operator, W, t_operator)
    return out, jnp.sum(U * products, axis=-1).astype(out.dtype)
