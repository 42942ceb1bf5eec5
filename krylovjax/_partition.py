r"""A sparse operator split by rows over the devices of a mesh, with halo exchange.

On a mesh, the BCOO products of `_sparse.py` all-gather the whole vector (`n * b`
numbers) for every product, however the graph is numbered. Sparse Krylov codes that
scale do otherwise: each device keeps a block of rows of $A$ and, for each product,
receives from the other devices only the entries of $x$ that its rows read (the
*halo*). This module builds that layout once, on the host, and applies it inside
`jax.shard_map`.

**Partitioning** (`partition_graph`, NumPy, on every host). The nodes are renumbered
by a locality-preserving order (reverse Cuthill-McKee from `scipy.sparse.csgraph` by
default, or one the user gives) and cut into `P` equal blocks of `n_local` rows (the
last padded with empty rows, so that `P * n_local >= n`). Device $i$ keeps the entries
of its rows. A column that another device $j$ owns is a halo row: device $i$ receives
it from $j$ over the *shift* $s = (i - j) \bmod P$. For each shift with any halo, one
`lax.ppermute` sends, from every device that has rows for the device $s$ places after
it, a buffer as long as the largest such list; a graph numbered with locality has
halos over few shifts.

**The product** ($y = A x$ on device $i$):

$$ \tilde x = [x_i;\ r_{s_1};\ r_{s_2};\ \dots], \qquad
   r_s = \mathrm{ppermute}_s(x_{i - s}[\mathrm{send}_s]), \qquad
   y_i = \sum_{e \in i} a_e\, \tilde x_{c_e} \text{ at row } r_e, $$

the last by the chunked sparse product of `_sparse.py`, whose memory is a chunk of
entries, not all of them. Its derivatives are JAX's: the transpose of a `ppermute`
is the `ppermute` back, the transpose of the gather of sent rows a local scatter-add.
So $A^\top y$ (the reverse pass of `krylov`), the cotangent of the edge weights
($\bar a_e = \langle \bar y_{r_e}, \tilde x_{c_e} \rangle$) and forward-mode tangents
move the same halo rows and nothing else. `krylov`, the bases, the readouts,
`lanczos`, `funm_action`, `trace_funm` and `KrylovGraphConv` take the operator like
any other callable.

Vectors live in the partitioned numbering, `(P * n_local, ...)`, split by rows over
the mesh axis: `GraphPartition.to_partitioned` and `from_partitioned` convert
(differentiably). Padded rows hold zeros and stay zero.
"""

import math
from functools import partial
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import sparse
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P, reshard
from jaxtyping import Array, ArrayLike, Inexact, Int, Shaped

from ._checks import check_inexact
from ._sharding import explicit_mesh, typed_like
from ._sparse import spmv


class PartitionedOperator(eqx.Module):
    r"""A square sparse matrix split by rows over one axis of a mesh, applied with
    halo exchange. Made by [`krylovjax.GraphPartition.operator`][].

    Call it on a vector or block `x` of shape `(P * n_local, ...)` in the
    partitioned numbering; it returns $A x$ in the same numbering and sharding.
    Pass it as `A` to [`krylovjax.krylov`][] and the other functions, or as the
    adjacency of [`krylovjax.nn.KrylovGraphConv`][]. `values` is its only
    floating-point array: gradients with respect to the operator reach it, and
    [`krylovjax.GraphPartition.from_partitioned_values`][] maps them back to
    the input's entries.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.experimental import sparse
        >>> import krylovjax
        >>> A = sparse.BCOO.fromdense(jnp.array([[0.0, 1.0], [1.0, 0.0]]))
        >>> part = krylovjax.partition_graph(A, 1, order=None)
        >>> mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> op = part.operator(mesh)
        >>> op(jnp.array([1.0, 2.0]))
        Array([2., 1.], dtype=float32)
        >>> def product(op, w):  # differentiable in the input's entries `w`
        ...     op = op.with_values(part.to_partitioned_values(w))
        ...     return op(jnp.array([1.0, 2.0]))
        >>> product(op, 3 * A.data)
        Array([6., 3.], dtype=float32)

        ```
    """

    values: Inexact[Array, "parts entries"]
    rows: Int[Array, "parts entries"]
    cols: Int[Array, "parts entries"]
    sends: tuple[Int[Array, "parts _"], ...]
    pairs: tuple[tuple[tuple[int, int], ...], ...] = eqx.field(static=True)
    mesh: Mesh = eqx.field(static=True)
    axis: str = eqx.field(static=True)
    n_local: int = eqx.field(static=True)

    @property
    def shape(self) -> tuple[int, int]:
        """`(P * n_local, P * n_local)`."""
        n = self.n_local * self.mesh.shape[self.axis]
        return (n, n)

    @property
    def dtype(self) -> Any:
        return self.values.dtype

    def with_values(
        self, values: Inexact[Array, "parts entries"]
    ) -> "PartitionedOperator":
        """The same sparsity with the stored values `values`, of the operator's
        `(P, m)` shape (from [`krylovjax.GraphPartition.to_partitioned_values`][]),
        split over the mesh axis like the operator's own. Works inside `jax.jit`,
        where gradients reach `values`."""
        arg = "PartitionedOperator.with_values(values=...)"
        values = _checked_values(values, self.values.shape, arg, "the operator's")
        sharding = NamedSharding(self.mesh, P(self.axis))
        if AxisType.Explicit in self.mesh.axis_types:
            values = reshard(values, sharding)
        else:
            values = jax.lax.with_sharding_constraint(values, sharding)
        return eqx.tree_at(lambda op: op.values, self, values)

    def __call__(self, x: Shaped[Array, "n ..."]) -> Shaped[Array, "n ..."]:
        if x.ndim < 1 or x.shape[0] != self.shape[0]:
            msg = (
                f"A `PartitionedOperator` of shape {self.shape} must be applied to an "
                f"array with {self.shape[0]} rows (the partitioned numbering, see "
                f"`GraphPartition.to_partitioned`); got shape {x.shape}."
            )
            raise ValueError(msg)
        spec = P(self.axis)
        local = partial(
            _local_product,
            axis=self.axis,
            pairs=self.pairs,
            n_local=self.n_local,
        )
        product = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(spec, spec, spec, (spec,) * len(self.sends), spec),
            out_specs=spec,
            check_vma=False,
        )
        if AxisType.Explicit not in self.mesh.axis_types:
            return product(self.values, self.rows, self.cols, self.sends, x)
        # On an `Explicit` mesh the vector is typed: split by rows for the product,
        # and the result typed like `x` (no-ops for `x` split by rows already).
        rows = NamedSharding(self.mesh, P(self.axis))
        y = product(self.values, self.rows, self.cols, self.sends, reshard(x, rows))
        return typed_like(y, x)


def _local_product(values, rows, cols, sends, x, *, axis, pairs, n_local):
    """One device's rows of $A x$: receive the halo rows over each shift (from the
    devices that have any for it; the others receive zeros, which no entry reads),
    append them to the local rows, and multiply by the local entries."""
    received = [
        lax.ppermute(x[send[0]], axis, perm=list(perm))
        for perm, send in zip(pairs, sends, strict=True)
    ]
    extended = jnp.concatenate([x, *received], axis=0) if received else x
    indices = jnp.stack([rows[0], cols[0]], axis=1)
    # A square product over the extended rows (the sparse product's tangent has the
    # shape of its input), of which the first `n_local` rows are this device's.
    y = spmv(values[0], indices, extended, extended.shape[0], False, True)
    return y[:n_local]


class GraphPartition:
    r"""How the rows of a sparse matrix are split over `P` devices: the node order,
    the blocks, and the halo each device receives. Made by
    [`krylovjax.partition_graph`][] on the host (NumPy); not a pytree.

    **Attributes:**

    - `num_nodes`: $n$, the matrix's size.
    - `num_parts`: $P$, the number of blocks (devices).
    - `n_local`: rows per block, $\lceil n / P \rceil$.
    - `order`: `order[p]` is the input node placed at position `p` of the
        partitioned numbering (length $n$).
    - `halo`: a `(P, P)` integer array, `halo[i, j]` the number of rows that device
        `i` receives from device `j` for each product.
    - `shifts`: the shifts $s$ (device `i` receives from `i - s`) over which any
        rows move; each costs one `lax.ppermute` per product.

    !!! Example

        ```python
        >>> import numpy as np
        >>> from jax.experimental import sparse
        >>> import krylovjax
        >>> n = 8  # a path graph: each node reads its two neighbours
        >>> rows = np.r_[np.arange(1, n), np.arange(n - 1)]
        >>> cols = np.r_[np.arange(n - 1), np.arange(1, n)]
        >>> entries = np.stack([rows, cols], 1)
        >>> A = sparse.BCOO((np.ones(2 * n - 2), entries), shape=(n, n))
        >>> part = krylovjax.partition_graph(A, 2, order=None)
        >>> part.halo.tolist()  # one row each way across the cut
        [[0, 1], [1, 0]]
        >>> part.bytes_per_product(width=64, dtype=np.float32)
        512

        ```
    """

    def __init__(self, *, num_nodes, num_parts, n_local, order, entries, layout):
        self.num_nodes = num_nodes
        self.num_parts = num_parts
        self.n_local = n_local
        self.order = order
        self._entries = entries  # per input entry: its slot in the (P, m) layout
        self._layout = layout  # rows, cols, sends, shifts, halo, values
        self.halo = layout["halo"]
        self.shifts = layout["shifts"]
        self._inverse = np.empty(num_nodes, np.int64)
        self._inverse[order] = np.arange(num_nodes)

    def __repr__(self) -> str:
        received = int(self.halo.sum(axis=1).max()) if self.num_parts else 0
        return (
            f"GraphPartition(num_nodes={self.num_nodes}, num_parts={self.num_parts}, "
            f"n_local={self.n_local}, shifts={self.shifts}, "
            f"largest halo={received} rows)"
        )

    def bytes_per_product(self, width: int = 1, dtype: Any = np.float32) -> int:
        """The bytes each product sends over the wire, summed over the devices, for
        vectors of `width` columns of `dtype`: for each shift, one buffer as long
        as the shift's largest halo from every device that sends any rows over it."""
        rows = sum(
            len(pairs) * send.shape[1]
            for pairs, send in zip(
                self._layout["pairs"], self._layout["sends"], strict=True
            )
        )
        return rows * width * np.dtype(dtype).itemsize

    def to_partitioned(self, x: ArrayLike) -> Array:
        """`x` of shape `(n, ...)` in the input numbering as `(P * n_local, ...)` in
        the partitioned one: rows reordered, zero rows appended (differentiable).
        An `x` split over an `Explicit` mesh comes back replicated on it, since rows
        move between devices; place the result by rows (`P(axis, None)`)."""
        x = jnp.asarray(x)
        if x.ndim < 1 or x.shape[0] != self.num_nodes:
            msg = (
                f"`GraphPartition.to_partitioned(x=...)` must have {self.num_nodes} "
                f"rows (one per node); got shape {x.shape}."
            )
            raise ValueError(msg)
        pad = self.num_parts * self.n_local - self.num_nodes
        order = jnp.asarray(np.r_[self.order, np.full(pad, self.num_nodes)])
        return _permute_rows(x, order)

    def from_partitioned(self, y: ArrayLike) -> Array:
        """The inverse of `to_partitioned`: `(P * n_local, ...)` back to `(n, ...)`
        in the input numbering (differentiable)."""
        y = jnp.asarray(y)
        if y.ndim < 1 or y.shape[0] != self.num_parts * self.n_local:
            msg = (
                f"`GraphPartition.from_partitioned(y=...)` must have "
                f"{self.num_parts * self.n_local} rows (the partitioned numbering); "
                f"got shape {y.shape}."
            )
            raise ValueError(msg)
        return _permute_rows(y, jnp.asarray(self._inverse))

    def to_partitioned_values(self, values: ArrayLike) -> Array:
        """One value per stored entry of the input matrix, in its order (its
        `data`, padding included), as the `(P, m)` values of a
        `PartitionedOperator` (for
        [`krylovjax.PartitionedOperator.with_values`][]; differentiable, so a
        loss of the operator has a gradient in the input's entries)."""
        arg = "GraphPartition.to_partitioned_values(values=...)"
        values = _checked_values(
            values, self._entries.shape, arg, "one value per stored entry of the input"
        )
        shape = self._layout["rows"].shape
        flat = jnp.zeros(math.prod(shape), values.dtype)
        flat = flat.at[jnp.asarray(self._entries)].set(
            values, mode="drop", unique_indices=True
        )
        return flat.reshape(shape)

    def from_partitioned_values(self, values: ArrayLike) -> Array:
        """The inverse of `to_partitioned_values`: the `(P, m)` values of a
        `PartitionedOperator` (or their gradient) as one value per entry of the
        input matrix, in its order (differentiable). Entries outside the matrix
        (JAX's padding) get zero, as their gradient in JAX's own products."""
        values = jnp.asarray(values)
        expected = self._layout["rows"].shape
        if values.shape != expected:
            msg = (
                f"`GraphPartition.from_partitioned_values(values=...)` must have "
                f"shape {expected} (a `PartitionedOperator`'s values); got shape "
                f"{values.shape}."
            )
            raise ValueError(msg)
        return _permute_rows(values.reshape(-1), jnp.asarray(self._entries))

    def operator(self, mesh: Mesh, axis: str | None = None) -> PartitionedOperator:
        r"""The matrix as a [`krylovjax.PartitionedOperator`][] on `mesh`.

        **Arguments:**

        - `mesh`: a `jax.sharding.Mesh` (of either axis type, over one or several
            processes) whose axis `axis` has `num_parts` devices.
        - `axis`: the mesh axis the rows are split over; may be omitted for a mesh
            with one axis.

        **Returns:**

        The operator with the input matrix's values, its arrays placed on `mesh`
        split along `axis` (each process places its own devices' blocks). Call
        it outside `jax.jit` and pass the operator in: over several processes a
        compiled function cannot hold global arrays as constants. For other
        values (learnable edge weights), see
        [`krylovjax.PartitionedOperator.with_values`][].
        """
        if not isinstance(mesh, Mesh):
            msg = (
                "`GraphPartition.operator(mesh=...)` must be a `jax.sharding.Mesh`; "
                f"got {type(mesh).__name__}."
            )
            raise TypeError(msg)
        if axis is None:
            if len(mesh.axis_names) != 1:
                msg = (
                    "`GraphPartition.operator(axis=...)` must name one of the mesh's "
                    f"axes {mesh.axis_names}, since it has more than one."
                )
                raise ValueError(msg)
            axis = str(mesh.axis_names[0])
        if axis not in mesh.axis_names or mesh.shape[axis] != self.num_parts:
            size = mesh.shape.get(axis)
            msg = (
                f"`GraphPartition.operator(mesh=..., axis={axis!r})` must be a mesh "
                f"axis of {self.num_parts} devices (the partition's num_parts); the "
                f"mesh has axes {dict(mesh.shape)}"
                + ("." if size is None else f", {axis!r} of size {size}.")
            )
            raise ValueError(msg)
        layout = self._layout
        sharding = NamedSharding(mesh, P(axis))
        return PartitionedOperator(
            values=_place(layout["values"], sharding),
            rows=_place(layout["rows"], sharding),
            cols=_place(layout["cols"], sharding),
            sends=tuple(_place(s, sharding) for s in layout["sends"]),
            pairs=layout["pairs"],
            mesh=mesh,
            axis=axis,
            n_local=self.n_local,
        )


def _checked_values(values: Any, shape: tuple, arg: str, what: str) -> Array:
    """`values` as an array of `shape` with an inexact dtype, or a `ValueError` /
    `TypeError` naming `arg`."""
    values = jnp.asarray(values)
    if values.shape != tuple(shape):
        msg = (
            f"`{arg}` must have shape {tuple(shape)} ({what}); got shape "
            f"{values.shape}."
        )
        raise ValueError(msg)
    check_inexact(values, arg)
    return values


def _permute_rows(x: Array, order: Array) -> Array:
    """`x[order]`, rows past the end read as zeros. Each row is read at most once
    (`unique_indices`), so the transpose is a scatter without collisions (XLA's
    partitioner of jax 0.10 aborts on the plain gather's transpose on a mesh)."""
    # On an `Explicit` mesh a gather from a split array must name its result's
    # sharding: replicated, since the rows move between devices.
    if x.shape[0] == 0:  # an empty graph: every row is padding
        return jnp.zeros((order.shape[0], *x.shape[1:]), x.dtype)
    mesh = explicit_mesh(x, split=True)
    out = None if mesh is None else NamedSharding(mesh, P())
    return x.at[order].get(
        mode="fill", fill_value=0, unique_indices=True, out_sharding=out
    )


def _place(array: np.ndarray, sharding: NamedSharding) -> Array:
    """A host array as a global array with `sharding`: each process places its own
    devices' blocks (also across processes)."""
    return jax.make_array_from_callback(array.shape, sharding, lambda i: array[i])


def _rcm_order(rows: np.ndarray, cols: np.ndarray, n: int) -> np.ndarray:
    """Reverse Cuthill-McKee of the symmetrised pattern (SciPy, which JAX
    requires)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import reverse_cuthill_mckee

    if n == 0:
        return np.arange(0)  # SciPy's RCM has no empty graph
    ones = np.ones(rows.size, np.int8)
    pattern = coo_matrix((ones, (rows, cols)), shape=(n, n)).tocsr()
    return np.asarray(reverse_cuthill_mckee(pattern + pattern.T, symmetric_mode=True))


def _check_order(order: Any, n: int) -> np.ndarray:
    order = np.asarray(order)
    if (
        order.shape != (n,)
        or not np.issubdtype(order.dtype, np.integer)
        or not np.array_equal(np.sort(order), np.arange(n))
    ):
        msg = (
            '`partition_graph(order=...)` must be "rcm", None or a permutation of '
            f"range({n}) (an integer array of shape ({n},)); got "
            f"{order.dtype} array of shape {order.shape}."
        )
        raise ValueError(msg)
    return order.astype(np.int64)


def partition_graph(
    A: Shaped[sparse.BCOO, "n n"] | Any,
    num_parts: int,
    *,
    order: str | None | ArrayLike = "rcm",
) -> GraphPartition:
    r"""Split the rows of a sparse matrix over `num_parts` devices and list the
    halo each device needs, for a [`krylovjax.PartitionedOperator`][].

    **Arguments:**

    - `A`: a square `jax.experimental.sparse.BCOO` matrix or SciPy sparse matrix,
        with concrete (not traced) indices. Entries outside the matrix (JAX's
        padding) are dropped. Duplicates add up, as in its products.
    - `num_parts`: $P \ge 1$, the number of devices along the mesh axis.
    - `order`: the node order before the rows are cut into blocks: `"rcm"`
        (reverse Cuthill-McKee of the symmetrised pattern, from
        `scipy.sparse.csgraph`; the default), `None` (the input's order), or a
        permutation `order` with `order[p]` the input node placed at position `p`.

    **Returns:**

    A [`krylovjax.GraphPartition`][]: its `operator(mesh)` is the matrix in the
    partitioned numbering, its `halo` the rows moved per product.

    The partition is computed with NumPy on the host, in $O(\mathrm{nnz} \log
    \mathrm{nnz})$ time. For several processes, each computes the same partition
    from the same matrix and places only its own devices' blocks.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.experimental import sparse
        >>> import krylovjax
        >>> n = 12
        >>> i = np.arange(n)
        >>> rows, cols = np.r_[i, i], np.r_[(i + 1) % n, (i - 1) % n]  # a ring
        >>> entries = np.stack([rows, cols], 1)
        >>> A = sparse.BCOO((np.full(2 * n, 0.5, np.float32), entries), shape=(n, n))
        >>> part = krylovjax.partition_graph(A, 1)
        >>> op = part.operator(jax.make_mesh((1,), ("x",)))
        >>> x0 = jnp.arange(n, dtype=jnp.float32)
        >>> X = krylovjax.krylov(op, part.to_partitioned(x0), 3)
        >>> X_bcoo = krylovjax.krylov(A, x0, 3)
        >>> bool(jnp.allclose(part.from_partitioned(X), X_bcoo))
        True

        ```
    """
    rows, cols, values, n, inside = _entries_of(A)
    check_inexact(values, "partition_graph(A=...)")  # as for a BCOO `A` of `krylov`
    num_parts = _check_parts(num_parts)
    perm: np.ndarray
    if isinstance(order, str):
        if order != "rcm":
            msg = (
                '`partition_graph(order=...)` must be "rcm", None or a permutation; '
                f"got {order!r}."
            )
            raise ValueError(msg)
        perm = _rcm_order(rows, cols, n)
    elif order is None:
        perm = np.arange(n)
    else:
        perm = _check_order(order, n)
    n_local = max(1, -(-n // num_parts))
    inverse = np.empty(n, np.int64)
    inverse[perm] = np.arange(n)
    layout, slots = _layout(inverse[rows], inverse[cols], values, num_parts, n_local)
    # Every stored entry's slot; a dropped one gets its own slot past the end.
    entries = layout["rows"].size + np.arange(inside.size)
    entries[inside] = slots
    return GraphPartition(
        num_nodes=n,
        num_parts=num_parts,
        n_local=n_local,
        order=perm,
        entries=entries,
        layout=layout,
    )


def _check_parts(num_parts: Any) -> int:
    if (
        isinstance(num_parts, bool)
        or not isinstance(num_parts, (int, np.integer))
        or num_parts < 1
    ):
        msg = (
            "`partition_graph(num_parts=...)` must be an integer >= 1; got "
            f"{num_parts!r}."
        )
        raise ValueError(msg)
    return int(num_parts)


def _entries_of(A: Any) -> tuple:
    """`(rows, cols, values, n, inside)` of a BCOO or SciPy matrix: the entries
    inside the matrix, and which of the stored entries they are (JAX's padding,
    entries outside the matrix, is dropped)."""
    if isinstance(A, sparse.BCOO):
        if A.ndim != 2 or A.n_batch or A.n_dense or A.shape[0] != A.shape[1]:
            msg = (
                "`partition_graph(A=...)` must be a square two-dimensional BCOO "
                f"matrix without batch or dense dimensions; got shape {A.shape} "
                f"(n_batch={A.n_batch}, n_dense={A.n_dense})."
            )
            raise ValueError(msg)
        try:
            indices = np.asarray(A.indices)
            values = np.asarray(A.data)
        except jax.errors.TracerArrayConversionError as err:
            msg = (
                "`partition_graph(A=...)` needs concrete indices, computed outside "
                "`jax.jit`; got a traced BCOO matrix. Partition once, outside, and "
                "give traced values with `PartitionedOperator.with_values`."
            )
            raise TypeError(msg) from err
        n = A.shape[0]
        rows, cols = indices[:, 0].astype(np.int64), indices[:, 1].astype(np.int64)
    elif hasattr(A, "tocoo") and hasattr(A, "shape"):  # SciPy sparse
        coo = A.tocoo()
        if coo.shape[0] != coo.shape[1]:
            msg = f"`partition_graph(A=...)` must be square; got shape {coo.shape}."
            raise ValueError(msg)
        n = coo.shape[0]
        rows, cols, values = (
            coo.row.astype(np.int64),
            coo.col.astype(np.int64),
            coo.data,
        )
    else:
        msg = (
            "`partition_graph(A=...)` must be a `jax.experimental.sparse.BCOO` or "
            f"SciPy sparse matrix; got {type(A).__name__}."
        )
        raise TypeError(msg)
    inside = (rows >= 0) & (rows < n) & (cols >= 0) & (cols < n)
    return rows[inside], cols[inside], values[inside], n, inside


def _layout(rows, cols, values, parts: int, n_local: int) -> tuple[dict, np.ndarray]:
    """The `(P, m)` entry layout, the send lists per shift and the halo matrix, from
    the entries' rows and columns in the partitioned numbering."""
    owner, col_owner = rows // n_local, cols // n_local
    remote = owner != col_owner
    # Each device's halo: the distinct remote columns its rows read, grouped by
    # shift and sorted by column within a shift.
    shift = (owner - col_owner) % parts
    span = parts * n_local
    keys = (owner * parts + shift) * span + cols  # sorted like (owner, shift, col)
    need_keys = np.unique(keys[remote])
    group, need_cols = np.divmod(need_keys, span)
    need = np.stack([group // parts, group % parts, need_cols], 1)
    senders = (need[:, 0] - need[:, 1]) % parts
    halo = np.bincount(need[:, 0] * parts + senders, minlength=parts * parts)
    halo = halo.reshape(parts, parts)
    i = np.arange(parts)
    shifts = tuple(s for s in range(1, parts) if halo[i, (i - s) % parts].max() > 0)
    lengths = {s: int(halo[i, (i - s) % parts].max()) for s in shifts}
    offset, start = {}, n_local
    for s in shifts:
        offset[s], start = start, start + lengths[s]
    # Position of each needed column in its receiver's buffer for its shift.
    first = np.searchsorted(group, group, side="left")
    rank = np.arange(len(need)) - first
    sends = []
    pairs = tuple(
        tuple((j, (j + s) % parts) for j in range(parts) if halo[(j + s) % parts, j])
        for s in shifts
    )
    for s in shifts:
        send = np.zeros((parts, lengths[s]), np.int32)
        here = need[:, 1] == s
        receiver, c, r = need[here, 0], need[here, 2], rank[here]
        send[(receiver - s) % parts, r] = c % n_local
        sends.append(send)
    # The extended column of every entry.
    ext = cols % n_local
    if remote.any():
        where = np.searchsorted(need_keys, keys[remote])
        pos = np.array([offset.get(s, 0) for s in range(parts)], np.int64)
        ext[remote] = pos[need[where, 1]] + rank[where]
    # Entries per device, sorted by (row, column); padded with rows past the block.
    sort = np.lexsort((ext, rows, owner))
    counts = np.bincount(owner, minlength=parts)
    m = max(1, int(counts.max()) if counts.size else 1)
    slot_in_part = np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts)
    slots = np.empty(rows.size, np.int64)
    slots[sort] = owner[sort] * m + slot_in_part
    local_rows = np.full(parts * m, n_local, np.int32)
    local_cols = np.zeros(parts * m, np.int32)
    local_values = np.zeros(parts * m, values.dtype)
    local_rows[slots] = rows % n_local
    local_cols[slots] = ext
    local_values[slots] = values
    layout = {
        "rows": local_rows.reshape(parts, m),
        "cols": local_cols.reshape(parts, m),
        "values": local_values.reshape(parts, m),
        "sends": sends,
        "shifts": shifts,
        "pairs": pairs,
        "halo": halo,
    }
    return layout, slots
