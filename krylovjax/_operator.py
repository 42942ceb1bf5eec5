r"""One internal form for every operator that `krylov` accepts.

`krylov(A, x0, d)` accepts a dense `(n, n)` array, a
`jax.experimental.sparse.BCOO` matrix, or any callable that maps arrays of `x0`'s
shape to arrays of the same shape and dtype (a closure, an `equinox.Module`, a bound
method such as a lineax operator's `.mv`). `as_operator` turns each of these into an
[`AbstractOperator`][] so that the algorithms are written once. An operator is a
pytree whose floating-point leaves are exactly the arrays that gradients must reach:
the dense matrix, the BCOO values, or every array a callable closes over (made
explicit by `equinox.filter_closure_convert`).

The interface, modelled on lineax's `AbstractLinearOperator`:

- `mv(x)`: $A x$ for one vector (or block) of `x0`'s shape;
- `transpose()`: the operator $A^\top$, whose `mv` is the vector-Jacobian product of
  $x \mapsto A x$ (JAX's convention: the transpose, not the conjugate transpose,
  also for complex dtypes). A callable keeps its input structure, so no example
  input is needed; a callable is linearised once, when `transpose()` is called;
- `as_matrix()`: the matrix that `mv` applies to each vector (for a callable, to
  `x0` flattened);
- `mv_add(x, y)`: $y + A x$, which the BCOO kind scatter-adds into `y` itself (a
  step of the reverse pass);
- `mm(xs)`: $A$ applied to a stack of inputs along a new leading axis, in one
  batched call;
- `param_vjp(xs, cts)`: the cotangent of the operator's arrays for
  $\sum_k \langle \bar y_k, A x_k \rangle$, one batched VJP of `mm` over the
  whole stack rather than $k$ sequential rank-one updates;
- `add_param_vjp(acc, stored, first, cts)`: `acc` plus `param_vjp` for a slice of
  a stack, how the reverse pass sums its chunks. The dense and BCOO kinds
  specialise it to bound the temporary memory (see each class).

Adding an operator kind means one class here and one branch in `as_operator`.
"""

import abc
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.core import Tracer
from jax.experimental import sparse
from jaxtyping import Array, Inexact, Shaped

from ._checks import check_bcoo_matrix, check_inexact, standard_result_type
from ._linearity import check_linear
from ._sparse import add_sampled, spmv, spmv_add

# How many steps the reverse pass of `krylov` takes per chunk (see `_scan.py`), unless
# the operator asks for fewer (`AbstractOperator.gradient_chunk`); and how many
# vectors a chunk's buffers may hold where the operator sizes the chunk to them
# (with the few vectors the loops keep besides, under 64).
CHUNK = 64
GRADIENT_VECTORS = 48


class AbstractOperator(eqx.Module):
    """A linear operator in the form the algorithms consume."""

    @abc.abstractmethod
    def mv(self, x: Array) -> Array:
        """$A x$ for one input of `x0`'s shape."""

    @abc.abstractmethod
    def transpose(self) -> "AbstractOperator":
        r"""The operator $A^\top$ (the VJP of `mv`; no conjugation)."""

    @abc.abstractmethod
    def as_matrix(self) -> Array:
        """The matrix of `mv` on one vector: `(n, n)`."""

    def mv_add(self, x: Array, y: Array) -> Array:
        """$y + A x$ (a kind may compute it in place of `y`)."""
        return y + self.mv(x)

    def mm(self, xs: Array) -> Array:
        """`mv` of every input of a stack `(k, ...)`, in one batched call."""
        return jax.vmap(self.mv)(xs)

    def param_vjp(self, xs: Array, cts: Array) -> "AbstractOperator":
        r"""The cotangent of the operator's inexact arrays for
        $\sum_k \langle \mathrm{cts}_k, A\,\mathrm{xs}_k \rangle$: one VJP of `mm`."""
        diff, static = eqx.partition(self, eqx.is_inexact_array)
        out, vjp = jax.vjp(lambda diff: eqx.combine(diff, static).mm(xs), diff)
        (grad,) = vjp(typed_like(cts, out))
        return grad

    def gradient_chunk(self, vector_size: int) -> int:
        """How many steps the reverse pass of `krylov` may take per chunk (fewer for
        very wide vectors): how many adjoint vectors it keeps at once, for vectors
        of `vector_size` numbers."""
        return CHUNK

    def add_param_vjp(
        self, acc: "AbstractOperator", stored: Array, first: Array | int, cts: Array
    ) -> "AbstractOperator":
        """`acc` plus `param_vjp(xs, cts)` for the `k = len(cts)` stored vectors
        `xs = stored[first:first + k]`: how the reverse pass sums its chunks."""
        xs = lax.dynamic_slice_in_dim(stored, first, cts.shape[0])
        return jtu.tree_map(jnp.add, acc, self.param_vjp(xs, cts))


def typed_like(y: Array, like: Array) -> Array:
    """`y` with the sharding type of `like`; a no-op unless `like`'s mesh is
    `Explicit`.

    On an explicit mesh the sharding is part of an array's type. A VJP takes
    cotangents typed exactly like the function's output, and a scan carry must keep
    its type: `A @ x` for a row-sharded `A` is typed row-sharded even when `x` is
    replicated, and a callable's output need not be sharded like its input. On an
    `Auto` mesh or none, XLA places arrays itself (and an array made inside
    `jax.set_mesh` may name a mesh that its input does not), so nothing is done.
    """
    sharding = jax.typeof(like).sharding
    if jax.sharding.AxisType.Explicit not in sharding.mesh.axis_types:
        return y
    if jax.typeof(y).sharding == sharding:
        return y
    return jax.sharding.reshard(y, sharding)


def _sharding_of(x: Any) -> Any:
    """The sharding of an array or `jax.ShapeDtypeStruct`: a concrete array's own
    (on a concrete `Mesh`, which an eager `reshard` needs), else its type's (on an
    abstract mesh)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x.sharding
    if isinstance(x, jax.Array) and not isinstance(x, Tracer):
        return x.sharding
    return jax.typeof(x).sharding


def explicit_mesh(*trees: Any) -> Any:
    """The mesh of the first array (or `jax.ShapeDtypeStruct`) among the leaves of
    `trees` that lies on a mesh with an `Explicit` axis, replicated or not; `None`
    if there is none."""
    for x in jtu.tree_leaves(trees):
        if not (eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)):
            continue
        mesh = getattr(_sharding_of(x), "mesh", None)
        if mesh is not None and jax.sharding.AxisType.Explicit in mesh.axis_types:
            return mesh
    return None


def _unplaced(x: Any) -> bool:
    return eqx.is_array(x) and jax.typeof(x).sharding.mesh.empty


def convert_callable(A: Callable, x0: Any, arg: str, vector: str) -> tuple:
    """`closure_convert(A, x0)` and the shape of its output.

    On an explicit mesh a callable whose own products JAX cannot type for `x0`'s
    sharding (a matrix split by columns times a vector split by rows; under
    `jax.vmap`, a matrix split by rows times a batch split on the same axis)
    raises a `ValueError` naming both arguments, rather than JAX's error from
    inside the callable, later. There the callable is also applied once to `x0`
    itself, whose batch axis under `jax.vmap` its shape does not show (the
    result is unused: under `jax.jit` nothing of it is compiled)."""
    try:
        fn = closure_convert(A, x0)
        out = jax.eval_shape(fn, x0)
        if explicit_mesh(fn, x0, out) is not None:
            fn(x0)
        return fn, out
    except Exception as err:
        # JAX's sharding errors have no public names.
        if type(err).__name__ not in ("ShardingTypeError", "DuplicateSpecError"):
            raise
        typed = _typed(x0)
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        msg = (
            f"`{arg}` cannot be applied to `{vector}` of type {typed}: JAX cannot "
            f"type the callable's products for that sharding ({reason}). On an "
            f"`Explicit` mesh give `{vector}` a sharding that the callable accepts, "
            f"or state its products' shardings inside it (`out_sharding=`)."
        )
        raise ValueError(msg) from err


def _typed(x: Any) -> str:
    """`x`'s type with its sharding, as JAX writes it (`float64[8@x]`); the types
    of a pytree's leaves, comma-separated."""
    types = []
    for leaf in jtu.tree_leaves(x):
        aval = jax.typeof(leaf)
        try:
            types.append(aval.str_short(mesh_axis_types=True))
        except TypeError:  # a JAX that does not name the axis types
            types.append(aval.str_short())
    return ", ".join(types)


def on_common_mesh(mesh: Any, tree: Any) -> Any:
    """`tree` with each array that lies on no mesh replicated on `mesh` (`None`:
    `tree` unchanged).

    On an explicit mesh an array that was never placed (a plain `jnp.ones(n)`) has
    a type without a mesh, and it does not mix with the operator's: `A @ x0` is
    typed on `A`'s mesh, so the scan's carry, the concatenation of `x0` with the
    stack and the reverse pass's buffers would not match, and a contraction over a
    sharded axis cannot state its result's sharding on a matrix without a mesh.
    Replicated on the mesh of the others, it is what `device_put(x, P())` makes;
    its gradient comes back as it came in.
    """
    if mesh is None:
        return tree

    def place(x):
        if not _unplaced(x):
            return x
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return jax.sharding.reshard(jnp.asarray(x), sharding)

    return jtu.tree_map(place, tree)


def any_unplaced(tree: Any) -> bool:
    """Whether an array among the leaves of `tree` lies on no mesh."""
    return any(_unplaced(x) for x in jtu.tree_leaves(tree))


# The reverse pass (see `_scan.py`) adds each chunk's gradient of a dense (n, n)
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
# Steps per chunk for a BCOO matrix (see `SparseOperator.gradient_chunk`).
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


def _explicit(matrix: Array) -> bool:
    mesh = jax.typeof(matrix).sharding.mesh
    return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def _like_input(x: Array) -> Any:
    """The output sharding of a reverse step's product with input `x`: `x`'s own on
    an explicit mesh, where a contraction over an axis that both operands shard
    (`A` sharded by rows, and `x0` too) must be told where the result lives, as
    JAX's own transpose of the forward product is; `None` (XLA's choice) elsewhere.
    """
    return jax.typeof(x).sharding if _explicit(x) else None


def _row_block(matrix: Array) -> int | None:
    """Rows per block of the gradient of a dense `matrix`; `None`: one product (on
    an explicit mesh, the product states its sharding instead; see `param_vjp`)."""
    if matrix.shape[0] >= LEAN_FROM and not _explicit(matrix):
        return ROW_BLOCK
    return None


def _dense_chunk(matrix: Array, vector_size: int) -> int:
    if _explicit(matrix):
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


def _cotangent(operator: AbstractOperator) -> AbstractOperator:
    # `equinox.filter_custom_vjp` wants cotangents with the structure of
    # `equinox.filter(vjp_arg, equinox.is_inexact_array)`.
    return eqx.filter(operator, eqx.is_inexact_array)


class DenseOperator(AbstractOperator):
    """A dense square matrix."""

    matrix: Inexact[Array, "n n"]

    def mv(self, x: Shaped[Array, "n ..."]) -> Shaped[Array, "n ..."]:
        # Typed like `x` on an explicit mesh (see `_like_input`): a column-sharded
        # matrix and an `x` split by rows contract an axis that both shard.
        dims = (((1,), (0,)), ((), ()))
        return lax.dot_general(self.matrix, x, dims, out_sharding=_like_input(x))

    def transpose(self) -> AbstractOperator:
        return DenseTransposeOperator(self.matrix)

    def as_matrix(self) -> Array:
        return self.matrix

    def mm(self, xs: Shaped[Array, "k n ..."]) -> Shaped[Array, "k n ..."]:
        return jnp.einsum(
            "nm,km...->kn...", self.matrix, xs, out_sharding=_like_input(xs)
        )

    def param_vjp(self, xs: Array, cts: Array) -> AbstractOperator:
        # sum_k ct_k x_k^T: contract the stack axis and any block axis in one GEMM.
        # `out_sharding`: on an explicit mesh, a contraction over a sharded axis (a
        # sharded block of x0) must be told where the result lives: with the matrix.
        axes = (0, *range(2, xs.ndim))
        grad = lax.dot_general(
            cts,
            xs,
            ((axes, axes), ((), ())),
            out_sharding=jax.typeof(self.matrix).sharding,
        )
        return _cotangent(DenseOperator(grad))

    def gradient_chunk(self, vector_size: int) -> int:
        return _dense_chunk(self.matrix, vector_size)

    def add_param_vjp(self, acc: AbstractOperator, stored, first, cts):
        block = _row_block(self.matrix)
        if block is None:
            return super().add_param_vjp(acc, stored, first, cts)
        axes = (0, *range(2, cts.ndim))
        xs = lax.dynamic_slice_in_dim(stored, first, cts.shape[0])

        def product(start, size):
            rows = lax.dynamic_slice_in_dim(cts, start, size, axis=1)
            return lax.dot_general(rows, xs, ((axes, axes), ((), ())))

        assert isinstance(acc, DenseOperator)
        return _cotangent(DenseOperator(_add_by_rows(acc.matrix, product, block)))


class DenseTransposeOperator(AbstractOperator):
    r"""$A^\top$ for a dense matrix $A$, kept as $A$.

    `mv` contracts the matrix's first axis directly: `A.T @ y` would make XLA
    materialise the transposed matrix (inside every step of a loop, or once as a
    second `(n, n)` array outside it). On an explicit mesh its output is sharded
    like its input (see `_like_input`).
    """

    matrix: Inexact[Array, "n n"]

    def mv(self, y: Shaped[Array, "n ..."]) -> Shaped[Array, "n ..."]:
        dims = (((0,), (0,)), ((), ()))
        return lax.dot_general(self.matrix, y, dims, out_sharding=_like_input(y))

    def transpose(self) -> AbstractOperator:
        return DenseOperator(self.matrix)

    def as_matrix(self) -> Array:
        return self.matrix.T


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
        return lax.dot_general(z, self.transposed, dims, out_sharding=_like_input(z))

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

    def gradient_chunk(self, vector_size: int) -> int:
        return _dense_chunk(self.transposed, vector_size)

    def add_param_vjp(self, acc: AbstractOperator, stored, first, cts):
        block = _row_block(self.transposed)
        if block is None:
            return super().add_param_vjp(acc, stored, first, cts)
        xs = lax.dynamic_slice_in_dim(stored, first, cts.shape[0])
        n = xs.shape[-1]
        rows = math.prod(xs.shape[:-1])
        lhs, rhs = xs.reshape(rows, n), cts.reshape(rows, n)

        def product(start, size):
            part = lax.dynamic_slice_in_dim(lhs, start, size, axis=1)
            return lax.dot_general(part, rhs, (((0,), (0,)), ((), ())))

        assert isinstance(acc, DenseRowsOperator)
        return _cotangent(
            DenseRowsOperator(_add_by_rows(acc.transposed, product, block))
        )


class SparseOperator(AbstractOperator):
    """A two-dimensional `jax.experimental.sparse.BCOO` matrix, or its transpose.

    Products and the gradient of the stored values take the entries a chunk at a
    time (`_sparse.py`), so their temporaries are bounded by a chunk rather than by
    the number of stored entries times the width of `x0`.
    """

    matrix: sparse.BCOO
    # Whether this is the matrix's transpose (the indices are read the other way
    # round, never copied).
    transposed: bool = eqx.field(static=True, default=False)

    def mv(self, x: Array) -> Array:
        n = self.matrix.shape[0]
        sorted_rows = self.matrix.indices_sorted and not self.transposed
        return spmv(
            self.matrix.data, self.matrix.indices, x, n, self.transposed, sorted_rows
        )

    def mv_add(self, x: Array, y: Array) -> Array:
        n = self.matrix.shape[0]
        sorted_rows = self.matrix.indices_sorted and not self.transposed
        data, indices = self.matrix.data, self.matrix.indices
        return spmv_add(data, indices, x, y, n, self.transposed, sorted_rows)

    def transpose(self) -> AbstractOperator:
        return SparseOperator(self.matrix, not self.transposed)

    def as_matrix(self) -> Array:
        data, indices = self.matrix.data, self.matrix.indices
        mesh = explicit_mesh(data, indices)
        if mesh is not None:
            # JAX's `todense` scatters the entries with no sharding it can state
            # when they are split on an explicit mesh; the product with the
            # identity states it (`_sparse.spmv`), and gives it a gradient. The
            # matrix is replicated on the mesh, also when the call is outside it.
            n = self.matrix.shape[0]
            eye = on_common_mesh(mesh, jnp.eye(n, dtype=data.dtype))
            return typed_like(spmv(data, indices, eye, n, self.transposed, False), eye)
        dense = self.matrix.todense()
        return dense.T if self.transposed else dense

    def mm(self, xs: Array) -> Array:
        # One product for the whole stack: (n, k*prod(b)) -> (n, k, *b) -> (k, n, *b).
        # Reshaping the transposed product straight to xs.shape would mix the stack
        # and block axes.
        out = self.mv(_as_columns(xs))
        return jnp.moveaxis(out.reshape(xs.shape[1], xs.shape[0], *xs.shape[2:]), 0, 1)

    def param_vjp(self, xs: Array, cts: Array) -> AbstractOperator:
        # The whole stack as one block of columns, (n, k*b): each entry then reads
        # two contiguous rows, where a stack (k, n) would be read with stride n.
        indices, shape = self.matrix.indices, self.matrix.shape
        data = jnp.zeros_like(self.matrix.data, jnp.result_type(self.matrix.data, cts))
        data = add_sampled(
            data,
            indices,
            self.transposed,
            _as_columns(cts)[None],
            _as_columns(xs)[None],
            0,
        )
        grad = SparseOperator(
            sparse.BCOO((data, indices), shape=shape), self.transposed
        )
        return _cotangent(grad)

    def gradient_chunk(self, vector_size: int) -> int:
        # The sampled product gathers, for each entry, the chunk's adjoint and
        # stored vectors at its row and column: with 8 steps per chunk those
        # gathers stay small enough for the cache, and a chunk keeps about 5 vectors
        # beyond plain autodiff (24 steps: about 50, and the gradient took 1.2-1.4x
        # longer at n = 512 with 8 entries per row; 0.9x at n = 20k).
        return SPARSE_CHUNK

    def add_param_vjp(self, acc: AbstractOperator, stored, first, cts):
        # data_e += sum_k <ct_k[row_e], x_k[col_e]>, a chunk of entries at a time,
        # reading the stored vectors in place.
        assert isinstance(acc, SparseOperator)
        indices, shape = self.matrix.indices, self.matrix.shape
        data = add_sampled(
            acc.matrix.data, indices, self.transposed, cts, stored, first
        )
        grad = SparseOperator(
            sparse.BCOO((data, indices), shape=shape), self.transposed
        )
        return _cotangent(grad)


def _as_columns(xs: Shaped[Array, "k n ..."]) -> Shaped[Array, "n _"]:
    """Stack of k inputs (k, n, *b) -> one (n, k*prod(b)) matrix."""
    columns = xs.shape[0] * math.prod(xs.shape[2:])
    return jnp.moveaxis(xs, 0, 1).reshape(xs.shape[1], columns)


class FunctionOperator(AbstractOperator):
    """A linear callable, closure-converted so that its arrays are pytree leaves.

    It keeps the structure of its input (`x0`'s shape and dtype), as lineax's
    `FunctionLinearOperator` does, so that `transpose()` and `as_matrix()` need no
    example input.
    """

    fn: Callable
    # `jax.typeof(x0)`: shape, dtype and, on a mesh, sharding.
    in_structure: Any = eqx.field(static=True)

    def mv(self, x: Array) -> Array:
        return self.fn(x)

    def transpose(self) -> AbstractOperator:
        # The operator is linear, so its VJP at any point is A^T: linearise once, at
        # zero. Call this outside of any loop and reuse the result at every step.
        x = _zeros(self.in_structure)
        out, vjp = jax.vjp(self.fn, x)

        def transposed(y):
            return vjp(typed_like(y, out))[0]

        return FunctionOperator(
            eqx.filter_closure_convert(transposed, x), self.in_structure
        )

    def gradient_chunk(self, vector_size: int) -> int:
        # A chunk's gradient of the callable's arrays is one batched VJP, whose
        # output is a temporary as large as those arrays.
        leaves = jtu.tree_leaves(eqx.filter(self, eqx.is_inexact_array))
        return budget_chunk(sum(x.size for x in leaves), vector_size)

    def as_matrix(self) -> Array:
        # Column j is A e_j for the j-th unit input, `x0` flattened.
        shape, dtype = self.in_structure.shape, self.in_structure.dtype
        size = math.prod(shape)
        units = jnp.eye(size, dtype=dtype).reshape(size, *shape)
        sharding = self.in_structure.sharding
        if jax.sharding.AxisType.Explicit not in sharding.mesh.axis_types:
            return jax.vmap(self.fn)(units).reshape(size, size).T
        # On an explicit mesh each unit input is typed like `x0` (the converted
        # callable checks it), and the columns are gathered before they are
        # flattened, which a split axis does not allow.
        spec = jax.sharding.PartitionSpec(None, *sharding.spec)
        units = jax.sharding.reshard(units, sharding.update(spec=spec))
        columns = jax.vmap(self.fn)(units)
        replicated = sharding.update(spec=jax.sharding.PartitionSpec())
        return jax.sharding.reshard(columns, replicated).reshape(size, size).T


def _zeros(structure: Any) -> Array:
    # Zeros of an abstract array's type, its sharding on an explicit mesh included.
    zeros = jnp.zeros(structure.shape, structure.dtype)
    if jax.typeof(zeros).sharding == structure.sharding:
        return zeros
    return jax.sharding.reshard(zeros, structure.sharding)


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

    def gradient_chunk(self, vector_size: int) -> int:
        return self.inner.gradient_chunk(vector_size)

    def add_param_vjp(self, acc: AbstractOperator, stored, first, cts):
        assert isinstance(acc, BatchedOperator)
        batch = cts.shape[1]
        inner = self.inner.add_param_vjp(
            acc.inner, _merge(stored), first * batch, _merge(cts)
        )
        return _cotangent(BatchedOperator(inner))


def _merge(xs: Array) -> Array:
    """A stack `(k, B, ...)` of batches as one stack of `k B` vectors."""
    return xs.reshape(xs.shape[0] * xs.shape[1], *xs.shape[2:])


def _describe(x: Any) -> str:
    kind = f"an object of type {type(x).__name__}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{kind} with shape {tuple(x.shape)} and dtype {x.dtype}"
    return kind


def closure_convert(fn: Callable, *args: Any) -> Callable:
    """`equinox.filter_closure_convert(fn, *args)`, with every array that `fn` closes
    over made a JAX array.

    A Python float that `jax.grad` or `jax.jvp` is called with becomes a tracer
    whose value is a Python scalar type, not an array. The derivative rules
    (Equinox's custom rules and primitives, and the library's) split their
    arguments into arrays, which are differentiated, and the rest, which is static:
    such a value would lose its derivative, or make the rule fail. `jnp.asarray`
    gives it an array value; it changes nothing for an array.
    """
    converted = eqx.filter_closure_convert(fn, *args)
    return jtu.tree_map(lambda x: jnp.asarray(x) if eqx.is_array(x) else x, converted)


def as_operator(
    A: Any, x0: Array, fn_name: str, vector: str = "x0"
) -> tuple[AbstractOperator, Array]:
    """Validate `A` against `x0` and return `(operator, x0)` in the internal form;
    errors call `x0` by its argument name in `fn_name`, `vector`.

    For a matrix `A` (dense or BCOO) the dtypes of `A` and `x0` are promoted to their
    common type (`jnp.result_type` under JAX's standard rules, also when the caller
    has set `jax_numpy_dtype_promotion="strict"`), so a complex matrix with a real
    `x0` gives a complex Krylov matrix; weak types count as in JAX's own `A @ x0` (a
    weakly typed `x0` takes the matrix's dtype). A callable must itself return
    `x0`'s shape and dtype, and be linear: nonlinear and affine maps raise a
    `TypeError`. When some of the arrays (of `A`, of `x0`, or the callable's output)
    lie on a mesh with `Explicit` axes, those that lie on no mesh are replicated on
    it (`on_common_mesh`).
    """
    arg = f"{fn_name}(A=...)"
    check_operator_type(A, arg)
    if isinstance(A, sparse.BCOO):
        _check_matrix_shape(A.shape, x0, fn_name, vector)
        check_bcoo_matrix(A, arg)
        check_inexact(A.data, arg)
        dtype = standard_result_type(A.data, x0)
        mesh = explicit_mesh(A.data, A.indices, x0)
        data, indices, x0 = on_common_mesh(mesh, (A.data, A.indices, x0))
        matrix = sparse.BCOO((data.astype(dtype), indices), shape=A.shape)
        return SparseOperator(matrix), x0.astype(dtype)
    if isinstance(A, jax.Array) or _is_numpy_array(A):
        _check_matrix_shape(A.shape, x0, fn_name, vector)
        # Before `jnp.asarray`, which turns int64 into int32 when x64 is disabled.
        check_inexact(A, arg)
        A = jnp.asarray(A)
        dtype = standard_result_type(A, x0)
        A, x0 = on_common_mesh(explicit_mesh(A, x0), (A, x0))
        return DenseOperator(A.astype(dtype)), x0.astype(dtype)
    if callable(A):
        fn, out = convert_callable(A, x0, arg, f"{fn_name}({vector}=...)")
        if not isinstance(out, jax.ShapeDtypeStruct):
            msg = (
                f"`{arg}` must be a callable that returns one array of the same shape "
                f"and dtype as `{vector}`; it returned a pytree {out}."
            )
            raise TypeError(msg)
        if out.shape != x0.shape:
            msg = (
                f"`{arg}` must be a callable that returns an array of the same shape "
                f"as `{vector}`, {x0.shape}; it returned shape {out.shape}."
            )
            raise ValueError(msg)
        if out.dtype != x0.dtype:
            msg = (
                f"`{arg}` must be a callable that returns an array of the same dtype "
                f"as `{vector}`, {x0.dtype}; it returned dtype {out.dtype}."
            )
            raise TypeError(msg)
        mesh = explicit_mesh(fn, x0, out)
        if mesh is not None and any_unplaced(x0):
            # Traced again with `x0` on the mesh: the conversion checks its type.
            x0 = on_common_mesh(mesh, x0)
            fn = closure_convert(A, x0)
        fn = on_common_mesh(mesh, fn)
        check_linear(fn, x0, arg)
        return FunctionOperator(fn, jax.typeof(x0)), x0
    raise AssertionError  # `check_operator_type` let through no other kind


def check_operator_type(A: Any, arg: str) -> None:
    """Raise a `TypeError` naming `arg` unless `A` is a dense array, a BCOO matrix or
    a callable; for a sparse or masked type that is not taken, say how to convert
    it."""
    hint = _unsupported(A)
    if hint is None and (
        isinstance(A, sparse.BCOO | jax.Array) or _is_numpy_array(A) or callable(A)
    ):
        return
    got = hint if hint is not None else f"{_describe(A)}."
    msg = (
        f"`{arg}` must be a square array, a `jax.experimental.sparse.BCOO` matrix or "
        f"a callable; got {got}"
    )
    raise TypeError(msg)


def _unsupported(A: Any) -> str | None:
    """Describe a matrix type that `krylov` does not take, and how to convert it."""
    kind = type(A).__name__
    if type(A).__module__.startswith("scipy.sparse"):
        return (
            f"a SciPy sparse matrix of type {kind}. Convert it with "
            f"`jax.experimental.sparse.BCOO.from_scipy_sparse(A)`."
        )
    if isinstance(A, sparse.BCSR):
        return "a `jax.experimental.sparse.BCSR` matrix. Convert it with `A.to_bcoo()`."
    if isinstance(A, sparse.JAXSparse) and not isinstance(A, sparse.BCOO):
        return (
            f"a `jax.experimental.sparse` matrix of type {kind}. Convert it with "
            f"`jax.experimental.sparse.BCOO.fromdense(A.todense())`."
        )
    if isinstance(A, np.ma.MaskedArray):
        return (
            "a NumPy masked array, whose masked entries have no value to use. Fill "
            "them explicitly, e.g. `np.ma.filled(A, 0)` for a matrix that is zero "
            "there."
        )
    return None


def _is_numpy_array(A: Any) -> bool:
    return type(A).__module__ == "numpy" and hasattr(A, "shape")


def _check_matrix_shape(
    shape: tuple[int, ...], x0: Array, fn_name: str, vector: str
) -> None:
    if len(shape) != 2 or shape[0] != shape[1]:
        msg = f"`{fn_name}(A=...)` must be a square matrix; got shape {tuple(shape)}."
        raise ValueError(msg)
    if x0.ndim not in (1, 2):
        msg = (
            f"`{fn_name}({vector}=...)` must have shape (n,) or (n, b) when `A` is a "
            f"matrix; got shape {x0.shape}."
        )
        raise ValueError(msg)
    if x0.shape[0] != shape[0]:
        msg = (
            f"`{fn_name}({vector}=...)` must have first axis of length {shape[0]} to "
            f"match `A` of shape {tuple(shape)}; got shape {x0.shape}."
        )
        raise ValueError(msg)
