r"""How the scan's derivative passes cut their work into chunks, for each operator kind.

The reverse pass of `krylov` (`_scan.py`) runs backwards over chunks of steps:
each chunk's adjoint vectors are kept at once, and the chunk's share of the
operator's gradient is one batched product with the matching stored vectors,
added to a running sum. This module holds what that depends on, per kind:

- `gradient_chunk(operator, vector_size)`: how many steps a chunk takes (fewer for
  very wide vectors, or where the product's temporary is large);
- `add_param_vjp(operator, acc, stored, first, cts, row_blocks=True)`: `acc` plus
  the chunk's share of the gradient, `param_vjp` of a slice of the stored stack.
  The dense and BCOO kinds specialise it to bound its temporary memory;
- `mv_add(operator, x, y)`: $y + A x$, which the BCOO kind scatter-adds into `y`
  itself (a step of the reverse pass);
- `chunk_steps(x0, most)`: the cap on a chunk's numbers, whatever the kind;
- `operator_numbers(operator)`: how many numbers its gradient holds;

and the two operator kinds that only the scan makes: `DenseRowsOperator` (a dense
matrix applied to a block held as rows) and `BatchedOperator` (one operator
applied to a batch of vectors, under `jax.vmap`).

A new operator kind needs nothing here: the generic paths serve it
(`python benchmarks/bench_operators.py` measures whether a specialisation pays).
"""

import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jax.experimental import sparse
from jaxtyping import Array, Inexact, Shaped

from ._operator import (
    AbstractOperator,
    DenseOperator,
    FunctionOperator,
    SparseOperator,
)
from ._sharding import is_explicit, like_input
from ._sparse import add_sampled, spmv_add

# How many steps the reverse pass takes per chunk, unless the operator asks for
# fewer (`gradient_chunk`); and how many vectors a chunk's buffers may hold where
# the operator sizes the chunk to them (with the few vectors the loops keep
# besides, under 64).
CHUNK = 64
GRADIENT_VECTORS = 48
# ... and no more than `CHUNK_ELEMENTS` numbers, so that a chunk of very wide
# vectors (the node features of a large graph) holds few of them.
CHUNK_ELEMENTS = 2**22


def chunk_steps(x0: Array, most: int = CHUNK) -> int:
    """At most `most` steps of vectors like `x0`, and no more than
    `CHUNK_ELEMENTS` numbers (at least one step)."""
    return max(1, min(most, CHUNK_ELEMENTS // max(1, x0.size)))


def _cotangent(operator: AbstractOperator) -> AbstractOperator:
    # `equinox.filter_custom_vjp` wants cotangents with the structure of
    # `equinox.filter(vjp_arg, equinox.is_inexact_array)`.
    return eqx.filter(operator, eqx.is_inexact_array)


# The reverse pass adds each chunk's gradient of a dense (n, n)
# matrix, one GEMM, into its running sum. How it bounds the chunk's buffers (its
# adjoint vectors, the copy of its stored vectors that the GEMM reads, the product),
# for vectors of v numbers:
# - from `LEAN_FROM` rows on, blocks of `ROW_BLOCK` rows of the product, each added
#   in place, and chunks of `LEAN_CHUNK` steps: 24 + 24 + 16 = 64 vectors;
# - below, one product of n^2 numbers and as many steps as `GRADIENT_VECTORS`
#   vectors leave room for (`budget_chunk`), at least one: a step's rank-one (or
#   rank-b) gradient then adds into the running sum in place, as in plain autodiff;
# - except for vectors of fewer than `SMALL` numbers: there a chunk's fixed costs
#   dominate cheap steps, and chunks of `CHUNK` steps keep the reverse pass about
#   twice as fast as plain autodiff's, for about 2 * 64 + n + 8 extra vectors (at
#   most 161 at n = 32, 47 KiB at n = 63, in float32; see docs/adjoint.md).
LEAN_FROM = 256
ROW_BLOCK = 16
LEAN_CHUNK = 24
SMALL = 64
# Steps per chunk for a BCOO matrix (see `gradient_chunk`).
SPARSE_CHUNK = 8


def _add_by_rows(
    acc: Array, product: Callable[[int | Array, int], Array], block: int
) -> Array:
    """`acc + P` for a `P` like `acc` given by rows: `product(start, size)` is
    `P[start:start + size]`. Blocks of `block` rows (contiguous in memory), each
    added in place, so the temporary is one block rather than a second `acc`."""
    full, rest = divmod(acc.shape[0], block)

    def add(acc, start, size):
        part = lax.dynamic_slice_in_dim(acc, start, size)
        return lax.dynamic_update_slice_in_dim(
            acc, part + product(start, size), start, 0
        )

    if full:
        acc = lax.fori_loop(0, full, lambda j, acc: add(acc, j * block, block), acc)
    return add(acc, full * block, rest) if rest else acc


def _row_block(matrix: Array) -> int | None:
    """Rows per block of the gradient of a dense `matrix`; `None`: one product (on
    an explicit mesh, the product states its sharding instead; see `param_vjp`)."""
    if matrix.shape[0] >= LEAN_FROM and not is_explicit(matrix):
        return ROW_BLOCK
    return None


def _dense_chunk(matrix: Array, vector_size: int) -> int:
    if is_explicit(matrix):
        return CHUNK
    if _row_block(matrix) is not None:
        return LEAN_CHUNK
    return budget_chunk(matrix.size, vector_size)


def budget_chunk(arrays: int, vector_size: int) -> int:
    """Steps per chunk when a chunk's gradient of the operator's arrays (`arrays`
    numbers) is one temporary of their size: as many as `GRADIENT_VECTORS` vectors
    leave room for beside it (each step keeps an adjoint vector and a copy of a
    stored one), at least one. One step per chunk adds each step's gradient into
    the running sum in place, as plain autodiff does. Vectors smaller than `SMALL`
    numbers take chunks of `CHUNK` steps (see above)."""
    if vector_size < SMALL:
        return CHUNK
    room = GRADIENT_VECTORS * vector_size - arrays
    return max(1, min(CHUNK, room // (2 * vector_size)))


class DenseRowsOperator(AbstractOperator):
    r"""A dense matrix $A$ applied to a block held as rows: $Z \mapsto Z A^\top$.

    The scan uses it for a dense matrix and a block $x_0$ of shape `(n, b)` (see
    `_scan.py`): it runs on $Z = X^\top$ of shape `(b, n)`, so that the stacks of
    vectors and of adjoints, `(k, b, n)`, are `(k b, n)` matrices as they lie in
    memory and the gradient is one GEMM that reads them without copying. With the
    block as columns, `(k, n, b)`, XLA copies both stacks into a GEMM layout first
    (1.5x plain scan's temporary memory at b = 8), and $A^\top \Lambda$ for a
    block contracts $A$'s first axis, several times slower per step on CPU than a
    plain product.

    It holds $A^\top$, formed once outside the scan, so that both the forward step
    $Z A^\top$ and the reverse step $\Lambda A$ are plain matrix products.
    """

    transposed: Inexact[Array, "n n"]

    def mv(self, z: Shaped[Array, "b n"]) -> Shaped[Array, "b n"]:
        dims = (((1,), (0,)), ((), ()))
        return lax.dot_general(z, self.transposed, dims, out_sharding=like_input(z))

    def transpose(self) -> AbstractOperator:
        # Forms A itself: called once, outside the reverse scan.
        return DenseRowsOperator(self.transposed.T)

    def as_matrix(self) -> Array:
        return self.transposed.T

    def param_vjp(self, xs: Array, cts: Array) -> AbstractOperator:
        # The cotangent of A^T for sum_k <ct_k, x_k A^T> is sum over the stack and
        # the rows of x^T ct: both stacks as (k b, n) matrices (a reshape without
        # copy) and one GEMM contracting their rows. On an explicit mesh with the
        # block axis sharded that reshape is not expressible; there both axes are
        # contracted directly (and XLA copies one stack).
        spec = jax.typeof(xs).sharding.spec
        n = xs.shape[-1]
        if len(spec) > 1 and spec[1] is not None:
            lhs, rhs, axes = xs, cts, (0, 1)
        else:
            # An explicit row count: `-1` is ambiguous for an empty block (b = 0).
            rows = math.prod(xs.shape[:-1])
            lhs, rhs, axes = xs.reshape(rows, n), cts.reshape(rows, n), (0,)
        grad = lax.dot_general(
            lhs,
            rhs,
            ((axes, axes), ((), ())),
            out_sharding=jax.typeof(self.transposed).sharding,
        )
        return _cotangent(DenseRowsOperator(grad))


class BatchedOperator(AbstractOperator):
    """An operator applied to a batch of vectors: each vector has its own copy of the
    same `inner` operator, as under `jax.vmap` of a call with one operator.

    A vector of this operator has a leading batch axis; a stack of them, `(k, B, ...)`,
    is a stack of `k B` vectors of `inner`, so the gradient of the shared operator
    sums over the batch in the same batched product.
    """

    inner: AbstractOperator

    def mv(self, x: Array) -> Array:
        return jax.vmap(self.inner.mv)(x)

    def transpose(self) -> AbstractOperator:
        return BatchedOperator(self.inner.transpose())

    def as_matrix(self) -> Array:
        return self.inner.as_matrix()

    def mm(self, xs: Array) -> Array:
        return self.inner.mm(_merge(xs)).reshape(xs.shape)

    def param_vjp(self, xs: Array, cts: Array) -> AbstractOperator:
        return _cotangent(
            BatchedOperator(self.inner.param_vjp(_merge(xs), _merge(cts)))
        )


def _merge(xs: Array) -> Array:
    """A stack `(k, B, ...)` of batches as one stack of `k B` vectors."""
    return xs.reshape(xs.shape[0] * xs.shape[1], *xs.shape[2:])


def _dense_add_param_vjp(operator, acc, stored, first, cts, row_blocks):
    block = _row_block(operator.matrix) if row_blocks else None
    if block is None:
        return _generic_add_param_vjp(operator, acc, stored, first, cts)
    axes = (0, *range(2, cts.ndim))
    xs = lax.dynamic_slice_in_dim(stored, first, cts.shape[0])

    def product(start, size):
        rows = lax.dynamic_slice_in_dim(cts, start, size, axis=1)
        return lax.dot_general(rows, xs, ((axes, axes), ((), ())))

    assert isinstance(acc, DenseOperator)
    return _cotangent(DenseOperator(_add_by_rows(acc.matrix, product, block)))


def _rows_add_param_vjp(operator, acc, stored, first, cts, row_blocks):
    block = _row_block(operator.transposed) if row_blocks else None
    if block is None:
        return _generic_add_param_vjp(operator, acc, stored, first, cts)
    xs = lax.dynamic_slice_in_dim(stored, first, cts.shape[0])
    n = xs.shape[-1]
    rows = math.prod(xs.shape[:-1])
    lhs, rhs = xs.reshape(rows, n), cts.reshape(rows, n)

    def product(start, size):
        part = lax.dynamic_slice_in_dim(lhs, start, size, axis=1)
        return lax.dot_general(part, rhs, (((0,), (0,)), ((), ())))

    assert isinstance(acc, DenseRowsOperator)
    return _cotangent(DenseRowsOperator(_add_by_rows(acc.transposed, product, block)))


def _sparse_add_param_vjp(operator, acc, stored, first, cts):
    # data_e += sum_k <ct_k[row_e], x_k[col_e]>, a chunk of entries at a time,
    # reading the stored vectors in place.
    assert isinstance(acc, SparseOperator)
    indices, shape = operator.matrix.indices, operator.matrix.shape
    data = add_sampled(
        acc.matrix.data, indices, operator.transposed, cts, stored, first
    )
    grad = SparseOperator(
        sparse.BCOO((data, indices), shape=shape),
        operator.transposed,
    )
    return _cotangent(grad)


def _batched_add_param_vjp(operator, acc, stored, first, cts, row_blocks):
    assert isinstance(acc, BatchedOperator)
    batch = cts.shape[1]
    inner = add_param_vjp(
        operator.inner,
        acc.inner,
        _merge(stored),
        first * batch,
        _merge(cts),
        row_blocks=row_blocks,
    )
    return _cotangent(BatchedOperator(inner))


def _generic_add_param_vjp(operator, acc, stored, first, cts):
    xs = lax.dynamic_slice_in_dim(stored, first, cts.shape[0])
    return jtu.tree_map(jnp.add, acc, operator.param_vjp(xs, cts))


def add_param_vjp(
    operator: AbstractOperator,
    acc: AbstractOperator,
    stored: Array,
    first: Array | int,
    cts: Array,
    *,
    row_blocks: bool = True,
) -> AbstractOperator:
    """`acc` plus `operator.param_vjp(xs, cts)` for the `k = len(cts)` stored
    vectors `xs = stored[first:first + k]`: how the reverse pass sums its chunks.
    Without `row_blocks`, a dense matrix's share is one product even from
    `LEAN_FROM` rows on (a temporary as large as the matrix)."""
    if isinstance(operator, DenseOperator):
        return _dense_add_param_vjp(operator, acc, stored, first, cts, row_blocks)
    if isinstance(operator, DenseRowsOperator):
        return _rows_add_param_vjp(operator, acc, stored, first, cts, row_blocks)
    if isinstance(operator, SparseOperator):
        return _sparse_add_param_vjp(operator, acc, stored, first, cts)
    if isinstance(operator, BatchedOperator):
        return _batched_add_param_vjp(operator, acc, stored, first, cts, row_blocks)
    return _generic_add_param_vjp(operator, acc, stored, first, cts)


def operator_numbers(operator: AbstractOperator) -> int:
    """How many numbers the operator's inexact arrays hold (its gradient's size)."""
    leaves = jtu.tree_leaves(eqx.filter(operator, eqx.is_inexact_array))
    return sum(x.size for x in leaves)


def gradient_chunk(operator: AbstractOperator, vector_size: int) -> int:
    """How many steps the reverse pass may take per chunk, for vectors of
    `vector_size` numbers: how many adjoint vectors it keeps at once."""
    if isinstance(operator, DenseOperator):
        return _dense_chunk(operator.matrix, vector_size)
    if isinstance(operator, DenseRowsOperator):
        return _dense_chunk(operator.transposed, vector_size)
    if isinstance(operator, SparseOperator):
        # The sampled product gathers, for each entry, the chunk's adjoint and
        # stored vectors at its row and column: with 8 steps per chunk those
        # gathers stay small enough for the cache, and a chunk keeps about 5
        # vectors beyond plain autodiff (24 steps: about 50, and the gradient
        # took 1.2-1.4x longer at n = 512 with 8 entries per row; 0.9x at
        # n = 20k).
        return SPARSE_CHUNK
    if isinstance(operator, FunctionOperator):
        # A chunk's gradient of the callable's arrays is one batched VJP, whose
        # output is a temporary as large as those arrays.
        return budget_chunk(operator_numbers(operator), vector_size)
    if isinstance(operator, BatchedOperator):
        return gradient_chunk(operator.inner, vector_size)
    return CHUNK


def mv_add(operator: AbstractOperator, x: Array, y: Array) -> Array:
    """$y + A x$; for a BCOO matrix scatter-added into `y` itself."""
    if isinstance(operator, SparseOperator):
        matrix = operator.matrix
        n = matrix.shape[0]
        sorted_rows = matrix.indices_sorted and not operator.transposed
        return spmv_add(
            matrix.data, matrix.indices, x, y, n, operator.transposed, sorted_rows
        )
    return y + operator.mv(x)
