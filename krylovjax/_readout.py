r"""Readouts of a Krylov sequence without the Krylov matrix: `krylov_readout`
($[C x_0, \dots, C x_{d-1}]$) and `polynomial_action` ($\sum_k \theta_k x_k$).

Both run the recurrence of `_scan.py`,
$x_{k+1} = a_k A x_k + b_k x_k - c_k x_{k-1}$ ($A x_k$ for the monomial basis),
and add the readout of each vector to the output as it is made, so the forward
pass keeps one or two vectors and the output. What they read off is a
`_Readout`: a piece $r_k(x_k)$ per step (`piece`), linear in $x_k$ and in the
readout's own arrays, put into the output (`put`: a row of it, or a sum).

**Reverse pass.** With $\bar y$ the output's cotangent, the vectors' cotangents
are $g_k = r_k^\top(\bar y)$ and the adjoint recurrence is the scan's
(`_scan.adjoint_update`), but it pairs $\lambda_{k+1}$ with $x_k$ in reverse
order, and the $x_k$ are not all stored. It may keep `checkpoints` vectors (pairs
of vectors for a three-term basis) besides its working ones, and
`_schedule.plan_checkpoints` splits them into checkpoints every $s$ vectors,
stored by the forward pass in the same loop that makes the output, and spare
ones. The reverse pass takes the segments from the last to the first:

- with $s - 1$ spare vectors it recomputes the segment from its checkpoint into
  one buffer (`_recompute`) and runs the segment's adjoint steps from the top,
  each reading $x_k$ from the buffer, forming $g_k$ and the readout's gradient at
  step $k$ (a VJP of `piece`), $\lambda_k$, and the pairing
  $a_k \lambda_{k+1} x_k^\top$ of the operator's gradient. For small vectors
  (`SMALL_VECTOR`) the pairings of a chunk of steps (the scan's chunk policy,
  `_chunks.gradient_chunk`) are one batched product reading the buffer in place
  (`_chunks.add_param_vjp`: a GEMM for a dense matrix), and so are a matrix
  readout's VJPs; otherwise one product per step;
- with fewer, it runs the binomial schedule of `_schedule.segment_actions`
  (Griewank's revolve) in one loop over all segments' actions
  (`_reverse_binomial`): advance the working state, keep it in a spare slot,
  load a slot or a checkpoint, or take the adjoint step of the vector it holds.

Storing every vector ($s = 1$) recomputes nothing; it is the default while the
$d$ vectors take at most `STORE_ALL_BYTES` (where memory is no concern and time
is). Then a readout that one batched product can read (a dense `C` of vectors,
scalar coefficients) reads the stored vectors once after the loop
(`_Readout.from_stack`), for small vectors the reverse chunks are longer
(`CHUNK_NUMBERS`), and a small dense matrix's gradient is one product per chunk
(`WHOLE_PRODUCT_NUMBERS`). Above, the default keeps as many vectors as those
bytes hold, between `FEWEST` and $2\lceil\sqrt d\,\rceil - 1$
(`default_checkpoints`): about one extra forward pass for $O(\sqrt d)$ vectors, or
a few more for vectors so large that only a couple can be kept.

**Forward and reverse mode from one rule**, as for `krylov`: a `custom_jvp`
whose tangent is a primitive (`_tangent.tangent_primitive`), implemented by JAX's
forward mode through the forward pass (one pass with the tangents beside the
vectors, $O(1)$ vectors) and transposed by the reverse pass above, with the
checkpoints as the only residual.
"""

import math
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.experimental import sparse
from jaxtyping import Array, Inexact

from ._bases import AbstractBasis, basis_coefficients
from ._checks import (
    as_array,
    check_bcoo_matrix,
    check_choice,
    check_inexact,
    check_output_size,
    check_size,
    describe,
    is_numpy_array,
    standard_result_type,
)
from ._chunks import (
    CHUNK,
    DenseRowsOperator,
    add_param_vjp,
    chunk_steps,
    gradient_chunk,
    operator_numbers,
)
from ._krylov import check_problem
from ._linearity import check_linear
from ._operator import AbstractOperator, DenseOperator, closure_convert
from ._rules import tangent_or_none
from ._scan import (
    Coefficients,
    adjoint_update,
    adjoint_vector,
    forward_step,
    inexact_zeros,
)
from ._schedule import ADJOINT, ADVANCE, LOAD, STORE, plan_checkpoints, reverse_actions
from ._sharding import check_invariant, typed_like, zeros_stack
from ._tangent import (
    coefficient_cotangents,
    is_tangent,
    like_tangent,
    nones,
    tangent_primitive,
)
from ._typing import OperatorLike, StaticInt

# ------------------------------------------------------------------- readouts


# Vectors of at most this many numbers get the reverse pass's products a chunk
# of steps at a time (the operator's pairings, and the readout's VJP where it is
# `batched`): at (n, d) = (512, 200) and (32, 5000) that made the gradient
# 1.4-2.3x faster, while for the SSM kernel's (64, 256) blocks (a rank-256
# update per step is a GEMM already) a chunk at a time was 1.3x slower.
SMALL_VECTOR = 4096


# For a dense matrix the reverse pass takes chunks of at least this many numbers
# of adjoint vectors (1 MiB in float32; more steps than the scan's `_chunks.CHUNK`
# for vectors under 4096 numbers): for small vectors a step costs what its
# operations' overheads do, and a chunk's own operations (a GEMM of the
# operator's gradient, the readout's VJP) are spread over more steps. At (n, d) =
# (32, 5000) chunks of 256 to 1024 steps made the gradient 5-10% faster than
# chunks of 64, and at (512, 200) one chunk of all 200 steps (with the gradient
# one product, `WHOLE_PRODUCT_NUMBERS`) 7-12% faster than chunks of 24 (the
# reverse-settings table of `benchmarks/bench_readout.py`).
CHUNK_NUMBERS = 2**18

# A dense matrix of at most this many numbers gets each chunk's gradient as one
# product (a temporary as large as the matrix, 1 MiB in float32) rather than the
# scan's blocks of rows (`_chunks.LEAN_FROM`), which bound the temporary at the
# price of a small GEMM per block.
WHOLE_PRODUCT_NUMBERS = 2**18


def _reverse_chunk_steps(operator: AbstractOperator, x0: Array) -> int:
    """Steps per chunk of the reverse pass over stored vectors like `x0`: the
    scan's policy (`_chunks.gradient_chunk`), at least `CHUNK_NUMBERS` numbers for
    a dense matrix; 1 (a step at a time) above `SMALL_VECTOR` numbers."""
    if x0.size > SMALL_VECTOR:
        return 1
    most = gradient_chunk(operator, x0.size)
    dense = isinstance(operator, (DenseOperator, DenseRowsOperator))
    if dense and x0.size * CHUNK < CHUNK_NUMBERS:
        most = CHUNK_NUMBERS // max(1, x0.size)
    return chunk_steps(x0, most)


def _zero_piece(readout: "_Readout", params, x0: Array) -> Array:
    """Zeros like a piece of `readout`, its sharding included (the piece of zeros:
    one product, typed by JAX's own rules)."""
    return jnp.zeros_like(readout.piece(params, jnp.zeros_like(x0)))


class _Readout(eqx.Module):
    """What a readout reads off the sequence: a piece per step, linear in the
    vector and in the readout's arrays, put into the output. The reverse pass
    takes the pieces' VJP for a chunk of steps at once where `batched` (worth it
    when a step's piece is a small product, at the cost of the chunk's
    cotangents), else one step at a time."""

    batched = False

    def params(self, k) -> Any:
        """The arrays that step `k`'s piece reads (a pytree)."""
        raise NotImplementedError

    def piece(self, params, x: Array) -> Array:
        raise NotImplementedError

    def put(self, out: Array, k, piece: Array) -> Array:
        raise NotImplementedError

    def chunk_params(self, first, size: int) -> tuple[Any, int | None]:
        """The arrays that steps `first .. first + size - 1` read, and their
        batch axis (`None`: shared by the steps)."""
        raise NotImplementedError

    def chunk_take(self, ct: Array, first, size: int) -> Array:
        """The cotangents of those steps' pieces, stacked, from the output's."""
        raise NotImplementedError

    def add_chunk_params(self, acc: Any, first, ct) -> "_Readout":
        """`acc` (a cotangent of the readout) plus `ct`, a cotangent of
        `chunk_params(first, ...)`."""
        raise NotImplementedError

    def empty(self, x0: Array, d: int) -> Array:
        raise NotImplementedError

    def reads_stack(self, xs: Array) -> bool:
        """Whether `from_stack` can read the `d` vectors stacked in `xs` (else the
        pieces are put in one at a time)."""
        del xs
        return False

    def from_stack(self, xs: Array, out: Array) -> Array:
        """The output from all `d` vectors stacked in `xs`, by one batched product
        that reads `xs` in place."""
        raise NotImplementedError


class Rows(_Readout):
    r"""$y_k = C x_k$ as row $k$ of an output `(d, *C(x).shape)`. `C` is a
    matrix (dense or BCOO) or a closure-converted linear callable."""

    C: Any
    # A step's piece is a small matrix-vector product: a chunk's are one GEMM.
    batched = True

    def params(self, k):
        del k
        return self.C

    def piece(self, params, x):
        if callable(params):
            return params(x)
        x = x.astype(params.dtype)
        if x.ndim > 2:
            # C reads axis 0, as of a block (`@` would contract axis -2).
            y = params @ x.reshape(x.shape[0], -1)
            return y.reshape(params.shape[0], *x.shape[1:])
        return params @ x

    def put(self, out, k, piece):
        return lax.dynamic_update_index_in_dim(out, piece.astype(out.dtype), k, 0)

    def chunk_params(self, first, size):
        del first, size
        return self.C, None

    def chunk_take(self, ct, first, size):
        return lax.dynamic_slice_in_dim(ct, first, size)

    def add_chunk_params(self, acc, first, ct):
        del first
        C = jtu.tree_map(jnp.add, acc.C, eqx.filter(ct, eqx.is_inexact_array))
        return Rows(C)

    def empty(self, x0, d):
        zero = _zero_piece(self, self.C, x0)
        return jnp.broadcast_to(zero[None], (d, *zero.shape))

    def reads_stack(self, xs):
        # A dense C and vectors: one GEMM contracting the stack's last axis. (For
        # blocks the product would contract a middle axis: a copy of the stack.)
        return isinstance(self.C, jax.Array) and xs.ndim == 2

    def from_stack(self, xs, out):
        return jnp.asarray(jax.vmap(lambda x: self.piece(self.C, x))(xs), out.dtype)


class Sum(_Readout):
    r"""$y = \sum_k \theta_k x_k$ for scalar `coeffs[k]`, or
    $\sum_k x_k W_k$ for `coeffs` of shape `(d, b_in, b_out)`."""

    coeffs: Array
    batched = True

    def params(self, k):
        return lax.dynamic_index_in_dim(self.coeffs, k, 0, False)

    def piece(self, params, x):
        x = x.astype(params.dtype)
        return params * x if params.ndim == 0 else x @ params

    def put(self, out, k, piece):
        del k
        return out + piece.astype(out.dtype)

    def chunk_params(self, first, size):
        return lax.dynamic_slice_in_dim(self.coeffs, first, size), 0

    def chunk_take(self, ct, first, size):
        del first
        return jnp.broadcast_to(ct[None], (size, *ct.shape))

    def add_chunk_params(self, acc, first, ct):
        rows = lax.dynamic_slice_in_dim(acc.coeffs, first, ct.shape[0])
        return Sum(lax.dynamic_update_slice_in_dim(acc.coeffs, rows + ct, first, 0))

    def empty(self, x0, d):
        del d
        return _zero_piece(self, self.params(0), x0)

    def reads_stack(self, xs):
        # Scalar coefficients: one product contracting the stack's first axis.
        del xs
        return self.coeffs.ndim == 1

    def from_stack(self, xs, out):
        total = jnp.tensordot(self.coeffs, xs.astype(self.coeffs.dtype), axes=1)
        return out + total.astype(out.dtype)


# -------------------------------------------------------------- forward pass


class _Plan(eqx.Module):
    """The static shape of one run: `d` vectors in `count` segments of `every`
    (the last one `last` long), each reversed with `spare` vectors to keep some
    of its own in (`_schedule.py`). `every == 1` stores every vector."""

    d: int = eqx.field(static=True)
    every: int = eqx.field(static=True)
    spare: int = eqx.field(static=True)

    @property
    def buffered(self) -> bool:
        """Whether a segment is recomputed whole into a buffer (else by the
        binomial schedule of `_schedule.segment_actions`)."""
        return self.spare >= self.every - 1

    @property
    def count(self) -> int:
        return -(-self.d // self.every)

    @property
    def last(self) -> int:
        return self.d - (self.count - 1) * self.every


# Below this many bytes for the d vectors, the default stores them all: the
# reverse pass then recomputes nothing, as fast as the materialising path. Above,
# it keeps about as many vectors as this many bytes hold, between `FEWEST` and
# the $2\lceil\sqrt d\,\rceil - 1$ that take one extra forward pass.
STORE_ALL_BYTES = 256 * 2**20
FEWEST = 2


def default_checkpoints(d: int, x0: Array, pairs: bool) -> int:
    r"""The default `checkpoints`: `d - 1` (every vector stored) while the `d`
    vectors take at most `STORE_ALL_BYTES`; else as many states (`pairs`: a state
    is two vectors) as `STORE_ALL_BYTES` hold, at least `FEWEST` and at most
    $2\lceil\sqrt d\,\rceil - 1$."""
    vector = x0.size * x0.dtype.itemsize
    if d * vector <= STORE_ALL_BYTES:
        return d - 1
    held = STORE_ALL_BYTES // (vector * (2 if pairs else 1))
    return max(FEWEST, min(held, 2 * (math.isqrt(d - 1) + 1) - 1))


def _padded(coefficients: Coefficients | None, d: int):
    r"""$(a_k, b_k, c_k)$ and $c_{k+1}$ for $k = 0, \dots, d - 1$, zero where the
    basis has none: the forward step reads $(a_k, b_k, c_k)$, the reverse step
    $(a_k, b_k, c_{k+1})$."""
    if coefficients is None:
        return None
    a, b, c = coefficients
    a, b, c_next = (jnp.pad(v, (0, 1)) for v in (a, b, c[1:]))
    c_next = jnp.pad(c_next, (0, 1))[:d]
    c = jnp.pad(c, (0, 1))
    return a, b, c, c_next


def _current(state) -> Array:
    return state if isinstance(state, jax.Array) else state[1]


def _advance(operator: AbstractOperator, state, padded, k):
    """The state at vector `k + 1` from that at `k`."""
    if padded is None:
        return forward_step(operator, None, state, None)
    x_prev, x = state
    abc = tuple(lax.dynamic_index_in_dim(v, k, 0, False) for v in padded[:3])
    return x, forward_step(operator, x_prev, x, abc)


def _run(operator, readout: _Readout, padded, state, out, lo, length, advance):
    """Vectors `lo .. lo + length - 1` from `state` (at `lo`), each read into
    `out`; with `advance`, the state at `lo + length` too (else `state` is
    returned as it was)."""

    def body(carry, j):
        state, out = carry
        k = lo + j
        out = readout.put(out, k, readout.piece(readout.params(k), _current(state)))
        return (_advance(operator, state, padded, k), out), None

    start = state
    (state, out), _ = lax.scan(body, (state, out), jnp.arange(length - 1))
    k = lo + length - 1
    out = readout.put(out, k, readout.piece(readout.params(k), _current(state)))
    if advance:
        return _advance(operator, state, padded, k), out
    return start, out


def _first_state(x0: Array, padded):
    return x0 if padded is None else (jnp.zeros_like(x0), x0)


def readout_forward(
    operator: AbstractOperator,
    x0: Array,
    readout: _Readout,
    coefficients: Coefficients | None,
    plan: _Plan,
    keep: bool,
):
    """The output, and with `keep` what the reverse pass reads (`None` without
    `keep`): for `plan.every == 1` every vector, `(d, *x0.shape)`; else the
    checkpoints, the states at vectors `every, 2 every, ...` (`count - 1` rows;
    pairs of vectors for a three-term basis; the first segment starts at `x0`)."""
    padded = _padded(coefficients, plan.d)
    out = readout.empty(x0, plan.d)
    state = _first_state(x0, padded)
    if plan.every == 1:
        return _forward_storing(operator, readout, padded, state, out, plan, keep)
    if not keep or plan.count == 1:
        return _run(operator, readout, padded, state, out, 0, plan.d, False)[1], None
    every = plan.every
    stack = jtu.tree_map(lambda v: zeros_stack(v, plan.count - 1), state)

    # One loop over all vectors, which stores a checkpoint when it reaches one:
    # so the checkpoints are ready only once the output is (with a loop per
    # segment, XLA may finish the last segment after the reverse pass, holding
    # its vectors through it).
    def body(carry, k):
        state, out, stack = carry
        out = readout.put(out, k, readout.piece(readout.params(k), _current(state)))
        state = _advance(operator, state, padded, k)
        row = (k + 1) // every - 1

        def store(stack):
            return jtu.tree_map(
                lambda s, v: lax.dynamic_update_index_in_dim(s, v, row, 0),
                stack,
                state,
            )

        at_checkpoint = ((k + 1) % every == 0) & (row < plan.count - 1)
        stack = lax.cond(at_checkpoint, store, lambda stack: stack, stack)
        return (state, out, stack), None

    (state, out, stack), _ = lax.scan(body, (state, out, stack), jnp.arange(plan.d - 1))
    k = plan.d - 1
    out = readout.put(out, k, readout.piece(readout.params(k), _current(state)))
    return out, stack


def _forward_storing(operator, readout, padded, state, out, plan, keep):
    """`readout_forward` for `every == 1`: every vector stored (with `keep`).
    With `keep`, a readout that can read the whole stack at once
    (`_Readout.from_stack`) does so after the loop, which then only advances
    and stores: for small vectors, where a step costs what its operations'
    overheads do, that takes a matrix-vector product out of every step."""
    x0 = _current(state)
    xs = zeros_stack(x0, plan.d) if keep else None
    if keep and readout.reads_stack(xs):

        def advance(carry, k):
            state, xs = carry
            xs = lax.dynamic_update_index_in_dim(xs, _current(state), k, 0)
            return (_advance(operator, state, padded, k), xs), None

        (state, xs), _ = lax.scan(advance, (state, xs), jnp.arange(plan.d - 1))
        xs = lax.dynamic_update_index_in_dim(xs, _current(state), plan.d - 1, 0)
        return readout.from_stack(xs, out), xs

    def body(carry, k):
        state, out, xs = carry
        x = _current(state)
        out = readout.put(out, k, readout.piece(readout.params(k), x))
        if keep:
            xs = lax.dynamic_update_index_in_dim(xs, x, k, 0)
        return (_advance(operator, state, padded, k), out, xs), None

    (state, out, xs), _ = lax.scan(body, (state, out, xs), jnp.arange(plan.d - 1))
    k = plan.d - 1
    x = _current(state)
    out = readout.put(out, k, readout.piece(readout.params(k), x))
    if keep:
        xs = lax.dynamic_update_index_in_dim(xs, x, k, 0)
    return out, xs


# -------------------------------------------------------------- reverse pass


class _Adjoint(eqx.Module):
    """What every step of one reverse pass reads."""

    operator: AbstractOperator
    transpose: AbstractOperator
    readout: _Readout
    padded: tuple | None
    ct: Array
    want_operator: bool = eqx.field(static=True)
    want_readout: bool = eqx.field(static=True)
    # Steps whose pairings with the operator's gradient are one batched product
    # (1: a product per step).
    chunk: int = eqx.field(static=True)
    # Whether a dense matrix's share of a chunk is summed in blocks of rows.
    row_blocks: bool = eqx.field(static=True)


def _recompute(adj: _Adjoint, state, lo, length: int) -> Array:
    """The segment's vectors `lo .. lo + length - 1` from its state at `lo`."""
    first = _current(state)
    stack = zeros_stack(first, length)
    stack = lax.dynamic_update_index_in_dim(stack, first, 0, 0)

    if adj.padded is None:
        # The monomial step reads its vector from the stack: no carried copy.
        def body(j, stack):
            x = lax.dynamic_index_in_dim(stack, j, 0, False)
            y = forward_step(adj.operator, None, x, None)
            return lax.dynamic_update_index_in_dim(stack, y, j + 1, 0)

        return lax.fori_loop(0, length - 1, body, stack)

    def body3(j, carry):
        state, stack = carry
        state = _advance(adj.operator, state, adj.padded, lo + j)
        return state, lax.dynamic_update_index_in_dim(stack, _current(state), j + 1, 0)

    return lax.fori_loop(0, length - 1, body3, (state, stack))[1]


def _readout_cotangents(adj: _Adjoint, xs, k0, first, size: int):
    """For vectors `k0 + first ..` (rows `first ..` of `xs`), `size` of them:
    their cotangents from the readout, stacked, and the readout's gradient from
    those steps (`None` unless wanted): one VJP of the readout's pieces, batched
    over the steps (for a matrix `C`, two GEMMs)."""
    params, axis = adj.readout.chunk_params(k0 + first, size)
    ct = adj.readout.chunk_take(adj.ct, k0 + first, size)
    xs = lax.dynamic_slice_in_dim(xs, first, size)

    def pieces(params, xs):
        if axis is None:
            # Shared arrays (a matrix, BCOO or a callable's): closed over.
            return jax.vmap(lambda x: adj.readout.piece(params, x))(xs)
        return jax.vmap(adj.readout.piece, in_axes=(axis, 0))(params, xs)

    # On an `Explicit` mesh the cotangent must have the pieces' sharding type: a
    # loss that gathers rows of the output (`from_partitioned`) gives a
    # replicated one.
    if adj.want_readout:
        out, vjp = eqx.filter_vjp(pieces, params, xs)
        ct_params, gs = vjp(jtu.tree_map(typed_like, ct, out))
    else:
        out, vjp = eqx.filter_vjp(lambda xs: pieces(params, xs), xs)
        (gs,), ct_params = vjp(jtu.tree_map(typed_like, ct, out)), None
    return gs.astype(xs.dtype), ct_params


def _adjoint_step(adj: _Adjoint, acc, xs, lo, row, g):
    """The adjoint step of vector `lo + row`, read from `xs[row]`, whose
    cotangent from the readout is `g`: the new `acc` and the vector that the
    operator's gradient pairs with it."""
    carry, grad, ct_readout, dsum = acc
    k = lo + row
    x = lax.dynamic_index_in_dim(xs, row, 0, False)
    g = typed_like(g, x)
    w = adjoint_vector(carry)
    abc = None
    if adj.padded is not None:
        a, b, _, c_next = (lax.dynamic_index_in_dim(v, k, 0, False) for v in adj.padded)
        abc = (a, b, c_next)
        w = a * w
    carry, dots = adjoint_update(adj.transpose, carry, g, x, abc)
    if dots is not None:
        dsum = lax.dynamic_update_index_in_dim(dsum, dots, k, 0)
    return (carry, grad, ct_readout, dsum), w


def _reverse_chunk(adj: _Adjoint, acc, xs, lo, first, size: int):
    """The adjoint steps of rows `first + size - 1` down to `first` of `xs`
    (vectors `lo + first + ...`), their pairings with the operator's gradient one
    batched product reading `xs` in place."""

    if adj.readout.batched and adj.chunk > 1:
        gs, ct_params = _readout_cotangents(adj, xs, lo, first, size)
    else:
        gs, ct_params = None, None

    def step(j, inner):
        acc, ws = inner
        row = first + size - 1 - j
        if gs is not None:
            g = lax.dynamic_index_in_dim(gs, size - 1 - j, 0, False)
        else:
            g, ct_step = _readout_cotangents(adj, xs, lo, row, 1)
            g = g[0]
            if ct_step is not None:
                carry, grad, ct_readout, dsum = acc
                ct_readout = adj.readout.add_chunk_params(ct_readout, lo + row, ct_step)
                acc = (carry, grad, ct_readout, dsum)
        acc, w = _adjoint_step(adj, acc, xs, lo, row, g)
        if ws is not None:
            ws = lax.dynamic_update_index_in_dim(ws, w, size - 1 - j, 0)
        return acc, ws

    ws = zeros_stack(xs[0], size) if adj.want_operator else None
    acc, ws = lax.fori_loop(0, size, step, (acc, ws))
    carry, grad, ct_readout, dsum = acc
    if ws is not None:
        grad = add_param_vjp(
            adj.operator, grad, xs, first, ws, row_blocks=adj.row_blocks
        )
    if ct_params is not None:
        ct_readout = adj.readout.add_chunk_params(ct_readout, lo + first, ct_params)
    return carry, grad, ct_readout, dsum


def _reverse_vectors(adj: _Adjoint, acc, xs, lo, length: int):
    """The adjoint steps of vectors `lo + length - 1` down to `lo`, stored in
    `xs`, in chunks of `adj.chunk` steps (the top one shorter).

    `acc` is `(carry, grad, ct_readout, dsum)`: the adjoint carry at vector
    `lo + length` ($\\lambda$, or the pair of a three-term basis), the running
    gradients of the operator and of the readout (`None` when not wanted), and
    the coefficients' products per vector (`None` for the monomial basis)."""
    size = min(adj.chunk, length)
    full = length // size
    top = length - full * size
    if top:
        acc = _reverse_chunk(adj, acc, xs, lo, full * size, top)

    def chunk(c, acc):
        return _reverse_chunk(adj, acc, xs, lo, (full - 1 - c) * size, size)

    return lax.fori_loop(0, full, chunk, acc)


def _reverse_binomial(adj: _Adjoint, acc, stored, first, plan: _Plan):
    """The adjoint steps of all `plan.d` vectors by the binomial schedules of
    `_schedule.reverse_actions`: one loop over their actions, with the working
    state, `plan.spare` slots and `acc` as its carry. A checkpoint is read where
    the schedule loads it (`first` for `x0`, else a row of `stored`), so that no
    copy of it is kept.

    Each conditional carries only what it changes, because XLA copied whatever
    passed through one of its branches unchanged, at every action (the slots;
    the operator's gradient, n^2 numbers for a dense matrix): the working state
    moves by a `lax.switch` (advance, load, or stay), the adjoint step is a
    `lax.cond` on `acc`, and the slots are written outside both, every action
    writing one slot back (the working state for `STORE`, its own contents
    otherwise).

    Without spare slots the schedule recomputes each vector from its segment's
    checkpoint (`LOAD`, `ADVANCE` up to it, `ADJOINT`): its actions, $d^2/2$ for
    `checkpoints=0`, are then worked out from a cursor in the carry (the vector
    due and the working state's vector) instead of read from a table, which
    would be a constant of that size in the program."""
    if plan.spare == 0:
        lengths = [min(plan.every, plan.d - lo) for lo in range(0, plan.d, plan.every)]
        count = sum(n * (n - 1) // 2 + 2 * n for n in lengths)
        actions = None
    else:
        table = reverse_actions(plan.d, plan.every, plan.spare)
        count, actions = len(table), jnp.asarray(np.asarray(table, np.int32))
    slots = jtu.tree_map(lambda v: zeros_stack(v, max(plan.spare, 1)), first)
    last = max(plan.spare, 1) - 1

    def advance(k, state, slots):
        return _advance(adj.operator, state, adj.padded, k)

    def keep(k, state, slots):
        return state

    def load(i, state, slots):
        c = -i - 1  # the checkpoint, for i < 0

        def pick(f, kept, s):
            if s is not None:
                s = lax.dynamic_index_in_dim(s, jnp.maximum(c - 1, 0), 0, False)
                f = jnp.where(c == 0, f, s)
            kept = lax.dynamic_index_in_dim(kept, jnp.clip(i, 0, last), 0, False)
            return jnp.where(i < 0, f, kept)

        if stored is None:
            return jtu.tree_map(lambda f, k: pick(f, k, None), first, slots)
        return jtu.tree_map(pick, first, slots, stored)

    branches = [advance, keep, load, keep]
    assert [ADVANCE, STORE, LOAD, ADJOINT] == list(range(4))

    def next_action(j, cursor):
        """Action `j` and the cursor after it: `(due, at)`, the vector whose
        adjoint step is next and the one the working state holds (-1: none)."""
        if actions is not None:
            return actions[j, 0], actions[j, 1], cursor
        due, at = cursor
        segment = due // plan.every
        kind = jnp.where(at < 0, LOAD, jnp.where(at < due, ADVANCE, ADJOINT))
        arg = jnp.where(kind == LOAD, -segment - 1, jnp.where(kind == ADVANCE, at, due))
        moved = jnp.where(kind == LOAD, segment * plan.every, at + 1)
        cursor = (
            jnp.where(kind == ADJOINT, due - 1, due),
            jnp.where(kind == ADJOINT, -1, moved),
        )
        return kind, arg, cursor

    def body(j, carry):
        state, slots, acc, cursor = carry
        kind, arg, cursor = next_action(j, cursor)
        i = jnp.clip(arg, 0, last)

        def write(s, v):
            kept = lax.dynamic_index_in_dim(s, i, 0, False)
            v = jnp.where(kind == STORE, v, kept)
            return lax.dynamic_update_index_in_dim(s, v, i, 0)

        slots = jtu.tree_map(write, slots, state)
        state = lax.switch(kind, branches, arg, state, slots)

        def adjoint(acc):
            return _reverse_vectors(adj, acc, _current(state)[None], arg, 1)

        acc = lax.cond(kind == ADJOINT, adjoint, lambda acc: acc, acc)
        return state, slots, acc, cursor

    cursor = (jnp.asarray(plan.d - 1, jnp.int32), jnp.asarray(-1, jnp.int32))
    carry = (first, slots, acc, cursor)
    return lax.fori_loop(0, count, body, carry)[2]


def readout_adjoint(
    operator: AbstractOperator,
    x0: Array,
    readout: _Readout,
    coefficients: Coefficients | None,
    stored,
    ct: Array,
    plan: _Plan,
    want_operator: bool,
    want_readout: bool,
):
    """The cotangents of `x0`, the operator (`None` unless `want_operator`), the
    readout (`None` unless `want_readout`) and the coefficients (`None` without
    them) for the output's cotangent `ct`, from what `readout_forward` stored."""
    padded = _padded(coefficients, plan.d)
    adj = _Adjoint(
        operator,
        operator.transpose(),
        readout,
        padded,
        ct,
        want_operator,
        want_readout,
        chunk=_reverse_chunk_steps(operator, x0) if plan.buffered else 1,
        row_blocks=operator_numbers(operator) > WHOLE_PRODUCT_NUMBERS,
    )
    zeros = jnp.zeros_like(x0)
    carry = zeros if padded is None else (zeros, zeros)
    grad = inexact_zeros(operator) if want_operator else None
    ct_readout = inexact_zeros(readout) if want_readout else None
    dsum = None
    if padded is not None:
        # Typed like a product of two vectors (replicated on an explicit mesh).
        dsum = typed_like(jnp.zeros((plan.d, 3), x0.dtype), jnp.sum(jnp.zeros_like(x0)))
    acc = (carry, grad, ct_readout, dsum)
    if plan.every == 1:
        acc = _reverse_vectors(adj, acc, stored, 0, plan.d)
    elif not plan.buffered:
        acc = _reverse_binomial(adj, acc, stored, _first_state(x0, padded), plan)
    else:
        first = _first_state(x0, padded)

        def segment(c, length, acc):
            """Segment `c`, from checkpoint `c - 1` (from `x0` for `c == 0`)."""

            def at(s, f):
                s = lax.dynamic_index_in_dim(s, jnp.maximum(c - 1, 0), 0, False)
                return jnp.where(c == 0, f, s)

            state = first if stored is None else jtu.tree_map(at, stored, first)
            lo = c * plan.every
            xs = _recompute(adj, state, lo, length)
            return _reverse_vectors(adj, acc, xs, lo, length)

        top = plan.count - 1
        acc = segment(top, plan.last, acc)
        acc = lax.fori_loop(
            0, top, lambda i, acc: segment(top - 1 - i, plan.every, acc), acc
        )
    carry, grad, ct_readout, dsum = acc
    ct_x0 = typed_like(adjoint_vector(carry), x0)
    ct_coefficients = None
    if dsum is not None:
        d = plan.d
        ct_coefficients = (
            dsum[: d - 1, 0],
            dsum[: d - 1, 1],
            jnp.pad(dsum[: max(d - 2, 0), 2], (1, 0))[: d - 1],
        )
    return ct_x0, grad, ct_readout, ct_coefficients


# -------------------------------------------------------------- the rule


def _filled(primal, tangent):
    """`tangent` with zeros for its `None` leaves (where `primal` has an inexact
    array); zeros like `primal` for a `None` tangent."""
    if tangent is None:
        return inexact_zeros(primal)
    return jtu.tree_map(
        lambda p, t: jnp.zeros_like(p) if t is None and eqx.is_inexact_array(p) else t,
        primal,
        tangent,
        is_leaf=lambda v: v is None,
    )


def _tangent_impl(
    operator,
    x0,
    readout,
    coefficients,
    stored,
    plan,
    like,
    t_operator,
    t_x0,
    t_readout,
    t_coefficients,
):
    """JAX's forward mode through the forward pass, in the arguments that have a
    tangent (the others are closed over, so no product with a zero tangent is
    made)."""
    del stored, like
    primals = (operator, x0, readout, coefficients)
    tangents = (t_operator, t_x0, t_readout, t_coefficients)
    moving = [i for i, t in enumerate(tangents) if jtu.tree_leaves(t)]

    def value(*parts):
        full = list(primals)
        for i, part in zip(moving, parts, strict=True):
            full[i] = part
        operator, x0, readout, coefficients = full
        return readout_forward(operator, x0, readout, coefficients, plan, False)[0]

    if not moving:
        out = jax.eval_shape(value)
        return jnp.zeros(out.shape, out.dtype)
    return eqx.filter_jvp(
        value,
        tuple(primals[i] for i in moving),
        tuple(_filled(primals[i], tangents[i]) for i in moving),
    )[1]


def _tangent_transpose(inputs, ct):
    (
        operator,
        x0,
        readout,
        coefficients,
        stored,
        plan,
        like,
        t_operator,
        t_x0,
        t_readout,
        t_coefficients,
    ) = inputs
    want_operator = is_tangent(t_operator)
    want_readout = is_tangent(t_readout)
    ct_x0, ct_operator, ct_readout, ct_coefficients = readout_adjoint(
        operator,
        x0,
        readout,
        coefficients,
        stored,
        ct,
        plan,
        want_operator,
        want_readout,
    )
    ct_coefficients = coefficient_cotangents(t_coefficients, ct_coefficients)
    return (
        nones(operator),
        nones(x0),
        nones(readout),
        nones(coefficients),
        nones(stored),
        nones(plan),
        nones(like),
        like_tangent(t_operator, ct_operator) if want_operator else nones(t_operator),
        ct_x0 if is_tangent(t_x0) else None,
        like_tangent(t_readout, ct_readout) if want_readout else nones(t_readout),
        ct_coefficients,
    )


# Arguments: (operator, x0, readout, coefficients, stored, plan, like,
# t_operator, t_x0, t_readout, t_coefficients); the output is like `like`, a
# `jax.ShapeDtypeStruct` of the output.
readout_tangent = tangent_primitive(
    "readout_tangent", _tangent_impl, _tangent_transpose, like=6
)


@eqx.filter_custom_jvp
def _readout(operator, x0, readout, coefficients, *, plan):
    return readout_forward(operator, x0, readout, coefficients, plan, False)[0]


@_readout.def_jvp
def _readout_jvp(primals, tangents, *, plan):
    check_invariant(primals, "The derivative of a readout")
    operator, x0, readout, coefficients = primals
    t_operator, t_x0, t_readout, t_coefficients = tangents
    out, stored = readout_forward(operator, x0, readout, coefficients, plan, True)
    like = jax.ShapeDtypeStruct(out.shape, out.dtype)
    if coefficients is not None and t_coefficients is None:
        t_coefficients = (None, None, None)
    if t_coefficients is not None:
        t_coefficients = tuple(t_coefficients)
    t_out = readout_tangent(
        operator,
        x0,
        readout,
        coefficients,
        stored,
        plan,
        like,
        tangent_or_none(t_operator),
        t_x0,
        tangent_or_none(t_readout),
        t_coefficients,
    )
    return out, t_out


def readout(
    operator: AbstractOperator,
    x0: Array,
    readout: _Readout,
    coefficients: Coefficients | None,
    plan: _Plan,
) -> Array:
    """The readout of the `plan.d` vectors, differentiable in both modes."""
    return _readout(operator, x0, readout, coefficients, plan=plan)


# ------------------------------------------------------------ the public API


def _check_checkpoints(
    checkpoints: Any, d: int, x0: Array, coefficients, fn_name: str
) -> _Plan:
    if checkpoints is None:
        checkpoints = default_checkpoints(d, x0, coefficients is not None)
    else:
        checkpoints = check_size(
            checkpoints,
            f"{fn_name}(checkpoints=...)",
            what="how many vectors the reverse pass keeps",
            minimum=0,
        )
    return _Plan(d, *plan_checkpoints(d, checkpoints))


def _coefficients(basis, d: int, x0: Array, fn_name: str):
    if basis is None:
        return None
    return basis_coefficients(basis, d, x0.dtype, fn_name)


def _as_readout_matrix(C: Any, x0: Array, fn_name: str) -> Any:
    """`C` as a `(p, n)` matrix of `x0`'s dtype promoted with its own, or a
    closure-converted linear callable; checked."""
    arg = f"{fn_name}(C=...)"
    n = x0.shape[0]
    if isinstance(C, sparse.BCOO) or isinstance(C, jax.Array) or is_numpy_array(C):
        if len(C.shape) != 2 or C.shape[1] != n:
            msg = (
                f"`{arg}` must be a matrix of shape (p, {n}), p readouts of vectors "
                f"of x0's length {n}; got shape {tuple(C.shape)}."
            )
            raise ValueError(msg)
        if isinstance(C, sparse.BCOO):
            check_bcoo_matrix(C, arg)
            check_inexact(C.data, arg)
            dtype = standard_result_type(C.data, x0)
            return sparse.BCOO((C.data.astype(dtype), C.indices), shape=C.shape)
        check_inexact(C, arg)
        C = jnp.asarray(C)
        return C.astype(standard_result_type(C, x0))
    if callable(C):
        fn = closure_convert(C, x0)
        out = jax.eval_shape(fn, x0)
        if not isinstance(out, jax.ShapeDtypeStruct) or out.ndim == 0:
            msg = (
                f"`{arg}` must be a (p, {n}) matrix or a linear callable that maps "
                f"arrays like x0 to one array with at least one axis; it returned "
                f"{out}."
            )
            raise TypeError(msg)
        if not jnp.issubdtype(out.dtype, jnp.inexact):
            # A linear map of floating-point vectors has floating-point values.
            msg = (
                f"`{arg}` must be a linear callable with floating-point or complex "
                f"values; it returned {out.dtype}."
            )
            raise TypeError(msg)
        check_linear(fn, x0, arg)
        return fn
    msg = (
        f"`{arg}` must be a (p, {n}) matrix (a JAX or NumPy array, or a BCOO "
        f"matrix) or a linear callable; got {describe(C)}."
    )
    raise TypeError(msg)


def krylov_readout(
    A: OperatorLike,
    x0: Inexact[Array | np.ndarray, "n ..."],
    d: StaticInt,
    C: Any,
    *,
    basis: AbstractBasis | None = None,
    layout: Literal["columns", "rows"] = "columns",
    checkpoints: StaticInt | None = None,
) -> Inexact[Array, "..."]:
    r"""The readout $[C x_0, C x_1, \dots, C x_{d-1}]$ of a Krylov sequence,
    $x_k = A^k x_0$ (or $p_k(A) x_0$ in a polynomial `basis`), without the Krylov
    matrix.

    It is `C @ krylov(A, x0, d, basis=basis)` (for a matrix `C`; for a vector
    `x0`), but the $d$ vectors are never stored: each is read out as it is made, so
    the forward pass keeps one vector (two for a polynomial basis) and the output.
    An SSM kernel $\bar K_l = C \bar A^l \bar B$ (S4's "Krylov function") is
    `krylov_readout(A_bar, B_bar, L, C, layout="rows")`.

    **Derivatives.** One rule for forward and reverse mode, like
    [`krylovjax.krylov`][]'s default: `jax.jvp`, `jax.grad`, `jax.vjp`,
    `jax.linearize`, `jax.jacfwd`, `jax.hessian`. Gradients reach the arrays of
    `A`, `x0`, `C` and the basis. Reverse mode needs the $x_k$ in reverse order
    and keeps at most `checkpoints` of them (pairs of vectors for a polynomial
    basis), recomputing the others from the nearest one kept by binomial
    checkpointing (Griewank's revolve; see the docs' adjoint page): $d - 1$
    stores every vector and recomputes nothing; $2\lceil\sqrt d\,\rceil - 1$
    costs about one more forward pass; fewer cost more passes, each vector
    recomputed at most $r$ times for the smallest $r$ with
    $\binom{c + 1 + r}{r} \geq d$, roughly.
    Forward mode runs the tangents beside the vectors and keeps $O(1)$ vectors.

    **Arguments:**

    - `A`: the operator, any kind [`krylovjax.krylov`][] accepts: a square array,
        a BCOO matrix, or a linear callable.
    - `x0`: the starting vector `(n,)` or block `(n, b)` (any shape for a callable
        `A`), floating point or complex; promoted with `A` as in `krylov`.
    - `d`: the number of vectors read out, a static `int >= 1`.
    - `C`: the readout: a `(p, n)` matrix (a JAX or NumPy array, or a BCOO matrix;
        promoted with `x0`'s dtype), so that each readout is `C @ x_k` (contracting
        the first axis of $x_k$, of length n, whatever its shape); or a linear
        callable mapping arrays like `x0` to an array with at least one axis (a
        nonlinear or affine one raises a `TypeError`, and so does one with integer
        values; the test is by derivatives, so a map whose derivative JAX takes to
        be zero, such as `jnp.round`, passes it).
    - `basis`: `None` (the monomial basis) or a polynomial basis such as
        [`krylovjax.Chebyshev`][], as in `krylov`.
    - `layout`: `"columns"` (default) puts the new axis of length $d$ after the
        readout's first axis, `(p, d)` or `(p, d, b)`, like `C @ krylov(...)`;
        `"rows"` puts it first, `(d, p, ...)`.
    - `checkpoints`: how many vectors the reverse pass may keep besides its
        working ones (about six: the adjoint, its update, the output's cotangent
        and the vector being recomputed), a static `int >= 0`; values of $d - 1$
        or more store every vector (the memory of `C @ krylov(...)`, and its
        time), `0` keeps only `x0` and recomputes each vector from it ($d(d-1)/2$
        products). `None`
        (default): every vector while the $d$ vectors take at most 256 MiB;
        else as many as 256 MiB hold, at least 2 and at most
        $2\lceil\sqrt d\,\rceil - 1$ (for vectors of 512 MiB at $d = 16$:
        2, which recompute 28 products where the forward pass makes 15).

    **Returns:**

    The readouts, of `C`'s output dtype, with the axis of length $d$ placed by
    `layout`.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> import krylovjax
        >>> A = jnp.array([[0.5, 1.0], [0.0, 0.5]])
        >>> x0 = jnp.array([0.0, 1.0])
        >>> C = jnp.array([[1.0, 0.0]])
        >>> krylovjax.krylov_readout(A, x0, 4, C)
        Array([[0.  , 1.  , 1.  , 0.75]], dtype=float32)
        >>> grad = jax.grad(lambda A: krylovjax.krylov_readout(A, x0, 4, C).sum())(A)
        >>> bool(jnp.allclose(grad, jax.grad(
        ...     lambda A: (C @ krylovjax.krylov(A, x0, 4)).sum())(A)))
        True

        ```
    """
    fn_name = "krylov_readout"
    check_choice(layout, ("columns", "rows"), f"{fn_name}(layout=...)")
    operator, x0, d = check_problem(A, x0, d, fn_name, stacked=False)
    coefficients = _coefficients(basis, d, x0, fn_name)
    plan = _check_checkpoints(checkpoints, d, x0, coefficients, fn_name)
    rows = Rows(_as_readout_matrix(C, x0, fn_name))
    piece = eqx.filter_eval_shape(rows.piece, rows.C, x0)
    check_output_size(d, [piece], fn_name, what="the readout `C x0`")
    out = readout(operator, x0, rows, coefficients, plan)
    return out if layout == "rows" else jnp.moveaxis(out, 0, 1)


def polynomial_action(
    A: OperatorLike,
    x0: Inexact[Array | np.ndarray, "n ..."],
    coeffs: Inexact[Array | np.ndarray, "d ..."],
    *,
    basis: AbstractBasis | None = None,
    checkpoints: StaticInt | None = None,
) -> Inexact[Array, "..."]:
    r"""The polynomial $\sum_{k=0}^{d-1} \theta_k\, p_k(A)\, x_0$ applied to $x_0$,
    or with a matrix per degree, $\sum_k p_k(A)\, X_0\, W_k$, without the Krylov
    matrix.

    With $p_k(\lambda) = \lambda^k$ (the default) it is
    `jnp.tensordot(coeffs, krylov(A, x0, d, layout="rows"), 1)`; with
    `basis=krylovjax.Chebyshev(lo, hi)` a Chebyshev series, and so on. Per-degree
    matrices `W_k` mix channels as a polynomial graph filter does (TAGConv,
    ChebConv: $\sum_k T_k(\tilde L) X W_k$). The vectors are summed into the
    output as they are made, so the forward pass keeps one vector (two for a
    polynomial basis) besides the output; derivatives and memory are as for
    [`krylovjax.krylov_readout`][], whose `checkpoints` this takes too.

    **Arguments:**

    - `A`, `x0`, `basis`, `checkpoints`: as for `krylov_readout`.
    - `coeffs`: the coefficients, shape `(d,)` (one number per degree; any `x0`)
        or `(d, b_in, b_out)` for an `x0` of shape `(n, b_in)` (one matrix per
        degree). Their length is the number of terms $d \ge 1$. Floating point or
        complex; the output has the dtype of `x0` (promoted with `A`) promoted
        with theirs.

    **Returns:**

    An array of `x0`'s shape for coefficients of shape `(d,)`; of shape
    `(n, b_out)` for `(d, b_in, b_out)`.

    !!! Example

        ```python
        >>> import jax.numpy as jnp
        >>> import krylovjax
        >>> A = jnp.diag(jnp.array([0.5, -0.5]))
        >>> x0 = jnp.ones(2)
        >>> # T_0 + T_2 at 0.5 and -0.5: 1 + (2 * 0.25 - 1) = 0.5
        >>> krylovjax.polynomial_action(A, x0, jnp.array([1.0, 0.0, 1.0]),
        ...                             basis=krylovjax.Chebyshev(-1.0, 1.0))
        Array([0.5, 0.5], dtype=float32)

        ```
    """
    fn_name = "polynomial_action"
    arg = f"{fn_name}(coeffs=...)"
    coeffs = as_array(coeffs, arg)
    check_inexact(coeffs, arg)
    if coeffs.ndim not in (1, 3) or coeffs.shape[0] < 1:
        msg = (
            f"`{arg}` must have shape (d,) or (d, b_in, b_out) with d >= 1; got "
            f"shape {coeffs.shape}."
        )
        raise ValueError(msg)
    d = coeffs.shape[0]
    operator, x0, d = check_problem(A, x0, d, fn_name, stacked=False)
    if coeffs.ndim == 3 and (x0.ndim != 2 or x0.shape[1] != coeffs.shape[1]):
        msg = (
            f"`{arg}` of shape (d, b_in, b_out) = {coeffs.shape} needs `x0` of shape "
            f"(n, {coeffs.shape[1]}); got x0 of shape {x0.shape}."
        )
        raise ValueError(msg)
    coefficients = _coefficients(basis, d, x0, fn_name)
    plan = _check_checkpoints(checkpoints, d, x0, coefficients, fn_name)
    coeffs = coeffs.astype(standard_result_type(coeffs, x0))
    return readout(operator, x0, Sum(coeffs), coefficients, plan)
