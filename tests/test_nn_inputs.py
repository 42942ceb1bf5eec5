"""Dtypes and input conversion of the layers in `krylovjax.nn`.

Each layer takes a `dtype=` like `equinox.nn.Linear` and promotes its inputs with it
(`jnp.promote_types`), so integer and boolean inputs give the same output as the
inputs cast to the layer's dtype; inputs that are not arrays of numbers raise errors
naming the layer's own argument. Also: array-likes and other sparse formats for the
graph operator, integer types for `num_hops`, and graphs with no nodes.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import unchecked
from jax.experimental import sparse

from krylovjax.nn import (
    KrylovGraphConv,
    LinearDynamics,
    StateSpaceConv,
    normalise_adjacency,
)

N_NODES = 6
KINDS = ["linear_dynamics", "state_space", "graph_dense", "graph_bcoo"]


def _ring(n=N_NODES):
    """A 0/1 integer adjacency matrix: a ring with one chord."""
    ring = np.roll(np.eye(n, dtype=np.int32), 1, axis=1)
    adjacency = ring + ring.T
    adjacency[0, 3] = adjacency[3, 0] = 1
    return adjacency


@functools.cache
def _layer(kind, dtype=None):
    # `dtype=` is passed only when given, so that the tests of the default layer
    # exercise nothing but what they are about. Layers are immutable: each is made
    # once (under the 64-bit mode of its first call; see
    # test_default_dtype_follows_64_bit_mode for the other).
    kwargs = {"key": jr.key(0)} if dtype is None else {"key": jr.key(0), "dtype": dtype}
    if kind == "linear_dynamics":
        return LinearDynamics(3, 5, learn_x0=False, **kwargs)
    if kind == "state_space":
        return StateSpaceConv(4, 2, 3, 8, dt_min=0.05, dt_max=0.5, **kwargs)
    return KrylovGraphConv(2, 3, 2, **kwargs)


def _inputs(kind):
    """Integer-valued NumPy inputs for one call: a dict of argument -> array."""
    if kind == "linear_dynamics":
        return {"x0": np.array([1, -2, 3])}
    if kind == "state_space":
        return {"x": np.arange(16).reshape(8, 2) % 5 - 2}
    return {"adjacency": _ring(), "H": np.arange(12).reshape(N_NODES, 2) % 3 - 1}


def _call(kind, layer, inputs):
    """Call `layer` on `inputs`; a graph_bcoo adjacency is made BCOO first."""
    inputs = dict(inputs)
    if kind == "graph_bcoo":
        inputs["adjacency"] = _bcoo(inputs["adjacency"])
    return layer(**inputs)


def _bcoo(dense):
    # `BCOO.fromdense` compares the matrix with a Python 0, a promotion that strict
    # mode (conftest.py) refuses for a boolean matrix: JAX's, not krylovjax's.
    with jax.numpy_dtype_promotion("standard"):
        return sparse.BCOO.fromdense(jnp.asarray(dense))


def _cast(inputs, dtype):
    return {name: np.asarray(value).astype(dtype) for name, value in inputs.items()}


def _tolerance(dtype):
    return 1e-5 if jnp.finfo(dtype).bits == 32 else 1e-12


# --- integer and boolean inputs --------------------------------------------------


CASES = [
    ("linear_dynamics", "x0"),
    ("state_space", "x"),
    ("graph_dense", "H"),
    ("graph_dense", "adjacency"),
    ("graph_bcoo", "H"),
    ("graph_bcoo", "adjacency"),
]


# Every input of every layer once, the integer and boolean dtypes in turn.
@pytest.mark.parametrize(
    ("kind", "name", "input_dtype"),
    [(*case, (np.int32, np.int64, np.bool_)[i % 3]) for i, case in enumerate(CASES)],
)
def test_integer_and_boolean_inputs_match_the_cast_input(kind, name, input_dtype):
    # As with `equinox.nn.Linear`, an integer or boolean input is promoted to the
    # layer's dtype: nothing is truncated and nothing raises.
    layer = _layer(kind)  # float64: conftest.py enables 64-bit mode
    inputs = _cast(_inputs(kind), np.float64)
    inputs[name] = _inputs(kind)[name].astype(input_dtype)
    expected = _call(kind, layer, _cast(inputs, np.float64))
    out = _call(kind, layer, inputs)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_state_space_integer_input_keeps_the_convolution():
    # The convolution part is not cast away: the output differs from x @ D^T.
    layer = _layer("state_space")
    x = _inputs("state_space")["x"].astype(np.int32)
    out = layer(x)
    assert not np.allclose(out, x.astype(layer.D.dtype) @ layer.D.T, atol=1e-3)


def _key_array(shape):
    return jr.split(jr.key(0), shape)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: _layer("linear_dynamics")(_key_array(3)),
            TypeError,
            r"`LinearDynamics\.__call__\(x0=\.\.\.\)` must have a numeric .*got dtype "
            r"key",
        ),
        (
            lambda: unchecked(_layer("linear_dynamics"))("abc"),
            TypeError,
            r"`LinearDynamics\.__call__\(x0=\.\.\.\)` must be an array of numbers.*"
            r"type str",
        ),
        (
            lambda: _layer("state_space")(_key_array((8, 2))),
            TypeError,
            r"`StateSpaceConv\.__call__\(x=\.\.\.\)` must have a numeric",
        ),
        (
            lambda: _layer("state_space")([[None, None]]),
            TypeError,
            r"`StateSpaceConv\.__call__\(x=\.\.\.\)` must be an array of numbers",
        ),
        (
            lambda: _layer("graph_dense")(_ring(), _key_array((N_NODES, 2))),
            TypeError,
            r"`KrylovGraphConv\.__call__\(H=\.\.\.\)` must have a numeric",
        ),
        (
            lambda: _layer("graph_dense")(_key_array((6, 6)), jnp.ones((6, 2))),
            TypeError,
            r"`KrylovGraphConv\.__call__\(adjacency=\.\.\.\)` must have a numeric",
        ),
        (
            lambda: unchecked(_layer("graph_dense"))(lambda v: v, jnp.ones((6, 2))),
            TypeError,
            r"`KrylovGraphConv\.__call__\(adjacency=\.\.\.\)` must be an array of "
            r"numbers.*type function",
        ),
        (
            lambda: _layer("graph_dense")(
                sparse.BCOO.fromdense(jnp.ones((6, 6)), n_batch=1), jnp.ones((6, 2))
            ),
            ValueError,
            r"`KrylovGraphConv\.__call__\(adjacency=\.\.\.\)` must be a BCOO matrix "
            r"with n_batch=0 and n_dense=0; got n_batch=1",
        ),
        (
            lambda: unchecked(normalise_adjacency)(object()),
            TypeError,
            r"`normalise_adjacency\(adjacency=\.\.\.\)` must be an array of numbers",
        ),
    ],
)
def test_bad_inputs_name_the_layer_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


# Sizes too large to allocate or to index: a ValueError naming the layer's own
# argument, before anything is allocated (JAX allocates asynchronously, so a weight
# too large failed only when first used, with an out-of-memory error). A horizon
# beyond the step counter's range is caught first in 32-bit mode, the memory bound
# in 64-bit mode.
HUGE = 10**15


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: KrylovGraphConv(3, 4, HUGE, key=jr.key(0)),
            r"`KrylovGraphConv\(in_features=\.\.\., out_features=\.\.\., "
            r"num_hops=\.\.\.\)` is too large: the weight of shape "
            r"\(4, 3000000000000003\)",
        ),
        (
            lambda: KrylovGraphConv(1, 1, 10**7, key=jr.key(0))(
                jnp.eye(10**4), jnp.ones((10**4, 1))
            ),
            r"`KrylovGraphConv\(num_hops=\.\.\.\)` is too large: 10000001 stacked "
            r"copies of the node features `H`",
        ),
        (
            lambda: LinearDynamics(3, HUGE, key=jr.key(0)),
            r"`LinearDynamics\(horizon=\.\.\.\)` (must be at most|is too large)",
        ),
        (
            lambda: LinearDynamics(10**4, 10**7, key=jr.key(0)),
            r"`LinearDynamics\(horizon=\.\.\.\)` is too large: 10000000 stacked "
            r"copies of the state",
        ),
        (
            lambda: LinearDynamics(3, 4, key=jr.key(0))(horizon=HUGE),
            r"`LinearDynamics\.__call__\(horizon=\.\.\.\)` (must be at most|is too "
            r"large)",
        ),
        (
            lambda: LinearDynamics(10**9, 4, key=jr.key(0)),
            r"`LinearDynamics\(state_size=\.\.\.\)` is too large: the matrix",
        ),
    ],
)
def test_sizes_too_large_name_the_layer_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- the layer's dtype ----------------------------------------------------------


# float32 for every layer (float64, 64-bit mode's default, is what every other test
# uses); float64 given explicitly once.
@pytest.mark.parametrize(
    "kind, dtype",
    [(kind, jnp.float32) for kind in KINDS] + [("state_space", jnp.float64)],
)
def test_parameters_and_output_have_the_layer_dtype(kind, dtype):
    layer = _layer(kind, dtype=dtype)
    for path, leaf in jax.tree_util.tree_leaves_with_path(
        eqx.filter(layer, eqx.is_array)
    ):
        assert leaf.dtype == dtype, jax.tree_util.keystr(path)
    out = _call(kind, layer, _cast(_inputs(kind), dtype))
    assert out.dtype == dtype
    # The same parameters in float64 give the same output, to the dtype's accuracy.
    wide = jax.tree.map(
        lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, layer
    )
    expected = _call(kind, wide, _cast(_inputs(kind), np.float64))
    tol = _tolerance(dtype)
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", KINDS)
def test_integer_input_to_a_float32_layer_gives_float32(kind):
    layer = _layer(kind, dtype=jnp.float32)
    out = _call(kind, layer, _inputs(kind))  # int64 inputs under x64
    assert out.dtype == jnp.float32
    expected = _call(kind, layer, _cast(_inputs(kind), np.float32))
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_wider_input_promotes_a_float32_layer(kind):
    # JAX's promotion, as in `equinox.nn.Linear`: float64 input, float64 output.
    layer = _layer(kind, dtype=jnp.float32)
    out = _call(kind, layer, _cast(_inputs(kind), np.float64))
    assert out.dtype == jnp.float64


@pytest.mark.parametrize("kind", KINDS)
def test_default_dtype_follows_64_bit_mode(kind):
    # `dtype=None` is float64 in 64-bit mode and float32 otherwise, as in eqx.nn.Linear.
    for x64, dtype in [(True, jnp.float64), (False, jnp.float32)]:
        with jax.enable_x64(x64):
            layer = _layer.__wrapped__(kind)  # made anew, not the cached layer
            leaves = jax.tree_util.tree_leaves(eqx.filter(layer, eqx.is_array))
            assert {leaf.dtype for leaf in leaves} == {jnp.dtype(dtype)}


def test_complex_linear_dynamics_matches_matrix_powers():
    model = LinearDynamics(3, 5, dtype=jnp.complex128, key=jr.key(1))
    K, x0 = model.transition, model.x0
    assert K.dtype == x0.dtype == jnp.complex128
    assert jnp.all(K.imag != 0)
    expected = jnp.stack([jnp.linalg.matrix_power(K, t) @ x0 for t in range(5)])
    out = model()
    assert out.dtype == jnp.complex128
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["graph_dense", "graph_bcoo"])
def test_complex_graph_conv_matches_sum_of_powers(kind):
    layer = _layer(kind, dtype=jnp.complex128)
    assert layer.weight.dtype == layer.bias.dtype == jnp.complex128
    inputs = _cast(_inputs(kind), np.float64)
    adjacency, H = inputs["adjacency"], inputs["H"]
    blocks = [np.linalg.matrix_power(adjacency, j) @ H for j in range(3)]
    weight, bias = np.asarray(layer.weight), np.asarray(layer.bias)
    expected = np.concatenate(blocks, axis=1) @ weight.T + bias
    out = _call(kind, layer, inputs)
    assert out.dtype == jnp.complex128
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda k: LinearDynamics(3, 5, dtype=jnp.int32, key=k),
            r"`LinearDynamics\(dtype=\.\.\.\)` must be a floating-point or complex "
            r"dtype or None; got dtype int32",
        ),
        (
            lambda k: KrylovGraphConv(2, 3, 1, dtype=jnp.bool_, key=k),
            r"`KrylovGraphConv\(dtype=\.\.\.\)` must be .*got dtype bool",
        ),
        (
            lambda k: KrylovGraphConv(2, 3, 1, dtype="not a dtype", key=k),
            r"`KrylovGraphConv\(dtype=\.\.\.\)` must be .*got 'not a dtype'",
        ),
        (
            lambda k: StateSpaceConv(2, 1, 1, 5, dtype=jnp.complex64, key=k),
            r"`StateSpaceConv\(dtype=\.\.\.\)` must be a real floating-point dtype "
            r"or None; got dtype complex64",
        ),
        (
            lambda k: StateSpaceConv(2, 1, 1, 5, dtype=jnp.float16, key=k),
            r"`StateSpaceConv\(dtype=\.\.\.\)` must be float32 or float64.*FFT.*got "
            r"dtype float16",
        ),
    ],
)
def test_dtype_errors(build, match):
    with pytest.raises(TypeError, match=match):
        build(jr.key(0))


# --- StateSpaceConv: half-precision and complex inputs ---------------------------


@pytest.mark.parametrize("input_dtype", [jnp.float16, jnp.bfloat16])
def test_state_space_half_precision_input_is_promoted(input_dtype):
    layer = _layer("state_space")
    x = jnp.asarray(_inputs("state_space")["x"] / 4, dtype=input_dtype)
    out = layer(x)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, layer(x.astype(jnp.float64)), rtol=1e-12)


@pytest.mark.parametrize(
    ("input_dtype", "out_dtype"),
    [(jnp.complex64, jnp.complex128), (jnp.complex128, jnp.complex128)],
)
def test_state_space_complex_input_is_the_linear_map_on_each_part(
    input_dtype, out_dtype
):
    layer = _layer("state_space")
    re = jr.normal(jr.key(1), (8, 2))
    im = jr.normal(jr.key(2), (8, 2))
    x = jax.lax.complex(re, im).astype(input_dtype)
    out = layer(x)
    assert out.dtype == out_dtype
    expected = jax.lax.complex(layer(x.real), layer(x.imag))
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-12)


# --- KrylovGraphConv(num_hops=...) ------------------------------------------------


@pytest.mark.parametrize(
    "num_hops", [np.int64(2), np.int32(2), np.uint8(2), np.array(2), np.int64(0)]
)
def test_num_hops_accepts_any_integer_type(num_hops):
    layer = KrylovGraphConv(2, 3, num_hops, key=jr.key(0))
    assert type(layer.num_hops) is int
    assert layer.num_hops == int(num_hops)
    assert layer.weight.shape == (3, 2 * (int(num_hops) + 1))
    H = jnp.ones((N_NODES, 2))
    assert layer(normalise_adjacency(_ring()), H).shape == (N_NODES, 3)


@pytest.mark.parametrize("num_hops", [True, np.bool_(True), 2.0, np.float64(2.0)])
def test_num_hops_rejects_bool_and_non_integers(num_hops):
    # `True` is an `int` to the annotation (bool subclasses int); the others lie
    # outside it.
    build = KrylovGraphConv if num_hops is True else unchecked(KrylovGraphConv)
    with pytest.raises(TypeError, match=r"`KrylovGraphConv\(num_hops=\.\.\.\)`"):
        build(2, 3, num_hops, key=jr.key(0))


# --- array-likes and sparse formats for the graph operator --------------------------


def test_adjacency_as_nested_lists():
    layer = _layer("graph_dense")
    adjacency = normalise_adjacency(_ring().astype(np.float64))
    H = jr.normal(jr.key(3), (N_NODES, 2))
    np.testing.assert_allclose(
        layer(adjacency.tolist(), H), layer(adjacency, H), rtol=1e-12
    )
    np.testing.assert_allclose(
        normalise_adjacency(_ring().tolist()),
        normalise_adjacency(_ring().astype(np.float64)),
        rtol=1e-12,
    )


def test_normalise_boolean_adjacency_with_self_loops():
    # `bool + bool` is a logical or in JAX: the entries must become numbers first,
    # so that a self-loop counts twice on the diagonal, as for the float matrix.
    adjacency = _ring().astype(bool)
    adjacency[1, 1] = True
    expected = normalise_adjacency(adjacency.astype(np.float64))
    for matrix in [adjacency, _bcoo(adjacency)]:
        out = normalise_adjacency(matrix)
        dense = out.todense() if isinstance(out, sparse.BCOO) else out
        assert dense.dtype == jnp.float64
        np.testing.assert_allclose(dense, expected, rtol=1e-12)


def test_scipy_sparse_adjacency_raises_with_the_conversion():
    scipy_sparse = pytest.importorskip("scipy.sparse")
    layer = _layer("graph_dense")
    matrix = scipy_sparse.csr_matrix(_ring().astype(np.float64))
    H = jnp.ones((N_NODES, 2))
    hint = r"SciPy sparse matrix.*`jax\.experimental\.sparse\.BCOO\.from_scipy_sparse`"
    with pytest.raises(TypeError, match=r"`KrylovGraphConv\.__call__\(adjacency=.*"):
        unchecked(layer)(matrix, H)
    with pytest.raises(TypeError, match=hint):
        unchecked(layer)(matrix, H)
    with pytest.raises(TypeError, match=r"`normalise_adjacency\(adjacency=.*" + hint):
        unchecked(normalise_adjacency)(matrix)
    # The conversion the message suggests works.
    converted = sparse.BCOO.from_scipy_sparse(matrix)
    np.testing.assert_allclose(
        layer(converted, H), layer(matrix.toarray(), H), rtol=1e-12
    )


def test_bcsr_adjacency_raises_with_the_conversion():
    matrix = sparse.BCSR.fromdense(jnp.asarray(_ring(), dtype=jnp.float64))
    match = (
        r"adjacency=\.\.\.\)` must be a dense array or a .*BCOO.*got a BCSR.*to_bcoo"
    )
    with pytest.raises(TypeError, match=match):
        unchecked(_layer("graph_dense"))(matrix, jnp.ones((N_NODES, 2)))
    with pytest.raises(TypeError, match=match):
        unchecked(normalise_adjacency)(matrix)


# --- graphs with no nodes ---------------------------------------------------------


def _empty(kind):
    adjacency = jnp.zeros((0, 0))
    return sparse.BCOO.fromdense(adjacency) if kind == "graph_bcoo" else adjacency


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("kind", ["graph_dense", "graph_bcoo"])
def test_graph_conv_on_a_graph_with_no_nodes(kind, jit):
    layer = _layer(kind)
    adjacency, H = _empty(kind), jnp.zeros((0, 2))

    def loss(layer_and_H):
        layer, H = layer_and_H
        return jnp.sum(layer(adjacency, H) ** 2)

    apply = eqx.filter_jit(layer.__call__) if jit else layer
    out = apply(adjacency, H)
    assert out.shape == (0, 3)
    assert out.dtype == jnp.float64
    grad = eqx.filter_grad(loss)
    grads, grad_H = (eqx.filter_jit(grad) if jit else grad)((layer, H))
    assert grads.weight.shape == layer.weight.shape
    np.testing.assert_array_equal(grads.weight, 0)
    np.testing.assert_array_equal(grads.bias, 0)
    assert grad_H.shape == (0, 2)


@pytest.mark.parametrize("kind", ["graph_dense", "graph_bcoo"])
def test_graph_conv_adjacency_gradient_on_a_graph_with_no_nodes(kind):
    layer, H = _layer(kind), jnp.zeros((0, 2))
    adjacency = _empty(kind)
    if kind == "graph_bcoo":
        grad = jax.grad(
            lambda data: jnp.sum(
                layer(sparse.BCOO((data, adjacency.indices), shape=(0, 0)), H)
            )
        )(adjacency.data)
        assert grad.shape == adjacency.data.shape
    else:
        grad = jax.grad(lambda a: jnp.sum(layer(a, H)))(adjacency)
        assert grad.shape == (0, 0)


@pytest.mark.parametrize("kind", ["graph_dense", "graph_bcoo"])
def test_normalise_adjacency_with_no_nodes(kind):
    out = normalise_adjacency(_empty(kind))
    assert isinstance(out, sparse.BCOO) == (kind == "graph_bcoo")
    assert out.shape == (0, 0)
