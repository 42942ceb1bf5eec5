r"""`ChebGraphConv`: the Chebyshev spectral graph convolution (Defferrard et al., 2016).

The layer of PyTorch Geometric's `ChebConv`. A graph of $N$ nodes is given by its
adjacency matrix $A$, $A_{ij}$ the weight of the edge from node $i$ to node $j$ (the
matrix `torch_geometric.utils.to_dense_adj` builds from `edge_index` and the edge
weights). Self-loops are removed, $A_{ii} = 0$, the degrees are the row sums
$D = \operatorname{diag}(A \mathbf{1})$, and the Laplacian is one of

$$L = I - D^{-1/2} A D^{-1/2} \;(\texttt{"sym"}), \qquad
  L = I - D^{-1} A \;(\texttt{"rw"}), \qquad L = D - A \;(\texttt{None}),$$

where a node of degree 0 has $D^{-1/2}_{ii} = D^{-1}_{ii} = 0$ (its row of $L$ is
that of $I$, or zero for `None`). With $\hat L = 2 L / \lambda_\max - I$ and the
node features $X \in \mathbb{R}^{N \times F_\text{in}}$,

$$\bar X_0 = X, \quad \bar X_1 = \hat L^\top X, \quad
  \bar X_k = 2 \hat L^\top \bar X_{k-1} - \bar X_{k-2}, \qquad
  Y = \sum_{k=0}^{K-1} \bar X_k W_k + \mathbf{1} b^\top.$$

The transpose is PyG's message passing: a message travels along an edge from $i$ to
$j$, so node $j$ sums $\hat L_{ij} x_i$. For an undirected graph ($A$ symmetric)
$\hat L^\top = \hat L$ with `"sym"` and `None`, and $L^\top = I - A D^{-1}$ with
`"rw"`.

$\bar X_k = T_k(\hat L^\top) X$, with $T_k$ the Chebyshev polynomials of the first
kind. Since $\hat L^\top = 2 L^\top / \lambda_\max - I$ is the affine map of
[`krylovjax.Chebyshev`][] from $[0, \lambda_\max]$ onto $[-1, 1]$, applied to
$L^\top$, the output is one [`krylovjax.polynomial_action`][] call,
`polynomial_action(L.T, X, W, basis=Chebyshev(0, lambda_max))`: $\hat L$ is never
formed, and neither are the $K$ blocks, which are summed as they are made.
"""

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.experimental import sparse
from jaxtyping import Array, ArrayLike, DTypeLike, Float, PRNGKeyArray, Shaped

from .._bases import Chebyshev, RealScalar, real_scalar
from .._checks import (
    as_input,
    check_allocation,
    check_dtype,
    check_size,
)
from .._readout import polynomial_action
from .._typing import StaticInt
from ._graph_conv import _as_adjacency
from ._init import uniform

Normalization = Literal["sym", "rw"] | None


def _check_normalization(value: Any, layer: str = "ChebGraphConv") -> Normalization:
    if value is not None and (not isinstance(value, str) or value not in ("sym", "rw")):
        msg = (
            f"`{layer}(normalization=...)` must be 'sym', 'rw' or None; got {value!r}."
        )
        raise ValueError(msg)
    return value


def _check_real(x: Any, arg: str) -> None:
    if jnp.iscomplexobj(x):
        msg = f"`{arg}` must be real; got dtype {x.dtype}."
        raise TypeError(msg)


def _check_lambda_max(value: Any, layer: str = "ChebGraphConv") -> Array:
    """`lambda_max` as a real scalar array; a concrete value must be finite and > 0
    (a traced one is not checked)."""
    arg = f"{layer}.__call__(lambda_max=...)"
    lam = real_scalar(value, arg)
    if not isinstance(lam, Tracer):
        concrete = np.asarray(lam)
        if not (np.isfinite(concrete) and concrete > 0):
            msg = f"`{arg}` must be finite and > 0; got {concrete}."
            raise ValueError(msg)
    return lam


def _inverse(x: Array, power: float) -> Array:
    """`x ** -power`, 0 where `x == 0` (PyG's `masked_fill` of `inf`), with a
    gradient that is 0 there rather than `nan`."""
    zero = x == 0
    safe = jnp.where(zero, jnp.ones_like(x), x)
    return jnp.where(zero, jnp.zeros_like(x), safe ** jnp.asarray(-power, x.dtype))


def _dense_laplacian(A: Array, normalization: Normalization) -> Array:
    """$L^\\top$ of the dense adjacency `A`."""
    n = A.shape[0]
    A = jnp.where(jnp.eye(n, dtype=bool), jnp.zeros((), A.dtype), A)
    degree = A.sum(axis=1)
    if normalization is None:
        L = jnp.diag(degree) - A
    elif normalization == "sym":
        s = _inverse(degree, 0.5)
        L = jnp.eye(n, dtype=A.dtype) - s[:, None] * A * s[None, :]
    else:
        L = jnp.eye(n, dtype=A.dtype) - _inverse(degree, 1.0)[:, None] * A
    return L.T


def _sparse_laplacian(A: sparse.BCOO, normalization: Normalization) -> sparse.BCOO:
    """$L^\\top$ of the BCOO adjacency `A`: its entries transposed and rescaled,
    plus $N$ diagonal entries.

    An index $i \\in [-N, 0)$ counts from the end, as in JAX's BCOO operations; an
    entry with an index outside $[-N, N)$ is padding. Padding entries and
    self-loops are kept with the value 0 (padding at index $N$), so they contribute
    nothing and their values get a zero gradient.
    """
    n = A.shape[0]
    dtype = A.dtype
    rows = jnp.where(A.indices[:, 0] < 0, A.indices[:, 0] + n, A.indices[:, 0])
    cols = jnp.where(A.indices[:, 1] < 0, A.indices[:, 1] + n, A.indices[:, 1])
    inside = (rows >= 0) & (rows < n) & (cols >= 0) & (cols < n)
    keep = inside & (rows != cols)
    zeros = jnp.zeros_like(A.data)
    weights = jnp.where(keep, A.data, zeros)
    # In range wherever a value is gathered; padding entries are masked out above.
    r, c = jnp.clip(rows, 0, max(n - 1, 0)), jnp.clip(cols, 0, max(n - 1, 0))
    degree = jax.ops.segment_sum(weights, r, num_segments=n)
    if n == 0:
        off = weights
    elif normalization is None:
        off = -weights
    elif normalization == "sym":
        s = _inverse(degree, 0.5)
        off = -(s[r] * weights * s[c])
    else:
        off = -(_inverse(degree, 1.0)[r] * weights)
    off = jnp.where(keep, off, zeros)
    diagonal = degree if normalization is None else jnp.ones((n,), dtype)
    padding = jnp.full_like(rows, n)
    # Transposed: the entry (i, j) of L goes to (j, i).
    edges = jnp.stack(
        [jnp.where(inside, cols, padding), jnp.where(inside, rows, padding)], axis=1
    )
    loops = jnp.arange(n, dtype=A.indices.dtype)
    indices = jnp.concatenate([edges, jnp.stack([loops, loops], axis=1)])
    data = jnp.concatenate([off, diagonal])
    return sparse.BCOO((data, indices), shape=(n, n))


def chebyshev_filter(
    adjacency: Any,
    X: Array,
    coeffs: Array,
    normalization: Normalization,
    lambda_max: Any,
    layer: str,
    dtype: Any,
) -> Array:
    r"""$\sum_k T_k(\hat L^\top) X\, W_k$ (`coeffs` of shape `(K, F_in, F_out)`)
    or $\sum_k w_k T_k(\hat L^\top) X$ (`coeffs` of shape `(K,)`) for a layer
    called `layer` with parameters of `dtype`: the adjacency checked against `X`
    (already checked), its Laplacian, and one `polynomial_action` call."""
    n = X.shape[0]
    a_arg = f"{layer}.__call__(adjacency=...)"
    adjacency = _as_adjacency(adjacency, a_arg, dtype)
    _check_real(adjacency, a_arg)
    shape = tuple(adjacency.shape)
    if shape != (n, n):
        msg = (
            f"`{a_arg}` must have shape {(n, n)} to match `X` of shape "
            f"{X.shape}; got shape {shape}."
        )
        raise ValueError(msg)
    basis = Chebyshev(0.0, _check_lambda_max(lambda_max, layer))
    if isinstance(adjacency, sparse.BCOO):
        laplacian = _sparse_laplacian(adjacency, normalization)
    else:
        laplacian = _dense_laplacian(adjacency, normalization)
    return polynomial_action(laplacian, X, coeffs, basis=basis)


class ChebGraphConv(eqx.Module):
    r"""The Chebyshev spectral graph convolution of PyTorch Geometric's `ChebConv`.

    For node features $X \in \mathbb{R}^{N \times F_\text{in}}$ and a graph with
    adjacency matrix $A$ ($A_{ij}$ the weight of the edge from node $i$ to node
    $j$),

    $$Y = \sum_{k=0}^{K-1} T_k(\hat L^\top) X\, W_k + \mathbf{1} b^\top, \qquad
      \hat L = \frac{2 L}{\lambda_\max} - I,$$

    with $T_k$ the Chebyshev polynomials of the first kind, $W_k \in
    \mathbb{R}^{F_\text{in} \times F_\text{out}}$ (`weight[k]`) and $L$ the graph
    Laplacian of `normalization` (self-loops of $A$ ignored, degrees
    $D = \operatorname{diag}(A \mathbf{1})$, a node of degree 0 given the row of
    $I$):

    - `"sym"`: $L = I - D^{-1/2} A D^{-1/2}$;
    - `"rw"`: $L = I - D^{-1} A$;
    - `None`: $L = D - A$.

    $\hat L^\top$ rather than $\hat L$ because messages travel along the edges,
    from $i$ to $j$; for an undirected graph (symmetric $A$) the two are the same
    except with `"rw"`, where $L^\top = I - A D^{-1}$.

    This is what `torch_geometric.nn.ChebConv(in_features, out_features, K,
    normalization, bias=use_bias)` computes, `forward(x, edge_index, edge_weight,
    lambda_max=lambda_max)`, with the same parameters: its `lins[k].weight` is
    `weight[k].T` and its `bias` is `bias`; `adjacency` is
    `to_dense_adj(edge_index, edge_attr=edge_weight)[0]`, or the BCOO matrix with
    `indices = edge_index.T` and `data = edge_weight` (duplicate edges add up,
    as in PyG).

    The sum is one [`krylovjax.polynomial_action`][] call in the
    [`krylovjax.Chebyshev`][] basis on $[0, \lambda_\max]$, applied to $L^\top$,
    with $W_k$ per degree; gradients reach $W$, $b$, $X$, the values of
    `adjacency` (dense or BCOO) and $\lambda_\max$.

    **Memory.** The blocks $T_k(\hat L^\top) X$ are summed into the output as
    they are made: the forward pass keeps two of them. The reverse pass stores
    the $K$ blocks ($N K F_\text{in}$ numbers) and recomputes nothing, unless
    they would take more than 256 MiB and $K$ is about 28 or more: then about $3\sqrt K$
    arrays of the size of $X$ (checkpoints of pairs of blocks every
    $\lceil\sqrt K\,\rceil$ degrees, and one recomputed segment).
    The Laplacian is built densely ($N^2$ numbers) for a dense
    `adjacency`, and for a BCOO one as a BCOO matrix of its entries plus $N$
    diagonal ones, so a sparse graph stays sparse.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> from jax.experimental import sparse
        >>> from krylovjax.nn import ChebGraphConv
        >>> edge_index = jnp.array([[0, 1, 1, 2], [1, 0, 2, 1]])  # a path 0 - 1 - 2
        >>> A = sparse.BCOO((jnp.ones(4), edge_index.T), shape=(3, 3))
        >>> conv = ChebGraphConv(2, 4, 3, key=jax.random.key(0))
        >>> apply = jax.jit(lambda conv, A, X: conv(A, X, lambda_max=1.5))
        >>> X = jnp.ones((3, 2))
        >>> Y = apply(conv, A, X)
        >>> Y.shape
        (3, 4)
        >>> bool(jnp.allclose(Y, apply(conv, A.todense(), X)))  # the same, dense
        True

        ```
    """

    weight: Float[Array, "K f_in f_out"]
    bias: Float[Array, " f_out"] | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    K: int = eqx.field(static=True)
    normalization: Normalization = eqx.field(static=True)

    def __init__(
        self,
        in_features: StaticInt,
        out_features: StaticInt,
        K: StaticInt,
        *,
        normalization: Normalization = "sym",
        use_bias: bool = True,
        dtype: DTypeLike | None = None,
        key: PRNGKeyArray,
    ):
        r"""**Arguments:**

        - `in_features`: $F_\text{in}$, the number of input features per node.
        - `out_features`: $F_\text{out}$, the number of output features per node.
        - `K`: the number of Chebyshev polynomials $T_0, \dots, T_{K-1}$, at least
            1 (`K=1` is a plain per-node linear layer), any integer type.
        - `normalization`: the Laplacian, `"sym"` (default), `"rw"` or `None`, as
            above.
        - `use_bias`: whether to add a learnable bias $b$ (default `True`).
        - `dtype`: the real floating-point dtype of $W$ and $b$. Defaults to
            `jax.numpy.float32` or `jax.numpy.float64` depending on whether JAX is
            in 64-bit mode, as in `equinox.nn.Linear`.
        - `key`: a `jax.random` key for the initialisation (keyword only).

        As in PyG, each $W_k$ is drawn from the Glorot (Xavier) uniform
        distribution, on $\pm \sqrt{6 / (F_\text{in} + F_\text{out})}$, and $b$ is
        zero.
        """
        f_in = check_size(in_features, "ChebGraphConv(in_features=...)")
        f_out = check_size(out_features, "ChebGraphConv(out_features=...)")
        K = check_size(K, "ChebGraphConv(K=...)", what="the number of polynomials")
        self.normalization = _check_normalization(normalization)
        dtype = check_dtype(dtype, "ChebGraphConv(dtype=...)", allow_complex=False)
        arg = "ChebGraphConv(in_features=..., out_features=..., K=...)"
        check_allocation((K, f_in, f_out), dtype, arg, "the weight")
        lim = float(np.sqrt(6 / (f_in + f_out)))
        self.weight = uniform(key, (K, f_in, f_out), dtype, lim)
        self.bias = jnp.zeros((f_out,), dtype) if use_bias else None
        self.in_features = f_in
        self.out_features = f_out
        self.K = K

    def __call__(
        self,
        adjacency: Shaped[ArrayLike, "N N"] | Shaped[sparse.BCOO, "N N"] | list | tuple,
        X: Shaped[ArrayLike, "N f_in"] | list | tuple,
        *,
        lambda_max: RealScalar = 2.0,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "N f_out"]:
        r"""**Arguments:**

        - `adjacency`: the weighted adjacency matrix $A$, shape `(N, N)`, with
            $A_{ij}$ the weight of the edge from node $i$ to node $j$: a dense array
            (or nested lists) or a two-dimensional `jax.experimental.sparse.BCOO`
            matrix (convert a SciPy sparse matrix with
            `jax.experimental.sparse.BCOO.from_scipy_sparse`). Its diagonal (the
            self-loops) is ignored, and so are BCOO padding entries (an index
            outside the matrix). The weights are meant to be non-negative; a
            negative degree gives `nan` with `"sym"`, as in PyG.
        - `X`: the node features, shape `(N, in_features)`. $N = 0$ (an empty
            graph) is allowed.
        - `lambda_max`: $\lambda_\max$, a real scalar (a Python number or a JAX
            array, traced ones included; it gets a gradient), default 2.0: an
            upper bound of the spectrum of the `"sym"` and `"rw"` Laplacians. A
            concrete value must be finite and $> 0$. PyG's default for
            `lambda_max=None` is twice the largest entry of $L$, which is 2.0 for
            `"sym"` and `"rw"` but twice the largest degree for `None`: pass that
            value explicitly there.
        - `key`: ignored; accepted for compatibility with `equinox.nn`.

        The values of `X` and `adjacency` are promoted with the layer's dtype
        (`jnp.promote_types` by JAX's standard rules, also under strict dtype
        promotion), so integer or boolean inputs give the same output as the inputs
        cast to that dtype; complex inputs raise a `TypeError`.

        **Returns:**

        The new node features, shape `(N, out_features)`, in the layer's dtype
        promoted with those of `X` and `adjacency`.
        """
        del key
        dtype = self.weight.dtype
        x_arg = "ChebGraphConv.__call__(X=...)"
        X = as_input(X, x_arg, dtype)
        _check_real(X, x_arg)
        if X.ndim != 2 or X.shape[1] != self.in_features:
            msg = (
                f"`{x_arg}` must have shape (N, {self.in_features}) (N nodes, "
                f"in_features={self.in_features}); got shape {X.shape}."
            )
            raise ValueError(msg)
        out = chebyshev_filter(
            adjacency,
            X,
            self.weight,
            self.normalization,
            lambda_max,
            "ChebGraphConv",
            dtype,
        )
        if self.bias is not None:
            out = out + self.bias.astype(out.dtype)[None, :]
        return out
