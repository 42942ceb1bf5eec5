"""Do the hand-specialised operator gradients pay? Dense and BCOO against callables.

`krylov`'s reverse pass sums each chunk's share of the operator's gradient with the
operator's `add_param_vjp` (`krylovjax/_operator.py`). A dense matrix and a BCOO
matrix have specialised versions (blocks of rows of one GEMM; blocks of stored
entries); a callable gets the generic one, one batched VJP of the callable over the
chunk. Passing the same matrix as a callable (`lambda x: A @ x`) runs the generic
path on the same arithmetic, so this script times `jax.grad` of
`sum(krylov(A, x0, d) * W)` with respect to `A` (or the BCOO values) and `x0` both
ways, side by side in one run, and reports XLA's compiled temporary memory.

Run `python benchmarks/bench_operators.py` (about a minute; `--quick` for a smoke
run). It prints a Markdown table; nothing is written.
"""

import argparse

import _harness as h
import jax
import jax.numpy as jnp
from jax.experimental import sparse

import krylovjax


def dense_case(n, d):
    key_a, key_x, key_w = jax.random.split(jax.random.key(0), 3)
    A, _ = jnp.linalg.qr(jax.random.normal(key_a, (n, n), jnp.float32))
    x0 = jax.random.normal(key_x, (n,), jnp.float32)
    W = jax.random.normal(key_w, (n, d), jnp.float32)
    return {
        "specialised (dense)": lambda A, x0: krylovjax.krylov(A, x0, d),
        "generic (callable)": lambda A, x0: krylovjax.krylov(lambda v: A @ v, x0, d),
    }, (A, x0, W)


def sparse_case(n, d, per_row=5):
    key_i, key_v, key_x, key_w = jax.random.split(jax.random.key(1), 4)
    rows = jnp.repeat(jnp.arange(n), per_row)
    cols = jax.random.randint(key_i, (n * per_row,), 0, n)
    indices = jnp.stack([rows, cols], axis=1)
    values = jax.random.normal(key_v, (n * per_row,), jnp.float32) / per_row**0.5
    x0 = jax.random.normal(key_x, (n,), jnp.float32)
    W = jax.random.normal(key_w, (n, d), jnp.float32)

    def bcoo(values):
        return sparse.BCOO((values, indices), shape=(n, n))

    return {
        "specialised (BCOO)": lambda v, x0: krylovjax.krylov(bcoo(v), x0, d),
        "generic (callable)": lambda v, x0: krylovjax.krylov(
            lambda x: bcoo(v) @ x, x0, d
        ),
    }, (values, x0, W)


def run(cases, timing):
    header = "operator | n | d | path | grad time vs specialised | temp memory"
    print("\n".join(h.table(header, [])))
    for kind, n, d, make in cases:
        builders, args = make(n, d)
        fns = {}
        for name, build in builders.items():

            def loss(a, x0, W, build=build):
                return jnp.sum(build(a, x0) * W)

            fns[name] = (jax.grad(loss, argnums=(0, 1)), args)
        got = h.measure(fns, **timing)
        base = next(iter(got.values()))["median_s"]
        for name, r in got.items():
            time, temp = f"{r['median_s'] / base:.2f}", f"{r['temp_bytes'] / 1024:.0f}"
            print(h.row([kind, n, d, name, time, f"{temp} KiB"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few runs")
    args = parser.parse_args()
    h.cpu_by_default()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, float32")
    if args.quick:
        timing = {"target_s": 0.05, "min_rounds": 3, "max_rounds": 5}
        cases = [("dense", 32, 100, dense_case), ("BCOO", 256, 50, sparse_case)]
    else:
        timing = {"target_s": 1.0, "min_rounds": 10, "max_rounds": 200}
        cases = [
            ("dense", 64, 1000, dense_case),
            ("dense", 512, 200, dense_case),
            ("BCOO", 4096, 200, sparse_case),
            ("BCOO", 65536, 50, sparse_case),
        ]
    run(cases, timing)


if __name__ == "__main__":
    main()
