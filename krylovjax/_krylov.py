r"""`krylov`: the Krylov matrix $[x_0, A x_0, \dots, A^{d-1} x_0]$.

The public function, and the one place where the method and the derivative rule are
chosen. It validates its arguments, turns `A` into the internal operator form
(`_operator.py`), resolves `method="auto"` and the default rule, and calls one
builder from `BUILDERS`: every builder takes `(operator, x0, d)` and returns the
stack `(d, *x0.shape)`, to which `krylov` applies `layout` once. A construction
method lives in its own module (`_scan.py`, `_doubling.py`) with its derivative
rules and any layout trick of its own; adding one means a module and rows here.
"""

from collections.abc import Callable
from typing import Literal

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Inexact

from ._bases import AbstractBasis, basis_coefficients
from ._checks import as_array, check_choice, check_depth, check_output_size
from ._doubling import choose_method, krylov_doubling, krylov_doubling_custom_vjp
from ._operator import AbstractOperator, as_operator
from ._partition import PartitionedOperator, krylov_matrix_powers
from ._scan import (
    basis_custom_jvp,
    basis_scan,
    krylov_custom_jvp,
    krylov_custom_vjp,
    krylov_scan,
)
from ._sequence import ADJOINTS, Adjoint
from ._sharding import as_typed
from ._typing import OperatorLike, StaticInt

LAYOUTS = ("columns", "rows")
METHODS = ("auto", "scan", "doubling")

# (method, adjoint) -> builder; a missing pair is a combination that does not exist.
BUILDERS: dict[tuple[str, str], Callable[[AbstractOperator, Array, int], Array]] = {
    ("scan", "custom_jvp"): krylov_custom_jvp,
    ("scan", "custom_vjp"): krylov_custom_vjp,
    ("scan", "autodiff"): krylov_scan,
    ("doubling", "custom_vjp"): krylov_doubling_custom_vjp,
    ("doubling", "autodiff"): krylov_doubling,
}
# adjoint -> builder of a polynomial basis (`basis=`), `(operator, x0,
# coefficients, d)` -> the stack; the scan is its only method.
BASIS_BUILDERS = {
    "custom_jvp": basis_custom_jvp,
    "autodiff": basis_scan,
}
# The rule each method uses when `adjoint=None`.
DEFAULT_ADJOINT: dict[str, str] = {"scan": "custom_jvp", "doubling": "custom_vjp"}


def krylov(
    A: OperatorLike,
    x0: Inexact[Array | np.ndarray, "n ..."],
    d: StaticInt,
    *,
    layout: Literal["columns", "rows"] = "columns",
    adjoint: Adjoint | None = None,
    method: Literal["scan", "doubling", "auto"] = "scan",
    basis: AbstractBasis | None = None,
) -> Inexact[Array, "..."]:
    r"""Build the Krylov matrix $[x_0, A x_0, A^2 x_0, \dots, A^{d-1} x_0]$, or
    $[p_0(A) x_0, \dots, p_{d-1}(A) x_0]$ in a polynomial basis.

    By default the $d$ vectors are built by one `lax.scan` of $d - 1$ applications
    of $A$, and one derivative rule serves forward and reverse mode: `jax.jvp`,
    `jax.jacfwd`, `jax.linearize`, `jax.grad`, `jax.vjp` and `jax.hessian` all work.
    The reverse pass is written by hand: it propagates the gradient of $x_0$, keeps
    only the forward output, runs the adjoint recurrence backwards a chunk of steps
    at a time (as many as keep its buffers within 64 vectors beyond plain autodiff's
    memory) and forms each chunk's share of the gradient of a dense $A$ with one
    matrix product.

    **Arguments:**

    - `A`: the operator. One of: a square `(n, n)` array; a two-dimensional
        `jax.experimental.sparse.BCOO` matrix; or a linear callable mapping arrays of
        `x0`'s shape and dtype to arrays of the same shape and dtype (a function that
        closes over arrays, an `equinox.Module`, a bound method such as
        `lineax_operator.mv`). Gradients reach every floating-point array that `A`
        holds: the dense matrix, the BCOO values, closed-over arrays, module leaves.
        A callable must be linear: one that JAX cannot transpose, or that adds a
        term independent of its input (`lambda x: M @ x + c`), raises a
        `TypeError` at trace time; a nonlinear map belongs in
        [`krylovjax.iterate`][]. The check reads the callable's structure, not the
        values of the JAX arrays it closes over: one that puts such an array in its
        output (a padding `jnp.zeros(1)` made outside it, a `jnp.where` fill) is
        taken to add a term, even if it holds zeros; make those zeros inside the
        callable (`jnp.zeros_like(x[:1])`, or the literal `0.0`). A
        [`krylovjax.PartitionedOperator`][] made with `steps=s > 1` builds the
        monomial basis in blocks of $s$ products per halo exchange (the matrix
        powers kernel), differentiated by JAX's rules through the blocks
        (`adjoint=None` or `"autodiff"`).
    - `x0`: the starting vector `(n,)`, or a block of `b` starting vectors
        `(n, b)`. For a callable `A`, any shape with at least one axis. Must be
        floating point or complex: integer and boolean arrays raise a `TypeError`
        rather than being promoted. With a matrix `A`, `A` and `x0` are promoted to
        their common dtype, `jax.numpy.result_type(A, x0)` by JAX's standard rules
        (weak types included). This promotion is part of `krylov` and is made
        explicitly, so it happens also under
        `jax.config.update("jax_numpy_dtype_promotion", "strict")`, which forbids
        implicit ones (as it does in `A @ x0`); a callable `A` is your code, and runs
        under your setting.
    - `d`: the number of vectors, a static Python `int >= 1` (so $d - 1$
        applications of $A$). `d = 1` returns `x0` with the new axis.
    - `layout`: where the new axis of length `d` goes. `"columns"` (default, the
        textbook Krylov matrix) inserts it right after the first axis: `(n,)` gives
        `(n, d)` and `(n, b)` gives `(n, d, b)`, so `X.reshape(n, d * b)` is the
        block Krylov matrix $[X_0 \mid A X_0 \mid \dots]$. `"rows"` puts it first:
        `(d, n)` or `(d, n, b)`, one vector per row.
    - `adjoint`: how derivatives are computed. `None` (default): the method's own
        rule, `"custom_jvp"` for the scan and `"custom_vjp"` for doubling.
        `"custom_jvp"` (scan only): a JVP rule whose tangent map,
        $\dot x_{k+1} = A \dot x_k + \dot A x_k$, is a primitive with a
        hand-written transpose, so forward mode works and reverse mode is the
        chunked adjoint pass described above (see the docs' adjoint page).
        `"custom_vjp"`: the same reverse pass as a `jax.custom_vjp`; `jax.jvp` and
        `jax.jacfwd` raise a `TypeError`. `"autodiff"`: JAX's own rules through the
        construction; reverse mode saves every step.
    - `method`: how the vectors are built. `"scan"`: one sequential `lax.scan` of
        $d - 1$ matrix-vector products. `"doubling"`: parallel in time, on a dense
        matrix (a BCOO matrix is densified, since its powers fill in; a callable is
        materialised as the $N \times N$ matrix of its action on `x0` flattened, $N$
        = `x0.size`, so it pays only for small $N$). It appends $A^k [x_0, \dots,
        x_{k-1}]$ and squares $A^k$ in $\lceil \log_2 d \rceil$ levels, and its
        reverse pass is parallel in time too (the levels transposed, or a parallel
        suffix scan of the adjoint recurrence when the powers would not fit in
        memory): about $\log_2 d$ products of $n \times n$ matrices plus $O(n^2 d)$
        work in large GEMMs, which beats the scan when $d$ is large and $n$ small.
        Its rounding errors are relative to $\|A^{2^k}\|$ rather than to each
        vector, so it loses accuracy against the scan when powers of $A$ grow and
        decay at very different rates: strongly non-normal $A$, or $x_0$ close to
        directions that $A$ contracts while others grow; with the spectral radius
        far from 1, the powers overflow (to `inf`, then `nan` where a zero meets
        them) even when $x_0$ never touches the growing mode, and for matrices whose
        powers the scan reproduces exactly (a reflection, say) doubling's error
        grows with $d$. So the default is `"scan"`. `"auto"` (opt-in) picks
        `"doubling"` for a dense matrix when $d$ is large compared with $n$ and
        `"scan"` otherwise, including every BCOO matrix, every callable, and
        whenever `adjoint="custom_jvp"`; where it picks doubling it has doubling's
        limits. Its thresholds depend on the dtype (doubling wins at smaller $d$ for
        complex dtypes) and on the block size (a block of $b > 1$ vectors counts as
        $2 b d$), and were measured on CPU ([`krylovjax.auto_method`][] names the
        choice; the measurements are in `benchmarks/README.md`); other backends use
        the CPU thresholds until measured.
    - `basis`: `None` (default) for the monomial basis $A^k x_0$; or a basis of
        polynomials $p_k$ with a three-term recurrence,
        $p_{k+1}(A) x = (a_k A + b_k) p_k(A) x - c_k p_{k-1}(A) x$:
        [`krylovjax.Chebyshev`][], [`krylovjax.Legendre`][],
        [`krylovjax.Jacobi`][] on an interval that holds the spectrum (see
        [`krylovjax.spectrum_interval`][]), or [`krylovjax.ThreeTerm`][] with
        coefficients of your own, which may be learned. Column $k$ is then
        $p_k(A) x_0$, built by one `lax.scan` (`method="scan"`; doubling is for the
        monomial basis only) with the derivative contract of the default: one rule
        for forward and reverse mode (`adjoint="custom_jvp"`, or `"autodiff"`), a
        reverse pass that keeps only the output, and gradients that reach the
        basis's own arrays (the interval, Jacobi's exponents, `ThreeTerm`'s
        coefficients). See the docs' page on polynomial bases.

    **Returns:**

    An array with one more axis than `x0`, of length `d`, placed by `layout`.
    Argument shapes and dtypes are checked at trace time; values are not: a `nan` or
    `inf` in `A` or `x0`, or powers of `A` that overflow the dtype, propagate into
    the output and gradients as in any JAX computation.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> import krylovjax
        >>> A = jnp.array([[0.0, 1.0], [-1.0, 0.0]])
        >>> x0 = jnp.array([1.0, 0.0])
        >>> krylovjax.krylov(A, x0, 4)
        Array([[ 1.,  0., -1.,  0.],
               [ 0., -1.,  0.,  1.]], dtype=float32)
        >>> jax.grad(lambda x: krylovjax.krylov(A, x, 4).sum())(x0)
        Array([0., 0.], dtype=float32)

        ```
    """
    check_choice(layout, LAYOUTS, "krylov(layout=...)")
    if adjoint is not None:
        check_choice(adjoint, ADJOINTS, "krylov(adjoint=...)")
    check_choice(method, METHODS, "krylov(method=...)")
    operator, x0, d = check_problem(A, x0, d, "krylov")
    if basis is not None:
        xs = _in_basis(operator, x0, d, basis, adjoint, method)
        return xs if layout == "rows" else jnp.moveaxis(xs, 0, 1)
    if isinstance(A, PartitionedOperator) and A.steps > 1:
        xs = _matrix_powers(A, x0, d, adjoint, method)
        return xs if layout == "rows" else jnp.moveaxis(xs, 0, 1)
    if method == "auto":
        # Doubling has a reverse-mode rule only: an explicit request for forward
        # mode keeps the scan.
        method = "scan" if adjoint == "custom_jvp" else choose_method(operator, x0, d)
    rule = DEFAULT_ADJOINT[method] if adjoint is None else adjoint
    build = BUILDERS.get((method, rule))
    if build is None:
        offered = [a for m, a in BUILDERS if m == method]
        msg = (
            f"`krylov(adjoint={rule!r})` is not available with "
            f"`method={method!r}`, which offers {offered}. For forward mode use "
            f"`method='scan'` (its default rule) or `adjoint='autodiff'`."
        )
        raise ValueError(msg)
    xs = x0[None] if d == 1 else build(operator, x0, d)
    return xs if layout == "rows" else jnp.moveaxis(xs, 0, 1)


def _in_basis(operator, x0, d, basis, adjoint, method) -> Array:
    """The stack of $p_k(A) x_0$ for a polynomial `basis`."""
    a, b, c = basis_coefficients(basis, d, x0.dtype, "krylov")
    if method == "doubling":
        msg = (
            "`krylov(method='doubling')` builds the monomial basis only; with "
            "`basis=...` use `method='scan'` (the default)."
        )
        raise ValueError(msg)
    rule = "custom_jvp" if adjoint is None else adjoint
    build = BASIS_BUILDERS.get(rule)
    if build is None:
        msg = (
            f"`krylov(adjoint={rule!r})` is not available with `basis=...`, which "
            f"offers {list(BASIS_BUILDERS)}."
        )
        raise ValueError(msg)
    return x0[None] if d == 1 else build(operator, x0, (a, b, c), d)


def _matrix_powers(A, x0, d, adjoint, method) -> Array:
    """The stack for a `PartitionedOperator` with `steps > 1`: blocks of `steps`
    products per exchange (`_partition.krylov_matrix_powers`)."""
    if method == "doubling" or adjoint not in (None, "autodiff"):
        msg = (
            f"`krylov(A=...)`, a `PartitionedOperator` with steps={A.steps}, is "
            "built in blocks of products with JAX's derivatives: it takes "
            f"`method='scan'` and `adjoint=None` or `'autodiff'`; got "
            f"method={method!r}, adjoint={adjoint!r}. For the hand-written rules "
            "use `GraphPartition.operator(mesh, steps=1)`."
        )
        raise ValueError(msg)
    return x0[None] if d == 1 else krylov_matrix_powers(A, x0, d)


def auto_method(
    A: OperatorLike, x0: Inexact[Array | np.ndarray, "n ..."], d: StaticInt
) -> Literal["scan", "doubling"]:
    r"""The method that `krylov(A, x0, d, method="auto")` would use: `"scan"` or
    `"doubling"`.

    `"auto"` picks doubling for a dense matrix when $d$ is large compared with $n$
    (from thresholds measured on CPU, per dtype; a block of $b > 1$ vectors counts
    as $2 b d$), and the scan otherwise, including every BCOO matrix and callable.
    Only shapes and dtypes are read, so this works on abstract arrays too.

    **Arguments:**

    As for [`krylovjax.krylov`][]: `A`, `x0` and `d`, checked in the same way.

    **Returns:**

    `"scan"` or `"doubling"`.

    !!! Example

        ```python
        >>> import jax.numpy as jnp
        >>> import krylovjax
        >>> krylovjax.auto_method(jnp.eye(4) / 2, jnp.ones(4), 4096)
        'doubling'
        >>> krylovjax.auto_method(jnp.eye(4) / 2, jnp.ones(4), 16)
        'scan'
        >>> krylovjax.auto_method(lambda x: x / 2, jnp.ones(4), 4096)
        'scan'

        ```
    """
    operator, x0, d = check_problem(A, x0, d, "auto_method")
    return choose_method(operator, x0, d)


def check_problem(A, x0, d, fn_name, stacked=True):
    """Check `A`, `x0` and `d` and return them in internal form; with `stacked`,
    also that `d` copies of `x0` fit in memory (the Krylov matrix)."""
    d = check_depth(d, fn_name)
    x0 = as_typed(as_array(x0, f"{fn_name}(x0=...)"))
    if x0.ndim == 0:
        msg = (
            f"`{fn_name}(x0=...)` must have at least one axis; got a scalar of "
            f"shape ()."
        )
        raise ValueError(msg)
    check_output_size(d, [x0] if stacked else [], fn_name)
    operator, x0 = as_operator(A, x0, fn_name)
    return operator, x0, d
