r"""The sequential method of `krylov`: one recurrence, one `lax.scan`, and its
derivative rules, for the monomial basis and for every three-term basis.

The engine builds $X = [x_0, x_1, \dots, x_{d-1}]$ on a new leading axis from

$$x_{-1} = 0, \qquad x_{k+1} = a_k A x_k + b_k x_k - c_k x_{k-1}$$

($k = 0, \dots, d - 2$, $c_0 = 0$). Without coefficients (`coefficients=None`,
`krylov`'s default) it is the monomial basis, $x_{k+1} = A x_k$, and no
coefficient enters its loops; a polynomial basis (`_bases.py`) gives the arrays
$(a, b, c)$, so that $x_k = p_k(A) x_0$.

**Reverse mode.** With output cotangents $g_0, \dots, g_{d-1}$ (one per stored
vector), the adjoint vectors satisfy $\lambda_d = 0$, $\lambda_{d-1} = g_{d-1}$ and

$$\lambda_k = g_k + a_k A^\top \lambda_{k+1} + b_k \lambda_{k+1}
  - c_{k+1} \lambda_{k+2}$$

($\lambda_k = g_k + A^\top \lambda_{k+1}$ for the monomial basis). The gradient of
$x_0$ is $\lambda_0$, that of $A$ is $\sum_k a_k \lambda_{k+1} x_k^\top$, and those
of the coefficients are, per step, $\langle A^\top \lambda_{k+1}, x_k\rangle$ for
$a_k$, $\langle \lambda_{k+1}, x_k \rangle$ for $b_k$ and
$-\langle \lambda_{k+1}, x_{k-1} \rangle$ for $c_k$ (bilinear products, no
conjugation: JAX's convention for complex numbers, what autodiff through the scan
gives). `adjoint_chunks` solves the recurrence backwards by one reverse
`lax.scan` over chunks of $k$ steps (`_chunks.gradient_chunk` chooses $k$ for the
operator's kind): each chunk's slice of the cotangent is copied once and the
vectors $a_{k-1} \lambda_k$ overwrite it, row by row, so one buffer of $k$ rows
holds both; the chunk's share of the operator's gradient is one batched product
with the matching stored vectors (a GEMM for a dense matrix, one sampled product
for BCOO, one batched VJP for a callable; `_chunks.add_param_vjp`), added to a
running sum. $A^\top \lambda_{k+1}$ serves both the adjoint and the gradient of
$a_k$, and $-\langle\lambda_{k+2}, x_k\rangle$ (the gradient of $c_{k+1}$) is
formed at the step where $x_k$ is read. The cotangent and the stored vectors are
only read, a chunk at a time, never copied whole or written, so the reverse pass
needs the forward output (its only residual, besides the operator and the
coefficients) plus a chunk's buffers, whatever form the cotangent has: a fresh
array, a broadcast constant (`X.sum()`), a closed-over weight.

**Forward and reverse mode from one rule** (`krylov_custom_jvp`, the default). A
`jax.custom_vjp` cannot be differentiated in forward mode, and JAX's own
transposition of a JVP rule would save per-step intermediates. So the JVP rule
computes the tangents

$$\dot x_{k+1} = a_k A \dot x_k + b_k \dot x_k - c_k \dot x_{k-1}
  + a_k \dot A x_k + \dot a_k A x_k + \dot b_k x_k - \dot c_k x_{k-1}$$

with a primitive (`krylov_tangent`, built by `_tangent.py`) that is linear in its
tangent arguments: its implementation is a chunked `lax.scan` (each chunk's
forcing terms from one batched product over the chunk's stored vectors), and its
transpose rule is `adjoint_chunks` above. `jax.jvp` and `jax.jacfwd` run the
tangent scan; `jax.grad` and `jax.vjp` linearise and transpose, which runs the
chunked reverse pass with the forward output as the only residual, less its last
vector $x_{d-1}$, which neither pass reads (the rule stores $x_1, \dots, x_{d-2}$
and computes $x_{d-1}$ outside that stack). That stack is written by a loop that
carries it (`_stored_tail`), so that under `vmap` over a batch of operators it has
the batch first, as the reverse pass reads it. Higher derivatives differentiate
these loops with JAX's own rules.

`krylov_custom_vjp` is the same reverse pass as a `jax.custom_vjp`, for reverse
mode only (monomial basis).
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array

from ._chunks import (
    CHUNK,
    BatchedOperator,
    DenseRowsOperator,
    add_param_vjp,
    chunk_steps,
    gradient_chunk,
    mv_add,
)
from ._operator import AbstractOperator, DenseOperator
from ._rules import fold_batch, reverse_rule, tangent_or_none
from ._sequence import trajectory, with_first
from ._sharding import check_invariant, is_split, typed_like, zeros_stack
from ._tangent import (
    coefficient_cotangents,
    is_tangent,
    like_tangent,
    nones,
    tangent_primitive,
)

# Up to this many steps, the reverse pass runs its chunks without a loop.
UNROLLED_STEPS = 16

# The arrays (a, b, c) of a three-term basis, each of shape (d - 1,); `None` for
# the monomial basis.
Coefficients = tuple[Array, Array, Array]


def _dot(x: Array, y: Array) -> Array:
    r"""The bilinear product $\sum x y$ (no conjugation)."""
    return jnp.sum(x * y)


# ----------------------------------------------------------------- forward pass


def forward_step(operator: AbstractOperator, x_prev, x: Array, abc) -> Array:
    """$x_{k+1} = a_k A x_k + b_k x_k - c_k x_{k-1}$ ($A x_k$ without
    coefficients), typed like $x_k$."""
    if abc is None:
        return typed_like(operator.mv(x), x)
    a, b, c = abc
    return typed_like(a * operator.mv(x) + b * x - c * x_prev, x)


def krylov_tail(
    operator: AbstractOperator,
    x0: Array,
    steps: int,
    coefficients: Coefficients | None = None,
) -> Array:
    r"""$[x_1, \dots, x_s]$ for $s$ = `steps`, by one `lax.scan`."""
    if coefficients is None:
        return trajectory(lambda x: typed_like(operator.mv(x), x), x0, steps)

    def body(carry, abc):
        x_prev, x = carry
        y = forward_step(operator, x_prev, x, abc)
        return (x, y), y

    rows = tuple(coef[:steps] for coef in coefficients)
    _, tail = lax.scan(body, (jnp.zeros_like(x0), x0), rows, length=steps)
    return tail


def krylov_scan(
    operator: AbstractOperator,
    x0: Array,
    d: int,
    coefficients: Coefficients | None = None,
) -> Array:
    r"""The stack $[x_0, \dots, x_{d-1}]$ by one scan, differentiated by JAX
    (`adjoint="autodiff"`)."""
    return with_first(x0, krylov_tail(operator, x0, d - 1, coefficients))


def _stored_tail(
    operator: AbstractOperator,
    x0: Array,
    steps: int,
    coefficients: Coefficients | None,
) -> Array:
    r"""$[x_1, \dots, x_s]$ like `krylov_tail`, written row by row into a stack
    that the loop carries.

    Under `vmap` over a batch of operators, a carried stack has the batch first,
    where a scan's stacked output has it second; the reverse pass's loops read the
    stack with the batch first, and would otherwise copy it whole.
    """
    stack = zeros_stack(x0, steps)
    if steps == 0:
        return stack

    if coefficients is None:

        def body(i, carry):
            x, stack = carry
            y = typed_like(operator.mv(x), x)
            return y, lax.dynamic_update_index_in_dim(stack, y, i, 0)

        return lax.fori_loop(0, steps, body, (x0, stack))[1]

    def body3(i, carry):
        x_prev, x, stack = carry
        y = forward_step(operator, x_prev, x, tuple(v[i] for v in coefficients))
        return x, y, lax.dynamic_update_index_in_dim(stack, y, i, 0)

    return lax.fori_loop(0, steps, body3, (jnp.zeros_like(x0), x0, stack))[2]


# ----------------------------------------------------------------- reverse pass


def _chunks(steps: int, chunk: int) -> tuple[int, int, int]:
    """Split the rows 1 .. steps - 1 into `full` chunks of `size` and `rest` more.

    `size` is at most `chunk`: the largest divisor of the row count between
    `chunk / 2` and `chunk` where there is one, so that no separate `rest` pass
    (whose buffers XLA keeps beside the loop's) is needed.
    """
    rows = steps - 1
    size = max(1, min(chunk, rows))
    divisors = [s for s in range(chunk // 2, chunk + 1) if s and rows % s == 0]
    if rows > chunk and divisors:
        size = divisors[-1]
    full, rest = divmod(rows, size)
    return size, full, rest


def _windows(steps: int, chunk: int) -> tuple[int, int, int]:
    """Cover the rows 1 .. steps - 1 with `count` windows of `size` rows, from the
    top down.

    `size` is a divisor of the row count between `3 chunk / 4` and `chunk` where
    there is one; else the windows are as few as chunks of `chunk` rows need and as
    even as possible, and the lowest, which starts at row 1, shares its top
    `overlap` rows (fewer than `count`) with the window above, which has done them.
    A few skipped steps cost less than a separate pass for the rest, whose chunk
    buffers XLA would keep beside the loop's.
    """
    rows = steps - 1
    divisors = [s for s in range(-(-3 * chunk // 4), chunk + 1) if rows % s == 0]
    if rows <= chunk or divisors:
        size = min(rows, chunk) if rows <= chunk else divisors[-1]
        return size, rows // size, 0
    count = -(-rows // chunk)
    size = -(-rows // count)
    return size, count, count * size - rows


def _zero_after(y: Array, dtype) -> Array:
    """An exact zero computed from one entry of `y`, so that what adds it is
    computed after `y`: a scheduling dependence that changes no value (a non-finite
    entry is replaced first, so that no `0 * inf` makes a NaN). XLA keeps it: it
    does not fold `x * 0` for floating-point `x`, and it removes optimisation
    barriers before scheduling."""
    if y.size == 0 or is_split(y):
        # Nothing to read; or one entry of an array sharded on an explicit mesh,
        # which cannot be sliced out (and would cost a collective): no tie.
        return jnp.zeros((), dtype)
    probe = y.reshape(-1)[0]
    return (jnp.where(jnp.isfinite(probe), probe, 0) * 0).astype(dtype)


def inexact_zeros(tree: Any) -> Any:
    """Zeros like the inexact arrays of a pytree (`None` elsewhere)."""
    return jtu.tree_map(jnp.zeros_like, eqx.filter(tree, eqx.is_inexact_array))


class _Reverse(eqx.Module):
    """What every step of one reverse pass reads: the operator and its transpose
    (formed once: a callable is linearised once), the stored vectors, the
    cotangent, and for a three-term basis the coefficients each row uses."""

    operator: AbstractOperator
    transpose: AbstractOperator
    tail: Array
    g_tail: Array
    # Row r computes lambda_(r+1): rows of a_(r+1), b_(r+1), c_(r+2) and a_r
    # (zero beyond the last coefficient); `None` for the monomial basis.
    rows: tuple[Array, Array, Array, Array] | None
    want_operator: bool = eqx.field(static=True)


def _coefficient_rows(coefficients: Coefficients) -> tuple[Array, Array, Array, Array]:
    a, b, c = coefficients
    steps = a.shape[0]
    zero = jnp.zeros_like(a[:1])
    a_next = jnp.concatenate([a[1:], zero])
    b_next = jnp.concatenate([b[1:], zero])
    c_next = jnp.concatenate([c[2:], zero, zero])[:steps]
    return a_next, b_next, c_next, a


def adjoint_vector(carry):
    r"""$\lambda_{k+1}$ from a carry: the vector, or the pair
    $(\lambda_{k+1}, \lambda_{k+2})$ of a three-term basis."""
    return carry if isinstance(carry, jax.Array) else carry[0]


def _weighted(rev: _Reverse, lam: Array, r) -> Array:
    r"""$a_{i-1} \lambda_i$ for row $r = i - 1$ ($\lambda_i$ for the monomial basis):
    what the operator's gradient pairs with $x_{i-1}$."""
    return lam if rev.rows is None else rev.rows[3][r] * lam


def adjoint_update(
    transpose: AbstractOperator, carry: Any, g_i: Array, x_i, abc
) -> tuple[Any, Array | None]:
    r"""The adjoint recurrence at vector $i$: from the carry $\lambda_{i+1}$ (the
    pair $(\lambda_{i+1}, \lambda_{i+2})$ for a three-term basis) and $g_i$, the
    carry with $\lambda_i$, and for a three-term basis, whose `abc` is
    $(a_i, b_i, c_{i+1})$, the products $\langle A^\top \lambda_{i+1},
    x_i\rangle$, $\langle \lambda_{i+1}, x_i\rangle$ and
    $-\langle \lambda_{i+2}, x_i\rangle$: the gradients of $a_i$, $b_i$ and
    $c_{i+1}$ (`None` for the monomial basis, whose `x_i` is not read).

    Every reverse pass runs this step: the scan's (`_adjoint_step`) and the
    readouts' (`_readout.py`)."""
    lam1 = adjoint_vector(carry)
    if abc is None:
        return typed_like(mv_add(transpose, lam1, g_i), lam1), None
    _, lam2 = carry
    a_i, b_i, c_next = abc
    u = transpose.mv(lam1)
    lam = typed_like(g_i + a_i * u + b_i * lam1 - c_next * lam2, lam1)
    dots = jnp.stack([_dot(u, x_i), _dot(lam1, x_i), -_dot(lam2, x_i)])
    return (lam, lam1), dots


def _adjoint_step(rev: _Reverse, carry, g_i: Array, r, tie: bool = False):
    r"""One row of the reverse pass: from $\lambda_{i+1}$ (and $\lambda_{i+2}$) and
    $g_i$, $i = r + 1$, the carry with $\lambda_i$, the vector $a_{i-1} \lambda_i$
    that the operator's gradient pairs with $x_{i-1}$, and (three-term basis) the
    products of `adjoint_update`. With `tie`, $g_i$ is computed after the carry
    (`_zero_after`)."""
    if tie:
        g_i = g_i + _zero_after(adjoint_vector(carry), g_i.dtype)
    if rev.rows is None:
        lam, _ = adjoint_update(rev.transpose, carry, g_i, None, None)
        return lam, lam, None
    a_next, b_next, c_next, a_prev = (v[r] for v in rev.rows)
    x_i = lax.dynamic_index_in_dim(rev.tail, r, 0, False)
    carry, dots = adjoint_update(
        rev.transpose, carry, g_i, x_i, (a_next, b_next, c_next)
    )
    return carry, a_prev * carry[0], dots


def _first_row(rev: _Reverse, g_i: Array, r):
    r"""The top row: $\lambda_{d-1} = g_{d-1}$, with no product (tied to the stored
    vectors when the operator's gradient keeps them)."""
    lam = g_i + _zero_after(rev.tail, g_i.dtype) if rev.want_operator else g_i
    if rev.rows is None:
        return lam, lam, None
    # No coefficient a_(d-1): the products are dropped.
    return (lam, jnp.zeros_like(lam)), rev.rows[3][r] * lam, jnp.zeros(3, lam.dtype)


def _reverse_rows(rev: _Reverse, carry, start, g_rows: Array, valid=None):
    r"""The rows `start .. start + size - 1` (`size` = `len(g_rows)`), last first:
    the carry below them, their vectors $a_{i-1} \lambda_i$ (if the operator's
    gradient needs them, else `None`) and their products (three-term basis).

    When the operator's gradient needs them, each vector overwrites its own row of
    cotangent in `g_rows` (a fresh chunk-sized copy, updated in place): the
    chunk's cotangents and adjoints share one buffer. Rows from `valid` (a traced
    row count; `None`: all rows) on belong to the window above: the carry passes
    through them unchanged, and their rows of the buffer and their products become
    zeros."""
    size = g_rows.shape[0]
    if size == 1:
        # One step (vectors so wide that a chunk holds one): no loop, whose carry
        # and stacked output would be two copies of the same vector.
        if carry is None:
            carry, w, dots = _first_row(rev, g_rows[0], start)
        else:
            carry, w, dots = _adjoint_step(rev, carry, g_rows[0], start, tie=True)
        return (
            carry,
            w[None] if rev.want_operator else None,
            None if dots is None else dots[None],
        )
    if carry is None:
        zeros = jnp.zeros_like(g_rows[0])
        carry = zeros if rev.rows is None else (zeros, zeros)
    last = size - 1

    def masked_step(carry, g_i, row):
        new, w, dots = _adjoint_step(rev, carry, g_i, start + row)
        if valid is None:
            return new, w, dots
        keep = row < valid
        new = jtu.tree_map(lambda n, o: jnp.where(keep, n, o), new, carry)
        # From the masked carry, as a row above would see it: the unmasked
        # adjoint then dies at the mask.
        w = _weighted(rev, adjoint_vector(new), start + row)
        w = jnp.where(keep, w, jnp.zeros_like(w))
        dots = None if dots is None else jnp.where(keep, dots, jnp.zeros_like(dots))
        return new, w, dots

    if not rev.want_operator:

        def scan_step(carry, row):
            g_i = lax.dynamic_index_in_dim(g_rows, row, 0, False)
            new, _, dots = masked_step(carry, g_i, row)
            return new, dots

        carry, dots = lax.scan(scan_step, carry, jnp.arange(size), reverse=True)
        return carry, None, dots

    dots0 = None if rev.rows is None else jnp.zeros((size, 3), g_rows.dtype)

    def overwrite(j, state):
        carry, buffer, dots_rows = state
        row = last - j
        g_i = lax.dynamic_index_in_dim(buffer, row, 0, False)
        carry, w, dots = masked_step(carry, g_i, row)
        buffer = lax.dynamic_update_index_in_dim(buffer, w, row, 0)
        if dots is not None:
            dots_rows = lax.dynamic_update_index_in_dim(dots_rows, dots, row, 0)
        return carry, buffer, dots_rows

    return lax.fori_loop(0, size, overwrite, (carry, g_rows, dots0))


def _pairs(rev: _Reverse, start, size: int, state, valid=None):
    r"""Rows `start .. start + size - 1` of the tail: their adjoint vectors, the
    gradient of $\sum_i \langle a_{i-1}\lambda_i, A x_{i-1}\rangle$ over them as
    one batched product added to the running sum, and their products added to
    the coefficients' running sums."""
    carry, grad, dsum = state
    # A slice of the cotangent, not an index into it inside the loop: XLA then
    # never materialises a broadcast cotangent (the cotangent of `X.sum()`).
    g_rows = lax.dynamic_slice_in_dim(rev.g_tail, start, size)
    carry, w, dots = _reverse_rows(rev, carry, start, g_rows, valid)
    if rev.want_operator:
        assert w is not None
        grad = add_param_vjp(rev.operator, grad, rev.tail, start - 1, w)
    if dots is not None:
        part = lax.dynamic_slice_in_dim(dsum, start, size)
        dsum = lax.dynamic_update_slice_in_dim(dsum, part + dots, start, 0)
    return carry, grad, dsum


def _coefficient_gradients(dsum: Array, first: Array) -> Coefficients:
    """The gradients of $(a, b, c)$ from the rows' products (row $r$ holds those of
    $a_{r+1}$, $b_{r+1}$ and $c_{r+2}$) and step 0's (of $a_0$, $b_0$, $c_1$)."""
    steps = dsum.shape[0]
    da = jnp.concatenate([first[:1], dsum[: steps - 1, 0]])
    db = jnp.concatenate([first[1:2], dsum[: steps - 1, 1]])
    zero = jnp.zeros_like(first[:1])
    # c_0 multiplies x_(-1) = 0.
    dc = jnp.concatenate([zero, first[2:], dsum[: max(steps - 2, 0), 2]])[:steps]
    return da, db, dc


def adjoint_chunks(
    operator: AbstractOperator,
    x0: Array,
    tail: Array,
    g_tail: Array,
    want_operator: bool,
    coefficients: Coefficients | None = None,
    chunk: int | None = None,
) -> tuple[Array, AbstractOperator | None, Coefficients | None]:
    r"""The reverse pass over the computed vectors $x_1, \dots, x_{d-1}$.

    `g_tail` is the cotangent of the stack $[x_1, \dots, x_{d-1}]$, and `tail`
    holds at least $x_1, \dots, x_{d-2}$ (the last vector is never read: the
    tangent primitive stores only those). Solves the adjoint recurrence from
    $\lambda_{d-1}$ down to $\lambda_1$, `chunk` steps at a time (see the module
    docstring). Returns the gradient of $x_0$ through the steps (JAX adds $g_0$,
    since $x_0$ is put in front outside the rule), and, if `want_operator`,
    $\sum_{k} a_k \lambda_{k+1} x_k^\top$ as a cotangent of the operator (else
    `None`), and the gradients of the coefficients (`None` without them).
    """
    steps = g_tail.shape[0]
    rows = None if coefficients is None else _coefficient_rows(coefficients)
    # The transpose is formed once, outside the loops: a callable is linearised once.
    rev = _Reverse(operator, operator.transpose(), tail, g_tail, rows, want_operator)
    grad = inexact_zeros(operator) if want_operator else None
    dsum = None if rows is None else jnp.zeros((steps, 3), g_tail.dtype)
    # Outside the loops (wide vectors, the last rows), each cotangent row the
    # product adds into is tied to the vector before it (`_zero_after`), and the
    # first adjoint to the stored vectors when the operator's gradient keeps them.
    # The adjoints do not depend on the forward pass, and XLA would otherwise
    # materialise every broadcast cotangent row (the cotangent of `sum(X * W)`)
    # at the start of the program and keep them all live across the forward
    # scan: for a graph filter at n = 170k that was 3 of 8.4 vectors of temporary
    # memory, and 2 of 3 without the edge weights.
    most = chunk or chunk_steps(x0, gradient_chunk(operator, x0.size))
    size, full, rest = _chunks(steps, most)
    # The carry is `None` until the first row is done: lambda_(d-1) = g_(d-1).
    state = (None, grad, dsum)
    if full * size <= UNROLLED_STEPS:
        # A few steps of wide vectors (a graph filter): chunks in Python, whose
        # static slices of the cotangent XLA fuses with a broadcast cotangent; a
        # loop would take the whole cotangent, materialised, as its operand. Rows
        # 1 .. steps - 1 pair with the stored vector one row up: `full` chunks of
        # `size` rows and `rest` rows at the end, which go first.
        if rest:
            state = _pairs(rev, steps - rest, rest, state)
        for c in reversed(range(full)):
            state = _pairs(rev, 1 + c * size, size, state)
    else:
        # One loop over windows of `size` rows from the top down; the lowest may
        # share rows with the one above (see `_windows`).
        size, count, overlap = _windows(steps, most)

        def chunk_step(state, c):
            top = steps - (count - c) * size
            start = jnp.maximum(1, top)
            valid = size - (start - top) if overlap else None
            return _pairs(rev, start, size, state, valid), None

        zeros = jnp.zeros_like(x0)
        state = (zeros if rows is None else (zeros, zeros), *state[1:])
        state, _ = lax.scan(chunk_step, state, jnp.arange(count), reverse=True)
    carry, grad, dsum = state
    # Row 0, lambda_1, pairs with x0, which is not in the tail.
    if carry is None:
        carry, w, dots = _first_row(rev, g_tail[0], 0)
    else:
        carry, w, dots = _adjoint_step(rev, carry, g_tail[0], 0, tie=True)
    lam1 = typed_like(adjoint_vector(carry), x0)
    if want_operator:
        assert grad is not None
        grad = add_param_vjp(operator, grad, x0[None], 0, typed_like(w, x0)[None])
    # The transpose that served every step serves x0 too, adding into zeros tied
    # to lambda_1 like the rows above.
    zeros = jnp.zeros_like(x0) + _zero_after(lam1, x0.dtype)
    if coefficients is None:
        return typed_like(mv_add(rev.transpose, lam1, zeros), lam1), grad, None
    assert dsum is not None and dots is not None
    dsum = dsum.at[0].set(dots)
    a, b, c = coefficients
    lam2 = carry[1]
    c1 = c[1] if steps > 1 else jnp.zeros_like(c[0])
    u = rev.transpose.mv(lam1)
    ct_x0 = typed_like(zeros + a[0] * u + b[0] * lam1 - c1 * lam2, x0)
    first = jnp.stack([_dot(u, x0), _dot(lam1, x0), -_dot(lam2, x0)])
    return ct_x0, grad, _coefficient_gradients(dsum, first)


# ------------------------------------------------------------ forward mode


def _forcing(operator, t_operator, xs, xs_prev, abc, t_abc):
    r"""The forcing terms of a chunk's tangent steps: $\dot A x_k$ (monomial), or
    $a_k \dot A x_k + \dot a_k A x_k + \dot b_k x_k - \dot c_k x_{k-1}$, from one
    batched product over the chunk's stored vectors `xs` (`operator.mm`,
    differentiated in the direction `t_operator`; `None`: $\dot A = 0$); `None`
    where every term is zero."""
    t_a, t_b, t_c = (None, None, None) if t_abc is None else t_abc
    products = t_operator is not None or t_a is not None
    r = None
    if products:
        if t_operator is None:
            y, t_y = operator.mm(xs), None
        else:
            y, t_y = eqx.filter_jvp(lambda op: op.mm(xs), (operator,), (t_operator,))
        if abc is None:
            return t_y
        shape = (-1, *([1] * (xs.ndim - 1)))
        if t_y is not None:
            r = abc[0].reshape(shape) * t_y
        if t_a is not None:
            term = t_a.reshape(shape) * y
            r = term if r is None else r + term
    shape = (-1, *([1] * (xs.ndim - 1)))
    if t_b is not None:
        term = t_b.reshape(shape) * xs
        r = term if r is None else r + term
    if t_c is not None:
        term = -t_c.reshape(shape) * xs_prev
        r = term if r is None else r + term
    return r


def _tangent_steps(operator, carry, r, abc, length: int):
    """A chunk's `length` tangent steps (`lax.scan`): the recurrence on the
    tangents, plus the forcing terms `r` (`None`: zero)."""

    def step(carry, row):
        r_k, abc_k = row
        if abc is None:
            t = carry
            t_next = operator.mv(t) if r_k is None else operator.mv(t) + r_k
            t_next = typed_like(t_next, t)
            return t_next, t_next
        t_prev, t = carry
        t_next = forward_step(operator, t_prev, t, abc_k)
        t_next = t_next if r_k is None else typed_like(t_next + r_k, t)
        return (t, t_next), t_next

    return lax.scan(step, carry, (r, abc), length=length)


def tangent_chunks(
    operator: AbstractOperator,
    x0: Array,
    stored: Array,
    coefficients: Coefficients | None,
    t_operator: AbstractOperator | None,
    t_x0: Array,
    t_coefficients: tuple | None,
    chunk: int | None = None,
) -> Array:
    r"""The tangents $[\dot x_1, \dots, \dot x_{d-1}]$ of the tail.

    `stored` is $[x_1, \dots, x_{d-2}]$: the tail without its last vector, which
    no tangent reads. Runs `chunk` steps at a time, each chunk's forcing terms as
    one batched product (`_forcing`); `t_operator` `None` means $\dot A = 0$, a
    `None` among `t_coefficients` that that coefficient's tangent is zero.
    """
    steps = stored.shape[0] + 1
    three = coefficients is not None
    if t_coefficients is not None and all(t is None for t in t_coefficients):
        t_coefficients = None
    wants_prev = t_coefficients is not None and t_coefficients[2] is not None

    def rows(v, start, size):
        return None if v is None else lax.dynamic_slice_in_dim(v, start, size)

    def forward(carry, x_last, xs, start):
        # Steps start .. start + size - 1, whose x_k are `xs` and whose x_(k-1)
        # are `x_last` (the vector before the chunk) and `xs` less its last row.
        size = xs.shape[0]
        abc = None
        if coefficients is not None:
            abc = tuple(rows(v, start, size) for v in coefficients)
        t_abc = None
        if t_coefficients is not None:
            t_abc = tuple(rows(v, start, size) for v in t_coefficients)
        xs_prev = None
        if wants_prev:
            xs_prev = jnp.concatenate([x_last[None], xs[:-1]])
        r = _forcing(operator, t_operator, xs, xs_prev, abc, t_abc)
        return _tangent_steps(operator, carry, r, abc, size)

    # Step 0 uses x0 (and x_(-1) = 0); steps 1 .. steps - 1 use the stored
    # vectors one row up.
    carry = (jnp.zeros_like(t_x0), t_x0) if three else t_x0
    x_before = jnp.zeros_like(x0) if wants_prev else None
    carry, first = forward(carry, x_before, x0[None], 0)
    parts = [first]
    size, full, rest = _chunks(steps, chunk or chunk_steps(x0, CHUNK))
    # The vector before a chunk, carried only where x_(k-1) is read.
    x_last = x0 if wants_prev else None
    if full:

        def chunk_step(state, c):
            carry, x_last = state
            xs = lax.dynamic_slice_in_dim(stored, c * size, size)
            carry, ts = forward(carry, x_last, xs, 1 + c * size)
            return (carry, xs[-1] if wants_prev else None), ts

        (carry, x_last), ts = lax.scan(chunk_step, (carry, x_last), jnp.arange(full))
        parts.append(ts.reshape(full * size, *ts.shape[2:]))
    if rest:
        xs = stored[full * size : full * size + rest]
        _, ts = forward(carry, x_last, xs, 1 + full * size)
        parts.append(ts)
    return jnp.concatenate(parts)


def _tangent_transpose(inputs, g):
    operator, x0, stored, coefficients, t_operator, t_x0, t_coefficients = inputs
    want_operator = is_tangent(t_operator)
    ct_x0, ct_operator, ct_coefficients = adjoint_chunks(
        operator, x0, stored, g, want_operator, coefficients
    )
    ct_operator = like_tangent(t_operator, ct_operator) if want_operator else None
    ct_coefficients = coefficient_cotangents(t_coefficients, ct_coefficients)
    return (
        nones(operator),
        nones(x0),
        nones(stored),
        nones(coefficients),
        ct_operator if want_operator else nones(t_operator),
        ct_x0,
        ct_coefficients,
    )


def _tangent_batch(bind, args, axes):
    # Under `vmap` with one operator and one basis for the whole batch (the usual
    # case: a batch of starting vectors), the batch becomes part of each vector,
    # so that `grad` of the vmapped call still runs `adjoint_chunks`. Otherwise (a
    # batch of operators, of bases, or of their tangents) the implementation is
    # vmapped instead.
    operator, x0, stored, coefficients, t_operator, t_x0, t_coefficients = args
    op_ax, x0_ax, stored_ax, coef_ax, t_op_ax, t_x0_ax, t_coef_ax = axes
    shared = (op_ax, coef_ax, t_op_ax, t_coef_ax)
    if any(a is not None for a in jtu.tree_leaves(shared)):
        return None
    x0, stored, t_x0 = fold_batch(
        (x0, stored, t_x0), (x0_ax, stored_ax, t_x0_ax), (0, 1, 0)
    )
    t_operator = None if t_operator is None else BatchedOperator(t_operator)
    out = bind(
        BatchedOperator(operator),
        x0,
        stored,
        coefficients,
        t_operator,
        t_x0,
        t_coefficients,
    )
    return out, 1


# Arguments: (operator, x0, stored, coefficients, t_operator, t_x0, t_coefficients);
# the tangents are like `stored` with one more row (the last vector, which no
# tangent or adjoint reads).
krylov_tangent = tangent_primitive(
    "krylov_tangent",
    tangent_chunks,
    _tangent_transpose,
    like=2,
    batch=_tangent_batch,
    extra_rows=1,
)


@eqx.filter_custom_jvp
def _krylov_custom_jvp(operator, x0, coefficients, *, d: int):
    return krylov_scan(operator, x0, d, coefficients)


@_krylov_custom_jvp.def_jvp
def _krylov_jvp(primals, tangents, *, d):
    check_invariant(primals, "The derivative of `krylov`")
    operator, x0, coefficients = primals
    t_operator, t_x0, t_coefficients = tangents
    # The derivative rules read x_1 .. x_(d-2) only: the last vector is computed
    # outside the stored stack, so that reverse mode does not keep it.
    stored = _stored_tail(operator, x0, d - 2, coefficients)
    x = x0 if d == 2 else stored[-1]
    abc = None
    x_prev = None
    if coefficients is not None:
        x_prev = x0 if d == 3 else jnp.zeros_like(x0) if d == 2 else stored[-2]
        abc = tuple(coef[d - 2] for coef in coefficients)
    last = forward_step(operator, x_prev, x, abc)
    tail = jnp.concatenate([stored, last[None]])
    t_x0 = jnp.zeros_like(x0) if t_x0 is None else t_x0
    t_operator = tangent_or_none(t_operator)
    if coefficients is not None and t_coefficients is None:
        t_coefficients = (None, None, None)
    if t_coefficients is not None:
        t_coefficients = tuple(t_coefficients)
    t_tail = krylov_tangent(
        operator, x0, stored, coefficients, t_operator, t_x0, t_coefficients
    )
    return with_first(x0, tail), with_first(t_x0, t_tail)


def _krylov_adjoint(operator, x0, tail, g_tail, want_operator, d):
    del d
    ct_x0, ct_operator, _ = adjoint_chunks(operator, x0, tail, g_tail, want_operator)
    return ct_operator, ct_x0


# The monomial scan's reverse pass as a `jax.custom_vjp` of the steps (x0 goes in
# front outside it; see `_sequence.py`).
_krylov_tail_custom_vjp = reverse_rule(
    lambda operator, x0, d: krylov_tail(operator, x0, d - 1), _krylov_adjoint
)


# ------------------------------------------------------------------ the builders
#
# What `krylov` dispatches to, one per derivative rule: `(operator, x0, d)` -> the
# stack `(d, *x0.shape)` for the monomial basis, `(operator, x0, coefficients, d)`
# for a three-term basis.


def _dense_block_as_rows(rule):
    """`rule`, run on a block's transpose when `A` is dense and `x0` a block.

    With `x0` of shape `(n, b)` and a dense `A`, the scan runs on `x0.T`, one vector
    per row, through `DenseRowsOperator` (its docstring says why), and the stack
    `(d, b, n)` is transposed back to `(d, n, b)`.
    """

    def build(operator: AbstractOperator, x0: Array, *args) -> Array:
        if isinstance(operator, DenseOperator) and x0.ndim == 2:
            zs = rule(DenseRowsOperator(operator.matrix.T), x0.T, *args)
            return jnp.swapaxes(zs, 1, 2)
        return rule(operator, x0, *args)

    return build


def _custom_jvp(operator: AbstractOperator, x0: Array, d: int) -> Array:
    return _krylov_custom_jvp(operator, x0, None, d=d)


def _custom_vjp(operator: AbstractOperator, x0: Array, d: int) -> Array:
    return with_first(x0, _krylov_tail_custom_vjp(operator, x0, d))


def _basis_custom_jvp(operator, x0, coefficients: Coefficients, d: int) -> Array:
    return _krylov_custom_jvp(operator, x0, coefficients, d=d)


def _basis_scan(operator, x0, coefficients: Coefficients, d: int) -> Array:
    return krylov_scan(operator, x0, d, coefficients)


# The scan with one rule for forward and reverse mode (the default).
krylov_custom_jvp = _dense_block_as_rows(_custom_jvp)
# The scan with the same reverse pass as a `jax.custom_vjp` (reverse mode only).
krylov_custom_vjp = _dense_block_as_rows(_custom_vjp)
# A three-term basis, with the default's rule and with JAX's (`"autodiff"`).
basis_custom_jvp = _dense_block_as_rows(_basis_custom_jvp)
basis_scan = _dense_block_as_rows(_basis_scan)
