"""Benchmark block Lanczos quadrature against vmapped single-vector Lanczos.

The task: an estimate of $\\operatorname{tr} \\log A$ from 64 Rademacher probes $Z$
for a symmetric positive definite $A$, at equal products with $A$:

- block: `krylovjax.trace_funm(jnp.log, A, key, d, num_probes=64,
  block_size=16)`, the 64 probes as 4 blocks of 16, block Gauss quadrature
  $\operatorname{tr}(R_0^\top E_0^\top \log(T) E_0 R_0) / 16$ from
  `krylovjax.block_lanczos` at depth $d$ ($d$ products of $A$ with 16 columns per
  block), and "of which block Lanczos": the 4 block decompositions alone (the rest
  is the `(16 d, 16 d)` eigenproblems);
- single: the same call without `block_size`, `jax.vmap` over the 64 probes of
  Lanczos quadrature $\|z\|^2 e_0^\top \log(T) e_0$ from `krylovjax.lanczos` at
  depth $d$ ($d$ products with one vector per probe, which `vmap` batches into
  products with 64 columns);
- products only: $d$ products of $A$ with 64 columns, nothing else (what the
  products cost inside either method);
- keys: `jax.vmap` of the single-vector call over 4 keys with 16 probes each
  (the same 64 runs under two nested `vmap`s, as a study over seeds makes them;
  its error is not reported: its probes differ).

Both estimates use the same probes (the same key), and both re-orthogonalise
(the default) or neither does (`--no-reorthogonalize`). The two matrices have
exact log-determinants in closed form: a dense symmetric circulant (its
eigenvalues are the discrete Fourier transform of its first row) and the BCOO
five-point Laplacian of a square grid plus a shift. The times are measured side by
side (`_harness.measure`, interleaved rounds), forward only, in
float32 (`--dtype float64` for the other); the errors are relative to the exact
value.

Run `python benchmarks/bench_block.py` (dense n = 4096 and BCOO n = 99856, d = 20;
a few minutes on two cores) or `--quick` (n = 1024 and 10^4).

`--derivatives` measures the block decompositions' derivative rules instead, on
the dense matrix: the gradient (in $A$) and a JVP (along $A$) of the block
estimate above and of $\sum f(A) B$ for `funm_action` with a block $B$ of 16
Gaussian columns (Lanczos with $f = \log$, Arnoldi with $f = \exp$ of $A/4$), each
with `adjoint="custom_jvp"` (the default: each step replayed on the final basis)
and `adjoint="autodiff"` (JAX's rules through the scan), side by side: time and
XLA's compiled temporary memory.

`--batches` measures `trace_funm(probes_per_batch=k)` instead: the 64 probes'
single-vector runs (and the 4 blocks of 16) a batch at a time, k in 64 (all at
once, the default `None`), 32, 16 and 8, on both matrices and on the Laplacian
plus identity of an Erdos-Renyi graph (n = 20000, 200000 random edges), value and
value with gradient (in the dense matrix, in the BCOO entries), side by side:
time relative to all at once, XLA's compiled temporary memory, and the largest
difference of the outputs from all at once.
"""

import argparse
from pathlib import Path

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse

import krylovjax

PROBES = 64
BLOCK = 16


def circulant(n: int) -> tuple[np.ndarray, float]:
    """A dense SPD symmetric circulant matrix and its exact log-determinant."""
    j = np.arange(n)
    distance = np.minimum(j, n - j)
    first = np.exp(-distance / 8.0) / 8.0
    first[0] += 0.5
    eigenvalues = np.fft.fft(first).real
    assert eigenvalues.min() > 0
    matrix = first[(j[None, :] - j[:, None]) % n]
    return matrix, float(np.sum(np.log(eigenvalues)))


def laplacian(m: int, shift: float = 0.05) -> tuple[sparse.BCOO, float]:
    """The five-point Laplacian of an m x m grid plus `shift` I (n = m^2), as BCOO,
    and its exact log-determinant."""
    n = m * m
    index = np.arange(n).reshape(m, m)
    rows, cols, vals = [index.ravel()], [index.ravel()], [np.full(n, 4.0 + shift)]
    for a, b in ((index[:-1, :], index[1:, :]), (index[:, :-1], index[:, 1:])):
        for r, c in ((a, b), (b, a)):
            rows.append(r.ravel())
            cols.append(c.ravel())
            vals.append(np.full(r.size, -1.0))
    indices = np.stack([np.concatenate(rows), np.concatenate(cols)], axis=1)
    data = np.concatenate(vals)
    matrix = sparse.BCOO((jnp.asarray(data), jnp.asarray(indices)), shape=(n, n))
    k = np.arange(1, m + 1)
    line = 2.0 - 2.0 * np.cos(np.pi * k / (m + 1))
    eigenvalues = shift + line[:, None] + line[None, :]
    return matrix, float(np.sum(np.log(eigenvalues)))


KEY = jax.random.key(0)


def block_estimate(A, d, reorth=True):
    return krylovjax.trace_funm(
        jnp.log,
        A,
        KEY,
        d,
        num_probes=PROBES,
        block_size=BLOCK,
        reorthogonalize=reorth,
    )


def single_estimate(A, d, reorth=True):
    return krylovjax.trace_funm(
        jnp.log, A, KEY, d, num_probes=PROBES, reorthogonalize=reorth
    )


def block_decomposition(A, Z, d, reorth=True):
    """The block Lanczos runs alone (no quadrature): what the blocks' small
    eigenproblems add is the difference."""
    n = Z.shape[0]
    blocks = Z.reshape(n, PROBES // BLOCK, BLOCK).transpose(1, 0, 2)

    def one(B):
        dec = krylovjax.block_lanczos(A, B, d, reorthogonalize=reorth)
        return dec.diagonal, dec.off_diagonal

    return jax.vmap(one)(blocks)


def keys_estimate(A, d, reorth=True, package=krylovjax):
    keys = jax.random.split(KEY, PROBES // BLOCK)

    def one(key):
        return package.trace_funm(
            jnp.log, A, key, d, num_probes=BLOCK, reorthogonalize=reorth
        )

    return jax.vmap(one)(keys)


def products_only(A, Z, d):
    def step(_, X):
        Y = A @ X
        return Y / jnp.max(jnp.abs(Y))

    return jax.lax.fori_loop(0, d, step, Z)


def run_case(name, A, exact, n, d, dtype, reorth, timing, log, against=None):
    rng = np.random.default_rng(0)
    Z = jnp.asarray(rng.choice([-1.0, 1.0], size=(n, PROBES)).astype(dtype))
    if isinstance(A, np.ndarray):
        A = jnp.asarray(A.astype(dtype))
    else:
        A = sparse.BCOO((A.data.astype(dtype), A.indices), shape=A.shape)
    fns = {
        "block": (lambda A: block_estimate(A, d, reorth), (A,)),
        "single": (lambda A: single_estimate(A, d, reorth), (A,)),
        "keys": (lambda A: keys_estimate(A, d, reorth), (A,)),
        "products": (lambda A, Z: products_only(A, Z, d), (A, Z)),
        "block decomposition": (
            lambda A, Z: block_decomposition(A, Z, d, reorth),
            (A, Z),
        ),
    }
    if against is not None:
        fns["block at ref"] = (
            lambda A: against.trace_funm(
                jnp.log,
                A,
                KEY,
                d,
                num_probes=PROBES,
                block_size=BLOCK,
                reorthogonalize=reorth,
            ),
            (A,),
        )
        fns["keys at ref"] = (
            lambda A: keys_estimate(A, d, reorth, against),
            (A,),
        )
        fns["single at ref"] = (
            lambda A: against.trace_funm(
                jnp.log, A, KEY, d, num_probes=PROBES, reorthogonalize=reorth
            ),
            (A,),
        )
    log(f"{name}: n = {n}, d = {d}, compiling and timing")
    results = h.measure(fns, outputs=True, **timing)
    errors = {
        key: abs(float(results[key]["output"]) - exact) / abs(exact)
        for key in ("block", "single")
    }
    for key in results:
        results[key].pop("output")
    return {"case": name, "n": n, "d": d, "exact": exact, "errors": errors} | {
        "results": results
    }


def derivative_fns(A, d, dtype):
    """`{(task, mode, adjoint): (fn, args)}` for `--derivatives`."""
    B = jax.random.normal(jax.random.key(1), (A.shape[0], BLOCK), dtype)

    def tasks(adjoint):
        options = {"adjoint": adjoint}
        return {
            "trace_funm, 4 blocks of 16": lambda A: krylovjax.trace_funm(
                jnp.log, A, KEY, d, num_probes=PROBES, block_size=BLOCK, **options
            ),
            "funm_action lanczos": lambda A: jnp.sum(
                krylovjax.funm_action(jnp.log, A, B, d, method="lanczos", **options)
            ),
            "funm_action arnoldi": lambda A: jnp.sum(
                krylovjax.funm_action(
                    jax.scipy.linalg.expm, A / 4, B, d, method="arnoldi", **options
                )
            ),
        }

    fns = {}
    for adjoint in ("custom_jvp", "autodiff"):
        for task, f in tasks(adjoint).items():
            fns[(task, "grad", adjoint)] = (jax.grad(f), (A,))
            fns[(task, "jvp", adjoint)] = (
                lambda A, f=f: jax.jvp(f, (A,), (A,)),
                (A,),
            )
    return fns


def run_derivatives(n, d, dtype, timing, log):
    matrix, _ = circulant(n)
    A = jnp.asarray(matrix.astype(dtype))
    log(f"derivatives: dense n = {n}, d = {d}, compiling and timing")
    results = h.measure(derivative_fns(A, d, dtype), **timing)
    rows = []
    for task, mode, adjoint in results:
        if adjoint != "custom_jvp":
            continue
        ours, theirs = results[task, mode, adjoint], results[task, mode, "autodiff"]
        rows.append(
            [
                task,
                mode,
                h.ms(ours["median_s"]),
                h.ms(theirs["median_s"]),
                h.fmt(h.ratio(ours["median_s"], theirs["median_s"])),
                h.kib(ours["temp_bytes"]),
                h.kib(theirs["temp_bytes"]),
                h.fmt(h.ratio(theirs["temp_bytes"], ours["temp_bytes"]), ".1f"),
            ]
        )
    header = (
        "task | mode | custom_jvp ms | autodiff ms | time custom_jvp / autodiff "
        "| custom_jvp temp KiB | autodiff temp KiB | autodiff temp / custom_jvp temp"
    )
    lines = [
        f"jax {jax.__version__}, {jax.devices()[0].platform}, {dtype}, "
        f"{h.cores()} cores; dense n = {n}, d = {d}, blocks of {BLOCK}",
        "",
        *h.table(header, rows, "llrrrrrr"),
    ]
    records = {" / ".join(k): v for k, v in results.items()}
    return records, "\n".join(lines) + "\n"


def random_graph(n: int, edges: int, seed: int = 0) -> sparse.BCOO:
    """The Laplacian plus identity of an Erdos-Renyi graph with `edges` random
    edges, as BCOO (symmetric positive definite; no closed-form log-determinant)."""
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, n, edges), rng.integers(0, n, edges)
    degree = np.bincount(np.concatenate([a, b]), minlength=n)
    rows = np.concatenate([a, b, np.arange(n)])
    cols = np.concatenate([b, a, np.arange(n)])
    data = np.concatenate([-np.ones(2 * edges), degree + 1.0])
    indices = jnp.asarray(np.stack([rows, cols], axis=1))
    return sparse.BCOO((jnp.asarray(data), indices), shape=(n, n))


BATCHES = (None, 32, 16, 8)


def batch_fns(A, d, dtype):
    """`{(method, batch, mode): (fn, args)}` for `--batches`: the estimate as a
    function of the matrix (dense) or of its entries (BCOO)."""
    if isinstance(A, np.ndarray):
        arg = jnp.asarray(A.astype(dtype))

        def matrix(x):
            return x

    else:
        arg, indices, shape = A.data.astype(dtype), A.indices, A.shape

        def matrix(x):
            return sparse.BCOO((x, indices), shape=shape)

    fns = {}
    for method, block in (("single", None), ("block", BLOCK)):
        for batch in BATCHES:
            if block is not None and batch is not None and batch < block:
                continue

            def f(x, block=block, batch=batch):
                return krylovjax.trace_funm(
                    jnp.log,
                    matrix(x),
                    KEY,
                    d,
                    num_probes=PROBES,
                    block_size=block,
                    probes_per_batch=batch,
                )

            fns[(method, batch, "value")] = (f, (arg,))
            fns[(method, batch, "value and grad")] = (jax.value_and_grad(f), (arg,))
    return fns


def run_batches(cases, d, dtype, timing, log):
    rows, records = [], {}
    for name, A in cases:
        log(f"batches: {name}, n = {A.shape[0]}, d = {d}, compiling and timing")
        results = h.measure(batch_fns(A, d, dtype), outputs=True, **timing)
        outputs = {key: r.pop("output") for key, r in results.items()}
        for key, r in results.items():
            method, batch, mode = key
            first = (method, None, mode)
            base = results[first]
            rows.append(
                [
                    name,
                    method,
                    mode,
                    PROBES if batch is None else batch,
                    h.ms(r["median_s"]),
                    h.fmt(h.ratio(r["median_s"], base["median_s"])),
                    h.kib(r["temp_bytes"]),
                    h.fmt(h.ratio(base["temp_bytes"], r["temp_bytes"]), ".1f"),
                    f"{h.largest_difference(outputs[key], outputs[first]):.1e}",
                ]
            )
            records[f"{name} / {method} / {batch} / {mode}"] = r
    header = (
        "matrix | method | mode | probes per batch | ms | time / all at once "
        "| temp KiB | all at once temp / temp | outputs' rel. difference"
    )
    lines = [
        f"jax {jax.__version__}, {jax.devices()[0].platform}, {dtype}, "
        f"{h.cores()} cores; tr log A from {PROBES} Rademacher probes, d = {d}; "
        f"block: {PROBES // BLOCK} blocks of {BLOCK}",
        "",
        *h.table(header, rows, "lllrrrrrr"),
    ]
    return records, "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few runs")
    parser.add_argument("--depth", type=int, default=20, help="d, products per probe")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument(
        "--no-reorthogonalize",
        action="store_true",
        help="both methods without re-orthogonalisation (default: with)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "out" / "block"
    )
    parser.add_argument(
        "--derivatives",
        action="store_true",
        help="the derivative rules' time and memory instead (dense matrix only)",
    )
    parser.add_argument(
        "--batches",
        action="store_true",
        help="trace_funm(probes_per_batch=...)'s time and memory instead",
    )
    parser.add_argument(
        "--against",
        metavar="REF",
        help="also time both paths of the package at git revision REF, side by "
        "side (the last columns: today's time over theirs)",
    )
    args = parser.parse_args()
    against = h.import_at(args.against) if args.against else None
    if (args.derivatives or args.batches) and args.against:
        parser.error("--derivatives and --batches do not go with --against")
    if args.derivatives and args.batches:
        parser.error("--derivatives and --batches do not go together")
    h.cpu_by_default()
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    log = h.Log()
    if args.quick:
        timing = {"target_s": 0.2, "min_rounds": 3, "max_rounds": 10}
        dense_n, grid = 1024, 100
    else:
        timing = {"target_s": 1.0, "min_rounds": 5, "max_rounds": 20}
        dense_n, grid = 4096, 316
    d = args.depth
    reorth = not args.no_reorthogonalize
    if args.batches or args.derivatives:
        if args.batches:
            cases = [
                ("dense", circulant(dense_n)[0]),
                ("BCOO grid", laplacian(grid)[0]),
                ("BCOO random", random_graph(20000, 200000)),
            ]
            records, markdown = run_batches(cases, d, args.dtype, timing, log)
            stem = "block_batches"
        else:
            records, markdown = run_derivatives(dense_n, d, args.dtype, timing, log)
            stem = "block_derivatives"
        print(markdown)
        report = {"machine": h.machine_info(), "records": records}
        h.write_results(args.out, report, markdown, stem=stem)
        log(f"wrote {args.out}")
        return
    records = []
    matrix, exact = circulant(dense_n)
    records.append(
        run_case(
            "dense", matrix, exact, dense_n, d, args.dtype, reorth, timing, log, against
        )
    )
    del matrix
    matrix, exact = laplacian(grid)
    records.append(
        run_case(
            "BCOO",
            matrix,
            exact,
            grid * grid,
            d,
            args.dtype,
            reorth,
            timing,
            log,
            against,
        )
    )
    rows = []
    for r in records:
        res = r["results"]
        block, single, products, decomposition, keys = (
            res[k]["median_s"]
            for k in ("block", "single", "products", "block decomposition", "keys")
        )
        extra = []
        if against is not None:
            extra = [
                h.fmt(h.ratio(block, res["block at ref"]["median_s"])),
                h.fmt(h.ratio(single, res["single at ref"]["median_s"])),
                h.fmt(h.ratio(keys, res["keys at ref"]["median_s"])),
            ]
        rows.append(
            [
                r["case"],
                r["n"],
                r["d"],
                h.ms(block),
                h.ms(decomposition),
                h.ms(single),
                h.ms(products),
                h.ms(keys),
                h.fmt(h.ratio(single, block)),
                f"{r['errors']['block']:.2e}",
                f"{r['errors']['single']:.2e}",
                h.fmt(res["block"]["compile_s"], ".1f"),
                h.fmt(res["single"]["compile_s"], ".1f"),
                *extra,
            ]
        )
    lines = [
        f"jax {jax.__version__}, {jax.devices()[0].platform}, {args.dtype}, "
        f"{h.cores()} cores; tr log A from {PROBES} Rademacher probes "
        f"({PROBES // BLOCK} blocks of {BLOCK}), d products per probe, "
        f"re-orthogonalisation {'on' if reorth else 'off'}",
        "",
        *h.table(
            "matrix | n | d | block ms | of which block Lanczos ms | single ms "
            "| products only ms | 4 keys x 16 probes ms "
            "| single / block time | block rel. error | single rel. error "
            "| block compile s | single compile s"
            + (
                f" | block / block at {args.against} | single / single at "
                f"{args.against} | keys / keys at {args.against}"
                if against
                else ""
            ),
            rows,
            "lrrrrrrrrrrrr" + ("rrr" if against else ""),
        ),
    ]
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    report = {"machine": h.machine_info(), "records": records}
    stem = "block" if reorth else "block_no_reorth"
    h.write_results(args.out, report, markdown, stem=stem)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
