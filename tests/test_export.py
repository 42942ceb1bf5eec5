"""Tests that every program krylovjax builds can be exported for GPU and TPU.

The README promises CPU, GPU and TPU; this machine has a CPU only. `jax.export`
lowers a jitted function for any platform without its hardware, so each program is
exported for `cuda`, `rocm` and `tpu` and the artifact is checked:

- the export succeeds (it also refuses custom calls that JAX does not guarantee
  stable, such as host callbacks, unless told otherwise);
- `exported.platforms` is the platform asked for;
- the input avals match the arguments, and the output avals and pytree match the
  result the program computes on the CPU (`jax.eval_shape`; the values are
  computed, all in one jitted call, where an artifact runs and is compared with
  them);
- the StableHLO text holds no `custom_call` target that exists only on CPU (LAPACK,
  BLAS, DUCC FFT, CPU callbacks), and every target it does hold is one listed below
  for that platform: none at all for `krylov`, `iterate`, `LinearDynamics` and
  `KrylovGraphConv`; the LU factorisation of `jnp.linalg.solve` in
  `StateSpaceConv.discretise` (cuSOLVER, hipSOLVER or the TPU's `LuDecomposition`;
  its FFT is the native `stablehlo.fft` op, not a custom call);
- the float32 programs hold no float64 type (TPUs have no float64 arithmetic), even
  though `conftest.py` enables 64-bit mode.

Coverage. For `cuda`: `krylov` with `method="scan"` and each adjoint (`None`,
`"custom_jvp"`, `"custom_vjp"`, `"autodiff"`), and with `method="doubling"` and
`None`, `"custom_vjp"` and `"autodiff"`, each under every transform it has (forward,
`jax.grad` of a scalar loss with respect to the operator's arrays and `x0`, and
`jax.jvp` where the adjoint has forward mode), with the operator kinds (dense, BCOO,
closure, `equinox.Module`, bound method) and a vector or block `x0` in turn, so that
each method also meets every kind with a vector and with a block (what a program
holds depends on each of these, not on their combination). `iterate` with each
adjoint, forward, grad and (but for `"custom_vjp"`) jvp. The three layers of
`krylovjax.nn` (`KrylovGraphConv` with a dense and a BCOO adjacency), forward and
`equinox.filter_grad` of a loss. The matrix functions and readouts: the gradient
of `trace_funm` (also in batches), `funm_action` with `tol`, `krylov_readout` and
`polynomial_action` (Chebyshev), and `spectrum_interval` by Lanczos; those that
solve small eigenproblems may hold the platform's symmetric eigensolver (cuSOLVER's
or hipSOLVER's `syevd`, the TPU's `Eigh`) and nothing else. For `rocm` and `tpu`:
a representative subset
(`SUBSET`) that covers every method, adjoint, operator family, block layout and
transform at least once, each of `iterate`'s adjoints, the gradient of each
layer, and `trace_funm` and `funm_action` with `tol`.

Also: controls that the checks can fail (exporting for `cpu` gives LAPACK targets, a
float64 program shows float64 types); one artifact lowered for all four platforms at
once, holding each platform's lowering and run on the CPU against the direct result;
and, skipped where they cannot run, the accelerator artifacts run on their own
hardware and a `serialize` / `deserialize` round trip (which needs `flatbuffers`, not
a test dependency).
"""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    assert_trees_close,
    make_operator,
    scalar_loss,
    sparse_mask,
    supported,
    x0_shape,
)
from jax import export
from jax.experimental import sparse

import krylovjax
from krylovjax.nn import (
    KrylovGraphConv,
    LinearDynamics,
    StateSpaceConv,
)

N = 3
D = 5
BLOCK = 2
DTYPE = jnp.float32
ACCELERATORS = ("cuda", "rocm", "tpu")
KINDS = ("dense", "bcoo", "closure", "module", "method")
KRYLOV_ADJOINTS = (None, "custom_jvp", "custom_vjp", "autodiff")

# The custom-call targets each platform may show, per family of program.
NO_TARGETS = {"cuda": set(), "rocm": set(), "tpu": set()}
LU_TARGETS = {
    "cuda": {"cusolver_getrf_ffi", "cu_lu_pivots_to_permutation"},
    "rocm": {"hipsolver_getrf_ffi", "hip_lu_pivots_to_permutation"},
    "tpu": {"LuDecomposition"},
}
# The symmetric eigensolver of the small matrices of Lanczos quadrature.
EIGH_TARGETS = {
    "cuda": {"cusolver_syevd_ffi"},
    "rocm": {"hipsolver_syevd_ffi"},
    "tpu": {"Eigh"},
}
# Names of custom calls that exist only in the CPU runtime.
CPU_SPECIFIC = re.compile(
    r"lapack|cpu|ducc|pocketfft|mkl|onednn|eigen|^blas|cblas|openblas", re.IGNORECASE
)
_TARGET_PATTERNS = (
    re.compile(r"stablehlo\.custom_call\s+@([\w.$-]+)"),
    re.compile(r'call_target_name\s*=\s*"([^"]+)"'),
)
# A float64 tensor or complex type: `tensor<f64>`, `tensor<3x5xf64>`, `complex<f64>`.
_F64 = re.compile(r"(?:\dx|<)f64>")


def custom_call_targets(module_text):
    """The set of `custom_call` target names in a StableHLO module's text."""
    return {m for p in _TARGET_PATTERNS for m in p.findall(module_text)}


# ------------------------------------------------------------------- programs


def _normal(seed, shape):
    # NumPy, not `jax.random`: eager JAX calls would compile one small program each.
    return np.random.default_rng(seed).standard_normal(shape).astype(DTYPE)


def _normal_like(seed, tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    new = [jnp.asarray(_normal(seed + i, x.shape)) for i, x in enumerate(leaves)]
    return jax.tree_util.tree_unflatten(treedef, new)


@functools.cache
def _krylov_inputs(kind, block):
    """`(build, (params, x0), tangents)`: `build(params)` is an operator of `kind`."""
    A = _normal(0, (N, N)) * np.float32(0.9 / np.sqrt(N))
    if kind == "bcoo":
        indices = np.argwhere(sparse_mask(N)).astype(np.int32)
        params = jnp.asarray(A[tuple(indices.T)])

        def build(data):
            return sparse.BCOO((data, jnp.asarray(indices)), shape=(N, N))

    else:
        # The callable kinds from `helpers.make_operator`; their construction
        # performs no JAX computation.
        params, build = make_operator(kind, jnp.asarray(A))
    x0 = jnp.asarray(_normal(1, x0_shape(N, block)))
    return build, (params, x0), _normal_like(2, (params, x0))


def _krylov_program(method, adjoint, kind, block, transform):
    build, args, tangents = _krylov_inputs(kind, block)

    def forward(params, x0):
        return krylovjax.krylov(build(params), x0, D, method=method, adjoint=adjoint)

    return _transformed(forward, args, tangents, transform)


class _Step(eqx.Module):
    """x -> tanh(W x + b): a nonlinear step with two parameter leaves."""

    weight: jax.Array
    bias: jax.Array

    def __call__(self, x):
        return jnp.tanh(self.weight @ x + self.bias)


@functools.cache
def _iterate_inputs():
    step = _Step(jnp.asarray(_normal(3, (N, N))), jnp.asarray(_normal(4, (N,))))
    args = (step, jnp.asarray(_normal(5, (N,))))
    return args, _normal_like(6, args)


def _iterate_program(adjoint, transform):
    args, tangents = _iterate_inputs()

    def forward(step, x0):
        return krylovjax.iterate(step, x0, D, adjoint=adjoint)

    return _transformed(forward, args, tangents, transform)


def _transformed(forward, args, tangents, transform):
    if transform == "forward":
        return forward, args
    if transform == "grad":
        argnums = tuple(range(len(args)))
        return jax.grad(lambda *a: scalar_loss(forward(*a)), argnums), args
    if transform == "jvp":
        k = len(args)

        def jvp(*primals_and_tangents):
            primals, tangents = primals_and_tangents[:k], primals_and_tangents[k:]
            return jax.jvp(forward, primals, tangents)

        return jvp, (*args, *tangents)
    raise ValueError(transform)


_KEY = jr.key(0)


def _ring_adjacency(n=5):
    """A normalised ring with self-loops, as `normalise_adjacency` gives, in NumPy."""
    ring = np.roll(np.eye(n, dtype=np.float32), 1, axis=1)
    with_loops = ring + ring.T + np.eye(n, dtype=np.float32)
    degree = with_loops.sum(axis=1)
    return with_loops / np.sqrt(np.outer(degree, degree))


def _filled(seed, shapes):
    """A pytree of small random NumPy-made arrays with the given shapes and dtypes."""
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    new = [
        jnp.asarray((0.3 * _normal(seed + i, x.shape)).astype(x.dtype))
        for i, x in enumerate(leaves)
    ]
    return jax.tree_util.tree_unflatten(treedef, new)


@functools.cache
def _layer_inputs(layer):
    """`(model, inputs)`. The layer's structure comes from `filter_eval_shape` and
    its values from NumPy: initialising it eagerly would compile many small
    programs, and the values matter here only for the CPU comparison."""
    if layer == "linear_dynamics":
        shapes = eqx.filter_eval_shape(LinearDynamics, N, D, dtype=DTYPE, key=_KEY)
        return _filled(10, shapes), ()
    if layer == "state_space":
        shapes = eqx.filter_eval_shape(
            StateSpaceConv, 4, 2, 3, D, dtype=DTYPE, key=_KEY
        )
        return _filled(20, shapes), (jnp.asarray(_normal(30, (D, 2))),)
    if layer in ("graph_dense", "graph_bcoo"):
        shapes = eqx.filter_eval_shape(KrylovGraphConv, 2, 3, 2, dtype=DTYPE, key=_KEY)
        adjacency = _ring_adjacency()
        if layer == "graph_bcoo":
            indices = np.argwhere(adjacency != 0).astype(np.int32)
            adjacency = sparse.BCOO(
                (jnp.asarray(adjacency[tuple(indices.T)]), jnp.asarray(indices)),
                shape=adjacency.shape,
            )
        else:
            adjacency = jnp.asarray(adjacency)
        features = jnp.asarray(_normal(40, (adjacency.shape[0], 2)))
        return _filled(50, shapes), (adjacency, features)
    raise ValueError(layer)


def _layer_program(layer, transform):
    model, inputs = _layer_inputs(layer)

    def forward(model, *inputs):
        return model(*inputs)

    if transform == "forward":
        return forward, (model, *inputs)
    if transform == "grad":
        grad = eqx.filter_grad(lambda m, *a: scalar_loss(forward(m, *a)))
        # `filter_grad`'s wrapper is not hashable: wrap it for `jax.jit`.
        return (lambda m, *a: grad(m, *a)), (model, *inputs)
    raise ValueError(transform)


# The matrix functions, readouts and the spectrum interval, on a float32 SPD matrix
# of size FUNCTION_N: the gradient of a scalar of each (the interval: its value).
FUNCTION_N = 6
FUNCTIONS = {
    "trace_funm": lambda A: krylovjax.trace_funm(
        jnp.log, A, jr.key(0), 3, num_probes=4
    ),
    "trace_funm_batches": lambda A: krylovjax.trace_funm(
        jnp.log, A, jr.key(0), 3, num_probes=5, probes_per_batch=2, sampler="normal"
    ),
    "funm_action_tol": lambda A: scalar_loss(
        krylovjax.funm_action(
            jnp.exp, A, jnp.ones(FUNCTION_N, DTYPE), 4, method="lanczos", tol=1e-4
        )
    ),
    "krylov_readout": lambda A: scalar_loss(
        krylovjax.krylov_readout(
            A, jnp.ones(FUNCTION_N, DTYPE), 5, jnp.ones((2, FUNCTION_N), DTYPE)
        )
    ),
    "polynomial_action": lambda A: scalar_loss(
        krylovjax.polynomial_action(
            A,
            jnp.ones(FUNCTION_N, DTYPE),
            jnp.ones(5, DTYPE),
            basis=krylovjax.Chebyshev(),
        )
    ),
    "spectrum_interval": lambda A: krylovjax.spectrum_interval(
        A, method="lanczos", key=jr.key(0), d=3
    ),
}
# Those that hold an eigensolver (the others hold no custom call).
EIGH_FUNCTIONS = (
    "trace_funm",
    "trace_funm_batches",
    "funm_action_tol",
    "spectrum_interval",
)


def _function_program(name, transform):
    n = FUNCTION_N
    A = jnp.asarray(np.eye(n) * 2 + np.full((n, n), 0.1), DTYPE)
    fn = FUNCTIONS[name]
    return (fn if transform == "forward" else jax.grad(fn)), (A,)


# -------------------------------------------------------------------- cases


def _krylov_transforms(method, adjoint):
    # Forward mode needs a JVP rule: the scan's default is custom_jvp, doubling's
    # default a custom_vjp.
    forward_mode = adjoint in ("custom_jvp", "autodiff") or (
        adjoint is None and method == "scan"
    )
    return ("forward", "grad", "jvp") if forward_mode else ("forward", "grad")


def _krylov_cases():
    """For each method: every (adjoint, transform) and every (kind, block) once, the
    two lists zipped in turn (the shorter one starts again); and two more."""
    kinds = [(kind, block) for block in (None, BLOCK) for kind in KINDS]
    cases = []
    for method in ("scan", "doubling"):
        rules = [
            (adjoint, transform)
            for adjoint in KRYLOV_ADJOINTS
            if supported(method, "dense", "custom_vjp" if adjoint is None else adjoint)
            for transform in _krylov_transforms(method, adjoint)
        ]
        for i in range(max(len(rules), len(kinds))):
            adjoint, transform = rules[i % len(rules)]
            kind, block = kinds[i % len(kinds)]
            cases.append(("krylov", method, adjoint, kind, block, transform))
    # Plus the commonest programs: the default's gradient for a block, dense and BCOO.
    for kind in ("dense", "bcoo"):
        cases.append(("krylov", "scan", None, kind, BLOCK, "grad"))
    return cases


def _iterate_cases():
    return [
        ("iterate", adjoint, transform)
        for adjoint in ("custom_jvp", "custom_vjp", "autodiff")
        for transform in ("forward", "grad", "jvp")
        if not (adjoint == "custom_vjp" and transform == "jvp")
    ]


LAYERS = ("linear_dynamics", "state_space", "graph_dense", "graph_bcoo")


def _layer_cases():
    return [("layer", layer, t) for layer in LAYERS for t in ("forward", "grad")]


def _function_cases():
    return [
        ("function", name, "forward" if name == "spectrum_interval" else "grad")
        for name in FUNCTIONS
    ]


ALL_CASES = _krylov_cases() + _iterate_cases() + _layer_cases() + _function_cases()

# What `rocm` and `tpu` are checked on: each method and adjoint, each operator
# family (dense, BCOO, callable), vector and block, every transform, each of
# `iterate`'s adjoints and the gradient of each layer.
SUBSET = [
    ("krylov", "scan", None, "dense", None, "forward"),
    ("krylov", "scan", None, "bcoo", None, "grad"),
    ("krylov", "scan", "custom_jvp", "dense", BLOCK, "jvp"),
    ("krylov", "scan", "custom_vjp", "closure", BLOCK, "grad"),
    ("krylov", "scan", "autodiff", "method", BLOCK, "grad"),
    ("krylov", "doubling", None, "module", BLOCK, "grad"),
    ("krylov", "doubling", "custom_vjp", "module", None, "grad"),
    ("krylov", "doubling", "autodiff", "dense", BLOCK, "grad"),
    ("krylov", "doubling", "autodiff", "bcoo", BLOCK, "jvp"),
    ("iterate", "custom_jvp", "jvp"),
    ("iterate", "custom_vjp", "grad"),
    ("iterate", "autodiff", "forward"),
] + [("layer", layer, "grad") for layer in LAYERS]
SUBSET += [("function", "trace_funm", "grad"), ("function", "funm_action_tol", "grad")]
assert set(SUBSET) <= set(ALL_CASES)


def _case_id(case):
    if case[0] != "krylov":
        return "-".join(case)
    _, method, adjoint, kind, block, transform = case
    adjoint = "default" if adjoint is None else adjoint
    block = "vector" if block is None else f"block{block}"
    return "-".join((method, adjoint, kind, block, transform))


def _program(case):
    family, *rest = case
    if family == "krylov":
        return _krylov_program(*rest)
    if family == "iterate":
        return _iterate_program(*rest)
    if family == "function":
        return _function_program(*rest)
    return _layer_program(*rest)


def _allowed_targets(case):
    if case[0] == "function" and case[1] in EIGH_FUNCTIONS:
        return EIGH_TARGETS
    return LU_TARGETS if case[:2] == ("layer", "state_space") else NO_TARGETS


MULTI_PLATFORM = (
    ("krylov", "scan", None, "bcoo", None, "grad"),
    ("krylov", "doubling", "autodiff", "dense", BLOCK, "grad"),
    ("iterate", "custom_jvp", "jvp"),
    ("layer", "state_space", "grad"),
)
assert set(MULTI_PLATFORM) <= set(SUBSET)


def _cpu_shapes(case):
    """The shapes, dtypes and pytree of a program's result on the CPU, from
    `jax.eval_shape`: what the export's output avals are compared with."""
    fn, args = _program(case)
    with jax.default_device(jax.devices("cpu")[0]):
        return jax.eval_shape(fn, *args)


@functools.cache
def _cpu_results(cases):
    """The CPU result of each of `cases`, from one jitted call: the values that
    the artifacts run here (or on an accelerator) are compared with.

    One compilation for all of them: compiling each on its own would double its
    running time.
    """
    programs = [_program(case) for case in cases]

    def run_all(all_args):
        return [fn(*args) for (fn, _), args in zip(programs, all_args, strict=True)]

    with jax.default_device(jax.devices("cpu")[0]):
        outs = jax.jit(run_all)([args for _, args in programs])
    return dict(zip(cases, outs, strict=True))


# -------------------------------------------------------------------- checks


def _avals(tree):
    leaves = jax.tree_util.tree_leaves(tree)
    return [(tuple(x.shape), np.dtype(x.dtype)) for x in leaves]


def check_artifact(exported, platforms, args, cpu_out, allowed):
    """Every check on one exported artifact (see the module docstring)."""
    assert exported.platforms == platforms, exported.platforms
    assert _avals(exported.in_avals) == _avals(args)
    assert exported.out_tree == jax.tree_util.tree_structure(cpu_out)
    assert _avals(exported.out_avals) == _avals(cpu_out)
    text = exported.mlir_module()
    targets = custom_call_targets(text)
    cpu_only = {t for t in targets if CPU_SPECIFIC.search(t)}
    assert not cpu_only, f"CPU-only custom calls for {platforms}: {sorted(cpu_only)}"
    expected = set().union(*(allowed[p] for p in platforms if p in allowed))
    assert targets <= expected, (
        f"unexpected custom calls for {platforms}: {sorted(targets - expected)}"
    )
    assert not _F64.search(text), "a float64 value in a float32 program"
    return targets


def _export(fn, args, platforms):
    return export.export(jax.jit(fn), platforms=platforms)(*args)


@pytest.mark.parametrize(
    "platform, case",
    [("cuda", c) for c in ALL_CASES]
    + [(p, c) for p in ("rocm", "tpu") for c in SUBSET],
    ids=lambda v: v if isinstance(v, str) else _case_id(v),
)
def test_export_for_accelerator(platform, case):
    fn, args = _program(case)
    exported = _export(fn, args, (platform,))
    targets = check_artifact(
        exported, (platform,), args, _cpu_shapes(case), _allowed_targets(case)
    )
    if case[:2] == ("layer", "state_space"):
        # The solve is lowered for the platform asked for, and the FFT is native.
        assert targets == LU_TARGETS[platform], targets
        assert "stablehlo.fft" in exported.mlir_module()


def test_checks_can_fail():
    """Controls: the checks above do flag what they look for.

    For `cpu`, `StateSpaceConv`'s solve lowers to LAPACK, which is flagged as
    CPU-only; a float64 `krylov` shows float64 types.
    """
    fn, args = _program(("layer", "state_space", "grad"))
    targets = custom_call_targets(_export(fn, args, ("cpu",)).mlir_module())
    flagged = {t for t in targets if CPU_SPECIFIC.search(t)}
    assert any(t.startswith("lapack_") for t in flagged), targets
    A, x0 = jnp.eye(N, dtype=jnp.float64), jnp.ones(N, jnp.float64)
    exported = _export(lambda A, x: krylovjax.krylov(A, x, D), (A, x0), ("cuda",))
    assert _F64.search(exported.mlir_module())


@pytest.mark.parametrize("case", MULTI_PLATFORM, ids=_case_id)
def test_multi_platform_artifact_runs_on_cpu(case):
    """One artifact lowered for all four platforms, called here on the CPU."""
    fn, args = _program(case)
    platforms = ("cpu", *ACCELERATORS)
    exported = _export(fn, args, platforms)
    assert exported.platforms == platforms
    # The module dispatches on the platform at run time, so it holds each
    # platform's lowering: for the solve, LAPACK next to the accelerators' calls.
    targets = custom_call_targets(exported.mlir_module())
    if case[:2] == ("layer", "state_space"):
        assert set().union(*LU_TARGETS.values()) <= targets, targets
        assert any(t.startswith("lapack_") for t in targets), targets
    else:
        assert not targets, targets
    cpu_out = _cpu_results(MULTI_PLATFORM)[case]
    assert _avals(exported.out_avals) == _avals(cpu_out)
    assert_trees_close(exported.call(*args), cpu_out, rtol=1e-5, atol=1e-6)


def _has_backend(platform):
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


@pytest.mark.parametrize("platform", ACCELERATORS)
def test_artifact_runs_on_its_accelerator(platform):
    if not _has_backend(platform):
        pytest.skip(f"running a {platform} artifact needs a {platform} device")
    for case in SUBSET:
        fn, args = _program(case)
        exported = _export(fn, args, (platform,))
        with jax.default_device(jax.devices(platform)[0]):
            out = exported.call(*args)
        # TPUs multiply float32 matrices in reduced precision by default.
        tol = {"rtol": 2e-2, "atol": 2e-3} if platform == "tpu" else {"rtol": 1e-4}
        want = jax.device_get(_cpu_results(tuple(SUBSET))[case])
        assert_trees_close(jax.device_get(out), want, **tol)


def test_artifacts_serialise():
    """The accelerator artifacts survive `serialize` / `deserialize`."""
    pytest.importorskip("flatbuffers", reason="`Exported.serialize` needs flatbuffers")
    for platform in ACCELERATORS:
        for case in MULTI_PLATFORM:
            fn, args = _program(case)
            exported = _export(fn, args, (platform,))
            restored = export.deserialize(exported.serialize())
            assert restored.platforms == (platform,)
            assert restored.out_tree == exported.out_tree
            assert _avals(restored.out_avals) == _avals(exported.out_avals)
            assert restored.mlir_module() == exported.mlir_module()
