"""Tests for `krylovjax.nn.ChebGraphConv` against PyTorch Geometric's `ChebConv`.

The oracle is `pyg_cheb_conv`, a transcription into JAX of what PyG's `ChebConv`
computes from an edge list: `get_laplacian` (self-loops removed, degrees summed
over the source node, the inverse degree of an isolated node set to 0, loops added
for every node), `ChebConv.__norm__` (`2 L / lambda_max - I`) and the message
passing of `propagate` (node `col` sums `norm * x[row]`), with the `Tx_k` loop of
`forward`. The test graph is directed, with a self-loop, a duplicate edge and an
isolated node, so each of those rules shows.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import adam_losses, unchecked
from jax.experimental import sparse
from jax.test_util import check_grads

from krylovjax.nn import ChebGraphConv

N = 5
# Edges (row -> col, weight): node 4 is isolated, (0, 0) is a self-loop, (1, 2)
# appears twice.
ROWS = np.array([0, 1, 1, 2, 2, 3, 0, 3, 1])
COLS = np.array([1, 0, 2, 1, 3, 0, 0, 2, 2])
WEIGHTS = np.array([0.5, 1.5, 2.0, 1.0, 0.7, 1.2, 0.9, 0.3, 0.4])
# The BCOO matrix holds the edges and one padding entry (an index outside the
# matrix, with a value that must be ignored).
INDICES = np.concatenate([np.stack([ROWS, COLS], axis=1), [[N, 0]]])
PADDING = 7.0
NORMALIZATIONS = ["sym", "rw", None]


def pyg_cheb_conv(x, weights, weight, bias, normalization, lambda_max):
    """PyG's `ChebConv.forward(x, edge_index, weights, lambda_max=lambda_max)` with
    `edge_index = [ROWS, COLS]`, `lins[k].weight = weight[k].T` and `bias`."""
    n, dtype = x.shape[0], x.dtype
    keep = ROWS != COLS  # remove_self_loops
    rows, cols, w = ROWS[keep], COLS[keep], weights[keep]
    deg = jnp.zeros(n, dtype).at[rows].add(w)
    if normalization is None:
        edge_weight = jnp.concatenate([-w, deg])
    elif normalization == "sym":
        dis = deg**-0.5
        dis = jnp.where(jnp.isinf(dis), 0.0, dis)
        edge_weight = jnp.concatenate([-(dis[rows] * w * dis[cols]), jnp.ones(n)])
    else:
        di = 1.0 / deg
        di = jnp.where(jnp.isinf(di), 0.0, di)
        edge_weight = jnp.concatenate([-(di[rows] * w), jnp.ones(n)])
    loops = np.arange(n)
    rows, cols = np.concatenate([rows, loops]), np.concatenate([cols, loops])
    norm = 2.0 * edge_weight / lambda_max
    norm = jnp.where(rows == cols, norm - 1.0, norm)

    def propagate(h):
        return jnp.zeros_like(h).at[cols].add(norm[:, None] * h[rows])

    tx0 = x
    out = tx0 @ weight[0]
    if weight.shape[0] > 1:
        tx1 = propagate(x)
        out = out + tx1 @ weight[1]
    for k in range(2, weight.shape[0]):
        tx2 = 2.0 * propagate(tx1) - tx0
        out = out + tx2 @ weight[k]
        tx0, tx1 = tx1, tx2
    return out + bias[None, :]


def _adjacencies(weights):
    dense = jnp.zeros((N, N), weights.dtype).at[ROWS, COLS].add(weights)
    data = jnp.concatenate([weights, jnp.full((1,), PADDING, weights.dtype)])
    return dense, sparse.BCOO((data, jnp.asarray(INDICES)), shape=(N, N))


def _layer(normalization="sym", K=4, f_in=2, f_out=3, seed=0):
    """A layer with a nonzero bias, and node features for it."""
    wkey, bkey, xkey = jr.split(jr.key(seed), 3)
    conv = ChebGraphConv(f_in, f_out, K, normalization=normalization, key=wkey)
    conv = eqx.tree_at(lambda c: c.bias, conv, jr.normal(bkey, (f_out,)))
    return conv, jr.normal(xkey, (N, f_in))


def _close(actual, expected, rtol):
    """Entrywise relative error below `rtol`, relative to the largest entry where
    an entry is near zero."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    atol = rtol * np.max(np.abs(expected), initial=0.0)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


@functools.cache
def _against_pyg(normalization):
    """Outputs and gradients of a layer and of `pyg_cheb_conv`, from one program.

    The layer runs on the dense adjacency with the default `lambda_max` and on the
    BCOO one with a traced `lambda_max`; its gradients are those of the BCOO run
    (of the weight, the bias, `X`, the BCOO values and `lambda_max`), the
    reference's those of the same function of the edge weights.
    """
    conv, x = _layer(normalization)
    weights, lam = jnp.asarray(WEIGHTS), jnp.asarray(3.5)
    cotangent = jr.normal(jr.key(7), (N, 3))

    @jax.jit
    def run(conv, x, weights, lam):
        dense, bcoo = _adjacencies(weights)

        def layer(conv, x, data, lam):
            A = sparse.BCOO((data, bcoo.indices), shape=bcoo.shape)
            return conv(A, x, lambda_max=lam)

        def pyg(weight, bias, x, w, lam):
            return pyg_cheb_conv(x, w, weight, bias, normalization, lam)

        out, vjp = jax.vjp(layer, conv, x, bcoo.data, lam)
        ref, ref_vjp = jax.vjp(pyg, conv.weight, conv.bias, x, weights, lam)
        g_conv, *grads = vjp(cotangent)
        return {
            "default": conv(dense, x),
            "default_ref": pyg(conv.weight, conv.bias, x, weights, 2.0),
            "out": out,
            "ref": ref,
            "grads": (g_conv.weight, g_conv.bias, *grads),
            "ref_grads": ref_vjp(cotangent),
        }

    return conv, x, jax.tree.map(np.asarray, run(conv, x, weights, lam))


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_matches_pyg_dense_and_sparse(normalization):
    conv, x, r = _against_pyg(normalization)
    _close(r["default"], r["default_ref"], rtol=1e-12)
    _close(r["out"], r["ref"], rtol=1e-12)
    # Isolated node 4 with "sym"/"rw": T_k(L_hat) x_4 = T_k(0) x_4 at lambda_max=2,
    # so K = 4 gives x_4 (W_0 - W_2) + b there.
    if normalization is not None:
        expected = x[4] @ (conv.weight[0] - conv.weight[2]) + conv.bias
        _close(r["default"][4], expected, rtol=1e-12)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_gradients_match_pyg(normalization):
    _, _, r = _against_pyg(normalization)
    g_weight, g_bias, g_x, g_data, g_lam = r["grads"]
    ref_weight, ref_bias, ref_x, ref_w, ref_lam = r["ref_grads"]
    _close(g_weight, ref_weight, rtol=1e-10)
    _close(g_bias, ref_bias, rtol=1e-10)
    _close(g_x, ref_x, rtol=1e-10)
    _close(g_data[:-1], ref_w, rtol=1e-10)
    _close(g_lam, ref_lam, rtol=1e-10)
    assert g_data[-1] == 0.0  # the padding entry
    assert g_data[6] == 0.0  # the self-loop, which PyG removes
    # Most edges' gradients are nonzero ("rw" makes that of 0 -> 1, the only edge
    # out of node 0, exactly zero).
    assert np.count_nonzero(ref_w) >= 7


def test_single_polynomial_is_a_linear_layer():
    conv, x = _layer(K=1)
    _, bcoo = _adjacencies(jnp.asarray(WEIGHTS))
    out = jax.jit(lambda c, a, x: c(a, x))(conv, bcoo, x)
    _close(out, x @ conv.weight[0] + conv.bias[None, :], rtol=1e-12)


def test_gradients_match_finite_differences():
    # A path 0 - 1 - 2 with weights, as a BCOO matrix.
    indices = jnp.array([[0, 1], [1, 0], [1, 2], [2, 1]])
    conv = ChebGraphConv(2, 2, 3, key=jr.key(1))

    @jax.jit
    def f(weight, bias, x, data):
        layer = eqx.tree_at(lambda c: (c.weight, c.bias), conv, (weight, bias))
        return layer(sparse.BCOO((data, indices), shape=(3, 3)), x, lambda_max=1.8)

    x = jr.normal(jr.key(2), (3, 2))
    data = jnp.array([1.0, 1.0, 0.5, 2.0])
    bias = jnp.array([0.3, -0.2])
    check_grads(f, (conv.weight, bias, x, data), order=1, modes=("rev",))


def test_adam_steps_reduce_a_loss():
    conv, x = _layer()
    target = jr.normal(jr.key(3), (N, 3))
    _, bcoo = _adjacencies(jnp.asarray(WEIGHTS))
    losses = adam_losses(conv, lambda c: jnp.mean((c(bcoo, x) - target) ** 2), 1e-2)
    assert losses[3] < losses[0]


def test_initialisation():
    conv = ChebGraphConv(4, 6, 3, key=jr.key(0))
    assert conv.weight.shape == (3, 4, 6)
    assert np.all(np.abs(np.asarray(conv.weight)) <= np.sqrt(6 / (4 + 6)))
    assert np.all(np.asarray(conv.bias) == 0.0)
    assert ChebGraphConv(4, 6, 3, use_bias=False, key=jr.key(0)).bias is None


def test_errors():
    conv = ChebGraphConv(2, 3, 2, key=jr.key(0))
    dense = jnp.ones((N, N))
    with pytest.raises(
        ValueError, match=r"`ChebGraphConv\.__call__\(X=\.\.\.\)`.*\(N, 2\).*\(5, 3\)"
    ):
        conv(dense, jnp.ones((N, 3)))
    with pytest.raises(ValueError, match=r"`ChebGraphConv\(K=\.\.\.\)`.*>= 1.*got 0"):
        ChebGraphConv(2, 3, 0, key=jr.key(0))
    with pytest.raises(
        ValueError,
        match=r"`ChebGraphConv\(normalization=\.\.\.\)` must be 'sym', 'rw' or None; "
        r"got 'laplacian'",
    ):
        unchecked(ChebGraphConv)(2, 3, 2, normalization="laplacian", key=jr.key(0))
    bcoo = sparse.BCOO((jnp.ones(1), jnp.zeros((1, 2), int)), shape=(4, 4))
    for adjacency in (jnp.ones((4, 4)), bcoo):
        with pytest.raises(
            ValueError,
            match=r"`ChebGraphConv\.__call__\(adjacency=\.\.\.\)` must have shape "
            r"\(5, 5\) to match `X` of shape \(5, 2\); got shape \(4, 4\)",
        ):
            unchecked(conv)(adjacency, jnp.ones((N, 2)))
    with pytest.raises(
        ValueError, match=r"`ChebGraphConv\.__call__\(lambda_max=\.\.\.\)`.*> 0.*got 0"
    ):
        conv(dense, jnp.ones((N, 2)), lambda_max=0.0)
