"""Dtypes and input conversion of the layers in `krylovjax.nn`.

Each layer takes a `dtype=` like `equinox.nn.Linear` and promotes its inputs with it
(`jnp.promote_types`), so integer and boolean inputs give the same output as the
inputs cast to the layer's dtype; inputs that are not arrays of numbers raise errors
naming the layer's own argument. Also: array-likes and other sparse formats for the
graph operator, integer types for `num_hops`, and graphs with no nodes.

Compiling is what the tests spend their time on, and an eager call compiles each of
its operations: but for the errors (raised before anything is computed) and the
eager half of test_graph_conv_on_a_graph_with_no_nodes, the layers are called inside
one jitted function per test, on inputs it closes over (so that each reaches the
layer as it is: a NumPy array, a list, a BCOO matrix); checks of shapes and dtypes
alone are traced (`eqx.filter_eval_shape`), never run.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import numpy_array, unchecked
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


def _make(kind, dtype=None):
    # `dtype=` is passed only when given, so that the tests of the default layer
    # exercise nothing but what they are about.
    kwargs = {"key": jr.key(0)} if dtype is None else {"key": jr.key(0), "dtype": dtype}
    if kind == "linear_dynamics":
        return LinearDynamics(3, 5, learn_x0=False, **kwargs)
    if kind == "state_space":
        return StateSpaceConv(4, 2, 3, 8, dt_min=0.05, dt_max=0.5, **kwargs)
    return KrylovGraphConv(2, 3, 2, **kwargs)


# Every (kind, dtype) that the tests use.
LAYERS = (
    [(kind, None) for kind in KINDS]
    + [(kind, jnp.float32) for kind in KINDS]
    + [("state_space", jnp.float64)]
    + [(kind, jnp.complex128) for kind in ["graph_dense", "graph_bcoo"]]
)


@functools.cache
def _layers():
    # Layers are immutable: each is made once, all by one jitted program (made one
    # at a time, their random initialisations compile a program per shape and
    # dtype), under the 64-bit mode of the first call (see
    # test_default_dtype_follows_64_bit_mode for the other). Called outside the
    # tests' traced functions: inside one, the cached layers would be its tracers.
    return eqx.filter_jit(lambda: [_make(k, dtype) for k, dtype in LAYERS])()


def _layer(kind, dtype=None):
    return _layers()[LAYERS.index((kind, dtype))]


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
    """`BCOO.fromdense(dense)` for a NumPy matrix, built from NumPy's nonzero
    entries: their values in `dense`'s dtype and their indices, in row-major
    order."""
    dense = np.asarray(dense)
    indices = np.argwhere(dense).astype(np.int32)
    return sparse.BCOO((dense[dense != 0], indices), shape=dense.shape)


def _cast(inputs, dtype):
    return {name: np.asarray(value).astype(dtype) for name, value in inputs.items()}


def _tolerance(dtype):
    return 1e-5 if jnp.finfo(dtype).bits == 32 else 1e-12


def _assert_close(case, actual, desired, **tolerance):
    np.testing.assert_allclose(actual, desired, **tolerance, err_msg=str(case))


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
INPUT_CASES = [
    (*case, (np.int32, np.int64, np.bool_)[i % 3]) for i, case in enumerate(CASES)
]


def test_integer_and_boolean_inputs_match_the_cast_input():
    """As with `equinox.nn.Linear`, an integer or boolean input is promoted to the
    layer's dtype: nothing is truncated and nothing raises. For every case of
    `INPUT_CASES` (kind, input, its dtype), the float64 layer's output is float64
    and equals its output for the input cast to float64."""
    calls = []
    for kind, name, input_dtype in INPUT_CASES:
        inputs = _cast(_inputs(kind), np.float64)
        inputs[name] = _inputs(kind)[name].astype(input_dtype)
        calls.append((kind, _layer(kind), inputs, _cast(inputs, np.float64)))

    def run():
        return [
            (_call(kind, layer, inputs), _call(kind, layer, cast))
            for kind, layer, inputs, cast in calls
        ]

    for case, (out, expected) in zip(INPUT_CASES, jax.jit(run)(), strict=True):
        assert out.dtype == jnp.float64, case
        _assert_close(case, out, expected, rtol=1e-12, atol=1e-12)


def test_state_space_integer_input_keeps_the_convolution():
    # The convolution part is not cast away: the output differs from x @ D^T.
    layer = _layer("state_space")
    x = _inputs("state_space")["x"].astype(np.int32)
    out = jax.jit(lambda: layer(x))()
    D = np.asarray(layer.D)
    assert not np.allclose(out, x.astype(D.dtype) @ D.T, atol=1e-3)


def _key_array(shape):
    # Keys made from NumPy data: `jr.split` compiles a program for each shape.
    return jr.wrap_key_data(np.zeros((*np.atleast_1d(shape), 2), np.uint32))


def _batched_bcoo():
    """A `(6, 6)` BCOO matrix of ones with `n_batch=1`, from NumPy arrays."""
    columns = np.broadcast_to(np.arange(6, dtype=np.int32)[None, :, None], (6, 6, 1))
    return sparse.BCOO((np.ones((6, 6)), columns), shape=(6, 6))


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
            lambda: _layer("graph_dense")(_key_array((6, 6)), np.ones((6, 2))),
            TypeError,
            r"`KrylovGraphConv\.__call__\(adjacency=\.\.\.\)` must have a numeric",
        ),
        (
            lambda: unchecked(_layer("graph_dense"))(lambda v: v, np.ones((6, 2))),
            TypeError,
            r"`KrylovGraphConv\.__call__\(adjacency=\.\.\.\)` must be an array of "
            r"numbers.*type function",
        ),
        (
            lambda: _layer("graph_dense")(_batched_bcoo(), np.ones((6, 2))),
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
# in 64-bit mode. The checks of a call are traced on abstract layers and inputs
# (`eqx.filter_eval_shape`): they read shapes alone (the graph filter's weight, of
# 10**7 + 1 entries, and its 10**4 x 10**4 adjacency matrix take seconds to make).
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
            lambda: LinearDynamics(3, HUGE, key=jr.key(0)),
            r"`LinearDynamics\(horizon=\.\.\.\)` (must be at most|is too large)",
        ),
        (
            lambda: LinearDynamics(10**4, 10**7, key=jr.key(0)),
            r"`LinearDynamics\(horizon=\.\.\.\)` is too large: 10000000 stacked "
            r"copies of the state",
        ),
        (
            lambda: eqx.filter_eval_shape(
                lambda: LinearDynamics(3, 4, key=jr.key(0))(horizon=HUGE)
            ),
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


def _widened(layer):
    """`layer` with its floating-point parameters in float64."""
    return jax.tree.map(
        lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, layer
    )


# float32 for every layer (float64, 64-bit mode's default, is what every other test
# uses); float64 given explicitly once.
DTYPE_CASES = [(kind, jnp.float32) for kind in KINDS] + [("state_space", jnp.float64)]


def test_parameters_and_output_have_the_layer_dtype():
    """For every case of `DTYPE_CASES` (kind, dtype), in one program:

    - the parameters and the output for inputs in the dtype have the layer's dtype,
      and the same parameters in float64 give the same output to the dtype's
      accuracy;
    - for a float32 layer, integer inputs (int64 under x64) give float32, equal to
      the output for the inputs cast to float32;
    - for a float32 layer, float64 inputs give float64 (JAX's promotion, as in
      `equinox.nn.Linear`).
    """

    layers = [_layer(kind, dtype=dtype) for kind, dtype in DTYPE_CASES]

    def run():
        out = []
        for (kind, dtype), layer in zip(DTYPE_CASES, layers, strict=True):
            wide = _call(kind, _widened(layer), _cast(_inputs(kind), np.float64))
            float32 = None
            if dtype == jnp.float32:
                float32 = (
                    _call(kind, layer, _inputs(kind)),
                    _call(kind, layer, _cast(_inputs(kind), np.float64)),
                )
            out.append((_call(kind, layer, _cast(_inputs(kind), dtype)), wide, float32))
        return out

    for case, (out, expected, float32) in zip(DTYPE_CASES, jax.jit(run)(), strict=True):
        kind, dtype = case
        layer = _layer(kind, dtype=dtype)
        for path, leaf in jax.tree_util.tree_leaves_with_path(
            eqx.filter(layer, eqx.is_array)
        ):
            assert leaf.dtype == dtype, (case, jax.tree_util.keystr(path))
        assert out.dtype == dtype, case
        tol = _tolerance(dtype)
        _assert_close(case, out, expected, rtol=tol, atol=tol)
        if float32 is not None:
            integer, wider = float32
            assert integer.dtype == jnp.float32, case
            _assert_close(case, integer, out, rtol=1e-6, atol=1e-6)
            assert wider.dtype == jnp.float64, case


@pytest.mark.parametrize("kind", KINDS)
def test_default_dtype_follows_64_bit_mode(kind):
    # `dtype=None` is float64 in 64-bit mode and float32 otherwise, as in
    # eqx.nn.Linear. The layer is made anew (not the cached one), traced: only the
    # dtypes of its parameters are read.
    for x64, dtype in [(True, jnp.float64), (False, jnp.float32)]:
        with jax.enable_x64(x64):
            layer = eqx.filter_eval_shape(_make, kind)
            leaves = [
                leaf
                for leaf in jax.tree_util.tree_leaves(layer)
                if isinstance(leaf, jax.ShapeDtypeStruct)
            ]
            assert {leaf.dtype for leaf in leaves} == {jnp.dtype(dtype)}


def test_complex_linear_dynamics_matches_matrix_powers():
    def run():
        model = LinearDynamics(3, 5, dtype=jnp.complex128, key=jr.key(1))
        return model, model()

    model, out = eqx.filter_jit(run)()
    K, x0 = np.asarray(model.transition), np.asarray(model.x0)
    assert model.transition.dtype == model.x0.dtype == jnp.complex128
    assert np.all(K.imag != 0)
    expected = np.stack([np.linalg.matrix_power(K, t) @ x0 for t in range(5)])
    assert out.dtype == jnp.complex128
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_complex_graph_conv_matches_sum_of_powers():
    """A complex128 graph filter, dense and BCOO adjacency: complex parameters and
    output, the weighted sum of the powers of the adjacency matrix."""
    kinds = ["graph_dense", "graph_bcoo"]
    inputs = _cast(_inputs("graph_dense"), np.float64)
    layers = [_layer(kind, dtype=jnp.complex128) for kind in kinds]
    outs = jax.jit(
        lambda: [
            _call(kind, layer, inputs)
            for kind, layer in zip(kinds, layers, strict=True)
        ]
    )()
    for kind, out in zip(kinds, outs, strict=True):
        layer = _layer(kind, dtype=jnp.complex128)
        assert layer.weight.dtype == layer.bias.dtype == jnp.complex128
        adjacency, H = inputs["adjacency"], inputs["H"]
        blocks = [np.linalg.matrix_power(adjacency, j) @ H for j in range(3)]
        weight, bias = np.asarray(layer.weight), np.asarray(layer.bias)
        expected = np.concatenate(blocks, axis=1) @ weight.T + bias
        assert out.dtype == jnp.complex128, kind
        _assert_close(kind, out, expected, rtol=1e-12, atol=1e-12)


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


def test_state_space_half_precision_input_is_promoted():
    """float16 and bfloat16 inputs to the float64 layer give float64, its output
    for the input cast to float64."""
    layer = _layer("state_space")
    dtypes = [jnp.float16, jnp.bfloat16]
    xs = [np.asarray(_inputs("state_space")["x"] / 4).astype(t) for t in dtypes]

    def run():
        xs_jax = [jnp.asarray(x) for x in xs]  # JAX arrays, made in the program
        return [(layer(x), layer(x.astype(jnp.float64))) for x in xs_jax]

    outs = jax.jit(run)()
    for dtype, (out, expected) in zip(dtypes, outs, strict=True):
        assert out.dtype == jnp.float64, dtype
        _assert_close(dtype, out, expected, rtol=1e-12)


# (input dtype, output dtype)
COMPLEX_CASES = [(jnp.complex64, jnp.complex128), (jnp.complex128, jnp.complex128)]


def test_state_space_complex_input_is_the_linear_map_on_each_part():
    """A complex input to the float64 layer: the output has the promoted dtype and
    is the layer applied to the real and to the imaginary part, for complex64 and
    complex128 (`COMPLEX_CASES`)."""
    layer = _layer("state_space")
    z = numpy_array(1, (8, 2), jnp.complex128)
    xs = [z.astype(input_dtype) for input_dtype, _ in COMPLEX_CASES]

    def run():
        xs_jax = [jnp.asarray(x) for x in xs]  # JAX arrays, made in the program
        return [
            (layer(x), jax.lax.complex(layer(x.real), layer(x.imag))) for x in xs_jax
        ]

    outs = jax.jit(run)()
    for case, (out, expected) in zip(COMPLEX_CASES, outs, strict=True):
        assert out.dtype == case[1], case
        _assert_close(case, out, expected, rtol=1e-10, atol=1e-12)


# --- KrylovGraphConv(num_hops=...) ------------------------------------------------


@pytest.mark.parametrize(
    "num_hops", [np.int64(2), np.int32(2), np.uint8(2), np.array(2), np.int64(0)]
)
def test_num_hops_accepts_any_integer_type(num_hops):
    # Traced, not run: the layer's fields, its weight's shape and its output's.
    layer = eqx.filter_eval_shape(
        lambda: KrylovGraphConv(2, 3, num_hops, key=jr.key(0))
    )
    assert type(layer.num_hops) is int
    assert layer.num_hops == int(num_hops)
    assert layer.weight.shape == (3, 2 * (int(num_hops) + 1))
    H = jax.ShapeDtypeStruct((N_NODES, 2), jnp.float64)
    out = eqx.filter_eval_shape(
        lambda layer, H: layer(normalise_adjacency(_ring()), H), layer, H
    )
    assert out.shape == (N_NODES, 3)


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
    adjacency = _ring() / 3.0
    H = numpy_array(3, (N_NODES, 2), jnp.float64)

    def run():
        return (
            layer(adjacency.tolist(), H),
            layer(adjacency, H),
            normalise_adjacency(_ring().tolist()),
            normalise_adjacency(_ring().astype(np.float64)),
        )

    from_lists, from_array, normalised_lists, normalised = jax.jit(run)()
    np.testing.assert_allclose(from_lists, from_array, rtol=1e-12)
    np.testing.assert_allclose(normalised_lists, normalised, rtol=1e-12)


def test_normalise_boolean_adjacency_with_self_loops():
    # `bool + bool` is a logical or in JAX: the entries must become numbers first,
    # so that a self-loop counts twice on the diagonal, as for the float matrix.
    adjacency = _ring().astype(bool)
    adjacency[1, 1] = True

    def run():
        expected = normalise_adjacency(adjacency.astype(np.float64))
        dense = normalise_adjacency(adjacency)
        return expected, dense, normalise_adjacency(_bcoo(adjacency)).todense()

    expected, *outs = jax.jit(run)()
    for name, dense in zip(["dense", "BCOO"], outs, strict=True):
        assert dense.dtype == jnp.float64, name
        _assert_close(name, dense, expected, rtol=1e-12)


def test_scipy_sparse_adjacency_raises_with_the_conversion():
    scipy_sparse = pytest.importorskip("scipy.sparse")
    layer = _layer("graph_dense")
    matrix = scipy_sparse.csr_matrix(_ring().astype(np.float64))
    H = np.ones((N_NODES, 2))
    hint = r"SciPy sparse matrix.*`jax\.experimental\.sparse\.BCOO\.from_scipy_sparse`"
    with pytest.raises(TypeError, match=r"`KrylovGraphConv\.__call__\(adjacency=.*"):
        unchecked(layer)(matrix, H)
    with pytest.raises(TypeError, match=hint):
        unchecked(layer)(matrix, H)
    with pytest.raises(TypeError, match=r"`normalise_adjacency\(adjacency=.*" + hint):
        unchecked(normalise_adjacency)(matrix)

    # The conversion the message suggests works.
    def run():
        converted = sparse.BCOO.from_scipy_sparse(matrix)
        return layer(converted, H), layer(matrix.toarray(), H)

    converted, dense = jax.jit(run)()
    np.testing.assert_allclose(converted, dense, rtol=1e-12)


def test_bcsr_adjacency_raises_with_the_conversion():
    # The BCSR matrix of the ring, from NumPy: its row pointers, column indices and
    # values.
    ring = _ring().astype(np.float64)
    rows, columns = np.nonzero(ring)
    indptr = np.searchsorted(rows, np.arange(N_NODES + 1)).astype(np.int32)
    matrix = sparse.BCSR(
        (ring[rows, columns], columns.astype(np.int32), indptr), shape=ring.shape
    )
    match = (
        r"adjacency=\.\.\.\)` must be a dense array or a .*BCOO.*got a BCSR.*to_bcoo"
    )
    with pytest.raises(TypeError, match=match):
        unchecked(_layer("graph_dense"))(matrix, np.ones((N_NODES, 2)))
    with pytest.raises(TypeError, match=match):
        unchecked(normalise_adjacency)(matrix)


# --- graphs with no nodes ---------------------------------------------------------


def _empty(kind):
    """The adjacency matrix of a graph with no nodes (a BCOO one stores nothing)."""
    if kind == "graph_bcoo":
        return sparse.BCOO((np.zeros(0), np.zeros((0, 2), np.int32)), shape=(0, 0))
    return jnp.zeros((0, 0))


# Eagerly and under jit: eagerly, every operation of the layer and of its gradient
# runs on its own.
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("kind", ["graph_dense", "graph_bcoo"])
def test_graph_conv_on_a_graph_with_no_nodes(kind, jit):
    layer = _layer(kind)
    adjacency, H = _empty(kind), jnp.zeros((0, 2))

    def loss(layer_and_H):
        layer, H = layer_and_H
        return jnp.sum(layer(adjacency, H) ** 2)

    def both(layer, H):
        grad = eqx.filter_grad(loss)
        return layer(adjacency, H), grad((layer, H))

    out, (grads, grad_H) = (eqx.filter_jit(both) if jit else both)(layer, H)
    assert out.shape == (0, 3)
    assert out.dtype == jnp.float64
    assert grads.weight.shape == layer.weight.shape
    np.testing.assert_array_equal(grads.weight, 0)
    np.testing.assert_array_equal(grads.bias, 0)
    assert grad_H.shape == (0, 2)


def test_graph_conv_adjacency_gradient_on_a_graph_with_no_nodes():
    """The gradient with respect to the adjacency matrix of a graph with no nodes:
    of the dense matrix, `(0, 0)`; of a BCOO matrix's stored values, empty."""
    dense, bcoo = _empty("graph_dense"), _empty("graph_bcoo")
    dense_layer, bcoo_layer = _layer("graph_dense"), _layer("graph_bcoo")

    def run(dense, data):
        H = jnp.zeros((0, 2))

        def from_bcoo(data):
            A = sparse.BCOO((data, bcoo.indices), shape=(0, 0))
            return jnp.sum(bcoo_layer(A, H))

        return (
            jax.grad(lambda a: jnp.sum(dense_layer(a, H)))(dense),
            jax.grad(from_bcoo)(data),
        )

    grad_dense, grad_data = jax.jit(run)(dense, bcoo.data)
    assert grad_dense.shape == (0, 0)
    assert grad_data.shape == bcoo.data.shape


def test_normalise_adjacency_with_no_nodes():
    kinds = ["graph_dense", "graph_bcoo"]
    outs = jax.jit(lambda: [normalise_adjacency(_empty(kind)) for kind in kinds])()
    for kind, out in zip(kinds, outs, strict=True):
        assert isinstance(out, sparse.BCOO) == (kind == "graph_bcoo"), kind
        assert out.shape == (0, 0), kind
