"""Benchmark `krylovjax.krylov` against the ways a user would otherwise write it.

Five ways of building the Krylov matrix X = [x0, A x0, ..., A^(d-1) x0] of shape
(n, d), all jitted, on the CPU in float32 (`benchmarks/README.md` has the details):
`krylovjax` (`krylov(A, x0, d)`, its defaults), `kj_vjp` (the same reverse pass as a
`jax.custom_vjp`), `scan` (a plain `lax.scan`, differentiated by JAX), `unrolled` (a
Python loop, stacked) and `concat` (a Python loop growing X by concatenation). For
the forward pass and for `jax.grad` of `sum(X * W)` with respect to `A` and `x0`:
run time (side by side, interleaved), compile time and XLA's compiled memory; also
a block x0, every form of loss, the default against `method="doubling"`, and the
compile time against d.

Run `python benchmarks/bench_krylov.py` (a few minutes on 2 cores) or `--quick` (a
smoke run, under a minute). Results go to `--out` (default `benchmarks/out/krylov`,
git-ignored): `results.json`, `results.md` and `grad_time_memory_vs_d.png`.

`--against REF` instead times the package at git revision REF (`git archive`, see
`_harness.import_at`) against the working tree's, forward and `grad` side by side in
the same rounds, and writes `against.json` and `against.md`: the ratios new / old of
the median times and of the fastest rounds (with `--against HEAD`, the noise of the
measurement) and the largest difference between the two implementations' results.
"""

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import _harness as h
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import sparse as jsparse

import krylovjax

METHODS = ("krylovjax", "kj_vjp", "scan", "unrolled", "concat")
# The unrolled loop and concatenate growth trace d separate operations, and XLA's
# compile time grows faster than linearly in d (at n = 8 on a loaded 2-core machine:
# grad of `unrolled` compiled in 3.6 s at d = 100 and 12 s at d = 200; grad of
# `concat` in 18 s at d = 100 and 195 s at d = 200). Past these depths they are
# skipped.
PEER_MAX_D = {"unrolled": 200, "concat": 100}
SKIPPED = "skipped (d too large to compile in reasonable time)"
KINDS = ("forward", "grad")
# `--against`: the largest relative difference between the results of the old and
# the new code that counts as agreeing (float32, rounding changed by a refactor).
AGREE = 1e-4

FULL = {
    "sizes": [(3, 10), (64, 50), (512, 200), (32, 5000), (1024, 100)],
    "scaling_n": 8,
    "scaling_ds": (10, 10000),
    "compile_repeats": 3,
    "plot_n": 64,
    "plot_ds": [10, 20, 50, 100, 200, 500, 1000, 2000],
    "timing": {"target_s": 0.3, "min_rounds": 5, "max_rounds": 200},
    "block_sizes": [(64, 1024, 8), (256, 1024, 8)],
    # (n, d, b, kind of A): dense at the three sizes of the time target, a dense size
    # whose gradient adds one step at a time, BCOO and a callable (a closure over a
    # dense matrix).
    "loss_sizes": [
        (512, 200, None, "dense"),
        (32, 5000, None, "dense"),
        (256, 1024, 8, "dense"),
        (128, 400, None, "dense"),
        (512, 200, None, "bcoo"),
        (512, 200, None, "callable"),
    ],
    "doubling_sizes": [(16, 4096), (64, 4096)],
}
QUICK = {
    "sizes": [(3, 10), (16, 20)],
    "scaling_n": 8,
    "scaling_ds": (10, 100),
    "compile_repeats": 1,
    "plot_n": 16,
    "plot_ds": [10, 20],
    "timing": {"target_s": 0.02, "min_rounds": 3, "max_rounds": 10},
    "block_sizes": [(16, 20, 4)],
    "loss_sizes": [
        (16, 100, None, "dense"),
        (8, 100, 2, "dense"),
        (16, 100, None, "bcoo"),
    ],
    "doubling_sizes": [(8, 256)],
}


# The ways of building X, each returning shape (n, d), or (n, d, b) for a block x0
# of shape (n, b).


def krylov_scan(A, x0, d):
    """Plain autodiff's version: a `lax.scan` of `d - 1` products, `x0` in front."""

    def step(x, _):
        y = A(x) if callable(A) else A @ x
        return y, y

    _, ys = lax.scan(step, x0, length=d - 1)
    return jnp.moveaxis(jnp.concatenate([x0[None], ys]), 0, 1)


def krylov_unrolled(A, x0, d):
    xs = [x0]
    for _ in range(d - 1):
        xs.append(A @ xs[-1])
    return jnp.stack(xs, axis=1)


def krylov_concat(A, x0, d):
    X = x0[:, None]
    for _ in range(d - 1):
        X = jnp.concatenate([X, (A @ X[:, -1])[:, None]], axis=1)
    return X


BUILDERS: dict[str, Callable] = {
    "krylovjax": lambda A, x0, d: krylovjax.krylov(A, x0, d),
    "kj_vjp": lambda A, x0, d: krylovjax.krylov(A, x0, d, adjoint="custom_vjp"),
    "scan": krylov_scan,
    "unrolled": krylov_unrolled,
    "concat": krylov_concat,
}


def make_functions(build: Callable, d: int) -> tuple[Callable, Callable]:
    """Fresh (forward, grad) functions, so that no trace or compile cache is hit."""

    def forward(A, x0):
        return build(A, x0, d)

    def loss(A, x0, W):
        return jnp.sum(build(A, x0, d) * W)

    return forward, jax.grad(loss, argnums=(0, 1))


def problem(n: int, d: int, b: int | None = None, seed: int = 0):
    """`A`, `x0` of shape `(n,)` (or `(n, b)`) and the loss weights `W` like X."""
    key_a, key_x, key_w = jax.random.split(jax.random.key(seed), 3)
    # A random orthogonal matrix: every power of A keeps the norm of x0, so that
    # nothing overflows or underflows in float32 even at d = 10000.
    A, _ = jnp.linalg.qr(jax.random.normal(key_a, (n, n), jnp.float32))
    block = () if b is None else (b,)
    x0 = jax.random.normal(key_x, (n, *block), jnp.float32)
    W = jax.random.normal(key_w, (n, d, *block), jnp.float32)
    return A, x0, W


def measure_size(methods, n, d, timing, b=None) -> dict[str, dict]:
    """Every method's forward and grad at one size, all timed side by side."""
    A, x0, W = problem(n, d, b)
    fns = {}
    for method in methods:
        forward, grad = make_functions(BUILDERS[method], d)
        fns[method, "forward"] = (forward, (A, x0))
        fns[method, "grad"] = (grad, (A, x0, W))
    got = h.measure(fns, outputs=True, **timing)
    size = {"n": n, "d": d, "b": b}
    return {m: {"method": m, **size, **{k: got[m, k] for k in KINDS}} for m in methods}


def check_agreement(results: list[dict], tag: str = "") -> dict[str, float]:
    """Largest relative difference of each method's outputs from plain `scan`'s."""
    ref = {(r["n"], r["d"]): r for r in results if r["method"] == "scan"}
    return {
        f"{r['method']} n={r['n']} d={r['d']}{tag}": max(
            h.largest_difference(r[k]["output"], ref[r["n"], r["d"]][k]["output"])
            for k in KINDS
        )
        for r in results
        if "skipped" not in r and r["method"] != "scan" and (r["n"], r["d"]) in ref
    }


def run_sizes(sizes, config, cache, log) -> list[dict]:
    results = []
    for n, d in sizes:
        methods = [m for m in METHODS if d <= PEER_MAX_D.get(m, d)]
        if (methods[0], n, d) not in cache:
            for method, r in measure_size(methods, n, d, config["timing"]).items():
                cache[method, n, d] = r
                log(
                    f"  {method:>9} n={n:<5} d={d:<5} "
                    f"fwd {r['forward']['median_s'] * 1e3:9.3f} ms  "
                    f"grad {r['grad']['median_s'] * 1e3:9.3f} ms  "
                    f"compile grad {r['grad']['compile_s']:6.2f} s"
                )
        for method in METHODS:
            skipped = {"method": method, "n": n, "d": d, "skipped": SKIPPED}
            results.append(cache.get((method, n, d), skipped))
    return results


def run_block_sizes(sizes, config, log) -> list[dict]:
    """krylovjax against plain scan for a block x0 of shape (n, b)."""
    results = []
    for n, d, b in sizes:
        methods = ["krylovjax", "kj_vjp", "scan"]
        for method, r in measure_size(methods, n, d, config["timing"], b).items():
            results.append(r)
            log(
                f"  {method:>9} n={n:<5} d={d:<5} b={b:<3} "
                f"fwd {r['forward']['median_s'] * 1e3:9.3f} ms  "
                f"grad {r['grad']['median_s'] * 1e3:9.3f} ms"
            )
    return results


# Every form of loss a model puts on X: the cotangent that reaches the reverse pass
# is then a broadcast constant (sum, mean), a constant or passed-in weight, a fresh
# array (a nonlinear readout, C @ X), or zero but for one column.
LOSSES = {
    "sum": lambda X, W: X.sum(),
    "mean": lambda X, W: X.mean(),
    "constant weights": lambda X, W: jnp.sum(
        X * jnp.cos(jnp.arange(X.size)).reshape(X.shape)
    ),
    "weights argument": lambda X, W: jnp.sum(X * W),
    "tanh readout": lambda X, W: jnp.sum(jnp.tanh(X) ** 2),
    "C @ X readout": lambda X, W: jnp.sum(
        jnp.tensordot(jnp.ones((4, X.shape[0]), X.dtype), X, 1) ** 2
    ),
    "last column": lambda X, W: X[:, -1].sum(),
}


def loss_operator(kind: str, A):
    """`(make, array)`: `make(array)` is the `A` that `krylov` gets for `kind`, and
    `array` the one that `grad` differentiates (the stored values, for BCOO: about 8
    entries per row of the dense `A`)."""
    if kind == "bcoo":
        mask = jax.random.uniform(jax.random.key(1), A.shape) < 8 / A.shape[0]
        pattern = jsparse.BCOO.fromdense(jnp.where(mask, A, 0))
        return lambda data: jsparse.BCOO((data, pattern.indices), shape=A.shape), (
            pattern.data
        )
    if kind == "callable":
        return lambda A: lambda x: A @ x, A
    return lambda A: A, A


def run_losses(sizes, config, log) -> list[dict]:
    """Temporary memory (and time) of `grad` for every form of loss."""
    results = []
    for n, d, b, kind in sizes:
        A, x0, W = problem(n, d, b)
        make, A = loss_operator(kind, A)
        for loss_name, loss in LOSSES.items():
            fns = {}
            for method in ("krylovjax", "scan"):

                def f(A, x0, W, build=BUILDERS[method], loss=loss, d=d, make=make):
                    return loss(build(make(A), x0, d), W)

                fns[method] = (jax.grad(f, argnums=(0, 1)), (A, x0, W))
            got = h.measure(fns, **config["timing"])
            kj, sc = got["krylovjax"]["temp_bytes"], got["scan"]["temp_bytes"]
            row = {"n": n, "d": d, "b": b, "kind": kind, "loss": loss_name}
            row.update(
                krylovjax=kj,
                scan=sc,
                time_ratio=got["krylovjax"]["median_s"] / got["scan"]["median_s"],
                extra_vectors=(kj - sc) / (4 * n * (b or 1)),
            )
            log(
                f"  {loss_name:>16} {kind:>8} n={n:<4} d={d:<5} b={b} temp "
                f"{kj / 1024:.0f} vs {sc / 1024:.0f} KiB "
                f"({row['extra_vectors']:+.0f} vectors), "
                f"time ratio {row['time_ratio']:.2f}"
            )
            results.append(row)
    return results


def run_doubling(sizes, config, log) -> list[dict]:
    """What the default (the scan) gives up against `method="doubling"`."""
    results = []
    for n, d in sizes:
        A, x0, W = problem(n, d)
        fns = {}
        for method in ("scan", "doubling"):

            def f(A, x0, W, method=method, d=d):
                return jnp.sum(krylovjax.krylov(A, x0, d, method=method) * W)

            fns[method] = (jax.value_and_grad(f, argnums=(0, 1)), (A, x0, W))
        got = h.measure(fns, **config["timing"])
        scan_s, doubling_s = got["scan"]["median_s"], got["doubling"]["median_s"]
        results.append({"n": n, "d": d, "scan_s": scan_s, "doubling_s": doubling_s})
        log(f"  n={n} d={d} value+grad: scan / doubling {scan_s / doubling_s:.2f}")
    return results


def grad_compile_time(method: str, n: int, d: int, repeats: int) -> dict:
    A, x0, W = problem(n, d)
    times, temp = [], None
    for _ in range(repeats):
        _, grad = make_functions(BUILDERS[method], d)
        compiled, seconds = h.compile_timed(grad, (A, x0, W))
        times.append(seconds)
        temp = h.memory(compiled)["temp_bytes"]
    point = {"method": method, "n": n, "d": d, "compile_s": statistics.median(times)}
    return point | {"compile_all_s": times, "temp_bytes": temp}


# Reporting.


def markdown(report: dict) -> str:
    m, config = report["machine"], report["config"]
    by_key = {
        (r["method"], r["n"], r["d"]): r for r in report["sizes"] if "skipped" not in r
    }

    def get(method, n, d, name, field="median_s"):
        r = by_key.get((method, n, d))
        return None if r is None else r[name][field]

    rows = []
    for n, d in config["sizes"]:
        kj, sc = (get(x, n, d, "grad") for x in ("krylovjax", "scan"))
        kj_m, sc_m = (get(x, n, d, "grad", "temp_bytes") for x in ("krylovjax", "scan"))
        pairs = [(kj, sc), (kj, get("krylovjax", n, d, "forward"))]
        pairs += [(sc, get("scan", n, d, "forward")), (kj_m, sc_m)]
        pairs += [(kj, get(x, n, d, "grad")) for x in ("unrolled", "concat")]
        pairs += [(get("kj_vjp", n, d, "grad"), sc)]
        pairs += [(get("kj_vjp", n, d, "grad", "temp_bytes"), sc_m)]
        rows.append([n, d, *(h.fmt(h.ratio(a, b)) for a, b in pairs)])
    lines = [
        "# krylovjax benchmark",
        "",
        f"Machine: {m['device']} ({m['backend']}), {m['cpu_count']} CPUs, jax "
        f"{m['versions']['jax']}, float32, commit `{m['git_commit']}`. "
        f"Mode: {report['mode']}; total run time {report['total_s']:.0f} s.",
        "",
        "Loss: `sum(X * W)`, gradient with respect to `A` and `x0`. Times are medians "
        "of repeated jitted calls; memory is XLA's compiled temporary allocation.",
        "",
        "## Ratios (measured side by side)",
        "",
        *h.table(
            "n | d | kj grad / scan grad | kj grad / kj fwd | scan grad / scan fwd "
            "| kj grad temp / scan grad temp | kj grad / unrolled grad "
            "| kj grad / concat grad | kj_vjp grad / scan grad "
            "| kj_vjp grad temp / scan grad temp",
            rows,
        ),
        "",
        "## Block x0",
        "",
        "`x0` of shape `(n, b)`, `X` of shape `(n, d, b)`; unrolled and concat are "
        "not run at these depths.",
        "",
    ]
    blocks = {(r["method"], r["n"], r["d"], r["b"]): r for r in report["blocks"]}
    rows = []
    for n, d, b in config["block_sizes"]:
        kj, sc, jv = (
            blocks[x, n, d, b]["grad"] for x in ("krylovjax", "scan", "kj_vjp")
        )
        rows.append(
            [n, d, b, h.fmt(h.ratio(kj["median_s"], sc["median_s"]))]
            + [h.fmt(h.ratio(kj["temp_bytes"], sc["temp_bytes"]))]
            + [h.fmt(h.ratio(jv["median_s"], sc["median_s"]))]
            + [h.ms(kj["median_s"]), h.ms(sc["median_s"])]
        )
    lines += h.table(
        "n | d | b | kj grad / scan grad | kj grad temp / scan grad temp "
        "| kj_vjp grad / scan grad | kj grad ms | scan grad ms",
        rows,
    )
    lines += [
        "",
        "## Every form of loss",
        "",
        "Compiled temporary memory of `grad` (with respect to `A`, or its stored "
        "values, and `x0`) with the defaults against plain autodiff through a "
        "`lax.scan`, the difference in vectors of `x0`'s size (the target: at most "
        "64), and the time ratio.",
        "",
        *h.table(
            "A | n | d | b | loss | kj temp KiB | scan temp KiB | extra vectors "
            "| temp ratio | time ratio",
            [
                [r["kind"], r["n"], r["d"], r["b"] or "-", r["loss"]]
                + [
                    h.kib(r["krylovjax"]),
                    h.kib(r["scan"]),
                    f"{r['extra_vectors']:+.0f}",
                ]
                + [h.fmt(h.ratio(r["krylovjax"], r["scan"])), h.fmt(r["time_ratio"])]
                for r in report["losses"]
            ],
        ),
        "",
        "## What the default gives up against doubling",
        "",
        "The default method is the scan, which never overflows where the vectors do "
        'not. `method="doubling"` (opt-in) is faster at long d and small n; value '
        "and gradient of `sum(X * W)`:",
        "",
        *h.table(
            "n | d | scan ms | doubling ms | scan / doubling",
            [
                [r["n"], r["d"], h.ms(r["scan_s"]), h.ms(r["doubling_s"])]
                + [h.fmt(h.ratio(r["scan_s"], r["doubling_s"]))]
                for r in report["doubling"]
            ],
        ),
    ]
    scaling = report["compile_scaling"]
    lo, hi = scaling["points"]
    rows = []
    for r in report["sizes"]:
        f, g = r.get("forward"), r.get("grad")
        rows.append(
            [r["method"], r["n"], r["d"], r["skipped"], *[""] * 6]
            if "skipped" in r
            else [r["method"], r["n"], r["d"], h.ms(f["median_s"]), h.ms(g["median_s"])]
            + [f"{f['compile_s']:.3f}", f"{g['compile_s']:.3f}"]
            + [h.kib(f["temp_bytes"]), h.kib(g["temp_bytes"]), h.kib(g["output_bytes"])]
        )
    lines += [
        "",
        f"Compile time of krylovjax `grad` (n = {lo['n']}, median of "
        f"{len(lo['compile_all_s'])}): d = {lo['d']}: {lo['compile_s']:.3f} s, "
        f"d = {hi['d']}: {hi['compile_s']:.3f} s, ratio **{scaling['ratio']:.2f}**.",
        "",
        "## Raw numbers",
        "",
        "Times in ms (median), compile in s, memory in KiB (temp / output).",
        "",
        *h.table(
            "method | n | d | fwd ms | grad ms | fwd compile s | grad compile s "
            "| fwd temp KiB | grad temp KiB | grad output KiB",
            rows,
        ),
        "",
        f"## Against d at fixed n (n = {config['plot_n']}; the data of the figure)",
        "",
        "Compile time of `grad` in s; `grad` time in ms; `grad` temporary memory in "
        "KiB. `-`: skipped (d too large to compile in reasonable time).",
        "",
    ]
    grid = {(r["method"], r["d"]): r["grad"] for r in report["plot"] if "grad" in r}
    rows = []
    for d in config["plot_ds"]:
        gs = [grid.get((x, d), {}) for x in METHODS]
        rows.append(
            [d, *(h.fmt(g.get("compile_s"), ".3f") for g in gs)]
            + [h.ms(g.get("median_s")) for g in gs]
            + [h.kib(g.get("temp_bytes")) for g in gs]
        )
    columns = ["compile s", "grad ms", "temp KiB"]
    lines += h.table(["d", *(f"{x} {c}" for c in columns for x in METHODS)], rows)
    lines += [
        "",
        "## Agreement",
        "",
        "Largest relative difference of forward output and gradients from plain "
        f"`scan`: {max(report['agreement'].values(), default=0.0):.2e}.",
        "",
    ]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in METHODS:
        rows = sorted(
            (r for r in report["plot"] if r["method"] == method and "skipped" not in r),
            key=lambda r: r["d"],
        )
        ds = [r["d"] for r in rows]
        fields = (("median_s", 1e3), ("temp_bytes", 1 / 1024))
        for ax, (field, scale) in zip(axes, fields, strict=True):
            if ds:
                ys = [r["grad"][field] * scale for r in rows]
                ax.plot(ds, ys, "o-", label=method)
    for ax, ylabel in zip(
        axes, ("grad time [ms]", "grad temp memory [KiB]"), strict=True
    ):
        ax.set(xscale="log", yscale="log", xlabel="d", ylabel=ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"jax.grad of sum(X * W), n = {report['config']['plot_n']}, float32 CPU "
        f"(unrolled up to d = {PEER_MAX_D['unrolled']}, "
        f"concat up to d = {PEER_MAX_D['concat']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# The package at another revision against the working tree's.


def run_against(ref: str, old, config: dict, log) -> dict:
    """Forward and `grad` of `krylov` at `ref` (the module `old`) and in the working
    tree, all four timed side by side in the same rounds, at the sizes of `config`:
    the vector sizes and the block sizes with the default method, the doubling
    sizes with `method="doubling"`. The timing is the full run's (about 0.3 s per
    function) even for the quick sizes, which cost little and would be noisy
    otherwise."""
    log(f"against {old.__name__} ({Path(old.__file__).parent})")
    cases = [(n, d, None, "scan") for n, d in config["sizes"]]
    cases += [(n, d, b, "scan") for n, d, b in config["block_sizes"]]
    cases += [(n, d, None, "doubling") for n, d in config["doubling_sizes"]]
    rows = []
    for n, d, b, method in cases:
        A, x0, W = problem(n, d, b)
        fns = {}
        for tag, lib in (("new", krylovjax), ("old", old)):
            forward, grad = make_functions(
                lambda A, x0, d, lib=lib, m=method: lib.krylov(A, x0, d, method=m), d
            )
            fns[tag, "forward"] = (forward, (A, x0))
            fns[tag, "grad"] = (grad, (A, x0, W))
        got = h.measure(fns, outputs=True, shared_batch=True, **FULL["timing"])
        row = {"n": n, "d": d, "b": b, "method": method}
        for k in KINDS:
            new, old_ = got["new", k], got["old", k]
            row[k] = {"new_s": new["median_s"], "old_s": old_["median_s"]}
            row[k]["new_over_old"] = new["median_s"] / old_["median_s"]
            row[k]["min_new_over_old"] = new["min_s"] / old_["min_s"]
            row[k]["difference"] = h.largest_difference(new["output"], old_["output"])
        row["agree"] = max(row[k]["difference"] for k in KINDS) <= AGREE
        rows.append(row)
        log(
            f"  {method:>8} n={n:<5} d={d:<5} b={b}: new / old forward "
            f"{row['forward']['new_over_old']:.3f}, "
            f"grad {row['grad']['new_over_old']:.3f}"
            + ("" if row["agree"] else f"; the results DIFFER by more than {AGREE:g}")
        )
    return {"ref": ref, "old": old.__name__, "rows": rows}


def against_markdown(report: dict) -> str:
    m, a = report["machine"], report["against"]
    ratios = [r[k]["new_over_old"] for r in a["rows"] for k in KINDS]
    fastest = [r[k]["min_new_over_old"] for r in a["rows"] for k in KINDS]
    lines = [
        f"# krylov: the working tree against `{a['ref']}` ({a['old']})",
        "",
        f"Machine: {m['device']} ({m['backend']}), {m['cpu_count']} CPUs, jax "
        f"{m['versions']['jax']}, float32, working tree on commit "
        f"`{m['git_commit']}`. Mode: {report['mode']}. Forward and `grad` of "
        "`sum(krylov(A, x0, d, method=...) * W)` with respect to `A` and `x0`, the "
        "new and the old code timed side by side in the same interleaved rounds: "
        "ratios of the median times, and of the fastest rounds' (on a loaded "
        "machine, where most rounds wait for a core, the fastest is the better "
        "measure of the code); times are medians. `difference`: largest |new - old| "
        "/ largest |old| of the outputs.",
        "",
    ]
    rows = []
    for r in a["rows"]:
        worst = max(r[k]["difference"] for k in KINDS)
        rows.append(
            [r["method"], r["n"], r["d"], r["b"] or "-"]
            + [h.fmt(r[k]["new_over_old"], ".3f") for k in KINDS]
            + [h.fmt(r[k]["min_new_over_old"], ".3f") for k in KINDS]
            + [h.ms(r[k][f"{v}_s"]) for k in KINDS for v in ("new", "old")]
            + [f"{worst:.1e}" + ("" if r["agree"] else " (DIFFER)")]
        )
    lines += h.table(
        "method | n | d | b | fwd new / old | grad new / old | fastest fwd new / old "
        "| fastest grad new / old | fwd new ms | fwd old ms | grad new ms "
        "| grad old ms | difference",
        rows,
    )
    differ = [r for r in a["rows"] if not r["agree"]]
    lines += [
        "",
        f"new / old over all rows: {min(ratios):.3f} to {max(ratios):.3f}, median "
        f"{statistics.median(ratios):.3f}; of the fastest rounds {min(fastest):.3f} "
        f"to {max(fastest):.3f}, median {statistics.median(fastest):.3f}. The results "
        + (
            f"agree to {AGREE:g} in every row."
            if not differ
            else f"DIFFER by more "
            f"than {AGREE:g} in {len(differ)} of {len(a['rows'])} rows."
        ),
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "out" / "krylov",
        help="output folder (default: benchmarks/out/krylov, git-ignored)",
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the figure")
    parser.add_argument(
        "--against",
        metavar="REF",
        help="only time the package at git revision REF against the working tree",
    )
    args = parser.parse_args(argv)
    h.cpu_by_default()
    config = QUICK if args.quick else FULL
    log = h.Log()
    report: dict = {"mode": "quick" if args.quick else "full"}
    if args.against:
        try:
            old = h.import_at(args.against)
        except ValueError as error:
            parser.error(str(error))
        report["against"] = run_against(args.against, old, config, log)
        report.update(machine=h.machine_info(), config=config, total_s=log.elapsed())
        text = against_markdown(report)
        h.write_results(args.out, report, text, stem="against")
        print(text)
        log(f"wrote {args.out}/against.json, against.md")
        return report

    cache: dict = {}
    log("sizes")
    sizes = run_sizes(config["sizes"], config, cache, log)
    log("block x0")
    blocks = run_block_sizes(config["block_sizes"], config, log)
    agreement = {**check_agreement(sizes), **check_agreement(blocks, " block")}
    log("every form of loss")
    losses = run_losses(config["loss_sizes"], config, log)
    log("the default against doubling")
    doubling = run_doubling(config["doubling_sizes"], config, log)
    log("plot grid")
    plot_n = config["plot_n"]
    plot_rows = run_sizes([(plot_n, d) for d in config["plot_ds"]], config, cache, log)
    log("krylovjax compile scaling")
    points = [
        grad_compile_time(
            "krylovjax", config["scaling_n"], d, config["compile_repeats"]
        )
        for d in config["scaling_ds"]
    ]
    scaling = {
        "points": points,
        "ratio": points[1]["compile_s"] / points[0]["compile_s"],
    }
    log(f"  ratio {scaling['ratio']:.2f}")

    for r in list(cache.values()) + blocks:
        for name in ("forward", "grad"):
            r[name].pop("output", None)
    report.update(
        machine=h.machine_info(),
        config={**config, "dtype": "float32", "peer_max_d": PEER_MAX_D},
        sizes=sizes,
        plot=plot_rows,
        blocks=blocks,
        losses=losses,
        doubling=doubling,
        compile_scaling=scaling,
        agreement=agreement,
        total_s=log.elapsed(),
    )
    text = markdown(report)
    h.write_results(args.out, report, text)
    if not args.no_plot:
        plot(report, args.out / "grad_time_memory_vs_d.png")
    print(text)
    log(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
