r"""`KrylovGraphConv`: a polynomial graph filter on block Krylov features.

A TAGConv-style layer (Du et al., 2017): with a normalised adjacency operator
$\hat A$ and node features $H \in \mathbb{R}^{N \times F_\text{in}}$, it mixes the
block Krylov features $[H, \hat A H, \dots, \hat A^k H]$ -- the node features
diffused over $0, 1, \dots, k$ hops -- with one learnable linear map. The output
is one [`krylovjax.polynomial_action`][] call with a weight matrix per hop, which
sums the hops as they are made: the features are never stored, and a sparse
$\hat A$ (BCOO) gets its gradient as sampled products.
"""

import math
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import sparse
from jaxtyping import Array, ArrayLike, DTypeLike, Inexact, PRNGKeyArray, Shaped

from .._checks import (
    as_input,
    check_allocation,
    check_bcoo_matrix,
    check_dtype,
    check_size,
)
from .._partition import PartitionedOperator
from .._readout import polynomial_action
from .._typing import StaticInt
from ._init import uniform


def _is_scipy_sparse(x: Any) -> bool:
    # SciPy is not a dependency: if it is not imported, `x` is no SciPy matrix.
    scipy_sparse = sys.modules.get("scipy.sparse")
    return scipy_sparse is not None and scipy_sparse.issparse(x)


def _as_partitioned(
    adjacency: PartitionedOperator, arg: str, dtype: Any
) -> PartitionedOperator:
    """A `PartitionedOperator` with its values promoted with `dtype`."""
    values = as_input(adjacency.values, arg, dtype)
    return eqx.tree_at(lambda op: op.values, adjacency, values)


def _as_adjacency(adjacency: Any, arg: str, dtype: Any | None) -> Array | sparse.BCOO:
    """A dense array or a two-dimensional BCOO matrix promoted with `dtype`.

    Array-likes (nested lists, NumPy arrays) become JAX arrays; the values are
    promoted as by `as_input`. Other sparse formats raise a `TypeError` that says
    how to convert them; the shape is left to the caller to check.
    """
    if isinstance(adjacency, PartitionedOperator):
        msg = (
            f"`{arg}` must be a dense array or a `jax.experimental.sparse.BCOO` "
            "matrix; a `PartitionedOperator` is taken by `KrylovGraphConv` only. "
            "Normalise the adjacency before partitioning it."
        )
        raise TypeError(msg)
    if isinstance(adjacency, sparse.BCOO):
        check_bcoo_matrix(adjacency, arg)
        data = as_input(adjacency.data, arg, dtype)
        return sparse.BCOO((data, adjacency.indices), shape=adjacency.shape)
    if isinstance(adjacency, sparse.JAXSparse):
        msg = (
            f"`{arg}` must be a dense array or a `jax.experimental.sparse.BCOO` "
            f"matrix; got a {type(adjacency).__name__} matrix. Convert it with "
            f"`.to_bcoo()`."
        )
        raise TypeError(msg)
    if _is_scipy_sparse(adjacency):
        msg = (
            f"`{arg}` must be a dense array or a `jax.experimental.sparse.BCOO` "
            f"matrix; got a SciPy sparse matrix of type {type(adjacency).__name__}. "
            f"Convert it with `jax.experimental.sparse.BCOO.from_scipy_sparse`."
        )
        raise TypeError(msg)
    return as_input(adjacency, arg, dtype)


def normalise_adjacency(
    adjacency: Shaped[ArrayLike, "N N"] | Shaped[sparse.BCOO, "N N"] | list | tuple,
) -> Inexact[Array, "N N"] | Inexact[sparse.BCOO, "N N"]:
    r"""The symmetrically normalised adjacency with self-loops (Kipf and Welling).

    $$\hat A = D^{-1/2} (A + I) D^{-1/2}, \qquad D = \operatorname{diag}((A + I)
    \mathbf{1}).$$

    Its eigenvalues lie in $(-1, 1]$ for a non-negative symmetric $A$, so powers of
    $\hat A$ stay bounded, as [`krylovjax.nn.KrylovGraphConv`][] needs.

    **Arguments:**

    - `adjacency`: a square, non-negative (possibly weighted) adjacency matrix
        `(N, N)`: a dense array (or nested lists) or a two-dimensional
        `jax.experimental.sparse.BCOO` matrix (convert a SciPy sparse matrix with
        `jax.experimental.sparse.BCOO.from_scipy_sparse`). Integer and boolean
        entries are converted to JAX's default floating dtype. $N = 0$ is allowed.

    **Returns:**

    $\hat A$ in the same format as `adjacency`, with its floating-point dtype. A
    BCOO result holds the original entries plus $N$ diagonal entries (duplicates
    are summed when it is applied).

    !!! Example

        ```python
        >>> import jax.numpy as jnp
        >>> from jax.experimental import sparse
        >>> from krylovjax.nn import normalise_adjacency
        >>> A = jnp.array([[0.0, 1.0], [1.0, 0.0]])
        >>> normalise_adjacency(A)
        Array([[0.5, 0.5],
               [0.5, 0.5]], dtype=float32)
        >>> normalise_adjacency(sparse.BCOO.fromdense(A)).todense()
        Array([[0.5, 0.5],
               [0.5, 0.5]], dtype=float32)

        ```
    """
    arg = "normalise_adjacency(adjacency=...)"
    adjacency = _as_adjacency(adjacency, arg, None)
    shape = tuple(adjacency.shape)
    if len(shape) != 2 or shape[0] != shape[1]:
        msg = f"`{arg}` must be a square matrix (N, N); got shape {shape}."
        raise ValueError(msg)
    n = shape[0]
    if isinstance(adjacency, sparse.BCOO):
        diag = jnp.arange(n, dtype=adjacency.indices.dtype)
        indices = jnp.concatenate([adjacency.indices, jnp.stack([diag, diag], axis=1)])
        data = jnp.concatenate([adjacency.data, jnp.ones(n, adjacency.dtype)])
        # An index in [-n, 0) counts from the end, as in JAX's products.
        rows, cols = (jnp.where(i < 0, i + n, i) for i in indices.T)
        degree = jax.ops.segment_sum(data, rows, num_segments=n)
        data = data / jnp.sqrt(degree[rows] * degree[cols])
        return sparse.BCOO((data, indices), shape=shape)
    with_loops = adjacency + jnp.eye(n, dtype=adjacency.dtype)
    degree = with_loops.sum(axis=1)
    return with_loops / jnp.sqrt(degree[:, None] * degree[None, :])


class KrylovGraphConv(eqx.Module):
    r"""A polynomial graph filter: a linear map of $[H, \hat A H, \dots, \hat A^k H]$.

    For node features $H \in \mathbb{R}^{N \times F_\text{in}}$ and a graph operator
    $\hat A \in \mathbb{R}^{N \times N}$ (typically from
    [`krylovjax.nn.normalise_adjacency`][]),

    $$Y = \sum_{j=0}^{k} \hat A^j H\, W_j^\top + \mathbf{1} b^\top
      = [H \mid \hat A H \mid \dots \mid \hat A^k H]\, W^\top + \mathbf{1} b^\top,$$

    with $W = [W_0 \mid \dots \mid W_k] \in
    \mathbb{R}^{F_\text{out} \times (k+1) F_\text{in}}$. The sum is one
    [`krylovjax.polynomial_action`][] call (`x0 = H`, one $W_j^\top$ per hop), so
    $\hat A$ may be dense or a BCOO matrix, and its values get gradients too.

    **Memory.** The forward pass keeps $H$, one hop $\hat A^j H$ and the output;
    the reverse pass stores the $k + 1$ hops and recomputes nothing, unless they
    would take more than 256 MiB and $k + 1$ is about 12 or more: then about
    $2\sqrt{k+1}$ arrays of the size of $H$ (checkpoints every
    $\lceil\sqrt{k+1}\,\rceil$ hops and one recomputed segment; see
    [`krylovjax.polynomial_action`][]).

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> from krylovjax.nn import KrylovGraphConv, normalise_adjacency
        >>> ring = jnp.roll(jnp.eye(5), 1, axis=1)
        >>> A_hat = normalise_adjacency(ring + ring.T)
        >>> conv = KrylovGraphConv(3, 4, 2, key=jax.random.key(0))
        >>> apply = jax.jit(lambda conv, A, H: conv(A, H))
        >>> apply(conv, A_hat, jnp.ones((5, 3))).shape
        (5, 4)
        >>> apply(conv, jnp.zeros((0, 0)), jnp.ones((0, 3))).shape  # an empty graph
        (0, 4)

        ```
    """

    weight: Inexact[Array, "out hops_in"]
    bias: Inexact[Array, " out"] | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    num_hops: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)

    def __init__(
        self,
        in_features: StaticInt,
        out_features: StaticInt,
        num_hops: StaticInt,
        *,
        use_bias: bool = True,
        dtype: DTypeLike | None = None,
        key: PRNGKeyArray,
    ):
        r"""**Arguments:**

        - `in_features`: $F_\text{in}$, the number of input features per node.
        - `out_features`: $F_\text{out}$, the number of output features per node.
        - `num_hops`: $k \ge 0$, the highest power of $\hat A$ (so $k + 1$ blocks;
            `num_hops=0` is a plain per-node linear layer), any integer type.
        - `use_bias`: whether to add a learnable bias $b$ (default `True`).
        - `dtype`: the dtype of $W$ and $b$, floating point or complex. Defaults to
            `jax.numpy.float32` or `jax.numpy.float64` depending on whether JAX is
            in 64-bit mode, as in `equinox.nn.Linear`.
        - `key`: a `jax.random` key for the initialisation (keyword only).

        $W$ and $b$ are initialised like `equinox.nn.Linear` with fan-in
        $(k + 1) F_\text{in}$.
        """
        f_in = check_size(in_features, "KrylovGraphConv(in_features=...)")
        f_out = check_size(out_features, "KrylovGraphConv(out_features=...)")
        num_hops = check_size(
            num_hops, "KrylovGraphConv(num_hops=...)", what="hops", minimum=0
        )
        dtype = check_dtype(dtype, "KrylovGraphConv(dtype=...)")
        fan_in = (num_hops + 1) * f_in
        # The weight is (out_features, (num_hops + 1) in_features).
        arg = "KrylovGraphConv(in_features=..., out_features=..., num_hops=...)"
        check_allocation((f_out, fan_in), dtype, arg, "the weight")
        lim = 1 / math.sqrt(fan_in)
        wkey, bkey = jax.random.split(key)
        self.weight = uniform(wkey, (f_out, fan_in), dtype, lim)
        self.bias = uniform(bkey, (f_out,), dtype, lim) if use_bias else None
        self.in_features = f_in
        self.out_features = f_out
        self.num_hops = num_hops
        self.use_bias = use_bias

    def __call__(
        self,
        adjacency: Shaped[ArrayLike, "N N"]
        | Shaped[sparse.BCOO, "N N"]
        | PartitionedOperator
        | list
        | tuple,
        H: Shaped[ArrayLike, "N in"] | list | tuple,
        *,
        key: PRNGKeyArray | None = None,
    ) -> Inexact[Array, "N out"]:
        r"""**Arguments:**

        - `adjacency`: the graph operator $\hat A$, shape `(N, N)`: a dense array
            (or nested lists) or a two-dimensional `jax.experimental.sparse.BCOO`
            matrix, usually normalised (see [`krylovjax.nn.normalise_adjacency`][])
            so that its powers stay bounded. Convert a SciPy sparse matrix with
            `jax.experimental.sparse.BCOO.from_scipy_sparse`.
        - `H`: the node features, shape `(N, in_features)`. $N = 0$ (an empty
            graph) is allowed.
        - `key`: ignored; accepted for compatibility with `equinox.nn`.

        The values of `adjacency` and `H` are promoted with the layer's dtype
        (`jnp.promote_types` by JAX's standard rules, also under strict dtype
        promotion), so integer or boolean inputs give the same output as the inputs
        cast to that dtype.

        **Returns:**

        The new node features, shape `(N, out_features)`, in the layer's dtype
        promoted with those of `adjacency` and `H`.
        """
        del key
        dtype = self.weight.dtype
        H = as_input(H, "KrylovGraphConv.__call__(H=...)", dtype)
        if H.ndim != 2 or H.shape[1] != self.in_features:
            msg = (
                f"`KrylovGraphConv.__call__(H=...)` must have shape (N, "
                f"{self.in_features}) (N nodes, in_features={self.in_features}); "
                f"got shape {H.shape}."
            )
            raise ValueError(msg)
        n = H.shape[0]
        arg = "KrylovGraphConv.__call__(adjacency=...)"
        if isinstance(adjacency, PartitionedOperator):
            adjacency = _as_partitioned(adjacency, arg, dtype)
        else:
            adjacency = _as_adjacency(adjacency, arg, dtype)
        shape = tuple(adjacency.shape)
        if shape != (n, n):
            msg = (
                f"`{arg}` must have shape {(n, n)} to match `H` of shape "
                f"{H.shape}; got shape {shape}."
            )
            raise ValueError(msg)
        # The weight's columns, (k + 1) F_in, as one (F_in, F_out) matrix per hop:
        # Y = sum_j A^j H W_j^T, summed as the hops are made (`polynomial_action`),
        # so the (N, k + 1, F_in) features are never stored.
        weight = self.weight.reshape(-1, self.num_hops + 1, self.in_features)
        coeffs = jnp.transpose(weight, (1, 2, 0))
        out = polynomial_action(adjacency, H, coeffs)
        if self.bias is not None:
            out = out + self.bias.astype(out.dtype)[None, :]
        return out
