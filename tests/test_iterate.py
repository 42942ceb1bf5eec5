"""Values, reverse-mode gradients and residual memory of `krylovjax.iterate`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    MLP,
    assert_trees_close,
    iterate_scan_reference,
    random_array,
    random_like,
    random_matrix,
    temp_bytes,
    tol,
    vjps,
)
from jax.test_util import check_grads

import krylovjax

D = 4
ADJOINTS = ("custom_vjp", "custom_jvp")
# Forward mode raises for a custom_vjp (see test_transforms.py).
MODES = {"custom_vjp": ["rev"], "custom_jvp": ["fwd", "rev"]}


class Coupled(eqx.Module):
    """A nonlinear step on a dict state {"x": (3,), "y": (2, 3)}."""

    w: jax.Array
    v: jax.Array

    def __call__(self, state):
        x, y = state["x"], state["y"]
        return {"x": jnp.sin(self.w @ x + y[0]), "y": jnp.tanh(self.v * y * x[None])}


def _coupled(dtype, seed=0):
    kw, kv, kx, ky = jr.split(jr.key(seed), 4)
    step = Coupled(random_matrix(kw, 3, dtype), random_array(kv, (2, 3), dtype))
    state = {
        "x": random_array(kx, (3,), dtype),
        "y": random_array(ky, (2, 3), dtype),
    }
    return step, state


def _python_loop(step, x0, d):
    states = [x0]
    for _ in range(d - 1):
        states.append(step(states[-1]))
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *states)


# ---------------------------------------------------------------------- values


def test_values_tuple_state_closure():
    w = jnp.array([[0.5, -0.2], [0.1, 0.3]])
    step = lambda s: (jnp.tanh(w @ s[0]) + s[1], 0.5 * s[1])  # noqa: E731
    x0 = (jnp.array([1.0, -1.0]), jnp.array([0.2, 0.4]))
    xs = jax.jit(lambda x0: krylovjax.iterate(step, x0, D))(x0)
    assert isinstance(xs, tuple)
    assert_trees_close(xs, _python_loop(step, x0, D), **tol(jnp.float64))


def test_depth_one_returns_x0_with_new_axis():
    step, state = _coupled(jnp.float32)
    xs, grad = jax.jit(
        lambda s: (
            krylovjax.iterate(step, s, 1),
            jax.grad(lambda s: krylovjax.iterate(step, s, 1)["x"].sum())(s),
        )
    )(state)
    assert_trees_close(xs, jax.tree_util.tree_map(lambda x: x[None], state), rtol=0)
    np.testing.assert_array_equal(grad["x"], np.ones(3, np.float32))
    np.testing.assert_array_equal(grad["y"], np.zeros((2, 3), np.float32))


# ------------------------------------------------------------------- gradients


# One single-precision real and one double-precision complex dtype: the rules'
# code is the same for every dtype, these two show rounding and conjugation.
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.complex128])
def test_values_and_vjp_pytree_state_against_scan_autodiff(dtype):
    # Both rules (the default is custom_jvp) against plain autodiff through a scan
    # and through a Python loop, values and VJPs, in one program.
    step, state = _coupled(dtype)
    fs = [
        lambda s, x: krylovjax.iterate(s, x, D),
        lambda s, x: krylovjax.iterate(s, x, D, adjoint="custom_vjp"),
        lambda s, x: iterate_scan_reference(s, x, D),
        lambda s, x: krylovjax.iterate(s, x, D, adjoint="autodiff"),
        lambda s, x: _python_loop(s, x, D),
    ]
    (out, grads), (out_vjp, grads_vjp), (out_ref, grads_ref), *plain = vjps(
        fs, (step, state), jr.key(1)
    )
    assert out["x"].shape == (D, 3) and out["y"].shape == (D, 2, 3)
    assert out["x"].dtype == out_vjp["x"].dtype == dtype
    for other, other_grads in plain:
        assert_trees_close(other, out_ref, **tol(dtype))
        assert_trees_close(other_grads, grads_ref, **tol(dtype))
    assert_trees_close(out, out_ref, **tol(dtype))
    assert_trees_close(out_vjp, out_ref, **tol(dtype))
    assert_trees_close(grads, grads_ref, **tol(dtype))
    assert_trees_close(grads_vjp, grads_ref, **tol(dtype))


@pytest.mark.parametrize("adjoint", ADJOINTS)
def test_vjp_mlp_against_scan_autodiff(adjoint):
    mlp = MLP(jr.key(0), state=3, width=6)
    x0 = random_array(jr.key(1), (3,), jnp.float64)
    fs = [
        lambda m, x: krylovjax.iterate(m, x, D, adjoint=adjoint),
        lambda m, x: iterate_scan_reference(m, x, D),
    ]
    (out, grads), (out_ref, grads_ref) = vjps(fs, (mlp, x0), jr.key(2))
    assert_trees_close(out, out_ref, **tol(jnp.float64))
    assert_trees_close(grads, grads_ref, **tol(jnp.float64))
    for leaf in jax.tree_util.tree_leaves(grads):
        assert np.any(leaf != 0)


# Each rule once, on each kind of step: custom_jvp (forward and reverse) on an MLP,
# custom_vjp (reverse) on a pytree state. First order: second derivatives of every
# rule are checked against autodiff in test_transforms.py (test_iterate_transforms,
# grad of grad; test_iterate_forward_mode, jax.hessian).
@pytest.mark.parametrize("adjoint", ["custom_jvp"])
def test_grads_mlp_finite_differences(adjoint):
    mlp = MLP(jr.key(0), state=3, width=4)
    x0 = random_array(jr.key(1), (3,), jnp.float64)
    f = jax.jit(lambda m, x: krylovjax.iterate(m, x, 3, adjoint=adjoint))
    check_grads(f, (mlp, x0), order=1, modes=MODES[adjoint])


@pytest.mark.parametrize("adjoint", ["custom_vjp"])
def test_grads_pytree_state_finite_differences(adjoint):
    step, state = _coupled(jnp.float64, seed=3)
    f = jax.jit(lambda s, x: krylovjax.iterate(s, x, 3, adjoint=adjoint))
    check_grads(f, (step, state), order=1, modes=MODES[adjoint])


def test_jvp_pytree_state_with_custom_jvp():
    # Tangents of the step's arrays and of every state leaf at once.
    step, state = _coupled(jnp.float64)
    tangents = random_like(jr.key(4), (step, state))

    @jax.jit
    def jvps(args, tangents):
        return [
            jax.jvp(f, args, tangents)
            for f in (
                lambda s, x: krylovjax.iterate(s, x, D, adjoint="custom_jvp"),
                lambda s, x: iterate_scan_reference(s, x, D),
            )
        ]

    (out, t_out), (out_ref, t_ref) = jvps((step, state), tangents)
    assert_trees_close(out, out_ref, **tol(jnp.float64))
    assert_trees_close(t_out, t_ref, **tol(jnp.float64))
    assert all(np.any(t != 0) for t in jax.tree.leaves(t_out))


@pytest.mark.parametrize("adjoint", ADJOINTS)
def test_grads_closure_over_traced_array(adjoint):
    # The step closes over an array created inside the differentiated function.
    x0 = random_array(jr.key(1), (3,), jnp.float64)
    w = random_matrix(jr.key(2), 3, jnp.float64)

    def loss(fn, w, x0):
        return jnp.sum(fn(lambda x: jnp.sin(w @ x), x0, D) ** 2)

    lib = lambda s, x, d: krylovjax.iterate(s, x, d, adjoint=adjoint)  # noqa: E731
    grads, expected = jax.jit(
        lambda w, x: [
            jax.grad(lambda w, x, fn=fn: loss(fn, w, x), (0, 1))(w, x)
            for fn in (lib, iterate_scan_reference)
        ]
    )(w, x0)
    assert_trees_close(grads, expected, **tol(jnp.float64))


@pytest.mark.parametrize("adjoint", ADJOINTS)
def test_only_some_inputs_differentiated(adjoint):
    # Gradient of the step only, and of one state leaf only.
    step, state = _coupled(jnp.float64)

    def loss(fn):
        return lambda s, x: sum(jnp.sum(v**2) for v in jax.tree.leaves(fn(s, x, D)))

    lib = lambda s, x, d: krylovjax.iterate(s, x, d, adjoint=adjoint)  # noqa: E731

    @jax.jit
    def grads(step, state):
        return [
            (jax.grad(loss(f), 0)(step, state), jax.grad(loss(f), 1)(step, state))
            for f in (lib, iterate_scan_reference)
        ]

    assert_trees_close(*grads(step, state), **tol(jnp.float64))


@pytest.mark.parametrize("adjoint", ADJOINTS)
def test_vjp_accepts_numpy_cotangent(adjoint):
    step, state = _coupled(jnp.float64)
    out, vjp = jax.vjp(lambda x: krylovjax.iterate(step, x, D, adjoint=adjoint), state)
    ct = jax.tree.map(np.asarray, random_like(jr.key(0), out))
    _, vjp_ref = jax.vjp(lambda x: iterate_scan_reference(step, x, D), state)
    assert_trees_close(vjp(ct), vjp_ref(ct), **tol(jnp.float64))


# ---------------------------------------------------------------------- memory


def test_custom_rules_save_less_memory_than_autodiff():
    # A wide hidden layer: autodiff through the scan saves every step's hidden
    # activations; the hand-written rules save only the trajectory (custom_jvp:
    # its tangent step is checkpointed, so the transposed scan recomputes each
    # step's linearisation instead of saving it). This is also what shows that
    # each rule runs: a call that fell back to autodiff would keep the hidden
    # layers, and `adjoint="autodiff"` that did not would not.
    state, width, d = 8, 512, 64
    mlp = MLP(jr.key(0), state=state, width=width, dtype=jnp.float32)
    x0 = random_array(jr.key(1), (state,), jnp.float32)

    def grad(adjoint):
        def loss(m, x):
            return jnp.sum(krylovjax.iterate(m, x, d, adjoint=adjoint) ** 2)

        return jax.grad(loss)

    autodiff = temp_bytes(grad("autodiff"), mlp, x0)
    # Autodiff keeps at least (d - 1) hidden layers of `width` float32 values.
    hidden = (d - 1) * width * 4
    assert autodiff >= hidden
    custom = {adjoint: temp_bytes(grad(adjoint), mlp, x0) for adjoint in ADJOINTS}
    for adjoint, temp in custom.items():
        assert temp < hidden / 4, adjoint
        assert 4 * temp < autodiff, adjoint
    # The default's reverse pass (the transpose of its tangent map) recomputes the
    # hidden layers as the custom_vjp does.
    assert custom["custom_jvp"] <= custom["custom_vjp"]
