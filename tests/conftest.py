"""Test configuration: float64 for gradient checks, strict dtype and rank promotion
(as lineax's tests), a modest hypothesis profile.

Under strict promotion JAX refuses implicit promotions (`float32 + float64`, an
integer array with a Python float) and implicit rank promotion (`(n, m) + (m,)`), so
the library is tested to make none of its own: every cast and broadcast in it is
explicit, and its documented promotions (a matrix `A` with `x0` in `krylov`, the
layers' inputs with their dtype) are made by JAX's standard rules whatever the
caller's setting. The tests make their own mixed-dtype operations explicit too.

Compiling is what the suite spends its time on, so XLA's backend optimisations
(LLVM's code generation passes) are off: `jax_disable_most_optimizations`. The HLO
passes that decide what a program computes and how much memory it needs (fusion,
buffer assignment) run as usual, so values, derivatives and the compiled memory
that the tests assert are those of a user's program; the examples run in their own
processes with the default settings.

For the same reason XLA:CPU emits its fused kernels with its classic LLVM emitter
rather than the MLIR fusion emitters (`--xla_cpu_use_fusion_emitters=false`, in
`XLA_FLAGS`, which XLA reads at its first compilation): it compiles the same
optimised HLO, with the same buffers, in about half the time. The processes that
tests start inherit it; the examples' do not (`test_examples.py`).
"""

import os

FUSION_EMITTERS_OFF = "--xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} {FUSION_EMITTERS_OFF}".strip()
)

import jax  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_disable_most_optimizations", True)

settings.register_profile("krylovjax", max_examples=20, deadline=None)
settings.load_profile("krylovjax")

# The longest tests (the trace estimators and the block decompositions, which
# compile slowly, the examples, the two-process partition test) first, so that
# under pytest-xdist no worker starts one of them while the other has run out of
# work; otherwise the collection order.
FIRST = (
    "test_trace.py",
    "test_trace_tol.py",
    "test_block.py",
    "test_examples.py",
    "test_partition.py",
    "test_funm_tol.py",
)


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=rank)
