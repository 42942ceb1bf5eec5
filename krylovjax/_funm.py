r"""`funm_action`: matrix functions through a Krylov basis, with error control.

It is a thin layer over the decompositions of `_arnoldi.py` and `_lanczos.py`,
whose derivative rules carry the cost of differentiating through the $d$
matrix-vector products. What this module adds acts on the small $d \times d$
matrix only:

- $f(A)\,b \approx \|b\|\, Q\, f(H)\, e_0$, with $A Q = Q H + r e_{d-1}^\top$ from
  Arnoldi (`f` a matrix function of $H$, differentiated by JAX), or
  $f(A)\,b \approx \|b\|\, Q\, V f(\Lambda) V^\top e_0$ from Lanczos, with
  $T = V \Lambda V^\top$ the eigendecomposition of the real symmetric tridiagonal
  $T$ (`f` a scalar function applied to the eigenvalues);
- with `tol=`, a stop test (`Tolerance`) that ends the decomposition once an
  a-posteriori estimate of the error from successive approximations meets the
  tolerance (see "Stopping early" in `_orthogonal.py` for why the derivatives
  stay exact).

`_trace.py` builds the stochastic trace $\operatorname{tr} f(A)$ on the same
quadrature (`_funm_e0`).

The derivative of $c = f(T)\, e_0$ is written by hand (`_funm_e0`), because JAX's
rule for `eigh` divides by $\lambda_i - \lambda_j$ and gives `nan` at repeated
eigenvalues, which a breakdown of Lanczos produces (the block of $T$ after the
breakdown is zero). With $F_{ij} = f[\lambda_i, \lambda_j]$ the first divided
differences, the Daleckii--Krein formula

$$\dot c = V \big(F \circ (V^\top \dot T V)\big) V^\top e_0
  + V \operatorname{diag}(\partial_\theta f(\lambda))\, V^\top e_0$$

holds for repeated eigenvalues as for distinct ones; the second term is the
derivative with respect to arrays $\theta$ that `f` closes over (a diffusion time,
say). It is a JVP rule, linear in the tangents, so JAX transposes it for reverse
mode. Each $F_{ij}$ is the quotient $(f_i - f_j) / (\lambda_i - \lambda_j)$ or the
mean of $f'_i$ and $f'_j$, whichever has the smaller estimated error
(`_divided_differences`).

**What $e_0$ does not see.** When the Krylov space is invariant after $k < d$
vectors (a breakdown), the rest of the small matrix is invisible from $e_0$, but
`f` is evaluated there too, and an `f` that is infinite there turns
$0 \cdot \infty$ into `nan`. Lanczos: eigenpairs whose
first eigenvector entry is below the machine epsilon are evaluated at the visible
Ritz value of largest weight instead of their own eigenvalue, a point where `f` is
finite whenever the result is. Arnoldi: the block after the first zero subdiagonal
entry of $H$ is replaced by $c I$, decoupled from the visible block $H_{11}$, which
leaves $f(H) e_0 = (f(H_{11}) e_0, 0)$ unchanged; $c$ is the first of
$\|H_{11}\|_F$, $H_{00}$ and $-\|H_{11}\|_F$ at which $f(cI)$ is finite
(`_hidden_point`, which says why these three).

**Half precision.** For bfloat16 and float16 inputs the small matrix is worked in
float32 (`eigh` and `expm` have no half-precision kernels, and an eigenvalue near
10 rounded to bfloat16 is off by up to 1/32, $e^{\lambda}$ by 3 percent), and a
real result is rounded to the input's dtype at the end.
"""

from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.core import ShapedArray
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Inexact, Int, Real

from ._arnoldi import arnoldi_in_working_dtype, arnoldi_with_stop
from ._checks import (
    as_array,
    check_choice,
    standard_result_type,
)
from ._expansion import chebyshev_action
from ._lanczos import lanczos_in_working_dtype, lanczos_with_stop
from ._operator import closure_convert
from ._orthogonal import (
    ADJOINTS,
    AbstractStop,
    Adjoint,
    check_problem,
    conj,
    last_step,
    safe_norm,
    working_dtype,
)
from ._sharding import auto_types, explicit_mesh, gathered, is_explicit, typed_like
from ._typing import OperatorLike, StaticInt

METHODS = ("lanczos", "arnoldi", "chebyshev")


class FunmInfo(eqx.Module):
    r"""What [`krylovjax.funm_action`][] with `tol=` reports with its result.

    **Fields:**

    - `error`: the estimated norm of the error, $\|y - f(A)\, b\|$, a real
        scalar; `inf` where the last differences did not yet decrease (no
        estimate), 0 after a breakdown (the result is then exact).
    - `depth`: the number of Krylov vectors used, an int32 scalar (`1 <= depth
        <= d`); as many products with `A` were made.
    - `converged`: whether `error <= tol * ||y||`, a bool scalar: `False` when
        the maximum depth `d` was reached first.

    None of them is differentiated (their derivatives are zero).

    !!! Example

        ```python
        >>> import jax.numpy as jnp
        >>> import krylovjax
        >>> A = jnp.diag(jnp.arange(1.0, 6.0))
        >>> b = jnp.ones(5)
        >>> y, info = krylovjax.funm_action(
        ...     jnp.log, A, b, 5, method="lanczos", tol=1e-6
        ... )
        >>> int(info.depth), bool(info.converged)  # 5 eigenvalues: exact at 5
        (5, True)
        >>> bool(jnp.allclose(y, jnp.log(jnp.arange(1.0, 6.0)), atol=1e-5))
        True

        ```
    """

    error: Real[Array, ""]
    depth: Int[Array, ""]
    converged: Bool[Array, ""]


def funm_action(
    f: Callable[[Array], Array],
    A: OperatorLike,
    b: Inexact[Array | np.ndarray, " n"] | Inexact[Array | np.ndarray, "n k"],
    d: StaticInt,
    *,
    method: Literal["lanczos", "arnoldi", "chebyshev"],
    reorthogonalize: bool = True,
    adjoint: Adjoint = "custom_jvp",
    interval: tuple[Any, Any] | None = None,
    tol: float | None = None,
) -> Inexact[Array, " n *k"] | tuple[Inexact[Array, " n"], FunmInfo]:
    r"""The action $f(A)\, b$ of a matrix function, from $d$ Krylov vectors.

    Builds an orthonormal basis $Q$ of the Krylov space
    $\operatorname{span}\{b, A b, \dots, A^{d-1} b\}$ and the projection of $A$ onto
    it, and returns

    $$f(A)\, b \approx \|b\|\, Q\, f(Q^* A Q)\, e_0 .$$

    `method` says which decomposition is used, and so what `f` is:

    - `method="lanczos"`, for symmetric or Hermitian $A$: [`krylovjax.lanczos`][]
        gives the real tridiagonal $T = Q^* A Q$, and `f` is a **scalar function**,
        applied elementwise to the eigenvalues of $T$ (`jnp.exp`,
        `lambda x: x ** -0.5`, `jnp.log`): $f(T) = V f(\Lambda) V^\top$ by `eigh`.
    - `method="arnoldi"`, for any $A$: [`krylovjax.arnoldi`][] gives the upper
        Hessenberg $H = Q^* A Q$, and `f` is a **matrix function**, called on the
        `(d, d)` array $H$ (`jax.scipy.linalg.expm`, or a polynomial or rational
        function of $H$).

    - `method="chebyshev"`, for symmetric or Hermitian $A$ with spectrum in
        `interval=(lo, hi)`: `f` is a **scalar function**, replaced by its
        Chebyshev interpolant of degree $d - 1$ on the interval (computed in JAX
        from `f` at the $d$ Chebyshev nodes), and
        $f(A)\, b \approx \sum_k c_k T_k(A)\, b$ with the vectors from
        `krylov(A, b, d, basis=Chebyshev(lo, hi))`: no inner products and no
        small eigenproblem, so nothing but products with $A$ per step (no global
        reduction on many devices). Its error is uniform on the interval and falls
        like $\rho^{-d}$ for `f` analytic in an ellipse of parameter $\rho$ around
        it; Lanczos adapts to the spectrum and to `b`, and is never worse than twice
        the best polynomial of its degree (see the docs' page on polynomial bases
        for both at equal products).

    The two kinds of `f` are not interchangeable, and `method` has no default so that
    every call says which it passes: `jnp.exp` with `method="arnoldi"` would
    exponentiate the entries of $H$, not $H$. A scalar function of a non-Hermitian
    $H$ would need its eigenvectors or Schur form, which JAX computes on the CPU
    only, so the Arnoldi path takes a matrix function instead. Both paths run on any
    backend.

    For Hermitian $A$ with spectrum in $[\lambda_{\min}, \lambda_{\max}]$ the error is
    at most $2\|b\| \min_{p} \max_{\lambda} |f(\lambda) - p(\lambda)|$ over
    polynomials $p$ of degree $d - 1$ (in exact arithmetic, which
    re-orthogonalisation keeps close to): it falls geometrically in $d$ for $f$
    analytic around the spectrum, the faster the further $f$'s singularities are
    from $[\lambda_{\min}, \lambda_{\max}]$ relative to its width. For $e^{-tA}$,
    $A$ positive semidefinite, it falls superlinearly once
    $d \gtrsim \sqrt{t \lambda_{\max}}$; for $A^{-1/2}$ and $\log A$ like
    $((\sqrt\kappa - 1) / (\sqrt\kappa + 1))^d$ with $\kappa$ the condition number,
    as for conjugate gradients. The result is exact when the Krylov space is
    invariant (a breakdown after $k < d$ vectors).

    **Arguments:**

    - `f`: the function, as the table above says. With `method="lanczos"` it is
        called once on the `(d,)` real eigenvalues of $T$ and must return `(d,)`
        values, real or complex, computed elementwise (its derivative is taken
        elementwise); a matrix function raises a `ValueError` here, naming `f`.
        With `method="arnoldi"` it is called on the `(d, d)` matrix $H$ and must
        return a `(d, d)` array; it is also called, batched by `jax.vmap` and not
        differentiated, on the three matrices $c I$ of the breakdown rule below.
        It may close over arrays (a time step, a shift): gradients reach them.
        For bfloat16 and float16 inputs it is called on float32 arrays (JAX has no
        half-precision `eigh` or `expm`).
    - `A`: the operator, any kind [`krylovjax.krylov`][] accepts: a square array, a
        `jax.experimental.sparse.BCOO` matrix, or a linear callable. With
        `method="lanczos"` it must be symmetric (real) or Hermitian (complex); this
        is not checked.
    - `b`: the vector, shape `(n,)`, floating point or complex. A zero `b` gives
        zeros (`f` is then evaluated at the $d \times d$ identity rather than at
        the zero matrix, where a logarithm is infinite); the approximation is not
        differentiable in `b` there, being homogeneous but not linear, and its
        gradient in `b` is whatever the decomposition's rule gives at a zero
        vector.
        A block `b` of shape `(n, k)` gives $f(A)\, b$ of shape `(n, k)`
        (below, **Blocks**).
    - `d`: the number of Krylov vectors, a static Python int, `1 <= d <= n`;
        for a block, the number of blocks of $k$ vectors, `d * k <= n`.
    - `method`: `"lanczos"` or `"arnoldi"`, see above. Required.
    - `reorthogonalize`: whether the decomposition re-orthogonalises each new vector
        against all previous ones (default `True`). Without it, Lanczos loses
        orthogonality once Ritz values converge and the result stalls at a
        level that depends on $A$; see the docs' page on bases.
    - `interval`: with `method="chebyshev"` (and only then, where it is required),
        the pair `(lo, hi)` of real scalars that holds the spectrum of `A`
        ([`krylovjax.spectrum_interval`][] estimates one); gradients reach it.
    - `adjoint`: the decomposition's derivative rule, passed on to it: its default
        `"custom_jvp"` (forward and reverse mode), or `"autodiff"` (JAX's own rules
        through the loop, to compare against).
    - `tol`: a relative tolerance, a Python float in $(0, 1)$, for
        `method="lanczos"` and `"arnoldi"`. `d` is then the maximum depth, and the
        depth used is the first at which the estimated error is at most
        `tol * ||y||` (see **Error control** below). The return value changes to
        a pair `(y, info)`, with `info` a [`krylovjax.FunmInfo`][]. Default
        `None`: exactly `d` vectors, and `y` alone.

    **Error control.** With $c_k = f(S_k)\, e_0$ the coefficients from $k$
    vectors ($S_k$ the leading block of $T$ or $H$), the approximations
    $y_k = \|b\| Q_k c_k$ differ by $\|y_k - y_j\| = \|b\|\, \|c_k - c_j\|$
    (the basis is orthonormal). The test compares the approximations at
    successive check steps (every step up to 16, then every $k / 16$ steps, so
    that the small $d \times d$ function evaluations stay few), and estimates
    the error of the newer as the tail of a geometric series: the last
    difference times $\rho / (1 - \rho)$, with $\rho$ the larger of the last two
    ratios of successive differences. This successive-difference estimate needs
    nothing but the small matrix, works for any `f` and both methods, and is
    exact for linear convergence ($A^{-1/2}$, $\log A$) and an overestimate for
    superlinear convergence ($e^{-tA}$), where the residual-based estimates of
    Saad and of Hochbruck and Lubich are tied to the exponential. It needs at least
    three checks, so the depth used is at least 3 unless the space is invariant
    before (a breakdown, where the result is exact and the error 0). It is an
    estimate, not a bound: a convergence that stalls and then resumes can
    fool it.

    The depth is chosen inside one compiled program: the buffers keep the
    static size `d`, the steps after the chosen depth are skipped (a `lax.cond`;
    under `jax.vmap` a batched `cond` computes both branches, so every member of
    the batch costs `d` products, each keeping its own depth and result), and
    the derivatives (both modes) are
    exact for the approximation returned: that of a fixed depth equal to the
    depth used. The reverse pass still loops over the `d` slots of the buffer
    (the slots after the depth used are zero vectors), so choose `d` near the
    depth you expect rather than far above it.

    **Returns:**

    $f(A)\, b$ approximated from $d$ vectors, shape `(n,)`, in the dtype that the
    basis and $f$'s values promote to; for bfloat16 and float16 inputs the small
    matrix is worked in float32 and a real result rounded to the input's dtype at
    the end (a complex one is complex64). Differentiable (forward and reverse mode) in
    the arrays `A` holds, in `b`, and in the arrays `f` closes over. With
    `method="lanczos"` the first derivatives of the $d \times d$ part have a rule
    of their own that stays finite and exact at repeated eigenvalues of $T$ (after a
    breakdown), where JAX's rule for `eigh` gives `nan`. Second derivatives
    (`jax.hessian`, reverse over reverse, with or without `tol`) differentiate
    that rule, through a rule for `eigh` that is finite at exactly equal
    eigenvalues (the zero block that a breakdown or an early end leaves in $T$);
    close but distinct eigenvalues of $T$ make them large.

    **Blocks.** For `b` of shape `(n, k)`, `"lanczos"` and `"arnoldi"` use
    [`krylovjax.block_lanczos`][] and [`krylovjax.block_arnoldi`][]: $d$ products
    of $A$ with $k$ vectors build one basis of the block Krylov space
    $\operatorname{span}\{b, A b, \dots, A^{d-1} b\}$ (dimension $d k$), and
    $f(A)\, b \approx Q f(S) E_0 R_0$ with $S$ the `(d k, d k)` block tridiagonal
    or block Hessenberg matrix and $b = Q_0 R_0$; `f` is the same kind of function
    as for a vector, called on the $d k$ eigenvalues or on the `(d k, d k)`
    matrix. Each column is approximated from the space of all of them, which
    holds its own Krylov space of depth $d$: at equal products typically more
    accurate than $k$ single-vector runs, for an `eigh` (or `f`) of size $d k$
    (and, on a CPU, more time: see the docs' page on bases). Columns that
    deflate (a repeated, zero or invariant column) give finite values and
    derivatives, and a zero block gives zeros. `adjoint` is passed on to the
    block methods (whose default rule keeps memory linear in `d` in reverse
    mode too), and they take no `tol` (`jax.vmap` over the columns does).
    `"chebyshev"` computes each column's action, batched.

    **Breakdown.** When the Krylov space is invariant after $k < d$ vectors, the
    rest of the small matrix is invisible from $e_0$ (zero after the breakdown), yet
    `f` is evaluated there too, and an `f` that is infinite there (`1 / x`,
    `jnp.log`, `jnp.linalg.inv` at 0) would turn the result into `nan`. So what
    $e_0$ does not see is replaced, which leaves the result exact:

    - Lanczos: each eigenvalue of $T$ whose eigenvector has a first entry below
        the machine epsilon is evaluated at the visible Ritz value of largest
        weight, where `f` is evaluated anyway. (The Rayleigh quotient $T_{00}$
        would not do: it is 0 for a vertex of a bipartite graph.)
    - Arnoldi: the block of $H$ after its first zero subdiagonal entry is replaced
        by $c I$, decoupled from the visible block $H_{11}$, which leaves
        $f(H) e_0 = (f(H_{11}) e_0, 0)$ unchanged. $c$ is the first of
        $\|H_{11}\|_F$, $H_{00}$ and $-\|H_{11}\|_F$ at which $f(c I)$ is finite.
        The first is real, positive and at least the spectral radius, so `inv`,
        `log` and `sqrtm` are finite there (also for a bipartite graph, whose $H$
        has a zero diagonal, and for complex eigenvalues); the second is in the
        numerical range, where `expm` does not overflow when the first does
        (large negative eigenvalues); the third is the last resort. An
        eigenvalue of $H_{11}$ would always do, but takes `eig`, which JAX runs on
        the CPU only.

    At a breakdown the derivatives are those of the invariant space found: exact
    for perturbations that keep it invariant (every nearby `b` when $A$ has at most
    $k$ distinct eigenvalues, edge weights that keep a graph's components apart).
    A perturbation that would enlarge it (`b` an eigenvector, moved off it) is not
    seen: with $d < n$ the approximation is not differentiable there, and with
    $d = n$, where it equals $f(A) b$ for every `b`, the derivative returned in
    that direction is not $f(A)$'s. For a quadratic form $b^H f(A)\, b$ (a term of
    `trace_funm`) the first derivatives in `A` are exact at a breakdown (they
    couple only eigenvalues inside the invariant space), but the second ones are
    not: they miss the couplings to the eigenvalues outside it (for
    $A = I + U U^\top$, $U$ of rank 2, at $d = n = 10$: $-80.6$ against $-92.6$
    along a random symmetric direction). A breakdown is also missed where $\|A q_k\|$
    is far below $\|A\|$ (an ill-conditioned $A$ and `b` near an eigenvector of a
    small eigenvalue): the next vector is then rounding noise, and derivatives
    through it are as large as $1 / \beta_k$. The values stay accurate in both
    cases.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp, jax.scipy.linalg
        >>> import krylovjax
        >>> A = jnp.array([[2.0, 1.0, 0.0], [1.0, 2.0, 1.0], [0.0, 1.0, 2.0]])
        >>> b = jnp.array([1.0, 0.0, 0.0])
        >>> @jax.jit
        ... def exp_action(A, b):
        ...     y = krylovjax.funm_action(jnp.exp, A, b, 3, method="lanczos")
        ...     expm = jax.scipy.linalg.expm
        ...     z = krylovjax.funm_action(expm, A, b, 3, method="arnoldi")
        ...     return y, z, expm(A) @ b
        >>> y, z, exact = exp_action(A, b)
        >>> bool(jnp.allclose(y, exact, rtol=1e-5))
        True
        >>> bool(jnp.allclose(z, y, rtol=1e-5))
        True
        >>> # The depth chosen by a tolerance, at most 3:
        >>> y, info = krylovjax.funm_action(
        ...     jnp.exp, A, b, 3, method="lanczos", tol=1e-4
        ... )
        >>> int(info.depth), bool(info.converged)
        (3, True)

        ```
    """
    fn_name = "funm_action"
    _check_callable(f, f"{fn_name}(f=...)")
    check_choice(method, METHODS, f"{fn_name}(method=...)")
    b = as_array(b, f"{fn_name}(b=...)")
    if b.ndim not in (1, 2):
        msg = (
            f"`{fn_name}(b=...)` must be a vector of shape (n,) or a block of shape "
            f"(n, k); got shape {b.shape}."
        )
        raise ValueError(msg)
    if (method == "chebyshev") != (interval is not None):
        msg = (
            f"`{fn_name}(interval=...)` is required with `method='chebyshev'` and "
            f"taken by no other method; got method={method!r}, interval={interval!r}."
        )
        raise ValueError(msg)
    if tol is not None:
        tol = _check_tol(tol, f"{fn_name}(tol=...)")
        if method == "chebyshev":
            msg = (
                f"`{fn_name}(tol=...)` is taken by `method='lanczos'` and "
                f"`method='arnoldi'`, whose error it estimates; got "
                f"method={method!r}."
            )
            raise ValueError(msg)
    if method == "chebyshev":
        check_choice(adjoint, ("custom_jvp", "autodiff"), f"{fn_name}(adjoint=...)")
        if b.ndim == 2:
            # No inner products: the columns' runs batch into products with blocks.
            y = jax.vmap(
                lambda c: chebyshev_action(f, A, c, d, interval, adjoint),
                in_axes=1,
                out_axes=1,
            )(b)
        else:
            y = chebyshev_action(f, A, b, d, interval, adjoint)
        return y.astype(_result_dtype(b.dtype, y.dtype))
    if b.ndim == 2:
        if tol is not None:
            msg = (
                f"`{fn_name}(tol=...)` takes one vector `b`; got a block of shape "
                f"{b.shape} (`jax.vmap` over its columns gives each its own depth)."
            )
            raise ValueError(msg)
        check_choice(adjoint, ADJOINTS, f"{fn_name}(adjoint=...)")
        # Imported here: `_block` builds on this module's small-matrix functions.
        from ._block import block_action

        options = {"reorthogonalize": reorthogonalize, "adjoint": adjoint}
        return block_action(f, A, b, d, method=method, **options)
    # The decomposition checks its arguments again; this names `funm_action`.
    operator, b_promoted, d = check_problem(
        A, b, d, reorthogonalize, adjoint, fn_name, vector="b"
    )
    # The stop test's functions are called inside the decomposition, which runs
    # with a mesh's axes `Auto` (`_orthogonal.on_mesh`): converted for that.
    inside = auto_types(explicit_mesh(operator, b_promoted))
    arg = f"{fn_name}(f=...)"
    # For a zero `b` the small matrix is evaluated as the identity instead (its
    # result is multiplied by zero): f(0) may be infinite, log(0) say.
    options = {"reorthogonalize": reorthogonalize, "adjoint": adjoint}
    estimate = None
    if method == "lanczos":
        if tol is None:
            dec = lanczos_in_working_dtype(A, b, d, **options)
        else:
            real = _working_dtype(jnp.finfo(b_promoted.dtype).dtype)
            with inside:
                fns = tuple(
                    _scalar_function(
                        f, jnp.zeros((int(n),), real), arg, _MATRIX_FUNCTION_HINT
                    )
                    for n in block_sizes(d)
                )
                small = (jnp.zeros((d,), real), jnp.zeros((d - 1,), real))
                stop = tolerance(_LanczosCoefficients(fns), small, d, tol)
            dec, estimate = lanczos_with_stop(A, b, d, stop, **options)
        work = _working_dtype(dec.diagonal.dtype)
        nonzero = dec.norm != 0
        diagonal = jnp.where(nonzero, dec.diagonal, jnp.ones_like(dec.diagonal))
        off_diagonal = jnp.where(
            nonzero, dec.off_diagonal, jnp.zeros_like(dec.off_diagonal)
        )
        diagonal, off_diagonal = diagonal.astype(work), off_diagonal.astype(work)
        fn = _scalar_function(f, jnp.zeros_like(diagonal), arg, _MATRIX_FUNCTION_HINT)
        coefficients = _funm_e0(fn, diagonal, off_diagonal)
        betas = dec.off_diagonal
    else:
        work = _working_dtype(b_promoted.dtype)
        square = jax.ShapeDtypeStruct((d, d), work)
        what = f"the ({d}, {d}) matrix H to a ({d}, {d}) array"
        _check_output(jax.eval_shape(f, square), (d, d), arg, what)
        if tol is None:
            dec = arnoldi_in_working_dtype(A, b, d, **options)
        else:
            with inside:
                fns = tuple(
                    closure_convert(f, jnp.zeros((int(n), int(n)), work))
                    for n in block_sizes(d)
                )
                H0 = jnp.zeros((d, d), work)
                stop = tolerance(_ArnoldiCoefficients(fns), H0, d, tol)
            dec, estimate = arnoldi_with_stop(A, b, d, stop, **options)
        H = jnp.where(
            dec.norm != 0, dec.hessenberg.astype(work), jnp.eye(d, dtype=work)
        )
        coefficients = _matrix_function_e0(f, H)
        betas = jnp.real(jnp.diagonal(dec.hessenberg, -1))
    dtype = standard_result_type(dec.basis.dtype, coefficients.dtype)
    scaled = coefficients.astype(dtype) * dec.norm.astype(dtype)
    y = dec.basis.astype(dtype) @ scaled
    y = y.astype(_result_dtype(b_promoted.dtype, coefficients.dtype))
    if estimate is None or tol is None:
        return y
    # A zero after the last (`betas` is empty at d = 1).
    betas = lax.stop_gradient(jnp.pad(betas, (0, 1)))
    size = lax.stop_gradient(_norm(coefficients))
    info = FunmInfo(
        error=lax.stop_gradient(estimate * dec.norm),
        depth=(last_step(betas) + 1).astype(jnp.int32),
        converged=lax.stop_gradient(estimate <= tol * size),
    )
    return y, info


# ------------------------------------------------------------ error control


# The stop test of `funm_action(tol=...)` runs at every step up to this many, then
# every (k + 1) // CHECK_SPACING steps: the depth it picks is at most 1 /
# CHECK_SPACING above the step at which the estimate first meets `tol`, and the
# small function evaluations (d x d each) number about CHECK_SPACING * (1 +
# ln(depth / CHECK_SPACING)) rather than depth.
CHECK_SPACING = 16


def check_steps(d: int) -> np.ndarray:
    """Whether the stop test runs after step `k`, for `k < d` (the last step
    always)."""
    checks = np.zeros(d, bool)
    k = 0
    while k < d:
        checks[k] = True
        k += max(1, (k + 1) // CHECK_SPACING)
    checks[d - 1] = True
    return checks


class _State(eqx.Module):
    coefficients: Array  # c at the last check
    differences: Array  # the last two differences between checks, newest first
    count: Array  # the checks made
    estimate: Array


class Tolerance(AbstractStop):
    r"""The stop test of `funm_action(tol=...)`: an a-posteriori estimate of the
    error from successive approximations.

    With $c_j = f(S_j)\, e_0$ the coefficients from the first $j$ vectors
    ($S_j$ the leading block of $T$ or $H$), checked at steps $j_1 < j_2 <
    \dots$ (`check_steps`), the difference $\delta_i = \|c_{j_i} -
    c_{j_{i-1}}\|$ ($= \|y_{j_i} - y_{j_{i-1}}\| / \|b\|$, the basis being
    orthonormal) estimates the error of the older approximation. With
    $\rho = \max(\delta_i / \delta_{i-1}, \delta_{i-1} / \delta_{i-2})$, the
    error of the newer one is estimated as $\|b\|\, \delta_i\, \rho / (1 -
    \rho)$: the tail of a geometric series of ratio $\rho$, exact for linear
    convergence and an overestimate for the superlinear convergence of
    $e^{-tA}$ (whose ratios fall); the larger of the last two ratios guards
    against one accidentally small one. It is `inf` while $\rho \ge 1$ and
    before three checks. The test passes when the estimate is at most
    `tol` $\cdot \|y\|$."""

    coefficients: Callable[[Any], Array]
    tol: float = eqx.field(static=True)
    depth: int = eqx.field(static=True)
    out: jax.ShapeDtypeStruct = eqx.field(static=True)

    def init(self, d: int) -> _State:
        real = jnp.finfo(self.out.dtype).dtype
        return _State(
            coefficients=jnp.zeros(self.out.shape, self.out.dtype),
            differences=jnp.zeros((2,), real),
            count=jnp.zeros((), jnp.int32),
            estimate=jnp.asarray(jnp.inf, real),
        )

    def __call__(
        self, state: _State, k: Array, small: Any, broken: Array
    ) -> tuple[_State, Array]:
        checks = jnp.asarray(check_steps(self.depth))
        # The block of the first k + 1 vectors is evaluated inside the smallest
        # of `block_sizes` that holds it (its rest is zero, decoupled from it).
        sizes = block_sizes(self.depth)
        index = jnp.asarray(np.searchsorted(sizes, np.arange(1, self.depth + 1)))[k]

        def check(state: _State) -> tuple[_State, Array]:
            c = _one_at_a_time(self.coefficients, small, index)
            difference = _norm(c - state.coefficients)
            newer, older = state.differences[0], state.differences[1]
            ratio = jnp.maximum(_ratio(difference, newer), _ratio(newer, older))
            tail = difference * ratio / jnp.where(ratio < 1, 1 - ratio, 1)
            inf = jnp.asarray(jnp.inf, tail.dtype)
            estimate = jnp.where((state.count >= 2) & (ratio < 1), tail, inf)
            estimate = jnp.where(difference == 0, 0, estimate)
            new = _State(
                coefficients=c,
                differences=jnp.stack([difference, newer]),
                count=state.count + 1,
                estimate=estimate.astype(state.estimate.dtype),
            )
            return new, estimate <= self.tol * _norm(c)

        def wait(state: _State) -> tuple[_State, Array]:
            return state, jnp.asarray(False)

        # The schedule depends on `k` alone: under `vmap` the `cond` stays one.
        state, stops = lax.cond(checks[k], check, wait, state)
        estimate = jnp.where(broken, 0, state.estimate)
        return eqx.tree_at(lambda s: s.estimate, state, estimate), stops

    def estimate(self, state: _State) -> Array:
        return state.estimate


def block_sizes(d: int) -> np.ndarray:
    """The sizes at which the stop test evaluates the leading block of the small
    matrix: powers of two from 8, and `d`. A check after step `k` costs a
    function of a matrix of at most `2 (k + 1)` rows rather than `d`."""
    sizes, size = [], 8
    while size < d:
        sizes.append(size)
        size *= 2
    return np.array([*sizes, d])


def _pad(c: Array, d: int) -> Array:
    return jnp.concatenate([c, jnp.zeros((d - c.shape[0],), c.dtype)])


class _LanczosCoefficients(eqx.Module):
    """$f(T)\\, e_0$ from the diagonal and off-diagonal of $T$, evaluated on its
    leading block of size `block_sizes(d)[index]` (one closure-converted `f` per
    size); with `first`, only its first entry, $e_0^\\top f(T)\\, e_0$ (a
    quadrature, as `trace_funm` stops on)."""

    fns: tuple[Callable, ...]
    first: bool = eqx.field(static=True, default=False)

    def __call__(self, small: tuple[Array, Array], index: Array) -> Array:
        diagonal, off_diagonal = small
        d = diagonal.shape[0]

        def branch(fn: Callable, size: int) -> Callable:
            def run(diagonal: Array, off_diagonal: Array) -> Array:
                c = _funm_e0(fn, diagonal[:size], off_diagonal[: size - 1])
                return _pad(c, d)

            return run

        sizes = block_sizes(d)
        branches = [branch(fn, int(n)) for fn, n in zip(self.fns, sizes, strict=True)]
        c = lax.switch(index, branches, diagonal, off_diagonal)
        return c[:1] if self.first else c


class _ArnoldiCoefficients(eqx.Module):
    """$f(H)\\, e_0$ from $H$, on its leading block as for Lanczos."""

    fns: tuple[Callable, ...]

    def __call__(self, H: Array, index: Array) -> Array:
        d = H.shape[0]

        def branch(f: Callable, size: int) -> Callable:
            def run(H: Array) -> Array:
                return _pad(_matrix_function_e0(f, H[:size, :size]), d)

            return run

        sizes = block_sizes(d)
        branches = [branch(f, int(n)) for f, n in zip(self.fns, sizes, strict=True)]
        return lax.switch(index, branches, H)


def tolerance(coefficients: Callable, small: Any, d: int, tol: float) -> Tolerance:
    """The stop test of `tol` for what `coefficients` computes from `small`, the
    small matrix of a decomposition of depth `d`."""
    out = jax.eval_shape(coefficients, small, jnp.zeros((), jnp.int32))
    return Tolerance(coefficients, tol, d, jax.ShapeDtypeStruct(out.shape, out.dtype))


def _one_at_a_time(fn: Callable, small: Any, index: Array) -> Array:
    """`fn(small)`, and under `jax.vmap` one member of the batch after another
    (`jax.custom_batching.sequential_vmap`): jaxlib's batched `eigh` on CPU waits
    on its own thread pool, where two at once can wait on each other forever (see
    `_trace.py`). No derivatives pass through (the test has none)."""
    arrays, rest = eqx.partition(fn, eqx.is_array)
    arrays = lax.stop_gradient(arrays)

    @jax.custom_batching.sequential_vmap
    def call(arrays: Any, small: Any, index: Array) -> Array:
        return eqx.combine(arrays, rest)(small, index)

    return call(arrays, lax.stop_gradient(small), index)


def _norm(x: Array) -> Array:
    # Scaled (`safe_norm`): the plain sum of squares of coefficients above 1e19
    # overflowed in float32 (`exp` of eigenvalues near 45), and an infinite norm
    # met every tolerance at the first check.
    return safe_norm(x)


def _ratio(x: Array, y: Array) -> Array:
    """x / y, with 0 / 0 = 0 and x / 0 = inf otherwise."""
    safe = jnp.where(y == 0, 1, y)
    # In x's dtype: weakly typed 0 and inf would make a float64 value in 64-bit
    # mode (which TPUs do not have) in a float32 program.
    zero, inf = jnp.zeros((), x.dtype), jnp.asarray(jnp.inf, x.dtype)
    return jnp.where(y == 0, jnp.where(x == 0, zero, inf), x / safe)


def _check_tol(tol: Any, arg: str) -> float:
    if isinstance(tol, bool) or not isinstance(tol, int | float | np.floating):
        msg = (
            f"`{arg}` must be a positive Python float, the relative tolerance of the "
            f"result; got {tol!r} of type {type(tol).__name__}."
        )
        raise TypeError(msg)
    if not 0 < tol < 1:
        msg = f"`{arg}` must satisfy 0 < tol < 1; got {tol!r}."
        raise ValueError(msg)
    return float(tol)


# ------------------------------------------------------------- the small matrix


@eqx.filter_custom_jvp
def _funm_e0(fn: Callable, diagonal: Array, off_diagonal: Array) -> Array:
    r"""$f(T)\, e_0$ for the real symmetric tridiagonal $T$, by `eigh`."""
    lam, V, weights = _eigh(diagonal, off_diagonal)
    values = fn(lam)
    dtype = values.dtype
    return V.astype(dtype) @ (values * weights.astype(dtype))


@_funm_e0.def_jvp
def _funm_e0_jvp(primals, tangents):
    fn, diagonal, off_diagonal = primals
    t_fn, t_diagonal, t_off_diagonal = tangents
    lam, V, weights = _eigh(diagonal, off_diagonal)
    values, derivatives = jax.jvp(fn, (lam,), (jnp.ones_like(lam),))
    dtype = values.dtype
    Vc, wc = V.astype(dtype), weights.astype(dtype)
    out = Vc @ (values * wc)

    terms = jnp.zeros_like(values)
    if t_diagonal is not None or t_off_diagonal is not None:
        zero_diag = jnp.zeros_like(diagonal)
        zero_off = jnp.zeros_like(off_diagonal)
        dT = _tridiagonal(
            zero_diag if t_diagonal is None else t_diagonal,
            zero_off if t_off_diagonal is None else t_off_diagonal,
        )
        E = (V.T @ dT @ V).astype(dtype)
        F = _divided_differences(lam, values, derivatives)
        terms = (F * E) @ wc
    dvalues = function_tangent(fn, t_fn, lam)
    if dvalues is not None:
        terms = terms + dvalues.astype(dtype) * wc
    return out, Vc @ terms


def function_tangent(fn: Callable, t_fn: Any, lam: Array) -> Array | None:
    """The tangent of `fn(lam)` from the tangents of the leaves `fn` holds (what it
    closes over), or `None` when none has one. The leaves are chosen by their
    tangents, not by type: a closed-over Python float that `grad` traces arrives
    as a scalar that is not an array, with a tangent."""
    leaves, treedef = jtu.tree_flatten(fn)
    t_leaves = treedef.flatten_up_to(t_fn)
    wanted = {
        i: jnp.asarray(p)
        for i, (p, t) in enumerate(zip(leaves, t_leaves, strict=True))
        if t is not None
    }
    if not wanted:
        return None

    def fn_of(diff):
        new = [diff.get(i, leaf) for i, leaf in enumerate(leaves)]
        return jtu.tree_unflatten(treedef, new)(lam)

    t_wanted = {i: jnp.asarray(t_leaves[i], p.dtype) for i, p in wanted.items()}
    _, dvalues = jax.jvp(fn_of, (wanted,), (t_wanted,))
    return dvalues


def eigh_one_at_a_time(T: Array) -> tuple[Array, Array]:
    """`jnp.linalg.eigh(T)` of a small Hermitian matrix, and under `jax.vmap` one
    matrix of the batch after another (a loop, as `sequential_vmap` does, over
    the batch gathered from the devices).

    jaxlib's batched `eigh` on CPU splits its batch over the thread pool that runs
    it and waits there for the parts: two batched `eigh`s that XLA runs at once
    can wait on each other forever (a `vmap` over 1000 keys of the gradients of
    a deflated trace estimate with its sketch held fixed did). One matrix at a
    time runs inline.

    It is a primitive (`_eigh_p`) with a batching rule (the loop), a lowering
    (`jnp.linalg.eigh`) and a JVP rule (JAX's rule for `eigh`, written out with
    the primitive for the primal): derivatives of every order, in both modes, and
    inside loops. (A `jax.custom_batching.custom_vmap` under a `jax.custom_jvp`
    did the same to first order, but in a `lax.scan` JAX's partial evaluation
    inlines a `custom_jvp`'s function, and second derivatives then reached the
    `custom_vmap`, which cannot be linearised: `jax.hessian` of `trace_funm`
    failed.)"""
    lam, V = _eigh_p.bind(T)
    return lam, V


def _eigh_abstract(T):
    lam, V = jax.eval_shape(jnp.linalg.eigh, jax.ShapeDtypeStruct(T.shape, T.dtype))
    # Placed like `T`: its sharding, less its last axis for the eigenvalues.
    sharding = T.sharding
    spec = (*sharding.spec, *[None] * (T.ndim - len(sharding.spec)))
    return (
        ShapedArray(lam.shape, lam.dtype, sharding=sharding.update(spec=P(*spec[:-1]))),
        ShapedArray(V.shape, V.dtype, sharding=sharding),
    )


def _eigh_batched(args, dims):
    """A loop over the batch (`lax.map`), gathered first where it is split over
    an explicit mesh (keys split over devices): a loop cannot run over a split
    axis. The outputs come back split as the batch was."""
    (T,), (dim,) = args, dims
    T = jnp.moveaxis(T, dim, 0)
    lam, V = lax.map(eigh_one_at_a_time, gathered(T))
    if is_explicit(T):
        sharding = jax.typeof(T).sharding
        batch = sharding.spec[0] if len(sharding.spec) else None
        lam = jax.sharding.reshard(lam, sharding.update(spec=P(batch)))
    return (lam, typed_like(V, T)), (0, 0)


def _eigh_jvp(primals, tangents):
    (T,), (t_T,) = primals, tangents
    lam, V = eigh_one_at_a_time(T)
    t_T = ad.instantiate_zeros(t_T)
    # As `jnp.linalg.eigh`, which symmetrises its input (and so its tangent).
    t_T = (t_T + conj(t_T).T) / 2
    E = conj(V).T @ t_T.astype(V.dtype) @ V
    # 1 / (lambda_j - lambda_i) off the diagonal, and zero for equal eigenvalues
    # (the zero block a decomposition that ended early leaves in T), where the
    # eigenvectors have no derivative: finite (with a finite derivative in turn)
    # where JAX's rule has inf * 0. Unchanged elsewhere.
    gap = lam[None, :] - lam[:, None]
    equal = gap == 0
    F = jnp.where(equal, 0, 1 / jnp.where(equal, 1, gap))
    return (lam, V), (jnp.real(jnp.diagonal(E)).astype(lam.dtype), V @ (F * E))


_eigh_p = jax.extend.core.Primitive("krylovjax_eigh_one_at_a_time")
_eigh_p.multiple_results = True
_eigh_p.def_impl(lambda T: tuple(jnp.linalg.eigh(T)))
_eigh_p.def_abstract_eval(_eigh_abstract)
mlir.register_lowering(
    _eigh_p, mlir.lower_fun(lambda T: tuple(jnp.linalg.eigh(T)), multiple_results=True)
)
batching.primitive_batchers[_eigh_p] = _eigh_batched
ad.primitive_jvps[_eigh_p] = _eigh_jvp


def _eigh(diagonal: Array, off_diagonal: Array) -> tuple[Array, Array, Array]:
    r"""Eigenvalues, eigenvectors and first eigenvector entries of T, with the
    eigenvalues that $e_0$ does not see replaced by the visible one of largest
    weight: `f` is evaluated there anyway, so it is finite there whenever the
    result is. (The Rayleigh quotient $T_{00}$ is not: it is 0 on a bipartite
    graph, where $1/x$ and $\log x^2$ are infinite.)"""
    lam, V = eigh_one_at_a_time(_tridiagonal(diagonal, off_diagonal))
    weights = V[0]
    hidden = jnp.abs(weights) <= jnp.finfo(lam.dtype).eps
    seen = lam[jnp.argmax(jnp.abs(weights))]
    return jnp.where(hidden, seen, lam), V, weights


def _tridiagonal(diagonal: Array, off_diagonal: Array) -> Array:
    return jnp.diag(diagonal) + jnp.diag(off_diagonal, 1) + jnp.diag(off_diagonal, -1)


# The quotient's error estimate counts this many units of rounding in each value of
# `f` and in each eigenvalue it is evaluated at (XLA's elementwise functions are
# accurate to a few units).
ROUNDING_UNITS = 4


def _divided_differences(lam: Array, values: Array, derivatives: Array) -> Array:
    r"""$F_{ij} = f[\lambda_i, \lambda_j]$: the quotient
    $q = (f_i - f_j) / (\lambda_i - \lambda_j)$ or the mean
    $m = (f'_i + f'_j) / 2$, whichever has the smaller estimated error.

    With gap $g = |\lambda_i - \lambda_j|$, the quotient's rounding error is
    estimated as $e_q = u \epsilon\, (|f_i| + |\lambda_i f'_i| + |f_j| +
    |\lambda_j f'_j|) / g$, $u$ = `ROUNDING_UNITS`: each value computed as
    $f(\lambda (1 + \delta))(1 + \delta')$ with $|\delta|, |\delta'| \le u
    \epsilon$ (the term $\lambda f'$ is the rounding of `f`'s argument, as in
    $e^{-t\lambda}$). The error of the eigenvalues themselves, about
    $\epsilon \max|\lambda|$ each, does not enter: `eigh` returns the exact
    eigenpairs of a nearby matrix, at which the quotient is the exact divided
    difference, so it moves the quotient and the mean alike. (Charged to the
    quotient, it would take the mean where the quotient is the more accurate,
    by up to two orders of magnitude for a logarithm at eigenvalues a few percent
    apart in float32.)

    The mean is exact at $g = 0$; its error is $\frac{g^2}{12} |f'''|$ to leading
    order, which neither $f'_i - f'_j$ nor a fixed threshold on $g$ bounds where
    `f` changes shape between the two (a step, a fast oscillation: there $f'$ may
    even be equal at both ends). What is known of it is $|q - m|$, which is that
    error up to the quotient's. So the quotient is taken where $|q - m| > e_q$,
    where the mean is off by more than the quotient can be, and the mean
    otherwise, which is then within $2 e_q$ of the truth. The test is made as
    $|(f_i - f_j) - m (\lambda_i - \lambda_j)| > g\, e_q$, with no division, so a
    tiny gap cannot overflow it; an exactly repeated eigenvalue ($g = 0$, as after
    a breakdown) takes the mean, which is exact and finite there. For a smooth
    `f` of unit scale the switch falls where $g^3 \approx 200\, \epsilon$, both
    errors a few times $\epsilon^{2/3}$."""
    real = jnp.finfo(values.dtype).dtype
    signed_gap = lam[:, None] - lam[None, :]
    distinct = signed_gap != 0
    safe_gap = jnp.where(distinct, signed_gap, jnp.ones_like(signed_gap))
    safe_gap = safe_gap.astype(values.dtype)
    difference = values[:, None] - values[None, :]
    quotient = difference / safe_gap
    mean = (derivatives[:, None] + derivatives[None, :]) / 2
    size = jnp.abs(values) + (jnp.abs(lam) * jnp.abs(derivatives)).astype(real)
    unit = jnp.asarray(ROUNDING_UNITS * jnp.finfo(real).eps, real)
    error = unit * (size[:, None] + size[None, :])
    resolved = jnp.abs(difference - mean * safe_gap) > error
    return jnp.where(distinct & resolved, quotient, mean)


def _matrix_function_e0(f: Callable, H: Array) -> Array:
    r"""$f(H)\, e_0$ for Arnoldi's $H$, with what $e_0$ does not see replaced.

    From the first zero subdiagonal entry on (a breakdown), $H$ is block upper
    triangular, $\begin{pmatrix} H_{11} & H_{12} \\ 0 & H_{22} \end{pmatrix}$, and
    $f(H)\, e_0 = (f(H_{11})\, e_0, 0)$ whatever $H_{12}$ and $H_{22}$ are. They
    are replaced by $0$ and $c I$ (`_hidden_point`): after a breakdown $H_{22}$ is
    zero, where $f$ may be infinite (`inv`, `log`), and the infinity would turn
    into `nan` in the visible block too. Derivatives reach the visible block only,
    as they would have (the decomposition's tangents vanish beyond it)."""
    broken = jnp.cumsum((jnp.diagonal(H, -1) == 0).astype(jnp.int32)) > 0
    # Padded with `False`, not joined to fresh zeros (under a `vmap` over vectors
    # split over an explicit mesh, an array on no mesh does not join `broken`) nor
    # to `broken[:1]` (empty at d = 1).
    visible = ~jnp.pad(broken, (1, 0))
    block = jnp.where(visible[:, None] & visible[None, :], H, jnp.zeros_like(H))
    c = _hidden_point(f, lax.stop_gradient(block))
    hidden = jnp.where(visible, jnp.zeros_like(jnp.diagonal(H)), c)
    return f(block + jnp.diag(hidden))[:, 0]


def _hidden_point(f: Callable, block: Array) -> Array:
    r"""The $c$ of the hidden block $c I$: the first of $\rho = \|H_{11}\|_F$,
    $H_{00}$ and $-\rho$ at which $f(c I)$ is finite ($\rho$ when none is).

    The point that is always safe would be an eigenvalue of $H_{11}$, where $f$ is
    finite whenever the result is; no finite formula gives one (they are the
    roots of a polynomial of degree up to $d$), and `eig` runs on the CPU only.
    Each candidate covers what the one before misses. $\rho \ge$ the spectral
    radius is real and positive unless $H_{11} = 0$: `inv`, `log` and `sqrtm`
    (whose derivative is infinite at 0) are finite there, on a bipartite graph
    (all of $H$'s diagonal zero) and for complex eigenvalues too, and so is a
    resolvent $(zI - H)^{-1}$ unless $z = \rho$. $H_{00} = q_0^* A q_0$ lies in
    the numerical range: `expm` of a matrix with large negative eigenvalues, which
    overflows at $\rho$, is finite there, and so is a resolvent at $z = \rho$.
    $-\rho$ is the last resort. `f` is called on the three matrices $c I$ at once
    (`jax.vmap`), without derivatives."""
    d = block.shape[0]
    rho = jnp.sqrt(jnp.sum(jnp.abs(block) ** 2)).astype(block.dtype)
    candidates = jnp.stack([rho, block[0, 0], -rho])
    eye = jnp.eye(d, dtype=block.dtype)
    finite = jax.vmap(lambda c: jnp.all(jnp.isfinite(f(c * eye))))(candidates)
    return candidates[jnp.argmax(finite)]


def _working_dtype(dtype: Any) -> np.dtype:
    """The dtype the small matrix is worked in: the decompositions' own
    (`_orthogonal.working_dtype`, at least float32: `eigh`, `solve` and `expm` have
    no half-precision kernels)."""
    return working_dtype(dtype)


def _result_dtype(dtype: Any, values_dtype: Any) -> np.dtype:
    """The result's dtype: `dtype` promoted with that of `f`'s values, the working
    precision given back where it was raised from a half one (a float32 result of
    bfloat16 inputs is bfloat16; a complex one stays complex64, there being no
    complex half dtype)."""
    out = standard_result_type(dtype, values_dtype)
    if out == _working_dtype(dtype) and out != dtype:
        return np.dtype(dtype)
    return out


# --------------------------------------------------------------------- checks


# What `funm_action` adds when `f` fails on the eigenvalues: the other method.
_MATRIX_FUNCTION_HINT = (
    " For a matrix function of the small matrix, such as `jax.scipy.linalg.expm`, "
    'use `method="arnoldi"`.'
)


def _scalar_function(f: Callable, example: Array, arg: str, hint: str = "") -> Callable:
    """`f` closure-converted on `(d,)` eigenvalues like `example`; its output
    checked.

    The example is typed like the eigenvalues it will be called with (on a mesh,
    its sharding too: the closure-converted function checks that), so it is made
    from the tridiagonal matrix's own diagonal. A shape or type error that `f`
    raises on them, as a matrix function does on a vector, is raised again naming
    `arg`, with `hint` appended."""
    (d,) = example.shape
    try:
        fn = closure_convert(f, example)
        out = jax.eval_shape(fn, example)
    except (TypeError, ValueError, IndexError) as err:
        kind = TypeError if isinstance(err, TypeError) else ValueError
        # JAX appends a note on its filtered traceback; the message is what precedes.
        reason = str(err).split("\n-----")[0]
        msg = (
            f"`{arg}` must be a scalar function, applied elementwise to the ({d},) "
            f"eigenvalues of T (a {example.dtype} array); calling it on them raised "
            f"{type(err).__name__}: {reason}{hint}"
        )
        raise kind(msg) from err
    _check_output(out, (d,), arg, f"the ({d},) eigenvalues of T to ({d},) values")
    return fn


def _check_output(out: Any, shape: tuple[int, ...], arg: str, what: str) -> None:
    if not isinstance(out, jax.ShapeDtypeStruct):
        msg = f"`{arg}` must map {what}; it returned a pytree {out}."
        raise TypeError(msg)
    if out.shape != shape:
        msg = f"`{arg}` must map {what}; it returned shape {out.shape}."
        raise ValueError(msg)
    if not jnp.issubdtype(out.dtype, jnp.inexact):
        msg = (
            f"`{arg}` must map {what} of a floating-point or complex dtype; it "
            f"returned dtype {out.dtype}."
        )
        raise TypeError(msg)


def _check_callable(f: Any, arg: str) -> None:
    if not callable(f):
        msg = f"`{arg}` must be a callable; got an object of type {type(f).__name__}."
        raise TypeError(msg)
