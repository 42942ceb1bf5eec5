"""Compiled memory of `jax.grad` through `krylov` against plain autodiff, per case.

The guarantee: `jax.grad` of a loss of `krylovjax.krylov(A, x0, d)` with the
defaults needs at most the compiled temporary memory of plain autodiff through a
`lax.scan` (`adjoint="autodiff"`) plus 64 vectors of `x0`'s size, for every form of
loss and every operator kind. Vectors of fewer than 64 numbers (a dense or callable
`A` with a small `x0`) take chunks of 64 steps, whose buffers hold `2 * 64 + n`
vectors, plus up to 16 more that XLA keeps beside the loops: their bound is
`2 * 64 + n + 16` vectors.

This script checks the full grid: 7 forms of loss (sum, mean, constant weights,
weights passed as an argument, `tanh` squared, a readout squared, the last column)
x 3 operator kinds (dense, BCOO with about 8 entries per row, a callable) x 5 sizes
`(n, d, block)` (vectors of fewer than 64 numbers; a block of 64; a size where a
dense matrix's gradient adds one step at a time; sizes where it adds blocks of
rows), all in float32. The test suite checks 15 of these cases
(`tests/test_defaults.py::test_grad_memory_at_most_plain_autodiff`); the cases
are built the same way (same matrices, patterns and losses).

Memory is XLA's `compiled.memory_analysis().temp_size_in_bytes` of
`jax.jit(grad).lower(...).compile()`: nothing runs, so the numbers do not depend
on the load of the machine. 64-bit mode is on, as in the test suite (the arrays are
float32; the loop counters are 64-bit, as there). For each case it prints
`(ours - plain) / vector`, the excess in vectors of `x0`'s size, against the bound
(a cell over its bound is marked `FAIL`), and exits with status 1 if any case is
over.

Run `python benchmarks/bench_memory.py` (a few minutes on two CPU cores) or
`python benchmarks/bench_memory.py --quick` (the smallest sizes only). It writes
`results.json` and `results.md` into `--out` (default `benchmarks/out/memory/`,
which git ignores).
"""

import argparse
import pathlib

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse

import krylovjax

LOSSES = (
    "sum",
    "mean",
    "constant_weights",
    "weights_argument",
    "tanh",
    "readout",
    "last",
)
KINDS = ("dense", "bcoo", "callable")
# (n, d, block)
SIZES = [
    (16, 500, None),
    (16, 500, 4),
    (128, 120, None),
    (256, 60, None),
    (256, 60, 4),
]
# The chunk of the reverse pass and the extra vectors XLA may keep beside its loops
# for vectors of fewer than `CHUNK` numbers.
CHUNK = 64
SMALL_EXTRA = 16


def loss_of(form, X, W):
    """The scalar loss of the Krylov matrix `X` (as `tests/helpers.scalar_loss`)."""
    if form == "sum":
        return X.sum()
    if form == "mean":
        return X.mean()
    if form == "constant_weights":
        return jnp.sum(X * jnp.arange(X.size, dtype=X.dtype).reshape(X.shape))
    if form == "weights_argument":
        return jnp.sum(X * W)
    if form == "tanh":
        return jnp.sum(jnp.tanh(X) ** 2)
    if form == "readout":
        n = X.shape[0]
        C = jnp.linspace(-1.0, 1.0, 3 * n, dtype=X.dtype).reshape(3, n)
        return jnp.sum(jnp.tensordot(C, X, 1) ** 2)
    if form == "last":
        return X[:, -1].sum()
    raise ValueError(form)


def problem(kind, n, d, block):
    """`(build, (A, x0, W))`: `build(A)` is the operator of `kind` and `A` its
    arrays (the stored values for BCOO)."""
    dense = jax.random.normal(jax.random.key(6), (n, n), jnp.float32)
    dense = (float(0.9 / np.sqrt(n)) * dense).astype(jnp.float32)
    keep = jax.random.uniform(jax.random.key(7), (n, n), jnp.float32) < 8 / n
    like = sparse.BCOO.fromdense(jnp.where(keep, dense, 0))
    shape = (n,) if block is None else (n, block)
    x0 = jnp.ones(shape, jnp.float32)
    W = jnp.ones((n, d, *shape[1:]), jnp.float32)
    if kind == "dense":
        return (lambda A: A), (dense, x0, W)
    if kind == "bcoo":
        return (lambda A: sparse.BCOO((A, like.indices), shape=like.shape)), (
            like.data,
            x0,
            W,
        )
    return (lambda A: lambda x: A @ x), (dense, x0, W)


def measure_case(form, kind, n, d, block):
    build, args = problem(kind, n, d, block)

    def grad(adjoint):
        def f(A, x0, W):
            X = krylovjax.krylov(build(A), x0, d, adjoint=adjoint)
            return loss_of(form, X, W)

        return jax.grad(f, (0, 1))

    ours = h.memory(h.compile_timed(grad(None), args)[0])["temp_bytes"]
    plain = h.memory(h.compile_timed(grad("autodiff"), args)[0])["temp_bytes"]
    size = n if block is None else n * block
    small = size < CHUNK and kind != "bcoo"
    bound = 2 * CHUNK + n + SMALL_EXTRA if small else CHUNK
    excess = (ours - plain) / (4 * size)
    return {
        "loss": form,
        "kind": kind,
        "n": n,
        "d": d,
        "block": block,
        "ours_bytes": ours,
        "plain_bytes": plain,
        "excess_vectors": excess,
        "bound_vectors": bound,
        "ok": ours <= plain + bound * 4 * size,
    }


def render(results):
    """One table: a row per operator kind and size, a column per loss form."""
    lines = [
        "`(ours - plain) / vector`: compiled temporary memory of `jax.grad` with the",
        "defaults beyond plain autodiff, in vectors of `x0`'s size (float32), against",
        "the bound (`<= b`); `FAIL` marks a case over its bound.",
        "",
    ]
    cells = {(r["kind"], r["n"], r["d"], r["block"], r["loss"]): r for r in results}
    rows = []
    for kind in KINDS:
        for n, d, block in SIZES:
            row = [kind, n, d, "-" if block is None else block]
            for form in LOSSES:
                r = cells.get((kind, n, d, block, form))
                if r is None:
                    row.append("")
                    continue
                mark = "" if r["ok"] else " FAIL"
                row.append(f"{r['excess_vectors']:.1f} (<= {r['bound_vectors']}){mark}")
            rows.append(row)
    header = ["kind", "n", "d", "block", *LOSSES]
    lines += h.table(header, rows, "lrrr" + "r" * len(LOSSES))
    over = [r for r in results if not r["ok"]]
    lines += ["", f"{len(results) - len(over)} of {len(results)} cases within bound."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the smallest sizes only")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=h.REPO / "benchmarks" / "out" / "memory",
        help="folder for results.json and results.md",
    )
    args = parser.parse_args()
    h.cpu_by_default()
    jax.config.update("jax_enable_x64", True)
    log = h.Log()
    sizes = [s for s in SIZES if s[0] <= 16] if args.quick else SIZES
    results = []
    for kind in KINDS:
        for n, d, block in sizes:
            for form in LOSSES:
                r = measure_case(form, kind, n, d, block)
                results.append(r)
                status = "ok" if r["ok"] else "FAIL"
                log(
                    f"{kind:8s} n={n:3d} d={d:3d} block={block} {form:16s} "
                    f"{r['excess_vectors']:7.1f} <= {r['bound_vectors']:3d}  {status}"
                )
    markdown = render(results)
    print(markdown)
    report = {"machine": h.machine_info(), "results": results}
    h.write_results(args.out, report, markdown)
    print(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")
    if not all(r["ok"] for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
