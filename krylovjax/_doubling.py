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

Everything works on the Krylov matrix in the columns layout, `(n, d)` for a vector
and `(n, d, b)` for a block $X_0$ of $b$ columns, which in memory is the flattened
$(n, d b)$ matrix $[X_0 \mid A X_0 \mid \dots]$: every level is one GEMM
$P X_{[:, :m]}$ on a contiguous range of vectors, appended by concatenation. The
builders at the end return `krylov`'s common stack `(d, *x0.shape)`, one transpose
that XLA merges with `krylov`'s layout.

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

The matrix comes from the operator's `as_matrix()`. A BCOO matrix is densified
for the products, since $A^2, A^4, \dots$ fill in after a few levels; only the
gradient of its stored values is sparse. A callable is materialised as the matrix
of its action on $x_0$ flattened ($N \times N$ for $N$ = `x0.size`; the gradient
reaches its arrays through that materialisation), so doubling pays only for small
$N$; `auto` never picks it for a callable.

All matrix products here use `jax.lax.Precision.HIGHEST`: on accelerators whose
default float32 matrix product rounds to fewer bits, high powers $A^{2^k}$ would
otherwise lose accuracy that the scan keeps. Each also names the sharding of its
result, so that on an `Explicit` mesh the Krylov matrix keeps the sharding of $x_0$
(a block may be split along $b$) and the powers and the gradient of $A$ keep that
of $A$ (which may be split by rows).
"""

import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Inexact

from ._operator import AbstractOperator, DenseOperator
from ._rules import reverse_rule
from ._sharding import is_explicit

_HIGHEST = lax.Precision.HIGHEST


# ----------------------------------------------------------------------- selection

# `method="auto"` picks "doubling" for a dense matrix when the depth (d, or 2 b d for a
# block of b vectors) reaches `min_depth` in the first row `(max_n, min_depth)` of its
# dtype's table with `n <= max_n`, and "scan" otherwise. Measured on CPU with
# `benchmarks/bench_methods.py`; the tables and their provenance are in
# `benchmarks/README.md` ("How `auto` chooses").
_COMPLEX_MIN_DEPTH = (
    (4, 1024),
    (32, 128),
    (64, 256),
    (128, 512),
    (256, 1024),
    (512, 4096),
)
_MIN_DEPTH: dict[str, tuple[tuple[int, int], ...]] = {
    "float32": ((4, 1024), (16, 256), (64, 512), (512, 4096)),
    "float64": ((4, 1024), (16, 256), (32, 512), (64, 1024), (512, 4096)),
    "complex64": _COMPLEX_MIN_DEPTH,
    "complex128": _COMPLEX_MIN_DEPTH,
}


def choose_method(
    operator: AbstractOperator, x0: Array, d: int
) -> Literal["scan", "doubling"]:
    """The method that `krylov(method="auto")` uses for this problem.

    `operator` and `x0` are in internal form, after dtype promotion (see
    `as_operator`); the dtype selects the table (other inexact dtypes use float32's).
    Only the CPU was measured, so every backend uses these tables.
    """
    if not isinstance(operator, DenseOperator):
        return "scan"
    table = _MIN_DEPTH.get(jnp.dtype(x0.dtype).name, _MIN_DEPTH["float32"])
    n = x0.shape[0]
    # A block of b > 1 vectors counts as 2 b times the depth (measured).
    b = math.prod(x0.shape[1:])
    depth = d if b == 1 else 2 * b * d
    for max_n, min_depth in table:
        if n <= max_n:
            return "doubling" if depth >= min_depth else "scan"
    return "scan"


# ------------------------------------------------------------------------- forward
#
# Everything below works on the Krylov matrix in the columns layout, `krylov`'s
# own output: an (n, d) array [x_0, A x_0, ...] for a vector x0, and an (n, d, b)
# array [X_0 | A X_0 | ...] for a block X_0 of b columns. In memory the latter is
# the flattened (n, d*b) block Krylov matrix, and every level is a plain GEMM on a
# contiguous range of the middle axis, with no transposes. The block axis is kept
# apart so that a block sharded along it stays sharded along it: flattened, a
# sharding of the (n, d*b) matrix would split the vectors, not the block.
#
# Every product names its result's sharding (`out_sharding`): the buffer keeps the
# sharding of x0 and every matrix that of A. Without a mesh, and on an `Auto` mesh,
# this changes nothing; on an `Explicit` mesh, where the sharding is part of an
# array's type, it is what lets a row-sharded A multiply a replicated x0 (the
# product would be typed row-sharded) and a block sharded along b contract its
# block axis for the gradient of A (a sum over devices).


def _dot(lhs: Array, rhs: Array, contract: tuple, like: Array) -> Array:
    """`lax.dot_general` at the highest precision, with `like`'s sharding."""
    return lax.dot_general(
        lhs,
        rhs,
        (contract, ((), ())),
        precision=_HIGHEST,
        out_sharding=jax.typeof(like).sharding,
    )


def _mm(P: Array, X: Array) -> Array:
    """$P X$ for `X` of shape `(n, m, *b)`."""
    return _dot(P, X, ((1,), (0,)), X)


def _mm_transpose(P: Array, X: Array) -> Array:
    r"""$P^\top X$, contracting $P$'s first axis (no transposed copy of $P$)."""
    return _dot(P, X, ((0,), (0,)), X)


def _square(P: Array) -> Array:
    return _dot(P, P, ((1,), (0,)), P)


def _outer(C: Array, X: Array, like: Array) -> Array:
    r"""$\sum_k C_{:, k} X_{:, k}^\top$, contracting the vectors and any block axis."""
    if C.ndim == 3 and _block_unsharded(C):
        # As (n, m*b) matrices (a reshape without copy): contracting both axes of
        # the 3-D arrays makes XLA transpose one of them first.
        C = C.reshape(C.shape[0], C.shape[1] * C.shape[2])
        X = X.reshape(X.shape[0], X.shape[1] * X.shape[2])
    axes = tuple(range(1, C.ndim))
    return _dot(C, X, (axes, axes), like)


def _block_unsharded(X: Array) -> bool:
    """Whether the block axis of `X`, `(n, m, b)`, is known to lie on one device.

    True without a mesh, and on an `Explicit` mesh when its type says so. On an
    `Auto` mesh the type does not say, and merging a block axis that the compiler
    has split with the vectors' axis would make it gather the block at every level.
    """
    sharding = jax.typeof(X).sharding
    if sharding.mesh.empty:
        return True
    spec = sharding.spec
    return sharding.mesh.are_all_axes_explicit and (len(spec) < 3 or spec[2] is None)


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
    matrix: Inexact[Array, "n n"], x0: Inexact[Array, "n 1 *b"], d: int
) -> Inexact[Array, "n d *b"]:
    """The forward pass by doubling on the `(n, d, *b)` columns layout."""
    xs = x0
    for power, (_, m) in zip(_powers(matrix, d), _levels(d), strict=True):
        # Concatenation measured faster than writing into a preallocated buffer.
        xs = jnp.concatenate([xs, _mm(power, xs[:, :m])], axis=1)
    return xs


def adjoint_doubling(
    matrix: Inexact[Array, "n n"],
    xs: Inexact[Array, "n d *b"],
    g: Inexact[Array, "n d *b"],
    matrix_grad: bool = True,
) -> tuple[Inexact[Array, "n 1 *b"], Inexact[Array, "n n"] | None]:
    r"""The reverse pass: the gradients of $x_0$ and of the dense matrix $A$.

    `xs` (the forward output) and its cotangent `g` are in the `(n, d, *b)` columns
    layout. Transposes the forward levels when the $\lceil \log_2 d \rceil$ powers
    fit in twice the memory of the buffer and one matrix, and uses the
    Hillis-Steele scan (one power alive at a time) otherwise. The matrix gradient
    is `None` unless `matrix_grad`. An empty block (`b = 0`) has zero gradients.
    """
    n = g.shape[0]
    if n * n * len(_levels(g.shape[1])) <= 2 * (g.size + n * n):
        return _reverse_levels(matrix, xs, g, matrix_grad)
    lam = _suffix_scan_hillis_steele(matrix, g)
    grad_matrix = None
    if matrix_grad:
        # sum_k lam_(k+1) x_k^T as one GEMM over contiguous ranges.
        grad_matrix = _outer(lam[:, 1:], xs[:, :-1], matrix)
    return lam[:, :1], grad_matrix


def _reverse_levels(
    matrix: Array, xs: Array, g: Array, matrix_grad: bool
) -> tuple[Array, Array | None]:
    # Level (k, m) computed X[:, k:k+m] = P X[:, :m] with P = A^k; its transpose
    # adds P^T C[:, k:k+m] to the cotangent C[:, :m] and P's cotangent gains
    # C[:, k:k+m] X[:, :m]^T. P = Q^2 for the previous level's Q passes a
    # cotangent G to Q as G Q^T + Q^T G.
    d = g.shape[1]
    ct = g
    grad_power = None
    levels = _levels(d)
    powers = _powers(matrix, d)
    for i in reversed(range(len(levels))):
        k, m = levels[i]
        power = powers[i]
        out = ct[:, k : k + m]
        head = ct[:, :m] + _mm_transpose(power, out)
        ct = head if m == k else jnp.concatenate([head, ct[:, m:k]], axis=1)
        if matrix_grad:
            grad = _outer(out, xs[:, :m], matrix)
            if grad_power is not None:
                # The next level's power is this one squared.
                grad = grad + _dot(grad_power, power, ((1,), (1,)), matrix)
                grad = grad + _mm_transpose(power, grad_power)
            grad_power = grad
    if matrix_grad and grad_power is None:
        grad_power = jnp.zeros_like(matrix)
    return ct[:, :1], grad_power


def _suffix_scan_hillis_steele(matrix: Array, g: Array) -> Array:
    r"""All $\lambda_i = \sum_{j \ge i} (A^\top)^{j-i} g_j$, `(n, d, *b)` layout."""
    d = g.shape[1]
    lam = g
    power = matrix
    shift = 1
    while shift < d:
        update = _mm_transpose(power, lam[:, shift:])
        lam = lam.at[:, : d - shift].add(update)
        shift *= 2
        if shift < d:
            power = _square(power)
    return lam


def _doubling_adjoint(operator, x0, xs, g, matrix_grad, d):
    del x0, d
    matrix = operator.as_matrix()
    grad_x0, grad_matrix = adjoint_doubling(matrix, xs, g, matrix_grad)
    if not matrix_grad:
        return None, grad_x0
    # Through `as_matrix`: the matrix itself, for a BCOO matrix its stored values
    # (the dense gradient sampled at the stored indices), for a callable the
    # arrays it holds.
    diff, static = eqx.partition(operator, eqx.is_inexact_array)
    _, vjp = jax.vjp(lambda diff: eqx.combine(diff, static).as_matrix(), diff)
    (grad_operator,) = vjp(grad_matrix)
    return grad_operator, grad_x0


# Doubling's columns `(n, d, *b)` with its own reverse pass (`adjoint_doubling`).
_doubling_columns = reverse_rule(
    lambda operator, x0, d: _forward_columns(operator.as_matrix(), x0, d),
    _doubling_adjoint,
)


# ------------------------------------------------------------------ the builders
#
# What `krylov` dispatches to: `(operator, x0, d)` -> the stack `(d, *x0.shape)`.


def _doubling(columns):
    """A builder from a function of `(operator, x0 as (n, 1, *b), d)` that returns
    the columns layout `(n, d, *b)`."""

    def build(operator: AbstractOperator, x0: Array, d: int) -> Array:
        n = jax.eval_shape(operator.as_matrix).shape[0]
        if x0.shape[0] != n or x0.size == n:
            # A callable's matrix acts on x0 flattened (a vector needs no reshape).
            # On an explicit mesh a split axis cannot be flattened: x0 is gathered
            # first (the matrix is replicated too), the stack split like x0 after.
            sharding = jax.typeof(x0).sharding
            explicit = is_explicit(x0)
            if explicit:
                x0 = jax.sharding.reshard(x0, sharding.update(spec=P()))
            xs = columns(operator, x0.reshape(n, 1), d).T.reshape(d, *x0.shape)
            if explicit:
                xs = jax.sharding.reshard(
                    xs, sharding.update(spec=P(None, *sharding.spec))
                )
            return xs
        return jnp.moveaxis(columns(operator, x0[:, None], d), 1, 0)

    return build


def _autodiff_columns(operator: AbstractOperator, x0: Array, d: int) -> Array:
    return _forward_columns(operator.as_matrix(), x0, d)


def _custom_vjp_columns(operator: AbstractOperator, x0: Array, d: int) -> Array:
    return _doubling_columns(operator, x0, d)


# Doubling differentiated by JAX.
krylov_doubling = _doubling(_autodiff_columns)
# Doubling with its own parallel-in-time reverse pass (the default rule).
krylov_doubling_custom_vjp = _doubling(_custom_vjp_columns)
