r"""One internal form for every operator that `krylov` accepts.

`krylov(A, x0, d)` accepts a dense `(n, n)` array, a
`jax.experimental.sparse.BCOO` matrix, or any callable that maps arrays of `x0`'s
shape to arrays of the same shape and dtype (a closure, an `equinox.Module`, a bound
method such as a lineax operator's `.mv`). `as_operator` turns each of these into an
[`AbstractOperator`][] so that the algorithms are written once. An operator is a
pytree whose floating-point leaves are exactly the arrays that gradients must reach:
the dense matrix, the BCOO values, or every array a callable closes over (made
explicit by `equinox.filter_closure_convert`).

Every operator offers the four things the forward and reverse passes need:

- `mv(x)`: $A x$ for one vector (or block) of `x0`'s shape;
- `transpose(like)`: a function $y \mapsto A^\top y$, which is the vector-Jacobian
  product of $x \mapsto A x$ (JAX's convention: the transpose, not the conjugate
  transpose, also for complex dtypes);
- `mm(xs)`: $A$ applied to a stack of inputs along a new leading axis, in one batched
  call;
- `param_vjp(xs, cts)`: the cotangent of the operator's arrays for
  $\sum_k \langle \bar y_k, A x_k \rangle$, computed as one batched operation over
  the whole stack (one GEMM for a dense matrix, one sampled product for BCOO, one
  batched VJP for a callable) rather than $k$ sequential rank-one updates.
"""

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.experimental import sparse
from jaxtyping import Array, Inexact, Shaped

from ._checks import check_bcoo_matrix, check_inexact
from ._linearity import check_linear


class AbstractOperator(eqx.Module):
    """A linear operator in the form the algorithms consume."""

    def mv(self, x: Array) -> Array:
        raise NotImplementedError

    def transpose(self, like: Array) -> Callable[[Array], Array]:
        raise NotImplementedError

    def mm(self, xs: Array) -> Array:
        return jax.vmap(self.mv)(xs)

    def param_vjp(self, xs: Array, cts: Array) -> "AbstractOperator":
        raise NotImplementedError

    def add_param_vjp(
        self, acc: "AbstractOperator", xs: Array, cts: Array
    ) -> "AbstractOperator":
        """`acc` plus `param_vjp(xs, cts)`: how the reverse pass sums its chunks."""
        return jtu.tree_map(jnp.add, acc, self.param_vjp(xs, cts))


# The reverse pass adds each chunk's (n, n) gradient of a dense matrix into its
# running sum this many rows at a time, so that no second (n, n) array exists.
ROW_BLOCK = 64


def _add_by_rows(
    acc: Array, product: Callable[[int | Array, int], Array], block: int = ROW_BLOCK
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


def _by_rows(matrix: Array) -> bool:
    # Worth it once the matrix is taller than a block; on an explicit mesh the
    # product states its sharding instead (see `param_vjp`).
    mesh = jax.typeof(matrix).sharding.mesh
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    return matrix.shape[0] > ROW_BLOCK and not explicit


def _cotangent(operator: AbstractOperator) -> AbstractOperator:
    # `equinox.filter_custom_vjp` wants cotangents with the structure of
    # `equinox.filter(vjp_arg, equinox.is_inexact_array)`.
    return eqx.filter(operator, eqx.is_inexact_array)


class DenseOperator(AbstractOperator):
    """A dense square matrix."""

    matrix: Inexact[Array, "n n"]

    def mv(self, x: Shaped[Array, "n ..."]) -> Shaped[Array, "n ..."]:
        return self.matrix @ x

    def transpose(self, like: Array) -> Callable[[Array], Array]:
        del like
        # Contract the matrix's first axis directly: `matrix.T @ y` would make XLA
        # materialise the transposed matrix inside every step of the reverse scan.
        # (A dense matrix with a block x0 takes `DenseRowsOperator` instead.)
        return lambda y: lax.dot_general(self.matrix, y, (((0,), (0,)), ((), ())))

    def mm(self, xs: Shaped[Array, "k n *b"]) -> Shaped[Array, "k n *b"]:
        return jnp.einsum("nm,km...->kn...", self.matrix, xs)

    def param_vjp(self, xs: Array, cts: Array) -> AbstractOperator:
        # sum_k ct_k x_k^T: contract the stack axis and any block axis in one GEMM.
        axes = (0, *range(2, xs.ndim))
        # `out_sharding`: on an explicit mesh, a contraction over a sharded axis (a
        # sharded block of x0) must be told where the result lives: with the matrix.
        grad = lax.dot_general(
            cts,
            xs,
            ((axes, axes), ((), ())),
            out_sharding=jax.typeof(self.matrix).sharding,
        )
        return _cotangent(DenseOperator(grad))

    def add_param_vjp(self, acc: AbstractOperator, xs: Array, cts: Array):
        if not _by_rows(self.matrix):
            return super().add_param_vjp(acc, xs, cts)
        axes = (0, *range(2, xs.ndim))

        def product(start, size):
            rows = lax.dynamic_slice_in_dim(cts, start, size, axis=1)
            return lax.dot_general(rows, xs, ((axes, axes), ((), ())))

        assert isinstance(acc, DenseOperator)
        return _cotangent(DenseOperator(_add_by_rows(acc.matrix, product)))


class DenseRowsOperator(AbstractOperator):
    r"""A dense matrix $A$ applied to a block held as rows: $Z \mapsto Z A^\top$.

    `krylov` uses it for a dense matrix and a block $x_0$ of shape `(n, b)`: the scan
    runs on $Z = X^\top$ of shape `(b, n)`, so that the stacks of vectors and of
    adjoints, `(k, b, n)`, are `(k b, n)` matrices as they lie in memory and the
    gradient is one GEMM that reads them without copying. With the block as columns,
    `(k, n, b)`, XLA copies both stacks into a GEMM layout first (1.5x plain scan's
    temporary memory at b = 8), and $A^\top \Lambda$ for a block contracts $A$'s
    first axis, several times slower per step on CPU than a plain product.

    It holds $A^\top$, formed once outside the scan, so that both the forward step
    $Z A^\top$ and the reverse step $\Lambda A$ are plain matrix products.
    """

    transposed: Inexact[Array, "n n"]

    def mv(self, z: Shaped[Array, "b n"]) -> Shaped[Array, "b n"]:
        return z @ self.transposed

    def transpose(self, like: Array) -> Callable[[Array], Array]:
        del like
        matrix = self.transposed.T  # A itself: called once, outside the reverse scan
        return lambda y: y @ matrix

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

    def add_param_vjp(self, acc: AbstractOperator, xs: Array, cts: Array):
        if not _by_rows(self.transposed):
            return super().add_param_vjp(acc, xs, cts)
        n = xs.shape[-1]
        rows = math.prod(xs.shape[:-1])
        lhs, rhs = xs.reshape(rows, n), cts.reshape(rows, n)

        def product(start, size):
            part = lax.dynamic_slice_in_dim(lhs, start, size, axis=1)
            return lax.dot_general(part, rhs, (((0,), (0,)), ((), ())))

        assert isinstance(acc, DenseRowsOperator)
        return _cotangent(DenseRowsOperator(_add_by_rows(acc.transposed, product)))


class SparseOperator(AbstractOperator):
    """A two-dimensional `jax.experimental.sparse.BCOO` matrix."""

    matrix: sparse.BCOO

    def mv(self, x: Array) -> Array:
        return self.matrix @ x

    def transpose(self, like: Array) -> Callable[[Array], Array]:
        del like
        transposed = self.matrix.transpose()
        return lambda y: transposed @ y

    def mm(self, xs: Array) -> Array:
        # (n, k*prod(b)) -> (n, k, *b) -> (k, n, *b). Reshaping the transposed
        # product straight to xs.shape would mix the stack and block axes.
        out = self.matrix @ _as_columns(xs)
        return jnp.moveaxis(out.reshape(xs.shape[1], xs.shape[0], *xs.shape[2:]), 0, 1)

    def param_vjp(self, xs: Array, cts: Array) -> AbstractOperator:
        # One batched VJP with respect to the stored values: the sampled product
        # data_j -> sum_k ct_k[row_j] x_k[col_j], for all k at once.
        indices, shape = self.matrix.indices, self.matrix.shape

        def apply(data):
            return sparse.BCOO((data, indices), shape=shape) @ _as_columns(xs)

        _, vjp = jax.vjp(apply, self.matrix.data)
        (grad,) = vjp(_as_columns(cts))
        return _cotangent(SparseOperator(sparse.BCOO((grad, indices), shape=shape)))

    def add_param_vjp(self, acc: AbstractOperator, xs: Array, cts: Array):
        # data_j += sum_k ct_k[row_j] . x_k[col_j], a block of stored entries at a
        # time: the gathered rows are (k, n / 4, *b), a quarter of a chunk of
        # vectors, never (k, nnz, *b) as the batched VJP of `param_vjp` would be.
        indices, shape = self.matrix.indices, self.matrix.shape
        block = max(1, shape[0] // 4)
        axes = (0, *range(2, xs.ndim))

        def product(start, size):
            entries = lax.dynamic_slice_in_dim(indices, start, size)
            ct_rows = jnp.take(cts, entries[:, 0], axis=1)
            x_cols = jnp.take(xs, entries[:, 1], axis=1)
            return jnp.sum(ct_rows * x_cols, axis=axes)

        assert isinstance(acc, SparseOperator)
        data = _add_by_rows(acc.matrix.data, product, block)
        return _cotangent(SparseOperator(sparse.BCOO((data, indices), shape=shape)))


def _as_columns(xs: Shaped[Array, "k n *b"]) -> Shaped[Array, "n k*b"]:
    """Stack of k inputs (k, n, *b) -> one (n, k*prod(b)) matrix."""
    columns = xs.shape[0] * math.prod(xs.shape[2:])
    return jnp.moveaxis(xs, 0, 1).reshape(xs.shape[1], columns)


class FunctionOperator(AbstractOperator):
    """A linear callable, closure-converted so that its arrays are pytree leaves."""

    fn: Callable

    def mv(self, x: Array) -> Array:
        return self.fn(x)

    def transpose(self, like: Array) -> Callable[[Array], Array]:
        # The operator is linear, so its VJP at any point is A^T. Linearise once, at
        # zero, outside of any loop; the returned function is reused at every step.
        out, vjp = jax.vjp(self.fn, jnp.zeros_like(like))
        return lambda y: vjp(self._like(y, out))[0]

    def param_vjp(self, xs: Array, cts: Array) -> AbstractOperator:
        diff, static = eqx.partition(self.fn, eqx.is_inexact_array)

        def apply(diff):
            return jax.vmap(eqx.combine(diff, static))(xs)

        out, vjp = jax.vjp(apply, diff)
        (grad,) = vjp(self._like(cts, out))
        return _cotangent(FunctionOperator(grad))

    @staticmethod
    def _like(ct: Array, out: Array) -> Array:
        """`ct` with the sharding type of `out`; a no-op unless the mesh is `Explicit`.

        A VJP takes cotangents typed exactly like the function's output. On an
        explicit mesh the sharding is part of that type, and a callable's output need
        not be sharded like its input: `lambda v: A @ v` with a row-sharded `A` gives
        a row-sharded vector even for a replicated `v`, while the cotangents (the
        adjoint vectors) keep `x0`'s sharding.
        """
        sharding = jax.typeof(out).sharding
        if jax.typeof(ct).sharding == sharding:
            return ct
        return jax.sharding.reshard(ct, sharding)


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

    def transpose(self, like: Array) -> Callable[[Array], Array]:
        transpose_mv = self.inner.transpose(like[0])
        return jax.vmap(transpose_mv)

    def mm(self, xs: Array) -> Array:
        return self.inner.mm(_merge(xs)).reshape(xs.shape)

    def param_vjp(self, xs: Array, cts: Array) -> AbstractOperator:
        return _cotangent(
            BatchedOperator(self.inner.param_vjp(_merge(xs), _merge(cts)))
        )

    def add_param_vjp(self, acc: AbstractOperator, xs: Array, cts: Array):
        assert isinstance(acc, BatchedOperator)
        inner = self.inner.add_param_vjp(acc.inner, _merge(xs), _merge(cts))
        return _cotangent(BatchedOperator(inner))


def _merge(xs: Array) -> Array:
    """A stack `(k, B, ...)` of batches as one stack of `k B` vectors."""
    return xs.reshape(xs.shape[0] * xs.shape[1], *xs.shape[2:])


def _describe(x: Any) -> str:
    kind = f"an object of type {type(x).__name__}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{kind} with shape {tuple(x.shape)} and dtype {x.dtype}"
    return kind


def as_operator(A: Any, x0: Array, fn_name: str) -> tuple[AbstractOperator, Array]:
    """Validate `A` against `x0` and return `(operator, x0)` in the internal form.

    For a matrix `A` (dense or BCOO) the dtypes of `A` and `x0` are promoted to their
    common type (`jnp.result_type`), so a complex matrix with a real `x0` gives a
    complex Krylov matrix; weak types count as in JAX's own `A @ x0` (a weakly typed
    `x0` takes the matrix's dtype). A callable must itself return `x0`'s shape and
    dtype, and be linear: nonlinear and affine maps raise a `TypeError`.
    """
    arg = f"{fn_name}(A=...)"
    hint = _unsupported(A)
    if hint is not None:
        msg = (
            f"`{arg}` must be a square array, a `jax.experimental.sparse.BCOO` matrix "
            f"or a callable; got {hint}"
        )
        raise TypeError(msg)
    if isinstance(A, sparse.BCOO):
        _check_matrix_shape(A.shape, x0, fn_name)
        check_bcoo_matrix(A, arg)
        check_inexact(A.data, arg)
        dtype = jnp.result_type(A.data, x0)
        data = A.data.astype(dtype)
        matrix = sparse.BCOO((data, A.indices), shape=A.shape)
        return SparseOperator(matrix), x0.astype(dtype)
    if isinstance(A, jax.Array) or _is_numpy_array(A):
        _check_matrix_shape(A.shape, x0, fn_name)
        # Before `jnp.asarray`, which turns int64 into int32 when x64 is disabled.
        check_inexact(A, arg)
        A = jnp.asarray(A)
        dtype = jnp.result_type(A, x0)
        return DenseOperator(A.astype(dtype)), x0.astype(dtype)
    if callable(A):
        fn = eqx.filter_closure_convert(A, x0)
        out = jax.eval_shape(fn, x0)
        if not isinstance(out, jax.ShapeDtypeStruct):
            msg = (
                f"`{arg}` must be a callable that returns one array of the same shape "
                f"and dtype as `x0`; it returned a pytree {out}."
            )
            raise TypeError(msg)
        if out.shape != x0.shape:
            msg = (
                f"`{arg}` must be a callable that returns an array of the same shape "
                f"as `x0`, {x0.shape}; it returned shape {out.shape}."
            )
            raise ValueError(msg)
        if out.dtype != x0.dtype:
            msg = (
                f"`{arg}` must be a callable that returns an array of the same dtype "
                f"as `x0`, {x0.dtype}; it returned dtype {out.dtype}."
            )
            raise TypeError(msg)
        check_linear(fn, x0, arg)
        return FunctionOperator(fn), x0
    msg = (
        f"`{arg}` must be a square array, a `jax.experimental.sparse.BCOO` matrix or "
        f"a callable; got {_describe(A)}."
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


def _check_matrix_shape(shape: tuple[int, ...], x0: Array, fn_name: str) -> None:
    if len(shape) != 2 or shape[0] != shape[1]:
        msg = f"`{fn_name}(A=...)` must be a square matrix; got shape {tuple(shape)}."
        raise ValueError(msg)
    if x0.ndim not in (1, 2):
        msg = (
            f"`{fn_name}(x0=...)` must have shape (n,) or (n, b) when `A` is a matrix; "
            f"got shape {x0.shape}."
        )
        raise ValueError(msg)
    if x0.shape[0] != shape[0]:
        msg = (
            f"`{fn_name}(x0=...)` must have first axis of length {shape[0]} to match "
            f"`A` of shape {tuple(shape)}; got shape {x0.shape}."
        )
        raise ValueError(msg)
