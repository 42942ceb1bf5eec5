r"""The sequential method of `krylov`: one `lax.scan`, and its derivative rules.

The forward pass is one `lax.scan` of $d - 1$ applications of $A$, stacked as
$X = [x_0, x_1, \dots, x_{d-1}]$ on a new leading axis.

**Reverse mode.** With output cotangents $g_0, \dots, g_{d-1}$ (one per stored
vector), the adjoint vectors satisfy

$$\lambda_{d-1} = g_{d-1}, \qquad \lambda_i = g_i + A^\top \lambda_{i+1},$$

and then the gradient of $x_0$ is $\lambda_0$ and the gradient of $A$ is
$\sum_{i=1}^{d-1} \lambda_i x_{i-1}^\top$. `adjoint_chunks` solves the recurrence
backwards by one reverse `lax.scan` over chunks of $k$ steps (the operator
chooses $k$: `_chunks.gradient_chunk`): each chunk's slice of the
cotangent is copied once and its adjoint vectors overwrite it, row by row, so one
buffer of $k$ rows holds both; the chunk's share of the
operator's gradient is one batched product with the matching stored vectors (a
GEMM for a dense matrix, one sampled product for BCOO, one batched VJP for a
callable; see `_operator.py`), added to a running sum. The cotangent and the
stored vectors are only read, a chunk at a time, never copied whole or written, so
the reverse pass needs the forward output (its only residual, besides the
operator) plus a chunk's buffers (the adjoints, the slice of stored vectors the
product reads, one block of the product), whatever form the cotangent has: a
fresh array, a broadcast constant (`X.sum()`), a closed-over weight.

The transpose is JAX's convention for complex numbers too: the rule computes the
vector-Jacobian product (plain transpose, no conjugation), exactly what autodiff
through the scan would give.

**Forward and reverse mode from one rule** (`krylov_custom_jvp`, the default). A
`jax.custom_vjp` cannot be differentiated in forward mode, and JAX's own
transposition of a JVP rule would save per-step intermediates. So the JVP rule
computes the tangents

$$\dot x_0 = \dot x_0, \qquad \dot x_{k+1} = A \dot x_k + \dot A x_k$$

with a primitive (`tangent_p`) that is linear in $(\dot A, \dot x_0)$: its
implementation is a chunked `lax.scan` (each chunk's $\dot A x_k$ in one batched
product), and its transpose rule is `adjoint_chunks` above. `jax.jvp` and
`jax.jacfwd` run the tangent scan; `jax.grad` and `jax.vjp` linearise and
transpose, which runs the chunked reverse pass with the forward output as the
only residual, less its last vector $x_{d-1}$, which neither pass reads (the rule
stores $x_1, \dots, x_{d-2}$ and computes $x_{d-1}$ outside that stack). That stack
is written by a loop that carries it (`_stored_tail`), so that under `vmap` over a
batch of operators it has the batch first, as the reverse pass reads it. Higher
derivatives differentiate these loops with JAX's own rules.

`krylov_custom_vjp` is the same reverse pass as a `jax.custom_vjp`, for reverse
mode only.
"""

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array

from ._chunks import (
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
from ._sharding import is_split, typed_like
from ._tangent import is_tangent, like_tangent, nones, tangent_primitive

# Up to this many steps, the reverse pass runs its chunks without a loop.
UNROLLED_STEPS = 16


def krylov_scan(operator: AbstractOperator, x0: Array, d: int) -> Array:
    r"""$[x_0, A x_0, \dots, A^{d-1} x_0]$ stacked on a new first axis, by one scan,
    differentiated by JAX (`adjoint="autodiff"`)."""
    return with_first(x0, krylov_tail(operator, x0, d - 1))


def krylov_tail(operator: AbstractOperator, x0: Array, steps: int) -> Array:
    r"""$[A x_0, \dots, A^{s} x_0]$ for $s$ = `steps`, by one `lax.scan`."""
    return trajectory(lambda x: typed_like(operator.mv(x), x), x0, steps)


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


def _inexact_zeros(operator: AbstractOperator) -> AbstractOperator:
    return jtu.tree_map(jnp.zeros_like, eqx.filter(operator, eqx.is_inexact_array))


def adjoint_chunks(
    operator: AbstractOperator,
    x0: Array,
    tail: Array,
    g_tail: Array,
    want_operator: bool,
    chunk: int | None = None,
) -> tuple[Array, AbstractOperator | None]:
    r"""The reverse pass over the computed vectors $x_1, \dots, x_{d-1}$.

    `g_tail` is the cotangent of the stack $[x_1, \dots, x_{d-1}]$, and `tail`
    holds at least $x_1, \dots, x_{d-2}$ (the last vector is never read: the
    tangent primitive stores only those).
    Solves $\lambda_i = g_i + A^\top \lambda_{i+1}$ from $i = d - 1$ down to $1$,
    `chunk` steps at a time (see the module docstring). Returns $A^\top \lambda_1$,
    the gradient of $x_0$ through the steps (JAX adds $g_0$, since $x_0$ is put in
    front outside the rule), and, if `want_operator`,
    $\sum_{i \ge 1} \lambda_i x_{i-1}^\top$ as a cotangent of the operator (else
    `None`).
    """
    steps = g_tail.shape[0]
    # Called once, outside the loops: a callable is linearised once.
    transpose = operator.transpose()

    def step(lam_next, g_i):
        return typed_like(mv_add(transpose, lam_next, g_i), lam_next)

    # Outside the loops (wide vectors, the last rows), each cotangent row the
    # product adds into is tied to the vector before it (`_zero_after`), and the
    # first adjoint to the stored vectors when the operator's gradient keeps them.
    # The adjoints do not depend on the forward pass, and XLA would otherwise
    # materialise every broadcast cotangent row (the cotangent of `sum(X * W)`)
    # at the start of the program and keep them all live across the forward
    # scan: for a graph filter at n = 170k that was 3 of 8.4 vectors of temporary
    # memory, and 2 of 3 without the edge weights.
    def tied_step(lam_next, g_i):
        return step(lam_next, g_i + _zero_after(lam_next, g_i.dtype))

    def first(g_i):
        return g_i + _zero_after(tail, g_i.dtype) if want_operator else g_i

    def reverse(lam_next, g_rows, valid=None):
        # The adjoint vectors of the rows of `g_rows`, last first. When the
        # operator's gradient needs them, each overwrites its own row of cotangent
        # in `g_rows` (a fresh chunk-sized copy, updated in place): the chunk's
        # cotangents and adjoints share one buffer. Rows from `valid` (a traced row
        # count; `None`: all rows) on belong to the window above: the adjoint passes
        # through them unchanged, and their rows of the buffer become zeros.
        if g_rows.shape[0] == 1:
            # One step (vectors so wide that a chunk holds one): no loop, whose
            # carry and stacked output would be two copies of the same vector.
            # The last row's adjoint is its cotangent: no product with zeros.
            g_i = g_rows[0]
            lam_i = first(g_i) if lam_next is None else tied_step(lam_next, g_i)
            return lam_i, lam_i[None] if want_operator else None
        if lam_next is None:
            lam_next = jnp.zeros_like(x0)
        last = g_rows.shape[0] - 1

        def masked_step(lam_next, g_i, row):
            lam_i = step(lam_next, g_i)
            if valid is None:
                return lam_i, lam_i
            keep = row < valid
            lam_i = jnp.where(keep, lam_i, lam_next)
            return lam_i, jnp.where(keep, lam_i, jnp.zeros_like(lam_i))

        if not want_operator:

            def scan_step(lam, row):
                g_i = lax.dynamic_index_in_dim(g_rows, row, 0, False)
                return masked_step(lam, g_i, row)[0], None

            return lax.scan(scan_step, lam_next, jnp.arange(last + 1), reverse=True)

        def overwrite(j, carry):
            lam_next, buffer = carry
            row = last - j
            g_i = lax.dynamic_index_in_dim(buffer, row, 0, False)
            lam_i, out = masked_step(lam_next, g_i, row)
            return lam_i, lax.dynamic_update_index_in_dim(buffer, out, row, 0)

        return lax.fori_loop(0, last + 1, overwrite, (lam_next, g_rows))

    def pairs(start, size, lam_next, acc, valid=None):
        # Rows start .. start + size - 1 of the tail: their adjoint vectors, and
        # the gradient of sum_i <lam_i, A x_(i-1)> over them as one batched
        # product, added to `acc`.
        # A slice of the cotangent, not an index into it inside the loop: XLA then
        # never materialises a broadcast cotangent (the cotangent of `X.sum()`).
        g_rows = lax.dynamic_slice_in_dim(g_tail, start, size)
        lam_next, lams = reverse(lam_next, g_rows, valid)
        if want_operator:
            assert acc is not None and lams is not None
            acc = add_param_vjp(operator, acc, tail, start - 1, lams)
        return lam_next, acc

    most = chunk or chunk_steps(x0, gradient_chunk(operator, x0.size))
    # `None` until the first row is done: lambda_(d-1) = g_(d-1).
    lam_next = None
    grad = _inexact_zeros(operator) if want_operator else None
    size, full, rest = _chunks(steps, most)
    if full * size <= UNROLLED_STEPS:
        # A few steps of wide vectors (a graph filter): chunks in Python, whose
        # static slices of the cotangent XLA fuses with a broadcast cotangent; a
        # loop would take the whole cotangent, materialised, as its operand. Rows
        # 1 .. steps - 1 pair with the stored vector one row up: `full` chunks of
        # `size` rows and `rest` rows at the end, which go first.
        if rest:
            lam_next, grad = pairs(steps - rest, rest, lam_next, grad)
        for c in reversed(range(full)):
            lam_next, grad = pairs(1 + c * size, size, lam_next, grad)
    else:
        # One loop over windows of `size` rows from the top down; the lowest may
        # share rows with the one above (see `_windows`).
        size, count, overlap = _windows(steps, most)

        def chunk_step(carry, c):
            top = steps - (count - c) * size
            start = jnp.maximum(1, top)
            valid = size - (start - top) if overlap else None
            return pairs(start, size, *carry, valid=valid), None

        lam_next = jnp.zeros_like(x0)
        (lam_next, grad), _ = lax.scan(
            chunk_step, (lam_next, grad), jnp.arange(count), reverse=True
        )
    # Row 0, lam_1, pairs with x0, which is not in the tail.
    g_1 = g_tail[0]
    lam1 = first(g_1) if lam_next is None else tied_step(lam_next, g_1)
    lam1 = typed_like(lam1, x0)
    if want_operator:
        assert grad is not None
        grad = add_param_vjp(operator, grad, x0[None], 0, lam1[None])
    # The transpose that served every step serves x0 too, adding into zeros
    # tied to lam_1 like the rows above.
    return tied_step(lam1, jnp.zeros_like(x0)), grad


def _krylov_adjoint(operator, x0, tail, g_tail, want_operator, d):
    del d
    grad_x0, grad_operator = adjoint_chunks(operator, x0, tail, g_tail, want_operator)
    return grad_operator, grad_x0


# The reverse pass as a `jax.custom_vjp` of the steps: x0 goes in front outside
# of it (see `_sequence.py`).
_krylov_tail_custom_vjp = reverse_rule(
    lambda operator, x0, d: krylov_tail(operator, x0, d - 1), _krylov_adjoint
)


def _krylov_custom_vjp(operator: AbstractOperator, x0: Array, d: int) -> Array:
    return with_first(x0, _krylov_tail_custom_vjp(operator, x0, d))


# ------------------------------------------------------------ forward mode


def tangent_chunks(
    operator: AbstractOperator,
    x0: Array,
    stored: Array,
    t_operator: AbstractOperator | None,
    t_x0: Array,
    chunk: int | None = None,
) -> Array:
    r"""The tangents $\dot x_{k+1} = A \dot x_k + \dot A x_k$ of the tail.

    `stored` is $[x_1, \dots, x_{d-2}]$: the tail without its last vector, which
    no tangent reads. Returns $[\dot x_1, \dots, \dot x_{d-1}]$. Runs `chunk`
    steps at a time, each chunk's $\dot A x_k$ as one batched product
    (`operator.mm` differentiated in the direction `t_operator`); `t_operator`
    `None` means $\dot A = 0$.
    """
    steps = stored.shape[0] + 1

    def forward(t, xs):
        if t_operator is None:
            r = None
        else:
            _, r = eqx.filter_jvp(lambda op: op.mm(xs), (operator,), (t_operator,))

        def step(t, r_k):
            t_next = operator.mv(t) if r_k is None else operator.mv(t) + r_k
            t_next = typed_like(t_next, t)
            return t_next, t_next

        return lax.scan(step, t, r, length=xs.shape[0])

    # Step 0 uses x0; steps 1 .. steps - 1 use the stored vectors one row up.
    t, first = forward(t_x0, x0[None])
    parts = [first]
    size, full, rest = _chunks(steps, chunk or chunk_steps(x0))
    if full:

        def chunk_step(t, c):
            return forward(t, lax.dynamic_slice_in_dim(stored, c * size, size))

        t, ts = lax.scan(chunk_step, t, jnp.arange(full))
        parts.append(ts.reshape(full * size, *ts.shape[2:]))
    if rest:
        _, ts = forward(t, stored[full * size : full * size + rest])
        parts.append(ts)
    return jnp.concatenate(parts)


def _tangent_transpose(inputs, g):
    operator, x0, tail, t_operator, t_x0 = inputs
    want_operator = is_tangent(t_operator)
    ct_x0, ct_operator = adjoint_chunks(operator, x0, tail, g, want_operator)
    if want_operator:
        ct_operator = like_tangent(t_operator, ct_operator)
    else:
        ct_operator = nones(t_operator)
    return nones(operator), nones(x0), nones(tail), ct_operator, ct_x0


def _tangent_batch(bind, args, axes):
    # Under `vmap` with one operator for the whole batch (the usual case: a batch of
    # starting vectors), the batch becomes part of each vector, so that `grad` of
    # the vmapped call still runs `adjoint_chunks`. Otherwise (a batch of operators
    # or of operator tangents) the implementation is vmapped instead.
    operator, x0, tail, t_operator, t_x0 = args
    op_axes, x0_axis, tail_axis, t_op_axes, t_x0_axis = axes
    if any(a is not None for a in jtu.tree_leaves((op_axes, t_op_axes))):
        return None
    x0, tail, t_x0 = fold_batch(
        (x0, tail, t_x0), (x0_axis, tail_axis, t_x0_axis), (0, 1, 0)
    )
    t_operator = None if t_operator is None else BatchedOperator(t_operator)
    out = bind(BatchedOperator(operator), x0, tail, t_operator, t_x0)
    return out, 1


# Arguments: (operator, x0, stored, t_operator, t_x0); the tangents are like `stored`
# with one more row (the last vector, which no tangent or adjoint reads).
krylov_tangent = tangent_primitive(
    "krylov_tangent",
    tangent_chunks,
    _tangent_transpose,
    like=2,
    batch=_tangent_batch,
    extra_rows=1,
)


def _stored_tail(operator: AbstractOperator, x0: Array, steps: int) -> Array:
    r"""$[A x_0, \dots, A^{s} x_0]$ like `krylov_tail`, written row by row into a
    stack that the loop carries.

    Under `vmap` over a batch of operators, a carried stack has the batch first,
    where a scan's stacked output has it second; the reverse pass's loops read the
    stack with the batch first, and would otherwise copy it whole.
    """
    stack = jnp.broadcast_to(jnp.zeros_like(x0)[None], (steps, *x0.shape))
    if steps == 0:
        return stack

    def body(i, carry):
        x, stack = carry
        y = typed_like(operator.mv(x), x)
        return y, lax.dynamic_update_index_in_dim(stack, y, i, 0)

    return lax.fori_loop(0, steps, body, (x0, stack))[1]


@eqx.filter_custom_jvp
def _krylov_custom_jvp(operator: AbstractOperator, x0: Array, *, d: int) -> Array:
    return krylov_scan(operator, x0, d)


@_krylov_custom_jvp.def_jvp
def _krylov_jvp(primals, tangents, *, d):
    operator, x0 = primals
    t_operator, t_x0 = tangents
    # The derivative rules read x_1 .. x_(d-2) only: the last vector is computed
    # outside the stored stack, so that reverse mode does not keep it.
    stored = _stored_tail(operator, x0, d - 2)
    before_last = x0 if d == 2 else stored[-1]
    last = typed_like(operator.mv(before_last), before_last)
    tail = jnp.concatenate([stored, last[None]])
    t_x0 = jnp.zeros_like(x0) if t_x0 is None else t_x0
    t_operator = tangent_or_none(t_operator)
    t_tail = krylov_tangent(operator, x0, stored, t_operator, t_x0)
    return with_first(x0, tail), with_first(t_x0, t_tail)


# ------------------------------------------------------------------ the builders
#
# What `krylov` dispatches to: one per derivative rule, all `(operator, x0, d)` ->
# the stack `(d, *x0.shape)`.


def _dense_block_as_rows(rule):
    """`rule`, run on a block's transpose when `A` is dense and `x0` a block.

    With `x0` of shape `(n, b)` and a dense `A`, the scan runs on `x0.T`, one vector
    per row, through `DenseRowsOperator` (its docstring says why), and the stack
    `(d, b, n)` is transposed back to `(d, n, b)`.
    """

    def build(operator: AbstractOperator, x0: Array, d: int) -> Array:
        if isinstance(operator, DenseOperator) and x0.ndim == 2:
            zs = rule(DenseRowsOperator(operator.matrix.T), x0.T, d)
            return jnp.swapaxes(zs, 1, 2)
        return rule(operator, x0, d)

    return build


def _custom_jvp(operator: AbstractOperator, x0: Array, d: int) -> Array:
    return _krylov_custom_jvp(operator, x0, d=d)


# The scan with one rule for forward and reverse mode (the default).
krylov_custom_jvp = _dense_block_as_rows(_custom_jvp)
# The scan with the same reverse pass as a `jax.custom_vjp` (reverse mode only).
krylov_custom_vjp = _dense_block_as_rows(_krylov_custom_vjp)
