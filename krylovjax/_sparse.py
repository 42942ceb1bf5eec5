r"""Sparse products whose memory is bounded by a chunk, not by the stored entries.

`A @ x` for a BCOO matrix $A$ with $\mathrm{nnz}$ stored entries and `x` of shape
`(n, *b)` is, entry by entry, $y_{r_e} \mathrel{+}= a_e\, x_{c_e}$. JAX's own BCOO
product gathers $x_{c_e}$ for every entry at once, an `(nnz, *b)` temporary: for a
graph with 170 thousand nodes, 2.5 million edges and 128 features that is 1.2 GB
per product, and at a million nodes it no longer fits. Here the entries are taken a
chunk at a time (`CHUNK_ELEMENTS` gathered numbers per chunk) inside a
`lax.fori_loop`, and each chunk's products are scatter-added into the output in
place, so the temporary is one chunk. On CPU this is also faster than the batched
product (`benchmarks/bench_graphs.py`).

Derivatives. `spmv` has a JVP rule, $\dot y = A \dot x + \dot A x$, whose tangent
comes from a tangent primitive (`_tangent.py`): its implementation is the same
chunked product, and its transpose (reverse mode) is written here, chunked too: the
cotangent of $x$ is the product with $A^\top$ (a scatter-add by columns), and the
cotangent of the stored values, $\bar a_e = \langle \bar y_{r_e}, x_{c_e} \rangle$,
is summed a chunk of entries at a time (`add_sampled`, which the reverse pass of
`krylov` also uses for a stack of vectors, `_operator.SparseOperator.add_param_vjp`).
A hand-written transpose, not JAX's transposition of the loop: jax < 0.10 cannot
transpose a loop that a `custom_jvp` rule returns as a tangent.

Every chunk has the same shape: the last one starts early enough to end at the last
entry and skips the entries that the chunk before it already took, so nothing is
padded or copied.

Padding. JAX pads a BCOO matrix with entries whose indices lie outside the matrix
(index $n$: `BCOO.fromdense(M, nse=...)`, `sum_duplicates(nse=...)`, most
fixed-size BCOO operations under `jit`), and its products ignore them. So do these,
with JAX's reading of an index (see `_entries`): an entry whose row or column is
outside the matrix contributes nothing to a product or its tangent, whatever `x`
holds, and its value's cotangent is exactly zero. Its indices are clamped into
range wherever a gather or scatter promises in-bounds indices, and its term is
zero, not zero times a row of `x`, so that an infinite or NaN row cannot leak in.

JAX's own BCOO products. A callable `A` may apply a BCOO matrix with JAX's product;
the reverse pass then takes the VJP of that callable vmapped over a stack of
vectors (`_operator.AbstractOperator.param_vjp`), and a forward-over-reverse
derivative (`jax.hessian`, `jax.jacfwd(jax.grad(...))`) batches that VJP once
more. There JAX's batching rule of `bcoo_extract` (jax 0.7.2 to 0.11) is
handed a dense operand batched on an axis past the batch axes of the indices and
raises a `ValueError`, although moving that axis to the front gives the answer;
plain JAX code that vmaps a BCOO product and takes its Hessian fails the same way.
When krylovjax is imported, `_wrap_extract_batching` wraps that rule, for the whole
process: it calls JAX's own and, only where that raises, moves the batch axis of
both operands to the front, so that nothing JAX computes changes.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.experimental import sparse
from jax.interpreters import batching
from jax.sharding import NamedSharding, PartitionSpec as P, reshard
from jaxtyping import Array, Int, Shaped

from ._rules import fold_batch
from ._sharding import explicit_mesh
from ._tangent import is_tangent, nones, tangent_primitive

# How many numbers one chunk of a product gathers: 2**20 (4 MB in float32).
CHUNK_ELEMENTS = 2**20
# `add_sampled` unrolls its loop over the vectors up to this many.
UNROLLED_VECTORS = 8


def chunk_size(nnz: int, width: int) -> int:
    """Entries per chunk when each entry gathers `width` numbers."""
    return max(1, min(nnz, CHUNK_ELEMENTS // max(1, width)))


def _chunk(i, size: int, total: int):
    """`(first, keep)` of chunk `i`: its entries are `first .. first + size - 1`,
    and `keep` marks those it owns (the last chunk starts early; see above)."""
    start = i * size
    first = jnp.minimum(start, total - size)
    keep = first + jnp.arange(size) >= start
    return first, keep


def _entries(indices, first, size: int, transposed: bool, shape: tuple[int, int]):
    """`(rows, columns, inside)` of the entries `first .. first + size - 1` (of
    $A^\top$ if `transposed`), sliced from `indices` `(nnz, 2)` without copying it
    whole, for a matrix of `shape` (that of $A^\top$ if `transposed`).

    As in JAX's own BCOO operations, an index $i$ in $[-n, 0)$ counts from the end,
    $i + n$, and an entry with an index outside $[-n, n)$ is padding. `inside`
    marks the entries that are not; the indices of the others are clamped into
    range (which keeps sorted rows sorted), so that reading them is in bounds."""
    idx = lax.dynamic_slice_in_dim(indices, first, size)
    rows, columns = (idx[:, 1], idx[:, 0]) if transposed else (idx[:, 0], idx[:, 1])
    rows, row_inside = _wrapped(rows, shape[0])
    columns, column_inside = _wrapped(columns, shape[1])
    return rows, columns, row_inside & column_inside


def _wrapped(i, n: int):
    """`(index, inside)`: `i` counted from the end where negative, clamped to
    `[0, n)`, and whether it was in range."""
    i = jnp.where(i < 0, i + n, i)
    inside = (i >= 0) & (i < n)
    return jnp.clip(i, 0, n - 1), inside


def _take(x, i):
    """`x[i]` for indices `i` known to be in range (see `_entries`)."""
    return x.at[i].get(mode="promise_in_bounds", wrap_negative_indices=False)


def _on(mesh, x, spec: P):
    """`x` resharded to `spec` on `mesh`: named with its mesh, so that it needs no
    `jax.set_mesh` around the call (arrays placed on a mesh, called outside it)."""
    return reshard(x, NamedSharding(mesh, spec))


def _entry_axis(indices):
    """The mesh axis (or axes) the stored entries are split over, or `None`."""
    spec = jax.typeof(indices).sharding.spec
    return spec[0] if len(spec) else None


@partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5))
def spmv(
    data: Shaped[Array, " nnz"],
    indices: Int[Array, "nnz 2"],
    x: Shaped[Array, "m ..."],
    n_out: int,
    transposed: bool,
    rows_sorted: bool,
) -> Shaped[Array, "n_out ..."]:
    r"""$y = A x$ (or $A^\top x$ if `transposed`) with $A$ given by its stored
    entries, values `data` at `indices` `(row, column)`, a chunk of entries at a
    time. Duplicates add up and the order does not matter; `rows_sorted` (the
    output's rows in order) lets XLA write the output in order."""
    mesh = explicit_mesh(data, indices, x, split=True)
    if mesh is None:
        return _spmv_local(data, indices, x, n_out, transposed, rows_sorted)
    # One device's share of the entries, against all of `x`: an all-gather of `x`,
    # the local product, and a sum over the devices, typed like `x`. When `x` is
    # split by rows over the same axis as the entries, the sum is a reduce-scatter
    # straight into each device's rows.
    axis = _entry_axis(indices)
    x_spec = jax.typeof(x).sharding.spec
    scatter = (
        axis is not None
        and len(x_spec) > 0
        and x_spec[0] == axis
        and n_out == x.shape[0]
        and n_out % _axis_size(mesh, axis) == 0
    )

    def local(data, indices, x_all):
        y = _spmv_local(data, indices, x_all, n_out, transposed, rows_sorted)
        if axis is None:
            return y
        if scatter:
            return lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)
        return lax.psum(y, axis)

    y = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(axis), P(axis, None), P()),
        out_specs=P(axis) if scatter else P(),
        check_vma=False,
    )(
        _on(mesh, data, P(axis)),
        _on(mesh, indices, P(axis, None)),
        _on(mesh, x, P()),
    )
    return _on(mesh, y, x_spec) if y.shape == x.shape else y


def _axis_size(mesh, axis) -> int:
    names = axis if isinstance(axis, tuple) else (axis,)
    return math.prod(mesh.shape[name] for name in names)


def _spmv_local(data, indices, x, n_out, transposed, rows_sorted, init=None):
    out = jnp.zeros((n_out, *x.shape[1:]), jnp.result_type(data, x))
    out = out if init is None else init.astype(out.dtype)
    nnz = data.shape[0]
    if nnz == 0 or n_out == 0 or x.shape[0] == 0:
        return out  # (with no columns, every entry is padding)
    size = chunk_size(nnz, math.prod(x.shape[1:]))
    shape = (n_out, x.shape[0])
    block = (size, *(1,) * (x.ndim - 1))

    def body(i, y):
        first, keep = _chunk(i, size, nnz)
        r, c, inside = _entries(indices, first, size, transposed, shape)
        keep = keep & inside
        a = jnp.where(keep, lax.dynamic_slice_in_dim(data, first, size), 0)
        # The entries not kept read a row of zeros, not a row of `x` (which may be
        # infinite) times zero: the gather fills the rows of an index past the end.
        # A `where` on the gathered rows would do the same, but in a scan of
        # products JAX computes its broadcast mask, a loop invariant, for every
        # chunk before the scan: (chunks, size, *b) booleans kept throughout.
        c = jnp.where(keep, c, x.shape[0])
        rows = x.at[c].get(mode="fill", fill_value=0, wrap_negative_indices=False)
        terms = a.reshape(block) * rows
        return y.at[r].add(
            terms,
            indices_are_sorted=rows_sorted,
            mode="promise_in_bounds",
            wrap_negative_indices=False,
        )

    return lax.fori_loop(0, -(-nnz // size), body, out)


def _tangent_impl(data, indices, x, t_data, t_x, static):
    r"""$A \dot x + \dot A x$; a `None` tangent is zero."""
    # Evaluated eagerly, the primitive may be handed NumPy arrays.
    data, indices, x, t_data, t_x = jax.tree.map(
        jnp.asarray, (data, indices, x, t_data, t_x)
    )
    t_y = jnp.zeros_like(x)
    if t_x is not None:
        t_y = t_y + spmv(data, indices, t_x, *static)
    if t_data is not None:
        t_y = t_y + spmv(t_data, indices, x, *static)
    return t_y


def _tangent_transpose(inputs, ct):
    data, indices, x, t_data, t_x, static = inputs
    _, transposed, _ = static
    ct = jnp.asarray(ct)  # NumPy when a cotangent is given eagerly
    ct_x = ct_data = None
    if is_tangent(t_x):
        ct_x = spmv(data, indices, ct, x.shape[0], not transposed, False)
    if is_tangent(t_data):
        zeros = jnp.zeros_like(data, jnp.result_type(ct))
        ct_data = add_sampled(zeros, indices, transposed, ct[None], x[None], 0)
    return nones(data), nones(indices), nones(x), ct_data, ct_x, nones(static)


def _tangent_batch(bind, args, axes):
    # A batch of vectors for one matrix (`vmap` over `x0`) becomes columns of `x`,
    # so that `grad` of the vmapped call still transposes with the rule above;
    # otherwise (a batch of matrices) the implementation is vmapped instead.
    data, indices, x, t_data, t_x, static = args
    data_axis, indices_axis, x_axis, t_data_axis, t_x_axis, _ = axes
    if any(a is not None for a in (data_axis, indices_axis, t_data_axis)):
        return None
    if t_x is None:
        (x,) = fold_batch((x,), (x_axis,), (1,))
    else:
        x, t_x = fold_batch((x, t_x), (x_axis, t_x_axis), (1, 1))
    return bind(data, indices, x, t_data, t_x, static), 1


# Arguments: (data, indices, x, t_data, t_x, static); the tangent is like `x` (the
# matrix is square, and `x` has the product's dtype: see `_operator.as_operator`).
_spmv_tangent = tangent_primitive(
    "spmv_tangent", _tangent_impl, _tangent_transpose, like=2, batch=_tangent_batch
)


def _spmv_jvp(n_out, transposed, rows_sorted, primals, tangents):
    data, indices, x = primals
    t_data, _, t_x = (None if isinstance(t, SymbolicZero) else t for t in tangents)
    static = (n_out, transposed, rows_sorted)
    y = spmv(data, indices, x, *static)
    if t_data is None and t_x is None:
        return y, jnp.zeros_like(y)
    return y, _spmv_tangent(data, indices, x, t_data, t_x, static)


spmv.defjvp(_spmv_jvp, symbolic_zeros=True)


@partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6))
def spmv_add(
    data: Shaped[Array, " nnz"],
    indices: Int[Array, "nnz 2"],
    x: Shaped[Array, "m ..."],
    y: Shaped[Array, "n_out ..."],
    n_out: int,
    transposed: bool,
    rows_sorted: bool,
) -> Shaped[Array, "n_out ..."]:
    r"""$y + A x$ (or $y + A^\top x$), scatter-added into `y` itself: no array of
    zeros to start from and no separate sum (a step of the reverse pass,
    $\lambda_i = g_i + A^\top \lambda_{i+1}$, is one call)."""
    if explicit_mesh(data, indices, x, y, split=True) is not None:
        return y + spmv(data, indices, x, n_out, transposed, rows_sorted)
    return _spmv_local(data, indices, x, n_out, transposed, rows_sorted, init=y)


def _spmv_add_jvp(n_out, transposed, rows_sorted, primals, tangents):
    data, indices, x, y = primals
    t_data, _, t_x, t_y = (None if isinstance(t, SymbolicZero) else t for t in tangents)
    static = (n_out, transposed, rows_sorted)
    out = spmv_add(data, indices, x, y, *static)
    t_out = jnp.zeros_like(out) if t_y is None else t_y
    if t_data is not None or t_x is not None:
        t_out = t_out + _spmv_tangent(data, indices, x, t_data, t_x, static)
    return out, t_out


spmv_add.defjvp(_spmv_add_jvp, symbolic_zeros=True)


def add_sampled(
    acc: Shaped[Array, " nnz"],
    indices: Int[Array, "nnz 2"],
    transposed: bool,
    cts: Shaped[Array, "k n ..."],
    stored: Shaped[Array, "s n ..."],
    first_step: Array | int,
) -> Shaped[Array, " nnz"]:
    r"""`acc` plus $\sum_k \langle \bar y_{k, r_e}, x_{k, c_e} \rangle$ for every stored
    entry $e$, where $x_k$ = `stored[first_step + k]`: the gradient of the stored
    values for $\sum_k \langle \bar y_k, A x_k \rangle$.

    A chunk of entries at a time, reading the `k` vectors of `cts` and of `stored`
    only at the chunk's rows and columns (`stored` is never sliced or copied).
    """
    mesh = explicit_mesh(acc, indices, cts, stored, split=True)
    if mesh is None:
        return _add_sampled_local(acc, indices, transposed, cts, stored, first_step)
    # Each device sums over its share of the entries, against all of the `k`
    # vectors (an all-gather of them); the result is split like the entries.
    axis = _entry_axis(indices)
    k = cts.shape[0]
    stored = lax.dynamic_slice_in_dim(stored, first_step, k)

    def local(acc, indices, cts, stored):
        return _add_sampled_local(acc, indices, transposed, cts, stored, 0)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(axis), P(axis, None), P(), P()),
        out_specs=P(axis),
        check_vma=False,
    )(
        _on(mesh, acc, P(axis)),
        _on(mesh, indices, P(axis, None)),
        _on(mesh, cts, P()),
        _on(mesh, stored, P()),
    )


def _add_sampled_local(acc, indices, transposed, cts, stored, first_step):
    nnz = acc.shape[0]
    k = cts.shape[0]
    shape = (cts.shape[1], stored.shape[1])
    if nnz == 0 or k == 0 or 0 in shape:
        return acc  # (in a matrix of size 0, every entry is padding)
    # Entries per chunk: at most `CHUNK_ELEMENTS` numbers gathered from one vector.
    width = math.prod(cts.shape[2:])
    size = chunk_size(nnz, width)
    axes = tuple(range(1, cts.ndim - 1))

    def body(i, acc):
        first, keep = _chunk(i, size, nnz)
        r, c, inside = _entries(indices, first, size, transposed, shape)
        keep = keep & inside

        # One vector at a time: gathers from a single vector fuse into the sum that
        # reads them (no gathered array is written), where one gather of all `k`
        # vectors at once, `(k, size)`, is written out and ran 3-12x slower on CPU.
        # Unrolled for single vectors only: with a block, XLA then keeps every
        # step's gathered rows at once.
        def add(j, part):
            ct = lax.dynamic_index_in_dim(cts, j, 0, False)
            x = lax.dynamic_index_in_dim(stored, first_step + j, 0, False)
            return part + jnp.where(keep, jnp.sum(_take(ct, r) * _take(x, c), axes), 0)

        part = lax.dynamic_slice_in_dim(acc, first, size)
        unroll = width == 1 and k <= UNROLLED_VECTORS
        part = lax.fori_loop(0, k, add, part, unroll=unroll)
        return lax.dynamic_update_slice_in_dim(acc, part, first, 0)

    return lax.fori_loop(0, -(-nnz // size), body, acc)


def _extract_front(batched_args, batch_dims, **params):
    """`bcoo_extract` batched with the batch axis of both operands in front."""
    indices, dense = batched_args
    indices_axis, dense_axis = batch_dims
    if indices_axis is None:
        indices = lax.expand_dims(indices, (0,))
    else:
        indices = jnp.moveaxis(indices, indices_axis, 0)
    if dense_axis is None:
        dense = jnp.broadcast_to(dense[None], (indices.shape[0], *dense.shape))
    else:
        dense = jnp.moveaxis(dense, dense_axis, 0)
    return sparse.bcoo_extract_p.bind(indices, dense, **params), 0


def _wrap_extract_batching() -> None:
    """Wrap JAX's batching rule of `bcoo_extract` (see above): JAX's own rule runs
    first, and only where it raises a `ValueError` is the batch axis moved to the
    front. JAX keeps the rules in `fancy_primitive_batchers`, whose rules also take
    the axis data (jax >= 0.7), or in `primitive_batchers` (a plain dict before)."""
    prim = getattr(sparse, "bcoo_extract_p", None)
    fancy = getattr(batching, "fancy_primitive_batchers", None)
    if prim is None:
        return
    if isinstance(fancy, dict) and prim in fancy:
        jax_rule = fancy[prim]

        def rule(axis_data, batched_args, batch_dims, **params):
            try:
                return jax_rule(axis_data, batched_args, batch_dims, **params)
            except ValueError:
                return _extract_front(batched_args, batch_dims, **params)

        fancy[prim] = rule
    elif isinstance(batching.primitive_batchers, dict):
        jax_rule = batching.primitive_batchers[prim]

        def plain_rule(batched_args, batch_dims, **params):
            try:
                return jax_rule(batched_args, batch_dims, **params)
            except ValueError:
                return _extract_front(batched_args, batch_dims, **params)

        batching.primitive_batchers[prim] = plain_rule


_wrap_extract_batching()
