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

Derivatives. `spmv` has a JVP rule, $\dot y = A \dot x + \dot A x$, made of the
same chunked product, so that JAX's transposition of it (reverse mode) is chunked
too: the cotangent of $x$ is the product with $A^\top$ (a scatter-add by columns),
and the cotangent of the stored values,
$\bar a_e = \langle \bar y_{r_e}, x_{c_e} \rangle$, is summed a chunk of entries
at a time. `add_sampled` is that last sum over a stack of vectors, as the reverse
pass of `krylov` needs it (`_operator.SparseOperator.add_param_vjp`).

Every chunk has the same shape: the last one starts early enough to end at the last
entry and skips the entries that the chunk before it already took, so nothing is
padded or copied.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array, Int, Shaped

# How many numbers one chunk of a product gathers: 2**20 (4 MB in float32).
CHUNK_ELEMENTS = 2**20


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


def _entries(indices, first, size: int, transposed: bool):
    """Rows and columns of the entries `first .. first + size - 1` (of $A^\top$ if
    `transposed`), sliced from `indices` `(nnz, 2)` without copying it whole."""
    idx = lax.dynamic_slice_in_dim(indices, first, size)
    return (idx[:, 1], idx[:, 0]) if transposed else (idx[:, 0], idx[:, 1])


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
    out = jnp.zeros((n_out, *x.shape[1:]), jnp.result_type(data, x))
    nnz = data.shape[0]
    if nnz == 0 or n_out == 0:
        return out
    size = chunk_size(nnz, math.prod(x.shape[1:]))

    def body(i, y):
        first, keep = _chunk(i, size, nnz)
        a = jnp.where(keep, lax.dynamic_slice_in_dim(data, first, size), 0)
        r, c = _entries(indices, first, size, transposed)
        terms = a.reshape(size, *(1,) * (x.ndim - 1)) * x[c]
        return y.at[r].add(
            terms, indices_are_sorted=rows_sorted, mode="promise_in_bounds"
        )

    return lax.fori_loop(0, -(-nnz // size), body, out)


def _spmv_jvp(n_out, transposed, rows_sorted, primals, tangents):
    data, indices, x = primals
    t_data, _, t_x = tangents
    static = (n_out, transposed, rows_sorted)
    y = spmv(data, indices, x, *static)
    t_y = jnp.zeros_like(y)
    if not isinstance(t_x, SymbolicZero):
        t_y = t_y + spmv(data, indices, t_x, *static)
    if not isinstance(t_data, SymbolicZero):
        t_y = t_y + spmv(t_data, indices, x, *static)
    return y, t_y


spmv.defjvp(_spmv_jvp, symbolic_zeros=True)


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
    nnz = acc.shape[0]
    k = cts.shape[0]
    if nnz == 0 or k == 0:
        return acc
    size = chunk_size(nnz, k * math.prod(cts.shape[2:]))
    steps = first_step + jnp.arange(k)
    axes = (0, *range(2, cts.ndim))

    def body(i, acc):
        first, keep = _chunk(i, size, nnz)
        r, c = _entries(indices, first, size, transposed)
        terms = jnp.sum(cts[:, r] * stored[steps[:, None], c[None, :]], axis=axes)
        part = lax.dynamic_slice_in_dim(acc, first, size)
        return lax.dynamic_update_slice_in_dim(
            acc, part + jnp.where(keep, terms, 0), first, 0
        )

    return lax.fori_loop(0, -(-nnz // size), body, acc)
