r"""`krylov`: the Krylov matrix $[x_0, A x_0, \dots, A^{d-1} x_0]$ and its adjoint.

The forward pass is one `lax.scan` of $d - 1$ applications of $A$. The reverse pass is
written by hand (`equinox.filter_custom_vjp`). With output cotangents
$g_0, \dots, g_{d-1}$ (one per stored vector), the adjoint vectors satisfy

$$\lambda_{d-1} = g_{d-1}, \qquad \lambda_i = g_i + A^\top \lambda_{i+1},$$

and then

- the gradient of $x_0$ is $\lambda_0$;
- the gradient of $A$ is $\sum_{i=1}^{d-1} \lambda_i x_{i-1}^\top
  = [\lambda_1, \dots, \lambda_{d-1}] \, [x_0, \dots, x_{d-2}]^\top$.

The rule covers the $d - 1$ computed vectors $x_1, \dots, x_{d-1}$; `krylov` puts
$x_0$ in front of them outside the rule, so JAX adds $g_0$ to the gradient of $x_0$ and
the rule returns $A^\top \lambda_1$. One reverse `lax.scan` runs the recurrence over
$g_1, \dots, g_{d-1}$ and writes $\lambda_2, \dots, \lambda_{d-1}$ into a single
buffer: the output cotangent itself, updated in place (row $j$ holds $\lambda_{j+2}$
once $g_{j+1}$ has been read; the last row is zeroed). Row by row, that buffer lines up
with the saved vectors $x_1, \dots, x_{d-1}$, so the gradient of the operator is one
batched operation on the two buffers, without slicing either: a single GEMM for a dense
matrix, one sampled product for a BCOO matrix, one batched VJP for a callable (see
`_operator.py`), plus the one remaining pair $\lambda_1 x_0^\top$. The forward pass
saves nothing but its own output; the operator and $x_0$ are the primal inputs. Saved
output and adjoint buffer thus have $d - 1$ rows each, the same as the residuals and
cotangents of plain autodiff through the scan.

The transpose is JAX's convention for complex numbers too: the rule computes the
vector-Jacobian product (plain transpose, no conjugation), exactly what autodiff
through the scan would give.
"""

from typing import Any, Literal

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array, Inexact

from ._checks import as_array, check_choice, check_depth
from ._operator import AbstractOperator, as_operator

LAYOUTS = ("columns", "rows")
ADJOINTS = ("custom_vjp", "autodiff")
METHODS = ("auto", "scan", "doubling")


def krylov(
    A: Any,
    x0: Inexact[Array, "n ..."],
    d: int,
    *,
    layout: Literal["columns", "rows"] = "columns",
    adjoint: Literal["custom_vjp", "autodiff"] = "custom_vjp",
    method: Literal["auto", "scan", "doubling"] = "auto",
) -> Inexact[Array, "..."]:
    r"""Build the Krylov matrix $[x_0, A x_0, A^2 x_0, \dots, A^{d-1} x_0]$.

    The $d$ vectors are built by one `lax.scan` of $d - 1$ applications of $A$.
    Reverse-mode derivatives use a hand-written adjoint that propagates the gradient
    of $x_0$, writes all adjoint vectors into one preallocated buffer, and computes
    the gradient of a dense $A$ as one matrix product.

    **Arguments:**

    - `A`: the operator. One of: a square `(n, n)` array; a two-dimensional
        `jax.experimental.sparse.BCOO` matrix; or a linear callable mapping arrays of
        `x0`'s shape and dtype to arrays of the same shape and dtype (a function that
        closes over arrays, an `equinox.Module`, a bound method such as
        `lineax_operator.mv`). Gradients reach every floating-point array that `A`
        holds: the dense matrix, the BCOO values, closed-over arrays, module leaves.
        A callable is assumed linear; a nonlinear map belongs in
        [`krylovjax.iterate`][].
    - `x0`: the starting vector `(n,)`, or a block of `b` starting vectors
        `(n, b)`. For a callable `A`, any shape with at least one axis. Must be
        floating point or complex: integer and boolean arrays raise a `TypeError`
        rather than being promoted. With a matrix `A`, `A` and `x0` are promoted to
        their common dtype.
    - `d`: the number of vectors, a static Python `int >= 1` (so $d - 1$
        applications of $A$). `d = 1` returns `x0` with the new axis.
    - `layout`: where the new axis of length `d` goes. `"columns"` (default, the
        textbook Krylov matrix) inserts it right after the first axis: `(n,)` gives
        `(n, d)` and `(n, b)` gives `(n, d, b)`, so `X.reshape(n, d * b)` is the
        block Krylov matrix $[X_0 \mid A X_0 \mid \dots]$. `"rows"` puts it first:
        `(d, n)` or `(d, n, b)`, one vector per row.
    - `adjoint`: how reverse-mode derivatives are computed. `"custom_vjp"`
        (default) uses the hand-written adjoint described above; like every
        `jax.custom_vjp`, it supports `jax.grad`, `jax.vjp`, `jax.jacrev` and
        `grad` of `grad`, but forward mode (`jax.jvp`, `jax.jacfwd`,
        `jax.hessian`) raises a `TypeError`. `"autodiff"` differentiates the same
        `lax.scan` with JAX's own rules: forward mode works, and reverse mode costs
        more time and memory.
    - `method`: how the vectors are built. `"scan"`: one sequential `lax.scan` of
        $d - 1$ matrix-vector products. `"doubling"`: parallel in time, for a dense
        or BCOO matrix only (a BCOO matrix is densified, since its powers fill in;
        a callable raises a `ValueError`). It appends $A^k [x_0, \dots, x_{k-1}]$
        and squares $A^k$ in $\lceil \log_2 d \rceil$ levels, and its reverse pass
        solves the adjoint recurrence by a parallel suffix scan: about
        $\log_2 d$ products of $n \times n$ matrices plus $O(n^2 d)$ work in large
        GEMMs, which beats the scan when $d$ is large and $n$ small. Its rounding
        errors are relative to $\|A^{2^k}\|$ rather than to each vector, so it
        loses accuracy against the scan when powers of $A$ grow and decay at very
        different rates: strongly non-normal $A$, or $x_0$ close to directions
        that $A$ contracts while others grow; with the spectral radius far from 1,
        the powers overflow or underflow (to `inf` or `0`) about as early as the
        vectors do. `"auto"` (default) picks `"doubling"` for a dense matrix when
        $d$ is large compared with $n$ (thresholds measured on CPU, see
        `krylovjax/_doubling.py`) and `"scan"` otherwise, including every BCOO
        matrix and callable.

    **Returns:**

    An array with one more axis than `x0`, of length `d`, placed by `layout`.

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
    d = check_depth(d, "krylov")
    check_choice(layout, LAYOUTS, "krylov(layout=...)")
    check_choice(adjoint, ADJOINTS, "krylov(adjoint=...)")
    check_choice(method, METHODS, "krylov(method=...)")
    x0 = as_array(x0, "krylov(x0=...)")
    if x0.ndim == 0:
        msg = "`krylov(x0=...)` must have at least one axis; got a scalar of shape ()."
        raise ValueError(msg)
    operator, x0 = as_operator(A, x0, "krylov")
    from ._doubling import (
        check_doubling,
        choose_method,
        dense_matrix,
        krylov_doubling,
        krylov_doubling_custom_vjp,
    )

    if method == "doubling":
        check_doubling(operator)
    elif method == "auto":
        method = choose_method(operator, x0, d)
    if d == 1:
        xs = x0[None]
    elif method == "doubling" and adjoint == "custom_vjp":
        xs = krylov_doubling_custom_vjp((operator, x0), d)
    elif method == "doubling":
        xs = krylov_doubling(dense_matrix(operator), x0, d)
    elif adjoint == "custom_vjp":
        tail = _krylov_tail_custom_vjp((operator, x0), d)
        xs = jnp.concatenate([x0[None], tail])
    else:
        xs = krylov_scan(operator, x0, d)
    return xs if layout == "rows" else jnp.moveaxis(xs, 0, 1)


def krylov_scan(operator: AbstractOperator, x0: Array, d: int) -> Array:
    """The forward pass: `x0` followed by `krylov_tail`, stacked on a new first axis."""
    return jnp.concatenate([x0[None], krylov_tail(operator, x0, d - 1)])


def krylov_tail(operator: AbstractOperator, x0: Array, steps: int) -> Array:
    r"""$[A x_0, \dots, A^{s} x_0]$ for $s$ = `steps`, by one `lax.scan`."""

    def step(x, _):
        y = operator.mv(x)
        return y, y

    _, tail = lax.scan(step, x0, length=steps)
    return tail


@eqx.filter_custom_vjp
def _krylov_tail_custom_vjp(vjp_arg: tuple[AbstractOperator, Array], d: int) -> Array:
    # The rule covers x_1, ..., x_(d-1) only; `krylov` puts x0 in front outside of
    # it. JAX then adds the cotangent of that first slot to the gradient of x0, and
    # the saved output and the adjoint buffer both have d - 1 rows, not d.
    operator, x0 = vjp_arg
    return krylov_tail(operator, x0, d - 1)


@_krylov_tail_custom_vjp.def_fwd
def _krylov_fwd(perturbed, vjp_arg, d):
    del perturbed
    tail = _krylov_tail_custom_vjp.fn(vjp_arg, d)
    return tail, tail


@_krylov_tail_custom_vjp.def_bwd
def _krylov_bwd(tail, g_tail, perturbed, vjp_arg, d):
    operator, x0 = vjp_arg
    operator_perturbed, _ = perturbed
    if g_tail is None:
        g_tail = jnp.zeros_like(tail)
    # With lam_i the adjoint of x_i: lam_shifted = [lam_2, ..., lam_(d-1), 0] and
    # lam_1, the adjoint recurrence run over the tail's cotangents.
    lam_shifted, lam1 = adjoint_scan(operator, g_tail)
    grad_x0 = operator.transpose(x0)(lam1)
    if any(jtu.tree_leaves(operator_perturbed)):
        # sum_(i=1)^(d-1) lam_i x_(i-1)^T: the pairs (lam_(j+2), x_(j+1)) line up row
        # by row in `lam_shifted` and `tail` (the zero last row pairs with x_(d-1)),
        # so one batched product covers them without slicing either buffer; the
        # pair (lam_1, x_0) is added on its own.
        grad_operator = jtu.tree_map(
            jnp.add,
            operator.param_vjp(tail, lam_shifted),
            operator.param_vjp(x0[None], lam1[None]),
        )
    else:
        grad_operator = jtu.tree_map(
            lambda _: None, eqx.filter(operator, eqx.is_inexact_array)
        )
    return grad_operator, grad_x0


def adjoint_scan(operator: AbstractOperator, g: Array) -> tuple[Array, Array]:
    r"""Solve the adjoint recurrence $\lambda_i = g_i + A^\top \lambda_{i+1}$ backwards.

    Returns the buffer $[\lambda_1, \dots, \lambda_{d-1}, 0]$ (stacked on the
    leading axis) and $\lambda_0$. The buffer is `g` itself, overwritten in place by
    one reverse scan: step $k$ reads $g_k$ from slot $k$ and then stores
    $\lambda_{k+1}$ there, so no second buffer of the cotangent's size exists, and
    the shifted order lines the buffer up with the forward vectors for one GEMM.
    """
    d = g.shape[0]
    transpose_mv = operator.transpose(g[0])
    lam_last = g[d - 1]
    lam = lax.dynamic_update_index_in_dim(g, 0 * lam_last, d - 1, 0)

    def step(carry, _):
        k, lam_next, lam = carry
        lam_k = lax.dynamic_index_in_dim(lam, k, 0, keepdims=False)
        lam_k = lam_k + transpose_mv(lam_next)
        # `0 * lam_k` makes the write below depend on the read above, so XLA orders
        # them and updates the buffer in place instead of copying it every step.
        # (It changes a row only when lam_k is already inf or nan.)
        lam_next = lam_next + 0 * lam_k
        lam = lax.dynamic_update_index_in_dim(lam, lam_next, k, 0)
        return (k - 1, lam_k, lam), None

    (_, lam0, lam), _ = lax.scan(step, (d - 2, lam_last, lam), length=d - 1)
    return lam, lam0
