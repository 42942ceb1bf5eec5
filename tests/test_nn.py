"""Tests for the layers in `krylovjax.nn`.

Every layer is checked for output shapes, agreement with an independent reference
(powers of the matrix, a time-domain recurrence, an explicit sum of graph
diffusions), `jax.jit` and `jax.vmap`, gradients of every learnable array against
central finite differences in float64 (`conftest.py` enables 64-bit mode), a
serialise/deserialise round trip, and the errors raised for bad arguments.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import unchecked
from jax.experimental import sparse
from jax.test_util import check_grads

from krylovjax.nn import (
    KrylovGraphConv,
    LinearDynamics,
    StateSpaceConv,
    normalise_adjacency,
)

N_NODES = 6


def _ring_adjacency(n=N_NODES):
    ring = np.roll(np.eye(n), 1, axis=1)
    adjacency = ring + ring.T
    adjacency[0, 3] = adjacency[3, 0] = 1.0  # a chord, so degrees differ
    return jnp.asarray(adjacency)


def _make(kind, key=None):
    """A small layer of each kind and a matching (single-sample) input tuple."""
    key = jr.key(0) if key is None else key
    if kind == "linear_dynamics":
        return LinearDynamics(3, 7, key=key), ()
    if kind == "linear_dynamics_x0":
        model = LinearDynamics(3, 7, learn_x0=False, key=key)
        return model, (jr.normal(jr.key(1), (3,)),)
    if kind == "state_space":
        model = StateSpaceConv(4, 2, 3, 12, dt_min=0.05, dt_max=0.5, key=key)
        return model, (jr.normal(jr.key(1), (12, 2)),)
    if kind == "graph_dense":
        model = KrylovGraphConv(2, 3, 3, key=key)
        a_hat = normalise_adjacency(_ring_adjacency())
        return model, (a_hat, jr.normal(jr.key(1), (N_NODES, 2)))
    if kind == "graph_bcoo":
        model = KrylovGraphConv(2, 3, 3, key=key)
        a_hat = normalise_adjacency(sparse.BCOO.fromdense(_ring_adjacency()))
        return model, (a_hat, jr.normal(jr.key(1), (N_NODES, 2)))
    raise ValueError(kind)


KINDS = [
    "linear_dynamics",
    "linear_dynamics_x0",
    "state_space",
    "graph_dense",
    "graph_bcoo",
]
SHAPES = {
    "linear_dynamics": (7, 3),
    "linear_dynamics_x0": (7, 3),
    "state_space": (12, 3),
    "graph_dense": (N_NODES, 3),
    "graph_bcoo": (N_NODES, 3),
}


# --- references --------------------------------------------------------------------


# The references are NumPy: eager JAX operations would each compile a program.


def test_linear_dynamics_matches_matrix_powers():
    model = LinearDynamics(4, 6, key=jr.key(2))
    K, x0 = np.asarray(model.transition), np.asarray(model.x0)
    expected = np.stack([np.linalg.matrix_power(K, t) @ x0 for t in range(6)])
    np.testing.assert_allclose(model(), expected, rtol=1e-12, atol=1e-12)
    other = np.arange(4.0)
    expected = np.stack([np.linalg.matrix_power(K, t) @ other for t in range(9)])
    np.testing.assert_allclose(
        model(jnp.asarray(other), horizon=9), expected, rtol=1e-12, atol=1e-12
    )


def _state_space_reference(layer, u):
    """Time-domain recurrence s_t = A s_(t-1) + B u_t, y_t = C s_t + D u_t."""
    A_bar, B_bar = layer.discretise()
    state = jnp.zeros(layer.state_size)
    ys = []
    for u_t in u:
        state = A_bar @ state + B_bar @ u_t
        ys.append(layer.C @ state + layer.D @ u_t)
    return jnp.stack(ys)


N_TIMES = (1, 7, 12)


def test_state_space_matches_recurrence():
    # Every length in one program.
    layer, (u,) = _make("state_space")
    got = eqx.filter_jit(
        lambda layer, u: [
            (layer(u[:t]), _state_space_reference(layer, u[:t])) for t in N_TIMES
        ]
    )(layer, u)
    for out, expected in got:
        np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-12)


def test_state_space_is_causal():
    layer, (u,) = _make("state_space")
    changed = u.at[8:].add(1.0)
    out_changed, out = eqx.filter_jit(lambda layer: (layer(changed), layer(u)))(layer)
    np.testing.assert_allclose(out_changed[:8], out[:8], rtol=1e-12)
    assert not np.allclose(out_changed[8:], out[8:])


def test_state_space_discretisation():
    layer = StateSpaceConv(5, 2, 1, 4, key=jr.key(3))
    skew, damping = np.asarray(layer.skew), np.asarray(layer.damping)
    a_c = skew - skew.T - damping @ damping.T - layer.min_damping * np.eye(5)
    h = 0.5 * np.exp(np.asarray(layer.log_step))
    inverse = np.linalg.inv(np.eye(5) - h * a_c)
    A_bar, B_bar = layer.discretise()
    np.testing.assert_allclose(A_bar, inverse @ (np.eye(5) + h * a_c), rtol=1e-10)
    np.testing.assert_allclose(
        B_bar, inverse @ (2 * h * np.asarray(layer.B)), rtol=1e-10
    )


@pytest.mark.parametrize("scale", [1.0, 100.0])
def test_state_space_transition_is_a_contraction(scale):
    # Whatever the parameters, ||A_bar||_2 < 1, so long kernels stay bounded.
    layer = StateSpaceConv(6, 1, 1, 1000, key=jr.key(4))
    layer = eqx.tree_at(
        lambda m: (m.skew, m.damping, m.log_step),
        layer,
        (scale * layer.skew, scale * layer.damping, jnp.asarray(3.0)),
    )
    A_bar, B_bar = (np.asarray(M) for M in layer.discretise())
    assert np.linalg.norm(A_bar, 2) < 1
    kernel = np.asarray(eqx.filter_jit(lambda m: m.kernel())(layer))
    assert np.all(np.isfinite(kernel))
    bound = np.linalg.norm(np.asarray(layer.C), 2) * np.linalg.norm(B_bar, 2)
    assert np.max(np.abs(kernel)) <= bound * (1 + 1e-12)


def _graph_reference(layer, a_hat, H):
    if isinstance(a_hat, sparse.BCOO):
        dense = np.zeros(a_hat.shape)
        np.add.at(dense, tuple(np.asarray(a_hat.indices).T), np.asarray(a_hat.data))
    else:
        dense = np.asarray(a_hat)
    H, weight, bias = (np.asarray(x) for x in (H, layer.weight, layer.bias))
    blocks = [np.linalg.matrix_power(dense, j) @ H for j in range(layer.num_hops + 1)]
    return np.concatenate(blocks, axis=1) @ weight.T + bias[None, :]


@pytest.mark.parametrize("kind", ["graph_dense", "graph_bcoo"])
def test_graph_conv_matches_sum_of_powers(kind):
    layer, (a_hat, H) = _make(kind)
    np.testing.assert_allclose(
        layer(a_hat, H), _graph_reference(layer, a_hat, H), rtol=1e-10, atol=1e-12
    )


def test_graph_conv_without_bias_and_zero_hops():
    layer = KrylovGraphConv(2, 3, 0, use_bias=False, key=jr.key(5))
    assert layer.bias is None
    H = jr.normal(jr.key(6), (N_NODES, 2))
    np.testing.assert_allclose(
        layer(_ring_adjacency(), H), H @ layer.weight.T, rtol=1e-12
    )


def test_normalise_adjacency_dense_and_sparse_agree():
    adjacency = _ring_adjacency()
    with_loops = np.asarray(adjacency) + np.eye(N_NODES)
    d = with_loops.sum(axis=1)
    expected = with_loops / np.sqrt(d[:, None] * d[None, :])
    np.testing.assert_allclose(normalise_adjacency(adjacency), expected, rtol=1e-12)
    bcoo = normalise_adjacency(sparse.BCOO.fromdense(adjacency))
    assert isinstance(bcoo, sparse.BCOO)
    np.testing.assert_allclose(bcoo.todense(), expected, rtol=1e-12)
    # Indices in [-N, 0) count from the end, as in JAX's products.
    A = sparse.BCOO.fromdense(adjacency)
    wrapped = (
        A.indices - N_NODES * (jnp.arange(A.nse, dtype=A.indices.dtype) % 2)[:, None]
    )
    bcoo = normalise_adjacency(sparse.BCOO((A.data, wrapped), shape=A.shape))
    np.testing.assert_allclose(bcoo.todense(), expected, rtol=1e-12)
    assert np.max(np.abs(np.linalg.eigvalsh(expected))) <= 1 + 1e-12


# --- transforms ---------------------------------------------------------------------


def test_vmap_linear_dynamics_over_initial_states():
    model, _ = _make("linear_dynamics_x0")
    x0s = jr.normal(jr.key(7), (5, 3))
    batched, single = eqx.filter_jit(lambda m, x: (jax.vmap(m)(x), m(x[2])))(model, x0s)
    assert batched.shape == (5, 7, 3)
    np.testing.assert_allclose(batched[2], single, rtol=1e-12)


def test_vmap_state_space_over_sequences():
    layer, _ = _make("state_space")
    u = jr.normal(jr.key(8), (4, 10, 2))
    batched, single = eqx.filter_jit(lambda m, u: (jax.vmap(m)(u), m(u[1])))(layer, u)
    assert batched.shape == (4, 10, 3)
    np.testing.assert_allclose(batched[1], single, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["graph_dense", "graph_bcoo"])
def test_vmap_graph_conv_over_feature_sets(kind):
    layer, (a_hat, _) = _make(kind)
    H = jr.normal(jr.key(9), (3, N_NODES, 2))
    batched, single = eqx.filter_jit(
        lambda m, a, H: (jax.vmap(m, in_axes=(None, 0))(a, H), m(a, H[2]))
    )(layer, a_hat, H)
    assert batched.shape == (3, N_NODES, 3)
    np.testing.assert_allclose(batched[2], single, rtol=1e-10)


def test_vmap_over_an_ensemble_of_layers():
    keys = jr.split(jr.key(10), 3)
    models = eqx.filter_vmap(lambda k: LinearDynamics(3, 4, key=k))(keys)
    out = eqx.filter_vmap(lambda m: m())(models)
    assert out.shape == (3, 4, 3)
    # Each member is the layer its key makes.
    np.testing.assert_allclose(
        out[1], LinearDynamics(3, 4, key=keys[1])(), rtol=1e-12, atol=1e-12
    )


# --- gradients ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_every_parameter_and_match_finite_differences(kind):
    model, args = _make(kind)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    weights = jr.normal(jr.key(11), SHAPES[kind])

    @jax.jit
    def loss(params):
        return jnp.sum(weights * eqx.combine(params, static)(*args))

    grads = jax.grad(loss)(params)
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
        assert jnp.all(jnp.isfinite(leaf)), path
        assert jnp.any(leaf != 0), f"no gradient reaches {jax.tree_util.keystr(path)}"
    # Reverse mode (forward mode: test_defaults.py::test_layers_support_forward_mode).
    check_grads(loss, (params,), order=1, modes=["rev"], eps=1e-6)


def test_graph_conv_gradient_of_sparse_adjacency_values():
    layer, (a_hat, H) = _make("graph_bcoo")
    weights = jr.normal(jr.key(12), (N_NODES, 3))

    @jax.jit
    def loss(data, H):
        operator = sparse.BCOO((data, a_hat.indices), shape=a_hat.shape)
        return jnp.sum(weights * layer(operator, H))

    check_grads(loss, (a_hat.data, H), order=1, modes=["rev"], eps=1e-6)


# --- serialisation ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_output_under_jit_and_serialise_round_trip(kind, tmp_path):
    # The output's shape and dtype under `jit` (its values are checked against
    # independent references above), and a round trip through a file.
    model, args = _make(kind, key=jr.key(13))
    path = tmp_path / "layer.eqx"
    eqx.tree_serialise_leaves(path, model)
    fresh, _ = _make(kind, key=jr.key(14))
    loaded = eqx.tree_deserialise_leaves(path, fresh)
    out_fresh, out_model, out_loaded = eqx.filter_jit(
        lambda models, args: [m(*args) for m in models]
    )([fresh, model, loaded], args)
    assert out_model.shape == SHAPES[kind]
    assert out_model.dtype == jnp.float64
    assert jnp.all(jnp.isfinite(out_model))
    assert not np.allclose(out_fresh, out_model)
    np.testing.assert_array_equal(out_loaded, out_model)


# --- errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda k: LinearDynamics(0, 5, key=k), ValueError, r"state_size=.*got 0"),
        (lambda k: LinearDynamics(3, -1, key=k), ValueError, r"horizon=.*got -1"),
        (
            lambda k: unchecked(LinearDynamics)(3.0, 5, key=k),
            TypeError,
            r"`LinearDynamics\(state_size=\.\.\.\)` must be a Python int",
        ),
        (
            lambda k: unchecked(LinearDynamics)(3, 5, learn_x0=1, key=k),
            TypeError,
            r"`LinearDynamics\(learn_x0=\.\.\.\)` must be a bool",
        ),
        (lambda k: StateSpaceConv(0, 1, 1, 5, key=k), ValueError, r"state_size="),
        (lambda k: StateSpaceConv(2, 0, 1, 5, key=k), ValueError, r"in_channels="),
        (lambda k: StateSpaceConv(2, 1, 0, 5, key=k), ValueError, r"out_channels="),
        (lambda k: StateSpaceConv(2, 1, 1, 0, key=k), ValueError, r"length="),
        (
            lambda k: StateSpaceConv(2, 1, 1, 5, dt_min=0.2, dt_max=0.1, key=k),
            ValueError,
            r"dt_min=0\.2, dt_max=0\.1",
        ),
        (
            lambda k: StateSpaceConv(2, 1, 1, 5, min_damping=0.0, key=k),
            ValueError,
            r"min_damping=.*got 0\.0",
        ),
        (
            lambda k: StateSpaceConv(2, 1, 1, 5, dt_max=math.inf, key=k),
            ValueError,
            r"dt_min <= dt_max < inf; got dt_min=0\.001, dt_max=inf",
        ),
        (
            lambda k: StateSpaceConv(2, 1, 1, 5, min_damping=math.inf, key=k),
            ValueError,
            r"min_damping=\.\.\.\)` must be finite and > 0; got inf",
        ),
        (lambda k: KrylovGraphConv(0, 2, 1, key=k), ValueError, r"in_features="),
        (lambda k: KrylovGraphConv(2, 0, 1, key=k), ValueError, r"out_features="),
        (lambda k: KrylovGraphConv(2, 2, -1, key=k), ValueError, r"num_hops=.*-1"),
        (
            lambda k: unchecked(KrylovGraphConv)(2, 2, 1.5, key=k),
            TypeError,
            r"`KrylovGraphConv\(num_hops=\.\.\.\)` must be a Python int",
        ),
    ],
)
def test_constructor_errors(build, error, match):
    with pytest.raises(error, match=match):
        build(jr.key(0))


def test_flags_take_numpy_bools():
    # As `ChebIIConv(nonnegative=...)` does: a NumPy bool is a bool.
    for flag in (False, True):
        layer = LinearDynamics(3, 5, learn_x0=np.bool_(flag), key=jr.key(0))
        assert layer.learn_x0 is flag
        assert (layer.x0 is not None) == flag


def test_linear_dynamics_call_errors():
    model = LinearDynamics(3, 5, key=jr.key(0))
    with pytest.raises(ValueError, match=r"x0=.*shape \(3,\).*got shape \(4,\)"):
        model(jnp.ones(4))
    with pytest.raises(ValueError, match=r"horizon=.*got 0"):
        model(horizon=0)
    fixed = LinearDynamics(3, 5, learn_x0=False, key=jr.key(0))
    with pytest.raises(ValueError, match=r"x0=.*required.*learn_x0=False.*\(3,\)"):
        fixed()
    with pytest.raises(TypeError, match=r"horizon=.*static"):
        jax.jit(lambda h: model(horizon=h))(4)


def test_state_space_call_errors():
    layer = StateSpaceConv(2, 3, 1, 10, key=jr.key(0))
    with pytest.raises(
        ValueError, match=r"x=.*\(L, 3\).*length=10.*got shape \(11, 3\)"
    ):
        layer(jnp.ones((11, 3)))
    with pytest.raises(ValueError, match=r"x=.*\(L, 3\).*got shape \(10, 2\)"):
        layer(jnp.ones((10, 2)))
    with pytest.raises(ValueError, match=r"x=.*got shape \(2, 10, 3\)"):
        unchecked(layer)(jnp.ones((2, 10, 3)))
    with pytest.raises(ValueError, match=r"length=.*got 0"):
        layer.kernel(0)


def test_graph_conv_call_errors():
    layer = KrylovGraphConv(2, 3, 2, key=jr.key(0))
    a_hat = normalise_adjacency(_ring_adjacency())
    with pytest.raises(ValueError, match=r"H=.*\(N, 2\).*got shape \(6, 3\)"):
        layer(a_hat, jnp.ones((N_NODES, 3)))
    with pytest.raises(
        ValueError,
        match=r"adjacency=.*\(5, 5\).*`H` of shape \(5, 2\).*got shape \(6, 6\)",
    ):
        unchecked(layer)(a_hat, jnp.ones((5, 2)))
    with pytest.raises(ValueError, match=r"normalise_adjacency.*got shape \(2, 3\)"):
        unchecked(normalise_adjacency)(jnp.ones((2, 3)))
