r"""The sequential method of `krylov`: one `lax.scan`, and its two derivative rules.

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

For a dense matrix and a block $x_0$ of shape `(n, b)`, `krylov` runs the same rule on
the block's transpose, one vector per row (`DenseRowsOperator`), so that both stacks
are `((d - 1) b, n)` matrices as they lie in memory and the gradient GEMM reads them
without copying.

The transpose is JAX's convention for complex numbers too: the rule computes the
vector-Jacobian product (plain transpose, no conjugation), exactly what autodiff
through the scan would give.

**Forward mode.** A `custom_vjp` cannot be differentiated in forward mode, so
`adjoint="custom_jvp"` gives the recurrence a JVP rule instead, written so that JAX's
own transposition of it is the same lean reverse pass. For $x_{k+1} = A x_k$ with
tangents $\dot A$ and $\dot x_0$, the tangent trajectory satisfies

$$\dot x_{k+1} = A \dot x_k + r_k, \qquad r_k = \dot A x_k ,$$

starting from the tangent of $x_0$.

All $r_k$ are computed at once from the stored trajectory as one batched product
(`operator.mm` differentiated with respect to the operator: one GEMM for a dense
matrix), and the tangents by one linear `lax.scan`. Both pieces are linear in the
tangents, so under `jax.grad` JAX transposes them: the scan becomes the reverse scan
$\lambda_k = g_k + A^\top \lambda_{k+1}$ writing its cotangents into one stacked
buffer, and the batched product becomes one GEMM $\sum_k \lambda_{k+1} x_k^\top$. The
only residuals are the forward output and the operator.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array

from ._operator import AbstractOperator


def krylov_scan(operator: AbstractOperator, x0: Array, d: int) -> Array:
    """The forward pass: `x0` followed by `krylov_tail`, stacked on a new first axis."""
    return jnp.concatenate([x0[None], krylov_tail(operator, x0, d - 1)])


def krylov_tail(operator: AbstractOperator, x0: Array, steps: int) -> Array:
    r"""$[A x_0, \dots, A^{s} x_0]$ for $s$ = `steps`, by one `lax.scan`."""

    def step(x, _):
        y = keep_sharding(operator.mv(x), x)
        return y, y

    _, tail = lax.scan(step, x0, length=steps)
    return tail


@eqx.filter_custom_vjp
def krylov_tail_custom_vjp(vjp_arg: tuple[AbstractOperator, Array], d: int) -> Array:
    # The rule covers x_1, ..., x_(d-1) only; `krylov` puts x0 in front outside of
    # it. JAX then adds the cotangent of that first slot to the gradient of x0, and
    # the saved output and the adjoint buffer both have d - 1 rows, not d.
    operator, x0 = vjp_arg
    return krylov_tail(operator, x0, d - 1)


@krylov_tail_custom_vjp.def_fwd
def _krylov_fwd(perturbed, vjp_arg, d):
    del perturbed
    tail = krylov_tail_custom_vjp.fn(vjp_arg, d)
    return tail, tail


@krylov_tail_custom_vjp.def_bwd
def _krylov_bwd(tail, g_tail, perturbed, vjp_arg, d):
    operator, x0 = vjp_arg
    operator_perturbed, _ = perturbed
    if g_tail is None:
        g_tail = jnp.zeros_like(tail)
    # With lam_i the adjoint of x_i: lam_shifted = [lam_2, ..., lam_(d-1), 0] and
    # lam_1, the adjoint recurrence run over the tail's cotangents.
    # One transpose serves every step and the final product (for a callable it
    # linearises the operator, which is then done once).
    transpose_mv = operator.transpose(x0)
    lam_shifted, lam1 = adjoint_scan(transpose_mv, g_tail)
    grad_x0 = keep_sharding(transpose_mv(lam1), x0)
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


def adjoint_scan(
    transpose_mv: Callable[[Array], Array], g: Array
) -> tuple[Array, Array]:
    r"""Solve the adjoint recurrence $\lambda_i = g_i + A^\top \lambda_{i+1}$ backwards.

    `transpose_mv` is $y \mapsto A^\top y$. Returns the buffer
    $[\lambda_1, \dots, \lambda_{d-1}, 0]$ (stacked on the leading axis) and
    $\lambda_0$. The buffer is `g` itself, overwritten in place by one reverse scan:
    step $k$ reads $g_k$ from slot $k$ and then stores $\lambda_{k+1}$ there, so no
    second buffer of the cotangent's size exists, and the shifted order lines the
    buffer up with the forward vectors for one GEMM.
    """
    d = g.shape[0]
    lam_last = g[d - 1]
    lam = lax.dynamic_update_index_in_dim(g, jnp.zeros_like(lam_last), d - 1, 0)

    def step(carry, _):
        k, lam_next, lam = carry
        lam_k = lax.dynamic_index_in_dim(lam, k, 0, keepdims=False)
        lam_k = keep_sharding(lam_k + transpose_mv(lam_next), lam_next)
        # Adding `min(|lam_k|, 0)`, which is zero unless lam_k is already nan, makes
        # the write below depend on the read above, so XLA orders them and updates
        # the buffer in place instead of copying it every step.
        lam_next = lam_next + jnp.minimum(jnp.abs(lam_k), 0).astype(lam_k.dtype)
        lam = lax.dynamic_update_index_in_dim(lam, lam_next, k, 0)
        return (k - 1, lam_k, lam), None

    (_, lam0, lam), _ = lax.scan(step, (d - 2, lam_last, lam), length=d - 1)
    return lam, lam0


@eqx.filter_custom_jvp
def krylov_custom_jvp(operator: AbstractOperator, x0, *, d: int):
    return krylov_scan(operator, x0, d)


@krylov_custom_jvp.def_jvp
def _krylov_jvp(primals, tangents, *, d):
    operator, x0 = primals
    t_operator, t_x0 = tangents
    xs = krylov_scan(operator, x0, d)
    t_x0 = jnp.zeros_like(x0) if t_x0 is None else t_x0
    if t_operator is None or not jtu.tree_leaves(t_operator):
        r = None
    else:
        # r_k = (dA) x_k for every stored x_k at once: linear in the operator tangent.
        # All d vectors are used (r_(d-1) is not needed) so that no slice of the
        # stored trajectory is copied.
        _, r = eqx.filter_jvp(lambda op: op.mm(xs), (operator,), (t_operator,))

    def step(t, r_k):
        t_next = operator.mv(t) if r_k is None else operator.mv(t) + r_k
        return keep_sharding(t_next, t), t

    # d steps that emit the tangent before updating it: the stacked output is the
    # whole tangent trajectory, so under transposition the output cotangent feeds the
    # reverse scan directly and the cotangent of r lands in one stacked buffer. The
    # last update is not needed; it costs one matrix-vector product.
    _, t_xs = lax.scan(step, t_x0, r, length=d)
    return xs, t_xs


def keep_sharding(y: Array, like: Array) -> Array:
    """Give `y` the sharding type of `like`; a no-op unless the mesh is `Explicit`.

    On an explicit-sharding mesh the sharding is part of an array's type, so a scan
    carry must keep it: `A @ x` for a row-sharded `A` is typed row-sharded even when
    `x` is replicated.
    """
    sharding = jax.typeof(like).sharding
    if jax.typeof(y).sharding == sharding:
        return y
    return jax.sharding.reshard(y, sharding)
