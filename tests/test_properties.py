"""Property-based tests over random sizes, layouts and dtypes."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    ADJOINTS,
    DTYPES,
    LAYOUTS,
    METHODS,
    assert_trees_close,
    iterate_scan_reference,
    krylov_loop,
    krylov_scan_reference,
    random_array,
    random_matrix,
    supported,
    tol,
    x0_shape,
)
from hypothesis import assume, given, settings, strategies as st

import krylovjax

sizes = st.integers(1, 4)
blocks = st.one_of(st.none(), st.integers(1, 3))
depths = st.integers(1, 5)
layouts = st.sampled_from(LAYOUTS)
dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2**16)
adjoints = st.sampled_from(ADJOINTS)


# Every dtype, layout, adjoint and operator kind is tested deterministically
# elsewhere (test_krylov.py, test_doubling.py, test_iterate.py); these draw the sizes.
@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=3, deadline=None)
@given(
    n=sizes,
    b=blocks,
    d=depths,
    layout=layouts,
    dtype=dtypes,
    adjoint=adjoints,
    seed=seeds,
)
def test_krylov_values_and_vjp(method, n, b, d, layout, dtype, adjoint, seed):
    assume(supported(method=method, adjoint=adjoint))
    ka, kx, kc = jr.split(jr.key(seed), 3)
    A = random_matrix(ka, n, dtype)
    x0 = random_array(kx, x0_shape(n, b), dtype)

    def lib(A, x0):
        return krylovjax.krylov(A, x0, d, layout=layout, adjoint=adjoint, method=method)

    def ref(A, x0):
        return krylov_scan_reference(lambda x: A @ x, x0, d, layout)

    out = jax.eval_shape(lib, A, x0)
    expected_shape = (n, d, *x0.shape[1:]) if layout == "columns" else (d, *x0.shape)
    assert out.shape == expected_shape
    assert out.dtype == dtype
    ct = random_array(kc, out.shape, dtype)

    @jax.jit
    def run(A, x0, ct):
        out, vjp = jax.vjp(lib, A, x0)
        _, vjp_ref = jax.vjp(ref, A, x0)
        return out, krylov_loop(lambda x: A @ x, x0, d, layout), vjp(ct), vjp_ref(ct)

    out, expected, grads, grads_ref = run(A, x0, ct)
    assert_trees_close(out, expected, **tol(dtype))
    assert_trees_close(grads, grads_ref, **tol(dtype))


@settings(max_examples=3, deadline=None)
@given(n=sizes, d=depths, dtype=dtypes, adjoint=adjoints, seed=seeds)
def test_iterate_pytree_vjp(n, d, dtype, adjoint, seed):
    kw, kx, ky, kc = jr.split(jr.key(seed), 4)
    w = random_matrix(kw, n, dtype)
    state = {"x": random_array(kx, (n,), dtype), "y": random_array(ky, (2,), dtype)}

    def step(w, s):
        return {"x": jnp.sin(w @ s["x"]) + s["y"][0], "y": jnp.tanh(s["y"] * s["x"][0])}

    def lib(w, s):
        return krylovjax.iterate(lambda t: step(w, t), s, d, adjoint=adjoint)

    def ref(w, s):
        return iterate_scan_reference(lambda t: step(w, t), s, d)

    out = jax.eval_shape(lib, w, state)
    assert out["x"].shape == (d, n) and out["y"].shape == (d, 2)
    kcx, kcy = jr.split(kc)
    ct = {"x": random_array(kcx, (d, n), dtype), "y": random_array(kcy, (d, 2), dtype)}

    @jax.jit
    def vjps(w, s, ct):
        results = []
        for f in (lib, ref):
            out, vjp = jax.vjp(f, w, s)
            results.append((out, vjp(ct)))
        return results

    (out, grads), (out_ref, grads_ref) = vjps(w, state, ct)
    # A complex sine grows like exp(|Im z|): some draws overflow in the plain scan
    # too, and then there is nothing finite to compare with.
    assume(all(np.all(np.isfinite(x)) for x in jax.tree.leaves((out_ref, grads_ref))))
    assert_trees_close(out, out_ref, **tol(dtype))
    assert_trees_close(grads, grads_ref, **tol(dtype))
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
