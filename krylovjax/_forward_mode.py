r"""A `custom_jvp` formulation of `krylov` and `iterate`: forward and reverse mode.

A `custom_vjp` cannot be differentiated in forward mode. This module instead gives the
Krylov recurrence a custom JVP rule, written so that JAX's own transposition of it is
the same lean reverse pass as the hand-written adjoint in `_krylov.py`.

For $x_{k+1} = A x_k$ with tangents $\dot A$ and $\dot x_0$, the tangent trajectory
satisfies

$$\dot x_0 = \dot x_0, \qquad \dot x_{k+1} = A \dot x_k + r_k,
  \qquad r_k = \dot A x_k .$$

All $r_k$ are computed at once from the stored trajectory as one batched product
(`operator.mm` differentiated with respect to the operator: one GEMM for a dense
matrix), and the tangents by one linear `lax.scan`. Both pieces are linear in the
tangents, so under `jax.grad` JAX transposes them: the scan becomes the reverse scan
$\lambda_k = g_k + A^\top \lambda_{k+1}$ writing its cotangents into one stacked
buffer, and the batched product becomes one GEMM $\sum_k \lambda_{k+1} x_k^\top$. The
only residuals are the forward output and the operator.

For `iterate` the tangent step is $\dot x_{k+1} = \partial_x f(x_k) \dot x_k +
\partial_\theta f(x_k) \dot\theta$. Its body is wrapped in `jax.checkpoint`, so reverse
mode saves only the stored states and recomputes each step's linearisation, as the
hand-written adjoint does.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax

from ._iterate import iterate_scan
from ._krylov import krylov_scan
from ._operator import AbstractOperator


def _zeros_if_none(tangent, primal):
    """Materialise symbolic-zero (`None`) tangents of floating-point leaves."""

    def materialise(t, p):
        if t is not None:
            return t
        return None if p is None else jnp.zeros_like(p)

    return jtu.tree_map(materialise, tangent, primal, is_leaf=lambda t: t is None)


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
        return t_next, t

    # d steps that emit the tangent before updating it: the stacked output is the
    # whole tangent trajectory, so under transposition the output cotangent feeds the
    # reverse scan directly and the cotangent of r lands in one stacked buffer. The
    # last update is not needed; it costs one matrix-vector product.
    _, t_xs = lax.scan(step, t_x0, r, length=d)
    return xs, t_xs


@eqx.filter_custom_jvp
def iterate_custom_jvp(step, x0, *, d: int):
    return iterate_scan(step, x0, d)


@iterate_custom_jvp.def_jvp
def _iterate_jvp(primals, tangents, *, d):
    step, x0 = primals
    t_step, t_x0 = tangents
    xs = iterate_scan(step, x0, d)
    t_x0 = _zeros_if_none(t_x0, x0)
    diff, static = eqx.partition(step, eqx.is_inexact_array)
    t_diff = _zeros_if_none(eqx.filter(t_step, eqx.is_inexact_array), diff)

    @jax.checkpoint
    def tangent_step(t, x_k):
        _, t_next = jax.jvp(
            lambda p, x: eqx.combine(p, static)(x), (diff, x_k), (t_diff, t)
        )
        return t_next

    def body(t, k):
        x_k = jtu.tree_map(lambda x: x[k], xs)
        t_next = tangent_step(t, x_k)
        return t_next, t_next

    _, t_rest = lax.scan(body, t_x0, jnp.arange(d - 1))
    t_xs = jtu.tree_map(lambda a, b: jnp.concatenate([a[None], b]), t_x0, t_rest)
    return xs, t_xs
