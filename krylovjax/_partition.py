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
from ._sharding import explicit_mesh, is_explicit, typed_like
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
    the input's entries. Made with `steps=s > 1`, it also holds the layout of
    the matrix powers kernel: `matrix_powers` and `krylov`'s monomial basis then
    exchange halos $s$ hops deep once per $s$ products.

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
    powers: "_Powers | None" = None

    @property
    def steps(self) -> int:
        """The products per exchange of [`krylovjax.krylov`][]'s monomial basis and
        of `matrix_powers` (`GraphPartition.operator(steps=...)`); 1 by default."""
        return 1 if self.powers is None else self.powers.steps

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
        self._check_vector(x)
        local = partial(
            _local_product, axis=self.axis, pairs=self.pairs, n_local=self.n_local
        )
        spec = P(self.axis)
        in_specs = (spec, spec, spec, (spec,) * len(self.sends), spec)
        product = self._shard_map(local, in_specs, spec)
        y = product(self.values, self.rows, self.cols, self.sends, self._split(x))
        return typed_like(y, x)

    def matrix_powers(self, x: Shaped[Array, "n ..."]) -> Shaped[Array, "s n ..."]:
        r"""$[A x, A^2 x, \dots, A^s x]$, of shape `(s, *x.shape)` with $s$ =
        `steps`, from one exchange of the rows of `x` within $s$ hops of each
        device's rows (and one of the values of the entries within $s - 1$
        hops): the matrix powers kernel. Each device repeats its neighbours'
        products near the cut, so this pays where an exchange costs more than
        those products. Differentiable like the product; with `steps=1`, $A x$
        with a new axis.

        !!! Example

            ```python
            >>> import jax, jax.numpy as jnp, numpy as np
            >>> from jax.experimental import sparse
            >>> import krylovjax
            >>> A = sparse.BCOO.fromdense(jnp.array([[0.0, 1.0], [1.0, 0.0]]))
            >>> part = krylovjax.partition_graph(A, 1, order=None)
            >>> op = part.operator(jax.make_mesh((1,), ("x",)), steps=3)
            >>> op.matrix_powers(jnp.array([1.0, 2.0]))
            Array([[2., 1.],
                   [1., 2.],
                   [2., 1.]], dtype=float32)

            ```
        """
        self._check_vector(x)
        if self.powers is None:
            return self(x)[None]
        return self._powers_with(self._extended_values(), x, self.steps)

    def _extended_values(self) -> Inexact[Array, "parts entries"]:
        """The values of `matrix_powers`' extended entries: each device's own
        followed by those it receives (one exchange). `krylov`
        makes it once per call and passes it to `_powers_with` for every block
        of `steps` products."""
        powers = self.powers
        if powers is None:
            return self.values
        local = partial(_local_values, axis=self.axis, pairs=powers.value_pairs)
        spec = P(self.axis)
        exchange = self._shard_map(
            local, (spec, (spec,) * len(powers.value_sends)), spec
        )
        return exchange(self.values, powers.value_sends)

    def _powers_with(
        self,
        values: Inexact[Array, "parts entries"],
        x: Shaped[Array, "n ..."],
        count: int,
    ) -> Shaped[Array, "count n ..."]:
        """`matrix_powers(x)[:count]` (`count <= steps`) with the extended values
        `values` from `_extended_values()`: one exchange of `x`'s halo."""
        powers = self.powers
        assert powers is not None and 1 <= count <= powers.steps
        local = partial(
            _local_powers,
            axis=self.axis,
            pairs=powers.x_pairs,
            n_local=self.n_local,
            count=count,
        )
        spec = P(self.axis)
        in_specs = (spec, spec, spec, (spec,) * len(powers.x_sends), spec)
        product = self._shard_map(local, in_specs, P(None, self.axis))
        ys = product(values, powers.rows, powers.cols, powers.x_sends, self._split(x))
        if not is_explicit(x):
            return ys
        # Each vector typed like `x`, as the product's result (`typed_like`).
        like = jax.typeof(x).sharding
        return reshard(ys, like.update(spec=P(None, *like.spec)))

    def _shard_map(self, local, in_specs, out_specs):
        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=False,
        )

    def _split(self, x: Array) -> Array:
        """`x`, on an `Explicit` mesh (where arrays are typed) resharded by rows
        for the products; unchanged on an `Auto` mesh."""
        if AxisType.Explicit not in self.mesh.axis_types:
            return x
        return reshard(x, NamedSharding(self.mesh, P(self.axis)))

    def _check_vector(self, x: Any) -> None:
        if x.ndim < 1 or x.shape[0] != self.shape[0]:
            msg = (
                f"A `PartitionedOperator` of shape {self.shape} must be applied to an "
                f"array with {self.shape[0]} rows (the partitioned numbering, see "
                f"`GraphPartition.to_partitioned`); got shape {x.shape}."
            )
            raise ValueError(msg)


def krylov_matrix_powers(op: PartitionedOperator, x0: Array, d: int) -> Array:
    """`krylov`'s stack `(d, *x0.shape)` for an operator with `steps = s > 1`: one
    `lax.scan` over blocks of `s` products, each from one exchange of `x`'s deep
    halo, after one exchange of the values; JAX's derivatives (through the
    `ppermute`s and the sparse products, as for the product itself)."""
    values = op._extended_values()
    full, rest = divmod(d - 1, op.steps)

    def block(x, _):
        ys = op._powers_with(values, x, op.steps)
        return ys[-1], ys

    x, stack = x0, [x0[None]]
    if full:
        x, ys = lax.scan(block, x0, length=full)
        stack.append(ys.reshape(full * op.steps, *x0.shape))
    if rest:
        stack.append(op._powers_with(values, x, rest))
    return jnp.concatenate(stack)


class _Powers(eqx.Module):
    """What `PartitionedOperator.matrix_powers` adds to the operator (see
    `_powers_layout`): the extended entries' rows and columns, and the send lists
    of the deeper halo of `x` and of the received entries' values."""

    rows: Int[Array, "parts entries"]
    cols: Int[Array, "parts entries"]
    x_sends: tuple[Int[Array, "parts _"], ...]
    value_sends: tuple[Int[Array, "parts _"], ...]
    x_pairs: tuple[tuple[tuple[int, int], ...], ...] = eqx.field(static=True)
    value_pairs: tuple[tuple[tuple[int, int], ...], ...] = eqx.field(static=True)
    steps: int = eqx.field(static=True)


def _received(x, sends, *, axis, pairs):
    """The rows `x[send]` that each device receives over each shift (zeros from a
    device with nothing to send)."""
    return [
        lax.ppermute(x[send[0]], axis, perm=list(perm))
        for perm, send in zip(pairs, sends, strict=True)
    ]


def _local_product(values, rows, cols, sends, x, *, axis, pairs, n_local):
    """One device's rows of $A x$: receive the halo rows over each shift (from the
    devices that have any for it; the others receive zeros, which no entry reads),
    append them to the local rows, and multiply by the local entries."""
    extended = jnp.concatenate([x, *_received(x, sends, axis=axis, pairs=pairs)])
    indices = jnp.stack([rows[0], cols[0]], axis=1)
    # A square product over the extended rows (the sparse product's tangent has the
    # shape of its input), of which the first `n_local` rows are this device's.
    y = spmv(values[0], indices, extended, extended.shape[0], False, True)
    return y[:n_local]


def _local_values(values, sends, *, axis, pairs):
    """One device's extended values: its own, then those it receives."""
    received = _received(values[0], sends, axis=axis, pairs=pairs)
    return jnp.concatenate([values[0], *received])[None]


def _local_powers(values, rows, cols, sends, x, *, axis, pairs, n_local, count):
    """One device's rows of $A x, \\dots, A^{count} x$: receive the deep halo once,
    then `count` products over the extended entries (product $k$ is exact within
    `steps - k` hops of the device's rows, which include its own)."""
    z = jnp.concatenate([x, *_received(x, sends, axis=axis, pairs=pairs)])
    indices = jnp.stack([rows[0], cols[0]], axis=1)
    ys = []
    for _ in range(count):
        z = spmv(values[0], indices, z, z.shape[0], False, False)
        ys.append(z[:n_local])
    return jnp.stack(ys)


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

    def __init__(
        self, *, num_nodes, num_parts, n_local, order, entries, layout, partitioned
    ):
        self.num_nodes = num_nodes
        self.num_parts = num_parts
        self.n_local = n_local
        self.order = order
        self._entries = entries  # per input entry: its slot in the (P, m) layout
        self._layout = layout  # rows, cols, sends, shifts, halo, values
        # The entries' rows, columns (partitioned numbering) and slots, from which
        # `operator(steps=...)` makes the layout of the matrix powers kernel.
        self._partitioned = partitioned
        self._powers: dict[int, dict] = {}
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
        return _rows_sent(self._layout) * width * np.dtype(dtype).itemsize

    def bytes_per_exchange(
        self, width: int = 1, dtype: Any = np.float32, steps: int = 1
    ) -> int:
        """The bytes of one exchange of `operator(mesh, steps=steps)`'s
        `matrix_powers` (and of each block of `steps` products of
        [`krylovjax.krylov`][] with it), summed over the devices, for vectors of
        `width` columns of `dtype`: the rows within `steps` hops of each device's
        rows, padded per shift as for `bytes_per_product` (which it equals for
        `steps=1`). Not counted: one exchange per call of the values of the
        entries within `steps - 1` hops."""
        steps = _check_steps(steps, "GraphPartition.bytes_per_exchange")
        if steps == 1:
            return self.bytes_per_product(width, dtype)
        plan = self._powers_layout(steps)["x"]
        return _rows_sent(plan) * width * np.dtype(dtype).itemsize

    def _powers_layout(self, steps: int) -> dict:
        if steps not in self._powers:
            rows, cols, slots = self._partitioned
            m = self._layout["rows"].shape[1]
            self._powers[steps] = _powers_layout(
                rows, cols, slots, self.num_parts, self.n_local, m, steps
            )
        return self._powers[steps]

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

    def operator(
        self, mesh: Mesh, axis: str | None = None, *, steps: int = 1
    ) -> PartitionedOperator:
        r"""The matrix as a [`krylovjax.PartitionedOperator`][] on `mesh`.

        **Arguments:**

        - `mesh`: a `jax.sharding.Mesh` (of either axis type, over one or several
            processes) whose axis `axis` has `num_parts` devices.
        - `axis`: the mesh axis the rows are split over; may be omitted for a mesh
            with one axis.
        - `steps`: $s \ge 1$, products per exchange for [`krylovjax.krylov`][]'s
            monomial basis and `PartitionedOperator.matrix_powers` (the matrix
            powers kernel): each device receives the rows within $s$ hops of its
            own once per $s$ products and repeats its neighbours' products near
            the cut. Every other use (a single product, the bases, the readouts,
            the decompositions) makes one exchange per product, whatever
            `steps`.

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
        steps = _check_steps(steps, "GraphPartition.operator")
        layout = self._layout
        sharding = NamedSharding(mesh, P(axis))
        powers = None
        if steps > 1:
            deep = self._powers_layout(steps)
            powers = _Powers(
                rows=_place(deep["rows"], sharding),
                cols=_place(deep["cols"], sharding),
                x_sends=tuple(_place(s, sharding) for s in deep["x"]["sends"]),
                value_sends=tuple(_place(s, sharding) for s in deep["values"]["sends"]),
                x_pairs=deep["x"]["pairs"],
                value_pairs=deep["values"]["pairs"],
                steps=steps,
            )
        return PartitionedOperator(
            values=_place(layout["values"], sharding),
            rows=_place(layout["rows"], sharding),
            cols=_place(layout["cols"], sharding),
            sends=tuple(_place(s, sharding) for s in layout["sends"]),
            pairs=layout["pairs"],
            mesh=mesh,
            axis=axis,
            n_local=self.n_local,
            powers=powers,
        )


def _rows_sent(plan: dict) -> int:
    """The rows an exchange of `_exchange`'s `plan` sends, summed over the devices:
    for each shift, its padded buffer from every device that sends over it."""
    return sum(
        len(pairs) * send.shape[1]
        for pairs, send in zip(plan["pairs"], plan["sends"], strict=True)
    )


def _check_steps(steps: Any, fn_name: str) -> int:
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        msg = f"`{fn_name}(steps=...)` must be an integer >= 1; got {steps!r}."
        raise ValueError(msg)
    return int(steps)


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
    rows, cols = inverse[rows], inverse[cols]
    layout, slots = _layout(rows, cols, values, num_parts, n_local)
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
        partitioned=(rows, cols, slots),
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
    inside the matrix, and which of the stored entries they are. As in JAX's
    products, a BCOO index in $[-n, 0)$ counts from the end, and an entry with an
    index outside $[-n, n)$ is padding, dropped."""
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
        rows, cols = (np.where(i < 0, i + n, i) for i in (rows, cols))
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


def _exchange(receiver, sender, item, parts: int) -> tuple[dict, np.ndarray]:
    """How to move items between the devices: device `receiver[k]` needs item
    `item[k]` (an index into device `sender[k]`'s local array; the triples are
    distinct, `receiver != sender`).

    Returns `(plan, position)`. `plan` has `shifts` (each shift $s$ over which any
    item moves: device $j$ sends to $j + s$), `sends` (per shift, a `(P, length)`
    array: the items that each device sends, padded to the shift's longest list),
    `pairs` (per shift, the `(sender, receiver)` pairs that send anything) and
    `halo` (`halo[i, j]`, the items device `i` receives from `j`). `position[k]`
    is where need `k` lands in its receiver's buffer, the received lists
    concatenated shift after shift (sorted by item within a shift)."""
    receiver, sender, item = (np.asarray(a, np.int64) for a in (receiver, sender, item))
    shift = (receiver - sender) % parts
    group = receiver * parts + shift
    order = np.lexsort((item, group))
    first = np.searchsorted(group[order], group[order], side="left")
    rank = np.empty(group.size, np.int64)
    rank[order] = np.arange(group.size) - first
    halo = np.bincount(receiver * parts + sender, minlength=parts * parts)
    halo = halo.reshape(parts, parts)
    i = np.arange(parts)
    shifts = tuple(s for s in range(1, parts) if halo[i, (i - s) % parts].max() > 0)
    offset = np.zeros(parts, np.int64)
    sends, start = [], 0
    for s in shifts:
        length = int(halo[i, (i - s) % parts].max())
        send = np.zeros((parts, length), np.int32)
        here = shift == s
        send[sender[here], rank[here]] = item[here]
        sends.append(send)
        offset[s], start = start, start + length
    pairs = tuple(
        tuple((j, (j + s) % parts) for j in range(parts) if halo[(j + s) % parts, j])
        for s in shifts
    )
    plan = {"shifts": shifts, "sends": sends, "pairs": pairs, "halo": halo}
    return plan, offset[shift] + rank


def _layout(rows, cols, values, parts: int, n_local: int) -> tuple[dict, np.ndarray]:
    """The `(P, m)` entry layout, the send lists per shift and the halo matrix, from
    the entries' rows and columns in the partitioned numbering."""
    owner, col_owner = rows // n_local, cols // n_local
    remote = owner != col_owner
    # Each device's halo: the distinct remote columns its rows read.
    span = parts * n_local
    need_keys, need_of = np.unique(
        owner[remote] * span + cols[remote], return_inverse=True
    )
    receiver, need_cols = np.divmod(need_keys, span)
    plan, position = _exchange(
        receiver, need_cols // n_local, need_cols % n_local, parts
    )
    # The extended column of every entry: its row of `x`, or of the received halo
    # after the device's own `n_local` rows.
    ext = cols % n_local
    ext[remote] = n_local + position[need_of.reshape(-1)]
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
        **plan,
    }
    return layout, slots


def _powers_layout(rows, cols, slots, parts: int, n_local: int, m: int, steps: int):
    """The layout of `steps` products per exchange (the matrix powers kernel), from
    the entries' rows and columns in the partitioned numbering and their `slots` in
    the `(P, m)` layout.

    Device $i$ receives, once per `steps` products, the rows of $x$ within `steps`
    hops of its rows that other devices own, and, once per call, the values of
    the entries of the rows within `steps - 1` hops that other devices own. Its
    extended vector is its `n_local` rows followed by the received rows; its
    extended entries are its own `m` slots followed by the received ones, with
    their rows and columns in the extended vector (padding: a row past its end).
    Product $k$ is then exact on the rows within `steps - k` hops, its own rows
    included."""
    from scipy.sparse import csr_matrix

    span = parts * n_local
    # reads @ mask: the columns that the rows in `mask` read.
    reads = csr_matrix(
        (np.ones(rows.size, np.float32), (cols, rows)), shape=(span, span)
    )
    by_row = np.argsort(rows, kind="stable")
    starts = np.searchsorted(rows[by_row], np.arange(span + 1))
    # level[:, p]: hops from device p's rows (-1: farther), all devices at once.
    level = np.full((span, parts), -1, np.int64)
    level[np.arange(span), np.arange(span) // n_local] = 0
    for hop in range(1, steps + 1):
        reached = reads @ (level >= 0).astype(np.float32) > 0
        level[reached & (level < 0)] = hop
    x_need, v_need = [], []  # (receiver, node) and (receiver, entry)
    for p in range(parts):
        nodes = np.flatnonzero(level[:, p] > 0)
        x_need.append(np.stack([np.full(nodes.size, p), nodes], 1))
        far = np.flatnonzero((level[:, p] > 0) & (level[:, p] < steps))
        lo, count = starts[far], starts[far + 1] - starts[far]
        first = np.repeat(lo - (np.cumsum(count) - count), count)
        entries = by_row[first + np.arange(int(count.sum()))]
        v_need.append(np.stack([np.full(entries.size, p), entries], 1))
    x_need, v_need = np.concatenate(x_need), np.concatenate(v_need)
    x_plan, x_position = _exchange(
        x_need[:, 0], x_need[:, 1] // n_local, x_need[:, 1] % n_local, parts
    )
    v_rows = rows[v_need[:, 1]]
    v_plan, v_position = _exchange(
        v_need[:, 0], v_rows // n_local, slots[v_need[:, 1]] % m, parts
    )
    keys = x_need[:, 0] * span + x_need[:, 1]  # sorted: receiver, then node
    n_ext = n_local + sum(send.shape[1] for send in x_plan["sends"])

    def extended(receiver, nodes):
        """The position of `nodes` in `receiver`'s extended vector."""
        at = nodes % n_local
        remote = nodes // n_local != receiver
        found = np.searchsorted(keys, receiver[remote] * span + nodes[remote])
        at[remote] = n_local + x_position[found]
        return at

    received = sum(send.shape[1] for send in v_plan["sends"])
    ext_rows = np.full((parts, m + received), n_ext, np.int64)  # padding
    ext_cols = np.zeros((parts, m + received), np.int64)
    owner = rows // n_local
    ext_rows[owner, slots % m] = rows % n_local
    ext_cols[owner, slots % m] = extended(owner, cols)
    receiver, entry = v_need[:, 0], v_need[:, 1]
    ext_rows[receiver, m + v_position] = extended(receiver, rows[entry])
    ext_cols[receiver, m + v_position] = extended(receiver, cols[entry])
    return {
        "rows": ext_rows.astype(np.int32),
        "cols": ext_cols.astype(np.int32),
        "x": x_plan,
        "values": v_plan,
    }
