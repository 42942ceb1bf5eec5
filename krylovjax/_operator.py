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
- `mm(xs)`: $A$ applied to a stack of inputs along a new leading axis, in one
  batched call;
- `param_vjp(xs, cts)`: the cotangent of the operator's arrays for
  $\sum_k \langle \bar y_k, A x_k \rangle$, one batched VJP of `mm` over the
  whole stack rather than $k$ sequential rank-one updates.

That is all an operator is. How the scan's derivative passes cut their work into
chunks for each kind, and the kinds only the scan uses, live with the scan
(`_chunks.py`); validation of `A` lives in `_checks.py`.

Adding an operator kind means one class here and one branch in `as_operator`
(and, only where a benchmark shows that it pays, a chunk policy in `_chunks.py`).
"""

import abc
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jax.experimental import sparse
from jaxtyping import Array, Inexact, Shaped

from ._checks import (
    check_bcoo_matrix,
    check_inexact,
    check_matrix_shape,
    check_operator_type,
    is_numpy_array,
    standard_result_type,
)
from ._linearity import check_linear
from ._sharding import (
    any_unplaced,
    describe_type,
    explicit_mesh,
    like_input,
    on_common_mesh,
    typed_like,
)
from ._sparse import add_sampled, spmv


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
        typed = describe_type(x0)
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        msg = (
            f"`{arg}` cannot be applied to `{vector}` of type {typed}: JAX cannot "
            f"type the callable's products for that sharding ({reason}). On an "
            f"`Explicit` mesh give `{vector}` a sharding that the callable accepts, "
            f"or state its products' shardings inside it (`out_sharding=`)."
        )
        raise ValueError(msg) from err


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
        return lax.dot_general(self.matrix, x, dims, out_sharding=like_input(x))

    def transpose(self) -> AbstractOperator:
        return DenseTransposeOperator(self.matrix)

    def as_matrix(self) -> Array:
        return self.matrix

    def mm(self, xs: Shaped[Array, "k n ..."]) -> Shaped[Array, "k n ..."]:
        return jnp.einsum(
            "nm,km...->kn...", self.matrix, xs, out_sharding=like_input(xs)
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
        return lax.dot_general(self.matrix, y, dims, out_sharding=like_input(y))

    def transpose(self) -> AbstractOperator:
        return DenseOperator(self.matrix)

    def as_matrix(self) -> Array:
        return self.matrix.T


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
    A: Any, x0: Array, fn_name: str, vector: str = "x0", column: bool = False
) -> tuple[AbstractOperator, Array]:
    """Validate `A` against `x0` and return `(operator, x0)` in the internal form;
    errors call `x0` by its argument name in `fn_name`, `vector`, or with `column`
    a column of it (a block method checks its operator against one column; a
    matrix's shape is checked against the whole block there).

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
        check_matrix_shape(A.shape, x0, fn_name, vector)
        check_bcoo_matrix(A, arg)
        check_inexact(A.data, arg)
        dtype = standard_result_type(A.data, x0)
        mesh = explicit_mesh(A.data, A.indices, x0)
        data, indices, x0 = on_common_mesh(mesh, (A.data, A.indices, x0))
        matrix = sparse.BCOO((data.astype(dtype), indices), shape=A.shape)
        return SparseOperator(matrix), x0.astype(dtype)
    if isinstance(A, jax.Array) or is_numpy_array(A):
        check_matrix_shape(A.shape, x0, fn_name, vector)
        # Before `jnp.asarray`, which turns int64 into int32 when x64 is disabled.
        check_inexact(A, arg)
        A = jnp.asarray(A)
        dtype = standard_result_type(A, x0)
        A, x0 = on_common_mesh(explicit_mesh(A, x0), (A, x0))
        return DenseOperator(A.astype(dtype)), x0.astype(dtype)
    if callable(A):
        fn, out = convert_callable(A, x0, arg, f"{fn_name}({vector}=...)")
        like = f"a column of `{vector}`" if column else f"`{vector}`"
        if not isinstance(out, jax.ShapeDtypeStruct):
            msg = (
                f"`{arg}` must be a callable that returns one array of the same shape "
                f"and dtype as {like}; it returned a pytree {out}."
            )
            raise TypeError(msg)
        if out.shape != x0.shape:
            msg = (
                f"`{arg}` must be a callable that returns an array of the same shape "
                f"as {like}, {x0.shape}; it returned shape {out.shape}."
            )
            raise ValueError(msg)
        if out.dtype != x0.dtype:
            msg = (
                f"`{arg}` must be a callable that returns an array of the same dtype "
                f"as {like}, {x0.dtype}; it returned dtype {out.dtype}."
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
