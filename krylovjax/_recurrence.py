r"""Three-term recurrences: the polynomial bases of `krylov(basis=...)`, and their
derivative rules.

A basis (`_bases.py`) gives coefficients $a_k, b_k, c_k$ ($k = 0, \dots, d - 2$,
$c_0 = 0$) of the recurrence

$$x_{-1} = 0, \qquad x_{k+1} = a_k A x_k + b_k x_k - c_k x_{k-1},$$

so that $x_k = p_k(A) x_0$. The forward pass is one `lax.scan` whose carry is the
pair $(x_{k-1}, x_k)$; it stacks $X = [x_0, \dots, x_{d-1}]$ as `krylov` does.

**Reverse mode.** With output cotangents $g_0, \dots, g_{d-1}$, the adjoint vectors
satisfy $\lambda_d = 0$, $\lambda_{d-1} = g_{d-1}$ and

$$\lambda_k = g_k + a_k A^\top \lambda_{k+1} + b_k \lambda_{k+1}
  - c_{k+1} \lambda_{k+2},$$

and the gradients are $\lambda_0$ for $x_0$, $\sum_k a_k \lambda_{k+1} x_k^\top$ for
$A$ (one batched product per chunk of steps: a GEMM for a dense matrix), and, per
step, $\langle A^\top \lambda_{k+1}, x_k\rangle$ for $a_k$,
$\langle \lambda_{k+1}, x_k \rangle$ for $b_k$ and
$-\langle \lambda_{k+1}, x_{k-1} \rangle$ for $c_k$ (bilinear products: JAX's
convention for complex numbers, as autodiff through the scan gives). `adjoint_rows`
runs it backwards over chunks of steps, reading a chunk's slice of the cotangent and
of the stored vectors at a time; its only residual is the forward output (less its
last vector, which nothing reads). $A^\top \lambda_{k+1}$ serves both the adjoint
and the gradient of $a_k$, and $-\langle\lambda_{k+2}, x_k\rangle$ (the gradient of
$c_{k+1}$) is formed at step $k$, where $x_k$ is at hand.

**Forward mode.** The tangents satisfy the same recurrence with a forcing term,

$$\dot x_{k+1} = a_k A \dot x_k + b_k \dot x_k - c_k \dot x_{k-1}
  + a_k \dot A x_k + \dot a_k A x_k + \dot b_k x_k - \dot c_k x_{k-1},$$

formed from the stored $x_k$ by one batched product (`tangent_rows`). As for the
monomial scan (`_scan.py`), the JVP rule's tangent map is a primitive
(`_tangent.py`) whose transpose is `adjoint_rows`, so one rule serves `jax.jvp`,
`jax.grad` and their compositions.
"""

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array

from ._chunks import add_param_vjp, chunk_steps
from ._operator import AbstractOperator, SparseOperator
from ._rules import tangent_or_none
from ._sequence import with_first
from ._sharding import typed_like
from ._tangent import is_tangent, like_tangent, nones, tangent_primitive

# How many steps of the reverse pass share one batched product for the gradient of
# the operator. A chunk keeps its adjoint vectors (times a_k), the slice of the
# cotangent and the slice of stored vectors it reads: 3 * 16 = 48 vectors, beside
# a residual of d vectors where autodiff through the scan keeps two per step.
CHUNK = 16

Coefficients = tuple[Array, Array, Array]


def _dot(x: Array, y: Array) -> Array:
    """The bilinear product $\\sum x y$ (no conjugation)."""
    return jnp.sum(x * y)


# ----------------------------------------------------------------- forward pass


def _step(operator: AbstractOperator, x_prev: Array, x: Array, a, b, c) -> Array:
    """$x_{k+1} = a_k A x_k + b_k x_k - c_k x_{k-1}$, typed like $x_k$."""
    return typed_like(a * operator.mv(x) + b * x - c * x_prev, x)


def recurrence_tail(
    operator: AbstractOperator, x0: Array, coefficients: Coefficients, steps: int
) -> Array:
    """$[x_1, \\dots, x_s]$ for $s$ = `steps`, by one `lax.scan`."""

    def body(carry, abc):
        x_prev, x = carry
        y = _step(operator, x_prev, x, *abc)
        return (x, y), y

    rows = tuple(coef[:steps] for coef in coefficients)
    _, tail = lax.scan(body, (jnp.zeros_like(x0), x0), rows, length=steps)
    return tail


def recurrence_scan(
    operator: AbstractOperator, x0: Array, coefficients: Coefficients, d: int
) -> Array:
    """The stack $[x_0, \\dots, x_{d-1}]$, differentiated by JAX
    (`adjoint="autodiff"`)."""
    return with_first(x0, recurrence_tail(operator, x0, coefficients, d - 1))


# ----------------------------------------------------------------- reverse pass


def _adjoint_chunk(transpose, g_rows, x_rows, a_rows, b_rows, cn_rows, carry, want_w):
    """Steps $k$ of one chunk, last first: their adjoints and per-step products.

    `g_rows`, `x_rows`, `a_rows`, `b_rows`, `cn_rows` hold $g_k$, $x_k$, $a_k$,
    $b_k$ and $c_{k+1}$ for the chunk's steps; `carry` is
    $(\\lambda_{k+1}, \\lambda_{k+2})$ above the chunk. Returns the carry below it and,
    per step, $a_k \\lambda_{k+1}$ (if `want_w`; the chunk's share of the gradient
    of $A$ pairs it with $x_k$) and the gradients of $a_k$, $b_k$ and $c_{k+1}$.
    """

    def body(carry, row):
        lam1, lam2 = carry
        g_k, x_k, a_k, b_k, cn_k = row
        u = transpose.mv(lam1)
        lam = typed_like(g_k + a_k * u + b_k * lam1 - cn_k * lam2, lam1)
        dots = (_dot(u, x_k), _dot(lam1, x_k), -_dot(lam2, x_k))
        w = a_k * lam1 if want_w else None
        return (lam, lam1), (w, dots)

    rows = (g_rows, x_rows, a_rows, b_rows, cn_rows)
    return lax.scan(body, carry, rows, reverse=True)


def adjoint_rows(
    operator: AbstractOperator,
    x0: Array,
    stored: Array,
    coefficients: Coefficients,
    g: Array,
    want_operator: bool,
) -> tuple[Array, AbstractOperator | None, Coefficients]:
    r"""The reverse pass (see the module docstring).

    `g` is the cotangent of $[x_1, \dots, x_{d-1}]$ and `stored` holds
    $x_1, \dots, x_{d-2}$. Returns the gradient of $x_0$ through the steps (JAX
    adds $g_0$: $x_0$ is put in front outside the rule), of the operator (if
    `want_operator`, else `None`) and of the three coefficient arrays.
    """
    a, b, c = coefficients
    steps = g.shape[0]  # d - 1
    rows = steps - 1  # the steps k = 1 .. d - 2, whose x_k is stored
    cn = jnp.concatenate([c[1:], jnp.zeros_like(c[:1])])  # c_(k+1); c_(d-1) = 0
    transpose = operator.transpose()
    grad = (
        jtu.tree_map(jnp.zeros_like, eqx.filter(operator, eqx.is_inexact_array))
        if want_operator
        else None
    )
    # lambda_(d-1) = g_(d-1), lambda_d = 0.
    carry = (typed_like(g[steps - 1], x0), jnp.zeros_like(x0))

    def chunk(start, size, carry, grad):
        # Steps k = start .. start + size - 1 (1 <= start): slices of the
        # cotangent (row k - 1 of `g` is g_k) and of the stored vectors, read once.
        g_rows = lax.dynamic_slice_in_dim(g, start - 1, size)
        x_rows = lax.dynamic_slice_in_dim(stored, start - 1, size)
        a_rows, b_rows, cn_rows = (
            lax.dynamic_slice_in_dim(v, start, size) for v in (a, b, cn)
        )
        carry, (w, dots) = _adjoint_chunk(
            transpose, g_rows, x_rows, a_rows, b_rows, cn_rows, carry, want_operator
        )
        if grad is not None and w is not None:
            grad = add_param_vjp(operator, grad, stored, start - 1, w)
        return carry, grad, dots

    size = min(chunk_steps(x0, CHUNK), max(rows, 1))
    full, rest = divmod(rows, size)
    parts = []
    if rest:
        carry, grad, dots = chunk(1 + full * size, rest, carry, grad)
        parts.append(dots)
    if full:

        def chunk_step(state, i):
            carry, grad = state
            carry, grad, dots = chunk(1 + i * size, size, carry, grad)
            return (carry, grad), dots

        (carry, grad), dots = lax.scan(
            chunk_step, (carry, grad), jnp.arange(full), reverse=True
        )
        parts.append(jtu.tree_map(lambda v: v.reshape(-1), dots))
    # Step 0 pairs with x0, which is not stored; its adjoint is the gradient of x0.
    lam1, lam2 = carry
    u = transpose.mv(lam1)
    ct_x0 = typed_like(a[0] * u + b[0] * lam1 - cn[0] * lam2, x0)
    if grad is not None:
        grad = add_param_vjp(operator, grad, x0[None], 0, (a[0] * lam1)[None])
    first = (_dot(u, x0), _dot(lam1, x0), -_dot(lam2, x0))
    # Steps in order: 0, the chunks from the bottom up, then the rest at the top.
    da, db, dcn = (
        jnp.concatenate([first[i][None], *(p[i] for p in reversed(parts))])
        for i in range(3)
    )
    # dcn[k] is the gradient of c_(k+1); c_0 multiplies x_(-1) = 0.
    dc = jnp.concatenate([jnp.zeros_like(dcn[:1]), dcn[:-1]])
    return ct_x0, grad, (da, db, dc)


# ------------------------------------------------------------------ forward mode


def tangent_rows(
    operator: AbstractOperator,
    x0: Array,
    stored: Array,
    coefficients: Coefficients,
    t_operator: AbstractOperator | None,
    t_x0: Array,
    t_coefficients: tuple,
) -> Array:
    r"""The tangents $[\dot x_1, \dots, \dot x_{d-1}]$ (see the module docstring).

    One `lax.scan`; each step also forms its forcing term from the stored $x_k$
    (the products $A x_k$ and $\dot A x_k$ of one JVP of the operator, where they
    are needed). `t_operator` `None` means $\dot A = 0$; a `None` among
    `t_coefficients` means that coefficient's tangent is zero.
    """
    a, b, c = coefficients
    t_a, t_b, t_c = t_coefficients
    steps = stored.shape[0] + 1
    xs = jnp.concatenate([x0[None], stored])  # x_0 .. x_(d-2)
    zeros = jnp.zeros_like(a)
    t_abc = tuple(zeros if t is None else t for t in (t_a, t_b, t_c))
    with_products = t_operator is not None or t_a is not None
    # The products with A and its tangent, a_k dA x_k + da_k A x_k: one batched
    # product over the stack (a GEMM for a dense matrix, one vmapped call for a
    # callable); for a BCOO matrix one per step, whose batched product flattens a
    # block axis, which a split axis refuses on an explicit mesh.
    products = None
    if with_products and not isinstance(operator, SparseOperator):
        if t_operator is None:
            y, t_y = operator.mm(xs), None
        else:
            y, t_y = eqx.filter_jvp(lambda op: op.mm(xs), (operator,), (t_operator,))
        shape = (-1, *([1] * x0.ndim))
        products = jnp.zeros_like(xs)
        if t_y is not None:
            products = products + a.reshape(shape) * t_y
        if t_a is not None:
            products = products + t_abc[0].reshape(shape) * y

    def forcing(x_prev, x, a_k, dots, product):
        dot_a, dot_b, dot_c = dots
        r = dot_b * x - dot_c * x_prev
        if product is not None:
            return r + product
        if not with_products:
            return r
        if t_operator is None:
            return r + dot_a * operator.mv(x)
        y, t_y = eqx.filter_jvp(lambda op: op.mv(x), (operator,), (t_operator,))
        return r + dot_a * y + a_k * t_y

    def body(carry, row):
        (t_prev, t), x_prev = carry
        x, abc, dots, product = row
        r_k = forcing(x_prev, x, abc[0], dots, product)
        t_next = typed_like(_step(operator, t_prev, t, *abc) + r_k, t)
        return ((t, t_next), x), t_next

    init = ((jnp.zeros_like(t_x0), t_x0), jnp.zeros_like(x0))
    rows = (xs, (a, b, c), t_abc, products)
    _, ts = lax.scan(body, init, rows, length=steps)
    return ts


def _tangent_transpose(inputs, g):
    operator, x0, stored, coefficients, t_operator, t_x0, t_coefficients = inputs
    want_operator = is_tangent(t_operator)
    ct_x0, ct_operator, ct_coefficients = adjoint_rows(
        operator, x0, stored, coefficients, g, want_operator
    )
    ct_operator = like_tangent(t_operator, ct_operator) if want_operator else None
    ct_coefficients = tuple(
        ct if is_tangent(t) else None
        for t, ct in zip(t_coefficients, ct_coefficients, strict=True)
    )
    return (
        nones(operator),
        nones(x0),
        nones(stored),
        nones(coefficients),
        ct_operator if want_operator else nones(t_operator),
        ct_x0,
        ct_coefficients,
    )


# Arguments: (operator, x0, stored, coefficients, t_operator, t_x0, t_coefficients);
# the tangents are like `stored` with one more row (the last vector, which no
# tangent or adjoint reads).
recurrence_tangent = tangent_primitive(
    "recurrence_tangent", tangent_rows, _tangent_transpose, like=2, extra_rows=1
)


@eqx.filter_custom_jvp
def _recurrence_custom_jvp(operator, x0, coefficients, *, d: int):
    return recurrence_scan(operator, x0, coefficients, d)


@_recurrence_custom_jvp.def_jvp
def _recurrence_jvp(primals, tangents, *, d):
    operator, x0, coefficients = primals
    t_operator, t_x0, t_coefficients = tangents
    # The rules read x_1 .. x_(d-2) only: the last vector is computed outside the
    # stored stack, so that reverse mode does not keep it.
    stored = recurrence_tail(operator, x0, coefficients, d - 2)
    x_prev = x0 if d == 3 else jnp.zeros_like(x0) if d == 2 else stored[-2]
    x = x0 if d == 2 else stored[-1]
    last = _step(operator, x_prev, x, *(coef[d - 2] for coef in coefficients))
    tail = jnp.concatenate([stored, last[None]])
    t_x0 = jnp.zeros_like(x0) if t_x0 is None else t_x0
    t_operator = tangent_or_none(t_operator)
    if t_coefficients is None:
        t_coefficients = (None, None, None)
    t_tail = recurrence_tangent(
        operator, x0, stored, coefficients, t_operator, t_x0, tuple(t_coefficients)
    )
    return with_first(x0, tail), with_first(t_x0, t_tail)


def recurrence_custom_jvp(
    operator: AbstractOperator, x0: Array, coefficients: Coefficients, d: int
) -> Array:
    """The stack $[x_0, \\dots, x_{d-1}]$ with one derivative rule for forward and
    reverse mode (the default)."""
    return _recurrence_custom_jvp(operator, x0, coefficients, d=d)
