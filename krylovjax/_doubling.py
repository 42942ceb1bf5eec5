r"""Parallel-in-time construction of the Krylov matrix by repeated doubling.

`krylov(..., method="doubling")` builds $X = [x_0, A x_0, \dots, A^{d-1} x_0]$ in
$\lceil \log_2 d \rceil$ levels instead of $d - 1$ sequential matrix-vector products.
Starting from $X = [x_0]$ and $P = A$, each level appends $P X$ to $X$ and squares
$P$:

$$[x_0, \dots, x_{k-1}] \;\to\; [x_0, \dots, x_{k-1} \mid A^k x_0, \dots,
  A^k x_{k-1}], \qquad A^k \to A^{2k},$$

with the last level truncated to $d$ vectors. The cost is about $\log_2 d$ products
$n \times n \times n$ plus $n^2 d$ work spread over the levels; every product is one
large GEMM, so the method pays off when $A$ is small and $d$ is large, where the
sequential scan is dominated by per-step overhead.

Everything works on the Krylov matrix in the columns layout flattened to one
$(n, d b)$ matrix $[X_0 \mid A X_0 \mid \dots]$ for a block $X_0$ of $b$ columns,
so every level is one GEMM $P X_{[:, :m]}$ on a contiguous column range, appended
by concatenation; `layout="rows"` transposes once at the end.

The reverse pass (its own `equinox.filter_custom_vjp`) is parallel in time too:

- when the $\lceil \log_2 d \rceil$ powers $A, A^2, A^4, \dots$ fit in twice the
  memory of the buffer plus one matrix (every problem where doubling is fast,
  $d \gg n$), it transposes the forward levels, last first. Level $(k, m)$ computed
  $X_{[:, k:k+m]} = P X_{[:, :m]}$ with $P = A^k$; its transpose adds
  $P^\top C_{[:, k:k+m]}$ to the cotangent $C_{[:, :m]}$, and $P$'s cotangent
  $G$ gains $C_{[:, k:k+m]} X_{[:, :m]}^\top$; since $P = Q^2$ for the previous
  level's $Q$, $Q$'s cotangent gains $G Q^\top + Q^\top G$. About $2 n^2 d$ work
  in contiguous GEMMs plus $3 n^3 \log_2 d$ for the powers. The gradient of $x_0$
  is what is left of $C$, its first $b$ columns; the gradient of $A$ is the
  cotangent of the first power.
- otherwise it solves the adjoint recurrence $\lambda_{d-1} = g_{d-1}$,
  $\lambda_i = g_i + A^\top \lambda_{i+1}$, whose closed form
  $\lambda_i = \sum_{j \ge i} (A^\top)^{j-i} g_j$ is a suffix scan with a constant
  matrix, by the Hillis-Steele scan: $\lambda \leftarrow g$, then
  $\lambda_i \leftarrow \lambda_i + (A^s)^\top \lambda_{i+s}$ ($i + s < d$) for
  $s = 1, 2, 4, \dots$, one contiguous GEMM per step with only one power alive at a
  time. Then, exactly as for the scan, the gradient of $x_0$ is $\lambda_0$ and the
  gradient of $A$ is one GEMM $[\lambda_1 | \dots | \lambda_{d-1}] \,
  [x_0 | \dots | x_{d-2}]^\top$ (block columns contracted too).

Either way the powers are recomputed by squaring in the reverse pass rather than
saved by the forward pass, and memory stays $O(n d + n^2)$ (the first scheme's
$n^2 \log_2 d$ is at most twice that by its condition). For a BCOO matrix the
gradient of $A$ is taken through the densification, i.e. the dense gradient
sampled at the stored indices. Residuals are the forward output and the operator.

A BCOO matrix is densified (`A.todense()`) for the products, since $A^2, A^4, \dots$
fill in after a few levels; only the gradient of its stored values is sparse.
A callable operator has no matrix to square, so it is rejected.

All matrix products here use `jax.lax.Precision.HIGHEST`: on accelerators whose
default float32 matrix product rounds to fewer bits, high powers $A^{2^k}$ would
otherwise lose accuracy that the scan keeps.
"""

import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array, Inexact

from ._operator import AbstractOperator, DenseOperator, FunctionOperator, SparseOperator

_HIGHEST = lax.Precision.HIGHEST


def check_doubling(operator: AbstractOperator) -> None:
    """Raise a `ValueError` unless `operator` is a dense or BCOO matrix."""
    if isinstance(operator, FunctionOperator):
        msg = (
            "`krylov(method='doubling')` needs a dense or BCOO matrix `A`; got a "
            "callable. Pass the matrix itself, or use `method='scan'`."
        )
        raise ValueError(msg)


def dense_matrix(operator: AbstractOperator) -> Inexact[Array, "n n"]:
    """The operator as a dense `(n, n)` array (a BCOO matrix is densified)."""
    if isinstance(operator, DenseOperator):
        return operator.matrix
    if isinstance(operator, SparseOperator):
        return operator.matrix.todense()
    check_doubling(operator)
    msg = f"Unsupported operator {type(operator).__name__}."
    raise TypeError(msg)


# ----------------------------------------------------------------------- selection

# `method="auto"` picks "doubling" for a dense matrix when `d >= min_depth` for the
# first row `(max_n, min_depth)` of `_MIN_DEPTH` with `n <= max_n`, and "scan"
# otherwise, including every n > 256, every BCOO matrix and callable. Measured with
#   python benchmarks/bench_methods.py
#   python benchmarks/bench_methods.py --ns 4 16 32 64 128 256 --ds 512 1024 4096 \
#       --skip-accuracy --repeats 15 --out benchmarks/results_methods/focus
# (2 shared CPU cores, float32, jit(value_and_grad) of sum(krylov(A, x0, d) * W)
# with respect to A and x0, x0 of shape (n,), default layout "columns", median of
# interleaved repeats). time(scan) / time(doubling), > 1 where doubling is faster,
# one value per run (the machine is shared, so runs disagree by up to 30%):
#
#   n \ d    16    128   512         1024        4096
#   4       0.40  0.52  0.69        1.03, 1.07  2.46, 2.40
#   16      0.74  0.85  1.75        2.46, 2.50  3.02, 3.04
#   32                  1.48        2.13        2.12
#   64      0.31  0.28  1.21        1.43, 1.35  1.40, 1.63
#   128                 0.63        0.98        1.68
#   256     0.13  0.27  0.41        0.55, 0.57  1.06, 1.07
#   1024    0.04  0.14              0.40        (not run)
#
# Doubling does about 3 n^2 d work (forward, transposed levels: P^T C and C X^T
# per level) against the scan's 3 n^2 d, plus about 4 n^3 log2(d) for the powers
# and their cotangents, all in large GEMMs; it wins once d is large enough for
# the scan's per-step overhead to dominate and n small enough for the n^3 term
# not to. The same table is used for every dtype, block size and backend: only
# CPU float32 with x0 of shape (n,) was measured. On a GPU, where each scan step
# costs a kernel launch, the crossover is expected at smaller d, which this table
# does not exploit. The latest full tables, with accuracy and memory, are in
# benchmarks/results_methods/.
_MIN_DEPTH: tuple[tuple[int, int | None], ...] = ((4, 1024), (64, 512), (256, 4096))


def choose_method(
    operator: AbstractOperator,
    x0: Array,
    d: int,
    backend: str | None = None,
) -> Literal["scan", "doubling"]:
    """The method that `krylov(method="auto")` uses for this problem.

    **Arguments:**

    - `operator`: the operator in internal form (see `as_operator`).
    - `x0`: the starting vector `(n,)` or block `(n, b)`, after dtype promotion.
    - `d`: the number of vectors.
    - `backend`: the JAX backend name; defaults to `jax.default_backend()`.

    **Returns:**

    `"scan"` or `"doubling"`.
    """
    if not isinstance(operator, DenseOperator):
        return "scan"
    if backend is None:
        backend = jax.default_backend()
    n = x0.shape[0]
    for max_n, min_depth in _MIN_DEPTH:
        if n <= max_n:
            return "doubling" if min_depth is not None and d >= min_depth else "scan"
    return "scan"


# ------------------------------------------------------------------------- forward
#
# Everything below works on the Krylov matrix in the columns layout, flattened to
# one (n, d*b) matrix [X_0 | A X_0 | ... | A^(d-1) X_0] for a block X_0 of b
# columns (b = 1 for a vector x0): vector k of block column j is column k*b + j.
# Every level is then a plain GEMM on a contiguous column range, with no transposes.


def _mm(P: Array, X: Array) -> Array:
    return jnp.matmul(P, X, precision=_HIGHEST)


def _mm_transpose(P: Array, X: Array) -> Array:
    r"""$P^\top X$, contracting $P$'s first axis (no transposed copy of $P$)."""
    return lax.dot_general(P, X, (((0,), (0,)), ((), ())), precision=_HIGHEST)


def _square(P: Array) -> Array:
    return jnp.matmul(P, P, precision=_HIGHEST)


def _flatten(x0: Array) -> Array:
    """`x0` of shape `(n, *b)` as an `(n, prod(b))` matrix."""
    return x0.reshape(x0.shape[0], math.prod(x0.shape[1:]))


def _lay_out(xs: Array, x0: Array, d: int, layout: str) -> Array:
    """The `(n, d*b)` Krylov matrix in `krylov`'s `layout`, for `x0` of `(n, *b)`."""
    cols = xs.reshape(x0.shape[0], d, *x0.shape[1:])
    return cols if layout == "columns" else jnp.moveaxis(cols, 1, 0)


def _levels(d: int) -> list[tuple[int, int]]:
    """`(k, m)` for every doubling level: `m` new vectors appended after `k`."""
    levels, k = [], 1
    while k < d:
        m = min(k, d - k)
        levels.append((k, m))
        k += m
    return levels


def _powers(matrix: Array, d: int) -> list[Array]:
    r"""$A^k$ for every level of `_levels(d)`: $A, A^2, A^4, \dots$."""
    powers = []
    for i in range(len(_levels(d))):
        powers.append(matrix if i == 0 else _square(powers[-1]))
    return powers


def _forward_columns(
    matrix: Inexact[Array, "n n"], x0: Inexact[Array, "n b"], d: int
) -> Inexact[Array, "n d*b"]:
    """The forward pass by doubling on the flattened columns layout."""
    b = x0.shape[1]
    xs = x0
    for power, (_, m) in zip(_powers(matrix, d), _levels(d), strict=True):
        # Concatenation measured faster than writing into a preallocated buffer.
        xs = jnp.concatenate([xs, _mm(power, xs[:, : m * b])], axis=1)
    return xs


def krylov_doubling(
    matrix: Inexact[Array, "n n"],
    x0: Inexact[Array, "n ..."],
    d: int,
    layout: Literal["columns", "rows"] = "columns",
) -> Inexact[Array, "..."]:
    """The forward pass by doubling, differentiated by JAX, laid out by `layout`."""
    return _lay_out(_forward_columns(matrix, _flatten(x0), d), x0, d, layout)


def adjoint_doubling(
    matrix: Inexact[Array, "n n"],
    xs: Inexact[Array, "n d*b"],
    g: Inexact[Array, "n d*b"],
    b: int,
    matrix_grad: bool = True,
) -> tuple[Inexact[Array, "n b"], Inexact[Array, "n n"] | None]:
    r"""The reverse pass: the gradients of $x_0$ and of the dense matrix $A$.

    `xs` (the forward output) and its cotangent `g` are in the flattened columns
    layout, `b` columns a vector. Transposes the forward levels when the
    $\lceil \log_2 d \rceil$ powers fit in twice the memory of the buffer and one
    matrix, and uses the Hillis-Steele scan (one power alive at a time) otherwise.
    The matrix gradient is `None` unless `matrix_grad`.
    """
    n = g.shape[0]
    d = g.shape[1] // b
    if n * n * len(_levels(d)) <= 2 * (g.size + n * n):
        return _reverse_levels(matrix, xs, g, b, matrix_grad)
    lam = _suffix_scan_hillis_steele(matrix, g, b)
    grad_matrix = None
    if matrix_grad:
        # sum_k lam_(k+1) x_k^T as one GEMM over contiguous column ranges.
        grad_matrix = lax.dot_general(
            lam[:, b:], xs[:, :-b], (((1,), (1,)), ((), ())), precision=_HIGHEST
        )
    return lam[:, :b], grad_matrix


def _reverse_levels(
    matrix: Array, xs: Array, g: Array, b: int, matrix_grad: bool
) -> tuple[Array, Array | None]:
    # Level (k, m) computed X[:, k:k+m] = P X[:, :m] with P = A^k; its transpose
    # adds P^T C[:, k:k+m] to the cotangent C[:, :m] and P's cotangent gains
    # C[:, k:k+m] X[:, :m]^T. P = Q^2 for the previous level's Q passes a
    # cotangent G to Q as G Q^T + Q^T G.
    d = g.shape[1] // b
    ct = g
    grad_power = None
    levels = _levels(d)
    powers = _powers(matrix, d)
    for i in reversed(range(len(levels))):
        k, m = levels[i]
        power = powers[i]
        out = ct[:, k * b : (k + m) * b]
        head = ct[:, : m * b] + _mm_transpose(power, out)
        ct = head if m == k else jnp.concatenate([head, ct[:, m * b : k * b]], axis=1)
        if matrix_grad:
            grad = lax.dot_general(
                out, xs[:, : m * b], (((1,), (1,)), ((), ())), precision=_HIGHEST
            )
            if grad_power is not None:
                # The next level's power is this one squared.
                grad = grad + lax.dot_general(
                    grad_power, power, (((1,), (1,)), ((), ())), precision=_HIGHEST
                )
                grad = grad + _mm_transpose(power, grad_power)
            grad_power = grad
    if matrix_grad and grad_power is None:
        grad_power = jnp.zeros_like(matrix)
    return ct[:, :b], grad_power


def _suffix_scan_hillis_steele(matrix: Array, g: Array, b: int = 1) -> Array:
    r"""All $\lambda_i = \sum_{j \ge i} (A^\top)^{j-i} g_j$, columns layout."""
    d = g.shape[1] // b
    lam = g
    power = matrix
    shift = 1
    while shift < d:
        update = _mm_transpose(power, lam[:, shift * b :])
        lam = lam.at[:, : (d - shift) * b].add(update)
        shift *= 2
        if shift < d:
            power = _square(power)
    return lam


@eqx.filter_custom_vjp
def _doubling_columns(vjp_arg: tuple[AbstractOperator, Array], d: int) -> Array:
    operator, x0 = vjp_arg
    return _forward_columns(dense_matrix(operator), x0, d)


@_doubling_columns.def_fwd
def _doubling_fwd(perturbed, vjp_arg, d):
    del perturbed
    xs = _doubling_columns.fn(vjp_arg, d)
    return xs, xs


@_doubling_columns.def_bwd
def _doubling_bwd(xs, g, perturbed, vjp_arg, d):
    operator, x0 = vjp_arg
    operator_perturbed, _ = perturbed
    if g is None:
        g = jnp.zeros_like(xs)
    matrix_grad = any(jtu.tree_leaves(operator_perturbed))
    grad_x0, grad_matrix = adjoint_doubling(
        dense_matrix(operator), xs, g, x0.shape[1], matrix_grad
    )
    diff, static = eqx.partition(operator, eqx.is_inexact_array)
    if matrix_grad:
        # Through `dense_matrix`: the matrix itself, or for a BCOO matrix its
        # stored values (the dense gradient sampled at the stored indices).
        _, vjp = jax.vjp(lambda diff: dense_matrix(eqx.combine(diff, static)), diff)
        (grad_operator,) = vjp(grad_matrix)
    else:
        grad_operator = jtu.tree_map(lambda _: None, diff)
    return grad_operator, grad_x0


def krylov_doubling_custom_vjp(
    vjp_arg: tuple[AbstractOperator, Array],
    d: int,
    layout: Literal["columns", "rows"] = "columns",
) -> Array:
    """The forward pass by doubling with its own reverse pass, laid out by `layout`."""
    operator, x0 = vjp_arg
    xs = _doubling_columns((operator, _flatten(x0)), d)
    return _lay_out(xs, x0, d, layout)
