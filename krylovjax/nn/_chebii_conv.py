r"""`ChebIIConv`: ChebNetII's propagation, a graph filter given by its values at the
Chebyshev nodes (He, Wei and Wen, NeurIPS 2022).

A filter of degree $K$ is learnt through its values $\gamma_j$ at the $K + 1$
Chebyshev nodes of the first kind,

$$x_j = \cos\frac{(j + \tfrac12)\pi}{K + 1}, \qquad j = 0, \dots, K,$$

rather than through its coefficients. The filter is the polynomial $p$ of degree
at most $K$ that interpolates $(x_j, \tilde\gamma_j)$, $\tilde\gamma_j =
\operatorname{ReLU}(\gamma_j)$ (ChebNetII's non-negativity; $\gamma_j$ itself
with `nonnegative=False`). By the discrete orthogonality of $T_0, \dots, T_K$ on
these nodes its Chebyshev coefficients are

$$w_k = \frac{2}{K + 1} \sum_{j=0}^{K} \tilde\gamma_j T_k(x_j), \qquad
  p(x) = \frac{w_0}{2} + \sum_{k=1}^{K} w_k T_k(x),$$

and on the graph, with the Laplacian $L$ and $\hat L = 2 L / \lambda_\max - I$ of
[`krylovjax.nn.ChebGraphConv`][] (the same normalisations, self-loops dropped, the
same transposed propagation),

$$Y = p(\hat L^\top) X = \frac{w_0}{2} X + \sum_{k=1}^{K} w_k T_k(\hat L^\top) X.$$

So $\tilde\gamma_j$ is the filter's response at the Laplacian eigenvalue
$\lambda_j = \lambda_\max (x_j + 1) / 2$. The output is one
[`krylovjax.polynomial_action`][] call, `polynomial_action(L.T, X, w,
basis=Chebyshev(0, lambda_max))`, which sums the blocks $T_k(\hat L^\top) X$ as
they are made (never storing them; memory as for [`krylovjax.nn.ChebGraphConv`][]),
and the coefficients a constant $(K + 1) \times (K + 1)$ matrix times
$\tilde\gamma$, so the reverse pass is that call's plus one small product.

With $\gamma_j = 1$ for every $j$ (the official code's initialisation) the
discrete orthogonality $\sum_j T_k(x_j) = 0$, $1 \le k \le K$, gives
$w = (2, 0, \dots, 0)$ and $Y = X$: the layer starts as the identity filter.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse
from jaxtyping import Array, ArrayLike, DTypeLike, Float, PRNGKeyArray, Shaped

from .._bases import RealScalar
from .._checks import (
    as_input,
    check_allocation,
    check_dtype,
    check_size,
)
from .._typing import StaticInt
from ._cheb_conv import (
    Normalization,
    _check_normalization,
    _check_real,
    chebyshev_filter,
)


def _angles(K: int) -> np.ndarray:
    r"""$\theta_j = (j + 1/2) \pi / (K + 1)$, $j = 0, \dots, K$: the nodes are
    $x_j = \cos \theta_j$ (decreasing) and $T_k(x_j) = \cos(k \theta_j)$."""
    return (np.arange(K + 1) + 0.5) * np.pi / (K + 1)


def _interpolation_matrix(K: int) -> np.ndarray:
    r"""$M$ with $M \tilde\gamma = (w_0 / 2, w_1, \dots, w_K)$: $M_{kj} = (2 -
    \delta_{k0}) T_k(x_j) / (K + 1)$, in float64."""
    k = np.arange(K + 1)[:, None]
    scale = np.where(k == 0, 1.0, 2.0) / (K + 1)
    return scale * np.cos(k * _angles(K)[None, :])


class ChebIIConv(eqx.Module):
    r"""ChebNetII's propagation: a learnable graph filter of degree $K$ given by its
    values at the Chebyshev nodes.

    For node features $X \in \mathbb{R}^{N \times F}$ and a graph with adjacency
    matrix $A$ ($A_{ij}$ the weight of the edge from node $i$ to node $j$),

    $$Y = \frac{w_0}{2} X + \sum_{k=1}^{K} w_k T_k(\hat L^\top) X, \qquad
      w_k = \frac{2}{K + 1} \sum_{j=0}^{K} \operatorname{ReLU}(\gamma_j)\,
      T_k(x_j), \qquad x_j = \cos\frac{(j + \tfrac12)\pi}{K + 1},$$

    with $T_k$ the Chebyshev polynomials of the first kind, $\gamma \in
    \mathbb{R}^{K+1}$ (`gamma`) the learnable filter values and $\hat L = 2 L /
    \lambda_\max - I$, $L$ the Laplacian of `normalization` exactly as in
    [`krylovjax.nn.ChebGraphConv`][] (self-loops of $A$ ignored, the transposed
    propagation of PyG's message passing). $Y = p(\hat L^\top) X$ for the
    polynomial $p$ of degree at most $K$ with $p(x_j) = \operatorname{ReLU}
    (\gamma_j)$: $\gamma_j$ sets the filter's response at the Laplacian eigenvalue
    $\lambda_\max (x_j + 1) / 2$. The ReLU (`nonnegative=True`) is the paper's
    constraint; it makes the response non-negative at the nodes, not necessarily
    between them.

    The layer maps features to features of the same width: as in ChebNetII's
    decoupled design, the feature transforms (the MLP before the propagation,
    dropout) are separate layers, e.g. `equinox.nn.Linear` applied to each node.
    `gamma` starts at 1, the official code's default, for which the discrete
    orthogonality of $T_0, \dots, T_K$ on the nodes gives $w = (2, 0, \dots, 0)$:
    the identity filter, $Y = X$.

    This is the official code's `ChebnetII_prop(K)` (`forward(x, edge_index,
    edge_weight)`) with `normalization="sym"` and the default `lambda_max=2.0`,
    and its `temp` is `gamma[::-1]`: it numbers the same nodes in increasing order,
    $\cos((K - j + \tfrac12)\pi / (K + 1))$. The adjacency is given as for
    [`krylovjax.nn.ChebGraphConv`][], dense or BCOO; gradients reach `gamma`, $X$,
    the values of `adjacency` and $\lambda_\max$.

    !!! Example

        ```python
        >>> import equinox as eqx, jax, jax.numpy as jnp
        >>> from jax.experimental import sparse
        >>> from krylovjax.nn import ChebIIConv
        >>> edge_index = jnp.array([[0, 1, 1, 2], [1, 0, 2, 1]])  # a path 0 - 1 - 2
        >>> A = sparse.BCOO((jnp.ones(4), edge_index.T), shape=(3, 3))
        >>> X = jnp.arange(6.0).reshape(3, 2)
        >>> apply = jax.jit(lambda conv, A, X: conv(A, X))
        >>> conv = ChebIIConv(3)
        >>> conv.gamma
        Array([1., 1., 1., 1.], dtype=float32)
        >>> bool(jnp.allclose(apply(conv, A, X), X, atol=1e-5))  # identity at init
        True
        >>> p = lambda x: (1 - x) / 2  # a low-pass filter, p(L_hat) = I - L / 2
        >>> low_pass = eqx.tree_at(lambda c: c.gamma, conv, p(conv.nodes))
        >>> s = 1 / jnp.sqrt(jnp.array([1.0, 2.0, 1.0]))  # D^-1/2
        >>> S = s[:, None] * A.todense() * s[None, :]
        >>> bool(jnp.allclose(apply(low_pass, A, X), (X + S @ X) / 2))
        True

        ```
    """

    gamma: Float[Array, " K_plus_1"]
    K: int = eqx.field(static=True)
    normalization: Normalization = eqx.field(static=True)
    nonnegative: bool = eqx.field(static=True)

    def __init__(
        self,
        K: StaticInt,
        *,
        normalization: Normalization = "sym",
        nonnegative: bool | np.bool_ = True,
        dtype: DTypeLike | None = None,
    ):
        r"""**Arguments:**

        - `K`: the degree of the filter, at least 0 (`K + 1` values $\gamma_j$;
            `K=0` is a learnable scalar times $X$), any integer type.
        - `normalization`: the Laplacian, `"sym"` (default, ChebNetII's), `"rw"` or
            `None`, as for [`krylovjax.nn.ChebGraphConv`][].
        - `nonnegative`: whether the filter values are $\operatorname{ReLU}
            (\gamma_j)$ (default `True`, the paper's constraint) or $\gamma_j$
            itself.
        - `dtype`: the real floating-point dtype of `gamma`. Defaults to
            `jax.numpy.float32` or `jax.numpy.float64` depending on whether JAX is
            in 64-bit mode, as in `equinox.nn.Linear`.

        `gamma` starts at 1 (the identity filter), so no key is needed.
        """
        K = check_size(K, "ChebIIConv(K=...)", what="the filter degree", minimum=0)
        self.normalization = _check_normalization(normalization, "ChebIIConv")
        if not isinstance(nonnegative, bool | np.bool_):
            msg = (
                f"`ChebIIConv(nonnegative=...)` must be a bool; got {nonnegative!r} "
                f"of type {type(nonnegative).__name__}."
            )
            raise TypeError(msg)
        dtype = check_dtype(dtype, "ChebIIConv(dtype=...)", allow_complex=False)
        check_allocation((K + 1,), dtype, "ChebIIConv(K=...)", "gamma")
        self.gamma = jnp.ones((K + 1,), dtype)
        self.K = K
        self.nonnegative = bool(nonnegative)

    @property
    def nodes(self) -> Float[Array, " K_plus_1"]:
        r"""The Chebyshev nodes $x_0 > \dots > x_K$ at which `gamma` gives the
        filter's values, in the dtype of `gamma`."""
        return jnp.asarray(np.cos(_angles(self.K)), self.gamma.dtype)

    def __call__(
        self,
        adjacency: Shaped[ArrayLike, "N N"] | Shaped[sparse.BCOO, "N N"] | list | tuple,
        X: Shaped[ArrayLike, "N F"] | list | tuple,
        *,
        lambda_max: RealScalar = 2.0,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "N F"]:
        r"""**Arguments:**

        - `adjacency`: the weighted adjacency matrix $A$, shape `(N, N)`, a dense
            array (or nested lists) or a two-dimensional
            `jax.experimental.sparse.BCOO` matrix, as for
            [`krylovjax.nn.ChebGraphConv`][]: its diagonal and BCOO padding entries
            are ignored.
        - `X`: the node features, shape `(N, F)`, any $F$. $N = 0$ is allowed.
        - `lambda_max`: $\lambda_\max$, a real scalar (traced ones included; it
            gets a gradient), default 2.0, the bound of the `"sym"` and `"rw"`
            spectra; a concrete value must be finite and $> 0$. With `None`, pass
            an upper bound of the spectrum of $L$ (e.g. twice the largest degree):
            the nodes then cover it.
        - `key`: ignored; accepted for compatibility with `equinox.nn`.

        The values of `X` and `adjacency` are promoted with the layer's dtype, as
        in [`krylovjax.nn.ChebGraphConv`][]; complex inputs raise a `TypeError`.

        **Returns:**

        The filtered node features $Y = p(\hat L^\top) X$, shape `(N, F)`, in the
        layer's dtype promoted with those of `X` and `adjacency`.
        """
        del key
        dtype = self.gamma.dtype
        x_arg = "ChebIIConv.__call__(X=...)"
        X = as_input(X, x_arg, dtype)
        _check_real(X, x_arg)
        if X.ndim != 2:
            msg = (
                f"`{x_arg}` must have shape (N, F) (N nodes, F features); got shape "
                f"{X.shape}."
            )
            raise ValueError(msg)
        values = self.gamma
        if self.nonnegative:
            values = jax.nn.relu(values)
        matrix = jnp.asarray(_interpolation_matrix(self.K), values.dtype)
        coefficients = matrix @ values  # (w_0 / 2, w_1, ..., w_K)
        return chebyshev_filter(
            adjacency,
            X,
            coefficients,
            self.normalization,
            lambda_max,
            "ChebIIConv",
            dtype,
        )
